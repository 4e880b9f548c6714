"""Property tests over mutated headers: every input parses to exactly what safetensors reads, or
is refused with an AloadError. Never another exception, never a hang (pytest-timeout), never an
allocation larger than the file (the header is checked against the file size before parsing)."""

from __future__ import annotations

import asyncio
import os
import struct
import tempfile

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import save

import aload
from aload.format import DTYPES

DTYPE_NAMES = sorted(k for k in DTYPES if k not in ("F8_E8M0",))


@st.composite
def checkpoints(draw: st.DrawFn) -> bytes:
    n = draw(st.integers(1, 4))
    tensors = {}
    for i in range(n):
        shape = tuple(draw(st.lists(st.integers(0, 3), max_size=3)))
        dtype = DTYPES[draw(st.sampled_from(DTYPE_NAMES))]
        tensors[f"t{i}"] = torch.zeros(shape, dtype=torch.float64).to(dtype)
    return save(tensors)


@st.composite
def mutated(draw: st.DrawFn) -> bytes:
    blob = bytearray(draw(checkpoints()))
    n = struct.unpack("<Q", blob[:8])[0]
    kind = draw(st.sampled_from(["flip", "truncate", "length", "splice"]))
    if kind == "flip":  # change bytes inside the header
        for _ in range(draw(st.integers(1, 4))):
            pos = draw(st.integers(8, 8 + n - 1))
            blob[pos] = draw(st.integers(0, 255))
    elif kind == "truncate":
        blob = blob[: draw(st.integers(0, len(blob)))]
    elif kind == "length":
        blob[:8] = struct.pack("<Q", draw(st.one_of(st.integers(0, 2 * n + 16), st.integers(0, 2**64 - 1))))
    else:  # replace a digit run in the header (offsets, shapes) with another number
        text = bytes(blob[8 : 8 + n])
        digits = [i for i, c in enumerate(text) if 48 <= c <= 57]
        if digits:
            i = draw(st.sampled_from(digits))
            blob[8 + i] = ord(str(draw(st.integers(0, 9))))
    return bytes(blob)


def check(blob: bytes, must_accept: bool = False) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "m.safetensors")
        with open(path, "wb") as f:
            f.write(blob)

        async def ours() -> dict[str, torch.Tensor] | None:
            try:
                async with aload.stream(path) as s:
                    return {n: t.clone() async for n, t in s}
            except aload.AloadError:
                return None

        got = asyncio.run(ours())
        if got is None:
            assert not must_accept, "a valid checkpoint was refused"
            return  # refused with an aload error: allowed for a damaged file
        with safe_open(path, "pt") as f:  # accepted: safetensors must read exactly the same
            assert sorted(f.keys()) == sorted(got)
            for k in f.keys():
                want = f.get_tensor(k)
                assert want.dtype == got[k].dtype and want.shape == got[k].shape
                assert want.reshape(-1).view(torch.uint8).tolist() == got[k].reshape(-1).view(torch.uint8).tolist()


# CI runs a few hundred examples; `HYPOTHESIS_PROFILE=long pytest tests/test_fuzz.py` runs the long fuzz.
settings.register_profile("ci", max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("long", max_examples=20_000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@given(checkpoints())
def test_valid_checkpoints_read_exactly_as_safetensors(blob: bytes) -> None:
    check(blob, must_accept=True)


@given(mutated())
def test_mutated_headers_are_read_identically_or_refused(blob: bytes) -> None:
    check(blob)
