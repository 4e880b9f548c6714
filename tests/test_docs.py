"""Every ```python block in docs/ runs, against a generated checkpoint named CHECKPOINT."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from .conftest import llama_like

ROOT = Path(__file__).resolve().parent.parent
BLOCK = re.compile(r"```python\n(.*?)```", re.S)


def docs_with_code() -> list[Path]:
    return sorted(p for p in (ROOT / "docs").glob("*.md") if BLOCK.search(p.read_text()))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Llama-shaped names, two shards and an index, sized for examples/engine_llama's docs config."""
    tensors = llama_like(n_layers=2, hidden=64, vocab=128)
    for i in range(2):  # the engine example's MLP is 128 wide
        p = f"model.layers.{i}.mlp."
        tensors[p + "gate_proj.weight"], tensors[p + "up_proj.weight"] = torch.randn(128, 64), torch.randn(128, 64)
        tensors[p + "down_proj.weight"] = torch.randn(64, 128)
        tensors[f"model.layers.{i}.self_attn.k_proj.weight"] = torch.randn(32, 64)
        tensors[f"model.layers.{i}.self_attn.v_proj.weight"] = torch.randn(32, 64)
    folder = tmp_path_factory.mktemp("docs") / "ckpt"
    folder.mkdir()
    names = sorted(tensors)
    weight_map = {}
    for k, part in enumerate((names[::2], names[1::2])):
        fname = f"model-0000{k + 1}-of-00002.safetensors"
        save_file({n: tensors[n] for n in part}, str(folder / fname))
        weight_map.update(dict.fromkeys(part, fname))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return str(folder)


@pytest.mark.parametrize("doc", docs_with_code(), ids=lambda p: p.name)
def test_doc_examples_run(doc: Path, checkpoint: str) -> None:
    sys.path.insert(0, str(ROOT))
    namespace: dict[str, object] = {"CHECKPOINT": checkpoint, "__name__": f"docs.{doc.stem}"}
    try:
        for i, block in enumerate(BLOCK.findall(doc.read_text())):
            exec(compile(block, f"{doc.name}[{i}]", "exec"), namespace)  # blocks share a namespace, in order
    finally:
        sys.path.remove(str(ROOT))


def scripts_with_options() -> list[Path]:
    return sorted(p for d in ("benchmarks", "examples") for p in (ROOT / d).glob("*.py") if "argparse" in p.read_text())


@pytest.mark.parametrize("script", scripts_with_options(), ids=lambda p: f"{p.parent.name}/{p.name}")
def test_script_help_prints_its_usage(script: Path) -> None:
    """The documented way into each script works: ``--help`` printed a traceback where an option's
    help held a bare ``%`` (loop_stalls.py's --partial)."""
    out = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.startswith("usage:"), out.stdout[:500]
