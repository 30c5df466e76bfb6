//! The interposer without a GPU: a stand-in `libcudart.so` (built here with `cc`, its
//! symbols versioned like NVIDIA's) and a C program linked against it run under
//! `LD_PRELOAD=libstreamalloc_preload.so`.
//!
//! With no CUDA driver, streamalloc's allocator cannot be created, so every call must
//! reach the stand-in runtime through `dlsym(RTLD_NEXT)` with its arguments intact, after
//! one warning; and the ABI details hold: `cudaMalloc(NULL, n)` is `cudaErrorInvalidValue`,
//! `cudaFree(NULL)` reaches the runtime and succeeds, the preload is visible to the program
//! and nothing panics. (On a GPU, `benches/gpu/launch/preload_test.cu` checks that
//! allocations are served by streamalloc.)
//!
//! A second test adds a stand-in driver (`libcuda.so`, found through `LD_LIBRARY_PATH`)
//! so that streamalloc's allocator does exist, and checks the routing around CUDA graph
//! capture: stream-ordered calls on a stream being captured reach the runtime, never the
//! pool.
//!
//! Skipped (with a message) when `cc` is not available.

use std::process::Command;

mod support;
use support::{build, preload_library, StandIns, DRIVER_COMMON};

const FAKE_CUDART: &str = r#"
#include <stdio.h>
#include <stdlib.h>
static int mallocs, frees, null_frees, async_mallocs, async_frees, get_devices;
static void report(void) __attribute__((destructor));
static void report(void) {
    printf("fake: mallocs=%d frees=%d null_frees=%d async_mallocs=%d async_frees=%d get_devices=%d\n",
           mallocs, frees, null_frees, async_mallocs, async_frees, get_devices);
}
int cudaGetDevice(int* d) { get_devices++; *d = 0; return 0; }
int cudaMalloc(void** p, size_t n) { if (!p) return 1; mallocs++; *p = n ? malloc(n) : NULL; return 0; }
int cudaFree(void* p) { if (!p) { null_frees++; return 0; } frees++; free(p); return 0; }
int cudaMallocAsync(void** p, size_t n, void* s) { (void)s; async_mallocs++; *p = malloc(n); return 0; }
int cudaFreeAsync(void* p, void* s) { (void)s; async_frees++; free(p); return 0; }
"#;

const PROGRAM: &str = r#"
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <string.h>
int cudaMalloc(void**, size_t); int cudaFree(void*);
int cudaMallocAsync(void**, size_t, void*); int cudaFreeAsync(void*, void*);
int main(void) {
    int failures = 0;
    printf("preload active: %s\n", dlsym(RTLD_DEFAULT, "streamalloc_preload_active") ? "yes" : "no");
    const char* (*last_error)(void) = (const char* (*)(void))dlsym(RTLD_DEFAULT, "streamalloc_last_error");
    if (cudaMalloc(NULL, 8) != 1) failures++;
    if (last_error) printf("last error after cudaMalloc(NULL, 8): %s\n", last_error());
    if (cudaFree(NULL) != 0) failures++;
    if (last_error && last_error()[0] != 0) failures++;
    for (int i = 0; i < 10; i++) {
        char* p = NULL;
        if (cudaMalloc((void**)&p, 4096) != 0 || !p) { failures++; continue; }
        memset(p, i, 4096);
        if (p[4095] != i) failures++;
        if (cudaFree(p) != 0) failures++;
        char* q = NULL;
        if (cudaMallocAsync((void**)&q, 512, (void*)0x1234) != 0 || !q) { failures++; continue; }
        if (cudaFreeAsync(q, (void*)0x5678) != 0) failures++;
    }
    printf("failures=%d\n", failures);
    return failures != 0;
}
"#;

