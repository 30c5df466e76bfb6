//! A deterministic simulated GPU with a race detector: the backend of every CI test.
//!
//! # The model
//! - **Memory**: a finite capacity; segments get fresh, never-reused address ranges, so a
//!   touch of freed memory is always caught.
//! - **Streams**: queues of operations with durations. An operation starts when its stream
//!   is free, the host has enqueued it, and every event its stream waits on has fired; its
//!   completion time is fixed when it is enqueued (nothing later can delay it).
//! - **Host**: runs ahead of the device. Its clock moves only when a test advances it or
//!   when it synchronises (an event, a stream, the device, or a segment free, which the
//!   driver's `cuMemFree` implies). An event query answers whether the event's time has
//!   come on the host clock.
//! - **Happens-before**: a vector clock per stream and one for the host. Recording an event
//!   captures its stream's clock; a stream wait merges it; a host synchronisation, or a
//!   query that answers "complete", merges it into the host clock, which every operation
//!   enqueued afterwards inherits.
//!
//! # The race detector
//! Every operation names the byte ranges it reads and writes ([`Access`]). Each access is
//! checked against the shadow memory: an earlier write (for reads and writes) or read (for
//! writes) by another stream that does not happen-before it is a [`Race`] naming both
//! operations. Touching memory outside any live segment is reported the same way. A
//! correct allocator over race-free programs produces none; property tests assert so.
//!
//! # Virtual memory
//! Address reservations hold no memory; pages mapped into them count against the capacity
//! and are the only part of a reservation an operation may touch (anything else is
//! [`RaceKind::OutOfBounds`]). Unmapping is the host releasing memory with no implicit
//! synchronisation, as `cuMemUnmap` does: any earlier access to the pages that the host
//! has not observed complete is reported as a [`RaceKind::Unordered`] race with the unmap.
//! Each `map_pages` call is one mapping of one physical allocation, and `unmap_pages` must
//! cover whole mappings, as `cuMemUnmap` requires. `alias_pages` maps pages already mapped
//! a second time, elsewhere (stitching), and as a driver does, only whole allocations (so
//! stitching asks for one allocation per page, `set_page_allocations`): the detector checks accesses at the physical
//! pages (see [`vm`]), so the two addresses of one byte are one byte to it, and a page
//! goes back to the device only with its last mapping.
//!
//! # Contents and host copies
//! Each byte range carries a version, the operation that last wrote it ([`contents`]):
//! enough to check that memory copied to page-locked host buffers and back holds what it
//! held ([`SimBackend::contents`]). Host copies run on the backend's own stream and are
//! checked like launches ([`copies`]); a page mapped fresh holds version 0.
//!
//! # Graphs
//! CUDA graphs are captured and replayed as on a real device, so that the detector sees
//! what a graph does to memory when it runs, not when it was recorded:
//! - [`SimBackend::begin_capture`] starts capturing a stream. From then on a
//!   [`SimBackend::launch`] on it does not execute: its label, accesses and duration are
//!   appended to the graph being captured, and the stream's clock and time stay put.
//! - [`SimBackend::end_capture`] ends it and returns the [`GraphId`].
//! - [`SimBackend::replay`] enqueues the graph's operations, in capture order, on any
//!   stream, each checked exactly like a launch and labelled `replay N of graph G:
//!   <label>`. A replay's access to bytes that eager work touched with no happens-before
//!   is an [`RaceKind::Unordered`] race naming both; an access to memory that is no longer
//!   in a live segment or mapping is [`RaceKind::OutOfBounds`]. The addresses are the ones
//!   captured: memory a graph uses must stay the graph's for as long as it is replayed.
//! - [`SimBackend::destroy_graph`] forgets it.
//!
//! Capture rules are checked while a stream captures: device synchronisation, event
//! queries, segment frees, host synchronisation with the capturing stream, waits of the
//! capturing stream on events recorded outside the capture, and waits of other streams on
//! events recorded inside it (in CUDA that would pull them into the capture, which the
//! simulator does not model). [`SimBackend::set_capturing`] turns the rules on without
//! recording a graph (launches then execute at once), for tests of the rules alone.

