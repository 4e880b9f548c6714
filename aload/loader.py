"""Loading into a model: the phases, the built-in loader, ``load`` and ``load_sync``.

``load`` runs ``Loader.load_weights_and_postprocess`` on a worker thread fed lazily from the
async pipeline through the sync bridge, inside ``torch.cuda.stream(...)`` for a CUDA target,
while the event loop keeps serving.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ._threads import paced, run_in_thread, start_thread
from .bridge import LoadCancelled, SyncBridge
from .checkpoint import DEFAULT_CONCURRENCY, Checkpoint
from .errors import AloadError, LoadError, UsageError, add_note
from .format import TensorSpec
from .integrity import Manifest
from .pipeline import TensorStream
from .reader import DEFAULT_CHUNK_BYTES, DEFAULT_MAX_INFLIGHT_BYTES, Progress
from .stages import Pair, Stage

Hook = Callable[[nn.Module], None]


@dataclass
class Installed:
    """What the load phase installed: parameter names, and checkpoint names nothing took."""

    names: set[str] = field(default_factory=set)
    unexpected: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    load_s: float = 0.0
    postprocess_s: float = 0.0


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

    def summary(self) -> str:
        ttft = f"{self.ttft_s * 1e3:.1f} ms" if self.ttft_s is not None else "-"
        return (
            f"{self.tensors} tensors, {self.bytes / 1e9:.3f} GB in {self.seconds:.3f} s "
            f"({self.gbps:.2f} GB/s); first tensor {ttft}; peak in flight "
            f"{self.peak_inflight_bytes / 2**20:.1f} MiB; load {self.load_s:.3f} s, "
            f"post-processing {self.postprocess_s:.3f} s; missing {len(self.missing)}, "
            f"unexpected {len(self.unexpected)}"
            + (f"; SHA-256 verified for {self.verified_shards} shard(s)" if self.verified_shards else "")
        )


@dataclass
class _Walk:
    """One pass over a model: every parameter and buffer by name (a tied tensor under each of its
    names), and the persistent state (what ``state_dict`` holds) grouped by tensor so that ties
    count once, in ``state_dict`` order. ``named_parameters``, ``named_buffers`` and ``state_dict``
    each walk the whole module tree: on 20,000 modules that was ~180 ms of a 0.86 s load."""

    model: nn.Module
    targets: dict[str, torch.Tensor]
    state: dict[str, int]  # persistent name -> which tensor (names of one tied tensor share it)

    def missing(self, installed: set[str]) -> list[str]:
        """The first name of each persistent tensor installed under none of its names."""
        if self.state.keys() <= installed:  # the usual case, in C: every name was installed
            return []
        covered = {self.state[n] for n in paced(installed) if n in self.state}
        out: list[str] = []
        for name, key in paced(self.state.items()):
            if key not in covered:
                covered.add(key)  # a tie is reported once
                out.append(name)
        return out


def _walk(model: nn.Module) -> _Walk:
    # Two flat dicts, not a list per tensor: a load creates few objects the garbage collector
    # has to track (20,000 small lists were part of what set off a full collection mid-load).
    targets: dict[str, torch.Tensor] = {}
    state: dict[str, int] = {}
    for pre, module in paced(_named_modules(model)):  # on a thread
        for key, p in module._parameters.items():
            if p is not None:
                targets[pre + key] = p
                state[pre + key] = id(p)
        for key, b in module._buffers.items():
            if b is not None:
                targets[pre + key] = b
                if key not in module._non_persistent_buffers_set:
                    state[pre + key] = id(b)
    return _Walk(model, targets, state)


def _named_modules(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """``model.named_modules(remove_duplicate=False)`` as ``(prefix, module)``, the prefix being
    the module's name and a dot ("" for the root), in the same order, with a stack instead of one
    generator per tree level (each name passed up through every level above it: on 20,000
    modules that was most of the walk)."""
    stack: list[tuple[str, nn.Module]] = [("", model)]
    while stack:
        pre, module = stack.pop()
        yield pre, module
        if module._modules:
            stack.extend(reversed([(pre + k + ".", m) for k, m in module._modules.items() if m is not None]))


def _modules(model: nn.Module) -> Iterator[nn.Module]:
    """``model.modules()``, same modules in the same order, without building the names that
    ``named_modules`` makes for each (half of the post-processing pass on 20,000 modules)."""
    seen: set[int] = set()
    stack = [model]
    while stack:
        module = stack.pop()
        if id(module) in seen:
            continue  # and its submodules, as modules() does
        seen.add(id(module))
        yield module
        if module._modules:
            stack.extend(reversed([m for m in module._modules.values() if m is not None]))


@contextlib.contextmanager
def device_loading_context(module: nn.Module, device: torch.device) -> Iterator[None]:
    """Parameters living on the CPU go to ``device`` for the call and come back after, as the
    engines do for CPU-offloaded layers; parameters created during the call stay where made."""
    if device.type == "cpu":
        yield
        return
    moved = {n: p for n, p in module.named_parameters() if p.device.type == "cpu"}
    for p in moved.values():
        p.data = p.data.to(device)
    try:
        yield
    finally:
        params = dict(module.named_parameters())
        for n in moved:
            if n in params:
                params[n].data = params[n].data.to("cpu")


class Loader:
    """The phases of a load, as methods a subclass can override one at a time."""

    def __init__(
        self, *, strict: bool = True, after_load: Sequence[Hook] = (), after_postprocess: Sequence[Hook] = ()
    ) -> None:
        self.strict = strict
        self.after_load = tuple(after_load)
        self.after_postprocess = tuple(after_postprocess)
        self._walked: _Walk | None = None  # from destinations() to the built-in loader of one load

    def _walked_for(self, model: nn.Module) -> _Walk:
        if self._walked is None or self._walked.model is not model:
            self._walked = _walk(model)
        return self._walked

    def destinations(
        self, model: nn.Module, device: torch.device
    ) -> Callable[[str, TensorSpec], torch.Tensor | None] | None:
        """Where the built-in loader can have bytes read straight into the parameter; None
        when the model brings its own ``load_weights`` (it decides where weights go)."""
        if hasattr(model, "load_weights"):
            return None
        targets = self._walked_for(model).targets

        def dest(name: str, spec: TensorSpec) -> torch.Tensor | None:
            # Asked of every tensor (small ones are read straight in too), so the cheapest checks
            # torch has (``torch.Size`` is a tuple; ``is_cpu`` makes no device object), and the
            # parameter itself rather than ``.data``: a new tensor object per tensor set off
            # collections of the whole model (89,820 tensors: 2-7 us each instead of ~0.9).
            t = targets.get(name)
            if t is None or t.shape != spec.shape or t.dtype != spec.torch_dtype or not t.is_cpu:
                return None
            return t if t.is_contiguous() else None

        return dest

    def load_weights_only(self, model: nn.Module, weights: Iterable[Pair], device: torch.device) -> Installed:
        """Install weights: ``model.load_weights(weights)`` when the model has it, else copy into
        ``named_parameters()``/``named_buffers()`` by name."""
        if hasattr(model, "load_weights"):
            result = model.load_weights(weights)  # type: ignore[operator]
            names = set(result) if isinstance(result, (set, frozenset)) else set()
            # The engines' check: every parameter named in what load_weights reports, before
            # post-processing creates parameters of its own (scales). Skipped when it reports nothing.
            missing = [n for n, _ in model.named_parameters() if n not in names] if names else []
            if self.strict and missing:
                raise LoadError(_describe_mismatch(missing, []))
            return Installed(names, missing=missing)
        return self._builtin(model, weights)

    def _builtin(self, model: nn.Module, weights: Iterable[Pair]) -> Installed:
        walked, self._walked = self._walked_for(model), None  # not kept past this load
        targets = walked.targets
        done = Installed()
        with torch.no_grad():
            for name, t in weights:
                target = targets.get(name)
                if target is None:
                    done.unexpected.append(name)
                    continue
                if t is not target:  # else read straight into it (``destinations`` checked it)
                    if t.shape != target.shape:
                        raise LoadError(
                            f"shape {list(t.shape)} in the checkpoint, {list(target.shape)} in the model", tensor=name
                        )
                    if t.data_ptr() != target.data_ptr() or t.dtype != target.dtype:  # else in place too
                        target.copy_(t, non_blocking=True)
                done.names.add(name)
                del t
        done.missing = walked.missing(done.names)
        if self.strict and (done.missing or done.unexpected):
            raise LoadError(_describe_mismatch(done.missing, done.unexpected))
        return done

    def postprocess_weights(self, model: nn.Module, device: torch.device) -> None:
        """For every module with a ``quant_method``: ``process_weights_after_loading(module)``."""
        classes: dict[type, bool] = {}
        for module in paced(_modules(model)):
            method = _quant_method(module, classes)
            if method is not None and hasattr(method, "process_weights_after_loading"):
                with device_loading_context(module, device):
                    method.process_weights_after_loading(module)

    def load_weights_and_postprocess(
        self, model: nn.Module, weights: Iterable[Pair], device: torch.device
    ) -> Installed:
        """Both phases, through ``self`` so that an override of either is honoured. Every weight
        is in (and, on a GPU, every copy complete) before any post-processing starts."""
        t0 = time.perf_counter()
        done = self.load_weights_only(model, weights, device)
        if device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()
        t1 = time.perf_counter()
        for hook in self.after_load:
            hook(model)
        self.postprocess_weights(model, device)
        for hook in self.after_postprocess:
            hook(model)
        done.load_s, done.postprocess_s = t1 - t0, time.perf_counter() - t1
        return done


def _quant_method(module: nn.Module, classes: dict[type, bool]) -> Any:
    """``getattr(module, "quant_method", None)`` without the miss going through
    ``Module.__getattr__``, which builds an AttributeError message for every module that has
    none (60 ms over 20,000 modules). ``classes`` caches which classes define one."""
    cls = type(module)
    defined = classes.get(cls)
    if defined is None:
        defined = classes[cls] = hasattr(cls, "quant_method")
    if defined:  # a class attribute or a property: the real lookup
        return getattr(module, "quant_method", None)
    for where in (module.__dict__, module._parameters, module._buffers, module._modules):
        if "quant_method" in where:
            return where["quant_method"]
    return None


def _describe_mismatch(missing: list[str], unexpected: list[str]) -> str:
    def few(names: list[str]) -> str:
        return ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")

    parts = []
    if missing:
        parts.append(f"{len(missing)} missing from the checkpoint ({few(missing)})")
    if unexpected:
        parts.append(f"{len(unexpected)} unexpected in the checkpoint ({few(unexpected)})")
    return "weights do not match the model: " + "; ".join(parts) + " (strict=False to load anyway)"


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
    max_inflight_bytes: int = DEFAULT_MAX_INFLIGHT_BYTES,
    concurrency: int = DEFAULT_CONCURRENCY,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    loader: Loader | None = None,
    strict: bool = True,
    after_load: Sequence[Hook] = (),
    after_postprocess: Sequence[Hook] = (),
    progress: Callable[[Progress], None] | None = None,
    verify: Manifest | None = None,
    **options: Any,
) -> LoadReport:
    """Stream ``source`` into ``model`` and post-process it; returns a ``LoadReport``.

    The loader runs on a worker thread (``model.load_weights(iterable)`` if the model has it, else
    the built-in loader, which reads straight into CPU parameters). Cancelling the awaiting task
    stops every read and raises ``LoadCancelled`` inside the loader; no thread or file outlives
    the call, and the first error is the one raised.
    """
    t0 = time.perf_counter()
    loader = loader or Loader(strict=strict, after_load=after_load, after_postprocess=after_postprocess)
    dev = _device(model, device)
    cuda = torch.cuda.Stream(dev) if dev.type == "cuda" else None  # type: ignore[no-untyped-call]
    # The built-in loader's walk over the model is one Python step per module: on a thread, where
    # the interpreter switches away every 5 ms, not on the loop (20,000 modules: ~45 ms). A model
    # with its own load_weights needs no walk, nor the thread's round trip (0.6-1.9 ms here).
    if hasattr(model, "load_weights") and type(loader).destinations is Loader.destinations:
        dests = None
    else:
        dests = await run_in_thread(loader.destinations, model, dev)
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
        t0=t0,
    )
    bridge: SyncBridge | None = None
    try:
        async with ts:
            bridge = SyncBridge(ts)
            pump = asyncio.ensure_future(bridge.pump())
            work, thread = start_thread(_work, loader, model, bridge, dev, cuda, name="aload-load")
            done = await _supervise(bridge, pump, work, thread)
    except BaseException as exc:
        if isinstance(exc, AloadError):
            exc.locate(ts.checkpoint.url if ts.checkpoint is not None else os.fspath(source))  # type: ignore[arg-type]
        _record_progress(exc, bridge, direct=dests is not None)
        raise
    finally:
        loader._walked = None  # a Loader kept for later loads holds no reference to this model
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
        verified_shards=stats.verified_shards,
    )


def _recorded_event(stream: Any) -> Any:
    """An event marking everything enqueued on the load stream so far (the copy that read a
    buffer included): the buffer is reused only once it has completed."""
    event = torch.cuda.Event()  # type: ignore[no-untyped-call]
    event.record(stream)
    return event


def _work(loader: Loader, model: nn.Module, bridge: SyncBridge, dev: torch.device, cuda: Any) -> Installed:
    ctx = torch.cuda.stream(cuda) if cuda is not None else contextlib.nullcontext()
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
