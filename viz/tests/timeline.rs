//! What a trace means over time: lifetimes paired from events, counters after each event,
//! each stream's cached bytes, for the shapes of traces the engine and PyTorch write.

use streamalloc_viz::limits::Budget;
use streamalloc_viz::model::{Block, BlockState, DeviceSnapshot, Event, Segment, TraceAction};
use streamalloc_viz::timeline::{Counter, Timeline};

fn ev(action: TraceAction, addr: u64, size: u64, stream: u64) -> Event {
    Event {
        action,
        addr,
        size,
        stream,
        time_ns: 0,
        stack: None,
        device_free: None,
    }
}

fn device(segments: Vec<Segment>, trace: Vec<Event>) -> DeviceSnapshot {
    DeviceSnapshot {
        device: 0,
        time_ns: None,
        trace_dropped: 0,
        segments,
        trace,
    }
}

#[test]
fn pairs_lifetimes_and_counts_pending() {
    use TraceAction::*;
    let d = device(
        vec![],
        vec![
            ev(SegmentAlloc, 0x1000, 100, 7),
            ev(Alloc, 0x1000, 40, 7),
            ev(Alloc, 0x1028, 60, 9), // another stream, in stream 7's segment
            ev(FreeRequested, 0x1000, 40, 7),
            ev(FreeCompleted, 0x1000, 40, 7),
            ev(FreeRequested, 0x1028, 60, 9),
            ev(FreeCompleted, 0x1028, 60, 9),
            ev(SegmentFree, 0x1000, 100, 7),
        ],
    );
    let t = Timeline::build(&d);
    assert_eq!(t.allocs.len(), 2);
    assert_eq!(t.allocs[0].start, Some(1));
    assert_eq!(t.allocs[0].free_requested, Some(3));
    assert_eq!(t.allocs[0].end, Some(4));
    let col = |k: Counter| t.counters[k as usize].clone();
    assert_eq!(col(Counter::Active), vec![0, 40, 100, 100, 60, 60, 0, 0]);
    assert_eq!(col(Counter::Allocated), vec![0, 40, 100, 60, 60, 0, 0, 0]);
    assert_eq!(col(Counter::Pending), vec![0, 0, 0, 40, 0, 60, 0, 0]);
    assert_eq!(
        col(Counter::Reserved),
        vec![100, 100, 100, 100, 100, 100, 100, 0]
    );
    assert_eq!(t.peak(Counter::Active), Some((2, 100)));
    // The stream-9 block lies in stream 7's segment: its bytes are not stream 7's cache.
    let s7 = t.streams.iter().position(|&s| s == 7).unwrap();
    assert_eq!(t.allocs[1].owner as usize, s7);
    let cached7: Vec<(u32, u64)> = t.cached_changes[s7].clone();
    assert_eq!(
        cached7,
        vec![(0, 100), (1, 60), (2, 0), (4, 40), (6, 100), (7, 0)]
    );
}

#[test]
fn before_the_trace_and_reuse_without_free_completed() {
    use TraceAction::*;
    let seg = Segment {
        addr: 0x1000,
        size: 100,
        pool: "large".into(),
        stream: 1,
        expandable: false,
        tag: None,
        asleep: false,
        blocks: vec![
            Block {
                addr: 0x1000,
                size: 50,
                requested: 50,
                state: BlockState::ActiveAllocated,
                stream: 1,
                pending_events: 0,
                stack: None,
                lent_to: None,
            },
            Block {
                addr: 0x1032,
                size: 50,
                requested: 0,
                state: BlockState::Inactive,
                stream: 1,
                pending_events: 0,
                stack: None,
                lent_to: None,
            },
        ],
    };
    let d = device(
        vec![seg],
        vec![
            // A block allocated before the trace is freed.
            ev(FreeRequested, 0x1032, 50, 1),
            ev(FreeCompleted, 0x1032, 50, 1),
            // A block freed with pending events, reused by another stream at once.
            ev(Alloc, 0x1032, 50, 1),
            ev(FreeRequested, 0x1032, 50, 1),
            ev(CrossStreamWait, 0x1032, 50, 2),
            ev(Alloc, 0x1032, 50, 2),
        ],
    );
    let t = Timeline::build(&d);
    // Before the trace: the freed block and the block still allocated at the end.
    assert_eq!(t.initial[Counter::Active as usize], 100);
    assert_eq!(t.initial[Counter::Reserved as usize], 100);
    assert_eq!(t.segments.len(), 1);
    assert_eq!(t.segments[0].start, None);
    assert_eq!(
        t.counters[Counter::Active as usize],
        vec![100, 50, 100, 100, 100, 100]
    );
    assert_eq!(
        t.counters[Counter::Pending as usize],
        vec![50, 0, 0, 50, 50, 0]
    );
    let reused = &t.allocs[t.allocs.len() - 2];
    assert_eq!((reused.start, reused.end), (Some(2), Some(5)));
    assert_eq!(t.active_at(5).len(), 2);
}

