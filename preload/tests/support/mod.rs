//! What the interposer's tests without a GPU share: stand-in CUDA libraries and a C program
//! built with `cc` into a folder of their own, the interposer this test run built, and the
//! parts of the stand-in driver that every test needs alike. Each test file uses the part
//! it needs.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::Command;

/// Runs `cc`: true on success, false when there is no compiler; a failed compilation
/// panics with its messages.
pub fn cc(args: &[&str]) -> bool {
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

/// The `libstreamalloc_preload.so` this test run built.
pub fn preload_library() -> PathBuf {
    // The test runs as target/<profile>/deps/<test>-<hash>.
    let exe = std::env::current_exe().unwrap();
    let deps = exe.parent().unwrap();
    // `cargo build` copies the library up a level; `cargo test` alone leaves it in deps/
    // (and an earlier build's copy up there may be stale): the newer of the two.
    let candidates = [
        deps.parent().unwrap().join("libstreamalloc_preload.so"),
        deps.join("libstreamalloc_preload.so"),
    ];
    let preload = candidates
        .into_iter()
        .filter_map(|path| Some((path.metadata().ok()?.modified().ok()?, path)))
        .max()
        .map(|(_, path)| path)
        .expect("libstreamalloc_preload.so is built beside the test");
    assert!(preload.is_file(), "{preload:?} missing");
    preload
}

/// The sources of one test's stand-ins.
pub struct StandIns<'a> {
    /// The stand-in `libcudart.so`, in parts joined in order, its `cuda*` symbols
    /// versioned like NVIDIA's.
    pub runtime: &'a [&'a str],
    /// Symbols the runtime exports besides `cuda*` (for the program's probes), e.g. `fake_*;`.
    pub runtime_extra_exports: &'a str,
    /// The stand-in `libcuda.so` (the first name cudarc's loader tries), in parts joined
    /// in order; none: no driver.
    pub driver: &'a [&'a str],
    /// The C program.
    pub program: &'a str,
    /// Libraries the program links besides the runtime, e.g. `-ldl`.
    pub program_libs: &'a [&'a str],
}

/// Writes and compiles `stand_ins` into a fresh folder `name` of the test run's temporary
/// folder, the program finding the libraries there (`rpath`). Returns the folder and the
/// program, or `None` without a C compiler.
pub fn build(name: &str, stand_ins: &StandIns) -> Option<(PathBuf, PathBuf)> {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(name);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let s = |p: &Path| p.to_str().unwrap().to_owned();
    std::fs::write(dir.join("fake_cudart.c"), stand_ins.runtime.concat()).unwrap();
    std::fs::write(
        dir.join("fake_cudart.map"),
        format!(
            "libcudart.so.13 {{ global: cuda*; {} local: *; }};\n",
            stand_ins.runtime_extra_exports
        ),
    )
    .unwrap();
    std::fs::write(dir.join("main.c"), stand_ins.program).unwrap();
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
    if !stand_ins.driver.is_empty() {
        std::fs::write(dir.join("fake_cuda.c"), stand_ins.driver.concat()).unwrap();
        assert!(cc(&[
            "-shared",
            "-fPIC",
            "-o",
            &s(&dir.join("libcuda.so")),
            &s(&dir.join("fake_cuda.c")),
        ]));
    }
    let program = dir.join("main");
    let (out, main, lib_dir) = (
        s(&program),
        s(&dir.join("main.c")),
        format!("-L{}", s(&dir)),
    );
    let rpath = format!("-Wl,-rpath,{}", s(&dir));
    let mut args = vec!["-o", &out, &main, &lib_dir, "-lcudart"];
    args.extend(stand_ins.program_libs);
    args.push(&rpath);
    assert!(cc(&args));
    Some((dir, program))
}

