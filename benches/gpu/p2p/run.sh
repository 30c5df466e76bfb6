#!/usr/bin/env bash
# Runs the p2p correctness checks and the goal table on N GPUs (default 2).
# Usage: benches/gpu/p2p/run.sh [N] [OUT_DIR]   (needs python/ on PYTHONPATH and
# STREAMALLOC_LIB pointing at a release libstreamalloc.so)
set -u
N=${1:-2}; OUT=${2:-.}
HERE=$(cd "$(dirname "$0")" && pwd)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
rc=0
python3 "$HERE/ce_unit_check.py" || rc=1
timeout 150 torchrun --nproc_per_node="$N" "$HERE/check.py" > "$OUT/check.log" 2>&1 || rc=1
grep -v "^W1\|^\[W\|^\[rank.*W" "$OUT/check.log" | tail -40
python3 "$HERE/bench.py" "$N" --out "$OUT" > "$OUT/bench.log" 2>&1 || rc=1
tail -30 "$OUT/bench.log"
# The copy engine under expandable segments (memory mapped with the VMM API, which CUDA IPC
# cannot export): its shared region is a cuMemAlloc of its own, so it works under both.
i=0
for conf in "STREAMALLOC=1 STREAMALLOC_CONF=expandable_segments:true" "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"; do
  i=$((i + 1)); echo "== ce under $conf"
  env $conf SMOKE=1 timeout 120 torchrun --nproc_per_node="$N" "$HERE/check.py" > "$OUT/check_expandable_$i.log" 2>&1 || rc=1
  grep -v "^W1\|^\[W\|^\[rank.*W" "$OUT/check_expandable_$i.log" | tail -5
done
exit $rc
