"""S3 through moto's real S3-protocol server on 127.0.0.1, started here; checkpoints uploaded with boto3."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import aload

from .conftest import collect, llama_like

BUCKET = "weights"


@pytest.fixture(scope="module")
def s3() -> Iterator[dict[str, Any]]:
    import boto3
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    opts = {"endpoint_url": f"http://{host}:{port}", "access_key": "test", "secret_key": "test", "region": "us-east-1"}
    client = boto3.client(
        "s3",
        endpoint_url=opts["endpoint_url"],
        aws_access_key_id="test",
        aws_secret_access_key="test",
        region_name="us-east-1",
    )
    client.create_bucket(Bucket=BUCKET)

    async def warm() -> None:  # the first aiobotocore client loads botocore's models (once per process)
        async with aload.open(f"s3://{BUCKET}/", **opts) as _:
            pass

    try:
        asyncio.run(warm())
    except aload.AloadError:
        pass  # an empty bucket: nothing to open, the models are loaded all the same
    try:
        yield {"opts": opts, "client": client}
    finally:
        server.stop()


def upload(client: Any, folder: Path, prefix: str, skip: tuple[str, ...] = ()) -> None:
    for p in sorted(folder.iterdir()):
        if p.name not in skip:
            client.upload_file(str(p), BUCKET, f"{prefix}/{p.name}")


async def test_sharded_checkpoint_streams_identical_to_local(
    s3: dict[str, Any], sharded: Callable[..., Path], bodies: str
) -> None:
    tensors = llama_like(hidden=96)
    folder = sharded(tensors, 3)
    upload(s3["client"], folder, "llama")
    local = await collect(aload.stream(folder))
    async with aload.stream(f"s3://{BUCKET}/llama/", max_inflight_bytes=256 * 1024, **s3["opts"]) as s:
        remote = await collect(s)
        stats = s.stats
    assert list(remote) == list(local) and all(torch.equal(remote[k], local[k]) for k in local)
    assert stats.peak_inflight_bytes <= 256 * 1024


async def test_opening_costs_one_call_per_shard(
    s3: dict[str, Any], sharded: Callable[..., Path], write: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each shard's size and header come from one ranged get_object, with no head_object; an
    object shorter than the probe is not asked for again for its data; an empty object still
    gets its own error."""
    from aload import s3 as s3mod
    from aload.checkpoint import HEADER_PROBE_BYTES

    calls: list[tuple[str, str, str]] = []
    real = s3mod.S3Source._call

    async def counted(self: Any, op: str, byte_range: tuple[int, int], **kw: Any) -> Any:
        calls.append((op, kw.get("Key", ""), kw.get("Range", "")))
        return await real(self, op, byte_range, **kw)

    monkeypatch.setattr(s3mod.S3Source, "_call", counted)
    folder = sharded(llama_like(hidden=96), 3)
    upload(s3["client"], folder, "onecall")
    async with await aload.open(f"s3://{BUCKET}/onecall/", **s3["opts"]) as ckpt:
        assert {s.name: s.size for s in ckpt.shards} == {p.name: p.stat().st_size for p in folder.glob("*.safetensors")}
    probe = f"bytes=0-{HEADER_PROBE_BYTES - 1}"
    shards = sorted(c for c in calls if c[1].endswith(".safetensors"))
    assert shards == sorted(("get_object", f"onecall/{s.name}", probe) for s in ckpt.shards)
    small = write({"a": torch.arange(4.0)}, name="small/model.safetensors")
    s3["client"].upload_file(str(small), BUCKET, "small/model.safetensors")
    got = await collect(aload.stream(f"s3://{BUCKET}/small/model.safetensors", **s3["opts"]))
    assert got["a"].tolist() == [0.0, 1.0, 2.0, 3.0]
    assert [c for c in calls if c[1] == "small/model.safetensors"] == [("get_object", "small/model.safetensors", probe)]
    s3["client"].put_object(Bucket=BUCKET, Key="empty/model.safetensors", Body=b"")
    with pytest.raises(aload.HeaderError, match="too short"):
        await aload.open(f"s3://{BUCKET}/empty/model.safetensors", **s3["opts"])