mod clock;
mod contents;
mod copies;
mod driver;
mod graphs;
mod ipc;
mod race;
mod shadow;
mod unmap;
mod vm;

pub use self::graphs::GraphId;
pub use self::race::{Access, Race, RaceKind};

use self::clock::VectorClock;
use self::contents::{Contents, HostMemory};
use self::graphs::{CapturedOp, SimGraph};
use self::shadow::{OpRef, Shadow};
use self::vm::VirtualMemory;
use super::BackendResult;
use crate::error::BackendError;
use crate::types::{DevicePtr, StreamId};
use parking_lot::Mutex;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// Where simulated segments start (an address that looks like a real device pointer).
const BASE_ADDRESS: u64 = 0x7f00_0000_0000;
/// Gap left after every segment so that segments are never adjacent.
const SEGMENT_GUARD: u64 = 2 << 20;
/// Page size of the simulated virtual-memory API (CUDA's usual granularity).
pub const PAGE_SIZE: u64 = 2 << 20;
/// The entry of `SimState::calls` that counts physical allocations the virtual-memory calls
/// touched ([`SimBackend::driver_allocations`]).
const DRIVER_ALLOCATIONS: &str = "driver allocations";

#[derive(Debug, Default)]
struct SimStream {
    /// Device time at which the last enqueued operation completes.
    tail_time: u64,
    /// What has happened before the stream's next operation.
    clock: VectorClock,
    /// Operations enqueued.
    ops: u64,
}

#[derive(Debug, Clone, Default)]
struct SimEvent {
    /// Device time at which the captured work completes, and the captured clock; `None`
    /// until recorded (an unrecorded event counts as complete, as in CUDA).
    recorded: Option<(u64, VectorClock)>,
    /// Stream it was recorded on, for capture checks.
    stream: Option<usize>,
    /// Recorded while its stream was capturing: it stands for captured work.
    in_capture: bool,
}

#[derive(Debug, Default)]
struct SimState {
    capacity: u64,
    reserved: u64,
    next_address: u64,
    /// Live segments: start → size.
    segments: BTreeMap<u64, u64>,
    /// Address reservations, the mappings into them and the physical pages behind those.
    vm: VirtualMemory,
    streams: Vec<SimStream>,
    stream_index: HashMap<StreamId, usize>,
    host_time: u64,
    host_clock: VectorClock,
    events: HashMap<u64, SimEvent>,
    next_event: u64,
    shadow: Shadow,
    /// Labels of every operation, for race messages.
    log: Vec<String>,
    races: Vec<Race>,
    capturing: HashSet<usize>,
    /// Streams the program destroyed: naming one in a call is a misuse (on a GPU, a
    /// dangling handle).
    destroyed: HashSet<usize>,
    /// Streams recording a graph (a subset of `capturing`) and what they recorded.
    recording: HashMap<usize, Vec<CapturedOp>>,
    graphs: BTreeMap<u64, SimGraph>,
    next_graph: u64,
    /// Backend calls made, by name, for tests that count driver traffic.
    calls: BTreeMap<&'static str, u64>,
    /// Fail the next `alloc_segment` calls with a non-OOM error (failure injection).
    fail_next_allocs: u32,
    /// Refuse every `alias_pages` call, as a driver without second mappings would.
    refuse_aliases: bool,
    /// `map_pages` backs each page with its own allocation (`set_page_allocations`).
    page_allocations: bool,
    /// Host time each `map_pages` and `unmap_pages` call takes (0: free).
    mapping_cost_ns: u64,
    /// Panic in the next call of this name (panic injection).
    panic_next: Option<&'static str>,
    /// Descriptors of exported allocations and imports (CUDA IPC).
    ipc: ipc::SimIpc,
    /// What device memory holds, keyed like `shadow` (see [`contents`]).
    contents: Contents,
    /// Page-locked host buffers and what they hold.
    host: HostMemory,
}

