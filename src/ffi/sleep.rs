//! Sleep and wake across the C ABI: tagging a memory pool, putting tags to sleep (their
//! device memory back to the driver, addresses and live blocks kept, optionally backed up
//! to page-locked host memory) and waking them (the same addresses mapped again, the
//! backup restored). The policy is the engine's (`Allocator::sleep`); these only translate.
//!
//! ```c
//! int streamalloc_tag_pool(int device, uint64_t id0, uint64_t id1, const char* tag);
//! int streamalloc_sleep(int device, const char* const* tags, size_t count, int backup,
//!                       streamalloc_sleep_report_t* report);
//! int streamalloc_wake(int device, const char* const* tags, size_t count,
//!                      streamalloc_sleep_report_t* report);
//! int64_t streamalloc_release_host_backup(int device, const char* const* tags, size_t count);
//! const char* streamalloc_tags_json(int device);
//! ```
//!
//! `backup` is [`BACKUP_NONE`] (0) or [`BACKUP_HOST`] (1); `report` may be null. Every call
//! returns 0 (or the bytes freed), or -1 with the reason in `streamalloc_last_error()`: an
//! unknown tag, a sleeping tag slept again, an awake tag woken, a pool being allocated to,
//! whole segments (`expandable_segments:false`), a null or non-UTF-8 tag. A refusal changes
//! nothing.

pub use super::layout::StreamallocSleepReport;
use super::{device_call, engine_message, error, fail};
use crate::registry::{self, Registry};
use std::cell::RefCell;
use std::ffi::{c_char, c_int, CStr, CString};
use streamalloc_allocator::{Backend, Backup, PoolId};

/// `backup` of [`streamalloc_sleep`]: nothing is copied; waking maps fresh memory.
pub const BACKUP_NONE: c_int = 0;
/// `backup` of [`streamalloc_sleep`]: live blocks are copied to page-locked host memory and
/// back at wake.
pub const BACKUP_HOST: c_int = 1;

/// The most tags one call may name.
const MAX_TAGS: usize = 4096;

/// Tags memory pool `(id0, id1)` of `device` with `tag` (a NUL-terminated UTF-8 name).
/// Returns 0, or -1.
///
/// # Safety
/// `tag` must be null or a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn streamalloc_tag_pool(
    device: c_int,
    id0: u64,
    id1: u64,
    tag: *const c_char,
) -> c_int {
    // SAFETY: forwarded from this function's # Safety.
    unsafe { tag_pool(registry::global(), device, id0, id1, tag) }
}

/// [`streamalloc_tag_pool`] on `registry`.
///
/// # Safety
/// As [`streamalloc_tag_pool`].
pub unsafe fn tag_pool<B: Backend>(
    registry: &Registry<B>,
    device: c_int,
    id0: u64,
    id1: u64,
    tag: *const c_char,
) -> c_int {
    error::call(-1, || {
        // SAFETY: forwarded from this function's # Safety.
        let tag = match unsafe { read_tag(tag, "streamalloc_tag_pool") } {
            Ok(tag) => tag,
            Err(message) => return fail(-1, message),
        };
        device_call(registry, device, -1, |allocator| {
            allocator
                .tag_pool(PoolId(id0, id1), &tag)
                .map(|()| 0)
                .map_err(|err| engine_message(device, err))
        })
    })
}

/// Puts the `count` tags at `tags` to sleep on `device`, with `backup` ([`BACKUP_NONE`]
/// or [`BACKUP_HOST`]); fills `*report` if not null. Returns 0, or -1.
///
/// # Safety
/// `tags` must be null or point to `count` readable pointers, each null or a
/// NUL-terminated string; `report` must be null or writable for one
/// `streamalloc_sleep_report_t`.
#[no_mangle]
pub unsafe extern "C" fn streamalloc_sleep(
    device: c_int,
    tags: *const *const c_char,
    count: usize,
    backup: c_int,
    report: *mut StreamallocSleepReport,
) -> c_int {
    // SAFETY: forwarded from this function's # Safety.
    unsafe { sleep(registry::global(), device, tags, count, backup, report) }
}

