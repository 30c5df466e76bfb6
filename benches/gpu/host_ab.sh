#!/usr/bin/env bash
# Builds (or settings) of libstreamalloc.so side by side on the host paths, in one call:
# PyTorch's Python alloc/free loop (alloc_bench.py micro) with the hook floor and every
# build alternating pass by pass in one process (loop_ab.py, LOOP_PROCS processes), then
# the same loop one process per allocator, interleaved floor / each variant, ROUNDS times
# (each process the best of five passes), then the C ABI without PyTorch (host_abi.cpp,
# every build in one process) with the trace ring on and off, and the host's primitives
# before and after. The GPU host's speed drifts between calls and within them (a process
# ran at ~1.3 us/op, then at ~2.5, pinned), so builds are compared only within one call,
# and the in-process comparison is the one to read.
# Every process runs on one CPU (PIN, default 4).
#   benches/gpu/host_ab.sh OUTDIR NAME=LIB[@CONF] ...
# CONF is a STREAMALLOC_CONF string for that variant, e.g. old=a.so new=b.so
# new_untraced=b.so@trace_capacity:0.
set -u
OUT=${1:?output directory}; shift
[ $# -ge 1 ] || { echo "usage: $0 OUTDIR NAME=LIB[@CONF] ..." >&2; exit 2; }
ROUNDS=${ROUNDS:-4}; PIN=${PIN:-4}  # ROUNDS=0: the in-process runs and the C ABI only
W=/tmp/host_ab; rm -rf "$W"; mkdir -p "$W" "$OUT"; D=$(cd "$(dirname "$0")" && pwd)
export CUDA_VISIBLE_DEVICES=0 PYTHONUNBUFFERED=1
names=(); libs=(); confs=()
for spec in "$@"; do
  name=${spec%%=*}; rest=${spec#*=}
  case "$name" in ""|*[!A-Za-z0-9_]*|floor) echo "bad variant name in '$spec'" >&2; exit 2;; esac
  lib=${rest%%@*}; conf=""; [ "$rest" != "$lib" ] && conf=${rest#*@}
  [ -f "$lib" ] || { echo "$name: no file $lib" >&2; exit 2; }
  names+=("$name"); libs+=("$lib"); confs+=("$conf")
done
nvcc -shared -Xcompiler -fPIC -o $W/pb.so $D/pluggable_bump.c -lcudart > $W/nvcc.log 2>&1 || { cat $W/nvcc.log; exit 1; }
g++ -O2 -o $W/host_abi $D/host_abi.cpp -ldl -lpthread || exit 1
taskset -c "$PIN" $W/host_abi > $W/primitives_before.txt
# First the loop with the floor and every build in one process, alternating pass by pass
# (loop_ab.py: the comparison the host's drifting speed leaves intact), LOOP_PROCS times.
nvcc -shared -Xcompiler -fPIC -o $W/ps.so $D/pluggable_switch.c -lcudart -ldl > $W/nvcc.log 2>&1 || { cat $W/nvcc.log; exit 1; }
for p in $(seq "${LOOP_PROCS:-3}"); do
  timeout 300 taskset -c "$PIN" python3 $D/loop_ab.py $W/ps.so $W/loop_ab_$p.json "$@" \
    > $W/loop_ab_$p.txt 2>&1 || echo "loop_ab process $p failed: $(tail -c 300 $W/loop_ab_$p.txt)"
done
# Each process is bounded, and its line printed as it ends, so a stuck run shows.
micro() {  # NAME ALLOC [LIB [CONF]]
  STREAMALLOC_LIB=${3:-} STREAMALLOC_CONF=${4:-} timeout 120 taskset -c "$PIN" \
    python3 $D/alloc_bench.py "$2" micro $W/micro_$1_$i.json > $W/micro_$1_$i.log 2>&1 \
    || echo "micro $1 round $i failed: $(tail -c 300 $W/micro_$1_$i.log)"
  echo "round $i $1: $(head -c 120 $W/micro_$1_$i.json 2>/dev/null)"
}
for i in $(seq "$ROUNDS"); do
  micro floor "so:$W/pb.so:pb_malloc:pb_free"
  for v in "${!names[@]}"; do micro "${names[$v]}" streamalloc "${libs[$v]}" "${confs[$v]}"; done
done
uniq_libs=$(printf '%s\n' "${libs[@]}" | awk '!seen[$0]++')
# shellcheck disable=SC2086 # one argument per build
taskset -c "$PIN" $W/host_abi $uniq_libs > $W/abi_on.txt
# shellcheck disable=SC2086
STREAMALLOC_CONF=trace_capacity:0 taskset -c "$PIN" $W/host_abi $uniq_libs > $W/abi_off.txt
taskset -c "$PIN" $W/host_abi > $W/primitives_after.txt
tar czf "$OUT/host_ab.tgz" -C $W --exclude pb.so --exclude ps.so --exclude host_abi .
python3 - "$W" "$@" <<'PY'
import glob, json, re, statistics, sys
w, specs = sys.argv[1], sys.argv[2:]
def loop(name):
    runs = []
    for f in sorted(glob.glob(f"{w}/micro_{name}_*.json")):
        if not re.fullmatch(rf"micro_{name}_\d+\.json", f.rsplit("/", 1)[1]):
            continue
        r = json.load(open(f))
        if "error" in r or "ns_per_op" not in r:
            print(f"{f}: {r.get('error', r)}")
            continue
        runs.append(r["ns_per_op"])
    return runs
print("primitives before:", open(f"{w}/primitives_before.txt").read().strip())
for spec in specs:
    print(spec)
floor = loop("floor")
# ROUNDS=0 runs no per-process rounds: then there is no such table to print.
if glob.glob(f"{w}/micro_*.log"):
    print("| Python loop, ns/op | best | median | best over the floor's best | all |")
    print("| --- | --- | --- | --- | --- |")
    for name in ["floor"] + [s.split("=", 1)[0] for s in specs]:
        v = loop(name)
        if not v:
            print(f"| {name} | failed | | | |")
            continue
        over = f"{(min(v) / min(floor) - 1) * 100:+.1f}%" if name != "floor" and floor else ""
        print(f"| {name} | {min(v):.1f} | {statistics.median(v):.1f} | {over} | {[round(x) for x in v]} |")
for f in sorted(glob.glob(f"{w}/loop_ab_*.txt")):
    print(f"In one process ({f.rsplit('/', 1)[1]}):")
    print(open(f).read().strip())
print("C ABI, ring on: ", open(f"{w}/abi_on.txt").read().strip())
print("C ABI, ring off:", open(f"{w}/abi_off.txt").read().strip())
print("primitives after:", open(f"{w}/primitives_after.txt").read().strip())
PY