async def test_a_large_index_is_read_whole(s3: dict[str, Any], sharded: Callable[..., Path]) -> None:
    tensors = {f"model.layers.{i}.experts.{i % 7}.w": torch.full((2,), float(i)) for i in range(6000)}
    folder = sharded(tensors, 4)
    assert (folder / "model.safetensors.index.json").stat().st_size > 256 << 10
    upload(s3["client"], folder, "bigindex")
    remote = await collect(aload.stream(f"s3://{BUCKET}/bigindex/", **s3["opts"]))
    assert len(remote) == len(tensors) and all(torch.equal(remote[k], v) for k, v in tensors.items())


async def test_listing_without_index_and_single_object(s3: dict[str, Any], sharded: Callable[..., Path]) -> None:
    tensors = llama_like()
    folder = sharded(tensors, 2)
    upload(s3["client"], folder, "noindex", skip=("model.safetensors.index.json",))
    listed = await collect(aload.stream(f"s3://{BUCKET}/noindex", **s3["opts"]))
    one = await collect(aload.stream(f"s3://{BUCKET}/noindex/model-00001-of-00002.safetensors", **s3["opts"]))
    assert listed.keys() == tensors.keys() and set(one) < set(tensors)


async def test_missing_bucket_key_and_bad_credentials(s3: dict[str, Any], write: Callable[..., Path]) -> None:
    path = write({"a": torch.ones(4)})
    s3["client"].upload_file(str(path), BUCKET, "one/model.safetensors")
    opts = s3["opts"]
    with pytest.raises(aload.SourceError, match="not found") as info:
        await aload.open("s3://no-such-bucket/x/model.safetensors", **opts)
    assert "s3://no-such-bucket/x/model.safetensors" in str(info.value)
    with pytest.raises(aload.SourceError, match="not found"):
        await aload.open(f"s3://{BUCKET}/one/nope.safetensors", **opts)
    ok = await collect(aload.stream(f"s3://{BUCKET}/one/model.safetensors", **opts))
    assert torch.equal(ok["a"], torch.ones(4))
    bad = {**opts, "access_key": "AKIAWRONG", "secret_key": "wrong-s3cret"}
    try:
        async with aload.open(f"s3://{BUCKET}/one/model.safetensors", **bad):
            pass  # moto accepts any key unless told otherwise; a real store refuses it
    except aload.SourceError as exc:
        assert "wrong-s3cret" not in str(exc) and "denied" in str(exc)


async def test_no_secret_key_in_errors_logs_or_repr(
    s3: dict[str, Any], write: Callable[..., Path], caplog: pytest.LogCaptureFixture
) -> None:
    import traceback

    caplog.set_level(logging.DEBUG)
    secret = "s3cr3t-key-2718281828"
    path = write({"a": torch.ones(4)})
    s3["client"].upload_file(str(path), BUCKET, "sec/model.safetensors")
    opts = {**s3["opts"], "secret_key": secret}  # moto takes any key
    texts = []
    async with aload.open(f"s3://{BUCKET}/sec/", **opts) as ckpt:
        texts += [repr(ckpt), repr(ckpt.store), repr(ckpt.shards), repr(ckpt.source(ckpt.specs["a"]))]
    for url in (f"s3://{BUCKET}/sec/nope.safetensors", "s3://no-such-bucket/x/"):
        with pytest.raises(aload.SourceError) as info:
            await aload.open(url, **opts)
        texts.append("".join(traceback.format_exception(info.value)))
    texts += [f"{r.name}: {r.getMessage()}" for r in caplog.records if not r.name.startswith("werkzeug")]
    assert texts and not [t for t in texts if secret in t]


@pytest.mark.parametrize("seed", [1, 3, 5])
async def test_random_checkpoints_stream_identical_over_s3(s3: dict[str, Any], tmp_path: Path, seed: int) -> None:
    from .test_differential import random_checkpoint, reference, streamed

    path = random_checkpoint(tmp_path / "ckpt", seed)
    prefix = f"diff{seed}"
    if path.is_dir():
        upload(s3["client"], path, prefix)
        url = f"s3://{BUCKET}/{prefix}/"
    else:
        s3["client"].upload_file(str(path), BUCKET, f"{prefix}/{path.name}")
        url = f"s3://{BUCKET}/{prefix}/{path.name}"
    assert await streamed(url, **s3["opts"]) == reference(path)


