"""Random valid checkpoints (every dtype, odd shapes, many shards, unicode names, metadata),
written by safetensors, stream byte-identical to what safetensors reads: from local files and
over HTTP here, over S3 in test_remote.py."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

import aload
from examples.range_server import FileServer

DTYPES = [
    torch.float64,
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.uint16,
    torch.uint32,
    torch.uint64,
    torch.bool,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
]
NAMES = ["w", "層.{i}.重み", "emb😀{i}", "a.b.c.{i}", "{i}", "x" * 60 + "{i}", "naïve/{i}"]
SEEDS = range(6)


def random_checkpoint(folder: Path, seed: int) -> Path:
    """A folder of 1-4 shards with an index (or a single file), seeded."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for i in range(rng.randint(1, 24)):
        dtype = rng.choice(DTYPES)
        shape = [rng.choice([0, 1, 2, 3, 7, 64, 257]) for _ in range(rng.randint(0, 3))]
        if rng.random() < 0.15:
            shape = [rng.randint(40_000, 90_000)]  # larger than a chunk: split reads
        raw = torch.randint(
            0, 256, (int(torch.tensor(shape).prod()) * dtype.itemsize,), generator=gen, dtype=torch.uint8
        )
        tensors[rng.choice(NAMES).format(i=i)] = raw.view(dtype).reshape(shape)  # every bit pattern, NaNs too
    folder.mkdir(parents=True)
    metadata = {"format": "pt", "ünï": "çødé", "seed": str(seed)}
    shards = rng.randint(1, min(4, len(tensors)))
    if shards == 1 and rng.random() < 0.5:
        save_file(tensors, str(folder / "model.safetensors"), metadata=metadata)
        return folder / "model.safetensors"
    names = list(tensors)
    rng.shuffle(names)
    weight_map = {}
    for k in range(shards):
        fname = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[k::shards]}
        save_file(part, str(folder / fname), metadata=metadata)
        weight_map.update(dict.fromkeys(part, fname))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return folder


def reference(path: Path) -> dict[str, bytes]:
    files = [path] if path.is_file() else sorted(path.glob("*.safetensors"))
    out = {}
    for f in files:
        with safe_open(str(f), "pt") as st:
            for k in st.keys():
                t = st.get_tensor(k)
                out[k] = bytes(t.reshape(-1).view(torch.uint8).numpy()) if t.numel() else b""
    return out


async def streamed(url: str, **options: Any) -> dict[str, bytes]:
    out = {}
    async with aload.stream(url, chunk_bytes=64 << 10, max_inflight_bytes=512 << 10, **options) as s:
        async for name, t in s:
            assert name not in out
            out[name] = bytes(t.reshape(-1).view(torch.uint8).numpy()) if t.numel() else b""
    return out


@pytest.mark.parametrize("seed", SEEDS)
async def test_local_and_http_streams_equal_safetensors(tmp_path: Path, seed: int) -> None:
    path = random_checkpoint(tmp_path / "ckpt", seed)
    want = reference(path)
    assert await streamed(str(path)) == want
    assert await streamed(str(path), read="cached") == want
    assert await streamed(str(path), read="direct") == want
    async with FileServer() as srv:
        srv.add_folder(path if path.is_dir() else path.parent)
        url = srv.url + ("/" if path.is_dir() else f"/{path.name}")
        assert await streamed(url) == want
