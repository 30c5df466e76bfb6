//! The driver calls on the simulated device: each capability group of the engine's
//! `Backend`, checked as the CUDA driver checks them, plus the capture rules and the race
//! detector's view of unmapping.

use super::{copies, SimBackend, SimEvent, SimState, PAGE_SIZE, SEGMENT_GUARD};
use crate::backend::{self, BackendResult};
use crate::error::BackendError;
use crate::types::{DevicePtr, EventHandle, HostPtr, StreamId};
use std::sync::atomic::Ordering;

fn unknown_event(operation: &'static str, event: EventHandle) -> BackendError {
    BackendError::new(operation, format!("invalid resource handle {event:?}"))
}

/// Virtual host time, in nanoseconds: traces are deterministic.
impl backend::Clock for SimBackend {
    fn now_ns(&self) -> u64 {
        self.host_now.load(Ordering::Relaxed)
    }

    fn now_ticks(&self) -> u64 {
        self.now_ns()
    }

    fn ticks_to_ns(&self, ticks: u64) -> u64 {
        ticks
    }

    fn precise_ns(&self) -> u64 {
        self.now_ns()
    }

    /// The virtual time is the only clock, whichever the configuration names.
    fn set_trace_clock(&self, _clock: crate::config::TraceClock) {}
}

impl backend::Segments for SimBackend {
    fn total_memory(&self) -> BackendResult<u64> {
        Ok(self.state.lock().capacity)
    }

    fn free_memory(&self) -> BackendResult<u64> {
        let state = self.state.lock();
        Ok(state.capacity.saturating_sub(state.reserved))
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

impl backend::Events for SimBackend {
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
        state.alive(index, "cuEventRecord")?;
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

impl backend::Streams for SimBackend {
    fn stream_wait_event(&self, stream: StreamId, event: EventHandle) -> BackendResult<()> {
        let mut state = self.call("stream_wait_event");
        let index = state.stream_of(stream);
        state.alive(index, "cuStreamWaitEvent")?;
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
        state.alive(index, "cuStreamIsCapturing")?;
        Ok(state.capturing.contains(&index))
    }
}

impl backend::VirtualMemory for SimBackend {
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
        self.charge_allocations(&mut state, source.len() as u64);
        Ok(())
    }

    fn unmap_pages(&self, ptr: DevicePtr, size: u64) -> BackendResult<()> {
        let mut state = self.call("unmap_pages");
        let mappings = state.unmap_checked(ptr.0, ptr.0.saturating_add(size), "unmap_pages")?;
        self.charge_allocations(&mut state, mappings as u64);
        Ok(())
    }

    fn map_pages_whole(&self, ptr: DevicePtr, size: u64) -> BackendResult<()> {
        self.map_fresh("map_pages_whole", ptr, size, Some(false))
    }
}

impl backend::HostMemory for SimBackend {
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
        let allocations = if per_page { size / PAGE_SIZE } else { 1 };
        self.charge_allocations(&mut state, allocations);
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
