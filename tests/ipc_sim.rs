//! CUDA IPC of mapped memory on the simulated device: a sender and a receiver, two
//! allocators on one device as two processes on one GPU, with the race detector watching
//! both through the physical pages they share.
//!
//! - A stitched range (free pages of several holes mapped a second time) is shared as its
//!   pages, in order: the receiver's bytes are the sender's bytes, byte for byte.
//! - An allocation of an expandable segment is shared as the mappings under it, and the
//!   offset locates it.
//! - The receiver's work is ordered after the sender's by the event PyTorch sends along
//!   (without it the detector reports the race); closing the import waits for the
//!   receiver's work before unmapping; after both sides freed, the pages serve the sender
//!   again with no race.
//! - Pages the sender frees and unmaps stay allocated while imported; a handle opened after
//!   the sender unmapped its pages fails with the reason, as `pidfd_getfd` does.
//! - What cannot be shared says why: a whole segment (shared with `cudaIpcGetMemHandle`), a
//!   pointer no allocation, and the stitched range's own second mappings.

use streamalloc::ffi::ipc::{close_import, export_allocation, open_handle};
use streamalloc_allocator::backend::ipc::{IpcBackend, IpcError};
use streamalloc_allocator::backend::sim::{Access, RaceKind, SimBackend};
use streamalloc_allocator::backend::{Events, Streams};
use streamalloc_allocator::{Allocation, Allocator, Config, DevicePtr, StreamId};

const MIB: u64 = 1 << 20;

/// A device and two allocators on it, the sender's and the receiver's, with one stream
/// each.
fn two_processes(config: Config) -> (SimBackend, [(Allocator<SimBackend>, StreamId); 2]) {
    let device = SimBackend::new(4 << 30);
    let sender = Allocator::new(device.clone(), config.clone()).unwrap();
    let receiver = Allocator::new(device.clone(), config).unwrap();
    let (s, r) = (device.create_stream(), device.create_stream());
    (device, [(sender, s), (receiver, r)])
}

/// A 40 MiB allocation stitched from the free pages of two holes around a live block.
fn stitched(allocator: &Allocator<SimBackend>, stream: StreamId) -> (Allocation, Allocation) {
    let below = allocator.malloc(30 * MIB, stream).unwrap();
    let live = allocator.malloc(4 * MIB, stream).unwrap();
    let above = allocator.malloc(26 * MIB, stream).unwrap();
    allocator.free(below.ptr).unwrap();
    allocator.free(above.ptr).unwrap();
    let wide = allocator.malloc(40 * MIB, stream).unwrap();
    assert_eq!(allocator.stats().stitches, 1, "the request was stitched");
    (wide, live)
}

/// The physical bytes behind a range, adjacent ranges joined.
fn physical(device: &SimBackend, ptr: u64, len: u64) -> Vec<(u64, u64)> {
    let mut joined: Vec<(u64, u64)> = Vec::new();
    for (start, end) in device.physical_ranges(DevicePtr(ptr), len).expect("mapped") {
        match joined.last_mut() {
            Some(last) if last.1 == start => last.1 = end,
            _ => joined.push((start, end)),
        }
    }
    joined
}

/// The sender fills `block`, exports it and records the event PyTorch sends along; the
/// receiver opens the handle, waits for the event (or not) and adds one in place; returns
/// the receiver's base and offset.
fn send_and_update(
    device: &SimBackend,
    [(sender, s), (receiver, r)]: &[(Allocator<SimBackend>, StreamId); 2],
    block: &Allocation,
    wait: bool,
) -> (u64, u64) {
    device.launch(
        *s,
        &[Access::write(block.ptr, block.size)],
        5_000,
        "sender fills",
    );
    let (handle, offset) = export_allocation(sender, block.ptr.0).unwrap();
    let event = device.create_event().unwrap();
    device.record_event(event, *s).unwrap();
    let base = open_handle(receiver, &handle).unwrap();
    assert_eq!(
        physical(device, base + offset, block.size),
        physical(device, block.ptr.0, block.size),
        "the receiver maps the sender's bytes, in order"
    );
    if wait {
        device.stream_wait_event(*r, event).unwrap();
    }
    let at = DevicePtr(base + offset);
    let update = [Access::read(at, block.size), Access::write(at, block.size)];
    device.launch(*r, &update, 5_000, "receiver adds one");
    (base, offset)
}

