"""The model side of a load: where each checkpoint tensor goes, and the phases that put it there.

``Loader``'s phases (``load_weights_only``, ``postprocess_weights``, both in
``load_weights_and_postprocess``) run on the worker thread ``aload.load`` starts; the built-in
loader copies into ``named_parameters()``/``named_buffers()`` by name, or has the reader put the
bytes straight into them (``destinations``). One walk over the module tree serves a load.
"""

from __future__ import annotations

import contextlib
import itertools
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ._threads import Pacer, paced
from .errors import LoadError
from .format import TensorSpec
from .plan import DIRECT_MIN_BYTES
from .stages import Pair

Hook = Callable[[nn.Module], None]


@dataclass
class Installed:
    """What the load phase installed: parameter names, and checkpoint names nothing took."""

    names: set[str] = field(default_factory=set)
    unexpected: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    load_s: float = 0.0
    postprocess_s: float = 0.0
    #: What the built-in loader made per tensor (its walk over the model), for the caller to free
    #: in pieces (``_threads.free_in_pieces``): freed on the loader's thread as it returned, it
    #: held the GIL, and the event loop, 4.1-4.7 ms on DeepSeek-V3's 89,820 tensors (alone).
    spent: list[Any] = field(default_factory=list, repr=False, compare=False)


@dataclass
class _Walk:
    """One pass over a model: every parameter and buffer by name (a tied tensor under each of its
    names), and the persistent state (what ``state_dict`` holds) grouped by tensor so that ties
    count once, in ``state_dict`` order. ``named_parameters``, ``named_buffers`` and ``state_dict``
    each walk the whole module tree: on 20,000 modules that was ~180 ms of a 0.86 s load."""

    model: nn.Module
    targets: dict[str, torch.Tensor]
    state: dict[str, int]  # persistent name -> which tensor (names of one tied tensor share it)
    quantized: bool  # some module has a quant method to post-process with

    def missing(self, installed: set[str]) -> list[str]:
        """The first name of each persistent tensor installed under none of its names."""
        if self._all_in(installed):  # the usual case: every name was installed
            return []
        covered = {self.state[n] for n in paced(installed) if n in self.state}
        out: list[str] = []
        for name, key in paced(self.state.items()):
            if key not in covered:
                covered.add(key)  # a tie is reported once
                out.append(name)
        return out

    def _all_in(self, installed: set[str]) -> bool:
        """Whether every persistent name is in ``installed``: in C, a piece at a time, the GIL let
        go between pieces (in one call, on DeepSeek-V3's 89,820 names, it held the GIL 6.3-6.7 ms
        at the end of the load, and the event loop with it)."""
        names, pace = iter(self.state), Pacer()
        for _ in range(0, len(self.state), _CHECK_PIECE):
            if not installed.issuperset(itertools.islice(names, _CHECK_PIECE)):
                return False
            pace()
        return True


#: Names checked in one C call by ``_Walk._all_in`` (~0.2 ms).
_CHECK_PIECE = 4096


