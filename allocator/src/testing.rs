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

use crate::backend::sim::{Access, SimBackend};
use crate::backend::Backend;
use crate::config::{Config, ReusePolicy};
use crate::error::AllocError;
use crate::types::{DevicePtr, StreamId};
use crate::Allocator;

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
}

#[derive(Clone, Debug)]
struct Live {
    ptr: DevicePtr,
    size: u64,
    stream: usize,
    shared: bool,
}

/// A program under execution.
#[derive(Debug)]
pub struct Harness {
    device: SimBackend,
    allocator: Allocator<SimBackend>,
    streams: Vec<StreamId>,
    live: Vec<Live>,
    steps: usize,
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
        })
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
        match *op {
            Op::Malloc {
                stream,
                size,
                duration,
            } => {
                let stream = stream as usize % STREAMS;
                match self.allocator.malloc(size, self.streams[stream]) {
                    Ok(block) => {
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
                        });
                    }
                    Err(AllocError::OutOfMemory(_)) | Err(AllocError::InvalidSize(_)) => {}
                    Err(err) => return Err(format!("step {step}: malloc failed: {err}")),
                }
            }
            Op::Free { block } => {
                if !self.live.is_empty() {
                    let live = self.live.swap_remove(block as usize % self.live.len());
                    self.allocator
                        .free(live.ptr)
                        .map_err(|err| format!("step {step}: free failed: {err}"))?;
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
                    let (owner, user_id) = (self.streams[live.stream], self.streams[user]);
                    // The program's own ordering: the user stream waits for the owner.
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
                    let live = self.live[block as usize % self.live.len()].clone();
                    // Once other streams read it, the owner only reads (a write would be
                    // the program's own race).
                    let access = if live.shared {
                        Access::read(live.ptr, live.size)
                    } else {
                        Access::write(live.ptr, live.size)
                    };
                    self.device.launch(
                        self.streams[live.stream],
                        &[access],
                        u64::from(duration),
                        &format!("step {step}: owner work on {:?}", live.ptr),
                    );
                }
            }
            Op::AdvanceHost { ns } => self.device.advance_host(u64::from(ns)),
            Op::SyncStream { stream } => self
                .device
                .synchronize_stream(self.streams[stream as usize % STREAMS]),
            Op::EmptyCache => {
                self.allocator
                    .empty_cache()
                    .map_err(|err| format!("step {step}: empty_cache failed: {err}"))?;
            }
        }
        self.check()
            .map_err(|err| format!("after step {step} ({op:?}): {err}"))
    }

    /// Checks every invariant now.
    pub fn check(&self) -> Result<(), String> {
        if let Some(race) = self.device.races().first() {
            return Err(race.to_string());
        }
        self.allocator.check_invariants()?;
        let mut ranges: Vec<(u64, u64)> = self
            .live
            .iter()
            .map(|l| (l.ptr.0, l.ptr.0 + l.size))
            .collect();
        ranges.sort_unstable();
        for pair in ranges.windows(2) {
            if pair[0].1 > pair[1].0 {
                return Err(format!(
                    "live blocks overlap: {:#x?} and {:#x?}",
                    pair[0], pair[1]
                ));
            }
        }
        let stats = self.allocator.stats();
        let live_bytes: u64 = self.live.iter().map(|l| l.size).sum();
        if stats.allocated_bytes.current != live_bytes {
            return Err(format!(
                "stats say {} allocated, live blocks add up to {live_bytes}",
                stats.allocated_bytes.current
            ));
        }
        if stats.reserved_bytes.current != self.device.reserved() {
            return Err(format!(
                "stats say {} reserved, the device has {} in segments",
                stats.reserved_bytes.current,
                self.device.reserved()
            ));
        }
        Ok(())
    }

    /// Frees every live block, empties the cache and checks that nothing is left: no
    /// reserved byte, no segment, no event object, no race.
    pub fn finish(mut self) -> Result<(), String> {
        for live in std::mem::take(&mut self.live) {
            self.allocator
                .free(live.ptr)
                .map_err(|err| format!("final free: {err}"))?;
        }
        self.allocator
            .empty_cache()
            .map_err(|err| format!("final empty_cache: {err}"))?;
        self.check()?;
        let stats = self.allocator.stats();
        let leftovers = [
            ("reserved bytes", stats.reserved_bytes.current),
            ("segments", self.device.live_segments() as u64),
            ("outstanding events", stats.events_outstanding),
            ("event objects", self.device.live_events() as u64),
        ];
        for (what, count) in leftovers {
            if count != 0 {
                return Err(format!(
                    "after freeing everything and empty_cache: {count} {what} left"
                ));
            }
        }
        Ok(())
    }
}

