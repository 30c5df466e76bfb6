#!/usr/bin/env bash
# GPU acceptance of streamalloc.p2p on N GPUs of one host (default 4):
#   1. hang_dropin.py: the multi_tensor_hang reproduction with
#      `from streamalloc.p2p import batch_isend_irecv` (random and sorted order, T x1, x100,
#      x1000): completes, every value checked, staging within the budget; mismatched and
#      invalid lists raise the same P2PError on every rank; empty lists work;
#   2. bench.py N: every method side by side (one table, printed last).
# Usage: benches/gpu/p2p/accept.sh [N] [OUT_DIR]   (python3 with torch and streamalloc
# installed; about 4-5 minutes at N=4). Exits non-zero if any check fails.
set -u
N=${1:-4}
OUT=${2:-p2p_accept_out}
HERE=$(cd "$(dirname "$0")" && pwd)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
mkdir -p "$OUT"
rc=0
python3 -c "import streamalloc.p2p, torch; print('streamalloc', streamalloc.__version__, 'torch', torch.__version__)" || exit 1
PYTHONPATH="$HERE/../../../python:${PYTHONPATH:-}" python3 "$HERE/dropin_unit_check.py" || rc=1
echo "== hang_dropin.py on $N GPUs"
timeout 150 python3 -m torch.distributed.run --standalone --nproc-per-node="$N" \
  "$HERE/hang_dropin.py" --json "$OUT/hang_dropin.json" > "$OUT/hang_dropin.log" 2>&1 || rc=1
# The table and verdict (rank 0), or the log's end when it did not get that far.
if grep -q "^hang_dropin:" "$OUT/hang_dropin.log"; then
  sed -n '/^multi_tensor_hang pattern/,$p' "$OUT/hang_dropin.log" | grep -v "^\[\|^W1\|^I1"
else
  echo "hang_dropin.py did not finish; the end of $OUT/hang_dropin.log:"
  tail -30 "$OUT/hang_dropin.log"
  rc=1
fi
echo "== bench.py $N"
python3 "$HERE/bench.py" "$N" --out "$OUT" || rc=1
exit $rc
