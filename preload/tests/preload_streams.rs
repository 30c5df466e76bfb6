//! Streams a program destroys, under the interposer, on a stand-in driver that reports any
//! call naming a destroyed stream (on a GPU: a dangling handle). Each round allocates and
//! frees on a new stream with `cudaMallocAsync` / `cudaFreeAsync`, destroys it, then
//! allocates on a long-lived stream under a memory limit that leaves it the dead streams'
//! memory to take. The interposer marks every stream a program passes it volatile, so no
//! driver call may name a destroyed one. Skipped (with a message) when `cc` is not
//! available.

use std::path::{Path, PathBuf};
use std::process::Command;

const FAKE_CUDART: &str = r#"
int cudaGetDevice(int* d) { *d = 0; return 0; }
int cudaStreamIsCapturing(void* s, int* status) { (void)s; *status = 0; return 0; }
int cudaMalloc(void** p, unsigned long n) { (void)p; (void)n; return 2; }
int cudaFree(void* p) { (void)p; return 0; }
int cudaMallocAsync(void** p, unsigned long n, void* s) { (void)p; (void)n; (void)s; return 2; }
int cudaFreeAsync(void* p, void* s) { (void)p; (void)s; return 0; }
"#;

/// One device with virtual memory management; streams are plain handles, and
/// `fake_destroy_stream` makes one dead: a later call naming it prints `dead stream:` and
/// fails as the driver may.
const FAKE_CUDA: &str = r#"
#include <stdint.h>
#include <stdio.h>
typedef int CUresult;
static __thread void* current;
static int ctx_token, event_token;
static uint64_t next_va = 0x7e0000000000ull, next_handle = 1;
static void* dead[64];
static int ndead;
void fake_destroy_stream(void* s) { if (ndead < 64) dead[ndead++] = s; }
static int is_dead(void* s, const char* call) {
    for (int i = 0; i < ndead; i++)
        if (dead[i] == s) { printf("dead stream: %s on %p\n", call, s); fflush(stdout); return 1; }
    return 0;
}
CUresult cuInit(unsigned f) { (void)f; return 0; }
CUresult cuDeviceGetCount(int* n) { *n = 1; return 0; }
CUresult cuDeviceGet(int* d, int ordinal) { *d = ordinal; return 0; }
CUresult cuDeviceTotalMem_v2(size_t* bytes, int d) { (void)d; *bytes = (size_t)80 << 30; return 0; }
CUresult cuDeviceCanAccessPeer(int* can, int d, int peer) { (void)d; (void)peer; *can = 0; return 0; }
CUresult cuDeviceGetAttribute(int* v, int attr, int d) { (void)d; *v = attr == 102; return 0; }
CUresult cuDevicePrimaryCtxRetain(void** ctx, int d) { (void)d; *ctx = &ctx_token; return 0; }
CUresult cuCtxGetCurrent(void** ctx) { *ctx = current; return 0; }
CUresult cuCtxSetCurrent(void* ctx) { current = ctx; return 0; }
CUresult cuCtxPushCurrent_v2(void* ctx) { current = ctx; return 0; }
CUresult cuCtxPopCurrent_v2(void** ctx) { if (ctx) *ctx = current; current = NULL; return 0; }
CUresult cuCtxSynchronize(void) { return 0; }
CUresult cuMemGetInfo_v2(size_t* f, size_t* t) { *f = *t = (size_t)80 << 30; return 0; }
CUresult cuEventCreate(void** e, unsigned f) { (void)f; *e = &event_token; return 0; }
CUresult cuEventRecord(void* e, void* s) { (void)e; return is_dead(s, "cuEventRecord") ? 400 : 0; }
CUresult cuStreamWaitEvent(void* s, void* e, unsigned f) {
    (void)e; (void)f; return is_dead(s, "cuStreamWaitEvent") ? 400 : 0;
}
CUresult cuStreamIsCapturing(void* s, int* status) {
    *status = 0; return is_dead(s, "cuStreamIsCapturing") ? 400 : 0;
}
/* Events complete when queried: the program's work is always done. */
CUresult cuEventQuery(void* e) { (void)e; return 0; }
CUresult cuMemGetAllocationGranularity(size_t* g, const void* prop, int option) {
    (void)prop; (void)option; *g = 2 << 20; return 0;
}
CUresult cuMemAddressReserve(uint64_t* p, size_t size, size_t align, uint64_t addr, unsigned long long f) {
    (void)align; (void)addr; (void)f;
    *p = next_va;
    next_va += (size + (2 << 20) - 1) / (2 << 20) * (2 << 20) + (2 << 20);
    return 0;
}
CUresult cuMemCreate(uint64_t* h, size_t size, const void* prop, unsigned long long f) {
    (void)size; (void)prop; (void)f; *h = next_handle++; return 0;
}
CUresult cuGetErrorName(CUresult c, const char** s) { (void)c; *s = "FAKE_ERROR"; return 0; }
CUresult cuGetErrorString(CUresult c, const char** s) { (void)c; *s = "fake driver error"; return 0; }
#define OK(name) CUresult name() { return 0; }
OK(cuMemMap) OK(cuMemUnmap) OK(cuMemRelease) OK(cuMemAddressFree) OK(cuMemSetAccess)
OK(cuMemAlloc_v2) OK(cuMemFree_v2) OK(cuThreadExchangeStreamCaptureMode)
OK(cuEventDestroy_v2) OK(cuEventSynchronize)
OK(cuStreamCreate) OK(cuStreamDestroy_v2) OK(cuStreamSynchronize)
OK(cuMemsetD8Async) OK(cuMemcpyDtoDAsync_v2) OK(cuMemcpyDtoH_v2) OK(cuMemcpyHtoD_v2)
OK(cuStreamBeginCapture_v2) OK(cuStreamEndCapture) OK(cuGraphDestroy)
OK(cuMemExportToShareableHandle) OK(cuMemImportFromShareableHandle)
OK(cuMemHostAlloc) OK(cuMemFreeHost) OK(cuMemcpyDtoHAsync_v2) OK(cuMemcpyHtoDAsync_v2)
"#;

