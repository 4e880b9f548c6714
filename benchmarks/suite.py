"""The benchmark suite: aload against the loaders people use today, on the same checkpoints.

    python benchmarks/suite.py [--sizes 1,4,8] [--many] [--small] [--scenarios warm,cold,partial]
                               [--reps 5] [--loaders all] [--out benchmarks/out] [--ckpt-dir DIR]
                               [--remote GIB] [--page-cache fresh|as-is]

Generates Llama-shaped bf16 checkpoints (big matrices and small norms, ~2 GiB shards) and, with
--many, one of 20,000 small tensors; runs every loader on the same checkpoint in a fresh process
each, alternating the order between repetitions; writes JSON rows, a markdown table (median and
min-max) and PNG plots (throughput per scenario; memory over time for one load of each loader).

Every loader delivers every tensor into a preallocated, already touched model (a ``copy_``, as
``load_weights`` does), so lazy loaders are not credited for bytes never touched. Blocking loaders
run in ``asyncio.to_thread`` inside an asyncio app, as a serving frontend would have to, so the
event-loop lateness is comparable. Warm = every shard read with ``dd`` before each run; before a
checkpoint's warm runs it is dropped from the page cache and read once in order (``--page-cache
fresh``, the default), since how the page cache holds it (2 MiB pages or 4 KiB ones) sets the pace
of every loader that copies out of a mapping, and the report gives that share (``huge_share``).
Cold = fsync + POSIX_FADV_DONTNEED on every shard before a run;
partial = warm, then the first 10% of each shard dropped from the page cache (``--scenarios
warm,cold,partial``), as on a host where other work evicted part of the checkpoint. ``--remote
GIB`` also runs ``benchmarks/remote.py`` (HTTP and S3 over loopback, nginx as the origin; it
needs nginx) on a checkpoint of that size, as many repetitions, and adds its table to the report.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

#: name -> what it stands for. runai_best uses the concurrency the driver found best (--runai-sweep).
LOADERS = {
    "aload": "aload.load, built-in loader (reads straight into the parameters)",
    "aload_lw": "aload.load into a vLLM-style model.load_weights that copy_()s each tensor",
    "load_file": "safetensors.torch.load_file per shard",
    "safe_open": "safe_open + get_tensor loop (vLLM's default iterator)",
    "threadpool": "load_file over shards in a pool of 4 threads, all shards submitted (vLLM's multi-thread iterator)",
    "sglang_window": "load_file in a pool of 4 with a FIFO window of max_workers + 1 shard futures (sglang)",
    "runai": "Run:ai Model Streamer, its defaults",
    "runai_best": "Run:ai Model Streamer at the concurrency that did best here",
    "fastsafetensors": "fastsafetensors on the CPU (nogds); with --device cuda, onto the GPU (nogds: through its pinned buffers)",
    "load_file_gpu": "safetensors.torch.load_file(shard, device=...) per shard, then copy_ on the GPU (--device cuda only)",
}


# -- checkpoints --------------------------------------------------------------------------------


def make_llama(folder: Path, size_gib: float) -> Path:
    """Llama-3-8B-shaped layers, bf16, ~2 GiB shards (written once, reused)."""
    from examples.demo import llama_shapes, write_checkpoint

    if not (folder / "model.safetensors.index.json").exists():
        folder.mkdir(parents=True, exist_ok=True)
        hidden, inter, vocab = 4096, 14336, 32000
        per_layer = 2 * (2 * hidden * hidden + 2 * hidden * hidden // 4 + 3 * inter * hidden)
        layers = max(1, int((size_gib * 2**30 - 4 * vocab * hidden) // per_layer))
        write_checkpoint(folder, llama_shapes(hidden, inter, vocab, layers), shards=max(1, round(size_gib / 2)))
    return folder


def make_small(folder: Path) -> Path:
    """A Qwen2.5-0.5B-shaped bf16 checkpoint (24 layers, hidden 896, tied embeddings): 1 GB in 217
    tensors, a 272 MB embedding first and 8.7 MB MLP matrices; one shard."""
    from examples.demo import llama_shapes, write_checkpoint

    if not (folder / "model.safetensors.index.json").exists():
        folder.mkdir(parents=True, exist_ok=True)
        shapes = llama_shapes(896, 4864, 151936, 24)
        del shapes["lm_head.weight"]  # tied to the embedding
        write_checkpoint(folder, shapes, shards=1)
    return folder


def make_many(folder: Path, n: int = 20_000) -> Path:
    """n small tensors (a norm-sized 4 KiB each), for per-tensor overhead."""
    import torch
    from safetensors.torch import save_file

    if not (folder / "model.safetensors").exists():
        folder.mkdir(parents=True, exist_ok=True)
        g = torch.Generator().manual_seed(0)
        save_file(
            {
                f"model.layers.{i // 10}.t{i % 10}.weight": torch.randn(2048, generator=g).to(torch.bfloat16)
                for i in range(n)
            },
            str(folder / "model.safetensors"),
        )
    return folder


def make_many_shards(folder: Path, n_shards: int = 64, per_shard: int = 300) -> Path:
    """``n_shards`` shards with an index, ``per_shard`` tensors of 32 KiB each (19,200 tensors,
    0.63 GB by default): what opening and reading many shards costs, and where the loop waits."""
    import json

    import torch
    from safetensors.torch import save_file

    if not (folder / "model.safetensors.index.json").exists():
        folder.mkdir(parents=True, exist_ok=True)
        g = torch.Generator().manual_seed(0)
        weight_map: dict[str, str] = {}
        for s in range(n_shards):
            name = f"model-{s + 1:05d}-of-{n_shards:05d}.safetensors"
            part = {
                f"model.layers.{s}.w{i}": torch.randn(64, 256, generator=g).to(torch.bfloat16) for i in range(per_shard)
            }
            save_file(part, str(folder / name), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(part, name))
        (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return folder


def moe_names() -> list[str]:
    """DeepSeek-V3's tensor names (61 layers, 256 routed experts from layer 3, FP8 block scales):
    89,820 of them."""
    names = []
    for layer in range(61):
        pre = f"model.layers.{layer}."
        for e in range(256 if layer >= 3 else 0):
            for proj in ("gate_proj", "up_proj", "down_proj"):
                names += [f"{pre}mlp.experts.{e}.{proj}.weight", f"{pre}mlp.experts.{e}.{proj}.weight_scale_inv"]
        for proj in ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"):
            names += [f"{pre}self_attn.{proj}.weight", f"{pre}self_attn.{proj}.weight_scale_inv"]
        names += [f"{pre}input_layernorm.weight", f"{pre}post_attention_layernorm.weight"]
    return names


def make_moe(folder: Path, n_shards: int = 163) -> Path:
    """DeepSeek-V3's layout at a tiny scale: its 89,820 tensor names in 163 shards with an
    indented index (8.7 MB), each tensor 8 x 16 bf16 (23 MB in all). What a MoE checkpoint's
    metadata costs: the index, 163 headers, the plan and the walk, per tensor."""
    import json

    import torch
    from safetensors.torch import save_file

    if not (folder / "model.safetensors.index.json").exists():
        folder.mkdir(parents=True, exist_ok=True)
        names = moe_names()
        per = -(-len(names) // n_shards)
        g = torch.Generator().manual_seed(0)
        weight_map: dict[str, str] = {}
        for s in range(n_shards):
            part = names[s * per : (s + 1) * per]
            fname = f"model-{s + 1:05d}-of-{n_shards:06d}.safetensors"
            save_file(
                {n: torch.randn(8, 16, generator=g).to(torch.bfloat16) for n in part},
                str(folder / fname),
                metadata={"format": "pt"},
            )
            weight_map.update(dict.fromkeys(part, fname))
        index = {"metadata": {"total_size": 2 * 8 * 16 * len(names)}, "weight_map": weight_map}
        (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return folder


def shards(folder: Path) -> list[Path]:
    return sorted(folder.glob("*.safetensors"))


def drop_cache(folder: Path) -> None:
    from aload.sources.local import evict  # as ``aload bench --cold`` does

    evict(str(folder))


#: "partial": warm, then this share of each shard dropped from the page cache, from its start (a
#: file read in order loses its oldest pages first), as on a host where other work evicted some.
PARTIAL_EVICT = 0.1


def evict_head(folder: Path, share: float = PARTIAL_EVICT) -> None:
    for p in shards(folder):
        fd = os.open(p, os.O_RDONLY)
        os.posix_fadvise(fd, 0, int(os.fstat(fd).st_size * share), os.POSIX_FADV_DONTNEED)
        os.close(fd)


def huge_share(folder: Path) -> float | None:
    """The share of the checkpoint's bytes that the kernel maps in 2 MiB pages (``FilePmdMapped``
    in ``/proc/self/smaps``) from a private mapping of each shard touched once per 2 MiB: the page
    cache's large folios. Call it with the checkpoint all in the page cache (a touch reads what
    is not). None where the kernel does not say.

    It sets the pace of every loader that copies out of a mapping (``safe_open``, ``load_file``,
    aload through ``load_weights``): a fault and a page-table entry per 2 MiB instead of per
    4 KiB (or per 64 KiB of fault-around), and as few to drop after. A file written or read in order (``dd``, ``cat``, a mapping's
    faults) comes into the page cache in 2 MiB folios where memory allows; ``POSIX_FADV_WILLNEED``
    brings pages in 4 KiB ones."""
    import mmap

    import numpy as np

    HUGE = 2 << 20  # a huge page

    mapped = total = 0
    for p in shards(folder):
        size = p.stat().st_size
        fd = os.open(p, os.O_RDONLY)
        try:
            m = mmap.mmap(fd, size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        try:
            arr = np.frombuffer(m, dtype=np.uint8)
            addr = arr.ctypes.data
            int(arr[::HUGE].max())  # a touch maps the whole folio it falls in
            pmd = smaps_field(addr, "FilePmdMapped")
            del arr
        finally:
            m.close()
        if pmd is None:
            return None
        mapped += pmd
        total += size
    return mapped / total if total else None


def smaps_field(addr: int, field: str) -> int | None:
    """``field`` (bytes) of this process's mapping that holds ``addr``, from ``/proc/self/smaps``."""
    inside = False
    try:
        with open("/proc/self/smaps") as f:
            for line in f:
                head = line.split(None, 1)[0]
                if not head.endswith(":"):
                    lo, _, hi = head.partition("-")
                    inside = int(lo, 16) <= addr < int(hi, 16)
                elif inside and head == field + ":":
                    return int(line.split()[1]) << 10
    except OSError:
        return None
    return None


