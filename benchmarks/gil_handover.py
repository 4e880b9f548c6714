"""How late a 1 ms ticker on the event loop runs while another thread is busy, by what it does:
``copy_()`` on small tensors back to back (what an engine's ``load_weights`` does per tensor), or
pure Python (which keeps the GIL until the interpreter's switch interval, 5 ms, runs out).

    python benchmarks/gil_handover.py [--ticks 1000]
"""

from __future__ import annotations

import argparse
import asyncio
import threading
import time

import torch


def busy(kind: str, stop: threading.Event) -> None:
    src, dst = torch.randn(256), torch.empty(256)
    n = 0
    while not stop.is_set():
        if kind == "copy_":
            dst.copy_(src)
        else:
            for _ in range(50):
                n += 1


async def lateness(kind: str, ticks: int) -> list[float]:
    stop = threading.Event()
    worker = threading.Thread(target=busy, args=(kind, stop))
    worker.start()
    late: list[float] = []
    try:
        for _ in range(ticks):
            t = time.perf_counter()
            await asyncio.sleep(0.001)
            late.append((time.perf_counter() - t - 0.001) * 1e3)
    finally:
        stop.set()
        worker.join()
    return sorted(late)


def quantile(late: list[float], q: float) -> float:
    return late[min(len(late) - 1, int(q * len(late)))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ticks", type=int, default=1000)
    args = ap.parse_args()
    for kind in ("copy_", "pure Python", "copy_"):
        late = asyncio.run(lateness(kind, args.ticks))
        p50, p99 = quantile(late, 0.5), quantile(late, 0.99)
        print(f"{kind:12s} ticker late: p50 {p50:.2f} ms, p99 {p99:.2f} ms, max {late[-1]:.2f} ms")


if __name__ == "__main__":
    main()
