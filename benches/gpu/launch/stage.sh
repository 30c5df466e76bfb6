#!/usr/bin/env bash
# Builds streamalloc here (release) and copies everything benches/gpu/launch/run.sh needs
# into one folder to take to the GPU machine.
#   bash benches/gpu/launch/stage.sh [DEST]
# DEST defaults to target/gpu-launch in this repository. A DEST that exists must be empty
# or a folder this script filled before (it then starts afresh). The build goes to cargo's
# target folder ($CARGO_TARGET_DIR if set). Then, on the GPU machine:
#   bash DEST/run.sh DEST
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../../.." && pwd)
DEST=${1:-$ROOT/target/gpu-launch}
case "$DEST" in /*) ;; *) DEST="$PWD/$DEST" ;; esac
MARK=.streamalloc-stage
cd "$ROOT"

if [ -e "$DEST" ]; then
    if [ ! -d "$DEST" ]; then
        echo "stage.sh: $DEST exists and is not a folder" >&2
        exit 2
    fi
    if [ -n "$(ls -A "$DEST")" ] && [ ! -e "$DEST/$MARK" ]; then
        echo "stage.sh: $DEST is not empty and was not filled by stage.sh; name another folder" >&2
        exit 2
    fi
fi

cargo build --release -p streamalloc -p streamalloc-preload
TARGET=$(cargo metadata --format-version 1 --no-deps \
    | python3 -c 'import json, sys; print(json.load(sys.stdin)["target_directory"])')
REL="$TARGET/release"

# Only a folder this script filled (or an empty one) is cleared.
if [ -d "$DEST" ]; then
    find "$DEST" -mindepth 1 -delete
fi
mkdir -p "$DEST/python"
touch "$DEST/$MARK"
for f in streamalloc libstreamalloc.so libstreamalloc_preload.so; do
    # Debug info is not needed there, and stripped the folder stays small to copy.
    strip --strip-debug -o "$DEST/$f" "$REL/$f" 2>/dev/null || cp "$REL/$f" "$DEST/$f"
done
tar -C python --exclude=__pycache__ -cf - streamalloc | tar -C "$DEST/python" -xf -
cp benches/gpu/launch/run.sh benches/gpu/launch/summary.py benches/gpu/launch/gpt2_train.py \
   benches/gpu/launch/pp_isend.py benches/gpu/launch/preload_test.cu "$DEST/"

# A target folder may be shared by several checkouts: make sure these files are this
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
