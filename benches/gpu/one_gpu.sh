#!/usr/bin/env bash
# What one GPU can check of a build (run.sh's goal table needs two, for pp_isend):
# streamalloc-gpu-test, then GPT-2 small and ResNet-50 training (STEPS steps, median of
# steps 2..) with PyTorch's allocator, with streamalloc's default configuration and with
# expandable segments, in one call; a table of step times, peak reserved / allocated and
# loss differences is printed last. Logs and JSON land in OUT/one_gpu.tgz.
#   STREAMALLOC_LIB=.../libstreamalloc.so STREAMALLOC_GPU_TEST=.../streamalloc-gpu-test \
#     benches/gpu/one_gpu.sh OUT
set -u
OUT=${1:?output directory}; W=/tmp/one_gpu; mkdir -p "$W" "$OUT"; B=$(cd "$(dirname "$0")" && pwd)
export STREAMALLOC_LIB=${STREAMALLOC_LIB:?path of libstreamalloc.so}
GPU_TEST=${STREAMALLOC_GPU_TEST:?path of streamalloc-gpu-test}
export CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0} STEPS=${STEPS:-10} PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
"$GPU_TEST" > $W/gpu_test.txt 2>&1; echo "streamalloc-gpu-test rc=$?" >> $W/gpu_test.txt
for work in gpt2 resnet; do
  for run in native default expandable; do
    case $run in
      native) alloc=native conf= ;;
      default) alloc=streamalloc conf= ;;
      expandable) alloc=streamalloc conf=expandable_segments:true ;;
    esac
    STREAMALLOC_CONF=$conf timeout 300 python3 $B/alloc_bench.py $alloc $work $W/${work}_$run.json \
      > $W/${work}_$run.log 2>&1 || echo "$work $run failed: $(tail -c 400 $W/${work}_$run.log)"
  done
done
tar czf "$OUT/one_gpu.tgz" -C $W .
cut -c1-220 $W/gpu_test.txt
python3 - $W <<'PY'
import json, sys
w = sys.argv[1]
print("| work | allocator | step ms (vs native) | peak reserved / allocated MiB | ratio | max abs loss difference |")
print("| --- | --- | --- | --- | --- | --- |")
for work in ["gpt2", "resnet"]:
    try:
        native = json.load(open(f"{w}/{work}_native.json"))
    except Exception as e:
        print(f"| {work} | native | missing: {e} | | | |"); continue
    for run in ["native", "default", "expandable"]:
        try:
            r = json.load(open(f"{w}/{work}_{run}.json"))
        except Exception as e:
            print(f"| {work} | {run} | missing: {e} | | | |"); continue
        if "error" in r:
            print(f"| {work} | {run} | error: {r['error'][:120]} | | | |"); continue
        diff = max(abs(a - b) for a, b in zip(r["losses"], native["losses"]))
        print(f"| {work} | {run} | {r['step_ms']:.1f} ({r['step_ms'] / native['step_ms']:.3f}x) | "
              f"{r['peak_reserved_mib']:.0f} / {r['peak_allocated_mib']:.0f} | "
              f"{r['peak_reserved_mib'] / r['peak_allocated_mib']:.3f} | {diff:.2e} |")
PY
