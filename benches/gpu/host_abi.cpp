// Host cost of streamalloc's C ABI without PyTorch: host_cost.py's loops (same sizes, same
// random sequences) over one or more builds of libstreamalloc.so, loaded side by side and
// measured in turn (best of 7 rounds each), so that two builds are compared under the same
// conditions of a shared host. Without arguments it times the primitives those loops are
// made of (rdtsc, the kernel's coarse and precise monotonic clocks, an atomic
// read-modify-write, an uncontended pthread mutex) on this host.
//   g++ -O2 -o host_abi host_abi.cpp -ldl -lpthread
//   ./host_abi                       # primitives
//   ./host_abi A.so [B.so ...]       # pairs of 4 KiB / 1 MiB / 64 MiB, mixed sizes; ns
#include <dlfcn.h>
#include <pthread.h>
#include <time.h>
#include <x86intrin.h>
#include <chrono>
#include <cstdio>
#include <random>
#include <vector>
#include <atomic>
using clk = std::chrono::steady_clock;
typedef void* (*malloc_fn)(size_t, int, void*);
typedef void (*free_fn)(void*, size_t, int, void*);
static malloc_fn sa_malloc; static free_fn sa_free;
static double ns(clk::time_point a, long n) { return std::chrono::duration<double, std::nano>(clk::now() - a).count() / n; }
struct Sizes { std::mt19937_64 g{7}; long operator()() { double r = (g() % 1000) / 1000.0; if (r < .6) return (long)(g() % (1 << 20)) + 1; if (r < .95) return (long)(g() % (63 << 20)) + (1 << 20); return (long)(g() % (192 << 20)) + (64 << 20); } };
double pair(long n, long size) {
  for (int i = 0; i < 1000; i++) sa_free(sa_malloc(size, 0, 0), size, 0, 0);
  auto a = clk::now();
  for (long i = 0; i < n; i++) { void* p = sa_malloc(size, 0, 0); sa_free(p, size, 0, 0); }
  return ns(a, n);
}
double mixed(long n) {
  Sizes size; std::mt19937_64 g(11); std::vector<void*> live; long ops = 0;
  auto a = clk::now();
  for (long i = 0; i < n; i++) {
    void* p = sa_malloc(size(), 0, 0); if (!p) { fprintf(stderr, "null\n"); return -1; } live.push_back(p); ops++;
    if (live.size() > 64) { size_t k = g() % live.size(); sa_free(live[k], 0, 0, 0); live[k] = live.back(); live.pop_back(); ops++; }
  }
  for (void* p : live) { sa_free(p, 0, 0, 0); ops++; }
  return ns(a, ops);
}
double rng_only(long n) {  // the mixed loop's own cost without the allocator
  Sizes size; std::mt19937_64 g(11); std::vector<void*> live; long ops = 0; long sink = 0;
  auto a = clk::now();
  for (long i = 0; i < n; i++) {
    sink += size(); live.push_back((void*)sink); ops++;
    if (live.size() > 64) { size_t k = g() % live.size(); live[k] = live.back(); live.pop_back(); ops++; }
  }
  ops += live.size();
  double r = ns(a, ops); if (sink == 42) printf("x"); return r;
}
int main(int argc, char** argv) {
  if (argc > 1) {
    // Several libraries: measured in turn, ROUNDS times, best of each (bursts of noise on
    // a shared host hit one round, not one library).
    int libs = argc - 1; const int ROUNDS = 7;
    std::vector<malloc_fn> ms(libs); std::vector<free_fn> fs(libs);
    for (int l = 0; l < libs; l++) {
      void* h = dlopen(argv[l + 1], RTLD_NOW | RTLD_LOCAL);
      if (!h) { fprintf(stderr, "%s\n", dlerror()); return 1; }
      ms[l] = (malloc_fn)dlsym(h, "streamalloc_malloc"); fs[l] = (free_fn)dlsym(h, "streamalloc_free");
      sa_malloc = ms[l]; sa_free = fs[l]; mixed(20000);
    }
    std::vector<std::vector<double>> best(libs, std::vector<double>(4, 1e9));
    long sizes[3] = {4096, 1 << 20, 64 << 20};
    for (int rep = 0; rep < ROUNDS; rep++)
      for (int l = 0; l < libs; l++) {
        sa_malloc = ms[l]; sa_free = fs[l];
        for (int s = 0; s < 3; s++) { double t = pair(200000, sizes[s]); if (t < best[l][s]) best[l][s] = t; }
        double t = mixed(100000); if (t < best[l][3]) best[l][3] = t;
      }
    for (int l = 0; l < libs; l++)
      printf("%-12s pair4K %.1f pair1M %.1f pair64M %.1f mixed %.1f\n", argv[l + 1], best[l][0], best[l][1], best[l][2], best[l][3]);
    return 0;
  }
  const long N = 20000000; unsigned long long s = 0;
  auto a = clk::now(); for (long i = 0; i < N; i++) s += __rdtsc(); double t_rdtsc = ns(a, N);
  struct timespec ts;
  a = clk::now(); for (long i = 0; i < N; i++) { clock_gettime(CLOCK_MONOTONIC_COARSE, &ts); s += ts.tv_nsec; } double t_coarse = ns(a, N);
  a = clk::now(); for (long i = 0; i < N; i++) { clock_gettime(CLOCK_MONOTONIC, &ts); s += ts.tv_nsec; } double t_mono = ns(a, N);
  std::atomic<long> x{0}; long e = 0;
  a = clk::now(); for (long i = 0; i < N; i++) { e = i; x.compare_exchange_strong(e, i + 1); } double t_cas = ns(a, N);
  a = clk::now(); for (long i = 0; i < N; i++) { x.exchange(i); } double t_xchg = ns(a, N);
  pthread_mutex_t m = PTHREAD_MUTEX_INITIALIZER;
  a = clk::now(); for (long i = 0; i < N; i++) { pthread_mutex_lock(&m); pthread_mutex_unlock(&m); } double t_mutex = ns(a, N);
  double t_rng = 1e9; for (int r = 0; r < 3; r++) { double t = rng_only(100000); if (t < t_rng) t_rng = t; }
  printf("rdtsc %.1f ns, coarse clock %.1f ns, monotonic clock %.1f ns, lock cmpxchg %.1f ns, xchg %.1f ns, pthread lock+unlock %.1f ns, mixed loop without allocator %.1f ns/op (%llu)\n", t_rdtsc, t_coarse, t_mono, t_cas, t_xchg, t_mutex, t_rng, s & 1);
  return 0;
}
