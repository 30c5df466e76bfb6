#!/usr/bin/env bash
# CUDA IPC of any tensor on ONE GPU under streamalloc's default configuration (expandable
# segments, stitching): the parent (the native door) sends int32 CUDA tensors of 1 KiB, 3 MiB
# (expandable) and 40 MiB (stitched from free pages of two holes) through a
# torch.multiprocessing Queue to a child that adds 1 in place; the parent checks every
# element. Children: the native door and PyTorch's own allocator (which opens streamalloc's
# handles written in PyTorch's 'e' format), each started by spawn and by forkserver. About
# a minute.
#   STREAMALLOC_LIB=.../libstreamalloc.so benches/gpu/ipc/run.sh [OUT]
# Needs Linux >= 5.6 (pidfd_getfd) and ptrace access from the child to the parent (the
# script allows it under Yama ptrace_scope 1; a container's seccomp profile may still deny
# pidfd_getfd, which the table then reports).
set -u
OUT=${1:-}
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(cd "$HERE/../../.." && pwd)
export STREAMALLOC_LIB=${STREAMALLOC_LIB:?path of libstreamalloc.so}
[ -f "$STREAMALLOC_LIB" ] || { echo "run.sh: STREAMALLOC_LIB=$STREAMALLOC_LIB is not a file" >&2; exit 2; }
export PYTHONPATH="$ROOT/python${PYTHONPATH:+:$PYTHONPATH}"
export CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0} PYTHONUNBUFFERED=1
unset PYTORCH_CUDA_ALLOC_CONF PYTORCH_NO_CUDA_MEMORY_CACHING STREAMALLOC_CONF
echo "kernel $(uname -r); $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>&1 | head -1)"
exec timeout 600 python3 "$HERE/ipc_check.py" ${OUT:+"$OUT"}
