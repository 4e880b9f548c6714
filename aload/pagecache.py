"""What the page cache holds of a local file, looked at once, when a load first reads it.

A local file is read from its mapping where its bytes sit in the page cache and from the disk
(``O_DIRECT``) where they do not, decided per unit from windows of the file: ``cachestat(2)``
counts a window's cached pages without mapping the file; ``mincore`` over a mapping, where the
kernel refuses that call, says it for the whole file only.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from ._syscalls import PAGE, all_cached, window_pages

#: The share of a unit's pages in the page cache from which it counts as cached (mapped, or copied
#: out of the mapping); below it the unit is read from the disk with O_DIRECT, its cached part
#: included. The pages a cached unit misses are read in ahead of its consumer, through the page
#: cache. Measured here (suite children, the first 10% of each shard evicted, 4 runs each): 1 GiB,
#: whose 250 MiB embedding was 60% cached, 6.9 GB/s built-in at 0.9 against 9.5 at 0.5, and
#: through ``load_weights`` 3.7 against 6.2 (3 runs; its evicted part went through the budget's
#: fresh buffers); 4 GiB the same either way. A 250 MiB tensor missing 6 MiB was read whole with
#: O_DIRECT at 0.99, its first tensor after 169-789 ms through ``load_weights``; mapped, 14-16 ms.
#: Where the disk is much faster than reading through the page cache, a higher share would fit.
WARM_SHARE = 0.5
#: The page cache is looked at in windows of this many bytes, so that a file partly evicted (by
#: other work on the host, oldest pages first) is mapped where it is cached and read from the disk
#: only where it is not: a 4 GiB checkpoint with 10% evicted was read whole with O_DIRECT, at
#: 1.3-2.2 GB/s, where the memory-mapped loaders took 4.6-6.0.
CACHE_WINDOW_BYTES = 4 << 20
#: Of each window, the last this many bytes are looked at (``window_pages``' sample) and stand for
#: the window: walking all of a file's pages in the cache took 9 ms a GB here, before a load's
#: first read could start; the sample, 1.2 ms.
CACHE_SAMPLE_BYTES = 256 << 10
#: The share of a range's windows in the page cache from which it counts as all there; a file
#: counts as warm from it too. Pages went missing from files read whole a few seconds before (on
#: the VM measured, 0.3-1% of a 1 GB file, with 18 GB of memory free), and a file warm but for
#: those was taken as cold: its small tensors read one run per unit by the loader's thread.
ALL_CACHED = 0.99


#: One file's windows looked at at a time: two threads each calling ``cachestat`` per window took
#: turns with the GIL at every call (two 2 GiB shards: 5.5-7.4 ms at once, 3.9 one after the other).
_LOOKING = threading.Lock()


class Residency:
    """A file's pages in the page cache when it was looked at: how many in each window (``before[i]``:
    in the windows before the i-th), or only whether all of it was (``before`` None)."""

    __slots__ = ("_before", "_size", "warm")

    def __init__(self, warm: bool, before: list[int] | None = None, size: int = 0) -> None:
        self.warm = warm
        self._before = before
        self._size = size

    @classmethod
    def look(cls, fd: int, size: int, mapping: Callable[[], np.ndarray[Any, Any]]) -> Residency:
        """Blocking: ``cachestat`` over sampled windows, or ``mincore`` over ``mapping()``."""
        with _LOOKING:
            pages = window_pages(fd, size, CACHE_WINDOW_BYTES, CACHE_SAMPLE_BYTES)
        return cls(all_cached(mapping())) if pages is None else cls._from(pages, size)

    @classmethod
    def look_now(cls, fd: int, size: int) -> Residency | None:
        """``look`` where it takes no wait, for the event loop: None where another file is being
        looked at or ``cachestat`` is refused (``mincore`` would map the file first)."""
        if not _LOOKING.acquire(blocking=False):
            return None
        try:
            pages = window_pages(fd, size, CACHE_WINDOW_BYTES, CACHE_SAMPLE_BYTES)
        finally:
            _LOOKING.release()
        return None if pages is None else cls._from(pages, size)

    @classmethod
    def _from(cls, pages: list[int], size: int) -> Residency:
        before = [0]
        for n in pages:
            before.append(before[-1] + n)
        return cls(before[-1] >= ALL_CACHED * -(-size // PAGE), before, size)

    def share_at(self, offset: int, length: int) -> float:
        """The share of the pages of the windows holding bytes ``offset``..``offset + length`` that
        were in the page cache; 1 or 0 where only the whole file was looked at."""
        before = self._before
        if before is None:
            return 1.0 if self.warm else 0.0
        w, size = CACHE_WINDOW_BYTES, self._size
        lo = min(offset // w, len(before) - 1)
        hi = min(-(-(offset + max(length, 1)) // w), len(before) - 1)
        pages = -(-(min(hi * w, size) - lo * w) // PAGE)
        return (before[hi] - before[lo]) / pages if pages > 0 else 1.0


def share_of(files: list[str]) -> float | None:
    """The share of the bytes of ``files`` in the page cache now, every page counted; None where a
    file cannot be opened or ``cachestat(2)`` is refused."""
    cached = pages = 0
    for name in files:
        try:
            fd = os.open(name, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except OSError:
            return None
        try:
            size = os.fstat(fd).st_size
            got = window_pages(fd, size, max(size, 1))
        finally:
            os.close(fd)
        if got is None and size:
            return None
        cached += sum(got or [])
        pages += -(-size // PAGE)
    return cached / pages if pages else None
