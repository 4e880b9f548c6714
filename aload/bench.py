"""Measuring a load as a user sees it: throughput, time to first tensor, memory, loop lateness.

Used by ``aload bench URL`` and by ``benchmarks/``. ``Probe`` runs a 1 ms ticker on the event loop
and samples the process's anonymous and resident memory every 2 ms on a thread of its own.
"""

from __future__ import annotations

import asyncio
import functools
import importlib.metadata
import itertools
import os
import platform
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .errors import UsageError
from .read import Progress, first_tensor
from .sources.local import cached, evict, is_local
from .stream import stream


def read_status(field_name: str, path: str = "/proc/self/status") -> int:
    """A field of ``/proc/self/status`` (or of ``path``, e.g. ``/proc/meminfo``) in bytes; 0 where
    there is no such file or field."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(field_name + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def stolen_s() -> float | None:
    """CPU time the hypervisor has taken from this machine's CPUs since boot, all of them
    together (``steal`` in ``/proc/stat``), in seconds; None where it is not known (not Linux, an
    old kernel). A VM's vCPUs wait while the host runs something else, and figures swing with it."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
        return int(fields[8]) / os.sysconf("SC_CLK_TCK") if fields[0] == "cpu" and len(fields) > 8 else None
    except (OSError, ValueError):
        return None


#: Environment variables that change how fast a load runs, named in ``host()`` where set.
HOST_ENV = ("ALOAD_READ", "GLIBC_TUNABLES")


@functools.cache
def _host(packages: tuple[str, ...]) -> dict[str, Any]:
    info: dict[str, Any] = {"cores": os.cpu_count(), "kernel": platform.release(), "python": platform.python_version()}
    try:
        with open("/proc/cpuinfo") as f:
            first = f.read().split("\n\n")[0]  # the first CPU's block
        fields = {k.strip(): v.strip() for k, _, v in (ln.partition(":") for ln in first.splitlines())}
        if "model name" in fields:
            info["cpu"] = (
                f"{fields['model name']} (family {fields.get('cpu family', '?')}, model {fields.get('model', '?')})"
            )
    except OSError:
        pass
    if memory := read_status("MemTotal", "/proc/meminfo"):
        info["memory_gib"] = round(memory / 2**30, 1)
    for pkg in packages:
        try:
            info[pkg] = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            pass
    return info


def host(packages: tuple[str, ...] = ("aload", "torch", "safetensors")) -> dict[str, Any]:
    """What a figure was measured on: cores, CPU, memory, kernel, Python, ``packages``' versions and
    the ``HOST_ENV`` variables that are set: a row means little without it."""
    info = dict(_host(packages))
    info.update((var, os.environ[var]) for var in HOST_ENV if os.environ.get(var))  # as they are now
    return info


