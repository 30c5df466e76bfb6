#!/usr/bin/env bash
# Host costs alone on the machine (nothing else running): the host's speed (primitives),
# the Python loop interleaved native / hook floor / streamalloc four times (each the best
# of five passes), host_cost.py with the ring on, off and with expandable segments, the C
# ABI without PyTorch (host_abi.cpp), and the primitives again.
set -u
OUT=${1:?output directory}; W=/tmp/host; mkdir -p $W; B=$(cd "$(dirname "$0")" && pwd)
export STREAMALLOC_LIB=${STREAMALLOC_LIB:?path of libstreamalloc.so} CUDA_VISIBLE_DEVICES=0
nvcc -shared -Xcompiler -fPIC -o $W/pb.so $B/pluggable_bump.c -lcudart > $W/nvcc.log 2>&1
g++ -O2 -o $W/host_abi $B/host_abi.cpp -ldl -lpthread
$W/host_abi > $W/primitives_before.txt
for i in 1 2 3 4; do
  for a in native "so:$W/pb.so:pb_malloc:pb_free" streamalloc; do
    n=${a%%:*}; [ "$n" = so ] && n=floor
    python3 $B/alloc_bench.py $a micro $W/micro_${n}_$i.json > /dev/null 2>&1
  done
done
python3 $B/host_cost.py $STREAMALLOC_LIB $W/hc_on.json > /dev/null 2>&1
STREAMALLOC_CONF=trace_capacity:0 python3 $B/host_cost.py $STREAMALLOC_LIB $W/hc_off.json > /dev/null 2>&1
STREAMALLOC_CONF=expandable_segments:true python3 $B/host_cost.py $STREAMALLOC_LIB $W/hc_exp.json > /dev/null 2>&1
$W/host_abi $STREAMALLOC_LIB > $W/abi_on.txt
STREAMALLOC_CONF=trace_capacity:0 $W/host_abi $STREAMALLOC_LIB > $W/abi_off.txt
$W/host_abi > $W/primitives_after.txt
tar czf $OUT/host.tgz -C $W --exclude pb.so --exclude host_abi .
python3 - $W <<'PY'
import json, sys, glob
w = sys.argv[1]
print("primitives before:", open(f"{w}/primitives_before.txt").read().strip())
for n in ["native", "floor", "streamalloc"]:
    v = [json.load(open(f))["ns_per_op"] for f in sorted(glob.glob(f"{w}/micro_{n}_*.json"))]
    print(f"micro {n:12s} best {min(v):7.1f}  all {[round(x) for x in v]}")
for f in ["hc_on", "hc_off", "hc_exp"]:
    print(f, open(f"{w}/{f}.json").read())
print("C ABI, ring on: ", open(f"{w}/abi_on.txt").read().strip())
print("C ABI, ring off:", open(f"{w}/abi_off.txt").read().strip())
print("primitives after:", open(f"{w}/primitives_after.txt").read().strip())
PY
