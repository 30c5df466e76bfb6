//! Sleep and wake through the C ABI, on simulated devices: the code behind
//! `streamalloc_tag_pool`, `streamalloc_sleep`, `streamalloc_wake`,
//! `streamalloc_release_host_backup` and `streamalloc_tags_json` serves a tagged pool's
//! sleep and wake, fills the report and the counters, and answers every misuse (double
//! sleep, wake of an unknown or awake tag, an allocation into a sleeping tag, null and
//! non-UTF-8 tags, a bad backup, whole segments) with its failure value and a one-line
//! last error, changing nothing.

use std::ffi::{c_char, c_int, c_void, CStr};
use streamalloc::ffi::sleep::{self, StreamallocSleepReport, BACKUP_HOST, BACKUP_NONE};
use streamalloc::ffi::{self, introspect, pools, stats, StreamallocStats};
use streamalloc::registry::Registry;
use streamalloc_allocator::backend::sim::SimBackend;
use streamalloc_allocator::Config;

const MIB: usize = 1 << 20;
const DEVICE: c_int = 0;

fn last_error() -> String {
    // SAFETY: the slot holds a NUL-terminated string until the next call.
    unsafe { CStr::from_ptr(ffi::streamalloc_last_error()) }
        .to_string_lossy()
        .into_owned()
}

fn counters(registry: &Registry<SimBackend>) -> StreamallocStats {
    let mut out = StreamallocStats::default();
    // SAFETY: a valid out pointer.
    assert_eq!(unsafe { stats::get_stats(registry, DEVICE, &mut out) }, 0);
    out
}

/// A registry with pool (0, 1) tagged "kv_cache" holding two live allocations.
fn tagged(config: Config) -> (Registry<SimBackend>, Vec<*mut c_void>) {
    let registry = Registry::simulated(config);
    assert_eq!(pools::pool_incref(&registry, DEVICE, 0, 1), 1);
    // SAFETY: a NUL-terminated tag.
    let rc = unsafe { sleep::tag_pool(&registry, DEVICE, 0, 1, c"kv_cache".as_ptr()) };
    assert_eq!(rc, 0, "{}", last_error());
    let blocks = [3 * MIB, 17 * MIB]
        .iter()
        .map(|&size| pools::malloc_in_pool(&registry, size, DEVICE, std::ptr::null_mut(), 0, 1))
        .collect::<Vec<_>>();
    assert!(blocks.iter().all(|p| !p.is_null()), "{}", last_error());
    (registry, blocks)
}

/// Calls `streamalloc_sleep` with `tags`.
fn sleep_with(
    registry: &Registry<SimBackend>,
    tags: &[*const c_char],
    backup: c_int,
    report: *mut StreamallocSleepReport,
) -> c_int {
    // SAFETY: `tags` holds `tags.len()` pointers; `report` is null or valid.
    unsafe { sleep::sleep(registry, DEVICE, tags.as_ptr(), tags.len(), backup, report) }
}

fn wake_with(registry: &Registry<SimBackend>, tags: &[*const c_char]) -> c_int {
    // SAFETY: as above, no report.
    unsafe {
        sleep::wake(
            registry,
            DEVICE,
            tags.as_ptr(),
            tags.len(),
            std::ptr::null_mut(),
        )
    }
}

fn tags_json(registry: &Registry<SimBackend>) -> serde_json::Value {
    let text = sleep::tags_json(registry, DEVICE);
    assert!(!text.is_null(), "{}", last_error());
    // SAFETY: a NUL-terminated string, valid until the next call on this thread.
    serde_json::from_str(unsafe { CStr::from_ptr(text) }.to_str().unwrap()).unwrap()
}

#[test]
fn a_tag_sleeps_and_wakes_through_the_c_abi_with_its_report_and_counters() {
    let (registry, blocks) = tagged(Config::default());
    let reserved = counters(&registry).reserved_current;
    let mut report = StreamallocSleepReport::default();
    let kv = [c"kv_cache".as_ptr()];
    assert_eq!(sleep_with(&registry, &kv, BACKUP_HOST, &mut report), 0);
    assert_eq!(last_error(), "", "a success leaves no error");
    assert!(report.bytes >= (20 * MIB) as u64);
    assert_eq!(report.copied, (20 * MIB) as u64);
    let asleep = counters(&registry);
    assert_eq!(asleep.sleeping_bytes, report.bytes);
    assert_eq!(asleep.reserved_current, reserved - report.bytes);
    assert_eq!(asleep.host_backup_bytes, report.copied);
    let json = tags_json(&registry);
    assert_eq!(json[0]["tag"], "kv_cache");
    assert_eq!(json[0]["pool"], serde_json::json!([0, 1]));
    assert_eq!(json[0]["asleep"], true);
    assert_eq!(json[0]["backed_up"], true);
    // The PyTorch-shaped snapshot lists reserved memory only: the sleeping pool is not in it.
    let (segments, _) =
        introspect::snapshot_rows(&registry.device(DEVICE).unwrap().allocator().snapshot());
    assert!(segments.iter().all(|s| s.pool_id1 != 1));
    let mut woken = StreamallocSleepReport::default();
    // SAFETY: as in `wake_with`, with a report.
    let rc = unsafe { sleep::wake(&registry, DEVICE, kv.as_ptr(), 1, &mut woken) };
    assert_eq!(rc, 0, "{}", last_error());
    assert_eq!((woken.bytes, woken.copied), (report.bytes, report.copied));
    assert_eq!(counters(&registry).reserved_current, reserved);
    assert_eq!(counters(&registry).sleeping_bytes, 0);
    // SAFETY: as for sleep.
    let freed = unsafe { sleep::release_host_backup(&registry, DEVICE, kv.as_ptr(), 1) };
    assert_eq!(freed, report.copied as i64);
    assert_eq!(counters(&registry).host_backup_bytes, 0);
    for block in blocks {
        ffi::free(&registry, block, 0, DEVICE, std::ptr::null_mut());
    }
    assert_eq!(counters(&registry).invalid_frees, 0);
}

