"""The thread pool a store's blocking reads run in: ``concurrent.futures``' executor, but with
its threads after the first started by the pool's own threads, not by the event loop."""

from __future__ import annotations

import concurrent.futures
import contextlib
import queue
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


class ReadThreads(concurrent.futures.Executor):
    """Up to ``threads`` threads taking calls in order, as ``ThreadPoolExecutor`` (a thread is
    started for a call when none is idle), but once the pool's first call is done, the thread
    that ran it starts all the others, so later calls do not start them on the caller's thread.

    ``Thread.start`` waits until the new thread has run its first lines, which need the GIL and a
    core, and ``ThreadPoolExecutor`` starts a thread inside ``submit``: on the event loop. A
    partly evicted 1 GiB checkpoint through ``load_weights``: the read pool's second thread was
    started from the loop in 5 of 10 loads, holding it 2.2-8.6 ms each time (``loop_stalls.py
    --partial``). The first call's result is out before those starts, so it never waits for them;
    a call that comes while they run waits for the first of them, not for a start on the loop."""

    def __init__(self, threads: int, name: str, init: Callable[..., None], initargs: tuple[Any, ...] = ()) -> None:
        self._size, self._name, self._init, self._initargs = threads, name, init, initargs
        self._calls: queue.SimpleQueue[_Call | None] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._idle = 0  # threads that finished a call and are not yet counted on for another
        self._starting = False  # a thread of the pool is starting the others (``start_all``)
        self._closed = False
        # Woken when the executor goes unclosed: its threads wait on the queue, not on it.
        self._finalizer = weakref.finalize(self, _wake_all, self._calls, threads)

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> concurrent.futures.Future[T]:
        fut: concurrent.futures.Future[T] = concurrent.futures.Future()
        with self._lock:
            if self._closed:
                raise RuntimeError("cannot submit to a closed pool")
            self._calls.put(_Call(fut, fn, args, kwargs))
            if self._idle:
                self._idle -= 1
                new = None
            else:
                new = None if self._starting else self._claim()
        if new is not None:  # every thread busy and none on its way: started here, as it must be
            self._start(new)
        return fut

    def start_all(self) -> None:
        """Start every thread not started yet, from the calling thread (not the event loop)."""
        if self._to_start():
            self._start_rest()

    def _to_start(self) -> bool:
        """Whether the caller is to start the threads not started yet (``_start_rest``): none is
        starting them already and some are left. Submits from now on leave the starts to it."""
        with self._lock:
            if self._starting or self._closed or len(self._threads) >= self._size:
                return False
            self._starting = True
            return True

    def _start_rest(self) -> None:
        try:
            while True:
                with self._lock:
                    t = self._claim()
                if t is None:
                    return
                self._start(t)
        finally:
            with self._lock:
                self._starting = False

    def _claim(self) -> threading.Thread | None:
        """A new thread counted as this pool's, not started yet; None when the pool is full. Called
        holding the lock."""
        if self._closed or len(self._threads) >= self._size:
            return None
        args = (weakref.ref(self), self._calls, self._init, self._initargs)
        t = threading.Thread(target=_serve, args=args, name=f"{self._name}_{len(self._threads)}", daemon=True)
        self._threads.append(t)
        return t

    def _start(self, t: threading.Thread) -> None:
        try:
            t.start()
        except BaseException:  # no thread to be had: not counted, and the next call tries again
            with self._lock:
                self._threads.remove(t)
            raise

    def _done(self) -> None:
        with self._lock:
            self._idle += 1

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        with self._lock:
            self._closed = True
            threads = list(self._threads)
        self._finalizer.detach()
        for _ in threads:
            self._calls.put(None)
        if wait:
            for t in threads:
                while t in self._threads:
                    try:
                        t.join()
                        break
                    except RuntimeError:  # claimed by a thread still starting it
                        time.sleep(0.0001)


class _Call:
    __slots__ = ("args", "fn", "fut", "kwargs")

    def __init__(self, fut: concurrent.futures.Future[Any], fn: Callable[..., Any], args: Any, kwargs: Any) -> None:
        self.fut, self.fn, self.args, self.kwargs = fut, fn, args, kwargs

    def run(self, before_result: Callable[[], Any] | None = None) -> None:
        if not self.fut.set_running_or_notify_cancel():
            return
        try:
            result = self.fn(*self.args, **self.kwargs)
        except BaseException as exc:  # the caller's error, raised where it awaits
            if before_result is not None:
                before_result()
            self.fut.set_exception(exc)
        else:
            if before_result is not None:
                before_result()
            self.fut.set_result(result)


def _serve(
    ref: weakref.ref[ReadThreads], calls: queue.SimpleQueue[_Call | None], init: Callable[..., None], args: Any
) -> None:
    """A ``ReadThreads`` thread: its calls in turn. It holds the pool weakly, so an unclosed pool
    is collected (and its threads woken)."""
    init(*args)
    first, starter = True, [False]

    def claim_starts() -> None:  # before the first result is out: the caller's next submit sees it
        pool = ref()
        starter[0] = pool is not None and pool._to_start()

    while (call := calls.get()) is not None:
        call.run(claim_starts if first else None)
        del call  # its arguments and result go now, not when the next call comes
        pool = ref()
        if pool is None:
            continue
        if first:  # after this thread's first call, with its result out: the others
            first = False
            if starter[0]:
                with contextlib.suppress(RuntimeError):  # no thread to be had: the calls go on with those there are
                    pool._start_rest()
        pool._done()
        del pool


def _wake_all(calls: queue.SimpleQueue[_Call | None], n: int) -> None:
    for _ in range(n):
        calls.put(None)
