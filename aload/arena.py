"""Host memory for units, and the tensors cut from it.

A unit is read into a ``Lease``: a region of the ``Arena`` (one buffer of the byte budget,
allocated once and reused, so pages are faulted in once per load instead of once per tensor), a
fresh allocation outside it, or a view of a mapped file. Its tensors are views of that memory,
cut from it a run at a time (``UnitView``, ``run_at``) on whichever thread consumes them.
"""

from __future__ import annotations

import bisect
import collections
import sys
from typing import Any

import numpy as np
import torch

from ._ntcopy import STREAMING_MIN_BYTES
from ._syscalls import madvise_in_steps, memory_at
from .direct import ALIGN  # O_DIRECT reads into a unit's buffer need its address aligned
from .format import TensorSpec
from .plan import Item, Unit


class Arena:
    """First-fit allocator over one buffer; regions are 4 KiB aligned. The buffer is allocated
    on first use and its pages faulted once, then reused for the rest of the load."""

    def __init__(self, capacity: int, pin: bool) -> None:
        self.capacity = capacity
        self.used = 0
        self._pin = pin
        self._free: list[tuple[int, int]] = [(0, capacity)]  # sorted (start, end)
        self.warm = 0 if not pin else capacity  # [0, warm) has been faulted in (pinned memory is)
        self._array: np.ndarray[Any, Any] | None = None

    def array(self) -> np.ndarray[Any, Any]:
        if self._array is None:
            self._array = host_array(self.capacity, self._pin)
        return self._array

    def drop(self) -> None:
        """Let the buffer go (views still held keep it alive); later frees are ignored."""
        self._array = None

    def alloc(self, n: int) -> int | None:
        """First fit: the lowest free region that holds ``n``. Streams release units in about the
        order they were allocated, so the low regions come free again first, and the arena's
        touched part stays near the bytes really in flight (first touches of fresh pages are
        what the arena exists to avoid) rather than sweeping the whole budget."""
        size = -(-n // ALIGN) * ALIGN
        for i, (start, end) in enumerate(self._free):
            if end - start >= size:
                self._free[i : i + 1] = [(start + size, end)] if end - start > size else []
                self.used += size
                return start
        return None

    def free(self, start: int, n: int) -> None:
        if self._array is None:  # dropped: nothing more is allocated from it
            return
        size = -(-n // ALIGN) * ALIGN
        end = start + size
        self.used -= size
        i = bisect.bisect(self._free, (start, end))
        if i < len(self._free) and self._free[i][0] == end:
            end = self._free.pop(i)[1]
        if i > 0 and self._free[i - 1][1] == start:
            start = self._free.pop(i - 1)[0]
            i -= 1
        self._free.insert(i, (start, end))


_MADV_POPULATE_WRITE = 23  # Linux 5.14
_PAGE = 4096
#: Fresh pages cost up to ~11 us each on the VM measured: 1 MiB a call keeps each hold of the
#: memory-map lock to a few ms (see ``madvise_in_steps``).
_PREFAULT_STEP = 1 << 20


def prefault(arr: np.ndarray[Any, Any], start: int, end: int) -> None:
    """Fault in [start, end) of a fresh buffer with one MADV_POPULATE_WRITE, on a helper thread,
    so the first touches do not happen page by page on the event loop while a response body is
    copied in (that held the loop 25-31 ms at p99). It saves little time where fresh memory is
    expensive in itself: 256 MiB took ~0.75 s either way in a new process on the VM measured.
    Contents are unchanged."""
    if not sys.platform.startswith("linux") or end <= start:
        return
    # Whole pages around the range: populating a page does not change what it holds.
    lo = (arr.ctypes.data + start) // _PAGE * _PAGE
    hi = -(-(arr.ctypes.data + end) // _PAGE) * _PAGE
    madvise_in_steps(lo, hi - lo, _MADV_POPULATE_WRITE, _PREFAULT_STEP)  # on failure pages fault as before


def host_array(n: int, pin: bool) -> np.ndarray[Any, Any]:
    if pin:
        return torch.empty(n, dtype=torch.uint8, pin_memory=True).numpy()
    # Page-aligned, so that a file on disk can be read into it with O_DIRECT (``read_frame``).
    raw = np.empty(n + ALIGN, dtype=np.uint8)
    skip = -raw.ctypes.data % ALIGN
    return raw[skip : skip + n]


#: Where a lease's memory comes from.
ARENA, OUTSIDE, MAPPED = "arena", "outside", "mapped"


class Lease:
    """Host memory holding one unit: a region of the arena, a fresh allocation, or a view of a
    mapped file (zero copy; ``populated`` by the read). Released when its last view dies. A unit
    read by ``Source.read_frame`` has its ``frame``: the whole blocks of the file around it, of
    which ``tensor`` is the unit's part."""

    __slots__ = ("__weakref__", "frame", "kind", "nbytes", "pad", "start", "tensor")

    def __init__(self, kind: str, start: int, nbytes: int, view: np.ndarray[Any, Any]) -> None:
        self.kind = kind
        self.start = start
        self.nbytes = nbytes
        self.tensor: torch.Tensor | None = torch.from_numpy(view)
        self.frame: np.ndarray[Any, Any] | None = None
        self.pad = 0  # where the unit starts in its frame


def byte_view(t: torch.Tensor) -> memoryview:
    """The bytes of the contiguous CPU tensor ``t``, writable (a parameter that requires grad
    too), holding ``t`` alive. From its address, not from torch ops: each op lets go of the GIL
    and waits to take it back, and on the event loop with the read threads busy the four that
    this took (detach, reshape, view, numpy) cost ~0.3 ms a unit read into a destination
    (a Qwen2.5-0.5B-shaped checkpoint: 36 ms of a 250 ms load)."""
    return memoryview(memory_at(t.data_ptr(), t.nbytes, t))  # type: ignore[arg-type]


class UnitView:
    """Typed views of one unit's buffer, one per dtype, from which a run of tensors is cut by one
    ``split_with_sizes`` (``run_at``): every torch call releases and retakes the GIL, and with the
    loader's thread busy each one can wait."""

    __slots__ = ("base", "typed")

    def __init__(self, base: torch.Tensor) -> None:
        self.base = base
        self.typed: dict[torch.dtype, torch.Tensor] = {}

    def _typed(self, spec: TensorSpec) -> torch.Tensor:
        dtype = spec.torch_dtype
        typed = self.typed.get(dtype)
        if typed is None:
            base, extra = self.base, self.base.numel() % spec.itemsize
            typed = self.typed[dtype] = (base[:-extra] if extra else base).view(dtype)
        return typed

    def pieces(self, items: list[Item]) -> collections.deque[torch.Tensor]:
        """The 1-D pieces of ``items`` (a run of neighbours of one dtype), in order, from one
        ``split_with_sizes`` call."""
        spec = items[0].spec
        size = spec.itemsize
        lo = items[0].offset // size
        sizes = [item.spec.nbytes // size for item in items]
        return collections.deque(self._typed(spec)[lo : lo + sum(sizes)].split_with_sizes(sizes))


def _uncut(unit: Unit, item: Item) -> torch.Tensor:
    """The tensor of ``item`` where none is cut from a buffer: its destination when it was read
    straight in, else a new empty one (a zero-size tensor owns no bytes, and holding it holds no
    buffer alive)."""
    if unit.dest is not None:
        return unit.dest
    if item.dest is not None:
        return item.dest
    spec = item.spec
    return torch.empty(spec.shape, dtype=spec.torch_dtype)


#: Tensors of a unit cut at once, at most (``run_at``): one ``split_with_sizes`` for the run instead
#: of an ``as_strided`` each (a micro-benchmark of 4 KiB tensors: 0.7-0.8 us a tensor against
#: 2.1-2.3), while a run's pieces, alive together until handed out, stay few.
CUT_RUN = 256


def run_at(
    unit: Unit, view: UnitView | None, i: int, handed: type[torch.Tensor] | None = None
) -> tuple[collections.deque[tuple[str, torch.Tensor]], int]:
    """The (name, tensor) pairs of the unit's delivered items in a run from item ``i`` on, each
    tensor a view of the unit's buffer or what ``_uncut`` gives, and the index of the item after
    the run; a view of ``STREAMING_MIN_BYTES`` or more as ``handed`` where given (``handed.py``: a
    CPU model's loader copies it past the caches). A run is at most
    ``CUT_RUN`` items of one dtype, cut from the buffer at once; a consumer takes its pairs with
    ``popleft`` (a C call, where a generator's step per tensor was Python), so that nothing here
    holds a pair once it is handed out and a unit's memory goes back once the consumer has
    dropped every tensor it was given."""
    items = unit.items
    n = len(items)
    if unit.dest is not None or unit.scatter or view is None:
        j = min(i + CUT_RUN, n)
        cut = collections.deque((item.name, _uncut(unit, item)) for item in items[i:j] if not item.skip)
        if unit.handed_off:
            unit.dest = None
        return cut, j
    dtype, j = items[i].spec.dtype, i + 1
    while j < n and j - i < CUT_RUN and items[j].spec.dtype == dtype:
        j += 1
    run = items[i:j]
    pieces = view.pieces(run)
    out: collections.deque[tuple[str, torch.Tensor]] = collections.deque()
    for item in run:
        piece = pieces.popleft()
        if item.skip:
            continue
        spec = item.spec
        if not spec.nbytes:  # owns no bytes: holds no buffer alive
            piece = _uncut(unit, item)
        else:
            if len(spec.shape) != 1:
                piece = piece.view(spec.shape)
            if handed is not None and spec.nbytes >= STREAMING_MIN_BYTES:
                piece = piece.as_subclass(handed)
        out.append((item.name, piece))
    return out, j
