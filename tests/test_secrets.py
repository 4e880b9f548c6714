"""Credentials never leave the process's memory: a token, header values, a presigned query string
and a password in the URL are grepped for in every error, log record, report and ``repr``."""

from __future__ import annotations

import dataclasses
import json
import logging
import traceback
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

import aload
from examples.range_server import FileServer

from .conftest import collect

TOKEN = "tok-s3cr3t-4711"
HEADER = "hdr-s3cr3t-0815"
QUERY = "X-Amz-Signature=sig-s3cr3t-1234"
PASSWORD = "pw-s3cr3t-9999"
SECRETS = (TOKEN, HEADER, "sig-s3cr3t-1234", PASSWORD)


def everything_about(exc: BaseException) -> str:
    return "".join(traceback.format_exception(exc)) + repr(exc) + repr(getattr(exc, "__notes__", ""))


async def test_no_credential_in_errors_logs_reports_or_repr(
    write: Callable[..., Path], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)  # every logger, aiohttp's included
    path = write({"w": torch.arange(4096.0)})
    texts: list[str] = []
    async with FileServer() as srv:
        srv.add_folder(path.parent)
        srv.auth = f"Bearer {TOKEN}"
        url = f"{srv.url}/{path.name}?{QUERY}"  # a presigned-style URL
        opts = dict(token=TOKEN, headers={"X-Extra": HEADER}, retries=2, timeout=0.3)

        # A good load: the checkpoint, its store and sources, the stream, the report.
        async with aload.open(url, **opts) as ckpt:
            texts += [repr(ckpt), str(ckpt), repr(ckpt.store), repr(ckpt.shards)]
            texts += [repr(ckpt.source(spec)) for spec in ckpt.specs.values()]
        async with aload.stream(url, **opts) as s:
            texts.append(repr(s))
            await collect(s)
            texts.append(repr(s.stats))
        m = nn.Module()
        m.register_buffer("w", torch.zeros(4096))
        report = await aload.load(m, url, **opts)
        texts += [repr(report), report.summary(), json.dumps(dataclasses.asdict(report))]
        assert torch.equal(m.w, torch.arange(4096.0))

        # Errors: a refused token, a password in the URL, a missing object, a server that keeps
        # failing until aload gives up, a server that stalls.
        with_password = srv.url.replace("http://", f"http://user:{PASSWORD}@") + f"/{path.name}"
        cases: list[tuple[str, dict[str, object], str | None]] = [
            (url, dict(opts, token="wrong-token"), None),
            (with_password, {}, None),
            (url.replace(path.name, "nope.safetensors"), opts, None),
            (url, opts, "503"),
            (url, opts, "trickle"),
        ]
        for case_url, case_opts, fault in cases:
            srv.faults[path.name] = [fault] * 8 if fault else []
            with pytest.raises(aload.AloadError) as info:
                await collect(aload.stream(case_url, **case_opts))
            texts.append(everything_about(info.value))
        srv.faults.clear()
    # The test's own server logs what it was sent (that is the server's business): the client's
    # side is every other logger, aload's and aiohttp's client included.
    server_side = ("aiohttp.access", "aiohttp.server", "aiohttp.web")
    texts += [f"{r.name}: {r.getMessage()}" for r in caplog.records if not r.name.startswith(server_side)]
    assert any("attempt 1 of 2 failed" in t for t in texts), "the retries were logged"
    blob = "\n".join(texts)
    for secret in SECRETS:
        assert secret not in blob, f"{secret} printed: ...{blob[max(0, blob.find(secret) - 200) :][:400]}..."
