"""A small HTTP server on 127.0.0.1 that serves files with Range (aiohttp), for the demo and the
tests; it misbehaves on request.

    python examples/range_server.py FOLDER [--port 8765]

``faults[name]`` is a list of what to do to the next requests for ``name``, one entry each:
"503" (answer 503), "cut" (send half the body, then drop the connection), "ignore-range" (answer
200 with the whole object), "bad-range" (a Content-Range off by one), "trickle" (send slower than
any sane timeout), "replace" (serve the object's replacement from now on: new bytes, new ETag),
"redirect" (307 to the same name under ``redirect_base``, this server if unset), "chunked" (the
body, ranged or whole, with chunked transfer encoding, no Content-Length), "overlong" (a ranged answer
with 1 MiB more body than its range, chunked). ``etags=False`` serves no ETags (a replaced object
then shows only in Last-Modified). ``ForwardProxy`` is a forward
proxy on 127.0.0.1, for ``http_proxy``/``https_proxy``.
"""

from __future__ import annotations

import asyncio
import hashlib
import re
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from email.utils import format_datetime, parsedate_to_datetime
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from aiohttp import web

#: Every answer's Last-Modified (object stores and their clients expect one), later for a replacement.
LAST_MODIFIED_AT = datetime(2026, 12, 6, tzinfo=timezone.utc)


