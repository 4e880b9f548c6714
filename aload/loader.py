"""Loading into a model: ``load`` and ``load_sync`` (the phases themselves: ``aload.install``).

``load`` runs ``Loader.load_weights_and_postprocess`` on a worker thread fed lazily from the
async pipeline through the sync bridge, inside ``torch.cuda.stream(...)`` for a CUDA target,
while the event loop keeps serving.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ._threads import free_in_pieces, run_in_thread, start_thread
from .bridge import LoadCancelled, SyncBridge
from .checkpoint import DEFAULT_CONCURRENCY, Checkpoint
from .errors import AloadError, LoadError, UsageError, add_note
from .format import TensorSpec
from .handed import copies, handing
from .install import Hook, Installed, Loader
from .integrity import Manifest
from .pipeline import TensorStream
from .plan import DIRECT_MIN_BYTES
from .reader import DEFAULT_CHUNK_BYTES, DEFAULT_MAX_INFLIGHT_BYTES, Progress, first_tensor
from .stages import Stage


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
    verified_shards: int = 0  # shards whose SHA-256 matched (``verify=``)
    opened_s: float | None = None  # the checkpoint open (index and headers parsed), from the call
    planned_s: float | None = None  # the plan made, from the call (the model's walk comes first)
    warm_copy: str | None = None  # "pread" or "map": how bytes came out of the page cache (aload.warmcopy)
    staged_bytes: int = 0  # read in pinned pieces and copied on to the GPU (built-in, weights_on_device)

    def summary(self) -> str:
        return (
            f"{self.tensors} tensors, {self.bytes / 1e9:.3f} GB in {self.seconds:.3f} s "
            f"({self.gbps:.2f} GB/s); first tensor {first_tensor(self.ttft_s, self.opened_s, self.planned_s)}; peak in flight "
            f"{self.peak_inflight_bytes / 2**20:.1f} MiB; load {self.load_s:.3f} s, "
            f"post-processing {self.postprocess_s:.3f} s; missing {len(self.missing)}, "
            f"unexpected {len(self.unexpected)}"
            + (f"; {self.staged_bytes / 1e9:.3f} GB on to the GPU in pinned pieces" if self.staged_bytes else "")
            + (f"; SHA-256 verified for {self.verified_shards} shard(s)" if self.verified_shards else "")
            + (f"; page cache copied by {_COPY_WORDS[self.warm_copy]}" if self.warm_copy else "")
        )


_COPY_WORDS = {"pread": "preadv", "map": "memcpy out of the mapping"}

#: Models of up to this many modules are walked on a thread while the checkpoint opens on the loop
#: (a walk of ~1 ms); a larger one is walked first. Two threads running Python at once make the
#: loop late: 20,000 modules, cold, a fresh process each, loop lateness p99 3.7-6.0 ms with the
#: walk beside the open against 1.7-2.6 walked first.
WALK_BESIDE_MODULES = 512

#: The default budget of a load by the built-in loader into GPU parameters (``load``): pinned
#: memory for ``reader.STAGE_SLOTS`` pieces of a few tensors at once, and runs of small ones.
STAGED_BUDGET_BYTES = 64 << 20


def _device(model: nn.Module, device: str | torch.device | None) -> torch.device:
    if device is not None:
        return torch.device(device)
    for t in model.parameters():
        return t.device
    return torch.device("cpu")


async def load(
    model: nn.Module,
    source: str | os.PathLike[str] | Checkpoint,
    *,
    device: str | torch.device | None = None,
    stages: Iterable[Stage] | Stage = (),
    max_inflight_bytes: int | None = None,
    concurrency: int = DEFAULT_CONCURRENCY,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    loader: Loader | None = None,
    strict: bool = True,
    after_load: Sequence[Hook] = (),
    after_postprocess: Sequence[Hook] = (),
    progress: Callable[[Progress], None] | None = None,
    verify: Manifest | None = None,
    in_order: bool = False,
    weights_on_device: bool = False,
    **options: Any,
) -> LoadReport:
    """Stream ``source`` into ``model`` and post-process it; returns a ``LoadReport``.

    The loader runs on a worker thread (``model.load_weights(iterable)`` if the model has it, else
    the built-in loader, which reads straight into CPU parameters). Cancelling the awaiting task
    stops every read and raises ``LoadCancelled`` inside the loader; no thread or file outlives
    the call, and the first error is the one raised.

    ``in_order`` (default False): tensors come in shard order, then offset order, except that one
    whose bytes must come from the disk lets the ones behind it that sit in the page cache go
    first, so the loader copies those while the disk works (a checkpoint a tenth evicted, through
    ``load_weights``: 1 GiB 6.6 -> 9.9 GB/s). A model's loader matches tensors by name, so the order
    does not change what it loads; True keeps ``aload.stream``'s order throughout.

    ``max_inflight_bytes`` (default 512 MiB; for the built-in loader into GPU parameters, 64 MiB
    of pinned memory, which costs ~0.5 ms a MiB to pin in each new process) bounds the host
    memory holding bytes on their way.

    ``weights_on_device`` (default False), for a model with its own ``load_weights`` on a GPU:
    hand it each tensor of 1 MiB or more already on that GPU, in a fresh tensor read a piece at a
    time through pinned memory and copied on the load's stream, as the built-in loader's are (the
    default budget is then 64 MiB); its ``copy_`` into the parameter is then one on the GPU.
    Smaller tensors come in pinned host memory as before. Each such tensor takes GPU memory
    until the model drops it: up to ``reader.DEVICE_AHEAD_BYTES`` (1 GiB) of them read ahead of
    the model (one larger goes alone), besides the parameters; they stay cached in torch's
    allocator after the load (``torch.cuda.empty_cache()`` hands them back); where GPU memory
    runs out, a ``LoadError`` names the tensor. Leading renames and filters are fine (they act
    on the plan); after a tensor stage such as ``stages.map`` every tensor is a host tensor.
    Without effect with ``verify``, on a CPU, or with the built-in loader.
    """
    t0 = time.perf_counter()
    loader = loader or Loader(strict=strict, after_load=after_load, after_postprocess=after_postprocess)
    dev = _device(model, device)
    cuda = torch.cuda.Stream(dev) if dev.type == "cuda" else None  # type: ignore[no-untyped-call]
    # The built-in loader's walk over the model is one Python step per module: on a thread, where
    # the interpreter switches away every 5 ms, not on the loop (20,000 modules: ~45 ms); for a model
    # of up to WALK_BESIDE_MODULES modules, while the checkpoint opens (the walk's thread and round
    # trip came first: 2-4 ms before the open, in a fresh process, 1 GiB). A model with its own
    # load_weights needs no walk, nor the round trip.
    walk: asyncio.Future[Any] | None = None
    dests: Any
    if type(loader).destinations is not Loader.destinations:  # a subclass's, which may say None
        dests = await run_in_thread(loader.destinations, model, dev)
    elif hasattr(model, "load_weights"):
        dests = None
    else:
        dests = walk = asyncio.ensure_future(run_in_thread(loader.destinations, model, dev))
        if sum(1 for _ in itertools.islice(model.modules(), WALK_BESIDE_MODULES + 1)) > WALK_BESIDE_MODULES:
            await walk  # a long walk first, as before (cancelled, its thread ends first)
    temps = weights_on_device and cuda is not None and dests is None
    if temps:
        dests = _on_device
    if max_inflight_bytes is None:
        # Into GPU parameters the built-in loader copies each large tensor on in pieces through a
        # few pinned buffers: pinning the whole default budget took ~245 ms on an H200 host.
        staged = cuda is not None and dests is not None
        max_inflight_bytes = STAGED_BUDGET_BYTES if staged else DEFAULT_MAX_INFLIGHT_BYTES
    ts = TensorStream(
        source,
        stages=stages,
        max_inflight_bytes=max_inflight_bytes,
        concurrency=concurrency,
        chunk_bytes=chunk_bytes,
        progress=progress,
        options=options,
        verify=verify,
        destinations=dests,
        pin=cuda is not None,
        release_event=(lambda: _recorded_event(cuda)) if cuda is not None else None,
        device_copy=_copier(cuda) if cuda is not None else None,
        device_empty=_maker(cuda) if temps else None,
        t0=t0,
        in_order=in_order,
    )
    bridge: SyncBridge | None = None
    try:
        async with ts:
            if walk is not None:  # awaited by the plan already, unless tensor stages left it out
                await walk
            # Into CPU parameters, large tensors copy themselves past the caches (handed.py).
            bridge = SyncBridge(ts, handed=handing() if dev.type == "cpu" else None)
            pump = asyncio.ensure_future(bridge.pump())
            work, thread = start_thread(_work, loader, model, bridge, dev, cuda, name="aload-load")
            done = await _supervise(bridge, pump, work, thread)
    except BaseException as exc:
        if isinstance(exc, AloadError):
            exc.locate(ts.checkpoint.url if ts.checkpoint is not None else os.fspath(source))  # type: ignore[arg-type]
        _record_progress(exc, bridge, direct=dests is not None and not temps)
        raise
    finally:
        if walk is not None and not walk.done():  # the open failed or was cancelled first
            walk.cancel()
            await asyncio.wait([walk])  # its thread ends before this returns
        loader._walked = loader._unquantized = None  # a Loader kept for later loads holds no reference to this model
    assert bridge is not None
    bridge.settle()
    stats = ts.stats
    if strict and not bridge.exhausted:
        raise LoadError(
            f"the loader returned after {len(bridge.names)} of {stats.tensors} tensors delivered and left the rest unread"
        )
    # What the load made per tensor, freed a piece at a time once this returns, not in one go.
    free_in_pieces([bridge.names, *ts.leftovers(), *done.spent])
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
        staged_bytes=stats.staged_bytes,
        warm_copy=stats.warm_copy,
        load_s=done.load_s,
        postprocess_s=done.postprocess_s,
        installed=len(done.names),
        missing=done.missing,
        unexpected=done.unexpected,
        verified_shards=stats.verified_shards,
        opened_s=stats.opened_s,
        planned_s=stats.planned_s,
    )


def _recorded_event(stream: Any) -> Any:
    """An event marking everything enqueued on the load stream so far (the copy that read a
    buffer included): the buffer is reused only once it has completed."""
    event = torch.cuda.Event()  # type: ignore[no-untyped-call]
    event.record(stream)
    return event


def _copier(stream: Any) -> Callable[[torch.Tensor, torch.Tensor], Any]:
    """``copy(dst, src)``: ``src`` (pinned) copied into ``dst`` (on the GPU) on the load's stream,
    without waiting; returns an event that completes with the copy."""

    def copy(dst: torch.Tensor, src: torch.Tensor) -> Any:
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)
        return _recorded_event(stream)

    return copy


def _on_device(name: str, spec: TensorSpec) -> torch.Tensor | None:
    """``weights_on_device``'s destinations: a stand-in (no memory) for each tensor of
    ``DIRECT_MIN_BYTES`` or more, made on the GPU when its reads start (``_maker``)."""
    if spec.nbytes < DIRECT_MIN_BYTES:
        return None
    return torch.empty(spec.shape, dtype=spec.torch_dtype, device="meta")


def _maker(stream: Any) -> Callable[[torch.Tensor], torch.Tensor]:
    """``empty(like)``: a new tensor like the stand-in ``like`` on the load stream's GPU, from
    the caching allocator on that stream, which its copies and the model's ``copy_`` (on the
    load's worker thread, inside ``torch.cuda.stream``) use: its memory goes to a later tensor
    only after the work queued on the stream before it is freed."""

    def empty(like: torch.Tensor) -> torch.Tensor:
        with torch.cuda.stream(stream):
            return torch.empty(like.shape, dtype=like.dtype, device=stream.device)

    return empty


def _work(loader: Loader, model: nn.Module, bridge: SyncBridge, dev: torch.device, cuda: Any) -> Installed:
    ctx = torch.cuda.stream(cuda) if cuda is not None else copies()
    try:
        with ctx:
            done = loader.load_weights_and_postprocess(model, bridge, dev)
        if cuda is not None:
            cuda.synchronize()
        return done
    except LoadCancelled:
        raise


def _record_progress(exc: BaseException, bridge: SyncBridge | None, direct: bool) -> None:
    """Say on a failed load's exception how far it got: ``exc.aload_delivered`` lists the tensors
    handed to the loader, in order, and a note says what that means for the model."""
    if bridge is not None:
        bridge.settle()
    names = list(bridge.names) if bridge is not None else []
    with contextlib.suppress(AttributeError, TypeError):  # an exception type that takes no attributes
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
    if direct and not (bridge is not None and bridge.exhausted):
        note += "; parameters the built-in loader reads into directly may hold new bytes already"
    add_note(exc, note)


async def _supervise(
    bridge: SyncBridge, pump: asyncio.Future[None], work: asyncio.Future[Installed], thread: Any
) -> Installed:
    """Wait for the worker; on cancellation or error stop the pipeline and the worker, and raise
    the error that started it (a pipeline error wins over what the loader made of it)."""
    try:
        # The pump may finish first (end of stream, or an error the worker sees on its next
        # pull); the worker may finish first (it stopped pulling). Either way, wait for the worker.
        await asyncio.wait([work, pump], return_when=asyncio.FIRST_COMPLETED)  # type: ignore[type-var]
        if not work.done():
            await asyncio.wait([work])
    except BaseException:
        bridge.close()
        await asyncio.wait([work])  # the worker stops at its next pull, or after post-processing
        raise
    finally:
        bridge.close()
        pump.cancel()
        await asyncio.wait([pump])
        thread.join()
        for fut in (work, pump):  # their errors are raised below or superseded; mark them seen
            if fut.done() and not fut.cancelled():
                fut.exception()
    if bridge.error is not None:
        raise bridge.error
    return work.result()


def load_sync(model: nn.Module, source: str | os.PathLike[str] | Checkpoint, **kwargs: Any) -> LoadReport:
    """``load`` for synchronous code: runs its own event loop (uvloop when installed).
    Refuses to run inside a running event loop: ``await aload.load(...)`` there instead."""
    try:
        running = asyncio.get_running_loop()
    except RuntimeError:
        running = None
    if running is not None:
        raise UsageError(f"load_sync() called inside a running event loop ({running!r}); use `await aload.load(...)`")
    try:
        import uvloop

        factory: Callable[[], asyncio.AbstractEventLoop] = uvloop.new_event_loop
    except ImportError:
        factory = asyncio.new_event_loop
    loop = factory()
    try:
        return loop.run_until_complete(load(model, source, **kwargs))
    finally:
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()
