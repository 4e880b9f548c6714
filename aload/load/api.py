"""``load`` and ``load_sync``: stream a checkpoint into a model on a worker thread, then
post-process it; the event loop keeps serving meanwhile."""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..errors import AloadError, LoadError, UsageError, add_note
from ..format import Checkpoint
from ..read import (
    DEFAULT_CONCURRENCY,
    DEFAULT_GROUP_TIMEOUT_S,
    DEFAULT_MAX_INFLIGHT_BYTES,
    DEFAULT_PINNED_BYTES,
    Manifest,
    Progress,
    check_positive,
    first_tensor,
)
from ..stages import Stage
from ..stream import TensorStream
from .bridge import LoadCancelled, SyncBridge
from .loader import Hook, Installed, Loader


@dataclass
class LoadReport:
    tensors: int
    bytes: int
    bytes_read: int
    seconds: float
    gbps: float
    ttft_s: float | None
    peak_inflight_bytes: int
    budget_wait_s: float
    overdraft_bytes: int
    direct_bytes: int
    load_s: float
    postprocess_s: float
    installed: int
    missing: list[str]
    unexpected: list[str]
    converted: int = 0  # tensors whose dtype the built-in loader converted
    bytes_received: int = 0  # read by another rank of the process group and shared with this one
    verified_shards: int = 0
    opened_s: float | None = None
    planned_s: float | None = None

    def summary(self) -> str:
        first = first_tensor(self.ttft_s, self.opened_s, self.planned_s)
        return (
            f"{self.tensors} tensors, {self.bytes / 1e9:.3f} GB in {self.seconds:.3f} s "
            f"({self.gbps:.2f} GB/s); first tensor {first}; peak in flight "
            f"{self.peak_inflight_bytes / 2**20:.1f} MiB; load {self.load_s:.3f} s, "
            f"post-processing {self.postprocess_s:.3f} s; installed {self.installed}, "
            f"missing {len(self.missing)}, unexpected {len(self.unexpected)}"
            + (f"; {self.converted} converted to the model's dtype" if self.converted else "")
            + (f"; SHA-256 verified for {self.verified_shards} shard(s)" if self.verified_shards else "")
        )


def _device(model: nn.Module, device: str | torch.device | None) -> torch.device:
    if device is not None:
        try:
            dev = torch.device(device)
        except RuntimeError as exc:
            raise UsageError(f"not a device: {device!r} ({exc})") from None
    else:
        dev = next((t.device for t in model.parameters()), torch.device("cpu"))
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise UsageError(f"device {str(dev)!r} asked for, but torch sees no CUDA device here")
    return dev


def _check_model(model: nn.Module) -> None:
    if not isinstance(model, nn.Module):
        raise UsageError(f"aload.load takes a torch.nn.Module, got {type(model).__name__}")
    if hasattr(model, "load_weights"):
        return  # the model's own loader decides where weights go
    meta = next((n for n, t in model.state_dict(keep_vars=True).items() if t.is_meta), None)
    if meta is not None:
        raise UsageError(
            f"the model's {meta!r} is on the meta device, where nothing can be loaded into it: build the "
            "model on a device (with torch.device('cpu'): ...), or call model.to_empty(device=...) first"
        )


