"""Run blocking work on a dedicated thread that is joined when it ends, so no thread
outlives the call (the loop's default executor keeps its threads alive)."""

from __future__ import annotations

import asyncio
import itertools
import os
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

from .errors import UsageError

T = TypeVar("T")

#: The longest stretch of aload's own work on the event loop before it lets the loop run (the reader).
PAUSE_AFTER_S = 0.001
#: The longest stretch of aload's own Python on a thread before it hands the GIL over (see ``paced``).
#: Half of ``PAUSE_AFTER_S``: against 1 ms, suite children alternating, 4-5 each, loop lateness p99
#: 3.8-5.6 -> 3.2-4.7 ms (20,000 tensors, built-in, warm), 5.2-6.8 -> 4.8-6.3 (the same, 10% of
#: the file evicted), 4.8-6.6 -> 4.0-6.1 (DeepSeek-V3's layout), p50 about halved; each load the
#: same within the noise to ~6% slower (282 -> 300 ms, 20,000 tensors warm).
PACE_S = 0.0005
#: Items between two looks at the clock.
CHECK_EVERY = 64
#: How much lower than the process's the scheduling priority of aload's read threads is (their
#: ``nice`` above the main thread's; Linux only; 0 leaves them as they are). With every core busy
#: copying out of the page cache, the event loop woke to a timer and waited for a core: a stall
#: with the loop thread in ``select`` and only the read threads running (``loop_stalls.py``).
#: Suite children, built-in, alternating with 0, loop lateness p99: warm 8 GiB 2.7-3.9 ms against
#: 3.7-5.3 (5 each), partly evicted 4 GiB 1.8-3.4 against 2.1-4.5 and 8 GiB 1.6-2.9 against
#: 2.9-3.6 (4 each); load times the same within the noise (warm 8 GiB 491-547 ms against 471-560).
#: Other work on the host at the normal priority takes the cores first: set it to 0 where a load
#: should not yield to it.
READ_NICE = 10
#: The environment variable that overrides ``READ_NICE``.
READ_NICE_ENV = "ALOAD_READ_NICE"


def read_nice() -> int:
    """``READ_NICE``, or the value of ``ALOAD_READ_NICE`` (0-19)."""
    said = os.environ.get(READ_NICE_ENV)
    if not said:
        return READ_NICE
    try:
        value = int(said)
    except ValueError:
        value = -1
    if not 0 <= value <= 19:
        raise UsageError(f"{READ_NICE_ENV} must be a whole number from 0 to 19, got {said!r}")
    return value


def lower_priority(by: int) -> None:
    """Make the calling thread's ``nice`` the process's plus ``by`` (at most 19). A thread may
    always lower its own priority; where the platform or a sandbox refuses, it stays as it is."""
    if by <= 0 or not sys.platform.startswith("linux"):
        return
    try:
        # On Linux a thread's id names that thread alone; the process id, its main thread.
        target = min(19, os.getpriority(os.PRIO_PROCESS, os.getpid()) + by)
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), target)
    except OSError:
        pass


#: Whether a local store's read threads are each kept to a core of their own where there are as
#: many of them as cores the process may use (the default: one per core, 2 on the VM measured).
#: Left to the scheduler, the two read threads copying a warm file sometimes shared one core for
#: a whole load, each ``sched_yield`` after a step handing that core to the other thread while
#: the second core sat idle: a 1 GiB warm load in a fresh process, 8 rounds alternating,
#: 49.0-62.1 ms (0.5-49 ms a load spent in those yields) against 48.8-52.6 pinned (0.3-1.0 ms).
#: With more cores than read threads, the scheduler has idle cores to spread them over: no pin.
#: ``ALOAD_READ_PIN=0`` turns it off.
READ_PIN_ENV = "ALOAD_READ_PIN"
_next_core = itertools.count()  # process-wide: each new read thread takes the next core in turn


def read_cores(threads: int) -> list[int] | None:
    """The cores a pool of ``threads`` read threads is spread over, one each, or None where they
    are left to the scheduler (``READ_PIN_ENV``; Linux only)."""
    if os.environ.get(READ_PIN_ENV, "1") == "0" or not hasattr(os, "sched_getaffinity"):
        return None
    try:
        cores = sorted(os.sched_getaffinity(0))
    except OSError:
        return None
    return cores if len(cores) == threads else None


