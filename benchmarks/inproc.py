"""Warm loads in one process, loaders alternating, for an A/B finer than fresh processes give:
the figures the warm notes of stop 54 in docs/benchmarks.md come from.

    python benchmarks/inproc.py CHECKPOINT_DIR [--loaders aload,aload_lw,load_file,safe_open,raw]
        [--tree DIR ...] [--rounds 8] [--split]

Each loader fills the same preallocated model (the suite's ``preallocated_model``) once a round,
in the order given; it prints each loader's loads, fastest first, as wall/CPU milliseconds of the
process. On the 2-core VM measured, a load in fresh processes (``start.py``, the suite) swung by
±15% from one process to the next, which hid changes of 1-5%; in one process the loaders share
the host's hour (it still turns fast and slow within minutes: compare rounds, not runs). The page
cache is left as it is (``suite.fresh_cache`` sets it as the suite does).

- ``aload``: the built-in loader; ``aload_lw``: through a vLLM-style ``load_weights`` that
  ``copy_()``s each tensor (the suite's engine); a suite peer by its name (``load_file``,
  ``safe_open``, ``threadpool``...), run on a thread through ``asyncio.to_thread`` as there.
- ``raw``: the floor for a warm copy on this host: each shard mapped, every tensor copied into
  its parameter by ``memcpy`` in 8 MiB steps on two threads, nothing else (no header parsing, no
  event loop, the pages never let go until the end); ``raw_nt``: the same by aload's copy past
  the caches (``aload._ntcopy``, ``memcpy`` where there is none), the floor for aload since stop 55.
- ``--tree DIR`` (a folder holding an ``aload/`` package, such as ``git archive REF aload | tar -x
  -C DIR``) adds ``aload@DIR`` and ``aload_lw@DIR``: that tree's package, imported under another
  name beside this one (aload's modules import each other relatively).
- ``--split``: for ``aload_lw`` and ``safe_open``, where the model's thread spent the load (waiting
  for the next tensor, in ``copy_()``, dropping the tensor); for ``aload``, the event loop's
  thread's CPU time.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import importlib
import json
import os
import shutil
import statistics
import struct
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

STEP = 8 << 20  # raw: bytes a memcpy
AT = "@"


def import_tree(tree: Path, index: int, into: Path) -> Any:
    """The ``aload`` package of ``tree``, imported as ``aload_tree<index>``, its stores its own:
    the registry names their modules in full (``"aload.local:LocalStore"``), which without this
    made another tree's loads read local files with this tree's ``aload.local`` (the A/Bs of
    stop 54 with ``--tree`` compared the reader, the bridge and the plan, not the local reads)."""
    name = f"aload_tree{index}"
    shutil.copytree(tree / "aload", into / name)
    if str(into) not in sys.path:
        sys.path.insert(0, str(into))
    pkg = importlib.import_module(name)
    sources = importlib.import_module(f"{name}.sources")
    for scheme, (target, extra) in list(sources.STORES.items()):
        if target.startswith("aload."):
            sources.STORES[scheme] = (name + target[len("aload") :], extra)
    return pkg


def layout(files: list[str]) -> list[tuple[str, str, int, int]]:
    """(file, tensor, offset in the file, bytes) of every tensor, from the headers."""
    out = []
    for f in files:
        with open(f, "rb") as fh:
            n = struct.unpack("<Q", fh.read(8))[0]
            header = json.loads(fh.read(n))
        for name, spec in header.items():
            if name != "__metadata__":
                lo, hi = spec["data_offsets"]
                out.append((f, name, 8 + n + lo, hi - lo))
    return out


def raw_copy(
    params: dict[str, Any], files: list[str], tensors: list[tuple[str, str, int, int]], streaming: bool = False
) -> None:
    from aload._ntcopy import copy_bytes
    from aload._syscalls import libc, map_private

    assert libc is not None
    step_copy = copy_bytes if streaming else libc.memcpy
    maps = {}
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        maps[f] = map_private(fd, os.fstat(fd).st_size, f)
        os.close(fd)
    work = []
    for f, name, off, n in tensors:
        dst, src = params[name].data.data_ptr(), maps[f].ctypes.data + off
        work += [(dst + o, src + o, min(STEP, n - o)) for o in range(0, n, STEP)]
    todo, lock = iter(work), threading.Lock()

    def copy() -> None:
        while True:
            with lock:
                step = next(todo, None)
            if step is None:
                return
            step_copy(*step)

    threads = [threading.Thread(target=copy) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


class Split:
    """Where the model's thread spent a load: waiting for the next tensor, copying, dropping."""

    def __init__(self) -> None:
        self.wait = self.copy = self.drop = 0.0

    def feed(self, pairs: Any, params: dict[str, Any]) -> None:
        it = iter(pairs)
        while True:
            t0 = time.perf_counter()
            pair = next(it, None)
            t1 = time.perf_counter()
            self.wait += t1 - t0
            if pair is None:
                return
            name, tensor = pair
            params[name].data.copy_(tensor)
            t2 = time.perf_counter()
            del pair, tensor
            self.copy += t2 - t1
            self.drop += time.perf_counter() - t2

    def __str__(self) -> str:
        return f"wait {self.wait * 1e3:.1f} copy {self.copy * 1e3:.1f} drop {self.drop * 1e3:.1f}"