async def load(
    model: nn.Module,
    source: str | os.PathLike[str] | Checkpoint,
    *,
    device: str | torch.device | None = None,
    stages: Iterable[Stage] | Stage = (),
    max_inflight_bytes: int = DEFAULT_MAX_INFLIGHT_BYTES,
    concurrency: int = DEFAULT_CONCURRENCY,
    chunk_bytes: int | None = None,
    loader: Loader | None = None,
    strict: bool = True,
    strict_dtype: bool = False,
    after_load: Sequence[Hook] = (),
    after_postprocess: Sequence[Hook] = (),
    progress: Callable[[Progress], None] | None = None,
    verify: Manifest | None = None,
    group: Any = None,
    share: str = "broadcast",
    group_timeout: float = DEFAULT_GROUP_TIMEOUT_S,
    staging: bool | None = None,
    pinned_bytes: int = DEFAULT_PINNED_BYTES,
    **options: Any,
) -> LoadReport:
    """Stream ``source`` into ``model`` and post-process it; returns a ``LoadReport``.

    The loader runs on a worker thread (``model.load_weights(iterable)`` if the model has it,
    else the built-in loader, which has the bytes read straight into CPU parameters of the
    checkpoint's dtype and copies the rest, converting dtypes as ``load_state_dict`` does unless
    ``strict_dtype``). On a CUDA device the loader runs inside ``torch.cuda.stream(...)``.
    Cancelling the awaiting task stops every read and raises ``LoadCancelled`` inside the
    loader; no thread or file outlives the call, and the first error is the one raised.
    ``group``, ``share`` and ``group_timeout``: the ranks of a process group share the reads
    (``aload.stream``; every rank calls ``load`` with the same source and stages).
    ``staging`` (default: on for a CUDA device): the built-in loader's reads into parameters on
    the device pass through a pool of ``pinned_bytes`` of pinned host buffers and are copied on a
    stream of their own; ``staging=True`` on the CPU runs the same path with plain memory.
    """
    check_positive(max_inflight_bytes=max_inflight_bytes, concurrency=concurrency, pinned_bytes=pinned_bytes)
    if chunk_bytes is not None:
        check_positive(chunk_bytes=chunk_bytes)
    _check_model(model)
    dev = _device(model, device)
    staged = dev.type == "cuda" if staging is None else bool(staging)
    loader = loader or Loader(
        strict=strict, strict_dtype=strict_dtype, after_load=after_load, after_postprocess=after_postprocess
    )
    t0 = time.perf_counter()

    async def destinations(ckpt: Checkpoint) -> Any:
        # parameters on the device are read into only through the staging pool
        return await ckpt.store.run(loader.destinations, model, dev if staged else torch.device("cpu"))

    ts = TensorStream(
        source,
        stages=stages,
        max_inflight_bytes=max_inflight_bytes,
        concurrency=concurrency,
        chunk_bytes=chunk_bytes,
        progress=progress,
        verify=verify,
        options=options,
        destinations=destinations,
        t0=t0,
        group=group,
        share=share,
        group_timeout=group_timeout,
        staging=(dev, pinned_bytes) if staged else None,
    )
    bridge: SyncBridge | None = None
    try:
        async with ts:
            bridge = SyncBridge(ts)
            done = await _supervise(bridge, loader, model, dev)
    except BaseException as exc:
        if isinstance(exc, AloadError):
            exc.locate(ts.checkpoint.url if ts.checkpoint is not None else os.fspath(source))  # type: ignore[arg-type]
        _record_progress(exc, bridge, ts.stats.direct_bytes > 0)
        raise
    assert bridge is not None
    stats = ts.stats
    if strict and not bridge.exhausted:
        raise LoadError(
            f"the loader returned after {len(bridge.names)} of {stats.tensors} tensors delivered and left the rest unread"
        )
    seconds = time.perf_counter() - t0
    return LoadReport(
        tensors=stats.tensors,
        bytes=stats.bytes,
        bytes_read=stats.bytes_read,
        seconds=seconds,
        gbps=stats.bytes / seconds / 1e9 if seconds > 0 else 0.0,
        ttft_s=stats.ttft_s,
        peak_inflight_bytes=stats.peak_inflight_bytes,
        budget_wait_s=stats.budget_wait_s,
        overdraft_bytes=stats.overdraft_bytes,
        direct_bytes=stats.direct_bytes,
        load_s=done.load_s,
        postprocess_s=done.postprocess_s,
        installed=len(done.names),
        missing=done.missing,
        unexpected=done.unexpected,
        converted=done.converted,
        verified_shards=stats.verified_shards,
        bytes_received=stats.bytes_received,
        opened_s=stats.opened_s,
        planned_s=stats.planned_s,
    )


