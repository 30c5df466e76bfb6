// The hook floor and one or more builds of libstreamalloc.so behind a single PyTorch
// pluggable allocator, switched between passes of one Python loop (loop_ab.py).
//
// Why: on the GPU host, a Python process's speed changes by up to 2x with the host's load
// (within one process too), so the floor and streamalloc measured in separate processes
// compare noise as often as allocators. Here they alternate pass by pass in one process,
// a few tens of milliseconds apart, over the same interpreter, the same PyTorch and the
// same memory layout. Every mode pays the same switch (one load and one branch), so the
// difference between a build's passes and the floor's is the build's own cost.
//
// Mode 0 is the floor: pluggable_bump.c's bump allocator over one cudaMalloc, free a no-op.
// Mode k > 0 calls the k-th build loaded with ps_load. The mode may change only while no
// block is live (loop_ab.py frees everything and synchronises at the end of each pass):
// a free of an address inside the floor's arena is the floor's (a no-op), and every other
// free goes to the current mode's build, which made the block.
#include <dlfcn.h>
#include <stddef.h>
#include <stdio.h>
#include <sys/types.h>
#include <cuda_runtime_api.h>

#define MAX_BUILDS 8
typedef void *(*malloc_fn)(size_t, int, cudaStream_t);
typedef void (*free_fn)(void *, size_t, int, cudaStream_t);
static malloc_fn build_malloc[MAX_BUILDS + 1];
static free_fn build_free[MAX_BUILDS + 1];
static int builds, mode;
// 8 GiB is plenty: the arena wraps (timing only, no data is ever written), and the rest of
// the device stays free for the builds.
static char *base;
static size_t off, cap = (size_t)8 << 30;

// Loads a build; returns its mode (1, 2, ...) or -1 with the reason on stderr.
int ps_load(const char *path) {
  if (builds == MAX_BUILDS) return -1;
  void *lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
  if (!lib) { fprintf(stderr, "ps_load: %s\n", dlerror()); return -1; }
  malloc_fn m = (malloc_fn)dlsym(lib, "streamalloc_malloc");
  free_fn f = (free_fn)dlsym(lib, "streamalloc_free");
  if (!m || !f) { fprintf(stderr, "ps_load: %s lacks streamalloc_malloc/free\n", path); return -1; }
  builds++;
  build_malloc[builds] = m; build_free[builds] = f;
  return builds;
}

// Selects the allocator for the next allocations: 0 the floor, k the k-th build.
int ps_set_mode(int next) {
  if (next < 0 || next > builds) return -1;
  mode = next;
  return 0;
}

static void *bump(ssize_t size, int device) {
  if (!base) {
    cudaSetDevice(device);
    if (cudaMalloc((void **)&base, cap) != cudaSuccess) return NULL;
  }
  size_t s = ((size_t)size + 511) & ~(size_t)511;
  if (off + s > cap) off = 0;
  void *p = base + off; off += s; return p;
}

void *ps_malloc(ssize_t size, int device, cudaStream_t stream) {
  if (mode == 0) return bump(size, device);
  return build_malloc[mode]((size_t)size, device, stream);
}

void ps_free(void *ptr, ssize_t size, int device, cudaStream_t stream) {
  if (base && (size_t)((char *)ptr - base) < cap) return;  // the floor's block
  build_free[mode](ptr, (size_t)size, device, stream);
}
