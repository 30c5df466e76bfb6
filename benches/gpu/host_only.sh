#!/usr/bin/env bash
# Host costs alone on the machine (nothing else running), in under 4 minutes on one GPU:
#   1. the host's speed (primitives: rdtsc, the kernel's coarse and precise clocks, an
#      atomic read-modify-write, a mutex), before and after, since the GPU hosts drift;
#   2. the C ABI without PyTorch (host_abi.cpp): pairs of 4 KiB / 1 MiB / 64 MiB and mixed
#      sizes, with the default configuration, with the trace ring's precise clock, and with
#      the ring off (what the ring and its clock cost);
#   3. host_cost.py: the same loops in C++ inside PyTorch, next to PyTorch's allocator;
#   4. the Python alloc/free loop (alloc_bench.py micro), PyTorch's allocator and
#      streamalloc alternating, three processes each (the best pass of each counts);
# then one table of the four acceptance figures against their targets.
#   benches/gpu/host_only.sh OUT            # STREAMALLOC_LIB: the library (default: the one
#                                           # streamalloc's Python package finds)
#   benches/gpu/host_only.sh --dry-run OUT  # no GPU: primitives, then the table's logic
set -u
DRY=0
[ "${1:-}" = "--dry-run" ] && { DRY=1; shift; }
OUT=${1:?usage: host_only.sh [--dry-run] OUT}
B=$(cd "$(dirname "$0")" && pwd); ROOT=$(cd "$B/../.." && pwd)
mkdir -p "$OUT"; W=$(mktemp -d); trap 'rm -rf "$W"' EXIT
export PYTHONPATH="$ROOT/python${PYTHONPATH:+:$PYTHONPATH}" CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0}
start=$(date +%s)
say() { echo "[$(( $(date +%s) - start )) s] $*" >&2; }
g++ -O2 -o "$W/host_abi" "$B/host_abi.cpp" -ldl -lpthread || { echo "host_only.sh: g++ failed" >&2; exit 1; }
say "primitives"
"$W/host_abi" > "$OUT/primitives_before.txt"
if [ $DRY = 0 ]; then
  if [ -z "${STREAMALLOC_LIB:-}" ]; then
    STREAMALLOC_LIB=$(python3 -c "from streamalloc import _lib; print(_lib.library_path())") ||
      { echo "host_only.sh: no libstreamalloc.so found; set STREAMALLOC_LIB" >&2; exit 1; }
  fi
  export STREAMALLOC_LIB
  # Both compilations first, side by side, so that none runs while something is timed.
  say "building the door and host_cost.py's loops (cached after the first run)"
  python3 -m streamalloc._door build > "$OUT/door_build.log" 2>&1 &
  python3 "$B/host_cost.py" --build-only > "$OUT/host_cost_build.log" 2>&1 &
  wait
  say "C ABI without PyTorch ($STREAMALLOC_LIB)"
  "$W/host_abi" "$STREAMALLOC_LIB" > "$OUT/abi_default.txt"
  STREAMALLOC_CONF=trace_clock:precise "$W/host_abi" "$STREAMALLOC_LIB" > "$OUT/abi_precise_clock.txt"
  STREAMALLOC_CONF=trace_capacity:0 "$W/host_abi" "$STREAMALLOC_LIB" > "$OUT/abi_ring_off.txt"
  say "host_cost.py (C++ loops inside PyTorch)"
  python3 "$B/host_cost.py" "$STREAMALLOC_LIB" "$OUT/host_cost.json" > /dev/null 2> "$OUT/host_cost.log" ||
    { tail -5 "$OUT/host_cost.log" >&2; echo "host_only.sh: host_cost.py failed" >&2; }
  say "the Python loop, three rounds"
  for i in 1 2 3; do
    for a in native streamalloc; do
      python3 "$B/alloc_bench.py" $a micro "$OUT/loop_${a}_$i.json" > /dev/null 2>> "$OUT/loop.log" ||
        echo "host_only.sh: the $a loop failed (see $OUT/loop.log)" >&2
    done
  done
fi
"$W/host_abi" > "$OUT/primitives_after.txt"
say "done"
python3 "$B/host_table.py" "$OUT"
