//! Sleep and wake as properties: random programs allocate in two tagged memory pools and
//! the default one on four streams, write, share blocks across streams (`record_use`),
//! free, and put the tagged pools to sleep and wake them, with and without a backup, under
//! every configuration that changes how memory is mapped (stitching, limits, reuse policy,
//! reclaims). A correct program never touches a sleeping pool's blocks, so after every
//! step:
//! - **no access to a sleeping page**, and no race: the simulator's detector reports
//!   nothing (an access to unmapped memory is out of bounds), and every live block of a
//!   sleeping pool has no memory behind it;
//! - **physical memory is bounded by what is awake**: the device holds exactly the
//!   allocator's reserved bytes, which leave out what the sleeping pools gave back
//!   (`sleeping_bytes`, the sum of what each sleep released);
//! - **contents after wake equal contents before sleep** with a backup (byte for byte, as
//!   the simulator's versions say), and fresh pages without one;
//! - a sleeping pool refuses allocations, sleep of a sleeping tag and wake of an awake
//!   one are refused and change nothing, and so is either while a pool is being allocated
//!   to;
//! - the engine's invariants hold, and at the end everything goes back.
//!
//! The test after the machine shows the contents property failing on a planted bug.

use proptest::prelude::*;
use proptest_state_machine::{prop_state_machine, ReferenceStateMachine, StateMachineTest};
use streamalloc_allocator::backend::sim::{Access, SimBackend};
use streamalloc_allocator::backend::{BackendResult, HostMemory};
use streamalloc_allocator::backend::{Events, Streams};
use streamalloc_allocator::testing::proptest_cases;
use streamalloc_allocator::{
    AllocError, Allocator, Backend, Backup, Config, DevicePtr, HostPtr, PoolId, ReusePolicy,
    SleepError, StreamId,
};

const MIB: u64 = 1 << 20;
const STREAMS: usize = 4;
/// The default pool, then the two tagged ones.
const POOLS: [PoolId; 3] = [PoolId::DEFAULT, PoolId(0, 1), PoolId(0, 2)];
const TAGS: [&str; 2] = ["kv_cache", "weights"];
/// An untagged pool a `use_mem_pool` context allocates to.
const OTHER_POOL: PoolId = PoolId(0, 9);

/// One step of a program. Indices pick among live blocks modulo their number.
#[derive(Clone, Debug)]
enum Step {
    /// Allocate in `POOLS[pool]` on a stream; the owner writes the block.
    Malloc {
        pool: u8,
        stream: u8,
        size: u64,
        duration: u32,
    },
    /// Free a live block.
    Free { block: u16 },
    /// The owner works on a block again (a read once other streams read it).
    Work { block: u16, duration: u32 },
    /// Another stream reads a block, ordered after its owner, and says so (`record_use`).
    Use {
        block: u16,
        stream: u8,
        duration: u32,
    },
    /// The host does other work.
    AdvanceHost { ns: u32 },
    /// The host waits for a stream.
    SyncStream { stream: u8 },
    /// `empty_cache()`.
    EmptyCache,
    /// Sleep the tags of bitmask `tags` (1..=3).
    Sleep { tags: u8, backup: bool },
    /// Wake the tags of bitmask `tags`.
    Wake { tags: u8 },
    /// Opens or closes a `use_mem_pool` context on another pool.
    PoolContext,
}

/// The configuration under test, and how many blocks are live.
#[derive(Clone, Debug)]
struct Model {
    stitch: bool,
    reclaim: bool,
    policy: ReusePolicy,
    limit: Option<u64>,
    live: usize,
    context_open: bool,
}

fn size() -> impl Strategy<Value = u64> {
    prop_oneof![
        3 => 1u64..=8192,
        3 => 8193u64..=(4 * MIB),
        2 => (4 * MIB + 1)..=(24 * MIB),
    ]
}

struct SleepMachine;

impl ReferenceStateMachine for SleepMachine {
    type State = Model;
    type Transition = Step;

    fn init_state() -> BoxedStrategy<Model> {
        (
            any::<bool>(),
            any::<bool>(),
            prop_oneof![3 => Just(ReusePolicy::StreamWait), 1 => Just(ReusePolicy::Pytorch)],
            prop_oneof![2 => Just(None), 1 => Just(Some(256 * MIB))],
        )
            .prop_map(|(stitch, reclaim, policy, limit)| Model {
                stitch,
                reclaim,
                policy,
                limit,
                live: 0,
                context_open: false,
            })
            .boxed()
    }

