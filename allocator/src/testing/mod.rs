//! An operation-level harness over the simulator: random programs of malloc / free /
//! record_use / stream work / host progress / empty_cache, executed against an
//! [`Allocator`] on a [`SimBackend`], with every invariant checked after every step.
//!
//! One harness serves the property tests (`tests/engine_properties.rs`), the cargo-fuzz
//! target (`fuzz/`) and the corpus replay test, so they all check the same things:
//! - no race: the simulator's detector finds none (the generated programs are themselves
//!   race-free, so any race is the allocator's);
//! - no two live blocks overlap;
//! - the engine's own invariants hold ([`Allocator::check_invariants`]) and the stats add
//!   up to the live blocks and the simulator's segments;
//! - after freeing everything and `empty_cache`, nothing is reserved and no event object
//!   is left.
//!
//! # Graphs and pools
//! Programs may also capture CUDA graphs, replay and destroy them, and allocate from a
//! user pool (`torch.cuda.MemPool`). A capture gets a fresh pool, as `torch.cuda.graph`
//! does: mallocs on the capturing stream go to it, and their first writes, like any
//! owner work on that stream, are recorded into the graph rather than run. Owner work
//! during capture on a block from outside the pool makes the block a graph input (read by
//! every replay), which the program then keeps alive until the graph is destroyed.
//!
//! The programs stay race-free by following PyTorch's rules: a replay touches only its
//! pool's memory and its inputs, so it is ordered after the eager work on those (and the
//! previous replays of graphs sharing them), eager work on them is ordered after the last
//! such replay, and `record_use` tells the allocator which streams replayed over a live
//! block. Nothing else is ordered: an eager block that overlaps a graph's memory races
//! with the replays. During a capture the program makes no call CUDA forbids (no
//! synchronisation, no `empty_cache`, no cross-stream wait with the capturing stream).
//!
//! One more invariant then: memory handed out in a pool that still has uses is never
//! handed to an allocation of another pool (the default one included).

mod bytes;
mod checks;
mod graphs;

pub use self::bytes::{decode, run_bytes};

use crate::backend::sim::GraphId;
use crate::backend::sim::{Access, SimBackend};
use crate::backend::{Events, Streams, VirtualMemory};
use crate::config::{Config, ReusePolicy};
use crate::error::AllocError;
/// The generator the property tests draw workloads from, re-exported where they import it.
pub use crate::rng::SplitMix64;
use crate::types::{DevicePtr, PoolId, StreamId};
use crate::Allocator;
use std::collections::{BTreeMap, BTreeSet};

/// Streams a harness program uses.
pub const STREAMS: usize = 4;

/// One step of a program. Indices pick among live blocks modulo their number, so any
/// sequence is valid.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Op {
    /// Allocate `size` bytes on stream `stream`; the new owner then writes the block.
    Malloc {
        /// Stream index, modulo [`STREAMS`].
        stream: u8,
        /// Bytes.
        size: u64,
        /// Duration of the first write, nanoseconds.
        duration: u32,
    },
    /// Free the `block`-th live block.
    Free {
        /// Live block index (modulo).
        block: u16,
    },
    /// Another stream uses the block: the program orders it after the owner's work (an
    /// event and a wait), launches a read on it and tells the allocator (`record_use`).
    Use {
        /// Live block index (modulo).
        block: u16,
        /// Stream index, modulo [`STREAMS`].
        stream: u8,
        /// Duration of the read, nanoseconds.
        duration: u32,
    },
    /// The owner works on the block again (a write, or a read once other streams use it).
    Work {
        /// Live block index (modulo).
        block: u16,
        /// Duration, nanoseconds.
        duration: u32,
    },
    /// The host does other work for a while.
    AdvanceHost {
        /// Nanoseconds.
        ns: u32,
    },
    /// The host waits for a stream.
    SyncStream {
        /// Stream index, modulo [`STREAMS`].
        stream: u8,
    },
    /// `empty_cache()`.
    EmptyCache,
    /// Starts capturing a graph on `stream` into a new pool (ignored while a capture is
    /// under way).
    BeginCapture {
        /// Stream index, modulo [`STREAMS`].
        stream: u8,
    },
    /// Ends the capture under way, if any: the graph becomes replayable.
    EndCapture,
    /// Replays the `graph`-th live graph on `stream`.
    Replay {
        /// Live graph index (modulo).
        graph: u16,
        /// Stream index, modulo [`STREAMS`].
        stream: u8,
    },
    /// Destroys the `graph`-th live graph and releases its pool's use.
    DestroyGraph {
        /// Live graph index (modulo).
        graph: u16,
    },
    /// Like [`Op::Malloc`], from the program's user pool (`torch.cuda.MemPool`).
    PoolMalloc {
        /// Stream index, modulo [`STREAMS`].
        stream: u8,
        /// Bytes.
        size: u64,
        /// Duration of the first write, nanoseconds.
        duration: u32,
    },
}

