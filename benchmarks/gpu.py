"""Onto the GPU: aload against InstantTensor, fastsafetensors, Run:ai's streamer and
``safetensors.torch.load_file``, and the pinned host-to-device ceiling, on one GPU host.

    python benchmarks/gpu.py --wheels .whl             # here: the peers' wheels for the GPU host
    python benchmarks/gpu.py [--size-gib 8] [--reps 3] [--out DIR]            # there (CUDA)
    python benchmarks/gpu.py --device cpu --size-gib 0.25 --reps 1            # a dry run, anywhere

Writes a Llama-shaped bf16 checkpoint to the host's disk (``--disk-dir``) and to /dev/shm, then
measures, each load in a fresh process, loaders alternating in order, median of ``--reps``:
``h2d`` (a pinned 1 GiB buffer copied to the device: the ceiling), ``aload`` (built-in loader,
reads staged through pinned buffers), ``aload_lw`` (a vLLM-style ``load_weights`` model that
``copy_()``s each tensor onto the device), ``instanttensor``, ``fastsafetensors`` (nogds),
``runai`` and ``load_file``, warm (page cache) and cold (dropped first) from disk, and from
/dev/shm. Every loader delivers into a preallocated model on the device; the first run of each
compares every tensor with ``safe_open``'s. Prints the table, the targets as ratios, and writes
``rows.jsonl``. Peers that are not installed (or need CUDA on a CPU run) are skipped, said so.
A deadline (``--budget-s``, default 420) stops starting new runs, so that a lease is not overrun.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
LOADERS = ("h2d", "aload", "aload_lw", "instanttensor", "fastsafetensors", "runai", "load_file")
PEER_WHEELS = ("instanttensor", "fastsafetensors", "runai-model-streamer")


def write(folder: Path, size_gib: float) -> list[Path]:
    from examples.demo import llama_shapes, write_checkpoint

    if not (folder / "model.safetensors.index.json").exists():
        folder.mkdir(parents=True, exist_ok=True)
        hidden, inter, vocab = 4096, 14336, 32000
        if size_gib < 1:
            hidden, inter, vocab = 1024, 3584, 8000
        per_layer = 2 * (2 * hidden * hidden + 2 * hidden * hidden // 4 + 3 * inter * hidden)
        layers = max(1, int((size_gib * 2**30 - 4 * vocab * hidden) // per_layer))
        write_checkpoint(folder, llama_shapes(hidden, inter, vocab, layers), shards=max(1, round(size_gib / 2)))
    return sorted(folder.glob("*.safetensors"))


def drop_cache(files: list[Path]) -> None:
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def warm_cache(files: list[Path]) -> None:
    for f in files:
        with open(f, "rb") as fh:
            while fh.read(64 << 20):
                pass


# -- one load, in a process of its own -----------------------------------------------------------


def one(loader: str, folder: Path, device: str, check: bool) -> dict[str, Any]:
    import torch
    from safetensors import safe_open

    files = sorted(folder.glob("*.safetensors"))
    dev = torch.device(device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    if loader == "h2d":
        n = 1 << 30
        src = torch.empty(n, dtype=torch.uint8, pin_memory=dev.type == "cuda")
        dst = torch.empty(n, dtype=torch.uint8, device=dev)
        dst.copy_(src, non_blocking=True)
        sync()
        t = time.perf_counter()
        for _ in range(4):
            dst.copy_(src, non_blocking=True)
        sync()
        return {"bytes": 4 * n, "seconds": time.perf_counter() - t}
    shapes: dict[str, tuple[torch.Size, torch.dtype]] = {}
    for f in files:
        with safe_open(str(f), "pt") as st:
            for k in st.keys():
                sl = st.get_slice(k)
                shapes[k] = (torch.Size(sl.get_shape()), torch.bfloat16)
    params = {k: torch.empty(s, dtype=d, device=dev) for k, (s, d) in shapes.items()}
    for p in params.values():
        p.fill_(0)
    sync()
    total = sum(p.numel() * p.element_size() for p in params.values())
    t = time.perf_counter()
    if loader in ("aload", "aload_lw"):
        import aload

        model = torch.nn.ParameterDict({k.replace(".", "_"): torch.nn.Parameter(v, requires_grad=False)
                                        for k, v in params.items()})  # fmt: skip
        rename = aload.stages.rename(r"\.", "_")
        if loader == "aload_lw":

            class Engine(torch.nn.Module):
                def load_weights(self, weights: Any) -> set[str]:
                    for name, w in weights:
                        params[name].copy_(w, non_blocking=True)
                    return set()

            aload.load_sync(Engine(), str(folder), device=dev)
        else:
            aload.load_sync(model, str(folder), stages=rename, device=dev, staging=True)
    elif loader == "instanttensor":
        from instanttensor import safe_open as it_open

        with it_open([str(f) for f in files], framework="pt", device=dev.index or 0) as fh:
            for name, tensor in fh.tensors():
                params[name].copy_(tensor)
    elif loader == "fastsafetensors":
        from fastsafetensors import SafeTensorsFileLoader, SingleGroup

        fl = SafeTensorsFileLoader(SingleGroup(), dev, nogds=True)
        fl.add_filenames({0: [str(f) for f in files]})
        fb = fl.copy_files_to_device()
        for name in shapes:
            params[name].copy_(fb.get_tensor(name))
        fb.close()
        fl.close()
    elif loader == "runai":
        from runai_model_streamer import SafetensorsStreamer

        with SafetensorsStreamer() as streamer:
            streamer.stream_files([str(f) for f in files])
            for name, tensor in streamer.get_tensors():
                params[name].copy_(tensor, non_blocking=True)
    elif loader == "load_file":
        from safetensors.torch import load_file

        for f in files:
            for name, tensor in load_file(str(f), device=str(dev)).items():
                params[name].copy_(tensor)
    else:
        raise SystemExit(f"unknown loader {loader}")
    sync()
    seconds = time.perf_counter() - t
    row: dict[str, Any] = {"bytes": total, "seconds": seconds}
    if check:
        bad = 0
        for f in files:
            with safe_open(str(f), "pt") as st:
                for k in st.keys():
                    bad += not torch.equal(params[k].cpu(), st.get_tensor(k))
        row["identical"] = bad == 0
    return row


# -- the driver ---------------------------------------------------------------------------------


def available(loader: str, device: str) -> str | None:
    """Why ``loader`` cannot run here, or None."""
    import importlib.util

    module = {"instanttensor": "instanttensor", "fastsafetensors": "fastsafetensors", "runai": "runai_model_streamer"}
    if loader in module and importlib.util.find_spec(module[loader]) is None:
        return "not installed"
    if loader == "instanttensor" and device == "cpu":
        return "needs CUDA"
    return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-gib", type=float, default=8)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--disk-dir", type=Path, default=Path("/tmp/aload-gpu"))
    ap.add_argument("--shm-dir", type=Path, default=Path("/dev/shm/aload-gpu"))
    ap.add_argument("--loaders", default=",".join(LOADERS))
    ap.add_argument("--out", type=Path, default=HERE / "out" / "gpu")
    ap.add_argument("--budget-s", type=float, default=420)
    ap.add_argument("--wheels", type=Path, help="download the peers' wheels for the GPU host (Python 3.12) here, and stop")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    ap.add_argument("--ckpt", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--check", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.one:
        print(json.dumps(one(a.one, a.ckpt, a.device, a.check)))
        return
    if a.wheels:
        platforms = [f"--platform=manylinux_2_{n}_x86_64" for n in (17, 27, 28, 31, 34, 35)]
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version",
                        "3.12", "--implementation", "cp", *platforms, "-d", str(a.wheels), *PEER_WHEELS], check=True)  # fmt: skip
        return
    deadline = time.monotonic() + a.budget_s
    a.out.mkdir(parents=True, exist_ok=True)
    disk = write(a.disk_dir, a.size_gib)
    shm = write(a.shm_dir, a.size_gib) if a.shm_dir.parent.exists() else []
    scenarios = [("disk", "warm", a.disk_dir, disk), ("disk", "cold", a.disk_dir, disk)]
    if shm:
        scenarios.append(("shm", "warm", a.shm_dir, shm))
    loaders = []
    for name in a.loaders.split(","):
        why = available(name, a.device)
        if why:
            print(f"{name}: skipped ({why})", flush=True)
        else:
            loaders.append(name)
    runs: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    stopped = False
    for rep in range(a.reps):
        order = loaders if rep % 2 == 0 else loaders[::-1]
        for where, state, folder, files in scenarios:
            for loader in order:
                if loader == "h2d" and (where, state) != ("disk", "warm"):
                    continue
                if time.monotonic() > deadline:
                    stopped = True
                    break
                (drop_cache if state == "cold" else warm_cache)(files)
                cmd = [sys.executable, __file__, "--one", loader, "--ckpt", str(folder), "--device", a.device]
                first = (where, state, loader) not in runs
                done = subprocess.run(cmd + (["--check"] if first else []), capture_output=True, text=True, timeout=600)
                if done.returncode:
                    print(f"{loader} {where} {state}: failed: {done.stderr.strip().splitlines()[-1:]}", flush=True)
                    runs.setdefault((where, state, loader), [])
                    continue
                row = json.loads(done.stdout.strip().splitlines()[-1])
                row |= {"loader": loader, "source": where, "state": state, "gbps": row["bytes"] / row["seconds"] / 1e9}
                runs.setdefault((where, state, loader), []).append(row)
                print(f"rep {rep} {where} {state} {loader}: {row['gbps']:.2f} GB/s"
                      + ("" if row.get("identical", True) else "  BYTES DIFFER"), flush=True)  # fmt: skip
    rows = []
    with open(a.out / "rows.jsonl", "w") as f:
        for (where, state, loader), got in runs.items():
            for r in got:
                f.write(json.dumps(r) + "\n")
            if got:
                gb = [r["gbps"] for r in got]
                rows.append((where, state, loader, statistics.median(gb), min(gb), max(gb),
                             all(r.get("identical", True) for r in got)))  # fmt: skip
    print(f"\n{a.size_gib:g} GiB, device {a.device}" + ("; stopped at the deadline" if stopped else ""))
    print("| source | state | loader | GB/s (median, min-max) | bytes identical |\n|---|---|---|---|---|")
    for where, state, loader, med, lo, hi, same in rows:
        print(f"| {where} | {state} | {loader} | {med:.2f} ({lo:.2f}-{hi:.2f}) | {'yes' if same else 'NO'} |")
    best = {(w, s, ld): m for w, s, ld, m, *_ in rows}
    h2d = best.get(("disk", "warm", "h2d"))
    for where, state in (("disk", "warm"), ("shm", "warm"), ("disk", "cold")):
        ours, it = best.get((where, state, "aload")), best.get((where, state, "instanttensor"))
        peers = [best[(where, state, p)] for p in ("instanttensor", "fastsafetensors", "runai", "load_file") if (where, state, p) in best]
        parts = []
        if ours and it:
            parts.append(f"aload / InstantTensor = {ours / it:.2f}x (target >= 1.0)")
        if ours and h2d and state == "warm":
            parts.append(f"aload / pinned H2D = {ours / h2d:.2f}x (target >= 0.6)")
        if state == "warm" and best.get((where, state, "aload_lw")) and it:
            parts.append(f"aload load_weights / InstantTensor = {best[(where, state, 'aload_lw')] / it:.2f}x (target >= 0.8)")
        if ours and peers and state == "cold":
            parts.append(f"aload / best peer = {ours / max(peers):.2f}x (target >= 1.0)")
        if parts:
            print(f"{where} {state}: " + "; ".join(parts))


if __name__ == "__main__":
    main()
