"""Into a device's memory through a pool of host buffers: each read of a tensor bound for the
device lands in a slab of the pool (pinned where CUDA is present), the slab's bytes are copied
to the tensor's place on the device on a copy stream (``non_blocking``), and the slab goes back
to the pool with an event recorded after that copy: it is lent again only once the event has
completed, never while the copy may still be reading it.

Many reads are in flight at once (the reader's ``concurrency``), each with a slab of its own,
so reading the next slab overlaps copying the last. The pool holds ``pinned_bytes`` at most, in
slabs of the chunk size, allocated as first needed. On a machine without CUDA the same path runs
with plain host memory and synchronous copies (a dry run of the logic, not of its speed).
"""

from __future__ import annotations

import asyncio
import collections
import functools
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import torch

from ..errors import UsageError
from ..sources import byte_tensor


class Event(Protocol):
    """What the pool needs of a CUDA event (``torch.cuda.Event``), so that tests can stand in."""

    def record(self, stream: Any = None) -> None: ...
    def query(self) -> bool: ...
    def synchronize(self) -> None: ...


class _Done:
    """The event of a synchronous copy: complete when recorded."""

    def record(self, stream: Any = None) -> None:
        pass

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


#: Host memory the pool may hold by default (``pinned_bytes``).
DEFAULT_PINNED_BYTES = 256 << 20


class Staging:
    """The pool of slabs and the copies out of them, for one load onto ``device``."""

    def __init__(
        self,
        device: torch.device,
        run: Callable[..., Awaitable[Any]],
        *,
        slab_bytes: int,
        pinned_bytes: int = DEFAULT_PINNED_BYTES,
        events: Callable[[], Event] | None = None,
    ) -> None:
        if pinned_bytes < slab_bytes:
            raise UsageError(f"pinned_bytes ({pinned_bytes}) must hold at least one chunk ({slab_bytes} bytes)")
        self.device = device
        self._cuda = device.type == "cuda"
        self._run = run
        self.slab_bytes = slab_bytes
        self.slabs = pinned_bytes // slab_bytes
        self.stream: Any = torch.cuda.Stream(device) if self._cuda else None  # type: ignore[no-untyped-call]
        self._events = events or (torch.cuda.Event if self._cuda else _Done)
        self._made = 0
        self._free: list[torch.Tensor] = []
        self._pending: collections.deque[tuple[Event, torch.Tensor]] = collections.deque()
        self._back: asyncio.Event | None = None  # set when a slab comes back to the pool
        self.waits = 0  # times a read waited for a copy to finish before it had a slab

    async def _take(self) -> torch.Tensor:
        while True:
            self._reap()
            if self._free:
                slab = self._free.pop()
            elif self._made < self.slabs:
                self._made += 1  # pinning memory takes a while: on a thread
                slab = await self._run(functools.partial(torch.empty, self.slab_bytes, dtype=torch.uint8, pin_memory=self._cuda))
            elif self._pending:
                self.waits += 1
                await self._run(self._pending[0][0].synchronize)  # the oldest copy, off the loop
                continue
            else:  # every slab is lent to a read in progress: wait for one to come back
                self.waits += 1
                self._back = self._back or asyncio.Event()
                self._back.clear()
                await self._back.wait()
                continue
            return slab

    def _reap(self) -> None:
        while self._pending and self._pending[0][0].query():
            self._free.append(self._pending.popleft()[1])

    def _give(self, slab: torch.Tensor) -> None:
        """Back to the pool, behind an event recorded on the copy stream after its last copy."""
        event = self._events()
        event.record(self.stream)
        self._pending.append((event, slab))
        if self._back is not None:
            self._back.set()

    def _load(self, source: Any, offset: int, dest: torch.Tensor, at: int, slab: torch.Tensor, n: int) -> None:
        """On a thread: ``n`` bytes from ``offset`` into the slab, then its copy to bytes
        ``at .. at + n`` of ``dest`` queued."""
        source.readinto(offset, memoryview(slab[:n].numpy()))  # type: ignore[arg-type]
        self._copy(dest, at, slab, n)

    def _copy(self, dest: torch.Tensor, at: int, slab: torch.Tensor, n: int) -> None:
        view = byte_tensor(dest)[at : at + n]
        if self.stream is not None:
            with torch.cuda.stream(self.stream):
                view.copy_(slab[:n], non_blocking=True)
        else:
            view.copy_(slab[:n])

    async def fill(self, source: Any, offset: int, dest: torch.Tensor, at: int, n: int) -> None:
        """Bytes ``at .. at + n`` of the tensor stored at ``offset`` of ``source`` into the same
        bytes of ``dest`` (a contiguous tensor on the device), one slab at a time."""
        for o in range(0, n, self.slab_bytes):
            m = min(self.slab_bytes, n - o)
            slab = await self._take()
            try:
                await self._run(self._load, source, offset + at + o, dest, at + o, slab, m)
            finally:
                self._give(slab)

    async def drain(self) -> None:
        """Every copy queued has completed (before the tensors are handed on, or the pool goes)."""
        while self._pending:
            event, slab = self._pending.popleft()
            if not event.query():
                await self._run(event.synchronize)
            self._free.append(slab)
