"""The sync bridge: a worker thread iterates the async pipeline as a plain iterator.

The loop side (``pump``) moves pairs into a small deque; the thread side (``__next__``) takes
them without a lock while there are any (deque operations are atomic) and waits on a
``threading.Condition`` only when there are none: the lock per pair cost ~5 us of each side's
time. The loop is told when the deque has room again (once it is half empty, so a busy consumer
costs few cross-thread wake-ups) and when the thread is starving, which lets the reader tell a
consumer that holds tensors from one that is merely slow.
"""

from __future__ import annotations

import asyncio
import collections
import threading
from collections.abc import Iterator

from .pipeline import TensorStream
from .stages import Pair

#: A waiting consumer is woken once this many pairs are ready, or when the pump next waits,
#: whichever comes first: a wake-up per pair (a futex and a GIL hand-off each way) cost more
#: than the pair itself on 20,000 small tensors.
_WAKE_BATCH = 16


class LoadCancelled(BaseException):
    """Raised inside ``model.load_weights`` when the load is cancelled; a BaseException so that
    ``except Exception`` in model code does not swallow it."""


class SyncBridge(Iterator[Pair]):
    def __init__(self, stream: TensorStream, maxsize: int = 64) -> None:
        self._stream = stream
        self._loop = asyncio.get_running_loop()
        self._max = maxsize
        self._items: collections.deque[Pair] = collections.deque()
        self._cond = threading.Condition()
        self._room = asyncio.Event()
        self._pump_waiting = False
        self._flush_pending = False
        self._consumer_waiting = False
        self._done = False
        self._closed = False
        self.error: BaseException | None = None
        self.exhausted = False
        self.names: list[str] = []  # handed to the consumer, in order

    async def pump(self) -> None:
        reader = self._stream.reader
        if reader is not None:
            # Waiting, and nothing in the deque it has not woken up to take yet.
            reader.starving = lambda: self._consumer_waiting and not self._items
        items = self._items
        try:
            async for pair in self._stream:
                if self._closed:
                    return
                # deque.append and popleft are atomic: the lock is taken only to wake a consumer
                # that said it waits (it re-checks the deque after saying so: no lost wake-up).
                items.append(pair)
                del pair
                if self._consumer_waiting:
                    if len(items) >= _WAKE_BATCH:
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
            with self._cond:
                self._done = True
                self._cond.notify_all()

    def _wake(self) -> None:
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

    def __next__(self) -> Pair:
        if self._closed:
            raise LoadCancelled()
        try:
            pair = self._items.popleft()  # the common case: no lock, no wait
        except IndexError:
            pair = self._wait()
        # Tell the pump there is room once the deque is half empty: few cross-thread wake-ups.
        if self._pump_waiting and len(self._items) <= self._max // 2:
            self._pump_waiting = False
            self._call(self._room.set)
        self.names.append(pair[0])
        return pair

    def _wait(self) -> Pair:
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
            self._cond.notify_all()
        self._room.set()
