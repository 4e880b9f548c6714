"""Loading into models: transformers checkpoints, the built-in loader, phases, hooks, failures."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import aload

from .conftest import hf_llama, llama_like

MiB = 1 << 20


def tiny_llama() -> Any:
    model = hf_llama()
    return model, model.config


@pytest.fixture(scope="module")
def llama_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any, Path]:
    """A tiny Llama saved sharded by transformers (built here, off the test's event loop)."""
    model, cfg = tiny_llama()
    folder = tmp_path_factory.mktemp("llama") / "ckpt"
    model.save_pretrained(folder, max_shard_size="100KB", safe_serialization=True)
    assert (folder / "model.safetensors.index.json").exists()
    return model, cfg, folder


@pytest.mark.parametrize("budget", [64 * 1024, 512 * MiB])
async def test_transformers_sharded_checkpoint_gives_identical_state_and_logits(
    llama_checkpoint: tuple[Any, Any, Path], budget: int
) -> None:
    from transformers import LlamaForCausalLM

    model, cfg, folder = llama_checkpoint
    torch.manual_seed(123)
    fresh = LlamaForCausalLM(cfg).eval()
    report = await aload.load(fresh, folder, max_inflight_bytes=budget)
    want, got = model.state_dict(), fresh.state_dict()
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    ids = torch.tensor([[1, 5, 9, 2, 7]])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, fresh(ids).logits)
    assert report.missing == [] and report.unexpected == [] and report.tensors == len(want)
    assert report.peak_inflight_bytes <= budget and report.bytes_read == report.bytes
    assert report.opened_s is not None and report.planned_s is not None and report.ttft_s is not None
    assert 0 < report.opened_s <= report.planned_s <= report.ttft_s <= report.seconds
    assert "ms (headers parsed at " in report.summary() and "GPU" not in report.summary()


async def test_tied_weights_and_non_persistent_buffers(write: Callable[..., Path]) -> None:
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(10, 4)
            self.head = nn.Linear(4, 10, bias=False)
            self.head.weight = self.embed.weight
            self.register_buffer("position_ids", torch.arange(5), persistent=False)

    src = Tied()
    path = write({"embed.weight": src.embed.weight.detach().clone() + 1, "position_ids": torch.arange(5) * 2})
    dst = Tied()
    report = await aload.load(dst, path)  # strict: the tied head and the buffer are not missing
    assert torch.equal(dst.head.weight, src.embed.weight + 1) and torch.equal(dst.position_ids, torch.arange(5) * 2)
    assert report.missing == [] and report.installed == 2


@pytest.mark.parametrize("count", [1, 15, 16, 17, 40])
async def test_a_waiting_loader_gets_every_pair_when_they_trickle_in(write: Callable[..., Path], count: int) -> None:
    """The bridge wakes a waiting loader in batches; pairs that arrive one at a time, with the
    pump waiting between them, must still reach it (and in order) however many there are, also
    when the budget holds only two of them (a loader left asleep would never release them)."""
    tensors = {f"t{i:02d}": torch.full((1024,), float(i)) for i in range(count)}
    path = write(tensors)

    async def slow(pairs: Any) -> Any:
        async for pair in pairs:
            await asyncio.sleep(0.002)  # the pump waits before each pair
            yield pair

    got: list[tuple[str, torch.Tensor]] = []

    class Engine(nn.Module):
        def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
            got.extend((n, t.clone()) for n, t in weights)
            return set()

    report = await asyncio.wait_for(
        aload.load(Engine(), path, stages=slow, max_inflight_bytes=8192, chunk_bytes=4096), 30
    )
    assert [n for n, _ in got] == list(tensors) and report.tensors == count
    assert all(torch.equal(t, tensors[n]) for n, t in got)