/// The program's user pool.
pub const USER_POOL: PoolId = PoolId(0, 1);

/// The rule the program's user pool is given when it is made.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum PoolRule {
    /// None: it grows as the allocator does.
    #[default]
    Plain,
    /// It grows by whole segments (a pool whose segments come from another allocator).
    WholeSegments,
    /// Its blocks are never split (`MemPool(no_split=True)`).
    NoSplit,
}

#[derive(Clone, Debug)]
struct Live {
    ptr: DevicePtr,
    size: u64,
    stream: usize,
    shared: bool,
    pool: PoolId,
    /// Graphs (by key) whose replays touch the block: the one it was allocated in during
    /// capture, and those that read it as an input.
    graphs: Vec<u64>,
}

/// A captured graph, by key (its pool is `PoolId(key, 0)`). Kept after destruction, as
/// eager work on its former memory must still follow its last replay.
#[derive(Clone, Debug)]
struct Graph {
    /// Set when the capture ends.
    id: Option<GraphId>,
    pool: PoolId,
    alive: bool,
    /// Stream of the latest replay.
    last_replay: Option<usize>,
    /// Streams that touched the graph's memory eagerly since the latest replay.
    touchers: BTreeSet<usize>,
    /// Graphs whose replays touch memory this graph's replays touch (one wrote a block
    /// the other reads). Kept after the block is freed: the replays still touch it.
    shares_memory_with: BTreeSet<u64>,
}

/// A program under execution.
#[derive(Debug)]
pub struct Harness {
    device: SimBackend,
    allocator: Allocator<SimBackend>,
    streams: Vec<StreamId>,
    live: Vec<Live>,
    steps: usize,
    /// The capture under way: stream index and graph key.
    capture: Option<(usize, u64)>,
    graphs: BTreeMap<u64, Graph>,
    next_graph: u64,
    /// Every range handed out in each pool that has uses, by pool.
    pool_ranges: BTreeMap<PoolId, Vec<(u64, u64)>>,
    check_pool_isolation: bool,
    /// Every out-of-memory failure under a limit is checked against
    /// [`Harness::pressure_floor`].
    check_pressure_bound: bool,
    user_pool_rule: PoolRule,
}

impl Harness {
    /// A harness with a device of `capacity` bytes.
    pub fn new(config: Config, capacity: u64) -> Result<Self, AllocError> {
        let device = SimBackend::new(capacity);
        let allocator = Allocator::new(device.clone(), config)?;
        let streams = (0..STREAMS).map(|_| device.create_stream()).collect();
        Ok(Self {
            device,
            allocator,
            streams,
            live: Vec::new(),
            steps: 0,
            capture: None,
            graphs: BTreeMap::new(),
            next_graph: 1,
            pool_ranges: BTreeMap::new(),
            check_pool_isolation: true,
            check_pressure_bound: false,
            user_pool_rule: PoolRule::Plain,
        })
    }

    /// Gives the user pool `rule` when the program makes it.
    pub fn with_user_pool_rule(mut self, rule: PoolRule) -> Self {
        self.user_pool_rule = rule;
        self
    }

    /// Checks every out-of-memory failure of a malloc made outside a capture against the
    /// pressure bound: under a memory limit, a request may fail only if the memory the
    /// engine cannot give back ([`Harness::pressure_floor`]) and the request in whole pages
    /// exceed the limit.
    pub fn check_pressure_bound(&mut self) {
        self.check_pressure_bound = true;
    }

