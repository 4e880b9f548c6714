"""A checkpoint: its shards, their tensors, its metadata. Assembled from headers already read
(``aload.sources.open_checkpoint`` reads them); every tensor in exactly one shard, and in the
shard the index names."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from ..errors import CheckpointError
from .header import TensorSpec

INDEX_NAME = "model.safetensors.index.json"


class _Closable(Protocol):
    url: str

    async def aclose(self) -> None: ...


@dataclass(frozen=True)
class Shard:
    """One safetensors file of a checkpoint: ``name`` relative to the checkpoint ("" for a
    single-file checkpoint), its URL or path, size, metadata and tensors in offset order."""

    name: str
    url: str
    size: int
    metadata: dict[str, str]
    specs: tuple[TensorSpec, ...]
    #: Length prefix and header: what a digest of the file starts with.
    head: bytes = field(default=b"", repr=False, compare=False)


@dataclass
class Checkpoint:
    """Shards, per-tensor specs (shard order, then offset order), metadata and total bytes.

    An async context manager: closing it closes every file and connection it opened.
    """

    url: str
    shards: tuple[Shard, ...]
    specs: dict[str, TensorSpec]
    metadata: dict[str, Any]
    store: Any = field(repr=False)

    @property
    def total_bytes(self) -> int:
        return sum(s.nbytes for s in self.specs.values())

    async def aclose(self) -> None:
        await self.store.aclose()

    async def __aenter__(self) -> Checkpoint:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


def assemble(
    store: _Closable, shards: list[Shard], metadata: dict[str, Any], index: dict[str, str] | None
) -> Checkpoint:
    """The checkpoint of ``shards``; with an ``index``, each tensor must be where it says."""
    specs: dict[str, TensorSpec] = {}
    for shard in shards:
        for spec in shard.specs:
            if spec.name in specs:
                raise CheckpointError(
                    f"tensor is in two shards: {specs[spec.name].shard} and {shard.url}",
                    url=store.url,
                    tensor=spec.name,
                )
            if index is not None and index.get(spec.name) != shard.name:
                placed = index.get(spec.name)
                why = f"the index places it in {placed!r}" if placed else "the index does not list it"
                raise CheckpointError(f"tensor found in {shard.name!r} but {why}", url=store.url, tensor=spec.name)
            specs[spec.name] = spec
    if index is not None and len(index) != len(specs):
        tensor = next(t for t in index if t not in specs)
        raise CheckpointError(
            f"the index places it in {index[tensor]!r}, which does not hold it", url=store.url, tensor=tensor
        )
    return Checkpoint(store.url, tuple(shards), specs, metadata, store)
