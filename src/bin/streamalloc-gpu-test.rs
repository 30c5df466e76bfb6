//! `streamalloc-gpu-test`: checks the CUDA backend and the C ABI on a real GPU.
//!
//! Prints one `PASS name: detail` or `FAIL name: detail` line per check and exits non-zero
//! if any failed. Without a CUDA driver or device it prints `SKIP: why` and exits 0, so CI
//! (no GPU) can run it too.
//!
//! The checks go through the same C ABI functions PyTorch calls (`streamalloc_malloc`,
//! `streamalloc_free`, `streamalloc_record_stream`, ...), on device 0, with streams and
//! copies made directly with the driver API:
//! - `cross_stream_reuse`: a long copy on stream B reads buffer X; stream A frees X (after
//!   `record_stream(X, B)`), gets it back at once and overwrites it. B's copy must still
//!   read the original bytes: A's overwrite waited for B on the device, not on the host.
//!   A control run without `record_stream` shows the same pattern does corrupt the copy,
//!   so the check can fail.
//! - `many_threads`: threads on their own streams allocate, fill, verify and free, with
//!   `record_stream` on a shared stream; every block read back holds what its owner wrote.
//! - `capture`: allocations on a stream being captured into a CUDA graph (a cached block
//!   and a new segment) succeed and leave the capture valid.
//! - `oom`: a memory limit gives a null pointer and our out-of-memory message; lifting it
//!   lets the same request succeed.
//! - `invalid_free`: unknown and double frees are counted, never fatal.
//! - `events_not_leaked`: after `empty_cache`, no event is outstanding and every event
//!   object created was destroyed; the engine's invariants hold.

use std::ffi::{c_void, CStr};
use std::process::ExitCode;
use std::time::Instant;
use streamalloc::ffi::{
    self, streamalloc_empty_cache, streamalloc_free, streamalloc_last_error, streamalloc_malloc,
    streamalloc_record_stream, streamalloc_set_memory_fraction, StreamallocStats,
};
use streamalloc::registry::{self, CudaAllocator};
use streamalloc_allocator::backend::cuda::{driver, sys, CudaBackend};
use streamalloc_allocator::{AllocError, Allocator, Config, StreamId};

const DEVICE: i32 = 0;
const MIB: usize = 1 << 20;

type Check = Result<String, String>;

/// A named check.
type NamedCheck = (&'static str, fn(&CudaAllocator) -> Check);

fn main() -> ExitCode {
    if let Err(err) = driver::load() {
        println!("SKIP: {err}");
        return ExitCode::SUCCESS;
    }
    let allocator = match registry::global().device(DEVICE) {
        Ok(device) => device.allocator(),
        Err(err) => {
            println!("SKIP: no usable CUDA device: {err}");
            return ExitCode::SUCCESS;
        }
    };
    let checks: [NamedCheck; 6] = [
        ("cross_stream_reuse", cross_stream_reuse),
        ("many_threads", many_threads),
        ("capture", capture),
        ("oom", oom),
        ("invalid_free", invalid_free),
        ("events_not_leaked", events_not_leaked),
    ];
    let mut failed = 0;
    for (name, check) in checks {
        let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| check(allocator)))
            .unwrap_or_else(|_| Err("panicked".to_string()));
        match outcome {
            Ok(detail) => println!("PASS {name}: {detail}"),
            Err(detail) => {
                failed += 1;
                println!("FAIL {name}: {detail}");
            }
        }
    }
    println!(
        "stats: {}",
        ffi::stats::stats_json_text(registry::global(), DEVICE).unwrap_or_default()
    );
    if failed == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

// ---- Driver helpers ---------------------------------------------------------------------

fn ck(code: sys::CUresult, what: &str) -> Result<(), String> {
    if code == sys::CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(format!("{what}: {}", driver::describe(code)))
    }
}

/// Makes the device's primary context current on this thread.
fn enter(allocator: &CudaAllocator) -> Result<(), String> {
    // SAFETY: the context is retained by the backend for the life of the process.
    ck(
        unsafe { sys::cuCtxSetCurrent(allocator.backend().context()) },
        "cuCtxSetCurrent",
    )
}

/// A non-blocking stream. Never destroyed (like PyTorch's pooled streams): the engine may
/// still own free blocks on it and record an event on it when another stream takes one.
struct Stream(sys::CUstream);