#[test]
fn misuse_fails_with_one_line_and_changes_nothing() {
    let (registry, _blocks) = tagged(Config::default());
    let kv = [c"kv_cache".as_ptr()];
    let before = counters(&registry);
    let refused = |rc: c_int, needle: &str| {
        assert_eq!(rc, -1);
        let message = last_error();
        assert!(message.contains(needle), "{needle:?} not in {message:?}");
        assert!(message.starts_with("streamalloc"), "{message}");
        assert_eq!(message.lines().count(), 1, "{message}");
    };
    refused(
        wake_with(&registry, &kv),
        "memory pool \"kv_cache\" is not asleep",
    );
    refused(
        sleep_with(
            &registry,
            &[c"kv".as_ptr()],
            BACKUP_NONE,
            std::ptr::null_mut(),
        ),
        "no memory pool is tagged \"kv\" (tags: \"kv_cache\")",
    );
    refused(
        wake_with(&registry, &[c"nope".as_ptr()]),
        "no memory pool is tagged \"nope\"",
    );
    refused(
        sleep_with(&registry, &kv, 7, std::ptr::null_mut()),
        "backup must be 0 (none) or 1 (host memory), not 7",
    );
    refused(
        sleep_with(
            &registry,
            &[std::ptr::null()],
            BACKUP_NONE,
            std::ptr::null_mut(),
        ),
        "a tag is null",
    );
    let not_utf8: &[u8] = b"\xff\xfe\0";
    refused(
        sleep_with(
            &registry,
            &[not_utf8.as_ptr().cast()],
            BACKUP_NONE,
            std::ptr::null_mut(),
        ),
        "not UTF-8",
    );
    // SAFETY: a null array with count 0, then with count 1.
    refused(
        unsafe {
            sleep::sleep(
                &registry,
                DEVICE,
                std::ptr::null(),
                0,
                0,
                std::ptr::null_mut(),
            )
        },
        "no tags given",
    );
    // SAFETY: as above.
    refused(
        unsafe { sleep::wake(&registry, DEVICE, std::ptr::null(), 1, std::ptr::null_mut()) },
        "tags is null",
    );
    // SAFETY: NUL-terminated tags.
    refused(
        unsafe { sleep::tag_pool(&registry, DEVICE, 0, 2, c"x".as_ptr()) },
        "pool(0, 2) does not exist",
    );
    // SAFETY: as above.
    refused(
        unsafe { sleep::tag_pool(&registry, DEVICE, 0, 1, c"other".as_ptr()) },
        "pool(0, 1) is already tagged \"kv_cache\"",
    );
    // SAFETY: as above.
    refused(
        unsafe { sleep::tag_pool(&registry, DEVICE, 0, 1, std::ptr::null()) },
        "a tag is null",
    );
    assert_eq!(counters(&registry), before, "every refusal changed nothing");
    assert_eq!(
        sleep_with(&registry, &kv, BACKUP_NONE, std::ptr::null_mut()),
        0
    );
    let asleep = counters(&registry);
    refused(
        sleep_with(&registry, &kv, BACKUP_HOST, std::ptr::null_mut()),
        "memory pool \"kv_cache\" is already asleep",
    );
    assert_eq!(
        counters(&registry),
        asleep,
        "the double sleep changed nothing"
    );
    // An allocation into a sleeping tag fails, naming it, and is no out-of-memory.
    let ptr = pools::malloc_in_pool(&registry, MIB, DEVICE, std::ptr::null_mut(), 0, 1);
    assert!(ptr.is_null());
    let message = last_error();
    assert!(
        message.contains("memory pool \"kv_cache\": it is asleep (wake it first)"),
        "{message}"
    );
    assert!(!message.contains("out of memory"), "{message}");
    assert_eq!(counters(&registry).ooms, 0);
    // Bad devices are refused like everywhere else.
    // SAFETY: as above.
    refused(
        unsafe { sleep::sleep(&registry, -3, kv.as_ptr(), 1, 0, std::ptr::null_mut()) },
        "device -3",
    );
    assert!(sleep::tags_json(&registry, -3).is_null());
}

#[test]
fn whole_segments_refuse_tags_naming_expandable_segments() {
    let registry = Registry::simulated(Config {
        expandable_segments: false,
        ..Config::default()
    });
    assert_eq!(pools::pool_incref(&registry, DEVICE, 0, 1), 1);
    // SAFETY: a NUL-terminated tag.
    let rc = unsafe { sleep::tag_pool(&registry, DEVICE, 0, 1, c"kv_cache".as_ptr()) };
    assert_eq!(rc, -1);
    let message = last_error();
    assert!(message.contains("expandable_segments:true"), "{message}");
    assert_eq!(message.lines().count(), 1);
}