/// [`streamalloc_sleep`] on `registry`.
///
/// # Safety
/// As [`streamalloc_sleep`].
pub unsafe fn sleep<B: Backend>(
    registry: &Registry<B>,
    device: c_int,
    tags: *const *const c_char,
    count: usize,
    backup: c_int,
    report: *mut StreamallocSleepReport,
) -> c_int {
    error::call(-1, || {
        let backup = match backup {
            BACKUP_NONE => Backup::None,
            BACKUP_HOST => Backup::Host,
            other => {
                return fail(
                    -1,
                    format!(
                        "streamalloc_sleep: backup must be 0 (none) or 1 (host memory), not {other}"
                    ),
                )
            }
        };
        // SAFETY: forwarded from this function's # Safety.
        let names = match unsafe { read_tags(tags, count, "streamalloc_sleep") } {
            Ok(names) => names,
            Err(message) => return fail(-1, message),
        };
        device_call(registry, device, -1, |allocator| {
            let names: Vec<&str> = names.iter().map(String::as_str).collect();
            let done = allocator
                .sleep(&names, backup)
                .map_err(|err| engine_message(device, err))?;
            let filled = StreamallocSleepReport {
                bytes: done.released,
                copied: done.backed_up,
                copies: done.copies,
            };
            // SAFETY: `report` is null or writable (see # Safety).
            unsafe { write_report(report, filled) };
            Ok(0)
        })
    })
}

/// Wakes the `count` sleeping tags at `tags` on `device`; fills `*report` if not null.
/// Returns 0, or -1 (nothing woken).
///
/// # Safety
/// As [`streamalloc_sleep`].
#[no_mangle]
pub unsafe extern "C" fn streamalloc_wake(
    device: c_int,
    tags: *const *const c_char,
    count: usize,
    report: *mut StreamallocSleepReport,
) -> c_int {
    // SAFETY: forwarded from this function's # Safety.
    unsafe { wake(registry::global(), device, tags, count, report) }
}

/// [`streamalloc_wake`] on `registry`.
///
/// # Safety
/// As [`streamalloc_sleep`].
pub unsafe fn wake<B: Backend>(
    registry: &Registry<B>,
    device: c_int,
    tags: *const *const c_char,
    count: usize,
    report: *mut StreamallocSleepReport,
) -> c_int {
    error::call(-1, || {
        // SAFETY: forwarded from this function's # Safety.
        let names = match unsafe { read_tags(tags, count, "streamalloc_wake") } {
            Ok(names) => names,
            Err(message) => return fail(-1, message),
        };
        device_call(registry, device, -1, |allocator| {
            let names: Vec<&str> = names.iter().map(String::as_str).collect();
            let done = allocator
                .wake(&names)
                .map_err(|err| engine_message(device, err))?;
            let filled = StreamallocSleepReport {
                bytes: done.mapped,
                copied: done.restored,
                copies: done.copies,
            };
            // SAFETY: `report` is null or writable (see # Safety).
            unsafe { write_report(report, filled) };
            Ok(0)
        })
    })
}

/// Frees the page-locked host buffers that the awake tags at `tags` keep for their next
/// backup. Returns the bytes freed, or -1.
///
/// # Safety
/// `tags` as for [`streamalloc_sleep`].
#[no_mangle]
pub unsafe extern "C" fn streamalloc_release_host_backup(
    device: c_int,
    tags: *const *const c_char,
    count: usize,
) -> i64 {
    // SAFETY: forwarded from this function's # Safety.
    unsafe { release_host_backup(registry::global(), device, tags, count) }
}

/// [`streamalloc_release_host_backup`] on `registry`.
///
/// # Safety
/// As [`streamalloc_release_host_backup`].
pub unsafe fn release_host_backup<B: Backend>(
    registry: &Registry<B>,
    device: c_int,
    tags: *const *const c_char,
    count: usize,
) -> i64 {
    error::call(-1, || {
        // SAFETY: forwarded from this function's # Safety.
        let names = match unsafe { read_tags(tags, count, "streamalloc_release_host_backup") } {
            Ok(names) => names,
            Err(message) => return fail(-1, message),
        };
        device_call(registry, device, -1, |allocator| {
            let names: Vec<&str> = names.iter().map(String::as_str).collect();
            allocator
                .release_host_backup(&names)
                .map(|bytes| i64::try_from(bytes).unwrap_or(i64::MAX))
                .map_err(|err| engine_message(device, err))
        })
    })
}

