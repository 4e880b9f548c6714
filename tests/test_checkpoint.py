"""Checkpoint layouts: single file, folder with index, folder without; their inconsistencies."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
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


async def test_a_clash_past_the_first_piece_of_a_large_shard_is_named(write: Callable[..., Path]) -> None:
    """Shards are added to the checkpoint a piece at a time (``_ASSEMBLE_PIECE`` tensors): a
    tensor two shards hold, found in a later piece, is the one named, not one of its own shard's
    earlier pieces."""
    from aload.checkpoint import _ASSEMBLE_PIECE

    n = _ASSEMBLE_PIECE + 8
    write({**{f"t{i:05d}": torch.ones(1) for i in range(n)}, "zz": torch.ones(1)}, name="ckpt/one.safetensors")
    path = write({**{f"u{i:05d}": torch.ones(1) for i in range(n)}, "zz": torch.ones(1)}, name="ckpt/two.safetensors")
    with pytest.raises(aload.CheckpointError, match="two shards") as info:
        await aload.open(path.parent)
    assert info.value.tensor == "zz"


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


def test_an_optional_client_is_imported_off_the_event_loop() -> None:
    """A process's first http:// or s3:// open imports aiohttp (~150 ms here) and aiobotocore
    (~120 ms more) on a thread: on the loop they held it that long."""
    code = textwrap.dedent(
        """
        import asyncio, sys, threading
        import aload, aload.checkpoint
        on_main = {}
        class Watch:
            def find_spec(self, name, path=None, target=None):
                if name in ("aiohttp", "aiobotocore") and name not in on_main:
                    on_main[name] = threading.current_thread() is threading.main_thread()
        sys.meta_path.insert(0, Watch())
        assert "aiohttp" not in sys.modules and "aiobotocore" not in sys.modules
        def stop(url, **options):  # no network: the import is what is looked at
            raise aload.UsageError("stop", url=url)
        aload.checkpoint.open_store = stop
        async def first_open(url):
            try:
                await aload.open(url)
            except aload.UsageError:
                pass
        for url in ("http://127.0.0.1:9/m", "s3://bucket/m"):
            asyncio.run(first_open(url))
        print(sorted(on_main.items()))
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    assert out.stdout.strip() == "[('aiobotocore', False), ('aiohttp', False)]", out.stdout + out.stderr


@pytest.mark.skipif(sys.implementation.name != "cpython", reason="CPython's cyclic collector")
async def test_specs_and_plan_items_are_left_out_of_the_cycle_collector(sharded: Callable[..., Path]) -> None:
    """Each ``TensorSpec`` and plan ``Item`` is a tuple of leaves the collector need not track.
    CPython stops tracking exact tuples of leaves by itself, but not a NamedTuple's instances: a
    load of 20,000 tensors promoted ~40,000 of them to the oldest generation, and every ~4 such
    loads a full collection (157-204 ms here, holding the GIL) walked the whole process. The plan
    is made with the collector paused."""
    import gc

    from aload.plan import make_plan

    folder = sharded({f"layers.{i}.w": torch.randn(8, 8) for i in range(2000)}, 2)
    collections: list[int] = []

    def watch(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            collections.append(info["generation"])

    async with await aload.open(folder) as ckpt:
        was = gc.isenabled()
        gc.enable()
        gc.callbacks.append(watch)
        try:
            plan = make_plan(ckpt, None, None, 1 << 20)
        finally:
            gc.callbacks.remove(watch)
            if not was:
                gc.disable()
        # Made with the collector paused: ~3 collections of the youngest generation otherwise,
        # each a step towards a full one.
        assert collections == [], collections
        items = [item for unit in plan.units for item in unit.items]
        assert len(items) == len(ckpt.specs) == 2000
        assert not any(gc.is_tracked(s) for s in ckpt.specs.values())
        assert not any(gc.is_tracked(item) for item in items)
        assert all(item.spec is ckpt.specs[item.name] for item in items)  # and they still read as before


async def test_headers_of_a_few_hundred_tensors_are_parsed_off_the_loop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DeepSeek-V3's shards have ~64 KB headers (552 tensors, ~1.4 ms to parse here): parsed on the
    loop, one after another, they held it that long each (p99 lateness 4.6-7.8 ms). A header of
    a few tensors is still parsed right there (a trip to a thread costs more)."""
    import threading

    from safetensors.torch import save_file

    import aload.checkpoint

    on_loop: dict[str, tuple[int, bool]] = {}
    parse = aload.checkpoint.parse_header

    def watched(raw: bytes, size: int, url: str) -> Any:
        on_loop[Path(url).name] = (len(raw), threading.current_thread() is threading.main_thread())
        return parse(raw, size, url)

    monkeypatch.setattr(aload.checkpoint, "parse_header", watched)
    shards = [{f"model.layers.{k}.mlp.experts.{j}.w": torch.zeros(2) for j in range(300)} for k in range(2)]
    shards.append({f"small.{i}": torch.zeros(2) for i in range(3)})
    weight_map = {}
    for k, part in enumerate(shards):
        save_file(part, str(tmp_path / f"s{k}.safetensors"))
        weight_map |= {name: f"s{k}.safetensors" for name in part}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    async with aload.open(tmp_path) as ckpt:
        assert len(ckpt.specs) == len(weight_map)
    assert sorted(on_loop) == ["s0.safetensors", "s1.safetensors", "s2.safetensors"]
    assert all(n > 16 << 10 and not on_main for n, on_main in (on_loop["s0.safetensors"], on_loop["s1.safetensors"]))
    assert on_loop["s2.safetensors"][0] < 1024 and on_loop["s2.safetensors"][1]
