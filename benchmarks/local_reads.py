"""The ways to get a local checkpoint's bytes into preallocated memory, without aload around them:
what aload's local reads are built on (docs/benchmarks.md, "Local reads").

    python benchmarks/local_reads.py CHECKPOINT_DIR [--reps 3] [--scenarios warm,cold]

Each method copies every shard of the folder into one preallocated, already touched buffer, on
a pool of threads, all pieces submitted at once; methods alternate within each repetition. Warm:
the files are read once with ``dd`` first; cold: ``fsync`` + ``POSIX_FADV_DONTNEED`` before each
method. Prints GB/s and the process CPU seconds per method, median and min-max over repetitions.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import ctypes
import mmap
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.suite import drop_cache, shards, warm_cache

libc = ctypes.CDLL(None, use_errno=True)
libc.memcpy.restype = ctypes.c_void_p
libc.memcpy.argtypes = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)
libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
MADV_DONTNEED, MADV_POPULATE_READ = 4, 22
MiB = 1 << 20
ALIGN = 4096


class Files:
    def __init__(self, folder: Path) -> None:
        self.paths = [str(p) for p in shards(folder)]
        self.sizes = [os.path.getsize(p) for p in self.paths]
        self.total = sum(self.sizes)
        self.dest = np.ones(self.total + 2 * MiB, dtype=np.uint8)  # touched, as a model's memory is

    def pieces(self, piece: int) -> list[tuple[int, int, int, int]]:
        """(file index, offset in file, length, offset in dest) of every piece."""
        out, base = [], 0
        for i, size in enumerate(self.sizes):
            out += [(i, o, min(piece, size - o), base + o) for o in range(0, size, piece)]
            base += size
        return out


def run_pool(threads: int, jobs: list[Any], fn: Callable[[Any], None]) -> None:
    with concurrent.futures.ThreadPoolExecutor(threads) as ex:
        list(ex.map(fn, jobs))


def preadv(f: Files, threads: int, piece: int) -> None:
    fds = [os.open(p, os.O_RDONLY) for p in f.paths]
    dest = memoryview(f.dest)
    try:
        run_pool(threads, f.pieces(piece), lambda j: os.preadv(fds[j[0]], [dest[j[3] : j[3] + j[2]]], j[1]))
    finally:
        [os.close(fd) for fd in fds]


def mapped(f: Files, flags: int) -> tuple[list[mmap.mmap], list[int]]:
    """Each file mapped whole, read-only (each mapping holds a descriptor of its own), and the
    mappings' addresses."""
    maps = []
    for p in f.paths:
        fd = os.open(p, os.O_RDONLY)
        maps.append(mmap.mmap(fd, 0, flags=flags, prot=mmap.PROT_READ))
        os.close(fd)
    return maps, [np.frombuffer(m, dtype=np.uint8).ctypes.data for m in maps]


def mapped_memcpy(f: Files, threads: int, piece: int, populate: bool = True) -> None:
    """MADV_POPULATE_READ, one memcpy, MADV_DONTNEED: what aload did for a file in the cache
    until 2026-12-03 (without the populate where all of it was cached: the copy's faults map it)."""
    _maps, bases = mapped(f, mmap.MAP_SHARED)  # the mappings alive while their addresses are used
    dest = f.dest.ctypes.data

    def one(j: tuple[int, int, int, int]) -> None:
        i, off, n, at = j
        lo = off - off % ALIGN
        if populate:
            libc.madvise(bases[i] + lo, off + n - lo, MADV_POPULATE_READ)
        libc.memcpy(dest + at, bases[i] + off, n)
        libc.madvise(bases[i] + lo, off + n - lo, MADV_DONTNEED)

    run_pool(threads, f.pieces(piece), one)


def mapped_faulting(f: Files, threads: int, piece: int) -> None:
    mapped_memcpy(f, threads, piece, populate=False)


