"""Stages and recipes: lazy, composable, and the name-only ones prune the read plan."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest
import torch
from torch import nn

import aload
from aload import stages as S

from .conftest import collect


async def test_keep_drop_rename_compose(write: Callable[..., Path]) -> None:
    path = write({"a.weight": torch.ones(2), "a.bias": torch.zeros(2), "b.weight": torch.full((2,), 2.0)})
    pipeline = S.drop(r"\.bias$") | S.rename([(r"^a\.", "x."), (r"^b\.", "y.")]) | S.keep(lambda n: n.startswith("x"))
    got = await collect(aload.stream(path, stages=pipeline))
    assert list(got) == ["x.weight"]


async def test_rename_to_none_drops_and_map_can_drop(write: Callable[..., Path]) -> None:
    path = write({"a": torch.ones(2), "b": torch.zeros(2), "c": torch.full((2,), 3.0)})
    pipeline = (S.rename(lambda n: None if n == "a" else n), S.map(lambda n, t: None if n == "b" else t + 1))
    got = await collect(aload.stream(path, stages=pipeline))
    assert list(got) == ["c"] and torch.equal(got["c"], torch.full((2,), 4.0))


async def test_a_plain_async_generator_is_a_stage(write: Callable[..., Path]) -> None:
    path = write({"a": torch.ones(2), "b": torch.zeros(2)})

    async def upper(items: AsyncIterator[tuple[str, torch.Tensor]]) -> AsyncIterator[tuple[str, torch.Tensor]]:
        async for name, t in items:
            yield name.upper(), t

    got = await collect(aload.stream(path, stages=[upper]))  # type: ignore[list-item]
    assert sorted(got) == ["A", "B"]


async def test_stages_are_lazy_one_tensor_at_a_time(write: Callable[..., Path]) -> None:
    path = write({f"t{i:02d}": torch.full((4,), float(i)) for i in range(10)})
    pulled: list[str] = []

    def spy(name: str, t: torch.Tensor) -> torch.Tensor:
        pulled.append(name)
        return t

    async with aload.stream(path, stages=S.map(spy)) as s:
        first = await s.__anext__()
        assert first[0] == "t00" and pulled == ["t00"]  # nothing ahead was transformed


async def test_select_mtp_layer_reads_only_that_layer(write: Callable[..., Path]) -> None:
    tensors = {
        "model.layers.0.w": torch.ones(4),
        "model.mtp.layers.0.w": torch.full((1024,), 0.0),
        "model.mtp.layers.1.w": torch.full((1024,), 1.0),
        "model.mtp.layers.2.w": torch.full((1024,), 2.0),
    }
    path = write(tensors)
    async with aload.stream(path, stages=S.select_mtp_layer(1)) as s:
        got = await collect(s)
        read = s.stats.bytes_read
    assert sorted(got) == ["model.layers.0.w", "model.mtp.layers.0.w"]
    assert torch.equal(got["model.mtp.layers.0.w"], tensors["model.mtp.layers.1.w"])
    assert read == 16 + 4096  # the other MTP layers were never read


async def test_weight_scale_inv_and_select_experts(write: Callable[..., Path]) -> None:
    tensors = {f"mlp.experts.{e}.w": torch.full((2,), float(e)) for e in range(8)}
    tensors["mlp.experts.3.weight_scale"] = torch.ones(1)
    tensors["attn.weight_scale"] = torch.ones(1)
    path = write(tensors)
    got = await collect(aload.stream(path, stages=S.select_experts([3, 5]) | S.weight_scale_inv()))
    assert sorted(got) == [
        "attn.weight_scale_inv",
        "mlp.experts.0.w",
        "mlp.experts.0.weight_scale_inv",
        "mlp.experts.1.w",
    ]
    assert torch.equal(got["mlp.experts.1.w"], torch.full((2,), 5.0))


async def test_tensor_parallel_slices(write: Callable[..., Path]) -> None:
    w = torch.arange(24.0).reshape(4, 6)
    path = write({"q_proj.weight": w, "o_proj.weight": w.clone(), "norm.weight": torch.ones(6)})
    tp = S.tensor_parallel(1, 2, column=[r"q_proj"], row=[r"o_proj"])
    got = await collect(aload.stream(path, stages=tp))
    assert torch.equal(got["q_proj.weight"], w[2:]) and torch.equal(got["o_proj.weight"], w[:, 3:])
    assert torch.equal(got["norm.weight"], torch.ones(6))


async def test_a_planned_tensor_parallel_stage_reads_only_the_rows_it_keeps(write: Callable[..., Path]) -> None:
    big = torch.randn(4096, 512)  # 8 MiB: a quarter of it is read straight into the parameter
    path = write({"q_proj.weight": big, "o_proj.weight": big.clone(), "norm.weight": torch.ones(512)})
    tp = S.tensor_parallel(1, 4, column=[r"q_proj"], row=[r"o_proj"])
    for stages in (tp, S.rename(r"^", "") | tp):  # first, or after name stages
        async with aload.stream(path, stages=stages) as s:
            got = {n: t.clone() async for n, t in s}
            read = s.stats.bytes_read
        assert torch.equal(got["q_proj.weight"], big[1024:2048]) and torch.equal(got["o_proj.weight"], big[:, 128:256])
        assert read == big.nbytes // 4 + big.nbytes + 512 * 4  # a quarter of q_proj, all of o_proj
    model = nn.ParameterDict({"q_proj": nn.Parameter(torch.zeros(1024, 512)), "o_proj": nn.Parameter(torch.zeros(4096, 128)),
                              "norm": nn.Parameter(torch.zeros(512))})  # fmt: skip
    report = await aload.load(model, path, stages=S.rename(r"\.weight$", "") | tp)
    assert torch.equal(model["q_proj"], big[1024:2048]) and torch.equal(model["o_proj"], big[:, 128:256])
    assert report.direct_bytes == big.nbytes // 4  # the rank's rows, read straight into its parameter
    # later in the stages it slices after reading: the same tensors, every byte read
    async with aload.stream(path, stages=S.map(lambda n, t: t) | tp) as s:
        late = {n: t.clone() async for n, t in s}
        assert s.stats.bytes_read == 2 * big.nbytes + 512 * 4
    assert all(torch.equal(late[k], got[k]) for k in got)


async def test_permute_qk_matches_the_engines_formula(write: Callable[..., Path]) -> None:
    heads, kv, hd, hidden = 4, 2, 8, 32
    q, k, v = torch.randn(heads * hd, hidden), torch.randn(kv * hd, hidden), torch.randn(kv * hd, hidden)
    path = write({"l.q_proj.weight": q, "l.k_proj.weight": k, "l.v_proj.weight": v})
    stage = S.permute_qk_for_rotary(num_heads=heads, num_kv_heads=kv, head_dim=hd, hidden_size=hidden)
    got = await collect(aload.stream(path, stages=stage))

    def ref(w: torch.Tensor, n: int) -> torch.Tensor:  # per head: interleaved pairs -> two halves
        return torch.cat([torch.cat([h[0::2], h[1::2]]) for h in w.view(n, hd, hidden)])

    assert torch.equal(got["l.q_proj.weight"], ref(q, heads))
    assert torch.equal(got["l.k_proj.weight"], ref(k, kv))
    assert torch.equal(got["l.v_proj.weight"], v)


def test_bad_stage_arguments_are_refused() -> None:
    with pytest.raises(aload.UsageError):
        S.keep()
    with pytest.raises(aload.UsageError):
        S.rename([("a", 1)])  # type: ignore[list-item]
    with pytest.raises(aload.UsageError):
        S.tensor_parallel(2, 2)
    with pytest.raises(aload.UsageError):
        aload.stream("x.safetensors", stages=[42])  # type: ignore[list-item]
