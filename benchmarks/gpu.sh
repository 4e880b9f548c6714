#!/usr/bin/env bash
# The GPU checks and timings, in one go, as run on a lent H200 (docs/benchmarks.md, "On a GPU"):
#
#   bash benchmarks/gpu.sh OUT [SIZES] [REPS]      # SIZES in GiB (default 4), REPS (default 2)
#
# 1. tests/test_cuda.py (loads into GPU models: pinned buffers, the load's stream, reuse only after
#    the copy's event); 2. the same tests with the event taken out, which must fail (the tests can
#    see a buffer reused too early); 3. the host-to-device copy ceiling, and pinned memory made
#    each way (benchmarks/pinning.py); 4. the budget (the pinned memory a load holds) of the
#    built-in loader, of a load_weights model, and of one with weights_on_device; 5. the suite
#    with the model on the GPU, warm and cold.
# STEPS (default 12345) picks steps: STEPS=145 bash benchmarks/gpu.sh OUT 1 2. Step 4 takes RUNS
# ("GIB LOADER MIB,...", LOADER builtin, lw or lwdev), ROUNDS and PINNING=register or runtime (see there).
# Writes OUT/tests.log, OUT/no-event.log, OUT/copies.log (3 and 4), OUT/SIZEg-report.md and
# OUT/SIZEg-rows.jsonl (the plots: ``suite.plots`` over the rows, on any machine). Needs python3
# with torch (CUDA), safetensors, aiofiles, numpy and pytest-asyncio; the peers fastsafetensors and
# runai-model-streamer where installed.
set -uo pipefail
export PYTHONUNBUFFERED=1
out=${1:?OUT}; sizes=${2:-4}; reps=${3:-2}
mkdir -p "$out"
want() { [[ ${STEPS:-12345} == *$1* ]]; }
here=$(cd "$(dirname "$0")/.." && pwd)
cd "$here"
# Checkpoints on a disk, not tmpfs: the cold runs drop them from the page cache.
ckpt=${CKPT_DIR:-/tmp/aload-gpu}
[ "$(stat -f -c %T /tmp)" = tmpfs ] && ckpt=${CKPT_DIR:-$here/.ckpt-gpu}
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv,noheader
python3 -c 'import torch, safetensors, sys; print(sys.version.split()[0], "torch", torch.__version__, "safetensors", safetensors.__version__)'
nproc; free -g | head -2; df -h "$(dirname "$ckpt")" | tail -1
if want 1; then
echo "== 1. tests/test_cuda.py"
python3 -m pytest -q -p no:cacheprovider -W default tests/test_cuda.py 2>&1 | tee "$out/tests.log" | tail -15

fi

if want 2; then
echo "== 2. the same, the release event taken out (expected: failures)"
python3 - <<'PY' 2>&1 | tee "$out/no-event.log" | tail -8
import pytest

import aload.loader


class NoEvent:
    def pytest_configure(self, config):
        aload.loader._recorded_event = lambda stream: None  # buffers handed back at once


pytest.main(["-q", "-p", "no:cacheprovider", "-W", "default", "tests/test_cuda.py", "-k", "not cancelled"], plugins=[NoEvent()])
PY

fi

if want 3; then
echo "== 3. host to device: one 1 GiB copy from pinned and from pageable memory" | tee "$out/copies.log"
python3 - <<'PY' 2>&1 | tee -a "$out/copies.log"
import time

import torch

n = 1 << 30
dst = torch.empty(n, dtype=torch.uint8, device="cuda")
for kind, src in (("pinned", torch.ones(n, dtype=torch.uint8).pin_memory()), ("pageable", torch.ones(n, dtype=torch.uint8))):
    best = 0.0
    for _ in range(5):
        torch.cuda.synchronize()
        t = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        best = max(best, n / (time.perf_counter() - t) / 1e9)
    print(f"{kind}: {best:.1f} GB/s (best of 5)")
t = time.perf_counter()
torch.empty(512 << 20, dtype=torch.uint8, pin_memory=True)
print(f"pinning a fresh 512 MiB: {(time.perf_counter() - t) * 1e3:.0f} ms")
PY
echo "   pinned memory made each way (benchmarks/pinning.py)" | tee -a "$out/copies.log"
python3 benchmarks/pinning.py 64 256 512 2>&1 | grep -v Warning | tee -a "$out/copies.log"

