//! Peer access without a GPU: the CUDA backend, under the interposer, on a stand-in driver
//! of two devices that map memory through the VMM API and can reach each other
//! (`cuDeviceCanAccessPeer`). Every `cuMemSetAccess` is logged with the devices it names.
//! A program allocates on device 0, then on device 1, then on device 0 again: device 0's
//! mappings name only itself until device 1 is used; then device 1 is granted device 0's
//! mappings made so far, device 1's mappings name both, and so do device 0's new ones.
//! Skipped (with a message) when `cc` is not available.

use std::path::{Path, PathBuf};
use std::process::Command;

/// The stand-in runtime: the current device, and allocation calls that are never reached
/// (the interposer serves them).
const FAKE_CUDART: &str = r#"
static int device;
int cudaGetDevice(int* d) { *d = device; return 0; }
int cudaSetDevice(int d) { device = d; return 0; }
int cudaStreamIsCapturing(void* s, int* status) { (void)s; *status = 0; return 0; }
int cudaMalloc(void** p, unsigned long n) { (void)p; (void)n; return 2; }
int cudaFree(void* p) { (void)p; return 0; }
int cudaMallocAsync(void** p, unsigned long n, void* s) { (void)p; (void)n; (void)s; return 2; }
int cudaFreeAsync(void* p, void* s) { (void)p; (void)s; return 0; }
"#;

/// The stand-in driver: two devices with virtual memory management, addresses handed out
/// from a counter (never touched), and a log line per `cuMemSetAccess`: `access ID,ID`.
const FAKE_CUDA: &str = r#"
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
typedef int CUresult;
typedef struct { int type; int id; } CUmemLocation;
typedef struct { CUmemLocation location; int flags; } CUmemAccessDesc;
static __thread void* current;
static int ctx_token[2], event_token;
static uint64_t next_va = 0x7e0000000000ull, next_handle = 1;
CUresult cuInit(unsigned f) { (void)f; return 0; }
CUresult cuDeviceGetCount(int* n) { *n = 2; return 0; }
CUresult cuDeviceGet(int* d, int ordinal) { *d = ordinal; return 0; }
CUresult cuDeviceTotalMem_v2(size_t* bytes, int d) { (void)d; *bytes = (size_t)80 << 30; return 0; }
/* FAKE_PEERS=0: devices the hardware does not link; a grant naming another device fails. */
static int linked(void) { const char* e = getenv("FAKE_PEERS"); return !e || e[0] != '0'; }
CUresult cuDeviceCanAccessPeer(int* can, int d, int peer) { *can = d != peer && linked(); return 0; }
/* 102: CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED; no descriptor export. */
CUresult cuDeviceGetAttribute(int* v, int attr, int d) { (void)d; *v = attr == 102; return 0; }
CUresult cuDevicePrimaryCtxRetain(void** ctx, int d) { *ctx = &ctx_token[d & 1]; return 0; }
CUresult cuCtxGetCurrent(void** ctx) { *ctx = current; return 0; }
CUresult cuCtxSetCurrent(void* ctx) { current = ctx; return 0; }
CUresult cuCtxPushCurrent_v2(void* ctx) { current = ctx; return 0; }
CUresult cuCtxPopCurrent_v2(void** ctx) { if (ctx) *ctx = current; current = NULL; return 0; }
CUresult cuCtxSynchronize(void) { return 0; }
CUresult cuMemGetInfo_v2(size_t* f, size_t* t) { *f = *t = (size_t)80 << 30; return 0; }
CUresult cuEventCreate(void** e, unsigned f) { (void)f; *e = &event_token; return 0; }
CUresult cuStreamIsCapturing(void* s, int* status) { (void)s; *status = 0; return 0; }
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
CUresult cuMemSetAccess(uint64_t p, size_t size, const CUmemAccessDesc* desc, size_t count) {
    (void)p; (void)size;
    printf("access ");
    for (size_t i = 0; i < count; i++) printf(i ? ",%d" : "%d", desc[i].location.id);
    printf("\n");
    fflush(stdout);
    return count > 1 && !linked() ? 1 : 0;
}
CUresult cuGetErrorName(CUresult c, const char** s) { (void)c; *s = "FAKE_ERROR"; return 0; }
CUresult cuGetErrorString(CUresult c, const char** s) { (void)c; *s = "fake driver error"; return 0; }
#define OK(name) CUresult name() { return 0; }
OK(cuMemMap) OK(cuMemUnmap) OK(cuMemRelease) OK(cuMemAddressFree)
OK(cuMemAlloc_v2) OK(cuMemFree_v2) OK(cuThreadExchangeStreamCaptureMode)
OK(cuEventDestroy_v2) OK(cuEventRecord) OK(cuEventQuery) OK(cuEventSynchronize)
OK(cuStreamWaitEvent) OK(cuStreamCreate) OK(cuStreamDestroy_v2) OK(cuStreamSynchronize)
OK(cuMemsetD8Async) OK(cuMemcpyDtoDAsync_v2) OK(cuMemcpyDtoH_v2) OK(cuMemcpyHtoD_v2)
OK(cuStreamBeginCapture_v2) OK(cuStreamEndCapture) OK(cuGraphDestroy)
OK(cuMemExportToShareableHandle) OK(cuMemImportFromShareableHandle)
OK(cuMemHostAlloc) OK(cuMemFreeHost) OK(cuMemcpyDtoHAsync_v2) OK(cuMemcpyHtoDAsync_v2)
"#;

