//! Memory pools keep a captured CUDA graph's memory its own.
//!
//! A graph writes the addresses it was captured with on every replay. If memory it
//! allocated during capture goes back to the ordinary free lists once the program frees
//! it, an eager allocation can take it and every replay overwrites that eager tensor.
//! The simulator executes captured work only on replay, so its race detector sees the
//! replay's write land on the eager tensor's bytes.
//!
//! Every scenario runs with whole segments and with expandable segments.

use streamalloc_allocator::backend::sim::{Access, GraphId, RaceKind, SimBackend};
use streamalloc_allocator::{Allocator, Config, DevicePtr, PoolId, StreamId};

const MIB: u64 = 1 << 20;
const SIZE: u64 = 4 * MIB;
const GRAPH_POOL: PoolId = PoolId(1, 0);
const USER_POOL: PoolId = PoolId(0, 1);

/// Whole segments and expandable segments (the default).
fn configs() -> [Config; 2] {
    [
        Config {
            expandable_segments: false,
            ..Config::default()
        },
        Config::default(),
    ]
}

struct Setup {
    device: SimBackend,
    allocator: Allocator<SimBackend>,
    /// Where the graph is captured, and where eager work runs afterwards.
    capture: StreamId,
    /// Where the graph is replayed (`torch.cuda.graph` captures on a side stream too).
    replay: StreamId,
}

fn setup(config: Config) -> Setup {
    let device = SimBackend::new(1 << 30);
    let allocator = Allocator::new(device.clone(), config).unwrap();
    let (capture, replay) = (device.create_stream(), device.create_stream());
    Setup {
        device,
        allocator,
        capture,
        replay,
    }
}

/// What [`capture_free_reuse`] leaves behind.
struct Scenario {
    graph: GraphId,
    /// The graph's intermediate, freed by the program after capture.
    tmp: DevicePtr,
    /// The graph's output, still held.
    out: DevicePtr,
    /// An eager tensor allocated after the free, written once.
    eager: DevicePtr,
}

/// Captures `tmp = alloc; write tmp; out = alloc; out = f(tmp)`, frees `tmp`, then
/// allocates an eager tensor of the same size on the same stream and writes it. Capture
/// allocations go to `pool`, or through plain `malloc` when `None`.
fn capture_free_reuse(s: &Setup, pool: Option<PoolId>) -> Scenario {
    let alloc = |size| match pool {
        Some(pool) => s.allocator.malloc_in(size, s.capture, pool).unwrap(),
        None => s.allocator.malloc(size, s.capture).unwrap(),
    };
    if let Some(pool) = pool {
        s.allocator.begin_allocate_to_pool(pool).unwrap();
    }
    s.device.begin_capture(s.capture);
    let tmp = alloc(SIZE).ptr;
    s.device
        .launch(s.capture, &[Access::write(tmp, SIZE)], 1_000, "write tmp");
    let out = alloc(SIZE).ptr;
    s.device.launch(
        s.capture,
        &[Access::read(tmp, SIZE), Access::write(out, SIZE)],
        1_000,
        "tmp to out",
    );
    let graph = s.device.end_capture(s.capture);
    if let Some(pool) = pool {
        s.allocator.end_allocate_to_pool(pool).unwrap();
    }
    s.allocator.free(tmp).unwrap();
    let eager = s.allocator.malloc(SIZE, s.capture).unwrap().ptr;
    s.device.launch(
        s.capture,
        &[Access::write(eager, SIZE)],
        1_000,
        "eager write",
    );
    Scenario {
        graph,
        tmp,
        out,
        eager,
    }
}

/// True if `[a, a + a_len)` and `[b, b + b_len)` share a byte.
fn overlaps(a: DevicePtr, a_len: u64, b: DevicePtr, b_len: u64) -> bool {
    a.0 < b.0 + b_len && b.0 < a.0 + a_len
}

/// Frees `blocks`, empties the cache and checks that nothing is left on the device.
fn tear_down(s: &Setup, blocks: &[DevicePtr]) {
    for &ptr in blocks {
        s.allocator.free(ptr).unwrap();
    }
    s.allocator.empty_cache().unwrap();
    assert_eq!(s.device.reserved(), 0, "memory left reserved");
    assert_eq!(s.allocator.stats().reserved_bytes.current, 0);
    s.allocator.check_invariants().unwrap();
}

#[test]
fn without_a_pool_a_replay_overwrites_the_eager_tensor_that_took_the_graphs_memory() {
    for config in configs() {
        let s = setup(config);
        let scenario = capture_free_reuse(&s, None);
        assert_eq!(
            scenario.eager, scenario.tmp,
            "the eager tensor got tmp's block"
        );
        s.device.replay(scenario.graph, s.replay);
        let races = s.device.races();
        let race = races.first().expect("the replay's write is reported");
        assert_eq!(race.kind, RaceKind::Unordered, "{race}");
        assert!(race.earlier.starts_with("eager write"), "{race}");
        assert!(
            race.later
                .starts_with(&format!("replay 1 of graph {}: write tmp", scenario.graph)),
            "{race}"
        );
    }
}

