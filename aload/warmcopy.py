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
#: Steps under this size (a tensor's tail) go by ``preadv``, untimed: the mapping's fixed costs
#: (the length check, two ``madvise`` calls) weigh on them, and their timings say little.
CHOOSE_MIN_BYTES = 4 << 20


def copy_mode() -> str:
    mode = os.environ.get(COPY_ENV) or "auto"
    if mode not in COPY_MODES:
        raise UsageError(f"{COPY_ENV} must be one of {COPY_MODES}, got {mode!r}")
    return mode


class CopyChoice:
    """One load's choice between ``PREAD`` and ``MAP``, made step by step from the nanoseconds
    per byte each took lately; shared by the load's read threads."""

    __slots__ = ("_lock", "_mode", "_steps", "_times", "counts")

    def __init__(self, mode: str = "auto") -> None:
        self._mode = mode
        self._lock = threading.Lock()
        self._times = (deque[float](maxlen=WINDOW), deque[float](maxlen=WINDOW))
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
            pread, mapped = self._times
            if len(pread) < TRIAL or len(mapped) < TRIAL:
                return n % 2  # concurrent steps go different ways: timed under the same load
            best = PREAD if statistics.median(pread) <= statistics.median(mapped) else MAP
            return 1 - best if n % EXPLORE == 0 else best

    def record(self, way: int, nbytes: int, ns: int) -> None:
        """A step of ``nbytes`` went ``way`` in ``ns`` nanoseconds."""
        if nbytes >= CHOOSE_MIN_BYTES:
            with self._lock:
                self._times[way].append(ns / nbytes)
                self.counts[way] += 1

    @property
    def chosen(self) -> str | None:
        """The way most steps went ("pread" or "map"); None before any step."""
        pread, mapped = self.counts
        if pread == mapped == 0:
            return None
        return "map" if mapped > pread else "pread"
