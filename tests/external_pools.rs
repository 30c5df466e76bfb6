//! Pools whose segments come from a caller's allocator (`torch.cuda.MemPool(allocator=...)`),
//! on simulated devices: the engine takes whole segments from the pool's source, splits and
//! caches them for that pool only, and gives each back to the source when it releases it,
//! with expandable segments in effect for the other pools or not; other pools never touch
//! the source; a source is refused where it cannot be honoured.

use std::ffi::{c_int, c_void, CStr};
use std::sync::Mutex;
use streamalloc::ffi::pool_rules::pool_set_segment_source;
use streamalloc::ffi::{self, pools};
use streamalloc::registry::sources::WithSources;
use streamalloc::registry::{simulated_device, Registry};
use streamalloc_allocator::backend::sim::SimBackend;
use streamalloc_allocator::Config;

const MIB: usize = 1 << 20;
const POOL: (u64, u64) = (1, 7);

fn registry(expandable_segments: bool) -> Registry<WithSources<SimBackend>> {
    fn create(ordinal: i32) -> Result<WithSources<SimBackend>, String> {
        Ok(WithSources::new(simulated_device(ordinal)?, ordinal))
    }
    Registry::with_config(
        create,
        Config {
            expandable_segments,
            ..Config::default()
        },
    )
}

fn last_error() -> String {
    // SAFETY: the slot holds a NUL-terminated string until the next call.
    unsafe { CStr::from_ptr(ffi::streamalloc_last_error()) }
        .to_string_lossy()
        .into_owned()
}

/// A caller's allocator: hands out addresses of its own range and logs what it made and
/// what came back. `refuse` makes it return null.
#[derive(Default)]
struct Source {
    made: Mutex<Vec<(u64, usize, c_int)>>,
    freed: Mutex<Vec<(u64, usize, c_int)>>,
    refuse: bool,
}

const SOURCE_BASE: u64 = 0x5000_0000_0000;

unsafe extern "C" fn source_alloc(ctx: *mut c_void, size: usize, device: c_int) -> *mut c_void {
    // SAFETY: the tests pass a live `Source` as ctx.
    let source = unsafe { &*(ctx as *const Source) };
    if source.refuse {
        return std::ptr::null_mut();
    }
    let mut made = source.made.lock().unwrap();
    let next = made
        .last()
        .map_or(SOURCE_BASE, |&(addr, size, _)| addr + size as u64);
    made.push((next, size, device));
    next as usize as *mut c_void
}

unsafe extern "C" fn source_free(ctx: *mut c_void, ptr: *mut c_void, size: usize, device: c_int) {
    // SAFETY: as in source_alloc.
    let source = unsafe { &*(ctx as *const Source) };
    source
        .freed
        .lock()
        .unwrap()
        .push((ptr as usize as u64, size, device));
}

fn give_source(registry: &Registry<WithSources<SimBackend>>, source: &Source) -> c_int {
    // SAFETY: the callbacks accept this ctx, which outlives every use in the test.
    unsafe {
        pool_set_segment_source(
            registry,
            0,
            POOL.0,
            POOL.1,
            Some(source_alloc),
            Some(source_free),
            source as *const Source as *mut c_void,
        )
    }
}

fn malloc(registry: &Registry<WithSources<SimBackend>>, size: usize, pool: (u64, u64)) -> u64 {
    pools::malloc_in_pool(registry, size, 0, std::ptr::null_mut(), pool.0, pool.1) as usize as u64
}

#[test]
fn a_pools_blocks_are_split_from_its_sources_segments_which_go_back_to_it_when_released() {
    let registry = registry(false);
    let source = Source::default();
    assert_eq!(pools::pool_incref(&registry, 0, POOL.0, POOL.1), 1);
    assert_eq!(give_source(&registry, &source), 0, "{}", last_error());

    let blocks: Vec<u64> = (0..3).map(|_| malloc(&registry, 3 * MIB, POOL)).collect();
    let made = source.made.lock().unwrap().clone();
    assert_eq!(
        made.len(),
        1,
        "three 3 MiB blocks split from one segment: {made:?}"
    );
    let (base, size, device) = made[0];
    assert_eq!(device, 0);
    for &block in &blocks {
        assert!(base <= block && block + 3 * MIB as u64 <= base + size as u64);
    }

    // Another pool and the default pool take their memory from streamalloc.
    let default = malloc(&registry, 3 * MIB, (0, 0));
    assert!(default != 0 && !(base..base + size as u64).contains(&default));
    assert_eq!(pools::pool_incref(&registry, 0, 2, 9), 1);
    let other = malloc(&registry, 3 * MIB, (2, 9));
    assert!(other != 0 && !(base..base + size as u64).contains(&other));
    assert_eq!(source.made.lock().unwrap().len(), 1);

    // Freed blocks are cached for the pool: the next request reuses them.
    ffi::free(
        &registry,
        blocks[2] as usize as *mut c_void,
        0,
        0,
        std::ptr::null_mut(),
    );
    assert_eq!(malloc(&registry, 3 * MIB, POOL), blocks[2]);
    assert_eq!(source.made.lock().unwrap().len(), 1);
    assert!(source.freed.lock().unwrap().is_empty());

    for &block in &blocks {
        ffi::free(
            &registry,
            block as usize as *mut c_void,
            0,
            0,
            std::ptr::null_mut(),
        );
    }
    assert_eq!(pools::pool_release(&registry, 0, POOL.0, POOL.1), 0);
    assert_eq!(pools::empty_cache_pool(&registry, 0, POOL.0, POOL.1), 0);
    assert_eq!(
        *source.freed.lock().unwrap(),
        made,
        "each segment back to its source"
    );
    assert!(registry
        .device(0)
        .unwrap()
        .allocator()
        .backend()
        .external_segments()
        .is_empty());
}

