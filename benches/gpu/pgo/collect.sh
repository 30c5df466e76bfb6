#!/usr/bin/env bash
# Runs the workloads a profile-guided libstreamalloc.so is tuned for, with an instrumented
# build (benches/gpu/pgo/build.sh instrument), on the GPU machine, and packs the raw
# profiles into OUT/profraw.tgz for `build.sh merge`:
#   - PyTorch's Python alloc/free loop (alloc_bench.py micro);
#   - GPT-2 small and ResNet-50 training, whole segments and expandable segments;
#   - the C ABI's same-size pairs and mixed sizes (host_abi.cpp).
# Training takes the real workloads' paths (events, growth, expandable mapping); the loop
# and the C ABI weight the fast paths every program runs.
#   STREAMALLOC_LIB=.../libstreamalloc.so benches/gpu/pgo/collect.sh OUT
set -u
OUT=${1:?output directory}; B=$(cd "$(dirname "$0")/.." && pwd)
LIB=${STREAMALLOC_LIB:?path of the instrumented libstreamalloc.so}
W=/tmp/pgo_collect; rm -rf "$W"; mkdir -p "$W/raw" "$OUT"
export CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0} STEPS=${STEPS:-4} PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export LLVM_PROFILE_FILE="$W/raw/%p.profraw"
run() {  # NAME CONF WORK
    STREAMALLOC_CONF=$2 timeout 300 python3 "$B/alloc_bench.py" streamalloc "$3" "$W/$1.json" \
        > "$W/$1.log" 2>&1 && echo "$1: $(head -c 160 "$W/$1.json")" \
        || echo "$1 failed: $(tail -c 400 "$W/$1.log")"
}
run micro "" micro
for work in gpt2 resnet; do
    run "${work}_default" "" "$work"
    run "${work}_expandable" expandable_segments:true "$work"
done
g++ -O2 -o "$W/host_abi" "$B/host_abi.cpp" -ldl -lpthread && "$W/host_abi" "$LIB" > "$W/host_abi.txt" 2>&1
echo "host_abi: $(tail -n 2 "$W/host_abi.txt" | tr '\n' ' ')"
count=$(find "$W/raw" -name '*.profraw' | wc -l)
[ "$count" -gt 0 ] || { echo "no .profraw written: is $LIB an instrumented build?"; exit 1; }
tar czf "$OUT/profraw.tgz" -C "$W/raw" .
echo "$count raw profiles, $(du -h "$OUT/profraw.tgz" | cut -f1) packed"