async def test_a_slow_loader_holds_few_whole_units(write: Callable[..., Path]) -> None:
    """Reads run a few units ahead of a slow ``load_weights``, not the whole budget: the bridge
    holds at most ``bridge.MAX_UNITS`` (4) units for the consumer's thread."""
    unit = 64 << 10
    tensors = {f"t{i:03d}": torch.full((unit // 4,), float(i)) for i in range(80)}  # a unit each
    path = write(tensors)
    got: list[str] = []

    class Engine(nn.Module):
        def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
            for name, t in weights:
                threading.Event().wait(0.2 if not got else 0.001)  # stalls at the first tensor
                assert torch.equal(t, tensors[name])
                got.append(name)
            return set()

    report = await aload.load(Engine(), path, chunk_bytes=unit, concurrency=2)
    assert got == list(tensors)
    # Queued in the reader (max(2, concurrency)), one more the producer holds, in the bridge, being
    # cut, and the consumer's previous tensor (``for name, t in weights`` holds it while asking
    # for the next).
    ahead = 2 + 1 + 4 + 1 + 1 + 1
    assert report.peak_inflight_bytes <= ahead * unit, report.peak_inflight_bytes // unit


async def test_strict_reports_missing_and_unexpected(write: Callable[..., Path]) -> None:
    path = write({"lin.weight": torch.ones(3, 2), "extra": torch.ones(1)})

    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(2, 3)

    with pytest.raises(aload.LoadError) as info:
        await aload.load(M(), path)
    assert "lin.bias" in str(info.value) and "extra" in str(info.value)
    m = M()
    report = await aload.load(m, path, strict=False)
    assert report.missing == ["lin.bias"] and report.unexpected == ["extra"]
    assert torch.equal(m.lin.weight, torch.ones(3, 2))


async def test_shape_mismatch_names_both_shapes(write: Callable[..., Path]) -> None:
    path = write({"weight": torch.ones(3, 2), "bias": torch.ones(2)})
    with pytest.raises(aload.LoadError, match=r"shape \[3, 2\] in the checkpoint, \[2, 2\] in the model") as info:
        await aload.load(nn.Linear(2, 2), path)
    assert info.value.tensor == "weight" and info.value.url == str(path)


async def test_builtin_reads_straight_into_parameters_and_converts_dtypes(write: Callable[..., Path]) -> None:
    tensors = llama_like(hidden=1024, dtype=torch.bfloat16)  # matrices of 0.5-4 MiB, small norms
    path = write(tensors)

    class Flat(nn.Module):
        def __init__(self, dtype: torch.dtype) -> None:
            super().__init__()
            for k, v in tensors.items():
                self.register_buffer(k.replace(".", "__"), torch.zeros(v.shape, dtype=dtype))

    same, wider = Flat(torch.bfloat16), Flat(torch.float32)
    rename = aload.stages.rename(r"\.", "__")
    r1 = await aload.load(same, path, stages=rename)
    r2 = await aload.load(wider, path, stages=rename)
    large = sum(t.nbytes for t in tensors.values() if t.nbytes >= 1 << 20)
    small = sum(t.nbytes for t in tensors.values() if t.nbytes < 1 << 20)
    # The large ones read straight into the parameters (no buffer, no copy_); the small ones in
    # a buffer, then copied.
    assert r1.direct_bytes == large
    assert r1.bytes_read == large + small and r1.peak_inflight_bytes <= small
    assert r2.direct_bytes == 0  # float32 targets: read into buffers, converted by copy_
    for k, v in tensors.items():
        assert torch.equal(getattr(same, k.replace(".", "__")), v)
        assert torch.equal(getattr(wider, k.replace(".", "__")), v.float())


class Recorder(nn.Module):
    """vLLM-style: ``load_weights`` and a quant_method post-processed after every load."""

    def __init__(self, log: list[str]) -> None:
        super().__init__()
        self.log = log
        self.w = nn.Parameter(torch.zeros(4), requires_grad=False)
        self.sub = nn.Module()
        self.sub.quant_method = self  # type: ignore[assignment]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        for name, t in weights:
            self.log.append(f"load {name}")
            if name == "w":
                self.w.data.copy_(t)
        return {"w"}

    def process_weights_after_loading(self, module: nn.Module) -> None:
        self.log.append("postprocess")


async def test_phases_in_order_with_hooks(write: Callable[..., Path]) -> None:
    path = write({"w": torch.arange(4.0), "other": torch.ones(2)})
    log: list[str] = []
    report = await aload.load(
        Recorder(log),
        path,
        after_load=[lambda m: log.append("after_load")],
        after_postprocess=[lambda m: log.append("after_post")],
    )
    assert log == ["load other", "load w", "after_load", "postprocess", "after_post"] or log == [
        "load w",
        "load other",
        "after_load",
        "postprocess",
        "after_post",
    ]
    assert report.installed == 1


async def test_an_override_of_one_phase_is_honoured(write: Callable[..., Path]) -> None:
    path = write({"w": torch.arange(4.0)})
    log: list[str] = []

    class NoPost(aload.Loader):
        def postprocess_weights(self, model: nn.Module, device: torch.device) -> None:
            log.append("custom postprocess")

    class Counting(aload.Loader):
        def load_weights_only(self, model: nn.Module, weights: Any, device: torch.device) -> aload.Installed:
            n = sum(1 for _ in weights)
            log.append(f"custom load {n}")
            return aload.Installed({"w"})

    class Dests(aload.Loader):  # asked even though the model has load_weights (aload skips its own)
        def destinations(self, model: nn.Module, device: torch.device) -> Any:
            log.append(f"destinations on {threading.current_thread().name != 'MainThread'}")
            return None

    await aload.load(Recorder(log), path, loader=NoPost())
    await aload.load(Recorder(log), path, loader=Counting())
    await aload.load(Recorder(log), path, loader=Dests())
    assert log == [
        "load w",
        "custom postprocess",
        "custom load 1",
        "postprocess",
        "destinations on True",  # a thread: an override may walk the model
        "load w",
        "postprocess",
    ]


async def test_quantization_postprocess_sees_every_weight(write: Callable[..., Path]) -> None:
    """An int8 quant method: post-processing must see the loaded float weight, not zeros."""

    class Int8:
        def process_weights_after_loading(self, layer: nn.Module) -> None:
            w = layer.weight.data
            scale = w.abs().amax(dim=1, keepdim=True) / 127
            layer.qweight = (w / scale).round().to(torch.int8)
            layer.scale = scale

    torch.manual_seed(0)
    ref = nn.Linear(8, 4, bias=False)
    path = write({"weight": ref.weight.detach().clone()})
    layer = nn.Linear(8, 4, bias=False)
    layer.quant_method = Int8()  # type: ignore[assignment]
    nn.init.zeros_(layer.weight)
    await aload.load(layer, path)
    deq = layer.qweight.float() * layer.scale
    assert (deq - ref.weight).abs().max() <= layer.scale.max() / 2 + 1e-6  # half a quantization step


async def test_loader_error_is_the_one_raised_and_nothing_leaks(write: Callable[..., Path]) -> None:
    path = write({f"t{i}": torch.randn(256, 1024) for i in range(16)})

    seen: list[str] = []

    class Boom(nn.Module):
        def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
            for name, _ in weights:
                seen.append(name)
                if len(seen) == 4:
                    raise KeyError("model code failed")

    with pytest.raises(KeyError, match="model code failed") as info:
        await aload.load(Boom(), path, max_inflight_bytes=2 * MiB, chunk_bytes=MiB)
    assert info.value.aload_delivered == seen  # type: ignore[attr-defined]
    assert any(repr(seen[-1]) in n and "4 tensor(s)" in n for n in getattr(info.value, "__notes__", []))


async def test_pipeline_error_wins_over_what_the_model_made_of_it(write: Callable[..., Path]) -> None:
    path = write({f"t{i}": torch.randn(16) for i in range(8)})

    class Swallow(nn.Module):
        def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
            try:
                for _ in weights:
                    pass
            except ValueError:
                raise RuntimeError("wrapped") from None

    def bad(name: str, t: torch.Tensor) -> torch.Tensor:
        if name == "t5":
            raise ValueError("stage failed on t5")
        return t

    with pytest.raises(ValueError, match="stage failed on t5"):
        await aload.load(Swallow(), path, stages=aload.stages.map(bad))


async def test_cancelling_a_load_stops_the_worker_and_reads(write: Callable[..., Path]) -> None:
    path = write({f"t{i}": torch.randn(256, 1024) for i in range(32)})
    started = threading.Event()
    seen: list[str] = []

    class Slow(nn.Module):
        def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
            for name, _ in weights:
                seen.append(name)
                started.set()
                threading.Event().wait(0.01)

    task = asyncio.ensure_future(aload.load(Slow(), path, max_inflight_bytes=2 * MiB, chunk_bytes=MiB))
    while not started.is_set():
        await asyncio.sleep(0.005)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert 0 < len(seen) < 32
    # no_leaks checks that the worker and reader threads and the files are gone


async def test_loader_that_stops_early_is_an_error(write: Callable[..., Path]) -> None:
    path = write({f"t{i}": torch.randn(16) for i in range(8)})

    class Lazy(nn.Module):
        def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
            next(iter(weights))

    with pytest.raises(aload.LoadError, match="left the rest unread"):
        await aload.load(Lazy(), path)


async def test_a_run_of_tensors_ends_where_the_loader_stops(
    write: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Small tensors reach ``load_weights`` in runs (a unit's, cut at once). A loader that
    fails, returns early or is cancelled in the middle of a run is told apart exactly: what it was
    given is what the error says was delivered, and after a cancel it is given nothing more."""
    from aload.load.bridge import SyncBridge

    CUT_RUN = 256
    n, stop_at = 3 * CUT_RUN, CUT_RUN + CUT_RUN // 2
    path = write({f"t{i:04d}": torch.full((16,), float(i)) for i in range(n)})
    seen: list[str] = []

    class Boom(nn.Module):
        def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
            for name, _ in weights:
                seen.append(name)
                if len(seen) == stop_at:
                    raise KeyError("model code failed")

    class HandsOn(nn.Module):
        def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
            for name, _ in weights:
                seen.append(name)
                if len(seen) == stop_at:  # a submodule's loader, given the same weights, takes some
                    for inner, _ in weights:
                        seen.append(inner)
                        if len(seen) == stop_at + 10:
                            break

    await aload.load(HandsOn(), path)
    assert seen == [f"t{i:04d}" for i in range(n)]  # each once, in order, wherever it was taken

    seen.clear()
    with pytest.raises(KeyError) as info:
        await aload.load(Boom(), path)
    assert info.value.aload_delivered == seen  # type: ignore[attr-defined]
    assert any(f"{stop_at} tensor(s)" in note for note in getattr(info.value, "__notes__", []))

    class Early(nn.Module):
        def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
            it = iter(weights)
            for _ in range(stop_at):
                next(it)

    with pytest.raises(aload.LoadError, match=f"after {stop_at} of {n} tensors"):
        await aload.load(Early(), path)

    closed, reached, resume = threading.Event(), threading.Event(), threading.Event()
    real_close = SyncBridge.close

    def close(self: SyncBridge) -> None:
        real_close(self)
        closed.set()

    monkeypatch.setattr(SyncBridge, "close", close)

    class Paused(nn.Module):
        def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
            for name, _ in weights:
                seen.append(name)
                if len(seen) == stop_at:
                    reached.set()
                    resume.wait()

    seen.clear()
    task = asyncio.ensure_future(aload.load(Paused(), path))
    while not reached.is_set():
        await asyncio.sleep(0.005)
    task.cancel()
    while not closed.is_set():
        await asyncio.sleep(0.005)
    resume.set()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert len(seen) == stop_at  # nothing more of its run after the cancel


async def test_load_sync_refuses_a_running_loop(write: Callable[..., Path]) -> None:
    path = write({"weight": torch.ones(2, 2), "bias": torch.ones(2)})
    with pytest.raises(aload.UsageError, match="running event loop"):
        aload.load_sync(nn.Linear(2, 2), path)


def test_load_sync_from_plain_code(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    save_file({"weight": torch.full((2, 2), 3.0), "bias": torch.ones(2)}, str(tmp_path / "m.safetensors"))
    lin = nn.Linear(2, 2)
    report = aload.load_sync(lin, tmp_path / "m.safetensors")
    assert torch.equal(lin.weight, torch.full((2, 2), 3.0)) and report.tensors == 2


def test_load_under_uvloop_keeps_the_loop_free(tmp_path: Path) -> None:
    """The same load under uvloop: the loop stays responsive and the weights arrive."""
    import uvloop
    from safetensors.torch import save_file

    from .conftest import LOOP_BLOCK_LIMIT_S, LoopWatchdog

    tensors = llama_like(hidden=256)
    save_file(tensors, str(tmp_path / "m.safetensors"))
    seen: dict[str, torch.Tensor] = {}

    class Engine(nn.Module):
        def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
            for name, t in weights:
                seen[name] = t.clone()
            return set()

    async def main() -> float:
        async with LoopWatchdog() as dog:
            await aload.load(Engine(), tmp_path / "m.safetensors", max_inflight_bytes=256 * 1024)
        return dog.worst

    assert uvloop.run(main()) < LOOP_BLOCK_LIMIT_S
    assert seen.keys() == tensors.keys() and all(torch.equal(seen[k], v) for k, v in tensors.items())


def test_post_processing_finds_quant_method_however_it_is_defined() -> None:
    from aload import Loader

    seen: list[str] = []

    class Method:
        def __init__(self, tag: str) -> None:
            self.tag = tag

        def process_weights_after_loading(self, module: nn.Module) -> None:
            seen.append(self.tag)

    class ModuleMethod(nn.Module):  # a quant method that is itself a submodule
        def process_weights_after_loading(self, module: nn.Module) -> None:
            seen.append("submodule")

    class ClassAttr(nn.Linear):
        quant_method = Method("class")

    class Prop(nn.Linear):
        @property
        def quant_method(self) -> Method:
            return Method("property")

    class NoneProp(nn.Linear):
        @property
        def quant_method(self) -> None:
            return None

    inst = nn.Linear(2, 2)
    inst.quant_method = Method("instance")  # type: ignore[assignment]
    sub = nn.Linear(2, 2)
    sub.quant_method = ModuleMethod()
    model = nn.Sequential(inst, ClassAttr(2, 2), Prop(2, 2), NoneProp(2, 2), sub, nn.Linear(2, 2), inst)
    Loader().postprocess_weights(model, torch.device("cpu"))
    assert seen == ["instance", "class", "property", "submodule"]  # inst once, though it is there twice


async def test_loads_running_at_once_in_one_loop_keep_to_their_own_models(tmp_path: Path) -> None:
    """A frontend may load several models at once (a draft model beside the target, adapters):
    each gets its own checkpoint's bytes, and one that fails or is cancelled leaves the others
    to finish."""
    from safetensors.torch import save_file

    def checkpoint(name: str, seed: int) -> tuple[Path, dict[str, torch.Tensor]]:
        g = torch.Generator().manual_seed(seed)
        tensors = {f"t{i}": torch.randn(64, 1024, generator=g) for i in range(12)}
        path = tmp_path / name / "model.safetensors"
        path.parent.mkdir()
        save_file(tensors, str(path))
        return path, tensors

    (pa, ta), (pb, tb), (pc, _) = checkpoint("a", 1), checkpoint("b", 2), checkpoint("c", 3)
    broken = tmp_path / "broken.safetensors"
    broken.write_bytes(pc.read_bytes()[:-1000])  # the last tensor cut short

    class Engine(nn.Module):  # vLLM-style, copying each tensor into its parameter
        def __init__(self) -> None:
            super().__init__()
            self.params = {k: torch.zeros(64, 1024) for k in ta}
            self.started = threading.Event()

        def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
            for name, t in weights:
                self.started.set()
                self.params[name].copy_(t)
                threading.Event().wait(0.002)  # slow enough for the loads to interleave
            return set()

    class Plain(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            for k in ta:
                self.register_parameter(k, nn.Parameter(torch.zeros(64, 1024), requires_grad=False))

    plain, engine, doomed = Plain(), Engine(), Engine()
    small = {"max_inflight_bytes": 2 * MiB, "chunk_bytes": MiB}
    cancelled = asyncio.ensure_future(aload.load(doomed, pc, **small))
    loads = asyncio.gather(
        aload.load(plain, pa, **small),
        aload.load(engine, pb, **small),
        aload.load(Plain(), broken, **small),
        return_exceptions=True,
    )
    while not doomed.started.is_set():
        await asyncio.sleep(0.002)
    cancelled.cancel()
    a, b, bad = await loads
    with pytest.raises(asyncio.CancelledError):
        await cancelled
    assert isinstance(a, aload.LoadReport) and isinstance(b, aload.LoadReport), (a, b)
    assert all(torch.equal(getattr(plain, k), v) for k, v in ta.items())
    assert all(torch.equal(engine.params[k], v) for k, v in tb.items())
    assert isinstance(bad, aload.AloadError) and "broken.safetensors" in str(bad), bad


_CYCLES = """
import asyncio, gc, sys
from pathlib import Path
import torch
from torch import nn
import aload

how, folder = sys.argv[1], Path(sys.argv[2])


class Engine(nn.Module):
    def load_weights(self, weights):
        for _ in weights:
            pass
        return set()


plain = nn.Module()
for i in range(200):
    plain.register_buffer(f"t{i}", torch.zeros(16))


async def main():
    if how == "stream":
        async with aload.stream(folder) as s:
            async for _ in s:
                pass
    elif how.startswith("http"):
        from examples.range_server import FileServer

        async with FileServer() as srv:
            srv.add_folder(folder)
            await aload.load(plain, srv.url)
    else:
        await aload.load(plain if how == "builtin" else Engine(), folder)


asyncio.run(main())  # the first load of a process makes what stays (caches, imports)
gc.collect()
gc.set_debug(gc.DEBUG_SAVEALL)
asyncio.run(main())
gc.collect()
print(sorted({type(o).__qualname__ for o in gc.garbage if type(o).__module__.startswith("aload")}))
"""


@pytest.mark.parametrize("how", ["builtin", "load_weights", "stream", "http"])
def test_a_load_leaves_nothing_for_the_cycle_collector(tmp_path: Path, how: str) -> None:
    """Once a load returns, its objects (a plan of two tracked objects per tensor, the reader, the
    bridge, the store and its sources) are freed at once, not left in a reference cycle for the
    next full collection, which holds the GIL for 150+ ms in a process with a large model in it.
    In a fresh process: in this one, other tests' failed loads leave cycles of their own."""
    import subprocess
    import sys

    from safetensors.torch import save_file

    save_file({f"t{i}": torch.randn(16) for i in range(200)}, str(tmp_path / "model.safetensors"))
    root = Path(__file__).resolve().parent.parent
    done = subprocess.run(
        [sys.executable, "-c", _CYCLES, how, str(tmp_path)], capture_output=True, text=True, cwd=root, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "[]", done.stdout


async def test_a_load_cancelled_during_a_long_walk_leaves_no_thread(
    write: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    from aload import Loader

    walking, real = threading.Event(), Loader.destinations

    def destinations(self: Loader, model: nn.Module, device: torch.device) -> Any:
        walking.set()
        time.sleep(0.2)
        return real(self, model, device)

    monkeypatch.setattr(Loader, "destinations", destinations)
    path = write({"w": torch.ones(4, 4)})
    model = nn.Module()
    model.register_parameter("w", nn.Parameter(torch.zeros(4, 4), requires_grad=False))
    task = asyncio.ensure_future(aload.load(model, path))
    while not walking.is_set():
        await asyncio.sleep(0.005)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert not any(t.name == "aload-worker" and t.is_alive() for t in threading.enumerate())
    assert torch.equal(model.w, torch.zeros(4, 4))


def _flat_model(tensors: dict[str, torch.Tensor]) -> nn.Module:
    model = nn.Module()
    for name, t in tensors.items():
        model.register_parameter(name, nn.Parameter(torch.zeros_like(t), requires_grad=False))
    return model


async def test_a_loader_holding_tensors_between_units_in_place_gets_the_next_anyway(
    write: Callable[..., Path],
) -> None:
    """A loader that keeps every tensor it is given, with units read in place between them, is
    still seen as waiting once the budget runs out: the next unit comes as an overdraft, not a
    deadlock."""
    tensors = {f"t{i:02d}": torch.full((256 * 1024,), float(i)) for i in range(12)}  # 1 MiB each
    path = write(tensors)
    model = _flat_model(tensors)
    kept: list[torch.Tensor] = []

    class Holding(aload.Loader):
        def destinations(self, model: nn.Module, device: torch.device) -> Any:
            real = super().destinations(model, device)
            assert real is not None
            # The odd ones into buffers of the budget, which this loader then keeps.
            return lambda name, spec: real(name, spec) if int(name[1:]) % 2 == 0 else None

        def load_weights_only(self, model: nn.Module, weights: Iterable[Any], device: torch.device) -> Any:
            names = set()
            for name, t in weights:
                target = getattr(model, name)
                if t is not target:
                    target.copy_(t)
                    kept.append(t)
                names.add(name)
            return aload.Installed(names)

    report = await asyncio.wait_for(
        aload.load(model, path, loader=Holding(), max_inflight_bytes=2 * MiB, chunk_bytes=MiB), 60
    )
    assert all(torch.equal(getattr(model, k), v) for k, v in tensors.items())
    assert len(kept) == 6 and report.overdraft_bytes > 0
