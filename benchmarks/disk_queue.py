"""How each loader keeps the disk busy on a cold load: the block device's reads in flight and
their size, sampled while the suite's cold runs go (docs/benchmarks.md, "Five repetitions, and
the cold rows at the disk's pace").

    python benchmarks/disk_queue.py CHECKPOINT_DIR [--loaders aload,runai,runai_best]
        [--runai-concurrency 16] [--reps 2]

Each loader loads the checkpoint cold, in a fresh process as in ``suite.py`` (``suite.child``),
loaders alternating between repetitions, while a thread of this process reads the device's
``inflight`` and ``stat`` (``/sys/dev/block/MAJOR:MINOR``, the device of the checkpoint's
filesystem) every 0.5 ms. The read window is the shortest stretch in which the device read 98%
of the checkpoint's bytes (reads of other files before and after it left out). Per run: the
suite's GB/s, the window, the device's GB/s in it, the reads in flight on average, the share of
samples with none in flight, and the mean read size. Linux only.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.suite import child, shards

SECTOR = 512
HEADER = "loader            GB/s  window s  device GB/s  in flight  idle  read KiB"


def line(loader: str, g: float, secs: float, dev_gbps: float, in_flight: float, idle: float, kib: float) -> str:
    return f"{loader:<16} {g:5.2f}  {secs:8.2f}  {dev_gbps:11.2f}  {in_flight:9.1f}  {idle:4.0%}  {kib:8.0f}"


def device_dir(folder: Path) -> Path:
    """The sysfs folder of the block device (or partition) that holds ``folder``."""
    dev = os.stat(folder).st_dev
    path = Path(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}").resolve()
    if not (path / "inflight").exists():
        raise SystemExit(f"{folder} is not on a block device with sysfs statistics ({path})")
    return path


def sample(dev: Path, stop: threading.Event, out: list[tuple[float, int, int, int]]) -> None:
    """(seconds, reads in flight, sectors read, reads completed) every 0.5 ms until ``stop``."""
    while not stop.is_set():
        inflight = int((dev / "inflight").read_text().split()[0])
        stat = (dev / "stat").read_text().split()
        out.append((time.perf_counter(), inflight, int(stat[2]), int(stat[0])))
        time.sleep(0.0005)


def window(samples: list[tuple[float, int, int, int]], sectors: int) -> tuple[int, int] | None:
    """The indices of the shortest stretch of ``samples`` over which ``sectors`` were read."""
    best: tuple[int, int] | None = None
    a = 0
    for b in range(len(samples)):
        while a < b and samples[b][2] - samples[a + 1][2] >= sectors:
            a += 1
        if samples[b][2] - samples[a][2] >= sectors:
            if best is None or samples[b][0] - samples[a][0] < samples[best[1]][0] - samples[best[0]][0]:
                best = (a, b)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("folder", type=Path)
    ap.add_argument("--loaders", default="aload,runai,runai_best")
    ap.add_argument("--runai-concurrency", type=int, default=16, help="runai_best's concurrency")
    ap.add_argument("--reps", type=int, default=2)
    a = ap.parse_args()
    dev = device_dir(a.folder)
    total = sum(p.stat().st_size for p in shards(a.folder))
    want = int(total * 0.98) // SECTOR
    loaders = a.loaders.split(",")
    concurrency = {ld: a.runai_concurrency if ld == "runai_best" else None for ld in loaders}
    child(loaders[0], a.folder, concurrency[loaders[0]], "cold")  # untimed, as the suite's first cold load
    got: dict[str, list[tuple[float, ...]]] = {ld: [] for ld in loaders}
    print(f"{dev.name}: {a.folder} ({total / 1e9:.2f} GB), cold")
    print(HEADER)
    for rep in range(a.reps):
        for ld in loaders if rep % 2 == 0 else loaders[::-1]:
            samples: list[tuple[float, int, int, int]] = []
            stop = threading.Event()
            t = threading.Thread(target=sample, args=(dev, stop, samples), daemon=True)
            t.start()
            row = child(ld, a.folder, concurrency[ld], "cold")
            stop.set()
            t.join()
            span = window(samples, want)
            if span is None:
                print(f"{ld:<16} {row['gbps']:5.2f}  the device read less than the checkpoint (cached elsewhere?)")
                continue
            w = samples[span[0] : span[1] + 1]
            secs = w[-1][0] - w[0][0]
            read = (w[-1][2] - w[0][2]) * SECTOR
            figures = (
                row["gbps"],
                secs,
                read / secs / 1e9,
                statistics.fmean(s[1] for s in w),
                sum(s[1] == 0 for s in w) / len(w),
                read / max(1, w[-1][3] - w[0][3]) / 1024,
            )
            got[ld].append(figures)
            print(line(ld, *figures), flush=True)
    print("medians:")
    for ld, rows in got.items():
        if rows:
            print(line(ld, *(statistics.median(col) for col in zip(*rows, strict=True))))


if __name__ == "__main__":
    main()
