"""The safetensors format as data: the dtype table and a header parse that trusts nothing.

A file is ``u64 little-endian N | N bytes of JSON | data``. The JSON maps tensor names to
``{"dtype", "shape", "data_offsets": [begin, end]}`` (offsets relative to the data area),
plus an optional ``"__metadata__"`` of str -> str. These rules follow the reference
implementation: the tensors, sorted by offset, tile the data area exactly.
"""

from __future__ import annotations

import ctypes
import operator
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from ._json import gc_paused, loads_header
from ._threads import CHECK_EVERY, Pacer, paced
from .errors import HeaderError

#: safetensors' header limit; larger headers are refused before any allocation.
MAX_HEADER_BYTES = 100_000_000
#: Largest byte count any tensor may claim (safetensors uses checked usize arithmetic).
_MAX_NBYTES = 2**63 - 1

# safetensors dtype name -> (torch attribute, item size in bytes). Names whose torch
# attribute is missing in the installed torch are left out and refused by name.
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

DTYPES: dict[str, torch.dtype] = {name: getattr(torch, attr) for name, attr, _ in _DTYPE_TABLE if hasattr(torch, attr)}
ITEMSIZE: dict[str, int] = {name: size for name, _, size in _DTYPE_TABLE if name in DTYPES}
DTYPE_NAMES: dict[torch.dtype, str] = {dtype: name for name, dtype in DTYPES.items()}


class TensorSpec(NamedTuple):
    """Where one tensor lives: its shard, dtype, shape and absolute byte range in the file.
    (A NamedTuple: checkpoints hold tens of thousands of these, built while parsing headers.)"""

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


@dataclass(frozen=True)
class Header:
    """A validated header: specs in offset order, metadata, and where the data area starts."""

    specs: tuple[TensorSpec, ...]
    metadata: dict[str, str]
    data_start: int


def header_length(prefix: bytes, file_size: int, url: str) -> int:
    """The JSON length from the 8-byte prefix, checked against the file and the limit."""
    if file_size < 8 or len(prefix) < 8:
        raise HeaderError(f"file is {file_size} bytes, too short for a safetensors header", url=url)
    n = int.from_bytes(prefix[:8], "little")
    if n > MAX_HEADER_BYTES:
        raise HeaderError(f"header claims {n} bytes, over the {MAX_HEADER_BYTES}-byte limit", url=url)
    if 8 + n > file_size:
        raise HeaderError(
            f"header claims {n} bytes but the file has only {file_size - 8} after the length",
            url=url,
            byte_range=(8, 8 + n),
        )
    return n


def parse_header(raw: bytes, file_size: int, url: str) -> Header:
    """Validate the JSON header ``raw`` (the N bytes after the prefix) of a file of ``file_size``."""
    data_start = 8 + len(raw)
    with gc_paused:
        obj = loads_header(raw, url)
        metadata = _metadata(obj.pop("__metadata__", None), url)
        specs = _specs(obj, url, data_start)
        del obj
    # Headers list their tensors in offset order, as safetensors writes them: if these tile the
    # data area in the order given, that is their (start, end) order. Else they are sorted, by
    # two stable sorts on C keys that make no tuples (a lambda, or a key tuple per tensor, which
    # set off collections, held the GIL 8-65 ms on 20,000 tensors, the event loop with it). Even
    # those two held it 2.5-6 ms together, which the event loop waited for every load.
    if _untiled_at(specs, file_size, data_start) is not None:
        specs.sort(key=_END)
        specs.sort(key=_START)
        _check_tiling(specs, file_size, data_start, url)
    return Header(tuple(specs), metadata, data_start)


_START, _END = operator.attrgetter("start"), operator.attrgetter("end")


def _untracker() -> Callable[[object], None]:
    fn = getattr(ctypes.pythonapi, "PyObject_GC_UnTrack", None) if sys.implementation.name == "cpython" else None
    if fn is None:
        return lambda obj: None
    fn.argtypes, fn.restype = (ctypes.py_object,), None
    return fn  # type: ignore[no-any-return]


#: ``untrack(obj)``: the cyclic garbage collector stops tracking ``obj`` (CPython's
#: ``PyObject_GC_UnTrack``; does nothing elsewhere). Only for immutable tuples of leaves (strings, numbers,
#: tuples of them), which can be part of no cycle: each ``TensorSpec`` and plan ``Item``. CPython
#: stops tracking exact tuples like these by itself, but not a NamedTuple's instances: a load of
#: 20,000 tensors promoted ~40,000 of them to the oldest generation, and every ~4 such loads a full
#: collection (157-204 ms here, holding the GIL) walked the whole process. ~0.3 us each.
untrack = _untracker()
#: ``_new_tuple(SomeNamedTuple, (fields...))`` makes one without the Python frame of its ``__new__``
#: (headers and plans make tens of thousands).
_new_tuple: Any = tuple.__new__


