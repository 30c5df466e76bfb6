#!/usr/bin/env bash
# Acceptance of the native PyTorch door's integration, about 3-4 minutes:
#   - torch.profiler(profile_memory=True) of a small GPT-2-shaped training step: allocation
#     and free events and export_memory_timeline, streamalloc vs PyTorch's allocator;
#   - torch.cuda.memory_stats(): the same keys as PyTorch's, which of the keys PyTorch
#     fills stay 0, reset_accumulated_memory_stats();
#   - a MemPool(use_on_oom=True) whose cached block serves a request outside it at OOM;
#   - an NCCL all_reduce on buffers of a MemPool(ProcessGroupNCCL's mem_allocator)
#     registered with NCCL, equal to the unregistered one (2 GPUs; skipped on 1);
#   - the door checks memory_stats, mempool and door of checks.py.
# streamalloc comes from the installed package, or from this checkout's python/ when
# STREAMALLOC_LIB names a libstreamalloc.so. The table is printed last.
#   benches/gpu/torch_door/accept_door.sh [OUT]
set -u
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(cd "$HERE/../../.." && pwd)
OUT=${1:-$(mktemp -d)}
mkdir -p "$OUT/results" "$OUT/logs"
if [ -n "${STREAMALLOC_LIB:-}" ]; then
  export PYTHONPATH="$ROOT/python${PYTHONPATH:+:$PYTHONPATH}"
fi
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
unset STREAMALLOC_CONF PYTORCH_CUDA_ALLOC_CONF PYTORCH_NO_CUDA_MEMORY_CACHING
python3 -c 'import torch, streamalloc; print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.device_count(), "GPU(s)", torch.cuda.get_device_name(0)); print("streamalloc", streamalloc.__version__, streamalloc.library_path())' 2>&1 | tee "$OUT/env.txt"
# The door is compiled at first use: once here, so that no timed check pays for it.
CUDA_VISIBLE_DEVICES=0 timeout 300 python3 -c 'import streamalloc._door as d; d.build()' >"$OUT/logs/build.log" 2>&1 \
  || { echo "accept_door.sh: building the native door failed:"; tail -20 "$OUT/logs/build.log"; exit 1; }
run() {  # CHECK ALLOC TIMEOUT [GPUS]
  local check=$1 alloc=$2 limit=$3 gpus=${4:-0}
  CUDA_VISIBLE_DEVICES=$gpus timeout "$limit" python3 "$HERE/accept_door.py" "$check" "$alloc" \
    "$OUT/results/$check.$alloc.json" >"$OUT/logs/$check.$alloc.log" 2>&1 \
    || [ -f "$OUT/results/$check.$alloc.json" ] \
    || echo "{\"check\": \"$check\", \"alloc\": \"$alloc\", \"error\": \"exit $? (see logs/$check.$alloc.log)\"}" \
      >"$OUT/results/$check.$alloc.json"
}
gpus=$(python3 -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)
for alloc in native sa_native; do
  run profile "$alloc" 120 &
  run stats "$alloc" 90 &
  wait
  STREAMALLOC_CONF=expandable_segments:false run use_on_oom "$alloc" 90
  if [ "$gpus" -ge 2 ]; then
    # A pool's segments come from another allocator only with whole segments.
    STREAMALLOC_CONF=expandable_segments:false run nccl "$alloc" 180 0,1
  else
    echo "{\"check\": \"nccl\", \"alloc\": \"$alloc\", \"status\": \"skipped\", \"figure\": \"skipped: 1 GPU\"}" \
      >"$OUT/results/nccl.$alloc.json"
  fi
done
# The existing door checks, one process each.
for alloc in native sa_native; do
  for check in door memory_stats mempool; do
    CUDA_VISIBLE_DEVICES=0 timeout 120 python3 "$HERE/checks.py" "$check" "$alloc" \
      "$OUT/results/door_$check.$alloc.json" >"$OUT/logs/door_$check.$alloc.log" 2>&1 &
  done
  wait
done
python3 - "$OUT/results" <<'PY'
import json, os, sys
d = sys.argv[1]
for name in sorted(os.listdir(d)):
    if name.startswith("door_"):
        path = os.path.join(d, name)
        with open(path) as f:
            res = json.load(f)
        res["check"] = "door_" + res.get("check", name.split(".")[0][5:])
        with open(path, "w") as f:
            json.dump(res, f)
PY
python3 "$HERE/accept_door.py" table "$OUT/results" | tee "$OUT/table.md"
