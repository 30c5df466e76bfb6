#!/usr/bin/env bash
# Acceptance of streamalloc's PyTorch doors on ONE GPU: CUDA graphs (eager tensors after
# replays, make_graphed_callables, shared graph pools, torch.compile reduce-overhead),
# multiprocessing, MemPool, memory history and viewers, cudnn.benchmark, memory stats,
# GPT-2 / ResNet-50 training, the Python alloc/free loop and streamalloc-gpu-test, for
# PyTorch's allocator, streamalloc's native door, its pluggable door and the native door
# with expandable segments. Each check runs in its own process with a timeout; the table
# (one row per check, one column per allocator) is printed last and saved as OUT/table.md,
# logs and JSON go to OUT/logs and OUT/results. About 6-8 minutes on one H200.
#   STREAMALLOC_LIB=.../libstreamalloc.so [STREAMALLOC_GPU_TEST=.../streamalloc-gpu-test] \
#   [STREAMALLOC_BIN=.../streamalloc] benches/gpu/torch_door/run.sh OUT
# Knobs: JOBS (checks at a time, 6), TOTAL_S / PARALLEL_S (start deadlines, 470 / 280 s),
# MICRO_ROUNDS (3), STEPS (alloc_bench training steps, 6).
set -u
OUT=${1:?usage: run.sh OUT}
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(cd "$HERE/../../.." && pwd)
mkdir -p "$OUT"
. "$ROOT/benches/gpu/env.sh"
# One inductor cache for every process: the first GPT-2 compile fills it for the others.
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-/tmp/torch_door_inductor}
unset STREAMALLOC_CONF PYTORCH_CUDA_ALLOC_CONF PYTORCH_NO_CUDA_MEMORY_CACHING
{
  echo "streamalloc: $STREAMALLOC_LIB"
  python3 -c 'import torch, sys; print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(0), "python", sys.version.split()[0])' 2>&1
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1
} | tee "$OUT/env.txt"
python3 "$HERE/driver.py" "$OUT" 2>&1 | tee "$OUT/driver.log"
exit "${PIPESTATUS[0]}"
