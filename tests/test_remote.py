"""Remote checkpoints through obstore: S3 against moto's server and HTTP against a Range server,
both real servers on 127.0.0.1 started here. Bytes match safetensors'; errors name the URL
without its secrets; an object replaced mid-load is an error; a cancelled load stops at once."""

from __future__ import annotations

import asyncio
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
from .test_differential import random_checkpoint, reference, streamed

BUCKET = "aload-test"


@pytest.fixture(scope="module")
def moto() -> Iterator[str]:
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


@pytest.fixture
def s3(moto: str, monkeypatch: pytest.MonkeyPatch) -> Any:
    """A boto3 client on moto's server, with the variables obstore reads pointing there too."""
    import boto3

    env = {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing-secret",
        "AWS_REGION": "us-east-1",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_ENDPOINT_URL": moto,
    }
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    client = boto3.client("s3", endpoint_url=moto)
    if BUCKET not in [b["Name"] for b in client.list_buckets()["Buckets"]]:
        client.create_bucket(Bucket=BUCKET)
    return client


def upload(client: Any, path: Path, prefix: str) -> str:
    files = [path] if path.is_file() else sorted(path.iterdir())
    for f in files:
        client.upload_file(str(f), BUCKET, f"{prefix}/{f.name}")
    return f"s3://{BUCKET}/{prefix}" + (f"/{path.name}" if path.is_file() else "")


@pytest.mark.parametrize("seed", range(4))
async def test_s3_streams_equal_safetensors(s3: Any, tmp_path: Path, seed: int) -> None:
    path = random_checkpoint(tmp_path / "ckpt", seed)
    url = upload(s3, path, f"diff{seed}")
    assert await streamed(url) == reference(path)


async def test_a_sharded_checkpoint_loads_from_s3_and_http(s3: Any, sharded: Any) -> None:
    tensors = llama_like(hidden=128)
    folder = sharded(tensors, 3)
    url = upload(s3, folder, "llama")
    model = nn.ParameterDict({k.replace(".", "_"): nn.Parameter(torch.zeros_like(v)) for k, v in tensors.items()})
    rename = aload.stages.rename(r"\.", "_")
    report = await aload.load(model, url, stages=rename, chunk_bytes=64 << 10)
    assert report.tensors == len(tensors) and report.bytes_read == report.bytes
    assert all(torch.equal(model[k.replace(".", "_")], v) for k, v in tensors.items())
    async with FileServer() as srv:
        srv.add_folder(folder)
        model2 = nn.ParameterDict({k.replace(".", "_"): nn.Parameter(torch.zeros_like(v)) for k, v in tensors.items()})
        await aload.load(model2, srv.url, stages=rename)
    assert all(torch.equal(model2[k.replace(".", "_")], v) for k, v in tensors.items())


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
