"""Command line: ``aload inspect PATH`` and ``aload load PATH``."""

from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import sys
import time
from collections import Counter
from dataclasses import asdict
from typing import Any, TextIO

from .checkpoint import DEFAULT_CONCURRENCY, open
from .errors import AloadError
from .loader import load
from .pipeline import stream
from .reader import DEFAULT_CHUNK_BYTES, DEFAULT_MAX_INFLIGHT_BYTES, Progress


class ProgressBar:
    """A one-line progress bar on stderr, redrawn at most ten times a second."""

    def __init__(self, out: TextIO = sys.stderr, width: int = 30) -> None:
        self.out, self.width, self._last = out, width, 0.0

    def __call__(self, p: Progress) -> None:
        now = time.perf_counter()
        final = p.tensors == p.tensors_total
        if not final and now - self._last < 0.1:
            return
        self._last = now
        frac = p.bytes / p.bytes_total if p.bytes_total else 1.0
        rate = p.bytes / p.elapsed_s / 1e9 if p.elapsed_s > 0 else 0.0
        eta = f"{(p.bytes_total - p.bytes) / (rate * 1e9):.0f}s" if rate > 0 and frac >= 0.05 else "?"
        bar = "#" * int(frac * self.width)
        self.out.write(
            f"\r[{bar:<{self.width}}] {frac:6.1%} {p.bytes / 1e9:.2f}/{p.bytes_total / 1e9:.2f} GB "
            f"{p.tensors}/{p.tensors_total} tensors {rate:.2f} GB/s ETA {eta}"
        )
        if final:
            self.out.write("\n")
        self.out.flush()


async def _inspect(args: argparse.Namespace) -> int:
    async with open(args.path) as ckpt:
        dtypes = Counter(s.dtype for s in ckpt.specs.values())
        info: dict[str, Any] = {
            "url": ckpt.url,
            "shards": [{"name": s.name or s.url, "bytes": s.size, "tensors": len(s.specs)} for s in ckpt.shards],
            "tensors": len(ckpt.specs),
            "bytes": ckpt.total_bytes,
            "dtypes": dict(sorted(dtypes.items())),
            "metadata": ckpt.metadata,
        }
    if args.json:
        print(json.dumps(info, indent=2, ensure_ascii=False))
        return 0
    print(f"{info['url']}: {info['tensors']} tensors, {ckpt.total_bytes / 1e9:.3f} GB in {len(ckpt.shards)} shard(s)")
    for s in info["shards"]:
        print(f"  {s['name']}: {s['tensors']} tensors, {s['bytes'] / 1e9:.3f} GB")
    print("  dtypes: " + ", ".join(f"{k} x{v}" for k, v in info["dtypes"].items()))
    for k, v in ckpt.metadata.items():
        print(f"  metadata {k}: {v}")
    return 0


def _factory(spec: str) -> Any:
    module, _, attr = spec.partition(":")
    if not attr:
        raise AloadError(f"--model takes module:callable, got {spec!r}")
    return getattr(importlib.import_module(module), attr)()


async def _load(args: argparse.Namespace) -> int:
    bar = None if args.quiet else ProgressBar()
    opts: dict[str, Any] = dict(
        max_inflight_bytes=args.budget, concurrency=args.concurrency, chunk_bytes=args.chunk_bytes, progress=bar
    )
    if args.model:
        report = await load(_factory(args.model), args.path, strict=not args.non_strict, **opts)
        row: dict[str, Any] = asdict(report)
    else:  # no model: stream every tensor and drop it, measuring the pipeline alone
        t0 = time.perf_counter()
        async with stream(args.path, **opts) as s:
            async for _ in s:
                pass
            st = s.stats
        seconds = time.perf_counter() - t0
        row = {**asdict(st), "seconds": seconds, "gbps": st.bytes / seconds / 1e9 if seconds else 0.0}
    if args.json:
        print(json.dumps(row, indent=2))
    else:
        for key in (
            "tensors",
            "bytes",
            "bytes_read",
            "seconds",
            "gbps",
            "ttft_s",
            "peak_inflight_bytes",
            "budget_wait_s",
        ):
            print(f"{key:>20}: {row.get(key)}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="aload", description="Stream safetensors checkpoints into PyTorch.")
    sub = parser.add_subparsers(dest="cmd", required=True)
    p_inspect = sub.add_parser("inspect", help="shards, tensors, dtypes, bytes and metadata")
    p_inspect.add_argument("path")
    p_inspect.add_argument("--json", action="store_true")
    p_load = sub.add_parser("load", help="stream the checkpoint (into --model if given) and print the report")
    p_load.add_argument("path")
    p_load.add_argument("--model", help="module:callable returning the nn.Module to load into")
    p_load.add_argument("--non-strict", action="store_true", help="report missing/unexpected names instead of failing")
    p_load.add_argument("--budget", type=int, default=DEFAULT_MAX_INFLIGHT_BYTES, help="max bytes in flight")
    p_load.add_argument("--concurrency", type=int, default=DEFAULT_CONCURRENCY)
    p_load.add_argument("--chunk-bytes", type=int, default=DEFAULT_CHUNK_BYTES)
    p_load.add_argument("--json", action="store_true")
    p_load.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    try:
        return asyncio.run(_inspect(args) if args.cmd == "inspect" else _load(args))
    except AloadError as exc:
        print(f"aload: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
