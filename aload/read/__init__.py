"""From a checkpoint to tensors: the read plan (``plan``), the budgeted concurrent reader
(``reader``), and shard digests checked from the bytes as they pass (``verify``)."""

from .plan import DestFn, Item, NameFn, Plan, Unit, make_plan
from .reader import (
    DEFAULT_CONCURRENCY,
    DEFAULT_MAX_INFLIGHT_BYTES,
    Progress,
    Reader,
    ReaderStats,
    check_positive,
    cut,
    first_tensor,
)
from .verify import Manifest, ShardHash, digests_for

__all__ = [
    "DEFAULT_CONCURRENCY",
    "DEFAULT_MAX_INFLIGHT_BYTES",
    "DestFn",
    "Item",
    "Manifest",
    "NameFn",
    "Plan",
    "Progress",
    "Reader",
    "ReaderStats",
    "ShardHash",
    "Unit",
    "check_positive",
    "cut",
    "digests_for",
    "first_tensor",
    "make_plan",
]