/// How the message of a panic planted by [`SimBackend::panic_on_next`] begins, so that
/// tests and harnesses tell planted panics from real ones.
pub const INJECTED_PANIC: &str = "injected panic in";

/// The simulated device. Cloning shares the device (it is an `Arc` inside).
#[derive(Clone, Debug, Default)]
pub struct SimBackend {
    state: Arc<Mutex<SimState>>,
    /// The host clock, mirrored outside the lock so trace timestamps cost one load.
    host_now: Arc<AtomicU64>,
}

impl SimBackend {
    /// A device with `capacity` bytes of memory.
    pub fn new(capacity: u64) -> Self {
        Self::with_base_address(capacity, BASE_ADDRESS)
    }

    /// A device with `capacity` bytes of memory whose segments start at `base`: several
    /// simulated devices in one process then hand out disjoint addresses, as real GPUs do.
    pub fn with_base_address(capacity: u64, base: u64) -> Self {
        let state = SimState {
            capacity,
            next_address: base,
            next_event: 1,
            next_graph: 1,
            ..SimState::default()
        };
        Self {
            state: Arc::new(Mutex::new(state)),
            host_now: Arc::new(AtomicU64::new(0)),
        }
    }

    /// A new stream.
    pub fn create_stream(&self) -> StreamId {
        let mut state = self.state.lock();
        let id = StreamId(0x5000 + state.streams.len() as u64);
        state.stream_of(id);
        id
    }

    /// Destroys `stream`, as `cudaStreamDestroy` would: its queued work still runs, and any
    /// later call naming it is reported ([`RaceKind::DeadStream`]) and fails.
    pub fn destroy_stream(&self, stream: StreamId) {
        let mut state = self.state.lock();
        let index = state.stream_of(stream);
        state.destroyed.insert(index);
    }

    /// Enqueues an operation of `duration_ns` on `stream` that performs `accesses`, checking
    /// each against every earlier access. `label` names it in race reports. On a stream
    /// that records a graph ([`SimBackend::begin_capture`]) it is recorded instead.
    pub fn launch(&self, stream: StreamId, accesses: &[Access], duration_ns: u64, label: &str) {
        self.state
            .lock()
            .launch(stream, accesses, duration_ns, label);
    }

    /// Moves the host clock forward (the host doing other work).
    pub fn advance_host(&self, ns: u64) {
        let mut state = self.state.lock();
        state.host_time += ns;
        self.publish(&state);
    }

    /// Makes every later `map_pages`, `alias_pages` and `unmap_pages` call take `ns` of host
    /// time per physical allocation it creates, maps or unmaps, as the driver's do (on an
    /// H200 under load, 40-70 µs an allocation to create and map with its access, 20-30 to
    /// unmap, whatever its size), so that policies weighing that cost can be tested.
    pub fn set_mapping_cost(&self, ns: u64) {
        self.state.lock().mapping_cost_ns = ns;
    }

    /// Blocks the host until `stream`'s work is done.
    pub fn synchronize_stream(&self, stream: StreamId) {
        let mut state = self.state.lock();
        let index = state.stream_of(stream);
        if state.capturing.contains(&index) {
            state.capture_violation(format!("synchronisation with capturing stream {index}"));
        }
        let (time, clock) = (
            state.streams[index].tail_time,
            state.streams[index].clock.clone(),
        );
        state.host_time = state.host_time.max(time);
        state.host_clock.merge(&clock);
        self.publish(&state);
    }

    /// Makes the next `count` segment allocations (or page mappings) fail with a driver
    /// error that is not an out-of-memory (failure injection for tests).
    pub fn fail_next_segment_allocs(&self, count: u32) {
        self.state.lock().fail_next_allocs = count;
    }

