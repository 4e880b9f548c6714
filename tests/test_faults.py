"""A fault, then a cancellation, at every stage of a load: the original error surfaces, it says
which tensors reached the loader, and no thread, file or connection is left (the autouse
``no_leaks`` fixture checks threads and checkpoint files; sockets are counted here)."""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import AsyncIterator, Callable, Iterable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import aload
from examples.range_server import FileServer

KiB = 1 << 10
NAMES = [f"t{i:02d}" for i in range(12)]
FAIL_AT = 5  # the tensor index where a fault is injected


def sockets() -> int:
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            n += os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
        except OSError:
            pass
    return n


class Failure(Exception):
    """What the injected fault raises (an exception type aload knows nothing about)."""


class Engine(nn.Module):
    """vLLM-style: ``load_weights`` copies each tensor in; post-processing via ``quant_method``."""

    def __init__(self, fail: str | None, gate: threading.Event | None = None) -> None:
        super().__init__()
        for n in NAMES:
            self.register_parameter(n, nn.Parameter(torch.zeros(64, 256), requires_grad=False))
        self.fail, self.gate = fail, gate
        self.seen: list[str] = []
        self.postprocessing = threading.Event()
        self.quant_method = Quant(self)  # the root module is post-processed too

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        for name, t in weights:
            if self.fail == "load_weights" and len(self.seen) == FAIL_AT:
                raise Failure("load_weights failed")
            if self.fail == "cancel_load_weights":
                threading.Event().wait(0.01)  # slow enough to be cancelled part-way
            self.get_parameter(name).data.copy_(t)
            self.seen.append(name)
        return set(self.seen) - ({NAMES[-1]} if self.fail == "strict" else set())


class Quant:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def process_weights_after_loading(self, module: nn.Module) -> None:
        e = self.engine
        e.postprocessing.set()
        if e.fail == "postprocess":
            raise Failure("post-processing failed")
        if e.fail == "cancel_postprocess":
            assert e.gate is not None
            e.gate.wait(10)


def stage_failing_at(name: str) -> Callable[[str, torch.Tensor], torch.Tensor]:
    def fn(n: str, t: torch.Tensor) -> torch.Tensor:
        if n == name:
            raise Failure(f"stage failed on {n}")
        return t

    return fn


def blocking_stage(name: str, reached: asyncio.Event) -> Any:
    async def stage(pairs: AsyncIterator[tuple[str, torch.Tensor]]) -> AsyncIterator[tuple[str, torch.Tensor]]:
        async for n, t in pairs:
            if n == name:
                reached.set()
                await asyncio.Event().wait()  # until cancelled
            yield n, t

    return stage


def failing_hook(model: nn.Module) -> None:
    raise Failure("hook failed")


@pytest.fixture
def path(write: Callable[..., Path]) -> Path:
    g = torch.Generator().manual_seed(5)
    return write({n: torch.randn(64, 256, generator=g) for n in NAMES})  # 64 KiB each: a unit each


def delivered(exc: BaseException) -> list[str]:
    names = getattr(exc, "aload_delivered", None)
    assert names is not None, f"{type(exc).__name__} does not say what was delivered"
    assert any(n.startswith("aload: ") for n in getattr(exc, "__notes__", [])), "no note on how far it got"
    return list(names)