    fn transitions(model: &Model) -> BoxedStrategy<Step> {
        let stream = 0..STREAMS as u8;
        let duration = 0u32..2_000_000;
        let mut choices: Vec<(u32, BoxedStrategy<Step>)> = vec![
            (
                8,
                (0..3u8, stream.clone(), size(), duration.clone())
                    .prop_map(|(pool, stream, size, duration)| Step::Malloc {
                        pool,
                        stream,
                        size,
                        duration,
                    })
                    .boxed(),
            ),
            (
                2,
                (0u32..3_000_000)
                    .prop_map(|ns| Step::AdvanceHost { ns })
                    .boxed(),
            ),
            (
                1,
                stream
                    .clone()
                    .prop_map(|stream| Step::SyncStream { stream })
                    .boxed(),
            ),
            (
                3,
                (1..4u8, any::<bool>())
                    .prop_map(|(tags, backup)| Step::Sleep { tags, backup })
                    .boxed(),
            ),
            (3, (1..4u8).prop_map(|tags| Step::Wake { tags }).boxed()),
            (1, Just(Step::PoolContext).boxed()),
        ];
        if !model.context_open {
            choices.push((1, Just(Step::EmptyCache).boxed()));
        }
        if model.live > 0 {
            choices.push((
                4,
                any::<u16>().prop_map(|block| Step::Free { block }).boxed(),
            ));
            choices.push((
                3,
                (any::<u16>(), duration.clone())
                    .prop_map(|(block, duration)| Step::Work { block, duration })
                    .boxed(),
            ));
            choices.push((
                3,
                (any::<u16>(), stream, duration)
                    .prop_map(|(block, stream, duration)| Step::Use {
                        block,
                        stream,
                        duration,
                    })
                    .boxed(),
            ));
        }
        proptest::strategy::Union::new_weighted(choices).boxed()
    }

    fn preconditions(model: &Model, step: &Step) -> bool {
        match step {
            Step::Free { .. } | Step::Work { .. } | Step::Use { .. } => model.live > 0,
            Step::EmptyCache => !model.context_open,
            _ => true,
        }
    }

    fn apply(mut model: Model, step: &Step) -> Model {
        match step {
            Step::Malloc { .. } => model.live += 1,
            Step::Free { .. } => model.live = model.live.saturating_sub(1),
            Step::PoolContext => model.context_open = !model.context_open,
            _ => {}
        }
        model
    }
}

#[derive(Clone, Debug)]
struct Live {
    ptr: DevicePtr,
    size: u64,
    stream: usize,
    pool: usize,
    shared: bool,
}

/// What a block holds: `(offset, len, version)` runs (`SimBackend::contents`).
type Held = Vec<(u64, u64, u64)>;

/// What a tag was put to sleep with.
#[derive(Debug)]
struct Asleep {
    backup: bool,
    /// What each live block held, by address.
    contents: Vec<(DevicePtr, u64, Held)>,
    released: u64,
}

struct Program<B: Backend = SimBackend> {
    /// The simulated device (the program's launches, and what the checks read).
    device: SimBackend,
    /// The allocator, over the device or a wrapper of it.
    allocator: Allocator<B>,
    streams: Vec<StreamId>,
    live: Vec<Live>,
    /// Per tag (`POOLS[1..]`), while asleep.
    asleep: [Option<Asleep>; 2],
    context_open: bool,
    step: usize,
}

impl Program<SimBackend> {
    fn new(model: &Model) -> Self {
        let device = SimBackend::new(1 << 30);
        Self::with_backend(model, device.clone(), device)
    }
}

impl<B: Backend> Program<B> {
    fn with_backend(model: &Model, device: SimBackend, backend: B) -> Self {
        let config = Config {
            stitch: model.stitch,
            reclaim: model.reclaim,
            reuse_policy: model.policy,
            memory_limit: model.limit,
            ..Config::default()
        };
        let allocator = Allocator::new(backend, config).unwrap();
        for (pool, tag) in POOLS[1..].iter().zip(TAGS) {
            allocator.create_or_incref_pool(*pool).unwrap();
            allocator.tag_pool(*pool, tag).unwrap();
        }
        allocator.create_or_incref_pool(OTHER_POOL).unwrap();
        let streams = (0..STREAMS).map(|_| device.create_stream()).collect();
        Self {
            device,
            allocator,
            streams,
            live: Vec::new(),
            asleep: [None, None],
            context_open: false,
            step: 0,
        }
    }

    fn pick(&self, block: u16) -> usize {
        block as usize % self.live.len()
    }

