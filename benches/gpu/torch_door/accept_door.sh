#!/usr/bin/env bash
# Acceptance of the native PyTorch door's integration, about 5-6 minutes:
#   - torch.profiler(profile_memory=True) of a small GPT-2-shaped training step: allocation
#     and free events and export_memory_timeline, streamalloc vs PyTorch's allocator;
#   - torch.cuda.memory_stats(): the same keys as PyTorch's, which of the keys PyTorch
#     fills stay 0, reset_accumulated_memory_stats();
#   - a MemPool(use_on_oom=True) whose cached block serves a request outside it at OOM;
#   - an NCCL all_reduce on buffers of a MemPool(ProcessGroupNCCL's mem_allocator)
#     registered with NCCL, equal to the unregistered one, on 2 and 4 ranks under the
#     default configuration (skipped where there are fewer GPUs);
#   - a MemPool(no_split=True): one segment per tensor;
#   - CUDA IPC of a 1 KiB, an expandable and a stitched tensor to spawned and forkserver
#     children (benches/gpu/ipc/ipc_check.py);
#   - memory_stats() after one workload against PyTorch's (stats_compare.py);
#   - the door checks memory_stats, mempool and door of checks.py;
#   - oom_recovery.py: a batch size finder's out-of-memory recovery under each allocator;
#   - foreign_streams.py: ExternalStreams made, used and destroyed with blocks cached;
#   - two_devices.py on GPUs 0 and 1: one process, two GPUs, PyTorch's allocator and both
#     doors (skipped on one GPU).
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
run() {  # CHECK ALLOC TIMEOUT [GPUS [ARG]]
  local check=$1 alloc=$2 limit=$3 gpus=${4:-0} arg=${5:-}
  local name=$check$arg
  CUDA_VISIBLE_DEVICES=$gpus timeout "$limit" python3 "$HERE/accept_door.py" "$check" "$alloc" \
    "$OUT/results/$name.$alloc.json" $arg >"$OUT/logs/$name.$alloc.log" 2>&1 \
    || [ -f "$OUT/results/$name.$alloc.json" ] \
    || echo "{\"check\": \"$name\", \"alloc\": \"$alloc\", \"error\": \"exit $? (see logs/$name.$alloc.log)\"}" \
      >"$OUT/results/$name.$alloc.json"
}
gpus=$(python3 -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)
for alloc in native sa_native; do
  run profile "$alloc" 120 &
  run stats "$alloc" 90 &
  wait
  STREAMALLOC_CONF=expandable_segments:false run use_on_oom "$alloc" 90
  run no_split "$alloc" 90
  # The pool's segments come whole from NCCL's allocator under the default configuration.
  for ranks in 2 4; do
    if [ "$gpus" -ge "$ranks" ]; then
      run nccl "$alloc" 180 "$(seq -s, 0 $((ranks - 1)))" "$ranks"
    else
      echo "{\"check\": \"nccl$ranks\", \"alloc\": \"$alloc\", \"status\": \"skipped\", \"figure\": \"skipped: $gpus GPU(s)\"}" \
        >"$OUT/results/nccl$ranks.$alloc.json"
    fi
  done
done
# Independent processes on one GPU each: run side by side.
run ipc sa_native 240 &
CUDA_VISIBLE_DEVICES=0 timeout 300 python3 "$HERE/stats_compare.py" "$OUT/results/stats_compare.json" \
  >"$OUT/logs/stats_compare.log" 2>&1 &
wait
python3 - "$OUT/results/stats_compare.json" "$OUT/results/stats_vs_pytorch.sa_native.json" <<'PY'
import json, sys
try:
    results = json.load(open(sys.argv[1]))
    ok = all(r["verdict"] for r in results)
    fig = "; ".join(f"{r['pair']}: {r['nonzero'][1]} non-zero keys vs {r['nonzero'][0]}, "
                    f"disagreeing: {', '.join(r['bad']) or 'none'}" for r in results)
    res = {"check": "stats_vs_pytorch", "alloc": "sa_native", "status": "PASS" if ok else "FAIL",
           "figure": fig}
except Exception as err:
    res = {"check": "stats_vs_pytorch", "alloc": "sa_native", "error": f"{err} (see logs/stats_compare.log)"}
json.dump(res, open(sys.argv[2], "w"))
PY
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
# A batch size finder's out-of-memory recovery (the error recognised by its text, cache
# emptied, batch halved, training continued), each allocator in turn.
CUDA_VISIBLE_DEVICES=0 timeout 600 python3 "$HERE/oom_recovery.py" --compare \
  >"$OUT/logs/oom_recovery.log" 2>&1
echo "oom_recovery.py (exit $?): $(tail -1 "$OUT/logs/oom_recovery.log")"
# Streams a library makes, uses and destroys while blocks freed on them are cached.
CUDA_VISIBLE_DEVICES=0 timeout 300 python3 "$HERE/foreign_streams.py" --compare \
  >"$OUT/logs/foreign_streams.log" 2>&1
echo "foreign_streams.py (exit $?): $(tail -1 "$OUT/logs/foreign_streams.log")"
# One process on two GPUs (a model split over them, a device other than the current one):
# PyTorch's allocator and both doors, each check PASS or FAIL; skipped on one GPU.
if [ "$gpus" -ge 2 ]; then
  CUDA_VISIBLE_DEVICES=0,1 timeout 600 python3 "$HERE/two_devices.py" --compare \
    >"$OUT/logs/two_devices.log" 2>&1
  echo "two_devices.py (exit $?): $(tail -1 "$OUT/logs/two_devices.log")"
fi
python3 "$HERE/accept_door.py" table "$OUT/results" | tee "$OUT/table.md"
