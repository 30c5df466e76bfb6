//! Graph capture and replay as the race detector sees them.

use super::*;
use crate::backend::{Events, Segments, Streams, VirtualMemory};

const MIB: u64 = 1 << 20;

fn device_with_segment() -> (SimBackend, DevicePtr) {
    let device = SimBackend::new(1 << 30);
    let segment = device.alloc_segment(4 * MIB).unwrap();
    (device, segment)
}

/// Makes `later` wait on the device for everything enqueued on `earlier` so far.
fn order(device: &SimBackend, earlier: StreamId, later: StreamId) {
    let event = device.create_event().unwrap();
    device.record_event(event, earlier).unwrap();
    device.stream_wait_event(later, event).unwrap();
    device.destroy_event(event).unwrap();
}

#[test]
fn captured_launches_do_not_execute() {
    let (device, buf) = device_with_segment();
    let (capture, eager) = (device.create_stream(), device.create_stream());
    device.begin_capture(capture);
    assert!(device.is_capturing(capture).unwrap());
    device.launch(capture, &[Access::write(buf, MIB)], 1_000, "captured write");
    // Nothing ran: the capturing stream's time did not move and an unordered eager
    // write of the same bytes conflicts with nothing.
    assert_eq!(device.device_time(), 0);
    device.launch(eager, &[Access::write(buf, MIB)], 10, "eager write");
    let graph = device.end_capture(capture);
    assert!(!device.is_capturing(capture).unwrap());
    assert_eq!(device.graph_len(graph), Some(1));
    assert!(device.races().is_empty(), "{:?}", device.races());
}

#[test]
fn a_replay_racing_with_eager_work_is_reported_naming_both() {
    let (device, buf) = device_with_segment();
    let (capture, eager) = (device.create_stream(), device.create_stream());
    device.begin_capture(capture);
    device.launch(capture, &[Access::write(buf, MIB)], 1_000, "write tmp");
    let graph = device.end_capture(capture);
    device.launch(eager, &[Access::write(buf, MIB)], 1_000, "eager write");
    device.replay(graph, capture);
    let races = device.races();
    assert_eq!(races.len(), 1, "{races:?}");
    assert_eq!(races[0].kind, RaceKind::Unordered);
    assert!(races[0].earlier.starts_with("eager write"), "{}", races[0]);
    assert!(
        races[0]
            .later
            .starts_with(&format!("replay 1 of graph {graph}: write tmp")),
        "{}",
        races[0]
    );
}

#[test]
fn a_replay_ordered_after_eager_work_is_clean() {
    let (device, buf) = device_with_segment();
    let (capture, eager) = (device.create_stream(), device.create_stream());
    device.begin_capture(capture);
    device.launch(capture, &[Access::read(buf, MIB)], 1_000, "read input");
    let graph = device.end_capture(capture);
    device.launch(eager, &[Access::write(buf, MIB)], 1_000, "fill input");
    order(&device, eager, capture);
    device.replay(graph, capture);
    assert!(device.races().is_empty(), "{:?}", device.races());
}

#[test]
fn replays_run_in_capture_order_and_take_their_duration() {
    let (device, buf) = device_with_segment();
    let stream = device.create_stream();
    device.begin_capture(stream);
    device.launch(stream, &[Access::write(buf, MIB)], 1_000, "first");
    device.launch(stream, &[Access::read(buf, MIB)], 2_000, "second");
    let graph = device.end_capture(stream);
    device.replay(graph, stream);
    device.replay(graph, stream);
    assert_eq!(device.device_time(), 6_000);
    // Same-stream replays are stream-ordered: no race among them.
    assert!(device.races().is_empty(), "{:?}", device.races());
    let log = &device.state.lock().log;
    let labels: Vec<&str> = log.iter().map(|l| l.split(" (").next().unwrap()).collect();
    assert_eq!(
        labels,
        [
            "replay 1 of graph 1: first",
            "replay 1 of graph 1: second",
            "replay 2 of graph 1: first",
            "replay 2 of graph 1: second",
        ]
    );
}

