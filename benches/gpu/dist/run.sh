#!/usr/bin/env bash
# Distributed training on N GPUs of one host under PyTorch's allocator, PyTorch's
# expandable segments and streamalloc's default: peak reserved / peak allocated (worst
# rank), median step time, losses against PyTorch's, and streamalloc's page mapping work
# once warm. Rows: FSDP2 GPT-2 small (varying length), FSDP2 with activation checkpointing
# on a Llama-style model, DDP GPT-2 small, a tensor-parallel MLP with all_reduce. Each
# (row, allocator) is one torchrun launch with a timeout; the table is printed last and
# saved as OUT/table.md, per-rank JSON in OUT/results, logs in OUT/logs.
# About 7-8 minutes on 4 GPUs (the native door is built first, once, if not cached).
#   benches/gpu/dist/run.sh OUT [NGPU] [--dry-run]
# NGPU: ranks per launch (default: every GPU nvidia-smi lists). Needs PyTorch, transformers
# and streamalloc importable by DIST_PYTHON (python3), e.g. the wheel installed with
# `python3 -m pip install --no-index --no-deps streamalloc-*.whl`.
# Knobs: DIST_ROWS (fsdp2_gpt2,fsdp2_ckpt,ddp_gpt2,tp_allreduce), DIST_COLUMNS
# (pt,pt_expandable,sa), DIST_STEPS (timed steps; 12, tp_allreduce 30), DIST_WARMUP (3),
# DIST_TIMEOUT (s per launch, 150), TOTAL_S (no launch starts after it, 480),
# STREAMALLOC_CACHE (where the native door is built and found; ~/.cache/streamalloc).
set -u
OUT=${1:?usage: run.sh OUT [NGPU] [--dry-run]}
shift
NGPU=
if [ $# -gt 0 ] && [ "${1#--}" = "$1" ]; then NGPU=$1; shift; fi
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
PY=${DIST_PYTHON:-python3}
export DIST_PYTHON=$PY
if [ -z "$NGPU" ]; then
  NGPU=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ')
  [ "$NGPU" -gt 0 ] 2>/dev/null || { echo "run.sh: nvidia-smi lists no GPU; give NGPU" >&2; exit 2; }
fi
case $NGPU in ''|*[!0-9]*|0) echo "run.sh: NGPU must be a positive integer, not '$NGPU'" >&2; exit 2;; esac
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
export STREAMALLOC_CACHE=${STREAMALLOC_CACHE:-$HOME/.cache/streamalloc}
# bench.py sets these per column; anything inherited would change what a column measures.
unset STREAMALLOC_CONF PYTORCH_CUDA_ALLOC_CONF PYTORCH_NO_CUDA_MEMORY_CACHING STREAMALLOC_DOOR
export DIST_COMMAND="benches/gpu/dist/run.sh $OUT $NGPU${*:+ $*}"
for arg in "$@"; do
  if [ "$arg" = --dry-run ]; then exec "$PY" "$HERE/bench.py" "$OUT" --ngpu "$NGPU" "$@"; fi
done
mkdir -p "$OUT"
{
  "$PY" -c 'import torch, sys; print("torch", torch.__version__, "cuda", torch.version.cuda, "nccl", ".".join(map(str, torch.cuda.nccl.version())), "python", sys.version.split()[0])' 2>&1
  "$PY" -c 'import transformers; print("transformers", transformers.__version__)' 2>&1
  "$PY" -c 'import streamalloc._lib as l; print("streamalloc", l.library_path())' 2>&1
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1
} | tee "$OUT/env.txt"
"$PY" "$HERE/bench.py" "$OUT" --ngpu "$NGPU" "$@" 2>&1 | tee "$OUT/driver.log"
exit "${PIPESTATUS[0]}"
