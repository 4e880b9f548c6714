"""Stages: lazy transforms over the stream of ``(name, tensor)`` pairs, one pair at a time.

A stage is a callable from an async iterator of pairs to an async iterator of pairs. Stages
that decide by name alone (``keep``, ``drop``, ``rename`` and the name recipes) also carry
``name_fn``; the leading run of such stages is applied to the read plan, so the bytes of a
dropped tensor are never read. Compose with a tuple or with ``|``.

Recipes for what the engines do today sit at the bottom, each a few lines on the generic stages.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from typing import Union

import torch

from .errors import UsageError, add_note
from .read.plan import SliceFn

Pair = tuple[str, torch.Tensor]
Pattern = Union[str, "re.Pattern[str]", Callable[[str], bool]]


class Stage:
    """Base of every stage; ``name_fn`` is set when the stage decides by name alone."""

    name_fn: Callable[[str], str | None] | None = None

    def __call__(self, items: AsyncIterator[Pair]) -> AsyncIterator[Pair]:
        raise NotImplementedError

    def __or__(self, other: Stage) -> Stage:
        return Chain((self, other))


class Chain(Stage):
    def __init__(self, stages: Iterable[Stage]) -> None:
        self.stages = tuple(flatten(stages))

    def __call__(self, items: AsyncIterator[Pair]) -> AsyncIterator[Pair]:
        for stage in self.stages:
            items = stage(items)
        return items

    def __repr__(self) -> str:
        return " | ".join(repr(s) for s in self.stages)


class NameStage(Stage):
    """Renames or drops by name: ``fn(name)`` returns the new name, or None to drop."""

    def __init__(self, fn: Callable[[str], str | None], label: str) -> None:
        self.name_fn = fn
        self._label = label

    async def __call__(self, items: AsyncIterator[Pair]) -> AsyncIterator[Pair]:
        fn = self.name_fn
        assert fn is not None
        async for name, tensor in items:
            new = _guarded(self, name, fn, name)
            if isinstance(new, str):
                yield new, tensor

    def __repr__(self) -> str:
        return self._label


class MapStage(Stage):
    """``fn(name, tensor)`` returns a tensor, or None to drop the pair."""

    def __init__(self, fn: Callable[[str, torch.Tensor], torch.Tensor | None], match: Pattern | None) -> None:
        self._fn = fn
        self._match = _predicate(match) if match is not None else None

    async def __call__(self, items: AsyncIterator[Pair]) -> AsyncIterator[Pair]:
        async for name, tensor in items:
            if self._match is None or self._match(name):
                out = _guarded(self, name, self._fn, name, tensor)
                del tensor  # the input's buffer may be released as soon as fn is done with it
                if out is None:
                    continue
                assert isinstance(out, torch.Tensor), f"map function returned {type(out).__name__}, not a tensor"
                tensor = out
            yield name, tensor

    def __repr__(self) -> str:
        return f"map({getattr(self._fn, '__name__', self._fn)!s})"


def _guarded(stage: Stage, name: str, fn: Callable[..., object], *args: object) -> object:
    try:
        return fn(*args)
    except Exception as exc:
        add_note(exc, f"aload: raised by stage {stage!r} on tensor {name!r}")
        raise


def flatten(stages: Iterable[Stage] | Stage) -> list[Stage]:
    if isinstance(stages, Stage) or (callable(stages) and not isinstance(stages, Iterable)):
        stages = (stages,)  # one stage, a Stage or a plain async generator function
    out: list[Stage] = []
    for stage in stages:
        if isinstance(stage, Chain):
            out.extend(stage.stages)
        elif isinstance(stage, Stage) or callable(stage):
            out.append(stage)
        else:
            raise UsageError(f"a stage must be callable over an async iterator of pairs, got {stage!r}")
    return out


def split_for_plan(
    stages: Iterable[Stage] | Stage,
) -> tuple[Callable[[str], str | None] | None, SliceFn | None, list[Stage]]:
    """The leading name-only stages as one name function (applied to the read plan), a slicing
    stage right after them as the plan's slice function (only the kept part is read), and the
    rest, applied to the tensors."""
    flat = flatten(stages)
    n = 0
    while n < len(flat) and getattr(flat[n], "name_fn", None) is not None:
        n += 1
    slices = None
    if n < len(flat) and isinstance(flat[n], SliceStage):
        slices = flat[n].slice_fn  # type: ignore[attr-defined]
        rest = flat[n + 1 :]
    else:
        rest = flat[n:]
    if n == 0:
        return None, slices, rest
    fns = [s.name_fn for s in flat[:n]]

    def names(name: str) -> str | None:
        for fn in fns:
            assert fn is not None
            new = fn(name)
            if new is None:
                return None
            name = new
        return name

    return names, slices, rest


def _predicate(pattern: Pattern) -> Callable[[str], bool]:
    if callable(pattern) and not isinstance(pattern, re.Pattern):
        return pattern
    if isinstance(pattern, (str, re.Pattern)):
        rx = re.compile(pattern)
        return lambda name: rx.search(name) is not None
    raise UsageError(f"a name pattern must be a regex or a predicate, got {pattern!r}")


def _any(patterns: Sequence[Pattern]) -> Callable[[str], bool]:
    if not patterns:
        raise UsageError("give at least one pattern or predicate")
    preds = [_predicate(p) for p in patterns]
    return lambda name: any(p(name) for p in preds)


def keep(*patterns: Pattern) -> Stage:
    """Keep the tensors whose name matches any pattern (``re.search``) or predicate."""
    match = _any(patterns)
    return NameStage(lambda n: n if match(n) else None, f"keep{patterns!r}")


def drop(*patterns: Pattern) -> Stage:
    """Drop the tensors whose name matches any pattern (``re.search``) or predicate."""
    match = _any(patterns)
    return NameStage(lambda n: None if match(n) else n, f"drop{patterns!r}")


def rename(
    rule: Callable[[str], str | None] | str | Sequence[tuple[str, str]], replacement: str | None = None
) -> Stage:
    """Rename by a function, by ``(pattern, replacement)`` (``re.sub``), or by a table of them
    applied in order. A function may return None to drop the tensor."""
    if callable(rule):
        return NameStage(rule, f"rename({getattr(rule, '__name__', rule)})")
    table = [(rule, replacement)] if isinstance(rule, str) else list(rule)
    if any(not isinstance(p, str) or not isinstance(r, str) for p, r in table):
        raise UsageError("rename takes a function, (pattern, replacement), or a list of such pairs")
    compiled = [(re.compile(p), str(r)) for p, r in table]

    def sub(name: str) -> str:
        for rx, repl in compiled:
            name = rx.sub(repl, name)
        return name

    return NameStage(sub, f"rename({table!r})")


def map(fn: Callable[[str, torch.Tensor], torch.Tensor | None], *, match: Pattern | None = None) -> Stage:
    """Transform each tensor: ``fn(name, tensor)`` returns a tensor, or None to drop it.
    With ``match``, only matching names go through ``fn``; the rest pass unchanged."""
    return MapStage(fn, match)


# -- recipes ----------------------------------------------------------------------------------


def select_mtp_layer(
    index: int, *, pattern: str = r"^model\.mtp\.layers\.(\d+)\.", target: str = "model.mtp.layers.0."
) -> Stage:
    """Keep one MTP/draft layer and remap it to layer 0; other MTP layers are never read
    (sglang's ``_filter_mtp_weights``). Names outside the MTP pattern pass unchanged."""
    rx = re.compile(pattern)

    def pick(name: str) -> str | None:
        m = rx.match(name)
        if m is None:
            return name
        return None if int(m.group(1)) != index else target + name[m.end() :]

    return NameStage(pick, f"select_mtp_layer({index})")


def weight_scale_inv() -> Stage:
    """``*.weight_scale`` -> ``*.weight_scale_inv`` (the name mxfp8/fp8 block-quantized models expect)."""
    return rename(r"\.weight_scale$", ".weight_scale_inv")


def select_experts(experts: Iterable[int], *, pattern: str = r"\.experts\.(\d+)\.", renumber: bool = True) -> Stage:
    """Expert parallelism: keep only this rank's experts (others are never read), numbered
    from 0 in the order given when ``renumber``. Names without an expert index pass unchanged."""
    local = {e: i for i, e in enumerate(experts)}
    rx = re.compile(pattern)

    def pick(name: str) -> str | None:
        m = rx.search(name)
        if m is None:
            return name
        idx = local.get(int(m.group(1)))
        if idx is None:
            return None
        if not renumber:
            return name
        return name[: m.start(1)] + str(idx) + name[m.end(1) :]

    return NameStage(pick, f"select_experts({sorted(local)})")


class SliceStage(MapStage):
    """A stage that keeps a part of some tensors (``slice_fn(name, shape) -> (dim, start, size)``
    or None). Right after the name stages (or first), it is planned: only a dim-0 part's bytes are
    read; a part on another dim is cut from the whole tensor. Elsewhere it narrows as it goes."""

    def __init__(self, slice_fn: SliceFn, label: str) -> None:
        self.slice_fn = slice_fn
        self._label = label

        def narrow(name: str, t: torch.Tensor) -> torch.Tensor:
            part = slice_fn(name, tuple(t.shape))
            return t if part is None else t.narrow(*part)

        super().__init__(narrow, None)

    def __repr__(self) -> str:
        return self._label


def tensor_parallel(
    rank: int, world_size: int, *, column: Sequence[Pattern] = (), row: Sequence[Pattern] = ()
) -> Stage:
    """Tensor parallelism: this rank's slice of column-parallel weights (dim 0) and row-parallel
    weights (dim 1); other tensors pass unchanged. Planned where it comes right after the name
    stages (or first): a column-parallel weight's rows are the only bytes read, so the ranks of a
    group read different bytes for them and share none of it; a row-parallel weight is read
    whole (and shared) and its slice delivered as a view."""
    if not 0 <= rank < world_size:
        raise UsageError(f"rank must be in [0, {world_size}), got {rank}")
    is_col = _any(column) if column else (lambda n: False)
    is_row = _any(row) if row else (lambda n: False)

    def part(name: str, shape: tuple[int, ...]) -> tuple[int, int, int] | None:
        dim = 0 if is_col(name) and shape else 1 if is_row(name) and len(shape) > 1 else None
        if dim is None:
            return None
        if shape[dim] % world_size:
            raise UsageError(f"dim {dim} of size {shape[dim]} does not split {world_size} ways", tensor=name)
        size = shape[dim] // world_size
        return dim, rank * size, size

    return SliceStage(part, f"tensor_parallel({rank}, {world_size})")


def permute_qk_for_rotary(*, num_heads: int, num_kv_heads: int, head_dim: int, hidden_size: int) -> Stage:
    """Permute Q/K projection rows from interleaved to half-split rotary layout (vLLM's Llama-4
    ``permute_qk_weight_for_rotary``): per head, rows (i, pair) become (pair, i)."""

    def permute(name: str, w: torch.Tensor) -> torch.Tensor:
        parts = name.split(".")
        heads = num_kv_heads if ("k_proj" in parts or "wk" in parts) else num_heads
        rows = head_dim * heads
        return w.view(heads, rows // heads // 2, 2, hidden_size).transpose(1, 2).reshape(rows, hidden_size)

    return map(permute, match=r"(^|\.)(q_proj|k_proj|wq|wk)\.weight$")
