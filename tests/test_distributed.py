"""Ranks of a real gloo process group (2 and 4 processes on 127.0.0.1, started here) share one
read of each byte: every mode gives the pairs a single process gets, in the same order; in
broadcast mode each rank reads about 1/N of the bytes (aload's statistics and an HTTP origin's
request log agree); a tensor-parallel stage reads only each rank's rows; a rank that fails, is
cancelled or dies ends every rank with an error naming it, and no rank hangs."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path
from typing import Any

import pytest
import torch

import aload
from examples.range_server import FileServer

from . import ranks
from .conftest import hf_llama


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A sharded Llama written by transformers (about 1 MiB in 3 shards)."""
    folder = tmp_path_factory.mktemp("dist") / "llama"
    hf_llama(0, hidden_size=128, intermediate_size=256, num_hidden_layers=2, vocab_size=256).save_pretrained(
        folder, max_shard_size="400KB"
    )
    return folder


async def single(url: str, **options: Any) -> list[str]:
    pairs, _ = await ranks.streamed(url, chunk_bytes=64 << 10, **options)
    return pairs


def total_bytes(folder: Path) -> int:
    from safetensors import safe_open

    n = 0
    for f in folder.glob("*.safetensors"):
        with safe_open(str(f), "pt") as st:
            n += sum(st.get_tensor(k).nbytes for k in st.keys())
    return n


@pytest.mark.parametrize("world", [2, 4])
async def test_every_mode_gives_the_single_process_pairs_and_broadcast_reads_each_byte_once(
    llama: Path, tmp_path: Path, world: int
) -> None:
    want = await single(str(llama))
    args = {"url": str(llama), "modes": ["broadcast", "none", "prefetch"], "model": world == 2, "tp": world == 2}
    results = await asyncio.to_thread(ranks.run, world, "same_pairs", tmp_path, args)
    total = total_bytes(llama)
    for r, res in enumerate(results):
        assert res is not None and "error" not in res, res
        for mode in args["modes"]:
            assert res[mode]["pairs"] == want, (r, mode)
        assert res["none"]["bytes_read"] == total and res["none"]["bytes_received"] == 0
        # what a rank reads for the others and receives from them counts against its own budget
        assert res["broadcast"]["peak"] <= (256 << 10) + res["broadcast"]["overdraft"], res["broadcast"]
    # broadcast: the ranks read disjoint parts that add up to the checkpoint, each about 1/N
    read = [res["broadcast"]["bytes_read"] for res in results]
    assert sum(read) == total
    assert all(res["broadcast"]["bytes_read"] + res["broadcast"]["bytes_received"] == total for res in results)
    assert max(read) <= total / world * 1.6 and min(read) >= total / world * 0.4, read
    if world == 2:
        model = hf_llama(0, hidden_size=128, intermediate_size=256, num_hidden_layers=2, vocab_size=256)
        expected = [ranks.digest(k, v) for k, v in model.state_dict().items()]
        assert all(res["model"]["state"] == expected for res in results)
        assert sum(res["model"]["bytes_read"] for res in results) == total
        # tensor parallel: each rank its own slices, the column-parallel rows only read by it
        for r, res in enumerate(results):
            assert res["tp"]["pairs"] == await single(str(llama), stages=ranks.tp_stage(r, world))
        read_tp = [res["tp"]["bytes_read"] for res in results]
        assert sum(read_tp) < total + total / 2, read_tp  # rows are not read twice; only shared bytes once


async def test_broadcast_from_an_http_origin_fetches_each_byte_once(llama: Path, tmp_path: Path) -> None:
    async with FileServer() as origin:
        origin.add_folder(llama)
        args = {"url": origin.url, "modes": ["broadcast"]}
        results = await asyncio.to_thread(ranks.run, 2, "same_pairs", tmp_path, args)
        want = await single(origin.url)
        fetched = {0: 0, 1: 0}
        for (_method, name, rng), agent in zip(origin.requests, origin.agents, strict=True):
            m = re.fullmatch(r"bytes=(\d+)-(\d+)", rng)
            rank = re.search(r"rank(\d)", agent)
            if m and rank and name.endswith(".safetensors"):
                fetched[int(rank.group(1))] += int(m.group(2)) - int(m.group(1)) + 1
    assert all(res is not None and res["broadcast"]["pairs"] == want for res in results), results
    total = total_bytes(llama)
    shards = [n for n in origin.files if n.endswith(".safetensors")]
    probes = 2 * 64 * 1024 * len(shards)  # each rank reads each shard's first 64 KiB for its header
    assert total <= sum(fetched.values()) <= total + probes
    assert all(n <= total / 2 + probes / 2 + 64 * 1024 for n in fetched.values()), fetched
    assert all(results[r]["broadcast"]["bytes_read"] < total * 0.8 for r in (0, 1))


@pytest.mark.parametrize("how", ["raise", "cancel", "exit"])
async def test_a_failing_rank_ends_every_rank_with_an_error_naming_it(llama: Path, tmp_path: Path, how: str) -> None:
    results = await asyncio.to_thread(
        ranks.run, 2, "one_fails", tmp_path, {"url": str(llama), "rank": 1, "how": how, "timeout": 30}
    )
    other = results[0]
    assert other is not None and other.get("error") == "GroupError", other
    assert "rank 1 of 2" in other["message"] or "process group failed" in other["message"], other
    if how != "exit":
        assert other["rank"] == 1
        assert {"raise": "RuntimeError", "cancel": "CancelledError"}[how] == results[1]["error"], results[1]
        if how == "raise":
            assert "consumer of rank 1 broke" in other["message"]
    assert other["seconds"] < 25 and not other["threads"], other
    assert results[1] is None if how == "exit" else not results[1]["threads"]


async def test_a_rank_that_stops_answering_is_waited_for_group_timeout_at_most(llama: Path, tmp_path: Path) -> None:
    args = {"url": str(llama), "rank": 1, "how": "stall", "stall": 5, "timeout": 2}
    results = await asyncio.to_thread(ranks.run, 2, "one_fails", tmp_path, args, 90)
    other = results[0]
    assert other["error"] == "GroupError" and "within 2 s" in other["message"], other
    assert other["seconds"] < 5 and not other["threads"], other


async def test_group_needs_an_initialised_cpu_group(llama: Path) -> None:
    with pytest.raises(aload.UsageError, match="init_process_group"):
        await single(str(llama), group=True)
    with pytest.raises(aload.UsageError, match="share must be one of"):
        aload.stream(str(llama), group=True, share="scatter")
    assert torch.distributed.is_available()
