"""The reader: bytes identical, order, the byte budget, plan pruning, no deadlock, no leaks."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import itertools
import math
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
from aload._threads import PAUSE_AFTER_S
from aload.local import LocalStore

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


@pytest.mark.parametrize("read", ["pread", "map"])
async def test_small_tensors_coalesce_and_large_ones_split(write: Callable[..., Path], read: str) -> None:
    tensors = {f"n{i:03d}": torch.full((16,), float(i)) for i in range(200)}  # 64 B each
    tensors["zz_big"] = torch.randn(4 * MiB // 4)  # 4 MiB
    path = write(tensors)
    async with aload.stream(path, chunk_bytes=MiB, read=read) as s:
        got = await collect(s)
        stats = s.stats
    assert all(torch.equal(got[k], v) for k, v in tensors.items())
    # 200 small tensors in one read, the big one in four; a file in the page cache is mapped,
    # and its bytes there are one piece (nothing to wait for, so no task per chunk)
    assert stats.reads == 1 + (4 if read == "pread" else 1)


async def test_coalesced_units_start_small_and_double(write: Callable[..., Path]) -> None:
    """The first tensors arrive after one small read, not a whole chunk's."""
    from aload.plan import FIRST_GROUP_BYTES, make_plan

    tensors = {f"n{i:04d}": torch.full((1024,), float(i)) for i in range(2048)}  # 4 KiB each, 8 MiB
    path = write(tensors)
    async with await aload.open(path) as ckpt:
        plan = make_plan(ckpt, None, None, 2 * MiB)
    sizes = [u.nbytes for u in plan.units]
    assert sizes[:4] == [FIRST_GROUP_BYTES, 2 * FIRST_GROUP_BYTES, 4 * FIRST_GROUP_BYTES, 2 * MiB]
    assert max(sizes) == 2 * MiB and sum(sizes) == 8 * MiB
    assert [i.name for u in plan.units for i in u.items] == list(tensors)
    got = await collect(aload.stream(path, chunk_bytes=2 * MiB))
    assert all(torch.equal(got[k], v) for k, v in tensors.items())