    /// Makes every later `alias_pages` call fail with a driver error that is not an
    /// out-of-memory, as on a driver that cannot map an allocation a second time.
    pub fn refuse_second_mappings(&self) {
        self.state.lock().refuse_aliases = true;
    }

    /// Makes the next backend call named `name` (as counted by [`SimBackend::calls`], e.g.
    /// `"alloc_segment"`) panic, with the message [`INJECTED_PANIC`] followed by the name:
    /// for tests of how callers contain a panic inside the engine.
    pub fn panic_on_next(&self, name: &'static str) {
        self.state.lock().panic_next = Some(name);
    }

    /// Every violation found so far.
    pub fn races(&self) -> Vec<Race> {
        self.state.lock().races.clone()
    }

    /// The physical bytes behind `[ptr, ptr + len)`, as `(start, end)` ranges: a whole
    /// segment is its own physical memory, mapped memory the pages its mappings hold (two
    /// addresses mapping one page give the same range). `None` if some byte is in neither.
    pub fn physical_ranges(&self, ptr: DevicePtr, len: u64) -> Option<Vec<(u64, u64)>> {
        let state = self.state.lock();
        let pieces = state.physical_pieces(ptr.0, len)?;
        Some(
            pieces
                .iter()
                .map(|&(_, len, physical)| (physical, physical + len))
                .collect(),
        )
    }

    /// Bytes currently obtained by segments.
    pub fn reserved(&self) -> u64 {
        self.state.lock().reserved
    }

    /// Bytes of physical pages mapped into address reservations (part of
    /// [`SimBackend::reserved`]): a page mapped at several addresses counts once.
    pub fn mapped(&self) -> u64 {
        self.state.lock().vm.physical_bytes
    }

    /// Live segments.
    pub fn live_segments(&self) -> usize {
        self.state.lock().segments.len()
    }

    /// Event objects created and not destroyed.
    pub fn live_events(&self) -> usize {
        self.state.lock().events.len()
    }

    /// The host clock, nanoseconds.
    pub fn host_time(&self) -> u64 {
        self.state.lock().host_time
    }

    /// Device time at which everything enqueued so far completes.
    pub fn device_time(&self) -> u64 {
        let state = self.state.lock();
        state
            .streams
            .iter()
            .map(|s| s.tail_time)
            .max()
            .unwrap_or(0)
            .max(state.host_time)
    }

    /// How many times the backend call `name` (e.g. `"stream_wait_event"`) was made.
    pub fn calls(&self, name: &str) -> u64 {
        self.state.lock().calls.get(name).copied().unwrap_or(0)
    }

    /// Physical allocations the virtual-memory calls created, mapped (a second time too)
    /// or unmapped: what the driver's time is proportional to, whatever the calls' count.
    pub fn driver_allocations(&self) -> u64 {
        self.calls(DRIVER_ALLOCATIONS)
    }

    fn publish(&self, state: &SimState) {
        self.host_now.store(state.host_time, Ordering::Relaxed);
    }

    /// A successful `map_pages`, `alias_pages` or `unmap_pages` takes
    /// [`SimBackend::set_mapping_cost`]'s host time for each of the `allocations` physical
    /// allocations it creates, maps or unmaps.
    fn charge_allocations(&self, state: &mut SimState, allocations: u64) {
        *state.calls.entry(DRIVER_ALLOCATIONS).or_default() += allocations;
        state.host_time += state.mapping_cost_ns * allocations;
        self.publish(state);
    }

    fn call(&self, name: &'static str) -> parking_lot::MutexGuard<'_, SimState> {
        let mut state = self.state.lock();
        *state.calls.entry(name).or_default() += 1;
        if state.panic_next == Some(name) {
            state.panic_next = None;
            drop(state);
            panic!("{INJECTED_PANIC} {name}");
        }
        state
    }
}

impl SimState {
    fn stream_of(&mut self, id: StreamId) -> usize {
        if let Some(index) = self.stream_index.get(&id) {
            return *index;
        }
        let index = self.streams.len();
        self.streams.push(SimStream::default());
        self.stream_index.insert(id, index);
        index
    }

