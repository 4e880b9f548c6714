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
    with pytest.raises(aload.HeaderError, match="only"):
        await aload.open(path)


TRICKY = {
    "plain": {"a": {"x": 1}, "b": {"y": [1, 2]}},
    "nested": {"a": {"x": {"q": 1}, "y": 2}, "b": 3, "c": {"d": {"e": {}}}},
    "cut marks in names": {'a},"b': {"x": '},"'}, '"},"': {"y": "}"}, "c": {"z": '{"k":1},"'}},
    "unicode": {"ünï": {"名前": '},"x'}, "b": {"c": 1}},
}


@pytest.mark.parametrize("piece", [1, 2, 3, 5, 8, 13, 64])
def test_a_large_header_decoded_in_pieces_is_exactly_the_whole_decode(
    monkeypatch: pytest.MonkeyPatch, piece: int
) -> None:
    """Cut anywhere, between entries or inside names and nested values, the pieces give the
    whole parse (same members, same order) or the text is parsed whole; invalid text fails
    as it would whole."""
    from aload import _json as js

    monkeypatch.setattr(js, "_JSON_PIECE", piece)
    texts = [json.dumps(obj, separators=(",", ":"), ensure_ascii=False) for obj in TRICKY.values()]
    texts += [json.dumps(obj) for obj in TRICKY.values()]  # spaces after commas: never cut
    bad = [t[:-1] for t in texts] + [t + "x" for t in texts] + [t.replace('},"', '}},"', 1) for t in texts]
    bad += ['{"a":{"x":1},"b":2}}', '{"a":{}},"b":{}}', '{,"a":{},"b":{}}', '{"a":{},"b":{},}', '{"a":{},,"b":{}}']
    for text in texts + bad:
        want, got = _both_ways(js._loads_in_pieces, text)
        if isinstance(want, dict):
            assert list(got) == list(want), text


def _both_ways(loads: Callable[[str], Any], text: str) -> tuple[Any, Any]:
    """``json.loads(text)`` and ``loads(text)`` (ValueError for a failure), checked equal."""
    try:
        want: Any = json.loads(text)
    except ValueError:
        want = ValueError
    try:
        got: Any = loads(text)
    except ValueError:
        got = ValueError
    assert got == want, text
    return want, got


