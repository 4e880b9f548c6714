"""Where a load's time goes, phase by phase: when each phase of ``aload.load`` started (from the
call) and how long it took, on which thread, for a few loads in one process.

    python benchmarks/phases.py CHECKPOINT_DIR [--loads 3] [--scenario warm|cold|partial]

The model is the suite's (a preallocated bf16 module tree with a parameter per tensor, every page
touched), then ``gc.collect()``, as in the suite's children. The phases are aload's own functions,
timed by wrapping them: the model's walk (``install._walk``), each shard's head read
(``checkpoint._read_head``), its JSON (``format.loads_header``) and specs (``format._specs``),
the checkpoint's assembly (``checkpoint._assemble``), the whole open (``checkpoint._read_layout``)
and the plan (``plan._make_plan``); then the report's ``opened_s``, ``planned_s`` and the total.
The first load is the one a fresh process makes (the suite's); later ones show what is left once
the process is warm.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import gc
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.suite import preallocated_model, set_page_cache

#: (module, function) pairs timed, in the order a load reaches them.
PHASES = (
    ("install", "_walk"),
    ("checkpoint", "_read_head"),
    ("format", "loads_header"),
    ("format", "_specs"),
    ("checkpoint", "_assemble"),
    ("checkpoint", "_read_layout"),
    ("plan", "_make_plan"),
)


def timed(fn: Any, name: str, log: list[tuple[str, float, float, str]], t0: list[float]) -> Any:
    if asyncio.iscoroutinefunction(fn):

        @functools.wraps(fn)
        async def wrapper_async(*args: Any, **kwargs: Any) -> Any:
            t = time.perf_counter()
            try:
                return await fn(*args, **kwargs)
            finally:
                log.append((name, t - t0[0], time.perf_counter() - t, "loop"))

        return wrapper_async

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            log.append((name, t - t0[0], time.perf_counter() - t, threading.current_thread().name))

    return wrapper


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folder", type=Path)
    ap.add_argument("--loads", type=int, default=3)
    ap.add_argument("--scenario", choices=("warm", "cold", "partial"), default="warm")
    a = ap.parse_args()

    import importlib

    import aload

    log: list[tuple[str, float, float, str]] = []
    t0 = [0.0]
    for mod_name, fn_name in PHASES:
        mod = importlib.import_module(f"aload.{mod_name}")
        setattr(mod, fn_name, timed(getattr(mod, fn_name), fn_name, log, t0))
    model, _ = preallocated_model(a.folder, "cpu")
    gc.collect()

    async def run() -> None:
        for i in range(a.loads):
            set_page_cache(a.folder, a.scenario)
            log.clear()
            t0[0] = time.perf_counter()
            r = await aload.load(model, a.folder)
            assert r.opened_s is not None and r.planned_s is not None
            print(
                f"load {i + 1}: {r.tensors} tensors in {r.seconds * 1e3:.0f} ms "
                f"({r.seconds / max(r.tensors, 1) * 1e6:.1f} us per tensor); opened at {r.opened_s * 1e3:.0f} ms, "
                f"planned at {r.planned_s * 1e3:.0f}, first tensor at {(r.ttft_s or 0) * 1e3:.0f}"
            )
            for name, start, took, thread in log:
                print(f"    {name:14s} at {start * 1e3:6.1f} ms, {took * 1e3:6.1f} ms  ({thread})")

    asyncio.run(run())


if __name__ == "__main__":
    main()
