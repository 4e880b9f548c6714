"""The safetensors format as data: the dtype table and a header parse that trusts nothing.

A file is ``u64 little-endian N | N bytes of JSON | data``. The JSON maps tensor names to
``{"dtype", "shape", "data_offsets": [begin, end]}`` (offsets relative to the data area),
plus an optional ``"__metadata__"`` of str -> str. These rules follow the reference
implementation: the tensors, sorted by offset, tile the data area exactly.
"""

from __future__ import annotations

import ctypes
import gc
import json
import operator
import re
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from ._threads import Pacer, paced
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
        obj = _load_json(raw, url)
        metadata = _metadata(obj.pop("__metadata__", None), url)
        specs = []
        for i, (name, entry) in enumerate(paced(obj.items()), 1):
            specs.append(_spec(name, entry, url, data_start))
            obj[name] = None  # freed here, a few at a time, not in one go at the end
            if not i % _YOUNG_EVERY:
                gc_paused.collect_young()
        del obj
        # By (start, end) in two stable sorts on C keys that make no tuples: a lambda, or a key
        # tuple per tensor (which set off collections), held the GIL 8-65 ms on 20,000 tensors,
        # and the event loop with it. Both are one pass when the header is in offset order.
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


class _GcPause:
    """``with gc_paused:`` no cyclic garbage collection while a header is parsed. JSON makes three
    containers per tensor (60,000 for a 20,000-tensor header), all alive until the parse ends, so
    the collector ran ~150 times during one and, every load or two, a full collection of the whole
    process (130-170 ms, holding the GIL and so the event loop): a third of a whole load's time.
    Parsing makes no reference cycles, so nothing is left for later. Collection resumes when the
    last pause ends (pauses on several threads nest) if it was enabled when the first began."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._depth = 0
        self._resume = False

    def __enter__(self) -> None:
        with self._lock:
            self._depth += 1
            if self._depth == 1:
                self._resume = gc.isenabled()
                gc.disable()

    def collect_young(self) -> None:
        """During a pause, a collection of the youngest generation now, if collection will resume:
        what the parse made would otherwise be examined in one go when it does (40,000 objects on
        a 20,000-tensor header: 3.7-4.0 ms holding the GIL, 7 ms with the cores busy). Each small
        one examines what was made since the last (a decoded piece of JSON, or a slice of specs),
        untracks the shape tuples and moves the rest up a generation (the specs themselves are not
        tracked: ``untrack``). Generation 0 only: a promotion to the oldest generation would bring
        its full collection (100+ ms) nearer."""
        if self._depth and self._resume:
            gc.collect(0)

    def __exit__(self, *exc: object) -> None:
        with self._lock:
            self._depth -= 1
            if self._depth == 0 and self._resume:
                gc.enable()


gc_paused = _GcPause()
#: Tensors parsed between two collections of the youngest generation during a pause.
_YOUNG_EVERY = 1024


def _load_json(raw: bytes, url: str) -> dict[str, Any]:
    def no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        out = dict(pairs)
        if len(out) != len(pairs):
            seen: set[str] = set()
            dup = next(k for k, _ in pairs if k in seen or seen.add(k))  # type: ignore[func-returns-value]
            raise HeaderError("header names a key twice", url=url, tensor=dup)
        return out

    try:
        text = raw.decode("utf-8")
        obj = _loads_in_pieces(text)  # the C decoder, fast; duplicates are checked below
        if _may_hide_duplicates(raw, obj):
            obj = json.loads(text, object_pairs_hook=no_duplicates)  # slow and exact
    except HeaderError:
        raise
    except (UnicodeDecodeError, ValueError) as exc:
        raise HeaderError(f"header is not valid UTF-8 JSON: {exc}", url=url, byte_range=(8, 8 + len(raw))) from exc
    if not isinstance(obj, dict):
        raise HeaderError(f"header is a JSON {type(obj).__name__}, not an object", url=url)
    return obj


#: A large header is decoded this many characters at a time (~1 ms each): one ``json.loads`` of a
#: 20,000-tensor header (1.9 MB) held the GIL 25-40 ms, and so the event loop, even from a thread.
_JSON_PIECE = 64 * 1024


def _loads_in_pieces(text: str) -> Any:
    """``json.loads(text)`` of a header: a large one in pieces (see ``_object_in_pieces``), so other
    threads get the GIL in between; invalid text is parsed whole, for the exact error."""
    if len(text) <= 2 * _JSON_PIECE:
        return json.loads(text)
    at = len(text) - len(text.lstrip(_WS))
    got = _object_in_pieces(text, at, _HEADER_CUT) if text[at : at + 1] == "{" else None
    if got is None or text[got[1] :].strip(_WS):
        return json.loads(text)
    return got[0]


def loads_index(text: str) -> Any:
    """``json.loads(text)`` of a checkpoint index: a large ``weight_map`` in pieces (89,820 entries,
    8.7 MB: one ``json.loads`` held the GIL 48 ms, and so the event loop, from its thread). The
    rest of the text is parsed with the map's object replaced by a string no index holds, which
    must come back as the top level's one ``weight_map``: anything else is parsed whole."""
    if len(text) <= 2 * _JSON_PIECE:
        return json.loads(text)
    m = _WEIGHT_MAP.search(text)
    got = _object_in_pieces(text, m.end() - 1, _INDEX_CUT) if m is not None else None
    if got is not None and m is not None:
        weight_map, end = got
        rest = text[: m.end() - 1] + json.dumps(_SPLICED) + text[end:]
        if rest.count('"weight_map"') == 1:
            try:
                obj = json.loads(rest)
            except ValueError:
                obj = None
            if type(obj) is dict and obj.get("weight_map") == _SPLICED:
                obj["weight_map"] = weight_map  # the same key, so the same place in the order
                return obj
    return json.loads(text)


