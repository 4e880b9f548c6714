"""Soak: many consecutive loads in one process leave no file descriptors or threads behind."""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Callable
from pathlib import Path

from torch import nn

import aload
from aload.bench import read_status
from examples.range_server import FileServer

from .conftest import llama_like


class Keep(nn.Module):
    def load_weights(self, weights: object) -> set[str]:
        for _name, t in weights:  # type: ignore[attr-defined]
            t.sum()
        return set()


def census() -> tuple[int, int]:
    return len(os.listdir("/proc/self/fd")), threading.active_count()


async def test_200_local_and_200_http_loads_leak_nothing(sharded: Callable[..., Path]) -> None:
    folder = sharded(llama_like(hidden=128), 3)
    model = nn.Module()
    await aload.load(Keep(), folder)  # warm-up: first-use allocations are not leaks
    fds0, threads0 = census()
    rss0 = read_status("VmRSS")
    for i in range(200):
        await aload.load(Keep() if i % 2 else model, folder, strict=False)
    fds1, threads1 = census()
    rss1 = read_status("VmRSS")
    async with FileServer() as srv:
        srv.add_folder(folder)
        await aload.load(Keep(), srv.url)
        fds2, threads2 = census()
        rss2 = read_status("VmRSS")
        for _ in range(200):
            await aload.load(Keep(), srv.url)
        for _ in range(100):  # the HTTP client closes a connection it let go of a moment later
            fds3, threads3 = census()
            if fds3 <= fds2:
                break
            await asyncio.sleep(0.02)
        rss3 = read_status("VmRSS")
    assert (fds1, threads1) == (fds0, threads0), "local loads left descriptors or threads"
    assert fds3 <= fds2 and threads3 == threads2, "HTTP loads left descriptors, connections or threads"
    # Each load reads ~1.3 MB: a load's worth kept alive per iteration would add 250+ MiB.
    assert rss1 - rss0 < 32 << 20 and rss3 - rss2 < 32 << 20, (rss1 - rss0, rss3 - rss2)
    print(
        f"\nsoak: 200 local + 200 HTTP loads; fds {fds0} -> {fds1}, {fds2} -> {fds3}; threads {threads0} -> "
        f"{threads1}, {threads2} -> {threads3}; RSS {(rss1 - rss0) / 2**20:+.1f} MiB over the local loads, "
        f"{(rss3 - rss2) / 2**20:+.1f} MiB over the HTTP loads"
    )
