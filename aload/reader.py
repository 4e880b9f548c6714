"""The reader: concurrent ranged reads, bounded by a byte budget, delivered in plan order (or
with ``in_order=False``, a load's: units already read may pass one still reading).

Everything read and not yet released by the consumer counts against ``max_inflight_bytes``:
a unit waits for budget before its reads start, and its bytes return to the budget when every
tensor viewing them (and every view derived from those) is dead. A unit's memory (a ``Lease``) is
a view of a mapped file when the source can map (zero copy; the read brings the pages in), else a
region of one arena of ``max_inflight_bytes`` (``aload.arena``), allocated once and reused, so pages are faulted in
once per load instead of once per tensor. Units wait in a bounded ``asyncio.Queue`` in plan order.

Two cases step outside the budget, one unit at a time, so a load never deadlocks:
- a unit larger than the whole budget is read alone once everything else is released;
- a consumer that holds on to tensors until the budget is exhausted, and then waits for the
  next one, gets it anyway ("overdraft", counted in ``ReaderStats.overdraft_bytes``).
  Memory then grows with what the consumer holds: that is the consumer's choice.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import weakref
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ._ntcopy import copy_bytes
from ._syscalls import HUGE, huge_buffer
from ._threads import PAUSE_AFTER_S, hand_back
from .arena import ARENA, MAPPED, OUTSIDE, Arena, Lease, UnitView, byte_view, host_array, prefault, run_at
from .direct import ALIGN
from .errors import LoadError, UsageError
from .integrity import Digests, ShardHash
from .plan import Plan, Unit
from .sources import IOPool, Source

DEFAULT_MAX_INFLIGHT_BYTES = 512 * 1024 * 1024
DEFAULT_CHUNK_BYTES = 16 * 1024 * 1024
#: A unit whose tensors average less than this is taken from the page cache, cold or not.
SMALL_MEAN_BYTES = 64 << 10
#: A view larger than this, dropped on the event loop (an ``aload.stream`` consumer's), has its
#: pages let go in steps of this many bytes, ``RELEASE_TURN_S`` of them a turn of the loop: all
#: at once, 250 MiB of them (``MADV_DONTNEED``) held the loop 3.1-3.4 ms.
RELEASE_STEP_BYTES = 4 << 20
RELEASE_TURN_S = 0.0002

#: A tensor bound for a GPU parameter (``Unit.on_device``) is read a piece of this size at a time
#: into pinned memory, each piece copied on to its part of the parameter on the load's CUDA
#: stream while the next is read; a unit holds ``STAGE_SLOTS`` pieces of the budget at once.
STAGE_PIECE_BYTES = 8 << 20
STAGE_SLOTS = 4
#: The reader's frames for pieces read from disk into host parameters (``Reader._read_through``),
#: each a piece of up to ``STAGE_PIECE_BYTES`` (at most an eighth of the budget each): the read
#: threads' 1 MiB reads queued across several frames while one is copied out of. Cold 4 and 8 GiB
#: built-in, 5 rounds: 4 frames 1,351 and 2,881 ms, 6 frames 1,258 and 2,798, 8 frames 1,270 and
#: 2,785 (docs/benchmarks.md, stop 51).
THROUGH_FRAMES = 6
#: How often a piece waiting to be reused asks whether its copy to the GPU has completed.
STAGE_POLL_S = 0.0002
#: The most bytes of tensors made on the GPU to hand on (``load(weights_on_device=True)``) that
#: a load holds ahead of its consumer: a unit waits for earlier ones to be dropped beyond this
#: (one larger goes alone, and a consumer that keeps them all gets the next anyway). On an H200
#: host, 1 and 4 GiB Llama-shaped loads held 474-612 MiB at the peak without a bound.
DEVICE_AHEAD_BYTES = 1 << 30


@dataclass
class ReaderStats:
    """Counters a test or a report can read at any time."""

    tensors: int = 0
    bytes: int = 0  # delivered
    bytes_read: int = 0
    reads: int = 0
    direct_bytes: int = 0  # read straight into their destination, outside the budget
    staged_bytes: int = 0  # read a piece at a time into pinned memory and copied on to a GPU parameter
    inflight_bytes: int = 0
    peak_inflight_bytes: int = 0
    budget_waits: int = 0
    budget_wait_s: float = 0.0
    overdraft_bytes: int = 0
    ttft_s: float | None = None
    verified_shards: int = 0  # shards whose SHA-256 matched the manifest
    # Seconds from the start (the stream made, or ``load`` called) until the checkpoint was open
    # (its index and every header read and parsed) and until the plan was made: what comes
    # before the first tensor (``ttft_s``), most of it on many small tensors.
    opened_s: float | None = None
    planned_s: float | None = None
    # How most bytes from the page cache came into their destinations, "pread" or "map"
    # (``aload.warmcopy``); None where none did (a remote store, views handed out, a cold file).
    warm_copy: str | None = None


async def _completed(event: Any) -> None:
    """Once ``event`` (a CUDA event, or None) has completed, asking every ``STAGE_POLL_S``."""
    while event is not None and not event.query():
        await asyncio.sleep(STAGE_POLL_S)


def first_tensor(ttft_s: float | None, opened_s: float | None, planned_s: float | None) -> str:
    """The time to first tensor and what came before it, as ``235.4 ms (headers parsed at 192,
    plan at 234)``: ms from the start until the checkpoint was open and the plan made."""
    if ttft_s is None:
        return "-"
    if opened_s is None or planned_s is None:
        return f"{ttft_s * 1e3:.1f} ms"
    return f"{ttft_s * 1e3:.1f} ms (headers parsed at {opened_s * 1e3:.0f}, plan at {planned_s * 1e3:.0f})"


@dataclass(frozen=True)
class Progress:
    tensors: int
    tensors_total: int
    bytes: int
    bytes_total: int
    elapsed_s: float


class Reader:
    """Reads a plan and yields ``(name, tensor)`` in plan order (``in_order``; else see ``_next_ready``)."""

    def __init__(
        self,
        plan: Plan,
        *,
        max_inflight_bytes: int,
        concurrency: int,
        chunk_bytes: int,
        pin: bool = False,
        release_event: Callable[[], Any] | None = None,
        device_copy: Callable[[torch.Tensor, torch.Tensor], Any] | None = None,
        device_empty: Callable[[torch.Tensor], torch.Tensor] | None = None,
        progress: Callable[[Progress], None] | None = None,
        t0: float | None = None,
        hashes: dict[str, ShardHash] | None = None,
        in_order: bool = True,
    ) -> None:
        _check_positive(max_inflight_bytes=max_inflight_bytes, concurrency=concurrency, chunk_bytes=chunk_bytes)
        self.plan = plan
        self._digests = Digests(hashes, plan.units, self._verified) if hashes is not None else None
        self.stats = ReaderStats()
        # Whether the final consumer is blocked waiting for a tensor. For plain `async for`,
        # waiting on the reader is that; a bridge to a thread replaces it with its own probe.
        self.starving: Callable[[], bool] | None = None
        self._arena = Arena(max_inflight_bytes, pin)
        self._pin = pin
        self._chunk = chunk_bytes
        # A piece of a unit bound for a GPU, and the most pinned memory one such unit holds.
        self._stage = max(1 << 20, min(chunk_bytes, STAGE_PIECE_BYTES, max_inflight_bytes // (2 * STAGE_SLOTS)))
        self._stage_max = min(STAGE_SLOTS * self._stage, max(self._stage, max_inflight_bytes // 2))
        self._gate = asyncio.Semaphore(concurrency)
        # Reads that wait for a local disk take slots of their own: they do not hold up copies
        # out of the page cache behind them (``in_order=False``).
        self._disk_gate = asyncio.Semaphore(concurrency) if not in_order else self._gate
        # Out of order, the tasks of units on disk that ``_next_ready`` takes off the queue besides
        # the few others, up to a budget's worth of bytes (``_room``).
        self._disk: set[asyncio.Future[None]] = set()
        self._disk_waiting = [0, 0]  # of those, taken off the queue and not handed out: units, bytes
        # Units read ahead of the consumer: ``2 * concurrency`` queued; out of order, half of them
        # queued and half (at least 2) taken off the queue to wait for their reads (``_next_ready``).
        self._queue: asyncio.Queue[tuple[Unit, Lease | None, asyncio.Future[None]] | None] = asyncio.Queue(
            maxsize=2 * concurrency if in_order else concurrency
        )
        self._changed = asyncio.Event()
        self._pending_get: asyncio.Future[Any] | None = None
        self._in_order = in_order
        # Taken off the queue, their reads not done yet (``in_order=False``), in plan order.
        self._waiting: list[tuple[Unit, Lease | None, asyncio.Future[None]] | None] = []
        self._releasing = 0  # views whose pages are being let go a step a turn (``_release_steps``)
        self._release_event = release_event
        # For units bound for a GPU: enqueues copy(dst, src) on the load's stream, returns an
        # event that completes with it (``_read_staged``).
        self._device_copy = device_copy
        # Makes a unit's GPU tensor where its destination is a stand-in on "meta" (``_read_staged``),
        # and the bytes of those made or about to be that the consumer has not dropped yet.
        self._device_empty = device_empty
        self._device_held = 0
        self._progress = progress
        self._loop = asyncio.get_running_loop()
        self._t0 = time.perf_counter() if t0 is None else t0
        self._producer: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        # Buffers are leased just ahead of the reads that fill them, not as far as the budget
        # allows: with a fast consumer the arena then cycles over its first few chunks instead of
        # touching the whole budget (fresh pages cost ~3 ms/MiB in a new process on the VM
        # measured, which halved HTTP throughput). Units read straight into a destination or
        # mapped from a file take no buffer and are not held back.
        self._window = min(max_inflight_bytes, 2 * concurrency * chunk_bytes)
        self._unread = 0  # bytes of leased buffers not yet read into
        self._helper = IOPool(1)  # one thread for prefaults (and a stream's scatters), started on first use
        self._through: asyncio.Queue[memoryview] | None = None  # ``_frames``
        # What a unit that needs no read waits for (``_produce``): done already.
        self._no_read: asyncio.Future[None] = self._loop.create_future()
        self._no_read.set_result(None)

    # -- budget ---------------------------------------------------------------------------
    def poke(self) -> None:
        """Something the budget depends on changed (the consumer started waiting): re-check."""
        self._changed.set()

    def _consumer_stuck(self) -> bool:
        get = self._pending_get  # the consumer's wait for the next unit, while it lasts
        return (
            get is not None
            and not get.done()
            and self._queue.empty()
            and not self._waiting
            and not self._releasing  # bytes on their way back (``_release_steps``): not stuck
            and (self.starving is None or self.starving())
        )

    async def _acquire(self, unit: Unit) -> Lease:
        waited_from: float | None = None
        try:
            while True:
                lease = self._try_alloc(unit)
                if lease is None and self._consumer_stuck():
                    await asyncio.sleep(0)  # let pending releases land first
                    lease = self._try_alloc(unit) or (self._overdraft(unit) if self._consumer_stuck() else None)
                if lease is not None:
                    return lease
                if waited_from is None:
                    waited_from = time.perf_counter()
                    self.stats.budget_waits += 1
                self._changed.clear()
                await self._changed.wait()
        finally:
            if waited_from is not None:
                self.stats.budget_wait_s += time.perf_counter() - waited_from

    def _mappable(self, unit: Unit, overdraft: bool = False) -> bool:
        """Whether ``unit`` is handed out as a view of its file's mapping. Where buffers are
        pinned (a GPU copies from pinned memory asynchronously; a mapping is not pinned), only
        outside the arena: a tensor larger than the budget or an ``overdraft``, which would
        otherwise need fresh memory. Pinning it would cost ~0.5 ms a MiB (512 MiB: 255-323 ms on
        an H200 host); a copy from pageable memory to the GPU ran at 6-8 GB/s there (~0.13 ms a
        MiB), and returns once the bytes are staged, so the view can go when the tensor does."""
        if unit.on_device or (self._pin and not overdraft and unit.nbytes <= self._arena.capacity):
            return False
        if unit.source.maps(unit.start, unit.nbytes):
            return True
        # A run of many small tensors goes through the page cache even from the disk: per-tensor
        # work, not the disk, sets its pace, and fresh buffers for it cost more than the mapping
        # (20,000 tensors cold through load_weights: anonymous memory 95 -> 15 MiB).
        return unit.source.can_map and len(unit.items) > 1 and unit.nbytes < SMALL_MEAN_BYTES * len(unit.items)

    def _buffered(self, unit: Unit) -> bool:
        """Whether ``unit`` is read into a leased buffer (the read-ahead window counts those)."""
        return not unit.in_place and unit.nbytes > 0 and not self._mappable(unit)

    def _try_alloc(self, unit: Unit) -> Lease | None:
        n, inflight, cap = unit.nbytes, self.stats.inflight_bytes, self._arena.capacity
        if inflight + n > cap and not (n > cap and inflight == 0):  # larger than the budget: alone
            return None
        if self._mappable(unit):
            return self._lease(MAPPED, unit.start, n, unit.source.view(unit.start, n), unit.source)
        return self._buffer(unit, from_arena=n <= cap)

    def _overdraft(self, unit: Unit) -> Lease:
        self.stats.overdraft_bytes += unit.nbytes
        if self._mappable(unit, overdraft=True):
            return self._lease(MAPPED, unit.start, unit.nbytes, unit.source.view(unit.start, unit.nbytes), unit.source)
        lease = self._buffer(unit, from_arena=False)
        assert lease is not None  # a fresh allocation always succeeds
        return lease

    def _buffer(self, unit: Unit, from_arena: bool) -> Lease | None:
        """A region of the arena (None when none is free) or a fresh allocation for ``unit``: the
        whole blocks of the file around it where the source reads straight into them. A fresh
        allocation is never pinned (see ``_mappable``): it is faulted in on the helper thread."""
        n = unit.nbytes
        align = 0 if (self._pin and from_arena) or unit.on_device else unit.source.frame_align(unit.start, n)
        pad = unit.start % align if align else 0
        size = -(-(pad + n) // align) * align if align else n
        if from_arena:
            start = self._arena.alloc(size)
            if start is None:
                return None
            kind, memory = ARENA, self._arena.array()[start : start + size]
        else:
            kind, start, memory = OUTSIDE, 0, host_array(size, False)
        lease = self._lease(kind, start, size, memory[pad : pad + n])
        if align:
            lease.frame, lease.pad = memory, pad
        return lease

    def _lease(self, kind: str, start: int, n: int, view: np.ndarray[Any, Any], source: Source | None = None) -> Lease:
        lease = Lease(kind, start, n, view)
        self.stats.inflight_bytes += n
        self.stats.peak_inflight_bytes = max(self.stats.peak_inflight_bytes, self.stats.inflight_bytes)
        # Fires when the last tensor sharing `view`'s memory dies, in whichever thread drops it.
        # It refers to the reader weakly: a tensor kept for good (``param.data = w``) does not keep
        # the reader and its plan.
        weakref.finalize(view, _view_released, weakref.ref(self), kind, start, n, source)
        return lease

    def _released_threadsafe(self, kind: str, start: int, n: int, source: Source | None) -> None:
        if source is not None:
            if n > RELEASE_STEP_BYTES and self._on_loop():
                self._releasing += 1
                self._release_steps(kind, start, n, source, start)
                return
            source.release(start, n)
        event = self._release_event() if self._release_event is not None and kind != MAPPED else None
        try:
            self._loop.call_soon_threadsafe(self._released, kind, start, n, event)
        except RuntimeError:  # loop closed: the reader is gone
            pass

    def _release_steps(self, kind: str, start: int, n: int, source: Source, at: int) -> None:
        """Let go of a view's pages from ``at`` on, in steps of ``RELEASE_STEP_BYTES`` (whole pages
        of the file, so that the steps' pages are the whole range's), for up to
        ``RELEASE_TURN_S`` a turn of the event loop; the budget gets its bytes back after the
        last step. A view whose pages were never touched mostly goes in one turn."""
        stop, deadline = start + n, time.perf_counter() + RELEASE_TURN_S
        try:
            while at < stop:
                end = min(stop, (at // RELEASE_STEP_BYTES + 1) * RELEASE_STEP_BYTES)
                source.release(at, end - at)
                at = end
                if at < stop and time.perf_counter() > deadline:
                    self._loop.call_soon(self._release_steps, kind, start, n, source, at)
                    return
        except BaseException:
            at = stop  # the bytes go back to the budget all the same
            raise
        finally:
            if at >= stop:
                self._releasing -= 1
                self._released_threadsafe(kind, start, n, None)

    def _on_disk(self, unit: Unit) -> bool:
        return unit.nbytes > 0 and not unit.scatter and unit.source.on_disk(unit.start, unit.nbytes)

    def _on_loop(self) -> bool:
        try:
            return asyncio.get_running_loop() is self._loop
        except RuntimeError:
            return False

    def _released(self, kind: str, start: int, n: int, event: Any) -> None:
        if event is not None and not event.query():  # a GPU copy still reads this memory
            self._loop.call_later(0.0005, self._released, kind, start, n, event)
            return
        if kind == ARENA:
            self._arena.free(start, n)
        self.stats.inflight_bytes -= n
        self._changed.set()

    # -- reads ----------------------------------------------------------------------------
    def _track(self, task: asyncio.Task[None]) -> asyncio.Task[None]:
        """``task``, cancelled and awaited by ``aclose`` if it is still running then."""
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def _verified(self) -> None:  # a shard's digest matched
        self.stats.verified_shards += 1

    async def _produce(self) -> None:
        if self._pin and any(not unit.in_place or unit.on_device for unit in self.plan.units):
            # Pinning is slow (64 MiB ~30 ms, 512 MiB ~245 ms on an H200 host): on a thread, not
            # on the event loop at the first lease (1 GiB into a GPU model: p99 lateness 42 ms).
            await self._helper.run(self._arena.array)
        for unit in self.plan.units:
            # Every source was made ready before the plan (``all_ready``, all at once): at once,
            # unless that failed, which is raised here.
            await unit.source.ready()
            if self._buffered(unit):
                while self._unread >= self._window:
                    self._changed.clear()
                    await self._changed.wait()
                self._unread += unit.nbytes
            if unit.on_device:
                if unit.dest is not None and unit.dest.is_meta:
                    await self._device_room(unit.nbytes)
                # Its pieces' pinned memory leased here, in plan order, as other units' buffers are:
                # a unit ahead of it never waits for budget that units behind it hold.
                pieces = Unit(unit.source, unit.start, min(unit.nbytes, self._stage_max), dest=unit.dest)
                stage = await self._acquire(pieces)
                task: asyncio.Future[None] = self._track(asyncio.ensure_future(self._read_staged(unit, stage)))
                lease = None
                del stage, pieces
            elif self._through_frames(unit):
                task = self._track(asyncio.ensure_future(self._read_through(unit)))
                lease = None
            else:
                lease = await self._acquire(unit) if not unit.in_place and unit.nbytes else None
                if lease is not None and lease.kind == MAPPED and unit.source.populated(unit.start, unit.nbytes):
                    # A view of pages all in the page cache: nothing to read, so no task (4 GiB
                    # warm through ``load_weights``: the loop's CPU 27.9 -> 26.2 ms a load).
                    task = self._no_read
                    self._count_read(unit.nbytes, False)
                else:
                    task = self._track(asyncio.ensure_future(self._read(unit, lease)))
            if self._digests is not None and unit.items:
                task = self._track(self._digests.chain(task, unit, lease.tensor if lease is not None else unit.dest))
            # Not units read into buffers: read ahead, they hold the budget's memory while the
            # consumer's thread sets the pace (4 GiB partly evicted through ``load_weights``: the
            # whole budget touched, 2 GB/s where fresh memory is slow).
            if not self._in_order and not self._buffered(unit) and self._on_disk(unit):
                self._disk.add(task)
            await self._queue.put((unit, lease, task))
            del lease
        await self._queue.put(None)

    async def _device_room(self, n: int) -> None:
        """Wait until ``n`` more bytes of tensors made on the GPU fit ``DEVICE_AHEAD_BYTES``
        beside those the consumer still holds, and count them."""
        while self._device_held and self._device_held + n > DEVICE_AHEAD_BYTES and not self._consumer_stuck():
            self._changed.clear()
            await self._changed.wait()
        self._device_held += n

    def _device_freed(self, n: int) -> None:
        self._device_held -= n
        self._changed.set()

    async def _read_staged(self, unit: Unit, stage: Lease) -> None:
        """A unit bound for a GPU parameter: read a piece at a time into ``stage`` (pinned memory
        of the budget, up to ``STAGE_SLOTS`` pieces), each piece copied on to its part of the parameter
        on the load's stream, and its slot read into again once that copy has completed. The
        unit is handed on once its copies have completed."""
        assert unit.dest is not None and self._device_copy is not None and stage.tensor is not None
        if unit.dest.is_meta:  # a tensor handed on on the GPU (``load(weights_on_device=True)``): made now
            name = unit.items[0].name
            if self._device_empty is None:
                raise UsageError("a destination on 'meta' needs device_empty to make it", tensor=name)
            try:
                unit.dest, unit.handed_off = self._device_empty(unit.dest), True
                # Not the reader itself: a model may keep the tensor (``param.data = w``) for good.
                weakref.finalize(unit.dest, _device_dropped, weakref.ref(self), unit.nbytes)
            except BaseException as exc:
                self._device_freed(unit.nbytes)
                if not isinstance(exc, torch.OutOfMemoryError):
                    raise
                raise LoadError(
                    f"out of GPU memory for a tensor of {unit.nbytes} bytes to hand on on the GPU (weights_on_device "
                    f"holds up to {DEVICE_AHEAD_BYTES >> 20} MiB of them ahead of the model; without it they come in host memory)",
                    tensor=name,
                    byte_range=(unit.start, unit.start + unit.nbytes),
                ) from exc
        # The parameter's bytes: a tensor ``destinations`` found contiguous, of the checkpoint's dtype and size.
        dest = unit.dest.detach().view(-1).view(torch.uint8)
        memory, piece, n = stage.tensor, self._stage, unit.nbytes
        slots = max(1, memory.numel() // piece)
        del stage  # the slots hold the memory; it goes back once the last copy from it completes
        gate = self._disk_gate if self._on_disk(unit) else self._gate

        async def slot(first: int) -> None:
            region = memory[first * piece : (first + 1) * piece]
            event = None
            for off in range(first * piece, n, slots * piece):
                size = min(piece, n - off)
                await _completed(event)  # its last copy no longer reads this memory
                async with gate:
                    await unit.source.readinto(unit.start + off, byte_view(region[:size]))
                assert self._device_copy is not None
                event = self._device_copy(dest[off : off + size], region[:size])
                self._count_read(size, False)
            await _completed(event)

        await asyncio.gather(*(slot(i) for i in range(min(slots, -(-n // piece)))))
        self.stats.staged_bytes += n

    def _through_frames(self, unit: Unit) -> bool:
        """A unit bound for a host parameter whose bytes sit on disk and come by ``O_DIRECT``."""
        return unit.dest is not None and not unit.on_device and bool(unit.source.frame_align(unit.start, unit.nbytes))

    async def _read_through(self, unit: Unit) -> None:
        """A unit on disk bound for a host parameter, in pieces of a frame's size that start where
        the file's blocks do (the first from the block the unit starts in): each read whole into
        one of the reader's ``THROUGH_FRAMES`` frames (``O_DIRECT`` straight into it), then its
        part of the unit copied into the parameter on the helper thread while other pieces are
        read. Read into the parameter through each read thread's bounce buffer instead (copied
        out right after each read), the built-in loader came slower cold than ``load_weights``
        into the budget's buffers (1 GB Qwen2.5-0.5B-shaped: ~1.7 GB/s against ~2.6): each
        ``O_DIRECT`` read took ~4 ms against ~2.7 at the same depth; a cold 4 GiB load, 2.2 GB/s
        before against 3.1 this way (docs/benchmarks.md, stop 51). A frame of a cancelled piece
        is dropped: its thread may still be reading into it."""
        assert unit.dest is not None
        frames, size = self._frames()
        dest, start, end = byte_view(unit.dest), unit.start, unit.start + unit.nbytes

        async def one(at: int) -> None:  # the frame's bytes of the file: [at, at + size)
            lo, hi = max(at, start), min(at + size, end)
            region = await frames.get()
            try:
                await unit.source.read_frame(at, region[: -(-(hi - at) // ALIGN) * ALIGN], hi - at)
                await self._helper.run(_copy, dest[lo - start : hi - start], region[lo - at : hi - at])
            except asyncio.CancelledError:
                raise  # its thread may still read into or copy out of the frame: not handed out again
            except BaseException:
                frames.put_nowait(region)
                raise
            frames.put_nowait(region)
            self._count_read(hi - lo, False)

        # Pieces where the file's blocks (and the frames' huge pages) begin: each read whole.
        await asyncio.gather(*(one(at) for at in range(start - start % ALIGN, end, size)))
        self.stats.direct_bytes += unit.nbytes

    def _frames(self) -> tuple[asyncio.Queue[memoryview], int]:
        """The frames of ``_read_through`` and their size, made at first need, in huge pages: a
        1 MiB ``O_DIRECT`` read into 4 KiB pages scattered in memory goes to a virtio disk as two
        requests (254 segments a request). Not faulted in ahead: the first ``O_DIRECT`` read into
        each faults its pages on a read thread (faulted in on the helper first, 32 MiB of fresh
        memory held every read back ~0.1 s at a cold load's start)."""
        size = max(ALIGN, self._stage // ALIGN * ALIGN)
        if self._through is None:
            stride = -(-size // HUGE) * HUGE
            memory, _ = huge_buffer(THROUGH_FRAMES * stride)
            self._through = asyncio.Queue()
            for i in range(THROUGH_FRAMES):
                self._through.put_nowait(memory[i * stride : i * stride + size])
        return self._through, size

    async def _read(self, unit: Unit, lease: Lease | None) -> None:
        if unit.nbytes == 0:
            return
        if unit.scatter:
            # A ``filled`` unit is filled here, by one scattering read on a read thread; any other
            # by its consumer (``Source.scatter_into``), and only brought into the cache here, ahead.
            async with self._gate:
                if unit.filled:
                    await unit.source.scatter_read(unit.start, [item.dest for item in unit.items])
                else:
                    await unit.source.prefetch(unit.start, unit.nbytes)
            self.stats.bytes_read += unit.nbytes
            self.stats.reads += 1
            self.stats.direct_bytes += unit.nbytes
            return
        buffered = self._buffered(unit)
        gate = self._disk_gate if self._on_disk(unit) else self._gate
        if lease is not None and lease.kind != MAPPED:
            await self._prefault(lease)
        if lease is not None and lease.frame is not None:
            frame = memoryview(lease.frame)  # type: ignore[arg-type]
            await self._read_frame(unit, frame, lease.pad, buffered, gate)
            return
        if lease is not None and lease.kind == MAPPED:
            buf = None  # zero copy: reading is bringing the file's pages in
        else:
            target = lease.tensor if lease is not None else unit.dest
            assert target is not None
            buf = byte_view(target)
        del lease
        # Bytes in the page cache come in one piece (a mapped unit's then costs one length check,
        # not a task per chunk on the loop: 4 GiB warm through load_weights made 253 of them).
        piece = unit.source.piece_bytes(self._chunk, unit.start, unit.nbytes, mapped=buf is None)
        if buf is None and piece < unit.nbytes and unit.source.scatters:
            # A view partly on disk: its missing pages all asked for at once, so that the disk has
            # them queued while its chunks are populated two at a time.
            await unit.source.prefetch(unit.start, unit.nbytes)
        if piece >= unit.nbytes:  # one read: awaited here, not in a task of its own
            await self._read_chunk(unit, buf, 0, unit.nbytes, buffered, gate)
        else:
            chunks = unit.chunks(piece)
            await asyncio.gather(*(self._read_chunk(unit, buf, off, n, buffered, gate) for off, n in chunks))
        if unit.dest is not None:
            self.stats.direct_bytes += unit.nbytes

    async def _prefault(self, lease: Lease) -> None:
        """Fault in the parts of a lease's buffer never used before, in one call on a thread (a
        pinned arena is all faulted in: ``Arena.warm``)."""
        if lease.kind == OUTSIDE:
            assert lease.tensor is not None
            memory = lease.frame if lease.frame is not None else lease.tensor.numpy()
            await self._helper.run(prefault, memory, 0, lease.nbytes)
        elif lease.start + lease.nbytes > self._arena.warm:
            lo, hi = max(lease.start, self._arena.warm), lease.start + lease.nbytes
            self._arena.warm = max(self._arena.warm, hi)
            await self._helper.run(prefault, self._arena.array(), lo, hi)

    async def _read_chunk(
        self, unit: Unit, buf: memoryview | None, off: int, n: int, buffered: bool, gate: asyncio.Semaphore
    ) -> None:
        # A view in the page cache needs no read, so no read slot: it is not held up behind the
        # reads of one on disk (``in_order=False`` hands it out before that one).
        free = buf is None and unit.source.in_memory(unit.start + off, n)
        async with contextlib.nullcontext() if free else gate:
            if buf is None:
                await unit.source.populate(unit.start + off, n)
            else:
                await unit.source.readinto(unit.start + off, buf[off : off + n])
        self._count_read(n, buffered)

    def _count_read(self, n: int, buffered: bool) -> None:
        if buffered:
            self._unread -= n
            self._changed.set()
        self.stats.bytes_read += n
        self.stats.reads += 1

    async def _read_frame(
        self, unit: Unit, frame: memoryview, pad: int, buffered: bool, gate: asyncio.Semaphore
    ) -> None:
        """A unit read straight into its ``frame`` (``Source.read_frame``), in chunks of whole
        blocks that start where the file's blocks do; each counts the unit's bytes it holds."""
        need, base = pad + unit.nbytes, unit.start - pad
        step = max(ALIGN, self._chunk // ALIGN * ALIGN)

        async def chunk(off: int) -> None:
            end = min(off + step, len(frame))
            async with gate:
                await unit.source.read_frame(base + off, frame[off:end], min(end, need) - off)
            self._count_read(min(end, need) - max(off, pad), buffered)

        await asyncio.gather(*(chunk(off) for off in range(0, need, step)))

    # -- delivery -------------------------------------------------------------------------
    async def units(self) -> AsyncIterator[tuple[Unit, UnitView | None]]:
        """Each unit in plan order once read (and hashed), with the view its tensors are cut
        from: ``items`` cuts them here; a bridge can cut them on its consumer's thread."""
        self._producer = asyncio.ensure_future(self._produce())
        while True:
            entry = await self._next_unit()
            if entry is None:
                if self._digests is not None:
                    self._digests.check_unread()
                return
            unit, lease, task = entry
            await task
            base = UnitView(lease.tensor) if lease is not None and lease.tensor is not None else None
            del lease, entry
            yield unit, base
            del base  # not held while waiting for the next unit

    async def items(self) -> AsyncIterator[tuple[str, torch.Tensor]]:
        """The tensors in plan order; each owns its memory until the consumer drops it.

        The tensors of a unit already read come without waiting for anything, so an ``async for``
        over them would never let the loop run another task until the unit ends (units of 4,096
        tensors of 4 KiB: 12-26 ms at worst): the loop is handed back every ~``PAUSE_AFTER_S`` of
        the consumer's and the cutting's work."""
        clock = time.perf_counter
        due = clock() + PAUSE_AFTER_S
        async for unit, base in self.units():
            if unit.scatter and not unit.filled:  # a bridge does this on its consumer's thread; here, on the helper's
                await self._helper.run(unit.source.scatter_into, unit.start, [item.dest for item in unit.items])
            i, n = 0, len(unit.items)
            while i < n:
                run, i = run_at(unit, base, i)
                while run:
                    self.account(unit, run[0][1].nbytes, 1)
                    yield run.popleft()  # not held here once handed out
                    if clock() >= due:
                        await hand_back()
                        due = clock() + PAUSE_AFTER_S
            del base
            due = clock() + PAUSE_AFTER_S  # the wait for the next unit let the loop run

    def account(self, unit: Unit, nbytes: int, tensors: int) -> None:
        """Count tensors of ``unit`` as delivered (on the loop: stats and progress live here)."""
        s = self.stats
        if s.ttft_s is None:
            s.ttft_s = time.perf_counter() - self._t0
        s.tensors += tensors
        s.bytes += nbytes
        if self._progress is not None:
            self._progress(
                Progress(s.tensors, self.plan.tensors, s.bytes, self.plan.nbytes, time.perf_counter() - self._t0)
            )

    async def _next_unit(self) -> tuple[Unit, Lease | None, asyncio.Future[None]] | None:
        if not self._in_order:
            return await self._next_ready()
        if not self._queue.empty():  # read ahead: no task, no wait
            return self._queue.get_nowait()
        return await self._get()

    async def _get(self) -> tuple[Unit, Lease | None, asyncio.Future[None]] | None:
        get = asyncio.ensure_future(self._queue.get())
        self._pending_get = get
        self._changed.set()
        try:
            producer = self._producer
            assert producer is not None
            await asyncio.wait([get, producer], return_when=asyncio.FIRST_COMPLETED)
            if not get.done():
                get.cancel()
                producer.result()  # raises the producer's error
            return get.result()
        finally:
            self._pending_get = None

    async def _next_ready(self) -> tuple[Unit, Lease | None, asyncio.Future[None]] | None:
        """The first unit in plan order whose read is done, of up to ``concurrency`` (at least 2)
        taken off the queue (``in_order=False``): a unit that waits for the disk lets the ones behind it
        that sit in the page cache go first, and the consumer copies them meanwhile. Units read
        from a local disk straight into their destinations are taken off besides those, up to a
        budget's worth of bytes (``_room``), and read in slots of their own: the units in the page
        cache behind a stretch on disk are read while the disk works (each shard of the 4 GiB
        checkpoint a tenth evicted, built-in: 12.7 -> 17.2 GB/s)."""
        waiting, limit = self._waiting, max(2, self._queue.maxsize)
        producer = self._producer
        assert producer is not None
        while True:
            while not self._queue.empty() and self._room(limit):
                self._take(self._queue.get_nowait())
            for i, entry in enumerate(waiting):
                if entry is None:  # the end: only once every unit before it is handed out
                    if i == 0:
                        del waiting[0]
                        return None
                    break
                if entry[2].done():
                    del waiting[i]
                    if entry[2] in self._disk:
                        self._disk.discard(entry[2])
                        self._disk_waiting[0] -= 1
                        self._disk_waiting[1] -= entry[0].nbytes
                    return entry
            more = self._room(limit) and (not waiting or waiting[-1] is not None)
            get = asyncio.ensure_future(self._queue.get()) if more else None
            aws: list[asyncio.Future[Any]] = [e[2] for e in waiting if e is not None]
            if get is not None:
                aws.append(get)
            if not producer.done():  # a producer that ended put the end on the queue
                aws.append(producer)
            self._pending_get = get
            self._changed.set()
            try:
                await asyncio.wait(aws, return_when=asyncio.FIRST_COMPLETED)
                if get is not None:
                    if get.done():
                        self._take(get.result())
                    else:
                        get.cancel()
                if producer.done() and not producer.cancelled() and producer.exception() is not None:
                    producer.result()  # raises the producer's error
            finally:
                self._pending_get = None
                if get is not None and not get.done():  # cancelled meanwhile: take nothing more
                    get.cancel()

    def _room(self, limit: int) -> bool:
        """Whether ``_next_ready`` takes another unit off the queue: fewer than ``limit`` units
        waiting besides those on disk, and those on disk less than a budget's worth of bytes (so
        that the units in the page cache behind a stretch on disk are read meanwhile)."""
        units, nbytes = self._disk_waiting
        return len(self._waiting) - units < limit and nbytes < self._arena.capacity

    def _take(self, entry: tuple[Unit, Lease | None, asyncio.Future[None]] | None) -> None:
        self._waiting.append(entry)
        if entry is not None and entry[2] in self._disk:
            self._disk_waiting[0] += 1
            self._disk_waiting[1] += entry[0].nbytes

    async def aclose(self) -> None:
        """Stop producing and wait for every read started (their buffers may still be written)."""
        pending = [t for t in (self._producer, *self._tasks) if t is not None and not t.done()]
        for t in pending:
            t.cancel()
        if pending:
            await asyncio.wait(pending)
        ended: list[asyncio.Future[Any]] = list(pending)
        while self._waiting or not self._queue.empty():  # drop queued leases so their memory returns
            entry = self._waiting.pop() if self._waiting else self._queue.get_nowait()
            if entry is not None:
                ended.append(entry[2])
        # A read that failed after the load had stopped for another error (a file cut short fails
        # every read past its end) is nobody's error now: taken here, not logged when collected
        # as "Task exception was never retrieved".
        for f in ended:
            if f.done() and not f.cancelled():
                f.exception()
        self._arena.drop()  # tensors still held keep their part alive; the rest returns now
        # The tasks ended; a cancelled one's traceback holds its frame's locals (a lease among
        # them): let go of them now, not through the cyclic collector (they refer to this reader).
        self._producer = None
        self._tasks.clear()
        if self._device_empty is not None:
            # Tensors made on the GPU for units never handed out are nobody's now, however long
            # this reader lives on (a stream object kept after its end).
            for unit in self.plan.units:
                if unit.handed_off:
                    unit.dest = None
        await self._helper.aclose()
        if self._digests is not None:
            await self._digests.aclose()


def _view_released(ref: weakref.ref[Reader], kind: str, start: int, n: int, source: Source | None) -> None:
    """The last tensor viewing a lease's memory is dead: its bytes go back to the reader's budget,
    and a mapped view's pages are let go (``Reader._released_threadsafe``); with the reader gone,
    only the pages."""
    reader = ref()
    if reader is not None:
        reader._released_threadsafe(kind, start, n, source)
    elif source is not None:
        source.release(start, n)


def _device_dropped(ref: weakref.ref[Reader], n: int) -> None:
    """A tensor made on the GPU is dead, in whichever thread dropped it: its bytes go back to the
    reader's count, if the reader is still there."""
    reader = ref()
    if reader is None:
        return
    try:
        reader._loop.call_soon_threadsafe(reader._device_freed, n)
    except RuntimeError:  # loop closed: the load is over
        pass


async def all_ready(sources: Iterable[Source]) -> None:
    """``ready()`` for each of ``sources``, in order, all started together (each source shares one
    outcome among all who wait for it); errors surface where its reads await it again."""
    unique = list({id(s): s for s in sources}.values())
    await asyncio.gather(*(s.ready() for s in unique), return_exceptions=True)


def _check_positive(**values: int) -> None:
    for key, value in values.items():
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise UsageError(
                f"{key} must be a positive integer number of {'bytes' if 'bytes' in key else 'requests'}, got {value!r}"
            )


def _copy(dst: memoryview, src: memoryview) -> None:
    assert len(dst) == len(src)
    copy_bytes(np.frombuffer(dst, dtype=np.uint8).ctypes.data, np.frombuffer(src, dtype=np.uint8).ctypes.data, len(dst))
