"""Shard digests checked while streaming: every manifest form, mismatches, dropped tensors,
direct reads into parameters, HTTP."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import aload
from aload import stages as S
from examples.range_server import FileServer

from .conftest import collect, llama_like

MiB = 1 << 20


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def shard_files(folder: Path) -> list[Path]:
    return sorted(folder.glob("*.safetensors"))


@pytest.fixture
def folder(sharded: Callable[..., Path]) -> Path:
    tensors = llama_like(hidden=128)
    tensors["big"] = torch.randn(MiB // 2)  # 2 MiB: read straight into its parameter by load()
    return sharded(tensors, 3)


def sha256sums(folder: Path, where: Path) -> Path:
    where.write_text("".join(f"{sha(p)}  {p.name}\n" for p in shard_files(folder)))
    return where


async def test_every_shard_verified_while_streaming_and_bytes_unchanged(folder: Path, tmp_path: Path) -> None:
    plain = await collect(aload.stream(folder))
    async with aload.stream(folder, verify=sha256sums(folder, tmp_path / "SHA256SUMS")) as s:
        verified = await collect(s)
        stats = s.stats
    assert list(verified) == list(plain) and all(torch.equal(verified[k], plain[k]) for k in plain)
    assert stats.verified_shards == 3


async def test_a_corrupted_shard_is_refused_naming_it_and_both_digests(folder: Path, tmp_path: Path) -> None:
    manifest = sha256sums(folder, tmp_path / "SHA256SUMS")
    victim = shard_files(folder)[1]
    good = sha(victim)
    data = bytearray(victim.read_bytes())
    data[-1] ^= 0x01  # one bit of the last tensor: the header still parses, the bytes differ
    victim.write_bytes(bytes(data))
    with pytest.raises(aload.CheckpointError) as err:
        await collect(aload.stream(folder, verify=manifest))
    msg = str(err.value)
    assert victim.name in msg and good in msg and hashlib.sha256(data).hexdigest() in msg
    # Without verify the same flip streams without complaint: the digest is what catches it.
    assert len(await collect(aload.stream(folder))) == len(llama_like()) + 1


async def test_dropped_tensors_are_read_for_the_digest_but_not_delivered(folder: Path, tmp_path: Path) -> None:
    keep = S.keep(lambda n: "layers.0." in n)
    async with aload.stream(folder, stages=keep, verify=sha256sums(folder, tmp_path / "m")) as s:
        got = await collect(s)
        stats = s.stats
    assert got and all("layers.0." in n for n in got)
    data = sum(p.stat().st_size for p in shard_files(folder))
    assert stats.verified_shards == 3 and stats.bytes_read > stats.bytes and stats.bytes_read <= data


@pytest.mark.parametrize("form", ["mapping", "json", "hf_model_info", "lfs_pointer_folder"])
async def test_manifest_forms(folder: Path, tmp_path: Path, form: str) -> None:
    digests = {p.name: sha(p) for p in shard_files(folder)}
    manifest: object
    if form == "mapping":
        manifest = digests
    elif form == "json":
        manifest = tmp_path / "digests.json"
        manifest.write_text(json.dumps(digests))
    elif form == "hf_model_info":
        manifest = tmp_path / "info.json"
        siblings = [{"rfilename": "config.json"}] + [
            {"rfilename": n, "lfs": {"sha256": d, "size": 1}} for n, d in digests.items()
        ]
        manifest.write_text(json.dumps({"id": "org/model", "siblings": siblings}))
    else:
        manifest = tmp_path / "pointers"
        manifest.mkdir()
        for n, d in digests.items():
            (manifest / n).write_text(f"version https://git-lfs.github.com/spec/v1\noid sha256:{d}\nsize 1\n")
    async with aload.stream(folder, verify=manifest) as s:  # type: ignore[arg-type]
        await collect(s)
        assert s.stats.verified_shards == 3


async def test_single_file_with_an_lfs_pointer(write: Callable[..., Path], tmp_path: Path) -> None:
    path = write(llama_like())
    pointer = tmp_path / "pointer"
    pointer.write_text(f"version https://git-lfs.github.com/spec/v1\noid sha256:{sha(path)}\nsize 9\n")
    async with aload.stream(path, verify=pointer) as s:
        await collect(s)
        assert s.stats.verified_shards == 1


async def test_bad_manifests_are_refused_before_any_read(folder: Path, tmp_path: Path) -> None:
    digests = {p.name: sha(p) for p in shard_files(folder)}
    missing = dict(list(digests.items())[:2])
    with pytest.raises(aload.CheckpointError, match=r"no SHA-256 for this shard.*00003"):
        await collect(aload.stream(folder, verify=missing))
    with pytest.raises(aload.UsageError, match="64 hex digits"):
        await collect(aload.stream(folder, verify={**digests, shard_files(folder)[0].name: "abc"}))
    (tmp_path / "bad").write_text("not a digest line\n")
    with pytest.raises(aload.UsageError, match="bad:1"):
        await collect(aload.stream(folder, verify=tmp_path / "bad"))
    with pytest.raises(aload.UsageError, match="cannot read the manifest"):
        await collect(aload.stream(folder, verify=tmp_path / "nowhere"))


async def test_load_verifies_direct_reads_and_over_http(folder: Path, tmp_path: Path) -> None:
    manifest = sha256sums(folder, tmp_path / "SHA256SUMS")
    tensors = await collect(aload.stream(folder))

    def model() -> torch.nn.Module:
        m = torch.nn.Module()
        for name, t in tensors.items():
            m.register_parameter(name.replace(".", "_"), torch.nn.Parameter(torch.zeros_like(t), requires_grad=False))
        return m

    rename = S.rename(lambda n: n.replace(".", "_"))
    local = model()
    report = await aload.load(local, folder, stages=rename, verify=manifest)
    assert report.verified_shards == 3 and "SHA-256 verified for 3 shard(s)" in report.summary()
    assert torch.equal(local.get_parameter("big"), tensors["big"])
    async with FileServer() as srv:
        srv.add_folder(folder)
        remote = model()
        report = await aload.load(remote, srv.url + "/", stages=rename, verify=manifest)
        assert report.verified_shards == 3
        for k, v in local.state_dict().items():
            assert torch.equal(remote.state_dict()[k], v)
        name = shard_files(folder)[0].name
        srv.files[name] = srv.files[name][:-1] + bytes([srv.files[name][-1] ^ 1])
        with pytest.raises(aload.CheckpointError, match=f"SHA-256 mismatch.*{name}|{name}.*SHA-256 mismatch"):
            await aload.load(model(), srv.url + "/", stages=rename, verify=manifest)
