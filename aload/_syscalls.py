"""What aload asks of the kernel directly, through ctypes, for local files: scattering
``preadv`` into many buffers, ``madvise`` in steps, a private mapping that holds no descriptor,
and which pages of a file sit in the page cache (``cachestat``, or ``mincore`` where it is
refused). Format-free and store-free: ``aload.local`` decides when each is worth it."""

from __future__ import annotations

import ctypes
import functools
import mmap
import os
import sys
import threading
import weakref
from pathlib import Path
from typing import Any

import numpy as np

from .errors import SourceError

PAGE = mmap.PAGESIZE

libc = ctypes.CDLL(None, use_errno=True) if os.name == "posix" else None
if libc is not None:
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long)
    libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
    libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    libc.preadv.restype = ctypes.c_ssize_t
    libc.preadv.argtypes = (ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_long)
    libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)
    libc.memcpy.restype = ctypes.c_void_p
    libc.memcpy.argtypes = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)

MADV_DONTNEED = 4
MADV_POPULATE_READ = 22  # Linux 5.14
MADV_HUGEPAGE = 14

LOCK_STEP = 16 << 20  # the most one madvise call maps or unmaps (see madvise_in_steps)

#: ``struct iovec`` is two 64-bit words here: (address, length) rows of a uint64 array are one.
IOVEC_OK = libc is not None and ctypes.sizeof(ctypes.c_void_p) == ctypes.sizeof(ctypes.c_size_t) == 8
IOV_MAX = 1024  # buffers per preadv(2) (Linux's UIO_MAXIOV)


def pread_into(fd: int, buf: memoryview, offset: int, url: str) -> None:
    """All of ``buf`` from ``offset`` (the kernel's copy, through the page cache), finishing
    short reads; an error or an early end names ``url`` and the bytes asked for."""
    done, total = 0, len(buf)
    while done < total:
        try:
            n = os.preadv(fd, [buf[done:]], offset + done)
        except OSError as exc:
            raise SourceError(f"read failed: {exc.strerror}", url=url, byte_range=(offset, offset + total)) from exc
        if n == 0:
            raise SourceError(f"file ended at byte {offset + done}", url=url, byte_range=(offset, offset + total))
        done += n


def read_cached(fd: int, buf: memoryview, offset: int) -> bool:
    """Fill ``buf`` from ``offset`` if the page cache holds all of it, without waiting for the disk
    (``RWF_NOWAIT``): False where a page is missing, the file ends first, or the kernel or the
    filesystem does not take the flag. For small reads on the event loop (a checkpoint's index
    and headers), which otherwise cost a trip to a read thread each."""
    flag = getattr(os, "RWF_NOWAIT", None)
    done, total = 0, len(buf)
    if flag is None:
        return total == 0
    while done < total:
        try:
            n = os.preadv(fd, [buf[done:]], offset + done, flag)
        except OSError:  # EAGAIN: not all cached; EOPNOTSUPP/EINVAL: not here
            return False
        if n == 0:
            return False
        done += n
    return True


#: What one ``POSIX_FADV_WILLNEED`` reads at most where the device's limits are not known.
WILLNEED_PIECE_BYTES = 128 << 10


@functools.cache
def willneed_piece(dev: int) -> int:
    """The most one ``POSIX_FADV_WILLNEED`` on a file of device ``dev`` (``st_dev``) reads: the
    kernel reads no more of a call's range than the larger of the device's ``read_ahead_kb`` and
    ``max_sectors_kb`` (``force_page_cache_ra``), the rest never: a 64 MiB call read 8 MiB on the
    VM measured. ``WILLNEED_PIECE_BYTES`` where sysfs does not say (a filesystem on no one block
    device). Looked up once per device."""
    base = f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}"
    for queue in (f"{base}/queue", f"{base}/../queue"):  # a partition's are its disk's
        try:
            kb = [int(Path(queue, n).read_text()) for n in ("read_ahead_kb", "max_sectors_kb")]
        except (OSError, ValueError):
            continue
        return max(PAGE, max(kb) << 10)
    return WILLNEED_PIECE_BYTES


def willneed(fd: int, offset: int, length: int, piece: int = WILLNEED_PIECE_BYTES) -> None:
    """Ask the kernel to read exactly these bytes into the page cache (it returns once the reads
    are queued), one call per ``piece`` (``willneed_piece``); nothing where the call does not
    exist."""
    if hasattr(os, "posix_fadvise"):
        for at in range(offset, offset + length, piece):
            os.posix_fadvise(fd, at, min(piece, offset + length - at), os.POSIX_FADV_WILLNEED)


def no_readahead(fd: int) -> None:
    """No read-ahead on ``fd`` (``POSIX_FADV_RANDOM``): a read that misses the page cache reads
    only its own pages. Where a file's bytes on disk are read with ``O_DIRECT``, the kernel's
    read-ahead from the header and the small tensors' buffered reads had brought megabytes of
    the large tensors after them into the page cache (about one cold load in 25 here), each then
    read again. ``willneed`` is not affected."""
    if hasattr(os, "posix_fadvise"):
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)


