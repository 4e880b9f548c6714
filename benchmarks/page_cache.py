"""How the page cache holds a file, and what that costs a loader that copies out of a mapping.

    python benchmarks/page_cache.py FILE [--rounds 2]

For each way of bringing a file into the page cache (it is dropped first: the file is read from
the disk each time), the share of it the kernel then maps in 2 MiB pages (``suite.huge_share``),
and one copy out of a private mapping of it, single-threaded, in three parts: faulting while
copying, or ``MADV_POPULATE_READ`` first and then the copy, and the ``munmap`` after.

The ways: ``POSIX_FADV_WILLNEED`` and ``readahead(2)`` in 8 MiB pieces (what aload asks the kernel
for ahead of a read), ``pread`` in 8 MiB pieces (``dd``, ``cat``), and a mapping's
``MADV_POPULATE_READ`` with and without ``MADV_HUGEPAGE``. On the 2-core VM measured (Linux 6.18,
ext4), a 1 GB file: 0% in 2 MiB pages after either of the first two, 96% after ``pread`` or a
mapping's faults, 100% with ``MADV_HUGEPAGE``; a file just written by ``safetensors`` 99.6%
(docs/benchmarks.md, stop 52).
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from aload._syscalls import MADV_HUGEPAGE, MADV_POPULATE_READ, libc, madvise_in_steps
from aload.local import cached_share
from benchmarks.suite import smaps_field

PIECE = 8 << 20


def drop(fd: int) -> None:
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)


def bring_in(way: str, fd: int, size: int) -> None:
    if way == "fadvise":
        for at in range(0, size, PIECE):
            os.posix_fadvise(fd, at, PIECE, os.POSIX_FADV_WILLNEED)
    elif way == "readahead":
        assert libc is not None
        for at in range(0, size, PIECE):
            libc.readahead(fd, ctypes.c_longlong(at), ctypes.c_size_t(PIECE))
    elif way == "pread":
        for at in range(0, size, PIECE):
            os.pread(fd, PIECE, at)
    else:  # "populate", "populate+huge"
        m = mmap.mmap(fd, size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ)
        arr = np.frombuffer(m, dtype=np.uint8)
        if way == "populate+huge":
            m.madvise(MADV_HUGEPAGE)
        madvise_in_steps(arr.ctypes.data, size, MADV_POPULATE_READ)
        del arr
        m.close()


def settle(path: Path, timeout: float = 30.0) -> None:
    """Wait until the asynchronous ways' reads are in (a mapped touch would read the rest)."""
    deadline = time.perf_counter() + timeout
    while time.perf_counter() < deadline and cached_share(str(path)) not in (None, 1.0):
        time.sleep(0.1)


def mapped_copy(fd: int, size: int, populate: bool) -> tuple[float, float, float, int | None]:
    """(populate s, copy s, munmap s, bytes mapped in 2 MiB pages) for one copy out of a fresh mapping."""
    dst = np.empty(size, dtype=np.uint8)
    dst.fill(1)  # touched: the destination's faults are not timed
    m = mmap.mmap(fd, size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ)
    arr = np.frombuffer(m, dtype=np.uint8)
    t0 = time.perf_counter()
    if populate:
        madvise_in_steps(arr.ctypes.data, size, MADV_POPULATE_READ)
    t1 = time.perf_counter()
    dst[:] = arr
    t2 = time.perf_counter()
    pmd = smaps_field(arr.ctypes.data, "FilePmdMapped")
    del arr
    t3 = time.perf_counter()
    m.close()
    t4 = time.perf_counter()
    return t1 - t0, t2 - t1, t4 - t3, pmd


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("file", type=Path)
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()
    size = a.file.stat().st_size
    fd = os.open(a.file, os.O_RDONLY)
    print(f"{a.file}: {size / 2**20:.0f} MiB; single-threaded copy out of a private mapping, ms")
    print("| brought in by | in 2 MiB pages | faults + copy | munmap | populate | copy | munmap |")
    print("|---|---|---|---|---|---|---|")
    for _ in range(a.rounds):
        for way in ("fadvise", "readahead", "pread", "populate", "populate+huge"):
            drop(fd)
            bring_in(way, fd, size)
            settle(a.file)
            _, faulting, unmap1, pmd = mapped_copy(fd, size, populate=False)
            pop, copy, unmap2, _ = mapped_copy(fd, size, populate=True)
            share = "unknown" if pmd is None else f"{pmd / size:.0%}"
            cells = [share, faulting * 1e3, unmap1 * 1e3, pop * 1e3, copy * 1e3, unmap2 * 1e3]
            print(f"| {way} | " + " | ".join(c if isinstance(c, str) else f"{c:.0f}" for c in cells) + " |")
    os.close(fd)


if __name__ == "__main__":
    main()
