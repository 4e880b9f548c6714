"""JSON of headers and indexes, decoded without holding the GIL for long.

A 20,000-tensor header is 1.9 MB of JSON and DeepSeek-V3's index 8.7 MB: one ``json.loads`` of
either held the GIL 25-48 ms, and the event loop with it, even from a thread. Here a large object
is decoded a piece at a time, cut between members, with the GIL handed over between pieces
(``_object_in_pieces``); the result is exactly the whole parse. The cyclic garbage collector is
paused meanwhile (``gc_paused``), as the decoder makes three containers per tensor.
"""

from __future__ import annotations

import gc
import json
import re
import threading
from collections.abc import Callable
from json.decoder import scanstring  # type: ignore[attr-defined]
from typing import Any

from ._threads import Pacer
from .errors import HeaderError


class _GcPause:
    """``with gc_paused:`` no cyclic garbage collection while a header is parsed. JSON makes three
    containers per tensor (60,000 for a 20,000-tensor header), all alive until the parse ends, so
    the collector ran ~150 times during one and, every load or two, a full collection of the whole
    process (130-170 ms, holding the GIL and so the event loop): a third of a whole load's time.
    Parsing makes no reference cycles, so nothing is left for later. Collection resumes when the
    last pause ends (pauses on several threads nest) if it was enabled when the first began.

    Nothing is collected during the pause either: a collection of the youngest generation after
    each piece (once done here, to spread the work) moved the live containers up, ten of those a
    collection of the middle generation, and the header's containers reached the oldest one. In a
    fresh process (the usual first load of a serving process) that set off a full collection in
    the middle of the load: 112-187 ms holding the GIL, in 7 of 7 streams of 20,000 tensors. The
    containers are freed, a piece at a time, once their specs are made (``format._specs``), so
    when collection resumes the youngest generation holds little: each spec is untracked, and
    specs of one shape share one shape tuple."""

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

    def __exit__(self, *exc: object) -> None:
        with self._lock:
            self._depth -= 1
            if self._depth == 0 and self._resume:
                gc.enable()


gc_paused = _GcPause()


def loads_header(raw: bytes, url: str) -> dict[str, Any]:
    """The header's JSON object, decoded a piece at a time when large; a key given twice, text
    that is not UTF-8 JSON, or anything but an object is a ``HeaderError``."""

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


def loads_paced(text: str, object_pairs_hook: Callable[[list[tuple[str, Any]]], Any] | None = None) -> Any:
    """``json.loads(text, object_pairs_hook=object_pairs_hook)`` of any JSON, with the GIL handed over
    between pieces: a container of more than ``_JSON_PIECE`` characters is walked a member at a time,
    smaller ones decoded whole (``_Walk``). For the JSON files botocore reads at a first S3 load
    (``_boto``): its endpoints (1.25 MB) and S3's model (1.4 MB), one ``json.loads`` each, held
    the GIL 15-27 ms from their thread, and so the event loop. The walk costs more in all: those
    two and S3's endpoint rules 69-80 ms against 25-38 whole, its longest C call 0.39-1.35 ms
    (``python benchmarks/json_pieces.py``, three runs, the fastest of five each). Text the walk
    does not take is parsed whole, for the exact result or error."""
    if len(text) <= 2 * _JSON_PIECE:
        return json.loads(text, object_pairs_hook=object_pairs_hook)
    walk = _Walk(text, object_pairs_hook)
    try:
        value, end = walk.value(_past_ws(text, 0))
        if _past_ws(text, end) == len(text):
            return value
    except (ValueError, IndexError, RecursionError):
        pass
    return json.loads(text, object_pairs_hook=object_pairs_hook)


_WS_RUN = re.compile(r"[ \t\n\r]*")


def _past_ws(text: str, i: int) -> int:
    """The index of the first character at or after ``i`` that is not JSON's whitespace."""
    m = _WS_RUN.match(text, i)
    return m.end() if m is not None else i


#: The first slice a container is tried in; then four times the last one's length (copying a
#: whole piece for each small value cost more than decoding it).
_FIRST_SLICE = 4096


class _Walk:
    """``value(i)``: the JSON value at ``text[i]`` and the index past it. An object or an array is
    first decoded from a slice of ``_JSON_PIECE`` characters: one that ends within it comes out
    whole, from the C decoder, in at most that many characters of work; a longer one fails there
    and is walked a member at a time instead (keys by the C string scanner, values by ``value``).
    The result is the whole parse's: the same decoder, the same hook, members in order."""

    __slots__ = ("decode", "hook", "pace", "size", "text")

    def __init__(self, text: str, hook: Callable[[list[tuple[str, Any]]], Any] | None) -> None:
        self.text, self.hook, self.pace, self.size = text, hook, Pacer(), min(_FIRST_SLICE, _JSON_PIECE)
        self.decode = json.JSONDecoder(object_pairs_hook=hook).raw_decode

    def value(self, i: int) -> tuple[Any, int]:
        text = self.text
        c = text[i]
        if c != "{" and c != "[":
            return self.decode(text, i)  # a string, number or literal: decoded where it lies
        size = self.size
        while True:
            try:
                got, n = self.decode(text[i : i + size])
                break
            except ValueError:  # longer than the slice (or not JSON: the walk finds where)
                if size >= _JSON_PIECE:
                    return self._object(i) if c == "{" else self._array(i)
                size = _JSON_PIECE
        self.size = min(_JSON_PIECE, max(_FIRST_SLICE, 4 * n))
        self.pace()
        return got, i + n

    def _object(self, i: int) -> tuple[Any, int]:
        text, ws = self.text, _past_ws
        pairs: list[tuple[str, Any]] = []
        i = ws(text, i + 1)
        if text[i] != "}":
            while True:
                if text[i] != '"':
                    raise ValueError(f"expected a key at {i}")
                key, i = scanstring(text, i + 1)
                i = ws(text, i)
                if text[i] != ":":
                    raise ValueError(f"expected ':' at {i}")
                v, i = self.value(ws(text, i + 1))
                pairs.append((key, v))
                i = ws(text, i)
                if text[i] != ",":
                    break
                i = ws(text, i + 1)
            if text[i] != "}":
                raise ValueError(f"expected ',' or '}}' at {i}")
        return (self.hook(pairs) if self.hook is not None else dict(pairs)), i + 1

    def _array(self, i: int) -> tuple[list[Any], int]:
        text, ws = self.text, _past_ws
        out: list[Any] = []
        i = ws(text, i + 1)
        if text[i] != "]":
            while True:
                v, i = self.value(i)
                out.append(v)
                i = ws(text, i)
                if text[i] != ",":
                    break
                i = ws(text, i + 1)
            if text[i] != "]":
                raise ValueError(f"expected ',' or ']' at {i}")
        return out, i + 1


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
