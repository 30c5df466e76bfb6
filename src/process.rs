//! What a process does at exit when `streamalloc run` (or the LD_PRELOAD shim) put
//! streamalloc into it: print its counters and write its snapshots.
//!
//! The program under the launcher is not ours, so it cannot be asked to call
//! `streamalloc_dump_snapshot` itself. Instead the launcher sets two variables and each
//! process acts on them at exit (the Python boot module from an `atexit` hook, the preload
//! shim from a C `atexit` handler), through [`streamalloc_at_exit`]:
//!
//! - [`STATS_ENV`] (`STREAMALLOC_STATS_AT_EXIT=1`): one line per device on stderr,
//!   `streamalloc: exit pid=… rank=… device=… allocs=… …`, so every rank shows that its
//!   memory went through streamalloc.
//! - [`SNAPSHOT_ENV`] (`STREAMALLOC_SNAPSHOT=PATH`): each device's snapshot, to a file per
//!   rank and device named by [`snapshot_path`].
//!
//! Only devices whose allocator already exists are visited: asking the registry for any
//! other would create a CUDA context at exit.

use crate::ffi::error;
use crate::registry::{self, Registry};
use std::ffi::c_int;
use std::path::{Path, PathBuf};
use streamalloc_allocator::{Allocator, Backend};

/// Variable that makes [`streamalloc_at_exit`] print the counters.
pub const STATS_ENV: &str = "STREAMALLOC_STATS_AT_EXIT";
/// Variable naming the snapshot file [`streamalloc_at_exit`] writes.
pub const SNAPSHOT_ENV: &str = "STREAMALLOC_SNAPSHOT";

/// The ordinals of the devices whose allocator exists in `registry`.
pub fn devices_in_use<B: Backend>(registry: &Registry<B>) -> Vec<i32> {
    registry
        .initialized()
        .map(|device| device.ordinal())
        .collect()
}

/// This process's rank as launchers report it: `RANK`, else `LOCAL_RANK` (torchrun,
/// mpirun with PyTorch's conventions). Only digits are kept, so it is safe in a file name.
pub fn rank() -> Option<String> {
    ["RANK", "LOCAL_RANK"].iter().find_map(|name| {
        let value = std::env::var(name).ok()?;
        let digits: String = value.chars().filter(char::is_ascii_digit).collect();
        (!digits.is_empty()).then_some(digits)
    })
}

/// The file a process writes `device`'s snapshot to, from the user's `base`:
/// `.rank{R}` is inserted before the extension when the process has a rank, and `.dev{D}`
/// when it used more than one device (`several`). `snap.json` → `snap.rank1.json`,
/// `snap.rank1.dev0.json`; without rank and with one device, `base` itself.
pub fn snapshot_path(base: &Path, rank: Option<&str>, device: i32, several: bool) -> PathBuf {
    let mut suffix = String::new();
    if let Some(rank) = rank {
        suffix.push_str(&format!(".rank{rank}"));
    }
    if several {
        suffix.push_str(&format!(".dev{device}"));
    }
    if suffix.is_empty() {
        return base.to_path_buf();
    }
    let name = base.file_name().map(|n| n.to_string_lossy().into_owned());
    let name = name.unwrap_or_default();
    let renamed = match name.rsplit_once('.') {
        Some((stem, ext)) if !stem.is_empty() => format!("{stem}{suffix}.{ext}"),
        _ => format!("{name}{suffix}"),
    };
    base.with_file_name(renamed)
}

/// The stats line [`streamalloc_at_exit`] prints for one device.
pub fn stats_line<B: Backend>(device: i32, allocator: &Allocator<B>, rank: Option<&str>) -> String {
    let s = allocator.stats();
    format!(
        "streamalloc: exit pid={} rank={} device={device} allocs={} frees={} \
         peak_allocated_bytes={} peak_reserved_bytes={} segments={} cross_stream_waits={} \
         ooms={} invalid_frees={}",
        std::process::id(),
        rank.unwrap_or("-"),
        s.allocs,
        s.frees,
        s.allocated_bytes.peak,
        s.reserved_bytes.peak,
        s.segment_allocs,
        s.cross_stream_waits,
        s.ooms,
        s.invalid_frees,
    )
}

fn flag(name: &str) -> bool {
    std::env::var(name).is_ok_and(|v| !v.is_empty() && v != "0")
}

