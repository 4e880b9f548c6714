"""The command line, run as a user would: a subprocess on a real checkpoint."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file


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
    assert "100.0%" in done.stderr  # the progress bar reached the end


def test_errors_are_one_line_and_name_the_file(tmp_path: Path) -> None:
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\xff" * 16)
    done = run("inspect", str(bad))
    assert done.returncode == 2 and str(bad) in done.stderr and "Traceback" not in done.stderr