def fresh_cache(folder: Path) -> None:
    """The checkpoint dropped from the page cache and read once in order (``dd``): the page cache
    as a sequential read leaves it, whatever earlier loads (and which loader made them) left."""
    drop_cache(folder)
    warm_cache(folder)


def preallocated_model(folder: Path, device: str = "cpu") -> tuple[Any, dict[str, Any]]:
    """A bf16 module tree with a parameter per checkpoint tensor on ``device``, every page touched
    (as an engine allocates its model before loading), and its parameters by name."""
    import torch
    from safetensors import safe_open

    from examples.demo import empty_model

    shapes: dict[str, tuple[int, ...]] = {}
    for f in shards(folder):
        with safe_open(str(f), "pt") as st:
            for k in st.keys():
                shapes[k] = tuple(st.get_slice(k).get_shape())
    model = empty_model(shapes, torch.bfloat16, device)  # zeros: every page touched before timing
    return model, dict(model.named_parameters())


def cache_bytecode() -> None:
    """aload's modules compiled to their ``__pycache__`` now, as ``pip install`` does for an
    installed package: with ``PYTHONDONTWRITEBYTECODE=1`` (set on this machine) a source tree's
    modules were compiled again in every process, and those imported during a load (the S3 and
    HTTP clients' modules, ~20 ms of ``compile`` for ``s3``, ``wire`` and ``http``) held the GIL,
    and so the event loop, 5-10 ms at a time. ``py_compile`` writes whatever that variable says."""
    import compileall

    compileall.compile_dir(str(HERE.parent / "aload"), quiet=1)


