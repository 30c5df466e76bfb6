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

/// What the environment asks of the process's exit, read in one place: [`STATS_ENV`],
/// [`SNAPSHOT_ENV`] and the rank launchers set.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ExitRequests {
    /// Print each device's stats line.
    pub stats: bool,
    /// Write each device's snapshot to this file (see [`snapshot_path`]).
    pub snapshot: Option<std::ffi::OsString>,
    /// This process's rank (see [`rank_from`]).
    pub rank: Option<String>,
}

impl ExitRequests {
    /// The requests of this process's environment.
    pub fn from_env() -> Self {
        let flag = |name: &str| std::env::var(name).is_ok_and(|v| !v.is_empty() && v != "0");
        ExitRequests {
            stats: flag(STATS_ENV),
            snapshot: std::env::var_os(SNAPSHOT_ENV).filter(|p| !p.is_empty()),
            rank: rank_from(|name| std::env::var(name).ok()),
        }
    }
}

/// This process's rank as launchers report it: `RANK`, else `LOCAL_RANK` (torchrun,
/// mpirun with PyTorch's conventions), looked up with `var`. Only digits are kept, so it
/// is safe in a file name.
pub fn rank_from(var: impl Fn(&str) -> Option<String>) -> Option<String> {
    ["RANK", "LOCAL_RANK"].iter().find_map(|name| {
        let value = var(name)?;
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

/// Does what the environment's [`ExitRequests`] ask for every device in use in
/// `registry`. Returns the number of snapshots that could not be written (each reported on
/// stderr). A device made unusable by a panic is reported, not read.
pub fn at_exit<B: Backend>(registry: &Registry<B>) -> usize {
    at_exit_with(registry, &ExitRequests::from_env())
}

/// [`at_exit`] for explicit `requests`.
pub fn at_exit_with<B: Backend>(registry: &Registry<B>, requests: &ExitRequests) -> usize {
    let ExitRequests {
        stats,
        snapshot,
        rank,
    } = requests;
    let stats = *stats;
    if !stats && snapshot.is_none() {
        return 0;
    }
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
        assert_eq!(
            // SAFETY: capacity 0 with a null pointer writes nothing.
            unsafe { streamalloc_devices_in_use(std::ptr::null_mut(), 0) },
            0
        );
        assert_eq!(streamalloc_at_exit(), 0);
    }

    #[test]
    fn the_rank_is_rank_else_local_rank_and_only_its_digits() {
        let env = |pairs: &'static [(&'static str, &'static str)]| {
            move |name: &str| {
                pairs
                    .iter()
                    .find(|(key, _)| *key == name)
                    .map(|(_, value)| value.to_string())
            }
        };
        assert_eq!(
            rank_from(env(&[("RANK", "3"), ("LOCAL_RANK", "1")])).as_deref(),
            Some("3")
        );
        assert_eq!(rank_from(env(&[("LOCAL_RANK", "1")])).as_deref(), Some("1"));
        assert_eq!(rank_from(env(&[("RANK", "../7")])).as_deref(), Some("7"));
        assert_eq!(
            rank_from(env(&[("RANK", "x"), ("LOCAL_RANK", "2")])).as_deref(),
            Some("2")
        );
        assert_eq!(rank_from(env(&[])), None);
    }

    /// The snapshot writer of `streamalloc_dump_snapshot` and `run --snapshot`: a write that
    /// fails midway leaves the file that was there as it was, and a target that is not a
    /// regular file is refused and left alone.
    #[test]
    fn snapshot_files_are_written_whole_or_not_at_all() {
        struct FailsMidway;
        impl serde::Serialize for FailsMidway {
            fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                use serde::ser::{Error, SerializeSeq};
                let mut seq = s.serialize_seq(None)?;
                for i in 0..100_000 {
                    seq.serialize_element(&i)?;
                }
                Err(S::Error::custom("the snapshot could not be serialised"))
            }
        }
        let scratch = tempfile::tempdir().unwrap();
        let dir = scratch.path();
        let existing = dir.join("snap.json");
        std::fs::write(&existing, b"precious").unwrap();
        let err = crate::ffi::write_json(existing.to_str().unwrap(), &FailsMidway).unwrap_err();
        assert!(err.contains("could not be serialised"), "{err}");
        assert_eq!(std::fs::read(&existing).unwrap(), b"precious");
        let fifo = dir.join("fifo");
        assert!(std::process::Command::new("mkfifo")
            .arg(&fifo)
            .status()
            .unwrap()
            .success());
        let err = crate::ffi::write_json(fifo.to_str().unwrap(), &1).unwrap_err();
        assert!(err.contains("FIFO"), "{err}");
        use std::os::unix::fs::FileTypeExt;
        assert!(std::fs::symlink_metadata(&fifo)
            .unwrap()
            .file_type()
            .is_fifo());
        let names: Vec<_> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        assert_eq!(names.len(), 2, "nothing left beside them: {names:?}");
    }

    #[test]
    fn a_simulated_device_writes_its_snapshot_where_the_requests_say() {
        let registry = Registry::simulated(streamalloc_allocator::Config::default());
        let device = registry.device(0).unwrap();
        let stream = device.allocator().backend().create_stream();
        device.run(|a| a.malloc(4096, stream).unwrap()).unwrap();
        let scratch = tempfile::tempdir().unwrap();
        let dir = scratch.path();
        let requests = ExitRequests {
            stats: false,
            snapshot: Some(dir.join("snap.json").into_os_string()),
            rank: Some("2".into()),
        };
        assert_eq!(at_exit_with(&registry, &requests), 0);
        let written = std::fs::read_to_string(dir.join("snap.rank2.json")).unwrap();
        assert!(written.contains("\"segments\""), "{written}");
        assert_eq!(at_exit_with(&registry, &ExitRequests::default()), 0);
    }
}