def preadv_scatter(fd: int, offset: int, dests: list[Any], url: str, step: int) -> None:
    """Fill ``dests``, laid end to end from ``offset``, with one ``preadv`` per ``IOV_MAX`` of
    them or per ``step`` bytes, whichever is less (the GIL let go in each; the Python between
    two is ~0.5 ms), finishing short reads."""
    assert libc is not None
    for first in range(0, len(dests), IOV_MAX):
        iov = np.array([(d.data_ptr(), d.nbytes) for d in dests[first : first + IOV_MAX]], dtype=np.uint64)
        offset = preadv_all(fd, offset, iov.reshape(-1, 2), url, step)


def preadv_all(fd: int, offset: int, iov: np.ndarray[Any, Any], url: str, step: int) -> int:
    """Fill the (address, length) rows of ``iov`` from ``offset``; the offset after them. Each
    call reads the rows that end within ``step`` bytes of where it starts (at least one), and
    between two calls this thread offers its core to any thread waiting for one: a kernel without
    preemption lets a copy of 64 MiB keep it ~10 ms (the event loop waited for a scheduler tick)."""
    assert libc is not None
    ends = np.cumsum(iov[:, 1])
    total = int(ends[-1]) if len(ends) else 0
    starts = ends - iov[:, 1]
    done = row = 0
    while done < total:
        if done:
            os.sched_yield()
        stop = max(row + 1, int(np.searchsorted(ends, done + step, side="right")))
        got = libc.preadv(fd, iov[row:].ctypes.data, min(stop, len(iov)) - row, offset + done)
        if got < 0:
            err = ctypes.get_errno()
            raise SourceError(f"read failed: {os.strerror(err)}", url=url, byte_range=(offset + done, offset + total))
        if got == 0:
            raise SourceError(f"file ended at byte {offset + done}", url=url, byte_range=(offset, offset + total))
        done += got
        row = int(np.searchsorted(ends, done, side="right"))  # the first buffer not yet full
        if row < len(iov) and starts[row] < done:  # partly filled: the rest of it next
            iov[row, 0] += np.uint64(done - int(starts[row]))
            iov[row, 1] = np.uint64(int(ends[row]) - done)
            starts[row] = done
    return offset + total


def madvise_in_steps(addr: int, length: int, advice: int, step: int = LOCK_STEP) -> int:
    """``madvise`` over ``length`` bytes from the page-aligned ``addr``, at most ``step`` bytes a
    call; 0, or the errno of the first call that failed. One call holds the process's memory-map
    lock for its whole range, and any ``mmap`` meanwhile (an allocation on the event loop) waits:
    16 MiB of fresh buffer in one call held the loop 45 ms on the VM measured."""
    assert libc is not None
    for at in range(addr, addr + length, step):
        if libc.madvise(ctypes.c_void_p(at), min(step, addr + length - at), advice) != 0:
            return ctypes.get_errno()
    return 0


_bounce = threading.local()


#: A bounce buffer lies in huge pages of its own (private memory, ``MADV_HUGEPAGE``, 2 MiB
#: aligned): a direct read into it is one request to the disk, and pinning its pages for the read
#: and copying out of them take fewer page walks. In 4 KiB pages a read is one segment per run of
#: pages that lie together, and a virtio disk takes 254 segments a request
#: (``/sys/block/*/queue/max_segments``): a 1 MiB piece went as two requests whenever its buffer's
#: pages lay scattered. Suite children, 8 GiB cold, built-in, alternating: in an hour when the
#: reads split (11,587-13,758 requests averaging 599-711 KiB, 5.9-6.3 s a load), buffers laid out
#: as these but shared (which gets no huge pages; why they did not split then is not known) made
#: 8,187 of 1,003 KiB, 3.8-3.9 s; in a later hour when neither split, 3 rounds: 2.96-3.40 s a
#: load and 1.44-1.76 CPU-s before, 2.56-2.95 s and 1.05-1.34 CPU-s in huge pages. Each direct
#: read thread keeps one, 2 MiB.
HUGE = 2 << 20


def bounce_buffer(n: int) -> tuple[memoryview, int]:
    """This thread's buffer of at least ``n`` bytes, aligned to ``HUGE`` and asked to be backed by
    huge pages, and its address (kept for the thread's life: one per reader thread)."""
    got: tuple[memoryview, int] | None = getattr(_bounce, "buf", None)
    if got is None or len(got[0]) < n:
        got = huge_buffer(n)
        _bounce.buf = got
    return got


def huge_buffer(n: int) -> tuple[memoryview, int]:
    """A fresh buffer of ``n`` bytes rounded up to ``HUGE``, aligned to it and asked to be backed
    by huge pages (refused: 4 KiB pages), and its address; not faulted in."""
    size = -(-n // HUGE) * HUGE
    m = mmap.mmap(-1, size + HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # shared: no huge pages
    addr = np.frombuffer(m, dtype=np.uint8).ctypes.data
    skip = -addr % HUGE
    if libc is not None:
        madvise_in_steps(addr + skip, size, MADV_HUGEPAGE)
    return memoryview(m)[skip : skip + size], addr + skip


def map_private(fd: int, size: int, url: str) -> np.ndarray[Any, Any]:
    """The whole file as a private, writable (copy-on-write) mapping: pages stay the page cache's
    until someone writes to a tensor, which then gets its own copy instead of a crash. Mapped
    with libc rather than ``mmap.mmap``, which keeps a duplicate descriptor open for as long as
    any tensor lives; this mapping holds none and is unmapped when its last view dies."""
    assert libc is not None
    addr = libc.mmap(None, size, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_PRIVATE, fd, 0)
    if addr in (None, ctypes.c_void_p(-1).value):
        err = ctypes.get_errno()
        raise SourceError(f"cannot map: {os.strerror(err)}", url=url)
    arr = memory_at(addr, size)
    weakref.finalize(arr, libc.munmap, addr, size)  # views of it keep it (their .base) alive
    return arr


def memory_at(addr: int, size: int, owner: object = None) -> np.ndarray[Any, Any]:
    """The ``size`` bytes at ``addr`` as a writable uint8 array, which keeps ``owner`` (what owns
    that memory) alive. Through the array interface, not a ctypes array: ``c_ubyte * size`` makes
    a ctypes type per size, and types are cyclic garbage, left for the next full collection."""
    return np.asarray(_Memory(addr, size, owner))


class _Memory:
    """``size`` bytes at ``addr``, writable, for ``np.asarray``; holds their ``owner``."""

    __slots__ = ("__array_interface__", "owner")

    def __init__(self, addr: int, size: int, owner: object) -> None:
        self.__array_interface__ = {"data": (addr, False), "shape": (size,), "typestr": "|u1", "version": 3}
        self.owner = owner


class _CacheRange(ctypes.Structure):
    _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]


class _CacheStat(ctypes.Structure):
    _fields_ = [(n, ctypes.c_uint64) for n in ("cache", "dirty", "writeback", "evicted", "recently_evicted")]


_SYS_CACHESTAT = 451  # Linux 6.5; the same number on every architecture
_cachestat_ok = sys.platform.startswith("linux")  # until the kernel (or a seccomp filter) refuses it


def window_pages(fd: int, size: int, window: int, sample: int | None = None) -> list[int] | None:
    """How many pages of each ``window`` bytes of the file, in order, sit in the page cache, from
    ``cachestat(2)``, without mapping the file (a mapping waits for the process's memory-map lock,
    which prefaulting buffers holds). None where the call is refused (then never asked again).

    Exact, by default: the kernel walks every page, ~9 ms a GB here for a file written through the
    page cache (4 KiB folios), before a load's first read. With ``sample``, only the last
    ``sample`` bytes of each window are looked at and their share stands for the window's: 1.2 ms
    for that GB with 256 KiB of each 4 MiB."""
    global _cachestat_ok
    if not _cachestat_ok or libc is None or size <= 0:
        return None
    stat, span = _CacheStat(), _CacheRange(0, window)
    stat_p, span_p = ctypes.byref(stat), ctypes.byref(span)
    pages = []
    for off in range(0, size, window):
        n = min(window, size - off)
        if sample is not None and sample < n:
            # The window's end: reading the header brings the file's first pages in (readahead).
            span.off, span.len = off + (n - sample) // PAGE * PAGE, sample
        else:
            span.off, span.len = off, window
        if libc.syscall(_SYS_CACHESTAT, fd, span_p, stat_p, 0) != 0:
            _cachestat_ok = False  # ENOSYS before 6.5, EPERM under a seccomp filter: mincore instead
            return None
        whole = -(-n // PAGE)
        looked = min(whole, -(-span.len // PAGE))  # the sample's pages, or the whole window's
        pages.append(whole if stat.cache >= looked else stat.cache * whole // looked)
    return pages


def all_cached(arr: np.ndarray[Any, Any], windows: int = 32, window_pages: int = 64) -> bool:
    """Whether a mapped file sits in the page cache, from ``mincore`` over ``windows`` evenly
    spaced runs of pages (the whole file when it is small): all of a 2 GB file took 33-37 ms."""
    assert libc is not None
    pages = -(-arr.nbytes // PAGE)
    step = max(window_pages, pages // windows)
    vec = np.zeros(window_pages, dtype=np.uint8)
    for first in range(0, pages, step):
        n = min(window_pages, pages - first)
        addr = arr.ctypes.data + first * PAGE
        length = min(n * PAGE, arr.nbytes - first * PAGE)
        if libc.mincore(ctypes.c_void_p(addr), length, vec.ctypes.data_as(ctypes.c_void_p)) != 0:
            return False
        if not np.all(vec[:n] & 1):
            return False
    return True