async def test_data_reads_go_straight_into_place_on_presigned_urls(
    s3: dict[str, Any], sharded: Callable[..., Path], monkeypatch: pytest.MonkeyPatch, bodies: str
) -> None:
    """Ranged data reads go through ``aload.wire`` on a presigned URL per object, made once and
    reused, with Range and If-Match (the ETag from the header probe) sent as headers."""
    from aload import wire

    asked: list[tuple[str, dict[str, str]]] = []
    real = wire.Client.open

    async def recorded(self: Any, url: str, headers: dict[str, str]) -> Any:
        asked.append((url, dict(headers)))
        return await real(self, url, headers)

    monkeypatch.setattr(wire.Client, "open", recorded)
    tensors = llama_like(hidden=256)
    folder = sharded(tensors, 3)
    upload(s3["client"], folder, "wire")
    got = await collect(aload.stream(f"s3://{BUCKET}/wire/", chunk_bytes=1 << 16, **s3["opts"]))
    assert set(got) == set(tensors) and all(torch.equal(got[k], v) for k, v in tensors.items())
    etags = {
        p.name: s3["client"].head_object(Bucket=BUCKET, Key=f"wire/{p.name}")["ETag"]
        for p in folder.glob("*.safetensors")
    }
    urls = {url.split("?")[0].rsplit("/", 1)[1]: url for url, _ in asked}
    assert set(urls) == set(etags) and len({url for url, _ in asked}) == len(etags)  # one URL per object
    assert all("X-Amz-Signature=" in url for url in urls.values())  # SigV4
    assert all(
        h["If-Match"] == etags[url.split("?")[0].rsplit("/", 1)[1]] and h["Range"].startswith("bytes=")
        for url, h in asked
    )


def test_preload_imports_the_clients_and_loads_the_s3_models() -> None:
    """``aload.preload()`` at start-up: the clients imported and botocore's S3 models loaded, so
    the first remote load does neither on a thread while the loop serves; a scheme aload does not
    know is refused."""
    import sys

    import botocore

    from aload import _boto

    _boto._WARMED = False
    botocore._xform_cache.clear()  # operation names, filled by building a client
    threads = set(threading.enumerate())
    aload.preload("http", "s3")
    assert {"aiohttp", "aiobotocore", "aload.http", "aload.s3"} <= set(sys.modules) and _boto._WARMED
    loader = _boto._session().get_component("data_loader")
    assert loader.load_service_model("s3", "service-2")["metadata"]["endpointPrefix"] == "s3"
    assert ("GetObject", "_") in botocore._xform_cache  # a client was built (and closed: no warning)
    assert set(threading.enumerate()) <= threads  # its thread is gone

    async def inside_a_running_loop() -> None:
        aload.preload("s3")

    asyncio.run(inside_a_running_loop())
    aload.preload()  # every scheme
    with pytest.raises(aload.UsageError, match="gopher"):
        aload.preload("gopher")


def test_preload_ends_with_a_full_collection_unless_told_not_to() -> None:
    """The full collection the imports make due runs in ``preload``, not in the first load; with
    ``collect=False`` preload starts none (the collector is off here, so none starts by itself)."""
    import gc

    done: list[int] = []

    def record(phase: str, info: dict[str, int]) -> None:
        if phase == "stop":
            done.append(info["generation"])

    was = gc.isenabled()
    gc.disable()
    gc.callbacks.append(record)
    try:
        aload.preload("http", collect=False)
        assert done == []
        aload.preload("http")
        assert done == [2]
    finally:
        gc.callbacks.remove(record)
        if was:
            gc.enable()