_WS = " \t\n\r"  # JSON's whitespace
_DECODE = json.JSONDecoder().raw_decode
#: Where a large object may be cut: the comma (group 1) between two members, after a member whose
#: value is an object (a header, as safetensors writes it) or a string (an index's weight_map).
_HEADER_CUT = re.compile(r'\}(,)"')
_INDEX_CUT = re.compile(r'"(,)[ \t\n\r]*"')
_WEIGHT_MAP = re.compile(r'"weight_map"[ \t\n\r]*:[ \t\n\r]*\{')
_SPLICED = "\x00aload: the weight_map"


def _object_in_pieces(text: str, at: int, cut: re.Pattern[str]) -> tuple[dict[str, Any], int] | None:
    """The JSON object that starts at ``text[at]`` and the index just past it, decoded a piece of
    ~``_JSON_PIECE`` characters at a time, cut between members; None if a piece does not parse.

    Each piece is parsed as an object of its own; when every piece is a non-empty object, the
    whole is one object with the pieces' members in order (JSON's grammar: ``{A,B}`` is an object
    when ``{A}`` and ``{B}`` are), so the result is exactly the whole parse. A cut that falls
    inside a string or a nested value, or past the object's end, leaves a piece that does not
    parse. The last piece is decoded up to the object's end, wherever that is."""
    out: dict[str, Any] = {}
    pace = Pacer()
    begin = at  # where the next piece's members start: the object's "{", then after a cut's comma
    while True:
        m = cut.search(text, begin + _JSON_PIECE)
        if m is None or m.start() > len(text) - _JSON_PIECE // 2:
            break
        comma = m.start(1)
        piece = text[begin:comma] + "}" if begin == at else "{" + text[begin:comma] + "}"
        try:
            part = json.loads(piece)
        except ValueError:
            return None
        if type(part) is not dict or not part:
            return None
        out.update(part)
        begin = comma + 1
        gc_paused.collect_young()  # the piece's containers, while they are few
        pace()  # let a thread waiting for the GIL (the event loop) have it: see ``paced``
    try:
        if begin == at:
            part, end = _DECODE(text, at)
        else:
            part, end = _DECODE("{" + text[begin:])
            end += begin - 1
    except ValueError:
        return None
    if type(part) is not dict or (begin != at and not part):
        return None
    out.update(part)
    return out, end


def _may_hide_duplicates(raw: bytes, obj: Any) -> bool:
    """True unless the plain parse provably saw every key: each entry has exactly one "dtype",
    "shape" and "data_offsets", so with no escapes in the text, equal counts of those quoted
    keys and of entries mean no key was given twice. Anything else takes the exact path."""
    if not isinstance(obj, dict) or _count(raw, b"\\"):
        return True
    n = len(obj) - ("__metadata__" in obj)
    return any(_count(raw, key) != n for key in (b'"dtype"', b'"shape"', b'"data_offsets"')) or (
        "__metadata__" in obj and _count(raw, b'"__metadata__"') != 1
    )


#: ``bytes.count`` holds the GIL: over a 1.9 MB header, the four scans above held it 4-7 ms
#: together (the event loop as late), so they go ~256 KiB at a time with pauses between.
_SCAN_PIECE = 256 << 10


def _count(raw: bytes, key: bytes) -> int:
    """``raw.count(key)``, a piece at a time (a match across two pieces is counted once, in the
    piece where it starts)."""
    if len(raw) <= _SCAN_PIECE:
        return raw.count(key)
    pace, n, over = Pacer(), 0, len(key) - 1
    for at in range(0, len(raw), _SCAN_PIECE):
        n += raw.count(key, at, at + _SCAN_PIECE + over)
        pace()
    return n


def _metadata(value: Any, url: str) -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        raise HeaderError("__metadata__ must be an object of strings to strings", url=url)
    return dict(value)


def _spec(name: str, entry: Any, url: str, data_start: int) -> TensorSpec:
    # Written for speed as well as strictness: a header can hold tens of thousands of entries.
    # `type(x) is int` refuses bools and floats alike.
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
    spec: TensorSpec = _new_tuple(TensorSpec, (name, dtype, tuple(shape), url, data_start + begin, data_start + end))
    untrack(spec)
    return spec


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
