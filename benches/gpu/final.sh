#!/usr/bin/env bash
# The goal table of run.sh (default configuration), then GPT-2, ResNet-50 (10 steps, with
# per-step times and allocator churn), the Python loop and host_cost.py with expandable
# segments. Logs and JSON land in one tarball OUT/final.tgz; the summary is printed last.
# EXPANDABLE_ONLY=1 skips run.sh's table (about half the time) for a quick check.
set -u
OUT=${1:?output directory}; W=/tmp/final; mkdir -p $W/exp
export STREAMALLOC_LIB=${STREAMALLOC_LIB:?path of libstreamalloc.so} STREAMALLOC_GPU_TEST=${STREAMALLOC_GPU_TEST:?path of streamalloc-gpu-test}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
if [ "${EXPANDABLE_ONLY:-0}" = 1 ]; then echo "(run.sh skipped: EXPANDABLE_ONLY=1)" > $W/default.txt
else STEP_TIMEOUT=120 bash "$(dirname "$0")/run.sh" $W/default > $W/default.txt 2>&1; fi
B=$(cd "$(dirname "$0")" && pwd); E=expandable_segments:true
run() { local n=$1 g=$2; shift 2; CUDA_VISIBLE_DEVICES=$g timeout 200 "$@" > $W/exp/$n.log 2>&1; echo "== $n rc=$?"; }
( run gpt2 0 env STEPS=10 STREAMALLOC_CONF=$E python3 $B/alloc_bench.py streamalloc gpt2 $W/exp/gpt2.json
  run gpt2_native 0 env STEPS=10 python3 $B/alloc_bench.py native gpt2 $W/exp/gpt2_native.json
  run micro 0 env STREAMALLOC_CONF=$E python3 $B/alloc_bench.py streamalloc micro $W/exp/micro.json ) &
( run resnet 1 env STEPS=10 STREAMALLOC_CONF=$E python3 $B/alloc_bench.py streamalloc resnet $W/exp/resnet.json
  run resnet_native 1 env STEPS=10 python3 $B/alloc_bench.py native resnet $W/exp/resnet_native.json
  run host_cost 1 env STREAMALLOC_CONF=$E python3 $B/host_cost.py $STREAMALLOC_LIB $W/exp/host_cost.json ) &
wait
tar czf $OUT/final.tgz -C $W .
tail -42 $W/default.txt
echo; echo "### expandable_segments:true (10 steps, median of steps 2-9; native in the same call)"
python3 - $W/exp <<'PY'
import json, sys
o = sys.argv[1]
for n in ["gpt2_native", "gpt2", "resnet_native", "resnet", "micro", "host_cost"]:
    try: r = json.load(open(f"{o}/{n}.json"))
    except Exception as e: print(n, "missing", e); continue
    if "step_ms" in r: print(f"{n:14s} step {r['step_ms']:.1f} ms  reserved/alloc {r['peak_reserved_mib']/r['peak_allocated_mib']:.3f} ({r['peak_reserved_mib']:.0f}/{r['peak_allocated_mib']:.0f})  losses {[round(x, 4) for x in r['losses'][-3:]]} {r.get('per_timed_step', '')} {r.get('error', '')}"); print("   steps ms", r.get("steps_ms"), "syncs/mapped MiB", r.get("steps_syncs_mapped_mib", ""))
    elif "ns_per_op" in r: print(n, round(r["ns_per_op"], 1), r.get("error", ""))
    else: print(n, json.dumps(r))
PY