#[test]
fn a_stitched_range_is_shared_as_its_pages_and_both_sides_free_without_a_race() {
    let (device, processes) = two_processes(Config::default());
    let [(sender, s), (receiver, _)] = &processes;
    let (wide, live) = stitched(sender, *s);
    let (handle, offset) = export_allocation(sender, wide.ptr.0).unwrap();
    assert_eq!(offset, 0, "the range starts the handle");
    assert_eq!(
        handle[1], b'e',
        "one 2 MiB allocation per page: PyTorch's format"
    );
    let (base, _) = send_and_update(&device, &processes, &wide, true);
    // The receiver drops the tensor: the import closes after its work.
    close_import(receiver, base).unwrap();
    assert!(receiver
        .backend()
        .ipc_import_size(DevicePtr(base))
        .is_none());
    // The sender frees it; the next request of that size takes the same pages again.
    sender.free(wide.ptr).unwrap();
    let again = sender.malloc(40 * MIB, *s).unwrap();
    device.launch(
        *s,
        &[Access::write(again.ptr, again.size)],
        1_000,
        "sender reuses",
    );
    sender.free(again.ptr).unwrap();
    sender.free(live.ptr).unwrap();
    assert_eq!(device.races(), [], "both sides ordered");
    sender.check_invariants().unwrap();
    receiver.check_invariants().unwrap();
}

#[test]
fn the_detector_sees_the_receiver_race_the_sender_through_the_shared_pages() {
    let (device, processes) = two_processes(Config::default());
    let [(sender, s), (receiver, _)] = &processes;
    let (wide, _live) = stitched(sender, *s);
    let (base, _) = send_and_update(&device, &processes, &wide, false);
    let races = device.races();
    assert!(
        races.iter().any(|race| race.kind == RaceKind::Unordered
            && race.earlier.starts_with("sender fills")
            && race.later.starts_with("receiver adds one")),
        "{races:?}"
    );
    close_import(receiver, base).unwrap();
}

#[test]
fn an_expandable_allocation_is_shared_as_the_mappings_under_it_at_its_offset() {
    let (device, processes) = two_processes(Config::default());
    let [(sender, s), (receiver, _)] = &processes;
    let first = sender.malloc(3 * MIB, *s).unwrap();
    let second = sender.malloc(3 * MIB + 512, *s).unwrap();
    let (handle, offset) = export_allocation(sender, second.ptr.0).unwrap();
    assert!(
        offset > 0 || second.ptr.0 % (2 * MIB) == 0,
        "offset {offset}"
    );
    let (base, offset_again) = send_and_update(&device, &processes, &second, true);
    assert_eq!(offset_again, offset);
    assert!(!handle.is_empty());
    close_import(receiver, base).unwrap();
    sender.free(second.ptr).unwrap();
    sender.free(first.ptr).unwrap();
    sender.empty_cache().unwrap();
    assert_eq!(device.races(), []);
    assert_eq!(device.reserved(), 0, "every page went back to the device");
}

#[test]
fn pages_the_sender_unmaps_stay_while_imported_and_a_late_open_fails_with_the_reason() {
    let (device, processes) = two_processes(Config::default());
    let [(sender, s), (receiver, r)] = &processes;
    let block = sender.malloc(8 * MIB, *s).unwrap();
    let (base, offset) = send_and_update(&device, &processes, &block, true);
    let (late_handle, _) = export_allocation(sender, block.ptr.0).unwrap();
    // The sender lets go of its memory while the receiver still works on it.
    sender.free(block.ptr).unwrap();
    sender.empty_cache().unwrap();
    assert!(
        device.reserved() >= 8 * MIB,
        "imported pages stay allocated"
    );
    let at = DevicePtr(base + offset);
    device.launch(
        *r,
        &[Access::read(at, block.size)],
        1_000,
        "receiver reads on",
    );
    match open_handle(receiver, &late_handle) {
        Err(message) => assert!(
            message.contains("no longer has that descriptor"),
            "{message}"
        ),
        Ok(_) => panic!("opened a handle whose memory the sender released"),
    }
    close_import(receiver, base).unwrap();
    assert_eq!(device.reserved(), 0, "gone with the last mapping");
    assert_eq!(device.races(), []);
}

#[test]
fn what_cannot_be_shared_here_says_why() {
    let (_, [(whole, s), _]) = two_processes(Config {
        expandable_segments: false,
        ..Config::default()
    });
    let block = whole.malloc(4 * MIB, s).unwrap();
    let err = export_allocation(&whole, block.ptr.0).unwrap_err();
    assert!(err.contains("cudaIpcGetMemHandle"), "{err}");
    let err = export_allocation(&whole, 0x1234).unwrap_err();
    assert!(err.contains("not a live allocation"), "{err}");

    // A stitched range's own mappings are second mappings, with no allocation to export:
    // its pages must be exported instead.
    let (device, [(sender, s), _]) = two_processes(Config::default());
    let (wide, _live) = stitched(&sender, s);
    assert!(matches!(
        device.ipc_export(wide.ptr, wide.size),
        Err(IpcError::NotMapped { .. })
    ));
    let err = open_handle(&sender, &[2, b'c']).unwrap_err();
    assert!(err.contains("not a handle of mapped memory"), "{err}");
}
