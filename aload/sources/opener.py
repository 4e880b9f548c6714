"""Opening a checkpoint: its layout, index and headers, read through a store; no tensor bytes."""

from __future__ import annotations

import asyncio
import posixpath
from collections.abc import Awaitable, Generator
from types import TracebackType
from typing import Any

from ..errors import CheckpointError
from ..format import (
    INDEX_NAME,
    MAX_INDEX_BYTES,
    Checkpoint,
    Shard,
    assemble,
    header_length,
    parse_header,
    parse_index,
)
from .base import Source, Store
from .registry import open_store

#: The first read of a file: its length prefix and, usually, all of its header.
HEADER_PROBE_BYTES = 64 * 1024
#: Headers and indexes larger than this are parsed on a thread, not on the event loop.
INLINE_PARSE_BYTES = 64 * 1024


class Opening:
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


async def open_checkpoint(url: str, *, concurrency: int, **options: Any) -> Checkpoint:
    store = open_store(url, concurrency=concurrency, **options)
    try:
        return await _layout(store)
    except BaseException:
        await store.aclose()
        raise


async def _layout(store: Store) -> Checkpoint:
    if await store.run(store.kind) == "file":
        shard = await _shard(store, "")
        return assemble(store, [shard], dict(shard.metadata), None)
    raw = await store.run(store.get, INDEX_NAME, MAX_INDEX_BYTES)
    weight_map: dict[str, str] | None = None
    metadata: dict[str, Any] = {}
    if raw is not None:
        index_url = posixpath.join(store.url, INDEX_NAME)
        weight_map, metadata, names = await _parse(store, len(raw), parse_index, raw, index_url)
    else:
        names = await store.run(store.list, ".safetensors")
        if not names:
            raise CheckpointError("no .safetensors files and no index", url=store.url)
    gate = asyncio.Semaphore(16)

    async def one(name: str) -> Shard:
        async with gate:
            return await _shard(store, name)

    shards = list(await asyncio.gather(*(one(n) for n in names)))
    if weight_map is None and len(shards) == 1:
        metadata = dict(shards[0].metadata)
    ckpt: Checkpoint = await _parse(
        store, sum(len(s.specs) for s in shards) * 64, assemble, store, shards, metadata, weight_map
    )
    return ckpt


async def _parse(store: Store, size: int, fn: Any, *args: Any) -> Any:
    """``fn(*args)``: a large parse on a thread, a small one here (a thread hop costs more)."""
    return await store.run(fn, *args) if size > INLINE_PARSE_BYTES else fn(*args)


async def _shard(store: Store, name: str) -> Shard:
    src = store.source(name)
    size, raw = await store.run(_read_head, src)
    specs, metadata = await _parse(store, len(raw), parse_header, raw, size, src.url)
    return Shard(name, src.url, size, metadata, tuple(specs), len(raw).to_bytes(8, "little") + raw)


def _read_head(src: Source) -> tuple[int, bytes]:
    """The file's size and its header's JSON bytes (the length checked before they are read)."""
    size = src.size()
    head = src.read(0, min(size, HEADER_PROBE_BYTES))
    n = header_length(head, size, src.url)
    raw = head[8 : 8 + n]
    if len(raw) < n:
        raw += src.read(len(head), 8 + n - len(head))
    return size, raw
