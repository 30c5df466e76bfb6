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
mod ipc;
mod race;
mod shadow;
mod unmap;
mod vm;

pub use self::race::{Access, Race, RaceKind};

use self::clock::VectorClock;
use self::contents::{Contents, HostMemory};
use self::shadow::{OpRef, Shadow};
use self::vm::VirtualMemory;
use super::BackendResult;
use crate::error::BackendError;
use crate::types::{DevicePtr, EventHandle, HostPtr, StreamId};
use parking_lot::Mutex;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// Where simulated segments start (an address that looks like a real device pointer).
const BASE_ADDRESS: u64 = 0x7f00_0000_0000;
/// Gap left after every segment so that segments are never adjacent.
const SEGMENT_GUARD: u64 = 2 << 20;
/// Page size of the simulated virtual-memory API (CUDA's usual granularity).
const PAGE_SIZE: u64 = 2 << 20;

/// A graph captured by [`SimBackend::end_capture`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct GraphId(pub u64);

impl fmt::Display for GraphId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// One launch recorded during capture.
#[derive(Clone, Debug)]
struct CapturedOp {
    label: String,
    accesses: Vec<Access>,
    duration_ns: u64,
}

#[derive(Debug, Default)]
struct SimGraph {
    ops: Vec<CapturedOp>,
    /// Replays enqueued so far, to number them in labels.
    replays: u64,
}

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

    /// Makes every later `map_pages` and `unmap_pages` call take `ns` of host time, as
    /// the driver's do (on an H200, ~80 µs per mapping made and undone), so that policies
    /// weighing that cost can be tested.
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

    /// Turns the capture rules on or off for `stream` without recording a graph: launches
    /// still execute at once. [`SimBackend::begin_capture`] records one.
    ///
    /// # Panics
    /// If `stream` is recording a graph (end it with [`SimBackend::end_capture`]).
    pub fn set_capturing(&self, stream: StreamId, capturing: bool) {
        let mut state = self.state.lock();
        let index = state.stream_of(stream);
        assert!(
            !state.recording.contains_key(&index),
            "stream {index} records a graph: end_capture ends it"
        );
        if capturing {
            state.capturing.insert(index);
        } else {
            state.capturing.remove(&index);
        }
    }

    /// Starts capturing a graph on `stream` (`cudaStreamBeginCapture`): launches on it are
    /// recorded, not executed, until [`SimBackend::end_capture`], and the capture rules
    /// apply ([`Streams::is_capturing`](super::Streams::is_capturing) answers true).
    ///
    /// # Panics
    /// If `stream` is already capturing.
    pub fn begin_capture(&self, stream: StreamId) {
        let mut state = self.state.lock();
        let index = state.stream_of(stream);
        assert!(
            state.capturing.insert(index),
            "stream {index} is already capturing"
        );
        state.recording.insert(index, Vec::new());
    }

    /// Ends the capture on `stream` (`cudaStreamEndCapture`) and returns the graph.
    ///
    /// # Panics
    /// If `stream` is not recording a graph.
    pub fn end_capture(&self, stream: StreamId) -> GraphId {
        let mut state = self.state.lock();
        let index = state.stream_of(stream);
        let ops = state
            .recording
            .remove(&index)
            .unwrap_or_else(|| panic!("stream {index} is not recording a graph"));
        state.capturing.remove(&index);
        let id = state.next_graph;
        state.next_graph += 1;
        state.graphs.insert(id, SimGraph { ops, replays: 0 });
        GraphId(id)
    }

    /// Enqueues every operation of `graph`, in capture order, on `stream`
    /// (`cudaGraphLaunch`), each checked like a [`SimBackend::launch`] and labelled
    /// `replay N of graph G: <label>`.
    ///
    /// # Panics
    /// If `graph` does not exist (never captured, or destroyed).
    pub fn replay(&self, graph: GraphId, stream: StreamId) {
        let mut state = self.state.lock();
        let recorded = state
            .graphs
            .get_mut(&graph.0)
            .unwrap_or_else(|| panic!("graph {graph} does not exist"));
        recorded.replays += 1;
        let (replay, ops) = (recorded.replays, recorded.ops.clone());
        for op in ops {
            let label = format!("replay {replay} of graph {graph}: {}", op.label);
            state.launch(stream, &op.accesses, op.duration_ns, &label);
        }
    }

    /// Destroys `graph` (`cudaGraphExecDestroy`): it can no longer be replayed. Replays
    /// already enqueued still count as the work they are.
    ///
    /// # Panics
    /// If `graph` does not exist.
    pub fn destroy_graph(&self, graph: GraphId) {
        let removed = self.state.lock().graphs.remove(&graph.0);
        assert!(removed.is_some(), "graph {graph} does not exist");
    }

    /// Operations recorded in `graph` (`None` if it does not exist).
    pub fn graph_len(&self, graph: GraphId) -> Option<usize> {
        self.state.lock().graphs.get(&graph.0).map(|g| g.ops.len())
    }

    /// Graphs captured and not destroyed.
    pub fn live_graphs(&self) -> usize {
        self.state.lock().graphs.len()
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

    fn publish(&self, state: &SimState) {
        self.host_now.store(state.host_time, Ordering::Relaxed);
    }

    /// A successful `map_pages` or `unmap_pages` takes [`SimBackend::set_mapping_cost`]'s
    /// host time.
    fn charge_mapping_call(&self, state: &mut SimState) {
        state.host_time += state.mapping_cost_ns;
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

    fn capture_violation(&mut self, what: String) {
        self.races.push(Race {
            earlier: "-".into(),
            later: what,
            range: (0, 0),
            kind: RaceKind::Capture,
        });
    }
}

fn unknown_event(operation: &'static str, event: EventHandle) -> BackendError {
    BackendError::new(operation, format!("invalid resource handle {event:?}"))
}

/// Virtual host time, in nanoseconds: traces are deterministic.
impl super::Clock for SimBackend {
    fn now_ns(&self) -> u64 {
        self.host_now.load(Ordering::Relaxed)
    }

    fn now_ticks(&self) -> u64 {
        self.now_ns()
    }

    fn ticks_to_ns(&self, ticks: u64) -> u64 {
        ticks
    }
}

impl super::Segments for SimBackend {
    fn total_memory(&self) -> BackendResult<u64> {
        Ok(self.state.lock().capacity)
    }

    fn alloc_segment(&self, size: u64) -> BackendResult<DevicePtr> {
        let mut state = self.call("alloc_segment");
        if state.fail_next_allocs > 0 {
            state.fail_next_allocs -= 1;
            return Err(BackendError::new("cuMemAlloc", "injected failure"));
        }
        if state.reserved + size > state.capacity {
            return Err(BackendError::out_of_memory(
                "cuMemAlloc",
                format!(
                    "{size} bytes requested, {} of {} in use",
                    state.reserved, state.capacity
                ),
            ));
        }
        let addr = state.next_address;
        state.next_address += size.div_ceil(SEGMENT_GUARD) * SEGMENT_GUARD + SEGMENT_GUARD;
        state.reserved += size;
        state.segments.insert(addr, size);
        Ok(DevicePtr(addr))
    }

    fn free_segment(&self, ptr: DevicePtr, size: u64) -> BackendResult<()> {
        let mut state = self.call("free_segment");
        if state.segments.get(&ptr.0) != Some(&size) {
            return Err(BackendError::new(
                "cuMemFree",
                format!("{ptr:?} ({size} bytes) is not a live segment"),
            ));
        }
        // cuMemFree synchronises the device before releasing.
        if !state.capturing.is_empty() {
            state.capture_violation(format!("segment free of {ptr:?} synchronises the device"));
        }
        state.sync_host_to_device();
        state.segments.remove(&ptr.0);
        state.reserved -= size;
        state.shadow.forget(ptr.0, ptr.0 + size);
        state.contents.set(ptr.0, ptr.0 + size, 0);
        self.publish(&state);
        Ok(())
    }
}

impl super::Events for SimBackend {
    fn create_event(&self) -> BackendResult<EventHandle> {
        let mut state = self.call("create_event");
        let id = state.next_event;
        state.next_event += 1;
        state.events.insert(id, SimEvent::default());
        Ok(EventHandle(id))
    }

    fn destroy_event(&self, event: EventHandle) -> BackendResult<()> {
        let mut state = self.call("destroy_event");
        state
            .events
            .remove(&event.0)
            .map(|_| ())
            .ok_or_else(|| unknown_event("cuEventDestroy", event))
    }

    fn record_event(&self, event: EventHandle, stream: StreamId) -> BackendResult<()> {
        let mut state = self.call("record_event");
        let index = state.stream_of(stream);
        let time = state.streams[index].tail_time.max(state.host_time);
        let mut clock = state.streams[index].clock.clone();
        clock.merge(&state.host_clock.clone());
        let in_capture = state.capturing.contains(&index);
        let record = state
            .events
            .get_mut(&event.0)
            .ok_or_else(|| unknown_event("cuEventRecord", event))?;
        record.recorded = Some((time, clock));
        record.stream = Some(index);
        record.in_capture = in_capture;
        Ok(())
    }

    fn query_event(&self, event: EventHandle) -> BackendResult<bool> {
        let mut state = self.call("query_event");
        if !state.capturing.is_empty() {
            state.capture_violation(format!("query of {event:?}"));
        }
        let record = state
            .events
            .get(&event.0)
            .cloned()
            .ok_or_else(|| unknown_event("cuEventQuery", event))?;
        match record.recorded {
            None => Ok(true),
            Some((time, clock)) if time <= state.host_time => {
                state.host_clock.merge(&clock);
                Ok(true)
            }
            Some(_) => Ok(false),
        }
    }

    fn synchronize_event(&self, event: EventHandle) -> BackendResult<()> {
        let mut state = self.call("synchronize_event");
        let record = state
            .events
            .get(&event.0)
            .cloned()
            .ok_or_else(|| unknown_event("cuEventSynchronize", event))?;
        if let Some((time, clock)) = record.recorded {
            state.host_time = state.host_time.max(time);
            state.host_clock.merge(&clock);
        }
        self.publish(&state);
        Ok(())
    }
}

impl super::Streams for SimBackend {
    fn stream_wait_event(&self, stream: StreamId, event: EventHandle) -> BackendResult<()> {
        let mut state = self.call("stream_wait_event");
        let index = state.stream_of(stream);
        let record = state
            .events
            .get(&event.0)
            .cloned()
            .ok_or_else(|| unknown_event("cuStreamWaitEvent", event))?;
        if state.capturing.contains(&index)
            && record.stream.is_some_and(|s| !state.capturing.contains(&s))
        {
            state.capture_violation(format!(
                "capturing stream {index} waits on {event:?} recorded outside the capture"
            ));
        }
        if !state.capturing.contains(&index) && record.in_capture {
            state.capture_violation(format!(
                "stream {index} waits on {event:?}, recorded inside a capture"
            ));
        }
        if let Some((time, clock)) = record.recorded {
            let sim_stream = &mut state.streams[index];
            sim_stream.tail_time = sim_stream.tail_time.max(time);
            sim_stream.clock.merge(&clock);
        }
        Ok(())
    }

    fn synchronize_device(&self) -> BackendResult<()> {
        let mut state = self.call("synchronize_device");
        if !state.capturing.is_empty() {
            state.capture_violation("device synchronisation".into());
        }
        state.sync_host_to_device();
        self.publish(&state);
        Ok(())
    }

    fn is_capturing(&self, stream: StreamId) -> BackendResult<bool> {
        let mut state = self.state.lock();
        let index = state.stream_of(stream);
        Ok(state.capturing.contains(&index))
    }
}

impl super::VirtualMemory for SimBackend {
    fn supports_virtual_memory(&self) -> bool {
        true
    }

    fn page_size(&self) -> u64 {
        PAGE_SIZE
    }

    fn reserve_address_space(&self, size: u64) -> BackendResult<DevicePtr> {
        let mut state = self.call("reserve_address_space");
        if size == 0 || !size.is_multiple_of(PAGE_SIZE) {
            return Err(BackendError::new(
                "cuMemAddressReserve",
                format!("size {size} is not a positive multiple of the page size"),
            ));
        }
        let addr = state.next_address;
        state.next_address += size + SEGMENT_GUARD;
        state.vm.reserve(addr, size);
        Ok(DevicePtr(addr))
    }

    fn release_address_space(&self, ptr: DevicePtr, size: u64) -> BackendResult<()> {
        let mut state = self.call("release_address_space");
        if state.vm.reservation(ptr.0) != Some(size) {
            return Err(BackendError::new(
                "cuMemAddressFree",
                format!("{ptr:?} ({size} bytes) is not a reservation"),
            ));
        }
        if state.vm.any_mapped(ptr.0, ptr.0 + size) {
            return Err(BackendError::new(
                "cuMemAddressFree",
                format!("{ptr:?} still has mapped pages"),
            ));
        }
        state.vm.release(ptr.0);
        Ok(())
    }

    fn map_pages(&self, ptr: DevicePtr, size: u64) -> BackendResult<()> {
        self.map_fresh("map_pages", ptr, size, None)
    }

    fn set_page_allocations(&self, on: bool) {
        self.state.lock().page_allocations = on;
    }

    fn alias_pages(&self, dst: DevicePtr, src: DevicePtr, size: u64) -> BackendResult<()> {
        let mut state = self.call("alias_pages");
        if state.refuse_aliases {
            return Err(BackendError::new("cuMemMap", "injected failure"));
        }
        let (start, end) = state.check_unmapped_target("cuMemMap", dst, size)?;
        if !src.0.is_multiple_of(PAGE_SIZE) {
            return Err(BackendError::new(
                "cuMemMap",
                format!("source {src:?} is not page-aligned"),
            ));
        }
        let Some(source) = src
            .0
            .checked_add(size)
            .and_then(|src_end| state.vm.translate(src.0, src_end))
        else {
            return Err(BackendError::new(
                "cuMemMap",
                format!("source [{:#x}, +{size:#x}) is not wholly mapped", src.0),
            ));
        };
        debug_assert_eq!(end - start, size);
        // As the driver: only whole allocations can be mapped a second time.
        if source.iter().any(|piece| !piece.whole) {
            return Err(BackendError::new(
                "cuMemMap",
                format!(
                    "CUDA_ERROR_NOT_SUPPORTED: [{:#x}, +{size:#x}) does not cover whole allocations",
                    src.0
                ),
            ));
        }
        state.vm.map_alias(start, &source, PAGE_SIZE);
        // One driver mapping per physical allocation the source spans.
        for _ in &source {
            self.charge_mapping_call(&mut state);
        }
        Ok(())
    }

    fn unmap_pages(&self, ptr: DevicePtr, size: u64) -> BackendResult<()> {
        let mut state = self.call("unmap_pages");
        state.unmap_checked(ptr.0, ptr.0.saturating_add(size), "unmap_pages")?;
        self.charge_mapping_call(&mut state);
        Ok(())
    }

    fn map_pages_whole(&self, ptr: DevicePtr, size: u64) -> BackendResult<()> {
        self.map_fresh("map_pages_whole", ptr, size, Some(false))
    }
}

impl super::HostMemory for SimBackend {
    fn alloc_host(&self, size: u64) -> BackendResult<HostPtr> {
        self.host_alloc(size)
    }

    fn free_host(&self, ptr: HostPtr, size: u64) -> BackendResult<()> {
        self.host_free(ptr, size)
    }

    fn copy_to_host(&self, dst: HostPtr, src: DevicePtr, size: u64) -> BackendResult<()> {
        self.host_copy(copies::Direction::ToHost, dst, src, size)
    }

    fn copy_to_device(&self, dst: DevicePtr, src: HostPtr, size: u64) -> BackendResult<()> {
        self.host_copy(copies::Direction::ToDevice, src, dst, size)
    }

    fn synchronize_copies(&self) -> BackendResult<()> {
        self.host_synchronize_copies()
    }
}

impl SimBackend {
    /// `map_pages` (`per_page: None`: as `set_page_allocations` says) and `map_pages_whole`
    /// (`Some(false)`), counted under `name`.
    fn map_fresh(
        &self,
        name: &'static str,
        ptr: DevicePtr,
        size: u64,
        per_page: Option<bool>,
    ) -> BackendResult<()> {
        let mut state = self.call(name);
        if state.fail_next_allocs > 0 {
            state.fail_next_allocs -= 1;
            return Err(BackendError::new("cuMemCreate", "injected failure"));
        }
        let (start, end) = state.check_unmapped_target("cuMemMap", ptr, size)?;
        if state.reserved + size > state.capacity {
            return Err(BackendError::out_of_memory(
                "cuMemCreate",
                format!(
                    "{size} bytes requested, {} of {} in use",
                    state.reserved, state.capacity
                ),
            ));
        }
        let per_page = per_page.unwrap_or(state.page_allocations);
        state.vm.map_fresh(start, end, PAGE_SIZE, per_page);
        state.reserved += size;
        self.charge_mapping_call(&mut state);
        Ok(())
    }
}

impl SimState {
    /// Checks that `[ptr, ptr + size)` is whole pages of one reservation with nothing
    /// mapped, for a call named `operation`; returns the range.
    fn check_unmapped_target(
        &self,
        operation: &'static str,
        ptr: DevicePtr,
        size: u64,
    ) -> BackendResult<(u64, u64)> {
        let start = ptr.0;
        let end = start.checked_add(size).ok_or_else(|| {
            BackendError::new(operation, format!("[{start:#x}, +{size:#x}) overflows"))
        })?;
        if size == 0 || !start.is_multiple_of(PAGE_SIZE) || !size.is_multiple_of(PAGE_SIZE) {
            return Err(BackendError::new(
                operation,
                format!("[{start:#x}, {end:#x}) is not page-aligned"),
            ));
        }
        if !self.vm.reserved(start, end) {
            return Err(BackendError::new(
                operation,
                format!("[{start:#x}, {end:#x}) is not inside one reservation"),
            ));
        }
        if self.vm.any_mapped(start, end) {
            return Err(BackendError::new(
                operation,
                format!("[{start:#x}, {end:#x}) is already (partly) mapped"),
            ));
        }
        Ok((start, end))
    }
}

#[cfg(test)]
mod tests;
