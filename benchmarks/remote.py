"""Remote sources over loopback: nginx as the origin (HTTP, and a read-only S3-compatible endpoint
for GET/HEAD), against curl, a raw aiohttp ranged reader, a raw obstore ranged reader, and
Run:ai's streamer reading the same objects through the same endpoint.

    python benchmarks/remote.py [--size-gib 2] [--reps 3] [--out benchmarks/out/remote]

Needs nginx (Debian: apt-get install nginx-light); this script writes its own config and starts
it on 127.0.0.1. Each run is a fresh process. Most rows stream the tensors and drop them (no model:
transport and pipeline; a raw reader reuses one 16 MiB buffer, aload hands out whole tensors, so
it touches ~2x the largest tensor of fresh memory). The ``*_model`` rows deliver into a
preallocated model whose pages are touched before timing: the raw reader writes each range
straight to its place in one buffer the size of the files, aload loads the model (tensors >= 1 MiB
read straight into their parameters). Prints a table (median, min-max) and the targets as ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
LOADERS = (
    "curl",
    "aiohttp_raw",
    "aload_http",
    "obstore_raw",
    "aload_s3",
    "runai_s3",
    "aiohttp_raw_model",
    "aload_http_model",
    "aload_s3_model",
    "aload_http_model_verify",
)
BUCKET = "weights"
CHUNK, CONNS = 16 << 20, 4


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_nginx(root: Path, port: int, tmp: Path) -> subprocess.Popen[bytes]:
    conf = tmp / "nginx.conf"
    conf.write_text(f"""
user root; daemon off; worker_processes 2; pid {tmp}/nginx.pid; error_log {tmp}/error.log;
events {{ worker_connections 256; }}
http {{
  access_log off; sendfile on; tcp_nopush on; keepalive_requests 100000;
  client_body_temp_path {tmp}; proxy_temp_path {tmp}; fastcgi_temp_path {tmp}; uwsgi_temp_path {tmp}; scgi_temp_path {tmp};
  types {{ }} default_type application/octet-stream;
  server {{ listen 127.0.0.1:{port}; root {root}; location / {{ }} }}
}}
""")
    proc = subprocess.Popen(["nginx", "-c", str(conf), "-p", str(tmp)])
    for _ in range(100):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.1).close()
            return proc
        except OSError:
            time.sleep(0.05)
    raise SystemExit(f"nginx did not start; see {tmp}/error.log")


# -- one run, in its own process --------------------------------------------------------------------


async def raw_aiohttp(urls: list[str], sizes: list[int], dest: bytearray | None = None) -> int:
    """Ranged GETs of CHUNK bytes over CONNS connections, each body copied into one reused buffer,
    or with ``dest`` (the files' bytes end to end) into its place there."""
    import aiohttp

    gate = asyncio.Semaphore(CONNS)
    buf = bytearray(CHUNK)
    bases = [sum(sizes[:i]) for i in range(len(sizes))]

    async def one(session: aiohttp.ClientSession, url: str, base: int, off: int, n: int) -> None:
        async with gate, session.get(url, headers={"Range": f"bytes={off}-{off + n - 1}"}) as r:
            r.raise_for_status()
            view = memoryview(buf) if dest is None else memoryview(dest)[base + off : base + off + n]
            got = 0
            async for chunk in r.content.iter_any():
                view[got : got + len(chunk)] = chunk
                got += len(chunk)

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=CONNS)) as s:
        await asyncio.gather(
            *(
                one(s, u, b, off, min(CHUNK, n - off))
                for u, n, b in zip(urls, sizes, bases, strict=True)
                for off in range(0, n, CHUNK)
            )
        )
    return sum(sizes)


async def raw_obstore(endpoint: str, keys: list[str], sizes: list[int]) -> int:
    """The same ranged reads through obstore (Rust object_store; its own runtime threads)."""
    import obstore
    from obstore.store import S3Store

    store = S3Store(
        BUCKET,
        endpoint=endpoint,
        region="us-east-1",
        access_key_id="x",
        secret_access_key="x",
        virtual_hosted_style_request=False,
        client_options={"allow_http": True},
    )
    gate = asyncio.Semaphore(CONNS)
    buf = bytearray(CHUNK)

    async def one(key: str, off: int, n: int) -> None:
        async with gate:
            data = await obstore.get_range_async(store, key, start=off, length=n)
            memoryview(buf)[:n] = memoryview(data)

    await asyncio.gather(
        *(one(k, off, min(CHUNK, n - off)) for k, n in zip(keys, sizes, strict=True) for off in range(0, n, CHUNK))
    )
    return sum(sizes)


