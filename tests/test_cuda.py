"""Loads into a model on a GPU: bytes land in pinned buffers, the copies to the GPU run on the
load's own CUDA stream, and a buffer is reused only after the copy that read it has completed.
The built-in loader's large tensors go on in pieces (``Reader._read_staged``).

The GPU tests are skipped where torch sees no CUDA device (CI has none). Each race check holds
the GPU busy before every copy (``torch.cuda._sleep``), so the copies run late while the reader
keeps refilling a small budget's buffers: a buffer reused before its copy completed shows as
wrong bytes. The pieces' bookkeeping is also checked on the CPU, with copies that run late on a
thread of their own.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import gc
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import aload
from aload import reader as reader_module
from aload.format import TensorSpec
from aload.install import Installed, Loader
from aload.pipeline import TensorStream
from aload.plan import Unit
from examples.demo import empty_model

from .conftest import drop_cache

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")

#: GPU cycles of busy-waiting before each copy (~0.5 ms on a 2 GHz GPU).
SLEEP_CYCLES = 1_000_000
#: A budget of a few tensors, so that each buffer is reused many times during one load.
SMALL_BUDGET = 6 << 20


def tensors(n: int = 40, dtype: torch.dtype = torch.float32, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random tensors of 256 KiB to ~5.3 MiB (float32), the larger ones more than a piece of the
    budgets below and not a whole number of pieces, and small ones between them (never zeros:
    they hide bytes not written)."""
    g = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for i in range(n):
        rows = (64, 256, 1360, 300)[i % 4]
        out[f"layers.{i}.weight"] = torch.randn(rows, 1024, generator=g).to(dtype)
        out[f"layers.{i}.norm"] = torch.randn(1024, generator=g).to(dtype)
    return out


def gpu_model(ts: dict[str, torch.Tensor], dtype: torch.dtype | None = None, on_cpu: Iterable[str] = ()) -> nn.Module:
    """A module tree with a parameter per name, on the GPU (those in ``on_cpu`` on the CPU), each
    filled with NaN first so that a tensor never written is caught."""
    model = empty_model({n: tuple(t.shape) for n, t in ts.items()}, dtype or next(iter(ts.values())).dtype, "cuda")
    keep_on_cpu = set(on_cpu)
    for name, p in model.named_parameters():
        p.data.fill_(float("nan"))
        if name in keep_on_cpu:
            p.data = p.data.cpu()
    return model


def assert_holds(model: nn.Module, ts: dict[str, torch.Tensor]) -> None:
    params = dict(model.named_parameters())
    assert set(params) == set(ts)
    wrong = [n for n, t in ts.items() if not torch.equal(params[n].cpu(), t.to(params[n].dtype))]
    assert not wrong, f"{len(wrong)} of {len(ts)} tensors hold other bytes than the checkpoint's: {wrong[:5]}"


def staged_part(ts: dict[str, torch.Tensor]) -> int:
    return sum(t.nbytes for t in ts.values() if t.nbytes >= 1 << 20)


def slowed(weights: Iterable[Any]) -> Iterator[Any]:
    """The pairs, each after the GPU was given ~0.5 ms of busy work on the current stream: the
    copy of it that follows runs that much later than it was asked for."""
    for pair in weights:
        torch.cuda._sleep(SLEEP_CYCLES)  # type: ignore[no-untyped-call]
        yield pair


class SlowGpuLoader(Loader):
    """The built-in loader with the GPU busy before each copy."""

    def load_weights_only(self, model: nn.Module, weights: Iterable[Any], device: torch.device) -> Installed:
        return super().load_weights_only(model, slowed(weights), device)


