"""HTTP(S) sources: concurrent ranged GETs, every response checked, the object pinned by its
ETag for the whole load, retries with backoff that resume where a body broke off. Requests go
through ``wire`` (a ranged GET's body received straight into its destination); a response
``wire`` does not read (an encoded body, one through a proxy) through aiohttp, imported then, on
a thread: an ``http://`` load that never needs it does not import it (~150 ms holding the GIL).

A URL naming a ``.safetensors`` object is one shard; any other URL is a checkpoint "folder":
``model.safetensors.index.json`` first, else ``model.safetensors`` (HTTP has no listing).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import logging
import os
import random
import re
import ssl
import sys
import urllib.request
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit, urlunsplit

from . import wire
from ._threads import run_in_thread, setup_switches
from .errors import SourceError, UsageError
from .sources import Source, Store

if TYPE_CHECKING:
    import aiohttp

#: Attempts per request (the first included) before giving up with the last cause.
DEFAULT_RETRIES = 5
#: Seconds without progress (connect, or between body bytes) before a request counts as failed.
DEFAULT_TIMEOUT_S = 30.0
RETRY_STATUS = {408, 429, 500, 502, 503, 504}
_CONTENT_RANGE = re.compile(r"bytes (\d+)-(\d+)/(\d+|\*)$")


def redact(url: str) -> str:
    """The URL without credentials or query string (presigned URLs carry secrets there)."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    if parts.port:
        host += f":{parts.port}"
    return urlunsplit((parts.scheme, host, parts.path, "", ""))


log = logging.getLogger("aload")


class _Retry(Exception):
    """A failure worth another attempt (connection, timeout, 5xx, 429, short body)."""


def warm() -> None:
    """aiohttp, imported now if the environment names a proxy for HTTP(S), which sends requests
    through it (``aload.preload``); a load ``wire`` reads whole never imports it."""
    proxies = urllib.request.getproxies()
    if proxies.get("http") or proxies.get("https"):
        importlib.import_module("aiohttp")


def _errors(*classes: type[BaseException], aiohttp: tuple[str, ...] = ()) -> tuple[type[BaseException], ...]:
    """``classes`` and the exception classes of aiohttp named, for an ``except``; those only if
    aiohttp was imported (if not, nothing can have raised them)."""
    module = sys.modules.get("aiohttp")
    return classes + (tuple(getattr(module, name) for name in aiohttp) if module is not None else ())


async def backoff(attempt: int) -> None:
    """Exponential backoff with jitter before attempt number ``attempt`` (0: no wait)."""
    if attempt:
        await asyncio.sleep(min(8.0, 0.1 * 2**attempt) * random.uniform(0.5, 1.0))


def check_content_range(header: str | None, first: int, last: int, size: int | None, url: str) -> int:
    """The total from ``bytes first-last/total``; anything else is an error naming the range."""
    m = _CONTENT_RANGE.match(header or "")
    if m is None or int(m.group(1)) != first or int(m.group(2)) != last or m.group(3) == "*":
        raise SourceError(
            f"Content-Range {header!r} does not match the requested bytes {first}-{last}",
            url=url,
            byte_range=(first, last + 1),
        )
    total = int(m.group(3))
    if size is not None and total != size:
        raise SourceError(f"object is now {total} bytes, was {size}: it changed during the load", url=url)
    return total


def probe_last(header: str | None, probe: int) -> int:
    """The last byte a GET of the first ``probe`` bytes should have answered with: an object
    shorter than that comes back whole, its range ending at its last byte."""
    m = _CONTENT_RANGE.match(header or "")
    if m is not None and m.group(3) != "*" and 0 < int(m.group(3)) < probe:
        return int(m.group(3)) - 1
    return probe - 1