@pytest.mark.parametrize("point", ["source", "stage", "load_weights", "hook", "postprocess", "strict"])
async def test_a_fault_at_each_point(path: Path, point: str) -> None:
    """What was delivered before a fault is a prefix of the file, and the error says so."""
    opts: dict[str, Any] = dict(chunk_bytes=64 * KiB, max_inflight_bytes=256 * KiB, concurrency=2)
    model = Engine(point)
    source: Any = path
    if point == "source":
        # The file shrinks after its header was read: tensor t05 onwards is gone.
        source = await aload.open(path)
        spec = source.specs[NAMES[FAIL_AT]]
        os.truncate(path, spec.start + 1)
    elif point == "stage":
        opts["stages"] = aload.stages.map(stage_failing_at(NAMES[FAIL_AT]))
    elif point == "hook":
        opts["after_load"] = [failing_hook]
    expected = {
        "source": aload.SourceError,
        "stage": Failure,
        "load_weights": Failure,
        "hook": Failure,
        "postprocess": Failure,
        "strict": aload.LoadError,
    }[point]
    try:
        with pytest.raises(expected) as info:
            await aload.load(model, source, **opts)
    finally:
        if isinstance(source, aload.Checkpoint):
            await source.aclose()
    got = delivered(info.value)
    assert got == model.seen or (point == "load_weights" and got[:-1] == model.seen and len(got) == FAIL_AT + 1)
    if point in ("source", "stage", "load_weights"):
        assert len(set(got)) == len(got) and set(got) <= set(NAMES) and NAMES[-1] not in got
        assert got == NAMES[: len(got)] and len(got) <= FAIL_AT + 1
        if point == "source":  # nothing past the cut can have been read
            assert not set(got) & set(NAMES[FAIL_AT:])
        if point == "stage":
            assert NAMES[FAIL_AT] not in got
        assert "partly loaded" in " ".join(info.value.__notes__)
    else:  # everything was in before the failure
        assert got == NAMES
        assert "all" in " ".join(info.value.__notes__)
    if point == "source":
        err = info.value
        assert isinstance(err, aload.SourceError) and err.byte_range is not None and str(path) in str(err)
        assert err.byte_range[0] <= spec.end and err.byte_range[1] > spec.start + 1


@pytest.mark.parametrize("point", ["read", "stage", "load_weights", "postprocess"])
async def test_cancelling_at_each_point(path: Path, point: str) -> None:
    socks = sockets()
    gate = threading.Event()
    model = Engine(f"cancel_{point}", gate)
    reached = asyncio.Event()
    opts: dict[str, Any] = dict(chunk_bytes=64 * KiB, max_inflight_bytes=256 * KiB, concurrency=2)
    async with FileServer() as srv:
        srv.add_folder(path.parent)
        url = f"{srv.url}/{path.name}"
        if point == "read":  # the server stalls mid-checkpoint
            srv.faults[path.name] = [None] * 4 + ["trickle"] * 8
            opts.update(timeout=30)
        if point == "stage":
            opts["stages"] = blocking_stage(NAMES[FAIL_AT], reached)
        task = asyncio.ensure_future(aload.load(model, url, **opts))
        for _ in range(2000):
            await asyncio.sleep(0.005)
            if (
                (point == "read" and len(srv.requests) >= 6)
                # every tensor before the blocked one in: the model's thread takes the last of
                # them some time after the stage has let it go (CI once cancelled before)
                or (point == "stage" and reached.is_set() and len(model.seen) >= FAIL_AT)
                or (point == "load_weights" and len(model.seen) >= 3)
                or (point == "postprocess" and model.postprocessing.is_set())
            ):
                break
        else:
            pytest.fail(f"the load never reached {point}")
        task.cancel()
        if point == "postprocess":
            await asyncio.sleep(0.05)
            assert not task.done()  # post-processing is not interrupted half-way...
            gate.set()  # ...it finishes, then the cancellation is raised
        with pytest.raises(asyncio.CancelledError) as info:
            await task
    got = delivered(info.value)
    assert got == model.seen
    if point == "postprocess":
        assert len(got) == len(NAMES)
    else:
        assert 0 <= len(got) < len(NAMES)
    if point == "stage":
        assert got == NAMES[:FAIL_AT]
    for _ in range(50):  # a transport closed in the last step closes its socket a loop turn later
        if sockets() == socks:
            break
        await asyncio.sleep(0.01)
    assert sockets() == socks, "a connection was left open"


async def test_a_slow_consumer_is_not_an_error(path: Path) -> None:
    class Slow(Engine):
        def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
            for name, t in weights:
                threading.Event().wait(0.02)
                self.get_parameter(name).data.copy_(t)
                self.seen.append(name)
            return set(self.seen)

    model = Slow(None)
    report = await aload.load(model, path, chunk_bytes=64 * KiB, max_inflight_bytes=128 * KiB)
    assert model.seen == NAMES and report.peak_inflight_bytes <= 128 * KiB and report.overdraft_bytes == 0