#[test]
fn a_source_that_has_no_memory_makes_the_request_fail_as_out_of_memory() {
    let registry = registry(false);
    let source = Source {
        refuse: true,
        ..Source::default()
    };
    assert_eq!(pools::pool_incref(&registry, 0, POOL.0, POOL.1), 1);
    assert_eq!(give_source(&registry, &source), 0);
    assert_eq!(malloc(&registry, 3 * MIB, POOL), 0);
    assert!(last_error().contains("out of memory"), "{}", last_error());
}

#[test]
fn under_expandable_segments_a_pools_segments_still_come_whole_from_its_source() {
    let registry = registry(true);
    let source = Source::default();
    assert_eq!(pools::pool_incref(&registry, 0, POOL.0, POOL.1), 1);
    assert_eq!(give_source(&registry, &source), 0, "{}", last_error());
    // The default pool maps pages as expandable segments do: nothing from the source.
    let default = malloc(&registry, 64 * MIB, (0, 0));
    assert_ne!(default, 0);
    assert!(source.made.lock().unwrap().is_empty());

    // The pool's requests: segments made by the source, split and cached for the pool.
    let small = malloc(&registry, 4096, POOL);
    let large: Vec<u64> = (0..3).map(|_| malloc(&registry, 3 * MIB, POOL)).collect();
    let made = source.made.lock().unwrap().clone();
    assert_eq!(
        made.iter().map(|&(_, size, _)| size).collect::<Vec<_>>(),
        [2 * MIB, 20 * MIB],
        "PyTorch's segment sizes: one small, one shared by the three 3 MiB blocks"
    );
    let inside = |addr: u64| {
        made.iter()
            .any(|&(base, size, _)| base <= addr && addr < base + size as u64)
    };
    assert!(inside(small) && large.iter().all(|&b| inside(b)));
    assert!(!inside(default));
    let device = registry.device(0).unwrap();
    device.run(|a| a.check_invariants()).unwrap().unwrap();

    for block in large.into_iter().chain([small, default]) {
        ffi::free(
            &registry,
            block as usize as *mut c_void,
            0,
            0,
            std::ptr::null_mut(),
        );
    }
    assert_eq!(pools::pool_release(&registry, 0, POOL.0, POOL.1), 0);
    ffi::empty_cache(&registry);
    assert_eq!(
        *source.freed.lock().unwrap(),
        made,
        "each segment back to its source"
    );
    assert!(device.allocator().backend().external_segments().is_empty());
    assert_eq!(device.allocator().stats().reserved_bytes.current, 0);
}

#[test]
fn a_source_is_refused_after_the_pool_allocated_and_for_the_default_pool() {
    let source = Source::default();
    let registry = registry(false);
    assert_eq!(pools::pool_incref(&registry, 0, POOL.0, POOL.1), 1);
    assert_ne!(malloc(&registry, MIB, POOL), 0);
    assert_eq!(give_source(&registry, &source), -1);
    assert!(
        last_error().contains("already holds memory"),
        "{}",
        last_error()
    );

    // SAFETY: the callbacks accept this ctx.
    let default = unsafe {
        pool_set_segment_source(
            &registry,
            0,
            0,
            0,
            Some(source_alloc),
            Some(source_free),
            &source as *const Source as *mut c_void,
        )
    };
    assert_eq!(default, -1);
    // SAFETY: a null callback is what is being refused.
    let null = unsafe {
        pool_set_segment_source(
            &registry,
            0,
            3,
            3,
            None,
            Some(source_free),
            std::ptr::null_mut(),
        )
    };
    assert_eq!(null, -1);
    assert!(source.made.lock().unwrap().is_empty());
}

/// The wrapper forwards every capability of the backend it wraps: free pages around a live
/// block are stitched into one range through it as through the device itself (a method
/// left to the trait's default would switch stitching off, and memory would grow).
#[test]
fn the_wrapped_device_stitches_as_the_device_does() {
    use streamalloc_allocator::{Allocator, Config};
    const MIB: u64 = 1 << 20;
    let device = SimBackend::new(1 << 30);
    let stream = device.create_stream();
    let allocator = Allocator::new(WithSources::new(device, 0), Config::default()).unwrap();
    let below = allocator.malloc(30 * MIB, stream).unwrap();
    let live = allocator.malloc(4 * MIB, stream).unwrap();
    let above = allocator.malloc(26 * MIB, stream).unwrap();
    allocator.free(below.ptr).unwrap();
    allocator.free(above.ptr).unwrap();
    let wide = allocator.malloc(40 * MIB, stream).unwrap();
    let stats = allocator.stats();
    assert_eq!(stats.stitches, 1, "{stats:?}");
    assert_eq!(stats.reserved_bytes.peak, 60 * MIB, "{stats:?}");
    allocator.free(wide.ptr).unwrap();
    allocator.free(live.ptr).unwrap();
    allocator.check_invariants().unwrap();
}
