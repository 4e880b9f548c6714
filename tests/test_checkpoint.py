"""Checkpoint layouts: single file, folder with index, folder without; their inconsistencies."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import aload

from .conftest import collect, llama_like


async def test_single_file_reads_only_headers(write: Callable[..., Path]) -> None:
    tensors = llama_like()
    path = write(tensors)
    async with aload.open(path) as ckpt:
        assert [s.name for s in ckpt.shards] == [""]
        assert set(ckpt.specs) == set(tensors)
        assert ckpt.total_bytes == sum(t.nbytes for t in tensors.values())
        spec = ckpt.specs["lm_head.weight"]
        assert spec.shape == (128, 64) and spec.dtype == "F32" and spec.shard == str(path)


async def test_indexed_folder_in_shard_then_offset_order(sharded: Callable[..., Path]) -> None:
    tensors = llama_like()
    folder = sharded(tensors, 3)
    async with aload.open(folder) as ckpt:
        assert [s.name for s in ckpt.shards] == [f"model-0000{k}-of-00003.safetensors" for k in (1, 2, 3)]
        assert ckpt.metadata["total_size"] == sum(t.nbytes for t in tensors.values())
        order = [(s.shard, s.start) for s in ckpt.specs.values()]
        assert order == sorted(order)
        got = [name async for name, _ in aload.stream(ckpt)]
    assert got == list(ckpt.specs)


async def test_folder_without_index(sharded: Callable[..., Path]) -> None:
    tensors = llama_like()
    folder = sharded(tensors, 2, index=False)
    got = await collect(aload.stream(folder))
    assert all(torch.equal(got[k], v) for k, v in tensors.items()) and len(got) == len(tensors)


async def test_index_only_names_its_files(sharded: Callable[..., Path], write: Callable[..., Path]) -> None:
    folder = sharded(llama_like(), 2)
    write({"stray": torch.ones(1)}, name="ckpt/zz-stray.safetensors")
    async with aload.open(folder) as ckpt:
        assert "stray" not in ckpt.specs and len(ckpt.shards) == 2


def _rewrite_index(folder: Path, fn: Callable[[dict[str, Any]], None]) -> None:
    idx = folder / "model.safetensors.index.json"
    obj = json.loads(idx.read_text())
    fn(obj["weight_map"])
    idx.write_text(json.dumps(obj))


@pytest.mark.parametrize(
    "bad", ["../outside.safetensors", "/etc/passwd", "http://x/y.safetensors", "a/../../b.safetensors"]
)
async def test_index_naming_files_outside_is_refused(sharded: Callable[..., Path], bad: str) -> None:
    folder = sharded(llama_like(), 2)
    _rewrite_index(folder, lambda wm: wm.__setitem__("model.norm.weight", bad))
    with pytest.raises(aload.CheckpointError, match="outside the checkpoint") as info:
        await aload.open(folder)
    assert info.value.tensor == "model.norm.weight"


@pytest.mark.parametrize("pad", [0, 3000])  # a small index, and one parsed in pieces on a thread
async def test_index_placing_a_tensor_in_a_non_string_is_refused(sharded: Callable[..., Path], pad: int) -> None:
    folder = sharded(llama_like(), 2)

    def spoil(wm: dict[str, Any]) -> None:
        wm.update({f"unused.{i}": "model-00001-of-00002.safetensors" for i in range(pad)})
        wm["model.norm.weight"] = ["model-00001-of-00002.safetensors"]

    _rewrite_index(folder, spoil)
    with pytest.raises(aload.CheckpointError, match="weight_map of tensor names to file names") as info:
        await aload.open(folder)
    assert info.value.tensor == "model.norm.weight"


async def test_tensor_found_in_another_shard_than_index_says(sharded: Callable[..., Path]) -> None:
    folder = sharded(llama_like(), 2)

    def swap(wm: dict[str, str]) -> None:
        wm["model.norm.weight"] = (
            "model-00001-of-00002.safetensors"
            if wm["model.norm.weight"].startswith("model-00002")
            else "model-00002-of-00002.safetensors"
        )

    _rewrite_index(folder, swap)
    with pytest.raises(aload.CheckpointError, match="index places it") as info:
        await aload.open(folder)
    assert info.value.tensor == "model.norm.weight"


async def test_tensor_the_index_does_not_list_is_refused(sharded: Callable[..., Path]) -> None:
    folder = sharded(llama_like(), 2)
    _rewrite_index(folder, lambda wm: wm.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(aload.CheckpointError, match="the index does not list it") as info:
        await aload.open(folder)
    assert info.value.tensor == "model.layers.1.mlp.up_proj.weight"


async def test_index_lists_tensor_no_shard_holds(sharded: Callable[..., Path]) -> None:
    folder = sharded(llama_like(), 2)
    _rewrite_index(folder, lambda wm: wm.__setitem__("ghost", "model-00001-of-00002.safetensors"))
    with pytest.raises(aload.CheckpointError, match="does not hold it"):
        await aload.open(folder)


async def test_tensor_in_two_shards_is_refused(write: Callable[..., Path]) -> None:
    write({"a": torch.ones(2), "dup": torch.ones(3)}, name="ckpt/one.safetensors")
    path = write({"dup": torch.zeros(3)}, name="ckpt/two.safetensors")
    with pytest.raises(aload.CheckpointError, match="two shards") as info:
        await aload.open(path.parent)
    assert info.value.tensor == "dup"


async def test_missing_path_and_empty_folder(tmp_path: Path) -> None:
    with pytest.raises(aload.SourceError, match="no such file"):
        await aload.open(tmp_path / "nope")
    with pytest.raises(aload.CheckpointError, match=r"no \.safetensors"):
        await aload.open(tmp_path)


async def test_index_not_json(sharded: Callable[..., Path]) -> None:
    folder = sharded(llama_like(), 2)
    (folder / "model.safetensors.index.json").write_text("{oops")
    with pytest.raises(aload.CheckpointError, match="index is not valid"):
        await aload.open(folder)


async def test_missing_shard_named_by_index(sharded: Callable[..., Path]) -> None:
    folder = sharded(llama_like(), 2)
    (folder / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(aload.SourceError, match="cannot open") as info:
        await aload.open(folder)
    assert "model-00002-of-00002" in str(info.value)


async def test_file_url_and_unknown_scheme(write: Callable[..., Path]) -> None:
    path = write({"a": torch.ones(2)})
    async with aload.open(f"file://{path}") as ckpt:
        assert list(ckpt.specs) == ["a"]
    with pytest.raises(aload.UsageError, match="no source for scheme"):
        await aload.open("gopher://x/y")


