"""The command line, run as a user would: a subprocess on a real checkpoint."""

from __future__ import annotations

import json
import os
import platform
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from .conftest import drop_cache


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "aload.cli", *args], capture_output=True, text=True, timeout=120)


def test_inspect_and_load(tmp_path: Path) -> None:
    path = tmp_path / "m.safetensors"
    save_file({"a": torch.ones(4, 4), "b": torch.zeros(3, dtype=torch.bfloat16)}, str(path), metadata={"k": "v"})
    info = json.loads(run("inspect", str(path), "--json").stdout)
    assert info["tensors"] == 2 and info["dtypes"] == {"BF16": 1, "F32": 1} and info["metadata"] == {"k": "v"}
    assert "2 tensors" in run("inspect", str(path)).stdout
    done = run("load", str(path), "--json")
    row = json.loads(done.stdout)
    assert row["tensors"] == 2 and row["bytes"] == 70
    assert done.stderr == ""  # no progress bar where stderr is not a terminal
    assert run("--version").stdout.startswith("aload ")
    listed = run("inspect", str(path), "--tensors")
    assert "a  F32[4, 4]  m.safetensors" in listed.stdout and "b  BF16[3]" in listed.stdout


def test_load_and_bench_take_a_read_mode(tmp_path: Path) -> None:
    path = tmp_path / "m.safetensors"
    save_file({"a": torch.ones(256, 1024), "b": torch.zeros(3)}, str(path))
    drop_cache(path)
    loaded = run("load", str(path), "--read", "direct", "-q", "--json")
    assert loaded.returncode == 0, loaded.stderr
    assert json.loads(loaded.stdout)["bytes"] == 256 * 1024 * 4 + 12
    rows = tmp_path / "rows.jsonl"
    benched = run("bench", str(path), "--read", "cached", "-q", "--json", str(rows))
    assert benched.returncode == 0, benched.stderr
    assert json.loads(rows.read_text().splitlines()[0])["bytes"] == 256 * 1024 * 4 + 12
    refused = run("load", str(path), "--read", "shared")
    assert refused.returncode == 2 and "cached" in refused.stderr  # the choices, named


def test_load_into_a_model_with_load_weights(tmp_path: Path) -> None:
    path = tmp_path / "m.safetensors"
    save_file({"a": torch.ones(256, 1024), "b": torch.zeros(3)}, str(path))
    done = run("load", str(path), "--model", "tests.cli_models:engine", "-q", "--json")
    assert done.returncode == 0, done.stderr  # the model checks what it got
    row = json.loads(done.stdout)
    assert row["installed"] == 2 and row["missing"] == [] and row["bytes"] == 256 * 1024 * 4 + 12
    line = run("load", str(path), "--model", "tests.cli_models:engine")
    assert line.returncode == 0 and line.stdout.startswith("2 tensors, 0.001 GB in "), line.stdout


def test_errors_are_one_line_and_name_the_file(tmp_path: Path) -> None:
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\xff" * 16)
    done = run("inspect", str(bad))
    assert done.returncode == 2 and str(bad) in done.stderr and "Traceback" not in done.stderr


def test_bench_prints_figures_and_writes_rows(tmp_path: Path) -> None:
    path = tmp_path / "m.safetensors"
    save_file({f"t{i}": torch.randn(64, 64) for i in range(8)}, str(path))
    out = tmp_path / "rows.jsonl"
    done = run("bench", str(path), "--json", str(out), "--budget", "65536", "--repeat", "2")
    assert done.returncode == 0, done.stderr
    assert "run 2: " in done.stdout and "loop lateness p50" in done.stdout
    assert "ms (headers parsed at " in done.stdout  # what came before the first tensor
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 2
    row = rows[0]
    assert row["tensors"] == 8 and row["bytes"] == 8 * 64 * 64 * 4 and row["max_inflight_bytes"] == 65536
    for key in (
        "seconds",
        "gbps",
        "ttft_s",
        "opened_s",
        "planned_s",
        "peak_anon_delta_bytes",
        "peak_rss_delta_bytes",
        "loop_lag_p99_ms",
        "cpu_s",
        "steal_s",
    ):
        assert key in row
    assert row["steal_s"] is None or row["steal_s"] >= 0
    # what it ran on, so that rows from two hosts are not compared as one
    assert row["host"]["cores"] == os.cpu_count() and row["host"]["python"] == platform.python_version()
    assert row["host"]["torch"] == torch.__version__
    assert "GLIBC_TUNABLES" not in row["host"]  # named only where set


