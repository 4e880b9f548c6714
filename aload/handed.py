"""Tensors handed to a CPU model's ``load_weights`` that copy themselves past the CPU's caches.

A model's loader puts each tensor into its parameter with ``param.data.copy_(loaded_weight)``
(vLLM's ``default_weight_loader``, most of its ``weight_loader`` methods, sglang's): torch's
copy, on ``torch.get_num_threads()`` threads, with ordinary stores, so every line written is
first read into the cache (4 GiB warm on the 2-core hosts measured: ~340-500 ms, while aload's
own copy by non-temporal stores, ``_ntcopy``, on two threads took ~215-250). aload owns the
tensors it hands out, not the model's copy; but a call on a tensor goes through its type's
``__torch_function__``, so a tensor of ``_ntcopy.STREAMING_MIN_BYTES`` or more goes to a CPU model's
loader as a ``HandedTensor``: where ``copy_`` reads it whole into a CPU tensor of the same
dtype and shape, both contiguous, the bytes go by ``_ntcopy.copy_bytes``, split between the
calling thread and helpers (as many threads in all as torch's copy would use), each piece in steps
that offer the core to a waiting thread, the event loop's (``COPY_STEP_BYTES``); everything else
(a copy that converts, broadcasts, goes to a GPU or records autograd; any other call) is torch's
own, with its results plain tensors. Views that a loader cuts before copying (``narrow``,
``view``, ``reshape``, indexing, ``split``, ``chunk``...: a tensor-parallel shard, a fused
projection's part) stay ``HandedTensor``.

The helpers belong to one load (``copies``, on the loader's thread) and run at the read threads'
lower priority (``_threads.READ_NICE``), so that the event loop takes a core first: a copy on any
other thread, or after the load, is done on the calling thread alone. ``ALOAD_STREAMING_COPY=0``
turns this off with the rest of the streaming copy (``handing`` is then None: plain tensors).
"""

from __future__ import annotations

import contextlib
import os
import queue
import threading
from collections.abc import Iterator
from typing import Any

import torch

from ._ntcopy import copy_bytes, streaming_copy
from ._threads import lower_priority, read_nice

_COPY = torch.Tensor.copy_
_PLAIN = (torch.Tensor, torch.nn.Parameter)
#: Calls whose tensor results share the handed tensor's memory: they stay ``HandedTensor``.
_VIEWS = frozenset(
    {
        torch.Tensor.narrow,
        torch.Tensor.view,
        torch.Tensor.reshape,
        torch.Tensor.__getitem__,
        torch.Tensor.split,
        torch.Tensor.chunk,
        torch.Tensor.detach,
        torch.Tensor.contiguous,
        torch.Tensor.flatten,
        torch.Tensor.squeeze,
        torch.Tensor.unsqueeze,
        torch.Tensor.view_as,
        torch.Tensor.reshape_as,
        torch.narrow,
        torch.split,
        torch.chunk,
        torch.reshape,
        torch.flatten,
        torch.squeeze,
        torch.unsqueeze,
    }
)
#: The least a helper thread is given to copy: a smaller copy stays on the calling thread.
SPLIT_PIECE_BYTES = 2 << 20
#: Each thread's piece of a copy goes in steps of this size, its core offered to any thread waiting
#: for one after each (``os.sched_yield``, as ``aload.local``'s copies out of the page cache): a
#: piece copied whole (tens of ms for a large tensor) left the event loop, woken beside it,
#: waiting for the scheduler's next tick. Suite children through ``load_weights``, alternating
#: (2026-12-05): loop lateness p99 (medians) 4 GiB partly evicted 2.6 ms in 8 MiB steps against
#: 4.7 whole (6 of 6 pairs lower), 2.4 in 4 MiB steps; 8 GiB warm 1.4 in 4 MiB steps, 2.2 in
#: 8 MiB, 3.0 whole; Qwen-shaped warm 2.1 against 2.4; 8 GiB cold 1.1 against 1.6; GB/s the same.
COPY_STEP_BYTES = 4 << 20
_local = threading.local()


def _copy_in_steps(dst: int, src: int, n: int) -> None:
    """``copy_bytes`` in steps of ``COPY_STEP_BYTES``, this thread's core offered after each."""
    at = 0
    while at < n:
        step = min(COPY_STEP_BYTES, n - at)
        copy_bytes(dst + at, src + at, step)
        at += step
        if at < n:
            os.sched_yield()