async def test_a_first_s3_load_builds_botocores_session_off_the_event_loop(
    s3: dict[str, Any], sharded: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without ``aload.preload``, the process's first S3 load builds botocore's session (its
    handlers' registration held the loop 5.5-5.7 ms) and loads its models on a thread, once;
    every load builds its client on a thread too (7.7-9 ms on the loop), with the switch
    interval shortened meanwhile and Python's put back after."""
    import sys

    from aload import _boto, _threads

    monkeypatch.setattr(_boto, "_SESSION", None)
    monkeypatch.setattr(_boto, "_WARMED", False)
    on_loop: list[bool] = []
    built: list[tuple[bool, float]] = []  # on the loop's thread?, the switch interval then
    real = _boto.get_session

    def get_session() -> Any:
        on_loop.append(threading.current_thread() is threading.main_thread())
        session = real()
        create = session.create_client

        def create_client(*args: Any, **kwargs: Any) -> Any:
            built.append((threading.current_thread() is threading.main_thread(), sys.getswitchinterval()))
            return create(*args, **kwargs)

        session.create_client = create_client
        return session

    monkeypatch.setattr(_boto, "get_session", get_session)
    tensors = llama_like(hidden=64)
    folder = sharded(tensors, 2)
    upload(s3["client"], folder, "first")
    python_s = sys.getswitchinterval()
    for _ in range(2):
        got = await collect(aload.stream(f"s3://{BUCKET}/first/", **s3["opts"]))
        assert set(got) == set(tensors) and all(torch.equal(got[k], v) for k, v in tensors.items())
        assert sys.getswitchinterval() == python_s
    assert on_loop == [False] and _boto._WARMED
    assert len(built) == 2 and not any(loop for loop, _ in built)
    assert all(s == pytest.approx(_threads.SETUP_SWITCH_S) for _, s in built) and python_s > _threads.SETUP_SWITCH_S


async def test_a_proxy_from_the_environment_carries_every_call(
    s3: dict[str, Any], sharded: Callable[..., Path], proxy_env: pytest.MonkeyPatch
) -> None:
    """With ``http_proxy`` set for the endpoint, the calls and the data reads all go through the
    proxy (the data through aiobotocore: ``aload.wire`` connects only directly)."""
    from examples.range_server import ForwardProxy

    tensors = llama_like(hidden=256)
    folder = sharded(tensors, 3)
    upload(s3["client"], folder, "proxied")  # before the proxy is named: boto3 here is blocking
    async with ForwardProxy() as proxy:
        proxy_env.setenv("HTTP_PROXY", proxy.url)
        got = await collect(aload.stream(f"s3://{BUCKET}/proxied/", chunk_bytes=1 << 16, **s3["opts"]))
    assert set(got) == set(tensors) and all(torch.equal(got[k], v) for k, v in tensors.items())
    endpoint = s3["opts"]["endpoint_url"]
    shards = {p.name for p in folder.glob("*.safetensors")}
    read = [t for m, t in proxy.requests if m == "GET" and t.rsplit("/", 1)[-1].split("?")[0] in shards]
    assert all(t.startswith(f"{endpoint}/{BUCKET}/proxied/") for m, t in proxy.requests)
    assert len(read) > 2 * len(shards)  # a probe per shard and the ranged data reads


def test_an_s3_load_leaves_nothing_for_the_cycle_collector(s3: dict[str, Any], sharded: Callable[..., Path]) -> None:
    """As for local and HTTP loads (tests/test_load.py), in a fresh process: the store and its
    sources are freed when the load ends, not left in a cycle for the next full collection."""
    import subprocess
    import sys

    upload(s3["client"], sharded(llama_like(hidden=64), 2), "cycles")
    code = (
        "import asyncio, gc, sys, aload\n"
        f"opts = {s3['opts']!r}\n"
        "async def main():\n"
        f"    async with aload.stream('s3://{BUCKET}/cycles/', **opts) as s:\n"
        "        async for _ in s:\n"
        "            pass\n"
        "asyncio.run(main()); gc.collect(); gc.set_debug(gc.DEBUG_SAVEALL); asyncio.run(main()); gc.collect()\n"
        "print(sorted({type(o).__qualname__ for o in gc.garbage if type(o).__module__.startswith('aload')}))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "[]", done.stdout