@dataclass
class Probe:
    """Loop lateness (1 ms ticker), peak memory over a baseline and the CPU time the hypervisor
    took (``stolen_s``), for one measured stretch."""

    lags: list[float] = field(default_factory=list)
    trace: list[tuple[float, int, int]] = field(default_factory=list)  # (s, anon, rss) deltas
    _stop: threading.Event = field(default_factory=threading.Event)

    async def __aenter__(self) -> Probe:
        self.base_anon, self.base_rss = read_status("RssAnon"), read_status("VmRSS")
        self.steal = self.steal0 = stolen_s()
        self.t0 = time.perf_counter()
        self._sampler = threading.Thread(target=self._sample, name="bench-sampler", daemon=True)
        self._sampler.start()
        self._ticker = asyncio.ensure_future(self._tick())
        await asyncio.sleep(0)
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._ticker.cancel()
        await asyncio.wait([self._ticker])
        self._stop.set()
        self._sampler.join()
        self.steal = stolen_s()

    async def _tick(self) -> None:
        while True:
            t = time.perf_counter()
            await asyncio.sleep(0.001)
            self.lags.append(time.perf_counter() - t - 0.001)

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.trace.append(
                (
                    time.perf_counter() - self.t0,
                    read_status("RssAnon") - self.base_anon,
                    read_status("VmRSS") - self.base_rss,
                )
            )
            time.sleep(0.002)

    def row(self) -> dict[str, Any]:
        lags = sorted(self.lags) or [0.0]
        return {
            "peak_anon_delta_bytes": max((a for _, a, _ in self.trace), default=0),
            "peak_rss_delta_bytes": max((r for _, _, r in self.trace), default=0),
            "loop_lag_p50_ms": lags[len(lags) // 2] * 1e3,
            "loop_lag_p99_ms": lags[min(len(lags) - 1, int(len(lags) * 0.99))] * 1e3,
            "steal_s": None if self.steal is None or self.steal0 is None else round(self.steal - self.steal0, 3),
        }


async def bench_stream(
    url: str,
    *,
    max_inflight_bytes: int,
    concurrency: int,
    chunk_bytes: int | None,
    progress: Any = None,
    cold: bool = False,
    **options: Any,
) -> dict[str, Any]:
    """Stream every tensor of ``url`` and drop it: the pipeline alone, as one benchmark row. With
    ``cold``, a local checkpoint is dropped from the page cache first (``aload.local.evict``).
    """
    if cold:
        evict(url)
    share = cached(url) if is_local(url) else None
    cpu0 = time.process_time()
    async with Probe() as probe:
        t0 = time.perf_counter()
        async with stream(
            url,
            max_inflight_bytes=max_inflight_bytes,
            concurrency=concurrency,
            chunk_bytes=chunk_bytes,
            progress=progress,
            **options,
        ) as s:
            async for pair in s:
                del pair  # dropped before the next is awaited: a loop variable would hold it meanwhile
            st = s.stats
        seconds = time.perf_counter() - t0
    return {
        "loader": "aload",
        "source": url,
        "bytes": st.bytes,
        "tensors": st.tensors,
        "seconds": seconds,
        "gbps": st.bytes / seconds / 1e9 if seconds > 0 else 0.0,
        "ttft_s": st.ttft_s,
        "opened_s": st.opened_s,
        "planned_s": st.planned_s,
        "cpu_s": time.process_time() - cpu0,
        "cached_at_start": share,
        "read": options.get("read") or "auto" if is_local(url) else None,
        "verified_shards": st.verified_shards,
        "max_inflight_bytes": max_inflight_bytes,
        "concurrency": concurrency,
        "chunk_bytes": chunk_bytes,
        "overdraft_bytes": st.overdraft_bytes,  # read outside the budget (none: each tensor is dropped)
        **probe.row(),
        "host": host(),
    }


async def sweep(
    url: str,
    *,
    budgets: list[int],
    concurrencies: list[int],
    chunks: list[int],
    rounds: int = 1,
    report: Callable[[int, int, dict[str, Any]], None] | None = None,
    progress: Callable[[], Any] | None = None,
    **options: Any,
) -> list[dict[str, Any]]:
    """One row per setting, best first (by throughput), after one untimed run of the first. A run
    under ``MIN_RUN_S`` is repeated, and the setting stands by the median of its runs. With
    ``rounds`` > 1 the grid is run that many times, forward and backward in turn, and each
    setting's row is its median run (the slower middle one of an even count; ``gbps_runs``: every
    run's figure): a storage's speed drifts over a sweep, and one pass in one order credits the
    drift to the settings that come late. A
    local checkpoint's share in the page cache can change between settings (a run reads it in):
    ``cold=True`` drops it before each, and ``uneven_cache`` says when the rows did not start
    alike. ``report(i, n, row)`` is called as each of the ``n`` runs finishes (a default grid is
    24 settings), and ``progress()`` makes each run's progress callback."""
    grid = list(itertools.product(budgets, concurrencies, chunks))
    if not grid:
        raise UsageError("a sweep needs at least one budget, concurrency and chunk size", url=url)
    if rounds < 1:
        raise UsageError(f"a sweep runs at least one round, got {rounds}", url=url)
    # One untimed run first: the first run in a process, or from a disk left idle, is slower.
    order = [grid[0]] + [s for r in range(rounds) for s in (grid if r % 2 == 0 else grid[::-1])]
    runs: dict[tuple[int, int, int], list[dict[str, Any]]] = {s: [] for s in grid}
    for i, setting in enumerate(order):
        budget, conc, chunk = setting
        bar = progress() if progress is not None else None
        row = await bench_stream(
            url, max_inflight_bytes=budget, concurrency=conc, chunk_bytes=chunk, progress=bar, **options
        )
        if i:
            runs[setting].append(row)
            if report is not None:
                report(i, len(order) - 1, row)
            # A run this short is mostly timer and start-up: run it again, up to MIN_RUN_S in all.
            spent, extra = float(row["seconds"]), 0
            while spent < MIN_RUN_S and extra < MAX_EXTRA_RUNS:
                again = await bench_stream(
                    url, max_inflight_bytes=budget, concurrency=conc, chunk_bytes=chunk, **options
                )
                runs[setting].append(again)
                spent, extra = spent + float(again["seconds"]), extra + 1
    rows = []
    for got in runs.values():
        by_speed = sorted(got, key=lambda r: float(r["gbps"]))
        rows.append({**by_speed[(len(by_speed) - 1) // 2], "gbps_runs": [r["gbps"] for r in got]})
    return sorted(rows, key=lambda r: -float(r["gbps"]))


#: A sweep's run shorter than this is repeated until its runs add up to it (at most
#: ``MAX_EXTRA_RUNS`` more): a few milliseconds measure the timer and the start-up, not the setting.
MIN_RUN_S = 0.5
MAX_EXTRA_RUNS = 20
#: Settings this close to the best (relative), or closer than the best's own runs spread, are
#: within noise of it: a 2-core VM swings more than this between identical runs.
NOISE = 0.05


def _spread(row: dict[str, Any]) -> float:
    runs = [float(g) for g in row.get("gbps_runs") or [row["gbps"]]]
    return (max(runs) - min(runs)) / max(float(row["gbps"]), 1e-12)


def within_noise(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows (best first, as ``sweep`` gives them) that cannot be told from the best: their
    median within ``NOISE`` of the best's, or within the spread of either's own runs."""
    best = rows[0]
    top = float(best["gbps"])
    return [
        r
        for r in rows
        if top - float(r["gbps"]) <= max(NOISE, _spread(best), _spread(r)) * max(top, 1e-12)
    ]


def describe(row: dict[str, Any]) -> str:
    ttft = first_tensor(row.get("ttft_s"), row.get("opened_s"), row.get("planned_s"))
    return (
        f"{row['gbps']:.2f} GB/s ({row['bytes'] / 1e9:.3f} GB, {row['tensors']} tensors in {row['seconds']:.3f} s); "
        f"first tensor {ttft}; peak memory +{row['peak_rss_delta_bytes'] / 2**20:.0f} MiB RSS "
        f"(+{row['peak_anon_delta_bytes'] / 2**20:.0f} MiB anonymous); loop lateness p50 "
        f"{row['loop_lag_p50_ms']:.2f} ms, p99 {row['loop_lag_p99_ms']:.2f} ms"
        + (f"; SHA-256 verified for {row['verified_shards']} shard(s)" if row.get("verified_shards") else "")
        + _cache_note(row.get("cached_at_start"), row.get("read"))
        + _steal_note(row.get("steal_s"), row["seconds"])
    )


#: The share of the machine's CPU time over a run that the hypervisor may take before ``describe``
#: says so.
STEAL_NOTE = 0.05


def _steal_note(steal: float | None, seconds: float) -> str:
    """Whether the hypervisor took a noticeable share of this machine's CPU during the run: on a
    VM, figures swing with what else its host runs."""
    cores = os.cpu_count() or 1
    if steal is None or seconds <= 0 or steal < STEAL_NOTE * seconds * cores:
        return ""
    return (
        f"; the hypervisor took {steal:.2f} s of this machine's CPU meanwhile "
        f"({steal / (seconds * cores):.0%} of {cores} CPUs: steal), so figures here swing with its other work"
    )


#: A local checkpoint this much in the page cache reads as "warm".
WARM = 0.99


def _cache_note(share: float | None, read: str | None = None) -> str:
    """Whether the disk was read at all: a warm page cache makes a local figure memory's speed,
    and, where tensors are handed out as views of the page cache, not even that."""
    if share is None:
        return ""
    state = "warm" if share >= WARM else "cold" if share <= 0.01 else "partly warm"
    note = f"; {share:.0%} of it in the page cache at start ({state})"
    if state == "warm":
        note += ": handed out as views of it, nothing copied (a load copies each byte once; --cold reads the disk)"
    return note


def uneven_cache(rows: list[dict[str, Any]]) -> str | None:
    """A line saying that the rows of a sweep found different shares of a local checkpoint in the
    page cache (a run read it in for those after it), so their figures do not compare;
    None when they started alike (within 5 points) or the share is not known."""
    shares = [r["cached_at_start"] for r in rows if r.get("cached_at_start") is not None]
    if not shares or max(shares) - min(shares) <= 0.05:
        return None
    return (
        f"note: the page cache held {min(shares):.0%} to {max(shares):.0%} of the checkpoint as these runs "
        "started, so they did not read alike: --cold reads it from the disk for every setting; or "
        "stream it once first, to compare them on memory"
    )


__all__ = ["Probe", "Progress", "bench_stream", "describe", "host", "read_status", "stolen_s", "sweep", "uneven_cache"]
