"""Where the event loop is late during one load, and why: the stall sampler the lateness notes in
docs/benchmarks.md come from.

    python benchmarks/loop_stalls.py CHECKPOINT_DIR [--load-weights | --stream] [--cold | --partial] [--late-ms 3]
        [--source URL [--preload]] [--switch-interval S]

``--source`` loads the same checkpoint from a URL instead (``http(s)://`` or ``s3://``, with the
endpoint and credentials from the usual AWS variables), the model still built from the folder;
``--preload`` calls ``aload.preload()`` first, as a serving process would at start-up.

A 1 ms ticker runs on the loop while ``aload.load`` fills a preallocated model (or, with
``--load-weights``, a vLLM-style ``load_weights`` that ``copy_()``s each tensor; with ``--stream``,
``aload.stream`` on the loop, each tensor dropped, as ``aload bench`` does). A watchdog thread
looks every 0.5 ms; when the ticker is more than ``--late-ms`` late, it records the loop thread's
stack and the stack of every other thread that is not idle in a pool, so a stall shows what held
the loop up: the GIL held by Python on another thread, a thread start (``Thread.start`` waits for
the new thread), a lock, or no core free. One line per stall: milliseconds since the load began,
how late, the loop thread's innermost frames; then the busy threads; then every garbage
collection that took longer than ``--late-ms``, on whichever thread it ran. Python's profilers do not
show these (the loop thread is not running, it is waiting). As in the suite, the model is built
and then ``gc.collect()`` runs before the load (``--no-gc-collect``: not), or the full collection
that building it left due falls in the load (92-118 ms on the loop, first tensor 126-155 ms
against 31-60 with the collection, Qwen2.5-0.5B-shaped, warm, here).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.suite import PARTIAL_EVICT, drop_cache, evict_head, preallocated_model, warm_cache

#: A pool thread waiting for work (``concurrent.futures.thread._worker`` at its queue ``get``).
_IDLE = ("_worker", "thread.py")


def frames(frame: Any, depth: int) -> str:
    stack = traceback.extract_stack(frame)[-depth:]
    return " < ".join(f"{Path(f.filename).name}:{f.name}:{f.lineno}" for f in reversed(stack))


def idle(frame: Any) -> bool:
    top = traceback.extract_stack(frame)[-1]
    return (top.name, Path(top.filename).name) == _IDLE or top.name in ("wait", "_wait_for_tstate_lock")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("folder", type=Path)
    how = ap.add_mutually_exclusive_group()
    how.add_argument("--load-weights", action="store_true", help="through a vLLM-style load_weights")
    how.add_argument("--stream", action="store_true", help="aload.stream on the loop, as aload bench does")
    cache = ap.add_mutually_exclusive_group()
    cache.add_argument("--cold", action="store_true", help="drop the files from the page cache first")
    cache.add_argument(
        "--partial",
        action="store_true",
        help=f"the suite's partial scenario: the first {PARTIAL_EVICT * 100:.0f}%% of each file evicted",
    )
    ap.add_argument("--late-ms", type=float, default=3.0)
    ap.add_argument("--source", help="load from this URL (the folder gives the model's shapes)")
    ap.add_argument("--preload", action="store_true", help="aload.preload() before the load")
    ap.add_argument(
        "--gc-collect",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="gc.collect() after building the model, as the suite does (default)",
    )
    ap.add_argument("--switch-interval", type=float, help="sys.setswitchinterval first (default: Python's, 0.005 s)")
    a = ap.parse_args()
    if a.switch_interval is not None:
        sys.setswitchinterval(a.switch_interval)

    import torch

    import aload

    model, params = preallocated_model(a.folder)
    if a.gc_collect:  # building the model leaves a full collection due: ~100 ms on the loop in the load
        gc.collect()
    drop_cache(a.folder) if a.cold else warm_cache(a.folder)
    if a.partial:
        evict_head(a.folder)
    if a.preload:
        aload.preload()

    class Engine(torch.nn.Module):
        def load_weights(self, weights: Any) -> set[str]:
            for name, t in weights:
                params[name].data.copy_(t)
            return set()

    loop_thread = threading.get_ident()
    last = [time.perf_counter()]
    t0 = [0.0]
    stop = threading.Event()
    stalls: list[tuple[float, float, str, list[str]]] = []

    def watch() -> None:
        me = threading.get_ident()
        while not stop.wait(0.0005):
            late = time.perf_counter() - last[0]
            if late * 1e3 <= a.late_ms:
                continue
            current = sys._current_frames()
            loop_frame = current.get(loop_thread)
            busy = [frames(f, 4) for tid, f in current.items() if tid not in (loop_thread, me) and not idle(f)]
            stalls.append((time.perf_counter() - t0[0], late, frames(loop_frame, 5) if loop_frame else "?", busy))
            while time.perf_counter() - last[0] > a.late_ms / 1e3 and not stop.is_set():
                time.sleep(0.0005)  # one record per stall

    collections: list[tuple[float, int, float, str]] = []  # at, generation, ms, thread
    began: list[float] = [0.0]

    def on_gc(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            began[0] = time.perf_counter()
        elif t0[0] and (took := time.perf_counter() - began[0]) * 1e3 > a.late_ms:
            collections.append((began[0] - t0[0], info["generation"], took, threading.current_thread().name))

    gc.callbacks.append(on_gc)

    async def run() -> Any:
        async def tick() -> None:
            while True:
                last[0] = time.perf_counter()
                await asyncio.sleep(0.001)

        ticker = asyncio.ensure_future(tick())
        await asyncio.sleep(0)
        watcher = threading.Thread(target=watch, name="stall-watch", daemon=True)
        watcher.start()
        t0[0] = time.perf_counter()
        try:
            if not a.stream:
                return (await aload.load(Engine() if a.load_weights else model, a.source or a.folder)).summary()
            async with aload.stream(a.source or a.folder) as s:
                async for pair in s:
                    del pair  # not held while the next is awaited
                return f"streamed {s.stats.tensors} tensors, {s.stats.bytes / 1e9:.3f} GB"
        finally:
            stop.set()
            ticker.cancel()
            watcher.join()

    print(asyncio.run(run()))
    print(f"{len(stalls)} stall(s) over {a.late_ms} ms:")
    for at, late, loop_stack, busy in stalls:
        print(f"{at * 1e3:8.1f} ms  {late * 1e3:5.1f} ms late  loop: {loop_stack}")
        for b in busy:
            print(f"{'':26}busy: {b}")
    for at, gen, took, thread in collections:  # the collector holds the GIL: a stall on any thread
        print(f"{at * 1e3:8.1f} ms  garbage collection of generation {gen}: {took * 1e3:.1f} ms, on {thread}")


if __name__ == "__main__":
    main()
