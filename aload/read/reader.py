"""The reader: concurrent ranged reads, bounded by a byte budget, delivered in plan order.

Bytes read into the reader's buffers (or viewed in a file's mapping) count against
``max_inflight_bytes`` from the moment their unit is started until every tensor viewing them
is dead; a unit waits for budget before its reads start. Units wait for their consumer in a
bounded ``asyncio.Queue``; reads in flight are bounded by ``concurrency``. Bytes read straight
into a destination (the model's own memory) use no budget.

Two cases step outside the budget, one unit at a time, so that a load never deadlocks: a unit
larger than the whole budget is read alone, once everything else is released; and a consumer
that holds on to tensors until the budget is spent, then waits for the next one, gets it
anyway ("overdraft", counted in ``ReaderStats.overdraft_bytes``).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import itertools
import os
import threading
import time
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..errors import GroupError, UsageError
from ..sources import Source, aligned_empty, byte_tensor
from .plan import Plan, Unit
from .share import Share
from .staging import Staging
from .verify import ShardHash

DEFAULT_MAX_INFLIGHT_BYTES = 512 * 1024 * 1024
#: Reads in flight: enough to keep a fast disk or a network link busy, one per core on larger hosts.
DEFAULT_CONCURRENCY = min(16, max(4, os.cpu_count() or 4))
#: Pairs handed out between two turns of the event loop: tensors already read come without a
#: wait, and a consumer that never awaits would otherwise hold the loop for a whole unit.
YIELD_EVERY = 256

#: Tensors cut from a buffer by one call, at most (``cut``).
CUT_RUN = 256

Pair = tuple[str, torch.Tensor]
Run = Callable[..., Awaitable[Any]]


@dataclass
class ReaderStats:
    tensors: int = 0
    bytes: int = 0
    bytes_read: int = 0
    reads: int = 0
    inflight_bytes: int = 0
    peak_inflight_bytes: int = 0
    budget_wait_s: float = 0.0
    budget_waits: int = 0  # times a unit waited for budget
    overdraft_bytes: int = 0
    direct_bytes: int = 0  # read straight into destinations
    bytes_received: int = 0  # read by another rank of the group and shared with this one
    ttft_s: float | None = None
    opened_s: float | None = None
    planned_s: float | None = None
    verified_shards: int = 0


@dataclass
class Progress:
    tensors: int
    tensors_total: int
    bytes: int
    bytes_total: int
    elapsed_s: float


def first_tensor(ttft_s: float | None, opened_s: float | None, planned_s: float | None) -> str:
    """The time to first tensor and what came before it, as ``235.4 ms (headers parsed at 192,
    plan at 234)``: ms from the start until the checkpoint was open and the plan made."""
    if ttft_s is None:
        return "-"
    if opened_s is None or planned_s is None:
        return f"{ttft_s * 1e3:.1f} ms"
    return f"{ttft_s * 1e3:.1f} ms (headers parsed at {opened_s * 1e3:.0f}, plan at {planned_s * 1e3:.0f})"


def check_positive(**values: Any) -> None:
    for key, value in values.items():
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            unit = "bytes" if "bytes" in key else "requests"
            raise UsageError(f"{key} must be a positive integer number of {unit}, got {value!r}")


class Budget:
    """Bytes in flight against a capacity; the producer waits in ``acquire``."""

    def __init__(self, capacity: int, stats: ReaderStats) -> None:
        self.capacity = capacity
        self.used = 0
        self._stats = stats
        self._wake: asyncio.Future[None] | None = None
        self._overdraft = False

    @property
    def waiting(self) -> bool:
        return self._wake is not None

    async def acquire(self, n: int) -> None:
        t = time.perf_counter()
        while self.used and self.used + n > self.capacity and not self._overdraft:
            self._stats.budget_waits += 1
            self._wake = asyncio.get_running_loop().create_future()
            try:
                await self._wake
            finally:
                self._wake = None
        if self.used and self.used + n > self.capacity:
            self._stats.overdraft_bytes += n
        self._overdraft = False
        self.used += n
        self._stats.budget_wait_s += time.perf_counter() - t
        self._stats.inflight_bytes = self.used
        self._stats.peak_inflight_bytes = max(self._stats.peak_inflight_bytes, self.used)

    def release(self, n: int) -> None:
        self.used -= n
        self._stats.inflight_bytes = self.used
        self._poke()

    def overdraft(self) -> None:
        """The consumer waits and holds everything: let the next unit through."""
        if self._wake is not None:
            self._overdraft = True
            self._poke()

    def _poke(self) -> None:
        if self._wake is not None and not self._wake.done():
            self._wake.set_result(None)


def _released(ref: weakref.ref[Reader], cost: int, source: Source | None, start: int, n: int) -> None:
    """The last tensor viewing a buffer is dead (on whichever thread dropped it)."""
    if source is not None:
        source.release(start, n)
    reader = ref()
    if reader is None:
        return
    if threading.get_ident() == reader._thread:  # dropped on the loop: returned at once
        reader._budget.release(cost)
        return
    try:
        reader._loop.call_soon_threadsafe(reader._budget.release, cost)
    except RuntimeError:  # the loop is closed: the load is over
        pass


def cut(unit: Unit, buf: np.ndarray[Any, Any] | None) -> list[Pair]:
    """The (name, tensor) pairs of ``unit``: its destinations, or views of ``buf`` (a copy
    where a tensor's bytes are misaligned for its dtype)."""
    if unit.into or buf is None:
        return [(it.name, it.dest) for it in unit.items if not it.skip]  # type: ignore[misc]
    base = torch.from_numpy(buf)
    addr = buf.ctypes.data
    items, out, i = unit.items, [], 0
    while i < len(items):
        spec = items[i].spec
        size = spec.itemsize
        if spec.nbytes and not items[i].offset % size and not (addr + items[i].offset) % size:
            # A run of neighbours of one dtype: cut by one split, not three calls a tensor (at most
            # CUT_RUN at once: the call holds the GIL while it makes every tensor of the run).
            j = i + 1
            while j < len(items) and j - i < CUT_RUN and items[j].spec.dtype == spec.dtype and items[j].spec.nbytes:
                j += 1
            lo, hi = items[i].offset, items[j - 1].offset + items[j - 1].spec.nbytes
            pieces = base[lo:hi].view(spec.torch_dtype).split_with_sizes([it.spec.nbytes // size for it in items[i:j]])
            for it, piece in zip(items[i:j], pieces, strict=True):
                if not it.skip:
                    t = piece if len(it.spec.shape) == 1 else piece.view(it.spec.shape)
                    out.append((it.name, t if it.narrow is None else t.narrow(*it.narrow)))
            i = j
            continue
        it = items[i]
        if not it.skip:  # no bytes, or misaligned for its dtype: a tensor of its own
            t = torch.empty(spec.shape, dtype=spec.torch_dtype)
            if spec.nbytes:
                t.view(-1).view(torch.uint8).copy_(base[it.offset : it.offset + spec.nbytes])
            out.append((it.name, t if it.narrow is None else t.narrow(*it.narrow)))
        i += 1
    return out


class Reader:
    def __init__(
        self,
        plan: Plan,
        run: Run,
        *,
        max_inflight_bytes: int,
        concurrency: int,
        chunk_bytes: int,
        progress: Callable[[Progress], None] | None = None,
        t0: float | None = None,
        hashes: dict[str, ShardHash] | None = None,
        share: Share | None = None,
        staging: Staging | None = None,
    ) -> None:
        self.plan = plan
        self._share = share
        self._staging = staging
        self.stats = ReaderStats()
        self._run = run
        self._chunk = chunk_bytes
        self._loop = asyncio.get_running_loop()
        self._thread = threading.get_ident()
        self._budget = Budget(max_inflight_bytes, self.stats)
        self._slots = asyncio.Semaphore(concurrency)
        self._queue: asyncio.Queue[tuple[Unit, asyncio.Future[Any]] | None] = asyncio.Queue(max(2, concurrency))
        self._producer: asyncio.Future[None] | None = None
        self._tasks: set[asyncio.Future[Any]] = set()
        self._progress = progress
        self._t0 = time.perf_counter() if t0 is None else t0
        self._hashes = hashes
        self._last = {u.items[0].spec.shard: u for u in plan.units if u.items}
        self._getting = False
        #: Set by a consumer that is not this reader's own caller (the bridge's thread): whether
        #: it waits with nothing left to take. None: the caller of ``units`` is the consumer.
        self.consumer_starving: Callable[[], bool] | None = None

    # -- reading ---------------------------------------------------------------------------
    async def _produce(self) -> None:
        for index, unit in enumerate(self.plan.units):
            cost = 0 if unit.into else unit.nbytes
            await self._budget.acquire(cost)
            read = self._read(unit, cost) if self._share is None else self._shared(index, unit, cost)
            task = asyncio.ensure_future(read)
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
            await self._queue.put((unit, task))
            del task
        await self._queue.put(None)

    async def _slot(self, read: Callable[..., Awaitable[None]], *args: Any) -> None:
        async with self._slots:
            await read(*args)
        self.stats.reads += 1

    def _chunks(self, unit: Unit) -> list[tuple[int, int]]:
        """(offset within the unit, length) of each read; boundaries on the source's alignment."""
        align = unit.source.align
        cuts = [0]
        while unit.nbytes - cuts[-1] > self._chunk:
            nxt = (unit.start + cuts[-1] + self._chunk) // align * align - unit.start
            cuts.append(max(nxt, cuts[-1] + align))
        cuts.append(unit.nbytes)
        return [(a, b - a) for a, b in itertools.pairwise(cuts) if b > a]

    async def _read(self, unit: Unit, cost: int) -> np.ndarray[Any, Any] | None:
        src = unit.source
        if unit.into:  # one large tensor, read straight into its destination (through the staging pool)
            dest = unit.items[0].dest
            fill = src.aread_into if self._staging is None else functools.partial(self._staging.fill, src)
            await asyncio.gather(*(self._slot(fill, unit.start, dest, o, n) for o, n in self._chunks(unit)))
            self.stats.direct_bytes += unit.nbytes
            self.stats.bytes_read += unit.nbytes
            return None
        buf = await src.abuffer(unit.start, unit.nbytes)
        if cost:
            weakref.finalize(buf, _released, weakref.ref(self), cost, src, unit.start, unit.nbytes)
        await asyncio.gather(*(self._slot(src.afill, buf, unit.start, o, n) for o, n in self._chunks(unit)))
        self.stats.bytes_read += unit.nbytes
        return buf

    async def _shared(self, index: int, unit: Unit, cost: int) -> np.ndarray[Any, Any] | None:
        """Unit ``index`` read here, or by the rank that reads it and shared (``share.py``)."""
        share = self._share
        assert share is not None
        if share.mode != "broadcast" or share.owners[index] < 0:
            return await self._read(unit, cost)
        if share.reads(index):
            try:
                buf = await self._read(unit, cost)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # every rank learns of it, then this rank raises its own error
                with contextlib.suppress(GroupError):
                    await share.exchange(index, unit, None, exc)
                raise
        elif unit.into:
            buf = None
        else:
            buf = aligned_empty(unit.start, unit.nbytes)
            if cost:
                weakref.finalize(buf, _released, weakref.ref(self), cost, None, 0, 0)
        dest = unit.items[0].dest if unit.into else None
        data = byte_tensor(dest) if dest is not None else torch.from_numpy(buf)
        await share.exchange(index, unit, data)
        if not share.reads(index):
            self.stats.bytes_received += unit.nbytes
        return buf

    # -- delivery --------------------------------------------------------------------------
    async def units(self) -> AsyncIterator[tuple[Unit, np.ndarray[Any, Any] | None]]:
        """Each unit in plan order once read (and hashed), with the buffer its tensors are cut from."""
        self._producer = asyncio.ensure_future(self._produce())
        while True:
            entry = await self._next()
            if entry is None:
                break
            unit, task = entry
            del entry
            buf = await task
            del task
            if self._hashes is not None and unit.items:
                await self._hash(unit, buf)
            yield unit, buf
            del buf
        if self._hashes is not None:  # shards with no tensor bytes: the digest is the header's
            for shard, sha in self._hashes.items():
                if shard not in self._last:
                    sha.check()
                    self.stats.verified_shards += 1
        if self._staging is not None:  # the copies to the device are complete before the load is
            await self._staging.drain()
        if self._share is not None:  # every rank got every unit, or all raise
            await self._share.finish()

    async def _hash(self, unit: Unit, buf: np.ndarray[Any, Any] | None) -> None:
        assert self._hashes is not None
        shard = unit.items[0].spec.shard
        sha = self._hashes[shard]
        if buf is not None and len(buf):
            await self._run(sha.update, memoryview(buf))  # type: ignore[arg-type]
        if self._last[shard] is unit:
            sha.check()
            self.stats.verified_shards += 1

    async def items(self) -> AsyncIterator[Pair]:
        """The tensors in plan order; each owns its memory until the consumer drops it."""
        n = 0
        async for unit, buf in self.units():
            pairs = collections.deque(cut(unit, buf))
            del buf
            self.account(unit)
            while pairs:
                yield pairs.popleft()
                n += 1
                if n % YIELD_EVERY == 0:
                    await asyncio.sleep(0)

    def account(self, unit: Unit) -> None:
        """Count ``unit``'s tensors as delivered (on the loop)."""
        s = self.stats
        if s.ttft_s is None:
            s.ttft_s = time.perf_counter() - self._t0
        for it in unit.items:
            if not it.skip:
                s.tensors += 1
                s.bytes += it.spec.nbytes
        if self._progress is not None:
            p = self.plan
            self._progress(Progress(s.tensors, p.tensors, s.bytes, p.nbytes, time.perf_counter() - self._t0))

    async def _next(self) -> tuple[Unit, asyncio.Future[Any]] | None:
        if not self._queue.empty():
            return self._queue.get_nowait()
        producer = self._producer
        assert producer is not None
        get: asyncio.Future[Any] = asyncio.ensure_future(self._queue.get())
        self._getting = True
        try:
            if self.consumer_starving is None or self.consumer_starving():
                self._budget.overdraft()
            waits: list[asyncio.Future[Any]] = [get, producer]
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            if not get.done():
                get.cancel()
                producer.result()  # raises the producer's error
            entry: tuple[Unit, asyncio.Future[Any]] | None = get.result()
            return entry
        finally:
            self._getting = False
            if not get.done():
                get.cancel()

    def poke(self) -> None:
        """On the loop: the outside consumer has started to wait (see ``consumer_starving``)."""
        if self._getting and self._queue.empty():
            self._budget.overdraft()

    async def aclose(self, error: BaseException | None = None) -> None:
        """Stop producing and wait for every read started (their buffers may still be written).
        In a group, this rank's next step tells the others why it stopped (``error``)."""
        try:
            await self._stop()
            if self._staging is not None:  # no copy still reads a slab, or writes the model, after this
                await self._staging.drain()
        finally:
            if self._share is not None:
                await self._share.farewell(error)
                await self._share.aclose()

    async def _stop(self) -> None:
        pending = [t for t in (self._producer, *self._tasks) if t is not None and not t.done()]
        for t in pending:
            t.cancel()
        if pending:
            await asyncio.wait(pending)
        ended: list[asyncio.Future[Any]] = list(pending)
        while not self._queue.empty():  # queued buffers go, so their bytes return
            entry = self._queue.get_nowait()
            if entry is not None:
                ended.append(entry[1])
        for f in ended:  # a read that failed after the load stopped for another error: nobody's now
            if f.done() and not f.cancelled():
                f.exception()
        self._producer = None
