# The exchange's copy kernel (python/streamalloc/csrc/p2p_copy_kernel.h) on the CPU: the same
# source compiled as plain C++, each warp's lanes run in turn. Random tables of pieces at every
# alignment (source and destination offsets 0-15 bytes apart), lengths from 0 to several
# chunks, launches over sub-ranges of the table as the rounds make them: every destination
# byte equals its source byte, and no byte outside the pieces changes. Then the kernel's
# cache (streamalloc._p2p_copy.kernel_for with a stand-in driver, PyTorch and NVRTC): a
# cached kernel loads without NVRTC being loaded; one the driver refuses is compiled again
# and replaces the cached one. Needs a C++ compiler ($CXX or c++); no torch, no GPU.
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


def check_kernel_cache():
    """kernel_for over three processes' worth of calls, with stand-ins for what needs a GPU:
    an empty cache compiles once; a filled one loads without NVRTC; a cached kernel the
    driver refuses is compiled again and written back."""
    import types

    sys.path.insert(0, os.path.join(HERE, "..", "..", "..", "python"))
    from streamalloc import _ce, _p2p_copy

    calls = {"nvrtc": 0, "compile": 0}

    class Driver:
        def use_device(self, index):
            pass

        def _module_load(self, module, cubin):
            return 1 if cubin == b"refused" else 0  # CUDA_ERROR_INVALID_VALUE for a stale one

        def _module_function(self, function, module, name):
            return 0

        def check(self, rc, what):
            if rc:
                raise _ce.CeError(f"{what} failed: {rc}")

    def nvrtc():
        calls["nvrtc"] += 1
        return object()

    def compile_(lib, source, arch):
        calls["compile"] += 1
        return b"compiled for sm_" + arch.encode()

    torch = types.ModuleType("torch")
    torch.version = types.SimpleNamespace(cuda="13.0")
    torch.cuda = types.SimpleNamespace(get_device_capability=lambda index: (9, 0))
    saved = {name: sys.modules.get(name) for name in ("torch",)}
    patched = {"_nvrtc": _p2p_copy._nvrtc, "_compile": _p2p_copy._compile}
    saved_driver, saved_cache = _ce.driver, os.environ.get("STREAMALLOC_CACHE")
    with tempfile.TemporaryDirectory() as cache:
        try:
            sys.modules["torch"] = torch
            os.environ["STREAMALLOC_CACHE"] = cache
            _ce.driver = lambda: Driver()
            _p2p_copy._nvrtc, _p2p_copy._compile = nvrtc, compile_
            device = types.SimpleNamespace(index=0)

            def new_process():
                _p2p_copy._FUNCTIONS.clear()
                calls.update(nvrtc=0, compile=0)

            def load():
                try:
                    _p2p_copy.kernel_for(device)
                    return "loaded"
                except Exception as err:  # reported as the check's failure
                    return f"{type(err).__name__}: {err}"

            new_process()
            load()
            cached = list((_p2p_copy.cache_dir()).glob("copy-*-sm_90.cubin"))
            check(calls == {"nvrtc": 1, "compile": 1} and len(cached) == 1,
                  f"an empty cache compiles once and keeps the kernel "
                  f"({calls}, {len(cached)} files)")
            new_process()
            outcome = load()
            check(outcome == "loaded" and calls == {"nvrtc": 0, "compile": 0},
                  f"a cached kernel loads without loading NVRTC ({outcome}, {calls})")
            cached[0].write_bytes(b"refused")
            new_process()
            outcome = load()
            check(outcome == "loaded" and calls == {"nvrtc": 1, "compile": 1}
                  and cached[0].read_bytes() == b"compiled for sm_90",
                  f"a cached kernel the driver refuses is compiled again and replaced "
                  f"({outcome}, {calls})")
        finally:
            _ce.driver = saved_driver
            _p2p_copy._nvrtc, _p2p_copy._compile = patched["_nvrtc"], patched["_compile"]
            _p2p_copy._FUNCTIONS.clear()
            for name, module in saved.items():
                if module is None:
                    sys.modules.pop(name, None)
                else:
                    sys.modules[name] = module
            if saved_cache is None:
                os.environ.pop("STREAMALLOC_CACHE", None)
            else:
                os.environ["STREAMALLOC_CACHE"] = saved_cache


def main():
    check_kernel_cache()
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
    print(f"copy kernel checks: all passed ({cases} random tables, the kernel's cache)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
