"""One policy for every remote read, tried as a hostile server would: the Hub's token goes only to
the Hub's host; redirects only to http(s), bounded; TLS verified, with a CA bundle option; a
version pin that holds also without ETags and on every store; bounded header and index reads;
missing credentials named without retries; no secret in any error or log record."""

from __future__ import annotations

import json
import logging
import ssl
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import aload
from examples.range_server import FileServer

from .conftest import llama_like
from .stores import Emulator, environ
from .test_differential import reference, streamed
from .test_remote import bucket, emulators, s3  # noqa: F401  (fixtures)

TOKEN = "hf_S3cretTokenValue42"


class Hub:
    """A Hub-like pair of servers: the Hub (``/ORG/REPO/resolve/REV/PATH``) answers every
    ``.safetensors`` request with a redirect to a second host (its file storage), which serves
    the bytes; the index it serves itself. Both record each request's Authorization."""

    def __init__(self) -> None:
        self.hub = FileServer()
        self.cdn = FileServer()

    async def __aenter__(self) -> Hub:
        await self.hub.__aenter__()
        await self.cdn.__aenter__()
        self.hub.redirect_base = self.cdn.url
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.cdn.__aexit__(*exc)
        await self.hub.__aexit__(*exc)

    def add(self, folder: Path, repo: str = "org/repo", revision: str = "main", sub: str = "", tree: bool = False) -> None:
        prefix = f"{repo}/resolve/{revision}/" + (f"{sub}/" if sub else "")
        self.hub.add_folder(folder, prefix)
        self.cdn.add_folder(folder, prefix)
        if tree:  # the tree API: the folder's files, by their paths in the repository
            listing = [{"type": "file", "path": (f"{sub}/" if sub else "") + f.name, "size": f.stat().st_size}
                       for f in sorted(folder.iterdir())]  # fmt: skip
            listing.append({"type": "directory", "path": (f"{sub}/" if sub else "") + "nested"})
            self.hub.files[f"api/models/{repo}/tree/{revision}" + (f"/{sub}" if sub else "")] = json.dumps(listing).encode()
        for name in self.hub.files:
            if name.endswith(".safetensors"):
                self.hub.faults[name] = ["redirect"] * 1000


@pytest.fixture
async def hub(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Hub]:
    async with Hub() as h:
        monkeypatch.setenv("HF_ENDPOINT", h.hub.url)
        monkeypatch.setenv("HF_TOKEN", TOKEN)
        yield h


async def test_a_hub_repo_loads_with_the_token_sent_only_to_the_hub(hub: Hub, sharded: Any) -> None:
    tensors = llama_like()
    folder = sharded(tensors, 2)
    hub.add(folder, revision="v1.0", sub="weights")
    assert await streamed("hf://org/repo@v1.0/weights") == reference(folder)
    assert hub.hub.authorizations and set(hub.hub.authorizations) == {f"Bearer {TOKEN}"}
    assert hub.cdn.requests and set(hub.cdn.authorizations) == {None}  # the other host never saw it
    model = nn.ParameterDict({k.replace(".", "_"): nn.Parameter(torch.zeros_like(v)) for k, v in tensors.items()})
    await aload.load(model, "hf://org/repo@v1.0/weights", stages=aload.stages.rename(r"\.", "_"))
    assert all(torch.equal(model[k.replace(".", "_")], v) for k, v in tensors.items())


@pytest.mark.parametrize("sub", ["", "weights"])
async def test_a_hub_folder_without_an_index_is_listed_by_the_tree_api(hub: Hub, sharded: Any, sub: str) -> None:
    folder = sharded(llama_like(), 3, index=False)
    hub.add(folder, sub=sub, tree=True)
    url = "hf://org/repo" + (f"/{sub}" if sub else "")
    assert await streamed(url) == reference(folder)
    assert {a for (_m, n, _r), a in zip(hub.hub.requests, hub.hub.authorizations, strict=True) if n.startswith("api/")} == {
        f"Bearer {TOKEN}"
    }


