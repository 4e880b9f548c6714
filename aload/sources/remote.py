"""Remote checkpoints, all through one client, obstore: ``s3://BUCKET/PREFIX``,
``http(s)://HOST/PATH``. Configuration comes from each ecosystem's environment (``AWS_*``,
incl. ``AWS_ENDPOINT_URL``) and from the ``config``/``client_options`` options, which go to
``obstore.store.from_url`` unchanged. Every range read is pinned to the object's ETag when
the server gives one, so an object replaced mid-load is an error, never mixed bytes."""

from __future__ import annotations

import os
import posixpath
import threading
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import numpy as np
import obstore
import obstore.exceptions as oe
from obstore.store import from_url

from ..errors import SourceError, UsageError
from .base import Source, Store, aligned_empty, byte_view


def redact(url: str) -> str:
    """``url`` without user info, query or fragment: what errors and logs may show."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    if parts.port:
        host = f"{host}:{parts.port}"
    return urlunsplit((parts.scheme, host, parts.path, "", ""))


_NOT_FOUND = "not found"


def _translate(exc: Exception, url: str, byte_range: tuple[int, int] | None = None) -> SourceError:
    """An obstore error as a ``SourceError`` naming the URL (never its secrets) and the cause."""
    if isinstance(exc, (oe.NotFoundError, FileNotFoundError)):
        why = _NOT_FOUND
    elif isinstance(exc, (oe.PermissionDeniedError, oe.UnauthenticatedError, PermissionError)):
        why = "access refused: check the credentials (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, AWS_PROFILE)"
    elif isinstance(exc, oe.PreconditionError):
        why = "the object changed during the load (its ETag no longer matches): load again"
    else:
        why = str(exc).splitlines()[0][:300] if str(exc) else type(exc).__name__
    return SourceError(why, url=url, byte_range=byte_range)


def _copy_into(data: Any, buf: memoryview) -> None:
    """The bytes of ``data`` into ``buf`` (numpy's copy lets go of the GIL)."""
    np.copyto(np.frombuffer(buf, dtype=np.uint8), np.frombuffer(data, dtype=np.uint8))


def _copy_into_tensor(data: Any, dest: Any, at: int, n: int) -> None:
    _copy_into(data, byte_view(dest)[at : at + n])


def _plain_http(scheme: str, config: dict[str, Any]) -> bool:
    """Whether the user named a plain-http endpoint: the URL itself, or an object store's
    endpoint in the options or the environment (a local S3 server), or ``AWS_ALLOW_HTTP``."""
    if scheme == "http" or os.environ.get("AWS_ALLOW_HTTP", "").lower() == "true":
        return True
    endpoints = [v for k, v in config.items() if "endpoint" in k.lower() and isinstance(v, str)]
    if scheme == "s3":
        endpoints += [os.environ.get(k, "") for k in ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL", "AWS_ENDPOINT")]
    return any(e.startswith("http://") for e in endpoints)


class RemoteSource(Source):
    """One remote object. Headers are read with obstore's blocking calls on the store's threads;
    tensor bytes with its async ones, on the event loop, so that a cancelled load stops them at
    once (the copy out of each response runs on a thread)."""

    def __init__(self, store: RemoteStore, path: str) -> None:
        self._store = store
        self._path = path
        self.url = redact(store.join(path))
        self.run = store.run
        self._size: int | None = None
        self._etag: str | None = None
        self._lock = threading.Lock()

    def _head(self, meta: Any) -> int:
        self._size, self._etag = int(meta["size"]), meta.get("e_tag")
        return self._size

    def size(self) -> int:
        with self._lock:
            if self._size is None:
                try:
                    return self._head(obstore.head(self._store.client, self._path))
                except Exception as exc:
                    raise _translate(exc, self.url) from None
            return self._size

    def _options(self, offset: int, n: int) -> dict[str, Any]:
        options: dict[str, Any] = {"range": (offset, offset + n)}
        if self._etag:  # pinned: an object replaced mid-load is an error, never mixed bytes
            options["if_match"] = self._etag
        return options

    def _checked(self, data: Any, offset: int, n: int) -> Any:
        if len(data) != n:
            raise SourceError(f"asked for {n} bytes, got {len(data)}", url=self.url, byte_range=(offset, offset + n))
        return data

    def read(self, offset: int, n: int) -> bytes:
        if not n:
            return b""
        return bytes(self._get(offset, n))

    def _get(self, offset: int, n: int) -> Any:
        self.size()
        try:
            data = obstore.get(self._store.client, self._path, options=self._options(offset, n)).bytes()  # type: ignore[arg-type]
        except Exception as exc:
            raise _translate(exc, self.url, (offset, offset + n)) from None
        return self._checked(data, offset, n)

    def readinto(self, offset: int, buf: memoryview) -> None:
        if len(buf):
            _copy_into(self._get(offset, len(buf)), buf)

    async def _aget(self, offset: int, n: int) -> Any:
        if self._size is None:
            await self.run(self.size)
        try:
            result = await obstore.get_async(self._store.client, self._path, options=self._options(offset, n))  # type: ignore[arg-type]
            data = await result.bytes_async()
        except Exception as exc:
            raise _translate(exc, self.url, (offset, offset + n)) from None
        return self._checked(data, offset, n)

    async def abuffer(self, offset: int, n: int) -> np.ndarray[Any, Any]:
        return aligned_empty(offset, n)

    async def afill(self, buf: np.ndarray[Any, Any], offset: int, at: int, n: int) -> None:
        data = await self._aget(offset + at, n)
        await self.run(_copy_into, data, memoryview(buf[at : at + n]))  # type: ignore[arg-type]

    async def aread_into(self, offset: int, dest: Any, at: int, n: int) -> None:
        data = await self._aget(offset + at, n)
        await self.run(_copy_into_tensor, data, dest, at, n)


class RemoteStore(Store):
    """An HTTP(S) folder or file, or an object-store prefix or object.

    ``config``, ``client_options`` and ``retry_config`` go to ``obstore.store.from_url``; plain
    ``http://`` is allowed where the URL says so; ``timeout`` (seconds) bounds each request."""

    def __init__(
        self,
        url: str,
        concurrency: int,
        *,
        config: dict[str, Any] | None = None,
        client_options: dict[str, Any] | None = None,
        retry_config: dict[str, Any] | None = None,
        timeout: float | None = None,
    ) -> None:
        super().__init__(url, concurrency)
        parts = urlsplit(url)
        if parts.query or parts.fragment:
            raise UsageError("a checkpoint URL takes no query or fragment", url=redact(url))
        self._file = parts.path.endswith(".safetensors")
        base = url.rsplit("/", 1)[0] if self._file else url.rstrip("/")
        self._name = url.rsplit("/", 1)[1] if self._file else ""
        self._base = base
        options = dict(client_options or {})
        if timeout is not None:  # per request, connecting to the last byte
            options.setdefault("timeout", f"{timeout}s")
        if _plain_http(parts.scheme, config or {}):
            options.setdefault("allow_http", True)
        try:
            self.client = from_url(base + "/", config=config, client_options=options, retry_config=retry_config)  # type: ignore[call-overload]
        except Exception as exc:
            raise UsageError(f"cannot configure the store: {exc}", url=redact(url)) from None
        self.url = redact(url)
        self._http = parts.scheme in ("http", "https")
        self._sources: dict[str, RemoteSource] = {}

    def join(self, name: str) -> str:
        return f"{self._base}/{name}"

    def source(self, name: str) -> RemoteSource:
        name = name or self._name
        src = self._sources.get(name)
        if src is None:
            src = self._sources[name] = RemoteSource(self, name)
        return src

    def kind(self) -> str:
        return "file" if self._file else "folder"

    def list(self, suffix: str) -> list[str]:
        try:
            found = obstore.list_with_delimiter(self.client)
        except Exception as exc:
            if self._http:  # a plain HTTP server lists nothing (no WebDAV): the usual single file
                return [n for n in ("model.safetensors",) if self.get_size(n) is not None]
            raise _translate(exc, self.url) from None
        return sorted(
            posixpath.basename(o["path"]) for o in found["objects"] if o["path"].endswith(suffix)
        )

    def get_size(self, name: str, src: RemoteSource | None = None) -> int | None:
        """The size of the object ``name``; None where it does not exist."""
        try:
            return (src or RemoteSource(self, name)).size()
        except SourceError as exc:
            if exc.message == _NOT_FOUND:
                return None
            raise

    def get(self, name: str, limit: int) -> bytes | None:
        src = RemoteSource(self, name)
        size = self.get_size(name, src)
        if size is None:
            return None
        if size > limit:
            raise SourceError(f"{size} bytes, over the {limit}-byte limit", url=src.url)
        return src.read(0, size)

    def close(self) -> None:
        self._sources.clear()  # each refers back to this store (``run``)
