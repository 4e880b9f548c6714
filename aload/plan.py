"""The read plan: which byte ranges to read, in which order, into what.

Tensors are taken in shard order, then offset order. Neighbouring small tensors coalesce into
one unit of up to ``chunk_bytes`` (a source's ``mapped_run_bytes`` where they are views of memory
that needs no read), the first few units smaller (``FIRST_GROUP_BYTES``); a gap left
by a pruned tensor, or a tensor whose offset would be misaligned for its dtype, starts a new unit.
A large tensor is a unit of its own, read later as several chunks in parallel. A tensor whose
destination is known is read straight into it: a large one by its own reads, a run of small ones
(where the source can) by one scattering read into all of theirs (a ``scatter`` unit), made by
the consumer's thread or, from a file all in the page cache, by a read thread (``filled``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from ._json import gc_paused
from ._threads import CHECK_EVERY, Pacer
from .checkpoint import Checkpoint
from .format import ITEMSIZE, TensorSpec, _new_tuple, untrack
from .sources import Source

#: Tensors smaller than this are read coalesced, never one read each, even when their destination
#: is known (20,000 tensors of 256 bytes took ~400 us each read one by one): into a buffer and
#: copied, or, from a source that scatters, by one read filling a run of destinations. A source's
#: ``scatter_below`` takes larger tensors into such runs too (a local file's, up to 16 MiB).
DIRECT_MIN_BYTES = 1 << 20

#: The first unit of coalesced small tensors holds up to this many bytes, the next twice as many,
#: and so on up to ``chunk_bytes``: the consumer starts on the first tensors after one small read
#: instead of a whole chunk's (on a cold disk, 16 MiB took 20-80 ms to arrive).
FIRST_GROUP_BYTES = 256 << 10

#: Runs that a read thread fills (``Unit.filled``) hold up to this many bytes (the first ones
#: less, as ``FIRST_GROUP_BYTES`` says): every unit costs a round trip through the event loop
#: between two reads, in which a read thread waited ~0.7 ms for the loop and the GIL on 2 cores.
#: A Qwen2.5-0.5B-shaped checkpoint, warm, read ~7 units a layer; in runs, one.
FILLED_RUN_BYTES = 64 << 20
#: A filled run starts at a tensor of at least this many bytes and holds at most
#: ``FILLED_RUN_TENSORS``; smaller ones join one (a layer's norms between its matrices: split off,
#: they made 4 units a layer of the Qwen-shaped checkpoint, ~20% slower) or stay in runs their
#: consumer fills. A read thread listing thousands of tiny buffers for ``preadv`` (~0.6 us of
#: Python each) takes the GIL from the event loop (20,000 tensors of 4 KiB scattered on the read
#: threads: loop lateness p99 6.2-13.3 against 3.2-4.1 ms).
FILLED_MIN_BYTES = 64 << 10
FILLED_RUN_TENSORS = 256

#: Plan-time renaming: the final name of a tensor, or None to drop it unread.
NameFn = Callable[[str], "str | None"]
#: The tensor to read ``spec`` straight into (contiguous, same dtype and size; on a GPU, read
#: through pinned memory), or None.
DestFn = Callable[[str, TensorSpec], "torch.Tensor | None"]


class Item(NamedTuple):
    """One tensor of a unit: a tuple the garbage collector is told not to track
    (``format.untrack``), as each ``TensorSpec``. It holds leaves and, in a ``scatter`` unit, the
    model's own parameter, which the model keeps alive and which refers to no ``Item``: a cycle
    through it cannot be made, and an untracked tuple only keeps what it holds alive."""

    spec: TensorSpec
    name: str
    offset: int  # within the unit
    skip: bool = False  # read (for a digest) but not delivered
    dest: torch.Tensor | None = None  # of a small tensor in a ``scatter`` unit: read straight into it


@dataclass
class Unit:
    """One buffer's worth of reads: a run of contiguous small tensors or one large tensor."""

    source: Source
    start: int
    nbytes: int = 0
    items: list[Item] = field(default_factory=list)
    dest: torch.Tensor | None = None
    #: Every item has its own ``dest``, and one scattering read (``Source.scatter_into``) fills them all.
    scatter: bool = False
    #: A ``scatter`` unit that the reader fills, on a read thread (``Source.scatter_read``), before
    #: handing it on; otherwise the reader only brings its bytes in and its consumer fills it.
    filled: bool = False
    #: ``dest`` is this load's own and the consumer's once handed out: ``run_at`` lets go of it,
    #: so that the consumer's dropping it frees it (``load(weights_on_device=True)``).
    handed_off: bool = False

    @property
    def on_device(self) -> bool:
        """Bound for a GPU parameter: read through pinned memory a piece at a time (``Reader._read_staged``)."""
        return self.dest is not None and not self.dest.is_cpu

    @property
    def in_place(self) -> bool:
        """Read straight into its destination(s): no buffer of the budget's."""
        return self.dest is not None or self.scatter

    def chunks(self, chunk_bytes: int) -> Iterator[tuple[int, int]]:
        """(offset within the unit, length) of each read."""
        for off in range(0, self.nbytes, chunk_bytes):
            yield off, min(chunk_bytes, self.nbytes - off)


@dataclass
class Plan:
    units: list[Unit]
    tensors: int
    nbytes: int