#[test]
fn expandable_unmaps_split_and_join_mappings() {
    use TraceAction::*;
    let d = device(
        vec![],
        vec![
            ev(SegmentMap, 0x1000, 0x200, 3),
            ev(SegmentMap, 0x1200, 0x200, 3),
            // Part of the first mapping and part of the second, in one call.
            ev(SegmentUnmap, 0x1100, 0x200, 3),
            // A range mapped before the trace.
            ev(SegmentUnmap, 0x9000, 0x100, 3),
            ev(SegmentUnmap, 0x1000, 0x100, 3),
        ],
    );
    let t = Timeline::build(&d);
    assert_eq!(
        t.counters[Counter::Reserved as usize],
        // 0x100 mapped before the trace is counted from the start.
        vec![0x300, 0x500, 0x300, 0x200, 0x100]
    );
    assert_eq!(t.initial[Counter::Reserved as usize], 0x100);
    let live: Vec<(u64, u64)> = t
        .segments
        .iter()
        .filter(|s| s.end.is_none())
        .map(|s| (s.addr, s.size))
        .collect();
    assert_eq!(live, vec![(0x1300, 0x100)]);
}

/// A timeline is charged to the budget it is built within: what it keeps (its counters,
/// lifetimes and cached changes) stays charged, what only building needs is given back,
/// and a budget that cannot afford it is an error.
#[test]
fn a_timeline_is_built_within_its_budget() {
    use TraceAction::*;
    let trace: Vec<Event> = (0..10_000u64)
        .flat_map(|i| {
            let addr = 0x1000 * (i % 64);
            [
                ev(Alloc, addr, 512, i % 3),
                ev(FreeCompleted, addr, 512, i % 3),
            ]
        })
        .collect();
    let d = device(vec![], trace);
    let mut budget = Budget::new(1 << 30);
    let t = Timeline::build_within(&d, &mut budget).unwrap();
    assert_eq!(t.allocs.len(), 10_000);
    let counters = 5 * 20_000 * 8;
    assert!(budget.used() >= counters, "{} charged", budget.used());
    assert!(budget.used() < 4 * counters, "{} charged", budget.used());
    let over = Timeline::build_within(&d, &mut Budget::new(counters)).unwrap_err();
    assert_eq!(over.stage, "building the timeline");
    assert_eq!(Timeline::build(&d).allocs, t.allocs);
}

#[test]
fn a_sleep_gives_reserved_memory_back_until_its_wake_and_is_a_sleeping_span() {
    use TraceAction::*;
    let asleep_before = Segment {
        addr: 0x9000,
        size: 0x100,
        pool: "large".into(),
        stream: 3,
        expandable: true,
        tag: Some("weights".into()),
        asleep: true,
        blocks: vec![],
    };
    let d = device(
        vec![asleep_before],
        vec![
            ev(SegmentMap, 0x1000, 0x400, 3),
            ev(Alloc, 0x1000, 0x300, 3),
            ev(Sleep, 0x1000, 0x400, 3),
            ev(Wake, 0x1000, 0x400, 3),
            ev(FreeRequested, 0x1000, 0x300, 3),
        ],
    );
    let t = Timeline::build(&d);
    assert_eq!(
        t.counters[Counter::Reserved as usize],
        vec![0x400, 0x400, 0, 0x400, 0x400],
        "the sleeping segment of the snapshot holds no memory"
    );
    assert_eq!(
        t.counters[Counter::Allocated as usize],
        vec![0, 0x300, 0x300, 0x300, 0],
        "a sleeping block stays allocated"
    );
    assert_eq!(t.sleeping.len(), 2);
    assert_eq!(t.sleeping_at(0), vec![(0x9000, 0x100)]);
    assert_eq!(t.sleeping_at(3), vec![(0x9000, 0x100), (0x1000, 0x400)]);
    assert_eq!(t.sleeping_at(4), vec![(0x9000, 0x100)]);
}
