"""Command line: ``aload inspect PATH`` and ``aload load PATH``."""

from __future__ import annotations

import argparse
import asyncio
import builtins
import importlib
import json
import os
import sys
import time
from collections import Counter
from dataclasses import asdict
from typing import Any, TextIO

from . import __version__
from . import open as open_checkpoint
from .errors import AloadError, UsageError
from .load import load
from .read import DEFAULT_CONCURRENCY, DEFAULT_MAX_INFLIGHT_BYTES, Progress
from .sources.local import READ_MODES, is_local
from .stream import stream


class ProgressBar:
    """A one-line progress bar on stderr, redrawn at most ten times a second."""

    def __init__(self, out: TextIO = sys.stderr, width: int = 30) -> None:
        self.out, self.width, self._last = out, width, 0.0

    @classmethod
    def if_terminal(cls, quiet: bool = False) -> ProgressBar | None:
        """A bar where stderr is a terminal and not ``quiet``; else None."""
        return None if quiet or not sys.stderr.isatty() else cls()

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
    async with open_checkpoint(args.path) as ckpt:
        dtypes = Counter(s.dtype for s in ckpt.specs.values())
        info: dict[str, Any] = {
            "url": ckpt.url,
            "shards": [{"name": s.name or s.url, "bytes": s.size, "tensors": len(s.specs)} for s in ckpt.shards],
            "tensors": len(ckpt.specs),
            "bytes": ckpt.total_bytes,
            "dtypes": dict(sorted(dtypes.items())),
            "metadata": ckpt.metadata,
        }
        if args.tensors:
            info["tensor_list"] = [
                {"name": t.name, "dtype": t.dtype, "shape": list(t.shape), "shard": t.shard} for t in ckpt.specs.values()
            ]
    if args.json:
        print(json.dumps(info, indent=2, ensure_ascii=False))
        return 0
    print(f"{info['url']}: {info['tensors']} tensors, {ckpt.total_bytes / 1e9:.3f} GB in {len(ckpt.shards)} shard(s)")
    for s in info["shards"]:
        print(f"  {s['name']}: {s['tensors']} tensors, {s['bytes'] / 1e9:.3f} GB")
    print("  dtypes: " + ", ".join(f"{k} x{v}" for k, v in info["dtypes"].items()))
    for k, v in ckpt.metadata.items():
        print(f"  metadata {k}: {v}")
    for t in info.get("tensor_list", []):
        print(f"  {t['name']}  {t['dtype']}{t['shape']}  {os.path.basename(t['shard'])}")
    return 0


def _factory(spec: str) -> Any:
    module, _, attr = spec.partition(":")
    if not attr:
        raise UsageError(f"--model takes module:callable, got {spec!r}")
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # as `python -m` does: the current folder's modules
    try:
        return getattr(importlib.import_module(module), attr)()
    except (ImportError, AttributeError) as exc:
        raise UsageError(f"--model {spec}: {exc}") from None


async def _load(args: argparse.Namespace) -> int:
    bar = ProgressBar.if_terminal(args.quiet)
    opts: dict[str, Any] = dict(
        max_inflight_bytes=args.budget, concurrency=args.concurrency, chunk_bytes=args.chunk_bytes, progress=bar
    )
    if args.verify:
        opts["verify"] = args.verify
    if args.read:
        opts["read"] = args.read
    if args.model:
        report = await load(_factory(args.model), args.path, strict=not args.non_strict, **opts)
        row: dict[str, Any] = asdict(report)
        if not args.json:
            print(report.summary())
            for label, names in (("missing", report.missing), ("unexpected", report.unexpected)):
                for name in names:
                    print(f"  {label}: {name}")
            return 0
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
        print(
            f"{row['tensors']} tensors, {row['bytes'] / 1e9:.3f} GB streamed in {row['seconds']:.3f} s "
            f"({row['gbps']:.2f} GB/s); peak in flight {row['peak_inflight_bytes'] / 2**20:.1f} MiB"
        )
    return 0


builtins_open = builtins.open  # `open` here is aload.open


_UNITS = {"k": 2**10, "m": 2**20, "g": 2**30}