def warm_cache(folder: Path) -> float:
    """Read every shard with dd (bs=16M); returns GB/s (the `dd` ceiling when already warm)."""
    t0 = time.perf_counter()
    for p in shards(folder):
        subprocess.run(["dd", f"if={p}", "of=/dev/null", "bs=16M"], check=True, capture_output=True)
    return sum(p.stat().st_size for p in shards(folder)) / (time.perf_counter() - t0) / 1e9


# -- one run, in its own process --------------------------------------------------------------------


def set_page_cache(folder: Path, scenario: str) -> None:
    """The checkpoint's pages as ``scenario`` says: all in the page cache ("warm"), none ("cold"),
    or all but the first 10% of each shard ("partial")."""
    drop_cache(folder) if scenario == "cold" else warm_cache(folder)
    if scenario == "partial":
        evict_head(folder)


def peer_iterator(loader: str, files: list[str], runai_concurrency: int | None) -> Iterator[tuple[str, Any]]:
    """The peers, written as the engines use them."""
    from concurrent.futures import ThreadPoolExecutor, as_completed

    from safetensors import safe_open
    from safetensors.torch import load_file

    if loader == "load_file":
        for f in files:
            yield from load_file(f).items()
    elif loader == "safe_open":
        for f in files:
            with safe_open(f, "pt") as st:
                for k in st.keys():
                    yield k, st.get_tensor(k)
    elif loader == "threadpool":
        with ThreadPoolExecutor(4) as ex:
            for fut in as_completed([ex.submit(load_file, f) for f in files]):
                yield from fut.result().items()
    elif loader == "sglang_window":
        with ThreadPoolExecutor(4) as ex:
            pending = [ex.submit(load_file, f) for f in files[:5]]
            rest = iter(files[5:])
            while pending:
                sd = pending.pop(0).result()
                nxt = next(rest, None)
                if nxt is not None:
                    pending.append(ex.submit(load_file, nxt))
                yield from sd.items()
                del sd
    elif loader in ("runai", "runai_best"):
        if loader == "runai_best" and runai_concurrency:
            os.environ["RUNAI_STREAMER_CONCURRENCY"] = str(runai_concurrency)
        from runai_model_streamer import SafetensorsStreamer

        with SafetensorsStreamer() as streamer:
            streamer.stream_files(files)
            yield from streamer.get_tensors()
    elif loader == "load_file_gpu":
        for f in files:
            yield from load_file(f, device=DEVICE).items()
    elif loader == "fastsafetensors":
        import torch
        from fastsafetensors import fastsafe_open

        device = f"cuda:{torch.cuda.current_device()}" if DEVICE == "cuda" else DEVICE  # it wants an index
        with fastsafe_open(files, nogds=True, device=device) as f:
            for k in f.keys():
                yield k, f.get_tensor(k)
    else:
        raise SystemExit(f"unknown loader {loader}")


