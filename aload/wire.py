"""Ranged GETs over HTTP/1.1 with the body received straight into the caller's buffer.

aiohttp hands a body over as ``bytes`` chunks that the reader then copies into place: two copies
of every byte and Python work per chunk. Here an ``asyncio.BufferedProtocol`` reads each response's
head; then the kernel copies the body into the tensor's memory (or the unit's buffer) itself. On
a plain connection a body of ``THREAD_BODY_BYTES`` or more is received on one of the client's
threads by one blocking ``recv_into`` with the GIL let go, the loop's transport paused meanwhile;
over TLS (decrypted by the loop's transport) and for short bodies the transport is given the
destination, ``RECV_BYTES`` at a time, on the loop. A prototype of the latter read 2 GiB over
loopback from nginx into one buffer at 1.80-1.88 GB/s and 0.41-0.49 CPU s/GB, against 0.83-0.94
GB/s and 1.13 for aiohttp; aload into a model went from 0.98 to 1.34-1.39 GB/s
(``benchmarks/remote.py``).

Only what aload's ranged reads need: GET, keep-alive connections per origin, TLS, redirects,
interim answers skipped, a password in the URL as Basic authorization, a deadline on progress.
A response this module does not read (no ``Content-Length``, a chunked or encoded body) raises
``Unsupported`` and the caller asks again through aiohttp; so does a URL the environment sends
through a proxy (``proxy_for``): this module connects only directly.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import os
import socket
import ssl
import struct
import time
import urllib.request
from typing import Any
from urllib.parse import quote, unquote, urljoin, urlsplit

from .errors import UsageError
from .sources import IOPool

#: The most a response's status line and headers may take.
MAX_HEAD_BYTES = 64 * 1024
#: The most one socket read puts into a destination. The kernel's copy runs on the event loop's
#: thread: 2 GiB over loopback into a model, 2 runs each, p99 loop lateness and throughput:
#: the whole rest of the range per read (up to 8 MiB came at once) 5.3-17 ms, 1.60-2.15 GB/s;
#: 1 MiB 4.4-5.3 ms, 1.55-2.01; 512 KiB 2.5-5.0 ms, 1.59-2.04; 256 KiB 1.7-2.5 ms, 1.33-1.63.
RECV_BYTES = 256 * 1024
#: A body of at least this many bytes on a plain (not TLS) connection is received
#: on one of the client's threads (``_receive``), the event loop free meanwhile; below it, or over
#: TLS, on the loop. On the loop every ``RECV_BYTES`` read is a round of the loop's Python, and the
#: loop's one thread does every copy: 2 GB over loopback from nginx into a model, 4 connections,
#: one process, 3 loads each alternating: on threads 2.9-3.4 GB/s, loop lateness p99 2.1-3.2 ms;
#: on the loop 2.5-2.8 GB/s, p99 1.2 ms (2 connections: 3.4-3.5 GB/s and 2.3-2.5 ms against
#: 2.7-3.1 and 1.3-2.4). Set it above any body's size to keep every body on the loop.
THREAD_BODY_BYTES = 1 << 20
_REDIRECTS = {301, 302, 303, 307, 308}
_MAX_REDIRECTS = 10


class WireError(Exception):
    """The connection failed, broke off, timed out or answered something that is not HTTP/1.1:
    worth another attempt."""


class Unsupported(Exception):
    """A response this module does not read (see the module's docstring)."""


def proxy_for(url: str) -> str | None:
    """The proxy the environment names for ``url``: ``http_proxy`` or ``https_proxy`` by the
    URL's scheme, unless ``no_proxy`` covers its host (as curl and aiohttp read them); or None."""
    parts = urlsplit(url)
    proxy = urllib.request.getproxies().get(parts.scheme.lower())
    if not proxy or urllib.request.proxy_bypass(parts.hostname or ""):
        return None
    return proxy


class Proxies:
    """``proxy_for``, looked up once per origin (reading the environment takes ~50 us a call)."""

    def __init__(self) -> None:
        self._by_origin: dict[tuple[str, str, int], str | None] = {}

    def __call__(self, url: str) -> str | None:
        origin = _origin(url)
        if origin not in self._by_origin:
            self._by_origin[origin] = proxy_for(url)
        return self._by_origin[origin]


class Headers(dict[str, str]):
    """Response headers by lower-case name; ``get`` takes any case."""

    def get(self, key: str, default: Any = None) -> Any:
        return super().get(key.lower(), default)


def _parse_head(raw: bytes) -> tuple[int, str, Headers]:
    lines = raw.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ", 2)
    if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not parts[1].isdigit():
        raise WireError(f"not an HTTP/1.x status line: {lines[0][:80]!r}")
    headers = Headers()
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if not sep or not name or name != name.strip():
            raise WireError(f"malformed header line: {line[:80]!r}")
        key, value = name.lower(), value.strip()
        headers[key] = f"{headers[key]}, {value}" if key in headers else value
    return int(parts[1]), parts[2] if len(parts) > 2 else "", headers


class _Connection(asyncio.BufferedProtocol):
    """One keep-alive connection. The head of a response is read into a scratch buffer; then
    reading pauses until the caller hands over the body's destination, which the transport then
    fills directly (or a thread of the pool, ``_receive``, for a long body on a plain socket).
    Anything unusual closes the connection: it is never reused after an error."""

    def __init__(self, timeout: float, pool: IOPool | None = None) -> None:
        self._timeout = timeout
        self._pool = pool  # receives long bodies on its threads (``THREAD_BODY_BYTES``)
        self._sock: socket.socket | None = None  # the connection's own socket, for those threads
        self._transport: asyncio.Transport | None = None
        self._scratch = bytearray(MAX_HEAD_BYTES)
        self._seen = 0  # bytes of the head (and maybe some body) in the scratch buffer
        self._spill: bytearray | None = None  # handed out when the scratch buffer is full
        self._extra: list[bytes] = []  # body bytes that came into spills before the destination
        self._view: memoryview | None = None  # the body's destination, while it is received
        self.received = 0  # bytes of the body in the destination
        self._waiter: asyncio.Future[None] | None = None
        self._head_end = -1
        self._last = 0.0  # when bytes last came
        self._timer: asyncio.TimerHandle | None = None
        self.closed = False

    # -- the transport's side ---------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]
        plain = transport.get_extra_info("sslcontext") is None and transport.get_extra_info("ssl_object") is None
        raw = transport.get_extra_info("socket")
        if self._pool is not None and plain and raw is not None:
            # A duplicate of the descriptor: the transport keeps (and closes) its own.
            with contextlib.suppress(OSError):
                self._sock = socket.socket(fileno=os.dup(raw.fileno()))
                self._sock.setblocking(False)  # as the transport's is (one file description)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._view = None
        self._fail(WireError(f"connection closed ({exc})" if exc else "connection closed by the server"))

    def get_buffer(self, sizehint: int) -> memoryview:
        # Not every buffer handed out is filled (uvloop asks before each read it tries), so
        # ``buffer_updated`` goes by the last one.
        self._spill = None
        if self._view is not None:
            return self._view[self.received : self.received + RECV_BYTES]
        if self._seen < len(self._scratch):
            return memoryview(self._scratch)[self._seen :]
        # Full, and reading paused: uvloop may still read once or twice before the pause takes
        # (an empty buffer here is a fatal error for the connection).
        self._spill = bytearray(RECV_BYTES)
        return memoryview(self._spill)

    def buffer_updated(self, nbytes: int) -> None:
        self._last = time.monotonic()
        if self._view is not None:
            self.received += nbytes
            if self.received == len(self._view):
                self._view = None
                self._wake()
            return
        if self._spill is not None:
            self._extra.append(bytes(self._spill[:nbytes]))
            self._spill = None
            if sum(map(len, self._extra)) > 16 * RECV_BYTES:
                self._fail(WireError("server sent far more than a response head before its body was read"))
            return
        self._seen += nbytes
        if self._head_end >= 0:  # bytes after a complete head before the body was asked for
            if self._seen == len(self._scratch):
                self._pause()
            return
        end = self._scratch.find(b"\r\n\r\n", 0, self._seen)
        if end >= 0:
            self._head_end = end
            self._pause()  # until the caller says where the body goes
            self._wake()
        elif self._seen == len(self._scratch):
            self._fail(WireError(f"response head over {MAX_HEAD_BYTES} bytes"))

    def eof_received(self) -> bool | None:
        return None  # close

    # -- the caller's side ------------------------------------------------------------------
    async def request(self, data: bytes) -> tuple[int, str, Headers]:
        assert self._transport is not None and self._view is None
        self._seen, self._head_end, self.received, self._extra, self._spill = 0, -1, 0, [], None
        self._transport.write(data)
        while True:
            if self._head_end < 0:
                self._resume()
                await self._wait()
            try:
                status, reason, headers = _parse_head(bytes(self._scratch[: self._head_end]))
                if not 100 <= status < 200 or status == 101:
                    return status, reason, headers
                # An interim answer (103 Early Hints from a CDN, 100 Continue): dropped; the final
                # one follows on the same connection, maybe already in the buffer.
                if self._extra:
                    raise WireError(f"an interim {status} answer followed by more than a head's worth")
            except WireError:
                self.close()
                raise
            rest = bytes(self._scratch[self._head_end + 4 : self._seen])
            self._scratch[: len(rest)] = rest
            self._seen = len(rest)
            self._head_end = self._scratch.find(b"\r\n\r\n", 0, self._seen)

    async def read_into(self, view: memoryview) -> None:
        """Fill ``view`` exactly with the body; ``received`` counts what landed, also on failure."""
        first = memoryview(self._scratch)[self._head_end + 4 : self._seen]
        early = len(first) + sum(map(len, self._extra))
        if early > len(view):
            raise WireError("server sent more bytes than the response holds")
        view[: len(first)] = first
        at = len(first)
        for chunk in self._extra:
            view[at : at + len(chunk)] = chunk
            at += len(chunk)
        self._extra = []
        self.received = early
        if early == len(view):
            return
        if self.closed:
            raise WireError("connection closed mid-body")
        # By the body's length, not by what is left of it: which path a body takes does not
        # depend on how much of it came with the head.
        if self._sock is not None and len(view) >= THREAD_BODY_BYTES:
            await self._receive_on_thread(view)
            return
        self._view = view
        self._resume()
        await self._wait()

    async def _receive_on_thread(self, view: memoryview) -> None:
        """The rest of the body into ``view`` by ``_receive`` on a thread of the pool, reading
        paused on the loop meanwhile (the head was read with it paused after). Cancelled, the
        socket is shut down, which ends the thread's wait, and the thread is waited for; the
        connection is closed on any failure."""
        assert self._pool is not None and self._sock is not None
        await self._pool.start()
        task = asyncio.ensure_future(self._pool.run(_receive, self, self._sock, view, self._timeout))
        try:
            await asyncio.shield(task)
        except BaseException:
            if not task.done():
                with contextlib.suppress(OSError):
                    self._sock.shutdown(socket.SHUT_RDWR)
                await asyncio.wait([task])
            if not task.cancelled():
                task.exception()  # retrieved: the error raised is the one above
            self.close()
            raise

    async def _wait(self) -> None:
        loop = asyncio.get_running_loop()
        self._waiter = loop.create_future()
        self._last = time.monotonic()
        self._timer = loop.call_later(self._timeout, self._check)
        try:
            await self._waiter
        except BaseException:
            self.close()  # cancelled, timed out or broken: the destination gets no more bytes
            raise
        finally:
            self._waiter = None
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None

    def _check(self) -> None:
        idle = time.monotonic() - self._last
        if idle >= self._timeout:
            self._timer = None
            self._fail(asyncio.TimeoutError(f"no bytes for {self._timeout:g} s"))
        else:
            self._timer = asyncio.get_running_loop().call_later(self._timeout - idle, self._check)

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def _fail(self, exc: BaseException) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_exception(exc)

    def _pause(self) -> None:
        if self._transport is not None and not self.closed:
            self._transport.pause_reading()

    def _resume(self) -> None:
        if self._transport is not None and not self.closed:
            self._transport.resume_reading()

    def close(self) -> None:
        self._view = None
        self.closed = True
        if self._transport is not None:
            self._transport.abort()
        # Closed on the loop only, never while a thread receives (``_receive_on_thread`` waits).
        if self._sock is not None:
            self._sock.close()
            self._sock = None


def _receive(conn: _Connection, sock: socket.socket, view: memoryview, timeout: float) -> None:
    """On a thread: ``view[conn.received:]`` filled from ``sock``, made blocking meanwhile (the
    loop's transport is paused), by ``recv_into`` with ``MSG_WAITALL``: one call, and one take of
    the GIL, for the whole body unless it breaks off or stalls. (Polling the non-blocking socket
    and taking what it held per call measured the same: 2.8-3.6 GB/s, p99 3.1-4.1 ms; a thread
    blocked in ``poll`` also needed a pipe to be stopped, where a blocked ``recv_into`` ends when
    the loop shuts the socket down.) ``conn.received`` counts what landed. Raises ``WireError``
    when the connection ends early, ``asyncio.TimeoutError`` when ``timeout`` seconds pass with
    no bytes (``SO_RCVTIMEO``: a call that times out with some bytes returns them, and the next
    waits afresh)."""
    got, n = conn.received, len(view)
    sec = int(timeout)
    usec = max(int((timeout - sec) * 1e6), 0 if sec else 1)  # all zero would mean no timeout
    sock.setblocking(True)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("@ll", sec, usec))
        while got < n:
            try:
                r = sock.recv_into(view[got:], n - got, socket.MSG_WAITALL)
            except BlockingIOError:
                raise asyncio.TimeoutError(f"no bytes for {timeout:g} s") from None
            except OSError as exc:
                raise WireError(f"connection failed mid-body ({exc})") from exc
            if r == 0:
                raise WireError("connection closed mid-body")
            got += r
            conn.received = got
    finally:
        sock.setblocking(False)  # as the transport had it (one file description)


