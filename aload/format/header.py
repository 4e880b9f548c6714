"""The safetensors header: the dtype table and a parse that trusts nothing.

A file is ``u64 little-endian N | N bytes of JSON | data``. The JSON maps tensor names to
``{"dtype", "shape", "data_offsets": [begin, end]}`` (offsets relative to the data area),
plus an optional ``"__metadata__"`` of str -> str. As in the reference implementation, the
tensors, sorted by offset, must tile the data area exactly.
"""

from __future__ import annotations

import json
from typing import Any, NamedTuple

import torch

from ..errors import HeaderError

#: safetensors' own header limit; a larger claim is refused before anything is allocated.
MAX_HEADER_BYTES = 100_000_000
_MAX_NBYTES = 2**63 - 1

# safetensors dtype name -> (torch attribute, item size). Names the installed torch lacks are
# left out, and refused by name.
_DTYPE_TABLE: tuple[tuple[str, str, int], ...] = (
    ("F64", "float64", 8),
    ("F32", "float32", 4),
    ("F16", "float16", 2),
    ("BF16", "bfloat16", 2),
    ("I64", "int64", 8),
    ("I32", "int32", 4),
    ("I16", "int16", 2),
    ("I8", "int8", 1),
    ("U8", "uint8", 1),
    ("U16", "uint16", 2),
    ("U32", "uint32", 4),
    ("U64", "uint64", 8),
    ("BOOL", "bool", 1),
    ("C64", "complex64", 8),
    ("F8_E4M3", "float8_e4m3fn", 1),
    ("F8_E5M2", "float8_e5m2", 1),
    ("F8_E4M3FNUZ", "float8_e4m3fnuz", 1),
    ("F8_E5M2FNUZ", "float8_e5m2fnuz", 1),
    ("F8_E8M0", "float8_e8m0fnu", 1),
)

DTYPES: dict[str, torch.dtype] = {n: getattr(torch, a) for n, a, _ in _DTYPE_TABLE if hasattr(torch, a)}
ITEMSIZE: dict[str, int] = {n: size for n, _, size in _DTYPE_TABLE if n in DTYPES}