/// A stand-in runtime's part for tests whose allocations the interposer serves on the
/// stand-in driver: no stream is capturing, and the runtime's own allocation calls, never
/// reached, fail if they are.
pub const RUNTIME_SERVED_BY_INTERPOSER: &str = r#"
int cudaStreamIsCapturing(void* s, int* status) { (void)s; *status = 0; return 0; }
int cudaMalloc(void** p, unsigned long n) { (void)p; (void)n; return 2; }
int cudaFree(void* p) { (void)p; return 0; }
int cudaMallocAsync(void** p, unsigned long n, void* s) { (void)p; (void)n; (void)s; return 2; }
int cudaFreeAsync(void* p, void* s) { (void)p; (void)s; return 0; }
"#;

/// The stand-in driver's common part: one primary context per device, contexts made
/// current as the driver would, 80 GiB devices, events created from one token, error
/// names, and a success for every call no test looks at (`OK`, also for the tests' own).
pub const DRIVER_COMMON: &str = r#"
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
typedef int CUresult;
static __thread void* current;
static int ctx_token[2], event_token;
CUresult cuInit(unsigned f) { (void)f; return 0; }
CUresult cuDeviceGet(int* d, int ordinal) { *d = ordinal; return 0; }
CUresult cuDeviceTotalMem_v2(size_t* bytes, int d) { (void)d; *bytes = (size_t)80 << 30; return 0; }
CUresult cuDevicePrimaryCtxRetain(void** ctx, int d) { *ctx = &ctx_token[d & 1]; return 0; }
CUresult cuCtxGetCurrent(void** ctx) { *ctx = current; return 0; }
CUresult cuCtxSetCurrent(void* ctx) { current = ctx; return 0; }
CUresult cuCtxPushCurrent_v2(void* ctx) { current = ctx; return 0; }
CUresult cuCtxPopCurrent_v2(void** ctx) { if (ctx) *ctx = current; current = NULL; return 0; }
CUresult cuCtxSynchronize(void) { return 0; }
CUresult cuMemGetInfo_v2(size_t* f, size_t* t) { *f = *t = (size_t)80 << 30; return 0; }
CUresult cuEventCreate(void** e, unsigned f) { (void)f; *e = &event_token; return 0; }
CUresult cuGetErrorName(CUresult c, const char** s) { (void)c; *s = "FAKE_ERROR"; return 0; }
CUresult cuGetErrorString(CUresult c, const char** s) { (void)c; *s = "fake driver error"; return 0; }
#define OK(name) CUresult name() { return 0; }
OK(cuThreadExchangeStreamCaptureMode)
OK(cuEventDestroy_v2) OK(cuEventSynchronize)
OK(cuStreamCreate) OK(cuStreamDestroy_v2) OK(cuStreamSynchronize)
OK(cuMemsetD8Async) OK(cuMemcpyDtoDAsync_v2) OK(cuMemcpyDtoH_v2) OK(cuMemcpyHtoD_v2)
OK(cuStreamBeginCapture_v2) OK(cuStreamEndCapture) OK(cuGraphDestroy)
OK(cuMemExportToShareableHandle) OK(cuMemImportFromShareableHandle)
OK(cuMemHostAlloc) OK(cuMemFreeHost) OK(cuMemcpyDtoHAsync_v2) OK(cuMemcpyHtoDAsync_v2)
"#;

/// The stand-in driver's virtual memory management: devices that support it (attribute
/// 102) without descriptor export, addresses handed out from a counter (never touched),
/// physical allocations that are handles only, and whole segments never used.
pub const DRIVER_VMM: &str = r#"
static uint64_t next_va = 0x7e0000000000ull, next_handle = 1;
CUresult cuDeviceGetAttribute(int* v, int attr, int d) { (void)d; *v = attr == 102; return 0; }
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
OK(cuMemMap) OK(cuMemUnmap) OK(cuMemRelease) OK(cuMemAddressFree)
OK(cuMemAlloc_v2) OK(cuMemFree_v2)
"#;
