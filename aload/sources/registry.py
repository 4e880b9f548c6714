"""Stores by URL scheme, imported when first used, with the install hint where a client is missing."""

from __future__ import annotations

import importlib
import inspect
from typing import Any
from urllib.parse import urlparse

from ..errors import UsageError
from .base import Store

#: scheme -> ("module:Class", the extra that installs its client)
STORES: dict[str, tuple[str, str | None]] = {
    "": ("aload.sources.local:LocalStore", None),
    "file": ("aload.sources.local:LocalStore", None),
    "http": ("aload.sources.remote:RemoteStore", "remote"),
    "https": ("aload.sources.remote:RemoteStore", "remote"),
    "s3": ("aload.sources.remote:RemoteStore", "remote"),
    "gs": ("aload.sources.remote:RemoteStore", "remote"),
    "az": ("aload.sources.remote:RemoteStore", "remote"),
    "azure": ("aload.sources.remote:RemoteStore", "remote"),
    "abfs": ("aload.sources.remote:RemoteStore", "remote"),
    "abfss": ("aload.sources.remote:RemoteStore", "remote"),
    "hf": ("aload.sources.hub:HubStore", "remote"),
}


def scheme_of(url: str) -> str:
    return urlparse(url).scheme.lower() if "://" in url else ""


def open_store(url: str, *, concurrency: int, **options: Any) -> Store:
    """The Store for ``url``, chosen by its scheme."""
    scheme = scheme_of(url)
    if scheme not in STORES:
        known = ", ".join(sorted(s + "://" for s in STORES if s))
        raise UsageError(f"no source for scheme {scheme!r} (known: {known}, or a local path)", url=url)
    target, extra = STORES[scheme]
    module_name, cls_name = target.split(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        hint = f": pip install 'aload[{extra}]'" if extra else ""
        raise UsageError(f"{scheme}:// needs an optional dependency{hint}", url=url) from exc
    cls = getattr(module, cls_name)
    takes = [p for p in inspect.signature(cls.__init__).parameters if p not in ("self", "url", "concurrency")]
    unknown = sorted(set(options) - set(takes))
    if unknown:
        raise UsageError(
            f"{', '.join(map(repr, unknown))}: not an option of aload.open/stream/load, nor of a "
            f"{scheme or 'local'} source (which takes: {', '.join(takes)})"
        )
    store: Store = cls(url, concurrency, **options)
    return store