def _work(loader: Loader, model: nn.Module, bridge: SyncBridge, dev: torch.device) -> Installed:
    if dev.type != "cuda":
        return loader.load_weights_and_postprocess(model, bridge, dev)
    stream = torch.cuda.Stream(dev)  # type: ignore[no-untyped-call]
    with torch.cuda.stream(stream):
        done = loader.load_weights_and_postprocess(model, bridge, dev)
    stream.synchronize()
    return done


async def _supervise(bridge: SyncBridge, loader: Loader, model: nn.Module, dev: torch.device) -> Installed:
    """Run the worker and the pump; on cancellation or error stop both, wait for the worker's
    thread to end, and raise the error that came first."""
    loop = asyncio.get_running_loop()
    work: asyncio.Future[Installed] = loop.create_future()

    def settle(fn: Callable[[Any], None], value: Any) -> None:
        if not work.done():
            fn(value)

    def run() -> None:
        try:
            result = _work(loader, model, bridge, dev)
        except BaseException as exc:
            loop.call_soon_threadsafe(settle, work.set_exception, exc)
        else:
            loop.call_soon_threadsafe(settle, work.set_result, result)

    pump = asyncio.ensure_future(bridge.pump())
    threading.Thread(target=run, name="aload-load", daemon=True).start()
    cancelled = False
    try:
        while not work.done():
            waits: list[asyncio.Future[Any]] = [work] if pump.done() else [work, pump]
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            if pump.done() and not pump.cancelled() and pump.exception() is not None:
                bridge.close()  # a read failed: the worker stops at its next tensor
                break
    except asyncio.CancelledError:
        cancelled = True
        bridge.close()
    # The worker's thread always ends before this returns (a copy in progress finishes first).
    while not work.done():
        try:
            await asyncio.wait([work])
        except asyncio.CancelledError:
            cancelled = True
    if not pump.done():
        bridge.close()
        pump.cancel()
    with contextlib.suppress(BaseException):
        await pump
    if cancelled:
        if not work.cancelled():
            work.exception()  # retrieved: the cancellation is what is raised
        raise asyncio.CancelledError
    if pump.done() and not pump.cancelled() and pump.exception() is not None:
        exc = work.exception()
        if exc is None or isinstance(exc, LoadCancelled):
            raise pump.exception()  # type: ignore[misc]
    return work.result()


def _record_progress(exc: BaseException, bridge: SyncBridge | None, direct: bool) -> None:
    """Say on a failed load's exception how far it got: ``exc.aload_delivered`` lists the
    tensors handed to the loader, in order, and a note says what that means for the model."""
    names = list(bridge.names) if bridge is not None else []
    with contextlib.suppress(AttributeError, TypeError):
        exc.aload_delivered = names  # type: ignore[attr-defined]
    if bridge is not None and bridge.exhausted:
        note = (
            f"aload: all {len(names)} tensors had been delivered to the loader; the error came after "
            "(the strict check, a hook or post-processing)"
        )
    elif names:
        note = (
            f"aload: {len(names)} tensor(s) had been delivered to the loader before the error (the last: "
            f"{names[-1]!r}; all of them in .aload_delivered): the model is partly loaded, do not serve it"
        )
    else:
        note = "aload: no tensor had been delivered to the loader"
        if direct:
            note += "; parameters the built-in loader reads into directly may hold new bytes already"
    add_note(exc, note)


def load_sync(*args: Any, **kwargs: Any) -> LoadReport:
    """``aload.load`` from synchronous code; refuses to run inside a running event loop."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        pass
    else:
        raise UsageError("load_sync() called from a running event loop; use `await aload.load(...)` there")
    return asyncio.run(load(*args, **kwargs))