def make_plan(
    ckpt: Checkpoint,
    names: NameFn | None,
    dest: DestFn | None,
    chunk_bytes: int,
    read_all: bool = False,
    run_bytes: int = 0,
    on_device: bool = False,
) -> Plan:
    """``read_all``: read dropped tensors too (without delivering them), so that every byte of
    every shard passes through in file order, as a digest needs. ``run_bytes``: the most a unit
    of a source's ``mapped_run_bytes`` may hold (a share of the budget; 0: ``chunk_bytes``).
    ``on_device``: a destination off the CPU (a GPU's) is taken, its unit read through pinned
    memory; else, and where every byte passes a digest, it is no destination.

    The cyclic collector is paused meanwhile (``gc_paused``): each ``Item`` is untracked, but
    still counted as it is made, and 20,000 of them set off ~28 collections of the youngest
    generation, which step the process towards its next full one (in a fresh process, its first:
    112-187 ms holding the GIL, in the middle of the load)."""
    with gc_paused:
        return _make_plan(ckpt, names, dest, chunk_bytes, read_all, run_bytes, on_device and not read_all)


def _make_plan(
    ckpt: Checkpoint,
    names: NameFn | None,
    dest: DestFn | None,
    chunk_bytes: int,
    read_all: bool,
    run_bytes: int,
    on_device: bool,
) -> Plan:
    units: list[Unit] = []
    tensors = nbytes = 0
    group: Unit | None = None
    groups = 0  # coalesced units so far: they start small and double (see FIRST_GROUP_BYTES)
    limit = chunk_bytes
    # Written for speed (89,820 tensors: 121 ms before): the open group's extent kept in locals,
    # no call per tensor (Items made by ``_new_tuple``), the pause checked every CHECK_EVERY tensors.
    g_start = g_end = 0
    g_shard = s_shard = m_shard = ""
    s_below = 0
    s_src: Source | None = None
    m_limit = chunk_bytes  # coalesced units without a destination, in the shard m_shard
    # Small tensors with a destination are read straight into it where the source can scatter
    # one read over many buffers; not when every byte must pass through a digest in order.
    scatter = dest is not None and not read_all
    pace = Pacer()
    for i, spec in enumerate(ckpt.specs.values(), 1):
        if i % CHECK_EVERY == 0:
            pace()
        name = names(spec.name) if names is not None else spec.name
        skip = name is None
        start, end = spec.start, spec.end
        n = end - start
        if name is None:
            if not read_all:
                group = None  # the gap it leaves is never read
                continue
            name = spec.name
        else:
            tensors += 1
            nbytes += n
        target = None
        if dest is not None and not skip:
            if scatter and spec.shard != s_shard:  # what the shard's source can scatter, once a shard
                s_shard, s_below, s_src = spec.shard, _scatter_below(ckpt, spec), ckpt.source(spec)
            below = s_below
            if (
                below > DIRECT_MIN_BYTES
                and n >= FILLED_MIN_BYTES
                and s_src is not None
                and not s_src.scatters_at(start, n)
            ):
                below = DIRECT_MIN_BYTES  # these bytes are on disk: as a shard that scatters small ones only
            if n >= DIRECT_MIN_BYTES or n < below:
                target = dest(name, spec)
                if target is not None and not on_device and not target.is_cpu:
                    target = None  # no stream to copy it on, or a digest to pass: read into a buffer
        else:
            below = s_below
        # A GPU destination (at least DIRECT_MIN_BYTES, ``Loader.destinations``) is a unit of its
        # own: a scattering read fills host memory only.
        if n > chunk_bytes or (target is not None and (n >= max(DIRECT_MIN_BYTES, below) or not target.is_cpu)):
            item = _new_tuple(Item, (spec, name, 0, skip, None))
            untrack(item)
            units.append(Unit(ckpt.source(spec), start, n, [item], target))
            group = None
            continue
        filled = target is not None and n >= FILLED_MIN_BYTES and below > DIRECT_MIN_BYTES
        if spec.shard != m_shard:
            m_shard = spec.shard
            m_limit = max(chunk_bytes, min(ckpt.source(spec).mapped_run_bytes, run_bytes))
        if (
            group is None
            or start != g_end
            or spec.shard != g_shard
            or (start - g_start) % ITEMSIZE[spec.dtype]
            or end - g_start > limit
            or (target is not None) != group.scatter
            or (filled and not group.filled)
            or (group.filled and len(group.items) >= FILLED_RUN_TENSORS)
        ):
            group = Unit(ckpt.source(spec), start, scatter=target is not None, filled=filled)
            units.append(group)
            g_start, g_shard = start, spec.shard
            limit = FILLED_RUN_BYTES if filled else chunk_bytes if target is not None else m_limit
            limit = min(limit, FIRST_GROUP_BYTES << groups)
            groups = min(groups + 1, 32)
        item = _new_tuple(Item, (spec, name, start - g_start, skip, target))
        untrack(item)
        group.items.append(item)
        g_end = end
        group.nbytes = end - g_start
    return Plan(units, tensors, nbytes)


def _scatter_below(ckpt: Checkpoint, spec: TensorSpec) -> int:
    """Tensors of ``spec``'s shard under this many bytes, with a destination, are read in runs by
    one scattering read each (0: none are). Larger ones than the plan's small ones where the
    source says so; runs of those are ``filled`` on a read thread (on the loader's thread, the
    copies of a shard's 8 MiB tensors ran beside the read threads' copies of its large ones:
    three busy threads on two cores, a Llama-shaped 1 GiB's loop lateness p99 2.8-4.1 -> 4.5-8.1
    ms)."""
    src = ckpt.source(spec)
    if not src.scatters:
        return 0
    return max(DIRECT_MIN_BYTES, src.scatter_below)