def start_read_thread(by: int, cores: list[int] | None) -> None:
    """A read thread's start: its priority lowered by ``by`` (``lower_priority``) and, where
    ``cores`` are given, the thread kept to the next of them (a sandbox that refuses: as it is)."""
    lower_priority(by)
    if cores:
        try:
            os.sched_setaffinity(threading.get_native_id(), {cores[next(_next_core) % len(cores)]})
        except OSError:
            pass


#: The interpreter's switch interval while a process's first remote load imports its client and
#: builds it on a thread, and while any later S3 client is built (``setup_switches``): that thread
#: runs Python for hundreds of ms the first time (modules executed, botocore's handlers registered
#: and its client built), 10-20 ms later, and Python lets a thread that
#: asks for the GIL wait a whole switch interval (5 ms by default) before it takes it from one that
#: runs Python. A first ``s3://`` load (2 GiB, fresh processes) left the event loop 5.1-7.9 ms
#: late 3-7 times in that set-up at 5 ms (three runs), never over 5 ms with this (nine runs;
#: ``benchmarks/loop_stalls.py DIR --source s3://...``, ``--switch-interval`` to compare).
#: Python's is put back when the last set-up ends, unless somebody changed it meanwhile.
#: ``ALOAD_SETUP_SWITCH_INTERVAL=0`` leaves it alone.
SETUP_SWITCH_S = 0.001
SETUP_SWITCH_ENV = "ALOAD_SETUP_SWITCH_INTERVAL"