#[test]
fn replays_of_one_graph_on_two_streams_must_be_ordered() {
    let (device, buf) = device_with_segment();
    let (a, b) = (device.create_stream(), device.create_stream());
    device.begin_capture(a);
    device.launch(a, &[Access::write(buf, MIB)], 1_000, "write");
    let graph = device.end_capture(a);
    device.replay(graph, a);
    device.replay(graph, b);
    let races = device.races();
    assert_eq!(races.len(), 1, "{races:?}");
    assert!(races[0].earlier.starts_with("replay 1 of graph 1: write"));
    assert!(races[0].later.starts_with("replay 2 of graph 1: write"));

    let (device, buf) = device_with_segment();
    let (a, b) = (device.create_stream(), device.create_stream());
    device.begin_capture(a);
    device.launch(a, &[Access::write(buf, MIB)], 1_000, "write");
    let graph = device.end_capture(a);
    device.replay(graph, a);
    order(&device, a, b);
    device.replay(graph, b);
    assert!(device.races().is_empty(), "{:?}", device.races());
}

#[test]
fn a_replay_touching_a_freed_segment_is_out_of_bounds() {
    let (device, buf) = device_with_segment();
    let stream = device.create_stream();
    device.begin_capture(stream);
    device.launch(stream, &[Access::write(buf, MIB)], 1_000, "write tmp");
    let graph = device.end_capture(stream);
    device.free_segment(buf, 4 * MIB).unwrap();
    device.replay(graph, stream);
    let races = device.races();
    assert_eq!(races.len(), 1, "{races:?}");
    assert_eq!(races[0].kind, RaceKind::OutOfBounds);
    assert!(races[0].later.starts_with("replay 1 of graph 1: write tmp"));
}

#[test]
fn a_replay_touching_unmapped_pages_is_out_of_bounds() {
    let device = SimBackend::new(1 << 30);
    let stream = device.create_stream();
    let range = device.reserve_address_space(2 * PAGE_SIZE).unwrap();
    device.map_pages(range, PAGE_SIZE).unwrap();
    device.begin_capture(stream);
    device.launch(stream, &[Access::write(range, 4096)], 1_000, "write");
    let graph = device.end_capture(stream);
    device.replay(graph, stream);
    device.synchronize_stream(stream);
    device.unmap_pages(range, PAGE_SIZE).unwrap();
    assert!(device.races().is_empty(), "{:?}", device.races());
    device.replay(graph, stream);
    let races = device.races();
    assert_eq!(races.len(), 1, "{races:?}");
    assert_eq!(races[0].kind, RaceKind::OutOfBounds);
}

#[test]
fn capture_rules_hold_while_recording() {
    let (device, _) = device_with_segment();
    let (capture, other) = (device.create_stream(), device.create_stream());
    let outside = device.create_event().unwrap();
    device.record_event(outside, other).unwrap();
    device.begin_capture(capture);
    device.synchronize_device().unwrap();
    device.query_event(outside).unwrap();
    device.stream_wait_event(capture, outside).unwrap();
    device.synchronize_stream(capture);
    let inside = device.create_event().unwrap();
    device.record_event(inside, capture).unwrap();
    device.stream_wait_event(other, inside).unwrap();
    device.end_capture(capture);
    let kinds: Vec<RaceKind> = device.races().iter().map(|r| r.kind).collect();
    assert_eq!(kinds, [RaceKind::Capture; 5], "{:?}", device.races());
}

#[test]
fn set_capturing_checks_the_rules_without_recording() {
    let (device, buf) = device_with_segment();
    let stream = device.create_stream();
    device.set_capturing(stream, true);
    assert!(device.is_capturing(stream).unwrap());
    device.launch(stream, &[Access::write(buf, MIB)], 1_000, "runs now");
    assert_eq!(device.device_time(), 1_000);
    device.set_capturing(stream, false);
    assert_eq!(device.live_graphs(), 0);
}

#[test]
fn destroyed_graphs_are_gone() {
    let device = SimBackend::new(1 << 30);
    let stream = device.create_stream();
    device.begin_capture(stream);
    let graph = device.end_capture(stream);
    assert_eq!(device.live_graphs(), 1);
    device.destroy_graph(graph);
    assert_eq!(device.live_graphs(), 0);
    assert_eq!(device.graph_len(graph), None);
}

#[test]
#[should_panic(expected = "does not exist")]
fn replaying_a_destroyed_graph_is_a_misuse() {
    let device = SimBackend::new(1 << 30);
    let stream = device.create_stream();
    device.begin_capture(stream);
    let graph = device.end_capture(stream);
    device.destroy_graph(graph);
    device.replay(graph, stream);
}

#[test]
#[should_panic(expected = "not recording a graph")]
fn end_capture_without_begin_is_a_misuse() {
    let device = SimBackend::new(1 << 30);
    let stream = device.create_stream();
    device.end_capture(stream);
}
