"""Shard digests: the SHA-256 of every shard, computed from the bytes as they stream (no second
read) and compared with a manifest the user gives.

A manifest is one of:
- a mapping of shard file name to hex digest;
- a ``sha256sum`` file (``<hex>  <name>`` per line);
- a JSON object of name to hex digest, or a Hugging Face model-info answer
  (``GET /api/models/{repo}?blobs=true``: ``siblings[].rfilename`` and ``.lfs.sha256``);
- a Git LFS pointer file (``oid sha256:<hex>``) for a single-file checkpoint, or a folder of
  them named like the shards (a clone made with ``GIT_LFS_SKIP_SMUDGE=1``).
"""

from __future__ import annotations

import hashlib
import json
import os
import posixpath
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Union

from ..errors import CheckpointError, UsageError
from ..format import Checkpoint, Shard

#: What ``verify=`` takes.
Manifest = Union[Mapping[str, str], str, "os.PathLike[str]"]

MAX_MANIFEST_BYTES = 16 * 1024 * 1024
_HEX = re.compile(r"[0-9a-fA-F]{64}")
_LFS = re.compile(r"^version https://git-lfs\.github\.com/spec/v1\s*$", re.M)
_LFS_OID = re.compile(r"^oid sha256:([0-9a-fA-F]{64})\s*$", re.M)


def shard_key(shard: Shard) -> str:
    """The name a manifest knows a shard by: its file name within the checkpoint."""
    return shard.name or posixpath.basename(shard.url.rstrip("/"))


async def digests_for(manifest: Manifest, ckpt: Checkpoint) -> dict[str, str]:
    """Shard URL -> expected lowercase hex SHA-256, for every shard of ``ckpt``."""
    if isinstance(manifest, Mapping):
        table, where = dict(manifest), "the digests given"
    elif isinstance(manifest, str | os.PathLike):
        where = os.fspath(manifest)
        table = await ckpt.store.run(_read_manifest, Path(where), [shard_key(s) for s in ckpt.shards])
    else:
        raise UsageError(f"verify= takes a mapping of shard name to SHA-256 or a manifest path, got {manifest!r}")
    by_name: dict[str, str] = {}
    for name, digest in table.items():
        if not isinstance(name, str) or not isinstance(digest, str) or not _HEX.fullmatch(digest):
            raise UsageError(f"{where}: {name!r} needs a SHA-256 of 64 hex digits, got {digest!r}")
        by_name[posixpath.normpath(name.replace("\\", "/"))] = digest.lower()
    out: dict[str, str] = {}
    for shard in ckpt.shards:
        key = shard_key(shard)
        found = by_name.get(key) or by_name.get(posixpath.basename(key))
        if found is None:
            raise CheckpointError(f"{where} has no SHA-256 for this shard ({key!r})", url=shard.url)
        out[shard.url] = found
    return out


def _read_manifest(path: Path, shards: list[str]) -> dict[str, str]:
    if path.is_dir():
        table = {}
        for name in shards:
            pointer = path / name
            if pointer.is_file():
                table[name] = _lfs_oid(_read_text(pointer), pointer)
        return table
    text = _read_text(path)
    if _LFS.search(text):
        if len(shards) != 1:
            raise UsageError(f"{path}: one LFS pointer, but the checkpoint has {len(shards)} shards")
        return {shards[0]: _lfs_oid(text, path)}
    if text.lstrip().startswith("{"):
        return _from_json(text, path)
    table = {}
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        parts = line.strip().split(maxsplit=1)
        if len(parts) != 2 or not _HEX.fullmatch(parts[0]):
            raise UsageError(f"{path}:{n}: expected '<sha256>  <file name>', got {line[:120]!r}")
        table[parts[1].lstrip("*")] = parts[0]
    return table


def _read_text(path: Path) -> str:
    try:
        with path.open("rb") as f:
            raw = f.read(MAX_MANIFEST_BYTES + 1)
    except OSError as exc:
        raise UsageError(f"cannot read the manifest {path}: {exc.strerror or exc}") from exc
    if len(raw) > MAX_MANIFEST_BYTES:
        raise UsageError(f"{path}: manifest larger than {MAX_MANIFEST_BYTES} bytes")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UsageError(f"{path}: manifest is not UTF-8 text") from exc


def _lfs_oid(text: str, path: Path) -> str:
    m = _LFS_OID.search(text)
    if not _LFS.search(text) or m is None:
        raise UsageError(f"{path}: not a Git LFS pointer with an 'oid sha256:' line")
    return m.group(1)


def _from_json(text: str, path: Path) -> dict[str, str]:
    try:
        obj: Any = json.loads(text)
    except ValueError as exc:
        raise UsageError(f"{path}: manifest is not valid JSON: {exc}") from exc
    if isinstance(obj, dict) and isinstance(obj.get("siblings"), list):  # Hugging Face model info
        return {
            s["rfilename"]: s["lfs"]["sha256"]
            for s in obj["siblings"]
            if isinstance(s, dict) and isinstance(s.get("lfs"), dict) and "rfilename" in s and "sha256" in s["lfs"]
        }
    if not isinstance(obj, dict):
        raise UsageError(f"{path}: a JSON manifest maps file names to SHA-256 digests")
    return obj


class ShardHash:
    """The running SHA-256 of one shard: its header first, then its data in file order."""

    __slots__ = ("expected", "hashed", "sha", "shard")

    def __init__(self, shard: Shard, expected: str) -> None:
        self.shard = shard
        self.expected = expected
        self.sha = hashlib.sha256()
        self.hashed = 0

    def update(self, data: Any) -> None:
        """Runs on a helper thread: hashlib lets go of the GIL for large buffers. The header
        (up to 100 MB) is hashed here with the first data, not on the event loop."""
        if not self.hashed:
            self.sha.update(self.shard.head)
            self.hashed = len(self.shard.head)
        self.sha.update(data)
        self.hashed += memoryview(data).nbytes

    def check(self) -> None:
        if not self.hashed:  # a shard without tensor bytes: its digest is the header's
            self.update(b"")
        if self.hashed != self.shard.size:
            raise CheckpointError(f"verified {self.hashed} of the shard's {self.shard.size} bytes", url=self.shard.url)
        actual = self.sha.hexdigest()
        if actual != self.expected:
            raise CheckpointError(
                f"SHA-256 mismatch: the manifest says {self.expected}, the bytes read hash to {actual}",
                url=self.shard.url,
            )