const PROGRAM: &str = r#"
#include <stdio.h>
int cudaSetDevice(int); int cudaMalloc(void**, unsigned long);
int main(void) {
    void *a = 0, *b = 0, *c = 0;
    int failures = 0;
    cudaSetDevice(0);
    failures += cudaMalloc(&a, 64ul << 20) != 0 || !a;
    printf("device 1 in use\n");
    fflush(stdout);
    cudaSetDevice(1);
    failures += cudaMalloc(&b, 64ul << 20) != 0 || !b;
    printf("device 0 again\n");
    fflush(stdout);
    cudaSetDevice(0);
    failures += cudaMalloc(&c, 256ul << 20) != 0 || !c;
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

/// Builds the stand-ins and the program in `name` and runs it under the interposer with
/// `FAKE_PEERS` set to `peers`; `None` without a C compiler. Returns its stdout.
fn run(name: &str, peers: &str) -> Option<String> {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(name);
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
        return None;
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
        &format!("-Wl,-rpath,{}", s(&dir)),
    ]));
    let out = Command::new(&program)
        .env("LD_PRELOAD", preload_library())
        .env("LD_LIBRARY_PATH", &dir)
        .env("STREAMALLOC_CONF", "expandable_segments:true")
        .env("FAKE_PEERS", peers)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success() && stdout.contains("failures=0"),
        "stdout: {stdout}\nstderr: {stderr}"
    );
    Some(stdout)
}

#[test]
fn devices_of_one_process_reach_each_others_mappings() {
    let Some(stdout) = run("preload_peers", "1") else {
        eprintln!("skipped: no C compiler (cc)");
        return;
    };
    // The log cut where the program switches devices.
    let phases: Vec<Vec<&str>> = stdout
        .split("device ")
        .map(|phase| phase.lines().filter(|l| l.starts_with("access ")).collect())
        .collect();
    let [alone, with_peer, again] = &phases[..] else {
        panic!("three phases expected: {stdout}");
    };
    assert!(
        !alone.is_empty() && alone.iter().all(|l| *l == "access 0"),
        "device 0 alone names only itself: {alone:?}"
    );
    let first_shared = with_peer
        .iter()
        .position(|l| *l == "access 1,0")
        .unwrap_or_else(|| panic!("device 1's mappings name both: {with_peer:?}"));
    assert_eq!(
        with_peer[..first_shared]
            .iter()
            .filter(|l| **l == "access 1")
            .count(),
        alone.len(),
        "device 1 is granted each of device 0's mappings before mapping its own: {with_peer:?}"
    );
    assert!(
        !again.is_empty() && again.iter().all(|l| *l == "access 0,1"),
        "device 0's new mappings name both: {again:?}"
    );
}

#[test]
fn devices_the_hardware_does_not_link_are_granted_nothing() {
    // A grant naming the other device would fail there, and with it every mapping.
    let Some(stdout) = run("preload_no_peers", "0") else {
        eprintln!("skipped: no C compiler (cc)");
        return;
    };
    let grants: Vec<&str> = stdout
        .lines()
        .filter(|l| l.starts_with("access "))
        .collect();
    assert!(
        !grants.is_empty() && grants.iter().all(|l| *l == "access 0" || *l == "access 1"),
        "{grants:?}"
    );
}