@dataclass
class FileServer:
    files: dict[str, bytes] = field(default_factory=dict)
    faults: dict[str, list[str]] = field(default_factory=dict)
    requests: list[tuple[str, str, str]] = field(default_factory=list)  # (method, name, Range)
    auth: str | None = None  # if set, the Authorization header every request must carry
    ssl: Any = None  # an ssl.SSLContext to serve HTTPS
    redirect_base: str = ""  # where "redirect" sends a request ("": this server)
    url: str = ""
    authorizations: list[str | None] = field(default_factory=list)  # each request's Authorization
    agents: list[str] = field(default_factory=list)  # each request's User-Agent
    connections: set[int] = field(default_factory=set)  # one id per connection that asked anything
    etags: bool = True  # False: answers carry no ETag, only Last-Modified
    _etags: dict[str, str] = field(default_factory=dict)
    _modified: dict[str, int] = field(default_factory=dict)  # seconds after LAST_MODIFIED_AT, per replacement

    def etag(self, name: str) -> str:
        if name not in self._etags:  # hashing a large file per request would dominate
            self._etags[name] = '"' + hashlib.md5(self.files[name]).hexdigest() + '"'
        return self._etags[name]

    def add_folder(self, folder: Path, prefix: str = "") -> None:
        """Every file under ``folder``, subfolders included, by its path relative to it."""
        for p in sorted(folder.rglob("*")):
            if p.is_file():
                self.files[prefix + p.relative_to(folder).as_posix()] = p.read_bytes()

    async def handle(self, request: web.Request) -> web.StreamResponse:
        name = request.match_info["name"]
        self.requests.append((request.method, name, request.headers.get("Range", "")))
        self.authorizations.append(request.headers.get("Authorization"))
        self.agents.append(request.headers.get("User-Agent", ""))
        self.connections.add(id(request.transport))
        if self.auth is not None and request.headers.get("Authorization") != self.auth:
            return web.Response(status=403, text="forbidden")
        if name not in self.files:
            return web.Response(status=404, text="not found")
        fault = self.faults.get(name, [None]).pop(0) if self.faults.get(name) else None
        if fault == "replace":
            self.files[name] = bytes(b ^ 0xFF for b in self.files[name])
            self._etags.pop(name, None)
            self._modified[name] = self._modified.get(name, 0) + 60
            fault = None
        data = self.files[name]
        etag = self.etag(name)
        modified = LAST_MODIFIED_AT + timedelta(seconds=self._modified.get(name, 0))
        stamp = {"Last-Modified": format_datetime(modified, usegmt=True)}
        if self.etags:
            stamp["ETag"] = etag
        if fault == "503":
            return web.Response(status=503, text="busy")
        if fault == "redirect":
            return web.Response(status=307, headers={"Location": f"{self.redirect_base}/{name}"})
        if_match = request.headers.get("If-Match")
        if if_match and if_match != etag:
            return web.Response(status=412, text="precondition failed")
        since = request.headers.get("If-Unmodified-Since")
        if since and parsedate_to_datetime(since) < modified:
            return web.Response(status=412, text="precondition failed")
        m = re.fullmatch(r"bytes=(\d+)-(\d+)", request.headers.get("Range", ""))
        if m is None or fault == "ignore-range":
            if fault == "chunked":
                whole = web.StreamResponse(headers=stamp)
                whole.enable_chunked_encoding()
                await whole.prepare(request)
                await whole.write(data)
                return whole
            return web.Response(body=data, headers=stamp)
        first, last = int(m.group(1)), min(int(m.group(2)), len(data) - 1)
        if first >= len(data):  # nothing of the range exists (an empty object): 416, as nginx says
            return web.Response(status=416, headers={"Content-Range": f"bytes */{len(data)}", **stamp})
        body = data[first : last + 1] + (b"\0" * (1 << 20) if fault == "overlong" else b"")
        shown = f"bytes {first + (1 if fault == 'bad-range' else 0)}-{last}/{len(data)}"
        headers = {"Content-Range": shown, **stamp, "Content-Length": str(len(body))}
        if fault in ("chunked", "overlong"):
            del headers["Content-Length"]
        resp = web.StreamResponse(status=206, headers=headers)
        if fault in ("chunked", "overlong"):
            resp.enable_chunked_encoding()
        await resp.prepare(request)
        if fault == "cut":
            await resp.write(body[: len(body) // 2])
            request.transport.close()  # type: ignore[union-attr]
            return resp
        if fault == "trickle":
            for i in range(0, len(body), 64):
                await resp.write(body[i : i + 64])
                await asyncio.sleep(0.5)
            return resp
        await resp.write(body)
        return resp

    async def __aenter__(self) -> FileServer:
        app = web.Application()
        app.router.add_get("/{name:.*}", self.handle)  # HEAD too, without the body
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0, ssl_context=self.ssl)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"{'https' if self.ssl else 'http'}://127.0.0.1:{port}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._runner.cleanup()


@dataclass
class ForwardProxy:
    """A forward proxy on 127.0.0.1, as ``http_proxy``/``https_proxy`` name one: absolute-form
    requests for ``http://`` targets (one per connection: it asks the origin to close after the
    answer) and ``CONNECT`` tunnels for ``https://``. ``requests`` records (method, target);
    ``auth``, if set, is the ``Proxy-Authorization`` every request must carry (else 407)."""

    requests: list[tuple[str, str]] = field(default_factory=list)
    auth: str | None = None
    url: str = ""
    _server: Any = None
    _tasks: set[Any] = field(default_factory=set)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)  # type: ignore[union-attr]
        up: asyncio.StreamWriter | None = None
        try:
            head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1")
            line, *fields = head.split("\r\n")
            method, target, version = line.split(" ", 2)
            self.requests.append((method, target))
            given = [f.split(":", 1)[1].strip() for f in fields if f.lower().startswith("proxy-authorization:")]
            if self.auth is not None and given != [self.auth]:
                writer.write(b"HTTP/1.1 407 Proxy Authentication Required\r\nContent-Length: 0\r\n\r\n")
                return
            if method == "CONNECT":
                host, port = target.rsplit(":", 1)
                up_r, up = await asyncio.open_connection(host, int(port))
                writer.write(b"HTTP/1.1 200 Connection established\r\n\r\n")
            else:
                parts = urlsplit(target)
                up_r, up = await asyncio.open_connection(parts.hostname, parts.port or 80)
                path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
                kept = [f for f in fields if f and not f.lower().startswith(("proxy-", "connection:"))]
                up.write(
                    "\r\n".join([f"{method} {path} {version}", *kept, "Connection: close", "", ""]).encode("latin-1")
                )
            await asyncio.gather(_pipe(reader, up), _pipe(up_r, writer))
        except (OSError, ValueError, asyncio.IncompleteReadError):
            pass
        finally:
            for w in (up, writer):
                if w is not None:
                    w.close()

    async def __aenter__(self) -> ForwardProxy:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._server.wait_closed()


async def _pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
    try:
        while data := await src.read(1 << 16):
            dst.write(data)
            await dst.drain()
    finally:
        if dst.can_write_eof() and not dst.is_closing():
            dst.write_eof()


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser(description="Serve FOLDER's files over HTTP with Range on 127.0.0.1.")
    ap.add_argument("folder", type=Path)
    ap.add_argument("--port", type=int, default=8765)
    a = ap.parse_args()
    srv = FileServer()
    srv.add_folder(a.folder)
    app = web.Application()
    app.router.add_route("GET", "/{name:.*}", srv.handle)
    web.run_app(app, host="127.0.0.1", port=a.port)


if __name__ == "__main__":
    main()
