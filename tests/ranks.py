"""What each rank of a test's process group runs (``test_distributed.py``): a real gloo group of
2 or 4 processes on 127.0.0.1, started with ``torch.multiprocessing`` (spawn). Each scenario
returns a JSON-able dict, written to ``OUT/rank{r}.json``; an exception is recorded as
``{"error": type, "message": ...}``."""

from __future__ import annotations

import asyncio
import datetime
import hashlib
import json
import os
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import aload

Scenario = Callable[[int, int, dict[str, Any]], Awaitable[dict[str, Any]]]
SCENARIOS: dict[str, Scenario] = {}


def scenario(fn: Scenario) -> Scenario:
    SCENARIOS[fn.__name__] = fn
    return fn


def digest(name: str, t: torch.Tensor) -> str:
    data = t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
    return hashlib.sha256(name.encode() + b"\0" + str(list(t.shape)).encode() + data).hexdigest()[:16]


async def streamed(url: str, **options: Any) -> tuple[list[str], aload.ReaderStats]:
    out = []
    async with aload.stream(url, **options) as s:
        async for name, t in s:
            out.append(digest(name, t))
        return out, s.stats


def tp_stage(rank: int, world: int) -> aload.stages.Stage:
    return aload.stages.tensor_parallel(
        rank, world, column=[r"q_proj", r"k_proj", r"v_proj", r"gate_proj", r"up_proj"], row=[r"o_proj", r"down_proj"]
    )


@scenario
async def same_pairs(rank: int, world: int, a: dict[str, Any]) -> dict[str, Any]:
    """The pairs each mode gives, with what this rank read; and a transformers model loaded."""
    out: dict[str, Any] = {}
    for mode in a["modes"]:
        agent = {"client_options": {"user_agent": f"rank{rank}"}} if "://" in a["url"] else {}
        pairs, stats = await streamed(
            a["url"], group=True, share=mode, chunk_bytes=64 << 10, max_inflight_bytes=256 << 10, **agent
        )
        out[mode] = {"pairs": pairs, "bytes_read": stats.bytes_read, "bytes_received": stats.bytes_received,
                     "peak": stats.peak_inflight_bytes, "overdraft": stats.overdraft_bytes}  # fmt: skip
    if a.get("tp"):
        pairs, stats = await streamed(a["url"], group=True, stages=tp_stage(rank, world), chunk_bytes=64 << 10)
        out["tp"] = {"pairs": pairs, "bytes_read": stats.bytes_read, "bytes_received": stats.bytes_received}
    if a.get("model"):
        from transformers import AutoConfig, AutoModelForCausalLM

        with torch.device("cpu"):
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(a["url"]))
        torch.nn.init.zeros_(model.lm_head.weight)
        report = await aload.load(model, a["url"], group=True, chunk_bytes=64 << 10, max_inflight_bytes=1 << 20)
        state = model.state_dict()
        out["model"] = {
            "state": [digest(k, v) for k, v in state.items()],
            "installed": report.installed,
            "bytes_read": report.bytes_read,
            "bytes_received": report.bytes_received,
        }
    return out


@scenario
async def one_fails(rank: int, world: int, a: dict[str, Any]) -> dict[str, Any]:
    """Rank ``a["rank"]`` fails as ``a["how"]`` says; every rank records how its load ended."""
    failing = rank == a["rank"]
    seen = 0

    async def consume() -> None:
        nonlocal seen
        async with aload.stream(a["url"], group=True, chunk_bytes=16 << 10, max_inflight_bytes=64 << 10,
                                group_timeout=a.get("timeout", 60)) as s:  # fmt: skip
            async for _name, _t in s:
                seen += 1
                if failing and seen == 3:
                    if a["how"] == "raise":
                        raise RuntimeError("the consumer of rank 1 broke")
                    if a["how"] == "exit":
                        os._exit(3)
                    if a["how"] == "cancel":
                        asyncio.current_task().cancel()  # type: ignore[union-attr]
                    if a["how"] == "stall":
                        await asyncio.sleep(a["stall"])
                await asyncio.sleep(0)

    t = time.monotonic()
    try:
        await consume()
        ended = {"ok": True}
    except asyncio.CancelledError:
        ended = {"error": "CancelledError", "message": ""}
    except Exception as exc:
        ended = {"error": type(exc).__name__, "message": str(exc), "rank": getattr(exc, "rank", None)}
    time.sleep(0.2)
    ended["seconds"] = time.monotonic() - t
    ended["threads"] = [th.name for th in threading.enumerate() if th.name.startswith("aload")]
    ended["seen"] = seen
    return ended


def main(rank: int, world: int, port: int, name: str, out: str, args: dict[str, Any]) -> None:
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
        timeout=datetime.timedelta(seconds=60),
    )  # fmt: skip
    try:
        result = asyncio.run(SCENARIOS[name](rank, world, args))
    except BaseException as exc:  # recorded for the test to judge
        result = {"error": type(exc).__name__, "message": str(exc)}
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    os._exit(0)  # no group teardown: a peer that failed may be gone already


def run(world: int, name: str, out: Path, args: dict[str, Any], timeout: float = 120) -> list[dict[str, Any]]:
    """``name`` on ``world`` fresh processes; each rank's result (None for a rank that wrote none).
    A process still running after ``timeout`` seconds is killed and reported as hung."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=main, args=(r, world, port, name, str(out), args), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    hung = []
    for r, p in enumerate(procs):
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            hung.append(r)
            p.kill()
            p.join()
    assert not hung, f"ranks {hung} hung"
    results = []
    for r in range(world):
        f = out / f"rank{r}.json"
        results.append(json.loads(f.read_text()) if f.exists() else None)
    return results
