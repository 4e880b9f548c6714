"""Remote checkpoints, all through one client, obstore: ``s3://``, ``gs://``, ``az://`` (also
``azure://``, ``abfs://``), ``http(s)://``, and ``hf://`` (``hub.py``, over the Hub's HTTP
endpoint). Configuration comes from each ecosystem's environment (``AWS_*``, ``GOOGLE_*``,
``AZURE_*``) first and the ``config``/``client_options`` options second, which go to
``obstore.store.from_url`` unchanged.

One policy for every scheme: TLS verified (``ca_bundle`` adds a trusted root); every range read
pinned to the object's version (ETag, generation, or Last-Modified where a server gives no
ETag), checked on each answer too, so an object replaced mid-load is an error, never mixed bytes;
header, index and listing reads bounded; errors and notes free of secrets."""

from __future__ import annotations

import os
import re
import threading
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import numpy as np
import obstore
import obstore.exceptions as oe
from obstore.store import from_url

from ..errors import CheckpointError, SourceError, UsageError
from .base import Source, Store, aligned_empty, byte_view

#: A prefix listed for ``*.safetensors`` may hold at most this many objects (point at the
#: folder that holds the checkpoint, not at a bucket's root).
MAX_LISTED = 100_000
#: Bytes per piece of a bounded (header, index) read.
_PIECE = 1 << 20

#: Where each scheme's client looks for credentials: named in the error when none were found.
CREDENTIALS = {
    "s3": "AWS_ACCESS_KEY_ID + AWS_SECRET_ACCESS_KEY (+ AWS_SESSION_TOKEN), AWS_WEB_IDENTITY_TOKEN_FILE, "
    "AWS_CONTAINER_CREDENTIALS_*, the instance role; or config={'aws_access_key_id': ...}",
    "gs": "GOOGLE_SERVICE_ACCOUNT (a key file), GOOGLE_SERVICE_ACCOUNT_KEY, GOOGLE_APPLICATION_CREDENTIALS, "
    "the metadata server; or config={'google_service_account': ...}",
    "az": "AZURE_STORAGE_ACCOUNT_NAME with AZURE_STORAGE_ACCOUNT_KEY, AZURE_STORAGE_SAS_KEY or "
    "AZURE_CLIENT_ID + AZURE_CLIENT_SECRET + AZURE_TENANT_ID (AZURE_STORAGE_USE_EMULATOR for Azurite)",
    "http": "the server's own rules (aload sends no credentials to plain URLs)",
    "hf": "HF_TOKEN, or token=...",
}
_FAMILY = {"azure": "az", "abfs": "az", "abfss": "az", "adl": "az", "https": "http", "gcs": "gs"}


def family(scheme: str) -> str:
    return _FAMILY.get(scheme, scheme)