class TensorSpec(NamedTuple):
    """Where one tensor lives: its shard (URL), dtype, shape and absolute byte range."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    shard: str
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def itemsize(self) -> int:
        return ITEMSIZE[self.dtype]

    @property
    def byte_range(self) -> tuple[int, int]:
        return (self.start, self.end)


def header_length(prefix: bytes, file_size: int, url: str) -> int:
    """The JSON length from the 8-byte prefix, checked against the file size and the limit."""
    if file_size < 8 or len(prefix) < 8:
        raise HeaderError(f"file is {file_size} bytes, too short to be a safetensors file", url=url)
    n = int.from_bytes(prefix[:8], "little")
    if n > MAX_HEADER_BYTES:
        raise HeaderError(
            f"{_not_safetensors(prefix)}its first 8 bytes claim a {n}-byte header, over the {MAX_HEADER_BYTES}-byte limit",
            url=url,
        )
    if 8 + n > file_size:
        raise HeaderError(
            f"{_not_safetensors(prefix)}header claims {n} bytes but the file has only {file_size - 8} after the length",
            url=url,
            byte_range=(8, 8 + n),
        )
    return n


def _not_safetensors(prefix: bytes) -> str:
    """What a file whose length prefix makes no sense looks like instead, as the start of a message."""
    if prefix[:2] == b"PK":
        return "not a safetensors file but a zip (torch.save?): convert it to safetensors, or pass the .safetensors file; "
    if prefix[:1] == b"\x80" and prefix[1:2] in (b"\x02", b"\x03", b"\x04", b"\x05"):
        return "not a safetensors file but a pickle (torch.save?): convert it to safetensors, or pass the .safetensors file; "
    if prefix[:1] == b"{":
        return "not a safetensors file but JSON (an index? pass the folder that holds it); "
    return "truncated, or not a safetensors file: "


def parse_header(raw: bytes, file_size: int, url: str) -> tuple[list[TensorSpec], dict[str, str]]:
    """The specs (in offset order) and metadata of the JSON header ``raw`` (the N bytes after
    the length prefix) of a file of ``file_size`` bytes."""
    data_start = 8 + len(raw)
    try:
        obj = json.loads(raw, object_pairs_hook=unique_keys)
    except RecursionError:  # hostile nesting: the C decoder gives up at the recursion limit
        raise HeaderError("header JSON is nested too deeply", url=url, byte_range=(8, data_start)) from None
    except (UnicodeDecodeError, ValueError) as exc:
        raise HeaderError(f"header is not valid UTF-8 JSON: {exc}", url=url, byte_range=(8, data_start)) from exc
    if type(obj) is not dict:
        raise HeaderError("header must be a JSON object", url=url, byte_range=(8, data_start))
    metadata = _metadata(obj.pop("__metadata__", None), url)
    specs = [_spec(name, entry, url, data_start) for name, entry in obj.items()]
    specs.sort(key=lambda s: (s.start, s.end))
    _check_tiling(specs, file_size, data_start, url)
    return specs, metadata


def _metadata(value: Any, url: str) -> dict[str, str]:
    if value is None:
        return {}
    if type(value) is not dict or not all(type(k) is str and type(v) is str for k, v in value.items()):
        raise HeaderError("__metadata__ must be an object of strings to strings", url=url)
    return value


def _spec(name: str, entry: Any, url: str, data_start: int) -> TensorSpec:
    """One entry, checked strictly (``type(x) is int`` refuses bools and floats alike)."""
    if type(entry) is not dict or set(entry) != {"dtype", "shape", "data_offsets"}:
        raise HeaderError("entry must be an object with exactly dtype, shape and data_offsets", url=url, tensor=name)
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    size = ITEMSIZE.get(dtype) if type(dtype) is str else None
    if size is None:
        raise HeaderError(f"unsupported dtype {dtype!r}", url=url, tensor=name)
    if type(shape) is not list or not all(type(d) is int and d >= 0 for d in shape):
        raise HeaderError(f"shape must be a list of non-negative integers, got {shape!r}", url=url, tensor=name)
    nbytes = size
    for dim in shape:
        nbytes *= dim
        if nbytes > _MAX_NBYTES:
            raise HeaderError(f"shape {shape} of {dtype} overflows", url=url, tensor=name)
    if type(offsets) is not list or len(offsets) != 2 or not all(type(o) is int for o in offsets):
        raise HeaderError(f"data_offsets must be two non-negative integers, got {offsets!r}", url=url, tensor=name)
    begin, end = offsets
    if begin < 0 or end < begin or end - begin != nbytes:
        raise HeaderError(
            f"data_offsets span {end - begin} bytes but {dtype}{shape} needs {nbytes}",
            url=url,
            tensor=name,
            byte_range=(data_start + begin, data_start + end),
        )
    return TensorSpec(name, dtype, tuple(shape), url, data_start + begin, data_start + end)


def _check_tiling(specs: list[TensorSpec], file_size: int, data_start: int, url: str) -> None:
    """Sorted by offset, the tensors must start at 0, touch end to end, and end at the file's end."""
    cursor = data_start
    for spec in specs:
        if spec.start != cursor:
            why = "overlaps the tensor before it" if spec.start < cursor else "leaves a gap before it"
            raise HeaderError(why, url=url, tensor=spec.name, byte_range=spec.byte_range)
        cursor = spec.end
    if cursor != file_size:
        raise HeaderError(
            f"tensors end at byte {cursor} but the file has {file_size} bytes",
            url=url,
            byte_range=(min(cursor, file_size), max(cursor, file_size)),
        )


class _Duplicate(ValueError):
    pass


def unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object whose keys are all different (safetensors refuses a repeated key)."""
    obj = dict(pairs)
    if len(obj) != len(pairs):
        seen: set[str] = set()
        key = next(k for k, _ in pairs if k in seen or seen.add(k))  # type: ignore[func-returns-value]
        raise _Duplicate(f"key {key!r} appears twice")
    return obj