fi

if want 4; then
echo "== 4. the budget (the pinned memory a load holds), warm, a fresh process each (pinning is paid per process):" | tee -a "$out/copies.log"
echo "   GIB LOADER MIB: the built-in loader, a load_weights model (lw), the same with weights_on_device (lwdev)" | tee -a "$out/copies.log"
# RUNS: the runs, comma-separated; ROUNDS: how many times each (default 2). PINNING=register:
# torch's pinned memory by cudaHostRegister on 8 threads (PYTORCH_CUDA_ALLOC_CONF, set before CUDA
# starts); PINNING=runtime: the same switched on in the process, before the load
# (torch.cuda.memory._set_allocator_settings).
runs=${RUNS:-4 builtin 32,4 builtin 64,4 builtin 128,4 builtin 512,1 lw 64,1 lw 128,1 lw 256,1 lw 512,1 lwdev 64,1 lwdev 128,1 lwdev 256}
[ "${PINNING:-}" = register ] && export PYTORCH_CUDA_ALLOC_CONF=pinned_use_cuda_host_register:True,pinned_num_register_threads:8
for gib in $(tr ',' '\n' <<<"$runs" | cut -d' ' -f1 | sort -u); do
  python3 -c "import sys; sys.path.insert(0, 'benchmarks'); import suite, pathlib; suite.make_llama(pathlib.Path('$ckpt/ckpt-${gib}g'), $gib.0)"
done
for round in $(seq "${ROUNDS:-2}"); do
  IFS=, read -ra each <<<"$runs"
  for run in "${each[@]}"; do
    set -- $run
    python3 - "$ckpt/ckpt-${1}g" "$2" "$3" <<'PY' 2>&1 | grep -v Warning
import asyncio, os, sys, time
from pathlib import Path

import torch

sys.path.insert(0, "benchmarks")
import suite

import aload

folder, how, mib = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
model, params = suite.preallocated_model(folder, "cuda")


class Engine(torch.nn.Module):  # as the suite's: copy_() each tensor into the GPU parameter
    def load_weights(self, weights):
        for name, t in weights:
            params[name].data.copy_(t)
        return set()


if os.environ.get("PINNING") == "runtime":
    torch.cuda.memory._set_allocator_settings("pinned_use_cuda_host_register:True,pinned_num_register_threads:8")
suite.warm_cache(folder)
torch.cuda.synchronize()
t = time.perf_counter()
target = model if how == "builtin" else Engine()
r = asyncio.run(aload.load(target, folder, max_inflight_bytes=mib << 20, device="cuda", weights_on_device=how == "lwdev"))
torch.cuda.synchronize()
s = time.perf_counter() - t
print(f"{folder.name} {how:7s} {os.environ.get('PINNING') or 'alloc':8s} budget {mib:4d} MiB: {r.bytes / s / 1e9:6.2f} GB/s, first tensor {r.ttft_s * 1e3:6.1f} ms, "
      f"staged {r.staged_bytes / r.bytes:.0%}, peak in flight {r.peak_inflight_bytes >> 20} MiB")
PY
  done
done | tee -a "$out/copies.log"
unset PYTORCH_CUDA_ALLOC_CONF

fi

if want 5; then
echo "== 5. the suite, the model on the GPU"
loaders=aload,aload_lw,aload_lw_dev,safe_open,threadpool,load_file_gpu
python3 -c 'import fastsafetensors' 2>/dev/null && loaders+=,fastsafetensors
python3 -c 'import runai_model_streamer' 2>/dev/null && loaders+=,runai
loaders=${LOADERS:-$loaders}  # LOADERS, SCENARIOS: a shorter run
for s in ${sizes//,/ }; do
  python3 benchmarks/suite.py --device cuda --sizes "$s" --scenarios "${SCENARIOS:-warm,cold}" --reps "$reps" \
    --loaders "$loaders" --out "/tmp/aload-gpu-out/$s" --ckpt-dir "$ckpt" 2>&1
  cp "/tmp/aload-gpu-out/$s/report.md" "$out/${s}g-report.md"
  cp "/tmp/aload-gpu-out/$s/rows.jsonl" "$out/${s}g-rows.jsonl"
done
fi
