"""Local files: a ``.safetensors`` file or a folder of them, read in a small thread pool.

A file in the page cache is read into its destinations by ``preadv`` (or handed out as views of
a private mapping, where there is none); one on disk is read with ``O_DIRECT`` past the page
cache, or through it (``read="shared"``), as the read modes below say; which is which is
decided per unit from the page cache's windows.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Callable, Iterable
from typing import Any, TypeVar
from urllib.parse import unquote, urlparse

import aiofiles
import numpy as np

from ._ntcopy import STREAMING_MIN_BYTES, copy_bytes, streaming_copy
from ._syscalls import (
    IOVEC_OK,
    WILLNEED_PIECE_BYTES,
    libc,
    no_readahead,
    pread_into,
    preadv_scatter,
    read_cached,
    willneed,
    willneed_piece,
)
from ._threads import LoopBudget
from .direct import ALIGN, DIRECT_DEPTH, DIRECT_PIECE_BYTES, O_DIRECT_MIN_BYTES, DirectFile
from .errors import SourceError, UsageError
from .mapping import RELEASE_SPAN_BYTES, FileMapping, Spans, check_length
from .pagecache import ALL_CACHED, WARM_SHARE, Residency, share_of
from .sources import IOPool, Source, Store
from .warmcopy import MAP, PREAD, CopyChoice, copy_mode

T = TypeVar("T")

#: Local read modes. "map": units without a known destination are handed out as views of a
#: private (copy-on-write) mapping of the file, with no copy and no anonymous memory; the read
#: brings their pages in ahead of the consumer; bytes on disk are read with O_DIRECT. "shared": as
#: "map", but bytes on disk come in through the page cache too (never O_DIRECT), so that processes
#: loading the same files at once (tensor-parallel ranks on one host) read each page from the disk
#: once between them. "pread": every unit is read into a buffer. Reads straight into a known
#: destination use os.preadv in every mode.
READ_MODES = ("map", "shared", "pread")
#: The environment variable that sets the read mode of loads that do not pass ``read``.
READ_ENV = "ALOAD_READ"
#: Pieces of a tensor with a destination in a file that sits in the page cache: large, for fewer
#: trips to the event loop; each is read in steps of ``PREAD_STEP_BYTES`` across the read threads.
WARM_PIECE_BYTES = 256 << 20
#: Bytes in the page cache with a destination are read by ``preadv`` (the kernel's copy, straight
#: from the page cache into the destination): a tensor under this size in one call, or, from a
#: file all in the page cache, in a run of them by one scattering ``preadv`` (``scatter_below``).
#: A larger one goes in steps of ``PREAD_STEP_BYTES`` across the read threads, each step by
#: ``preadv`` or by a ``memcpy`` out of the file's mapping (its pages dropped from the process
#: after), whichever the load's timings say is the faster now (``aload.warmcopy``): which one wins
#: has changed from host to host and from hour to hour. 2026-12-02, by ``preadv`` first:
#: ``benchmarks/local_reads.py CKPT --scenarios warm``, 2 threads, medians of 3: 1, 4, 8 GiB by
#: ``preadv`` in 16 MiB steps 14.4, 26.3, 17.8 GB/s, out of the mapping in 256 MiB pieces 11.9,
#: 15.5, 13.8. Suite children, warm, 3 rounds
#: alternating: 4 GiB 261-306 ms a load against 314-454, 8 GiB 503-576 against 794-884. On the VM
#: measured before, glibc's non-temporal stores (copies past 99 MiB) made the mapping's ``memcpy``
#: the faster (11 GB/s a thread against ~5 for ``preadv``). On the CPU the host got on 2026-12-03,
#: the mapping's copy (``MADV_POPULATE_READ`` first) kept the event loop on time better (8 GiB
#: p99 2.5-3.3 ms against 2.7-4.5), but was 15-20% slower at 4 and 8 GiB warm (docs/benchmarks.md,
#: "This host"). On 2026-12-03 20:23 UTC, 8 MiB steps: 4 and 8 GiB by ``preadv`` 11.3 and 11.0
#: GB/s, out of the mapping 13.7 and 15.1.
SCATTER_BELOW_BYTES = 16 << 20
#: The steps those ``preadv`` calls take, each followed by ``os.sched_yield()`` (``_copy_step``;
#: a scattering read yields between its calls of up to this many bytes). The kernel here runs
#: without preemption (``CONFIG_PREEMPT_NONE``, ``HZ`` 250): the event loop's thread, woken by its
#: timer while both cores copied in ``preadv``, waited for the next tick to get a core, ~4 ms.
#: Offered the core after each step, it runs once the step ends. Suite children, warm, built-in,
#: 5 rounds alternating (2026-12-03): loop lateness p99 4 GiB 3.1-6.0 ms in 16 MiB steps without
#: the yield, 1.7-2.0 in 8 MiB steps with it, 1.3-1.6 in 4 MiB steps; 8 GiB 3.4-4.4, 1.6-3.1,
#: 1.2-2.1; seconds a load (medians) 0.37, 0.38, 0.41 and 0.94, 0.95, 0.98. The Qwen-shaped
#: checkpoint (runs of 1-16 MiB tensors scattered in calls of up to 64 MiB), 6 rounds: p99
#: 5.4-8.3 ms before, 1.7-3.0 after, 0.105 s a load (median) either way.
PREAD_STEP_BYTES = 8 << 20
assert RELEASE_SPAN_BYTES % PREAD_STEP_BYTES == 0, "a step lies inside one of ``Spans``'s spans"
#: Small tensors of a file all in the page cache, without a destination (a model's own
#: ``load_weights``), are handed out in mapped views of up to this many bytes (at most a quarter of
#: the budget), not ``chunk_bytes``: nothing is read, and each unit cost the consumer's thread a
#: wait for the event loop. Qwen2.5-0.5B-shaped, warm, through ``load_weights``, in one process:
#: 16 MiB 272-298 ms a load, 64 MiB 252-267, 128 MiB 238-253, 256 MiB 247-257.
MAPPED_RUN_BYTES = 128 << 20


def read_mode(read: str | None) -> str:
    """The read mode a local load uses: ``read`` where given, else ``ALOAD_READ`` (an operator's
    choice for every load of the process, e.g. each rank's), else "map"."""
    return read or os.environ.get(READ_ENV) or "map"


def _path_from_url(url: str) -> str:
    if url.startswith("file://"):
        parsed = urlparse(url)
        if parsed.netloc not in ("", "localhost"):
            raise UsageError("file:// URLs must name a local path", url=url)
        return unquote(parsed.path)
    return os.path.expanduser(url)


def is_local(url: str) -> bool:
    """Whether ``url`` names a local checkpoint: a path, or a ``file://`` URL."""
    return "://" not in url or url.startswith("file://")


def _local_files(url: str) -> list[str]:
    """A local checkpoint's ``.safetensors`` files: the file itself, or those of the folder."""
    path = _path_from_url(url)
    if os.path.isdir(path):
        return [os.path.join(path, e) for e in sorted(os.listdir(path)) if e.endswith(".safetensors")]
    return [path]


def cached_share(url: str) -> float | None:
    """The share of a local checkpoint's bytes (a ``.safetensors`` file, or those of a folder)
    in the page cache now; None for a remote one, or where ``cachestat(2)`` is refused. For
    ``aload bench``: a figure means little without whether the disk was read."""
    return share_of(_local_files(url)) if is_local(url) else None


def evict(url: str) -> None:
    """Drop a local checkpoint's files from the page cache (each written back, then
    ``POSIX_FADV_DONTNEED``), so that the next read comes from the disk: ``aload bench --cold``.
    Pages another process has mapped stay, and so does all of a file on a filesystem that lives in
    memory (tmpfs); ``cached_share`` says what stayed."""
    if not is_local(url):
        raise UsageError("only a local checkpoint can be dropped from the page cache", url=url)
    for path in _local_files(url):
        try:
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except OSError as exc:
            raise SourceError(f"cannot open: {exc.strerror}", url=path) from exc
        try:
            with contextlib.suppress(OSError):  # dirty pages then stay, as the kernel keeps them
                os.fsync(fd)
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


class LocalSource(Source):
    """A local file read in the store's thread pool. It is opened once and kept open (and mapped at
    first need, in "map" mode), so a file replaced on disk mid-load is not mixed with its successor."""

    def __init__(
        self,
        path: str,
        pool: IOPool,
        mode: str,
        direct_pool: IOPool | None,
        choice: CopyChoice,
        budget: LoopBudget | None = None,
    ) -> None:
        self.url = path
        self._budget = budget or LoopBudget()  # the store's: what its files do on the loop, per turn
        self._choice = choice  # the load's, shared by its files
        self.can_map = mode in ("map", "shared") and libc is not None
        # "shared": a file not all in the page cache when first read comes into a destination by the
        # kernel's copy, cached parts too (with two processes reading the same files, a copy out
        # of the mapping of pages the other had just brought in ran at half that speed here).
        self._shared = mode == "shared"
        self._pool = pool
        self._direct_pool = direct_pool if self.can_map and mode == "map" and hasattr(os, "O_DIRECT") else None
        self._fd: int | None = None
        self._dio: DirectFile | None = None  # the same file opened with O_DIRECT (``aload.direct``)
        self._size: int | None = None
        self._piece = WILLNEED_PIECE_BYTES  # what one WILLNEED reads at most (``willneed_piece``)
        self._map: FileMapping | None = None  # made with the size known, mapped at first need
        self._residency: Residency | None = None  # the page cache when the file was first read
        self._deciding: asyncio.Future[bool] | None = None  # working that out, on a thread
        self.scatters = IOVEC_OK  # every read mode: a buffered preadv into the destinations

    def _open(self) -> int:
        if self._fd is None:
            try:
                self._fd = os.open(self.url, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
            except OSError as exc:
                raise SourceError(f"cannot open: {exc.strerror}", url=self.url) from exc
            st = os.fstat(self._fd)
            self._size, self._piece = st.st_size, willneed_piece(st.st_dev)
            if self.can_map and self._size:
                self._map = FileMapping(self._fd, self._size, self.url, self._piece)
            if self._direct_pool is not None:
                self._dio = DirectFile.open(self._fd, self.url)
                if self._dio is not None:  # its bytes on disk come by O_DIRECT, the rest as asked
                    no_readahead(self._fd)
        return self._fd

    @property
    def _direct(self) -> bool:
        """Whether bytes on disk are read with ``O_DIRECT``: the file opened so, no read refused."""
        return self._dio is not None and self._dio.ok

    async def size(self) -> int:
        if self._size is None:
            await self._pool.run(self._open)
        assert self._size is not None
        return self._size

    async def head(self, probe: int) -> tuple[int, bytes]:
        # Opened and read right here where the bytes sit in the page cache, within the loop's
        # budget: a trip to a read thread cost 1-7 ms before a load's first read (see
        # ``_small_cached``). Else open, size and read in one trip to a thread.
        if self._budget.allows():
            self._open()
            assert self._fd is not None and self._size is not None
            buf = bytearray(min(self._size, probe))
            if read_cached(self._fd, memoryview(buf), 0):
                return self._size, bytes(buf)
        return await self._pool.run(self._head, probe)

    def _head(self, probe: int) -> tuple[int, bytes]:
        self._open()
        assert self._fd is not None and self._size is not None
        buf = bytearray(min(self._size, probe))
        pread_into(self._fd, memoryview(buf), 0, self.url)
        return self._size, bytes(buf)

    async def readinto(self, offset: int, buf: memoryview) -> None:
        if self._fd is None:
            await self._pool.run(self._open)
        assert self._fd is not None
        n = len(buf)
        if n < O_DIRECT_MIN_BYTES or not self.can_map or not self._size:
            await self._pool.run(pread_into, self._fd, buf, offset, self.url)
            return
        await self._decided()
        cached = self._in_cache(offset, n) or not self._direct
        if (self._shared and not self._warm) or (cached and n < SCATTER_BELOW_BYTES):
            await self._pool.run(pread_into, self._fd, buf, offset, self.url)
        elif cached:
            step = PREAD_STEP_BYTES
            spans = Spans(self._map, offset, n) if self._map is not None else None
            whole = self._share_at(offset, n) == 1.0
            steps = [
                (buf[o : o + step], offset + o, whole or self._share_at(offset + o, min(step, n - o)) == 1.0, spans)
                for o in range(0, n, step)
            ]
            if not whole:  # the pages on disk asked for at once, not step by step
                await self._pool.run(self._prefetch, offset, n)
                steps.sort(key=lambda s: not s[2])  # the cached steps first, while the disk brings the others in
            await self._pool.run_all(self._copy_step, steps)
        else:
            assert self._direct_pool is not None and self._dio is not None  # _direct: opened with O_DIRECT
            await self._direct_pool.start(self._pool)
            step = DIRECT_PIECE_BYTES
            pieces = [(offset + o, buf[o : o + step]) for o in range(0, n, step)]
            await self._direct_pool.run_all(self._dio.read_bounced, pieces)

    def _copy_step(self, buf: memoryview, offset: int, cached: bool = False, spans: Spans | None = None) -> None:
        """One step of a copy out of the page cache, by ``preadv`` or out of the mapping as the
        load's ``CopyChoice`` says (and timed for it), then this thread's core offered to any
        thread waiting for one (``PREAD_STEP_BYTES``). ``cached``: the step's pages were all
        in the page cache when the file was first read (``FileMapping.copy_into``); ``spans``
        lets go of the mapped pages of the read this step is part of."""
        assert self._fd is not None
        m, choice = self._map, self._choice
        way = choice.pick(len(buf)) if m is not None else PREAD
        t = time.perf_counter_ns()
        if way != MAP or m is None or not m.copy_into(offset, buf, cached, release=spans is None):
            way = PREAD
            pread_into(self._fd, buf, offset, self.url)
        if spans is not None:  # timed with the step: letting go of the pages is part of the way's cost
            spans.done(offset, len(buf))
        choice.record(way, len(buf), time.perf_counter_ns() - t)
        os.sched_yield()

    def frame_align(self, offset: int, length: int) -> int:
        """Bytes on disk read with ``O_DIRECT`` go straight into a buffer aligned as the file is:
        no bounce buffer, no copy out of it (8 GiB cold through ``load_weights``: ~2 CPU s less)."""
        direct = self._direct and length >= O_DIRECT_MIN_BYTES
        return ALIGN if direct and not self._in_cache(offset, length) else 0

    async def read_frame(self, offset: int, frame: memoryview, need: int) -> None:
        assert self._direct_pool is not None and self._dio is not None  # frame_align: opened with O_DIRECT
        await self._direct_pool.start(self._pool)
        step = DIRECT_PIECE_BYTES
        pieces = [(offset + o, frame[o : o + step], min(step, need - o)) for o in range(0, need, step)]
        await self._direct_pool.run_all(self._dio.read_aligned, pieces)

    async def prefetch(self, offset: int, length: int) -> None:
        """The pages not in the page cache asked for (``POSIX_FADV_WILLNEED``: exactly these
        bytes, no read-around; the mapping's fault-in read 8 MiB around each run of small tensors
        here, most of it large tensors then read again with ``O_DIRECT``). Nothing for bytes all
        in the page cache, not even the length check a mapped view needs: ``scatter_into`` reads
        them with ``preadv``, which finds a file that shrank (an ``fstat`` on the event loop per
        run of small tensors was ~70 us of waiting for the GIL back)."""
        await self._decided()
        if self._share_at(offset, length) < 1.0:
            await self._pool.run(self._prefetch, offset, length)

    async def read_ahead(self, ranges: Callable[[], Iterable[tuple[int, int]]]) -> None:
        """The ranges asked for (``WILLNEED``) where the file is not all in the page cache and is
        mapped (small tensors come through the page cache, cold or not); a file that fails here
        fails at its read."""
        if not self.can_map:
            return
        with contextlib.suppress(SourceError):
            await self._decided()
            if not self._warm:
                await self._pool.run(self._read_ahead, ranges)

    def _read_ahead(self, ranges: Callable[[], Iterable[tuple[int, int]]]) -> None:
        for start, end in ranges():
            if self._share_at(start, end - start) < 1.0:
                self._prefetch(start, end - start)

    def _prefetch(self, offset: int, length: int) -> None:
        self._check_length(offset, length)
        assert self._fd is not None
        willneed(self._fd, offset, length, self._piece)

    async def scatter_read(self, offset: int, dests: list[Any]) -> None:
        await self._pool.run(self.scatter_into, offset, dests)

    def scatter_into(self, offset: int, dests: list[Any]) -> None:
        """From the page cache (``preadv``; ``prefetch`` asked for the pages): the many small
        tensors this is for are copied once, by the kernel, with no buffer of aload's between.
        Out of the mapping instead, each tensor past the CPU's caches, where the load's copies
        out of it are the faster and every page of the run sits in the page cache (``_mapped_run``)."""
        fd = self._fd
        assert fd is not None, "prefetched before"
        if not self._mapped_run(offset, dests):
            preadv_scatter(fd, offset, dests, self.url, PREAD_STEP_BYTES)

    def _mapped_run(self, offset: int, dests: list[Any]) -> bool:
        """A run of tensors laid end to end from ``offset`` copied into ``dests`` out of the
        mapping (``_ntcopy.copy_bytes``; the file's length checked first), this thread's core
        offered every ``PREAD_STEP_BYTES``, the run's pages let go after; False, nothing done,
        unless there is a copy past the caches, the load prefers the mapping's copies, the run is
        all in the page cache, and its tensors average ``STREAMING_MIN_BYTES`` or more (smaller
        ones are a ``ctypes`` call each this way, up to ``IOV_MAX`` of them one ``preadv``).
        Qwen2.5-0.5B-shaped, warm, built-in: most of its bytes come in such runs
        (docs/benchmarks.md, stop 55)."""
        m = self._map
        total = sum(d.nbytes for d in dests)
        if (
            m is None
            or total < len(dests) * STREAMING_MIN_BYTES
            or streaming_copy() is None
            or not self._choice.maps
            or not self.in_memory(offset, total)
        ):
            return False
        self._check_length(offset, total)  # a page past the end of a file cut short would kill the process
        base, at, since = m.array().ctypes.data + offset, 0, 0
        for d in dests:
            n = d.nbytes
            if since >= PREAD_STEP_BYTES:
                os.sched_yield()
                since = 0
            copy_bytes(d.data_ptr(), base + at, n)
            at, since = at + n, since + n
        m.release(offset, total)
        return True

    def view(self, offset: int, length: int) -> np.ndarray[Any, Any]:
        return self._mapping()[offset : offset + length]

    def _mapping(self) -> np.ndarray[Any, Any]:
        """The whole file, mapped at first need (``aload.mapping``)."""
        assert self._map is not None, "headers are read before data"
        return self._map.array()

    async def populate(self, offset: int, length: int) -> None:
        # All cached: the consumer's first touch maps each page, as with any memory-mapped
        # loader; mapping ahead on a thread only took cores from that copy (4 GiB through
        # load_weights, warm, 3 runs each: 9.3-10.0 vs 9.3 GB/s, RSS 250 vs 508 MiB).
        await self._unless_cached(self._populate, offset, length)

    def on_disk(self, offset: int, length: int) -> bool:
        return self._direct and length >= O_DIRECT_MIN_BYTES and not self._in_cache(offset, length)

    def in_memory(self, offset: int, length: int) -> bool:
        # Known only once decided: ``_share_at`` would otherwise look at the page cache here.
        return self._warm is not None and self._share_at(offset, length) == 1.0

    def populated(self, offset: int, length: int) -> bool:
        if not self.in_memory(offset, length):
            return False
        try:
            self._check_length(offset, length)
        except SourceError:
            return False  # ``populate`` raises it, when the unit's turn comes
        return True

    def _populate(self, offset: int, length: int) -> None:
        assert self._map is not None
        self._map.populate(offset, length)

    async def _unless_cached(self, fn: Callable[[int, int], None], offset: int, length: int) -> None:
        """``fn(offset, length)`` on a read thread, unless all of those bytes sat in the page
        cache (then only the file's length is checked)."""
        await self._decided()
        if self.in_memory(offset, length):
            self._check_length(offset, length)
            return
        await self._pool.run(fn, offset, length)

    @property
    def scatter_below(self) -> int:  # type: ignore[override]
        """Tensors under ``SCATTER_BELOW_BYTES`` with a destination are read in runs where their
        bytes sat in the page cache (``scatters_at``; bytes on disk: the larger ones with
        ``O_DIRECT``, one unit each)."""
        return 0 if self._residency is None else SCATTER_BELOW_BYTES

    def scatters_at(self, offset: int, length: int) -> bool:
        """Decided per range, not per file: a file partly evicted (its first 10%, the Qwen-shaped
        checkpoint's) had its 8 MiB tensors read one unit each all through, as from the disk."""
        return bool(self._warm) or self._share_at(offset, length) >= ALL_CACHED

    @property
    def mapped_run_bytes(self) -> int:  # type: ignore[override]
        """Small tensors of a file all in the page cache, without a destination, are handed out
        in views of up to ``MAPPED_RUN_BYTES``."""
        return MAPPED_RUN_BYTES if self._warm else 0

    def maps(self, offset: int, length: int) -> bool:
        """Bytes in the page cache are mapped; bytes on disk are read into buffers (``O_DIRECT``)
        where they can be."""
        return self.can_map and (not self._direct or self._in_cache(offset, length))

    def piece_bytes(self, chunk_bytes: int, offset: int, length: int, mapped: bool = False) -> int:
        """Large pieces for bytes in the page cache (each read in steps across the read threads;
        the pages it misses are asked for ahead), ``chunk_bytes`` for bytes on disk
        (each is split into direct reads). A mapped view is populated in one piece only where all
        of it is cached; the pages it misses are then brought in by several populates at once (in
        one, a view a tenth on disk made a partly evicted 1 GiB load through ``load_weights``
        0.21 -> 0.37 s)."""
        whole = self._share_at(offset, length) >= ALL_CACHED if mapped else self._in_cache(offset, length)
        return max(chunk_bytes, WARM_PIECE_BYTES) if whole else chunk_bytes

    async def ready(self) -> None:
        await self._decided()

    async def _decided(self) -> None:
        """``_cached()``, worked out on a thread the first time: ``cachestat`` walks the file's
        pages in the cache (and ``mincore``, where it is refused, first maps the file, which waits
        for the process's memory-map lock); on the loop that was 3-9 ms of lateness per shard of
        a 64-shard checkpoint."""
        if self._warm is None:
            if self._deciding is None and self._look_now():
                return
            if self._deciding is None:  # one decision, however many reads ask at once
                self._deciding = asyncio.ensure_future(self._pool.run(self._cached))
            await asyncio.shield(self._deciding)

    @property
    def _warm(self) -> bool | None:
        """Whether the file sat in the page cache when first read (None: not looked at yet)."""
        r = self._residency
        return None if r is None else r.warm

    def _look_now(self) -> bool:
        """The page cache looked at right here, for a file of up to ``INLINE_LOOK_BYTES`` already
        open, within the loop's budget (a file read without its mapping needs no look): the look itself took 0.4-0.6 ms for 1 GB, the trip to a
        read thread 3.5-6 ms at a load's start (a thread started, then a core shared with the
        threads of torch's last parallel operation, which spin a while before they sleep)."""
        size = self._size
        if size is None:
            return False
        if not (self.can_map and size > 0):
            residency: Residency | None = Residency(False)  # nothing mapped to look at (``_cached``)
        elif size > INLINE_LOOK_BYTES or not self._budget.allows():
            return False
        else:
            assert self._fd is not None
            residency = Residency.look_now(self._fd, size)
        if residency is None:
            return False
        self._residency = residency
        return True

    def _cached(self) -> bool:
        """Whether the file sat in the page cache when its data was first read, all of it but
        ``ALL_CACHED``'s share (looked at once, with which parts did; see ``_decided``)."""
        if self._residency is None:
            size = self._size or 0
            mapped = self.can_map and size > 0
            self._residency = Residency.look(self._open(), size, self._mapping) if mapped else Residency(False)
        return self._residency.warm

    def _in_cache(self, offset: int, length: int) -> bool:
        """Whether the bytes at ``offset`` are read from the page cache (``WARM_SHARE``)."""
        return self._share_at(offset, length) >= WARM_SHARE

    def _share_at(self, offset: int, length: int) -> float:
        r = self._residency
        if r is None:
            self._cached()
            r = self._residency
            assert r is not None
        return r.share_at(offset, length)

    def _check_length(self, offset: int, length: int) -> None:
        assert self._fd is not None
        check_length(self._fd, offset, length, self.url)

    def release(self, offset: int, length: int) -> None:
        m = self._map  # None once closed: the mapping goes with the last view of it
        if m is not None:
            m.release(offset, length)

    def close(self) -> None:
        if self._map is not None:
            self._map.drop()  # unmapped when the last tensor viewing it dies
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if self._dio is not None:
            self._dio.close()
            self._dio = None


#: The largest file whose page cache is looked at on the event loop (``LocalSource._look_now``).
INLINE_LOOK_BYTES = 2 << 30
#: The largest file (an index) read on the event loop when the page cache holds it (``_small_cached``).
INLINE_READ_BYTES = 1 << 20


def _small_cached(path: str, limit: int) -> bytes | None:
    """The file at ``path`` read right here, if it is no larger than ``limit`` and
    ``INLINE_READ_BYTES`` and the page cache holds all of it; else None (read it on a thread).
    On the loop: a fresh process's first trip to a read thread took 4-7 ms before a load's
    first read while the threads of torch's last parallel operation still spun (an index of
    906 bytes; 0.1 ms here)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return None  # said again, with its reason, on the thread
    try:
        size = os.fstat(fd).st_size
        if size > min(limit, INLINE_READ_BYTES):
            return None
        buf = bytearray(size)
        return bytes(buf) if read_cached(fd, memoryview(buf), 0) else None
    finally:
        os.close(fd)


class LocalStore(Store):
    """A local ``.safetensors`` file or a folder of them."""

    def __init__(self, url: str, *, concurrency: int, read: str | None = None) -> None:
        said = "read" if read is not None else READ_ENV
        read = read_mode(read)
        if read not in READ_MODES:
            raise UsageError(f"{said} must be one of {READ_MODES}, got {read!r}", url=url)
        self.url = _path_from_url(url)
        self._read = read
        self._pool = IOPool(concurrency, pin=True)  # a core each, where they fill the cores
        self._direct_pool = IOPool(max(concurrency, DIRECT_DEPTH))  # started by a first cold read
        self._sources: dict[str, LocalSource] = {}
        #: How this load copies out of the page cache (``aload.warmcopy``): one choice for its files.
        self.copy_choice = CopyChoice(copy_mode())
        self._budget = LoopBudget()  # the files' small reads and looks on the event loop, per turn

    async def kind(self) -> str:
        if os.path.isdir(self.url):
            return "folder"
        if os.path.isfile(self.url):
            return "file"
        raise SourceError("no such file or folder", url=self.url)

    def source(self, name: str) -> Source:
        path = self.url if name == "" else os.path.join(self.url, name)
        if path not in self._sources:
            self._sources[path] = LocalSource(
                path, self._pool, self._read, self._direct_pool, self.copy_choice, self._budget
            )
        return self._sources[path]

    async def list(self, suffix: str) -> list[str]:
        return sorted(e.name for e in os.scandir(self.url) if e.name.endswith(suffix) and e.is_file())

    async def get(self, name: str, limit: int) -> bytes | None:
        path = os.path.join(self.url, name)
        if not os.path.isfile(path):
            return None
        cached = _small_cached(path, limit)
        if cached is not None:
            return cached
        # aiofiles on the store's own pool (not the loop's default executor, whose threads
        # would outlive the load); the hot path uses os.preadv, measured faster. Not ``async
        # with``: aiofiles 25.1 closes the file there on the default executor all the same.
        f = await aiofiles.open(path, "rb", executor=self._pool.executor())
        try:
            data: bytes = await f.read(limit + 1)
        finally:
            await f.close()
        if len(data) > limit:
            raise SourceError(f"larger than the {limit}-byte limit for this file", url=path)
        return data

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        # A thread of the read pool, started by the first reads: starting a new thread holds the
        # event loop until that thread has run, 3-5 ms each when the cores are busy.
        return await self._pool.run(fn, *args)

    async def aclose(self) -> None:
        try:
            await self._pool.aclose()
            await self._direct_pool.aclose()
        finally:
            for src in self._sources.values():
                src.close()
