"""The reader: bytes identical, order, the byte budget, plan pruning, no deadlock, no leaks."""

from __future__ import annotations

import asyncio
import gc
import os
import time
import weakref
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import uvloop

import aload
from aload import stages as S

from .conftest import LOOP_BLOCK_LIMIT_S, LoopWatchdog, collect, llama_like

MiB = 1 << 20


def big_checkpoint(n: int = 24, rows: int = 256, cols: int = 1024) -> dict[str, torch.Tensor]:
    """n tensors of 1 MiB (float32 256x1024) plus small norms between them."""
    g = torch.Generator().manual_seed(1)
    out: dict[str, torch.Tensor] = {}
    for i in range(n):
        out[f"layers.{i}.w"] = torch.randn(rows, cols, generator=g)
        out[f"layers.{i}.norm"] = torch.randn(cols, generator=g)
    return out


async def test_budget_bounds_bytes_in_flight(write: Callable[..., Path]) -> None:
    tensors = big_checkpoint()  # ~24 MiB, six times the budget
    path = write(tensors)
    budget = 4 * MiB
    async with aload.stream(path, max_inflight_bytes=budget, chunk_bytes=MiB) as s:
        n = 0
        async for name, t in s:
            assert torch.equal(t, tensors[name])
            n += 1
            await asyncio.sleep(0)  # a consumer slower than the reads
        stats = s.stats
    assert n == len(tensors)
    assert stats.peak_inflight_bytes <= budget
    assert stats.overdraft_bytes == 0
    assert stats.budget_waits > 0  # the budget, not luck, kept it bounded
    assert stats.bytes_read == sum(t.nbytes for t in tensors.values())


async def test_stages_and_lazy_consumer_keep_the_bound(write: Callable[..., Path]) -> None:
    tensors = big_checkpoint()
    path = write(tensors)
    seen = []
    pipeline = S.rename(r"^layers\.", "model.layers.") | S.map(lambda n, t: t * 2, match=r"\.w$")

    class Model(torch.nn.Module):
        def load_weights(self, weights: object) -> None:
            for name, t in weights:  # type: ignore[attr-defined]
                seen.append(name)
                assert torch.equal(t, tensors[name.removeprefix("model.")] * (2 if name.endswith(".w") else 1))

    report = await aload.load(Model(), path, stages=pipeline, max_inflight_bytes=4 * MiB, chunk_bytes=MiB)
    assert len(seen) == len(tensors)
    assert report.peak_inflight_bytes <= 4 * MiB and report.overdraft_bytes == 0


async def test_dropped_tensors_are_never_read(write: Callable[..., Path]) -> None:
    tensors = big_checkpoint(n=8)
    path = write(tensors)
    async with aload.stream(path, stages=(S.keep(r"\.norm$"),)) as s:
        got = await collect(s)
        stats = s.stats
    assert set(got) == {k for k in tensors if k.endswith(".norm")}
    assert stats.bytes_read == sum(tensors[k].nbytes for k in got)


