"""A local file's private mapping: views of it, its pages faulted in ahead of their consumer, and
dropped from the process once consumed.

The pages stay the page cache's until someone writes to a tensor, which then gets its own copy
(copy-on-write) instead of a crash; dropping them from the mapping keeps the process's resident
memory within the budget and leaves them in the page cache.
"""

from __future__ import annotations

import errno
import os
import sys
import threading
from typing import Any

import numpy as np

from ._ntcopy import copy_bytes
from ._syscalls import (
    MADV_DONTNEED,
    MADV_POPULATE_READ,
    PAGE,
    WILLNEED_PIECE_BYTES,
    libc,
    madvise_in_steps,
    map_private,
    willneed,
)
from .errors import SourceError


def check_length(fd: int, offset: int, length: int, url: str) -> None:
    """Raise where the file no longer holds ``offset + length`` bytes: a mapped page past the end
    of a file truncated since it was opened would kill the process (SIGBUS) when touched."""
    if os.fstat(fd).st_size < offset + length:
        raise SourceError("file shrank since it was opened", url=url, byte_range=(offset, offset + length))


#: What ``Spans`` lets go of at a time.
RELEASE_SPAN_BYTES = 64 << 20


class FileMapping:
    """The whole file open as ``fd``, mapped private at first need, once, whichever thread asks
    first (a file read only from the disk is never mapped)."""

    __slots__ = ("_array", "_fd", "_lock", "_piece", "_populate_read", "_size", "url")

    def __init__(self, fd: int, size: int, url: str, piece: int = WILLNEED_PIECE_BYTES) -> None:
        self._fd, self._size, self.url = fd, size, url
        self._array: np.ndarray[Any, Any] | None = None
        self._lock = threading.Lock()
        self._populate_read = libc is not None and sys.platform.startswith("linux")
        self._piece = piece  # what one WILLNEED reads at most (``willneed_piece``)

    def array(self) -> np.ndarray[Any, Any]:
        arr = self._array
        if arr is None:
            with self._lock:
                if self._array is None:
                    self._array = map_private(self._fd, self._size, self.url)
                arr = self._array
        return arr

    def populate(self, offset: int, length: int) -> None:
        """Fault in the pages of ``offset..offset + length``, from the disk where they are not cached."""
        arr = self.array()
        check_length(self._fd, offset, length, self.url)
        # Exactly these bytes asked for first: a fault on a missing page reads around it
        # (``read_ahead_kb``, 8 MiB on the VM measured), into neighbours read with O_DIRECT.
        willneed(self._fd, offset, length, self._piece)
        if not self._populated(arr, offset, length):
            first = offset - offset % PAGE
            int(arr[first : offset + length : PAGE].max())  # one read per page faults it in

    def _populated(self, arr: np.ndarray[Any, Any], offset: int, length: int) -> bool:
        """Map the range's pages by ``MADV_POPULATE_READ`` (the length checked before): one call
        faults the range in (with the kernel's readahead) and lets go of the GIL throughout
        (touching pages from numpy holds it for small ranges, and on a cold disk each fault
        waits for the device while the event loop waits for the GIL). False where the kernel
        cannot (before 5.14: never asked again)."""
        if not self._populate_read:
            return False
        first = offset - offset % PAGE
        err = madvise_in_steps(arr.ctypes.data + first, offset + length - first, MADV_POPULATE_READ)
        if err == errno.EFAULT:  # a page past the end of the file: it shrank after the check
            raise SourceError("file shrank since it was opened", url=self.url, byte_range=(offset, offset + length))
        if err == errno.EINVAL:
            self._populate_read = False
        return err == 0

    def copy_into(self, offset: int, buf: memoryview, cached: bool = False, release: bool = True) -> bool:
        """Copy the file's bytes at ``offset`` into ``buf`` out of the mapping: its pages mapped
        first (after the length check: touching a page past the end of the file would kill the
        process), then one copy on this thread (past the caches: ``_ntcopy.copy_bytes``), then the
        pages dropped from the process again (``release=False``: the caller lets go of them, with
        ``Spans``). ``cached``: the caller saw every page of the range in the page cache, so none
        is populated first and the copy's own faults map them, one per 2 MiB page where the page cache holds them so
        (the populate walked every 4 KiB of them). False, with nothing copied, where the kernel
        cannot populate: the caller reads them instead. A file cut short after the length check
        still kills the process, as with any mapped loader."""
        if not self._populate_read:
            return False
        arr = self.array()
        n = len(buf)
        check_length(self._fd, offset, n, self.url)
        if not cached and not self._populated(arr, offset, n):
            return False
        copy_bytes(np.frombuffer(buf, dtype=np.uint8).ctypes.data, arr.ctypes.data + offset, n)
        if release:
            self.release(offset, n)
        return True

    def release(self, offset: int, length: int) -> None:
        """Drop the whole pages inside the range from this process (neighbours may share the
        pages at its ends); they stay in the page cache. Called after ``copy_into``, and on the
        thread that drops the last tensor viewing them, the consumer's: on a read thread
        instead, 8 GiB warm through ``load_weights`` ran ~8% faster and the event loop later (p99 5.0-8.1 ms against 3.2-4.3)."""
        arr = self._array  # a local reference keeps the mapping alive during the call
        lo, hi = -(-offset // PAGE) * PAGE, (offset + length) // PAGE * PAGE
        if arr is not None and libc is not None and hi > lo:
            madvise_in_steps(arr.ctypes.data + lo, hi - lo, MADV_DONTNEED)

    def drop(self) -> None:
        self._array = None  # unmapped when the last tensor viewing it dies


class Spans:
    """The pages of one range copied out of a mapping in steps (on any thread, in any order), let
    go of ``span`` bytes at a time, by the step that finishes a span (its bytes counted whichever
    way the step copied them); the steps are cut from the range's start, ``span`` a multiple of
    theirs. One ``MADV_DONTNEED`` per 8 MiB step cost every other core running the process an
    interrupt to flush its TLB, the other read thread's included, mid-copy. 4 GiB warm, built-in,
    ``ALOAD_WARM_COPY=map``, in one process, 5 loads each alternating (``docs/benchmarks.md``,
    stop 53): steps populated first and released per 8 MiB 239 ms a load (median), not populated
    233, released per 64 MiB 237, both 224 (``load_file`` 190). A step that fails leaves its
    span mapped until the file is unmapped, at the load's end."""

    __slots__ = ("_left", "_lock", "_map", "_n", "_offset", "_span")

    def __init__(self, mapping: FileMapping, offset: int, n: int, span: int = RELEASE_SPAN_BYTES) -> None:
        self._map, self._offset, self._n, self._span = mapping, offset, n, span
        self._left = [min(span, n - at) for at in range(0, n, span)]
        self._lock = threading.Lock()

    def done(self, offset: int, n: int) -> None:
        """The ``n`` bytes at ``offset`` (one step, inside one span) are copied."""
        i = (offset - self._offset) // self._span
        with self._lock:
            self._left[i] -= n
            last = self._left[i] == 0
        if last:
            at = self._offset + i * self._span
            self._map.release(at, min(self._span, self._offset + self._n - at))