class _Helpers:
    """Threads that take a piece of each large copy (``threads - 1`` of them, started at the
    first copy that splits, on the loader's thread); ``close`` ends them."""

    def __init__(self, threads: int) -> None:
        self.parts = max(1, threads)
        self._jobs: queue.SimpleQueue[tuple[int, int, int] | None] = queue.SimpleQueue()
        self._done: queue.SimpleQueue[BaseException | None] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []

    def copy(self, dst: int, src: int, n: int) -> None:
        parts = min(self.parts, n // SPLIT_PIECE_BYTES)
        if parts < 2:
            _copy_in_steps(dst, src, n)
            return
        if not self._threads:
            for k in range(self.parts - 1):
                t = threading.Thread(target=self._work, name=f"aload-copy-{k}", daemon=True)
                t.start()
                self._threads.append(t)
        piece = (n // parts + 4095) & ~4095
        at = 0
        for _ in range(parts - 1):
            self._jobs.put((dst + at, src + at, piece))
            at += piece
        error: BaseException | None = None
        try:
            _copy_in_steps(dst + at, src + at, n - at)
        finally:
            for _ in range(parts - 1):  # every piece done before the copy returns, or raises
                error = self._done.get() or error
        if error is not None:
            raise error

    def _work(self) -> None:
        lower_priority(read_nice())  # as the read threads: the event loop takes a core first
        while (job := self._jobs.get()) is not None:
            try:
                _copy_in_steps(*job)
            except BaseException as exc:  # handed back to the copying thread
                self._done.put(exc)
            else:
                self._done.put(None)

    def close(self) -> None:
        for _ in self._threads:
            self._jobs.put(None)
        for t in self._threads:
            t.join()
        self._threads.clear()


#: Where no load's helpers are (another thread, after the load): the calling thread alone.
_ALONE = _Helpers(1)


@contextlib.contextmanager
def copies() -> Iterator[None]:
    """On the loader's thread, for one load: ``HandedTensor`` copies on this thread are split
    with helper threads, which end with the block."""
    helpers = _Helpers(torch.get_num_threads())
    _local.helpers = helpers
    try:
        yield
    finally:
        _local.helpers = None
        helpers.close()


def _plain_copy(dst: Any, src: Any) -> tuple[int, int, int] | None:
    """The destination's and the source's addresses and the bytes, where ``dst.copy_(src)`` is a
    plain copy of bytes that torch would do as such (no autograd record, no conversion, no
    broadcast, no overlap); else None."""
    if type(dst) not in _PLAIN or dst.device.type != "cpu" or src.device.type != "cpu":
        return None
    if dst.dtype != src.dtype or dst.shape != src.shape or dst.layout != torch.strided:
        return None
    if not (dst.is_contiguous() and src.is_contiguous()) or dst.is_inference():
        return None
    if dst.requires_grad and torch.is_grad_enabled():  # torch raises or records: its own path
        return None
    if dst.is_conj() or dst.is_neg() or src.is_conj() or src.is_neg():
        return None
    d: int = dst.data_ptr()
    s: int = src.data_ptr()
    n: int = src.nbytes
    return (d, s, n) if n > 0 and (d + n <= s or s + n <= d) else None


class HandedTensor(torch.Tensor):
    """A tensor aload handed to a CPU model's loader; see the module's docstring."""

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        # ``non_blocking`` means nothing between two CPU tensors: taken with or without it.
        if func is _COPY and 2 <= len(args) <= 3 and (not kwargs or kwargs.keys() == {"non_blocking"}):
            dst = args[0]
            plain = _plain_copy(dst, args[1])
            if plain is not None:
                (getattr(_local, "helpers", None) or _ALONE).copy(*plain)
                torch.autograd.graph.increment_version(dst)
                return dst
        return _torchs(cls, func, args, kwargs)


def _torchs(cls: type[HandedTensor], func: Any, args: Any, kwargs: Any) -> Any:
    """``func`` as torch does it for plain tensors; a view's results handed on as ``cls``."""
    with torch._C.DisableTorchFunctionSubclass():
        out = func(*args, **(kwargs or {}))
    if func in _VIEWS:
        if type(out) is torch.Tensor:
            return out.as_subclass(cls)
        if type(out) is tuple:
            return tuple(t.as_subclass(cls) if type(t) is torch.Tensor else t for t in out)
    return out


def handing() -> type[HandedTensor] | None:
    """``HandedTensor`` where the streaming copy is there (x86-64 with AVX2, not switched off),
    else None."""
    return HandedTensor if streaming_copy() is not None else None


__all__ = ["HandedTensor", "copies", "handing"]