    fn launch(&mut self, stream: StreamId, accesses: &[Access], duration_ns: u64, label: &str) {
        let index = self.stream_of(stream);
        if let Some(graph) = self.recording.get_mut(&index) {
            // Captured work runs only when the graph is replayed.
            graph.push(CapturedOp {
                label: label.to_owned(),
                accesses: accesses.to_vec(),
                duration_ns,
            });
            return;
        }
        let host_clock = self.host_clock.clone();
        let host_time = self.host_time;
        let sim_stream = &mut self.streams[index];
        sim_stream.clock.merge(&host_clock);
        let epoch = sim_stream.clock.tick(index);
        sim_stream.ops += 1;
        let start = sim_stream.tail_time.max(host_time);
        sim_stream.tail_time = start + duration_ns;
        let op = OpRef {
            op: self.log.len(),
            stream: index,
            epoch,
        };
        self.log
            .push(format!("{label} (stream {index}, op {epoch})"));
        let clock = self.streams[index].clock.clone();
        for access in accesses {
            let (start, end) = (access.ptr.0, access.ptr.0 + access.len);
            let in_segment = self
                .segments
                .range(..=start)
                .next_back()
                .is_some_and(|(seg, size)| end <= seg + size);
            // A whole segment is its own physical memory; mapped memory is checked at the
            // physical pages behind it, whichever mapping the access goes through.
            let pieces = if in_segment {
                Some(Vec::new())
            } else {
                self.vm.translate(start, end)
            };
            let Some(pieces) = pieces else {
                self.races.push(Race {
                    earlier: "-".into(),
                    later: self.log[op.op].clone(),
                    range: (start, end),
                    kind: RaceKind::OutOfBounds,
                });
                continue;
            };
            let ranges: Vec<(u64, u64, u64)> = if in_segment {
                vec![(start, end - start, start)]
            } else {
                pieces.iter().map(|p| (p.virt, p.len, p.physical)).collect()
            };
            for piece in &pieces {
                self.vm.note_use(piece, op);
            }
            if access.write {
                for &(_, len, physical) in &ranges {
                    self.contents
                        .set(physical, physical + len, op.op as u64 + 1);
                }
            }
            for (virt, len, physical) in ranges {
                let conflicts =
                    self.shadow
                        .access(physical, physical + len, op, access.write, |prior| {
                            clock.covers(prior.stream, prior.epoch)
                        });
                for (prior, from, to) in conflicts {
                    // Reported at the addresses this access used.
                    let from = virt + (from.max(physical) - physical);
                    let to = virt + (to.min(physical + len) - physical);
                    self.races.push(Race {
                        earlier: self.log[prior.op].clone(),
                        later: self.log[op.op].clone(),
                        range: (from, to),
                        kind: RaceKind::Unordered,
                    });
                }
            }
        }
    }

    fn sync_host_to_device(&mut self) {
        for sim_stream in &self.streams {
            self.host_time = self.host_time.max(sim_stream.tail_time);
            self.host_clock.merge(&sim_stream.clock);
        }
    }

    /// `Err` (and a reported misuse) if the stream at `index` was destroyed.
    fn alive(&mut self, index: usize, call: &'static str) -> BackendResult<()> {
        if !self.destroyed.contains(&index) {
            return Ok(());
        }
        self.races.push(Race {
            earlier: "-".into(),
            later: format!("{call} on destroyed stream {index}"),
            range: (0, 0),
            kind: RaceKind::DeadStream,
        });
        Err(BackendError::new(call, "the stream was destroyed"))
    }

    fn capture_violation(&mut self, what: String) {
        self.races.push(Race {
            earlier: "-".into(),
            later: what,
            range: (0, 0),
            kind: RaceKind::Capture,
        });
    }
}

#[cfg(test)]
mod tests;
