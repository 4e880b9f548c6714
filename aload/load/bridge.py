"""The sync bridge: a worker thread iterates the async pipeline as a plain iterator.

The loop side (``pump``) puts pairs, or whole units whose tensors the worker cuts itself, into
a deque; the worker takes them without a lock while there are any (deque operations are atomic)
and waits on a condition only when there are none. The pump waits when the deque is full and
is told once it is half empty again.
"""

from __future__ import annotations

import asyncio
import collections
import threading
from collections.abc import AsyncIterator, Iterator
from typing import Any

from ..read import Unit, cut
from ..stages import Pair
from ..stream import TensorStream

#: Whole units waiting for the worker, at most (each up to ``chunk_bytes``, or one large tensor).
MAX_UNITS = 4
#: Pairs waiting for the worker, at most, where tensor stages hand pairs one by one.
MAX_PAIRS = 64


class LoadCancelled(BaseException):
    """Raised inside ``model.load_weights`` when the load is cancelled; a BaseException so that
    ``except Exception`` in model code does not swallow it."""


class _Batch:
    __slots__ = ("buf", "unit")

    def __init__(self, unit: Unit, buf: Any) -> None:
        self.unit, self.buf = unit, buf


class SyncBridge(Iterator[Pair]):
    def __init__(self, stream: TensorStream) -> None:
        self._stream = stream
        self._loop = asyncio.get_running_loop()
        self._max = MAX_UNITS if stream.cuts_later else MAX_PAIRS
        self._q: collections.deque[Pair | _Batch] = collections.deque()
        self._run: collections.deque[Pair] = collections.deque()
        self._cv = threading.Condition()
        self._room = asyncio.Event()
        self._pump_waiting = False
        self._waiting = False
        self._done = False
        self._closed = False
        self.error: BaseException | None = None
        self.exhausted = False
        self.names: list[str] = []  # handed to the consumer, in order

    # -- loop side ---------------------------------------------------------------------------
    async def _entries(self) -> AsyncIterator[Pair | _Batch]:
        if self._stream.cuts_later:
            async for unit, buf in self._stream.units():
                yield _Batch(unit, buf)
                del buf
        else:
            async for pair in self._stream:
                yield pair

    async def pump(self) -> None:
        reader = self._stream.reader
        if reader is not None:
            reader.consumer_starving = lambda: self._waiting and not self._q
        try:
            async for entry in self._entries():
                if self._closed:
                    return
                self._q.append(entry)
                del entry
                if self._waiting:
                    with self._cv:
                        self._cv.notify()
                if len(self._q) >= self._max:
                    self._room.clear()
                    self._pump_waiting = True  # before the re-check, which the worker's pops race
                    if len(self._q) >= self._max:
                        await self._room.wait()
                    self._pump_waiting = False
                    if self._closed:
                        return
        except BaseException as exc:
            if not isinstance(exc, asyncio.CancelledError):
                self.error = exc
            raise
        finally:
            if reader is not None:
                reader.consumer_starving = None  # it refers to this bridge
            with self._cv:
                self._done = True
                self._cv.notify_all()

    def close(self) -> None:
        """The worker's next ``__next__`` raises ``LoadCancelled``; the pump stops."""
        with self._cv:
            self._closed = True
            self._q.clear()
            self._cv.notify_all()
        self._room.set()

    # -- worker side -------------------------------------------------------------------------
    def __iter__(self) -> Iterator[Pair]:
        return self

    def __next__(self) -> Pair:
        while True:
            if self._closed:
                raise LoadCancelled()
            if self._run:
                pair = self._run.popleft()
                self.names.append(pair[0])
                return pair
            entry = self._take()
            if type(entry) is _Batch:
                self._run = collections.deque(cut(entry.unit, entry.buf))
            else:
                self._run = collections.deque((entry,))  # type: ignore[arg-type]
            del entry

    def _take(self) -> Pair | _Batch:
        try:
            entry = self._q.popleft()
        except IndexError:
            entry = self._wait()
        if self._pump_waiting and len(self._q) <= self._max // 2:
            self._pump_waiting = False
            self._call(self._room.set)
        return entry

    def _wait(self) -> Pair | _Batch:
        with self._cv:
            while True:
                if self._closed:
                    raise LoadCancelled()
                if self._q:
                    self._waiting = False
                    return self._q.popleft()
                if self._done:
                    self._waiting = False
                    if self.error is not None:
                        raise LoadCancelled() from self.error
                    self.exhausted = True
                    raise StopIteration
                if not self._waiting:
                    self._waiting = True  # read by the pump and the reader, then re-checked here
                    reader = self._stream.reader
                    if reader is not None:
                        self._call(reader.poke)
                    continue
                self._cv.wait()

    def _call(self, fn: Any) -> None:
        try:
            self._loop.call_soon_threadsafe(fn)
        except RuntimeError:  # the loop is closed
            pass
