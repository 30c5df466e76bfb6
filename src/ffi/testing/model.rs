//! The model of the caller's pointers and the checks after every call (see the module docs
//! of [`super`]).

use super::{driver_calls, last_error, Harness, Live, Outcome, SENTINEL};
use crate::ffi::error;
use std::collections::BTreeMap;
use std::ffi::{c_int, c_void};
use streamalloc_allocator::backend::sim::INJECTED_PANIC;
use streamalloc_allocator::DevicePtr;

impl Harness {
    /// Invalid frees counted on each created device, and in the registry.
    pub(super) fn invalid_frees(&self) -> (BTreeMap<c_int, u64>, u64) {
        let per_device = self
            .registry
            .initialized()
            .map(|d| (d.ordinal(), d.allocator().stats().invalid_frees))
            .collect();
        (per_device, self.registry.invalid_frees())
    }

    /// Notes a pointer `malloc` returned, if any; it must be new.
    pub(super) fn allocated(&mut self, ptr: u64, device: c_int, size: usize) -> Result<(), String> {
        if ptr == 0 {
            return if size == 0 && !last_error().is_empty() {
                Err("malloc of 0 bytes set an error".to_string())
            } else {
                Ok(())
            };
        }
        if let Some(live) = self.live.insert(ptr, Live { device }) {
            return Err(format!(
                "{ptr:#x} handed out again while live (device {})",
                live.device
            ));
        }
        self.dead.retain(|&p| p != ptr);
        match self.registry.get(device) {
            Some(d) if d.allocator().owns(DevicePtr(ptr)) => Ok(()),
            _ => Err(format!("{ptr:#x} is not a live block of device {device}")),
        }
    }

    /// Updates the model after `free(ptr, device)` and says whether it went as it should.
    pub(super) fn freed(
        &mut self,
        ptr: u64,
        device: c_int,
        (before, registry_before): (BTreeMap<c_int, u64>, u64),
    ) -> Result<(), String> {
        let live = self.live.remove(&ptr);
        if live.is_some() {
            self.dead.push(ptr);
        }
        if ptr == 0 || !self.exact() {
            return Ok(());
        }
        let (after, registry_after) = self.invalid_frees();
        let error = last_error();
        let mut expected = before.clone();
        let mut registry_expected = registry_before;
        if live.is_some() {
            if !error.is_empty() {
                return Err(format!("freeing a live pointer failed: {error}"));
            }
        } else {
            if !error.contains("unknown pointer") {
                return Err(format!("freeing a dead pointer: error {error:?}"));
            }
            if let Some(count) = expected.get_mut(&device) {
                *count += 1;
            }
            registry_expected += 1;
        }
        // A device created by this call (none is) would be missing from `before`.
        if after != expected || registry_after != registry_expected {
            return Err(format!(
                "invalid frees per device {before:?} -> {after:?} (expected {expected:?}), registry {registry_before} -> {registry_after} (expected {registry_expected})"
            ));
        }
        Ok(())
    }

    /// The checks after every call (see the module docs).
    pub(super) fn check(&mut self, outcome: &Outcome) -> Result<(), String> {
        let call = &outcome.call;
        let error = last_error();
        if error == SENTINEL {
            return Err(format!("{call}: the last error is stale"));
        }
        outcome
            .expect
            .clone()
            .map_err(|why| format!("{call}: {why}"))?;
        if let Some(failed) = outcome.failed {
            if failed == error.is_empty() {
                return Err(format!(
                    "{call}: {} with last error {error:?}",
                    if failed { "failed" } else { "succeeded" }
                ));
            }
        }
        if error.contains("internal error (panic)") {
            return Err(format!("{call}: a panic was caught: {error}"));
        }
        for device in self.registry.initialized() {
            let ordinal = device.ordinal();
            let backend = device.allocator().backend();
            match device.poisoned() {
                Some(poisoned) => {
                    let message = poisoned.to_string();
                    if !self.planted.contains(&ordinal) || !message.contains(INJECTED_PANIC) {
                        return Err(format!("{call}: device {ordinal} poisoned by a panic nobody planted: {message}"));
                    }
                    let now = (device.allocator().stats(), driver_calls(backend));
                    match self.poisoned.get(&ordinal) {
                        None => {
                            self.poisoned.insert(ordinal, now);
                        }
                        Some(then) if *then != now => {
                            return Err(format!(
                                "{call}: the engine of poisoned device {ordinal} was used"
                            ));
                        }
                        Some(_) => {}
                    }
                }
                None => {
                    device
                        .allocator()
                        .check_invariants()
                        .map_err(|why| format!("{call}: device {ordinal}: {why}"))?;
                    if let Some(race) = backend.races().first() {
                        return Err(format!("{call}: device {ordinal}: {race}"));
                    }
                }
            }
        }
        if error.contains("unusable after an internal panic") && self.poisoned.is_empty() {
            return Err(format!("{call}: {error}, yet no device is poisoned"));
        }
        Ok(())
    }

    /// Frees everything and checks that the devices end empty.
    pub(super) fn finish(mut self) -> Result<(), String> {
        let live: Vec<(u64, Live)> = self.live.iter().map(|(p, l)| (*p, *l)).collect();
        for (ptr, Live { device }) in live {
            error::set(SENTINEL);
            let before = self.invalid_frees();
            crate::ffi::free(
                &self.registry,
                ptr as usize as *mut c_void,
                0,
                device,
                std::ptr::null_mut(),
            );
            let outcome = Outcome {
                call: format!("final free({ptr:#x}, {device})"),
                failed: None,
                expect: self.freed(ptr, device, before),
            };
            self.check(&outcome)?;
        }
        for device in self.registry.initialized() {
            let allocated = device.allocator().stats().allocated_bytes.current;
            if self.exact() && allocated != 0 {
                return Err(format!(
                    "device {}: {allocated} bytes still allocated after every live pointer was freed",
                    device.ordinal()
                ));
            }
        }
        Ok(())
    }
}
