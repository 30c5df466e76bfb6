#!/usr/bin/env bash
# GPU acceptance of streamalloc.p2p, one command on a host with 4 GPUs (about 5 minutes):
#   0. the native P2POp reader and the copy kernel built ahead (cached: later runs skip it);
#      the pure checks (drop-in unit checks, the copy kernel on the CPU);
#   1. hang_dropin.py on 4 GPUs: the multi_tensor_hang reproduction with
#      `from streamalloc.p2p import batch_isend_irecv` (random and sorted order, T x1, x100,
#      x1000) beside an Exchange over the same lists; errors agreed on every rank;
#   2. bench.py 4: the pattern at ~58,000 ops per rank (drop-in, Exchange over the copy
#      engine and NCCL, merged buffers);
#   3. bench.py 2 (GPUs 0 and 1): ~85 parameter-shaped tensors over the copy engine;
#   4. queued_check.py on GPUs 0 and 1: an exchange agreed behind queued work does not wait
#      for it on the host;
#   5. the acceptance table, printed last (accept_table.py).
# Usage: benches/gpu/p2p/accept.sh [OUT_DIR]   (python3 with torch and streamalloc installed,
# or PYTHONPATH=python with STREAMALLOC_LIB set). Exits non-zero if any check fails.
set -u
OUT=${1:-p2p_accept_out}
HERE=$(cd "$(dirname "$0")" && pwd)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
rm -rf "$OUT/bench4" "$OUT/bench2" "$OUT/hang_dropin.json"
mkdir -p "$OUT"
rc=0
start=$(date +%s)
python3 -c "import streamalloc.p2p, torch; print('streamalloc', streamalloc.__version__, 'torch', torch.__version__)" || exit 1
echo "== building the native P2POp reader and the copy kernel (cached after the first run)"
python3 -m streamalloc._p2p_native build || rc=1
python3 "$HERE/dropin_unit_check.py" || rc=1
python3 "$HERE/copy_kernel_check.py" || rc=1
echo "== hang_dropin.py on 4 GPUs"
timeout 240 python3 -m torch.distributed.run --standalone --nproc-per-node=4 \
  "$HERE/hang_dropin.py" --json "$OUT/hang_dropin.json" > "$OUT/hang_dropin.log" 2>&1 || rc=1
if grep -q "^hang_dropin:" "$OUT/hang_dropin.log"; then
  sed -n '/^multi_tensor_hang pattern/,$p' "$OUT/hang_dropin.log" | grep -v "^\[\|^W1\|^I1"
else
  echo "hang_dropin.py did not finish; the end of $OUT/hang_dropin.log:"
  tail -30 "$OUT/hang_dropin.log"
  rc=1
fi
echo "== bench.py 4 (the pattern)"
python3 "$HERE/bench.py" 4 --out "$OUT/bench4" --only dropin,exchange_ce,exchange_nccl,merged || rc=1
echo "== bench.py 2 (parameter-shaped tensors, GPUs 0 and 1)"
CUDA_VISIBLE_DEVICES=${P2P_PAIR:-0,1} python3 "$HERE/bench.py" 2 --out "$OUT/bench2" \
  --only params_exchange_ce,params_exchange_nccl,params_merged || rc=1
echo "== queued_check.py (GPUs 0 and 1): no host wait for the caller's queued work"
CUDA_VISIBLE_DEVICES=${P2P_PAIR:-0,1} timeout 120 python3 -m torch.distributed.run --standalone \
  --nproc-per-node=2 "$HERE/queued_check.py" > "$OUT/queued_check.log" 2>&1 || rc=1
grep -E "^(pass|queued_check)" "$OUT/queued_check.log"
echo "(acceptance run: $(( $(date +%s) - start )) s)"
python3 "$HERE/accept_table.py" "$OUT" || rc=1
exit $rc