    /// True if the block's pool is asleep: a correct program leaves it alone.
    fn sleeping(&self, live: &Live) -> bool {
        live.pool > 0 && self.asleep[live.pool - 1].is_some()
    }

    fn tags(mask: u8) -> Vec<usize> {
        (0..2).filter(|t| mask & (1 << t) != 0).collect()
    }

    fn run(&mut self, step: &Step) -> Result<(), String> {
        self.step += 1;
        let needs_block = matches!(
            step,
            Step::Free { .. } | Step::Work { .. } | Step::Use { .. }
        );
        if needs_block && self.live.is_empty() {
            // The model counted a malloc that failed (out of memory, or a sleeping pool).
            return self.check();
        }
        match *step {
            Step::Malloc {
                pool,
                stream,
                size,
                duration,
            } => {
                let (pool, stream) = (pool as usize, stream as usize % STREAMS);
                let result = self
                    .allocator
                    .malloc_in(size, self.streams[stream], POOLS[pool]);
                let asleep = pool > 0 && self.asleep[pool - 1].is_some();
                match result {
                    Ok(block) if !asleep => {
                        self.device.launch(
                            self.streams[stream],
                            &[Access::write(block.ptr, block.size)],
                            u64::from(duration),
                            &format!("step {}: first write", self.step),
                        );
                        self.live.push(Live {
                            ptr: block.ptr,
                            size: block.size,
                            stream,
                            pool,
                            shared: false,
                        });
                    }
                    Ok(block) => return Err(format!("a sleeping pool allocated {block:?}")),
                    Err(AllocError::PoolAsleep { tag, .. }) if asleep && tag == TAGS[pool - 1] => {}
                    Err(AllocError::OutOfMemory(_)) if !asleep => {}
                    Err(err) => return Err(format!("malloc: {err}")),
                }
            }
            Step::Free { block } => {
                let live = self.live.swap_remove(self.pick(block));
                self.allocator
                    .free(live.ptr)
                    .map_err(|e| format!("free: {e}"))?;
            }
            Step::Work { block, duration } => {
                let live = self.live[self.pick(block)].clone();
                if !self.sleeping(&live) {
                    let access = if live.shared {
                        Access::read(live.ptr, live.size)
                    } else {
                        Access::write(live.ptr, live.size)
                    };
                    self.device.launch(
                        self.streams[live.stream],
                        &[access],
                        u64::from(duration),
                        &format!("step {}: owner work", self.step),
                    );
                }
            }
            Step::Use {
                block,
                stream,
                duration,
            } => {
                let index = self.pick(block);
                let live = self.live[index].clone();
                let user = stream as usize % STREAMS;
                if !self.sleeping(&live) && user != live.stream {
                    let event = self.device.create_event().map_err(|e| e.to_string())?;
                    let (owner, user_id) = (self.streams[live.stream], self.streams[user]);
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
                        &format!("step {}: read by stream {user}", self.step),
                    );
                    self.allocator
                        .record_use(live.ptr, user_id)
                        .map_err(|e| format!("record_use: {e}"))?;
                    self.live[index].shared = true;
                }
            }
            Step::AdvanceHost { ns } => self.device.advance_host(u64::from(ns)),
            Step::SyncStream { stream } => self
                .device
                .synchronize_stream(self.streams[stream as usize % STREAMS]),
            Step::EmptyCache => {
                self.allocator
                    .empty_cache()
                    .map_err(|e| format!("empty_cache: {e}"))?;
            }
            Step::PoolContext => {
                if self.context_open {
                    self.allocator.end_allocate_to_pool(OTHER_POOL).unwrap();
                } else {
                    self.allocator.begin_allocate_to_pool(OTHER_POOL).unwrap();
                }
                self.context_open = !self.context_open;
            }
            Step::Sleep { tags, backup } => self.sleep(Self::tags(tags), backup)?,
            Step::Wake { tags } => self.wake(Self::tags(tags))?,
        }
        self.check()
    }

    fn sleep(&mut self, tags: Vec<usize>, backup: bool) -> Result<(), String> {
        let names: Vec<&str> = tags.iter().map(|&t| TAGS[t]).collect();
        let before = self.allocator.stats();
        let refusal = if self.context_open {
            Some(SleepError::CaptureUnderway)
        } else {
            tags.iter()
                .find(|&&t| self.asleep[t].is_some())
                .map(|&t| SleepError::AlreadyAsleep(TAGS[t].into()))
        };
        // What each live block holds, read before the call (which waits for the writes).
        let mut records: Vec<Asleep> = tags
            .iter()
            .map(|_| Asleep {
                backup,
                contents: Vec::new(),
                released: 0,
            })
            .collect();
        if refusal.is_none() {
            for live in &self.live {
                if let Some(i) = tags.iter().position(|&t| t + 1 == live.pool) {
                    let held = self
                        .device
                        .contents(live.ptr, live.size)
                        .ok_or_else(|| format!("{:?} is not mapped", live.ptr))?;
                    records[i].contents.push((live.ptr, live.size, held));
                }
            }
        }
        let result = self
            .allocator
            .sleep(&names, if backup { Backup::Host } else { Backup::None });
        if let Some(expected) = refusal {
            let Err(AllocError::Sleep(err)) = result else {
                return Err(format!(
                    "sleep {names:?}: expected {expected}, got {result:?}"
                ));
            };
            if *err != expected || self.allocator.stats() != before {
                return Err(format!(
                    "sleep {names:?}: refused with {err}, or changed state"
                ));
            }
            return Ok(());
        }
        let report = result.map_err(|e| format!("sleep {names:?}: {e}"))?;
        let infos = self.allocator.tags();
        let mut released = 0;
        for (&t, mut record) in tags.iter().zip(records) {
            record.released = infos.iter().find(|i| i.name == TAGS[t]).unwrap().bytes;
            released += record.released;
            self.asleep[t] = Some(record);
        }
        if report.released != released {
            return Err(format!("sleep released {} of {released}", report.released));
        }
        Ok(())
    }

    fn wake(&mut self, tags: Vec<usize>) -> Result<(), String> {
        let names: Vec<&str> = tags.iter().map(|&t| TAGS[t]).collect();
        let before = self.allocator.stats();
        let result = self.allocator.wake(&names);
        let refusal = if self.context_open {
            Some(SleepError::CaptureUnderway)
        } else {
            tags.iter()
                .find(|&&t| self.asleep[t].is_none())
                .map(|&t| SleepError::NotAsleep(TAGS[t].into()))
        };
        if let Some(expected) = refusal {
            let Err(AllocError::Sleep(err)) = result else {
                return Err(format!(
                    "wake {names:?}: expected {expected}, got {result:?}"
                ));
            };
            if *err != expected || self.allocator.stats() != before {
                return Err(format!(
                    "wake {names:?}: refused with {err}, or changed state"
                ));
            }
            return Ok(());
        }
        match result {
            Ok(_) => {}
            // Under a limit there may be no room: refused, nothing changed.
            Err(AllocError::Sleep(err)) if matches!(*err, SleepError::NoRoom { .. }) => {
                if tags.iter().any(|&t| !self.allocator.tags()[t].asleep) {
                    return Err(format!("wake {names:?} refused ({err}) but woke a tag"));
                }
                return Ok(());
            }
            Err(err) => return Err(format!("wake {names:?}: {err}")),
        }
        for &t in &tags {
            let record = self.asleep[t].take().expect("asleep");
            for (ptr, size, held) in record.contents {
                if !self.live.iter().any(|l| l.ptr == ptr) {
                    continue; // freed while asleep
                }
                let now = self
                    .device
                    .contents(ptr, size)
                    .ok_or("unmapped after wake")?;
                let expected = if record.backup {
                    held
                } else {
                    vec![(0, size, 0)]
                };
                if now != expected {
                    return Err(format!(
                        "{}: {ptr:?} holds {now:?} after wake, expected {expected:?}",
                        TAGS[t]
                    ));
                }
            }
        }
        Ok(())
    }

    fn check(&self) -> Result<(), String> {
        let at = self.step;
        if let Some(race) = self.device.races().first() {
            return Err(format!("step {at}: {race}"));
        }
        self.allocator
            .check_invariants()
            .map_err(|e| format!("step {at}: {e}"))?;
        let stats = self.allocator.stats();
        if self.device.mapped() != stats.reserved_bytes.current {
            return Err(format!(
                "step {at}: the device holds {} bytes, the allocator reserves {}",
                self.device.mapped(),
                stats.reserved_bytes.current
            ));
        }
        let released: u64 = self.asleep.iter().flatten().map(|a| a.released).sum();
        if stats.sleeping_bytes != released {
            return Err(format!(
                "step {at}: sleeping_bytes {} but the sleeps released {released}",
                stats.sleeping_bytes
            ));
        }
        if self.device.host_bytes() != stats.host_backup_bytes {
            return Err(format!("step {at}: host buffers leak"));
        }
        let mut ranges: Vec<(u64, u64)> = Vec::new();
        for live in &self.live {
            if self.sleeping(live) && self.device.contents(live.ptr, 1).is_some() {
                return Err(format!("step {at}: {:?} is asleep but mapped", live.ptr));
            }
            ranges.push((live.ptr.0, live.ptr.0 + live.size));
        }
        ranges.sort_unstable();
        if ranges.windows(2).any(|w| w[0].1 > w[1].0) {
            return Err(format!("step {at}: live blocks overlap"));
        }
        Ok(())
    }

    /// Wakes everything, frees everything, returns every byte.
    fn finish(mut self) -> Result<(), String> {
        if self.context_open {
            self.allocator.end_allocate_to_pool(OTHER_POOL).unwrap();
            self.context_open = false;
        }
        let asleep: Vec<usize> = (0..2).filter(|&t| self.asleep[t].is_some()).collect();
        if !asleep.is_empty() {
            self.allocator.set_memory_limit(None).unwrap();
            self.wake(asleep)?;
        }
        for live in std::mem::take(&mut self.live) {
            self.allocator.free(live.ptr).map_err(|e| e.to_string())?;
        }
        self.allocator
            .release_host_backup(&TAGS)
            .map_err(|e| e.to_string())?;
        for pool in POOLS[1..].iter().chain([&OTHER_POOL]) {
            self.allocator
                .empty_pool_cache(*pool)
                .map_err(|e| e.to_string())?;
        }
        self.allocator.empty_cache().map_err(|e| e.to_string())?;
        self.check()?;
        if self.device.mapped() != 0 || self.device.host_bytes() != 0 {
            return Err(format!(
                "left behind: {} device bytes, {} host bytes",
                self.device.mapped(),
                self.device.host_bytes()
            ));
        }
        Ok(())
    }
}

