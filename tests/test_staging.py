"""Reads bound for a device go through a pool of host buffers (pinned on CUDA): a buffer is lent
again only after the event of the copy that read it has completed. Without a GPU here, the
device is a stand-in whose copies happen late (in stream order, when an event after them
completes, at moments the test's dice pick), so a buffer reused too early shows as wrong bytes; and the whole path runs on the
CPU with ``staging=True``, checked against a load without it."""

from __future__ import annotations

import asyncio
import random
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import aload
from aload.read.staging import Staging


class LateDevice(Staging):
    """A device whose copies run only when the event recorded after them completes."""

    def __init__(self, *args: Any, seed: int, **kwargs: Any) -> None:
        self.queued: list[tuple[torch.Tensor, torch.Tensor, int]] = []
        self.recorded: list[Any] = []
        self.rng = random.Random(seed)
        self.lock = threading.Lock()
        super().__init__(*args, events=self.event, **kwargs)

    def _copy(self, dest: torch.Tensor, at: int, slab: torch.Tensor, n: int) -> None:
        with self.lock:
            self.queued.append((dest.view(-1).view(torch.uint8)[at : at + n], slab, n))

    def event(self) -> Any:
        device = self

        class Late:
            """Recorded on the device's one copy stream: it completes after every copy queued
            before it (and the events before it), at a moment the test's dice pick."""

            def record(self, stream: Any = None) -> None:
                with device.lock:
                    self.work, device.queued = device.queued, []
                    self.done = False
                    device.recorded.append(self)

            def _run(self) -> None:
                with device.lock:
                    while not self.done:
                        first = device.recorded.pop(0)
                        for view, slab, n in first.work:
                            view.copy_(slab[:n])  # the bytes the slab holds now
                        first.done = True

            def query(self) -> bool:
                if not self.done and device.rng.random() < 0.3:
                    self._run()
                return self.done

            def synchronize(self) -> None:
                self._run()

        return Late()


class Bytes:
    """A source over bytes in memory."""

    def __init__(self, data: bytes) -> None:
        self.data = data

    def readinto(self, offset: int, buf: memoryview) -> None:
        buf[:] = self.data[offset : offset + len(buf)]


async def _run(fn: Any, *args: Any) -> Any:
    return await asyncio.to_thread(fn, *args)


@pytest.mark.parametrize("seed", range(4))
async def test_a_buffer_is_never_reused_before_its_copy_completed(seed: int) -> None:
    data = torch.randint(0, 256, (1 << 20,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
    source = Bytes(bytes(data.numpy()))
    dest = torch.zeros(1 << 20, dtype=torch.uint8)
    staging = LateDevice(torch.device("cpu"), _run, slab_bytes=16 << 10, pinned_bytes=48 << 10, seed=seed)
    pieces = [(at, 64 << 10) for at in range(0, 1 << 20, 64 << 10)]
    gate = asyncio.Semaphore(4)  # four reads in flight over three buffers: they must wait for copies

    async def one(at: int, n: int) -> None:
        async with gate:
            await staging.fill(source, 0, dest, at, n)

    await asyncio.gather(*(one(at, n) for at, n in pieces))
    await staging.drain()
    assert torch.equal(dest, data)  # a buffer reused early would have been copied with the wrong bytes
    assert staging.waits > 0  # the pool was short, and waited


async def test_the_staged_path_loads_what_the_direct_one_does(tmp_path: Path) -> None:
    tensors = {f"w{i}": torch.randn(512, 1024 if i % 2 else 600) for i in range(6)}  # 2-4 MiB each
    tensors["small"] = torch.randn(8)
    from safetensors.torch import save_file

    save_file(tensors, str(tmp_path / "model.safetensors"))

    def model() -> nn.ParameterDict:
        return nn.ParameterDict({k: nn.Parameter(torch.zeros_like(v)) for k, v in tensors.items()})

    staged, direct = model(), model()
    report = await aload.load(staged, tmp_path / "model.safetensors", staging=True, pinned_bytes=2 << 20,
                              chunk_bytes=1 << 20)  # fmt: skip
    await aload.load(direct, tmp_path / "model.safetensors", staging=False)
    assert report.direct_bytes == sum(v.nbytes for k, v in tensors.items() if k != "small")
    assert all(torch.equal(staged[k], v) and torch.equal(direct[k], v) for k, v in tensors.items())
    with pytest.raises(aload.UsageError, match="pinned_bytes"):
        await aload.load(model(), tmp_path / "model.safetensors", staging=True, pinned_bytes=1 << 10)
