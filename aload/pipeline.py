"""``aload.stream``: checkpoint -> plan -> reader -> stages, as one async iterator."""

from __future__ import annotations

import inspect
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from types import TracebackType
from typing import Any

import torch

from .arena import UnitView
from .checkpoint import DEFAULT_CONCURRENCY, Checkpoint, ReadAhead, _open, run_off_loop
from .errors import UsageError
from .integrity import Manifest, ShardHash, digests_for
from .plan import DestFn, Unit, make_plan
from .reader import (
    DEFAULT_CHUNK_BYTES,
    DEFAULT_MAX_INFLIGHT_BYTES,
    SMALL_MEAN_BYTES,
    Progress,
    Reader,
    ReaderStats,
    _check_positive,
    all_ready,
)
from .stages import Pair, Stage, split_for_plan

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
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        progress: Callable[[Progress], None] | None = None,
        options: dict[str, Any] | None = None,
        destinations: DestFn | Awaitable[DestFn | None] | None = None,
        pin: bool = False,
        release_event: Callable[[], Any] | None = None,
        device_copy: Callable[[torch.Tensor, torch.Tensor], Any] | None = None,
        device_empty: Callable[[torch.Tensor], torch.Tensor] | None = None,
        t0: float | None = None,
        verify: Manifest | None = None,
        in_order: bool = True,
    ) -> None:
        _check_positive(max_inflight_bytes=max_inflight_bytes, concurrency=concurrency, chunk_bytes=chunk_bytes)
        self._source = source
        # Time to first tensor and progress count from here, the stream's start: the index, the
        # headers and the plan come first (~2 s of a DeepSeek-V3-sized stream, 89,820 tensors).
        self._t0 = time.perf_counter() if t0 is None else t0
        self._names, self._stages = split_for_plan(stages)
        self._reader_args: dict[str, Any] = dict(
            max_inflight_bytes=max_inflight_bytes,
            concurrency=concurrency,
            chunk_bytes=chunk_bytes,
            pin=pin,
            release_event=release_event,
            device_copy=device_copy,
            device_empty=device_empty,
            progress=progress,
            t0=self._t0,
            in_order=in_order,
        )
        self._concurrency = concurrency
        self._chunk_bytes, self._budget = chunk_bytes, max_inflight_bytes
        self._options = options or {}
        self._verify = None if verify is False else verify  # type: ignore[comparison-overlap]  # False reads as off
        # Reading straight into a destination skips tensor stages, so only without them. An
        # awaitable (the model's walk, on a thread while the checkpoint opens) is awaited before
        # the plan.
        self._dest = destinations if not self._stages else None
        self._on_device = device_copy is not None  # a GPU destination has a stream to copy on
        self.checkpoint: Checkpoint | None = source if isinstance(source, Checkpoint) else None
        self._owns = self.checkpoint is None
        self.reader: Reader | None = None
        # Every tensor is read unless a stage drops names: only then is the data asked for early.
        self._ahead = ReadAhead(max_inflight_bytes, SMALL_MEAN_BYTES) if self._names is None else None
        self._chain: list[AsyncIterator[Any]] = []
        self._closed = False

    @property
    def stats(self) -> ReaderStats:
        return self.reader.stats if self.reader is not None else ReaderStats()

    async def start(self) -> None:
        if self.reader is not None:
            return
        if self.checkpoint is None:
            self.checkpoint = await _open(
                os.fspath(self._source),  # type: ignore[arg-type]
                concurrency=self._concurrency,
                ahead=self._ahead,
                **self._options,
            )
        elif self._ahead is not None:
            for shard in self.checkpoint.shards:
                self._ahead.shard(self.checkpoint.store.source(shard.name), shard)
        opened = time.perf_counter()
        # Coalesced units stay well under the budget, so several are in flight at once.
        group = min(self._chunk_bytes, max(1, self._budget // 4))
        hashes = None
        if self._verify is not None:
            digests = await digests_for(self._verify, self.checkpoint)
            hashes = {s.url: ShardHash(s, digests[s.url]) for s in self.checkpoint.shards}
        # How a source's tensors are read (in runs, in large views) depends on its page cache. All
        # at once, not one by one as the reads reach each shard: a thread round trip per shard, in
        # turn, made a 64-shard load 7-10% slower.
        await all_ready(self.checkpoint.store.source(s.name) for s in self.checkpoint.shards)
        if inspect.isawaitable(self._dest):
            self._dest = await self._dest
        args = (
            self.checkpoint,
            self._names,
            self._dest,
            group,
            hashes is not None,
            max(1, self._budget // 4),
            self._on_device,
        )
        # Planning is pure Python, one step per tensor: for a large checkpoint on a thread, where
        # the interpreter switches away every 5 ms, not on the loop (20,000 tensors: ~40 ms).
        plan = await run_off_loop(
            self.checkpoint.store, len(self.checkpoint.specs) >= _PLAN_INLINE_TENSORS, make_plan, *args
        )
        self.reader = Reader(plan, hashes=hashes, **self._reader_args)
        self.reader.stats.opened_s, self.reader.stats.planned_s = opened - self._t0, time.perf_counter() - self._t0
        it: AsyncIterator[Pair] = self.reader.items()
        self._chain = [it]
        for stage in self._stages:
            it = stage(it)
            self._chain.append(it)

    @property
    def cuts_later(self) -> bool:
        """Whether ``units`` can stand in for the pairs: no tensor stage needs to see them."""
        return not self._stages

    async def units(self) -> AsyncIterator[tuple[Unit, UnitView | None]]:
        """Whole units in plan order, for a consumer that cuts the tensors itself on its own
        thread (``arena.run_at``) and counts them delivered here (``reader.account``). Only where
        ``cuts_later``; the stream is then iterated this way instead of by pairs."""
        if not self.cuts_later:
            raise UsageError("units() bypasses the tensor stages this stream has")
        await self.start()
        assert self.reader is not None
        units = self.reader.units()
        self._chain = [units]  # closed by aclose(), like the pairs it replaces
        try:
            async for unit, base in units:
                yield unit, base
                del base
        except BaseException:
            await self.aclose()
            raise

    def __aiter__(self) -> TensorStream:
        return self

    async def __anext__(self) -> Pair:
        if self._closed:
            raise StopAsyncIteration
        try:
            await self.start()
            pair: Pair = await self._chain[-1].__anext__()
            return pair
        except BaseException:
            await self.aclose()
            raise

    async def aclose(self) -> None:
        """Stop every read, close the stages, and close the checkpoint if this stream opened it."""
        if self._closed:
            return
        self._closed = True
        try:
            for it in reversed(self._chain):
                aclose = getattr(it, "aclose", None)
                if aclose is not None:
                    await aclose()
            if self.reader is not None:
                await self.reader.aclose()
                choice = getattr(self.checkpoint.store, "copy_choice", None) if self.checkpoint else None
                self.reader.stats.warm_copy = choice.chosen if choice is not None else None
        finally:
            if self._ahead is not None:
                await self._ahead.aclose()
            if self._owns and self.checkpoint is not None:
                await self.checkpoint.aclose()

    def leftovers(self) -> list[list[Any]]:
        """Once closed, lists holding what this stream's plan and, where it opened it, checkpoint
        hold (one entry per tensor), in the order they can be emptied so that each frees what its
        entries held: for ``free_in_pieces``, before this stream is dropped."""
        assert self._closed
        plan = self.reader.plan if self.reader is not None else None
        out: list[list[Any]] = []
        if plan is not None:
            out.extend(unit.items for unit in plan.units)
            out.append(plan.units)
        if self._owns and self.checkpoint is not None:
            out.append(list(self.checkpoint.specs.values()))
        return out

    async def __aenter__(self) -> TensorStream:
        try:
            await self.start()
        except BaseException:
            await self.aclose()
            raise
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()


def stream(
    source: str | os.PathLike[str] | Checkpoint,
    *,
    stages: Iterable[Stage] | Stage = (),
    max_inflight_bytes: int = DEFAULT_MAX_INFLIGHT_BYTES,
    concurrency: int = DEFAULT_CONCURRENCY,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    progress: Callable[[Progress], None] | None = None,
    verify: Manifest | None = None,
    in_order: bool = True,
    **options: Any,
) -> TensorStream:
    """Stream ``(name, tensor)`` pairs from a path, URL or open ``Checkpoint``.

    ``max_inflight_bytes`` (default 512 MiB) bounds the bytes read and not yet released by the
    consumer; ``concurrency`` (default: one per core, 2 to 8) bounds the reads in flight;
    ``chunk_bytes`` (default 16 MiB) is the largest single read. ``verify`` (a mapping of shard
    name to SHA-256, or a manifest file: see ``aload.integrity``) checks every shard's digest
    from the bytes as they stream; every byte is then read, dropped tensors included, and a
    mismatch raises ``CheckpointError`` before the shard's last unit is delivered. ``in_order``
    (default True): shard order, then offset order; False: a unit whose bytes come from the disk
    lets the next few behind it that are already read (in the page cache) go first. Other keyword
    options go to the source.
    """
    return TensorStream(
        source,
        stages=stages,
        max_inflight_bytes=max_inflight_bytes,
        concurrency=concurrency,
        chunk_bytes=chunk_bytes,
        progress=progress,
        options=options,
        verify=verify,
        in_order=in_order,
    )
