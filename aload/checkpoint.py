"""A checkpoint: its shards, their validated headers, and a spec per tensor; nothing but
headers (and the index) is read here.

Layouts: one ``.safetensors`` file; a folder with ``model.safetensors.index.json`` (only the
files its ``weight_map`` names); a folder of ``*.safetensors`` without an index.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import operator
import os
import posixpath
from collections.abc import Awaitable, Callable, Generator, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, NoReturn, TypeVar

from ._json import loads_index
from ._threads import Pacer, hand_back, paced
from .errors import CheckpointError
from .format import TensorSpec, header_length, parse_header
from .sources import Source, Store, import_store, open_store

T = TypeVar("T")

INDEX_NAME = "model.safetensors.index.json"
MAX_INDEX_BYTES = 64 * 1024 * 1024
#: First request for a header; grown once when the header is larger.
HEADER_PROBE_BYTES = 64 * 1024
#: Headers larger than this are parsed off the event loop: ~1.4 ms per 64 KB (552 tensors) here,
#: and on the loop a parse holds it for all of that (DeepSeek-V3's 163 shards, p99 4.6-7.8 ms).
_INLINE_PARSE_BYTES = 16 << 10
#: Reads in flight: one per core, at least 2, at most 8. Measured on 2 cores (docs/benchmarks.md):
#: 2 reads gave the best cold throughput and kept loop lateness p99 under 3 ms; 4 gained ~5% warm
#: and doubled the lateness.
DEFAULT_CONCURRENCY = min(8, max(2, os.cpu_count() or 2))


@dataclass(frozen=True)
class Shard:
    """One safetensors file of a checkpoint."""

    name: str
    url: str
    size: int
    metadata: dict[str, str]
    specs: tuple[TensorSpec, ...]
    #: The file's first bytes: length prefix and header (what a digest of the file starts with).
    head: bytes = field(default=b"", repr=False, compare=False)


@dataclass
class Checkpoint:
    """Shards, per-tensor specs (shard order, then offset order), metadata and total bytes.

    An async context manager: closing it closes every file and connection it opened.
    """

    url: str
    shards: tuple[Shard, ...]
    specs: dict[str, TensorSpec]
    metadata: dict[str, Any]
    store: Store = field(repr=False)

    @property
    def total_bytes(self) -> int:
        return sum(s.nbytes for s in self.specs.values())

    def __post_init__(self) -> None:
        self._names = {s.url: s.name for s in self.shards}

    def source(self, spec: TensorSpec) -> Source:
        """The Source holding ``spec``'s bytes (one per shard, kept open)."""
        return self.store.source(self._names[spec.shard])

    async def aclose(self) -> None:
        await self.store.aclose()

    async def __aenter__(self) -> Checkpoint:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


class _Opening:
    """``await aload.open(url)`` or ``async with aload.open(url) as ckpt``."""

    def __init__(self, coro: Awaitable[Checkpoint]) -> None:
        self._coro = coro
        self._ckpt: Checkpoint | None = None

    def __await__(self) -> Generator[Any, None, Checkpoint]:
        return self._coro.__await__()

    async def __aenter__(self) -> Checkpoint:
        self._ckpt = await self._coro
        return self._ckpt

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        assert self._ckpt is not None
        await self._ckpt.aclose()


def open(url: str, *, concurrency: int = DEFAULT_CONCURRENCY, **options: Any) -> _Opening:
    """Open the checkpoint at ``url`` (a path, ``file://``, or a registered scheme), reading only
    its index and headers. ``concurrency`` sizes the pool of parallel reads."""
    return _Opening(_open(str(url), concurrency=concurrency, **options))


async def _open(url: str, *, concurrency: int, ahead: ReadAhead | None = None, **options: Any) -> Checkpoint:
    """``ahead``: told of each shard as soon as its header is parsed."""
    await import_store(url)
    store = open_store(url, concurrency=concurrency, **options)
    try:
        await store.prepare()
        return await _read_layout(store, ahead)
    except BaseException:
        if ahead is not None:
            await ahead.aclose()  # before the store's threads go
        await store.aclose()
        raise