def redact(url: str) -> str:
    """``url`` without user info, query or fragment: what errors and logs may show."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    if parts.port:
        host = f"{host}:{parts.port}"
    return urlunsplit((parts.scheme, host, parts.path, "", ""))


_URL = re.compile(r"[a-z][a-z0-9+.-]*://[^\s\"'<>]+", re.IGNORECASE)


def scrub(text: str, secrets: tuple[str, ...] = ()) -> str:
    """``text`` with every URL redacted (no user info, query: signatures, SAS tokens) and every
    known secret value removed."""
    text = _URL.sub(lambda m: redact(m.group(0)), text)
    for s in secrets:
        if len(s) >= 4:
            text = text.replace(s, "***")
    return text


_NOT_FOUND = "not found"
_CHANGED = "the object changed during the load (its version no longer matches): load again"
_CAUSES = (  # (pattern in the client's error, what to say)
    (re.compile(r"connection refused", re.I), "connection refused: is the server up, the endpoint right?"),
    (re.compile(r"dns error|failed to lookup|name or service not known", re.I), "DNS lookup failed: check the host name"),
    (
        re.compile(r"certificate|UnknownIssuer|tls handshake|InvalidCertificate", re.I),
        "TLS certificate not trusted: pass ca_bundle=PATH (AWS_CA_BUNDLE for s3://)",
    ),
    (re.compile(r"operation timed out|timed out|TimedOut", re.I), "timed out: raise timeout= or check the network"),
    (
        re.compile(r"builder error|BadScheme", re.I),
        "the client refused a plain http:// URL: pass client_options={'allow_http': True} "
        "(or set AWS_ALLOW_HTTP / GOOGLE_ALLOW_HTTP / AZURE_ALLOW_HTTP=true)",
    ),
    (re.compile(r"URL scheme is not allowed|redirect", re.I), "a redirect aload does not follow (only to http/https)"),
)
_NO_CREDENTIALS = re.compile(
    r"token request|credential|MissingAccount|Account must be specified|169\.254\.169\.254|metadata", re.I
)
_CODE = re.compile(r"<Code>([A-Za-z]+)</Code>|\"reason\":\s*\"([A-Za-z]+)\"")


def _translate(
    exc: Exception, url: str, scheme: str, byte_range: tuple[int, int] | None = None, secrets: tuple[str, ...] = ()
) -> SourceError:
    """A client error as a ``SourceError`` naming the URL (never its secrets) and the cause."""
    text = str(exc)
    where = CREDENTIALS.get(family(scheme), "")
    if isinstance(exc, (oe.NotFoundError, FileNotFoundError)):
        why = _NOT_FOUND
    elif isinstance(exc, (oe.PermissionDeniedError, oe.UnauthenticatedError, PermissionError)):
        code = _CODE.search(text)
        said = f" ({code.group(1) or code.group(2)})" if code else ""
        why = f"access refused{said}: check the credentials: {where}"
    elif isinstance(exc, oe.PreconditionError):
        why = _CHANGED
    elif isinstance(exc, oe.GenericError) and _NO_CREDENTIALS.search(text):
        why = f"no usable credentials found; looked at {where}"
    else:
        why = next((say for pattern, say in _CAUSES if pattern.search(text)), "")
        if not why:
            why = text.splitlines()[0][:300] if text else type(exc).__name__
    return SourceError(scrub(why, secrets), url=url, byte_range=byte_range)


def bounded(result: Any, limit: int) -> bytearray:
    """An obstore answer's body, read in pieces: at most ``limit`` bytes and one piece more, so that
    a server sending more than it should is caught before it fills memory."""
    out = bytearray()
    for piece in result.stream(min_chunk_size=min(limit, _PIECE) or 1):
        out += piece
        if len(out) > limit:
            break
    return out


def _copy_into(data: Any, buf: memoryview) -> None:
    """The bytes of ``data`` into ``buf`` (numpy's copy lets go of the GIL)."""
    np.copyto(np.frombuffer(buf, dtype=np.uint8), np.frombuffer(data, dtype=np.uint8))


def _copy_into_tensor(data: Any, dest: Any, at: int, n: int) -> None:
    _copy_into(data, byte_view(dest)[at : at + n])


_ALLOW_HTTP = {"s3": "AWS_ALLOW_HTTP", "gs": "GOOGLE_ALLOW_HTTP", "az": "AZURE_ALLOW_HTTP"}


def _plain_http(scheme: str, config: dict[str, Any]) -> bool:
    """Whether the user named a plain-http endpoint: the URL itself, an S3 endpoint in the options
    or the environment (a local S3 server), or the client's own switch (``AWS_ALLOW_HTTP``,
    ``GOOGLE_ALLOW_HTTP``, ``AZURE_ALLOW_HTTP``; obstore reads them only where no client options
    are passed, and aload passes some)."""
    if scheme == "http" or os.environ.get(_ALLOW_HTTP.get(family(scheme), ""), "").lower() == "true":
        return True
    endpoints = [v for k, v in config.items() if "endpoint" in k.lower() and isinstance(v, str)]
    if scheme == "s3":
        endpoints += [os.environ.get(k, "") for k in ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL", "AWS_ENDPOINT")]
    return any(e.startswith("http://") for e in endpoints)


def _ca_bundle(scheme: str, path: str | None) -> bytes | None:
    """The PEM roots to trust besides the system's: ``ca_bundle``, else ``AWS_CA_BUNDLE`` (s3://)."""
    path = path or (os.environ.get("AWS_CA_BUNDLE") if scheme == "s3" else None)
    if not path:
        return None
    try:
        with open(path, "rb") as f:
            return f.read(16 << 20)
    except OSError as exc:
        raise UsageError(f"cannot read the CA bundle {path}: {exc.strerror}") from None


_SECRET_KEY = re.compile(r"key|secret|token|password|sas|signature|credential", re.I)


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
        self._pin: dict[str, Any] = {}
        self._lock = threading.Lock()

    def _error(self, exc: Exception, byte_range: tuple[int, int] | None = None) -> SourceError:
        if isinstance(exc, FileNotFoundError) and self._size is not None:  # a pinned version is gone
            return SourceError(_CHANGED, url=self.url, byte_range=byte_range)
        return _translate(exc, self.url, self._store.scheme, byte_range, self._store.secrets)

    def size(self) -> int:
        with self._lock:
            if self._size is None:
                try:
                    meta = obstore.head(self._store.client, self._path)
                except Exception as exc:
                    raise self._error(exc) from None
                self._pin = {k: meta.get(k) for k in ("e_tag", "version", "last_modified") if meta.get(k)}
                self._size = int(meta["size"])
            return self._size

    def _options(self, offset: int, n: int) -> dict[str, Any]:
        options: dict[str, Any] = {"range": (offset, offset + n)}
        if "e_tag" in self._pin:
            options["if_match"] = self._pin["e_tag"]
        elif "last_modified" in self._pin:  # a server without ETags: the modification time
            options["if_unmodified_since"] = self._pin["last_modified"]
        if "version" in self._pin:
            options["version"] = self._pin["version"]
        return options

    def _check(self, meta: Any, offset: int, n: int, got: int | None = None) -> None:
        """The answer is of the pinned version (also where a server ignores the conditions) and
        as long as asked."""
        pin = self._pin
        keys = ("e_tag", "version") if "e_tag" in pin else ("version", "last_modified")
        if any(k in pin and meta.get(k) and meta.get(k) != pin[k] for k in keys):
            raise SourceError(_CHANGED, url=self.url, byte_range=(offset, offset + n))
        if got is not None and got != n:
            raise SourceError(f"asked for {n} bytes, got {got}", url=self.url, byte_range=(offset, offset + n))

    def read(self, offset: int, n: int) -> bytes:
        """At most ``n`` bytes from ``offset``, read in pieces: a server that sends more than
        asked is refused before it fills memory."""
        if not n:
            return b""
        self.size()
        try:
            result = obstore.get(self._store.client, self._path, options=self._options(offset, n))  # type: ignore[arg-type]
            self._check(result.meta, offset, n)
            out = bounded(result, n)
        except SourceError:
            raise
        except Exception as exc:
            raise self._error(exc, (offset, offset + n)) from None
        self._check({}, offset, n, len(out))
        return bytes(out)

    def readinto(self, offset: int, buf: memoryview) -> None:
        if len(buf):
            _copy_into(self.read(offset, len(buf)), buf)

    async def _aget(self, offset: int, n: int) -> Any:
        if self._size is None:
            await self.run(self.size)
        try:
            result = await obstore.get_async(self._store.client, self._path, options=self._options(offset, n))  # type: ignore[arg-type]
            self._check(result.meta, offset, n)
            data = await result.bytes_async()
        except SourceError:
            raise
        except Exception as exc:
            raise self._error(exc, (offset, offset + n)) from None
        self._check({}, offset, n, len(data))
        return data

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

    ``config``, ``client_options`` and ``retry_config`` go to ``obstore.store.from_url``;
    ``ca_bundle`` (a PEM file) adds trusted roots; ``timeout`` (seconds) bounds each request;
    plain ``http://`` is allowed where the URL or the S3 endpoint says so."""

    def __init__(
        self,
        url: str,
        concurrency: int,
        *,
        config: dict[str, Any] | None = None,
        client_options: dict[str, Any] | None = None,
        retry_config: dict[str, Any] | None = None,
        timeout: float | None = None,
        ca_bundle: str | None = None,
    ) -> None:
        super().__init__(url, concurrency)
        parts = urlsplit(url)
        self.url = redact(url)
        if parts.query or parts.fragment:
            raise UsageError("a checkpoint URL takes no query or fragment", url=self.url)
        self.scheme = parts.scheme.lower()
        options = dict(client_options or {})
        self.secrets = tuple(
            str(v) for d in (config or {}, options) for k, v in d.items() if _SECRET_KEY.search(k) and v
        ) + tuple(v for v in (options.get("default_headers") or {}).values() if isinstance(v, str))
        if parts.password:
            self.secrets += (parts.password,)
        self._file = parts.path.endswith(".safetensors")
        base = url.rsplit("/", 1)[0] if self._file else url.rstrip("/")
        self._name = url.rsplit("/", 1)[1] if self._file else ""
        self._base = base
        if timeout is not None:  # per request, connecting to the last byte
            options.setdefault("timeout", f"{timeout}s")
        if _plain_http(self.scheme, config or {}):
            options.setdefault("allow_http", True)
        roots = _ca_bundle(self.scheme, ca_bundle)
        if roots is not None:
            options.setdefault("root_certificate", roots)
        self._http = family(self.scheme) == "http"
        root = base if self._http else base + "/"  # obstore's HTTP store joins with a "/" of its own
        try:
            self.client = from_url(root, config=config, client_options=options or None, retry_config=retry_config)  # type: ignore[arg-type]
        except Exception as exc:
            err = _translate(exc, self.url, self.scheme, None, self.secrets)
            if "credentials" in err.message:
                raise err from None
            raise UsageError(f"cannot configure the store: {err.message}", url=self.url) from None
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
        """The names of the objects directly under the prefix that end in ``suffix``. A plain HTTP
        server lists nothing (no WebDAV): there, the usual single file."""
        if self._http:
            return [n for n in ("model.safetensors",) if self.get_size(n) is not None]
        found: list[str] = []
        seen = 0
        try:
            for batch in obstore.list(self.client, chunk_size=1000):
                seen += len(batch)
                if seen > MAX_LISTED:
                    raise CheckpointError(
                        f"over {MAX_LISTED} objects under this prefix: point at the folder that holds the checkpoint",
                        url=self.url,
                    )
                found += [o["path"] for o in batch if "/" not in o["path"] and o["path"].endswith(suffix)]
        except CheckpointError:
            raise
        except Exception as exc:
            raise _translate(exc, self.url, self.scheme, None, self.secrets) from None
        return sorted(found)

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