thread_local! {
    static JSON: RefCell<CString> = RefCell::new(CString::default());
}

/// `device`'s tags as a JSON array, by name: `[{"tag", "pool": [id0, id1], "asleep",
/// "bytes", "allocated", "backed_up", "host_bytes"}]` (`bytes`: mapped now if awake, given
/// back if asleep). Null on failure. The string stays valid until the next call on the
/// same thread.
#[no_mangle]
pub extern "C" fn streamalloc_tags_json(device: c_int) -> *const c_char {
    tags_json(registry::global(), device)
}

/// [`streamalloc_tags_json`] on `registry`.
pub fn tags_json<B: Backend>(registry: &Registry<B>, device: c_int) -> *const c_char {
    error::call(std::ptr::null(), || {
        let text = super::on_device(registry, device, |allocator| {
            let tags: Vec<serde_json::Value> = allocator
                .tags()
                .into_iter()
                .map(|t| {
                    serde_json::json!({
                        "tag": t.name,
                        "pool": [t.pool.0, t.pool.1],
                        "asleep": t.asleep,
                        "bytes": t.bytes,
                        "allocated": t.allocated,
                        "backed_up": t.backed_up,
                        "host_bytes": t.host_bytes,
                    })
                })
                .collect();
            Ok(serde_json::Value::Array(tags).to_string())
        });
        match text {
            Ok(text) => JSON
                .try_with(|slot| {
                    *slot.borrow_mut() = CString::new(text).unwrap_or_default();
                    slot.borrow().as_ptr()
                })
                .unwrap_or_else(|_| {
                    fail(
                        std::ptr::null(),
                        "streamalloc_tags_json: called while this thread exits",
                    )
                }),
            Err(message) => fail(std::ptr::null(), message),
        }
    })
}

/// Writes `filled` to `report` unless it is null.
///
/// # Safety
/// `report` must be null or writable for one `streamalloc_sleep_report_t`.
unsafe fn write_report(report: *mut StreamallocSleepReport, filled: StreamallocSleepReport) {
    if !report.is_null() {
        // SAFETY: non-null and writable (see # Safety).
        unsafe { report.write(filled) };
    }
}

/// The tag at `tag`, or why it cannot be read.
///
/// # Safety
/// `tag` must be null or a NUL-terminated string.
unsafe fn read_tag(tag: *const c_char, call: &str) -> Result<String, String> {
    if tag.is_null() {
        return Err(format!("{call}: a tag is null"));
    }
    // SAFETY: non-null and NUL-terminated (see # Safety).
    let bytes = unsafe { CStr::from_ptr(tag) };
    bytes
        .to_str()
        .map(str::to_owned)
        .map_err(|_| format!("{call}: a tag is not UTF-8"))
}

/// The `count` tags at `tags`, or why they cannot be read.
///
/// # Safety
/// `tags` must be null or point to `count` readable pointers, each null or a
/// NUL-terminated string.
unsafe fn read_tags(
    tags: *const *const c_char,
    count: usize,
    call: &str,
) -> Result<Vec<String>, String> {
    if count == 0 {
        return Err(format!("{call}: no tags given"));
    }
    if tags.is_null() {
        return Err(format!("{call}: tags is null"));
    }
    if count > MAX_TAGS {
        return Err(format!("{call}: {count} tags (at most {MAX_TAGS})"));
    }
    (0..count)
        .map(|i| {
            // SAFETY: `tags` points to `count` readable pointers (see # Safety).
            let tag = unsafe { *tags.add(i) };
            // SAFETY: each is null or NUL-terminated (see # Safety).
            unsafe { read_tag(tag, call) }
        })
        .collect()
}
