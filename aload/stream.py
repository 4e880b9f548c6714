"""``aload.stream``: checkpoint -> plan -> reader -> stages, as one async iterator."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator, Callable, Iterable
from types import TracebackType
from typing import Any

import numpy as np

from .errors import UsageError
from .format import Checkpoint
from .read import (
    DEFAULT_CONCURRENCY,
    DEFAULT_GROUP_TIMEOUT_S,
    DEFAULT_MAX_INFLIGHT_BYTES,
    DestFn,
    Manifest,
    Plan,
    Progress,
    Reader,
    ReaderStats,
    ShardHash,
    Share,
    Staging,
    Unit,
    check_positive,
    digests_for,
    make_plan,
)
from .sources import open_checkpoint
from .stages import Pair, Stage, split_for_plan

#: Checkpoints with more tensors than this are planned on a thread, not on the event loop.
_PLAN_INLINE_TENSORS = 2000


class TensorStream:
    """An async iterator of ``(name, tensor)`` in shard order, then offset order.

    Use it as ``async with aload.stream(...) as s: async for name, t in s: ...`` so that an early
    exit closes every read and file at once; a stream run to its end closes itself.
    """

    def __init__(
        self,
        source: str | os.PathLike[str] | Checkpoint,
        *,
        stages: Iterable[Stage] | Stage = (),
        max_inflight_bytes: int = DEFAULT_MAX_INFLIGHT_BYTES,
        concurrency: int = DEFAULT_CONCURRENCY,
        chunk_bytes: int | None = None,
        progress: Callable[[Progress], None] | None = None,
        verify: Manifest | None = None,
        options: dict[str, Any] | None = None,
        destinations: Callable[[Checkpoint], Any] | None = None,
        t0: float | None = None,
        group: Any = None,
        share: str = "broadcast",
        group_timeout: float = DEFAULT_GROUP_TIMEOUT_S,
        staging: tuple[Any, int] | None = None,
    ) -> None:
        check_positive(max_inflight_bytes=max_inflight_bytes, concurrency=concurrency)
        if chunk_bytes is not None:
            check_positive(chunk_bytes=chunk_bytes)
        self._source = source
        self._t0 = time.perf_counter() if t0 is None else t0
        self._names, self._slices, self._stages = split_for_plan(stages)
        # A process group's agreement (``read/share.py``); checked before anything is opened.
        self._share = Share(group, share, group_timeout) if group is not None and group is not False else None
        self._staging_for = staging  # (device, pinned_bytes): reads into the destinations go through a pool
        self._budget, self._concurrency, self._chunk = max_inflight_bytes, concurrency, chunk_bytes
        self._progress = progress
        self._verify = verify
        self._options = options or {}
        # Reading straight into a destination skips tensor stages, so only without them.
        self._destinations = destinations if not self._stages else None
        self.checkpoint: Checkpoint | None = source if isinstance(source, Checkpoint) else None
        self._owns = self.checkpoint is None
        self.reader: Reader | None = None
        self._chain: list[AsyncIterator[Any]] = []
        self._closed = False

    @property
    def stats(self) -> ReaderStats:
        return self.reader.stats if self.reader is not None else ReaderStats()

    @property
    def cuts_later(self) -> bool:
        """Whether ``units`` can stand in for the pairs: no tensor stage needs to see them."""
        return not self._stages

    async def start(self) -> None:
        if self.reader is not None:
            return
        if self.checkpoint is None:
            self.checkpoint = await open_checkpoint(
                os.fspath(self._source),  # type: ignore[arg-type]
                concurrency=self._concurrency,
                **self._options,
            )
        ckpt = self.checkpoint
        opened = time.perf_counter()
        hashes = None
        if self._verify is not None:
            digests = await digests_for(self._verify, ckpt)
            hashes = {s.url: ShardHash(s, digests[s.url]) for s in ckpt.shards}
        dest: DestFn | None = None
        if self._destinations is not None and hashes is None:
            dest = await self._destinations(ckpt)
        store = ckpt.store
        if self._chunk is None:
            self._chunk = store.chunk_bytes
        sources = {s.url: store.source(s.name) for s in ckpt.shards}
        # Units of small tensors stay well under the budget, so that several are in flight at once.
        args = (
            ckpt, sources, self._names, dest, self._chunk, hashes is not None, max(1, self._budget // 4), self._slices
        )  # fmt: skip
        if len(ckpt.specs) > _PLAN_INLINE_TENSORS:
            plan = await store.run(make_plan, *args)
        else:
            plan = make_plan(*args)
        if self._share is not None:
            self._share.bind(plan)
            self._share.piece_bytes = self._chunk
            if self._share.mode == "prefetch":
                await self._prefetch(plan)
        self.reader = Reader(
            plan,
            store.run,
            max_inflight_bytes=self._budget,
            concurrency=self._concurrency,
            chunk_bytes=self._chunk,
            progress=self._progress,
            t0=self._t0,
            hashes=hashes,
            share=self._share,
            staging=(
                Staging(self._staging_for[0], store.run, slab_bytes=self._chunk, pinned_bytes=self._staging_for[1])
                if self._staging_for is not None and dest is not None
                else None
            ),
        )
        self.reader.stats.opened_s, self.reader.stats.planned_s = opened - self._t0, time.perf_counter() - self._t0
        it: AsyncIterator[Pair] = self.reader.items()
        self._chain = [it]
        for stage in self._stages:
            it = stage(it)
            self._chain.append(it)

    async def _prefetch(self, plan: Plan) -> None:
        """``share="prefetch"``: this rank's part of a local checkpoint read into the page cache,
        then every rank waits for the others (a rank that failed ends them all)."""
        assert self._share is not None and self.checkpoint is not None
        store = self.checkpoint.store
        warm = getattr(store, "warm", None)
        if warm is None:
            raise UsageError("share='prefetch' warms a local checkpoint's page cache; use 'broadcast' for a remote one")
        gate = asyncio.Semaphore(self._concurrency)

        async def one(unit: Unit) -> None:
            async with gate:
                await store.run(warm, unit.source, unit.start, unit.nbytes)

        await asyncio.gather(*(one(u) for u in self._share.owned(plan)))  # a failure: ``aclose`` tells the others
        await self._share.barrier()

    async def units(self) -> AsyncIterator[tuple[Unit, np.ndarray[Any, Any] | None]]:
        """Whole units in plan order, for a consumer that cuts the tensors itself on its own
        thread (``read.cut``); only where ``cuts_later``, instead of the pairs."""
        assert self.cuts_later
        await self.start()
        assert self.reader is not None
        units = self.reader.units()
        self._chain = [units]
        async for unit, buf in units:
            self.reader.account(unit)
            yield unit, buf
            del buf

    def __aiter__(self) -> TensorStream:
        return self

    async def __anext__(self) -> Pair:
        if self._closed:
            raise StopAsyncIteration
        try:
            await self.start()
            pair: Pair = await self._chain[-1].__anext__()
            return pair
        except BaseException as exc:
            await self.aclose(None if isinstance(exc, StopAsyncIteration) else exc)
            raise

    async def aclose(self, error: BaseException | None = None) -> None:
        """Stop every read, close the stages, and close the checkpoint if this stream opened it.
        In a process group, ``error`` is what the other ranks are told this rank stopped for."""
        if self._closed:
            return
        self._closed = True
        try:
            for it in reversed(self._chain):
                aclose = getattr(it, "aclose", None)
                if aclose is not None:
                    await aclose()
            if self.reader is not None:
                await self.reader.aclose(error)
            elif self._share is not None:
                await self._share.farewell(error)
                await self._share.aclose()
        finally:
            if self._owns and self.checkpoint is not None:
                await self.checkpoint.aclose()

    async def __aenter__(self) -> TensorStream:
        try:
            await self.start()
        except BaseException as exc:
            await self.aclose(exc)
            raise
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose(e)


def stream(
    source: str | os.PathLike[str] | Checkpoint,
    *,
    stages: Iterable[Stage] | Stage = (),
    max_inflight_bytes: int = DEFAULT_MAX_INFLIGHT_BYTES,
    concurrency: int = DEFAULT_CONCURRENCY,
    chunk_bytes: int | None = None,
    progress: Callable[[Progress], None] | None = None,
    verify: Manifest | None = None,
    group: Any = None,
    share: str = "broadcast",
    group_timeout: float = DEFAULT_GROUP_TIMEOUT_S,
    **options: Any,
) -> TensorStream:
    """Stream ``(name, tensor)`` pairs from a path, URL or open ``Checkpoint``.

    ``group`` (a ``torch.distributed`` process group with a gloo backend, or True for the
    default group) makes the ranks share the work: every rank gets the same pairs, in the same
    order, and with ``share="broadcast"`` each byte is read by one rank and broadcast to the
    others; ``share="prefetch"`` splits a page-cache warm-up of a local checkpoint instead,
    ``share="none"`` shares nothing. A rank that fails ends every rank with a ``GroupError``;
    ``group_timeout`` (seconds) bounds each wait for the others. See docs/distributed.md.

    ``max_inflight_bytes`` (default 512 MiB) bounds the bytes read and not yet released by the
    consumer; ``concurrency`` (default: one per core, 4 to 16) bounds the reads in flight;
    ``chunk_bytes`` is the largest single read (default: 64 MiB from local files, 16 MiB from
    remote ones; units of coalesced small tensors are at most this large). ``verify`` (a mapping of shard
    name to SHA-256, or a manifest file) checks every shard's digest from the bytes as they
    stream; every byte is then read, and a mismatch raises ``CheckpointError`` before the
    shard's last tensor is delivered. Other keyword options go to the source (local files:
    ``read``; remote: ``config``, ``client_options``, ``retry_config``).
    """
    return TensorStream(
        source,
        stages=stages,
        max_inflight_bytes=max_inflight_bytes,
        concurrency=concurrency,
        chunk_bytes=chunk_bytes,
        progress=progress,
        verify=verify,
        options=options,
        group=group,
        share=share,
        group_timeout=group_timeout,
    )