class Engine(nn.Module):
    """vLLM-style: ``load_weights`` copies each tensor into its parameter, without waiting for the
    copy (``non_blocking=True``, as an engine copying from pinned memory would)."""

    def __init__(self, ts: dict[str, torch.Tensor], dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.inner = gpu_model(ts, dtype)
        self.streams: set[int] = set()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        params = dict(self.named_parameters())
        for name, t in slowed(weights):
            self.streams.add(torch.cuda.current_stream().cuda_stream)
            params["inner." + name].copy_(t, non_blocking=True)
        return set(params)


@gpu
@pytest.mark.parametrize("scenario", ["warm", "cold"])
async def test_the_built_in_loader_fills_a_gpu_model_through_reused_pinned_buffers(
    write: Callable[..., Path], scenario: str
) -> None:
    ts = tensors()
    path = write(ts)
    if scenario == "cold":
        drop_cache(path)
    model = gpu_model(ts)
    report = await aload.load(model, path, loader=SlowGpuLoader(), max_inflight_bytes=SMALL_BUDGET)
    assert report.tensors == len(ts) and not report.missing
    # Tensors of 1 MiB and more go on in pieces; the others are read into buffers and copied.
    assert report.staged_bytes == staged_part(ts) and report.direct_bytes == 0
    # The budget was reused over and over: a buffer handed back before its copy ended would show.
    assert report.bytes > 5 * SMALL_BUDGET and report.peak_inflight_bytes <= SMALL_BUDGET + (1 << 20)
    assert_holds(model, ts)


@gpu
async def test_load_weights_on_a_gpu_runs_on_the_loads_own_stream_and_sees_right_bytes(
    write: Callable[..., Path],
) -> None:
    ts = tensors(seed=1)
    path = write(ts)
    engine = Engine(ts)
    default = torch.cuda.current_stream().cuda_stream
    report = await aload.load(engine, path, max_inflight_bytes=SMALL_BUDGET)
    assert report.tensors == len(ts)
    assert len(engine.streams) == 1 and default not in engine.streams  # the load's stream, not the default one
    assert_holds(engine.inner, ts)


@gpu
async def test_bf16_checkpoint_into_float32_gpu_parameters(write: Callable[..., Path]) -> None:
    ts = tensors(n=12, dtype=torch.bfloat16, seed=2)
    path = write(ts)
    model = gpu_model(ts, dtype=torch.float32)
    await aload.load(model, path, loader=SlowGpuLoader(), max_inflight_bytes=SMALL_BUDGET)
    assert_holds(model, ts)


@gpu
async def test_parameters_kept_on_the_cpu_are_read_into_straight_beside_gpu_ones(write: Callable[..., Path]) -> None:
    ts = tensors(n=12, seed=3)
    path = write(ts)
    on_cpu = [n for n in ts if n.startswith(("layers.1.", "layers.5."))]
    model = gpu_model(ts, on_cpu=on_cpu)
    report = await aload.load(model, path, device="cuda", max_inflight_bytes=SMALL_BUDGET)
    assert report.direct_bytes == sum(ts[n].nbytes for n in on_cpu)
    assert report.staged_bytes == staged_part({n: t for n, t in ts.items() if n not in on_cpu})
    assert_holds(model, ts)
    assert {n for n, p in model.named_parameters() if p.is_cuda} == set(ts) - set(on_cpu)


@gpu
async def test_post_processing_on_a_gpu_sees_every_copy_complete(write: Callable[..., Path]) -> None:
    ts = tensors(n=24, seed=4)
    path = write(ts)
    sums: dict[str, float] = {}

    class Checksum:
        def process_weights_after_loading(self, module: nn.Module) -> None:
            # Enqueued on the load's stream and read back at once: a copy still in flight, or one
            # on another stream not waited for, would leave NaN here.
            sums[module.name] = float(module.weight.double().sum())

    model = gpu_model(ts)
    for i, layer in enumerate(model.layers.children()):
        layer.name = f"layers.{i}"
        layer.quant_method = Checksum()
    await aload.load(model, path, loader=SlowGpuLoader(), max_inflight_bytes=SMALL_BUDGET)
    assert sums == pytest.approx({f"layers.{i}": float(ts[f"layers.{i}.weight"].double().sum()) for i in range(24)})


@gpu
async def test_a_cancelled_gpu_load_stops_and_the_next_load_is_whole(write: Callable[..., Path]) -> None:
    ts = tensors(seed=5)
    path = write(ts)
    started = threading.Event()

    class Blocking(Loader):
        def load_weights_only(self, model: nn.Module, weights: Iterable[Any], device: torch.device) -> Installed:
            def first_then_wait() -> Iterator[Any]:
                for i, pair in enumerate(slowed(weights)):
                    if i == 3:
                        started.set()
                    yield pair

            return super().load_weights_only(model, first_then_wait(), device)

    task = asyncio.ensure_future(
        aload.load(gpu_model(ts), path, loader=Blocking(), max_inflight_bytes=SMALL_BUDGET, concurrency=1)
    )
    while not started.is_set():
        await asyncio.sleep(0.001)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    model = gpu_model(ts)
    await aload.load(model, path, max_inflight_bytes=SMALL_BUDGET)
    assert_holds(model, ts)


class LateCopies:
    """Stands in for the load's CUDA stream on the CPU: each copy runs ~2 ms after it is asked
    for, on a thread of its own, and the event it returns completes with it."""

    def __init__(self) -> None:
        self.pool = concurrent.futures.ThreadPoolExecutor(1)
        self.copies = 0

    def __call__(self, dst: torch.Tensor, src: torch.Tensor) -> Any:
        def later() -> None:
            time.sleep(0.002)
            dst.copy_(src)

        self.copies += 1
        done = self.pool.submit(later)
        return type("Event", (), {"query": lambda self: done.done()})()


async def test_pieces_bound_for_a_gpu_are_read_into_again_only_after_their_copies(
    write: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The pieces' bookkeeping on the CPU: destinations stand in for GPU parameters, copies run late."""
    monkeypatch.setattr(Unit, "on_device", property(lambda unit: unit.dest is not None))
    ts = tensors(n=16, seed=6)
    path = write(ts)
    dests = {n: torch.full_like(t, float("nan")) for n, t in ts.items()}
    copies = LateCopies()

    def dest(name: str, spec: TensorSpec) -> torch.Tensor | None:
        return dests[name] if spec.nbytes > 1 << 20 else None

    got: dict[str, torch.Tensor] = {}
    # Chunks of 1 MiB: larger tensors are units of their own, as GPU destinations are (a CPU one
    # of up to 16 MiB would join a run read by one scattering read), and go in pieces of 1 MiB.
    stream = TensorStream(
        path, destinations=dest, device_copy=copies, max_inflight_bytes=SMALL_BUDGET, chunk_bytes=1 << 20
    )
    async with stream:
        async for name, t in stream:
            got[name] = t.clone()
    copies.pool.shutdown(wait=True)
    big = [n for n in ts if ts[n].nbytes > 1 << 20]
    assert got.keys() == ts.keys() and stream.stats.staged_bytes == sum(ts[n].nbytes for n in big)
    assert copies.copies > len(big)  # the 5.3 MiB tensors went in several pieces
    wrong = [n for n in big if not torch.equal(dests[n], ts[n])]
    assert not wrong, f"pieces read into again before their copies ran: {wrong}"
    assert all(torch.equal(got[n], ts[n]) for n in ts if n not in big)
    assert stream.stats.peak_inflight_bytes <= SMALL_BUDGET


def stand_in(name: str, spec: TensorSpec) -> torch.Tensor | None:
    """``load(weights_on_device=True)``'s destinations: a stand-in on "meta" for each tensor of
    1 MiB or more, which ``device_empty`` makes real when its reads start."""
    return torch.empty(spec.shape, dtype=spec.torch_dtype, device="meta") if spec.nbytes >= 1 << 20 else None


class Made:
    """``device_empty`` on the CPU: a NaN-filled host tensor for each stand-in, each kept weakly
    in ``made``."""

    def __init__(self) -> None:
        self.made: list[weakref.ref[torch.Tensor]] = []

    def __call__(self, like: torch.Tensor) -> torch.Tensor:
        assert like.is_meta
        t = torch.full(like.shape, float("nan"), dtype=like.dtype)
        self.made.append(weakref.ref(t))
        return t


async def test_stand_in_destinations_become_tensors_of_the_consumers_own(write: Callable[..., Path]) -> None:
    """``load(weights_on_device=True)``'s path on the CPU: each large tensor's destination is a
    stand-in on "meta", made real when its reads start (``device_empty``), read in pieces with
    copies that run late, and no longer held by the stream once handed out: the consumer's
    dropping it frees it."""
    ts = tensors(n=16, seed=8)
    path = write(ts)
    copies = LateCopies()
    empty = Made()
    made = empty.made

    big = [n for n in ts if ts[n].nbytes >= 1 << 20]
    stream = TensorStream(
        path,
        destinations=stand_in,
        device_copy=copies,
        device_empty=empty,
        max_inflight_bytes=SMALL_BUDGET,
        chunk_bytes=1 << 20,
    )
    alive_after_drop = 0
    async with stream:
        async for name, t in stream:
            assert torch.equal(t, ts[name]), name
            if name in big:
                (ref,) = [r for r in made if r() is t]  # the tensor made for it, not a view of a buffer
                del t
                gc.collect()
                alive_after_drop += ref() is not None
    copies.pool.shutdown(wait=True)
    assert len(made) == len(big) and stream.stats.staged_bytes == sum(ts[n].nbytes for n in big)
    assert alive_after_drop == 0, "the stream still held tensors handed out"
    assert stream.stats.peak_inflight_bytes <= SMALL_BUDGET


@pytest.mark.parametrize("tensor_stage", [False, True])
async def test_renames_and_filters_keep_stand_ins_a_tensor_stage_does_not(
    write: Callable[..., Path], tensor_stage: bool
) -> None:
    """Leading renames and filters act on the plan, so tensors still come made for the consumer;
    after a tensor stage (``map``) every tensor is a host tensor from a buffer, as the stage saw it."""
    ts = tensors(n=8, seed=13)
    path = write(ts)
    empty = Made()
    made = empty.made

    stages: list[Any] = [aload.stages.drop(r"\.norm$"), aload.stages.rename([(r"^layers\.", "model.layers.")])]
    if tensor_stage:
        stages.append(aload.stages.map(lambda name, t: t))
    copies = LateCopies()
    stream = TensorStream(
        path, stages=stages, destinations=stand_in, device_copy=copies, device_empty=empty, chunk_bytes=1 << 20
    )
    got = {}
    async with stream:
        async for name, t in stream:
            got[name] = (t.clone(), any(r() is t for r in made))
    copies.pool.shutdown(wait=True)
    want = {"model." + n: t for n, t in ts.items() if not n.endswith(".norm")}
    assert got.keys() == want.keys() and all(torch.equal(got[n][0], want[n]) for n in want)
    big = {n for n, t in want.items() if t.nbytes >= 1 << 20}
    assert {n for n, (_, own) in got.items() if own} == (set() if tensor_stage else big)
    assert len(made) == (0 if tensor_stage else len(big))


@pytest.mark.parametrize("keep", [False, True])
async def test_tensors_made_to_hand_on_stay_within_their_bound(
    write: Callable[..., Path], monkeypatch: pytest.MonkeyPatch, keep: bool
) -> None:
    """At most ``DEVICE_AHEAD_BYTES`` of them alive at once, one larger alone; a consumer that
    keeps every one still gets the next (it would wait for itself otherwise)."""
    monkeypatch.setattr(reader_module, "DEVICE_AHEAD_BYTES", 8 << 20)
    ts = tensors(n=24, seed=11)  # tensors of 5.3 and 1.3 MiB among the small ones
    path = write(ts)
    alive: dict[int, int] = {}
    most = [0]

    def empty(like: torch.Tensor) -> torch.Tensor:
        t = torch.empty(like.shape, dtype=like.dtype)
        alive[id(t)] = t.nbytes
        weakref.finalize(t, alive.pop, id(t))
        most[0] = max(most[0], sum(alive.values()))
        return t

    kept = []
    copies = LateCopies()
    stream = TensorStream(
        path, destinations=stand_in, device_copy=copies, device_empty=empty, chunk_bytes=1 << 20, concurrency=8
    )
    async with stream:
        async for name, t in stream:
            assert torch.equal(t, ts[name]), name
            await asyncio.sleep(0.005)  # the consumer's work: the reader runs ahead meanwhile
            if keep:
                kept.append(t)
            del t
    copies.pool.shutdown(wait=True)
    big = [t.nbytes for t in ts.values() if t.nbytes >= 1 << 20]
    assert len(kept) == (len(ts) if keep else 0)
    if keep:
        assert most[0] == sum(big)  # every one made, none dropped: the bound gave way
    else:
        assert max(big) < most[0] <= 8 << 20  # more than one at once, never past the bound


async def test_a_stream_left_early_lets_go_of_the_tensors_it_made(write: Callable[..., Path]) -> None:
    """Leaving the stream after the first large tensor: nothing made for the ones behind it is
    held once the stream is closed, and the one kept stays the consumer's."""
    ts = tensors(n=16, seed=12)
    path = write(ts)
    empty = Made()
    made = empty.made

    copies = LateCopies()
    stream = TensorStream(
        path, destinations=stand_in, device_copy=copies, device_empty=empty, chunk_bytes=1 << 20, concurrency=4
    )
    kept: tuple[str, torch.Tensor] | None = None
    async with stream:
        async for name, t in stream:
            if t.nbytes >= 1 << 20:
                kept = (name, t)
                break
    copies.pool.shutdown(wait=True)
    reader = weakref.ref(stream.reader)
    del stream, t
    await asyncio.sleep(0.01)  # the releases already asked for run on the loop
    gc.collect()
    assert kept is not None and torch.equal(kept[1], ts[kept[0]])
    assert reader() is None  # the tensor kept does not keep the reader (nor its plan)
    assert len(made) > 1  # the reader had made more ahead of the consumer
    assert [r for r in made if r() is not None and r() is not kept[1]] == []


async def test_no_gpu_memory_for_a_stand_in_is_a_load_error_naming_the_tensor(write: Callable[..., Path]) -> None:
    ts = tensors(n=4, seed=10)
    path = write(ts)

    def empty(like: torch.Tensor) -> torch.Tensor:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 5.31 MiB")

    stream = TensorStream(
        path, destinations=stand_in, device_copy=LateCopies(), device_empty=empty, chunk_bytes=1 << 20
    )
    with pytest.raises(aload.LoadError, match="out of GPU memory") as err:
        async with stream:
            async for _ in stream:
                pass
    first_big = next(n for n, t in ts.items() if t.nbytes >= 1 << 20)
    assert err.value.tensor == first_big and err.value.byte_range is not None


@gpu
async def test_weights_on_device_hands_load_weights_its_large_tensors_on_the_gpu(write: Callable[..., Path]) -> None:
    ts = tensors(seed=9)
    path = write(ts)
    seen: dict[str, torch.device] = {}

    class OnDevice(Engine):
        def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
            def noted() -> Iterator[tuple[str, torch.Tensor]]:
                for name, t in weights:
                    seen[name] = t.device
                    yield name, t

            return super().load_weights(noted())

    engine = OnDevice(ts)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    report = await aload.load(engine, path, weights_on_device=True, max_inflight_bytes=SMALL_BUDGET)
    assert report.staged_bytes == staged_part(ts) and "GB on to the GPU in pinned pieces" in report.summary()
    assert {n for n, d in seen.items() if d.type == "cuda"} == {n for n, t in ts.items() if t.nbytes >= 1 << 20}
    assert_holds(engine.inner, ts)
    gc.collect()
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == before  # every tensor made for the load was freed


async def test_a_destination_off_the_cpu_without_a_stream_to_copy_on_is_not_read_into(
    write: Callable[..., Path],
) -> None:
    ts = tensors(n=4, seed=7)
    path = write(ts)
    meta = {n: torch.empty_like(t, device="meta") for n, t in ts.items()}
    stream = TensorStream(path, destinations=lambda name, spec: meta[name])
    got = {}
    async with stream:
        async for name, t in stream:
            got[name] = t.clone()
    assert got.keys() == ts.keys() and all(torch.equal(got[n], ts[n]) for n in ts)
    assert stream.stats.staged_bytes == 0 and stream.stats.direct_bytes == 0


@pytest.mark.parametrize("scenario", ["warm", "cold"])
async def test_pinned_memory_is_made_on_a_thread_and_none_outside_the_arena(
    write: Callable[..., Path], monkeypatch: pytest.MonkeyPatch, scenario: str
) -> None:
    """Pinning costs ~0.5 ms a MiB (an H200 host): the arena is pinned on the reader's helper
    thread, not on the loop, and a tensor larger than the budget is never pinned: a view of the
    mapping where the file is in the page cache, else fresh memory faulted in on that thread.
    On the CPU plain allocations stand in for pinned ones, each noting the thread that made it."""
    import numpy as np

    import aload.arena
    import aload.reader

    made: list[tuple[int, bool, str]] = []
    faulted: list[str] = []

    def host_array(n: int, pin: bool) -> np.ndarray[Any, Any]:
        made.append((n, pin, threading.current_thread().name))
        return np.empty(n, dtype=np.uint8)

    def prefault(arr: np.ndarray[Any, Any], start: int, end: int) -> None:
        faulted.append(threading.current_thread().name)

    monkeypatch.setattr(aload.arena, "host_array", host_array)
    monkeypatch.setattr(aload.reader, "host_array", host_array)
    monkeypatch.setattr(aload.reader, "prefault", prefault)
    ts = {"big": torch.randn(3 << 18), **tensors(n=4, seed=8)}  # 3 MiB, over the 2 MiB budget
    path = write(ts)
    if scenario == "cold":
        drop_cache(path)
    got = {}
    stream = TensorStream(path, pin=True, max_inflight_bytes=2 << 20, chunk_bytes=1 << 20)
    async with stream:
        async for name, t in stream:
            got[name] = t.clone()
    assert got.keys() == ts.keys() and all(torch.equal(got[n], ts[n]) for n in ts)
    main = threading.main_thread().name
    assert [(n, thread != main) for n, pin, thread in made if pin] == [(2 << 20, True)]  # the arena alone
    fresh = [n for n, pin, _ in made if not pin]
    if scenario == "warm":
        assert fresh == []  # views of the mapping
    else:  # what is still on the disk when its turn comes (the reads before bring some in)
        assert any(n > 2 << 20 for n in fresh)  # (an overdraft of a small run may come too)
        assert len(faulted) == len(fresh) and main not in faulted