def _metadata(value: Any, url: str) -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        raise HeaderError("__metadata__ must be an object of strings to strings", url=url)
    return dict(value)


def _specs(obj: dict[str, Any], url: str, data_start: int) -> list[TensorSpec]:
    """The specs of a header's entries, in its order, each entry freed once its spec is made."""
    specs: list[TensorSpec] = []
    # One tuple per shape, shared by its specs: a tuple is tracked by the collector until a
    # collection looks at it, and 20,000 of them were all the youngest generation held.
    shapes: dict[tuple[int, ...], tuple[int, ...]] = {}
    for name, entry in paced(obj.items()):
        specs.append(_spec(name, entry, url, data_start, shapes))
        obj[name] = None  # freed here, a few at a time, not in one go at the end
    return specs


def _spec(
    name: str, entry: Any, url: str, data_start: int, shapes: dict[tuple[int, ...], tuple[int, ...]]
) -> TensorSpec:
    """One entry, checked strictly: the error says what is wrong with it. Written for speed as
    well (a header can hold tens of thousands); ``type(x) is int`` refuses bools and floats alike.
    Its shape tuple is the one in ``shapes`` where an equal one is there already."""
    try:
        if type(entry) is not dict or len(entry) != 3:
            raise KeyError
        dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    except KeyError:
        raise HeaderError(
            "entry must be an object with exactly dtype, shape and data_offsets", url=url, tensor=name
        ) from None
    size = ITEMSIZE.get(dtype) if type(dtype) is str else None
    if size is None:
        raise HeaderError(f"unsupported dtype {dtype!r}", url=url, tensor=name)
    if type(shape) is not list:
        raise HeaderError(f"shape must be a list of non-negative integers, got {shape!r}", url=url, tensor=name)
    nbytes = size
    for dim in shape:
        if type(dim) is not int or dim < 0:
            raise HeaderError(f"shape must be a list of non-negative integers, got {shape!r}", url=url, tensor=name)
        nbytes *= dim
        if nbytes > _MAX_NBYTES:
            raise HeaderError(f"shape {shape} of {dtype} overflows", url=url, tensor=name)
    if type(offsets) is not list or len(offsets) != 2 or not (type(offsets[0]) is int and type(offsets[1]) is int):
        raise HeaderError(f"data_offsets must be two non-negative integers, got {offsets!r}", url=url, tensor=name)
    begin, end = offsets
    if begin < 0 or end < begin or end - begin != nbytes:
        raise HeaderError(
            f"data_offsets span {end - begin} bytes but {dtype}{shape} needs {nbytes}",
            url=url,
            tensor=name,
            byte_range=(data_start + begin, data_start + end),
        )
    dims = tuple(shape)
    dims = shapes.setdefault(dims, dims)
    spec: TensorSpec = _new_tuple(TensorSpec, (name, dtype, dims, url, data_start + begin, data_start + end))
    untrack(spec)
    return spec


def _untiled_at(specs: list[TensorSpec], file_size: int, data_start: int) -> tuple[int, int] | None:
    """None where the tensors, in this order, start at 0, touch end to end and end at the file's
    end; else where that fails: the index of the first out of place (``len(specs)`` when they end
    elsewhere than the file's end) and the byte where it should have started."""
    cursor = data_start
    pace = Pacer()  # a Python step per tensor: 20,000 held the GIL 2.7-7.8 ms in one go
    for i, spec in enumerate(specs):
        if spec.start != cursor:
            return i, cursor
        cursor = spec.end
        if not i % CHECK_EVERY:
            pace()
    return None if cursor == file_size else (len(specs), cursor)


def _check_tiling(specs: list[TensorSpec], file_size: int, data_start: int, url: str) -> None:
    """Sorted by offset, the tensors must start at 0, touch end to end, and end at the file's end."""
    bad = _untiled_at(specs, file_size, data_start)
    if bad is None:
        return
    i, cursor = bad
    if i < len(specs):
        spec = specs[i]
        why = "overlaps the tensor before it" if spec.start < cursor else "leaves a gap before it"
        raise HeaderError(why, url=url, tensor=spec.name, byte_range=spec.byte_range)
    raise HeaderError(
        f"tensors end at byte {cursor} but the file has {file_size} bytes",
        url=url,
        byte_range=(min(cursor, file_size), max(cursor, file_size)),
    )