async def test_a_single_file_repo_and_a_revision_with_a_slash(hub: Hub, write: Any) -> None:
    path = write({"w": torch.arange(6.0)})
    hub.add(path.parent, revision="refs/pr/1")  # the revision is one path segment, quoted
    assert await streamed("hf://org/repo@refs/pr/1") == reference(path)


async def test_the_token_is_not_sent_to_a_url_that_merely_mentions_the_hub(hub: Hub, write: Any) -> None:
    path = write({"w": torch.ones(4)})
    async with FileServer() as other:
        other.add_folder(path.parent, "huggingface.co/m/")
        await streamed(f"{other.url}/huggingface.co/m/model.safetensors")
        assert other.requests and set(other.authorizations) == {None}


@pytest.mark.parametrize(
    "url", ["hf://org", "hf://org/re po", "hf://org/repo@", "hf://org/repo/../x", "hf://../repo"]
)
async def test_malformed_hub_urls_are_usage_errors(hub: Hub, url: str) -> None:
    with pytest.raises(aload.UsageError):
        await aload.open(url)
    assert not hub.hub.requests


async def test_a_refused_token_is_named_without_its_value(hub: Hub, write: Any, caplog: Any) -> None:
    path = write({"w": torch.ones(4)})
    hub.add(path.parent)
    hub.hub.auth = "Bearer another"
    caplog.set_level(logging.DEBUG)
    with pytest.raises(aload.SourceError, match=r"access refused.*HF_TOKEN") as info:
        await aload.open("hf://org/repo/model.safetensors")
    assert TOKEN not in str(info.value) and TOKEN not in caplog.text and TOKEN not in repr(info.value.__dict__)