/// Does what [`STATS_ENV`] and [`SNAPSHOT_ENV`] ask for every device in use in
/// `registry`. Returns the number of snapshots that could not be written (each reported on
/// stderr). A device made unusable by a panic is reported, not read.
pub fn at_exit<B: Backend>(registry: &Registry<B>) -> usize {
    let stats = flag(STATS_ENV);
    let snapshot = std::env::var_os(SNAPSHOT_ENV).filter(|p| !p.is_empty());
    if !stats && snapshot.is_none() {
        return 0;
    }
    let rank = rank();
    let devices: Vec<_> = registry.initialized().collect();
    if stats && devices.is_empty() {
        eprintln!(
            "streamalloc: exit pid={} rank={}: no CUDA memory was allocated through streamalloc",
            std::process::id(),
            rank.as_deref().unwrap_or("-"),
        );
    }
    let mut failures = 0;
    for device in &devices {
        let ordinal = device.ordinal();
        let written = device.run(|allocator| {
            if stats {
                eprintln!("{}", stats_line(ordinal, allocator, rank.as_deref()));
            }
            let base = snapshot.as_ref()?;
            let path = snapshot_path(Path::new(base), rank.as_deref(), ordinal, devices.len() > 1);
            let shown = path.to_string_lossy().into_owned();
            Some(crate::ffi::write_json(&shown, &allocator.snapshot()).map(|()| shown))
        });
        match written {
            Ok(None) => {}
            Ok(Some(Ok(path))) => eprintln!("streamalloc: wrote snapshot {path}"),
            Ok(Some(Err(message))) => {
                eprintln!("{message}");
                failures += 1;
            }
            Err(err) => {
                eprintln!("streamalloc: exit pid={}: {err}", std::process::id());
                failures += usize::from(snapshot.is_some());
            }
        }
    }
    failures
}

/// `int streamalloc_at_exit(void)`: prints the counters and writes the snapshots that
/// `STREAMALLOC_STATS_AT_EXIT` / `STREAMALLOC_SNAPSHOT` ask for (see the module docs).
/// Returns 0, or -1 if a snapshot could not be written. Never creates a device's
/// allocator; safe to call more than once.
#[no_mangle]
pub extern "C" fn streamalloc_at_exit() -> c_int {
    error::call(-1, || match at_exit(registry::global()) {
        0 => 0,
        failures => crate::ffi::fail(
            -1,
            format_args!("streamalloc_at_exit: {failures} snapshots could not be written"),
        ),
    })
}

/// `int streamalloc_devices_in_use(int* out, int capacity)`: writes up to `capacity`
/// ordinals of the devices whose allocator exists into `out` and returns how many exist
/// (which may exceed `capacity`). `out` may be null when `capacity` is 0.
///
/// # Safety
/// `out` must be null or point to `capacity` writable `int`s.
#[no_mangle]
pub unsafe extern "C" fn streamalloc_devices_in_use(out: *mut c_int, capacity: c_int) -> c_int {
    error::call(-1, || {
        let devices = devices_in_use(registry::global());
        if !out.is_null() {
            for (i, &device) in devices
                .iter()
                .take(usize::try_from(capacity).unwrap_or(0))
                .enumerate()
            {
                // SAFETY: `out` points to `capacity` writable ints and `i < capacity`.
                unsafe { out.add(i).write(device) };
            }
        }
        devices.len() as c_int
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn snapshot_names_carry_rank_and_device() {
        let base = Path::new("/tmp/out/snap.json");
        assert_eq!(snapshot_path(base, None, 0, false), base);
        assert_eq!(
            snapshot_path(base, Some("3"), 3, false),
            Path::new("/tmp/out/snap.rank3.json")
        );
        assert_eq!(
            snapshot_path(base, Some("1"), 0, true),
            Path::new("/tmp/out/snap.rank1.dev0.json")
        );
        assert_eq!(
            snapshot_path(Path::new("snap"), None, 2, true),
            Path::new("snap.dev2")
        );
        assert_eq!(
            snapshot_path(Path::new(".hidden"), Some("0"), 0, false),
            Path::new(".hidden.rank0")
        );
    }

    #[test]
    fn nothing_in_use_without_a_gpu_call() {
        // No test in this binary creates a CUDA allocator.
        assert!(devices_in_use(registry::global()).is_empty());
        // SAFETY: capacity 0 with a null pointer writes nothing.
        assert_eq!(
            unsafe { streamalloc_devices_in_use(std::ptr::null_mut(), 0) },
            0
        );
        assert_eq!(streamalloc_at_exit(), 0);
    }
}