#[test]
fn with_the_graph_pools_switch_off_a_pool_gives_no_protection() {
    let s = setup(Config {
        graph_pools: false,
        ..Config::default()
    });
    let scenario = capture_free_reuse(&s, Some(GRAPH_POOL));
    assert_eq!(scenario.eager, scenario.tmp);
    s.device.replay(scenario.graph, s.replay);
    assert!(
        s.device
            .races()
            .iter()
            .any(|race| race.kind == RaceKind::Unordered
                && race.earlier.starts_with("eager write")
                && race.later.contains("write tmp")),
        "{:?}",
        s.device.races()
    );
}

#[test]
fn with_the_graphs_pool_replays_never_touch_eager_memory() {
    for config in configs() {
        let s = setup(config);
        let scenario = capture_free_reuse(&s, Some(GRAPH_POOL));
        for pool_block in [scenario.tmp, scenario.out] {
            assert!(
                !overlaps(scenario.eager, SIZE, pool_block, SIZE),
                "the eager tensor {:?} overlaps pool block {pool_block:?}",
                scenario.eager
            );
        }
        assert_eq!(
            s.allocator.pool_live_allocations(GRAPH_POOL),
            vec![scenario.out]
        );
        // The pool keeps its memory through empty_cache while the graph lives.
        s.allocator.empty_cache().unwrap();
        s.device.replay(scenario.graph, s.replay);
        s.device.replay(scenario.graph, s.replay);
        assert!(s.device.races().is_empty(), "{:?}", s.device.races());

        s.device.destroy_graph(scenario.graph);
        assert_eq!(s.allocator.release_pool(GRAPH_POOL).unwrap(), 0);
        tear_down(&s, &[scenario.out, scenario.eager]);
        assert!(s.device.races().is_empty(), "{:?}", s.device.races());
    }
}

#[test]
fn graphs_sharing_a_pool_replayed_in_capture_order_do_not_race() {
    for config in configs() {
        let s = setup(config);
        let stream = s.capture;
        // Each graph holds a use of the pool, as a capture with `pool=` does.
        assert_eq!(s.allocator.begin_allocate_to_pool(GRAPH_POOL).unwrap(), 1);
        s.device.begin_capture(stream);
        let a = s.allocator.malloc_in(SIZE, stream, GRAPH_POOL).unwrap().ptr;
        s.device
            .launch(stream, &[Access::write(a, SIZE)], 1_000, "g1: write a");
        let b = s.allocator.malloc_in(SIZE, stream, GRAPH_POOL).unwrap().ptr;
        s.device.launch(
            stream,
            &[Access::read(a, SIZE), Access::write(b, SIZE)],
            1_000,
            "g1: a to b",
        );
        s.allocator.free(a).unwrap();
        let g1 = s.device.end_capture(stream);
        s.allocator.end_allocate_to_pool(GRAPH_POOL).unwrap();

        assert_eq!(s.allocator.begin_allocate_to_pool(GRAPH_POOL).unwrap(), 2);
        s.device.begin_capture(stream);
        let c = s.allocator.malloc_in(SIZE, stream, GRAPH_POOL).unwrap().ptr;
        s.device.launch(
            stream,
            &[Access::read(b, SIZE), Access::write(c, SIZE)],
            1_000,
            "g2: b to c",
        );
        let g2 = s.device.end_capture(stream);
        s.allocator.end_allocate_to_pool(GRAPH_POOL).unwrap();
        assert_eq!(
            c, a,
            "the second graph reuses the first's freed intermediate"
        );

        let eager = s.allocator.malloc(SIZE, stream).unwrap().ptr;
        s.device
            .launch(stream, &[Access::write(eager, SIZE)], 1_000, "eager write");
        for block in [a, b] {
            assert!(!overlaps(eager, SIZE, block, SIZE));
        }
        for _ in 0..2 {
            s.device.replay(g1, s.replay);
            s.device.replay(g2, s.replay);
        }
        assert!(s.device.races().is_empty(), "{:?}", s.device.races());
        // The sharing is safe only in capture order: unordered replays of the two graphs
        // write the same bytes.
        let elsewhere = s.device.create_stream();
        s.device.replay(g1, s.replay);
        s.device.replay(g2, elsewhere);
        assert!(
            s.device
                .races()
                .iter()
                .any(|race| race.kind == RaceKind::Unordered
                    && race.earlier.contains("g1: write a")
                    && race.later.contains("g2: b to c")),
            "{:?}",
            s.device.races()
        );

        s.device.destroy_graph(g1);
        assert_eq!(s.allocator.release_pool(GRAPH_POOL).unwrap(), 1);
        s.device.destroy_graph(g2);
        assert_eq!(s.allocator.release_pool(GRAPH_POOL).unwrap(), 0);
        tear_down(&s, &[b, c, eager]);
    }
}