    /// The least memory the engine could have reserved for a request of `pool`: everything
    /// reserved but the whole free pages the request may use. Those are the whole pages of
    /// runs of free blocks in expandable segments of pools that hold no uses (the engine
    /// may unmap them), and, while stitching under the `stream_wait` policy, of the
    /// request's own pool (stitching may join them). What is left is live memory, free
    /// bytes stranded in partly used pages, and other pools' pinned memory.
    pub fn pressure_floor(&self, pool: PoolId) -> u64 {
        let snapshot = self.allocator.snapshot();
        let page = self.device.page_size();
        let config = self.allocator.config();
        let joins_own = config.stitch && config.reuse_policy == ReusePolicy::StreamWait;
        let mut usable = 0;
        for segment in snapshot.segments.iter().filter(|s| s.expandable) {
            let pinned = self.pool_ranges.contains_key(&segment.mempool);
            if pinned && !(joins_own && segment.mempool == pool) {
                continue;
            }
            // Runs of adjacent free blocks (after a synchronisation, free neighbours of any
            // streams merge).
            let mut runs: Vec<(u64, u64)> = Vec::new();
            for block in &segment.blocks {
                if block.state == crate::snapshot::BlockState::ActiveAllocated {
                    continue;
                }
                let (start, end) = (block.addr.0, block.addr.0 + block.size);
                match runs.last_mut() {
                    Some((_, to)) if *to == start => *to = end,
                    _ => runs.push((start, end)),
                }
            }
            usable += runs
                .iter()
                .map(|&(start, end)| crate::pool::stitch::whole_pages(start, end - start, page).1)
                .sum::<u64>();
        }
        snapshot.stats.reserved_bytes.current - usable
    }

    /// Stops checking pool isolation, so that a test can show what the race detector
    /// alone makes of memory that leaves a pool.
    pub fn skip_pool_isolation_check(&mut self) {
        self.check_pool_isolation = false;
    }

    /// Pools with uses: the user pool once used, and each live graph's.
    pub fn live_pools(&self) -> Vec<PoolId> {
        self.pool_ranges.keys().copied().collect()
    }

    /// Graphs captured and not destroyed.
    pub fn live_graphs(&self) -> usize {
        self.graphs.values().filter(|g| g.alive).count()
    }

    /// The allocator under test.
    pub fn allocator(&self) -> &Allocator<SimBackend> {
        &self.allocator
    }

    /// The simulated device.
    pub fn device(&self) -> &SimBackend {
        &self.device
    }

    /// Blocks currently allocated by the program.
    pub fn live_blocks(&self) -> usize {
        self.live.len()
    }