class _SetupSwitches:
    """``with setup_switches:`` the switch interval is ``SETUP_SWITCH_S`` (or the environment's)
    meanwhile, where that is shorter than the process's; set-ups at once on several threads nest."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._depth = 0
        self._before: float | None = None  # Python's, to put back
        self._ours: float | None = None  # what was set, as Python reads it back

    def __enter__(self) -> None:
        said = os.environ.get(SETUP_SWITCH_ENV)
        try:
            want = SETUP_SWITCH_S if said is None else float(said)
        except ValueError:
            raise UsageError(
                f"{SETUP_SWITCH_ENV} must be a number of seconds (0: leave Python's), got {said!r}"
            ) from None
        with self._lock:
            self._depth += 1
            if self._depth > 1:
                return
            before = sys.getswitchinterval()
            if 0 < want < before:
                sys.setswitchinterval(want)
                self._before, self._ours = before, sys.getswitchinterval()

    def __exit__(self, *exc: object) -> None:
        with self._lock:
            self._depth -= 1
            if self._depth == 0 and self._before is not None:
                if sys.getswitchinterval() == self._ours:  # nobody else changed it meanwhile
                    sys.setswitchinterval(self._before)
                self._before = self._ours = None


setup_switches = _SetupSwitches()


class LoopBudget:
    """Short blocking-free work done right on the event loop, where a trip to a thread would cost
    more (a local file's index, headers and page-cache look), up to ``PAUSE_AFTER_S`` of it per
    turn of the loop; past that, the caller takes the thread after all."""

    __slots__ = ("_since",)

    def __init__(self) -> None:
        self._since: float | None = None

    def allows(self) -> bool:
        now = time.perf_counter()
        if self._since is None:
            self._since = now
            asyncio.get_running_loop().call_soon(self._reset)  # the next turn starts afresh
        return now - self._since < PAUSE_AFTER_S

    def _reset(self) -> None:
        self._since = None


async def hand_back() -> None:
    """Let the event loop run whatever is due before aload's work on it goes on.

    Not ``asyncio.sleep(0)``: that puts this task back on the ready queue at once, ahead of the
    timers and I/O that fall due meanwhile, and a task they wake takes one more turn of the
    loop, so it ran after aload's next slice too, not this one: two slices late. With
    ``aload.stream`` on the loop (20,000 tensors, warm, the default loop), a 1 ms ticker was
    2.5-3.7 ms late on almost every tick while the tensors came; with a timer of 1 us instead,
    never over 2.5 ms, the stream no slower (three runs each way). uvloop runs its timers before
    its ready queue, where ``sleep(0)`` already did."""
    await asyncio.sleep(1e-6)


class Pacer:
    """Call it now and then from a loop on a thread: at most every ``PACE_S`` of work it lets go
    of the GIL (see ``paced``)."""

    __slots__ = ("_last",)

    def __init__(self) -> None:
        self._last = time.perf_counter()

    def __call__(self) -> None:
        if time.perf_counter() - self._last >= PACE_S:
            time.sleep(0)
            self._last = time.perf_counter()


def paced(items: Iterable[T], check_every: int = CHECK_EVERY) -> Iterator[T]:
    """``items``, letting go of the GIL every ~0.5 ms of the caller's work. A thread that runs
    Python without a call that releases the GIL keeps it for the interpreter's whole switch
    interval (5 ms) each time another thread asks: the event loop fell 5 ms late on every tick
    while a 20,000-tensor checkpoint was planned on a thread. ``time.sleep(0)`` hands it over to
    a thread that waits (p99 lateness 10.5 -> 0.4 ms against a busy thread); it costs ~80 us
    (the kernel's timer slack), hence a pause per so much time and not per so many items: per
    256 items it cost ~2 us per tensor on 20,000 tensors, per ~2 ms the loop was late 5-6 ms
    again (see ``PACE_S``). A cheaper hand-over, ``os.sched_yield()`` (~1 us), does not hand it
    over at all: the waiting thread is not awake yet when this one takes the GIL back. Nor does
    the same sleep with the thread's timer slack at 1 ns (``prctl``; 7-9 us instead of ~57): the
    loop ticked 1-9 times in 0.5-0.8 s, 200-250 ms late (``benchmarks/pacing.py``, 2026-12-05)."""
    pace = Pacer()
    for i, item in enumerate(items, 1):
        yield item
        if i % check_every == 0:
            pace()


#: Entries let go of in one turn of the event loop (see ``free_in_pieces``): ~0.4 ms of tensor specs.
FREE_PIECE = 1024

#: What ``free_in_pieces`` empties: lists, dicts and sets.
Spent = list[Any] | dict[Any, Any] | set[Any]


def free_in_pieces(spent: Iterable[Spent], piece: int = FREE_PIECE) -> None:
    """Empty each of ``spent`` in turn, ``piece`` entries per turn of the running event loop, from
    the next turn on. Where they hold the last references to what is in them, that is freed a
    piece at a time: a load's checkpoint and plan, freed in one go when ``load`` returned, held
    the loop 12 ms on 20,000 tensors and ~48 ms on DeepSeek-V3's 89,820. Should the loop close
    first, the rest goes with it."""
    loop = asyncio.get_running_loop()
    loop.call_soon(_Emptying(loop, iter(spent), piece))


class _Emptying:
    """One piece of ``free_in_pieces`` per call, then the next one scheduled (an object, not a
    closure, which would refer to itself: a cycle keeping what it holds for the collector)."""

    __slots__ = ("current", "loop", "piece", "todo")

    def __init__(self, loop: asyncio.AbstractEventLoop, todo: Iterator[Spent], piece: int) -> None:
        self.loop, self.todo, self.piece = loop, todo, piece
        self.current: Spent = []

    def __call__(self) -> None:
        left = self.piece
        while left > 0:
            current = self.current
            if not current:
                nxt = next(self.todo, None)
                if nxt is None:
                    return
                self.current = nxt
                continue
            n = min(left, len(current))
            if isinstance(current, list):
                del current[len(current) - n :]
            else:
                take: Callable[[], object] = current.popitem if isinstance(current, dict) else current.pop
                for _ in range(n):
                    take()
            left -= n
        self.loop.call_soon(self)


def start_thread(
    fn: Callable[..., T], *args: Any, name: str = "aload-worker"
) -> tuple[asyncio.Future[T], threading.Thread]:
    """Start ``fn(*args)`` on a new thread; the future resolves on the current loop."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[T] = loop.create_future()

    def deliver(result: Any, error: BaseException | None) -> None:
        if fut.cancelled():
            return
        if error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(result)

    def body() -> None:
        # ``Thread.start`` returns once this thread has signalled that it runs, and the loop thread
        # then needs the GIL back; running Python straight away kept it from the loop for the
        # switch interval (5.5-6 ms late at the walk's start in 4 of 4 loads, 0 of 4 with this).
        time.sleep(0)
        try:
            result, error = fn(*args), None
        except BaseException as exc:  # delivered to the awaiting task, re-raised there
            result, error = None, exc
        try:
            loop.call_soon_threadsafe(deliver, result, error)
        except RuntimeError:  # the loop closed while we ran: nobody is waiting
            pass

    thread = threading.Thread(target=body, name=name, daemon=True)
    thread.start()
    return fut, thread


async def run_in_thread(fn: Callable[..., T], *args: Any) -> T:
    """``await`` a blocking call on its own thread; the thread has ended when this returns."""
    fut, thread = start_thread(fn, *args)
    try:
        return await asyncio.shield(fut)
    finally:
        if not fut.done():
            await asyncio.wait([fut])
        while thread.is_alive():  # it is exiting; joining here could hold the loop for ms
            await asyncio.sleep(0.0005)
