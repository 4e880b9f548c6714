"""A load's first milliseconds, in fresh processes: when the checkpoint was opened and planned,
when the model got its first tensor, which threads were started and how long each start held the
thread that started it, and the whole load, for aload (built-in and through ``load_weights``)
against the ``safe_open`` loop, alternating, each load in a process of its own as in the suite.

    python benchmarks/start.py CHECKPOINT_DIR [--loaders aload,aload_lw,safe_open] [--rounds 8]
        [--cold | --partial] [--nap S] [--tree DIR ...] [--json FILE]

For a warm run, the header gives the share of the checkpoint the page cache holds in 2 MiB pages
(``suite.huge_share``), which sets the pace of every loader that copies out of a mapping. The
page cache is left as earlier loads left it; ``suite.fresh_cache`` resets it.

``--tree DIR`` adds aload from another tree (a folder holding an ``aload/`` package, such as
``git archive REF aload | tar -x -C DIR``) as loaders of their own (``aload@DIR``), for an A/B of
a change against the code before it in the same minutes. ``--nap S`` sleeps between building the
model and the load (the suite warms the page cache there, ~0.1-0.5 s): on the 2-core VM measured,
the first ~30 ms of a load right after a 4 GiB model was allocated sometimes ran ~5x slower, every
step on the loop taking that much more CPU time, with aload's code before and after a change
alike; after a nap of 0.5 s, not in 8 loads (docs/benchmarks.md, stop 50).

The model is the suite's (``preallocated_model``, touched, then ``gc.collect()``); the page cache
is warmed (``--cold``: dropped) after it is built. A start that held the event loop is one made
on the main thread, which runs the loop here.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
AT = "@"  # aload@DIR: aload from another tree
TREE_ENV = "START_TREE"  # in a child: the tree whose aload it loads with, ahead of this one
if os.environ.get(TREE_ENV):
    sys.path.insert(0, os.environ[TREE_ENV])


def run_child(loader: str, folder: Path, scenario: str, nap: float) -> dict[str, Any]:
    import aload  # before the suite, which puts this tree first on the path
    from benchmarks.suite import engine_and_peer, preallocated_model, set_page_cache, shards

    model, params = preallocated_model(folder)
    gc.collect()
    set_page_cache(folder, scenario)
    time.sleep(nap)
    from aload.bench import Probe

    starts: list[tuple[str, float, float, bool]] = []
    real_start = threading.Thread.start
    t0 = 0.0

    def start(self: threading.Thread) -> None:
        at = time.perf_counter()
        real_start(self)
        if t0 and self.name != "bench-sampler":  # the load's, not the harness's
            starts.append(
                (self.name, at - t0, time.perf_counter() - at, threading.current_thread() is threading.main_thread())
            )

    threading.Thread.start = start  # type: ignore[method-assign]
    first: list[float] = []  # when the first tensor is handed to the model (the suite: after its copy)
    files = [str(p) for p in shards(folder)]
    engine, blocking = engine_and_peer(params, loader, files, None, first, after_copy=False)

    async def main() -> dict[str, Any]:
        nonlocal t0
        async with Probe() as probe:
            t0 = time.perf_counter()
            report = None
            if loader.startswith("aload"):
                report = await aload.load(engine if loader == "aload_lw" else model, folder)
            else:
                await asyncio.to_thread(blocking)
            seconds = time.perf_counter() - t0
        ttft = report.ttft_s if report is not None and loader == "aload" else (first[0] - t0 if first else None)
        return {
            "ms": seconds * 1e3,
            "opened_ms": report.opened_s * 1e3 if report is not None and report.opened_s is not None else None,
            "planned_ms": report.planned_s * 1e3 if report is not None and report.planned_s is not None else None,
            "first_ms": ttft * 1e3 if ttft is not None else None,
            "loop_starts": sum(1 for s in starts if s[3]),
            "loop_start_ms": sum(s[2] for s in starts if s[3]) * 1e3,
            "starts": [(n, round(a * 1e3, 2), round(d * 1e3, 2), loop) for n, a, d, loop in starts],
            "loop_lag_p99_ms": probe.row()["loop_lag_p99_ms"],
            "aload": str(Path(aload.__file__).parent),
        }

    return asyncio.run(main())


def child(label: str, folder: Path, scenario: str, nap: float) -> dict[str, Any]:
    loader, _, tree = label.partition(AT)
    env = {k: v for k, v in os.environ.items() if k != TREE_ENV}
    if tree:
        env[TREE_ENV] = tree
    cmd = [sys.executable, str(Path(__file__).resolve()), str(folder), "--child", loader, "--nap", str(nap)]
    cmd += ["--scenario", scenario]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise SystemExit(f"{label}: {out.stderr[-2000:]}")
    row: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    row["loader"] = label
    return row


def summary(values: list[float | None]) -> str:
    got = [v for v in values if v is not None]
    if not got:
        return "-"
    return f"{statistics.median(got):.1f} ({min(got):.1f}-{max(got):.1f})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("folder", type=Path)
    ap.add_argument("--loaders", default="aload,aload_lw,safe_open", help="aload, aload_lw, or a suite peer")
    ap.add_argument("--rounds", type=int, default=8)
    cache = ap.add_mutually_exclusive_group()
    cache.add_argument(
        "--cold", dest="scenario", action="store_const", const="cold", help="the checkpoint dropped from the page cache"
    )
    cache.add_argument(
        "--partial",
        dest="scenario",
        action="store_const",
        const="partial",
        help="warm, then the first 10%% of each shard dropped, as the suite's",
    )
    ap.add_argument("--scenario", help=argparse.SUPPRESS)  # the child's
    ap.set_defaults(scenario="warm")
    ap.add_argument("--nap", type=float, default=0.0, help="seconds between building the model and the load")
    ap.add_argument("--tree", action="append", default=[], help="also aload from this tree (repeatable)")
    ap.add_argument("--json", type=Path, help="write every load's row here")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(run_child(a.child, a.folder, a.scenario, a.nap)))
        return
    labels = a.loaders.split(",")
    for tree in a.tree:
        labels += [f"{ld}{AT}{Path(tree).resolve()}" for ld in labels if ld.startswith("aload") and AT not in ld]
    rows: list[dict[str, Any]] = []
    for r in range(a.rounds):
        for label in labels if r % 2 == 0 else labels[::-1]:
            rows.append(child(label, a.folder, a.scenario, a.nap))
        print(f"round {r + 1} of {a.rounds}", file=sys.stderr, flush=True)
    from benchmarks.suite import huge_share

    # The page cache's layout sets the pace of the loaders that copy out of a mapping: said with
    # the figures. Warm only: a touch would read what a cold or partial run left out.
    share = huge_share(a.folder) if a.scenario == "warm" else None
    held = f"; {share:.0%} of it in 2 MiB pages of the page cache" if share is not None else ""
    print(f"{a.folder}, {a.scenario}, {a.rounds} rounds{held}; median (min-max), ms from the call")
    cols = ["ms", "opened_ms", "planned_ms", "first_ms", "loop_start_ms", "loop_lag_p99_ms"]
    print("| loader | load | opened | planned | first tensor | thread starts on the loop | loop lag p99 |")
    print("|---|---|---|---|---|---|---|")
    for label in labels:
        mine = [row for row in rows if row["loader"] == label]
        cells = [summary([row[c] for row in mine]) for c in cols]
        n = statistics.median(row["loop_starts"] for row in mine)
        cells[4] = f"{n:g}: {cells[4]}"
        print(f"| {label} | " + " | ".join(cells) + " |")
    if a.json:
        a.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
