"""Per-tensor overhead: 20,000 small tensors (256 bytes each), warm page cache.

    python benchmarks/bench_many.py [--tensors 20000] [--reps 5]

Prints microseconds per tensor for the whole call (open and header parse included): streaming
with ``aload.stream``, ``aload.load`` with the built-in loader, and ``aload.load`` into a
vLLM-style ``load_weights`` that drops each tensor.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
from safetensors.torch import save_file

import aload
from examples.demo import empty_model


class Engine(torch.nn.Module):
    def load_weights(self, weights: object) -> set[str]:
        for _ in weights:  # type: ignore[attr-defined]
            pass
        return set()


async def run(path: Path, model: torch.nn.Module, n: int, reps: int) -> None:
    cases = {"stream": [], "load (built-in)": [], "load (load_weights)": []}  # type: dict[str, list[float]]
    for _ in range(reps):
        t = time.perf_counter()
        async with aload.stream(path) as s:
            async for _pair in s:
                pass
        cases["stream"].append(time.perf_counter() - t)
        t = time.perf_counter()
        await aload.load(model, path)
        cases["load (built-in)"].append(time.perf_counter() - t)
        t = time.perf_counter()
        await aload.load(Engine(), path)
        cases["load (load_weights)"].append(time.perf_counter() - t)
    for name, secs in cases.items():
        us = [s / n * 1e6 for s in secs]
        print(f"{name:>22}: {statistics.median(us):6.1f} us/tensor (min {min(us):.1f}, max {max(us):.1f})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tensors", type=int, default=20_000)
    ap.add_argument("--reps", type=int, default=5)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "many.safetensors"
        save_file({f"blk.{i}.w": torch.randn(64) for i in range(a.tensors)}, str(path))
        model = empty_model({f"blk.{i}.w": (64,) for i in range(a.tensors)}, torch.float32)
        print(f"{a.tensors} tensors of 256 bytes, median of {a.reps}")
        asyncio.run(run(path, model, a.tensors, a.reps))


if __name__ == "__main__":
    main()
