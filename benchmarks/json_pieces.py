"""botocore's JSON files (those a first S3 load reads) decoded whole and in pieces
(``aload._json.loads_paced``): each way's time, the collector paused, and the longest single C
call of the piecewise decode (what holds the GIL, and so the event loop, at a time).

    python benchmarks/json_pieces.py [--reps 5]
"""

from __future__ import annotations

import argparse
import gc
import gzip
import json
import os
import sys
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import botocore

from aload import _json

FILES = ["endpoints.json", "s3/2006-03-01/service-2.json.gz", "s3/2006-03-01/endpoint-rule-set-1.json.gz"]


def timed(fn: Any, reps: int) -> tuple[float, float, Any]:
    """The fastest and slowest of ``reps`` calls, in ms, the collector paused, and one result."""
    took: list[float] = []
    for _ in range(reps):
        gc.disable()
        t = time.perf_counter()
        got = fn()
        took.append(time.perf_counter() - t)
        gc.enable()
    return min(took) * 1e3, max(took) * 1e3, got


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=5)
    a = ap.parse_args()
    data = Path(os.path.dirname(botocore.__file__)) / "data"
    print(f"botocore {botocore.__version__}, piece {_json._JSON_PIECE} characters")
    for name in FILES:
        path = data / name
        text = (gzip.open(path, "rb") if name.endswith(".gz") else path.open("rb")).read().decode()
        lo, hi, whole = timed(lambda text=text: json.loads(text, object_pairs_hook=OrderedDict), a.reps)
        plo, phi, paced = timed(lambda text=text: _json.loads_paced(text, OrderedDict), a.reps)
        assert paced == whole
        calls: list[float] = []
        walk = _json._Walk(text, OrderedDict)
        decode = walk.decode

        def one(*args: Any, decode: Any = decode, calls: list[float] = calls) -> Any:
            t = time.perf_counter()
            try:
                return decode(*args)
            finally:
                calls.append(time.perf_counter() - t)

        walk.decode = one  # type: ignore[method-assign]
        walk.pace = lambda: None  # type: ignore[method-assign]
        gc.disable()
        walk.value(0)
        gc.enable()
        print(
            f"{name}: {len(text) / 1e6:.2f} MB; whole {lo:.1f}-{hi:.1f} ms; in pieces {plo:.1f}-{phi:.1f} ms, "
            f"{len(calls)} C calls, the longest {max(calls) * 1e3:.2f} ms"
        )


if __name__ == "__main__":
    main()
