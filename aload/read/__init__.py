"""From a checkpoint to tensors: the read plan (``plan``), the budgeted concurrent reader
(``reader``), one read shared by the ranks of a process group (``share``), the pool of host buffers reads
bound for a device pass through (``staging``), and shard digests checked from the bytes as they pass (``verify``)."""

from .plan import DestFn, Item, NameFn, Plan, SliceFn, Unit, make_plan
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
from .share import DEFAULT_GROUP_TIMEOUT_S, Share
from .staging import DEFAULT_PINNED_BYTES, Staging
from .verify import Manifest, ShardHash, digests_for

__all__ = [
    "DEFAULT_CONCURRENCY",
    "DEFAULT_GROUP_TIMEOUT_S",
    "DEFAULT_MAX_INFLIGHT_BYTES",
    "DEFAULT_PINNED_BYTES",
    "DestFn",
    "Item",
    "Manifest",
    "NameFn",
    "Plan",
    "Progress",
    "Reader",
    "ReaderStats",
    "Share",
    "ShardHash",
    "SliceFn",
    "Staging",
    "Unit",
    "check_positive",
    "cut",
    "digests_for",
    "first_tensor",
    "make_plan",
]
