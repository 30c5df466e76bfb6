#!/usr/bin/env bash
# Peak reserved / peak allocated, step time (or tokens/s) and losses on ONE GPU for four
# allocators: PyTorch's, PyTorch's with expandable_segments:True, streamalloc's default
# configuration, and streamalloc with expandable_segments:false (FRAG_COLUMNS can add
# streamalloc with reclaim:false, or run fewer). Workloads: GPT-2 small
# training at a fixed and at a varying sequence length, ResNet-50 training, and GPT-2 small
# bf16 generation with growing KV caches over a stream of requests of varying shapes (models
# built from configs, random weights: no network). Each (workload, allocator) runs in its
# own process with a timeout, the columns of a workload back to back; the table is printed
# last and saved as OUT/table.md, logs and JSON go to OUT/logs and OUT/results.
# About 6-7 minutes on one H200 (the first streamalloc install builds the native door).
#   STREAMALLOC_LIB=.../libstreamalloc.so benches/gpu/fragmentation/run.sh OUT
# Knobs: TOTAL_S (no run starts after it, 450), FRAG_ROWS (gpt2,gpt2_varlen,resnet,infer),
# FRAG_ROUNDS (1: each row's columns once; more rotate the order and report median speed),
# FRAG_COLUMNS (pt_expandable,sa_default,sa_whole; sa_noreclaim: streamalloc reclaim:false),
# WARMUP (2), STEPS_GPT2 (20), STEPS_VARLEN (40), STEPS_RESNET (30), REQUESTS (24),
# FRAG_PYTHON (the Python with torch; python3).
set -u
OUT=${1:?usage: run.sh OUT}
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(cd "$HERE/../../.." && pwd)
mkdir -p "$OUT"
. "$ROOT/benches/gpu/env.sh"
# No network: transformers must not look for anything online.
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
# The driver sets these per column; anything inherited would change what a column measures.
unset STREAMALLOC_CONF PYTORCH_CUDA_ALLOC_CONF PYTORCH_NO_CUDA_MEMORY_CACHING STREAMALLOC_DOOR
PY=${FRAG_PYTHON:-python3}
export FRAG_PYTHON=$PY
{
  echo "streamalloc: $STREAMALLOC_LIB"
  "$PY" -c 'import torch, sys; print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(0), "python", sys.version.split()[0])' 2>&1
  "$PY" -c 'import transformers, torchvision; print("transformers", transformers.__version__, "torchvision", torchvision.__version__)' 2>&1
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1
} | tee "$OUT/env.txt"
"$PY" "$HERE/driver.py" "$OUT" 2>&1 | tee "$OUT/driver.log"
exit "${PIPESTATUS[0]}"
