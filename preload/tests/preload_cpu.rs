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
//! Skipped (with a message) when `cc` is not available.

use std::path::{Path, PathBuf};
use std::process::Command;

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

const VERSION_SCRIPT: &str = "libcudart.so.13 { global: cuda*; local: *; };\n";

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
    if (cudaFree(NULL) != 0) failures++;
    if (cudaMalloc(NULL, 8) != 1) failures++;
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
    // The test runs as target/<profile>/deps/preload_cpu-<hash>.
    let exe = std::env::current_exe().unwrap();
    let deps = exe.parent().unwrap();
    let uplifted = deps.parent().unwrap().join("libstreamalloc_preload.so");
    // `cargo build` copies the library up a level; `cargo test` alone leaves it in deps/.
    if uplifted.is_file() {
        uplifted
    } else {
        deps.join("libstreamalloc_preload.so")
    }
}

#[test]
fn calls_reach_the_real_runtime_when_no_gpu_is_there() {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("preload_cpu");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let s = |p: &Path| p.to_str().unwrap().to_owned();
    std::fs::write(dir.join("fake.c"), FAKE_CUDART).unwrap();
    std::fs::write(dir.join("fake.map"), VERSION_SCRIPT).unwrap();
    std::fs::write(dir.join("main.c"), PROGRAM).unwrap();
    let lib = dir.join("libcudart.so");
    if !cc(&[
        "-shared",
        "-fPIC",
        "-o",
        &s(&lib),
        &s(&dir.join("fake.c")),
        &format!("-Wl,--version-script={}", s(&dir.join("fake.map"))),
    ]) {
        eprintln!("skipped: no C compiler (cc)");
        return;
    }
    let program = dir.join("main");
    assert!(cc(&[
        "-o",
        &s(&program),
        &s(&dir.join("main.c")),
        &format!("-L{}", s(&dir)),
        "-lcudart",
        "-ldl",
        &format!("-Wl,-rpath,{}", s(&dir)),
    ]));
    let preload = preload_library();
    assert!(preload.is_file(), "{preload:?} missing");

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
