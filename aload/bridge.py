"""The sync bridge: a worker thread iterates the async pipeline as a plain iterator.

The loop side (``pump``) moves pairs, or whole units whose tensors the thread cuts itself, into a
small deque; the thread side (``_take_run``) takes them without a lock while there are any (deque
operations are atomic) and waits on a ``threading.Condition`` only when there are none: the lock
per pair cost ~5 us of each side's time. The thread hands a unit's tensors out a run at a time
(``__iter__``). The loop is told when the deque has room again (once it is half empty, so a busy
consumer costs few cross-thread wake-ups) and when the thread is starving, which lets the reader
tell a consumer that holds tensors from one that is merely slow.

Units read straight into their destinations (the built-in loader's parameters) leave the thread
nothing to do but take their names: a waiting thread is woken for them only once the deque is
full, or for the next unit it has work in, or at the end (4 GiB warm, built-in: the thread woken
~85-110 times a load instead of ~240, its CPU 4-6 ms instead of 9-10; docs/benchmarks.md, stop 54).
"""

from __future__ import annotations

import asyncio
import collections
import operator
import threading
from collections.abc import AsyncIterator, Iterator
from typing import Any

import torch

from ._threads import Pacer
from .arena import UnitView, run_at
from .pipeline import TensorStream
from .plan import Unit
from .stages import Pair

#: A waiting consumer is woken once this many pairs are ready, or when the pump next waits,
#: whichever comes first: a wake-up per pair (a futex and a GIL hand-off each way) cost more
#: than the pair itself on 20,000 small tensors.
_WAKE_BATCH = 16
#: Whole units waiting for the consumer's thread, at most. Each can be ``chunk_bytes`` or one large
#: tensor: 64 of them let the reads run up to the whole budget ahead of the consumer (64 shards from
#: a cold disk: 180-280 MiB of buffers, every fresh page faulted in on the cores the consumer and
#: the event loop need; with 4, 113 MiB, throughput the same within the noise).
_MAX_UNITS = 4


#: Units of at most this many tensors (a large tensor is a unit of its own) are cut on the loop
#: as they are queued, so that the consumer's thread goes from one ``copy_()`` to the next with a
#: ``popleft``: right after a copy of up to ~100 MiB has flushed the CPU's caches, each torch call
#: of the cut took 50-300 us there (4 GiB warm through ``load_weights``, suite children, 4 rounds
#: each way: the gaps between the model's copies 28-34 -> 23-27 ms of a 0.2-0.5 s load). A run of
#: many small tensors is still cut by the consumer, a run at a time (see ``_entries``).
_PRECUT = 2

#: The end of a run of pairs (``SyncBridge._run``): ``iter(run.popleft, _END)`` stops there. Not a
#: tuple, which would be compared with each pair's tensor.
_END = object()
_NAME = operator.itemgetter(0)


def _in_place(unit: Unit) -> bool:
    """Whether ``unit``'s tensors were all read straight into their destinations (the built-in
    loader's parameters), leaving the consumer nothing to do but take their names; not a tensor
    made on the GPU for a model's own ``load_weights`` (``Unit.handed_off``), which it copies."""
    return (unit.dest is not None and not unit.handed_off) or (unit.scatter and unit.filled)


class LoadCancelled(BaseException):
    """Raised inside ``model.load_weights`` when the load is cancelled; a BaseException so that
    ``except Exception`` in model code does not swallow it."""


class _Batch:
    """A whole unit handed over at once: the consumer cuts its tensors on its own thread."""

    __slots__ = ("base", "pairs", "unit")

    def __init__(self, unit: Unit, base: UnitView | None, pairs: collections.deque[Any] | None = None) -> None:
        self.unit = unit
        self.base = base
        self.pairs = pairs  # cut already, on the loop (``_PRECUT``); then ``base`` is None