impl Stream {
    fn new() -> Result<Self, String> {
        let mut stream: sys::CUstream = std::ptr::null_mut();
        ck(
            // SAFETY: valid out pointer; a context is current.
            unsafe {
                sys::cuStreamCreate(
                    &mut stream,
                    sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32,
                )
            },
            "cuStreamCreate",
        )?;
        Ok(Self(stream))
    }

    fn raw(&self) -> *mut c_void {
        self.0.cast()
    }

    fn sync(&self) -> Result<(), String> {
        // SAFETY: a live stream.
        ck(
            unsafe { sys::cuStreamSynchronize(self.0) },
            "cuStreamSynchronize",
        )
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        // SAFETY: a live stream; only waits for its work (see the type's docs).
        unsafe { sys::cuStreamSynchronize(self.0) };
    }
}

fn malloc(size: usize, stream: &Stream) -> Result<*mut c_void, String> {
    let ptr = streamalloc_malloc(size, DEVICE, stream.raw());
    if ptr.is_null() {
        Err(format!(
            "streamalloc_malloc({size}) failed: {}",
            last_error()
        ))
    } else {
        Ok(ptr)
    }
}

fn free(ptr: *mut c_void, stream: &Stream) {
    streamalloc_free(ptr, 0, DEVICE, stream.raw());
}

fn last_error() -> String {
    // SAFETY: the library returns a valid NUL-terminated thread-local string.
    unsafe { CStr::from_ptr(streamalloc_last_error()) }
        .to_string_lossy()
        .into_owned()
}

fn memset(ptr: *mut c_void, byte: u8, len: usize, stream: &Stream) -> Result<(), String> {
    // SAFETY: `ptr..ptr+len` is a live device allocation used in stream order.
    ck(
        unsafe { sys::cuMemsetD8Async(ptr as u64, byte, len, stream.0) },
        "cuMemsetD8Async",
    )
}

fn copy(dst: *mut c_void, src: *mut c_void, len: usize, stream: &Stream) -> Result<(), String> {
    // SAFETY: both ranges are live device allocations ordered on `stream`.
    ck(
        unsafe { sys::cuMemcpyDtoDAsync_v2(dst as u64, src as u64, len, stream.0) },
        "cuMemcpyDtoDAsync",
    )
}

/// Reads `len` bytes at `ptr + offset` (the caller has synchronised the writer).
fn read(ptr: *mut c_void, offset: usize, len: usize) -> Result<Vec<u8>, String> {
    let mut host = vec![0u8; len];
    ck(
        // SAFETY: the device range is live and its writers are complete; `host` has `len` bytes.
        unsafe { sys::cuMemcpyDtoH_v2(host.as_mut_ptr().cast(), ptr as u64 + offset as u64, len) },
        "cuMemcpyDtoH",
    )?;
    Ok(host)
}

fn stats() -> StreamallocStats {
    let mut out = StreamallocStats::default();
    // SAFETY: `out` is a valid, writable struct.
    unsafe { ffi::stats::streamalloc_get_stats(DEVICE, &mut out) };
    out
}

// ---- Checks -----------------------------------------------------------------------------

/// One round of the cross-stream pattern; returns (reused the block, bytes of the copy
/// that differ from the original, host ms spent in free+malloc).
fn reuse_round(record: bool) -> Result<(bool, usize, f64), String> {
    const X: usize = 256 * MIB;
    const SCRATCH: usize = 1024 * MIB;
    let (a, b) = (Stream::new()?, Stream::new()?);
    let x = malloc(X, &a)?;
    memset(x, 0x5A, X, &a)?;
    a.sync()?;
    let scratch = malloc(SCRATCH, &b)?;
    let out = malloc(X, &b)?;
    // Keep B busy for a while (~30 GB of copies), then read X.
    for _ in 0..60 {
        copy(
            scratch.wrapping_byte_add(SCRATCH / 2),
            scratch,
            SCRATCH / 2,
            &b,
        )?;
    }
    copy(out, x, X, &b)?;
    let started = Instant::now();
    if record {
        streamalloc_record_stream(x, b.raw());
    }
    free(x, &a);
    let y = malloc(X, &a)?;
    let host_ms = started.elapsed().as_secs_f64() * 1e3;
    memset(y, 0xFF, X, &a)?;
    a.sync()?;
    b.sync()?;
    let copied = read(out, 0, X)?;
    let bad = copied.iter().filter(|&&byte| byte != 0x5A).count();
    free(y, &a);
    free(out, &b);
    free(scratch, &b);
    Ok((y == x, bad, host_ms))
}

