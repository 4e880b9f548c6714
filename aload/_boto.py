"""One botocore session per process for ``aload.s3``, its S3 models loaded and its clients built
off the event loop, and ``warm`` for ``aload.preload``: loading them, and building a first client,
took tens of milliseconds the first time, on the loop if nobody did it before."""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
from collections import OrderedDict
from typing import Any

from aiobotocore.config import AioConfig
from aiobotocore.session import get_session
from botocore.loaders import JSONFileLoader

from ._json import loads_paced
from ._threads import run_in_thread, setup_switches
from .http import log

_SESSION: Any = None
_SESSION_LOCK = threading.Lock()


class _PacedJSONFileLoader(JSONFileLoader):  # type: ignore[misc]
    """botocore's JSON file loader, each file decoded with the GIL handed over between pieces
    (``loads_paced``): at a first S3 load its endpoints (1.25 MB) and S3's model (1.4 MB), one
    ``json.loads`` each on the thread that loads them, held the event loop 15-27 ms."""

    def _load_file(self, full_path: str, open_method: Any) -> Any:
        if not os.path.isfile(full_path):
            return None
        with open_method(full_path, "rb") as fp:
            payload = fp.read().decode("utf-8")
        return loads_paced(payload, object_pairs_hook=OrderedDict)


def _session() -> Any:
    """One botocore session per process: its loader caches the service models, which take tens of
    milliseconds to load (on the event loop, inside create_client) the first time only. Built
    on a thread the first time (``open_client``): its handlers' registration held the event loop
    5.5-5.7 ms (``benchmarks/loop_stalls.py DIR --source s3://...``). Its loader decodes its
    files in pieces (``_PacedJSONFileLoader``), where it is botocore's own kind."""
    global _SESSION
    with _SESSION_LOCK:
        if _SESSION is None:
            session = get_session()
            loader = session.get_component("data_loader")
            if type(getattr(loader, "file_loader", None)) is JSONFileLoader:
                loader.file_loader = _PacedJSONFileLoader()
            _SESSION = session
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
    (operation names, compiled patterns), so the first load's own client (``open_client``) is
    built the faster. It is built on a thread of its own, with its own event loop (this may be
    called inside a running one), from fixed dummy credentials and endpoint: nothing is looked
    up and nothing is contacted."""
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


async def open_client(stack: contextlib.AsyncExitStack, args: dict[str, Any]) -> Any:
    """An S3 client made from ``args`` (``create_client``'s), entered, and closed with ``stack``.

    It is built on a thread, with an event loop of its own, and then used on the caller's: the
    session, its models (the first time) and the client itself are all made there. Built on the
    event loop, a process's first client held it 7.7-9 ms even with the models loaded before
    (hook tables copied, its methods and endpoint rules made). Nothing in the client is bound to
    the loop it was built on: its HTTP sessions are made at its first request, on the caller's
    loop; its locks (Python's, >= 3.10) take a loop only once waited on. The first time, one URL
    is also presigned there (made and signed locally: its patterns compiled and caches filled),
    as ``warm`` does, so the first load's presigning does not do that on the loop."""
    global _WARMED
    first = not _WARMED

    def build() -> Any:
        if first:
            with contextlib.suppress(Exception):  # only a cache warm-up: create_client loads what is missing
                _load_models()

        async def enter() -> Any:
            client = await _session().create_client("s3", **args).__aenter__()
            if first:
                with contextlib.suppress(Exception):
                    await client.generate_presigned_url("get_object", Params={"Bucket": "b", "Key": "k"}, ExpiresIn=60)
            return client

        return asyncio.run(enter())

    # Python on that thread, ~0.1 s the first time and 10-20 ms later: see ``setup_switches``.
    # (Until stop 59 only the first build had it: after ``aload.preload``, a load's own build at
    # Python's 5 ms left the loop 6.2-8.1 ms late once a load, 3 of 3 runs of
    # ``benchmarks/loop_stalls.py DIR --source s3://... --preload``.)
    with setup_switches:
        client = await run_in_thread(build)
    _WARMED = True
    stack.push_async_exit(client)
    return client