def load_once(
    kind: str, pkg: Any, folder: Path, params: dict[str, Any], model: Any, split_on: bool
) -> tuple[float, float, str]:
    """One load by ``kind`` (from the aload package ``pkg`` where it is aload's): wall and CPU
    milliseconds, and with ``split_on`` where the model's thread (or the loop) spent it."""
    import torch
    from safetensors import safe_open

    from benchmarks.suite import engine_and_peer, shards

    files = [str(p) for p in shards(folder)]
    split = Split()

    class Engine(torch.nn.Module):
        def load_weights(self, weights: Any) -> set[str]:
            split.feed(weights, params)
            return set()

    _, blocking = engine_and_peer(params, kind, files, None, [])
    if kind == "safe_open" and split_on:

        def blocking() -> None:
            for f in files:
                with safe_open(f, "pt") as fh:
                    split.feed(((k, fh.get_tensor(k)) for k in fh.keys()), params)

    tensors = layout(files) if kind in ("raw", "raw_nt") else []  # read before the clock starts
    t, c, loop0 = time.perf_counter(), time.process_time(), time.thread_time()
    if kind == "aload":
        asyncio.run(pkg.load(model, folder))
    elif kind == "aload_lw":
        asyncio.run(pkg.load(Engine(), folder))
    elif kind in ("raw", "raw_nt"):
        raw_copy(params, files, tensors, streaming=kind == "raw_nt")
    else:
        asyncio.run(asyncio.to_thread(blocking))
    wall, cpu = (time.perf_counter() - t) * 1e3, (time.process_time() - c) * 1e3
    note = ""
    if split_on:
        note = f"loop {(time.thread_time() - loop0) * 1e3:.1f}" if kind == "aload" else str(split)
    return wall, cpu, note


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("folder", type=Path)
    ap.add_argument("--loaders", default="aload,aload_lw,load_file,safe_open,raw")
    ap.add_argument("--tree", type=Path, action="append", default=[], help="aload from another tree, beside")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--split", action="store_true", help="where the model's thread (or the loop) spent each load")
    a = ap.parse_args()

    import aload
    from benchmarks.suite import huge_share, preallocated_model

    labels = a.loaders.split(",")
    packages: dict[str, Any] = {"": aload}
    tmp = Path(tempfile.mkdtemp(prefix="aload-inproc-"))
    try:
        for i, tree in enumerate(a.tree):
            packages[str(tree)] = import_tree(tree, i, tmp)
            labels += [f"{x}{AT}{tree}" for x in a.loaders.split(",") if x in ("aload", "aload_lw")]
        model, params = preallocated_model(a.folder)
        gc.collect()
        time.sleep(0.5)
        print(f"{a.folder}: {huge_share(a.folder):.0%} in 2 MiB pages of the page cache; {len(labels)} loaders")
        runs: dict[str, list[tuple[float, float, str]]] = {k: [] for k in labels}
        for r in range(a.rounds):
            for label in labels:
                kind, _, tree = label.partition(AT)
                runs[label].append(load_once(kind, packages[tree], a.folder, params, model, a.split))
            print(f"round {r + 1} of {a.rounds}:", " ".join(f"{k}={runs[k][-1][0]:.0f}" for k in labels), flush=True)
        print("\nms a load, wall/CPU, fastest first; median wall")
        for label, got in runs.items():
            got.sort()
            walls = " ".join(f"{w:.0f}/{c:.0f}" for w, c, _ in got)
            print(f"{label:28s} {statistics.median(w for w, _, _ in got):7.1f}  {walls}")
            if a.split:
                for w, _, note in got:
                    print(f"{'':30s}{w:.0f} ms: {note}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