def _size(text: str) -> int:
    """ "512m", "1g", "64k" (KiB, MiB, GiB) or plain bytes -> bytes."""
    t = text.strip().lower()
    try:
        n = int(float(t[:-1]) * _UNITS[t[-1]]) if t and t[-1] in _UNITS else int(t)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (bytes, or a number ending in k, m or g)") from None
    if n <= 0:
        raise argparse.ArgumentTypeError(f"not a positive size: {text!r}")
    return n


def _sizes(text: str) -> list[int]:
    """ "128m,1048576" -> bytes."""
    return [_size(x) for x in text.split(",")]


def _count(text: str) -> int:
    """ "3" -> 3, a positive whole number."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if n <= 0:
        raise argparse.ArgumentTypeError(f"not positive: {text!r}")
    return n


def _counts(text: str) -> list[int]:
    """ "1,2,4" -> [1, 2, 4]."""
    return [_count(x) for x in text.split(",")]


def _setting(row: dict[str, Any]) -> str:
    """A sweep row's setting, as options the command line reads back."""
    return (
        f"--budget {_human(row['max_inflight_bytes'])} --concurrency {row['concurrency']} "
        f"--chunk-bytes {_human(row['chunk_bytes'])}"
    )


def _human(n: int) -> str:
    """The shortest exact spelling ``_size`` reads back: 536870912 -> "512m"."""
    for suffix, unit in (("g", 2**30), ("m", 2**20), ("k", 2**10)):
        if n % unit == 0:
            return f"{n // unit}{suffix}"
    return str(n)


async def _bench(args: argparse.Namespace) -> int:
    from .bench import bench_stream, describe, sweep, uneven_cache, within_noise

    if args.cold and not is_local(args.path):
        raise UsageError("--cold drops a local checkpoint from the page cache; this one is remote", url=args.path)
    options: dict[str, Any] = {"read": args.read} if args.read else {}
    options["cold"] = args.cold
    if args.verify:
        options["verify"] = args.verify
    if args.sweep:

        def report(i: int, n: int, r: dict[str, Any]) -> None:  # as each setting finishes
            print(
                f"[{i}/{n}] budget {_human(r['max_inflight_bytes'])}, concurrency {r['concurrency']}, "
                f"chunk {_human(r['chunk_bytes'])}: {describe(r)}",
                flush=True,
            )

        if not args.quiet:
            print("one untimed run of the first setting, then each setting in turn", file=sys.stderr)
        rows = await sweep(
            args.path,
            budgets=args.budget_sweep,
            concurrencies=args.concurrency_sweep,
            chunks=args.chunk_sweep,
            rounds=args.repeat,
            report=report,
            progress=None if ProgressBar.if_terminal(args.quiet) is None else ProgressBar,
            **options,
        )
        if args.repeat > 1:
            print(f"medians of {args.repeat} rounds, best first:")
            for r in rows:
                runs = r["gbps_runs"]
                print(
                    f"  budget {_human(r['max_inflight_bytes'])}, concurrency {r['concurrency']}, chunk "
                    f"{_human(r['chunk_bytes'])}: {r['gbps']:.2f} GB/s ({min(runs):.2f}-{max(runs):.2f})"
                )
        note = uneven_cache(rows)
        if note:
            print(note)
        tied = within_noise(rows)
        if len(tied) == 1:
            print(f"best here: {_setting(rows[0])} ({rows[0]['gbps']:.2f} GB/s)")
        else:
            low, high = min(r["gbps"] for r in tied), max(r["gbps"] for r in tied)
            print(
                f"no clear best: {len(tied)} settings are within noise of each other ({low:.2f}-{high:.2f} GB/s); "
                "any of them will do (--repeat 3 runs the grid in rounds to separate them):"
            )
            for r in tied:
                print(f"  {_setting(r)} ({r['gbps']:.2f} GB/s)")
    else:
        rows = []
        for i in range(args.repeat):  # repeats in one process: the later runs reuse what the first set up
            bar = ProgressBar.if_terminal(args.quiet)
            rows.append(
                await bench_stream(
                    args.path,
                    max_inflight_bytes=args.budget,
                    concurrency=args.concurrency,
                    chunk_bytes=args.chunk_bytes,
                    progress=bar,
                    **options,
                )
            )
            print(("" if args.repeat == 1 else f"run {i + 1}: ") + describe(rows[-1]))
    if args.json:
        with builtins_open(args.json, "w") as f:
            f.write("".join(json.dumps(r) + "\n" for r in rows))
    return 0


