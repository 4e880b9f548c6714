"""Tensors handed to a CPU model's ``load_weights`` copy themselves past the CPU's caches
(``aload.handed``): a plain ``copy_`` of the whole tensor goes by the streaming copy, split with
helper threads; any other call is torch's own, with the same results and the same errors."""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import aload
from aload import _ntcopy, _threads, handed
from aload.handed import HandedTensor, copies

from .conftest import count_copies, drop_cache, hf_llama

MiB = 1 << 20

needs_streaming = pytest.mark.skipif(
    _ntcopy.streaming_copy() is None, reason="no non-temporal copy here (not x86-64 Linux with AVX2)"
)


def copier_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("aload-copy")]


class Recording(torch.nn.Module):
    """A vLLM-style model: ``load_weights`` copies each tensor into its parameter by name, and
    notes the type it was handed and the thread it ran on."""

    def __init__(self, shapes: dict[str, torch.Tensor]) -> None:
        super().__init__()
        self.params = {k: torch.zeros_like(v) for k, v in shapes.items()}
        self.types: dict[str, type] = {}

    def load_weights(self, weights: Any) -> set[str]:
        for name, t in weights:
            self.types[name] = type(t)
            self.params[name].data.copy_(t)
        return set(self.params)


@needs_streaming
@pytest.mark.parametrize("cache", ["warm", "cold"])
async def test_a_cpu_models_loader_gets_large_tensors_that_copy_past_the_caches(
    write: Callable[..., Path], monkeypatch: pytest.MonkeyPatch, cache: str
) -> None:
    """From the page cache (views of the mapping) or the disk (the reads' buffers), each tensor
    of the streaming copy's minimum or more is a ``HandedTensor`` whose ``copy_`` goes by the
    streaming copy, split where it is large; smaller ones are plain tensors; the parameters hold
    the checkpoint's bytes and no helper thread outlives the load."""
    g = torch.Generator().manual_seed(3)
    tensors = {
        "big": torch.randn(5 * MiB // 4 + 3, generator=g),  # 5 MiB and 12 bytes: split, uneven
        "mid": torch.randn(256, 512, generator=g),  # 512 KiB: one thread
        "norm": torch.randn(1024, generator=g),  # 4 KiB: torch's copy
        "half": torch.randn(1024, 1024, generator=g).to(torch.bfloat16),
    }
    path = write(tensors)
    if cache == "cold":
        drop_cache(path)
    copied = count_copies(monkeypatch, handed)
    model = Recording(tensors)
    await aload.load(model, path)
    for k, v in tensors.items():
        assert torch.equal(model.params[k], v), k
    assert model.types == {"big": HandedTensor, "mid": HandedTensor, "norm": torch.Tensor, "half": HandedTensor}
    assert sum(copied) == sum(v.nbytes for k, v in tensors.items() if k != "norm")
    if torch.get_num_threads() > 1:
        assert len(copied) > 3  # "big" in pieces
    assert copier_threads() == []


@needs_streaming
async def test_an_engine_with_fused_projections_loads_the_same_bytes_handed_or_not(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``examples/engine_llama.py`` (q, k, v into one ``qkv_proj``, gate and up into one
    ``gate_up_proj``, each part's rows copied by its ``weight_loader``) holds the same parameters
    after a load with handed tensors, whose copies went by the streaming copy, as after one with
    plain tensors."""
    from examples.engine_llama import Config, EngineLlama

    fields = dict(vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=2)
    fields.update(num_attention_heads=4, num_key_value_heads=2)
    hf_llama(**fields).save_pretrained(tmp_path, safe_serialization=True)
    copied = count_copies(monkeypatch, handed)

    async def loaded() -> dict[str, torch.Tensor]:
        torch.manual_seed(1)
        model = EngineLlama(Config(**fields))
        await aload.load(model, tmp_path)
        return {k: v.detach().clone() for k, v in model.state_dict().items()}

    handed_load = await loaded()
    assert len(copied) >= 8  # every projection of 256 KiB, fused ones part by part
    monkeypatch.setattr(aload.loader, "handing", lambda: None)
    plain_load = await loaded()
    assert handed_load.keys() == plain_load.keys()
    assert all(torch.equal(handed_load[k], plain_load[k]) for k in plain_load)


async def test_with_the_streaming_copy_off_a_model_gets_plain_tensors(
    write: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``ALOAD_STREAMING_COPY=0`` (here: no streaming copy): every tensor handed is a plain one."""
    monkeypatch.setattr(_ntcopy, "_made", True)
    monkeypatch.setattr(_ntcopy, "_streaming", None)
    tensors = {"big": torch.randn(MiB), "norm": torch.randn(64)}
    model = Recording(tensors)
    await aload.load(model, write(tensors))
    assert model.types == {"big": torch.Tensor, "norm": torch.Tensor}
    assert all(torch.equal(model.params[k], v) for k, v in tensors.items())


def handed_tensor(*shape: int, dtype: torch.dtype = torch.float32) -> HandedTensor:
    t = torch.arange(int(np.prod(shape)), dtype=torch.float32).reshape(shape).to(dtype)
    return t.as_subclass(HandedTensor)  # type: ignore[return-value]


@needs_streaming
def test_a_plain_whole_copy_is_the_streaming_copys_and_counts_as_a_change(monkeypatch: pytest.MonkeyPatch) -> None:
    copied = count_copies(monkeypatch, handed)
    src = handed_tensor(512, 256)  # 512 KiB
    dst = torch.zeros(512, 256)
    version = dst._version
    with copies():
        assert dst.copy_(src) is dst
    assert torch.equal(dst, src.as_subclass(torch.Tensor)) and copied == [src.nbytes]
    assert dst._version > version  # autograd sees the change, as after torch's own copy_
    dst.zero_()
    dst.copy_(src, non_blocking=True)  # as the built-in loader copies (nothing to wait for on a CPU)
    assert torch.equal(dst, src.as_subclass(torch.Tensor)) and copied == [src.nbytes] * 2
    # A tensor-parallel shard (rows, contiguous) and a fused projection's part stay the copy's too.
    part = torch.zeros(1024, 256)
    shard = src.narrow(0, 256, 256)
    assert type(shard) is HandedTensor
    part.narrow(0, 512, 256).copy_(shard)
    assert torch.equal(part[512:768], src.as_subclass(torch.Tensor)[256:]) and not part[:512].any()
    assert copied == [src.nbytes, src.nbytes, shard.nbytes]
    assert copier_threads() == []


@needs_streaming
def test_every_other_call_is_torchs_own_with_plain_results(monkeypatch: pytest.MonkeyPatch) -> None:
    """Copies that convert, broadcast or write a non-contiguous destination, and every other
    call, give what torch gives for a plain tensor, and their results are plain tensors; views
    stay handed."""
    copied = count_copies(monkeypatch, handed)
    src = handed_tensor(512, 256)
    plain = src.as_subclass(torch.Tensor)
    cases: list[tuple[torch.Tensor, torch.Tensor]] = []
    for dst in (torch.zeros(512, 256, dtype=torch.float16), torch.zeros(2, 512, 256), torch.zeros(256, 512).t()):
        cases.append((dst.clone().copy_(src), dst.clone().copy_(plain)))
    for got, want in cases:
        assert torch.equal(got, want)
    assert copied == []
    for result in (src * 2, src.double(), src.clone(), src.sum(), torch.add(src, 1), src.to(torch.float16)):
        assert type(result) is torch.Tensor
    assert torch.equal(src * 2, plain * 2)
    for view in (src.view(-1), src.reshape(256, 512), src[3], *src.split(128), *src.chunk(2), src.detach()):
        assert type(view) is HandedTensor


@needs_streaming
def test_a_copy_torch_refuses_is_refused_the_same_way(monkeypatch: pytest.MonkeyPatch) -> None:
    """Into a leaf that requires grad (with grad on), into an inference tensor outside inference
    mode, and between overlapping memory: torch's own error, nothing copied by the streaming
    copy; under ``no_grad`` the leaf is a plain copy again."""
    copied = count_copies(monkeypatch, handed)
    src = handed_tensor(512, 256)
    leaf = torch.nn.Parameter(torch.zeros(512, 256))
    with pytest.raises(RuntimeError, match="leaf Variable that requires grad"):
        leaf.copy_(src)
    with torch.inference_mode():
        frozen = torch.zeros(512, 256)
    with pytest.raises(RuntimeError, match=r"[Ii]nference"):
        frozen.copy_(src)
    base = torch.zeros(2 * 512 * 256)
    overlapping = base[: 512 * 256].as_subclass(HandedTensor)
    with pytest.raises(RuntimeError, match="single memory location"):
        base[1000 : 1000 + 512 * 256].copy_(overlapping)
    assert copied == []
    with torch.no_grad():
        leaf.copy_(src)
    assert torch.equal(leaf.detach(), src.as_subclass(torch.Tensor)) and copied == [src.nbytes]


@pytest.mark.parametrize("n", [4 * MiB, 4 * MiB + 1, 7 * MiB + 4095, 64 * MiB + 12345])
def test_the_helpers_copy_every_byte_of_a_split_copy_and_end(n: int) -> None:
    src = np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8)
    dst = np.zeros(n + 64, dtype=np.uint8)
    helpers = handed._Helpers(3)
    try:
        helpers.copy(dst.ctypes.data, src.ctypes.data, n)
        assert np.array_equal(dst[:n], src) and not dst[n:].any()
        helpers_now = [t for t in threading.enumerate() if t.name.startswith("aload-copy")]
        assert len(helpers_now) == (2 if n >= 2 * handed.SPLIT_PIECE_BYTES else 0)
        if sys.platform.startswith("linux"):  # below the process's priority, as the read threads
            want = min(19, os.getpriority(os.PRIO_PROCESS, os.getpid()) + _threads.read_nice())
            for t in helpers_now:
                deadline = time.monotonic() + 5
                while os.getpriority(os.PRIO_PROCESS, t.native_id or 0) != want and time.monotonic() < deadline:
                    time.sleep(0.001)  # each lowers its own at its start
                assert os.getpriority(os.PRIO_PROCESS, t.native_id or 0) == want
    finally:
        helpers.close()
    assert copier_threads() == []


def test_each_piece_of_a_copy_goes_in_steps_offering_the_core_between_them(monkeypatch: pytest.MonkeyPatch) -> None:
    """A piece copied whole kept its core for tens of ms, the event loop woken beside it waiting
    for the scheduler's next tick: each thread copies ``COPY_STEP_BYTES`` at a time and yields."""
    steps: list[tuple[int, int]] = []  # (thread, bytes)
    yields: list[int] = []
    real_copy, real_yield = handed.copy_bytes, os.sched_yield

    def copy(dst: int, src: int, n: int) -> None:
        steps.append((threading.get_ident(), n))
        real_copy(dst, src, n)

    def sched_yield() -> None:
        yields.append(threading.get_ident())
        real_yield()

    monkeypatch.setattr(handed, "copy_bytes", copy)
    monkeypatch.setattr(os, "sched_yield", sched_yield)
    n = 5 * handed.COPY_STEP_BYTES + 12345  # two pieces, of 2.5 steps each (rounded to pages)
    src = np.random.default_rng(3).integers(0, 256, n, dtype=np.uint8)
    dst = np.zeros(n, dtype=np.uint8)
    helpers = handed._Helpers(2)
    try:
        helpers.copy(dst.ctypes.data, src.ctypes.data, n)
    finally:
        helpers.close()
    assert np.array_equal(dst, src)
    assert max(k for _, k in steps) == handed.COPY_STEP_BYTES and sum(k for _, k in steps) == n
    by_thread = {t: [k for u, k in steps if u == t] for t, _ in steps}
    assert len(by_thread) == 2 and all(len(ks) == 3 for ks in by_thread.values())  # 2.5 steps: 3 copies each
    assert sorted(yields) == sorted(
        t for t, ks in by_thread.items() for _ in ks[1:]
    )  # between steps, not after the last


def test_a_helpers_error_is_raised_by_the_copy_after_every_piece_is_done(monkeypatch: pytest.MonkeyPatch) -> None:
    """A piece that fails on a helper fails the copy, once all pieces are back (none still
    writing into the destination when the caller goes on)."""
    done: list[int] = []
    caller = threading.get_ident()

    def flaky(dst: int, src: int, n: int) -> None:
        if threading.get_ident() != caller:
            raise OSError("piece failed")
        done.append(n)

    monkeypatch.setattr(handed, "copy_bytes", flaky)
    helpers = handed._Helpers(2)
    try:
        with pytest.raises(OSError, match="piece failed"):
            helpers.copy(0, 0, 8 * MiB)
        assert done == [4 * MiB]
    finally:
        helpers.close()
    assert copier_threads() == []
