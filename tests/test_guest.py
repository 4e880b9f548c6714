"""aload is a guest in someone else's process: it hands out plain tensors, changes no process-wide
setting (not even for the length of a load), and maps no executable memory."""

from __future__ import annotations

import gc
import io
import os
import sys
import threading
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
from torch import nn

import aload

from .conftest import llama_like


def settings() -> dict[str, Any]:
    """What a library could change for the whole process."""
    return {
        "gc": (gc.isenabled(), gc.get_threshold(), gc.get_freeze_count()),
        "switch": sys.getswitchinterval(),
        "affinity": sorted(os.sched_getaffinity(0)),
        "nice": os.getpriority(os.PRIO_PROCESS, 0),
        "threads": torch.get_num_threads(),
    }


def thread_settings() -> dict[str, tuple[int, list[int]]]:
    """Each live thread's nice value and cores."""
    out = {}
    for t in threading.enumerate():
        tid = t.native_id
        if tid is None:
            continue
        try:
            out[t.name] = (os.getpriority(os.PRIO_PROCESS, tid), sorted(os.sched_getaffinity(tid)))
        except OSError:
            pass
    return out


def executable_mappings() -> set[str]:
    with open("/proc/self/maps") as f:
        return {line.split()[0] for line in f if line.split()[1][2] == "x"}


class Adopting(nn.Module):
    """A loader that adopts the tensors it is given as its parameters (no copy), as some do."""

    def __init__(self, probe: Callable[[], None]) -> None:
        super().__init__()
        self.probe = probe
        self.types: set[type] = set()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        for name, w in weights:
            self.types.add(type(w))
            self.register_parameter(name.replace(".", "_"), nn.Parameter(w, requires_grad=False))
            self.probe()
        return set()


async def test_plain_tensors_everywhere_and_an_adopted_state_dict_loads_with_weights_only(
    write: Callable[..., Path],
) -> None:
    tensors = {**llama_like(hidden=512), "big": torch.randn(1 << 20)}  # small ones and a 4 MiB one
    path = write(tensors)
    seen: set[type] = set()

    def spy(name: str, t: torch.Tensor) -> torch.Tensor:
        seen.add(type(t))
        return t

    async with aload.stream(path, stages=aload.stages.map(spy)) as s:
        async for _, t in s:
            seen.add(type(t))
    for read in ("cached", "direct"):
        model = Adopting(lambda: None)
        await aload.load(model, path, read=read)
        seen |= model.types
        buf = io.BytesIO()
        torch.save(model.state_dict(), buf)
        buf.seek(0)
        loaded = torch.load(buf, weights_only=True)
        assert all(torch.equal(loaded[k.replace(".", "_")], v) for k, v in tensors.items())
        assert {type(p) for p in model.parameters()} == {nn.Parameter}
    assert seen == {torch.Tensor}


async def test_no_process_wide_setting_changes_during_or_after_a_load(write: Callable[..., Path]) -> None:
    """Sampled on the loader's thread during the load and after it: garbage collector, switch
    interval, affinity and priority of the process and of every thread, torch's thread count."""
    tensors = {**llama_like(hidden=256), "big": torch.randn(1 << 22)}  # 16 MiB: several reads
    path = write(tensors)
    before, threads_before = settings(), thread_settings()
    during: list[dict[str, Any]] = []
    thread_views: list[dict[str, tuple[int, list[int]]]] = []

    def probe() -> None:
        during.append(settings())
        thread_views.append(thread_settings())

    for read in ("cached", "direct"):
        await aload.load(Adopting(probe), path, read=read, chunk_bytes=1 << 20, concurrency=4)
        model = nn.ParameterDict({k.replace(".", "_"): nn.Parameter(torch.zeros_like(v)) for k, v in tensors.items()})
        await aload.load(model, path, read=read, stages=aload.stages.rename(r"\.", "_"))
    assert during and all(d == before for d in during)
    nice, cores = threads_before["MainThread"]
    for view in thread_views:
        aload_threads = {n: v for n, v in view.items() if n.startswith("aload")}
        assert aload_threads and all(v == (nice, cores) for v in aload_threads.values()), aload_threads
    assert settings() == before


async def test_no_executable_memory_is_mapped(write: Callable[..., Path]) -> None:
    path = write({**llama_like(hidden=256), "big": torch.randn(1 << 20)})
    model = nn.Module()
    await aload.load(Adopting(lambda: None), path)  # imports and first-use set-up, once
    await aload.load(model, path, strict=False)
    before = executable_mappings()
    for read in ("cached", "direct"):
        await aload.load(Adopting(lambda: None), path, read=read)
        async with aload.stream(path, read=read) as s:
            async for _ in s:
                pass
    assert executable_mappings() <= before
