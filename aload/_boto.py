"""One botocore session per process for ``aload.s3``, its S3 models loaded off the event loop,
and ``warm`` for ``aload.preload``: loading them, and building a first client, took tens of
milliseconds the first time, on the loop if nobody did it before."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from typing import Any

from aiobotocore.config import AioConfig
from aiobotocore.session import get_session

from ._threads import run_in_thread
from .http import log

_SESSION: Any = None
_SESSION_LOCK = threading.Lock()


def _session() -> Any:
    """One botocore session per process: its loader caches the service models, which take tens of
    milliseconds to load (on the event loop, inside create_client) the first time only. Built
    on a thread the first time (``warm_session``): its handlers' registration held the event loop
    5.5-5.7 ms (``benchmarks/loop_stalls.py DIR --source s3://...``)."""
    global _SESSION
    with _SESSION_LOCK:
        if _SESSION is None:
            _SESSION = get_session()
        return _SESSION


_WARMED = False


def _load_models() -> None:
    """Read the JSON files create_client needs into the session loader's cache (a thread's work),
    the session built first where it is not yet."""
    loader = _session().get_component("data_loader")
    for type_name in ("service-2", "endpoint-rule-set-1"):
        loader.load_service_model("s3", type_name)
    for name in ("endpoints", "partitions", "sdk-default-configuration", "_retry"):
        with contextlib.suppress(Exception):  # a botocore without one of them builds it otherwise
            loader.load_data(name)


def warm() -> None:
    """Load botocore's S3 models now, and build and close one client (see ``aload.preload``).

    The client is thrown away: building the process's first one also fills botocore's caches
    (operation names, compiled patterns), so the first load's client, built on the event loop,
    held it 7.7-8.5 ms after the models alone were loaded and 3.7-4.6 ms after this. It is built
    on a thread of its own, with its own event loop (this may be called inside a running one),
    from fixed dummy credentials and endpoint: nothing is looked up and nothing is contacted."""
    global _WARMED
    _load_models()
    session = _session()
    _WARMED = True

    async def build_and_close() -> None:
        async with session.create_client(
            "s3",
            endpoint_url="http://127.0.0.1:9",
            region_name="us-east-1",
            aws_access_key_id="x",
            aws_secret_access_key="x",
            config=AioConfig(s3={"addressing_style": "path"}, signature_version="s3v4"),
        ) as client:
            # A request made and signed locally: the first one's validation, serialization and
            # signing paths (their patterns compiled) then run here, not on the first load's loop.
            await client.generate_presigned_url("get_object", Params={"Bucket": "b", "Key": "k"}, ExpiresIn=60)

    failed: list[BaseException] = []

    def run() -> None:
        try:
            asyncio.run(build_and_close())
        except Exception as exc:  # only a warm-up: the first load builds its client either way
            failed.append(exc)

    thread = threading.Thread(target=run, name="aload-s3-warm", daemon=True)
    thread.start()
    thread.join()
    if failed:
        log.debug("aload: building a first S3 client at preload failed: %r", failed[0])


async def warm_session() -> Any:
    """The session, built and its models loaded on a thread the first time: the first create_client then
    held the event loop up to 18-24 ms instead of 82-138 ms (``benchmarks/s3_first_client.py``;
    the rest is building the client, which has to happen on the loop)."""
    global _WARMED
    if not _WARMED:
        with contextlib.suppress(Exception):  # only a cache warm-up: create_client loads what is missing
            await run_in_thread(_load_models)
        _WARMED = True
    return _session()