@pytest.mark.parametrize("read", ["cached", "direct"])
async def test_small_tensors_coalesce_and_large_ones_split(write: Callable[..., Path], read: str) -> None:
    tensors = {f"n{i:03d}": torch.full((16,), float(i)) for i in range(200)}  # 64 B each
    tensors["zz_big"] = torch.randn(4 * MiB // 4)  # 4 MiB
    path = write(tensors)
    async with aload.stream(path, chunk_bytes=MiB, read=read) as s:
        got = await collect(s)
        stats = s.stats
    assert all(torch.equal(got[k], v) for k, v in tensors.items())
    # 200 small tensors in one read, the big one in four (five where direct reads start its
    # chunks on 4 KiB blocks of the file)
    assert stats.reads in (5, 6)


async def test_an_async_for_over_a_read_unit_lets_other_tasks_run(write: Callable[..., Path]) -> None:
    """4,000 tensors read as one unit come without waiting for anything: the stream still hands
    the loop back every ~1 ms, so another task runs while the unit is consumed."""
    tensors = {f"t{i:04d}": torch.full((16,), float(i)) for i in range(4000)}  # 64 B each, one unit
    path = write(tensors)
    ran = 0

    async def other() -> None:
        nonlocal ran
        while True:
            ran += 1
            await asyncio.sleep(0)

    seen: list[int] = []
    task = asyncio.ensure_future(other())
    try:
        async with aload.stream(path) as s:
            async for name, t in s:
                seen.append(ran)
                assert torch.equal(t, tensors[name])
            assert s.stats.reads == 1  # one unit, read once
    finally:
        task.cancel()
    assert len(seen) == 4000 and len(set(seen)) > 1  # the other task ran mid-unit


async def test_tensor_larger_than_budget_is_delivered_alone(write: Callable[..., Path]) -> None:
    tensors = {"a": torch.randn(1000), "huge": torch.randn(2 * MiB // 4), "z": torch.randn(1000)}
    path = write(tensors)
    async with aload.stream(path, max_inflight_bytes=MiB) as s:
        got = {}
        async for name, t in s:
            got[name] = t.clone()
            del t
    assert all(torch.equal(got[k], v) for k, v in tensors.items())


async def test_consumer_holding_every_tensor_does_not_deadlock(write: Callable[..., Path]) -> None:
    tensors = big_checkpoint(n=12)
    path = write(tensors)
    held = []
    async with aload.stream(path, max_inflight_bytes=2 * MiB, chunk_bytes=MiB) as s:
        async for name, t in s:
            held.append((name, t))  # never released
        stats = s.stats
    assert len(held) == len(tensors)
    assert all(torch.equal(t, tensors[n]) for n, t in held)
    assert stats.overdraft_bytes > 0  # reported, not hidden


async def test_buffers_are_recycled_not_overwritten_while_alive(write: Callable[..., Path]) -> None:
    """A derived view keeps its buffer alive: later reads must not reuse that memory."""
    tensors = big_checkpoint(n=16)
    path = write(tensors)
    kept = {}
    async with aload.stream(path, max_inflight_bytes=3 * MiB, chunk_bytes=MiB) as s:
        async for name, t in s:
            if name == "layers.0.w":
                kept[name] = t[10:20]  # a view of the buffer, not the tensor handed out
    assert torch.equal(kept["layers.0.w"], tensors["layers.0.w"][10:20])


async def test_time_to_first_tensor_counts_from_the_streams_start(write: Callable[..., Path]) -> None:
    """The header's parse and the plan come before the first tensor, and count: the clock starts
    when the stream is made, as ``load``'s does when it is called; the stats say when the
    checkpoint was open and when the plan was made."""
    path = write(big_checkpoint(n=2))
    s = aload.stream(path)
    await asyncio.sleep(0.05)
    async with s:
        async for _name, _t in s:
            pass
    st = s.stats
    assert st.ttft_s is not None and st.opened_s is not None and st.planned_s is not None
    assert 0.05 <= st.opened_s <= st.planned_s <= st.ttft_s  # what came first, in order


async def test_early_exit_closes_reads_and_files(write: Callable[..., Path]) -> None:
    path = write(big_checkpoint())
    async with aload.stream(path, max_inflight_bytes=4 * MiB) as s:
        async for _name, _t in s:
            break
    # the no_leaks fixture checks threads and file descriptors


@pytest.mark.parametrize("keep", [False, True])
async def test_early_exit_leaves_the_reader_to_be_freed(write: Callable[..., Path], keep: bool) -> None:
    """A stream left after its first tensor, with reads in flight: once it is closed nothing of
    it outlives it, even while the consumer keeps the tensor it was given (a cancelled read's
    frame held its buffer, whose release callback held the reader, which held that read)."""
    path = write(big_checkpoint())
    s = aload.stream(path, max_inflight_bytes=4 * MiB, concurrency=4)
    async with s:
        async for _name, t in s:  # noqa: B007  (the tensor is kept below)
            break
    reader = weakref.ref(s.reader)
    kept = t if keep else None
    del s, t
    await asyncio.sleep(0.01)  # the releases already asked for run on the loop
    gc.collect()
    assert reader() is None
    assert kept is None or kept.numel() > 0


async def test_truncated_shard_names_file_and_range(write: Callable[..., Path]) -> None:
    tensors = big_checkpoint(n=4)
    path = write(tensors)
    async with aload.open(path) as ckpt:
        os.truncate(path, os.path.getsize(path) - 100)  # shrinks under an open checkpoint
        with pytest.raises(aload.SourceError, match=r"file (ended|shrank)") as info:
            await collect(aload.stream(ckpt))
    assert info.value.url == str(path) and info.value.byte_range is not None


async def test_bad_budget_values_are_refused(write: Callable[..., Path]) -> None:
    path = write({"a": torch.ones(1)})
    for kw in ({"max_inflight_bytes": 0}, {"concurrency": -1}, {"chunk_bytes": 1.5}):
        with pytest.raises(aload.UsageError, match="positive integer"):
            aload.stream(path, **kw)  # type: ignore[arg-type]


async def test_progress_reports_up_to_every_tensor(write: Callable[..., Path]) -> None:
    tensors = llama_like()
    path = write(tensors)
    ticks: list[aload.Progress] = []
    await collect(aload.stream(path, progress=ticks.append, chunk_bytes=4096))
    assert len(ticks) > 1 and [t.tensors for t in ticks] == sorted(t.tensors for t in ticks)
    assert ticks[-1].tensors == ticks[-1].tensors_total == len(tensors)
    assert ticks[-1].bytes == ticks[-1].bytes_total == sum(t.nbytes for t in tensors.values())


def test_streams_under_uvloop_without_blocking(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    tensors = big_checkpoint(n=8)
    save_file(tensors, str(tmp_path / "m.safetensors"))

    async def main() -> float:
        async with LoopWatchdog() as dog:
            got = await collect(aload.stream(tmp_path / "m.safetensors", max_inflight_bytes=2 * MiB))
        assert all(torch.equal(got[k], v) for k, v in tensors.items())
        return dog.worst

    assert uvloop.run(main()) < LOOP_BLOCK_LIMIT_S


@pytest.mark.blocks_loop
async def test_watchdogs_catch_a_blocked_loop() -> None:
    """Both guards can fail: the debug-mode report (default loop) and the ticker (uvloop)."""
    import logging

    from .conftest import SlowCallbacks

    async def blocking_callback() -> None:  # what a blocking read on the loop looks like
        time.sleep(LOOP_BLOCK_LIMIT_S + 0.1)

    handler = SlowCallbacks()
    logging.getLogger("asyncio").addHandler(handler)
    try:
        async with LoopWatchdog() as dog:
            await asyncio.sleep(0.01)
            await asyncio.ensure_future(blocking_callback())
            await asyncio.sleep(0.01)
    finally:
        logging.getLogger("asyncio").removeHandler(handler)
    assert dog.worst >= LOOP_BLOCK_LIMIT_S
    assert any("blocking_callback" in r for r in handler.reports)


@pytest.mark.parametrize("read", ["cached", "direct"])
async def test_both_read_modes_give_the_same_bytes_within_budget(write: Callable[..., Path], read: str) -> None:
    tensors = big_checkpoint(n=10)
    path = write(tensors)
    async with aload.stream(path, max_inflight_bytes=3 * MiB, chunk_bytes=MiB, read=read) as s:
        got = await collect(s)
        stats = s.stats
    assert got.keys() == tensors.keys() and all(torch.equal(got[k], v) for k, v in tensors.items())
    assert stats.peak_inflight_bytes <= 3 * MiB and stats.bytes_read == sum(t.nbytes for t in tensors.values())


async def test_writing_into_a_handed_out_tensor_never_touches_the_file(write: Callable[..., Path]) -> None:
    """Mapped tensors are copy-on-write: a consumer may modify them in place."""
    tensors = {"a": torch.arange(1024.0), "b": torch.ones(512, 512)}
    path = write(tensors)
    before = path.read_bytes()
    async with aload.stream(path) as s:
        async for _name, t in s:
            t.mul_(-1)
    assert path.read_bytes() == before
    got = await collect(aload.stream(path))
    assert torch.equal(got["a"], tensors["a"])


async def test_unknown_read_mode_is_refused(tmp_path: Path) -> None:
    with pytest.raises(aload.UsageError, match="read must be one of"):
        await aload.open(tmp_path, read="mmap-ish")


class _Holder(torch.nn.Module):
    """A vLLM-style model whose load_weights keeps (or copies and drops) every tensor, and notes
    the thread each progress report came from."""

    def __init__(self, keep: bool) -> None:
        super().__init__()
        self.keep = keep
        self.got: dict[str, torch.Tensor] = {}

    def load_weights(self, weights: object) -> set[str]:
        for name, t in weights:  # type: ignore[attr-defined]
            self.got[name] = t if self.keep else t.clone()
            del t
        return set()


@pytest.mark.parametrize("keep", [False, True])
async def test_load_hands_whole_units_to_the_loader_thread_within_the_bound(
    write: Callable[..., Path], keep: bool
) -> None:
    """Without tensor stages the bridge passes whole units and the loader's thread cuts the
    tensors: same pairs, same order, the budget kept (or, for a loader that keeps every tensor,
    an overdraft reported rather than a deadlock), progress and counts on the loop thread."""
    import threading

    tensors = big_checkpoint(n=12)
    path = write(tensors)
    model = _Holder(keep)
    threads: set[int] = set()
    reports: list[aload.Progress] = []

    def progress(p: aload.Progress) -> None:
        threads.add(threading.get_ident())
        reports.append(p)

    rename = S.rename(r"^layers\.", "model.layers.")  # a name-only stage: applied in the plan
    report = await asyncio.wait_for(
        aload.load(model, path, stages=rename, max_inflight_bytes=2 * MiB, chunk_bytes=MiB, progress=progress), 60
    )
    async with aload.stream(path, stages=rename) as s:
        order = [name async for name, _ in s]  # file order, as a plain stream gives it
    assert list(model.got) == order and len(order) == len(tensors)
    assert all(torch.equal(model.got["model." + k], v) for k, v in tensors.items())
    assert report.tensors == len(tensors) and report.bytes == sum(t.nbytes for t in tensors.values())
    assert reports[-1].tensors == len(tensors) and threads == {threading.get_ident()}
    if keep:
        assert report.overdraft_bytes > 0
    else:
        assert report.peak_inflight_bytes <= 2 * MiB and report.overdraft_bytes == 0


async def test_load_with_verify_delivers_only_what_the_plan_keeps(write: Callable[..., Path], tmp_path: Path) -> None:
    import hashlib

    tensors = big_checkpoint(n=6)
    path = write(tensors)
    model = _Holder(False)
    keep = S.keep(lambda n: n.startswith("layers.2."))
    digest = {path.name: hashlib.sha256(path.read_bytes()).hexdigest()}
    report = await aload.load(model, path, stages=keep, verify=digest, chunk_bytes=MiB)
    assert sorted(model.got) == ["layers.2.norm", "layers.2.w"]
    assert all(torch.equal(t, tensors[n]) for n, t in model.got.items())
    assert report.verified_shards == 1 and report.tensors == 2
    assert report.bytes_read >= sum(t.nbytes for t in tensors.values())  # every byte went through the digest


def _mixed(n: int = 700) -> dict[str, torch.Tensor]:
    """Small tensors of four dtypes and five shapes (scalars and empty ones too): safetensors
    writes them grouped by dtype, in runs longer and shorter than ``arena.CUT_RUN``."""
    dtypes = [torch.bfloat16, torch.int8, torch.float16]
    shapes: list[tuple[int, ...]] = [(7,), (3, 5), (), (0, 4), (2, 2, 2)]
    g = torch.Generator().manual_seed(3)
    out = {}
    for i in range(n):
        dtype = torch.float32 if i < 400 else dtypes[i % 3]
        out[f"t{i:04d}"] = torch.randint(-100, 100, shapes[i % 5], generator=g).to(dtype)
    return out


async def test_tensors_cut_in_runs_are_the_files_own_and_not_held(write: Callable[..., Path]) -> None:
    """A unit's tensors are cut from its buffer in runs . Through the stream and
    through ``load_weights`` (with pruned tensors read for a digest among them), each is the file's
    own, and none is held by aload once handed out: its unit's memory goes back to the reader."""
    import hashlib
    import weakref

    CUT_RUN = 256

    tensors = _mixed()
    assert sum(t.dtype == torch.float32 for t in tensors.values()) > CUT_RUN
    path = write(tensors)

    def check(name: str, t: torch.Tensor) -> weakref.ref[torch.Tensor]:
        want = tensors[name]
        assert t.dtype == want.dtype and t.shape == want.shape and torch.equal(t, want), name
        if not want.numel():  # owns no bytes: holding it holds no unit's memory
            assert t.untyped_storage().nbytes() == 0, name
        return weakref.ref(t)

    seen = []
    async with aload.stream(path, max_inflight_bytes=MiB) as s:
        async for name, t in s:
            ref = check(name, t)
            del t
            assert ref() is None, name
            seen.append(name)
    assert sorted(seen) == sorted(tensors)

    class Model(torch.nn.Module):
        def load_weights(self, weights: object) -> None:
            for name, t in weights:  # type: ignore[attr-defined]
                ref = check(name, t)
                del t
                assert ref() is None, name
                seen.append(name)

    seen.clear()
    keep = S.keep(lambda n: int(n[1:]) % 11 != 5)
    digest = {path.name: hashlib.sha256(path.read_bytes()).hexdigest()}
    report = await aload.load(Model(), path, stages=keep, verify=digest)
    assert sorted(seen) == sorted(k for k in tensors if int(k[1:]) % 11 != 5)
    assert report.verified_shards == 1 and report.tensors == len(seen)