    /// Executes one step, then checks every invariant.
    pub fn apply(&mut self, op: &Op) -> Result<(), String> {
        self.steps += 1;
        let step = self.steps;
        let capturing = self.capture.map(|(stream, _)| stream);
        match *op {
            Op::Malloc {
                stream,
                size,
                duration,
            } => {
                let stream = stream as usize % STREAMS;
                let pool = match self.capture {
                    Some((capture, key)) if capture == stream => self.graphs[&key].pool,
                    _ => PoolId::DEFAULT,
                };
                self.malloc(step, stream, size, duration, pool)?;
            }
            Op::PoolMalloc {
                stream,
                size,
                duration,
            } => {
                let stream = stream as usize % STREAMS;
                // A capture's allocations belong to its graph's pool.
                if capturing != Some(stream) {
                    if !self.pool_ranges.contains_key(&USER_POOL) {
                        self.allocator
                            .create_or_incref_pool(USER_POOL)
                            .map_err(|err| format!("step {step}: create pool: {err}"))?;
                        let rule = match self.user_pool_rule {
                            PoolRule::Plain => Ok(()),
                            PoolRule::WholeSegments => {
                                self.allocator.set_pool_whole_segments(USER_POOL)
                            }
                            PoolRule::NoSplit => self.allocator.set_pool_no_split(USER_POOL),
                        };
                        rule.map_err(|err| format!("step {step}: pool rule: {err}"))?;
                        self.pool_ranges.insert(USER_POOL, Vec::new());
                    }
                    self.malloc(step, stream, size, duration, USER_POOL)?;
                }
            }
            Op::Free { block } => {
                if !self.live.is_empty() {
                    let index = block as usize % self.live.len();
                    // A live graph's inputs stay allocated while it can be replayed.
                    if !self.is_graph_input(&self.live[index]) {
                        let live = self.live.swap_remove(index);
                        self.allocator
                            .free(live.ptr)
                            .map_err(|err| format!("step {step}: free failed: {err}"))?;
                    }
                }
            }
            Op::Use {
                block,
                stream,
                duration,
            } => {
                if !self.live.is_empty() {
                    let index = block as usize % self.live.len();
                    let user = stream as usize % STREAMS;
                    let live = self.live[index].clone();
                    // A capturing stream takes part in no cross-stream ordering.
                    if capturing.is_some_and(|c| {
                        c == user
                            || c == live.stream
                            || self.touch_dependencies(index).any(|s| s == c)
                    }) {
                        return self.checked(step, op);
                    }
                    let (owner, user_id) = (self.streams[live.stream], self.streams[user]);
                    // The program's own ordering: the user stream waits for the owner, and
                    // for the replays that wrote the block.
                    let event = self.device.create_event().map_err(|e| e.to_string())?;
                    self.device
                        .record_event(event, owner)
                        .map_err(|e| e.to_string())?;
                    self.device
                        .stream_wait_event(user_id, event)
                        .map_err(|e| e.to_string())?;
                    self.device
                        .destroy_event(event)
                        .map_err(|e| e.to_string())?;
                    self.touch_graph_memory(index, user)?;
                    self.device.launch(
                        user_id,
                        &[Access::read(live.ptr, live.size)],
                        u64::from(duration),
                        &format!("step {step}: read of {:?} by stream {user}", live.ptr),
                    );
                    self.allocator
                        .record_use(live.ptr, user_id)
                        .map_err(|err| format!("step {step}: record_use failed: {err}"))?;
                    self.live[index].shared |= user != live.stream;
                }
            }
            Op::Work { block, duration } => {
                if !self.live.is_empty() {
                    let index = block as usize % self.live.len();
                    let live = self.live[index].clone();
                    // Once other streams read it, the owner only reads (a write would be
                    // the program's own race).
                    let mut access = if live.shared {
                        Access::read(live.ptr, live.size)
                    } else {
                        Access::write(live.ptr, live.size)
                    };
                    match self.capture {
                        Some((capture, key)) if capture == live.stream => {
                            // Recorded into the graph. A block from outside its pool is an
                            // input: the graph only reads it.
                            if live.pool != self.graphs[&key].pool {
                                access = Access::read(live.ptr, live.size);
                            }
                            if !live.graphs.contains(&key) {
                                self.live[index].graphs.push(key);
                                // Replays must follow the eager work that filled it.
                                let graph = self.graphs.get_mut(&key).expect("capturing");
                                graph.touchers.insert(live.stream);
                                graph.shares_memory_with.extend(&live.graphs);
                                for other in &live.graphs {
                                    let other = self.graphs.get_mut(other).expect("kept");
                                    other.shares_memory_with.insert(key);
                                }
                            }
                        }
                        _ => {
                            if capturing
                                .is_some_and(|c| self.touch_dependencies(index).any(|s| s == c))
                            {
                                return self.checked(step, op);
                            }
                            self.touch_graph_memory(index, live.stream)?
                        }
                    }
                    self.device.launch(
                        self.streams[live.stream],
                        &[access],
                        u64::from(duration),
                        &format!("step {step}: owner work on {:?}", live.ptr),
                    );
                }
            }
            Op::AdvanceHost { ns } => self.device.advance_host(u64::from(ns)),
            Op::SyncStream { stream } => {
                let stream = stream as usize % STREAMS;
                if capturing != Some(stream) {
                    self.device.synchronize_stream(self.streams[stream]);
                }
            }
            Op::EmptyCache => {
                // It synchronises the device, which a capture forbids.
                if capturing.is_none() {
                    self.allocator
                        .empty_cache()
                        .map_err(|err| format!("step {step}: empty_cache failed: {err}"))?;
                }
            }
            Op::BeginCapture { stream } => {
                if capturing.is_none() {
                    self.begin_capture(stream as usize % STREAMS)
                        .map_err(|err| format!("step {step}: {err}"))?;
                }
            }
            Op::EndCapture => self
                .end_capture()
                .map_err(|err| format!("step {step}: {err}"))?,
            Op::Replay { graph, stream } => {
                let stream = stream as usize % STREAMS;
                if let Some(key) = self.pick_graph(graph) {
                    let waits_on_capture = capturing
                        .is_some_and(|c| c == stream || self.replay_dependencies(key).contains(&c));
                    if !waits_on_capture {
                        self.replay(key, stream)
                            .map_err(|err| format!("step {step}: {err}"))?;
                    }
                }
            }
            Op::DestroyGraph { graph } => {
                if let Some(key) = self.pick_graph(graph) {
                    self.destroy_graph(key)
                        .map_err(|err| format!("step {step}: {err}"))?;
                }
            }
        }
        self.checked(step, op)
    }

