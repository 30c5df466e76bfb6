//! Peer access: the devices of one process may read and write each other's pages.
//!
//! Memory mapped through the VMM API is reachable only from the devices its
//! `cuMemSetAccess` names. PyTorch's own expandable segments add a device there when it
//! calls `enablePeerAccess`, but its pluggable allocator interface passes that call on to
//! no one and copies between devices with a plain `cudaMemcpyAsync`, which then fails with
//! "invalid argument": a model split over two GPUs in one process could not move its
//! activations. So every device's page map joins one list of the process when its backend
//! is made, and each pair of devices in it that the hardware connects
//! (`cuDeviceCanAccessPeer`) is granted access to the other's mappings, those made before
//! included (`PageMap::add_peer`). A process that uses one device (one rank per GPU) grants
//! nothing more.

use super::driver;
use super::sys;
use super::vmm::PageMap;
use parking_lot::Mutex;
use std::sync::{Arc, Weak};

/// The page map of every device of the process with a backend.
static PAGE_MAPS: Mutex<Vec<Weak<PageMap>>> = Mutex::new(Vec::new());

/// Adds `map` to the process's devices, making it and every other device that can reach
/// it peers of each other. A grant the driver refuses is logged and leaves that pair as
/// it was: the devices still work, their copies go through the driver's peer copy
/// (`cudaMemcpyPeerAsync`, as the native door does) or fail as before.
pub(super) fn join(map: &Arc<PageMap>) {
    let mut maps = PAGE_MAPS.lock();
    maps.retain(|other| other.strong_count() > 0);
    for other in maps.iter().filter_map(Weak::upgrade) {
        if other.ordinal() == map.ordinal() {
            continue;
        }
        grant(&other, map);
        grant(map, &other);
    }
    maps.push(Arc::downgrade(map));
}

/// Grants `to`'s device access to `pages`' mappings where the hardware allows it.
fn grant(pages: &PageMap, to: &PageMap) {
    if !can_access(to.device(), pages.device()) {
        return;
    }
    match pages.add_peer(to.ordinal()) {
        Ok(()) => tracing::debug!(
            device = pages.ordinal(),
            peer = to.ordinal(),
            "peer given access to the device's mappings"
        ),
        Err(err) => tracing::warn!(
            device = pages.ordinal(),
            peer = to.ordinal(),
            %err,
            "peer access to the device's mappings refused"
        ),
    }
}

/// True if contexts on `from` can reach memory of `to` directly.
fn can_access(from: sys::CUdevice, to: sys::CUdevice) -> bool {
    let mut can: std::ffi::c_int = 0;
    // SAFETY: valid out pointer; both are device handles of the loaded driver.
    let code = unsafe { sys::cuDeviceCanAccessPeer(&mut can, from, to) };
    driver::check(code, "cuDeviceCanAccessPeer").is_ok() && can != 0
}