class ReadAhead:
    """Asks for the bytes of small tensors while the rest is still being opened and planned: each
    shard's runs of them (``small_runs``) are asked of its source (``Source.read_ahead``) as soon
    as its header is parsed, up to ``allowance`` bytes of shards in all. Only for a load that
    reads every tensor (no stage drops names: dropped bytes are never read); large tensors are
    left alone (a cold load reads them past the page cache). Cold, 64 shards of 32 KiB tensors:
    the disk sat idle while 64 headers were parsed and 19,200 tensors planned, a third of the load."""

    def __init__(self, allowance: int, below: int) -> None:
        self._left = allowance
        self._below = below
        self._todo: collections.deque[tuple[Source, Callable[[], list[tuple[int, int]]]]] = collections.deque()
        self._task: asyncio.Task[None] | None = None

    def shard(self, src: Source, shard: Shard) -> None:
        if self._left <= 0 or shard.size - len(shard.head) < _LEAST_RUN_BYTES:
            return  # nothing left to ask for, or a shard too small to hold a run worth it
        limit = min(shard.size, self._left)  # the whole shard counted: its runs are not known yet
        self._left -= limit
        self._todo.append((src, functools.partial(small_runs, shard.specs, self._below, limit)))
        if self._task is None or self._task.done():
            self._task = asyncio.ensure_future(self._ask())

    async def _ask(self) -> None:
        # One shard at a time, in order, so that the disk brings them in in the order they are
        # read: all at once (16 threads) doubled the time to the first tensor, 64 shards cold.
        while self._todo:
            src, ranges = self._todo.popleft()
            await src.read_ahead(ranges)

    async def aclose(self) -> None:
        """Stop asking: what is still to be asked for is not (a hint, nothing waits for it)."""
        self._todo.clear()
        if self._task is not None:
            self._task.cancel()
            await asyncio.wait([self._task])


#: The least run of small tensors worth asking for ahead: runs of a norm or two between a
#: Llama's large matrices are not, nor DeepSeek-V3's shards of ~140 KB of tiny tensors (asked
#: for ahead or not, its cold load took 1,211 and 1,215 ms).
_LEAST_RUN_BYTES = 1 << 20


def small_runs(specs: Sequence[TensorSpec], below: int, limit: int) -> list[tuple[int, int]]:
    """The byte ranges ``(start, end)`` of the runs of adjacent tensors each under ``below`` bytes,
    of ``_LEAST_RUN_BYTES`` or more, in file order, up to ``limit`` bytes in all (``specs`` in
    offset order). A step per tensor, on a thread (20,000 tensors: ~4 ms)."""
    runs: list[tuple[int, int]] = []
    first = last = -1

    def close() -> None:
        nonlocal limit
        if last - first >= _LEAST_RUN_BYTES and limit > 0:
            runs.append((first, min(last, first + limit)))
            limit -= last - first

    for spec in paced(specs):
        if spec.end - spec.start < below:
            if first < 0:
                first = spec.start
            last = spec.end
        elif first >= 0:
            close()
            first = -1
    if first >= 0:
        close()
    return runs


async def _read_layout(store: Store, ahead: ReadAhead | None = None) -> Checkpoint:
    if await store.kind() == "file":
        shards = [await _read_shard(store, "", ahead)]
        return await _assemble_off_loop(store, shards, shards[0].metadata, None)
    raw = await store.get(INDEX_NAME, MAX_INDEX_BYTES)
    if raw is not None:
        index_url = posixpath.join(store.url, INDEX_NAME)
        # A large index on a thread: 19,200 entries took 16 ms on the loop.
        weight_map, metadata, names = await run_off_loop(
            store, len(raw) > _INLINE_PARSE_BYTES, _parse_index, raw, index_url
        )
    else:
        weight_map, metadata = None, {}
        names = await store.list(".safetensors")
        if not names:
            raise CheckpointError("no .safetensors files and no index", url=store.url)
    shards = await _read_shards(store, names, ahead)
    if weight_map is None and len(shards) == 1:
        metadata = dict(shards[0].metadata)
    return await _assemble_off_loop(store, shards, metadata, weight_map)