#[test]
fn a_user_pool_serves_only_its_own_allocations_and_keeps_its_memory_until_released() {
    for config in configs() {
        let s = setup(config);
        let stream = s.capture;
        assert_eq!(s.allocator.create_or_incref_pool(USER_POOL).unwrap(), 1);
        let mine = s.allocator.malloc_in(SIZE, stream, USER_POOL).unwrap();
        let site = s.allocator.allocation_at(mine.ptr).unwrap();
        let (segment, segment_size) = (site.segment, site.segment_size);
        assert_eq!(s.allocator.pool_live_allocations(USER_POOL), vec![mine.ptr]);
        assert!(s
            .allocator
            .pool_live_allocations(PoolId::DEFAULT)
            .is_empty());
        s.allocator.free(mine.ptr).unwrap();
        assert!(s.allocator.pool_live_allocations(USER_POOL).is_empty());

        // Ordinary allocations of every size never land in the pool's memory.
        let mut ordinary = Vec::new();
        for size in [512, 64 << 10, MIB, SIZE, SIZE] {
            let block = s.allocator.malloc(size, stream).unwrap();
            assert!(
                !overlaps(block.ptr, size, segment, segment_size),
                "a default-pool block at {:?} lies in the pool's segment",
                block.ptr
            );
            ordinary.push(block.ptr);
        }
        let in_pool = s.allocator.malloc_in(SIZE, stream, USER_POOL).unwrap();
        assert_eq!(in_pool.ptr, mine.ptr, "the pool reuses its own free block");
        s.allocator.free(in_pool.ptr).unwrap();

        // While the pool has a use, empty_cache leaves its memory alone.
        let reserved = s.device.reserved();
        s.allocator.empty_cache().unwrap();
        assert_eq!(s.device.reserved(), reserved);
        assert_eq!(s.allocator.release_pool(USER_POOL).unwrap(), 0);
        assert_eq!(s.allocator.pool_use_count(USER_POOL), 0);
        assert!(
            s.allocator.malloc_in(SIZE, stream, USER_POOL).is_err(),
            "a released pool serves nothing"
        );
        s.allocator.empty_cache().unwrap();
        assert!(
            s.device.reserved() < reserved,
            "the pool's memory went back"
        );
        tear_down(&s, &ordinary);
        assert!(s.device.races().is_empty(), "{:?}", s.device.races());
    }
}

// While one stream captures (PyTorch's default, global capture mode), the other streams'
// allocations may not query events, wait on events recorded on the capturing stream, or
// synchronise the device and free segments: any of these breaks the capture. The engine
// learns of the capture as PyTorch tells its allocator, by `begin_allocate_to_pool`.

/// Runs `body` while `capture` captures into the graph pool, announced to the engine as
/// PyTorch announces it.
fn during_capture<T>(
    allocator: &Allocator<SimBackend>,
    device: &SimBackend,
    capture: StreamId,
    body: impl FnOnce() -> T,
) -> T {
    allocator.begin_allocate_to_pool(GRAPH_POOL).unwrap();
    device.begin_capture(capture);
    let result = body();
    device.end_capture(capture);
    allocator.end_allocate_to_pool(GRAPH_POOL).unwrap();
    result
}

#[test]
fn while_one_stream_captures_another_streams_malloc_queries_no_event() {
    let s = setup(Config {
        reuse_policy: streamalloc_allocator::ReusePolicy::Pytorch,
        ..Config::default()
    });
    let (capture, other) = (s.capture, s.replay);
    let used = s.allocator.malloc(MIB, capture).unwrap();
    s.allocator.record_use(used.ptr, other).unwrap();
    s.allocator.free(used.ptr).unwrap();
    during_capture(&s.allocator, &s.device, capture, || {
        s.allocator.malloc(MIB, other).unwrap()
    });
    assert!(s.device.races().is_empty(), "{:?}", s.device.races());
}

#[test]
fn while_one_stream_captures_another_stream_never_takes_its_blocks_through_a_wait() {
    let s = setup(Config::default());
    let (capture, other) = (s.capture, s.replay);
    let block = s.allocator.malloc(MIB, capture).unwrap();
    s.allocator.free(block.ptr).unwrap();
    during_capture(&s.allocator, &s.device, capture, || {
        s.allocator.malloc(MIB, other).unwrap()
    });
    assert!(s.device.races().is_empty(), "{:?}", s.device.races());
}

#[test]
fn while_one_stream_captures_another_streams_malloc_frees_no_segment() {
    for config in configs() {
        let device = SimBackend::new(96 * MIB);
        let allocator = Allocator::new(device.clone(), config).unwrap();
        let (capture, cacher, other) = (
            device.create_stream(),
            device.create_stream(),
            device.create_stream(),
        );
        let cached = allocator.malloc(40 * MIB, cacher).unwrap();
        allocator.free(cached.ptr).unwrap();
        // Only releasing the cached segment (or unmapping its pages) would make room: that
        // must wait for the capture to end, so the request fails instead.
        let during = during_capture(&allocator, &device, capture, || {
            allocator.malloc(60 * MIB, other)
        });
        assert!(device.races().is_empty(), "{:?}", device.races());
        assert!(during.is_err(), "{during:?}");
    }
}
