# Host cost of malloc+free in C++ (no Python in the loop): PyTorch's native caching
# allocator next to streamalloc's C ABI (dlopen'ed libstreamalloc.so): same-size pairs (the
# cached fast path) and mixed sizes with a window of 64 live blocks, with what streamalloc did
# with the device during the mixed loops (per 1000 operations; bytes in MiB).
#   python host_cost.py LIBSTREAMALLOC.so OUT.json
#   python host_cost.py --build-only     # compile (and cache) the loops, measure nothing
# The loops are compiled with OPT (default -O2). torch's load_inline adds no optimisation
# flag of its own, so a harness written with load_inline alone runs its loops at -O0, where
# the unoptimised std::mt19937_64 and std::vector add ~30 ns to every mixed-size operation of
# either allocator; OPT=-O0 reproduces such a harness.
import json, os, sys, torch
from torch.utils.cpp_extension import load_inline
BUILD_ONLY = sys.argv[1:] == ["--build-only"]
if not BUILD_ONLY and len(sys.argv) != 3:
    sys.exit("usage: host_cost.py LIBSTREAMALLOC.so OUT.json | --build-only")
LIB, OUT = (None, None) if BUILD_ONLY else (sys.argv[1], sys.argv[2])
src = r'''
#include <torch/extension.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>
#include <dlfcn.h>
#include <chrono>
#include <random>
#include <stdexcept>
#include <vector>
using clk = std::chrono::steady_clock;
static double ns(clk::time_point a, clk::time_point b, long n) { return std::chrono::duration<double, std::nano>(b - a).count() / n; }
typedef void* (*malloc_fn)(size_t, int, cudaStream_t);
typedef void (*free_fn)(void*, size_t, int, cudaStream_t);
typedef const char* (*stats_fn)(int);
static malloc_fn sa_malloc; static free_fn sa_free; static stats_fn sa_stats_json;
void sa_load(std::string path) {
  void* h = dlopen(path.c_str(), RTLD_NOW | RTLD_GLOBAL);
  if (!h) throw std::runtime_error(dlerror());
  sa_malloc = (malloc_fn)dlsym(h, "streamalloc_malloc"); sa_free = (free_fn)dlsym(h, "streamalloc_free");
  sa_stats_json = (stats_fn)dlsym(h, "streamalloc_stats_json");
}
std::string sa_stats() { const char* s = sa_stats_json ? sa_stats_json(0) : nullptr; return s ? s : "{}"; }
struct Sizes { std::mt19937_64 g{7}; long operator()() { double r = (g() % 1000) / 1000.0; if (r < .6) return (long)(g() % (1 << 20)) + 1; if (r < .95) return (long)(g() % (63 << 20)) + (1 << 20); return (long)(g() % (192 << 20)) + (64 << 20); } };
double native_pair(long n, long size) {
  auto s = c10::cuda::getCurrentCUDAStream().stream();
  for (int i = 0; i < 1000; i++) c10::cuda::CUDACachingAllocator::raw_delete(c10::cuda::CUDACachingAllocator::raw_alloc_with_stream(size, s));
  auto a = clk::now();
  for (long i = 0; i < n; i++) c10::cuda::CUDACachingAllocator::raw_delete(c10::cuda::CUDACachingAllocator::raw_alloc_with_stream(size, s));
  return ns(a, clk::now(), n);
}
double sa_pair(long n, long size) {
  auto s = c10::cuda::getCurrentCUDAStream().stream();
  for (int i = 0; i < 1000; i++) sa_free(sa_malloc(size, 0, s), size, 0, s);
  auto a = clk::now();
  for (long i = 0; i < n; i++) { void* p = sa_malloc(size, 0, s); sa_free(p, size, 0, s); }
  return ns(a, clk::now(), n);
}
double native_mixed(long n) {
  auto s = c10::cuda::getCurrentCUDAStream().stream(); Sizes size; std::mt19937_64 g(11); std::vector<void*> live; long ops = 0;
  auto a = clk::now();
  for (long i = 0; i < n; i++) {
    live.push_back(c10::cuda::CUDACachingAllocator::raw_alloc_with_stream(size(), s)); ops++;
    if (live.size() > 64) { size_t k = g() % live.size(); c10::cuda::CUDACachingAllocator::raw_delete(live[k]); live[k] = live.back(); live.pop_back(); ops++; }
  }
  for (void* p : live) { c10::cuda::CUDACachingAllocator::raw_delete(p); ops++; }
  return ns(a, clk::now(), ops);
}
double sa_mixed(long n) {
  auto s = c10::cuda::getCurrentCUDAStream().stream(); Sizes size; std::mt19937_64 g(11); std::vector<void*> live; long ops = 0;
  auto a = clk::now();
  for (long i = 0; i < n; i++) {
    void* p = sa_malloc(size(), 0, s); if (!p) throw std::runtime_error("streamalloc_malloc returned null"); live.push_back(p); ops++;
    if (live.size() > 64) { size_t k = g() % live.size(); sa_free(live[k], 0, 0, s); live[k] = live.back(); live.pop_back(); ops++; }
  }
  for (void* p : live) { sa_free(p, 0, 0, s); ops++; }
  return ns(a, clk::now(), ops);
}
'''
OPT = os.environ.get("OPT", "-O2")
m = load_inline("sa_host_cost" + OPT.replace("-", "_"), cpp_sources=src,
                functions=["sa_load", "sa_stats", "native_pair", "sa_pair", "native_mixed", "sa_mixed"],
                extra_cflags=[OPT], extra_ldflags=["-lcudart", "-ldl"], with_cuda=True, verbose=False)
if BUILD_ONLY:
    sys.exit(0)
torch.cuda.init(); torch.empty(1, device="cuda")
m.sa_load(LIB)
# Each figure is the best of REPS runs taken in turn with the other allocator's: on the
# shared GPU host one run can be 1.5x slower than the next, for both allocators.
REPS = int(os.environ.get("REPS", 5))
r = {}
for sz in (4096, 1 << 20, 64 << 20):
    native, ours = [], []
    for _ in range(REPS):
        native.append(m.native_pair(200000, sz)); ours.append(m.sa_pair(200000, sz))
    r[f"native_pair_{sz}"], r[f"streamalloc_pair_{sz}"] = min(native), min(ours)
m.native_mixed(20000); m.sa_mixed(20000)
# What streamalloc did with the device during the timed mixed loops, per 1000 operations:
# mapping and synchronising (µs each) would dwarf the host path itself.
WORK = ("page_map_bytes", "page_unmap_bytes", "device_syncs", "segment_allocs", "segment_frees",
        "retries", "stitches", "stitch_revivals", "cross_stream_waits", "events_recorded")
before = json.loads(m.sa_stats()).get("stats", {})
native, ours = [], []
for _ in range(REPS):
    native.append(m.native_mixed(100000)); ours.append(m.sa_mixed(100000))
r["native_mixed"], r["streamalloc_mixed"] = min(native), min(ours)
after = json.loads(m.sa_stats()).get("stats", {})
ops = (after.get("allocs", 0) - before.get("allocs", 0)) + (after.get("frees", 0) - before.get("frees", 0))
for key in WORK:
    if key in after and ops:
        delta = after[key] - before.get(key, 0)
        r[f"streamalloc_mixed_{key}_per_1000_ops"] = delta * 1000 / ops / ((1 << 20) if key.endswith("_bytes") else 1)
r = {k: round(v, 1) for k, v in r.items()}
r["harness"] = OPT
json.dump(r, open(OUT, "w")); print(json.dumps(r))
