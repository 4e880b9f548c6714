"""Several processes loading the same checkpoint at once, as tensor-parallel ranks on one host do
(each reads every shard and keeps its slice), from a cold page cache.

    python benchmarks/ranks.py CHECKPOINT_DIR [--procs 2,4] [--loaders aload,aload_shared,aload_pread,safe_open] [--reps 2]

For each count and loader: the shards are dropped from the page cache, then that many processes,
each holding a preallocated model, start loading at the same moment. Prints each process's
seconds, the delivered GB/s (processes x checkpoint bytes / the slowest process's time) and the
bytes read from the disk meanwhile (the block device's counter, where the folder sits on one).
``aload`` reads a cold file with O_DIRECT, so every process reads every byte from the disk;
``aload_shared`` (``read="shared"``), ``aload_pread`` (``read="pread"``) and ``safe_open`` go
through the page cache, where the first reader of a page brings it in for all of them.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from benchmarks.suite import drop_cache, shards  # noqa: E402

LOADERS = ("aload", "aload_shared", "aload_pread", "safe_open")

CHILD = r"""
import asyncio, sys, time
from pathlib import Path
sys.path.insert(0, sys.argv[4])
from safetensors import safe_open
import aload
from benchmarks.suite import preallocated_model, shards

folder, loader, start = Path(sys.argv[1]), sys.argv[2], float(sys.argv[3])
model, params = preallocated_model(folder)
while time.time() < start:
    time.sleep(0.001)
t0 = time.perf_counter()
if loader.startswith("aload"):
    read = loader.partition("_")[2]  # aload_shared, aload_pread: that read mode
    asyncio.run(aload.load(model, folder, **({"read": read} if read else {})))
else:
    for f in shards(folder):
        with safe_open(str(f), "pt") as st:
            for k in st.keys():
                params[k].data.copy_(st.get_tensor(k))
print(time.perf_counter() - t0)
"""


def disk_read_bytes(folder: Path) -> int | None:
    """Bytes read so far from the block device holding ``folder`` (None where there is none)."""
    dev = os.stat(folder).st_dev
    try:
        with open(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}/stat") as f:
            return int(f.read().split()[2]) * 512  # sectors read
    except (OSError, IndexError, ValueError):
        return None


def run(folder: Path, loader: str, procs: int) -> list[float]:
    drop_cache(folder)
    start = time.time() + 3 + procs  # every process has built its model by then
    children = [
        subprocess.Popen(
            [sys.executable, "-c", CHILD, str(folder), loader, str(start), str(HERE.parent)],
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(procs)
    ]
    out = []
    for child in children:
        stdout, _ = child.communicate()
        if child.returncode != 0:
            raise SystemExit(f"{loader} failed")
        out.append(float(stdout.strip().splitlines()[-1]))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("folder", type=Path)
    ap.add_argument("--procs", default="2,4")
    ap.add_argument("--loaders", default=",".join(LOADERS))
    ap.add_argument("--reps", type=int, default=2)
    a = ap.parse_args()
    size = sum(p.stat().st_size for p in shards(a.folder))
    print(f"{a.folder}: {size / 1e9:.2f} GB, cold page cache before each run")
    for procs in (int(p) for p in a.procs.split(",")):
        gbps: dict[str, list[float]] = {}
        for rep in range(a.reps):
            order = a.loaders.split(",")
            for loader in order if rep % 2 == 0 else order[::-1]:  # alternating, as the suite does
                before = disk_read_bytes(a.folder)
                times = run(a.folder, loader, procs)
                after = disk_read_bytes(a.folder)
                disk = ""
                if before is not None and after is not None:
                    disk = f", {(after - before) / size:.2f}x the checkpoint from disk"
                gbps.setdefault(loader, []).append(procs * size / max(times) / 1e9)
                print(
                    f"  {procs} processes, rep {rep + 1}, {loader:>12}: each "
                    f"{' '.join(f'{t:.2f}' for t in times)} s, {gbps[loader][-1]:.2f} GB/s delivered{disk}",
                    flush=True,
                )
        line = ", ".join(f"{ld} {statistics.median(v):.2f}" for ld, v in gbps.items())
        print(f"{procs} processes, median GB/s delivered: {line}")


if __name__ == "__main__":
    main()