#: Checkpoints with more tensors than this are assembled on a thread (19,200 tensors in 64 shards:
#: 5-7 ms on the loop).
_INLINE_ASSEMBLE_TENSORS = 2000


async def _assemble_off_loop(
    store: Store, shards: list[Shard], metadata: dict[str, Any], index: dict[str, str] | None
) -> Checkpoint:
    large = sum(len(s.specs) for s in shards) >= _INLINE_ASSEMBLE_TENSORS
    return await run_off_loop(store, large, _assemble, store, shards, metadata, index)


async def run_off_loop(store: Store, large: bool, fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)``: on one of ``store``'s threads when the work is ``large`` (pure Python that
    would hold the event loop for milliseconds), else right here (a thread hop costs more)."""
    return await store.run(fn, *args) if large else fn(*args)


async def _read_shards(store: Store, names: list[str], ahead: ReadAhead | None = None) -> list[Shard]:
    """Every shard's header: all read first (16 at a time), then each parsed in turn, the loop
    free between two. Parsing each as its read came back, on the loop while the read threads
    came and went for the GIL, left the loop 5-14 ms late again and again: 89,820 tensors in
    163 shards, warm, p99 8.5 -> 4.3 ms; 64 shards, 5.6 -> 3.4 ms; throughput the same. All of
    them in one call on a thread was worse again (p99 8.5-11 ms): with the loop and another
    thread running Python (the model's walk) on 2 cores, the pauses of ``paced`` came and went
    before the loop was back on a core; a return to the loop after each header cannot be missed."""
    gate = asyncio.Semaphore(16)

    async def head(name: str) -> tuple[Source, int, bytes]:
        async with gate:
            return await _read_head(store, name)

    heads = await asyncio.gather(*(head(n) for n in names))
    shards = []
    for name, (src, size, raw) in zip(names, heads, strict=True):
        shards.append(await _parse_shard(store, name, src, size, raw))
        if ahead is not None:
            ahead.shard(src, shards[-1])
        await hand_back()
    return shards


async def _read_head(store: Store, name: str) -> tuple[Source, int, bytes]:
    """The shard's source, its size and its header's JSON bytes (checked against the size)."""
    src = store.source(name)
    size, head = await src.head(HEADER_PROBE_BYTES)
    n = header_length(head, size, src.url)
    raw = head[8 : 8 + n]
    if len(raw) < n:
        raw += await src.read(len(head), 8 + n - len(head))
    return src, size, raw


async def _parse_shard(store: Store, name: str, src: Source, size: int, raw: bytes) -> Shard:
    """A large header is parsed on one of the store's threads, a small one right here."""
    n = len(raw)
    header = await run_off_loop(store, n > _INLINE_PARSE_BYTES, parse_header, raw, size, src.url)
    return Shard(name, src.url, size, header.metadata, header.specs, n.to_bytes(8, "little") + raw)


async def _read_shard(store: Store, name: str, ahead: ReadAhead | None = None) -> Shard:
    src, size, raw = await _read_head(store, name)
    shard = await _parse_shard(store, name, src, size, raw)
    if ahead is not None:
        ahead.shard(src, shard)
    return shard


def _parse_index(raw: bytes, url: str) -> tuple[dict[str, str], dict[str, Any], list[str]]:
    """The index's weight map, its metadata, and the files it names, sorted. The names come from
    the walk over the map made here (on a thread for a large index): ``set(weight_map.values())``
    on the loop held it 3.2-4.1 ms on DeepSeek-V3's 89,820 entries."""
    try:
        obj = loads_index(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise CheckpointError(f"index is not valid UTF-8 JSON: {exc}", url=url) from exc
    weight_map = obj.get("weight_map") if isinstance(obj, dict) else None
    if not isinstance(weight_map, dict):
        raise CheckpointError("index needs a weight_map of tensor names to file names", url=url)
    first: dict[str, str] = {}  # each file named once, with the first tensor placed in it
    for tensor, fname in paced(weight_map.items()):  # on a thread for a large index
        if type(fname) is not str:
            raise CheckpointError("index needs a weight_map of tensor names to file names", url=url, tensor=tensor)
        first.setdefault(fname, tensor)
    for fname, tensor in first.items():  # a few hundred files at most, for ~100,000 entries
        _check_relative(fname, url, tensor)
    metadata = obj.get("metadata") or {}
    if not isinstance(metadata, dict):
        raise CheckpointError("index metadata must be an object", url=url)
    return weight_map, metadata, sorted(first)


def _check_relative(fname: str, url: str, tensor: str) -> None:
    """A shard name must be a plain relative path that stays inside the checkpoint folder."""
    norm = posixpath.normpath(fname.replace("\\", "/"))
    if (
        not fname
        or "://" in fname
        or norm.startswith("/")
        or norm == ".."
        or norm.startswith("../")
        or (len(fname) > 1 and fname[1] == ":")
        or "\x00" in fname
    ):
        raise CheckpointError(f"index names a file outside the checkpoint: {fname!r}", url=url, tensor=tensor)


def _assemble(store: Store, shards: list[Shard], metadata: dict[str, Any], index: dict[str, str] | None) -> Checkpoint:
    specs: dict[str, TensorSpec] = {}
    pace = Pacer()  # on a thread for a large checkpoint: see ``_assemble_off_loop``
    for shard in shards:
        # A piece of a shard at a time in C (map, isdisjoint, count, update): a loop per tensor
        # took 58-63 ms on 89,820 tensors, and a shard of 20,000 in one piece held the GIL 7 ms;
        # the slow search below runs only to name what is wrong.
        for at in range(0, len(shard.specs), _ASSEMBLE_PIECE):
            piece = shard.specs[at : at + _ASSEMBLE_PIECE]
            names = list(map(_NAME, piece))
            clash = not specs.keys().isdisjoint(names)
            if clash or (index is not None and list(map(index.get, names)).count(shard.name) != len(names)):
                _refuse(store, shard, piece, specs, index)
            specs.update(zip(names, piece, strict=True))
            pace()
    # Every tensor found is in the index (checked above), so the index names one no shard holds
    # exactly when it is longer.
    if index is not None and len(index) != len(specs):
        tensor = next(t for t in index if t not in specs)
        raise CheckpointError(
            f"the index places it in {index[tensor]!r}, which does not hold it", url=store.url, tensor=tensor
        )
    return Checkpoint(store.url, tuple(shards), specs, metadata, store)


_NAME = operator.itemgetter(0)  # a TensorSpec's name
#: Tensors of a shard added to a checkpoint at once (``_assemble``): ~0.5-1 ms here.
_ASSEMBLE_PIECE = 2048


def _refuse(
    store: Store,
    shard: Shard,
    piece: tuple[TensorSpec, ...],
    specs: dict[str, TensorSpec],
    index: dict[str, str] | None,
) -> NoReturn:
    """Raise for the first tensor of ``piece`` (of ``shard``) that another shard holds or the index
    puts elsewhere."""
    for spec in piece:
        if spec.name in specs:
            raise CheckpointError(
                f"tensor is in two shards: {specs[spec.name].shard} and {shard.url}", url=store.url, tensor=spec.name
            )
        if index is not None and index.get(spec.name) != shard.name:
            placed = index.get(spec.name)
            why = f"the index places it in {placed!r}" if placed else "the index does not list it"
            raise CheckpointError(f"tensor found in {shard.name!r} but {why}", url=store.url, tensor=spec.name)
    raise AssertionError("a clash was found but not named")  # pragma: no cover
