//! Page-locked host memory and the copies between it and device memory: the simulator's
//! side of `HostMemory::alloc_host`, `copy_to_host`, `copy_to_device` and
//! `synchronize_copies` (the backup of a sleeping memory pool), and what tests read of
//! memory's contents ([`SimBackend::contents`]).
//!
//! A copy is an operation on the backend's own copy stream, like a launch: its device-side
//! access is checked by the race detector (reading bytes some stream still writes, or
//! writing bytes some stream still reads, without the host having seen that work complete,
//! is a race; touching unmapped memory is out of bounds), and it moves the contents'
//! versions (see [`super::contents`]), so a copy out and back restores exactly what was
//! there. The copy stream inherits what the host has seen complete when a copy is issued,
//! and nothing else, as a driver's stream of its own would.

use super::{Access, SimBackend, SimState};
use crate::backend::BackendResult;
use crate::error::BackendError;
use crate::types::{DevicePtr, HostPtr, StreamId};

/// The stream host copies run on: the backend's own, as a driver backend creates one.
const COPY_STREAM: StreamId = StreamId(0xc0_0000);

/// Bytes a copy moves per nanosecond of device time (25 GB/s, a PCIe 4 link).
const COPY_BYTES_PER_NS: u64 = 25;

/// Which way a copy goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Direction {
    /// Device memory to a host buffer (`cuMemcpyDtoHAsync`).
    ToHost,
    /// A host buffer to device memory (`cuMemcpyHtoDAsync`).
    ToDevice,
}

impl SimBackend {
    /// What `[ptr, ptr + len)` holds, as `(offset, len, version)` runs from `ptr` covering
    /// it in order: the version is the number of the operation that last wrote the bytes
    /// (its place in the simulator's log, plus one), carried unchanged by copies, and 0
    /// for bytes never written since they were mapped. `None` if some byte lies in no live
    /// segment or mapping.
    pub fn contents(&self, ptr: DevicePtr, len: u64) -> Option<Vec<(u64, u64, u64)>> {
        let state = self.state.lock();
        let mut runs: Vec<(u64, u64, u64)> = Vec::new();
        for (virt, piece_len, physical) in state.physical_pieces(ptr.0, len)? {
            for (start, end, version) in state.contents.get(physical, physical + piece_len) {
                let offset = virt - ptr.0 + (start - physical);
                match runs.last_mut() {
                    Some(last) if last.0 + last.1 == offset && last.2 == version => {
                        last.1 += end - start;
                    }
                    _ => runs.push((offset, end - start, version)),
                }
            }
        }
        Some(runs)
    }

    /// Bytes of page-locked host buffers allocated and not freed.
    pub fn host_bytes(&self) -> u64 {
        self.state.lock().host.bytes
    }

    pub(super) fn host_alloc(&self, size: u64) -> BackendResult<HostPtr> {
        let mut state = self.call("alloc_host");
        if size == 0 {
            return Err(BackendError::new("cuMemHostAlloc", "size 0"));
        }
        Ok(HostPtr(state.host.alloc(size)))
    }

    pub(super) fn host_free(&self, ptr: HostPtr, size: u64) -> BackendResult<()> {
        let mut state = self.call("free_host");
        // As `cuMemFreeHost`, the copies under way finish first.
        state.wait_for_copies();
        self.publish(&state);
        if !state.host.free(ptr.0, size) {
            return Err(BackendError::new(
                "cuMemFreeHost",
                format!("{ptr:?} ({size} bytes) is not a live host buffer"),
            ));
        }
        Ok(())
    }

    /// A copy of `size` bytes between the host buffer at `host` and device memory at
    /// `device`, in `direction`.
    pub(super) fn host_copy(
        &self,
        direction: Direction,
        host: HostPtr,
        device: DevicePtr,
        size: u64,
    ) -> BackendResult<()> {
        let (name, operation) = match direction {
            Direction::ToHost => ("copy_to_host", "cuMemcpyDtoHAsync"),
            Direction::ToDevice => ("copy_to_device", "cuMemcpyHtoDAsync"),
        };
        let mut state = self.call(name);
        if size == 0 || !state.host.inside(host.0, size) {
            return Err(BackendError::new(
                operation,
                format!("[{host:?}, +{size:#x}) is not inside one host buffer"),
            ));
        }
        let label = format!(
            "{name} [{:#x}, {:#x}) {} {host:?}",
            device.0,
            device.0.saturating_add(size),
            if direction == Direction::ToHost {
                "to"
            } else {
                "from"
            }
        );
        let access = match direction {
            Direction::ToHost => Access::read(device, size),
            Direction::ToDevice => Access::write(device, size),
        };
        state.launch(COPY_STREAM, &[access], size / COPY_BYTES_PER_NS, &label);
        // Move the contents where the device side is memory at all (the race detector
        // has reported the rest as out of bounds).
        let Some(pieces) = state.physical_pieces(device.0, size) else {
            return Ok(());
        };
        for (virt, len, physical) in pieces {
            let at = host.0 + (virt - device.0);
            let state = &mut *state;
            match direction {
                Direction::ToHost => {
                    state
                        .contents
                        .copy_into(physical, len, &mut state.host.contents, at);
                }
                Direction::ToDevice => {
                    state
                        .host
                        .contents
                        .copy_into(at, len, &mut state.contents, physical);
                }
            }
        }
        Ok(())
    }

    pub(super) fn host_synchronize_copies(&self) -> BackendResult<()> {
        let mut state = self.call("synchronize_copies");
        state.wait_for_copies();
        self.publish(&state);
        Ok(())
    }
}

impl SimState {
    /// The host waits for the copy stream.
    fn wait_for_copies(&mut self) {
        let index = self.stream_of(COPY_STREAM);
        let (time, clock) = (
            self.streams[index].tail_time,
            self.streams[index].clock.clone(),
        );
        self.host_time = self.host_time.max(time);
        self.host_clock.merge(&clock);
    }

    /// `[start, start + len)` as `(virtual start, len, physical start)` pieces: a whole
    /// segment is its own physical memory, mapped memory the pages behind its mappings.
    /// `None` if some byte is in neither.
    pub(super) fn physical_pieces(&self, start: u64, len: u64) -> Option<Vec<(u64, u64, u64)>> {
        let end = start.checked_add(len)?;
        let in_segment = self
            .segments
            .range(..=start)
            .next_back()
            .is_some_and(|(seg, size)| end <= seg + size);
        if in_segment {
            return Some(vec![(start, len, start)]);
        }
        let pieces = self.vm.translate(start, end)?;
        Some(pieces.iter().map(|p| (p.virt, p.len, p.physical)).collect())
    }
}
