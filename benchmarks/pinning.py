"""What pinned host memory costs on this machine, ways of getting it compared (needs a GPU):

    python benchmarks/pinning.py [MIB ...]      # sizes, default 64 512

- ``alloc``: ``torch.empty(n, pin_memory=True)`` (``cudaHostAlloc``: the driver's zeroed pages);
- ``register``: anonymous memory, its pages made by ``MADV_POPULATE_WRITE`` (on 1 and on 8
  threads), then pinned by ``cudaHostRegister``;
- ``register file``: a read-only private mapping of FILE (its pages the page cache's) pinned as
  it is (``cudaHostRegisterReadOnly``), then copied to the GPU from there.
Each figure is one try in this process (each size a fresh range: nothing reused). Prints lines.
"""

from __future__ import annotations

import ctypes
import mmap
import sys
import threading
import time

import numpy as np
import torch

libc = ctypes.CDLL(None, use_errno=True)
libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
MADV_POPULATE_WRITE = 23
REGISTER_DEFAULT = 0


def ms(t: float) -> str:
    return f"{(time.perf_counter() - t) * 1e3:7.1f} ms"


def populate(addr: int, n: int, threads: int) -> None:
    step = -(-n // threads // mmap.PAGESIZE) * mmap.PAGESIZE

    def one(lo: int) -> None:
        libc.madvise(addr + lo, min(step, n - lo), MADV_POPULATE_WRITE)

    ts = [threading.Thread(target=one, args=(lo,)) for lo in range(0, n, step)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()


def copy_rate(src: torch.Tensor, dst: torch.Tensor) -> str:
    torch.cuda.synchronize()
    t = time.perf_counter()
    dst.copy_(src, non_blocking=True)
    issued = time.perf_counter() - t
    torch.cuda.synchronize()
    s = time.perf_counter() - t
    return f"copy to GPU {src.numel() / s / 1e9:5.1f} GB/s (the call returned in {issued * 1e3:.2f} ms)"


def main() -> None:
    sizes = [int(a) << 20 for a in sys.argv[1:]] or [64 << 20, 512 << 20]
    cudart = torch.cuda.cudart()
    torch.zeros(1, device="cuda")
    dst = torch.empty(max(sizes), dtype=torch.uint8, device="cuda")
    keep = []
    for n in sizes:
        mib = n >> 20
        t = time.perf_counter()
        a = torch.empty(n, dtype=torch.uint8, pin_memory=True)
        print(f"{mib:4d} MiB alloc (cudaHostAlloc):              {ms(t)}; {copy_rate(a, dst[:n])}")
        keep.append(a)
        for threads in (1, 8):
            m = mmap.mmap(-1, n)
            arr = np.frombuffer(m, dtype=np.uint8)
            addr = arr.ctypes.data
            t = time.perf_counter()
            populate(addr, n, threads)
            made = ms(t)
            t = time.perf_counter()
            err = cudart.cudaHostRegister(addr, n, REGISTER_DEFAULT)
            print(
                f"{mib:4d} MiB populate on {threads} thread(s) {made}, register {ms(t)} (error {int(err)}); "
                f"{copy_rate(torch.from_numpy(arr), dst[:n])}"
            )
            keep.append((m, arr))
        m = mmap.mmap(-1, n)
        arr = np.frombuffer(m, dtype=np.uint8)
        t = time.perf_counter()
        err = cudart.cudaHostRegister(arr.ctypes.data, n, REGISTER_DEFAULT)
        print(f"{mib:4d} MiB register untouched memory:           {ms(t)} (error {int(err)})")
        keep.append((m, arr))


if __name__ == "__main__":
    main()
