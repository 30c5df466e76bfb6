#!/usr/bin/env bash
# Prints the goal table (its runs: benches/gpu/results.md; the latest: docs/benchmarks.md) on one
# machine with 2 GPUs, native PyTorch next to streamalloc, in one run:
#   benches/gpu/run.sh [OUTDIR]
# Needs: python3 with PyTorch (transformers, torchvision), nvcc, torchrun; libstreamalloc.so
# where python/streamalloc finds it (next to the package, STREAMALLOC_LIB, or
# target/release); the GPU test binary at $STREAMALLOC_GPU_TEST (default
# target/release/streamalloc-gpu-test). Logs and JSON land in OUTDIR; the table is printed last.
# Two tracks run at once, one per GPU (each compares allocators on its own GPU); pp_isend
# then uses both.
set -u
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
OUT=${1:-$HERE/out}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
LIB=$(python3 -c "import sys; sys.path.insert(0, '$ROOT/python'); import streamalloc; print(streamalloc.library_path())") || exit 2
TEST=${STREAMALLOC_GPU_TEST:-$ROOT/target/release/streamalloc-gpu-test}
echo "library: $LIB"

step() {  # step NAME GPU COMMAND...: runs COMMAND on GPU (or "all"), log in OUT/NAME.log
  local name=$1 gpu=$2; shift 2
  local t0=$(date +%s) rc
  if [ "$gpu" = all ]; then timeout "${STEP_TIMEOUT:-300}" "$@" >"$OUT/$name.log" 2>&1
  else CUDA_VISIBLE_DEVICES=$gpu timeout "${STEP_TIMEOUT:-300}" "$@" >"$OUT/$name.log" 2>&1; fi
  rc=$?
  echo "== $name (gpu $gpu): rc=$rc, $(( $(date +%s) - t0 )) s"
}

nvcc -shared -Xcompiler -fPIC -o "$OUT/pluggable_bump.so" "$HERE/pluggable_bump.c" -lcudart >"$OUT/nvcc.log" 2>&1

# The C++ extension's compile is CPU-heavy: do it (and the host-cost runs) before the
# tracks, so it cannot disturb the Python micro benchmark.
step host_cost 1 python3 "$HERE/host_cost.py" "$LIB" "$OUT/host_cost.json"
step host_cost_notrace 1 env STREAMALLOC_CONF=trace_capacity:0 python3 "$HERE/host_cost.py" "$LIB" "$OUT/host_cost_notrace.json"
# The same loops unoptimised, as a harness built with load_inline alone compiles them.
step host_cost_O0 1 env OPT=-O0 python3 "$HERE/host_cost.py" "$LIB" "$OUT/host_cost_O0.json"

(   # track A, GPU 0
  step gpu_test 0 "$TEST"
  for a in native streamalloc "so:$OUT/pluggable_bump.so:pb_malloc:pb_free"; do
    n=${a%%:*}; [ "$n" = so ] && n=floor
    step "micro_$n" 0 python3 "$HERE/alloc_bench.py" "$a" micro "$OUT/micro_$n.json"
  done
  for a in native streamalloc; do step "gpt2_$a" 0 python3 "$HERE/alloc_bench.py" $a gpt2 "$OUT/gpt2_$a.json"; done
) &
(   # track B, GPU 1
  for a in native streamalloc; do step "resnet_$a" 1 python3 "$HERE/alloc_bench.py" $a resnet "$OUT/resnet_$a.json"; done
  step torch_probe 1 env STREAMALLOC_CONF=memory_limit:1GiB python3 "$HERE/torch_probe.py" "$OUT/torch_probe.json"
) &
wait
# PyTorch 2.11 keeps isend tensors alive in the Work until wait() (no record_stream);
# TORCH_NCCL_AVOID_RECORD_STREAMS=0 makes it free them and call record_stream instead.
for rs in 1 0; do
  step "pp_native_rs$rs" all env TORCH_NCCL_AVOID_RECORD_STREAMS=$rs torchrun --nproc_per_node=2 "$HERE/pp_isend.py" "$OUT/pp_native_rs$rs.json"
  step "pp_streamalloc_rs$rs" all env TORCH_NCCL_AVOID_RECORD_STREAMS=$rs STREAMALLOC=1 torchrun --nproc_per_node=2 "$HERE/pp_isend.py" "$OUT/pp_streamalloc_rs$rs.json"
done
# The same program with its isend going through BoundedSender (two 64 MiB slots).
step pp_native_staged all env STAGED=128 torchrun --nproc_per_node=2 "$HERE/pp_isend.py" "$OUT/pp_native_staged.json"
step pp_streamalloc_staged all env STAGED=128 STREAMALLOC=1 torchrun --nproc_per_node=2 "$HERE/pp_isend.py" "$OUT/pp_streamalloc_staged.json"

echo; grep -hE "^(PASS|FAIL|SKIP)" "$OUT/gpu_test.log"
echo; python3 "$HERE/report.py" "$OUT"
