"""How long creating the process's first S3 client holds the event loop (a 1 ms ticker's worst
lateness). aload builds it on a thread (``aload._boto.open_client``), the first time with the
models loaded there first and the switch interval shortened meanwhile; ``--no-warm`` skips those
two (the models then load inside ``create_client``, still on the thread).

    python benchmarks/s3_first_client.py [--no-warm]

Each run is a fresh process (the models are cached per process); no endpoint is contacted.
Here (stop 58): up to 2.0-2.2 ms, and 5.2-7.1 with ``--no-warm`` (three runs each); with the
client built on the loop (earlier stops), 18-24 ms, and 82-138 without the models loaded first.
"""

from __future__ import annotations

import argparse
import asyncio
import time

import aload._boto as boto
import aload.s3 as s3


async def main(warm: bool) -> None:
    if not warm:
        boto._WARMED = True  # skip the models' thread and the set-up's switch interval
    lags: list[float] = []

    async def tick() -> None:
        while True:
            t = time.perf_counter()
            await asyncio.sleep(0.001)
            lags.append(time.perf_counter() - t - 0.001)

    ticker = asyncio.ensure_future(tick())
    await asyncio.sleep(0.05)
    store = s3.S3Store(
        "s3://bucket/prefix/", concurrency=2, endpoint_url="http://127.0.0.1:9", access_key="x", secret_key="y"
    )
    await store.client()
    await asyncio.sleep(0.02)
    ticker.cancel()
    await store.aclose()
    print(
        f"first S3 client ({'models warmed on a thread' if warm else 'no warm-up'}): loop held up to {max(lags) * 1e3:.1f} ms"
    )


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--no-warm", action="store_true")
    asyncio.run(main(not ap.parse_args().no_warm))