class HttpSource(Source):
    def __init__(self, store: HttpStore, url: str) -> None:
        self.url = redact(url)
        self._full = url
        self._store = store
        self._size: int | None = None
        self._etag: str | None = None
        self._modified: str | None = None

    async def size(self) -> int:
        if self._size is None:
            await self.head(1)  # a one-byte ranged GET: it also shows whether Range is honoured
        assert self._size is not None
        return self._size

    async def head(self, probe: int) -> tuple[int, bytes]:
        """Size and first bytes in one ranged GET: the size probe and the header's read were two
        round trips per shard (163 for DeepSeek-V3's checkpoint, 16 at a time)."""
        if self._size is not None or probe <= 0:
            return await super().head(probe)

        async def first(resp: aiohttp.ClientResponse) -> tuple[int, bytes]:
            if resp.status == 416 and resp.headers.get("Content-Range") == "bytes */0":
                return 0, b""  # an empty object: the header check says so, naming it
            if resp.status != 206:
                raise SourceError(
                    f"server answered {resp.status} to a ranged GET; aload needs Range support", url=self.url
                )
            last = probe_last(resp.headers.get("Content-Range"), probe)
            total = self._content_range(resp, 0, last)  # the exact range, or an error naming it
            data = await resp.read()
            if len(data) > last + 1:
                raise SourceError("server sent more bytes than the range holds", url=self.url, byte_range=(0, last + 1))
            if len(data) <= last:
                raise _Retry(f"body ended after {len(data)} of {last + 1} bytes")
            self._etag = resp.headers.get("ETag")
            self._modified = resp.headers.get("Last-Modified")
            return total, data

        size, data = await self._request(0, probe - 1, first)
        self._size = size
        self._keep_if_whole(size, data)
        return size, data

    async def readinto(self, offset: int, buf: memoryview) -> None:
        if self._size is None:
            await self.size()
        if self._from_whole(offset, buf):
            return
        done = 0
        total = len(buf)

        async def body(resp: aiohttp.ClientResponse) -> None:
            nonlocal done
            start = offset + done
            if resp.status == 200:
                raise SourceError(
                    "server ignored Range and sent the whole object", url=self.url, byte_range=(offset, offset + total)
                )
            if resp.status != 206:
                raise SourceError(f"unexpected status {resp.status}", url=self.url, byte_range=(offset, offset + total))
            self._check_version(resp, offset, total)
            self._content_range(resp, start, offset + total - 1)
            if isinstance(resp, wire.Response):  # Content-Length is the rest of the range: checked
                try:
                    await resp.read_into(buf[done:])
                finally:
                    done += resp.received
                return
            async for chunk in resp.content.iter_any():
                n = len(chunk)
                if done + n > total:
                    raise SourceError(
                        "server sent more bytes than the range holds", url=self.url, byte_range=(offset, offset + total)
                    )
                buf[done : done + n] = chunk
                done += n
            if done < total:
                raise _Retry(f"body ended after {done} of {total} bytes")

        await self._request(offset, offset + total - 1, body, progress=lambda: offset + done)

    def _content_range(self, resp: aiohttp.ClientResponse, first: int, last: int) -> int:
        total = check_content_range(resp.headers.get("Content-Range"), first, last, self._size, self.url)
        length = resp.headers.get("Content-Length")
        if length is not None and int(length) != last - first + 1:
            raise SourceError(
                f"Content-Length {length} for {last - first + 1} requested bytes",
                url=self.url,
                byte_range=(first, last + 1),
            )
        return total

    def _check_version(self, resp: aiohttp.ClientResponse, offset: int, n: int) -> None:
        etag, modified = resp.headers.get("ETag"), resp.headers.get("Last-Modified")
        if (self._etag and etag and etag != self._etag) or (
            not self._etag and self._modified and modified and modified != self._modified
        ):
            raise SourceError(
                "object changed during the load (ETag/Last-Modified differ)",
                url=self.url,
                byte_range=(offset, offset + n),
            )

    def _headers(self, first: int, last: int) -> dict[str, str]:
        headers = {"Range": f"bytes={first}-{last}", "Accept-Encoding": "identity"}
        if self._etag:
            headers["If-Match"] = self._etag
        elif self._modified:
            headers["If-Unmodified-Since"] = self._modified
        return headers

    async def _request(self, first: int, last: int, handle: Any, progress: Any = None) -> Any:
        """GET bytes first..last with retries; a retry resumes from ``progress()`` when given."""
        cause: BaseException | None = None
        for attempt in range(self._store.retries):
            await backoff(attempt)
            start = progress() if progress is not None else first
            try:
                async with self._store.fetch(self._full, self._headers(start, last)) as resp:
                    if resp.status == 412:
                        raise SourceError(
                            "object changed during the load (If-Match failed)",
                            url=self.url,
                            byte_range=(first, last + 1),
                        )
                    if resp.status in (401, 403, 404):
                        raise SourceError(f"{resp.status} {resp.reason}", url=self.url)
                    if resp.status in RETRY_STATUS:
                        raise _Retry(f"{resp.status} {resp.reason}")
                    return await handle(resp)
            except _errors(ssl.SSLError, aiohttp=("ClientConnectorCertificateError", "ClientSSLError")) as exc:
                raise SourceError(
                    f"TLS certificate not trusted ({exc.__class__.__name__}); pass ca_bundle= for a private CA",
                    url=self.url,
                ) from exc
            except _errors(_Retry, wire.WireError, asyncio.TimeoutError, aiohttp=("ClientError",)) as exc:
                cause = exc
                log.warning(
                    "%s bytes [%d, %d): attempt %d of %d failed: %s",
                    self.url,
                    first,
                    last + 1,
                    attempt + 1,
                    self._store.retries,
                    self._store.scrub(f"{type(exc).__name__}: {exc}"),
                )
        raise SourceError(
            f"gave up after {self._store.retries} attempts; last: {self._store.scrub(f'{type(cause).__name__}: {cause}')}",
            url=self.url,
            byte_range=(first, last + 1),
        ) from None  # aiohttp's own errors may quote the full URL, query string included