def mapped_streaming(f: Files, threads: int, piece: int, streaming: bool = True) -> None:
    """Each piece copied out of a private mapping, faulted by the copy and let go once a
    ``RELEASE_SPAN_BYTES`` span is copied, by aload's copy past the caches (``_ntcopy``), or
    (``streaming=False``) by ``memcpy``: aload's warm steps out of the mapping, alone."""
    from aload._ntcopy import copy_bytes
    from aload.mapping import RELEASE_SPAN_BYTES

    copy = copy_bytes if streaming else libc.memcpy
    _maps, bases = mapped(f, mmap.MAP_PRIVATE)  # the mappings alive while their addresses are used
    dest = f.dest.ctypes.data

    left: dict[tuple[int, int], int] = {}  # bytes of each (file, span) not yet copied
    for i, off, n, _ in f.pieces(piece):
        key = (i, off // RELEASE_SPAN_BYTES)
        left[key] = left.get(key, 0) + n
    lock = threading.Lock()

    def one(j: tuple[int, int, int, int]) -> None:
        i, off, n, at = j
        copy(dest + at, bases[i] + off, n)
        key = (i, off // RELEASE_SPAN_BYTES)
        with lock:
            left[key] -= n
            last = left[key] == 0
        if last:  # the span's last piece, whichever thread copied it: let its pages go (as Spans)
            lo = key[1] * RELEASE_SPAN_BYTES
            libc.madvise(bases[i] + lo, min(RELEASE_SPAN_BYTES, f.sizes[i] - lo) // ALIGN * ALIGN, MADV_DONTNEED)

    run_pool(threads, f.pieces(piece), one)


def mapped_memcpy_steps(f: Files, threads: int, piece: int) -> None:
    mapped_streaming(f, threads, piece, streaming=False)


def direct(f: Files, threads: int, piece: int) -> None:
    """O_DIRECT into a per-thread aligned buffer, then memcpy: what aload does for a file on disk."""
    fds = [os.open(p, os.O_RDONLY | os.O_DIRECT) for p in f.paths]
    local = threading.local()
    dest = f.dest.ctypes.data

    def one(j: tuple[int, int, int, int]) -> None:
        i, off, n, at = j
        if not hasattr(local, "buf"):
            local.m = mmap.mmap(-1, piece + ALIGN)
            local.buf, local.addr = memoryview(local.m), np.frombuffer(local.m, dtype=np.uint8).ctypes.data
        span = -(-n // ALIGN) * ALIGN  # pieces start aligned; the last one of a file may be short
        got = 0
        while got < n:
            r = os.preadv(fds[i], [local.buf[got:span]], off + got)
            if r == 0:
                raise OSError(f"{f.paths[i]} ended at {off + got}")
            got += r
        libc.memcpy(dest + at, local.addr, n)

    try:
        run_pool(threads, f.pieces(piece), one)
    finally:
        [os.close(fd) for fd in fds]


METHODS: dict[str, dict[str, tuple[Callable[[Files, int, int], None], int, int]]] = {
    "warm": {
        "preadv 2 x 16 MiB": (preadv, 2, 16 * MiB),
        "preadv 4 x 16 MiB": (preadv, 4, 16 * MiB),
        "mapping + memcpy 2 x 16 MiB": (mapped_memcpy, 2, 16 * MiB),
        "mapping + memcpy 2 x 256 MiB": (mapped_memcpy, 2, 256 * MiB),
        "mapping, faulted by memcpy 2 x 256 MiB": (mapped_faulting, 2, 256 * MiB),
        "mapping, memcpy 2 x 8 MiB, spans let go": (mapped_memcpy_steps, 2, 8 * MiB),
        "mapping, streaming 2 x 8 MiB, spans let go": (mapped_streaming, 2, 8 * MiB),
    },
    "cold": {
        "preadv 16 x 2 MiB": (preadv, 16, 2 * MiB),
        "mapping + memcpy 8 x 32 MiB": (mapped_memcpy, 8, 32 * MiB),
        "O_DIRECT 16 x 1 MiB": (direct, 16, MiB),
        "O_DIRECT 16 x 4 MiB": (direct, 16, 4 * MiB),
        "O_DIRECT 32 x 1 MiB": (direct, 32, MiB),
    },
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("folder", type=Path)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--scenarios", default="warm,cold")
    a = ap.parse_args()
    f = Files(a.folder)
    for scenario in a.scenarios.split(","):
        results: dict[str, list[tuple[float, float]]] = {}
        for _ in range(a.reps):
            for name, (fn, threads, piece) in METHODS[scenario].items():
                drop_cache(a.folder) if scenario == "cold" else warm_cache(a.folder)
                c, t = time.process_time(), time.perf_counter()
                fn(f, threads, piece)
                s = time.perf_counter() - t
                results.setdefault(name, []).append((f.total / s / 1e9, time.process_time() - c))
        print(f"{scenario}, {f.total / 1e9:.2f} GB in {len(f.paths)} files, {a.reps} reps:")
        for name, rs in results.items():
            g, c = [r[0] for r in rs], [r[1] for r in rs]
            print(
                f"  {name:40s} {statistics.median(g):6.2f} GB/s ({min(g):.2f}-{max(g):.2f})"
                f"   cpu {statistics.median(c):5.2f} s ({min(c):.2f}-{max(c):.2f})"
            )


if __name__ == "__main__":
    main()
