#!/usr/bin/env bash
# Two builds of libstreamalloc.so side by side on the host paths, in one call: PyTorch's
# Python alloc/free loop (alloc_bench.py micro) interleaved hook floor / A / B, ROUNDS
# times (each the best of five passes), then the C ABI without PyTorch (host_abi.cpp, both
# builds in one process) with the trace ring on and off, and the host's primitives before
# and after. The GPU host's speed drifts between calls, so builds are compared only here.
# Every process runs on one CPU (PIN, default 4): unpinned, a Python process ran either at
# ~1.25 us/op or at ~2.5 us/op for its whole life, whichever allocator it used.
#   benches/gpu/host_ab.sh A.so B.so OUTDIR
set -u
A=${1:?build A (libstreamalloc.so)}; B=${2:?build B}; OUT=${3:?output directory}
ROUNDS=${ROUNDS:-4}; PIN=${PIN:-4}
W=/tmp/host_ab; mkdir -p "$W" "$OUT"; D=$(cd "$(dirname "$0")" && pwd)
export CUDA_VISIBLE_DEVICES=0 PYTHONUNBUFFERED=1
nvcc -shared -Xcompiler -fPIC -o $W/pb.so $D/pluggable_bump.c -lcudart > $W/nvcc.log 2>&1 || { cat $W/nvcc.log; exit 1; }
g++ -O2 -o $W/host_abi $D/host_abi.cpp -ldl -lpthread || exit 1
taskset -c "$PIN" $W/host_abi > $W/primitives_before.txt
# Each process is bounded, and its line printed as it ends, so a stuck run shows.
micro() {  # NAME ALLOC [LIB]
  STREAMALLOC_LIB=${3:-} timeout 120 taskset -c "$PIN" python3 $D/alloc_bench.py "$2" micro $W/micro_$1_$i.json \
    > $W/micro_$1_$i.log 2>&1 || echo "micro $1 round $i failed: $(tail -c 300 $W/micro_$1_$i.log)"
  echo "round $i $1: $(head -c 120 $W/micro_$1_$i.json 2>/dev/null)"
}
for i in $(seq "$ROUNDS"); do
  micro floor "so:$W/pb.so:pb_malloc:pb_free"
  micro A streamalloc "$A"
  micro B streamalloc "$B"
done
taskset -c "$PIN" $W/host_abi "$A" "$B" > $W/abi_on.txt
STREAMALLOC_CONF=trace_capacity:0 taskset -c "$PIN" $W/host_abi "$A" "$B" > $W/abi_off.txt
taskset -c "$PIN" $W/host_abi > $W/primitives_after.txt
tar czf "$OUT/host_ab.tgz" -C $W --exclude pb.so --exclude host_abi .
python3 - "$W" "$A" "$B" <<'PY'
import glob, json, statistics, sys
w, a, b = sys.argv[1:4]
def loop(name):
    runs = []
    for f in sorted(glob.glob(f"{w}/micro_{name}_*.json")):
        r = json.load(open(f))
        if "error" in r or "ns_per_op" not in r:
            sys.exit(f"{f}: {r.get('error', r)}")
        runs.append(r["ns_per_op"])
    return runs
print("primitives before:", open(f"{w}/primitives_before.txt").read().strip())
floor = loop("floor")
print(f"A = {a}\nB = {b}")
print("| Python loop, ns/op | best | median | best over the floor's best | all |")
print("| --- | --- | --- | --- | --- |")
for name, label in [("floor", "hook floor"), ("A", "A"), ("B", "B")]:
    v = loop(name)
    over = f"{(min(v) / min(floor) - 1) * 100:+.1f}%" if name != "floor" else ""
    print(f"| {label} | {min(v):.1f} | {statistics.median(v):.1f} | {over} | {[round(x) for x in v]} |")
print("C ABI, ring on: ", open(f"{w}/abi_on.txt").read().strip())
print("C ABI, ring off:", open(f"{w}/abi_off.txt").read().strip())
print("primitives after:", open(f"{w}/primitives_after.txt").read().strip())
PY
