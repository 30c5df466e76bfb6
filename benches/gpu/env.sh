# Sourced by the one-GPU table scripts (torch_door/run.sh, fragmentation/run.sh): checks
# STREAMALLOC_LIB, makes the repository's python/ importable, pins GPU 0 and keeps NVLink
# multicast off. Expects ROOT (the repository) to be set.
export STREAMALLOC_LIB=${STREAMALLOC_LIB:?path of libstreamalloc.so}
[ -f "$STREAMALLOC_LIB" ] || { echo "run.sh: STREAMALLOC_LIB=$STREAMALLOC_LIB is not a file" >&2; exit 2; }
export PYTHONPATH="$ROOT/python${PYTHONPATH:+:$PYTHONPATH}"
export CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0} PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
