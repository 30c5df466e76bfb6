#!/usr/bin/env bash
# Builds streamalloc here (release) and copies everything benches/gpu/launch/run.sh needs
# into one folder for the GPU machine (default /work/main/gpu-carry/launch; or $1).
#   bash benches/gpu/launch/stage.sh [DEST]
# Then, on the GPU machine:  bash gpu-carry/launch/run.sh gpu-carry/launch
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../../.." && pwd)
DEST=${1:-/work/main/gpu-carry/launch}
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-/work/target-shared}
cd "$ROOT"

cargo build --release -p streamalloc -p streamalloc-preload
REL="$CARGO_TARGET_DIR/release"

rm -rf "$DEST"
mkdir -p "$DEST/python"
for f in streamalloc libstreamalloc.so libstreamalloc_preload.so; do
    # Debug info is not needed there and would not fit the carry limit.
    strip --strip-debug -o "$DEST/$f" "$REL/$f" 2>/dev/null || cp "$REL/$f" "$DEST/$f"
done
tar -C python --exclude=__pycache__ -cf - streamalloc | tar -C "$DEST/python" -xf -
cp benches/gpu/launch/run.sh benches/gpu/launch/summary.py benches/gpu/launch/gpt2_train.py \
   benches/gpu/launch/pp_isend.py benches/gpu/launch/preload_test.cu "$DEST/"

# The target folder is shared by several checkouts: make sure these files are this
# checkout's build (its launcher, its exit hook, its interposer), not another's.
fail() { echo "stage.sh: $*; rebuild and stage again" >&2; exit 1; }
nm -D --defined-only "$DEST/libstreamalloc.so" | grep -q ' streamalloc_at_exit$' \
    || fail "$DEST/libstreamalloc.so lacks streamalloc_at_exit"
nm -D --defined-only "$DEST/libstreamalloc_preload.so" | grep -q ' cudaMallocAsync$' \
    || fail "$DEST/libstreamalloc_preload.so lacks cudaMallocAsync"
"$DEST/streamalloc" run --help | grep -q -- '--preload' || fail "$DEST/streamalloc has no 'run --preload'"

# CPU smoke test of the staged layout: the launcher finds its library and Python package
# next to itself, and a Python child gets them.
"$DEST/streamalloc" run --conf trace_capacity:4096 -- python3 -c '
import os, sys, streamalloc
assert sys.modules["sitecustomize"].__file__.startswith(sys.argv[1]), sys.modules["sitecustomize"].__file__
assert os.environ["STREAMALLOC_LIB"] == os.path.join(sys.argv[1], "libstreamalloc.so"), os.environ["STREAMALLOC_LIB"]
print("staged launcher OK:", os.environ["STREAMALLOC_LIB"])
' "$(cd "$DEST" && pwd -P)"
bash -n "$DEST/run.sh"
du -sh "$DEST"
echo "staged into $DEST"
