"""Ranks of a process group sharing one read: 1, 2 and 4 ranks (gloo, processes on this host)
stream one checkpoint from a local HTTP origin and from S3 (moto's server), each mode against
every rank reading everything (``share="none"``).

    python benchmarks/distributed.py [--size-mib 256] [--reps 3] [--ranks 1,2,4] [--out benchmarks/out/distributed]

Per row: the bytes the origin served (the HTTP server's log of ranged GETs, header probes
included; for S3 the ranks' own ``bytes_read``), that per rank, and the wall time of the slowest
rank (median of ``--reps`` runs, each a fresh set of processes). On one host the ranks share its
cores and its loopback, so the time column says what the coordination costs here; the bytes
column is what a shared origin (an object store, a model registry, a NAS) is spared.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import re
import socket
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def write_checkpoint(folder: Path, size_mib: int) -> int:
    """Llama-shaped bf16 tensors in two shards, about ``size_mib`` MiB."""
    import torch
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    hidden = 1024
    per_layer = 12 * hidden * hidden * 2
    layers = max(2, size_mib * 2**20 // per_layer)
    g = torch.Generator().manual_seed(0)
    tensors: dict[str, torch.Tensor] = {}
    for i in range(layers):
        p = f"model.layers.{i}."
        for name, shape in {"self_attn.qkv_proj": (3 * hidden, hidden), "self_attn.o_proj": (hidden, hidden),
                            "mlp.gate_up_proj": (8 * hidden // 2 * 2, hidden) , "input_layernorm": (hidden,)}.items():  # fmt: skip
            tensors[p + name + ".weight"] = torch.randn(*shape, generator=g).to(torch.bfloat16)
    names = list(tensors)
    half = len(names) // 2
    weight_map = {}
    for k, part in enumerate((names[:half], names[half:])):
        fname = f"model-{k + 1:05d}-of-00002.safetensors"
        save_file({n: tensors[n] for n in part}, str(folder / fname))
        weight_map.update({n: fname for n in part})
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return sum(t.nbytes for t in tensors.values())


def rank_main(rank: int, world: int, port: int, url: str, mode: str, out: str, env: dict[str, str]) -> None:
    os.environ.update(env)
    import torch.distributed as dist

    import aload

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))  # fmt: skip

    async def go() -> dict[str, Any]:
        opts: dict[str, Any] = {"client_options": {"user_agent": f"rank{rank}"}}
        if world > 1:
            opts.update(group=True, share=mode)
        t = time.perf_counter()
        async with aload.stream(url, **opts) as s:
            async for _name, _t in s:
                pass
            stats = s.stats
        return {"seconds": time.perf_counter() - t, "bytes_read": stats.bytes_read, "bytes": stats.bytes}

    Path(out, f"rank{rank}.json").write_text(json.dumps(asyncio.run(go())))
    os._exit(0)


def run_ranks(world: int, url: str, mode: str, env: dict[str, str], tmp: Path) -> list[dict[str, Any]]:
    import torch.multiprocessing as mp

    for f in tmp.glob("rank*.json"):
        f.unlink()
    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=rank_main, args=(r, world, port, url, mode, str(tmp), env)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(600)
    return [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(world)]


class Origin:
    """The Range server of examples/ on a loop of its own thread, with its request log."""

    def __init__(self, folder: Path) -> None:
        from examples.range_server import FileServer

        self.server = FileServer()
        self.server.add_folder(folder)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self.server.__aenter__(), self.loop).result()
        self.url = self.server.url

    def served(self) -> int:
        n = 0
        for _method, _name, rng in list(self.server.requests):
            m = re.fullmatch(r"bytes=(\d+)-(\d+)", rng)
            if m:
                n += int(m.group(2)) - int(m.group(1)) + 1
        return n

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.server.__aexit__(None, None, None), self.loop).result()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-mib", type=int, default=256)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--ranks", default="1,2,4")
    ap.add_argument("--out", type=Path, default=HERE / "out" / "distributed")
    ap.add_argument("--sources", default="http,s3")
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    folder = a.out / "ckpt"
    total = write_checkpoint(folder, a.size_mib)
    worlds = [int(w) for w in a.ranks.split(",")]
    rows: list[dict[str, Any]] = []
    sources = a.sources.split(",")
    for source in sources:
        env: dict[str, str] = {}
        stop: Any = None
        origin: Origin | None = None
        if source == "http":
            origin = Origin(folder)
            url = origin.url
        else:
            import logging

            import boto3
            from moto.server import ThreadedMotoServer

            logging.getLogger("werkzeug").setLevel(logging.ERROR)  # moto's server logs every request

            server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
            server.start()
            host, port = server.get_host_and_port()
            env = {"AWS_ACCESS_KEY_ID": "k", "AWS_SECRET_ACCESS_KEY": "s", "AWS_REGION": "us-east-1",
                   "AWS_ENDPOINT_URL": f"http://{host}:{port}"}  # fmt: skip
            s3 = boto3.client("s3", endpoint_url=env["AWS_ENDPOINT_URL"], aws_access_key_id="k",
                              aws_secret_access_key="s", region_name="us-east-1")  # fmt: skip
            s3.create_bucket(Bucket="weights")
            for f in folder.iterdir():
                s3.upload_file(str(f), "weights", f"ckpt/{f.name}")
            url, stop = "s3://weights/ckpt", server.stop
        for world in worlds:
            for mode in (["none"] if world == 1 else ["none", "broadcast"]):
                times, served = [], []
                for _ in range(a.reps):
                    before = origin.served() if origin else 0
                    res = run_ranks(world, url, mode, env, a.out)
                    assert all(r["bytes"] == total for r in res)
                    times.append(max(r["seconds"] for r in res))
                    served.append(origin.served() - before if origin else sum(r["bytes_read"] for r in res))
                row = {"source": source, "ranks": world, "share": mode, "bytes": total,
                       "origin_bytes": statistics.median(served), "seconds": statistics.median(times),
                       "seconds_runs": times}  # fmt: skip
                rows.append(row)
                print(f"{source} {world} rank(s) share={mode}: origin served {row['origin_bytes'] / 2**20:.0f} MiB "
                      f"({row['origin_bytes'] / total / world:.2f} of the checkpoint per rank), "
                      f"slowest rank {row['seconds']:.2f} s", flush=True)  # fmt: skip
        if origin:
            origin.close()
        if stop:
            stop()
    (a.out / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"\ncheckpoint {total / 2**20:.0f} MiB; {os.cpu_count()} CPUs\n")
    print("| source | ranks | share | origin bytes / checkpoint | per rank | slowest rank s |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['source']} | {r['ranks']} | {r['share']} | {r['origin_bytes'] / total:.2f} | "
              f"{r['origin_bytes'] / total / r['ranks']:.2f} | {r['seconds']:.2f} |")  # fmt: skip


if __name__ == "__main__":
    main()