def _walk(model: nn.Module) -> _Walk:
    # Two flat dicts, not a list per tensor: a load creates few objects the garbage collector
    # has to track (20,000 small lists were part of what set off a full collection mid-load).
    targets: dict[str, torch.Tensor] = {}
    state: dict[str, int] = {}
    classes: dict[type, bool] = {}
    quantized = False
    for pre, module in paced(_named_modules(model)):  # on a thread
        if not quantized:
            quantized = _quant_method(module, classes) is not None
        for key, p in module._parameters.items():
            if p is not None:
                name = pre + key  # one string in both dicts
                targets[name] = p
                state[name] = id(p)
        for key, b in module._buffers.items():
            if b is not None:
                name = pre + key
                targets[name] = b
                if key not in module._non_persistent_buffers_set:
                    state[name] = id(b)
    return _Walk(model, targets, state, quantized)


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
        # The model the built-in loader just loaded, when its walk found no quant method: loading
        # copies bytes only, so post-processing has nothing to do (its walk over 20,000 modules
        # was ~10% of a load). Cleared once used, and by hooks that run in between.
        self._unquantized: nn.Module | None = None

    def _walked_for(self, model: nn.Module) -> _Walk:
        if self._walked is None or self._walked.model is not model:
            self._walked = _walk(model)
        return self._walked

    def destinations(
        self, model: nn.Module, device: torch.device
    ) -> Callable[[str, TensorSpec], torch.Tensor | None] | None:
        """Where the built-in loader can have bytes read straight into the parameter; None
        when the model brings its own ``load_weights`` (it decides where weights go). A
        parameter on ``device``, a GPU, takes tensors of at least ``plan.DIRECT_MIN_BYTES``: the
        reader copies them on in pieces through pinned memory (smaller ones come in runs, and
        are copied here)."""
        if hasattr(model, "load_weights"):
            return None
        targets = self._walked_for(model).targets
        gpu = -2  # the GPU index whose parameters the load's stream can copy into; -2: none
        if device.type == "cuda":
            gpu = device.index if device.index is not None else torch.cuda.current_device()

        def dest(name: str, spec: TensorSpec) -> torch.Tensor | None:
            # Asked of every tensor (small ones are read straight in too), so the cheapest checks
            # torch has (``torch.Size`` is a tuple; ``is_cpu`` makes no device object), and the
            # parameter itself rather than ``.data``: a new tensor object per tensor set off
            # collections of the whole model (89,820 tensors: 2-7 us each instead of ~0.9).
            t = targets.get(name)
            if t is None or t.shape != spec.shape or t.dtype != spec.torch_dtype:
                return None
            if not t.is_cpu and (spec.nbytes < DIRECT_MIN_BYTES or t.get_device() != gpu):
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
        # From aload's bridge, the rest of a run of tensors read straight into their parameters
        # at once: each is one of ``targets`` (``destinations`` found it there), nothing to copy.
        in_place_rest = getattr(weights, "in_place_rest", None)
        if type(self).destinations is not Loader.destinations:
            in_place_rest = None  # destinations of a subclass's own choosing: each is checked
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
                elif in_place_rest is not None:
                    done.names.update(in_place_rest())
                done.names.add(name)
                del t
        done.missing = walked.missing(done.names)
        done.spent = [walked.targets, walked.state]
        self._unquantized = None if walked.quantized else model
        if self.strict and (done.missing or done.unexpected):
            raise LoadError(_describe_mismatch(done.missing, done.unexpected))
        return done

    def postprocess_weights(self, model: nn.Module, device: torch.device) -> None:
        """For every module with a ``quant_method``: ``process_weights_after_loading(module)``."""
        if self._unquantized is model:
            self._unquantized = None
            return  # the built-in loader's walk found none, and loading cannot have added one
        classes: dict[type, bool] = {}
        for module in paced(_modules(model)):
            method = _quant_method(module, classes)
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
        if self.after_load:
            self._unquantized = None  # a hook may give a module a quant method
        for hook in self.after_load:
            hook(model)
        self.postprocess_weights(model, device)
        for hook in self.after_postprocess:
            hook(model)
        done.load_s, done.postprocess_s = t1 - t0, time.perf_counter() - t1
        return done


def _quant_method(module: nn.Module, classes: dict[type, bool]) -> Any:
    """The module's ``quant_method`` when it has ``process_weights_after_loading``, else None;
    without a miss going through ``Module.__getattr__``, which builds an AttributeError message
    for every module that has none (60 ms over 20,000 modules). ``classes`` caches which classes
    define one."""
    cls = type(module)
    defined = classes.get(cls)
    if defined is None:
        defined = classes[cls] = hasattr(cls, "quant_method")
    # A class attribute or a property, an instance attribute, or a submodule of that name: the real
    # lookup (a parameter or buffer of that name is a tensor, no method to post-process with).
    if defined or "quant_method" in module.__dict__ or "quant_method" in module._modules:
        method = getattr(module, "quant_method", None)
        if hasattr(method, "process_weights_after_loading"):
            return method
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
