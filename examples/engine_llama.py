"""An engine-style Llama, loaded the way vLLM and sglang load models.

- Attention uses one fused ``qkv_proj`` and the MLP one fused ``gate_up_proj``; the checkpoint
  keeps Hugging Face's unfused names (``q_proj``, ``k_proj``, ``v_proj``, ``gate_proj``, ``up_proj``).
- ``load_weights(weights)`` walks ``stacked_params_mapping`` and calls each parameter's
  ``weight_loader(param, loaded_weight, shard_id)``, consuming the iterable lazily.
- Linear layers may carry a ``quant_method``; ``Int8WeightOnly`` quantizes weights online in
  ``process_weights_after_loading`` (per output channel, symmetric), as the engines' online
  quantization does, after every weight is in.

The forward pass follows ``transformers``' Llama (RMSNorm in float32, rotate-half rotary
embeddings, grouped-query attention), so its logits match ``LlamaForCausalLM``'s.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


def _fits(dest: torch.Tensor, src: torch.Tensor) -> None:
    """The shapes match exactly (``copy_`` would broadcast a row into a matrix)."""
    if dest.shape != src.shape:
        raise RuntimeError(f"shape {list(src.shape)} where {list(dest.shape)} is expected")


@dataclass
class Config:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0

    @classmethod
    def from_hf(cls, cfg: Any) -> Config:
        theta = getattr(cfg, "rope_theta", None) or (getattr(cfg, "rope_parameters", None) or {}).get(
            "rope_theta", 10000.0
        )
        return cls(
            cfg.vocab_size,
            cfg.hidden_size,
            cfg.intermediate_size,
            cfg.num_hidden_layers,
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.rms_norm_eps,
            theta,
        )

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


class Int8WeightOnly:
    """Online int8 weight quantization with one scale per output channel."""

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        w = layer.weight.data.float()
        scale = (w.abs().amax(dim=1, keepdim=True) / 127.0).clamp(min=1e-12)
        layer.weight = nn.Parameter(torch.round(w / scale).clamp(-127, 127).to(torch.int8), requires_grad=False)
        layer.weight_scale = nn.Parameter(scale, requires_grad=False)

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, layer.weight.float() * layer.weight_scale)


class Linear(nn.Module):
    """A linear layer whose output rows may be filled shard by shard (``shard_sizes``)."""

    def __init__(self, in_features: int, shard_sizes: dict[Any, int], quant_method: Any = None) -> None:
        super().__init__()
        self.shard_offsets: dict[Any, tuple[int, int]] = {}
        offset = 0
        for shard, size in shard_sizes.items():
            self.shard_offsets[shard] = (offset, size)
            offset += size
        self.weight = nn.Parameter(torch.empty(offset, in_features), requires_grad=False)
        self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]
        self.quant_method = quant_method

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: Any = None) -> None:
        if shard_id is None:
            _fits(param, loaded_weight)
            param.data.copy_(loaded_weight)
            return
        start, size = self.shard_offsets[shard_id]
        _fits(param.data[start : start + size], loaded_weight)
        param.data[start : start + size].copy_(loaded_weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quant_method is not None and self.weight.dtype == torch.int8:
            return self.quant_method.apply(self, x)
        return F.linear(x, self.weight)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Layer(nn.Module):
    def __init__(self, c: Config, quant: Any) -> None:
        super().__init__()
        hd, kv = c.head_dim, c.num_key_value_heads * c.head_dim
        self.c = c
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = nn.Module()
        self.self_attn.qkv_proj = Linear(c.hidden_size, {"q": c.num_attention_heads * hd, "k": kv, "v": kv}, quant)
        self.self_attn.o_proj = Linear(c.num_attention_heads * hd, {None: c.hidden_size}, quant)
        self.mlp = nn.Module()
        self.mlp.gate_up_proj = Linear(c.hidden_size, {0: c.intermediate_size, 1: c.intermediate_size}, quant)
        self.mlp.down_proj = Linear(c.intermediate_size, {None: c.hidden_size}, quant)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        c, hd = self.c, self.c.head_dim
        b, t, _ = x.shape
        qkv = self.self_attn.qkv_proj(self.input_layernorm(x))
        q, k, v = qkv.split([c.num_attention_heads * hd, c.num_key_value_heads * hd, c.num_key_value_heads * hd], -1)
        q = q.view(b, t, -1, hd).transpose(1, 2)
        k = k.view(b, t, -1, hd).transpose(1, 2)
        v = v.view(b, t, -1, hd).transpose(1, 2)
        q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        rep = c.num_attention_heads // c.num_key_value_heads
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.self_attn.o_proj(att.transpose(1, 2).reshape(b, t, -1))
        gate, up = self.mlp.gate_up_proj(self.post_attention_layernorm(x)).chunk(2, dim=-1)
        return x + self.mlp.down_proj(F.silu(gate) * up)


class EngineLlama(nn.Module):
    # (fused parameter, checkpoint name, shard id), as in vLLM's and sglang's Llama
    stacked_params_mapping = (
        (".qkv_proj", ".q_proj", "q"),
        (".qkv_proj", ".k_proj", "k"),
        (".qkv_proj", ".v_proj", "v"),
        (".gate_up_proj", ".gate_proj", 0),
        (".gate_up_proj", ".up_proj", 1),
    )

    def __init__(self, c: Config, quant: Any = None) -> None:
        super().__init__()
        self.c = c
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.model.embed_tokens.weight.requires_grad_(False)
        self.model.layers = nn.ModuleList(Layer(c, quant) for _ in range(c.num_hidden_layers))
        self.model.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.lm_head = Linear(c.hidden_size, {None: c.vocab_size}, quant)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:  # lazily, one tensor at a time
            if "rotary_emb.inv_freq" in name:
                continue
            shard: Any = None
            target = name
            for fused, part, shard_id in self.stacked_params_mapping:
                if part in name:
                    target, shard = name.replace(part, fused), shard_id
                    break
            param = params.get(target)
            if param is None:
                raise ValueError(f"checkpoint tensor {name!r} has no parameter {target!r} in this model")
            loader = getattr(param, "weight_loader", None)
            try:
                if shard is not None:
                    loader(param, tensor, shard)  # type: ignore[misc]
                elif loader is not None:
                    loader(param, tensor)
                else:
                    _fits(param, tensor)
                    param.data.copy_(tensor)
            except RuntimeError as exc:  # a shape that does not fit: name both sides
                raise ValueError(
                    f"checkpoint tensor {name!r} {list(tensor.shape)} does not fit parameter {target!r} "
                    f"{list(param.shape)}: {exc}"
                ) from exc
            loaded.add(target)
        return loaded

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        c = self.c
        x = self.model.embed_tokens(ids)
        pos = torch.arange(ids.shape[1], dtype=torch.float32)
        inv_freq = 1.0 / (c.rope_theta ** (torch.arange(0, c.head_dim, 2, dtype=torch.int64).float() / c.head_dim))
        freqs = torch.outer(pos, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
        for layer in self.model.layers:
            x = layer(x, cos, sin)
        return self.lm_head(self.model.norm(x))
