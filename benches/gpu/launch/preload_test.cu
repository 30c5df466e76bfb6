// A plain CUDA program for the LD_PRELOAD interposer: allocates and frees in a loop across
// two streams, with both cudaMalloc/cudaFree and cudaMallocAsync/cudaFreeAsync, and checks
// every byte it wrote with kernels. Built with the shared runtime so a preload reaches it:
//
//   nvcc -O2 -cudart shared -o preload_test preload_test.cu
//   LD_PRELOAD=libstreamalloc_preload.so STREAMALLOC_STATS_AT_EXIT=1 ./preload_test
//
// Each iteration races a slow reader on stream 2 against a writer on stream 1 that gets
// the memory the reader is still using, unless the allocator orders the reuse:
//  A. cudaMalloc a, fill on s1, slow copy a -> snap on s2, cudaFree(a) (callers rely on
//     cudaFree waiting for that copy), cudaMalloc a2 of the same size, fill it on s1 at
//     once with another pattern. snap must hold the first pattern.
//  B. cudaMallocAsync c on s1, fill, slow copy c -> snap2 on s2, cudaFreeAsync(c, s2),
//     cudaMallocAsync d of the same size on s1, fill at once. snap2 must hold c's pattern.
//     With --racy, c is freed on s1 instead (a user error: s2 still reads it), to show
//     the check catches a reuse that is not ordered.
//  C. (once, after the loop) cudaMallocAsync and cudaFreeAsync captured into a CUDA graph
//     on s1: they must become graph memory nodes, CUDA's memory for every launch. Had the
//     preload served them from its pool, the block would go back to the pool at capture
//     and be handed to the eager allocations made next, which the launches then overwrite.
//     Four eager buffers are filled, the graph launched three times, every word checked.
// Prints PASS/FAIL, whether streamalloc's preload is loaded, and its counters (through
// the library's own streamalloc_stats_json) as the proof the memory came from it.
#include <cuda_runtime.h>
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define CHECK(call)                                                                       \
    do {                                                                                  \
        cudaError_t err_ = (call);                                                        \
        if (err_ != cudaSuccess) {                                                        \
            printf("FAIL: %s:%d %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(err_)); \
            exit(1);                                                                      \
        }                                                                                 \
    } while (0)

__global__ void fill(unsigned* p, size_t n, unsigned v) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        p[i] = v ^ (unsigned)i;
}

__global__ void slow_copy(const unsigned* src, unsigned* dst, size_t n, long long spin) {
    if (threadIdx.x == 0) {
        long long t0 = clock64();
        while (clock64() - t0 < spin) {
        }
    }
    __syncthreads();
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        dst[i] = src[i];
}

__global__ void check(const unsigned* p, size_t n, unsigned v, unsigned long long* bad) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        if (p[i] != (v ^ (unsigned)i)) atomicAdd(bad, 1ULL);
}

int main(int argc, char** argv) {
    int racy = argc > 1 && strcmp(argv[1], "--racy") == 0;
    const int iters = 100;
    const long long spin = 2000000;  // ~1 ms at ~2 GHz: the reader is still busy when the writer starts
    const size_t max_n = (1 << 20) + 7 * 8192;
    const int grid = 264, block = 256;

    cudaStream_t s1, s2;
    CHECK(cudaStreamCreateWithFlags(&s1, cudaStreamNonBlocking));
    CHECK(cudaStreamCreateWithFlags(&s2, cudaStreamNonBlocking));
    cudaEvent_t filled;
    CHECK(cudaEventCreateWithFlags(&filled, cudaEventDisableTiming));

    unsigned *snap, *snap2;
    unsigned long long* bad;
    CHECK(cudaMalloc(&snap, max_n * 4));
    CHECK(cudaMalloc(&snap2, max_n * 4));
    CHECK(cudaMalloc(&bad, 3 * sizeof(unsigned long long)));
    CHECK(cudaMemset(bad, 0, 3 * sizeof(unsigned long long)));
    CHECK(cudaDeviceSynchronize());

    for (int it = 0; it < iters; it++) {
        size_t n = (1 << 20) + (size_t)(it % 8) * 8192;  // a few sizes: reuse, split and merge
        unsigned v1 = 0x1000u + it, v2 = 0x2000u + it, v3 = 0x3000u + it, v4 = 0x4000u + it;

        // A. cudaMalloc / cudaFree
        unsigned *a, *a2;
        CHECK(cudaMalloc(&a, n * 4));
        fill<<<grid, block, 0, s1>>>(a, n, v1);
        CHECK(cudaEventRecord(filled, s1));
        CHECK(cudaStreamWaitEvent(s2, filled, 0));
        slow_copy<<<grid, block, 0, s2>>>(a, snap, n, spin);
        CHECK(cudaFree(a));
        CHECK(cudaMalloc(&a2, n * 4));
        fill<<<grid, block, 0, s1>>>(a2, n, v2);
        check<<<grid, block, 0, s2>>>(snap, n, v1, bad);
        check<<<grid, block, 0, s1>>>(a2, n, v2, bad);
        CHECK(cudaStreamSynchronize(s1));  // a2 is checked before it is freed
        CHECK(cudaFree(a2));

        // B. cudaMallocAsync / cudaFreeAsync across streams
        unsigned *c, *d;
        CHECK(cudaMallocAsync((void**)&c, n * 4, s1));
        fill<<<grid, block, 0, s1>>>(c, n, v3);
        CHECK(cudaEventRecord(filled, s1));
        CHECK(cudaStreamWaitEvent(s2, filled, 0));
        slow_copy<<<grid, block, 0, s2>>>(c, snap2, n, spin);
        CHECK(cudaFreeAsync(c, racy ? s1 : s2));
        CHECK(cudaMallocAsync((void**)&d, n * 4, s1));
        fill<<<grid, block, 0, s1>>>(d, n, v4);
        check<<<grid, block, 0, s2>>>(snap2, n, v3, bad + 1);
        check<<<grid, block, 0, s1>>>(d, n, v4, bad + 1);
        CHECK(cudaFreeAsync(d, s1));
        CHECK(cudaGetLastError());
    }
    CHECK(cudaDeviceSynchronize());

    // C. stream-ordered allocation inside a graph capture
    const size_t gn = (size_t)1 << 22;
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    unsigned* g = NULL;
    CHECK(cudaStreamBeginCapture(s1, cudaStreamCaptureModeGlobal));
    CHECK(cudaMallocAsync((void**)&g, gn * 4, s1));
    fill<<<grid, block, 0, s1>>>(g, gn, 0x5000u);
    CHECK(cudaFreeAsync(g, s1));
    CHECK(cudaStreamEndCapture(s1, &graph));
    CHECK(cudaGraphInstantiate(&exec, graph, 0));
    CHECK(cudaGraphLaunch(exec, s1));
    CHECK(cudaStreamSynchronize(s1));
    unsigned* eager[4];
    for (int k = 0; k < 4; k++) {
        CHECK(cudaMallocAsync((void**)&eager[k], gn * 4, s2));
        fill<<<grid, block, 0, s2>>>(eager[k], gn, 0x6000u + k);
    }
    CHECK(cudaStreamSynchronize(s2));
    for (int r = 0; r < 3; r++) CHECK(cudaGraphLaunch(exec, s1));
    CHECK(cudaStreamSynchronize(s1));
    for (int k = 0; k < 4; k++) {
        check<<<grid, block, 0, s2>>>(eager[k], gn, 0x6000u + k, bad + 2);
        CHECK(cudaFreeAsync(eager[k], s2));
    }
    CHECK(cudaDeviceSynchronize());
    CHECK(cudaGraphExecDestroy(exec));
    CHECK(cudaGraphDestroy(graph));
    CHECK(cudaGetLastError());

    unsigned long long host_bad[3];
    CHECK(cudaMemcpy(host_bad, bad, sizeof host_bad, cudaMemcpyDeviceToHost));

    int device;
    CHECK(cudaGetDevice(&device));
    int preloaded = dlsym(RTLD_DEFAULT, "streamalloc_preload_active") != NULL;
    const char* (*stats_json)(int) = (const char* (*)(int))dlsym(RTLD_DEFAULT, "streamalloc_stats_json");
    CHECK(cudaFree(snap));
    CHECK(cudaFree(snap2));
    CHECK(cudaFree(bad));
    CHECK(cudaDeviceSynchronize());

    printf("iterations=%d mode=%s bad_words_malloc_free=%llu bad_words_async=%llu bad_words_graph=%llu\n",
           iters, racy ? "racy" : "ordered", host_bad[0], host_bad[1], host_bad[2]);
    printf("streamalloc preload loaded: %s\n", preloaded ? "yes" : "no");
    if (stats_json) {
        const char* json = stats_json(device);
        printf("streamalloc stats: %s\n", json ? json : "(unavailable)");
    }
    int ok = host_bad[0] == 0 && host_bad[1] == 0 && host_bad[2] == 0;
    printf("%s\n", ok ? "PASS" : "FAIL");
    return ok ? 0 : 1;
}