async def test_a_token_a_header_cannot_carry_is_a_usage_error(hub: Hub, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_TOKEN", "hf_tökenSecret")
    with pytest.raises(aload.UsageError, match="HF_TOKEN") as info:
        await aload.open("hf://org/repo")
    assert "tökenSecret" not in str(info.value)


@pytest.mark.parametrize("target", ["ftp://127.0.0.1:1", "gopher://127.0.0.1:1", "loop"])
async def test_redirects_go_only_to_http_and_end(write: Any, target: str) -> None:
    path = write({"w": torch.ones(4)})
    async with FileServer() as srv:
        srv.add_folder(path.parent)
        srv.redirect_base = "" if target == "loop" else target
        srv.faults[path.name] = ["redirect"] * 1000
        with pytest.raises(aload.SourceError, match=f"{srv.url}/model.safetensors"):
            await aload.open(f"{srv.url}/{path.name}", retry_config={"max_retries": 0})
        assert len(srv.requests) <= 12  # one answer, or the client's limit of 10 redirects


async def test_tls_is_verified_and_a_ca_bundle_is_honoured(tmp_path: Path, write: Any) -> None:
    import trustme

    ca = trustme.CA()
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("127.0.0.1").configure_cert(context)
    bundle = tmp_path / "ca.pem"
    ca.cert_pem.write_to_path(str(bundle))
    path = write({"w": torch.arange(4.0)})
    async with FileServer(ssl=context) as srv:
        srv.add_folder(path.parent)
        url = f"{srv.url}/{path.name}"
        with pytest.raises(aload.SourceError, match="TLS certificate not trusted: pass ca_bundle"):
            await aload.open(url, retry_config={"max_retries": 0})
        assert await streamed(url, ca_bundle=str(bundle)) == reference(path)
    with pytest.raises(aload.UsageError, match="cannot read the CA bundle"):
        await aload.open(url, ca_bundle=str(tmp_path / "missing.pem"))


@pytest.mark.parametrize("etags", [True, False])
async def test_a_replaced_http_object_is_an_error_with_or_without_etags(write: Any, etags: bool) -> None:
    path = write({f"t{i}": torch.full((64 << 10,), float(i)) for i in range(8)})
    async with FileServer(etags=etags) as srv:
        srv.add_folder(path.parent)
        srv.faults[path.name] = [None, None, "replace"]  # the header's reads, then new bytes
        with pytest.raises(aload.SourceError, match="changed during the load"):
            await streamed(f"{srv.url}/{path.name}")


async def test_an_object_replaced_in_a_store_is_an_error(bucket: Emulator, write: Any) -> None:  # noqa: F811
    path = write({f"t{i}": torch.full((64 << 10,), float(i)) for i in range(4)})
    url = bucket.put(path, "replaced")
    async with aload.stream(url, chunk_bytes=64 << 10) as s:
        bucket.upload("replaced/model.safetensors", path.read_bytes()[:-8] + b"\1" * 8)
        with pytest.raises(aload.SourceError, match="changed during the load"):
            async for _ in s:
                pass


async def test_a_server_sending_more_than_asked_is_refused(write: Any) -> None:
    path = write({"w": torch.ones(4)})
    async with FileServer() as srv:
        srv.add_folder(path.parent)
        srv.faults[path.name] = [None, "overlong"]  # the size, then the header read
        with pytest.raises(aload.SourceError, match=r"asked for|Content-Length"):
            await aload.open(f"{srv.url}/{path.name}")


@pytest.mark.parametrize("scheme", ["s3", "gs", "az"])
async def test_missing_credentials_are_named_at_once(
    scheme: str, emulators: dict[str, Emulator], monkeypatch: pytest.MonkeyPatch  # noqa: F811
) -> None:
    emu = emulators[scheme]
    environ(emu, monkeypatch)
    looked_at = {"s3": "AWS_ACCESS_KEY_ID", "gs": "GOOGLE_SERVICE_ACCOUNT", "az": "AZURE_STORAGE_ACCOUNT_NAME"}
    for k in list(emu.env):
        if "KEY" in k or "SERVICE_ACCOUNT" in k or "EMULATOR" in k:
            monkeypatch.delenv(k)
    with pytest.raises(aload.SourceError, match=f"credentials.*{looked_at[scheme]}"):
        await aload.open(f"{scheme}://aload-test/x/model.safetensors", retry_config={"max_retries": 0})


async def test_a_refused_azure_sas_token_stays_secret(
    emulators: dict[str, Emulator], monkeypatch: pytest.MonkeyPatch, write: Any, caplog: Any  # noqa: F811
) -> None:
    emu = emulators["az"]
    environ(emu, monkeypatch)
    url = emu.put(write({"w": torch.ones(4)}), "sas")
    sas = "sv=2021-08-06&ss=b&srt=sco&sp=r&se=2030-01-01T00:00:00Z&sig=Zm9yZ2VkU2lnbmF0dXJlU2VjcmV0"
    caplog.set_level(logging.DEBUG)
    with pytest.raises(aload.SourceError) as info:
        await aload.open(url, config={"azure_storage_sas_key": sas}, retry_config={"max_retries": 0})
    text = str(info.value) + caplog.text
    assert "Zm9yZ2VkU2lnbmF0dXJlU2VjcmV0" not in text and "sas/model.safetensors" in str(info.value)


async def test_a_listing_is_bounded(s3: Emulator,  # noqa: F811
    write: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    import aload.sources.remote as remote

    monkeypatch.setattr(remote, "MAX_LISTED", 3)
    for i in range(5):
        s3.upload(f"wide/sub{i}/x.bin", b"x")
    with pytest.raises(aload.CheckpointError, match="over 3 objects under this prefix"):
        await aload.open("s3://aload-test/wide")


async def test_a_refused_connection_is_named_as_such() -> None:
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(aload.SourceError, match="connection refused") as info:
        await aload.open(f"http://127.0.0.1:{port}/m/model.safetensors", retry_config={"max_retries": 0})
    assert f"127.0.0.1:{port}/m/model.safetensors" in str(info.value)
