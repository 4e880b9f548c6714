"""An async serving frontend that answers while it loads (aiohttp).

    python examples/serve.py CHECKPOINT [--port 8000] [--allow PREFIX ...]
    # CHECKPOINT: a Hugging Face Llama folder or URL; PREFIX: where reloads may come from

It listens at once and loads the model in the background with ``aload.load``:

- ``GET /health``  answers throughout, loading or not;
- ``GET /ready``   whether weights are in, and how far the current load is (bytes, tensors, ETA);
- ``POST /generate`` ``{"ids": [[...]]}`` runs the model (next-token argmax per position);
- ``POST /reload`` ``{"checkpoint": PATH}`` loads a new checkpoint into a fresh model while requests
  keep being served, then swaps it in with one assignment: a request sees the old weights or the
  new, never a mix. ``DELETE /reload`` cancels a running load. A failed or cancelled reload
  leaves the old weights serving and says why. Only checkpoints under an ``--allow`` prefix (a
  folder, or a URL prefix) may be reloaded: a reload URL from anyone who can reach the port
  would otherwise be a way in. Without ``--allow``, the start checkpoint's own folder or URL.

A malformed request is answered 400 with the reason. Each load is logged with its report line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import posixpath
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
log = logging.getLogger("serve")


def _under(checkpoint: str, prefix: str) -> bool:
    """Whether ``checkpoint`` lies under ``prefix``: local paths compared resolved, URLs by
    scheme, host and whole path segments (``..`` refused)."""
    local = "://" not in checkpoint or checkpoint.startswith("file://")
    if local != ("://" not in prefix or prefix.startswith("file://")):
        return False
    if local:
        path = Path(checkpoint.removeprefix("file://")).resolve()
        return path.is_relative_to(Path(prefix.removeprefix("file://")).resolve())
    if ".." in checkpoint.split("/") or "?" in checkpoint or "#" in checkpoint:
        return False
    head, _, tail = checkpoint.partition("://")
    phead, _, ptail = prefix.partition("://")
    tail, ptail = posixpath.normpath(tail), posixpath.normpath(ptail)
    return head == phead and (tail == ptail or tail.startswith(ptail.rstrip("/") + "/"))


class BadRequest(web.HTTPBadRequest):
    def __init__(self, reason: str) -> None:
        super().__init__(text=json.dumps({"error": reason}), content_type="application/json")


async def _json_object(request: web.Request) -> dict[str, Any]:
    try:
        body = await request.json()
    except (ValueError, UnicodeDecodeError) as exc:
        raise BadRequest(f"the body is not JSON: {exc}") from None
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object")
    return body


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


def _vocab(model: nn.Module) -> int | None:
    embedding = next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)
    return embedding.num_embeddings if embedding is not None else None


def _ids(ids: Any, vocab: int | None) -> torch.Tensor:
    """``ids`` checked: a non-empty list of equally long, non-empty lists of token ids in range."""
    if (
        not isinstance(ids, list)
        or not ids
        or not all(isinstance(row, list) and row and len(row) == len(ids[0]) for row in ids)
        or not all(isinstance(i, int) and not isinstance(i, bool) for row in ids for i in row)
    ):
        raise BadRequest('expected {"ids": [[int, ...], ...]}: non-empty rows of token ids, all of one length')
    if vocab is not None and not all(0 <= i < vocab for row in ids for i in row):
        raise BadRequest(f"token ids must lie in [0, {vocab})")
    return torch.tensor(ids, dtype=torch.long)


class Server:
    def __init__(self, factory: ModelFactory = engine_llama_factory, allow: list[str] | None = None) -> None:
        self.factory = factory
        self.allow = list(allow or [])  # reloads only from under these; empty: the start checkpoint's
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
            log.info("loaded %s as version %d: %s", checkpoint, self.version, report.summary())
        except asyncio.CancelledError:
            self.error = "load cancelled; the previous weights keep serving"
            log.warning("load of %s cancelled; version %d keeps serving", checkpoint, self.version)
            raise
        except Exception as exc:  # reported on /ready; the old model keeps serving
            delivered = getattr(exc, "aload_delivered", None)
            where = f" (after tensor {delivered[-1]!r})" if delivered else ""
            self.error = f"{type(exc).__name__}: {exc}{where}"
            log.error("load of %s failed; version %d keeps serving: %s", checkpoint, self.version, self.error)

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
        ids = _ids((await _json_object(request)).get("ids"), _vocab(model))

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
        checkpoint = (await _json_object(request)).get("checkpoint")
        if not isinstance(checkpoint, str) or not checkpoint:
            raise BadRequest('expected {"checkpoint": "PATH or URL"}')
        if not any(_under(checkpoint, prefix) for prefix in self.allow):
            log.warning("reload of %s refused: not under an allowed prefix", checkpoint)
            return web.json_response({"error": "checkpoint not under an allowed prefix (--allow)"}, status=403)
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

        if checkpoint is not None and not self.allow:
            self.allow = [checkpoint]

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
    ap.add_argument(
        "--allow",
        action="append",
        metavar="PREFIX",
        help="a folder or URL prefix reloads may come from (repeatable; default: the start checkpoint's)",
    )
    a = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    print(json.dumps({"listening": f"http://{a.host}:{a.port}", "loading": a.checkpoint, "t": time.time()}))
    web.run_app(Server(allow=a.allow).app(a.checkpoint), host=a.host, port=a.port)


if __name__ == "__main__":
    main()