def run_one(loader: str, base: str, ckpt: Path, names: list[str], sizes: list[int]) -> dict[str, Any]:
    from aload.bench import Probe, bench_stream

    name = loader
    endpoint = base
    urls = [f"{base}/{BUCKET}/ckpt/{n}" for n in names]
    keys = [f"ckpt/{n}" for n in names]
    # The S3 client's configuration as a user gives it: the standard environment.
    os.environ.update(
        AWS_ENDPOINT_URL=endpoint,
        AWS_ACCESS_KEY_ID="x",
        AWS_SECRET_ACCESS_KEY="x",
        AWS_DEFAULT_REGION="us-east-1",
        AWS_REGION="us-east-1",
        AWS_EC2_METADATA_DISABLED="true",
    )

    model: Any = None
    dest: bytearray | None = None
    if "_model" in loader:
        import torch
        from safetensors import safe_open

        from examples.demo import empty_model

        shapes: dict[str, tuple[int, ...]] = {}
        for n in names:
            with safe_open(str(ckpt / n), "pt") as st:
                shapes.update((k, tuple(st.get_slice(k).get_shape())) for k in st.keys())
        model = empty_model(shapes, torch.bfloat16)  # zeros: every page touched before timing
        dest = bytearray(sum(sizes))  # zeroed: touched too
    verify: dict[str, str] | None = None
    if loader.endswith("_verify"):  # the manifest a user would have; computed before timing
        import hashlib

        verify = {}
        for n in names:
            h = hashlib.sha256()
            with open(ckpt / n, "rb") as f:
                while block := f.read(16 << 20):
                    h.update(block)
            verify[n] = h.hexdigest()

    async def main() -> dict[str, Any]:
        if loader in ("aload_http_model", "aload_s3_model", "aload_http_model_verify"):
            import aload

            src = f"{base}/{BUCKET}/ckpt" if loader.startswith("aload_http") else f"s3://{BUCKET}/ckpt/"
            async with Probe() as probe:
                t0 = time.perf_counter()
                report = await aload.load(model, src, concurrency=CONNS, chunk_bytes=CHUNK, verify=verify)
                seconds = time.perf_counter() - t0
            assert verify is None or report.verified_shards == len(names)
            return {
                "bytes": report.bytes,
                "seconds": seconds,
                "gbps": report.bytes / seconds / 1e9,
                "ttft_s": report.ttft_s,
                **probe.row(),
            }
        if loader == "aload_http":
            return await bench_stream(
                f"{base}/{BUCKET}/ckpt", max_inflight_bytes=512 << 20, concurrency=CONNS, chunk_bytes=CHUNK
            )
        if loader == "aload_s3":
            return await bench_stream(
                f"s3://{BUCKET}/ckpt/", max_inflight_bytes=512 << 20, concurrency=CONNS, chunk_bytes=CHUNK
            )
        async with Probe() as probe:
            t0 = time.perf_counter()
            if loader in ("aiohttp_raw", "aiohttp_raw_model"):
                nbytes = await raw_aiohttp(urls, sizes, dest)
            elif loader == "obstore_raw":
                nbytes = await raw_obstore(endpoint, keys, sizes)
            elif loader == "curl":
                procs = [await asyncio.create_subprocess_exec("curl", "-sf", "-o", "/dev/null", u) for u in urls]
                await asyncio.gather(*(p.wait() for p in procs))
                nbytes = sum(sizes)
            elif loader == "runai_s3":
                os.environ.update(RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING="0")

                def runai() -> int:
                    from runai_model_streamer import SafetensorsStreamer

                    total = 0
                    with SafetensorsStreamer() as st:
                        st.stream_files([f"s3://{BUCKET}/ckpt/{n}" for n in names])
                        for _name, t in st.get_tensors():
                            total += t.nbytes
                    return total

                nbytes = await asyncio.to_thread(runai)
            else:
                raise SystemExit(f"unknown loader {loader}")
            seconds = time.perf_counter() - t0
        return {"bytes": nbytes, "seconds": seconds, "gbps": nbytes / seconds / 1e9, "ttft_s": None, **probe.row()}

    cpu0 = time.process_time()  # every thread of this process; curl's own processes are not counted
    row = asyncio.run(main())
    row["cpu_s"] = time.process_time() - cpu0
    row["loader"] = name
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-gib", type=float, default=2.0)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", type=Path, default=HERE / "out" / "remote")
    ap.add_argument("--loaders", default=",".join(LOADERS))
    ap.add_argument("--run", help=argparse.SUPPRESS)
    ap.add_argument("--base", help=argparse.SUPPRESS)
    ap.add_argument("--names", help=argparse.SUPPRESS)
    a = ap.parse_args()
    a.out = a.out.resolve() / f"{a.size_gib:g}g"  # nginx's root: the bucket folder inside it
    ckpt = a.out / BUCKET / "ckpt"
    if a.run:
        names = a.names.split(",")
        print(json.dumps(run_one(a.run, a.base, ckpt, names, [(ckpt / n).stat().st_size for n in names])))
        return
    if shutil.which("nginx") is None:
        raise SystemExit("needs nginx (apt-get install nginx-light)")
    from benchmarks.suite import cache_bytecode, make_llama, warm_cache

    cache_bytecode()
    make_llama(ckpt, a.size_gib)
    names = sorted(p.name for p in ckpt.iterdir())
    shard_names = [n for n in names if n.endswith(".safetensors")]
    warm_cache(ckpt)
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        nginx = start_nginx(a.out, port, Path(tmp))
        base = f"http://127.0.0.1:{port}"
        rows = []
        try:
            loaders = a.loaders.split(",")
            for rep in range(a.reps):
                for ld in loaders if rep % 2 == 0 else loaders[::-1]:
                    out = subprocess.run(
                        [
                            sys.executable,
                            __file__,
                            "--run",
                            ld,
                            "--base",
                            base,
                            "--out",
                            str(a.out.parent),
                            "--size-gib",
                            str(a.size_gib),
                            "--names",
                            ",".join(shard_names),
                        ],
                        capture_output=True,
                        text=True,
                    )
                    if out.returncode:
                        print(f"  {ld} failed: {out.stderr.strip().splitlines()[-1:]}", flush=True)
                        continue
                    row = json.loads(out.stdout.strip().splitlines()[-1])
                    row.update(rep=rep, source="loopback")
                    rows.append(row)
                    print(
                        f"  rep {rep} {ld:>16}: {row['gbps']:.2f} GB/s, loop lag p99 {row['loop_lag_p99_ms']:.1f} ms",
                        flush=True,
                    )
        finally:
            nginx.terminate()
            nginx.wait()
    med = {
        ld: statistics.median(r["gbps"] for r in rows if r["loader"] == ld)
        for ld in dict.fromkeys(r["loader"] for r in rows)
    }
    print("\n| loader | GB/s | CPU s/GB | loop lag p99 ms | peak RSS MiB |\n|---|---|---|---|---|")
    for ld in med:
        rs = [r for r in rows if r["loader"] == ld]
        g = [r["gbps"] for r in rs]
        print(
            f"| {ld} | {statistics.median(g):.2f} ({min(g):.2f}-{max(g):.2f}) | "
            f"{statistics.median(r['cpu_s'] / (r['bytes'] / 1e9) for r in rs):.2f} | "
            f"{statistics.median(r['loop_lag_p99_ms'] for r in rs):.2f} | "
            f"{statistics.median(r['peak_rss_delta_bytes'] for r in rs) / 2**20:.0f} |"
        )

    def ratio(x: str, y: str) -> str:
        return f"{med[x] / med[y]:.2f}x" if x in med and y in med and med[y] else "-"

    print(
        f"\naload http / raw aiohttp = {ratio('aload_http', 'aiohttp_raw')} (target >= 0.8); "
        f"aload http / curl = {ratio('aload_http', 'curl')} (target >= 0.6); "
        f"aload s3 / raw obstore = {ratio('aload_s3', 'obstore_raw')} (target >= 0.8); "
        f"aload s3 / Run:ai = {ratio('aload_s3', 'runai_s3')} (target >= 1)\n"
        f"into a model: aload http / raw aiohttp = {ratio('aload_http_model', 'aiohttp_raw_model')}; "
        f"aload http / curl = {ratio('aload_http_model', 'curl')}; "
        f"with SHA-256 verification / without = {ratio('aload_http_model_verify', 'aload_http_model')}"
    )
    (a.out / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


if __name__ == "__main__":
    main()
