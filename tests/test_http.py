"""HTTP sources against a real local server that honours Range, and misbehaves on request."""

from __future__ import annotations

import asyncio
import os
import ssl
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import aload
from examples.range_server import FileServer

from .conftest import collect, llama_like

MiB = 1 << 20


def tls_server(tmp_path: Path) -> tuple[ssl.SSLContext, Path]:
    """A server-side TLS context for 127.0.0.1 from a fresh test CA, and that CA's PEM file."""
    import trustme

    ca = trustme.CA()
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("127.0.0.1").configure_cert(server_ctx)
    ca_file = tmp_path / "ca.pem"
    ca.cert_pem.write_to_path(str(ca_file))
    return server_ctx, ca_file


@pytest.fixture
def folder(sharded: Callable[..., Path]) -> Path:
    tensors = llama_like(hidden=128)
    tensors["big"] = torch.randn(MiB // 2)  # 2 MiB: several chunks at chunk_bytes=1 MiB
    return sharded(tensors, 3)


async def test_http_stream_equals_local_and_budget_holds(folder: Path, bodies: str) -> None:
    local = await collect(aload.stream(folder))
    async with FileServer() as srv:
        srv.add_folder(folder)
        async with aload.stream(srv.url + "/", max_inflight_bytes=4 * MiB, chunk_bytes=MiB // 2) as s:
            remote = await collect(s)
            stats = s.stats
    assert list(remote) == list(local) and all(torch.equal(remote[k], local[k]) for k in local)
    assert stats.peak_inflight_bytes <= 4 * MiB and stats.bytes_read == stats.bytes


async def test_opening_costs_one_request_per_shard(folder: Path, write: Callable[..., Path]) -> None:
    """Each shard's size and header come from one ranged GET (a size probe and a read were two
    round trips); an object shorter than the probe comes back whole, its range ending at its end,
    and its data is not asked for again."""
    from aload.checkpoint import HEADER_PROBE_BYTES

    small = write({"a": torch.arange(4.0)}, name="small/model.safetensors")
    assert small.stat().st_size < HEADER_PROBE_BYTES
    sizes = {p.name: p.stat().st_size for p in folder.glob("*.safetensors")}
    async with FileServer() as srv:
        srv.add_folder(folder)
        srv.add_folder(small.parent, prefix="small/")
        async with await aload.open(srv.url) as ckpt:
            assert {s.name: s.size for s in ckpt.shards} == sizes
        got = await collect(aload.stream(f"{srv.url}/small/model.safetensors"))
        asked = [(n, r) for m, n, r in srv.requests if n.endswith(".safetensors")]
    probe = f"bytes=0-{HEADER_PROBE_BYTES - 1}"
    assert sorted(asked[: len(sizes)]) == sorted((n, probe) for n in sizes)
    assert [r for n, r in asked[len(sizes) :]] == [probe]  # and nothing for the data
    assert got["a"].tolist() == [0.0, 1.0, 2.0, 3.0]


async def test_a_large_index_is_read_whole(sharded: Callable[..., Path]) -> None:
    """An index of a few hundred KB over HTTP: the whole body, not what had arrived when the first
    read returned (an 8.7 MB index came back as its first ~128 KB, and failed to parse)."""
    tensors = {f"model.layers.{i}.experts.{i % 7}.w": torch.full((2,), float(i)) for i in range(6000)}
    folder = sharded(tensors, 4)
    assert (folder / "model.safetensors.index.json").stat().st_size > 256 << 10
    async with FileServer() as srv:
        srv.add_folder(folder)
        remote = await collect(aload.stream(srv.url))
    assert len(remote) == len(tensors) and all(torch.equal(remote[k], v) for k, v in tensors.items())


async def test_an_empty_object_is_named_as_too_short(tmp_path: Path) -> None:
    """An empty file answers a ranged GET with 416 (``bytes */0``): the error says the file is
    too short for a header, not that the server lacks Range support."""
    (tmp_path / "empty.safetensors").write_bytes(b"")
    async with FileServer() as srv:
        srv.add_folder(tmp_path)
        with pytest.raises(aload.HeaderError, match="0 bytes, too short") as info:
            await aload.open(f"{srv.url}/empty.safetensors")
    assert "empty.safetensors" in str(info.value)


async def test_single_object_and_folder_without_index(write: Callable[..., Path]) -> None:
    path = write({"a": torch.arange(10.0), "b": torch.ones(3, dtype=torch.bfloat16)})
    async with FileServer() as srv:
        srv.files["model.safetensors"] = path.read_bytes()
        one = await collect(aload.stream(srv.url + "/model.safetensors"))
        folder = await collect(aload.stream(srv.url))  # no index: falls back to model.safetensors
    assert torch.equal(one["a"], torch.arange(10.0)) and one.keys() == folder.keys()


async def test_load_into_a_model_over_http(folder: Path) -> None:
    class Keep(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.got: dict[str, torch.Tensor] = {}

        def load_weights(self, weights: object) -> set[str]:
            for n, t in weights:  # type: ignore[attr-defined]
                self.got[n] = t.clone()
            return set()

    async with FileServer() as srv:
        srv.add_folder(folder)
        model = Keep()
        report = await aload.load(model, srv.url, max_inflight_bytes=4 * MiB)
    assert report.tensors == len(model.got) and report.peak_inflight_bytes <= 4 * MiB


@pytest.mark.parametrize("fault", ["503", "cut"])
async def test_transient_failures_are_retried_and_resumed(folder: Path, fault: str, bodies: str) -> None:
    local = await collect(aload.stream(folder))
    async with FileServer() as srv:
        srv.add_folder(folder)
        shard = "model-00001-of-00003.safetensors"
        srv.faults[shard] = [None, fault, fault]  # after the size probe: two bad answers, then fine
        remote = await collect(aload.stream(srv.url, chunk_bytes=MiB, retries=4, timeout=5))
        retried = [r for m, n, r in srv.requests if n == shard]
    assert all(torch.equal(remote[k], local[k]) for k in local)
    if fault == "cut":  # a retry resumed where the body broke off (half way), not from the start
        spans = [tuple(map(int, r.removeprefix("bytes=").split("-"))) for r in retried if r]
        assert any(b[1] == a[1] and b[0] == a[0] + (a[1] - a[0] + 1) // 2 for a in spans for b in spans if a != b)


@pytest.mark.parametrize(
    ("fault", "message"),
    [
        ("ignore-range", "ignored Range"),
        ("bad-range", "Content-Range"),
        ("replace", "changed during the load"),
    ],
)
async def test_misbehaving_server_never_yields_wrong_bytes(folder: Path, fault: str, message: str, bodies: str) -> None:
    async with FileServer() as srv:
        srv.add_folder(folder)
        shard = "model-00002-of-00003.safetensors"
        srv.faults[shard] = [None, fault]  # the header read succeeds, the next request misbehaves
        with pytest.raises(aload.SourceError, match=message) as info:
            await collect(aload.stream(srv.url, retries=2, timeout=5))
    assert shard in str(info.value)


async def test_a_stalled_server_times_out_with_the_range_named(folder: Path, bodies: str) -> None:
    async with FileServer() as srv:
        srv.add_folder(folder)
        shard = "model-00003-of-00003.safetensors"
        srv.faults[shard] = [None, "trickle", "trickle"]
        with pytest.raises(aload.SourceError, match="gave up after 2 attempts") as info:
            await collect(aload.stream(srv.url, retries=2, timeout=0.2))
    assert info.value.byte_range is not None and shard in str(info.value)


async def test_missing_object_and_credentials_never_printed(folder: Path) -> None:
    async with FileServer() as srv:
        srv.add_folder(folder)
        srv.auth = "Bearer s3cr3t-token"
        with pytest.raises(aload.SourceError, match="403") as info:
            await aload.open(srv.url + "/model-00001-of-00003.safetensors?sig=s3cr3t-query")
        assert "s3cr3t" not in str(info.value) and "s3cr3t" not in repr(info.value)
        ok = await collect(aload.stream(srv.url, token="s3cr3t-token"))
        assert ok
        with pytest.raises(aload.SourceError, match="404"):
            await aload.open(srv.url + "/nope.safetensors", token="s3cr3t-token")


async def test_https_refuses_an_untrusted_certificate_and_accepts_a_given_ca(
    tmp_path: Path, write: Callable[..., Path]
) -> None:
    server_ctx, ca_file = tls_server(tmp_path)
    path = write({"w": torch.arange(6.0)})
    made: list[bool] = []  # per TLS context from the bundle: made on the loop's thread?
    real = ssl.create_default_context

    def watched(*args: Any, **kwargs: Any) -> ssl.SSLContext:
        if kwargs.get("cafile") == str(ca_file):
            made.append(threading.current_thread() is threading.main_thread())
        return real(*args, **kwargs)

    async with FileServer(ssl=server_ctx) as srv:
        srv.files["model.safetensors"] = path.read_bytes()
        assert srv.url.startswith("https://")
        with pytest.raises(aload.SourceError, match="TLS certificate not trusted"):
            await aload.open(srv.url + "/model.safetensors")
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(ssl, "create_default_context", watched)
            got = await collect(aload.stream(srv.url + "/model.safetensors", ca_bundle=str(ca_file)))
    assert torch.equal(got["w"], torch.arange(6.0))
    assert made == [False]  # once, on a thread: loading a bundle parses every certificate in it


async def test_buffers_are_leased_just_ahead_of_the_reads(
    write: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    # 4 MiB tensors read as 1 MiB ranges over 2 connections, a budget of 256 MiB and a consumer
    # faster than the server: the next buffer is leased only once fewer than 2 x 2 x 1 MiB of
    # leased bytes are unread, so what is in flight stays near what is being read rather than
    # growing to the budget (fresh pages were the slow part of HTTP loads on the VM measured).
    # Bodies on the loop: received on threads they come faster than this consumer takes them,
    # and finished units wait for it (within the budget, as they should).
    from aload import wire

    monkeypatch.setattr(wire, "THREAD_BODY_BYTES", 1 << 62)
    g = torch.Generator().manual_seed(3)
    tensors = {f"w{i}": torch.randn(1024, 1024, generator=g) for i in range(12)}
    path = write(tensors)
    async with FileServer() as srv:
        srv.add_folder(path.parent)
        url = f"{srv.url}/{path.name}"
        async with aload.stream(url, max_inflight_bytes=256 * MiB, concurrency=2, chunk_bytes=MiB) as s:
            sums = {name: float(t.sum()) async for name, t in s}
            stats = s.stats
    assert sums == {k: float(v.sum()) for k, v in tensors.items()}
    # held by the consumer (4) + being read (4) + the next one leased (4) + alignment
    assert stats.peak_inflight_bytes <= 13 * MiB, stats.peak_inflight_bytes >> 20


async def test_ranged_reads_reuse_a_few_connections(folder: Path) -> None:
    """Ranged GETs go over kept-alive connections: many requests, at most concurrency + 2
    connections (one per request would cost a handshake each, and a TLS one over HTTPS)."""
    async with FileServer() as srv:
        srv.add_folder(folder)
        await collect(aload.stream(srv.url, chunk_bytes=MiB // 4, concurrency=2))
        ranged = [r for m, n, r in srv.requests if r]
    assert len(ranged) >= 10 and len(srv.connections) <= 2 + 2  # the index's GET among them


async def test_redirects_are_followed_and_credentials_stay_with_their_origin(folder: Path) -> None:
    """A 307 within the origin is followed with the same headers; to another origin, without the
    Authorization header (a CDN behind a hub's redirect must not see the hub's token)."""
    local = await collect(aload.stream(folder))
    shard = "model-00001-of-00003.safetensors"
    async with FileServer() as cdn, FileServer(auth="Bearer hub-token") as hub:
        cdn.add_folder(folder)
        hub.add_folder(folder)
        hub.faults[shard] = ["redirect", "redirect"]  # the size probe and the first data read
        remote = await collect(aload.stream(hub.url, token="hub-token", chunk_bytes=MiB))
        assert [n for m, n, r in hub.requests].count(shard) >= 3  # both redirects were followed here
        hub.redirect_base = cdn.url
        hub.faults[shard] = [None, "redirect"]
        again = await collect(aload.stream(hub.url, token="hub-token", chunk_bytes=MiB))
    assert all(torch.equal(remote[k], local[k]) and torch.equal(again[k], local[k]) for k in local)
    assert [n for m, n, r in cdn.requests] == [shard]  # one read went to the other origin ...
    assert cdn.authorizations == [None]  # ... without the token


async def test_a_chunked_answer_is_read_through_aiohttp(folder: Path) -> None:
    """A ranged answer without Content-Length (chunked) is not read straight into place: the
    request is asked again through aiohttp, and so is every later one of the load."""
    local = await collect(aload.stream(folder))
    shard = "model-00001-of-00003.safetensors"
    async with FileServer() as srv:
        srv.add_folder(folder)
        srv.faults[shard] = ["chunked", "chunked", "chunked"]
        remote = await collect(aload.stream(srv.url, chunk_bytes=MiB))
        asked = [r for m, n, r in srv.requests if n == shard]
    assert all(torch.equal(remote[k], local[k]) for k in local)
    assert asked[0] == asked[1]  # the probe, asked again


async def test_a_chunked_index_alone_is_read_through_aiohttp(folder: Path) -> None:
    """An index sent chunked is asked again through aiohttp; the ranged reads stay on ``wire``
    (how a server sends a small JSON file says nothing about its ranged answers)."""
    local = await collect(aload.stream(folder))
    index = "model.safetensors.index.json"
    async with FileServer() as srv:
        srv.add_folder(folder)
        srv.faults[index] = ["chunked"]
        remote = await collect(aload.stream(srv.url, chunk_bytes=MiB))
        agents = list(zip(srv.requests, srv.agents, strict=True))
    assert all(torch.equal(remote[k], local[k]) for k in local)
    asked = [(n, a) for (m, n, r), a in agents if n == index]
    assert [a.startswith("aload") for n, a in asked] == [True, False]  # asked again, through aiohttp
    ranged = [a for (m, n, r), a in agents if r]
    assert ranged and all(a == "aload" for a in ranged)


async def test_a_load_over_http_does_not_import_aiohttp(folder: Path) -> None:
    """A process's first ``http://`` load that ``wire`` reads whole imports no aiohttp: its
    ~150 ms of imports, on a thread, would hold the GIL and the loop with it meanwhile."""
    async with FileServer() as srv:
        srv.add_folder(folder)
        code = (
            "import asyncio, sys, aload\n"
            "async def main():\n"
            f"    async with aload.stream({srv.url!r}) as s:\n"
            "        n = sum([1 async for _ in s])\n"
            "    print(n, 'aiohttp' in sys.modules)\n"
            "asyncio.run(main())\n"
        )
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-c", code, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
        )
        out, err = await proc.communicate()
    assert proc.returncode == 0, err.decode()
    count, imported = out.decode().split()
    assert int(count) == len(llama_like(hidden=128)) + 1 and imported == "False"


@pytest.mark.parametrize("proxy", ["", "http://127.0.0.1:9"])
def test_preload_imports_aiohttp_only_where_a_proxy_needs_it(proxy: str) -> None:
    code = "import sys, aload; aload.preload('http'); print('aiohttp' in sys.modules)"
    env = {k: v for k, v in os.environ.items() if "proxy" not in k.lower()} | ({"http_proxy": proxy} if proxy else {})
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == [str(bool(proxy))]


async def test_a_cancelled_read_writes_nothing_more_into_its_buffer(folder: Path, bodies: str) -> None:
    """Once a read is cancelled, its connection is closed and the destination gets no more bytes
    (they would land in a buffer the reader has handed to another unit)."""
    from aload import wire

    shard = "model-00001-of-00003.safetensors"
    async with FileServer() as srv:
        srv.add_folder(folder)
        srv.faults[shard] = ["trickle"]  # 64 bytes every 0.5 s
        client = wire.Client(limit=2, timeout=30)
        resp = await client.open(f"{srv.url}/{shard}", {"Range": "bytes=0-4095"})
        dest = bytearray(4096)
        task = asyncio.ensure_future(resp.read_into(memoryview(dest)))
        await asyncio.sleep(0.7)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        before = bytes(dest)
        await asyncio.sleep(1.1)  # two more trickles would have come
        client.release(resp)
        await client.aclose()
    assert 0 < resp.received < 4096 and bytes(dest) == before
    assert dest[: resp.received] == (folder / shard).read_bytes()[: resp.received]


def test_under_uvloop_no_request_is_asked_twice(folder: Path, caplog: pytest.LogCaptureFixture, bodies: str) -> None:
    """uvloop asks the protocol for a buffer before every read it tries, also while reading is
    paused: the body bytes that come then are kept, and no connection breaks (a broken one was
    retried silently: the load succeeded, with every data read asked twice)."""
    import uvloop

    local = asyncio.run(collect(aload.stream(folder)))

    async def main() -> tuple[dict[str, torch.Tensor], list[tuple[str, str, str]]]:
        async with FileServer() as srv:
            srv.add_folder(folder)
            got = await collect(aload.stream(srv.url, chunk_bytes=MiB // 2))
            return got, list(srv.requests)

    with caplog.at_level("INFO", logger="aload"):
        remote, requests = uvloop.run(main())
    assert all(torch.equal(remote[k], local[k]) for k in local)
    ranged = [(n, r) for m, n, r in requests if r]
    assert len(ranged) == len(set(ranged)) and not caplog.records


@pytest.mark.parametrize("runner", ["asyncio", "uvloop"])
def test_https_bodies_straight_into_place_under_either_loop(
    folder: Path, tmp_path: Path, runner: str, caplog: pytest.LogCaptureFixture, bodies: str
) -> None:
    """Over TLS the decrypted body goes into the destination through the loop's TLS layer, with
    reading paused between a response's head and its body: every byte right, no range asked twice."""
    import uvloop

    server_ctx, ca_file = tls_server(tmp_path)
    local = asyncio.run(collect(aload.stream(folder)))

    async def main() -> tuple[dict[str, torch.Tensor], list[tuple[str, str, str]]]:
        async with FileServer(ssl=server_ctx) as srv:
            srv.add_folder(folder)
            got = await collect(aload.stream(srv.url, chunk_bytes=MiB // 2, ca_bundle=str(ca_file)))
            return got, list(srv.requests)

    with caplog.at_level("INFO", logger="aload"):
        remote, requests = (uvloop.run if runner == "uvloop" else asyncio.run)(main())
    assert all(torch.equal(remote[k], local[k]) for k in local)
    ranged = [(n, r) for m, n, r in requests if r]
    assert len(ranged) == len(set(ranged)) and not caplog.records


@pytest.mark.parametrize("runner", ["asyncio", "uvloop"])
def test_long_bodies_are_received_on_threads_over_plain_http(
    folder: Path, tmp_path: Path, runner: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """By default a body of ``THREAD_BODY_BYTES`` or more on a plain connection is received on one
    of the client's threads, the rest on the loop; over TLS every body is received on the loop."""
    import uvloop

    from aload import wire

    threads: list[str] = []
    receive = wire._receive

    def spy(conn: Any, sock: Any, view: memoryview, timeout: float) -> None:
        threads.append(threading.current_thread().name)
        receive(conn, sock, view, timeout)

    monkeypatch.setattr(wire, "_receive", spy)
    server_ctx, ca_file = tls_server(tmp_path)
    local = asyncio.run(collect(aload.stream(folder)))
    big = [k for k, t in local.items() if t.nbytes >= wire.THREAD_BODY_BYTES]

    async def main(tls: bool) -> dict[str, torch.Tensor]:
        async with FileServer(ssl=server_ctx if tls else None) as srv:
            srv.add_folder(folder)
            return await collect(aload.stream(srv.url, chunk_bytes=4 * MiB, ca_bundle=str(ca_file) if tls else None))

    run = uvloop.run if runner == "uvloop" else asyncio.run
    remote = run(main(tls=False))
    assert all(torch.equal(remote[k], local[k]) for k in local)
    assert big and len(threads) >= len(big) and all(name.startswith("aload-io") for name in threads)
    threads.clear()
    remote = run(main(tls=True))
    assert all(torch.equal(remote[k], local[k]) for k in local) and threads == []


@pytest.mark.parametrize("split", [False, True])
async def test_interim_answers_are_skipped(split: bool) -> None:
    """A 103 Early Hints (or 100 Continue) before the real answer, in the same packet or apart,
    is dropped: the status, headers and body are the final answer's."""
    from aload import wire

    body = bytes(range(256)) * 64

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        interim = b"HTTP/1.1 103 Early Hints\r\nLink: </x>; rel=preload\r\n\r\n"
        final = f"HTTP/1.1 206 Partial Content\r\nContent-Range: bytes 0-{len(body) - 1}/{len(body)}\r\n"
        final += f"Content-Length: {len(body)}\r\n\r\n"
        writer.write(interim + (b"" if split else final.encode()))
        if split:
            await writer.drain()
            await asyncio.sleep(0.05)
            writer.write(final.encode())
        writer.write(body)
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    client = wire.Client(limit=1, timeout=5)
    try:
        resp = await client.open(f"http://127.0.0.1:{port}/x", {"Range": f"bytes=0-{len(body) - 1}"})
        assert (resp.status, resp.headers.get("content-range")) == (206, f"bytes 0-{len(body) - 1}/{len(body)}")
        got = await resp.read()
        client.release(resp)
    finally:
        await client.aclose()
        server.close()
        await server.wait_closed()
    assert got == body


async def test_request_lines_and_headers_are_well_formed(write: Callable[..., Path]) -> None:
    """A name with a space or non-ASCII letters is percent-encoded in the request line, a password
    in the URL becomes Basic authorization, and a header with a line break is refused, never sent."""
    import base64

    path = write({"w": torch.arange(6.0)}, name="odd/model ünï.safetensors")
    basic = "Basic " + base64.b64encode(b"user:p@ss word").decode()
    async with FileServer(auth=basic) as srv:
        srv.files["model ünï.safetensors"] = path.read_bytes()
        url = srv.url.replace("http://", "http://user:p%40ss%20word@") + "/model%20%C3%BCn%C3%AF.safetensors"
        got = await collect(aload.stream(url))
        raw = await collect(aload.stream(url.replace("%20%C3%BCn%C3%AF", " ünï")))  # as a user may type it
        assert torch.equal(got["w"], torch.arange(6.0)) and torch.equal(raw["w"], torch.arange(6.0))
        assert {n for m, n, r in srv.requests} == {"model ünï.safetensors"}
        with pytest.raises(aload.UsageError, match="line break"):
            await aload.open(srv.url + "/model%20%C3%BCn%C3%AF.safetensors", headers={"X-A": "1\r\nX-B: 2"})


async def test_a_cancelled_load_leaves_no_connection_open(folder: Path, bodies: str) -> None:
    """Cancelling a load while a body trickles in closes every connection it opened, at once."""
    import os

    shard = "model-00002-of-00003.safetensors"
    fds = len(os.listdir("/proc/self/fd"))
    async with FileServer() as srv:
        srv.add_folder(folder)
        srv.faults[shard] = [None, "trickle"]  # the header probe, then a data read that stalls
        task = asyncio.ensure_future(collect(aload.stream(srv.url, chunk_bytes=MiB, timeout=30)))
        for _ in range(100):  # until the trickling read has started
            await asyncio.sleep(0.02)
            if [n for m, n, r in srv.requests].count(shard) == 2:
                break
        await asyncio.sleep(0.1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        server = srv._runner.server
        assert server is not None
        for _ in range(100):  # the server sees the closes within a few ms; allow a busy machine 2 s
            if all(h.transport is None for h in server.connections):
                break
            await asyncio.sleep(0.02)
        assert all(h.transport is None for h in server.connections)  # every connection disconnected
    assert len(os.listdir("/proc/self/fd")) <= fds


@pytest.mark.parametrize(
    ("answer", "message"),
    [
        (b"HTTP/1.1 abc OK\r\n\r\n", "not an HTTP/1.x status line"),
        (b"SSH-2.0-OpenSSH\r\n\r\n", "not an HTTP/1.x status line"),
        (b"HTTP/1.1 206 OK\r\nX: " + b"y" * (70 << 10) + b"\r\n\r\n", "response head over"),
        (b"HTTP/1.1 206 OK\r\nno colon here\r\n\r\n", "malformed header line"),
        (b"HTTP/1.1 302 Found\r\nLocation: /again\r\n\r\n", "more than 10 redirects"),
        (
            b"HTTP/1.1 206 OK\r\nContent-Range: bytes 0-65535/99999\r\nContent-Length: 65536\r\n\r\nabc",
            "connection closed",
        ),
    ],
)
async def test_a_server_that_is_not_http_gets_a_named_error(answer: bytes, message: str, bodies: str) -> None:
    """Garbage, an endless head, a redirect loop or a body cut short: each attempt fails with the
    cause in the log, and the load fails naming the URL and the range, without hanging."""
    import logging

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                await reader.readuntil(b"\r\n\r\n")
                writer.write(answer)
                await writer.drain()
                if b"206" in answer:
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda r: records.append(r.getMessage())  # type: ignore[method-assign]
    logging.getLogger("aload").addHandler(handler)
    try:
        with pytest.raises(aload.SourceError, match="gave up after 2 attempts") as info:
            await asyncio.wait_for(aload.open(f"http://127.0.0.1:{port}/model.safetensors", retries=2, timeout=5), 20)
    finally:
        logging.getLogger("aload").removeHandler(handler)
        server.close()
        await server.wait_closed()
    assert "model.safetensors" in str(info.value) and "bytes" in str(info.value)
    assert any(message in r for r in records), records


async def test_a_proxy_from_the_environment_carries_every_request(
    folder: Path, proxy_env: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """With ``http_proxy`` set every request goes through the proxy (through aiohttp: ``aload.wire``
    connects only directly), with the credentials in the proxy's URL, never printed; ``no_proxy``
    covering the host sends them straight again."""
    import base64

    from examples.range_server import ForwardProxy

    local = await collect(aload.stream(folder))
    secret = "p@ss w0rd"
    async with (
        FileServer() as srv,
        ForwardProxy(auth="Basic " + base64.b64encode(f"me:{secret}".encode()).decode()) as proxy,
    ):
        srv.add_folder(folder)
        proxy_env.setenv("HTTP_PROXY", proxy.url.replace("http://", "http://me:p%40ss%20w0rd@"))
        remote = await collect(aload.stream(srv.url, chunk_bytes=MiB))
        through, served = list(proxy.requests), len(srv.requests)
        proxy_env.setenv("HTTP_PROXY", proxy.url.replace("http://", "http://me:wrong-p4ss@"))
        with pytest.raises(aload.SourceError, match="407") as info:
            await aload.open(srv.url)
        assert "wrong-p4ss" not in str(info.value) and "wrong-p4ss" not in caplog.text
        proxy_env.setenv("NO_PROXY", "127.0.0.1")
        proxy.requests.clear()
        again = await collect(aload.stream(srv.url, chunk_bytes=MiB))
    assert all(torch.equal(remote[k], local[k]) and torch.equal(again[k], local[k]) for k in local)
    assert len(through) == served >= 5  # the index, a probe per shard, the data
    assert all(m == "GET" and t.startswith(srv.url + "/") for m, t in through)
    assert proxy.requests == []  # no_proxy: straight to the server


async def test_https_through_a_proxy_tunnel(
    tmp_path: Path, write: Callable[..., Path], proxy_env: pytest.MonkeyPatch
) -> None:
    """``https_proxy``: a CONNECT tunnel per connection (the proxy's credentials on it), TLS to the
    origin inside it, with the given CA."""
    from examples.range_server import ForwardProxy

    server_ctx, ca_file = tls_server(tmp_path)
    tensors = {f"t{i}": torch.randn(256, 1024) for i in range(4)}
    path = write(tensors)
    async with FileServer(ssl=server_ctx) as srv, ForwardProxy(auth="Basic bWU6c2VjcmV0") as proxy:  # me:secret
        srv.files["model.safetensors"] = path.read_bytes()
        proxy_env.setenv("HTTPS_PROXY", proxy.url.replace("http://", "http://me:secret@"))
        got = await collect(aload.stream(srv.url + "/model.safetensors", ca_bundle=str(ca_file), chunk_bytes=MiB))
    assert all(torch.equal(got[k], v) for k, v in tensors.items())
    host = srv.url.removeprefix("https://")
    assert proxy.requests and all(r == ("CONNECT", host) for r in proxy.requests)
