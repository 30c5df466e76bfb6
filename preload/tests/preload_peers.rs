//! Peer access without a GPU: the CUDA backend, under the interposer, on a stand-in driver
//! of two devices that map memory through the VMM API and can reach each other
//! (`cuDeviceCanAccessPeer`). Every `cuMemSetAccess` is logged with the devices it names.
//! A program allocates on device 0, then on device 1, then on device 0 again: device 0's
//! mappings name only itself until device 1 is used; then device 1 is granted device 0's
//! mappings made so far, device 1's mappings name both, and so do device 0's new ones.
//! Skipped (with a message) when `cc` is not available.

use std::process::Command;

mod support;
use support::{
    build, preload_library, StandIns, DRIVER_COMMON, DRIVER_VMM, RUNTIME_SERVED_BY_INTERPOSER,
};

/// The stand-in runtime, after `RUNTIME_SERVED_BY_INTERPOSER`: the current device.
const FAKE_CUDART: &str = r#"
static int device;
int cudaGetDevice(int* d) { *d = device; return 0; }
int cudaSetDevice(int d) { device = d; return 0; }
"#;

/// The stand-in driver, after `DRIVER_COMMON` and `DRIVER_VMM`: two devices, and a log line
/// per `cuMemSetAccess`: `access ID,ID`.
const FAKE_CUDA: &str = r#"
typedef struct { int type; int id; } CUmemLocation;
typedef struct { CUmemLocation location; int flags; } CUmemAccessDesc;
/* FAKE_PEERS=0: devices the hardware does not link; a grant naming another device fails. */
static int linked(void) { const char* e = getenv("FAKE_PEERS"); return !e || e[0] != '0'; }
CUresult cuDeviceGetCount(int* n) { *n = 2; return 0; }
CUresult cuDeviceCanAccessPeer(int* can, int d, int peer) { *can = d != peer && linked(); return 0; }
CUresult cuStreamIsCapturing(void* s, int* status) { (void)s; *status = 0; return 0; }
CUresult cuMemSetAccess(uint64_t p, size_t size, const CUmemAccessDesc* desc, size_t count) {
    (void)p; (void)size;
    printf("access ");
    for (size_t i = 0; i < count; i++) printf(i ? ",%d" : "%d", desc[i].location.id);
    printf("\n");
    fflush(stdout);
    return count > 1 && !linked() ? 1 : 0;
}
OK(cuEventRecord) OK(cuEventQuery) OK(cuStreamWaitEvent)
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

/// Builds the stand-ins and the program in `name` and runs it under the interposer with
/// `FAKE_PEERS` set to `peers`; `None` without a C compiler. Returns its stdout.
fn run(name: &str, peers: &str) -> Option<String> {
    let stand_ins = StandIns {
        runtime: &[RUNTIME_SERVED_BY_INTERPOSER, FAKE_CUDART],
        runtime_extra_exports: "",
        driver: &[DRIVER_COMMON, DRIVER_VMM, FAKE_CUDA],
        program: PROGRAM,
        program_libs: &[],
    };
    let (dir, program) = build(name, &stand_ins)?;
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
