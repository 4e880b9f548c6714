"""LoRA adapters loaded on demand into a running server: many loads in one warm process.

    python benchmarks/adapters.py [--ranks 16,64] [--reps 12] [--cold] [--dir DIR]

A serving engine with LoRA enabled loads an adapter when a request first names it, while its
event loop keeps serving: the load's latency is added to that request's time to first token, and
its loop lateness to every other request's. This writes PEFT-shaped adapters for a Llama-2-7B base
(all seven projections of 32 layers, bf16: 448 tensors, ~80 MB at rank 16) and loads each, in
one process, into a preallocated slot (a module with a parameter per adapter tensor, as the
engine's LoRA slots are allocated up front), alternating the loaders' order each repetition:

- ``aload``: ``aload.load`` with the built-in loader (tensors of 1 MiB or more read straight into the slot);
- ``aload_lw``: ``aload.load`` into a ``load_weights`` that ``copy_()``s each tensor;
- ``safe_open``: ``safe_open`` + ``get_tensor`` + ``copy_()`` (vLLM's ``LoRAModel`` reads adapters so);
- ``load_file``: ``safetensors.torch.load_file`` + ``copy_()``.

The blocking loaders run through ``asyncio.to_thread``, as a frontend must. The page cache is
warm (an adapter in use is read often) unless ``--cold`` drops the file before every load. The
first two repetitions are left out of the figures (imports, first touches). Prints the median
(min-max) latency and the median of each load's loop lateness p99 (a 1 ms ticker).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
from safetensors.torch import save_file

import aload
from aload.bench import Probe
from benchmarks.suite import drop_cache, fmt, peer_iterator
from examples.demo import empty_model

LOADERS = ("aload", "aload_lw", "safe_open", "load_file")
#: Llama-2-7B's projections: name -> (in, out).
PROJECTIONS = {
    "self_attn.q_proj": (4096, 4096),
    "self_attn.k_proj": (4096, 4096),
    "self_attn.v_proj": (4096, 4096),
    "self_attn.o_proj": (4096, 4096),
    "mlp.gate_proj": (4096, 11008),
    "mlp.up_proj": (4096, 11008),
    "mlp.down_proj": (11008, 4096),
}


def make_adapter(folder: Path, rank: int, layers: int = 32) -> Path:
    """``adapter_model.safetensors`` as PEFT writes it (``lora_A``: rank x in, ``lora_B``: out x rank)."""
    folder.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(rank)
    tensors = {}
    for layer in range(layers):
        for proj, (n_in, n_out) in PROJECTIONS.items():
            pre = f"base_model.model.model.layers.{layer}.{proj}"
            tensors[f"{pre}.lora_A.weight"] = torch.randn(rank, n_in, generator=g).to(torch.bfloat16)
            tensors[f"{pre}.lora_B.weight"] = torch.randn(n_out, rank, generator=g).to(torch.bfloat16)
    save_file(tensors, folder / "adapter_model.safetensors")
    return folder


async def load_once(loader: str, folder: Path, slot: torch.nn.Module, params: dict[str, Any]) -> dict[str, float]:
    class Engine(torch.nn.Module):
        def load_weights(self, weights: Any) -> set[str]:
            for name, t in weights:
                params[name].copy_(t)
            return set()

    def blocking() -> None:
        for name, t in peer_iterator(loader, [str(folder / "adapter_model.safetensors")], None):
            params[name].copy_(t)

    async with Probe() as probe:
        t0 = time.perf_counter()
        if loader == "aload":
            await aload.load(slot, folder)
        elif loader == "aload_lw":
            await aload.load(Engine(), folder)
        else:
            await asyncio.to_thread(blocking)
        seconds = time.perf_counter() - t0
    return {"ms": seconds * 1e3, "p99": probe.row()["loop_lag_p99_ms"]}


async def bench(folder: Path, reps: int, cold: bool) -> dict[str, list[dict[str, float]]]:
    from safetensors import safe_open

    with safe_open(str(folder / "adapter_model.safetensors"), "pt") as f:
        want = {k: f.get_tensor(k) for k in f.keys()}
    slot = empty_model({k: tuple(v.shape) for k, v in want.items()}, torch.bfloat16)
    params = dict(slot.named_parameters())
    got: dict[str, list[dict[str, float]]] = {name: [] for name in LOADERS}
    for rep in range(reps):
        for loader in LOADERS if rep % 2 == 0 else LOADERS[::-1]:
            for p in params.values():
                p.data.zero_()
            if cold:
                drop_cache(folder)
            got[loader].append(await load_once(loader, folder, slot, params))
            assert all(torch.equal(params[k], v) for k, v in want.items()), loader  # the slot holds it
    return got


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", default="16,64", help="LoRA ranks, one adapter each (default 16,64)")
    ap.add_argument("--reps", type=int, default=12)
    ap.add_argument("--cold", action="store_true", help="drop the adapter from the page cache before each load")
    ap.add_argument("--dir", type=Path, help="where to write the adapters (default: a temporary folder)")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = a.dir or Path(tmp)
        print("| adapter | loader | ms | loop lag p99 ms |\n|---|---|---|---|")
        for rank in (int(r) for r in a.ranks.split(",")):
            folder = root / f"lora-r{rank}"
            if not (folder / "adapter_model.safetensors").exists():
                make_adapter(folder, rank)
            size = (folder / "adapter_model.safetensors").stat().st_size
            got = asyncio.run(bench(folder, a.reps, a.cold))
            for loader, runs in got.items():
                runs = runs[2:] or runs
                label = f"rank {rank}, {size / 1e6:.0f} MB{', cold' if a.cold else ''}"
                print(
                    f"| {label} | {loader} | {fmt([r['ms'] for r in runs], digits=1)} | {fmt([r['p99'] for r in runs], digits=1)} |"
                )


if __name__ == "__main__":
    main()