fn cross_stream_reuse(allocator: &CudaAllocator) -> Check {
    enter(allocator)?;
    let waits_before = stats().cross_stream_waits;
    let (reused, bad, host_ms) = reuse_round(true)?;
    let waits = stats().cross_stream_waits - waits_before;
    let (control_reused, control_bad, _) = reuse_round(false)?;
    let detail = format!(
        "block reused={reused}, corrupted bytes={bad}, device waits={waits}, host free+malloc {host_ms:.3} ms; \
         control without record_stream: reused={control_reused}, corrupted bytes={control_bad}"
    );
    if reused && bad == 0 && waits >= 1 {
        Ok(detail)
    } else {
        Err(detail)
    }
}

fn many_threads(allocator: &CudaAllocator) -> Check {
    const THREADS: usize = 8;
    const ITERATIONS: usize = 1500;
    enter(allocator)?;
    let comm = Stream::new()?;
    let comm_handle = comm.raw() as usize;
    let results: Vec<Result<(usize, usize), String>> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..THREADS)
            .map(|t| {
                scope.spawn(move || -> Result<(usize, usize), String> {
                    enter(allocator)?;
                    let own = Stream::new()?;
                    let comm = comm_handle as *mut c_void;
                    let mut rng = 0x9E37_79B9_7F4A_7C15u64 ^ (t as u64 + 1);
                    let mut live: Vec<(*mut c_void, usize, u8)> = Vec::new();
                    let (mut checked, mut bad) = (0, 0);
                    for i in 0..ITERATIONS {
                        rng ^= rng << 13;
                        rng ^= rng >> 7;
                        rng ^= rng << 17;
                        let size = match rng % 10 {
                            0..=5 => 512 + (rng >> 8) as usize % (MIB - 512),
                            6..=8 => MIB + (rng >> 8) as usize % (15 * MIB),
                            _ => 16 * MIB + (rng >> 8) as usize % (48 * MIB),
                        };
                        let byte = (t * 37 + i) as u8;
                        let ptr = malloc(size, &own)?;
                        memset(ptr, byte, size, &own)?;
                        if i % 8 == 0 {
                            streamalloc_record_stream(ptr, comm);
                        }
                        live.push((ptr, size, byte));
                        if live.len() > 4 {
                            let (ptr, size, byte) = live.remove((rng >> 32) as usize % live.len());
                            own.sync()?;
                            let head = read(ptr, 0, 64.min(size))?;
                            let tail = read(ptr, size - 64.min(size), 64.min(size))?;
                            checked += 1;
                            if head.iter().chain(tail.iter()).any(|&v| v != byte) {
                                bad += 1;
                            }
                            free(ptr, &own);
                        }
                    }
                    own.sync()?;
                    for (ptr, _, _) in live {
                        free(ptr, &own);
                    }
                    Ok((checked, bad))
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|_| Err("thread panicked".into())))
            .collect()
    });
    let (mut checked, mut bad) = (0, 0);
    for result in results {
        let (c, b) = result?;
        checked += c;
        bad += b;
    }
    allocator.check_invariants()?;
    let s = stats();
    let detail = format!(
        "{THREADS} threads x {ITERATIONS} allocations, {checked} blocks verified, {bad} corrupted; \
         cross-stream waits {}, events recorded {}",
        s.cross_stream_waits, s.events_recorded
    );
    if bad == 0 && checked > 0 {
        Ok(detail)
    } else {
        Err(detail)
    }
}