class Response:
    """A response whose head has been read: ``status``, ``reason``, ``headers``; the body is
    read with ``read_into`` (or ``read``) once, and only after the status has been checked."""

    def __init__(self, conn: _Connection, url: str, status: int, reason: str, headers: Headers) -> None:
        self._conn = conn
        self.url = url
        self.status, self.reason, self.headers = status, reason, headers
        self.done = False

    @property
    def received(self) -> int:
        return self._conn.received

    def _length(self) -> int:
        if self.headers.get("Transfer-Encoding") or self.headers.get("Content-Encoding", "identity") != "identity":
            raise Unsupported("an encoded body")
        length = self.headers.get("Content-Length")
        if length is None or not length.isdigit():
            raise Unsupported("no Content-Length")
        return int(length)

    async def read_into(self, view: memoryview) -> None:
        """The whole body into ``view``, which must be its exact length."""
        length = self._length()
        if length != len(view):
            raise WireError(f"Content-Length {length} for a {len(view)}-byte destination")
        await self._conn.read_into(view)
        self.done = True

    async def read(self) -> bytes:
        buf = bytearray(self._length())
        await self.read_into(memoryview(buf))
        return bytes(buf)


class Client:
    """Keep-alive connections per origin, at most ``limit`` requests at once."""

    def __init__(self, *, limit: int, timeout: float, ssl_context: ssl.SSLContext | None = None) -> None:
        self._gate = asyncio.Semaphore(limit)
        self._timeout = timeout
        self._pool = IOPool(limit)  # its threads receive long bodies (``THREAD_BODY_BYTES``)
        self._ssl = ssl_context
        self._idle: dict[tuple[str, str, int], list[_Connection]] = {}
        self._proxies = Proxies()
        self._closed = False

    async def open(self, url: str, headers: dict[str, str]) -> Response:
        """GET ``url`` and read the response's head, following redirects (``Authorization`` is
        not sent to another origin). Every response opened must be ``release``d. A successful
        one whose body this module cannot read raises ``Unsupported``."""
        await self._gate.acquire()
        try:
            resp = await self._follow(url, dict(headers))
            if 200 <= resp.status < 300:
                try:
                    resp._length()
                except Unsupported:
                    resp._conn.close()
                    raise
        except BaseException:
            self._gate.release()
            raise
        return resp

    def release(self, resp: Response) -> None:
        """The connection goes back to the pool if the body was read whole and the server keeps
        it open; otherwise it is closed."""
        conn = resp._conn
        keep = not self._closed and resp.done and not conn.closed
        if keep and resp.headers.get("Connection", "").lower() != "close":
            self._idle.setdefault(_origin(resp.url), []).append(conn)
        else:
            conn.close()
        self._gate.release()

    async def _follow(self, url: str, headers: dict[str, str]) -> Response:
        for _ in range(_MAX_REDIRECTS + 1):
            resp = await self._once(url, headers)
            location = resp.headers.get("Location")
            if resp.status not in _REDIRECTS or not location:
                return resp
            resp._conn.close()
            target = urljoin(url, location)
            if _origin(target) != _origin(url):
                headers = {k: v for k, v in headers.items() if k.lower() != "authorization"}
            url = target
        raise WireError(f"more than {_MAX_REDIRECTS} redirects")

    async def _once(self, url: str, headers: dict[str, str]) -> Response:
        parts = urlsplit(url)
        origin = _origin(url)
        if self._proxies(url) is not None:  # a redirect's target too
            raise Unsupported(f"the environment names a proxy for {origin[0]}://{origin[1]}")
        # As a browser sends it: spaces, control and non-ASCII characters percent-encoded (UTF-8),
        # escapes already there kept. A name from an index never reaches the request line raw.
        target = quote((parts.path or "/") + (f"?{parts.query}" if parts.query else ""), safe=_URL_SAFE)
        host = origin[1]
        host_header = f"[{host}]" if ":" in host else host
        if parts.port:
            host_header += f":{parts.port}"
        for k, v in headers.items():
            if any(c in f"{k}{v}" for c in "\r\n\0") or ":" in k:
                raise UsageError(f"header {k!r} holds a line break or a colon in its name")
        if parts.username is not None and not any(k.lower() == "authorization" for k in headers):
            user = f"{unquote(parts.username)}:{unquote(parts.password or '')}"
            headers = {**headers, "Authorization": "Basic " + base64.b64encode(user.encode()).decode()}
        lines = [f"GET {target} HTTP/1.1", f"Host: {host_header}", "User-Agent: aload"]
        lines += [f"{k}: {v}" for k, v in headers.items()]
        data = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
        conn = self._take(origin)
        fresh = conn is None
        while True:
            if conn is None:
                conn = await self._connect(origin)
            try:
                status, reason, head = await conn.request(data)
            except WireError:
                if fresh:
                    raise
                conn, fresh = None, True  # a kept connection the server had closed: once more, new
                continue
            return Response(conn, url, status, reason, head)

    def _take(self, origin: tuple[str, str, int]) -> _Connection | None:
        idle = self._idle.get(origin)
        while idle:
            conn = idle.pop()
            if not conn.closed:
                return conn
        return None

    async def _connect(self, origin: tuple[str, str, int]) -> _Connection:
        scheme, host, port = origin
        tls: Any = None
        if scheme == "https":
            if self._ssl is None:  # made once per client (tens of ms): an http:// store sent to https://
                self._ssl = ssl.create_default_context()
            tls = self._ssl
        loop = asyncio.get_running_loop()
        try:
            _, conn = await asyncio.wait_for(
                loop.create_connection(
                    lambda: _Connection(self._timeout, self._pool),
                    host,
                    port,
                    ssl=tls,
                    server_hostname=host if tls else None,
                ),
                self._timeout,
            )
        except ssl.SSLError:
            raise  # the caller names it: a certificate not trusted is not worth another attempt
        except OSError as exc:
            raise WireError(f"cannot connect to {host}:{port}: {exc}") from exc
        return conn

    def close(self) -> None:
        """Close the idle connections, and each busy one when it is released."""
        self._closed = True
        for conns in self._idle.values():
            for conn in conns:
                conn.close()
        self._idle.clear()

    async def aclose(self) -> None:
        """``close``, then wait for the threads that received bodies (none is busy by then)."""
        self.close()
        await self._pool.aclose()


#: Characters left as they are in a request target (besides letters, digits and ``_.-~``).
_URL_SAFE = "!#$%&'()*+,/:;=?@[]"


def _origin(url: str) -> tuple[str, str, int]:
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    host = parts.hostname or ""
    if not host.isascii():
        host = host.encode("idna").decode("ascii")
    return scheme, host, parts.port or (443 if scheme == "https" else 80)