def _tls_context(ca_bundle: str | None) -> ssl.SSLContext:
    return ssl.create_default_context(cafile=ca_bundle)


class HttpStore(Store):
    """A checkpoint behind HTTP(S). Options: ``headers`` (added to every request), ``token``
    (a bearer token; ``HF_TOKEN`` is used for huggingface.co), ``timeout`` (seconds without
    progress), ``retries`` (attempts per request), ``ca_bundle`` (a PEM file of CAs to trust)."""

    def __init__(
        self,
        url: str,
        *,
        concurrency: int,
        headers: dict[str, str] | None = None,
        token: str | None = None,
        timeout: float = DEFAULT_TIMEOUT_S,
        retries: int = DEFAULT_RETRIES,
        ca_bundle: str | None = None,
    ) -> None:
        if retries < 1 or timeout <= 0:
            raise UsageError("retries must be >= 1 and timeout > 0", url=redact(url))
        # A query string (a presigned URL, a SAS token) goes on every request, after the path.
        parts = urlsplit(url)
        self._query = parts.query
        self._base = urlunsplit((parts.scheme, parts.netloc, parts.path.rstrip("/"), "", ""))
        self.url = redact(self._base)
        self.retries = retries
        self._concurrency = concurrency
        self._timeout = timeout
        self._ca = ca_bundle
        self._headers = dict(headers or {})
        token = token or (os.environ.get("HF_TOKEN") if "huggingface.co" in url else None)
        if token:
            self._headers.setdefault("Authorization", f"Bearer {token}")
        # What must never be printed: header values, the query string, a password in the URL.
        self._proxy = wire.Proxies()
        proxy = self._proxy(self._base)
        values = (*self._headers.values(), token, parts.query, parts.password, urlsplit(proxy or "").password)
        values += tuple(v.removeprefix("Bearer ") for v in self._headers.values())  # a token given as a header
        self._secrets = sorted({v for v in values if v and len(v) >= 4}, key=len, reverse=True)
        self._session: aiohttp.ClientSession | None = None
        self._https = parts.scheme.lower() == "https"
        self._ssl: ssl.SSLContext | None = None  # made by prepare(), for https or ca_bundle
        self._wire: wire.Client | None = None
        self._wire_ok = True  # until a response wire does not read
        self._sources: dict[str, HttpSource] = {}

    def scrub(self, text: str) -> str:
        """``text`` with every credential this store holds replaced by ``***``."""
        for secret in self._secrets:  # longest first, so a part never leaves the rest showing
            text = text.replace(secret, "***")
        return text

    async def prepare(self) -> None:
        # Loading a CA bundle parses every certificate in it: 29-32 ms for the system bundle here,
        # on a thread rather than on the loop; once, for both clients.
        if (self._ca or self._https) and self._ssl is None:
            self._ssl = await run_in_thread(_tls_context, self._ca)

    @contextlib.asynccontextmanager
    async def fetch(self, url: str, headers: dict[str, str], sticky: bool = True) -> AsyncIterator[Any]:
        """A GET's response (``wire``'s, or aiohttp's where ``wire`` does not read the answers),
        its status and headers read, the body not yet. An answer ``wire`` cannot read sends the
        store's later requests to aiohttp too, or, not ``sticky``, only this one (an index a
        server sends chunked says nothing about how it answers ranged GETs)."""
        if self._wire_ok:
            if self._wire is None:
                self._wire = wire.Client(limit=self._concurrency + 2, timeout=self._timeout, ssl_context=self._ssl)
            client = self._wire
            try:
                resp = await client.open(url, {**self._headers, **headers})
            except wire.Unsupported as exc:
                log.info("%s: %s; reading through aiohttp%s", self.url, exc, " from now on" if sticky else "")
                self._wire_ok = not sticky
            else:
                try:
                    yield resp
                finally:
                    client.release(resp)
                return
        async with self._get(url, headers) as plain:
            yield plain

    @contextlib.asynccontextmanager
    async def _get(self, url: str, headers: dict[str, str]) -> AsyncIterator[aiohttp.ClientResponse]:
        """aiohttp's GET of ``url``, through the proxy the environment names for it, credentials
        in its URL included (aiohttp sends them to the proxy alone, on the request or on the
        ``CONNECT``); that proxy then serves every redirect of it."""
        session = await self.session()
        async with session.get(url, headers=headers, proxy=self._proxy(url)) as resp:
            yield resp

    async def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            if "aiohttp" not in sys.modules:  # ~150 ms of imports holding the GIL: not on the loop
                with setup_switches:
                    await run_in_thread(importlib.import_module, "aiohttp")
                if self._session is not None:  # another request made it meanwhile
                    return self._session
            import aiohttp

            ssl_ctx: Any = self._ssl if self._ssl is not None else (_tls_context(self._ca) if self._ca else True)
            self._session = aiohttp.ClientSession(
                headers=self._headers,
                connector=aiohttp.TCPConnector(limit=self._concurrency + 2, ssl=ssl_ctx),
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=self._timeout, sock_read=self._timeout),
                auto_decompress=False,
            )
        return self._session

    def _url(self, name: str) -> str:
        url = self._base if name == "" else f"{self._base}/{name}"
        return f"{url}?{self._query}" if self._query else url

    async def kind(self) -> str:
        return "file" if self._base.endswith(".safetensors") else "folder"

    def source(self, name: str) -> Source:
        if name not in self._sources:
            self._sources[name] = HttpSource(self, self._url(name))
        return self._sources[name]

    async def list(self, suffix: str) -> list[str]:
        src = self.source("model.safetensors")
        try:
            await src.size()
        except SourceError:
            return []
        return ["model.safetensors"]

    async def get(self, name: str, limit: int) -> bytes | None:
        url = self._url(name)
        for attempt in range(self.retries):
            await backoff(attempt)
            try:
                async with self.fetch(url, {"Accept-Encoding": "identity"}, sticky=False) as resp:
                    if resp.status == 404:
                        return None
                    if resp.status in RETRY_STATUS:
                        continue
                    if resp.status != 200:
                        raise SourceError(f"{resp.status} {resp.reason}", url=redact(url))
                    length = resp.headers.get("Content-Length")
                    if length is not None and length.isdigit() and int(length) > limit:
                        raise SourceError(f"{length} bytes, over the {limit}-byte limit for this file", url=redact(url))
                    if isinstance(resp, wire.Response):  # exactly Content-Length bytes, or an error
                        return await resp.read()
                    # The whole body: ``content.read(n)`` returns what has arrived so far, at most n
                    # bytes (an 8.7 MB index came back as its first ~128 KB).
                    chunks, got = [], 0
                    async for chunk in resp.content.iter_any():
                        got += len(chunk)
                        if got > limit:
                            raise SourceError(f"larger than the {limit}-byte limit for this file", url=redact(url))
                        chunks.append(chunk)
                    if length is not None and int(length) != got:
                        continue  # the body broke off: again
                    return b"".join(chunks)
            except _errors(wire.WireError, asyncio.TimeoutError, aiohttp=("ClientError",)):
                continue
        raise SourceError(f"gave up after {self.retries} attempts", url=redact(url))

    async def aclose(self) -> None:
        self._sources.clear()  # each refers back to this store: no cycle left for the collector
        if self._wire is not None:
            await self._wire.aclose()
            self._wire = None
        if self._session is not None:
            await self._session.close()
            self._session = None