fn capture(allocator: &CudaAllocator) -> Check {
    enter(allocator)?;
    let stream = Stream::new()?;
    // A cached block for the stream, then capture.
    let warm = malloc(3 * MIB, &stream)?;
    free(warm, &stream);
    stream.sync()?;
    let segments_before = stats().segment_allocs;
    ck(
        // SAFETY: a live stream with no capture in progress.
        unsafe {
            sys::cuStreamBeginCapture_v2(
                stream.0,
                sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_GLOBAL,
            )
        },
        "cuStreamBeginCapture",
    )?;
    let cached = streamalloc_malloc(3 * MIB, DEVICE, stream.raw());
    let fresh = streamalloc_malloc(700 * MIB, DEVICE, stream.raw());
    let error = if cached.is_null() || fresh.is_null() {
        last_error()
    } else {
        String::new()
    };
    let mut graph: sys::CUgraph = std::ptr::null_mut();
    // SAFETY: ends the capture begun above.
    let ended = unsafe { sys::cuStreamEndCapture(stream.0, &mut graph) };
    if !graph.is_null() {
        // SAFETY: the graph was just created by the capture.
        unsafe { sys::cuGraphDestroy(graph) };
    }
    for ptr in [cached, fresh] {
        if !ptr.is_null() {
            free(ptr, &stream);
        }
    }
    ck(ended, "cuStreamEndCapture (capture invalidated)")?;
    if !error.is_empty() {
        return Err(format!("allocation during capture failed: {error}"));
    }
    let grown = stats().segment_allocs - segments_before;
    Ok(format!(
        "cached block and a new 700 MiB segment ({grown} segment(s) grown) allocated while capturing; capture stayed valid"
    ))
}

fn oom(allocator: &CudaAllocator) -> Check {
    enter(allocator)?;
    // An allocator of its own with a 256 MiB limit.
    let config = Config {
        memory_limit: Some(256 * MIB as u64),
        ..Config::default()
    };
    let limited = Allocator::new(CudaBackend::new(DEVICE).map_err(|e| e.to_string())?, config)
        .map_err(|e| e.to_string())?;
    let engine_message = match limited.malloc(512 * MIB as u64, StreamId(0)) {
        Err(AllocError::OutOfMemory(report)) => report.to_string(),
        other => return Err(format!("expected out-of-memory, got {other:?}")),
    };
    // Through the C ABI: a 1% fraction refuses 8 GiB; lifting it serves it.
    let stream = Stream::new()?;
    streamalloc_set_memory_fraction(0.01, DEVICE);
    let refused = streamalloc_malloc(8 << 30, DEVICE, stream.raw());
    let message = last_error();
    streamalloc_set_memory_fraction(1.0, DEVICE);
    let served = streamalloc_malloc(8 << 30, DEVICE, stream.raw());
    if !served.is_null() {
        free(served, &stream);
    }
    // More than the device has: the driver refuses, the engine retries, then reports.
    let huge = streamalloc_malloc(1 << 40, DEVICE, stream.raw());
    let huge_message = last_error();
    let ok = refused.is_null()
        && message.contains("out of memory")
        && !served.is_null()
        && huge.is_null()
        && huge_message.contains("out of memory")
        && engine_message.contains("out of memory");
    let detail = format!(
        "limit 256 MiB: \"{engine_message}\"; C ABI at 1%: null={}, \"{message}\"; after lifting: served={}; 1 TiB: \"{huge_message}\"; ooms counted {}",
        refused.is_null(),
        !served.is_null(),
        stats().ooms
    );
    if ok {
        Ok(detail)
    } else {
        Err(detail)
    }
}

fn invalid_free(allocator: &CudaAllocator) -> Check {
    enter(allocator)?;
    let stream = Stream::new()?;
    let before = stats().invalid_frees;
    let ptr = malloc(MIB, &stream)?;
    free(ptr, &stream);
    free(ptr, &stream); // double free
    free(0xdead_0000usize as *mut c_void, &stream); // never allocated
    streamalloc_free(ptr, 0, 63, stream.raw()); // a device never used
    let counted = stats().invalid_frees - before;
    let again = malloc(MIB, &stream)?;
    free(again, &stream);
    allocator.check_invariants()?;
    let detail = format!(
        "3 bad frees, {counted} counted on device {DEVICE}, {} in the process; allocator still consistent",
        registry::global().invalid_frees()
    );
    if counted == 2 {
        Ok(detail)
    } else {
        Err(detail)
    }
}

fn events_not_leaked(allocator: &CudaAllocator) -> Check {
    enter(allocator)?;
    streamalloc_empty_cache();
    let error = last_error();
    allocator.check_invariants()?;
    let s = stats();
    let detail = format!(
        "after empty_cache: outstanding {}, created {}, destroyed {}, recorded {}, reserved {} bytes, allocated {} bytes",
        s.events_outstanding,
        s.events_created,
        s.events_destroyed,
        s.events_recorded,
        s.reserved_current,
        s.allocated_current
    );
    if s.events_outstanding == 0
        && s.events_created == s.events_destroyed
        && s.events_created > 0
        && s.allocated_current == 0
        && !error.contains("empty_cache")
    {
        Ok(detail)
    } else {
        Err(detail)
    }
}
