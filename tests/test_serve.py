"""The serving frontend, driven by a real HTTP client over loopback during a load and reloads."""

from __future__ import annotations

import asyncio
import statistics
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import torch
from aiohttp import web

from examples.range_server import FileServer
from examples.serve import Server, engine_llama_factory

from .conftest import hf_llama

IDS = [[5, 9, 14, 3, 27, 8]]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Two Llama checkpoints with different weights, written by transformers, and what each
    model answers for IDS; plus a corrupt one."""
    out: dict[str, Any] = {}
    for name, seed in (("a", 0), ("b", 1)):
        model = hf_llama(
            seed,
            vocab_size=512,
            hidden_size=256,
            intermediate_size=688,
            num_hidden_layers=4,
            num_attention_heads=8,
            num_key_value_heads=4,
        )
        folder = tmp_path_factory.mktemp(name) / "ckpt"
        model.save_pretrained(folder, max_shard_size="2MB")
        with torch.no_grad():
            out[name] = (str(folder), model(torch.tensor(IDS)).logits.argmax(-1).tolist())
    assert out["a"][1] != out["b"][1]
    bad = Path(out["b"][0]).parent / "bad"
    bad.mkdir()
    for f in Path(out["b"][0]).iterdir():
        data = f.read_bytes()
        (bad / f.name).write_bytes(data[:-64] if f.suffix == ".safetensors" else data)  # truncated shards
    out["bad"] = (str(bad), None)
    return out


async def test_serves_while_loading_and_swaps_atomically(checkpoints: dict[str, Any]) -> None:
    def slow_factory(folder: Path) -> torch.nn.Module:
        time.sleep(0.3)  # a model that takes a while to build (in a thread): requests keep coming
        return engine_llama_factory(folder)

    root = str(Path(checkpoints["a"][0]).parents[1])  # every checkpoint's folder is under it
    server = Server(slow_factory, allow=[root])
    runner = web.AppRunner(server.app(checkpoints["a"][0]))
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    base = f"http://127.0.0.1:{port}"
    health_ms: list[float] = []
    answers: list[dict[str, Any]] = []
    try:
        async with aiohttp.ClientSession() as http:

            async def health_until(predicate: Any) -> dict[str, Any]:
                while True:
                    t = time.perf_counter()
                    async with http.get(f"{base}/health") as r:
                        assert r.status == 200
                    health_ms.append((time.perf_counter() - t) * 1e3)
                    async with http.get(f"{base}/ready") as r:
                        ready = await r.json()
                    if predicate(ready):
                        return ready
                    await asyncio.sleep(0.002)

            # 1. listening at once; the load runs behind /health
            ready = await health_until(lambda s: s["ready"] or s["error"])
            assert ready["ready"] and ready["version"] == 1 and ready["error"] is None, ready

            async def generate() -> None:
                async with http.post(f"{base}/generate", json={"ids": IDS}) as r:
                    assert r.status == 200
                    answers.append(await r.json())

            await generate()
            assert answers[-1] == {"version": 1, "next": checkpoints["a"][1]}

            # 2. reload while requests keep coming: each sees the old weights or the new
            async with http.post(f"{base}/reload", json={"checkpoint": checkpoints["b"][0]}) as r:
                assert r.status == 202
            during = len(answers)
            while True:
                await asyncio.gather(*(generate() for _ in range(4)))
                async with http.get(f"{base}/ready") as r:
                    state = await r.json()
                if state["version"] == 2 and not state["loading"]:
                    break
            await generate()
            expected = {1: checkpoints["a"][1], 2: checkpoints["b"][1]}
            assert all(a["next"] == expected[a["version"]] for a in answers)
            assert any(a["version"] == 1 for a in answers[during:])  # served the old weights meanwhile
            assert answers[-1]["version"] == 2

            # 3. a reload that fails leaves the new weights serving and says why
            async with http.post(f"{base}/reload", json={"checkpoint": checkpoints["bad"][0]}) as r:
                assert r.status == 202
            state = await health_until(lambda s: not s["loading"])
            assert state["version"] == 2 and state["ready"] and "bad/model-" in (state["error"] or ""), state
            await generate()
            assert answers[-1] == {"version": 2, "next": checkpoints["b"][1]}

            # 4. a reload from a remote checkpoint (HTTP): config.json and weights come over the wire
            async with FileServer() as origin:
                origin.add_folder(Path(checkpoints["a"][0]))
                server.allow.append(origin.url)
                async with http.post(f"{base}/reload", json={"checkpoint": origin.url}) as r:
                    assert r.status == 202
                state = await health_until(lambda s: not s["loading"])
            assert state["version"] == 3 and state["error"] is None and state["checkpoint"] == origin.url, state
            await generate()
            assert answers[-1] == {"version": 3, "next": checkpoints["a"][1]}

            # 5. a cancelled reload: the old weights keep serving
            async with http.post(f"{base}/reload", json={"checkpoint": checkpoints["a"][0]}) as r:
                assert r.status == 202
            async with http.delete(f"{base}/reload") as r:
                assert r.status == 200 and (await r.json())["version"] == 3
            async with http.get(f"{base}/ready") as r:
                state = await r.json()
            assert state["version"] == 3 and not state["loading"] and "cancelled" in state["error"], state
            await generate()
            assert answers[-1] == {"version": 3, "next": checkpoints["a"][1]}
    finally:
        await runner.cleanup()
    print(
        f"\n/health during loads: {len(health_ms)} requests, p50 {statistics.median(health_ms):.2f} ms, "
        f"max {max(health_ms):.2f} ms; /generate answers {len(answers)}, all consistent"
    )


async def test_bad_requests_refused_reloads_and_a_shape_mismatch_are_named(
    checkpoints: dict[str, Any], tmp_path: Path, caplog: Any
) -> None:
    import json
    import logging
    import shutil

    caplog.set_level(logging.INFO, logger="serve")
    mismatch = tmp_path / "allowed" / "mismatch"
    shutil.copytree(checkpoints["a"][0], mismatch)
    config = json.loads((mismatch / "config.json").read_text())
    (mismatch / "config.json").write_text(json.dumps({**config, "intermediate_size": 512}))
    server = Server(engine_llama_factory, allow=[str(tmp_path / "allowed")])
    runner = web.AppRunner(server.app(checkpoints["a"][0]))
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    base = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]
    try:
        async with aiohttp.ClientSession() as http:
            while server.model is None:
                await asyncio.sleep(0.01)
            assert "loaded " in caplog.text and "tensors" in caplog.text  # the report line, logged
            bad = [
                ("generate", b"not json"),
                ("generate", b"[1, 2]"),
                ("generate", b'{"ids": [[1, 2], [3]]}'),
                ("generate", b'{"ids": [["a"]]}'),
                ("generate", b'{"ids": [[100000]]}'),
                ("generate", b'{"ids": []}'),
                ("reload", b'{"checkpoint": 7}'),
                ("reload", b"{}"),
            ]
            for path, body in bad:
                async with http.post(f"{base}/{path}", data=body) as r:
                    assert r.status == 400, (path, body, r.status)
                    assert (await r.json())["error"]
            for outside in [checkpoints["b"][0], str(tmp_path / "allowed" / ".." / "x"), "http://127.0.0.1:1/m"]:
                async with http.post(f"{base}/reload", json={"checkpoint": outside}) as r:
                    assert r.status == 403, outside
            assert "refused" in caplog.text
            async with http.post(f"{base}/reload", json={"checkpoint": str(mismatch)}) as r:
                assert r.status == 202
            while server.loading is not None and not server.loading.done():
                await asyncio.sleep(0.01)
            assert server.version == 1 and "mlp.gate_proj.weight" in (server.error or ""), server.error
            assert "[688, 256]" in server.error and "[512, 256]" in server.error
    finally:
        await runner.cleanup()
