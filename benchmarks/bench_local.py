"""Local-disk load benchmark: aload against safetensors' load_file and the safe_open loop
(vLLM's default iterator), each in a fresh process, alternating order, warm and cold page cache.

    python benchmarks/bench_local.py [--size-gib 4] [--reps 5] [--json benchmarks/out/local.json]

Every loader delivers every tensor into a preallocated (already touched) model, as an engine
would. Blocking loaders run in ``asyncio.to_thread`` so the event-loop lateness is comparable.
Reported per run: seconds, GB/s, time to first tensor, peak anonymous RSS over the baseline
(RssAnon sampled every 2 ms), event-loop lateness p50/p99 (1 ms ticker), CPU seconds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
#: aload: the built-in loader (reads straight into parameters); aload_lw: a vLLM-style
#: model.load_weights that copy_()s each tensor, so bytes go through aload's budgeted buffers.
LOADERS = ("aload", "aload_lw", "load_file", "safe_open")


def rss(field: str = "RssAnon") -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def make_checkpoint(folder: Path, size_gib: float) -> None:
    """Llama-3-8B-shaped layers in bf16 (big matrices and small norms), ~2 GiB shards."""
    from examples.demo import llama_shapes, write_checkpoint

    if (folder / "model.safetensors.index.json").exists():
        return
    folder.mkdir(parents=True, exist_ok=True)
    hidden, inter, vocab = 4096, 14336, 32000
    per_layer = 2 * (2 * hidden * hidden + 2 * hidden * hidden // 4 + 3 * inter * hidden)
    layers = max(1, int((size_gib * 2**30 - 4 * vocab * hidden) // per_layer))
    shapes = llama_shapes(hidden, inter, vocab, layers)
    write_checkpoint(folder, shapes, shards=max(1, round(size_gib / 2)))


def shards(folder: Path) -> list[Path]:
    return sorted(folder.glob("*.safetensors"))


def drop_cache(folder: Path) -> None:
    for p in shards(folder):
        fd = os.open(p, os.O_RDONLY)
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)


# -- one run, in its own process ---------------------------------------------------------------


def run_one(loader: str, folder: Path) -> dict[str, Any]:
    import torch

    from examples.demo import empty_model

    idx = json.loads((folder / "model.safetensors.index.json").read_text())
    from safetensors import safe_open

    shapes = {}
    for p in shards(folder):
        with safe_open(str(p), "pt") as f:
            for k in f.keys():
                shapes[k] = tuple(f.get_slice(k).get_shape())
    assert set(shapes) == set(idx["weight_map"])
    model = empty_model(shapes, torch.bfloat16)  # zeros: pages touched before timing
    params = dict(model.named_parameters())
    total = sum(p.nbytes for p in params.values())
    base, base_rss = rss(), rss("VmRSS")
    peak, peak_rss = [base], [base_rss]
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], rss())
            peak_rss[0] = max(peak_rss[0], rss("VmRSS"))
            time.sleep(0.002)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    first: list[float] = []

    def copy_in(name: str, t: Any) -> None:
        params[name].data.copy_(t)
        if not first:
            first.append(time.perf_counter())

    def blocking_load_file() -> None:
        from safetensors.torch import load_file

        for p in shards(folder):
            for k, t in load_file(str(p)).items():
                copy_in(k, t)

    def blocking_safe_open() -> None:
        for p in shards(folder):
            with safe_open(str(p), "pt") as f:
                for k in f.keys():
                    copy_in(k, f.get_tensor(k))

    async def main() -> dict[str, Any]:
        import aload

        lags: list[float] = []

        async def ticker() -> None:
            while True:
                t = time.perf_counter()
                await asyncio.sleep(0.001)
                lags.append(time.perf_counter() - t - 0.001)

        tick = asyncio.ensure_future(ticker())
        await asyncio.sleep(0.01)
        cpu0, t0 = time.process_time(), time.perf_counter()
        ttft = None
        if loader == "aload":
            report = await aload.load(model, folder)
            ttft = report.ttft_s
        elif loader == "aload_lw":

            class Engine(torch.nn.Module):
                def load_weights(self, weights: Any) -> set[str]:
                    for name, t in weights:
                        copy_in(name, t)
                    return set()

            report = await aload.load(Engine(), folder)
            ttft = report.ttft_s
        elif loader == "load_file":
            await asyncio.to_thread(blocking_load_file)
        else:
            await asyncio.to_thread(blocking_safe_open)
        seconds = time.perf_counter() - t0
        cpu = time.process_time() - cpu0
        tick.cancel()
        if ttft is None:
            ttft = first[0] - t0 if first else None
        lags.sort()
        return {
            "seconds": seconds,
            "ttft_s": ttft,
            "cpu_s": cpu,
            "loop_lag_p50_ms": lags[len(lags) // 2] * 1e3 if lags else None,
            "loop_lag_p99_ms": lags[min(len(lags) - 1, int(len(lags) * 0.99))] * 1e3 if lags else None,
        }

    row = asyncio.run(main())
    stop.set()
    sampler.join()
    # spot check: the model holds the checkpoint's bytes
    from safetensors import safe_open as so

    with so(str(shards(folder)[-1]), "pt") as f:
        k = list(f.keys())[-1]
        assert torch.equal(params[k], f.get_tensor(k)), k
    return {
        "loader": loader,
        "bytes": total,
        "gbps": total / row["seconds"] / 1e9,
        "peak_anon_delta_bytes": peak[0] - base,
        "peak_rss_delta_bytes": peak_rss[0] - base_rss,
        **row,
    }


# -- the driver -------------------------------------------------------------------------------


def dd_gbps(folder: Path) -> float:
    t0 = time.perf_counter()
    for p in shards(folder):
        subprocess.run(["dd", f"if={p}", "of=/dev/null", "bs=16M"], check=True, capture_output=True)
    return sum(p.stat().st_size for p in shards(folder)) / (time.perf_counter() - t0) / 1e9


def fmt(values: list[float], unit: str = "", scale: float = 1.0, digits: int = 2) -> str:
    vals = [v * scale for v in values if v is not None]
    if not vals:
        return "-"
    return f"{statistics.median(vals):.{digits}f}{unit} ({min(vals):.{digits}f}-{max(vals):.{digits}f})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-gib", type=float, default=4.0)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--dir", type=Path, default=HERE / "out")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--scenarios", default="warm,cold")
    ap.add_argument("--run", help=argparse.SUPPRESS)
    ap.add_argument("--ckpt", type=Path, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.run:
        print(json.dumps(run_one(a.run, a.ckpt)))
        return
    folder = a.dir / f"ckpt-{a.size_gib:g}g"
    make_checkpoint(folder, a.size_gib)
    size = sum(p.stat().st_size for p in shards(folder))
    print(f"checkpoint: {folder} ({size / 2**30:.2f} GiB, {len(shards(folder))} shards)", flush=True)
    dd_gbps(folder)
    dd = statistics.median(dd_gbps(folder) for _ in range(3))
    print(f"dd of the same files, warm: {dd:.2f} GB/s", flush=True)
    rows: list[dict[str, Any]] = []
    for scenario in a.scenarios.split(","):
        for rep in range(a.reps):
            order = LOADERS if rep % 2 == 0 else LOADERS[::-1]
            for loader in order:
                if scenario == "cold":
                    drop_cache(folder)
                else:
                    dd_gbps(folder)  # warm the cache
                out = subprocess.run(
                    [sys.executable, __file__, "--run", loader, "--ckpt", str(folder)],
                    capture_output=True,
                    text=True,
                    check=True,
                )
                row = json.loads(out.stdout.strip().splitlines()[-1])
                row.update(scenario=scenario, source="file", rep=rep)
                rows.append(row)
                print(f"  {scenario} rep {rep} {loader:>10}: {row['gbps']:.2f} GB/s", flush=True)
    print()
    print(
        "| scenario | loader | GB/s | seconds | ttft ms | peak anon delta MiB | peak RSS delta MiB "
        "| loop lag p50 ms | loop lag p99 ms | cpu s |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    best: dict[str, dict[str, float]] = {}
    for scenario in a.scenarios.split(","):
        for loader in LOADERS:
            rs = [r for r in rows if r["scenario"] == scenario and r["loader"] == loader]
            best.setdefault(scenario, {})[loader] = statistics.median(r["gbps"] for r in rs)
            print(
                f"| {scenario} | {loader} | {fmt([r['gbps'] for r in rs])} | {fmt([r['seconds'] for r in rs])} | "
                f"{fmt([r['ttft_s'] for r in rs], scale=1e3, digits=1)} | "
                f"{fmt([r['peak_anon_delta_bytes'] for r in rs], scale=2**-20, digits=0)} | "
                f"{fmt([r['peak_rss_delta_bytes'] for r in rs], scale=2**-20, digits=0)} | "
                f"{fmt([r['loop_lag_p50_ms'] for r in rs])} | {fmt([r['loop_lag_p99_ms'] for r in rs])} | "
                f"{fmt([r['cpu_s'] for r in rs])} |"
            )
    print()
    for scenario, by in best.items():
        peer = max(v for k, v in by.items() if not k.startswith("aload"))
        print(
            f"{scenario}: aload / fastest peer = {by['aload'] / peer:.2f}x"
            + (f"; aload / dd = {by['aload'] / dd:.2f}x" if scenario == "warm" else "")
        )
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
        print(f"rows: {a.json}")


if __name__ == "__main__":
    main()
