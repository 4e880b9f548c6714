"""Headers: every dtype, scalars, zero-size, unicode names; each rule has a file it refuses."""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open

import aload
from aload.format import DTYPES

from .conftest import collect

SAMPLES: dict[str, torch.Tensor] = {}
for code, dtype in DTYPES.items():
    base = torch.arange(-7, 17, dtype=torch.float64).reshape(2, 3, 4)
    if dtype == torch.bool:
        SAMPLES[code] = base > 0
    elif dtype.is_complex:
        SAMPLES[code] = torch.complex(base.float(), -base.float())
    elif code.startswith("U"):
        SAMPLES[code] = base.abs().to(dtype)
    elif code == "F8_E8M0":
        SAMPLES[code] = torch.full((5,), 4.0).to(dtype)
    else:
        SAMPLES[code] = base.to(dtype)


async def test_every_dtype_scalar_empty_and_unicode_match_safetensors(write: Callable[..., Path]) -> None:
    tensors = {f"t_{k}": v for k, v in SAMPLES.items()}
    tensors["scalar"] = torch.tensor(2.5, dtype=torch.float16)
    tensors["empty"] = torch.empty(0, 3, dtype=torch.float32)
    tensors["also.empty"] = torch.empty(4, 0, dtype=torch.int64)
    tensors["ünï.çødé/名前"] = torch.ones(3, dtype=torch.bfloat16)
    tensors["odd"] = torch.ones(3, dtype=torch.int8)  # leaves the next tensor misaligned
    path = write(tensors, metadata={"format": "pt", "ключ": "значение"})
    got = await collect(aload.stream(path))
    with safe_open(str(path), "pt") as f:
        names = list(f.keys())
        assert set(got) == set(names)
        for name in names:
            want = f.get_tensor(name)
            assert got[name].dtype == want.dtype and got[name].shape == want.shape, name
            assert got[name].view(-1).view(torch.uint8).tolist() == want.view(-1).view(torch.uint8).tolist(), name
    ckpt = await aload.open(path)
    async with ckpt:
        assert ckpt.metadata == {"format": "pt", "ключ": "значение"}
        assert ckpt.specs["scalar"].shape == () and ckpt.specs["empty"].nbytes == 0


def raw_file(path: Path, header: Any, data: bytes = b"", *, length: int | None = None) -> Path:
    blob = header if isinstance(header, bytes) else json.dumps(header).encode()
    n = len(blob) if length is None else length
    path.write_bytes(struct.pack("<Q", n) + blob + data)
    return path


def entry(dtype: str = "F32", shape: list[int] | None = None, offsets: list[int] | None = None) -> dict[str, Any]:
    return {
        "dtype": dtype,
        "shape": [2] if shape is None else shape,
        "data_offsets": [0, 8] if offsets is None else offsets,
    }


BAD: dict[str, tuple[Any, bytes, dict[str, Any]]] = {
    "length past the file": ({"a": entry()}, b"\0" * 8, {"length": 10_000}),
    "length over the limit": ({"a": entry()}, b"\0" * 8, {"length": 200_000_000}),
    "not json": (b"{not json", b"", {}),
    "not utf-8": (b'{"\xff": 1}', b"", {}),
    "json array": ([1, 2], b"", {}),
    "duplicate key": (
        b'{"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}, "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}',
        b"\0" * 8,
        {},
    ),
    "unknown dtype": ({"a": entry(dtype="F128")}, b"\0" * 8, {}),
    "4-bit dtype": ({"a": entry(dtype="F4")}, b"\0" * 8, {}),
    "negative dim": ({"a": entry(shape=[-2], offsets=[0, 8])}, b"\0" * 8, {}),
    "float dim": ({"a": entry(shape=[2.0])}, b"\0" * 8, {}),
    "bool dim": ({"a": entry(shape=[True, 2])}, b"\0" * 8, {}),
    "missing field": ({"a": {"dtype": "F32", "shape": [2]}}, b"\0" * 8, {}),
    "extra field": ({"a": {**entry(), "x": 1}}, b"\0" * 8, {}),
    "size mismatch": ({"a": entry(offsets=[0, 12])}, b"\0" * 12, {}),
    "inverted offsets": ({"a": entry(offsets=[8, 0])}, b"\0" * 8, {}),
    "negative offsets": ({"a": entry(offsets=[-8, 0])}, b"\0" * 8, {}),
    "bool offset": ({"a": entry(offsets=[False, 8])}, b"\0" * 8, {}),
    "overflowing shape": ({"a": entry(shape=[2**40, 2**40])}, b"\0" * 8, {}),
    "overlap": ({"a": entry(offsets=[0, 8]), "b": entry(offsets=[4, 12])}, b"\0" * 12, {}),
    "gap": ({"a": entry(offsets=[0, 8]), "b": entry(offsets=[12, 20])}, b"\0" * 20, {}),
    "overlap out of order": ({"b": entry(offsets=[4, 12]), "a": entry(offsets=[0, 8])}, b"\0" * 12, {}),
    "not from zero": ({"a": entry(offsets=[4, 12])}, b"\0" * 12, {}),
    "file longer than header says": ({"a": entry()}, b"\0" * 9, {}),
    "file shorter than header says": ({"a": entry()}, b"\0" * 7, {}),
    "metadata not strings": ({"__metadata__": {"k": 1}, "a": entry()}, b"\0" * 8, {}),
    "entry not object": ({"a": [1]}, b"\0" * 8, {}),
    "too short for a header": (b"", b"", {"length": 0}),
}


