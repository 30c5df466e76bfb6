# The exchange's copy kernel (python/streamalloc/csrc/p2p_copy_kernel.h) on the CPU: the same
# source compiled as plain C++, each warp's lanes run in turn. Random tables of pieces at every
# alignment (source and destination offsets 0-15 bytes apart), lengths from 0 to several
# chunks, launches over sub-ranges of the table as the rounds make them: every destination
# byte equals its source byte, and no byte outside the pieces changes. Needs a C++ compiler
# ($CXX or c++); no torch, no GPU.
#   python3 benches/gpu/p2p/copy_kernel_check.py
import ctypes
import os
import random
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
KERNEL = os.path.join(HERE, "..", "..", "..", "python", "streamalloc", "csrc", "p2p_copy_kernel.h")
CHUNK = 8192

failures = []


def check(cond, what):
    if not cond:
        failures.append(what)
        print("FAIL:", what, flush=True)


def build(folder):
    source = os.path.join(folder, "kernel.cpp")
    with open(source, "w") as f:
        f.write(f'#include "{os.path.abspath(KERNEL)}"\n')
    out = os.path.join(folder, "kernel.so")
    cxx = os.environ.get("CXX", "c++")
    subprocess.run([cxx, "-std=c++17", "-O1", "-Wall", "-Werror", "-shared", "-fPIC", source, "-o", out],
                   check=True)
    lib = ctypes.CDLL(out)
    u64p = ctypes.POINTER(ctypes.c_uint64)
    lib.streamalloc_p2p_copy_cpu.argtypes = [u64p, u64p, u64p, u64p, ctypes.c_uint]
    lib.streamalloc_p2p_copy_cpu.restype = None
    return lib.streamalloc_p2p_copy_cpu


def table(pieces):
    """(src, dst, len, first) arrays of a table; `first` is the chunk prefix sum."""
    n = len(pieces)
    src = (ctypes.c_uint64 * max(n, 1))(*[p[0] for p in pieces])
    dst = (ctypes.c_uint64 * max(n, 1))(*[p[1] for p in pieces])
    lens = (ctypes.c_uint64 * max(n, 1))(*[p[2] for p in pieces])
    first, at = [], 0
    for _, _, length in pieces:
        first.append(at)
        at += (length + CHUNK - 1) // CHUNK
    first.append(at)
    return src, dst, lens, (ctypes.c_uint64 * len(first))(*first)


def at(array, index):
    """A pointer to array[index:]."""
    return ctypes.cast(ctypes.addressof(array) + 8 * index, ctypes.POINTER(ctypes.c_uint64))


def one_case(copy, rng, case):
    count = rng.choice([1, 2, 7, rng.randint(1, 60)])
    lengths = [rng.choice([1, 2, 3, 15, 16, 17, rng.randint(1, 300), CHUNK - 1, CHUNK, CHUNK + 1,
                           rng.randint(CHUNK, 5 * CHUNK)]) for _ in range(count)]
    # Sources back to back in one arena, destinations in another, each at a random alignment.
    src_arena = bytearray(rng.getrandbits(8) for _ in range(sum(lengths) + 16 * count + 64))
    dst_size = sum(lengths) + 16 * count + 64
    dst_arena = (ctypes.c_ubyte * dst_size)()
    sentinel = rng.getrandbits(8)
    ctypes.memset(dst_arena, sentinel, dst_size)
    src_buf = (ctypes.c_ubyte * len(src_arena)).from_buffer(src_arena)
    s_base, d_base = ctypes.addressof(src_buf), ctypes.addressof(dst_arena)
    pieces, s_at, d_at, expected = [], 0, 0, {}
    order = list(range(count))
    rng.shuffle(order)  # destinations in another order than sources
    d_offsets = {}
    for i in order:
        d_at += rng.randint(0, 15)
        d_offsets[i] = d_at
        d_at += lengths[i]
    for i in range(count):
        s_at += rng.randint(0, 15)
        pieces.append((s_base + s_at, d_base + d_offsets[i], lengths[i]))
        for k in range(lengths[i]):
            expected[d_offsets[i] + k] = src_arena[s_at + k]
        s_at += lengths[i]
    src, dst, lens, first = table(pieces)
    # Launch over ranges of the table, as rounds do: [0, a), [a, b), [b, count).
    cuts = sorted({0, count, rng.randint(0, count), rng.randint(0, count)})
    for a, b in zip(cuts, cuts[1:]):
        if b > a:
            copy(at(src, a), at(dst, a), at(lens, a), at(first, a), b - a)
    got = bytes(dst_arena)
    wrong = [k for k, v in expected.items() if got[k] != v]
    untouched = all(got[k] == sentinel for k in range(dst_size) if k not in expected)
    check(not wrong, f"case {case}: {len(wrong)} destination bytes differ from their source "
                     f"(lengths {lengths[:8]}...)")
    check(untouched, f"case {case}: a byte outside every piece changed")


def main():
    with tempfile.TemporaryDirectory() as folder:
        try:
            copy = build(folder)
        except (OSError, subprocess.CalledProcessError) as err:
            print(f"FAIL: cannot compile the copy kernel as C++: {err}")
            return 1
        rng = random.Random(int(os.environ.get("SEED", "1")))
        cases = int(os.environ.get("CASES", "100"))
        for case in range(cases):
            one_case(copy, rng, case)
    if failures:
        print(f"{len(failures)} failure(s)")
        return 1
    print(f"copy kernel checks: all passed ({cases} random tables)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
