"""Local files: one ``.safetensors`` file or a folder of them.

Two ways in, one rule: a file of which at least half sits in the page cache when it is opened
is read through the page cache (``os.preadv`` straight into a destination; for a consumer
without one, views of a private mapping of the file, with no copy); any other file is read
with ``O_DIRECT`` past the page cache (into aligned buffers; into a destination through a
per-thread bounce buffer). ``read="cached"`` or ``read="direct"`` forces either.
"""

from __future__ import annotations

import mmap
import os
import stat
import threading
from typing import Any
from urllib.parse import unquote, urlparse

import numpy as np
import torch

from ..errors import SourceError, UsageError
from .base import ALIGN, Source, Store, aligned_empty
from .cachestat import cached_share

READ_MODES = ("auto", "cached", "direct")
#: A file with less of it in the page cache than this share is read with O_DIRECT ("auto").
DIRECT_BELOW_SHARE = 0.5
#: Files smaller than this are read through the page cache whatever is cached.
DIRECT_MIN_FILE_BYTES = 64 << 20
_O_DIRECT = getattr(os, "O_DIRECT", 0)
_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


def path_of(url: str) -> str:
    if url.startswith("file://"):
        parsed = urlparse(url)
        if parsed.netloc not in ("", "localhost"):
            raise UsageError("file:// URLs must name a local path", url=url)
        return unquote(parsed.path)
    return os.path.expanduser(url)


def is_local(url: str) -> bool:
    return "://" not in url or url.startswith("file://")


def local_files(url: str) -> list[str]:
    """A local checkpoint's ``.safetensors`` files: the file itself, or those of the folder."""
    path = path_of(url)
    if os.path.isdir(path):
        return [os.path.join(path, e) for e in sorted(os.listdir(path)) if e.endswith(".safetensors")]
    return [path]


def evict(url: str) -> None:
    """Drop a local checkpoint's files from the page cache (written back first), so that the next
    read comes from the disk. Pages another process maps stay, and so does a file on tmpfs."""
    for path in local_files(url):
        fd = _open(path, 0)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        except OSError:
            pass  # dirty pages then stay, as the kernel keeps them
        finally:
            os.close(fd)


def cached(url: str) -> float | None:
    """The share of a local checkpoint's bytes in the page cache now (None where unknown)."""
    total = got = 0.0
    for path in local_files(url):
        fd = _open(path, 0)
        try:
            size = os.fstat(fd).st_size
            share = cached_share(fd, size)
        finally:
            os.close(fd)
        if share is None:
            return None
        total, got = total + size, got + share * size
    return got / total if total else 1.0


def _open(path: str, flags: int) -> int:
    try:
        return os.open(path, os.O_RDONLY | _O_CLOEXEC | flags)
    except OSError as exc:
        raise SourceError(f"cannot open: {exc.strerror}", url=path) from exc


