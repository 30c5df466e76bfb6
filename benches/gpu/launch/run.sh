#!/usr/bin/env bash
# streamalloc as a user gets it, on a GPU machine (2 GPUs for the torchrun part):
#   (a) `streamalloc run -- python3 gpt2_train.py`: GPT-2 small, 4 steps, unmodified;
#   (b) `streamalloc run -- torchrun --nproc_per_node=2 pp_isend.py`: every rank;
#   (c) a CUDA C program built here with `nvcc -cudart shared`, under
#       LD_PRELOAD=libstreamalloc_preload.so (and under `streamalloc run --preload`).
# Each part is also run without streamalloc, for comparison. Proof that streamalloc
# served a process comes from that process itself: its exit line
# (`streamalloc: exit pid=.. rank=.. allocs=..`, printed by the library at exit with
# --stats), its snapshot file, and for (c) the library's own counters read by the program.
#
#   bash run.sh DIR [WORKDIR]
# DIR holds what stage.sh copies: streamalloc, libstreamalloc.so,
# libstreamalloc_preload.so, python/streamalloc/, and these scripts. No Rust needed here.
# Needs: python3 with PyTorch (transformers optional), torchrun, nvcc, 2 GPUs for (b).
# Prints a table last; exits non-zero if any check failed.
set -uo pipefail

if [ $# -lt 1 ] || [ ! -d "$1" ]; then
    echo "usage: $0 DIR [WORKDIR]   (DIR: the folder stage.sh filled)" >&2
    exit 2
fi
DIR=$(cd "$1" && pwd)
W=${2:-$(mktemp -d /tmp/streamalloc-launch.XXXXXX)}
mkdir -p "$W"
W=$(cd "$W" && pwd)
SA="$DIR/streamalloc"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# The launcher finds its library and Python package next to itself.
unset STREAMALLOC_LIB STREAMALLOC_PYTHON STREAMALLOC_CONF STREAMALLOC_SNAPSHOT STREAMALLOC_STATS_AT_EXIT
# torchrun's default is one OpenMP thread per worker anyway; say it to silence its warning.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}

for f in streamalloc libstreamalloc.so libstreamalloc_preload.so python/streamalloc/_boot/sitecustomize.py summary.py \
         gpt2_train.py pp_isend.py preload_test.cu; do
    [ -e "$DIR/$f" ] || { echo "missing $DIR/$f (run stage.sh)" >&2; exit 2; }
done

if [ ! -x "$SA" ]; then
    # A copy that lost its mode bits: run a copy, and tell it where its files are.
    cp "$SA" "$W/streamalloc" && chmod +x "$W/streamalloc" && SA="$W/streamalloc"
    export STREAMALLOC_LIB="$DIR/libstreamalloc.so" STREAMALLOC_PYTHON="$DIR/python" \
           STREAMALLOC_PRELOAD_LIB="$DIR/libstreamalloc_preload.so"
fi

step() { echo; echo "=== $* ==="; }
# run_logged NAME CMD...: stdout -> $W/NAME.out, stderr -> $W/NAME.err (both echoed), rc -> $W/NAME.rc
run_logged() {
    local name=$1; shift
    echo "+ $*"
    "$@" > >(tee "$W/$name.out") 2> >(tee "$W/$name.err" >&2)
    local rc=$?
    sleep 0.2  # let the tee processes flush
    echo "$rc" > "$W/$name.rc"
    echo "($name: exit $rc)"
}

step "environment"
"$SA" --version
nvidia-smi -L || true
python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "gpus", torch.cuda.device_count())'
nvcc --version | tail -1
NGPU=$(python3 -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)
echo "workdir: $W"

step "(a) GPT-2 small, 4 steps: PyTorch's allocator"
run_logged gpt2_native python3 "$DIR/gpt2_train.py" "$W/gpt2_native.json"
step "(a) GPT-2 small, 4 steps: streamalloc run -- python3"
run_logged gpt2_sa "$SA" run --stats --snapshot "$W/gpt2_snapshot.json" -- python3 "$DIR/gpt2_train.py" "$W/gpt2_sa.json"

if [ "$NGPU" -ge 2 ]; then
    step "(b) pp_isend.py on 2 ranks: PyTorch's allocator"
    run_logged pp_native torchrun --standalone --nproc_per_node=2 "$DIR/pp_isend.py" "$W/pp_native.json"
    step "(b) pp_isend.py on 2 ranks: streamalloc run -- torchrun"
    run_logged pp_sa "$SA" run --stats --snapshot "$W/pp_snapshot.json" -- \
        torchrun --standalone --nproc_per_node=2 "$DIR/pp_isend.py" "$W/pp_sa.json"
else
    echo "(b) skipped: needs 2 GPUs, found $NGPU"
fi

step "(c) preload_test.cu, built with nvcc -cudart shared"
nvcc -O2 -cudart shared -o "$W/preload_test" "$DIR/preload_test.cu" -ldl || echo "nvcc failed" > "$W/nvcc.failed"
if [ -x "$W/preload_test" ]; then
    run_logged preload_native "$W/preload_test"
    run_logged preload_sa env LD_PRELOAD="$DIR/libstreamalloc_preload.so" STREAMALLOC_STATS_AT_EXIT=1 "$W/preload_test"
    run_logged preload_run "$SA" run --preload --stats -- "$W/preload_test"
    # Freeing on the wrong stream is a user error the test must catch (expected FAIL).
    run_logged preload_racy env LD_PRELOAD="$DIR/libstreamalloc_preload.so" "$W/preload_test" --racy
fi

step "summary"
python3 "$DIR/summary.py" "$W" "$NGPU"
