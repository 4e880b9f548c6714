"""S3 and S3-compatible object stores, through aiobotocore (botocore's signing on aiohttp).

``s3://bucket/prefix/`` is a checkpoint folder (its index first, else a listing of
``*.safetensors`` under the prefix); ``s3://bucket/key.safetensors`` is one shard. Endpoint,
region and credentials come from the standard AWS environment variables and files unless given
as options (``endpoint_url``, ``region``, ``access_key``, ``secret_key``, ``session_token``);
path-style addressing is used when an endpoint is given (S3-compatible stores). Each object is
pinned by its ETag (``IfMatch``) for the whole load; ranged reads are checked like HTTP's.

Data reads go through ``wire`` (the body received straight into its destination) on a presigned
URL, made afresh every few minutes from the client's current credentials; Range and If-Match
travel as headers outside the signature. Everything else (the header probe, the index, listings)
and any answer ``wire`` does not read go through aiobotocore.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import ssl
import time
from typing import Any
from urllib.parse import urlsplit

import aiohttp
from aiobotocore.config import AioConfig
from botocore.exceptions import BotoCoreError, ClientError

from . import wire
from ._boto import open_client
from ._boto import warm as warm  # aload.preload("s3") calls it
from ._threads import run_in_thread
from .errors import SourceError, UsageError
from .http import DEFAULT_RETRIES, DEFAULT_TIMEOUT_S, RETRY_STATUS, backoff, check_content_range, log, probe_last
from .sources import Source, Store

_RETRY_CODES = {"500", "502", "503", "504", "SlowDown", "InternalError", "RequestTimeout", "ServiceUnavailable", "429"}
_GONE = {"NoSuchKey", "404", "NotFound"}
_DENIED = {"AccessDenied", "403", "InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken", "InvalidToken"}
#: A presigned URL is valid this long, and made afresh after a fifth of it.
_PRESIGN_S = 3600


def _code(exc: ClientError) -> str:
    return str(exc.response.get("Error", {}).get("Code", ""))


class S3Source(Source):
    def __init__(self, store: S3Store, key: str) -> None:
        self.url = f"s3://{store.bucket}/{key}"
        self._store = store
        self._key = key
        self._size: int | None = None
        self._etag: str | None = None

    async def size(self) -> int:
        if self._size is None:
            head = await self._call("head_object", (0, 0), Bucket=self._store.bucket, Key=self._key)
            self._size, self._etag = int(head["ContentLength"]), head.get("ETag")
        return self._size

    async def head(self, probe: int) -> tuple[int, bytes]:
        """Size and first bytes in one ranged GET (``head_object`` and a read were two round trips
        per shard); anything unusual (an empty object, a broken body) takes the two-call way."""
        if self._size is not None or probe <= 0:
            return await super().head(probe)
        try:
            resp = await self._call(
                "get_object", (0, probe), Bucket=self._store.bucket, Key=self._key, Range=f"bytes=0-{probe - 1}"
            )
        except SourceError:
            return await super().head(probe)  # e.g. InvalidRange on an empty object: its own error
        last = probe_last(resp.get("ContentRange"), probe)
        total = check_content_range(resp.get("ContentRange"), 0, last, None, self.url)
        try:
            async with resp["Body"] as body:
                data = await body.read()
        except (aiohttp.ClientError, asyncio.TimeoutError, BotoCoreError):
            return await super().head(probe)
        if len(data) != last + 1:
            return await super().head(probe)
        self._size, self._etag = total, resp.get("ETag")
        self._keep_if_whole(total, data)
        return total, data

    async def readinto(self, offset: int, buf: memoryview) -> None:
        await self.size()
        if not len(buf) or self._from_whole(offset, buf):
            return
        done = await self._read_wire(offset, buf) if self._store.wire_ok else 0
        if done < len(buf):  # wire met an answer it does not read: the rest through aiobotocore
            await self._read_boto(offset + done, buf[done:])

    async def _read_wire(self, offset: int, buf: memoryview) -> int:
        """``buf`` through ``wire`` on a presigned URL, resuming where a body broke off; returns
        the bytes read, short of ``len(buf)`` only if an answer was ``wire.Unsupported``."""
        total, done = len(buf), 0
        cause: BaseException | None = None
        for attempt in range(self._store.retries):
            await backoff(attempt)
            first, last = offset + done, offset + total - 1
            headers = {"Range": f"bytes={first}-{last}", "Accept-Encoding": "identity"}
            if self._etag:
                headers["If-Match"] = self._etag
            client = self._store.wire_client()
            try:
                resp = await client.open(await self._store.presigned(self._key), headers)
            except wire.Unsupported:
                self._store.wire_ok = False
                return done
            except ssl.SSLError as exc:
                raise SourceError(f"TLS failed ({exc.__class__.__name__})", url=self.url) from None
            except (wire.WireError, asyncio.TimeoutError) as exc:
                cause = exc
            else:
                try:
                    if self._check(resp, first, last):
                        try:
                            await resp.read_into(buf[done:])
                        finally:
                            done += resp.received
                        return done
                    cause = SourceError(f"{resp.status} {resp.reason}", url=self.url)
                except (wire.WireError, asyncio.TimeoutError) as exc:
                    cause = exc
                finally:
                    client.release(resp)
            log.warning(
                "%s bytes [%d, %d): attempt %d of %d failed after %d bytes: %s",
                self.url,
                offset,
                offset + total,
                attempt + 1,
                self._store.retries,
                done,
                type(cause).__name__,
            )
        raise SourceError(
            f"gave up after {self._store.retries} attempts; last: {cause}",
            url=self.url,
            byte_range=(offset, offset + total),
        ) from None  # a connection error may quote the presigned URL

    def _check(self, resp: wire.Response, first: int, last: int) -> bool:
        """True for the range asked for; False for an answer worth another attempt (a 5xx, or a
        403 from a presigned URL that expired: the next is made afresh); else an error."""
        span = (first, last + 1)
        if resp.status == 412:
            raise SourceError("object changed during the load (IfMatch failed)", url=self.url, byte_range=span)
        if resp.status == 403:
            self._store.forget_presigned()
            return False
        if resp.status == 404:
            raise SourceError("not found (404)", url=self.url)
        if resp.status in RETRY_STATUS:
            return False
        if resp.status != 206:
            raise SourceError(f"get_object answered {resp.status} {resp.reason}", url=self.url, byte_range=span)
        check_content_range(resp.headers.get("Content-Range"), first, last, self._size, self.url)
        if self._etag and resp.headers.get("ETag") not in (None, self._etag):
            raise SourceError("object changed during the load (ETag differs)", url=self.url, byte_range=span)
        return True

    async def _read_boto(self, offset: int, buf: memoryview) -> None:
        total, done = len(buf), 0
        for attempt in range(self._store.retries):  # a body that breaks off resumes from the bytes received
            if done == total:
                return
            await backoff(attempt)
            first, last = offset + done, offset + total - 1
            extra = {"IfMatch": self._etag} if self._etag else {}
            resp = await self._call(
                "get_object",
                (first, last + 1),
                Bucket=self._store.bucket,
                Key=self._key,
                Range=f"bytes={first}-{last}",
                **extra,
            )
            check_content_range(resp.get("ContentRange"), first, last, self._size, self.url)
            if self._etag and resp.get("ETag") not in (None, self._etag):
                raise SourceError(
                    "object changed during the load (ETag differs)", url=self.url, byte_range=(first, last + 1)
                )
            try:
                async with resp["Body"] as body:
                    async for chunk in body.iter_chunks(1 << 20):
                        if done + len(chunk) > total:
                            raise SourceError(
                                "store sent more bytes than the range holds",
                                url=self.url,
                                byte_range=(offset, offset + total),
                            )
                        buf[done : done + len(chunk)] = chunk
                        done += len(chunk)
            except (aiohttp.ClientError, asyncio.TimeoutError, BotoCoreError) as exc:
                # resume where the body stopped, on the next attempt
                log.warning(
                    "%s bytes [%d, %d): body broke off after %d bytes (attempt %d of %d): %s",
                    self.url,
                    offset,
                    offset + total,
                    done,
                    attempt + 1,
                    self._store.retries,
                    type(exc).__name__,
                )
        if done < total:
            raise SourceError(
                f"body broke off {self._store.retries} times; {done} of {total} bytes received",
                url=self.url,
                byte_range=(offset, offset + total),
            )

    async def _call(self, op: str, byte_range: tuple[int, int], **kwargs: Any) -> Any:
        cause: BaseException | None = None
        for attempt in range(self._store.retries):
            await backoff(attempt)
            try:
                client = await self._store.client()
                return await getattr(client, op)(**kwargs)
            except ClientError as exc:
                code = _code(exc)
                if code in ("PreconditionFailed", "412"):
                    raise SourceError(
                        "object changed during the load (IfMatch failed)", url=self.url, byte_range=byte_range
                    ) from None
                if code in _GONE or code == "NoSuchBucket":
                    raise SourceError(f"not found ({code})", url=self.url) from None
                if code in _DENIED:
                    raise SourceError(f"access denied ({code})", url=self.url) from None
                if code not in _RETRY_CODES:
                    raise SourceError(f"{op} failed ({code})", url=self.url, byte_range=byte_range) from None
                cause = exc
            except (aiohttp.ClientError, asyncio.TimeoutError, BotoCoreError) as exc:
                cause = exc
            log.warning(
                "%s %s bytes [%d, %d): attempt %d of %d failed: %s",
                self.url,
                op,
                *byte_range,
                attempt + 1,
                self._store.retries,
                type(cause).__name__,
            )
        raise SourceError(
            f"gave up after {self._store.retries} attempts; last: {type(cause).__name__}",
            url=self.url,
            byte_range=byte_range,
        ) from cause


class S3Store(Store):
    def __init__(
        self,
        url: str,
        *,
        concurrency: int,
        endpoint_url: str | None = None,
        region: str | None = None,
        access_key: str | None = None,
        secret_key: str | None = None,
        session_token: str | None = None,
        timeout: float = DEFAULT_TIMEOUT_S,
        retries: int = DEFAULT_RETRIES,
    ) -> None:
        parts = urlsplit(url)
        if not parts.netloc:
            raise UsageError("s3 URLs name a bucket: s3://bucket/prefix/", url=url)
        self.bucket = parts.netloc
        self.prefix = parts.path.lstrip("/")
        self.url = f"s3://{self.bucket}/{self.prefix}"
        self.retries = retries
        endpoint = endpoint_url or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        self._client_args: dict[str, Any] = {
            "endpoint_url": endpoint,
            "region_name": region
            or os.environ.get("AWS_REGION")
            or os.environ.get("AWS_DEFAULT_REGION")
            or "us-east-1",
            "aws_access_key_id": access_key,
            "aws_secret_access_key": secret_key,
            "aws_session_token": session_token,
            "config": AioConfig(
                s3={"addressing_style": "path" if endpoint else "auto"},
                signature_version="s3v4",  # presigned URLs too (SigV2's are refused by newer buckets)
                retries={"max_attempts": 1, "mode": "standard"},  # aload retries and resumes itself
                connect_timeout=timeout,
                read_timeout=timeout,
                max_pool_connections=concurrency + 2,
            ),
        }
        self._stack: contextlib.AsyncExitStack | None = None
        self._client: Any = None
        self._client_lock = asyncio.Lock()  # one client, however many reads ask for it first
        self._sources: dict[str, S3Source] = {}
        self._concurrency, self._timeout = concurrency, timeout
        self._https = not endpoint or endpoint.lower().startswith("https")
        self._ssl: ssl.SSLContext | None = None  # made by prepare()
        self._wire: wire.Client | None = None
        self.wire_ok = True  # until an answer wire does not read
        self._presigned: dict[str, tuple[float, str]] = {}  # key -> (when made, URL)

    async def prepare(self) -> None:
        if self._https and self._ssl is None:  # the system's CAs: tens of ms, on a thread
            self._ssl = await run_in_thread(ssl.create_default_context)

    def wire_client(self) -> wire.Client:
        if self._wire is None:
            self._wire = wire.Client(limit=self._concurrency + 2, timeout=self._timeout, ssl_context=self._ssl)
        return self._wire

    async def presigned(self, key: str) -> str:
        """A presigned GET of ``key``: made locally (no request), reused for a fifth of its life."""
        made = self._presigned.get(key)
        now = time.monotonic()
        if made is None or now - made[0] > _PRESIGN_S / 5:
            client = await self.client()
            url = await client.generate_presigned_url(
                "get_object", Params={"Bucket": self.bucket, "Key": key}, ExpiresIn=_PRESIGN_S
            )
            made = self._presigned[key] = (now, url)
        return made[1]

    def forget_presigned(self) -> None:
        self._presigned.clear()

    async def client(self) -> Any:
        if self._client is None:
            async with self._client_lock:
                if self._client is None:
                    stack = contextlib.AsyncExitStack()
                    self._client = await open_client(stack, self._client_args)
                    self._stack = stack
        return self._client

    def _key(self, name: str) -> str:
        if name == "":
            return self.prefix
        return f"{self.prefix.rstrip('/')}/{name}" if self.prefix else name

    async def kind(self) -> str:
        return "file" if self.prefix.endswith(".safetensors") else "folder"

    def source(self, name: str) -> Source:
        if name not in self._sources:
            self._sources[name] = S3Source(self, self._key(name))
        return self._sources[name]

    async def list(self, suffix: str) -> list[str]:
        prefix = self.prefix.rstrip("/") + "/" if self.prefix else ""
        names: list[str] = []
        token: str | None = None
        while True:
            extra = {"ContinuationToken": token} if token else {}
            resp = await S3Source(self, prefix)._call(
                "list_objects_v2", (0, 0), Bucket=self.bucket, Prefix=prefix, Delimiter="/", **extra
            )
            names += [o["Key"][len(prefix) :] for o in resp.get("Contents", []) if o["Key"].endswith(suffix)]
            token = resp.get("NextContinuationToken")
            if not token:
                return sorted(names)

    async def get(self, name: str, limit: int) -> bytes | None:
        src = S3Source(self, self._key(name))
        try:
            resp = await src._call("get_object", (0, limit), Bucket=self.bucket, Key=src._key)
        except SourceError as exc:
            if "not found" in exc.message and "NoSuchBucket" not in exc.message:
                return None
            raise
        if int(resp.get("ContentLength", 0)) > limit:
            raise SourceError(f"larger than the {limit}-byte limit for this file", url=src.url)
        async with resp["Body"] as body:
            data: bytes = await body.read()
        return data

    async def aclose(self) -> None:
        self._presigned.clear()
        self._sources.clear()  # each refers back to this store: no cycle left for the collector
        if self._wire is not None:
            await self._wire.aclose()
            self._wire = None
        if self._stack is not None:
            await self._stack.aclose()
            self._stack, self._client = None, None
