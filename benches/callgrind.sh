#!/usr/bin/env bash
# Instructions per operation on the host fast path, counted by callgrind: repeatable where
# timings on a shared machine are not. Runs each workload of benches/host_path.rs (default:
# the main ones) under `valgrind --tool=callgrind`, collecting only inside its measured
# loop, and prints the instructions per operation split by component
# (benches/callgrind_split.py says how an instruction is assigned to one).
#   benches/callgrind.sh [WORKLOAD ...]     # e.g. abi_pair door_loop
# Needs valgrind, addr2line (binutils) and python3. Counts are of the simulated
# device: the CUDA backend differs only in its clock (one rdtsc where the simulator loads
# its virtual time), which callgrind counts as one instruction whatever it costs.
set -euo pipefail
cd "$(dirname "$0")/.."
command -v valgrind >/dev/null || { echo "callgrind.sh: valgrind is not installed" >&2; exit 1; }
bin=$(cargo bench --bench host_path --no-run --message-format=json 2>/dev/null |
  python3 -c 'import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m["target"]["name"] == "host_path" and m.get("executable"):
        print(m["executable"])')
[ -x "$bin" ] || { echo "callgrind.sh: building benches/host_path.rs failed" >&2; exit 1; }
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
workloads=("$@")
[ ${#workloads[@]} -gt 0 ] || workloads=(abi_pair abi_pair_ring_off abi_mixed door_pair door_loop engine_pair engine_pair_ring_off)
args=()
for w in "${workloads[@]}"; do
  echo "callgrind: $w" >&2
  # The workload prints its operation count; callgrind, the instructions of the loop.
  valgrind --tool=callgrind --dump-instr=yes --callgrind-out-file="$out/$w.cg" \
    --collect-atstart=no --toggle-collect='host_path::measured' "$bin" "$w" >"$out/$w.txt" 2>"$out/$w.log" ||
    { cat "$out/$w.log" >&2; exit 1; }
  args+=("$out/$w.cg" "$(awk -v w="$w" '$1 == w { print $2 }' "$out/$w.txt")")
done
python3 benches/callgrind_split.py "$bin" "${args[@]}"