async def test_header_parse_and_plan_run_on_the_stores_own_threads(
    write: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A large header's parse and a large plan run on the read pool's threads, which are
    already running, not on new ones (each start holds the event loop until the thread runs)."""
    import threading

    from aload import checkpoint, pipeline

    where: dict[str, str] = {}

    def on_thread(name: str, fn: Callable[..., object]) -> Callable[..., object]:
        def wrapped(*args: object) -> object:
            where[name] = threading.current_thread().name
            return fn(*args)

        return wrapped

    monkeypatch.setattr(checkpoint, "parse_header", on_thread("parse", checkpoint.parse_header))
    monkeypatch.setattr(pipeline, "make_plan", on_thread("plan", pipeline.make_plan))
    tensors = {f"layer.{i}.norm": torch.full((4,), float(i)) for i in range(3000)}  # a ~200 KB header
    path = write(tensors)
    started = threading.Thread.start
    starts: list[str] = []

    def start(self: threading.Thread) -> None:
        starts.append(self.name)
        started(self)

    monkeypatch.setattr(threading.Thread, "start", start)
    got = await collect(aload.stream(path))
    assert len(got) == len(tensors)
    assert where["parse"].startswith("aload-io") and where["plan"].startswith("aload-io"), where
    assert not [n for n in starts if n.startswith("aload-worker")], starts


async def test_a_large_index_and_the_assembly_run_off_the_event_loop(
    sharded: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The index of 19,200 tensors took 16 ms to check on the loop, putting them together 5-7 ms."""
    import threading

    from aload import checkpoint

    on_loop: dict[str, bool] = {}

    def watched(name: str, fn: Callable[..., object]) -> Callable[..., object]:
        def wrapped(*args: object) -> object:
            on_loop[name] = threading.current_thread() is threading.main_thread()
            return fn(*args)

        return wrapped

    monkeypatch.setattr(checkpoint, "_parse_index", watched("index", checkpoint._parse_index))
    monkeypatch.setattr(checkpoint, "_assemble", watched("assemble", checkpoint._assemble))
    tensors = {f"model.layers.{i}.input_layernorm.weight": torch.full((4,), float(i)) for i in range(3000)}
    folder = sharded(tensors, 4)
    assert (folder / "model.safetensors.index.json").stat().st_size > 64 << 10
    got = await collect(aload.stream(folder))
    assert all(torch.equal(got[k], v) for k, v in tensors.items())
    assert on_loop == {"index": False, "assemble": False}


async def test_every_header_is_read_before_any_is_parsed(
    sharded: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Reads first, then parsing on the loop one header at a time: parsing while the read threads
    came and went for the GIL left the loop late by 5-14 ms, again and again (163 shards)."""
    from aload import checkpoint

    done: list[str] = []
    seen_at_first_parse: list[int] = []
    read_head, parse = checkpoint._read_head, checkpoint.parse_header

    async def counted(store: object, name: str) -> object:
        got = await read_head(store, name)  # type: ignore[arg-type]
        done.append(name)
        return got

    def parse_header(*args: object) -> object:
        seen_at_first_parse.append(len(done))
        return parse(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(checkpoint, "_read_head", counted)
    monkeypatch.setattr(checkpoint, "parse_header", parse_header)
    tensors = {f"layers.{i}.w": torch.full((4,), float(i)) for i in range(40)}
    folder = sharded(tensors, 8)
    got = await collect(aload.stream(folder))
    assert all(torch.equal(got[k], v) for k, v in tensors.items())
    assert len(done) == 8 and seen_at_first_parse == [8] * 8


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


async def test_a_task_a_timer_wakes_runs_in_the_streams_next_pause(write: Callable[..., Path]) -> None:
    """A consumer on the loop that takes 0.25 ms a tensor: the stream hands the loop back after
    each ~1 ms (at most 4 tensors), and a task whose short sleep ended meanwhile runs in that
    pause, not the one after (a pause of ``asyncio.sleep(0)`` let 5-8 tensors go by)."""
    tensors = {f"t{i:03d}": torch.full((16,), float(i)) for i in range(200)}  # 64 B each, one unit
    path = write(tensors)
    per_tensor_s = 0.00025
    consumed = 0
    gaps: list[int] = []

    async def sleeper() -> None:
        while True:
            at = consumed
            await asyncio.sleep(0.0001)
            gaps.append(consumed - at)

    task = asyncio.ensure_future(sleeper())
    try:
        async with aload.stream(path) as s:
            async for _name, _t in s:
                end = time.perf_counter() + per_tensor_s
                while time.perf_counter() < end:
                    pass
                consumed += 1
            assert s.stats.reads == 1  # one unit: no wait for a read between two tensors
    finally:
        task.cancel()
    assert consumed == 200 and sum(gaps) > 150  # it woke throughout
    assert max(gaps) <= math.ceil(PAUSE_AFTER_S / per_tensor_s)


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


async def test_progress_reports_every_tensor(write: Callable[..., Path]) -> None:
    tensors = llama_like()
    path = write(tensors)
    ticks: list[aload.Progress] = []
    await collect(aload.stream(path, progress=ticks.append))
    assert len(ticks) == len(tensors)
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


@pytest.mark.parametrize("read", ["map", "pread"])
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


def test_unknown_read_mode_is_refused(tmp_path: Path) -> None:
    with pytest.raises(aload.UsageError, match="read must be one of"):
        LocalStore(str(tmp_path), concurrency=2, read="mmap-ish")


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


async def test_large_tensors_are_cut_on_the_loop_runs_of_small_ones_by_the_consumer(
    write: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Through ``load_weights``, a unit of one or two tensors is cut on the event loop's thread as
    it is queued (``bridge._PRECUT``), a run of many small ones on the consumer's; either way each
    tensor is the file's own and not held once the model drops it."""
    import threading
    import weakref

    from aload import bridge

    g = torch.Generator().manual_seed(5)
    tensors = {f"big{i}": torch.randn(3 * MiB // 8, 2, generator=g) for i in range(3)}  # 3 MiB each
    tensors.update({f"small{i:03d}": torch.randn(64, generator=g) for i in range(40)})
    path = write(tensors)
    cut_on: dict[str, int] = {}
    run_at = bridge.run_at

    def recorded(unit: object, view: object, i: int, handed: object = None) -> object:
        run, j = run_at(unit, view, i, handed)  # type: ignore[arg-type]
        cut_on.update((name, threading.get_ident()) for name, _ in run)
        return run, j

    monkeypatch.setattr(bridge, "run_at", recorded)
    consumer: set[int] = set()

    class Model(torch.nn.Module):
        def load_weights(self, weights: object) -> None:
            consumer.add(threading.get_ident())
            for name, t in weights:  # type: ignore[attr-defined]
                assert torch.equal(t, tensors[name]), name
                ref = weakref.ref(t)
                del t
                assert ref() is None, name

    await aload.load(Model(), path, chunk_bytes=MiB)
    loop_thread = threading.get_ident()
    assert sorted(cut_on) == sorted(tensors)
    assert consumer and loop_thread not in consumer
    assert all(cut_on[f"big{i}"] == loop_thread for i in range(3))
    assert all(cut_on[n] in consumer for n in tensors if n.startswith("small"))


async def test_tensors_cut_in_runs_are_the_files_own_and_not_held(write: Callable[..., Path]) -> None:
    """A unit's tensors are cut from its buffer in runs (``arena.run_at``). Through the stream and
    through ``load_weights`` (with pruned tensors read for a digest among them), each is the file's
    own, and none is held by aload once handed out: its unit's memory goes back to the reader."""
    import hashlib
    import weakref

    from aload.arena import CUT_RUN

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


async def test_a_view_dropped_on_the_loop_lets_its_pages_go_over_several_turns(
    write: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stream's consumer drops its tensors on the event loop: the pages of a view are let go a
    few steps a turn of the loop (250 MiB of them at once held it 3.1-3.4 ms), every page of it,
    and its bytes go back to the budget after the last step. Meanwhile the reader waits for them:
    it does not take the consumer for stuck and read outside the budget (it did, into 250 MiB
    of fresh memory)."""
    from aload import local, reader

    monkeypatch.setattr(local, "MAPPED_RUN_BYTES", 0)  # a view of chunk_bytes each, from the page cache
    monkeypatch.setattr(reader, "RELEASE_STEP_BYTES", 64 << 10)
    monkeypatch.setattr(reader, "RELEASE_TURN_S", 0.0)  # one step a turn
    tensors = {f"t{i}": torch.full((1 << 18,), float(i)) for i in range(8)}  # 1 MiB each
    path = write(tensors)
    path.read_bytes()
    turn = [0]
    released: list[tuple[int, int, int]] = []
    real = local.LocalSource.release

    def spy(self: local.LocalSource, offset: int, length: int) -> None:
        released.append((offset, offset + length, turn[0]))
        real(self, offset, length)

    monkeypatch.setattr(local.LocalSource, "release", spy)

    async def ticker() -> None:
        while True:
            turn[0] += 1
            await asyncio.sleep(0)

    tick = asyncio.create_task(ticker())
    try:
        async with aload.stream(path, max_inflight_bytes=2 * MiB, chunk_bytes=MiB) as s:
            assert s.checkpoint is not None
            specs = s.checkpoint.specs
            async for name, t in s:
                assert torch.equal(t, tensors[name])
                del t
            stats = s.stats
        for _ in range(64):  # the last view's steps, after the stream's end
            await asyncio.sleep(0)
    finally:
        tick.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await tick
    if not released:
        pytest.skip("the file was not mapped here")
    assert stats.overdraft_bytes == 0 and stats.peak_inflight_bytes <= 2 * MiB
    for spec in specs.values():
        steps = sorted((a, b, k) for a, b, k in released if spec.start <= a < spec.end)
        assert steps[0][0] == spec.start and steps[-1][1] == spec.end  # every byte, in steps
        assert all(x[1] == y[0] for x, y in itertools.pairwise(steps))
        assert all(b - a <= 64 << 10 for a, b, _ in steps)
        assert len({k for *_, k in steps}) > 1  # over several turns of the loop
