"""``model.safetensors.index.json``: which file holds each tensor, checked before any is opened."""

from __future__ import annotations

import json
import posixpath
from typing import Any
from urllib.parse import unquote

from ..errors import CheckpointError
from .header import unique_keys

MAX_INDEX_BYTES = 64 * 1024 * 1024


def parse_index(raw: bytes, url: str) -> tuple[dict[str, str], dict[str, Any], list[str]]:
    """The index's weight map, its metadata, and the files it names (sorted)."""
    try:
        obj = json.loads(raw, object_pairs_hook=unique_keys)
    except RecursionError:
        raise CheckpointError("index JSON is nested too deeply", url=url) from None
    except (UnicodeDecodeError, ValueError) as exc:
        raise CheckpointError(f"index is not valid UTF-8 JSON: {exc}", url=url) from exc
    weight_map = obj.get("weight_map") if type(obj) is dict else None
    if type(weight_map) is not dict:
        raise CheckpointError("index needs a weight_map of tensor names to file names", url=url)
    first: dict[str, str] = {}  # each file, with the first tensor the index places in it
    for tensor, fname in weight_map.items():
        if type(fname) is not str:
            raise CheckpointError("index needs a weight_map of tensor names to file names", url=url, tensor=tensor)
        first.setdefault(fname, tensor)
    for fname, tensor in first.items():
        check_relative(fname, url, tensor)
    metadata = obj.get("metadata") or {}
    if type(metadata) is not dict:
        raise CheckpointError("index metadata must be an object", url=url)
    return weight_map, metadata, sorted(first)


def check_relative(fname: str, url: str, tensor: str | None = None) -> None:
    """A shard name must be a plain relative path that stays inside the checkpoint's folder,
    also once percent-decoded, with no query or fragment (it may become part of a URL)."""
    decoded = unquote(fname)
    norm = posixpath.normpath(decoded.replace("\\", "/"))
    if (
        not fname
        or any(c in fname for c in "?#\x00")
        or "://" in decoded
        or norm.startswith("/")
        or norm == ".."
        or norm.startswith("../")
        or (len(decoded) > 1 and decoded[1] == ":")
    ):
        raise CheckpointError(f"index names a file outside the checkpoint: {fname!r}", url=url, tensor=tensor)