def engine_and_peer(
    params: dict[str, Any],
    loader: str,
    files: list[str],
    runai_concurrency: int | None,
    first: list[float],
    after_copy: bool = True,
) -> tuple[Any, Callable[[], None]]:
    """A vLLM-style model whose ``load_weights`` ``copy_()``s each tensor into ``params``, and the
    blocking loop that feeds ``loader``'s tensors (a peer's) in the same way. ``first`` gets the
    time of the first tensor: after its copy, or (``after_copy=False``) as it is handed over."""
    import torch

    def copy_in(name: str, t: Any) -> None:
        if not first and not after_copy:
            first.append(time.perf_counter())
        params[name].data.copy_(t)
        if not first:
            first.append(time.perf_counter())

    class Engine(torch.nn.Module):
        def load_weights(self, weights: Any) -> set[str]:
            for name, t in weights:
                copy_in(name, t)
            return set()

    def blocking() -> None:
        for name, t in peer_iterator(loader, files, runai_concurrency):
            copy_in(name, t)

    return Engine(), blocking


def run_one(loader: str, folder: Path, runai_concurrency: int | None, scenario: str = "warm") -> dict[str, Any]:
    import torch
    from safetensors import safe_open

    import aload
    from aload.bench import Probe
    from aload.sources.local import cached

    files = [str(p) for p in shards(folder)]
    model, params = preallocated_model(folder, DEVICE)
    cuda = DEVICE.startswith("cuda")
    if GC_COLLECT:
        gc.collect()
    # The page cache is set up here, after the model is allocated: warmed before, an 8 GiB
    # checkpoint's pages (read once, so first in line) were partly evicted to make room for the
    # 8 GiB model, and "warm" runs were part cold (all loaders ~7 GB/s instead of ~10).
    set_page_cache(folder, scenario)
    share = cached(str(folder))  # cachestat; None where the kernel refuses it
    first: list[float] = []
    engine, blocking = engine_and_peer(params, loader, files, runai_concurrency, first)

    async def main() -> dict[str, Any]:
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        gpu0 = torch.cuda.memory_allocated() if cuda else 0
        cpu0 = time.process_time()
        async with Probe() as probe:
            t0 = time.perf_counter()
            report = None
            if loader in ("aload", "aload_lw"):
                # The engine's parameters live in its own tree (not walked here): where they are is said.
                where = DEVICE if cuda else None
                target = model if loader == "aload" else engine
                report = await aload.load(target, folder, device=where)
            else:
                await asyncio.to_thread(blocking)
            # The first tensor in its parameter: the built-in loader's read into it, or the first
            # copy_() done, through load_weights as for the peers.
            ttft = report.ttft_s if loader == "aload" else (first[0] - t0 if first else None)
            if cuda:  # every copy complete (aload.load returns after its own stream's)
                await asyncio.to_thread(torch.cuda.synchronize)
            seconds = time.perf_counter() - t0
        trace = probe.trace[:: max(1, len(probe.trace) // 400)]
        return {
            "seconds": seconds,
            "ttft_s": ttft,
            "cpu_s": time.process_time() - cpu0,
            # GPU memory allocated beyond the model's own at the peak (a loader's staging tensors)
            "peak_gpu_delta_bytes": torch.cuda.max_memory_allocated() - gpu0 if cuda else None,
            **probe.row(),
            "mem_trace": [(round(t, 4), a, r) for t, a, r in trace],
        }

    row = asyncio.run(main())
    last = list(params)[-1]
    with safe_open(files[-1], "pt") as st:  # the model really holds the checkpoint's bytes
        k = list(st.keys())[-1]
        assert torch.equal(params[k].cpu(), st.get_tensor(k)), (loader, k, last)
    total = sum(p.nbytes for p in params.values())
    return {
        "loader": loader,
        "source": "file",
        "device": DEVICE,
        "bytes": total,
        "tensors": len(params),
        "gbps": total / row["seconds"] / 1e9,
        "cached_at_start": share,
        **row,
    }


# -- the driver -------------------------------------------------------------------------------------


#: ``sys.setswitchinterval`` in every child when set (``--switch-interval``); None: Python's default.
SWITCH_INTERVAL: float | None = None
#: ``gc.collect()`` after building the model, in every child (``--no-gc-collect``: none). Building
#: the model (and importing torch: ~165,000 objects) leaves a full collection due, 30-90 ms on the
#: host since 2026-12-02, and whichever loader allocated next paid it on the event loop: on the
#: Qwen2.5-0.5B-shaped checkpoint load_file, the thread pool, sglang's window and aload did (p99
#: lateness 80-105 ms), safe_open and Run:ai did not. The suite compares the loaders, not which
#: one set off the harness's collection; troubleshooting.md tells a server to do the same.
GC_COLLECT = True
#: Where the model's parameters live (``--device``): "cpu", or "cuda" for a model on the GPU.
DEVICE = "cpu"


def child(loader: str, folder: Path, runai_c: int | None, scenario: str = "warm") -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--run", loader, "--ckpt", str(folder), "--scenario", scenario]
    if SWITCH_INTERVAL is not None:
        cmd += ["--switch-interval", str(SWITCH_INTERVAL)]
    cmd += ["--gc-collect" if GC_COLLECT else "--no-gc-collect", "--device", DEVICE]
    if runai_c:
        cmd += ["--runai-concurrency", str(runai_c)]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"{loader} failed on {folder}:\n{out.stderr[-3000:]}")
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def fmt(values: list[Any], scale: float = 1.0, digits: int = 2) -> str:
    vals = [v * scale for v in values if v is not None]
    if not vals:
        return "-"
    return f"{statistics.median(vals):.{digits}f} ({min(vals):.{digits}f}-{max(vals):.{digits}f})"


def table(rows: list[dict[str, Any]]) -> str:
    gpu = any(r.get("peak_gpu_delta_bytes") is not None for r in rows)  # a run with --device cuda
    head = (
        "| scenario | loader | GB/s | seconds | ttft ms | peak anon MiB | peak RSS MiB | loop lag p50 ms "
        "| loop lag p99 ms | cpu s |" + (" peak GPU extra MiB |" if gpu else "") + "\n"
        "|---|---|---|---|---|---|---|---|---|---|" + ("---|" if gpu else "") + "\n"
    )
    lines = []
    for scenario in dict.fromkeys(r["scenario"] for r in rows):
        for loader in dict.fromkeys(r["loader"] for r in rows):
            rs = [r for r in rows if r["scenario"] == scenario and r["loader"] == loader]
            if not rs:
                continue
            lines.append(
                f"| {scenario} | {loader} | {fmt([r['gbps'] for r in rs])} | {fmt([r['seconds'] for r in rs])} | "
                f"{fmt([r['ttft_s'] for r in rs], 1e3, 1)} | {fmt([r['peak_anon_delta_bytes'] for r in rs], 2**-20, 0)} | "
                f"{fmt([r['peak_rss_delta_bytes'] for r in rs], 2**-20, 0)} | {fmt([r['loop_lag_p50_ms'] for r in rs])} | "
                f"{fmt([r['loop_lag_p99_ms'] for r in rs])} | {fmt([r['cpu_s'] for r in rs])} |"
                + (f" {fmt([r.get('peak_gpu_delta_bytes') for r in rs], 2**-20, 0)} |" if gpu else "")
            )
    return head + "\n".join(lines) + "\n"


def ratios(rows: list[dict[str, Any]], dd: dict[str, float], budget: int = 512 << 20) -> str:
    """The targets, as ratios in this run."""
    out = []
    for scenario in dict.fromkeys(r["scenario"] for r in rows):
        med = {
            ld: statistics.median(r["gbps"] for r in rows if r["scenario"] == scenario and r["loader"] == ld)
            for ld in dict.fromkeys(r["loader"] for r in rows if r["scenario"] == scenario)
        }
        peers = {k: v for k, v in med.items() if not k.startswith("aload")}
        if "aload" not in med or not peers:
            continue
        best = max(peers, key=peers.__getitem__)
        line = f"{scenario}: aload {med['aload']:.2f} GB/s = {med['aload'] / peers[best]:.2f}x the fastest peer ({best} {peers[best]:.2f})"
        line += _paired(rows, scenario, "aload")
        if scenario in dd:
            line += f", {med['aload'] / dd[scenario]:.2f}x dd ({dd[scenario]:.2f})"
            line += _paired(rows, scenario, "aload", over_dd=True)
        for ld, words in (("aload_lw", "through load_weights"),):
            if ld in med:
                line += f"; {words} {med[ld]:.2f} = {med[ld] / peers[best]:.2f}x"
                line += _paired(rows, scenario, ld)
        # Each path's own peak.
        anon = {
            ld: max(r["peak_anon_delta_bytes"] for r in rows if r["scenario"] == scenario and r["loader"] == ld) >> 20
            for ld in ("aload", "aload_lw")
            if ld in med
        }
        line += "; peak anon " + ", ".join(f"{ld} {mib} MiB" for ld, mib in anon.items())
        line += f" (target <= {1.25 * budget / 2**20 + 64:.0f})"
        for ld in ("aload", "aload_lw"):
            mine = [r for r in rows if r["scenario"] == scenario and r["loader"] == ld]
            if mine:
                p99 = statistics.median(r["loop_lag_p99_ms"] for r in mine)
                line += f"; {ld} loop lag p99 {p99:.1f} ms (target <= 10)"
                if mine[0]["tensors"] >= 10_000:
                    per = statistics.median(r["seconds"] / r["tensors"] for r in mine) * 1e6
                    line += f", {per:.1f} us per tensor (target <= 25)"
        out.append(line)
    return "\n".join(out) + "\n"


def _paired(rows: list[dict[str, Any]], scenario: str, loader: str, over_dd: bool = False) -> str:
    """``loader``'s GB/s over the fastest peer's of the same repetition (the loaders of one
    repetition run back to back), or over that repetition's ``dd``, as " [per repetition median
    (min-max)]"; "" with fewer than 2 repetitions. The host's speed drifts within a run (8 GiB warm: the six fastest
    loaders 6.0-7.5 GB/s in one repetition, 4.9-6.1 in the next), and the fastest of seven peers'
    medians is the highest of seven noisy figures."""
    by_rep: dict[int, dict[str, float]] = {}
    dd_by_rep: dict[int, float] = {}
    for r in rows:
        if r["scenario"] == scenario:
            by_rep.setdefault(r.get("rep", 0), {})[r["loader"]] = r["gbps"]
            if r.get("dd_gbps"):
                dd_by_rep[r.get("rep", 0)] = r["dd_gbps"]
    got = []
    for rep, gbps in by_rep.items():
        peers = [v for k, v in gbps.items() if not k.startswith("aload")]
        over = dd_by_rep.get(rep) if over_dd else max(peers, default=None)
        if loader in gbps and over:
            got.append(gbps[loader] / over)
    if len(got) < 2:
        return ""
    return f" [per repetition {statistics.median(got):.2f}x ({min(got):.2f}-{max(got):.2f})]"


def plots(rows: list[dict[str, Any]], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    made = []
    scenarios = list(dict.fromkeys(r["scenario"] for r in rows))
    loaders = list(dict.fromkeys(r["loader"] for r in rows))
    # Small multiples: a panel per scenario (a row per cache state, a column per checkpoint), each
    # on its own scale, so the small-tensor checkpoints are as readable as the 8 GiB one.
    kinds = list(dict.fromkeys(sc.split(" ", 1)[0] for sc in scenarios))
    ckpts = list(dict.fromkeys(sc.split(" ", 1)[-1] for sc in scenarios))
    colors = {ld: plt.get_cmap("tab10")(i % 10) for i, ld in enumerate(loaders)}
    fig, axes = plt.subplots(
        len(kinds), len(ckpts), figsize=(2.9 * len(ckpts) + 1.2, 0.25 * len(loaders) * len(kinds) + 1.6), squeeze=False
    )
    for row, kind in enumerate(kinds):
        for col, ck in enumerate(ckpts):
            ax, sc = axes[row][col], f"{kind} {ck}"
            top = 0.0
            for i, ld in enumerate(loaders):
                v = [r["gbps"] for r in rows if r["scenario"] == sc and r["loader"] == ld]
                if not v:
                    continue
                m = statistics.median(v)
                top = max(top, max(v))
                ax.barh(i, m, xerr=[[m - min(v)], [max(v) - m]], color=colors[ld], capsize=2, height=0.75)
                ax.text(max(v), i, f" {m:.2f}" if m >= 0.1 else f" {m:.3f}", va="center", fontsize=7)
            ax.set_xlim(0, top * 1.45 or 1)
            if not top:  # a scenario run for another checkpoint only
                ax.text(0.5, 0.5, "not run", transform=ax.transAxes, ha="center", va="center", fontsize=9, color="gray")
            ax.set_yticks(range(len(loaders)), loaders if col == 0 else [], fontsize=8)
            ax.invert_yaxis()
            ax.set_title(sc, fontsize=9)
            ax.tick_params(axis="x", labelsize=7)
            if row == len(kinds) - 1:
                ax.set_xlabel("GB/s", fontsize=8)
    where = "GPU" if rows[0].get("device", "cpu") != "cpu" else "CPU"
    fig.suptitle(f"Load throughput into a preallocated {where} model\n(median, min-max; each panel its own scale)")
    fig.tight_layout()
    made.append(out / "throughput.png")
    fig.savefig(made[-1], dpi=100)
    plt.close(fig)

    sized = [sc for sc in scenarios if sc.startswith("warm") and sc.endswith("GiB")]
    pick = max(sized, key=lambda sc: float(sc.split()[1][:-3])) if sized else scenarios[0]  # the largest
    traces = {}
    for ld in loaders:
        r = next((r for r in rows if r["scenario"] == pick and r["loader"] == ld), None)
        if r and r.get("mem_trace"):
            traces[ld] = ([t for t, _, _ in r["mem_trace"]], [rss / 2**20 for _, _, rss in r["mem_trace"]])
    # Two panels: every loader over its whole load, and the fast ones (done within twice aload's
    # time) on their own time scale, where the slow loaders' seconds would squeeze them flat.
    fast_end = 2 * max(traces["aload"][0][-1], 0.05) if "aload" in traces else None
    fast = {ld: tr for ld, tr in traces.items() if fast_end is not None and tr[0][-1] <= fast_end}
    panels = [("every loader", traces)] + ([("the fast ones, zoomed", fast)] if 1 < len(fast) < len(traces) else [])
    fig, axes = plt.subplots(1, len(panels), figsize=(7 * len(panels), 5), squeeze=False)
    for ax, (title, shown) in zip(axes[0], panels, strict=True):
        for ld, (ts, mib) in shown.items():
            ax.plot(ts, mib, label=f"{ld} (peak {max(mib):.0f} MiB)", color=colors[ld])
        ax.set_xlabel("seconds into the load")
        ax.set_ylabel("RSS over baseline, MiB")
        ax.set_title(title, fontsize=10)
        ax.legend(fontsize=7)
    fig.suptitle(f"Memory during one load ({pick})")
    fig.tight_layout()
    made.append(out / "memory.png")
    fig.savefig(made[-1], dpi=110)
    plt.close(fig)
    return made


def machine() -> dict[str, Any]:
    """What ran the suite (``aload.bench.host``, the peers' versions too) and aload's commit."""
    from aload.bench import host

    info = host(("aload", "torch", "safetensors", "runai-model-streamer", "fastsafetensors"))
    try:
        git = ["git", "-C", str(HERE.parent)]
        info["aload_commit"] = subprocess.run(
            [*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        ).stdout.strip()
        if subprocess.run(
            [*git, "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True
        ).stdout:
            info["aload_commit"] += " (with uncommitted changes)"
    except OSError:
        pass
    return info


def _pct(share: float | None) -> str:
    return "unknown" if share is None else f"{share:.0%}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="1,4,8", help="GiB, comma separated")
    ap.add_argument("--many", action="store_true", help="also the 20,000-tensor checkpoint")
    ap.add_argument("--small", action="store_true", help="also a Qwen2.5-0.5B-shaped checkpoint (1 GB, 217 tensors)")
    ap.add_argument("--many-shards", action="store_true", help="also a checkpoint of 64 small shards")
    ap.add_argument("--moe", action="store_true", help="also DeepSeek-V3's layout: 89,820 tiny tensors, 163 shards")
    ap.add_argument("--scenarios", default="warm,cold")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--loaders", default="all")
    ap.add_argument("--out", type=Path, default=HERE / "out")
    ap.add_argument(
        "--ckpt-dir",
        type=Path,
        help="where the checkpoints are written once and reused (default: --out; 13 GiB for 1,4,8)",
    )
    ap.add_argument("--runai-sweep", default="4,8,16,32", help="concurrencies tried for runai_best (warm, once)")
    ap.add_argument("--replot", action="store_true", help="redraw the plots from --out's rows and traces")
    ap.add_argument(
        "--switch-interval",
        type=float,
        help="sys.setswitchinterval in every loader's process, for all loaders (default: Python's, 0.005 s)",
    )
    ap.add_argument(
        "--gc-collect",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="gc.collect() after building the model, in every loader's process (default; docs/troubleshooting.md)",
    )
    ap.add_argument(
        "--no-settle",
        action="store_true",
        help="no untimed first load before each cold and partial scenario (the first one after a pause ran 3-4x slower)",
    )
    ap.add_argument(
        "--page-cache",
        choices=("fresh", "as-is"),
        default="fresh",
        help="before a checkpoint's warm runs: drop it from the page cache and read it once in order (fresh, "
        "the default), or keep the page cache as earlier loads left it (as-is); the report gives the share in "
        "2 MiB pages either way",
    )
    ap.add_argument(
        "--device",
        default="cpu",
        help="where the model's parameters live: cpu (default) or cuda (peers copy_ onto the GPU; adds load_file_gpu)",
    )
    ap.add_argument(
        "--remote",
        type=float,
        help="also HTTP and S3 over loopback from nginx (benchmarks/remote.py), a checkpoint of this many GiB",
    )
    ap.add_argument("--run", help=argparse.SUPPRESS)
    ap.add_argument("--ckpt", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--runai-concurrency", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--scenario", default="warm", help=argparse.SUPPRESS)
    a = ap.parse_args()
    global SWITCH_INTERVAL, GC_COLLECT, DEVICE
    GC_COLLECT, DEVICE = a.gc_collect, a.device
    if a.switch_interval is not None:
        SWITCH_INTERVAL = a.switch_interval
        sys.setswitchinterval(a.switch_interval)
    if a.run:
        print(json.dumps(run_one(a.run, a.ckpt, a.runai_concurrency, a.scenario)))
        return
    cache_bytecode()
    if a.replot:
        traces = {(r["scenario"], r["loader"]): r["mem_trace"] for r in json.loads((a.out / "traces.json").read_text())}
        rows = [json.loads(line) for line in (a.out / "rows.jsonl").read_text().splitlines()]
        for r in rows:
            if r["rep"] == 0 and (r["scenario"], r["loader"]) in traces:
                r["mem_trace"] = traces[(r["scenario"], r["loader"])]
        print("written: " + ", ".join(map(str, plots(rows, a.out))))
        return
    every = [ld for ld in LOADERS if DEVICE != "cpu" or ld != "load_file_gpu"]
    loaders = every if a.loaders == "all" else a.loaders.split(",")
    a.out.mkdir(parents=True, exist_ok=True)
    where = a.ckpt_dir or a.out  # checkpoints written once there, reused by later runs
    ckpts: dict[str, Path] = {f"{s}GiB": make_llama(where / f"ckpt-{s}g", float(s)) for s in a.sizes.split(",") if s}
    if a.small:
        ckpts["qwen-0.5b"] = make_small(where / "ckpt-small")
    if a.many:
        ckpts["20k-tensors"] = make_many(where / "ckpt-many")
    if a.many_shards:
        ckpts["64-shards"] = make_many_shards(where / "ckpt-64-shards")
    if a.moe:
        ckpts["moe-layout"] = make_moe(where / "ckpt-moe")
    runai_c = None
    if "runai_best" in loaders:
        first = next(iter(ckpts.values()))
        trials = {int(c): child("runai_best", first, int(c))["gbps"] for c in a.runai_sweep.split(",")}
        runai_c = max(trials, key=trials.__getitem__)
        print(f"runai concurrency sweep (warm, {first.name}): {trials} -> {runai_c}", flush=True)
    rows: list[dict[str, Any]] = []
    dd: dict[str, list[float]] = {}
    huge: dict[str, list[float | None]] = {}
    for label, folder in ckpts.items():
        warm_cache(folder)
        dd[f"warm {label}"] = [warm_cache(folder) for _ in range(3)]
        for scenario in a.scenarios.split(","):
            name = f"{scenario} {label}"
            if scenario == "warm":
                if a.page_cache == "fresh":
                    fresh_cache(folder)
                huge[name] = [huge_share(folder)]
            # The first load to read a checkpoint from this VM's disk after a pause ran 3-4x slower
            # than the ones after it, whichever loader it was (safe_open 0.46 then 1.24 GB/s on
            # 1 GB; aload 0.48 then 1.87 on 8 GiB, even after a `cat` of the same files), and it
            # was always rep 0's first loader. So that loader loads once, untimed, first.
            if scenario != "warm" and not a.no_settle:
                child(loaders[0], folder, runai_c, scenario)
            for rep in range(a.reps):
                # The host drifts within a run: warm, `dd` is read again before each repetition,
                # and each aload run is also set against its own repetition's.
                dd_now = warm_cache(folder) if scenario == "warm" else None
                if dd_now is not None:
                    dd[name].append(dd_now)
                for loader in loaders if rep % 2 == 0 else loaders[::-1]:
                    row = child(loader, folder, runai_c, scenario)
                    row.update(
                        scenario=name,
                        rep=rep,
                        runai_concurrency=runai_c if loader == "runai_best" else None,
                        dd_gbps=dd_now,
                    )
                    if rep:
                        row.pop("mem_trace", None)
                    rows.append(row)
                    print(f"  {name} rep {rep} {loader:>16}: {row['gbps']:.2f} GB/s", flush=True)
            if scenario == "warm":
                huge[name].append(huge_share(folder))  # after: whether the runs changed it
    (a.out / "rows.jsonl").write_text(
        "".join(json.dumps({k: v for k, v in r.items() if k != "mem_trace"}) + "\n" for r in rows)
    )
    remote = run_remote(a.remote, a.reps, a.out / "remote") if a.remote else ""
    (a.out / "traces.json").write_text(json.dumps([r for r in rows if "mem_trace" in r]))
    host = machine()
    host["gc_collect"] = GC_COLLECT  # the harness's settings, with the host they ran on
    host["device"] = DEVICE
    if DEVICE != "cpu":
        import torch

        host["gpu"] = torch.cuda.get_device_name(DEVICE)
    if SWITCH_INTERVAL is not None:
        host["switch_interval"] = SWITCH_INTERVAL
    (a.out / "machine.json").write_text(json.dumps(host, indent=1) + "\n")
    report = "# aload benchmark suite\n\n" + "Host: " + ", ".join(f"{k} {v}" for k, v in host.items()) + "\n\n"
    report += "\n".join(f"- `{k}`: {v}" for k, v in LOADERS.items() if k in loaders)
    report += "\n\ndd of the same files (warm; before the runs and before each warm repetition): " + ", ".join(
        f"{k}: {statistics.median(v):.2f} GB/s ({min(v):.2f}-{max(v):.2f})" for k, v in dd.items()
    )
    if huge:
        report += (
            f"\n\nPage cache before and after each warm scenario ({a.page_cache}): share of the checkpoint in 2 MiB pages: "
            + ", ".join(f"{k}: {' -> '.join(_pct(v) for v in vs)}" for k, vs in huge.items())
        )
    report += "\n\n" + table(rows) + "\n" + ratios(rows, {k: statistics.median(v) for k, v in dd.items()})
    report += remote
    (a.out / "report.md").write_text(report)
    made = plots(rows, a.out)
    print("\n" + report)
    print(
        "written: "
        + ", ".join(str(p) for p in [a.out / "rows.jsonl", a.out / "machine.json", a.out / "report.md", *made])
    )


def run_remote(gib: float, reps: int, out: Path) -> str:
    """``benchmarks/remote.py`` in its own process (it writes its checkpoint and rows under
    ``out``), its progress echoed; its table and ratios as a section of the report, or why it
    did not run."""
    cmd = [sys.executable, str(HERE / "remote.py"), "--size-gib", f"{gib:g}", "--reps", str(reps), "--out", str(out)]
    head = f"\n## Remote sources over loopback (`{' '.join(['python benchmarks/remote.py', *cmd[2:6]])}`)\n\n"
    print(f"remote sources: {' '.join(cmd[1:])}", flush=True)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    lines = []
    for line in proc.stdout:
        print(line, end="", flush=True)
        lines.append(line)
    text = "".join(lines)
    at = text.find("| loader |")
    if proc.wait() or at < 0:
        last = text.strip().splitlines()[-1:] or ["no output"]
        return head + f"Not run: {last[0]}\n"
    return head + text[at:].strip() + "\n"


if __name__ == "__main__":
    main()