#[test]
fn calls_reach_the_real_runtime_when_no_gpu_is_there() {
    let stand_ins = StandIns {
        runtime: &[FAKE_CUDART],
        runtime_extra_exports: "",
        driver: &[],
        program: PROGRAM,
        program_libs: &["-ldl"],
    };
    let Some((_, program)) = build("preload_cpu", &stand_ins) else {
        eprintln!("skipped: no C compiler (cc)");
        return;
    };
    let preload = preload_library();

    // Without the preload: the stand-in runtime alone.
    let out = Command::new(&program).output().unwrap();
    let plain = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(plain.contains("preload active: no"), "{plain}");

    let out = Command::new(&program)
        .env("LD_PRELOAD", &preload)
        .env_remove("STREAMALLOC_CONF")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "stdout: {stdout}\nstderr: {stderr}");
    assert!(stdout.contains("preload active: yes"), "{stdout}");
    assert!(stdout.contains("failures=0"), "{stdout}");
    // The interposed functions share the library's last-error slot: set by the refusal,
    // cleared by the next call, which succeeded.
    assert!(
        stdout.contains(
            "last error after cudaMalloc(NULL, 8): streamalloc preload: cudaMalloc: devPtr is null"
        ),
        "{stdout}"
    );
    // Every call reached the runtime, arguments intact (the data check passed); the
    // zero-argument ones (cudaMalloc(NULL, 8)) never did.
    assert!(
        stdout.contains("fake: mallocs=10 frees=10 null_frees=1 async_mallocs=10 async_frees=10"),
        "{stdout}"
    );
    // One warning, however many calls.
    let warnings = stderr
        .lines()
        .filter(|l| l.contains("using CUDA's own allocator"))
        .count();
    assert_eq!(warnings, 1, "{stderr}");
    assert!(!stderr.contains("panic"), "{stderr}");
}

/// The stand-in runtime of the capture test: `cudaStreamIsCapturing` says that stream
/// 0xCA97 is being captured and fails with `cudaErrorStreamCaptureImplicit` for 0x906 (as
/// the legacy stream does while another stream captures in global mode); its own
/// allocations come from an arena the program can recognise (`fake_runtime_owns`).
const FAKE_CUDART_CAPTURE: &str = r#"
#include <stdio.h>
#include <stdint.h>
static char arena[1 << 20];
static size_t used;
static int mallocs, frees, async_mallocs, async_frees, capture_queries;
static void report(void) __attribute__((destructor));
static void report(void) {
    printf("fake: mallocs=%d frees=%d async_mallocs=%d async_frees=%d\n",
           mallocs, frees, async_mallocs, async_frees);
    printf("fake: capture_queries=%d\n", capture_queries);
}
static void* take(size_t n) {
    void* p = arena + used;
    used += (n + 255) & ~(size_t)255;
    return used <= sizeof arena ? p : NULL;
}
int fake_runtime_owns(void* p) { return (char*)p >= arena && (char*)p < arena + sizeof arena; }
int cudaGetDevice(int* d) { *d = 0; return 0; }
int cudaStreamIsCapturing(void* s, int* status) {
    capture_queries++;
    if (s == (void*)0x906) return 906;
    *status = s == (void*)0xCA97 ? 1 : 0;
    return 0;
}
int cudaMalloc(void** p, size_t n) { mallocs++; *p = take(n); return *p ? 0 : 2; }
int cudaFree(void* p) { if (p) frees++; return 0; }
int cudaMallocAsync(void** p, size_t n, void* s) { (void)s; async_mallocs++; *p = take(n); return *p ? 0 : 2; }
int cudaFreeAsync(void* p, void* s) { (void)s; async_frees++; return fake_runtime_owns(p) ? 0 : 1; }
"#;

/// The stand-in driver, after `DRIVER_COMMON`: one device without virtual memory
/// management, host memory as device memory, events that are always complete, and the same
/// capturing stream as the runtime's.
const FAKE_CUDA: &str = r#"
CUresult cuDeviceGetCount(int* n) { *n = 1; return 0; }
CUresult cuDeviceCanAccessPeer(int* can, int d, int peer) { (void)d; (void)peer; *can = 0; return 0; }
CUresult cuDeviceGetAttribute(int* v, int attr, int d) { (void)attr; (void)d; *v = 0; return 0; }
CUresult cuMemAlloc_v2(uint64_t* p, size_t n) {
    void* m = NULL;
    if (posix_memalign(&m, 2 << 20, n)) return 2;
    *p = (uint64_t)(uintptr_t)m;
    return 0;
}
CUresult cuMemFree_v2(uint64_t p) { free((void*)(uintptr_t)p); return 0; }
CUresult cuStreamIsCapturing(void* s, int* status) {
    if (s == (void*)0x906) return 906;
    *status = s == (void*)0xCA97 ? 1 : 0;
    return 0;
}
OK(cuEventRecord) OK(cuEventQuery) OK(cuStreamWaitEvent)
"#;