@pytest.mark.parametrize("case", sorted(BAD))
async def test_malformed_header_is_refused(tmp_path: Path, case: str) -> None:
    header, data, kw = BAD[case]
    path = raw_file(tmp_path / "bad.safetensors", header, data, **kw)
    if case == "too short for a header":
        path.write_bytes(b"\x01\x02")
    with pytest.raises(aload.HeaderError) as info:
        await aload.open(path)
    assert str(path) in str(info.value)


async def test_error_names_tensor_and_byte_range(tmp_path: Path) -> None:
    path = raw_file(tmp_path / "bad.safetensors", {"w": entry(offsets=[0, 12])}, b"\0" * 12)
    with pytest.raises(aload.HeaderError) as info:
        await aload.open(path)
    err = info.value
    assert err.tensor == "w" and err.byte_range is not None and err.url == str(path)
    assert "'w'" in str(err) and "bytes [" in str(err)


async def test_zero_size_tensors_and_a_header_out_of_offset_order(tmp_path: Path) -> None:
    """Specs come out by (start, end): a zero-size tensor sharing its offset with the tensor that
    starts there sorts before it, whatever order the header lists them in."""
    header = {
        "b": entry(offsets=[8, 16]),
        "z2": entry(shape=[0], offsets=[16, 16]),
        "z": entry(shape=[0, 3], offsets=[8, 8]),
        "a": entry(offsets=[0, 8]),
    }
    data = bytes(range(16))
    path = raw_file(tmp_path / "order.safetensors", header, data)
    async with await aload.open(path) as ckpt:
        assert list(ckpt.specs) == ["a", "z", "b", "z2"]
    got = await collect(aload.stream(path))
    assert got["b"].view(torch.uint8).tolist() == list(range(8, 16)) and got["z"].shape == (0, 3)


@pytest.mark.parametrize(
    "listed",
    [["a", "z", "b"], ["a", "b", "z"], ["z", "a", "b"]],
)
async def test_a_zero_size_tensor_sorts_before_the_tensor_at_its_offset(tmp_path: Path, listed: list[str]) -> None:
    """In offset order as listed (the tensors tile the file: kept as they are) or not (sorted),
    the specs come out the same."""
    entries = {"a": entry(offsets=[0, 8]), "z": entry(shape=[0], offsets=[8, 8]), "b": entry(offsets=[8, 16])}
    path = raw_file(tmp_path / "z.safetensors", {k: entries[k] for k in listed}, bytes(16))
    async with await aload.open(path) as ckpt:
        assert list(ckpt.specs) == ["a", "z", "b"]


async def test_huge_claimed_header_is_not_allocated(tmp_path: Path) -> None:
    """A header claiming 90 MB in a 100-byte file is refused from the file size alone."""
    path = raw_file(tmp_path / "liar.safetensors", b"{}", b"", length=90_000_000)
    with pytest.raises(aload.HeaderError, match="claims"):
        await aload.open(path)


async def test_a_deeply_nested_header_is_a_header_error(tmp_path: Path) -> None:
    """Hostile nesting is refused as an aload error naming the file, not a RecursionError."""
    deep = b"[" * 100_000 + b"]" * 100_000
    body = b'{"a":' + deep + b"}"
    path = tmp_path / "deep.safetensors"
    path.write_bytes(len(body).to_bytes(8, "little") + body)
    with pytest.raises(aload.HeaderError, match=r"deep\.safetensors"):
        await aload.open(path)


@pytest.mark.parametrize(
    ("content", "hint"),
    [(b"PK\x03\x04" + bytes(100), "zip"), (b"\x80\x02" + bytes(100), "pickle"), (b'{"weight_map": {}}', "index")],
)
async def test_a_file_that_is_not_safetensors_says_so(tmp_path: Path, content: bytes, hint: str) -> None:
    path = tmp_path / "model.bin"
    path.write_bytes(content)
    with pytest.raises(aload.HeaderError, match=hint):
        await aload.open(path)