def test_bench_names_the_settings_that_change_its_speed(tmp_path: Path) -> None:
    path = tmp_path / "m.safetensors"
    save_file({"a": torch.ones(16)}, str(path))
    out = tmp_path / "rows.jsonl"
    tunable = "glibc.cpu.x86_non_temporal_threshold=0x1000000"
    env = {**os.environ, "GLIBC_TUNABLES": tunable, "ALOAD_READ": "cached"}
    done = subprocess.run(
        [sys.executable, "-m", "aload.cli", "bench", str(path), "-q", "--json", str(out)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    host = json.loads(out.read_text())["host"]
    assert host["GLIBC_TUNABLES"] == tunable and host["ALOAD_READ"] == "cached"


def test_bench_drops_each_tensor_before_asking_for_the_next(tmp_path: Path) -> None:
    """Tensors larger than the budget are each read alone, none outside the budget: holding the
    previous one while waiting (a loop variable does) made every one of them an overdraft."""
    path = tmp_path / "m.safetensors"
    save_file({f"t{i}": torch.randn(1 << 18) for i in range(4)}, str(path))  # 1 MiB each
    out = tmp_path / "rows.jsonl"
    done = run("bench", str(path), "--json", str(out), "--budget", "256k", "-q")
    assert done.returncode == 0, done.stderr
    row = json.loads(out.read_text())
    assert row["tensors"] == 4 and row["overdraft_bytes"] == 0


def test_bench_says_how_much_of_a_local_checkpoint_the_page_cache_held(tmp_path: Path) -> None:
    """A local figure is memory's speed when the page cache held the files (in the default mode
    not even that: the tensors are views of it), the disk's when not: ``aload bench`` says which
    (``cachestat(2)``; nothing where the kernel refuses it), and ``--cold`` drops the files from
    the page cache before the run."""
    path = tmp_path / "m.safetensors"
    save_file({f"t{i}": torch.randn(256, 1024) for i in range(4)}, str(path))
    path.read_bytes()
    out = tmp_path / "rows.jsonl"
    done = run("bench", str(path), "-q", "--json", str(out))
    assert done.returncode == 0, done.stderr
    row = json.loads(out.read_text())
    assert row["read"] == "auto"
    share = row["cached_at_start"]
    if share is None:
        assert "page cache" not in done.stdout
        return
    assert share == 1.0 and "100% of it in the page cache at start (warm): handed out as views" in done.stdout
    drop_cache(path)
    done = run("bench", str(path), "-q", "--json", str(out))
    share = json.loads(out.read_text())["cached_at_start"]
    if share == 1.0:  # a filesystem that keeps its files in memory (tmpfs) says 100% again
        return
    assert share < 0.5 and f"{share:.0%} of it in the page cache at start (" in done.stdout, done.stdout
    path.read_bytes()
    done = run("bench", str(path), "-q", "--cold", "--json", str(out))
    assert done.returncode == 0, done.stderr
    row = json.loads(out.read_text())
    assert row["cached_at_start"] < 0.5 and row["tensors"] == 4 and "nothing copied" not in done.stdout


def test_bench_cold_is_for_local_checkpoints_only() -> None:
    url = "http://127.0.0.1:9/m.safetensors"
    done = run("bench", url, "-q", "--cold")
    assert done.returncode == 2
    assert "--cold" in done.stderr and url in done.stderr and "remote" in done.stderr


def test_a_sweep_says_when_its_runs_found_the_page_cache_unlike() -> None:
    from aload.bench import uneven_cache

    assert uneven_cache([{"cached_at_start": 0.81}, {"cached_at_start": 0.97}, {"cached_at_start": 1.0}]) == (
        "note: the page cache held 81% to 100% of the checkpoint as these runs started, so they did not read "
        "alike: --cold reads it from the disk for every setting; or stream it once first, to compare them on memory"
    )
    assert uneven_cache([{"cached_at_start": 1.0}, {"cached_at_start": 0.97}]) is None  # within 5 points
    assert uneven_cache([{"cached_at_start": None}, {"cached_at_start": None}]) is None  # remote, or not known


def test_bench_says_when_the_hypervisor_took_the_cpu() -> None:
    from aload import bench

    row = {"gbps": 1.0, "bytes": 10**9, "tensors": 3, "seconds": 1.0, "ttft_s": 0.1, "peak_rss_delta_bytes": 0}
    row |= {"peak_anon_delta_bytes": 0, "loop_lag_p50_ms": 0.1, "loop_lag_p99_ms": 1.0}
    cores = os.cpu_count() or 1
    taken = bench.describe(row | {"steal_s": 0.5 * cores})
    assert f"the hypervisor took {0.5 * cores:.2f} s of this machine's CPU meanwhile (50% of {cores} CPUs" in taken
    assert "hypervisor" not in bench.describe(row | {"steal_s": 0.01 * cores})  # under 5%: not worth a word
    assert "hypervisor" not in bench.describe(row | {"steal_s": None})  # not known (not Linux)
    if sys.platform.startswith("linux"):  # since boot, so it only grows
        first = bench.stolen_s()
        assert first is not None and 0 <= first <= (bench.stolen_s() or 0)


def test_bench_sweep_reports_the_best_setting(tmp_path: Path) -> None:
    path = tmp_path / "m.safetensors"
    save_file({f"t{i}": torch.randn(64, 64) for i in range(8)}, str(path))
    out = tmp_path / "rows.jsonl"
    done = run(
        "bench",
        str(path),
        "--sweep",
        "--budget-sweep",
        "1m",
        "--concurrency-sweep",
        "1,2",
        "--chunk-sweep",
        "1m,4096",
        "--json",
        str(out),
    )
    assert done.returncode == 0, done.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 4 and rows[0]["gbps"] == max(r["gbps"] for r in rows)
    # each setting as it finishes, in the grid's order (a default grid is 24 of them)
    lines = [line for line in done.stdout.splitlines() if line.startswith("[")]
    assert [line.split("]")[0] for line in lines] == ["[1/4", "[2/4", "[3/4", "[4/4"]
    assert lines[0].startswith("[1/4] budget 1m, concurrency 1, chunk 1m: ") and "GB/s" in lines[0]
    assert "untimed run" in done.stderr
    # runs of a few milliseconds are repeated: each setting stands by the median of several
    assert all(len(r["gbps_runs"]) > 1 for r in rows)
    # a best setting in the units --budget reads back, or the settings within noise of each other
    settings = re.findall(r"--budget 1m --concurrency [12] --chunk-bytes (?:1m|4k) \(", done.stdout)
    if "no clear best: " in done.stdout:
        tied = int(done.stdout.split("no clear best: ")[1].split()[0])
        assert tied >= 2 and len(settings) == tied
    else:
        assert "best here: " in done.stdout and len(settings) == 1


def test_a_sweep_names_no_best_among_settings_within_noise() -> None:
    from aload.bench import within_noise

    def row(gbps: float, *runs: float) -> dict[str, float | list[float]]:
        return {"gbps": gbps, "gbps_runs": list(runs) or [gbps]}

    assert len(within_noise([row(1.00), row(0.97), row(0.80)])) == 2  # 3% apart: noise
    assert len(within_noise([row(1.00), row(0.80)])) == 1  # 20% apart: a best
    # 15% apart, but the best's own runs spread 30%: no telling them apart
    assert len(within_noise([row(1.00, 0.8, 1.0, 1.1), row(0.85)])) == 2


def test_bench_sweep_in_rounds_alternates_its_order_and_ranks_by_medians(tmp_path: Path) -> None:
    """A storage's speed drifts over a sweep: in rounds, the grid runs forward then backward, and
    each setting stands by its median run, not by where in the sweep it came."""
    path = tmp_path / "m.safetensors"
    save_file({f"t{i}": torch.randn(64, 64) for i in range(8)}, str(path))
    out = tmp_path / "rows.jsonl"
    grid = "--sweep --repeat 3 --budget-sweep 1m --concurrency-sweep 1,2 --chunk-sweep 1m".split()
    done = run("bench", str(path), "-q", "--json", str(out), *grid)
    assert done.returncode == 0, done.stderr
    runs = [line.split(", chunk")[0].split("] ")[1] for line in done.stdout.splitlines() if line.startswith("[")]
    one, two = "budget 1m, concurrency 1", "budget 1m, concurrency 2"
    assert runs == [one, two, two, one, one, two]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 2 and rows[0]["gbps"] >= rows[1]["gbps"]
    for row in rows:
        runs = sorted(row["gbps_runs"])  # 3 rounds, each run this short repeated
        assert len(runs) >= 3 and row["gbps"] == runs[(len(runs) - 1) // 2]
    assert "medians of 3 rounds, best first:" in done.stdout
    assert run("bench", str(path), "--repeat", "0").returncode == 2


def test_sizes_read_as_a_user_writes_them(tmp_path: Path) -> None:
    path = tmp_path / "m.safetensors"
    save_file({"t": torch.randn(64, 64)}, str(path))
    row = json.loads(run("load", str(path), "--json", "--budget", "2m", "--chunk-bytes", "64k").stdout)
    assert row["tensors"] == 1
    done = run("bench", str(path), "--budget", "lots")
    assert done.returncode == 2 and "not a size: 'lots'" in done.stderr and "Traceback" not in done.stderr
    done = run("bench", str(path), "--sweep", "--chunk-sweep", "4m,0")
    assert done.returncode == 2 and "not a positive size" in done.stderr
    for counts, said in (("", "not a whole number: ''"), ("2,0", "not positive: '0'")):
        done = run("bench", str(path), "--sweep", "--concurrency-sweep", counts)
        assert done.returncode == 2 and said in done.stderr and "Traceback" not in done.stderr


def test_load_and_bench_verify_a_manifest(tmp_path: Path) -> None:
    import hashlib

    path = tmp_path / "m.safetensors"
    save_file({f"t{i}": torch.randn(32, 32) for i in range(4)}, str(path))
    manifest = tmp_path / "SHA256SUMS"
    manifest.write_text(f"{hashlib.sha256(path.read_bytes()).hexdigest()}  m.safetensors\n")
    row = json.loads(run("load", str(path), "--json", "--verify", str(manifest)).stdout)
    assert row["verified_shards"] == 1
    assert "SHA-256 verified for 1 shard(s)" in run("bench", str(path), "-q", "--verify", str(manifest)).stdout
    manifest.write_text(f"{'0' * 64}  m.safetensors\n")
    done = run("load", str(path), "--verify", str(manifest))
    assert done.returncode == 2 and "SHA-256 mismatch" in done.stderr and "0" * 64 in done.stderr


_INTERRUPTED = """
import os, signal, sys, threading, time
import aload
from tests.cli_models import slow
threading.Timer(0.5, lambda: os.kill(os.getpid(), signal.SIGINT)).start()
try:
    aload.load_sync(slow(), sys.argv[1])
    print("finished")
except KeyboardInterrupt:
    time.sleep(0.2)
    print("interrupted", [t.name for t in threading.enumerate() if t.name.startswith("aload")])
"""


@pytest.mark.parametrize("flags", [[], ["-X", "dev"]], ids=["plain", "dev-mode"])
def test_ctrl_c_in_load_sync_is_one_keyboard_interrupt_and_leaves_no_thread(tmp_path: Path, flags: list[str]) -> None:
    """Ctrl-C in ``load_sync`` raises one KeyboardInterrupt, prints nothing of aload's own and
    leaves no aload thread; also in Python's development mode (asyncio debug, all warnings)."""
    path = tmp_path / "m.safetensors"
    save_file({f"t{i}": torch.randn(64, 64) for i in range(64)}, str(path))
    done = subprocess.run(
        [sys.executable, *flags, "-c", _INTERRUPTED, str(path)], capture_output=True, text=True, timeout=120
    )
    assert done.stdout.strip() == "interrupted []" and done.stderr == "", (done.stdout, done.stderr)


def test_ctrl_c_on_the_command_line_is_one_line_and_exit_code_130(tmp_path: Path) -> None:
    path = tmp_path / "m.safetensors"
    save_file({f"t{i}": torch.randn(64, 64) for i in range(64)}, str(path))
    import signal
    import time

    ready = tmp_path / "ready"
    proc = subprocess.Popen(
        [sys.executable, "-m", "aload.cli", "load", str(path), "--model", "tests.cli_models:slow"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "ALOAD_TEST_READY": str(ready)},
    )
    deadline = time.monotonic() + 60
    while not ready.exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    proc.send_signal(signal.SIGINT)
    _out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and err.strip().splitlines() == ["aload: interrupted"], (proc.returncode, err)
