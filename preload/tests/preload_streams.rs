//! Streams a program destroys, under the interposer, on a stand-in driver that reports any
//! call naming a destroyed stream (on a GPU: a dangling handle). Each round allocates and
//! frees on a new stream with `cudaMallocAsync` / `cudaFreeAsync`, destroys it, then
//! allocates on a long-lived stream under a memory limit that leaves it the dead streams'
//! memory to take. The interposer marks every stream a program passes it volatile, so no
//! driver call may name a destroyed one. Skipped (with a message) when `cc` is not
//! available.

use std::process::Command;

mod support;
use support::{
    build, preload_library, StandIns, DRIVER_COMMON, DRIVER_VMM, RUNTIME_SERVED_BY_INTERPOSER,
};

/// The stand-in runtime, after `RUNTIME_SERVED_BY_INTERPOSER`: device 0 is current.
const FAKE_CUDART: &str = r#"
int cudaGetDevice(int* d) { *d = 0; return 0; }
"#;

/// The stand-in driver, after `DRIVER_COMMON` and `DRIVER_VMM`: one device; streams are
/// plain handles, and `fake_destroy_stream` makes one dead: a later call naming it prints
/// `dead stream:` and fails as the driver may.
const FAKE_CUDA: &str = r#"
static void* dead[64];
static int ndead;
void fake_destroy_stream(void* s) { if (ndead < 64) dead[ndead++] = s; }
static int is_dead(void* s, const char* call) {
    for (int i = 0; i < ndead; i++)
        if (dead[i] == s) { printf("dead stream: %s on %p\n", call, s); fflush(stdout); return 1; }
    return 0;
}
CUresult cuDeviceGetCount(int* n) { *n = 1; return 0; }
CUresult cuDeviceCanAccessPeer(int* can, int d, int peer) { (void)d; (void)peer; *can = 0; return 0; }
CUresult cuEventRecord(void* e, void* s) { (void)e; return is_dead(s, "cuEventRecord") ? 400 : 0; }
CUresult cuStreamWaitEvent(void* s, void* e, unsigned f) {
    (void)e; (void)f; return is_dead(s, "cuStreamWaitEvent") ? 400 : 0;
}
CUresult cuStreamIsCapturing(void* s, int* status) {
    *status = 0; return is_dead(s, "cuStreamIsCapturing") ? 400 : 0;
}
/* Events complete when queried: the program's work is always done. */
CUresult cuEventQuery(void* e) { (void)e; return 0; }
OK(cuMemSetAccess)
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

#[test]
fn no_driver_call_names_a_stream_the_program_destroyed() {
    let stand_ins = StandIns {
        runtime: &[RUNTIME_SERVED_BY_INTERPOSER, FAKE_CUDART],
        runtime_extra_exports: "",
        driver: &[DRIVER_COMMON, DRIVER_VMM, FAKE_CUDA],
        program: PROGRAM,
        // The stand-in driver's `fake_destroy_stream` for the program; the same library
        // streamalloc then loads.
        program_libs: &["-lcuda"],
    };
    let Some((dir, program)) = build("preload_streams", &stand_ins) else {
        eprintln!("skipped: no C compiler (cc)");
        return;
    };
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