_VERIFY_HELP = (
    "check each shard's SHA-256 while streaming, against a sha256sum file, a JSON name->digest map, "
    "Hugging Face model info (?blobs=true), or Git LFS pointer(s)"
)


def _source_arguments(parser: argparse.ArgumentParser) -> None:
    """What ``load`` and ``bench`` both take: the checkpoint, how to read it, how to check it."""
    parser.add_argument("path", help="a .safetensors file or a folder: a path, file://, http(s):// or s3:// URL")
    parser.add_argument(
        "--budget",
        type=_size,
        default=DEFAULT_MAX_INFLIGHT_BYTES,
        help=f"max bytes in flight: bytes, or 512m, 1g (default {DEFAULT_MAX_INFLIGHT_BYTES >> 20}m)",
    )
    parser.add_argument(
        "--concurrency", type=int, default=DEFAULT_CONCURRENCY, help="reads in flight (default %(default)s)"
    )
    parser.add_argument(
        "--chunk-bytes",
        type=_size,
        default=None,
        help="bytes per read: bytes, or 4m, 64m (default 64m for local files, 16m for remote ones)",
    )
    parser.add_argument(
        "--read",
        choices=READ_MODES,
        help="local files: auto (default: through the page cache where at least half the file is cached, "
        "else O_DIRECT), cached, or direct",
    )
    parser.add_argument("--verify", metavar="MANIFEST", help=_VERIFY_HELP)
    parser.add_argument("-q", "--quiet", action="store_true", help="no progress bar")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="aload", description="Stream safetensors checkpoints into PyTorch.")
    parser.add_argument("--version", action="version", version=f"aload {__version__}")
    sub = parser.add_subparsers(dest="cmd", required=True)
    p_inspect = sub.add_parser("inspect", help="shards, tensors, dtypes, bytes and metadata")
    p_inspect.add_argument("path", help="a .safetensors file or a folder: a path, file://, http(s):// or s3:// URL")
    p_inspect.add_argument("--tensors", action="store_true", help="list every tensor: name, dtype, shape, shard")
    p_inspect.add_argument("--json", action="store_true", help="print JSON")
    p_load = sub.add_parser("load", help="stream the checkpoint (into --model if given) and print the report")
    _source_arguments(p_load)
    p_load.add_argument("--model", help="module:callable returning the nn.Module to load into")
    p_load.add_argument("--non-strict", action="store_true", help="report missing/unexpected names instead of failing")
    p_load.add_argument("--json", action="store_true", help="print the report as JSON")
    p_bench = sub.add_parser(
        "bench", help="measure streaming your checkpoint: throughput, first tensor, memory, loop lateness"
    )
    _source_arguments(p_bench)
    p_bench.add_argument(
        "--sweep",
        action="store_true",
        help="try the grid below (after one untimed run) and report which setting did best",
    )
    p_bench.add_argument(
        "--budget-sweep", type=_sizes, default="128m,512m", help="budgets to try (default %(default)s)"
    )
    p_bench.add_argument(
        "--concurrency-sweep", type=_counts, default="1,2,4,8", help="concurrencies to try (default %(default)s)"
    )
    p_bench.add_argument(
        "--chunk-sweep", type=_sizes, default="4m,16m,64m", help="chunk sizes to try (default %(default)s)"
    )
    p_bench.add_argument(
        "--repeat",
        type=_count,
        default=1,
        help="stream it this many times in one process; with --sweep, run the grid this many times, "
        "forward and backward in turn, and rank the settings by their medians",
    )
    p_bench.add_argument(
        "--cold",
        action="store_true",
        help="drop a local checkpoint from the page cache before each run, so that it is read from the disk "
        "(pages another process has mapped stay)",
    )
    p_bench.add_argument("--json", help="write the row(s) here, one JSON object per line")
    args = parser.parse_args(argv)
    commands = {"inspect": _inspect, "load": _load, "bench": _bench}
    try:
        return asyncio.run(commands[args.cmd](args))
    except AloadError as exc:
        print(f"aload: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("aload: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `aload inspect ... | head`: the reader went away
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
