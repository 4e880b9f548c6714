"""Ways to read one object over HTTP into a buffer, from nginx on loopback, with a 1 ms ticker on
the event loop: aiohttp (bodies as ``bytes`` chunks, copied into place); ``aload.wire`` as it
runs (``wire (threads)``: each head read on the loop, each body by one blocking ``recv_into`` on
the client's threads) and with every body kept on the loop (``wire (loop)``: an
``asyncio.BufferedProtocol``, the kernel copying into place on the loop's thread); and blocking
sockets on worker threads (``recv_into`` the destination in 1 MiB steps, the loop not involved).

    python benchmarks/http_transports.py [--size-gib 1] [--conns 2,4] [--reps 3]

Needs nginx (Debian: apt-get install nginx-light). Ranges of 16 MiB; each transport fills one
buffer the size of the object, its pages touched before timing; the bytes are compared with the
file after each run. Prints GB/s, CPU s per GB (every thread of this process) and loop lateness.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import socket
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.remote import free_port, start_nginx

CHUNK = 16 << 20


async def with_aiohttp(url: str, size: int, dest: bytearray, conns: int) -> None:
    import aiohttp

    gate = asyncio.Semaphore(conns)

    async def one(session: aiohttp.ClientSession, off: int, n: int) -> None:
        async with gate, session.get(url, headers={"Range": f"bytes={off}-{off + n - 1}"}) as r:
            view, got = memoryview(dest)[off : off + n], 0
            async for chunk in r.content.iter_any():
                view[got : got + len(chunk)] = chunk
                got += len(chunk)

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=conns)) as s:
        await asyncio.gather(*(one(s, off, min(CHUNK, size - off)) for off in range(0, size, CHUNK)))


async def with_wire_on_loop(url: str, size: int, dest: bytearray, conns: int) -> None:
    from aload import wire

    kept, wire.THREAD_BODY_BYTES = wire.THREAD_BODY_BYTES, 1 << 62
    try:
        await with_wire(url, size, dest, conns)
    finally:
        wire.THREAD_BODY_BYTES = kept


async def with_wire(url: str, size: int, dest: bytearray, conns: int) -> None:
    from aload import wire

    client = wire.Client(limit=conns, timeout=30)

    async def one(off: int, n: int) -> None:
        resp = await client.open(url, {"Range": f"bytes={off}-{off + n - 1}"})
        try:
            await resp.read_into(memoryview(dest)[off : off + n])
        finally:
            client.release(resp)

    try:
        await asyncio.gather(*(one(off, min(CHUNK, size - off)) for off in range(0, size, CHUNK)))
    finally:
        await client.aclose()


def _threads(port: int, path: str, recv: int) -> Callable[[str, int, bytearray, int], Awaitable[None]]:
    async def run(url: str, size: int, dest: bytearray, conns: int) -> None:
        local = threading.local()

        def one(off: int, n: int) -> None:
            s = getattr(local, "sock", None)
            if s is None:
                s = local.sock = socket.create_connection(("127.0.0.1", port))
                socks.append(s)
            s.sendall(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nRange: bytes={off}-{off + n - 1}\r\n\r\n".encode())
            head = b""
            while b"\r\n\r\n" not in head:
                part = s.recv(65536)
                if not part:
                    raise ConnectionError("closed")
                head += part
            early = head.partition(b"\r\n\r\n")[2]
            view = memoryview(dest)[off : off + n]
            view[: len(early)] = early
            got = len(early)
            while got < n:
                k = s.recv_into(view[got : got + recv])  # the GIL let go while the kernel copies
                if not k:
                    raise ConnectionError("closed")
                got += k

        socks: list[socket.socket] = []
        loop = asyncio.get_running_loop()
        with concurrent.futures.ThreadPoolExecutor(conns) as ex:
            try:
                await asyncio.gather(
                    *(loop.run_in_executor(ex, one, off, min(CHUNK, size - off)) for off in range(0, size, CHUNK))
                )
            finally:
                for s in socks:
                    s.close()

    return run


async def timed(fn: Callable[..., Awaitable[None]], *args: object) -> tuple[float, float, float]:
    """(seconds, CPU seconds, p99 lateness ms) of ``fn(*args)`` with a 1 ms ticker running."""
    late: list[float] = []
    done = asyncio.Event()

    async def tick() -> None:
        while not done.is_set():
            t = time.perf_counter()
            await asyncio.sleep(0.001)
            late.append((time.perf_counter() - t - 0.001) * 1e3)

    ticker = asyncio.ensure_future(tick())
    c0, t0 = time.process_time(), time.perf_counter()
    await fn(*args)
    seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    done.set()
    await ticker
    late.sort()
    return seconds, cpu, late[min(len(late) - 1, int(0.99 * len(late)))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-gib", type=float, default=1.0)
    ap.add_argument("--conns", default="2,4")
    ap.add_argument("--reps", type=int, default=3)
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp())
    size = int(a.size_gib * (1 << 30))
    blob = tmp / "root" / "blob.bin"
    blob.parent.mkdir()
    with open(blob, "wb") as f:
        for _ in range(0, size, 1 << 24):
            f.write(bytes(range(256)) * (1 << 16))
    size = blob.stat().st_size
    want = blob.read_bytes()
    port = free_port()
    proc = start_nginx(blob.parent, port, tmp)
    url = f"http://127.0.0.1:{port}/blob.bin"
    try:
        dest = bytearray(size)
        for i in range(0, size, 4096):
            dest[i] = 1  # touched: first touches are not what is measured
        rows: dict[str, list[tuple[float, float, float]]] = {}
        for rep in range(a.reps):
            for conns in map(int, a.conns.split(",")):
                transports = {
                    f"aiohttp x{conns}": with_aiohttp,
                    f"wire (loop) x{conns}": with_wire_on_loop,
                    f"wire (threads) x{conns}": with_wire,
                    f"threads x{conns}": _threads(port, "/blob.bin", 1 << 20),
                }
                for name, fn in transports.items():
                    dest[:1] = b"\xff"
                    rows.setdefault(name, []).append(asyncio.run(timed(fn, url, size, dest, conns)))
                    assert dest == want, f"{name}: bytes differ"
                    print(f"  rep {rep} {name}: {size / rows[name][-1][0] / 1e9:.2f} GB/s", flush=True)
        print("\n| transport | GB/s | CPU s/GB | loop lag p99 ms |\n|---|---|---|---|")
        for name, runs in rows.items():
            gbps = [size / s / 1e9 for s, _, _ in runs]
            print(
                f"| {name} | {statistics.median(gbps):.2f} ({min(gbps):.2f}-{max(gbps):.2f}) "
                f"| {statistics.median(c / (size / 1e9) for _, c, _ in runs):.2f} "
                f"| {statistics.median(p for _, _, p in runs):.2f} |"
            )
    finally:
        proc.terminate()
        proc.wait()


if __name__ == "__main__":
    main()