impl StateMachineTest for SleepMachine {
    type SystemUnderTest = Program;
    type Reference = SleepMachine;

    fn init_test(model: &Model) -> Program {
        Program::new(model)
    }

    fn apply(mut program: Program, _model: &Model, step: Step) -> Program {
        if let Err(violation) = program.run(&step) {
            panic!("{step:?}: {violation}");
        }
        program
    }

    fn teardown(program: Program, _model: Model) {
        if let Err(violation) = program.finish() {
            panic!("{violation}");
        }
    }
}

prop_state_machine! {
    #![proptest_config(ProptestConfig {
        cases: proptest_cases(256),
        max_shrink_iters: 4096,
        failure_persistence: None,
        ..ProptestConfig::default()
    })]

    /// Sleeping pools are never touched, hold no memory, and wake as they slept.
    #[test]
    fn sleeping_memory_is_untouched_released_and_restored(sequential 1..80 => SleepMachine);
}

/// A device whose copies back from the host go nowhere: a wake that loses the backup.
struct LosesRestores(SimBackend);

streamalloc_allocator::forward_backend! {
    impl[] for LosesRestores as this => &this.0, SimBackend;
    Clock, Segments, Events, Streams, VirtualMemory
}

impl HostMemory for LosesRestores {
    fn alloc_host(&self, size: u64) -> BackendResult<HostPtr> {
        self.0.alloc_host(size)
    }
    fn free_host(&self, ptr: HostPtr, size: u64) -> BackendResult<()> {
        self.0.free_host(ptr, size)
    }
    fn copy_to_host(&self, dst: HostPtr, src: DevicePtr, size: u64) -> BackendResult<()> {
        self.0.copy_to_host(dst, src, size)
    }
    fn copy_to_device(&self, _dst: DevicePtr, _src: HostPtr, _size: u64) -> BackendResult<()> {
        Ok(()) // the planted loss
    }
    fn synchronize_copies(&self) -> BackendResult<()> {
        self.0.synchronize_copies()
    }
}

/// The program's checks catch a wake whose backup never comes back: the property fails.
#[test]
fn a_wake_that_loses_the_backup_fails_the_contents_property() {
    let model = SleepMachine::init_state()
        .new_tree(&mut proptest::test_runner::TestRunner::deterministic())
        .unwrap()
        .current();
    let device = SimBackend::new(1 << 30);
    let mut program = Program::with_backend(&model, device.clone(), LosesRestores(device));
    let steps = [
        Step::Malloc {
            pool: 1,
            stream: 0,
            size: 3 * MIB,
            duration: 1_000,
        },
        Step::Sleep {
            tags: 1,
            backup: true,
        },
    ];
    for step in &steps {
        program.run(step).unwrap();
    }
    let err = program.run(&Step::Wake { tags: 1 }).unwrap_err();
    assert!(err.contains("after wake"), "{err}");
}