const CAPTURE_PROGRAM: &str = r#"
#include <stdio.h>
int cudaMalloc(void**, size_t); int cudaFree(void*);
int cudaMallocAsync(void**, size_t, void*); int cudaFreeAsync(void*, void*);
int fake_runtime_owns(void*);
#define EAGER ((void*)0x1234)
#define CAPTURING ((void*)0xCA97)
#define IMPLICIT ((void*)0x906)
static int failures;
static void check(int ok, const char* what) {
    printf("%s: %s\n", ok ? "ok" : "FAILED", what);
    failures += !ok;
}
int main(void) {
    void *eager = NULL, *graph = NULL, *implicit = NULL, *plain = NULL;
    check(cudaMallocAsync(&eager, 4096, EAGER) == 0 && eager && !fake_runtime_owns(eager),
          "cudaMallocAsync on an eager stream is served by streamalloc");
    check(cudaMallocAsync(&graph, 4096, CAPTURING) == 0 && fake_runtime_owns(graph),
          "cudaMallocAsync on a captured stream is the runtime's (a graph allocation)");
    check(cudaMallocAsync(&implicit, 4096, IMPLICIT) == 0 && fake_runtime_owns(implicit),
          "cudaMallocAsync where the capture query fails is the runtime's");
    check(cudaFreeAsync(graph, CAPTURING) == 0, "cudaFreeAsync of a graph allocation in the capture reaches the runtime");
    check(cudaFreeAsync(implicit, EAGER) == 0, "cudaFreeAsync of a graph allocation outside a capture reaches the runtime");
    check(cudaFreeAsync(eager, CAPTURING) == 900, "cudaFreeAsync of our block on a captured stream is refused");
    check(cudaFreeAsync(eager, EAGER) == 0, "the same block is then freed on an eager stream");
    check(cudaMalloc(&plain, 4096) == 0 && plain && !fake_runtime_owns(plain), "cudaMalloc is served by streamalloc");
    check(cudaFree(plain) == 0, "cudaFree of our block");
    printf("failures=%d\n", failures);
    return failures != 0;
}
"#;

#[test]
fn stream_ordered_calls_under_capture_reach_the_runtime() {
    // NVIDIA's versioning, plus the program's probe of the arena.
    let stand_ins = StandIns {
        runtime: &[FAKE_CUDART_CAPTURE],
        runtime_extra_exports: "fake_*;",
        driver: &[DRIVER_COMMON, FAKE_CUDA],
        program: CAPTURE_PROGRAM,
        program_libs: &[],
    };
    let Some((dir, program)) = build("preload_capture", &stand_ins) else {
        eprintln!("skipped: no C compiler (cc)");
        return;
    };
    let preload = preload_library();

    let out = Command::new(&program)
        .env("LD_PRELOAD", &preload)
        .env("LD_LIBRARY_PATH", &dir)
        .env("STREAMALLOC_STATS_AT_EXIT", "1")
        .env_remove("STREAMALLOC_CONF")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "stdout: {stdout}\nstderr: {stderr}");
    assert!(stdout.contains("failures=0"), "{stdout}\n{stderr}");
    // The runtime saw exactly the two graph allocations and their frees; streamalloc
    // served the eager cudaMallocAsync and the cudaMalloc.
    assert!(
        stdout.contains("fake: mallocs=0 frees=0 async_mallocs=2 async_frees=2"),
        "{stdout}"
    );
    let stats = stderr
        .lines()
        .find(|l| l.starts_with("streamalloc: exit"))
        .unwrap_or_else(|| panic!("no exit line: {stderr}"));
    assert!(
        stats.contains(" allocs=2 ") && stats.contains(" frees=2 "),
        "{stats}"
    );
    assert!(!stderr.contains("using CUDA's own allocator"), "{stderr}");
    // The refused free is said once, naming the reason.
    assert_eq!(
        stderr
            .lines()
            .filter(|l| l.contains("on a stream being captured"))
            .count(),
        1,
        "{stderr}"
    );
    assert!(!stderr.contains("panic"), "{stderr}");
}