def _loads_sizes(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The length of every text ``aload._json`` hands ``json.loads`` from now on."""
    from aload import _json as js

    sizes: list[int] = []
    real = json.loads

    def loads(text: str, **kw: Any) -> Any:
        sizes.append(len(text))
        return real(text, **kw)

    monkeypatch.setattr(js.json, "loads", loads)
    return sizes


WM = {f"model.layers.{i}.w": f"model-{i % 3:05d}.safetensors" for i in range(40)}
INDEXES = {
    "plain": {"metadata": {"total_size": 1}, "weight_map": WM},
    "map first": {"weight_map": WM, "metadata": {"a": {"b": [1, "}"]}}},
    "nested weight_map": {"metadata": {"weight_map": {"x": "y", "z": "w"}}, "weight_map": WM},
    "cut marks in names": {"weight_map": {'a", "b': "f", '","': '", "', "c": "d\\", 'e"': "f", **WM}},
    "weight_map as a value": {"metadata": {"k": "weight_map"}, "weight_map": WM},
    "unicode": {"weight_map": {"ünï": "名前", **WM, "x": "\\u0000"}},
    "empty map": {"weight_map": {}, "pad": "x" * 50},
}


@pytest.mark.parametrize("piece", [1, 2, 3, 5, 8, 13, 64])
@pytest.mark.parametrize("indent", [None, 2])
def test_an_index_decoded_in_pieces_is_exactly_the_whole_decode(
    monkeypatch: pytest.MonkeyPatch, piece: int, indent: int | None
) -> None:
    """A weight_map decoded in pieces, cut anywhere, gives the whole parse (same members, same
    order, the last of a name given twice) or the text is parsed whole; invalid text fails as it
    would whole."""
    from aload import _json as js

    monkeypatch.setattr(js, "_JSON_PIECE", piece)
    texts = [json.dumps(obj, indent=indent, ensure_ascii=False) for obj in INDEXES.values()]
    sep = ", " if indent is None else ",\n  "
    texts += [t.replace('"weight_map"', '"weight_map"' + " " * 3, 1) for t in texts]  # space before ":"
    texts.append(texts[0].rstrip()[:-1] + sep + '"weight_map": "later"}')  # named twice: the last counts
    texts.append(texts[0].replace('"model.layers.3.w"', '"model.layers.30.w"', 1))  # a name twice, pieces apart
    bad = [t[:-1] for t in texts] + [t + "x" for t in texts] + [t.replace(sep, sep + sep, 1) for t in texts]
    bad += [t.replace('"metadata"', '"metadata" "', 1) for t in texts]
    for text in texts + bad:
        want, got = _both_ways(js.loads_index, text)
        if isinstance(want, dict):
            assert list(got) == list(want) and list(got["weight_map"]) == list(want["weight_map"]), text
    # ... and a plain index is not parsed whole: no json.loads sees more than about two pieces
    text, want = texts[0], json.loads(texts[0])
    sizes = _loads_sizes(monkeypatch)
    assert js.loads_index(text) == want
    assert len(sizes) > 2 and max(sizes) < len(text) / 2 and max(sizes) <= 2 * piece + 200, (len(text), sizes)


ANY_JSON = [
    {"a": [1, 2.5, -3e-7, True, False, None, "x"], "b": {"c": {"d": [[], {}, [{}], {"e": []}]}}},
    [{"k": "v" * 40, "n": [i, str(i), {"i": i}]} for i in range(30)],
    {"ünï": {"名前": '\u00e9\n"q"', "esc\\": ["]", "}", ",", ":", "\\"]}, "z": 0},
    {"deep": [[[[[[{"x": [1, [2, [3, [4, {"y": "}]"}]]]]}]]]]]], "after": "ok"},
    {"big": {f"k{i}": {"v": list(range(i % 7)), "s": "s" * (i % 50)} for i in range(60)}},
    {"dup": 1, "x": {"dup": 1, "dup ": 2}, "dup ": 3},
]


@pytest.mark.parametrize("piece", [1, 4, 16, 64, 256])
@pytest.mark.parametrize("indent", [None, 0, 2])
def test_any_json_decoded_in_pieces_is_exactly_the_whole_decode(
    monkeypatch: pytest.MonkeyPatch, piece: int, indent: int | None
) -> None:
    """``loads_paced`` (botocore's files at a first S3 load): however small the pieces, the same
    values, types and order as one ``json.loads`` with the same hook, a key given twice kept
    last; invalid text fails as it would whole; no slice decoded at once is longer than a piece."""
    from collections import OrderedDict

    from aload import _json as js

    monkeypatch.setattr(js, "_JSON_PIECE", piece)
    monkeypatch.setattr(js, "_FIRST_SLICE", max(1, piece // 4))
    texts = [json.dumps(obj, indent=indent, ensure_ascii=indent == 2) for obj in ANY_JSON]
    texts += ['{"dup": 1, "a": [1, 2], "dup": {"b": 2}}', ' \n [ 1 , { "a" : [ ] } , "x" ] \n ']
    bad = [t[:-1] for t in texts] + [t + "x" for t in texts] + [t + "{}" for t in texts]
    bad += [
        '{"a": [1, 2,], "b": ' + "1" * 40 + "}",
        '[{"a": 1}, {"b": 2}' + " " * 40,
        '{"a" 1, "b": "' + "x" * 40 + '"}',
    ]
    for text in texts + bad:
        for hook in (None, OrderedDict):
            want, got = _both_ways(lambda t, hook=hook: js.loads_paced(t, object_pairs_hook=hook), text)
            if want is not ValueError:
                assert _types(got) == _types(json.loads(text, object_pairs_hook=hook)), text

    slices: list[int] = []
    walk = js._Walk(texts[4], OrderedDict)
    decode = walk.decode

    def recorded(text: str, at: int = 0) -> Any:
        if at == 0:
            slices.append(len(text))
        return decode(text, at)

    walk.decode = recorded  # type: ignore[method-assign]
    assert walk.value(0)[0] == json.loads(texts[4], object_pairs_hook=OrderedDict)
    assert slices and max(slices) <= max(piece, 2), slices


def _types(value: Any) -> Any:
    """The value with each container's type beside it, keys in order: equal only if those are."""
    if isinstance(value, dict):
        return (type(value), [(k, _types(v)) for k, v in value.items()])
    if isinstance(value, list):
        return (list, [_types(v) for v in value])
    return (type(value), value)


def test_botocores_json_files_decode_in_pieces_as_they_do_whole() -> None:
    """The files a first S3 load reads, through the session's loader (``_PacedJSONFileLoader``):
    the same data as botocore's own loader gives."""
    pytest.importorskip("aiobotocore")
    from botocore.loaders import JSONFileLoader, create_loader

    from aload import _boto

    loader = _boto._session().get_component("data_loader")
    assert type(loader.file_loader) is _boto._PacedJSONFileLoader
    plain = create_loader()
    assert type(plain.file_loader) is JSONFileLoader
    for name in ("endpoints", "partitions"):
        assert _types(loader.file_loader.load_file(plain.load_data_with_path(name)[1])) == _types(plain.load_data(name))
    paced = create_loader()  # not the session's: its cached models may have been used (and changed) by clients
    paced.file_loader = _boto._PacedJSONFileLoader()
    assert _types(paced.load_service_model("s3", "service-2")) == _types(plain.load_service_model("s3", "service-2"))


async def test_a_large_header_is_decoded_a_piece_at_a_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, write: Callable[..., Path]
) -> None:
    """No single ``json.loads`` of a 3,000-tensor header takes more than ~2 pieces of it (one
    call holds the GIL, and so the event loop, for its whole length); a key named twice in
    different pieces is still refused (its keys counted a piece at a time too)."""
    from aload import _json as js

    monkeypatch.setattr(js, "_SCAN_PIECE", 4096)
    tensors = {f"layers.{i}.weight": torch.full((2,), float(i)) for i in range(3000)}
    path = write(tensors)
    sizes = _loads_sizes(monkeypatch)
    got = await collect(aload.stream(path))
    assert len(got) == 3000 and got["layers.2999.weight"].tolist() == [2999.0, 2999.0]
    header_len = struct.unpack("<Q", path.read_bytes()[:8])[0]
    assert header_len > 3 * js._JSON_PIECE  # the case under test: several pieces
    assert len(sizes) > 2 and max(sizes) <= 2 * js._JSON_PIECE + 2

    entries = {f"t{i}": entry(offsets=[8 * i, 8 * i + 8]) for i in range(3000)}
    text = json.dumps(entries, separators=(",", ":"))
    text = text[:-1] + ',"t5":' + json.dumps(entry(offsets=[24000, 24008]), separators=(",", ":")) + "}"
    dup = raw_file(tmp_path / "dup.safetensors", text.encode(), b"\0" * 24008)
    with pytest.raises(aload.HeaderError, match="twice"):
        await aload.open(dup)


def test_keys_are_counted_a_piece_at_a_time_wherever_the_pieces_cut(monkeypatch: pytest.MonkeyPatch) -> None:
    from aload import _json as js

    monkeypatch.setattr(js, "_SCAN_PIECE", 16)
    for at in range(48):
        raw = b"x" * at + b'"dtype"' + b"y" * (60 - at) + b'"dtype":"shape"'
        for key in (b'"dtype"', b'"shape"', b"\\", b"y"):
            assert js._count(raw, key) == raw.count(key), (at, key)


def test_paced_hands_over_the_gil_every_so_many_items(monkeypatch: pytest.MonkeyPatch) -> None:
    from aload import _threads

    slept: list[float] = []
    monkeypatch.setattr(_threads.time, "sleep", slept.append)
    monkeypatch.setattr(_threads, "PACE_S", 0.0)
    assert list(_threads.paced(range(1000), check_every=256)) == list(range(1000))
    assert slept == [0, 0, 0]


def test_a_large_header_leaves_the_collector_nothing_to_do() -> None:
    """Parsing pauses the cyclic collector and collects nothing meanwhile. The header's JSON
    containers are freed a piece at a time, never moved up the generations (where, in a fresh
    process, they set off a full collection in the middle of the load: 146-193 ms holding the
    GIL); the specs are untracked and share their shape tuples, so the youngest generation holds
    a few objects, not one per tensor, when collection resumes."""
    import gc

    from aload.format import parse_header

    n = 8192
    header = {f"t.{i}": {"dtype": "F32", "shape": [1], "data_offsets": [4 * i, 4 * i + 4]} for i in range(n)}
    raw = json.dumps(header, separators=(",", ":")).encode()  # as safetensors writes it
    collections: list[int] = []

    def watch(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            collections.append(info["generation"])

    gc.collect()
    was = gc.isenabled()
    gc.enable()
    gc.callbacks.append(watch)
    try:
        older = len(gc.get_objects(1)) + len(gc.get_objects(2))
        specs = parse_header(raw, 8 + len(raw) + 4 * n, "mem").specs
        young = len(gc.get_objects(0))
        moved_up = len(gc.get_objects(1)) + len(gc.get_objects(2)) - older
    finally:
        gc.callbacks.remove(watch)
        if not was:
            gc.disable()
    assert len(specs) == n and specs[-1].shape == (1,)
    assert len({id(spec.shape) for spec in specs}) == 1  # one tuple for the one shape
    assert collections in ([], [0]), collections  # at most the one that follows the pause
    assert young < 100 and moved_up < 100, (young, moved_up)