class SyncBridge(Iterator[Pair]):
    def __init__(self, stream: TensorStream, maxsize: int = 64, handed: type[torch.Tensor] | None = None) -> None:
        self._stream = stream
        self._handed = handed  # large tensors handed as this type (``handed.py``), where given
        self._loop = asyncio.get_running_loop()
        # Whole units are held to a few (see _MAX_UNITS), pairs to ``maxsize``.
        self._max = maxsize if not stream.cuts_later else _MAX_UNITS
        self._items: collections.deque[Pair | _Batch] = collections.deque()
        # Being cut: the unit, the view its tensors are cut from, and its next item not yet in a run.
        self._batch: tuple[Unit, UnitView | None, int] | None = None
        # Being handed out: a run of pairs, then ``_END`` (see ``__iter__``).
        self._run: collections.deque[Any] = collections.deque()
        self._cond = threading.Condition()
        self._room = asyncio.Event()
        self._pump_waiting = False
        self._flush_pending = False
        self._consumer_waiting = False
        self._held = 0  # units in place put in the deque since the waiting consumer was last woken
        self._done = False
        self._closed = False
        self.error: BaseException | None = None
        self.exhausted = False
        self.names: list[str] = []  # handed to the consumer, in order
        self._pace = Pacer()
        self._pairs = self._iterate()  # refers to this bridge: let go of in settle()

    async def _entries(self) -> AsyncIterator[Pair | _Batch]:
        """Pairs, or whole units where no tensor stage needs to see the pairs: then the loop
        does no work per tensor (cutting one is a torch call, and each torch call on the loop
        let the consumer's thread take the GIL mid-unit: a hand-off per tensor), except for units
        of at most ``_PRECUT`` tensors, cut here (a few calls a unit, for large tensors)."""
        stream = self._stream
        if not stream.cuts_later:
            async for pair in stream:
                yield pair
            return
        reader = stream.reader
        async for unit, base in stream.units():
            assert reader is not None
            delivered = [item for item in unit.items if not item.skip]
            if delivered:
                reader.account(unit, sum(item.spec.nbytes for item in delivered), len(delivered))
                if len(unit.items) <= _PRECUT and not unit.scatter:
                    pairs: collections.deque[Any] = collections.deque()
                    j = 0
                    while j < len(unit.items):  # a run per dtype
                        run, j = run_at(unit, base, j, self._handed)
                        pairs.extend(run)
                    del run
                    yield _Batch(unit, None, pairs)
                    del pairs
                else:
                    yield _Batch(unit, base)
            del base

    async def pump(self) -> None:
        reader = self._stream.reader
        if reader is not None:
            # Waiting, and nothing in the deque it has been woken up to take (only units held back).
            reader.starving = lambda: self._consumer_waiting and len(self._items) <= self._held
        items = self._items
        try:
            async for entry in self._entries():
                if self._closed:
                    return
                # deque.append and popleft are atomic: the lock is taken only to wake a consumer
                # that said it waits (it re-checks the deque after saying so: no lost wake-up).
                items.append(entry)
                batch = type(entry) is _Batch
                # A unit already in place is handed over with others (until the deque is full, or
                # the stream ends): nothing waits on it, and each wake-up cost both threads.
                hold = batch and _in_place(entry.unit) and len(items) < self._max  # type: ignore[union-attr]
                del entry
                if self._consumer_waiting:
                    if hold:
                        self._held += 1
                    elif batch or len(items) >= _WAKE_BATCH:
                        self._wake()
                    elif not self._flush_pending:  # wake it when this task next waits, at the latest
                        self._flush_pending = True
                        self._loop.call_soon(self._flush)
                if len(items) >= self._max:
                    self._room.clear()
                    self._pump_waiting = True  # before the re-check, which the consumer's pops race
                    if len(items) >= self._max:
                        await self._room.wait()  # set by the consumer, or by close()
                    self._pump_waiting = False
                    if self._closed:
                        return
        except BaseException as exc:
            if not isinstance(exc, asyncio.CancelledError):
                self.error = exc
            raise
        finally:
            if reader is not None:
                # The probe refers to this bridge, which refers to the stream and its reader: a
                # cycle that kept a load's plan (two tracked objects per tensor) alive until the
                # next full collection.
                reader.starving = None
            with self._cond:
                self._done = True
                self._cond.notify_all()

    def _wake(self) -> None:
        self._held = 0
        with self._cond:
            self._cond.notify()

    def _flush(self) -> None:
        self._flush_pending = False
        if self._consumer_waiting and self._items:
            self._wake()

    def _call(self, fn: object, *args: object) -> None:
        try:
            self._loop.call_soon_threadsafe(fn, *args)  # type: ignore[arg-type]
        except RuntimeError:
            pass

    def _poke(self) -> None:
        reader = self._stream.reader
        if reader is not None:
            self._call(reader.poke)

    def __iter__(self) -> Iterator[Pair]:
        """The pairs, a run at a time: within a run each comes from a C call (the run's
        ``popleft``) with no Python of aload's in between. A ``__next__`` per pair (a Python call,
        and a generator's step to cut the tensor) cost the consumer's thread 71-81 ms of CPU a
        load of 20,000 tensors, against 58-63 ms this way. One generator for the whole load,
        whoever iterates: a loader that hands ``weights`` on half-way (to a submodule's
        ``load_weights``) goes on from where that one stopped."""
        return self._pairs

    def __next__(self) -> Pair:
        return next(self._pairs)

    def _iterate(self) -> Iterator[Pair]:
        take = self._take_run
        while take():
            yield from iter(self._run.popleft, _END)

    def _take_run(self) -> bool:
        """Make the next run of pairs ``self._run``, ``_END`` last; False at the stream's end."""
        while True:
            if self._closed:
                raise LoadCancelled()
            batch = self._batch  # read once: close() may clear it from the loop
            if batch is not None:
                unit, view, i = batch
                if i < len(unit.items):
                    run, j = run_at(unit, view, i, self._handed)
                    self._batch = (unit, view, j)
                    del batch, view
                    if run:
                        return self._hand_out(run, unit.scatter)
                    continue
                self._batch = None
                del batch, unit, view
            try:
                entry = self._items.popleft()  # the common case: no lock, no wait
            except IndexError:
                try:
                    entry = self._wait()
                except StopIteration:
                    return False
            # Tell the pump there is room once the deque is half empty: few cross-thread wake-ups.
            if self._pump_waiting and len(self._items) <= self._max // 2:
                self._pump_waiting = False
                self._call(self._room.set)
            if type(entry) is _Batch:
                if entry.pairs is not None:
                    return self._hand_out(entry.pairs, False)
                unit = entry.unit
                if unit.scatter and not unit.filled:  # copied out of the page cache into the destinations, here
                    unit.source.scatter_into(unit.start, [item.dest for item in unit.items])
                self._batch = (unit, entry.base, 0)
                del unit, entry
                continue
            assert isinstance(entry, tuple)
            return self._hand_out(collections.deque((entry,)), False)

    def _hand_out(self, run: collections.deque[Any], in_place: bool) -> bool:
        self.names.extend(map(_NAME, run))
        if in_place:
            # Tensors already in place: the consumer's loop over them makes no call that lets go
            # of the GIL, so the loop gets it back here.
            self._pace()
        self._run = run
        run.append(_END)
        if self._closed:  # close() may have missed this run (it stops the one it sees)
            raise LoadCancelled()
        return True

    def settle(self) -> None:
        """Once the consumer has stopped: ``names`` only those handed out, not the rest of its
        run; and the generator let go of (with it, the cycle through this bridge)."""
        self._pairs = iter(())
        run = self._run
        pending = len(run) - run.count(_END)
        if pending:
            del self.names[-pending:]
            run.clear()

    def in_place_rest(self) -> list[str]:
        """The names of the current unit's tensors not yet handed out, taken as delivered in one
        go, when they were all read straight into their destinations (a ``scatter`` unit); else
        none. For the built-in loader, which has nothing to do for such a tensor but record its
        name: a ``__next__`` and a loop step each were ~2 us of a 20,000-tensor load's 25-30."""
        batch = self._batch  # read once: close() may clear it from the loop
        if batch is None or not batch[0].scatter:
            return []
        unit, _, i = batch
        self._batch = None
        # The current run's pairs not yet handed out, taken here (named when it was made). Popped,
        # not iterated: close() may add to the deque from the loop's thread meanwhile.
        run, names = self._run, []
        while (pair := run.popleft()) is not _END:  # never empty: this thread alone takes from it
            names.append(pair[0])
        run.append(_END)  # where the consumer's iterator stops
        rest = [item.name for item in unit.items[i:] if not item.skip]
        self.names.extend(rest)
        names.extend(rest)
        self._pace()  # the consumer's loop over them makes no call that lets go of the GIL
        return names

    def _wait(self) -> Pair | _Batch:
        with self._cond:
            while True:
                if self._closed:
                    raise LoadCancelled()
                if self._items:
                    self._consumer_waiting = False
                    return self._items.popleft()
                if self._done:
                    self._consumer_waiting = False
                    if self.error is not None:
                        raise self.error
                    self._batch = None
                    self.exhausted = True  # the consumer saw the end of the stream
                    raise StopIteration
                if not self._consumer_waiting:
                    self._consumer_waiting = True  # read by the pump and the reader, then re-checked here
                    self._poke()
                    continue
                self._cond.wait()

    def close(self) -> None:
        """Loop side: the consumer's next ``__next__`` raises ``LoadCancelled``; the pump stops."""
        with self._cond:
            self._closed = True
            self._items.clear()
            self._batch = None
            self._run.appendleft(_END)  # the consumer's next pair is the run's end
            self._cond.notify_all()
        self._room.set()