/// Decodes arbitrary bytes into a configuration and a program (the fuzz target's input
/// format: the first two bytes choose the policy and event batch, then 8 bytes an op).
pub fn decode(bytes: &[u8]) -> (Config, Vec<Op>) {
    let mut config = Config::default();
    if let Some(first) = bytes.first() {
        config.reuse_policy = if first & 1 == 0 {
            ReusePolicy::StreamWait
        } else {
            ReusePolicy::Pytorch
        };
        config.event_batch = 1 + usize::from(first >> 1) % 16;
    }
    if let Some(second) = bytes.get(1) {
        config.trace_capacity = usize::from(*second) * 4;
    }
    let ops = bytes
        .get(2..)
        .unwrap_or_default()
        .chunks_exact(8)
        .map(decode_op)
        .collect();
    (config, ops)
}

fn decode_op(chunk: &[u8]) -> Op {
    let word = u64::from_le_bytes(chunk.try_into().expect("chunks of 8"));
    let field = |shift: u32, bits: u32| (word >> shift) & ((1 << bits) - 1);
    let duration = (field(40, 16) as u32) * 100;
    match field(0, 3) {
        0 | 1 => Op::Malloc {
            stream: field(3, 2) as u8,
            // Sizes across both pools and every segment class, 1 B to 48 MiB.
            size: (1 + field(8, 26) % (48 << 20)) >> field(34, 4),
            duration,
        },
        2 => Op::Free {
            block: field(8, 16) as u16,
        },
        3 => Op::Use {
            block: field(8, 16) as u16,
            stream: field(3, 2) as u8,
            duration,
        },
        4 => Op::Work {
            block: field(8, 16) as u16,
            duration,
        },
        5 => Op::AdvanceHost { ns: duration },
        6 => Op::SyncStream {
            stream: field(3, 2) as u8,
        },
        _ => {
            if field(3, 3) == 0 {
                Op::EmptyCache
            } else {
                Op::Free {
                    block: field(8, 16) as u16,
                }
            }
        }
    }
}

/// Runs a decoded program on a 512 MiB device and reports the first violation.
pub fn run_bytes(bytes: &[u8]) -> Result<(), String> {
    let (config, ops) = decode(bytes);
    let mut harness = Harness::new(config, 512 << 20).map_err(|e| e.to_string())?;
    for op in &ops {
        harness.apply(op)?;
    }
    harness.finish()
}

/// splitmix64: the small deterministic generator behind simulated workloads (`p2p-sim`,
/// `p2p-nccl`, the staging property tests), so that the same seed gives every process
/// and every run the same tensors, with no dependency.
#[derive(Clone, Debug)]
pub struct SplitMix64(pub u64);

impl SplitMix64 {
    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// A number in `0..n` (0 when `n` is 0).
    pub fn below(&mut self, n: u64) -> u64 {
        if n == 0 {
            0
        } else {
            self.next_u64() % n
        }
    }

    /// A number in `lo..hi` (`lo` when the range is empty or one wide).
    pub fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.next_u64() % hi.saturating_sub(lo).max(1)
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
