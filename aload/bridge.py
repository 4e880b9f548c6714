"""The sync bridge: a worker thread iterates the async pipeline as a plain iterator.

The loop side (``pump``) moves pairs into a small deque; the thread side (``__next__``) takes
them under a ``threading.Condition``. The loop is told when the deque has room again (once it is
half empty, so a busy consumer costs few cross-thread wake-ups) and when the thread is starving,
which lets the reader tell a consumer that holds tensors from one that is merely slow.
"""

from __future__ import annotations

import asyncio
import collections
import threading
from collections.abc import Iterator

from .pipeline import TensorStream
from .stages import Pair


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
        try:
            async for pair in self._stream:
                while not self._closed:
                    with self._cond:  # flag and check together, or the wake-up can be missed
                        full = len(self._items) >= self._max
                        if full:
                            self._room.clear()
                            self._pump_waiting = True
                        else:
                            self._items.append(pair)
                            self._cond.notify()
                    if not full:
                        break
                    await self._room.wait()
                del pair
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
        with self._cond:
            while not self._items and not self._done and not self._closed:
                if not self._consumer_waiting:
                    self._consumer_waiting = True  # read by the reader on the loop thread
                    self._poke()
                self._cond.wait()
            self._consumer_waiting = False
            if self._closed:
                raise LoadCancelled()
            if not self._items:
                if self.error is not None:
                    raise self.error
                self.exhausted = True  # the consumer saw the end of the stream
                raise StopIteration
            pair = self._items.popleft()
            if self._pump_waiting and len(self._items) <= self._max // 2:
                self._pump_waiting = False
                self._call(self._room.set)
        self.names.append(pair[0])
        return pair

    def close(self) -> None:
        """Loop side: the consumer's next ``__next__`` raises ``LoadCancelled``; the pump stops."""
        with self._cond:
            self._closed = True
            self._items.clear()
            self._cond.notify_all()
        self._room.set()
