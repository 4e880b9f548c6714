"""Shared fixtures: real checkpoints written by safetensors, a loop watchdog, a leak check."""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

#: A callback holding the loop longer than this fails the test: generous, so that a busy 2-core
#: machine (another process on the CPU, a garbage collection with torch loaded) does not fail
#: it, while a blocking read of a whole checkpoint or a sleep on the loop still does. Lateness
#: figures belong in benchmarks/.
LOOP_BLOCK_LIMIT_S = 2.0


class LoopWatchdog:
    """A 2 ms ticker on the running loop recording its worst lateness."""

    def __init__(self) -> None:
        self.worst = 0.0
        self._task: asyncio.Task[None] | None = None

    async def _tick(self) -> None:
        while True:
            t = time.perf_counter()
            await asyncio.sleep(0.002)
            self.worst = max(self.worst, time.perf_counter() - t - 0.002)

    async def __aenter__(self) -> LoopWatchdog:
        self._task = asyncio.ensure_future(self._tick())
        await asyncio.sleep(0)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()
        await asyncio.wait([self._task])


class SlowCallbacks(logging.Handler):
    """Collects asyncio debug mode's "Executing <handle> took N seconds" reports."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.reports: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if message.startswith("Executing"):
            self.reports.append(message)


@pytest.fixture(autouse=True)
async def loop_watchdog(request: pytest.FixtureRequest) -> AsyncIterator[None]:
    """Every async test runs the loop in debug mode and fails if a callback other than the test's
    own coroutine held the loop over LOOP_BLOCK_LIMIT_S (asyncio's slow-callback report). The
    test's own steps are exempt: building models and checkpoints in a test body is not aload."""
    loop = asyncio.get_running_loop()
    handler = SlowCallbacks()
    logger = logging.getLogger("asyncio")
    logger.addHandler(handler)
    debug, slow = loop.get_debug(), loop.slow_callback_duration
    loop.set_debug(True)
    loop.slow_callback_duration = LOOP_BLOCK_LIMIT_S
    try:
        yield
    finally:
        loop.set_debug(debug)
        loop.slow_callback_duration = slow
        logger.removeHandler(handler)
    name = request.node.originalname
    blocked = [r for r in handler.reports if f"{name}()" not in r and "loop_watchdog()" not in r]
    if not request.node.get_closest_marker("blocks_loop"):
        assert not blocked, "the event loop was blocked: " + "; ".join(blocked)


def _open_checkpoint_fds() -> set[str]:
    out = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if ".safetensors" in target or target.endswith(".json"):
            out.add(f"{fd}->{target}")
    return out


@pytest.fixture(autouse=True)
def no_leaks() -> Iterator[None]:
    """No aload thread and no open checkpoint file survives a test."""
    before = _open_checkpoint_fds()
    yield
    deadline = time.monotonic() + 2.0
    while True:
        threads = [t.name for t in threading.enumerate() if t.name.startswith("aload")]
        fds = _open_checkpoint_fds() - before
        if (not threads and not fds) or time.monotonic() > deadline:
            break
        if fds:
            # A tensor viewing a file's mapping keeps the file open until it dies; one that an
            # exception's traceback holds (in a reference cycle) dies in a collection.
            gc.collect()
        time.sleep(0.01)
    assert not threads, f"threads left behind: {threads}"
    assert not fds, f"files left open: {fds}"


def drop_cache(path: Path, offset: int = 0, length: int = 0) -> None:
    """``length`` bytes of ``path`` from ``offset`` (0: to its end) out of the page cache, written
    back first (dirty pages stay). The page cache drops whole folios only (up to 2 MiB here)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, offset, length, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def llama_like(
    n_layers: int = 2, hidden: int = 64, vocab: int = 128, dtype: torch.dtype = torch.float32
) -> dict[str, torch.Tensor]:
    """Llama-shaped names and sizes: big matrices and small norms."""
    g = torch.Generator().manual_seed(0)
    out = {"model.embed_tokens.weight": torch.randn(vocab, hidden, generator=g).to(dtype)}
    for i in range(n_layers):
        p = f"model.layers.{i}."
        for proj, shape in {
            "self_attn.q_proj": (hidden, hidden),
            "self_attn.k_proj": (hidden // 2, hidden),
            "self_attn.v_proj": (hidden // 2, hidden),
            "self_attn.o_proj": (hidden, hidden),
            "mlp.gate_proj": (2 * hidden, hidden),
            "mlp.up_proj": (2 * hidden, hidden),
            "mlp.down_proj": (hidden, 2 * hidden),
        }.items():
            out[p + proj + ".weight"] = torch.randn(*shape, generator=g).to(dtype)
        out[p + "input_layernorm.weight"] = torch.randn(hidden, generator=g).to(dtype)
        out[p + "post_attention_layernorm.weight"] = torch.randn(hidden, generator=g).to(dtype)
    out["model.norm.weight"] = torch.randn(hidden, generator=g).to(dtype)
    out["lm_head.weight"] = torch.randn(vocab, hidden, generator=g).to(dtype)
    return out


@pytest.fixture
def write(tmp_path: Path) -> Callable[..., Path]:
    """write(tensors, name="model.safetensors", metadata=None) -> path, via safetensors."""

    def _write(
        tensors: dict[str, torch.Tensor], name: str = "model.safetensors", metadata: dict[str, str] | None = None
    ) -> Path:
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(path), metadata=metadata)
        return path

    return _write


@pytest.fixture
def sharded(tmp_path: Path) -> Callable[..., Path]:
    """sharded(tensors, n_shards, index=True) -> folder with model-0000k-of-0000n.safetensors."""
    import json

    def _sharded(tensors: dict[str, torch.Tensor], n: int = 3, index: bool = True) -> Path:
        folder = tmp_path / "ckpt"
        folder.mkdir()
        names = list(tensors)
        weight_map = {}
        for k in range(n):
            fname = f"model-{k + 1:05d}-of-{n:05d}.safetensors"
            part = {name: tensors[name] for name in names[k::n]}
            save_file(part, str(folder / fname))
            weight_map.update({name: fname for name in part})
        if index:
            (folder / "model.safetensors.index.json").write_text(
                json.dumps(
                    {"metadata": {"total_size": sum(t.nbytes for t in tensors.values())}, "weight_map": weight_map}
                )
            )
        return folder

    return _sharded


async def collect(it: Any) -> dict[str, torch.Tensor]:
    out = {}
    async for name, t in it:
        out[name] = t.clone()
    return out


def hf_llama(seed: int = 0, **overrides: Any) -> Any:
    """A small transformers LlamaForCausalLM (eval mode), seeded; overrides go to LlamaConfig."""
    from transformers import LlamaConfig, LlamaForCausalLM

    fields: dict[str, Any] = dict(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(**{**fields, **overrides})).eval()


@pytest.fixture
def proxy_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """``monkeypatch`` with no proxy variable set: a test names the proxy it means."""
    for name in ("http_proxy", "HTTP_PROXY", "https_proxy", "HTTPS_PROXY", "no_proxy", "NO_PROXY"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch
