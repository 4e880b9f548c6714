"""What aload's pause (``aload._threads.Pacer``) costs a thread running Python, and what it buys
the event loop, against the other ways to hand the GIL over.

    python benchmarks/pacing.py [--items 2000000] [--rounds 2]

A thread runs pure Python (dict stores, a pause looked at every 64 items) while the event loop
ticks every 1 ms. Each way is run in a fresh process, the ways alternating, ``--rounds`` times:

- ``none``: no pause; the interpreter's switch interval (5 ms) decides;
- ``sleep(0)``: aload's ``Pacer``, ``time.sleep(0)`` after each ~0.5 ms of work;
- ``sleep(0), slack 1 ns``: the same, with the thread's timer slack at 1 ns
  (``prctl(PR_SET_TIMERSLACK)``, Linux), so that the sleep returns at once;
- ``switch 0.5 ms``: no pause, the switch interval at 0.5 ms for the process.

Prints the thread's time for the work, the pauses and their median length, and how late the
loop's ticks ran (p50, p99, max).
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import json
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# aload's own pace (the loop below is ``Pacer``'s, timed per pause)
from aload._threads import CHECK_EVERY, PACE_S

WAYS = ("none", "sleep(0)", "sleep(0), slack 1 ns", "switch 0.5 ms")
PR_SET_TIMERSLACK = 29


def work(way: str, items: int, out: dict[str, Any]) -> None:
    if way == "sleep(0), slack 1 ns":
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_TIMERSLACK, ctypes.c_ulong(1), 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_TIMERSLACK)")
    pause = way.startswith("sleep(0)")
    sleeps: list[float] = []
    d: dict[int, tuple[int, str]] = {}
    t0 = last = time.perf_counter()
    for i in range(items):
        d[i & 1023] = (i, str(i))
        if pause and i % CHECK_EVERY == 0 and time.perf_counter() - last >= PACE_S:
            s = time.perf_counter()
            time.sleep(0)
            last = time.perf_counter()
            sleeps.append(last - s)
    out["work_s"] = time.perf_counter() - t0
    out["pauses"] = len(sleeps)
    out["pause_p50_us"] = sorted(sleeps)[len(sleeps) // 2] * 1e6 if sleeps else 0.0


async def one(way: str, items: int) -> dict[str, Any]:
    if way == "switch 0.5 ms":
        sys.setswitchinterval(0.0005)
    out: dict[str, Any] = {}
    worker = threading.Thread(target=work, args=(way, items, out))
    worker.start()
    late: list[float] = []
    while worker.is_alive():
        t = time.perf_counter()
        await asyncio.sleep(0.001)
        late.append((time.perf_counter() - t - 0.001) * 1e3)
    worker.join()
    ticks = len(late)
    late = sorted(late) or [0.0]  # no tick at all where the work ended first
    out.update(
        ticks=ticks, late_p50_ms=late[len(late) // 2], late_p99_ms=late[int(len(late) * 0.99)], late_max_ms=late[-1]
    )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--items", type=int, default=2_000_000)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--way", choices=WAYS, help=argparse.SUPPRESS)  # one way, in this process
    a = ap.parse_args()
    if a.way:
        print(json.dumps(asyncio.run(one(a.way, a.items))))
        return
    print(f"{a.items} items of Python on a thread, the loop ticking every 1 ms; a fresh process each")
    for r in range(a.rounds):
        for way in WAYS if r % 2 == 0 else WAYS[::-1]:
            cmd = [sys.executable, __file__, "--way", way, "--items", str(a.items)]
            row = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout)
            print(
                f"{way:22s} work {row['work_s'] * 1e3:6.0f} ms, {row['pauses']:5d} pauses of "
                f"{row['pause_p50_us']:5.1f} us; loop {row['ticks']:4d} ticks, late p50 {row['late_p50_ms']:6.2f} "
                f"p99 {row['late_p99_ms']:6.2f} max {row['late_max_ms']:6.2f} ms"
            )


if __name__ == "__main__":
    main()
