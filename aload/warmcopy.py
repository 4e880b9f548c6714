"""Which copy brings bytes from the page cache into their destinations the faster, on this host,
now: the kernel's (``preadv``) or a ``memcpy`` out of the file's private mapping.

Neither wins everywhere, nor on one host all day. On the KVM guest measured here
(``benchmarks/local_reads.py CKPT --scenarios warm``, 2 threads, 4 and 8 GiB), ``preadv`` ran at
17.8-26.3 GB/s against the mapping's 13.8-15.5 on 2026-12-02 and at 11.0-11.3 against 13.7-15.1
on the evening of 2026-12-03 (docs/benchmarks.md, "Warm copies chosen at run time"); loaders
that copy out of a mapping (``safe_open``, ``load_file``) rose and fell with it. So each load times its first steps both ways, takes the faster, and keeps timing the other
now and then (``EXPLORE``), in case the hour turns mid-load.
"""

from __future__ import annotations

import os
import statistics
import threading
from collections import deque

from .errors import UsageError

#: The environment variable that fixes the copy for every load of the process: "auto" (timed,
#: the default), "pread" or "map".
COPY_ENV = "ALOAD_WARM_COPY"
COPY_MODES = ("auto", "pread", "map")
PREAD, MAP = 0, 1
#: Steps timed each way before either is preferred (the first steps alternate).
TRIAL = 3
#: The latest timings kept each way; their medians are compared.
WINDOW = 5
#: Once one way is preferred, one step in this many goes the other way, to see whether it still
#: loses (one step in 32 at a third slower costs ~1% of the load).
EXPLORE = 32
#: Exploring steps of the other way that must say it was faster, by the median of their ratios to
#: the preferred way's latest steps, before the preference turns.
SWITCH_AFTER = 3
#: ... by this much at least: a step's time swings by a third from one to the next here, and ways
#: within a tenth of each other are not worth turning for.
SWITCH_RATIO = 0.9
#: Steps under this size (a tensor's tail) go by ``preadv``, untimed: the mapping's fixed costs
#: (the length check, two ``madvise`` calls) weigh on them, and their timings say little.
CHOOSE_MIN_BYTES = 4 << 20


def copy_mode() -> str:
    mode = os.environ.get(COPY_ENV) or "auto"
    if mode not in COPY_MODES:
        raise UsageError(f"{COPY_ENV} must be one of {COPY_MODES}, got {mode!r}")
    return mode


class CopyChoice:
    """One load's choice between ``PREAD`` and ``MAP``, shared by the load's read threads. The
    first steps go both ways at once (``TRIAL``) and the faster by their medians is preferred;
    from then on the way not preferred is tried one step in ``EXPLORE`` (one in a quarter of that
    until it has been tried ``SWITCH_AFTER`` times since the preference was set), each such step
    timed against the preferred way's latest steps (their median, ``WINDOW``), and the preference
    turns once the median of the last ``SWITCH_AFTER`` of those ratios is under ``SWITCH_RATIO``.

    Comparing each way's latest timings instead (the preferred way's from the last few
    milliseconds, the other's from its last exploring steps, long before) let a slow stretch of
    the host turn the choice back and forth: a process's first 4 GiB load (six processes,
    docs/benchmarks.md, stop 53) sent 5-71% of its steps by ``preadv``, in runs of 20-60, where
    the mapping's steps ran 8-26% faster (medians)."""

    __slots__ = ("_best", "_lock", "_mode", "_ratios", "_steps", "_times", "counts")

    def __init__(self, mode: str = "auto") -> None:
        self._mode = mode
        self._lock = threading.Lock()
        self._times = (deque[float](maxlen=WINDOW), deque[float](maxlen=WINDOW))
        self._best: int | None = None  # the way preferred, once the trial has timed both
        self._ratios = deque[float](maxlen=SWITCH_AFTER)  # the other way's steps against it
        self._steps = 0
        self.counts = [0, 0]  # steps timed each way: ``chosen``, and the tests

    def pick(self, nbytes: int) -> int:
        """The way the next step, of ``nbytes``, goes."""
        if nbytes < CHOOSE_MIN_BYTES:
            return PREAD
        if self._mode != "auto":
            return MAP if self._mode == "map" else PREAD
        with self._lock:
            n = self._steps
            self._steps += 1
            best = self._best
            if best is None:
                pread, mapped = self._times
                if len(pread) < TRIAL or len(mapped) < TRIAL:
                    return n % 2  # concurrent steps go different ways: timed under the same load
                best = self._best = PREAD if statistics.median(pread) <= statistics.median(mapped) else MAP
            # Until the other way has SWITCH_AFTER steps against this one (after the trial, after a
            # turn), it is looked at four times as often: a trial of 3 steps each way in a slow
            # first second picked the slower way, and 192 of 462 steps went by it.
            every = EXPLORE if len(self._ratios) == SWITCH_AFTER else EXPLORE // 4
            return 1 - best if n % every == 0 else best

    def record(self, way: int, nbytes: int, ns: int) -> None:
        """A step of ``nbytes`` went ``way`` in ``ns`` nanoseconds."""
        if nbytes >= CHOOSE_MIN_BYTES:
            per_byte = ns / nbytes
            with self._lock:
                best = self._best
                if best is not None and way != best and self._times[best]:
                    self._ratios.append(per_byte / statistics.median(self._times[best]))
                    if len(self._ratios) == SWITCH_AFTER and statistics.median(self._ratios) < SWITCH_RATIO:
                        self._best = way
                        self._ratios.clear()
                self._times[way].append(per_byte)
                self.counts[way] += 1

    @property
    def maps(self) -> bool:
        """Whether copies out of the mapping are the preferred way now (fixed so, or timed so)."""
        return self._mode == "map" or (self._mode == "auto" and self._best == MAP)

    @property
    def chosen(self) -> str | None:
        """The way most steps went ("pread" or "map"); None before any step."""
        pread, mapped = self.counts
        if pread == mapped == 0:
            return None
        return "map" if mapped > pread else "pread"