const PROGRAM: &str = r#"
#include <stdio.h>
#include <stdint.h>
int cudaMallocAsync(void**, unsigned long, void*); int cudaFreeAsync(void*, void*);
void fake_destroy_stream(void*);
#define MAIN ((void*)0x50)
int main(void) {
    int failures = 0;
    for (uintptr_t round = 0; round < 40; round++) {
        void* stream = (void*)(0x1000 + round);
        void* theirs[4] = {0};
        for (int k = 0; k < 4; k++)
            failures += cudaMallocAsync(&theirs[k], ((round * 7 + k * 5) % 13 + 1) << 20, stream) != 0;
        for (int k = 0; k < 4; k++) failures += cudaFreeAsync(theirs[k], stream) != 0;
        fake_destroy_stream(stream);
        void* ours[6] = {0};
        for (int k = 0; k < 6; k++)
            failures += cudaMallocAsync(&ours[k], ((round * 5 + k * 3) % 11 + 1) << 20, MAIN) != 0;
        for (int k = 0; k < 6; k++) failures += cudaFreeAsync(ours[k], MAIN) != 0;
    }
    printf("failures=%d\n", failures);
    return failures != 0;
}
"#;

fn cc(args: &[&str]) -> bool {
    let out = Command::new("cc").args(args).output();
    match out {
        Ok(out) if out.status.success() => true,
        Ok(out) => panic!(
            "cc {args:?} failed: {}",
            String::from_utf8_lossy(&out.stderr)
        ),
        Err(_) => false,
    }
}

fn preload_library() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let deps = exe.parent().unwrap();
    [
        deps.parent().unwrap().join("libstreamalloc_preload.so"),
        deps.join("libstreamalloc_preload.so"),
    ]
    .into_iter()
    .filter_map(|path| Some((path.metadata().ok()?.modified().ok()?, path)))
    .max()
    .map(|(_, path)| path)
    .expect("libstreamalloc_preload.so is built beside the test")
}

#[test]
fn no_driver_call_names_a_stream_the_program_destroyed() {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("preload_streams");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let s = |p: &Path| p.to_str().unwrap().to_owned();
    std::fs::write(dir.join("fake_cudart.c"), FAKE_CUDART).unwrap();
    std::fs::write(
        dir.join("fake_cudart.map"),
        "libcudart.so.13 { global: cuda*; local: *; };\n",
    )
    .unwrap();
    std::fs::write(dir.join("fake_cuda.c"), FAKE_CUDA).unwrap();
    std::fs::write(dir.join("main.c"), PROGRAM).unwrap();
    if !cc(&[
        "-shared",
        "-fPIC",
        "-o",
        &s(&dir.join("libcudart.so")),
        &s(&dir.join("fake_cudart.c")),
        &format!("-Wl,--version-script={}", s(&dir.join("fake_cudart.map"))),
    ]) {
        eprintln!("skipped: no C compiler (cc)");
        return;
    }
    assert!(cc(&[
        "-shared",
        "-fPIC",
        "-o",
        &s(&dir.join("libcuda.so")),
        &s(&dir.join("fake_cuda.c")),
    ]));
    let program = dir.join("main");
    assert!(cc(&[
        "-o",
        &s(&program),
        &s(&dir.join("main.c")),
        &format!("-L{}", s(&dir)),
        "-lcudart",
        // The stand-in driver's `fake_destroy_stream` for the program; the same library
        // streamalloc then loads.
        "-lcuda",
        &format!("-Wl,-rpath,{}", s(&dir)),
    ]));
    let out = Command::new(&program)
        .env("LD_PRELOAD", preload_library())
        .env("LD_LIBRARY_PATH", &dir)
        .env(
            "STREAMALLOC_CONF",
            "expandable_segments:true,memory_limit:96MiB",
        )
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success() && stdout.contains("failures=0"),
        "stdout: {stdout}\nstderr: {stderr}"
    );
    assert!(!stdout.contains("dead stream:"), "{stdout}");
}
