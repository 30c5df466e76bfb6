#!/usr/bin/env bash
# Profile-guided builds of libstreamalloc.so (rustc's -Cprofile-generate / -Cprofile-use).
#
# Why: in a Python program every call into the allocator finds its code cold, so what it
# costs there depends on how many lines of code and branches it runs through; a profile
# lets LLVM inline and lay out the fast paths by measured frequency. Measured on an H200
# (benches/gpu/results.md, 2026-11-24, profile-guided builds): the C ABI's pairs ~5 ns faster
# (76 -> 70 ns, ring on), the Python loop about a point closer to the hook floor, which is
# within that host's noise. So it is a tool for release builds, not the default build.
#
#   build.sh instrument DEST      an instrumented build in DEST/ (libstreamalloc.so); each
#                                 process that loads it writes a .profraw at exit where
#                                 LLVM_PROFILE_FILE says (benches/gpu/pgo/collect.sh runs the
#                                 workloads on the GPU machine)
#   build.sh merge PROFRAW...     merges raw profiles (files, or .tgz archives of them) into
#                                 target/pgo/libstreamalloc.profdata
#   build.sh use DEST             the release library built with that profile, in DEST/
#
# A profile fits the sources it was collected from: LLVM ignores functions whose code has
# changed since, so collect again after changing the engine (which is why no profile is
# committed). Builds go to their own target folders; an ordinary `cargo build` is never
# affected.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../../.." && pwd)
PROFILE=$ROOT/target/pgo/libstreamalloc.profdata
cd "$ROOT"

# llvm-profdata of rustc's own LLVM major version (raw profiles are not portable across).
profdata_tool() {
    local major
    major=$(rustc -vV | sed -n 's/^LLVM version: \([0-9]*\).*/\1/p')
    for tool in "$(rustc --print sysroot)/lib/rustlib/x86_64-unknown-linux-gnu/bin/llvm-profdata" \
        "llvm-profdata-$major" "/usr/lib/llvm-$major/bin/llvm-profdata"; do
        if command -v "$tool" > /dev/null 2>&1; then echo "$tool"; return; fi
    done
    echo "build.sh: no llvm-profdata for LLVM $major (apt-get install llvm-$major, or rustup component add llvm-tools)" >&2
    exit 1
}

# Builds the library with extra RUSTFLAGS into target/pgo-NAME and copies it, without its
# debug info, to DEST.
build() {
    local name=$1 dest=$2 flags=$3
    mkdir -p "$dest"
    RUSTFLAGS="${RUSTFLAGS:-} $flags" cargo build --release -p streamalloc --lib \
        --target-dir "$ROOT/target/pgo-$name"
    strip --strip-debug -o "$dest/libstreamalloc.so" "$ROOT/target/pgo-$name/release/libstreamalloc.so"
    echo "$dest/libstreamalloc.so ($name)"
}

case "${1:-}" in
instrument)
    # This default file name applies only where LLVM_PROFILE_FILE is unset at run time.
    build instrument "${2:?DEST}" "-Cprofile-generate=/tmp/streamalloc-pgo"
    ;;
merge)
    shift
    [ $# -ge 1 ] || { echo "usage: $0 merge PROFRAW|ARCHIVE.tgz..." >&2; exit 2; }
    tool=$(profdata_tool)
    work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
    for input in "$@"; do
        case "$input" in
            *.tgz|*.tar.gz) tar -xzf "$input" -C "$work" ;;
            *) cp "$input" "$work/" ;;
        esac
    done
    raws=$(find "$work" -name '*.profraw' | sort)
    [ -n "$raws" ] || { echo "build.sh: no .profraw in $*" >&2; exit 1; }
    mkdir -p "$(dirname "$PROFILE")"
    # shellcheck disable=SC2086 # one argument per file
    "$tool" merge -o "$PROFILE" $raws
    echo "$(echo "$raws" | wc -l) raw profiles -> $PROFILE"
    ;;
use)
    [ -f "$PROFILE" ] || { echo "build.sh: no $PROFILE; instrument, collect and merge first" >&2; exit 1; }
    build use "${2:?DEST}" "-Cprofile-use=$PROFILE"
    ;;
*)
    echo "usage: $0 instrument DEST | merge PROFRAW... | use DEST" >&2
    exit 2
    ;;
esac
