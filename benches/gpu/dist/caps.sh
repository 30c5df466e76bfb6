#!/usr/bin/env bash
# Memory under pressure, on one host: the lowest memory cap at which PyTorch's expandable
# segments and streamalloc's default each still train, and their uncapped step times
# (alternating launches), in one table (caps.py's doc says how).
#   benches/gpu/dist/caps.sh OUT dist [NGPU]     # FSDP2 GPT-2, FSDP2 + checkpointing, DDP
#   benches/gpu/dist/caps.sh OUT single [GPUS]   # GPT-2 varying length, generation; GPUS 0,1
# About 7-8 minutes for the FSDP2 rows on 4 GPUs, 3-4 for DDP alone (CAPS_ROWS=ddp_gpt2),
# 3 for the single phase. Needs PyTorch, transformers and streamalloc importable by python3.
# DIST_CAP_MODE=device caps by holding the device's other memory (as another process would)
# instead of setting a memory fraction: the allocator then learns of the cap only from the
# driver's refusals.
set -u
OUT=${1:?usage: caps.sh OUT dist|single [NGPU|GPUS]}
PHASE=${2:?usage: caps.sh OUT dist|single [NGPU|GPUS]}
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
export STREAMALLOC_CACHE=${STREAMALLOC_CACHE:-$HOME/.cache/streamalloc}
unset STREAMALLOC_CONF PYTORCH_CUDA_ALLOC_CONF PYTORCH_NO_CUDA_MEMORY_CACHING STREAMALLOC_DOOR
export CAPS_COMMAND="benches/gpu/dist/caps.sh $*"
mkdir -p "$OUT/results"
# The native door is compiled at first use: once here, so that no launch pays for it.
CUDA_VISIBLE_DEVICES=0 timeout 300 python3 "$HERE/workloads.py" --door "$OUT/results/door.json" >"$OUT/door.log" 2>&1 \
  || { echo "caps.sh: building the native door failed:"; tail -5 "$OUT/door.log"; }
case $PHASE in
  dist) exec python3 "$HERE/caps.py" "$OUT" --phase dist ${3:+--ngpu "$3"} ;;
  single) exec python3 "$HERE/caps.py" "$OUT" --phase single ${3:+--gpus "$3"} ;;
  *) echo "caps.sh: phase must be dist or single, not '$PHASE'" >&2; exit 2 ;;
esac
