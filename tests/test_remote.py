"""Remote checkpoints through obstore: S3 against moto's server and HTTP against a Range server,
both real servers on 127.0.0.1 started here. Bytes match safetensors'; errors name the URL
without its secrets; an object replaced mid-load is an error; a cancelled load stops at once."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import aload
from examples.range_server import FileServer

from .conftest import llama_like
from .stores import BUCKET, Emulator, emulator, environ
from .test_differential import random_checkpoint, reference, streamed

SCHEMES = ["s3", "gs", "az"]


@pytest.fixture(scope="module")
def emulators(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Emulator]]:
    """Each object store's server, started when a test first asks for it, stopped at the end."""
    started: dict[str, Emulator] = {}
    with contextlib.ExitStack() as stack:
        yield _Lazy(started, stack, tmp_path_factory.mktemp("emulators"))


class _Lazy(dict):  # type: ignore[type-arg]
    def __init__(self, started: dict[str, Emulator], stack: contextlib.ExitStack, tmp: Path) -> None:
        super().__init__()
        self._started, self._stack, self._tmp = started, stack, tmp

    def __missing__(self, scheme: str) -> Emulator:
        self[scheme] = self._stack.enter_context(emulator(scheme, self._tmp))
        return self[scheme]  # type: ignore[no-any-return]


@pytest.fixture(params=SCHEMES)
def bucket(request: pytest.FixtureRequest, emulators: dict[str, Emulator], monkeypatch: pytest.MonkeyPatch) -> Emulator:
    """One object store (each in turn), with the environment obstore reads pointing at it."""
    emu = emulators[request.param]
    environ(emu, monkeypatch)
    return emu


@pytest.fixture
def s3(emulators: dict[str, Emulator], monkeypatch: pytest.MonkeyPatch) -> Emulator:
    environ(emulators["s3"], monkeypatch)
    return emulators["s3"]


@pytest.mark.parametrize("seed", range(3))
async def test_every_store_streams_equal_safetensors(bucket: Emulator, tmp_path: Path, seed: int) -> None:
    path = random_checkpoint(tmp_path / "ckpt", seed)
    url = bucket.put(path, f"diff{seed}")
    assert await streamed(url) == reference(path)


async def test_a_sharded_checkpoint_loads_from_every_store_and_http(bucket: Emulator, sharded: Any) -> None:
    tensors = llama_like(hidden=128)
    folder = sharded(tensors, 3)
    rename = aload.stages.rename(r"\.", "_")

    def fresh() -> nn.ParameterDict:
        return nn.ParameterDict({k.replace(".", "_"): nn.Parameter(torch.zeros_like(v)) for k, v in tensors.items()})

    model = fresh()
    report = await aload.load(model, bucket.put(folder, "llama"), stages=rename, chunk_bytes=64 << 10)
    assert report.tensors == len(tensors) and report.bytes_read == report.bytes
    assert all(torch.equal(model[k.replace(".", "_")], v) for k, v in tensors.items())
    index = folder / "model.safetensors.index.json"
    async with FileServer() as srv:  # plain HTTP, the same folder
        srv.add_folder(folder)
        model = fresh()
        await aload.load(model, srv.url, stages=rename)
    assert all(torch.equal(model[k.replace(".", "_")], v) for k, v in tensors.items())
    index.unlink()  # a prefix without an index is listed
    model = fresh()
    await aload.load(model, bucket.put(folder, "listed"), stages=rename)
    assert all(torch.equal(model[k.replace(".", "_")], v) for k, v in tensors.items())


async def test_a_missing_object_or_bucket_is_an_error_naming_it(s3: Any) -> None:
    with pytest.raises(aload.CheckpointError, match=f"s3://{BUCKET}/nothing-here"):
        await aload.open(f"s3://{BUCKET}/nothing-here")
    with pytest.raises(aload.SourceError, match="not found") as info:
        await aload.open(f"s3://{BUCKET}/nothing-here/model.safetensors")
    assert "nothing-here/model.safetensors" in str(info.value)


async def test_an_object_replaced_mid_load_is_an_error_not_mixed_bytes(write: Any) -> None:
    path = write({f"t{i}": torch.full((64 << 10,), float(i)) for i in range(8)})
    async with FileServer() as srv:
        srv.add_folder(path.parent)
        srv.faults[path.name] = [None, None, "replace"]  # two header reads, then new bytes and ETag
        with pytest.raises(aload.SourceError, match="changed during the load"):
            async with aload.stream(f"{srv.url}/{path.name}", chunk_bytes=64 << 10) as s:
                async for _ in s:
                    pass


async def test_urls_with_secrets_or_queries(tmp_path: Path, write: Any) -> None:
    path = write({"w": torch.ones(4)})
    async with FileServer() as srv:
        srv.add_folder(path.parent)
        secret_url = srv.url.replace("http://", "http://user:hunter2@") + "/missing.safetensors"
        with pytest.raises(aload.SourceError) as info:
            await aload.open(secret_url)
        assert "hunter2" not in str(info.value) and "missing.safetensors" in str(info.value)
        with pytest.raises(aload.UsageError, match="no query"):
            await aload.open(f"{srv.url}/{path.name}?X-Amz-Signature=abc")


@pytest.mark.parametrize("name", ["%2e%2e/%2e%2e/x.safetensors", "x.safetensors?y=", "a#b.safetensors", "../x.safetensors"])
async def test_index_names_outside_the_checkpoint_are_refused(tmp_path: Path, name: str) -> None:
    folder = tmp_path / "ckpt"
    folder.mkdir()
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": name}}))
    async with FileServer() as srv:
        srv.add_folder(folder)
        with pytest.raises(aload.CheckpointError, match="outside the checkpoint"):
            await aload.open(srv.url)
        assert {r[1] for r in srv.requests} == {"model.safetensors.index.json"}  # nothing else was asked for


async def test_a_cancelled_remote_load_stops_at_once(write: Any) -> None:
    path = write({f"t{i}": torch.randn(64 << 10) for i in range(8)})  # 256 KiB each
    async with FileServer() as srv:
        srv.add_folder(path.parent)
        srv.faults[path.name] = [None, None] + ["trickle"] * 20  # headers, then a stalled body

        class Engine(nn.Module):
            def load_weights(self, weights: Any) -> None:
                for _ in weights:
                    pass

        task = asyncio.ensure_future(aload.load(Engine(), f"{srv.url}/{path.name}", chunk_bytes=256 << 10))
        for _ in range(400):
            await asyncio.sleep(0.01)
            if len(srv.requests) >= 3:
                break
        task.cancel()
        done, _ = await asyncio.wait([task], timeout=5)  # a trickle would take minutes
        assert done and task.cancelled()


def test_the_command_line_inspects_and_loads_every_store(bucket: Emulator, write: Any) -> None:
    import os
    import subprocess
    import sys

    url = bucket.put(write({"a": torch.ones(4, 4), "b": torch.zeros(3)}), "cli")

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "aload.cli", *args], capture_output=True, text=True,
                              timeout=120, env=dict(os.environ))  # fmt: skip

    info = json.loads(run("inspect", url, "--json").stdout)
    assert info["tensors"] == 2 and info["bytes"] == 76
    done = run("load", url)
    assert done.returncode == 0 and "2 tensors" in done.stdout, done.stderr
    missing = run("inspect", url.replace("cli/", "nope/"))
    assert missing.returncode != 0 and "nope/model.safetensors: not found" in missing.stderr