class LocalSource(Source):
    """A file opened once and kept open, so a file replaced on disk mid-load is never mixed with
    its successor."""

    def __init__(self, path: str, mode: str, run: Any) -> None:
        self.url = path
        self.run = run
        self._mode = mode
        self._lock = threading.Lock()
        self._fd: int | None = None
        self._dfd: int | None = None  # the same file with O_DIRECT, where it is read so
        self._size = 0
        self._map: mmap.mmap | None = None
        self._bounce = threading.local()

    def _opened(self) -> int:
        with self._lock:
            if self._fd is None:
                fd = _open(self.url, 0)
                st = os.fstat(fd)
                if stat.S_ISDIR(st.st_mode):
                    os.close(fd)
                    raise SourceError("is a folder, not a .safetensors file", url=self.url)
                self._size = st.st_size
                self._fd = fd
                if self._wants_direct(fd):
                    try:
                        self._dfd = os.open(self.url, os.O_RDONLY | _O_CLOEXEC | _O_DIRECT)
                    except OSError:  # a filesystem without O_DIRECT (tmpfs): the page cache
                        self._dfd = None
                    else:
                        self.align = ALIGN
            return self._fd

    def _wants_direct(self, fd: int) -> bool:
        if not _O_DIRECT or self._mode == "cached":
            return False
        if self._mode == "direct":
            return True
        share = cached_share(fd, self._size) if self._size >= DIRECT_MIN_FILE_BYTES else None
        return share is not None and share < DIRECT_BELOW_SHARE

    def size(self) -> int:
        self._opened()
        return self._size

    def read(self, offset: int, n: int) -> bytes:
        buf = bytearray(n)
        self._pread(self._opened(), memoryview(buf), offset)
        return bytes(buf)

    def _pread(self, fd: int, buf: memoryview, offset: int, need: int | None = None) -> None:
        """Fill ``buf`` from ``offset``, finishing short reads; ``need``: the bytes that must come
        (the rest may lie past the end of the file: a direct read's last block)."""
        total = len(buf)
        need = total if need is None else need
        done = 0
        while done < need:
            try:
                n = os.preadv(fd, [buf[done:]], offset + done)
            except OSError as exc:
                raise SourceError(
                    f"read failed: {exc.strerror}", url=self.url, byte_range=(offset, offset + total)
                ) from exc
            if n == 0:
                raise SourceError(
                    f"file ended at byte {offset + done}, before the tensors its header lists (truncated?)",
                    url=self.url,
                    byte_range=(offset, offset + total),
                )
            done += n

    def _check_length(self, offset: int, n: int) -> None:
        # Touching a mapped page past the end of a file cut short since it was opened would kill
        # the process (SIGBUS): the length is checked before a view is handed out.
        assert self._fd is not None
        if os.fstat(self._fd).st_size < offset + n:
            raise SourceError("file shrank since it was opened", url=self.url, byte_range=(offset, offset + n))

    def buffer(self, offset: int, n: int) -> np.ndarray[Any, Any]:
        self._opened()
        if self._dfd is not None or n == 0:
            return aligned_empty(offset, n)
        with self._lock:
            if self._map is None:
                # Private: a consumer that writes to a tensor gets its own copy of the page. As long
                # as the file is now (a file cut short since it was opened: what is left).
                size = min(self._size, os.fstat(self._fd).st_size)  # type: ignore[arg-type]
                self._map = mmap.mmap(self._fd, size, flags=mmap.MAP_PRIVATE)  # type: ignore[arg-type]
            if offset + n > len(self._map):
                raise SourceError("file shrank since it was opened", url=self.url, byte_range=(offset, offset + n))
            return np.frombuffer(self._map, dtype=np.uint8, count=n, offset=offset)

    def fill(self, buf: np.ndarray[Any, Any], offset: int, at: int, n: int) -> None:
        fd = self._opened()
        if self._dfd is None:  # a view of the mapping: ask for its pages, check the length
            self._check_length(offset + at, n)
            os.posix_fadvise(fd, offset + at, n, os.POSIX_FADV_WILLNEED)
            return
        # Whole blocks, straight into the allocation around ``buf`` (``aligned_empty``).
        lo = (offset + at) // ALIGN * ALIGN
        hi = -(-(offset + at + n) // ALIGN) * ALIGN
        raw = buf.base if buf.base is not None else buf
        first = buf.ctypes.data - raw.ctypes.data + at - (offset + at - lo)
        self._pread(self._dfd, memoryview(raw)[first : first + hi - lo], lo, need=offset + at + n - lo)  # type: ignore[arg-type]

    def read_into(self, offset: int, dest: Any, at: int, n: int) -> None:
        self._opened()
        if self._dfd is not None:
            super().read_into(offset, dest, at, n)
            return
        # Out of the page cache through the mapping, by torch's copy (which lets go of the GIL
        # and is preemptible, where a large preadv held a core in the kernel), then the pages
        # are dropped from the process again.
        src = torch.from_numpy(self.buffer(offset + at, n))
        self._check_length(offset + at, n)
        dest.detach().reshape(-1).view(torch.uint8)[at : at + n].copy_(src)
        del src
        self.release(offset + at, n)

    def readinto(self, offset: int, buf: memoryview) -> None:
        fd = self._opened()
        if self._dfd is None:
            self._pread(fd, buf, offset)
            return
        n = len(buf)
        lo = offset // ALIGN * ALIGN
        hi = -(-(offset + n) // ALIGN) * ALIGN
        bounce = self._bounce_of(hi - lo)
        self._pread(self._dfd, memoryview(bounce)[: hi - lo], lo, need=offset + n - lo)  # type: ignore[arg-type]
        at = offset - lo  # torch's copy lets go of the GIL
        torch.frombuffer(buf, dtype=torch.uint8).copy_(torch.from_numpy(bounce[at : at + n]))

    def _bounce_of(self, n: int) -> np.ndarray[Any, Any]:
        """This thread's aligned bounce buffer, grown to ``n`` bytes."""
        have = getattr(self._bounce, "buf", None)
        if have is None or len(have) < n:
            have = self._bounce.buf = aligned_empty(0, n)
        return have

    def warm(self, offset: int, n: int) -> None:
        """Bytes ``offset .. offset + n`` read through the page cache and dropped: there for the
        next reader (a share of a process group's prefetch)."""
        fd = self._opened()
        piece = min(n, 16 << 20)
        scratch = memoryview(self._bounce_of(piece))  # type: ignore[arg-type]
        for at in range(0, n, piece):
            m = min(piece, n - at)
            self._pread(fd, scratch[:m], offset + at)

    def release(self, offset: int, n: int) -> None:
        """Drop the mapped pages wholly inside the range from the process (they stay in the page
        cache): resident memory stays within the budget."""
        m = self._map
        lo, hi = -(-offset // mmap.PAGESIZE) * mmap.PAGESIZE, (offset + n) // mmap.PAGESIZE * mmap.PAGESIZE
        if m is not None and hi > lo and self._dfd is None:
            try:
                m.madvise(mmap.MADV_DONTNEED, lo, hi - lo)
            except (ValueError, OSError):  # closed meanwhile: nothing left to drop
                pass

    def close(self) -> None:
        # The mapping is not closed here: tensors handed out may still view it, and it is
        # unmapped when the last of them dies.
        self._map = None
        for fd in (self._fd, self._dfd):
            if fd is not None:
                os.close(fd)
        self._fd = self._dfd = None


class LocalStore(Store):
    """A local ``.safetensors`` file or folder. ``read``: "auto" (the rule above), "cached" or "direct"."""

    #: Reads of 64 MiB: each read is a trip to a thread and back, and a copy out of the page
    #: cache runs at memory speed (``benchmarks/suite.py``, 1 GiB warm, built-in loader).
    chunk_bytes = 64 << 20

    def __init__(self, url: str, concurrency: int, read: str | None = None) -> None:
        super().__init__(url, concurrency)
        mode = read or os.environ.get("ALOAD_READ") or "auto"
        if mode not in READ_MODES:
            raise UsageError(f"read must be one of {', '.join(READ_MODES)}, got {mode!r}", url=url)
        self._mode = mode
        self._path = path_of(url)
        self._sources: dict[str, LocalSource] = {}

    def source(self, name: str) -> LocalSource:
        src = self._sources.get(name)
        if src is None:
            path = os.path.join(self._path, name) if name else self._path
            src = self._sources[name] = LocalSource(path, self._mode, self.run)
        return src

    def kind(self) -> str:
        if os.path.isdir(self._path):
            return "folder"
        if not os.path.exists(self._path):
            raise SourceError("no such file or folder", url=self.url)
        return "file"

    def list(self, suffix: str) -> list[str]:
        return sorted(e for e in os.listdir(self._path) if e.endswith(suffix))

    def warm(self, source: LocalSource, offset: int, n: int) -> None:
        """Read a byte range into the page cache (``share="prefetch"``)."""
        source.warm(offset, n)

    def get(self, name: str, limit: int) -> bytes | None:
        path = os.path.join(self._path, name)
        try:
            with open(path, "rb") as f:
                data = f.read(limit + 1)
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise SourceError(f"cannot read: {exc.strerror}", url=path) from exc
        if len(data) > limit:
            raise SourceError(f"larger than the {limit}-byte limit", url=path)
        return data

    def close(self) -> None:
        for src in self._sources.values():
            src.close()
        self._sources.clear()  # each refers back to this store (``run``)