    fn checked(&self, step: usize, op: &Op) -> Result<(), String> {
        self.check()
            .map_err(|err| format!("after step {step} ({op:?}): {err}"))
    }

    /// Allocates in `pool` and has the owner write the new block (recorded, not run, on a
    /// capturing stream). Checks that no other live pool ever handed out these bytes.
    fn malloc(
        &mut self,
        step: usize,
        stream: usize,
        size: u64,
        duration: u32,
        pool: PoolId,
    ) -> Result<(), String> {
        let block = match self.allocator.malloc_in(size, self.streams[stream], pool) {
            Ok(block) => block,
            Err(AllocError::OutOfMemory(report)) => {
                if self.check_pressure_bound && self.capture.is_none() {
                    if let Some(limit) = self.allocator.memory_limit() {
                        let page = self.device.page_size();
                        let floor = self.pressure_floor(pool);
                        let request = size.div_ceil(page).max(1) * page;
                        if floor + request <= limit {
                            return Err(format!(
                                "step {step}: a request of {size} bytes on stream {stream} failed \
                                 under a limit of {limit} with {floor} bytes that cannot be given \
                                 back: {request} more fit ({report})"
                            ));
                        }
                    }
                }
                return Ok(());
            }
            Err(AllocError::InvalidSize(_)) | Err(AllocError::CaptureForbidsGrowth(_)) => {
                return Ok(())
            }
            Err(err) => return Err(format!("step {step}: malloc failed: {err}")),
        };
        let (start, end) = (block.ptr.0, block.ptr.0 + block.size);
        for (&other, ranges) in &self.pool_ranges {
            if other == pool || !self.check_pool_isolation {
                continue;
            }
            if let Some((from, to)) = ranges.iter().find(|(from, to)| *from < end && start < *to) {
                return Err(format!(
                    "step {step}: a block of {pool:?} at [{start:#x}, {end:#x}) overlaps \
                     [{from:#x}, {to:#x}), handed out in {other:?}, which still has uses"
                ));
            }
        }
        if let Some(ranges) = self.pool_ranges.get_mut(&pool) {
            ranges.push((start, end));
        }
        let graphs = match self.capture {
            Some((capture, key)) if capture == stream => vec![key],
            _ => Vec::new(),
        };
        self.device.launch(
            self.streams[stream],
            &[Access::write(block.ptr, size)],
            u64::from(duration),
            &format!("step {step}: first write of new block {:?}", block.ptr),
        );
        self.live.push(Live {
            ptr: block.ptr,
            size: block.size,
            stream,
            shared: false,
            pool,
            graphs,
        });
        Ok(())
    }
}

/// Cases for a property test: `PROPTEST_CASES` when set (CI's optimised second run asks
/// for 2000), else `default`. proptest reads that variable only into its default
/// configuration, so a test that sets `cases` itself would ignore it.
pub fn proptest_cases(default: u32) -> u32 {
    std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|cases| cases.parse().ok())
        .unwrap_or(default)
}
