"""An async serving frontend that answers while it loads (aiohttp).

    python examples/serve.py CHECKPOINT [--port 8000]      # CHECKPOINT: a Hugging Face Llama folder

It listens at once and loads the model in the background with ``aload.load``:

- ``GET /health``  answers throughout, loading or not;
- ``GET /ready``   whether weights are in, and how far the current load is (bytes, tensors, ETA);
- ``POST /generate`` ``{"ids": [[...]]}`` runs the model (next-token argmax per position);
- ``POST /reload`` ``{"checkpoint": PATH}`` loads a new checkpoint into a fresh model while requests
  keep being served, then swaps it in with one assignment: a request sees the old weights or the
  new, never a mix. ``DELETE /reload`` cancels a running load. A failed or cancelled reload
  leaves the old weights serving and says why.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from aiohttp import web
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import aload
from aload.sources import open_store
from examples.engine_llama import Config, EngineLlama

ModelFactory = Callable[[Path], nn.Module]


def engine_llama_factory(folder: Path) -> nn.Module:
    """A fresh (empty) engine-style Llama shaped by the checkpoint's config.json."""
    from transformers import LlamaConfig

    return EngineLlama(Config.from_hf(LlamaConfig.from_pretrained(folder)))


async def config_folder(checkpoint: str, tmp: Path) -> Path:
    """A local folder holding the checkpoint's config.json: the checkpoint itself when local,
    else ``tmp`` with config.json fetched through aload's source for the URL (http(s), s3)."""
    if "://" not in checkpoint or checkpoint.startswith("file://"):
        return Path(checkpoint.removeprefix("file://"))
    store = open_store(checkpoint, concurrency=2)
    try:
        data = await store.run(store.get, "config.json", 1 << 20)
    finally:
        await store.aclose()
    if data is None:
        raise aload.CheckpointError("no config.json beside the weights", url=checkpoint)
    (tmp / "config.json").write_bytes(data)
    return tmp


class Server:
    def __init__(self, factory: ModelFactory = engine_llama_factory) -> None:
        self.factory = factory
        self.model: nn.Module | None = None  # swapped by one assignment: the consistency point
        self.version = 0
        self.checkpoint: str | None = None
        self.progress: aload.Progress | None = None
        self.loading: asyncio.Task[None] | None = None
        self.error: str | None = None
        self.last_report: dict[str, Any] | None = None

    def start_load(self, checkpoint: str) -> bool:
        if self.loading is not None and not self.loading.done():
            return False
        self.error, self.progress = None, None
        self.loading = asyncio.ensure_future(self._load(checkpoint))
        return True

    async def _load(self, checkpoint: str) -> None:
        try:
            with tempfile.TemporaryDirectory() as tmp:
                folder = await config_folder(checkpoint, Path(tmp))
                model = await asyncio.to_thread(self.factory, folder)
            report = await aload.load(model, checkpoint, progress=self._on_progress)
            model.eval()
            self.model, self.checkpoint = model, checkpoint  # the swap
            self.version += 1
            self.last_report = asdict(report)
        except asyncio.CancelledError:
            self.error = "load cancelled; the previous weights keep serving"
            raise
        except Exception as exc:  # reported on /ready; the old model keeps serving
            self.error = f"{type(exc).__name__}: {exc}"

    def _on_progress(self, p: aload.Progress) -> None:
        self.progress = p

    # -- handlers -------------------------------------------------------------------------
    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def ready(self, request: web.Request) -> web.Response:
        body: dict[str, Any] = {
            "ready": self.model is not None,
            "version": self.version,
            "checkpoint": self.checkpoint,
            "loading": self.loading is not None and not self.loading.done(),
            "error": self.error,
        }
        p = self.progress
        if p is not None:
            rate = p.bytes / p.elapsed_s if p.elapsed_s > 0 else 0.0
            body["progress"] = {
                "bytes": p.bytes,
                "bytes_total": p.bytes_total,
                "tensors": p.tensors,
                "tensors_total": p.tensors_total,
                "eta_s": (p.bytes_total - p.bytes) / rate if rate > 0 else None,
            }
        return web.json_response(body)

    async def generate(self, request: web.Request) -> web.Response:
        model, version = self.model, self.version  # one reference for the whole request
        if model is None:
            return web.json_response({"error": "no weights loaded yet; see /ready"}, status=503)
        ids = torch.tensor((await request.json())["ids"], dtype=torch.long)

        def run() -> list[list[int]]:
            with torch.no_grad():
                return model(ids).argmax(-1).tolist()  # type: ignore[no-any-return]

        return web.json_response({"version": version, "next": await asyncio.to_thread(run)})

    async def cancel(self, request: web.Request) -> web.Response:
        if self.loading is None or self.loading.done():
            return web.json_response({"error": "no load is running"}, status=409)
        self.loading.cancel()
        await asyncio.wait([self.loading])  # aload stops every read and joins its threads
        return web.json_response({"cancelled": True, "version": self.version})

    async def reload(self, request: web.Request) -> web.Response:
        checkpoint = (await request.json())["checkpoint"]
        if not self.start_load(checkpoint):
            return web.json_response({"error": "a load is already running"}, status=409)
        return web.json_response({"accepted": checkpoint}, status=202)

    def app(self, checkpoint: str | None = None) -> web.Application:
        app = web.Application()
        app.add_routes(
            [
                web.get("/health", self.health),
                web.get("/ready", self.ready),
                web.post("/generate", self.generate),
                web.post("/reload", self.reload),
                web.delete("/reload", self.cancel),
            ]
        )

        async def lifecycle(app: web.Application) -> Any:
            if checkpoint is not None:
                self.start_load(checkpoint)  # listening starts now; the load runs behind it
            yield
            if self.loading is not None and not self.loading.done():
                self.loading.cancel()
                await asyncio.wait([self.loading])

        app.cleanup_ctx.append(lifecycle)
        return app


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    a = ap.parse_args()
    print(json.dumps({"listening": f"http://{a.host}:{a.port}", "loading": a.checkpoint, "t": time.time()}))
    web.run_app(Server().app(a.checkpoint), host=a.host, port=a.port)


if __name__ == "__main__":
    main()
