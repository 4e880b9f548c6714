"""Installing weights in a model, and the phases that put them there.

``Loader``'s phases (``load_weights_only``, ``postprocess_weights``, both in
``load_weights_and_postprocess``) run on the worker thread ``aload.load`` starts. The built-in
loader copies into ``named_parameters()``/``named_buffers()`` by name, or has the reader put
the bytes straight into them (``destinations``).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..errors import LoadError
from ..format import TensorSpec
from ..stages import Pair

Hook = Callable[[nn.Module], None]


@dataclass
class Installed:
    """What the load phase installed: parameter names, and names nothing took."""

    names: set[str] = field(default_factory=set)
    unexpected: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    converted: int = 0  # tensors whose dtype was converted on the way in
    load_s: float = 0.0
    postprocess_s: float = 0.0


@dataclass
class _Walk:
    """One pass over a model: every parameter and buffer by name (a tied tensor under each of
    its names), and which of them ``state_dict`` holds (persistent), by tensor."""

    model: nn.Module
    targets: dict[str, torch.Tensor]
    state: dict[str, int]  # persistent name -> id of its tensor

    def missing(self, installed: set[str]) -> list[str]:
        """The first name of each persistent tensor installed under none of its names."""
        covered = {self.state[n] for n in installed if n in self.state}
        out = []
        for name, key in self.state.items():
            if key not in covered:
                covered.add(key)  # a tie is reported once
                out.append(name)
        return out


def _walk(model: nn.Module) -> _Walk:
    targets: dict[str, torch.Tensor] = {}
    state: dict[str, int] = {}
    for prefix, module in model.named_modules(remove_duplicate=False):
        pre = prefix + "." if prefix else ""
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


def _quant_method(module: nn.Module) -> Any:
    method = getattr(module, "quant_method", None)
    return method if hasattr(method, "process_weights_after_loading") else None


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


def describe_mismatch(missing: list[str], unexpected: list[str], own_loader: bool = False) -> str:
    def few(names: list[str]) -> str:
        return ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")

    parts = []
    if missing:
        what = "not reported loaded by the model's load_weights" if own_loader else "missing from the checkpoint"
        parts.append(f"{len(missing)} of the model's parameters {what} ({few(missing)})")
    if unexpected:
        parts.append(f"{len(unexpected)} tensors in the checkpoint that the model has no place for ({few(unexpected)})")
    return "weights do not match the model: " + "; ".join(parts) + " (strict=False, or --non-strict, to load anyway)"


class Loader:
    """The phases of a load, as methods a subclass can override one at a time."""

    def __init__(
        self,
        *,
        strict: bool = True,
        strict_dtype: bool = False,
        after_load: Sequence[Hook] = (),
        after_postprocess: Sequence[Hook] = (),
    ) -> None:
        self.strict = strict
        self.strict_dtype = strict_dtype
        self.after_load = tuple(after_load)
        self.after_postprocess = tuple(after_postprocess)
        self._walked: _Walk | None = None  # from destinations() to the built-in loader, one load

    def _walk(self, model: nn.Module) -> _Walk:
        if self._walked is None or self._walked.model is not model:
            self._walked = _walk(model)
        return self._walked

    def destinations(
        self, model: nn.Module, device: torch.device
    ) -> Callable[[str, TensorSpec], torch.Tensor | None] | None:
        """Where the built-in loader can have bytes read straight into a parameter: a contiguous
        tensor of the checkpoint's dtype and shape, on the CPU or on ``device`` (the staging
        pool's; the CPU when there is none); None when the model brings its own ``load_weights``
        (it decides where weights go). Runs on a thread."""
        if hasattr(model, "load_weights"):
            return None
        targets = self._walk(model).targets

        def here(t: torch.Tensor) -> bool:
            return t.is_cpu or (t.device.type == device.type and device.index in (None, t.device.index))

        def dest(name: str, spec: TensorSpec) -> torch.Tensor | None:
            t = targets.get(name)
            if t is None or not here(t) or t.shape != spec.shape or t.dtype != spec.torch_dtype:
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
                raise LoadError(describe_mismatch(missing, [], own_loader=True))
            return Installed(names, missing=missing)
        return self._builtin(model, weights)

    def _builtin(self, model: nn.Module, weights: Iterable[Pair]) -> Installed:
        walked, self._walked = self._walk(model), None  # not kept past this load
        targets = walked.targets
        done = Installed()
        with torch.no_grad():
            for name, t in weights:
                target = targets.get(name)
                if target is None:
                    done.unexpected.append(name)
                    continue
                if t is not target:  # else read straight into it
                    if t.shape != target.shape:
                        raise LoadError(
                            f"shape {list(t.shape)} in the checkpoint, {list(target.shape)} in the model", tensor=name
                        )
                    if t.dtype != target.dtype:
                        if self.strict_dtype:
                            raise LoadError(
                                f"dtype {t.dtype} in the checkpoint, {target.dtype} in the model (strict_dtype=True)",
                                tensor=name,
                            )
                        done.converted += 1
                    target.copy_(t)
                done.names.add(name)
                del t
        done.missing = walked.missing(done.names)
        if self.strict and (done.missing or done.unexpected):
            raise LoadError(describe_mismatch(done.missing, done.unexpected))
        return done

    def postprocess_weights(self, model: nn.Module, device: torch.device) -> None:
        """For every module with a ``quant_method``: ``process_weights_after_loading(module)``."""
        for module in model.modules():
            method = _quant_method(module)
            if method is not None:
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
