"""The read plan: which byte ranges to read, in which order, into what.

Tensors come in shard order, then offset order. A tensor of ``chunk_bytes`` or more is a unit
of its own, read as several chunks in parallel; smaller neighbours coalesce into units of up
to ``chunk_bytes``. A tensor of ``DIRECT_MIN_BYTES`` or more whose destination is known (the
built-in loader's parameter) is a unit of its own, read straight into it; the rest go into
buffers of the reader's (views of a file's mapping where the page cache holds it), and their
consumer copies them. A dropped tensor leaves a gap that is never read.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from ..format import Checkpoint, TensorSpec
from ..sources import Source

#: Plan-time renaming: the final name of a tensor, or None to drop it unread.
NameFn = Callable[[str], "str | None"]
#: The CPU tensor to read ``spec`` straight into (contiguous, same dtype and shape), or None.
DestFn = Callable[[str, TensorSpec], "torch.Tensor | None"]
#: Plan-time slicing: (dim, start, size) of the part of tensor ``name`` (of ``shape``) to keep.
SliceFn = Callable[[str, tuple[int, ...]], "tuple[int, int, int] | None"]

#: Smaller tensors are not read straight into their destinations: they come in a buffer with
#: their neighbours, and their consumer copies them (a read per small tensor costs more than the
#: copy; ``benchmarks/suite.py --many``: 20,000 tensors of 4 KiB).
DIRECT_MIN_BYTES = 1 << 20


class Item(NamedTuple):
    spec: TensorSpec
    name: str
    offset: int  # within the unit
    dest: torch.Tensor | None = None
    skip: bool = False  # read (for a digest) but not delivered
    narrow: tuple[int, int, int] | None = None  # (dim, start, size): delivered as this part of it


@dataclass
class Unit:
    """One run of reads: contiguous small tensors, or one large tensor."""

    source: Source
    start: int
    nbytes: int = 0
    items: list[Item] = field(default_factory=list)
    #: Its one item is read straight into its ``dest``: no buffer, nothing against the budget.
    into: bool = False
    #: Its one item is this process's own slice of a tensor (the ranks of a group read different
    #: bytes for it): read by every rank for itself, never shared.
    local: bool = False


@dataclass
class Plan:
    units: list[Unit]
    tensors: int
    nbytes: int


def make_plan(
    ckpt: Checkpoint,
    sources: dict[str, Source],
    names: NameFn | None,
    dest: DestFn | None,
    chunk_bytes: int,
    read_all: bool = False,
    group_bytes: int | None = None,
    slices: SliceFn | None = None,
) -> Plan:
    """``sources``: shard URL -> Source. ``read_all``: dropped tensors are read too (not
    delivered), so that every byte of every shard passes in file order, as a digest needs.
    ``group_bytes`` (default ``chunk_bytes``): the most a unit of small tensors holds.
    ``slices``: the part of a tensor to keep; on dim 0 only its rows are read (a unit of its own,
    ``local``), on another dim the whole tensor is read and the part delivered as a view."""
    group_bytes = min(chunk_bytes, group_bytes or chunk_bytes)
    units: list[Unit] = []
    tensors = nbytes = 0
    group: Unit | None = None
    for spec in ckpt.specs.values():
        name = names(spec.name) if names is not None else spec.name
        skip = name is None
        if skip and not read_all:
            group = None  # the gap is never read
            continue
        part = slices(name, spec.shape) if slices is not None and not skip and not read_all else None  # type: ignore[arg-type]
        local = part is not None and (part[0] == 0 or len(spec.shape) < 2)
        if local:  # this rank's rows: only their bytes are read, in a unit of its own
            _, first, size = part  # type: ignore[misc]
            row = spec.nbytes // spec.shape[0] if spec.shape and spec.shape[0] else 0
            spec = spec._replace(
                shape=(size, *spec.shape[1:]), start=spec.start + first * row, end=spec.start + (first + size) * row
            )
            part = None
        if not skip:
            tensors += 1
            nbytes += spec.nbytes
        target = None
        if dest is not None and not skip and part is None and spec.nbytes >= DIRECT_MIN_BYTES:
            target = dest(name, spec)  # type: ignore[arg-type]
        if local or spec.nbytes >= chunk_bytes or target is not None:
            item = Item(spec, name or spec.name, 0, target, skip, part)
            units.append(Unit(sources[spec.shard], spec.start, spec.nbytes, [item], target is not None, local))
            group = None
            continue
        if (
            group is None
            or group.source is not sources[spec.shard]
            or spec.start != group.start + group.nbytes
            or spec.end - group.start > group_bytes
        ):
            group = Unit(sources[spec.shard], spec.start)
            units.append(group)
        group.items.append(Item(spec, name or spec.name, spec.start - group.start, target, skip, part))
        group.nbytes = spec.end - group.start
    return Plan(units, tensors, nbytes)
