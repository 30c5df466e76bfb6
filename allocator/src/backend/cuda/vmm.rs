//! Virtual-memory mapping for expandable segments (`cuMemAddressReserve`, `cuMemCreate`,
//! `cuMemMap`, `cuMemSetAccess`, `cuMemUnmap`, `cuMemRelease`, `cuMemAddressFree`).
//!
//! The engine reserves address space once and maps physical memory into it as it grows,
//! so a segment can grow and shrink instead of being allocated whole (PyTorch's
//! `expandable_segments`). Each `map` call is one physical allocation (`cuMemCreate`) and
//! one mapping: the driver's cost is per allocation, not per byte (~80 µs for a 2 MiB page
//! against ~2 µs per 2 MiB of a 512 MiB one, on an H200), and the engine sizes its calls
//! (`MAP_CHUNK`). `cuMemUnmap` must cover whole mappings, so `unmap` takes whole mappings
//! only. The handle of each mapping is kept here, keyed by its address, to release it.
//!
//! Where the device can export allocations as POSIX file descriptors, every allocation is
//! created exportable (`requestedHandleTypes`), so that CUDA IPC can share it later (see
//! [`super::ipc`]); a mapping's exported descriptor is made on first export, kept with
//! the mapping (one descriptor however often it is shared) and closed when the mapping is
//! released.
//!
//! Unlike `cuMemFree`, `cuMemUnmap` does not synchronise; the engine synchronises before
//! it unmaps a page any stream may still touch.

use super::driver;
use super::sys;
use crate::backend::ipc::{ExportedMapping, IpcError};
use crate::backend::BackendResult;
use crate::error::BackendError;
use crate::types::DevicePtr;
use parking_lot::{Mutex, RwLock};
use std::collections::BTreeMap;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

/// One mapping: its bytes, its physical allocation and, once exported, its descriptor.
#[derive(Debug)]
struct Mapping {
    size: u64,
    handle: sys::CUmemGenericAllocationHandle,
    fd: Option<OwnedFd>,
}

/// The physical pages mapped into reservations of one device.
#[derive(Debug)]
pub(super) struct PageMap {
    /// The device the pages live on.
    ordinal: i32,
    /// Its driver handle (`cuDeviceCanAccessPeer` asks by handle).
    device: sys::CUdevice,
    /// Other devices of the process granted access to every mapping, as this device is
    /// (`super::peers`). Read-locked from a mapping's access grant until it is recorded, so
    /// that a peer added meanwhile finds it recorded.
    peers: RwLock<Vec<i32>>,
    /// Bytes per page: the driver's granularity, at least 2 MiB.
    page_size: u64,
    /// The driver's minimum granularity (what an imported allocation must be a multiple of).
    granularity: u64,
    /// Allocations are created exportable as POSIX file descriptors.
    exportable: bool,
    /// Mapping address → its mapping.
    mappings: Mutex<BTreeMap<u64, Mapping>>,
    /// Each `map` backs every page with its own allocation (see
    /// `VirtualMemory::set_page_allocations`).
    page_allocations: std::sync::atomic::AtomicBool,
    /// Second mappings of pages already mapped (stitched ranges): address → bytes. Each is
    /// one `cuMemMap` of part of one allocation; the allocation is released with its own
    /// mapping, and the driver frees it once this one is gone too.
    aliases: Mutex<BTreeMap<u64, u64>>,
}

impl PageMap {
    /// The page map of device `ordinal`, or `None` if the device cannot map memory.
    /// The caller has made the device's context current.
    pub(super) fn probe(ordinal: i32, device: sys::CUdevice) -> Option<Self> {
        let mut supported: std::ffi::c_int = 0;
        // SAFETY: valid out pointer; `device` is a valid device handle.
        let code = unsafe {
            sys::cuDeviceGetAttribute(
                &mut supported,
                sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED,
                device,
            )
        };
        if code != sys::CUresult::CUDA_SUCCESS || supported == 0 {
            return None;
        }
        let mut posix: std::ffi::c_int = 0;
        // SAFETY: as above.
        let code = unsafe {
            sys::cuDeviceGetAttribute(
                &mut posix,
                sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED,
                device,
            )
        };
        let exportable = code == sys::CUresult::CUDA_SUCCESS && posix != 0;
        let prop = allocation_prop(ordinal, exportable);
        let mut granularity: usize = 0;
        // SAFETY: valid out pointer and property struct.
        let code = unsafe {
            sys::cuMemGetAllocationGranularity(
                &mut granularity,
                &prop,
                sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM,
            )
        };
        if code != sys::CUresult::CUDA_SUCCESS || granularity == 0 {
            return None;
        }
        let page_size = (granularity as u64)
            .max(2 << 20)
            .next_multiple_of(granularity as u64);
        Some(Self {
            ordinal,
            device,
            peers: RwLock::new(Vec::new()),
            page_size,
            granularity: granularity as u64,
            exportable,
            mappings: Mutex::new(BTreeMap::new()),
            aliases: Mutex::new(BTreeMap::new()),
            page_allocations: std::sync::atomic::AtomicBool::new(false),
        })
    }

    pub(super) fn page_size(&self) -> u64 {
        self.page_size
    }

    pub(super) fn granularity(&self) -> u64 {
        self.granularity
    }

    pub(super) fn exportable(&self) -> bool {
        self.exportable
    }

    pub(super) fn reserve(&self, size: u64) -> BackendResult<DevicePtr> {
        let mut ptr: sys::CUdeviceptr = 0;
        driver::check(
            // SAFETY: valid out pointer; no fixed address requested.
            unsafe {
                sys::cuMemAddressReserve(&mut ptr, size as usize, self.page_size as usize, 0, 0)
            },
            "cuMemAddressReserve",
        )?;
        Ok(DevicePtr(ptr))
    }

    pub(super) fn release(&self, ptr: DevicePtr, size: u64) -> BackendResult<()> {
        // SAFETY: a reservation made by `reserve`, with nothing mapped (the engine unmaps
        // every page first).
        driver::check(
            unsafe { sys::cuMemAddressFree(ptr.0, size as usize) },
            "cuMemAddressFree",
        )
    }

    /// See `VirtualMemory::set_page_allocations`.
    pub(super) fn set_page_allocations(&self, on: bool) {
        self.page_allocations
            .store(on, std::sync::atomic::Ordering::Relaxed);
    }

    /// Maps fresh physical memory over `[ptr, ptr + size)`: one allocation, or one per page
    /// (`set_page_allocations`); on failure, leaves nothing mapped.
    pub(super) fn map(&self, ptr: DevicePtr, size: u64) -> BackendResult<()> {
        self.check_range(ptr, size, "cuMemMap")?;
        let peers = self.peers.read();
        if !self
            .page_allocations
            .load(std::sync::atomic::Ordering::Relaxed)
        {
            return self.map_one(ptr, size, &peers);
        }
        // Every page its own allocation, then access granted to the run at once: the
        // driver's `cuMemSetAccess` costs ~39 µs for one page and ~285 µs for 64 (H100),
        // so one call per run instead of per page saves most of a page's cost.
        let mut made: Vec<(u64, sys::CUmemGenericAllocationHandle)> = Vec::new();
        let undo = |made: &[(u64, sys::CUmemGenericAllocationHandle)]| {
            for &(at, handle) in made {
                // SAFETY: mapped just above, in this function, and never handed out or
                // touched: unmapping needs no synchronisation.
                unsafe {
                    sys::cuMemUnmap(at, self.page_size as usize);
                    sys::cuMemRelease(handle);
                }
            }
        };
        for at in (ptr.0..ptr.0 + size).step_by(self.page_size as usize) {
            match self.create_and_map(DevicePtr(at), self.page_size) {
                Ok(handle) => made.push((at, handle)),
                Err(err) => {
                    undo(&made);
                    return Err(err);
                }
            }
        }
        if let Err(err) = self.grant_access(ptr, size, &peers) {
            undo(&made);
            return Err(err);
        }
        let mut mappings = self.mappings.lock();
        for (at, handle) in made {
            mappings.insert(
                at,
                Mapping {
                    size: self.page_size,
                    handle,
                    fd: None,
                },
            );
        }
        Ok(())
    }

    /// Maps one fresh physical allocation over `[ptr, ptr + size)` whatever
    /// `set_page_allocations` says (`VirtualMemory::map_pages_whole`); on failure, leaves nothing
    /// mapped.
    pub(super) fn map_whole(&self, ptr: DevicePtr, size: u64) -> BackendResult<()> {
        self.check_range(ptr, size, "cuMemMap")?;
        self.map_one(ptr, size, &self.peers.read())
    }

    /// Maps one fresh physical allocation over `[ptr, ptr + size)` and makes it
    /// accessible; on failure, leaves nothing mapped.
    fn map_one(&self, ptr: DevicePtr, size: u64, peers: &[i32]) -> BackendResult<()> {
        let handle = self.create_and_map(ptr, size)?;
        if let Err(err) = self.grant_access(ptr, size, peers) {
            // SAFETY: mapped above and never handed out.
            unsafe {
                sys::cuMemUnmap(ptr.0, size as usize);
                sys::cuMemRelease(handle);
            }
            return Err(err);
        }
        self.mappings.lock().insert(
            ptr.0,
            Mapping {
                size,
                handle,
                fd: None,
            },
        );
        Ok(())
    }

    /// Creates one physical allocation of `size` bytes and maps it at `ptr`, not yet
    /// accessible; on failure, leaves nothing created or mapped.
    fn create_and_map(
        &self,
        ptr: DevicePtr,
        size: u64,
    ) -> BackendResult<sys::CUmemGenericAllocationHandle> {
        let prop = allocation_prop(self.ordinal, self.exportable);
        let mut handle: sys::CUmemGenericAllocationHandle = 0;
        driver::check(
            // SAFETY: valid out pointer and property struct; `size` is a multiple of the
            // granularity (checked by the callers).
            unsafe { sys::cuMemCreate(&mut handle, size as usize, &prop, 0) },
            "cuMemCreate",
        )?;
        if let Err(err) = driver::check(
            // SAFETY: `[ptr, ptr + size)` lies in a reservation and is not mapped (the engine
            // maps each range once); `handle` is a fresh allocation of exactly `size` bytes.
            unsafe { sys::cuMemMap(ptr.0, size as usize, 0, handle, 0) },
            "cuMemMap",
        ) {
            // SAFETY: the handle was created above and never mapped.
            unsafe { sys::cuMemRelease(handle) };
            return Err(err);
        }
        Ok(handle)
    }

    /// Makes the mapped range `[ptr, ptr + size)` readable and writable by this device and
    /// its `peers`.
    fn grant_access(&self, ptr: DevicePtr, size: u64, peers: &[i32]) -> BackendResult<()> {
        let access: Vec<sys::CUmemAccessDesc> = std::iter::once(self.ordinal)
            .chain(peers.iter().copied())
            .map(access_for)
            .collect();
        driver::check(
            // SAFETY: the whole range is mapped (the callers mapped every allocation in it);
            // `access` holds `access.len()` valid descriptors.
            unsafe { sys::cuMemSetAccess(ptr.0, size as usize, access.as_ptr(), access.len()) },
            "cuMemSetAccess",
        )
    }

    /// Grants device `peer` access to every mapping, present and future (see
    /// `super::peers`). Nothing changes if a grant fails: the peer is recorded only once
    /// every present mapping admits it, so later mappings cannot fail for its sake.
    pub(super) fn add_peer(&self, peer: i32) -> BackendResult<()> {
        let mut peers = self.peers.write();
        if peer == self.ordinal || peers.contains(&peer) {
            return Ok(());
        }
        let access = access_for(peer);
        for (start, len) in self.mapped_ranges() {
            driver::check(
                // SAFETY: `[start, start + len)` is one live mapping: unmapping and
                // recording mappings wait for the peers' write lock held here; one valid
                // descriptor.
                unsafe { sys::cuMemSetAccess(start, len as usize, &access, 1) },
                "cuMemSetAccess",
            )?;
        }
        peers.push(peer);
        Ok(())
    }

    /// The device's handle, for `cuDeviceCanAccessPeer`.
    pub(super) fn device(&self) -> sys::CUdevice {
        self.device
    }

    /// The device's ordinal.
    pub(super) fn ordinal(&self) -> i32 {
        self.ordinal
    }

    /// Every mapping, first and second: `(address, bytes)`, one each (adjacent ones may
    /// lie in different reservations, which one `cuMemSetAccess` may not span).
    fn mapped_ranges(&self) -> Vec<(u64, u64)> {
        let mut ranges: Vec<(u64, u64)> = self
            .mappings
            .lock()
            .iter()
            .map(|(&start, mapping)| (start, mapping.size))
            .collect();
        ranges.extend(
            self.aliases
                .lock()
                .iter()
                .map(|(&start, &len)| (start, len)),
        );
        ranges
    }

    /// Maps the pages mapped at `[src, src + size)` again at `[dst, dst + size)`: one
    /// `cuMemMap` per allocation the source spans, each whole (the driver maps nothing
    /// else a second time), then one `cuMemSetAccess` over the whole range. On failure,
    /// leaves nothing new mapped.
    pub(super) fn alias(&self, dst: DevicePtr, src: DevicePtr, size: u64) -> BackendResult<()> {
        self.check_range(dst, size, "cuMemMap")?;
        self.check_range(src, size, "cuMemMap")?;
        let peers = self.peers.read();
        let mappings = self.mappings.lock();
        let end = src.0 + size;
        // (target address, bytes, its handle)
        let mut parts = Vec::new();
        let mut cursor = src.0;
        if let Some((&first, _)) = mappings.range(..=src.0).next_back() {
            for (&at, mapping) in mappings.range(first..end) {
                if cursor >= end || at > cursor || at + mapping.size <= cursor {
                    break;
                }
                if at != cursor || at + mapping.size > end {
                    return Err(BackendError::new(
                        "cuMemMap",
                        format!(
                            "{src:?} + {size} does not cover whole allocations: the driver maps only whole allocations a second time"
                        ),
                    ));
                }
                let to = at + mapping.size;
                parts.push((dst.0 + (cursor - src.0), to - cursor, mapping.handle));
                cursor = to;
            }
        }
        if cursor < end {
            return Err(BackendError::new(
                "cuMemMap",
                format!("{src:?} + {size} is not wholly mapped"),
            ));
        }
        let mut done: Vec<(u64, u64)> = Vec::new();
        let undo = |done: &[(u64, u64)]| {
            for &(at, len) in done {
                // SAFETY: mapped just above, in this function, and never handed out.
                unsafe { sys::cuMemUnmap(at, len as usize) };
            }
        };
        for &(at, len, handle) in &parts {
            if let Err(err) = driver::check(
                // SAFETY: `[at, at + len)` lies in a reservation and is not mapped (the engine
                // maps each address once); `handle` is a live allocation of exactly `len`
                // bytes (its own mapping is held under the lock), mapped whole.
                unsafe { sys::cuMemMap(at, len as usize, 0, handle, 0) },
                "cuMemMap",
            ) {
                undo(&done);
                return Err(err);
            }
            done.push((at, len));
        }
        if let Err(err) = self.grant_access(dst, size, &peers) {
            undo(&done);
            return Err(err);
        }
        drop(mappings);
        self.aliases.lock().extend(done);
        drop(peers);
        Ok(())
    }

    /// Unmaps and releases the mappings tiling `[ptr, ptr + size)`, which must be whole
    /// mappings made by `map`, or whole second mappings made by `alias` (checked before
    /// anything is unmapped). A second mapping releases nothing: its pages stay with their
    /// own mapping.
    pub(super) fn unmap(&self, ptr: DevicePtr, size: u64) -> BackendResult<()> {
        self.check_range(ptr, size, "cuMemUnmap")?;
        // Not while a peer is being granted every mapping (`add_peer`).
        let _peers = self.peers.read();
        if self.unmap_aliases(ptr, size)? {
            return Ok(());
        }
        let mut mappings = self.mappings.lock();
        let end = ptr.0 + size;
        let mut covered = ptr.0;
        for (&start, mapping) in mappings.range(ptr.0..end) {
            if start != covered || start + mapping.size > end {
                break;
            }
            covered = start + mapping.size;
        }
        if covered != end {
            return Err(BackendError::new(
                "cuMemUnmap",
                format!("{ptr:?} + {size} does not cover whole mappings"),
            ));
        }
        let whole: Vec<u64> = mappings
            .range(ptr.0..end)
            .map(|(&start, _)| start)
            .collect();
        for start in whole {
            let Mapping {
                size: len,
                handle,
                fd,
            } = mappings.remove(&start).expect("listed above");
            // An importer holds its own reference to the allocation; the descriptor only
            // served to hand it over.
            drop(fd);
            driver::check(
                // SAFETY: `start` was mapped by `map` with exactly this length, and the engine
                // synchronised so no stream can still touch it.
                unsafe { sys::cuMemUnmap(start, len as usize) },
                "cuMemUnmap",
            )?;
            // SAFETY: the handle's only mapping was just removed.
            driver::check(unsafe { sys::cuMemRelease(handle) }, "cuMemRelease")?;
        }
        Ok(())
    }

    /// Unmaps the second mappings tiling `[ptr, ptr + size)`; false (and nothing done) if
    /// `ptr` starts none.
    fn unmap_aliases(&self, ptr: DevicePtr, size: u64) -> BackendResult<bool> {
        let mut aliases = self.aliases.lock();
        if !aliases.contains_key(&ptr.0) {
            return Ok(false);
        }
        let end = ptr.0 + size;
        let mut covered = ptr.0;
        let mut parts = Vec::new();
        for (&start, &len) in aliases.range(ptr.0..end) {
            if start != covered || start + len > end {
                break;
            }
            parts.push((start, len));
            covered = start + len;
        }
        if covered != end {
            return Err(BackendError::new(
                "cuMemUnmap",
                format!("{ptr:?} + {size} does not cover whole mappings"),
            ));
        }
        for (start, len) in parts {
            aliases.remove(&start);
            driver::check(
                // SAFETY: `start` was mapped by `alias` with exactly this length, and the
                // engine made sure (events seen complete, or a synchronisation) that no
                // stream can still touch it.
                unsafe { sys::cuMemUnmap(start, len as usize) },
                "cuMemUnmap",
            )?;
        }
        Ok(true)
    }

    /// The mappings covering `[ptr, ptr + size)` in address order, each with its POSIX file
    /// descriptor (exported now if it was not yet). The descriptors stay owned here, open
    /// until their mapping is unmapped.
    pub(super) fn export(
        &self,
        ptr: DevicePtr,
        size: u64,
    ) -> Result<Vec<ExportedMapping>, IpcError> {
        if !self.exportable {
            return Err(IpcError::Unsupported {
                ordinal: self.ordinal,
            });
        }
        let end = ptr
            .0
            .checked_add(size.max(1))
            .ok_or(IpcError::NotMapped { ptr: ptr.0, size })?;
        let mut mappings = self.mappings.lock();
        let first = match mappings.range(..=ptr.0).next_back() {
            Some((&start, mapping)) if start + mapping.size > ptr.0 => start,
            _ => return Err(IpcError::NotMapped { ptr: ptr.0, size }),
        };
        let mut out = Vec::new();
        let mut covered = first;
        for (&start, mapping) in mappings.range_mut(first..end) {
            if start != covered {
                break;
            }
            let fd = match &mapping.fd {
                Some(fd) => fd.as_raw_fd(),
                None => {
                    let mut raw: std::ffi::c_int = -1;
                    driver::check(
                        // SAFETY: `raw` is a valid out location for a POSIX descriptor (the
                        // handle type asked for); the handle is live, created exportable.
                        unsafe {
                            sys::cuMemExportToShareableHandle(
                                (&mut raw as *mut std::ffi::c_int).cast(),
                                mapping.handle,
                                sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                                0,
                            )
                        },
                        "cuMemExportToShareableHandle",
                    )?;
                    // SAFETY: the driver just created this descriptor for us to own.
                    let owned = unsafe { OwnedFd::from_raw_fd(raw) };
                    mapping.fd.insert(owned).as_raw_fd()
                }
            };
            out.push(ExportedMapping {
                address: start,
                size: mapping.size,
                fd,
            });
            covered = start + mapping.size;
        }
        if covered < end {
            return Err(IpcError::NotMapped { ptr: ptr.0, size });
        }
        Ok(out)
    }

    fn check_range(&self, ptr: DevicePtr, size: u64, operation: &'static str) -> BackendResult<()> {
        if size == 0
            || !ptr.0.is_multiple_of(self.page_size)
            || !size.is_multiple_of(self.page_size)
        {
            return Err(BackendError::new(
                operation,
                format!(
                    "{ptr:?} + {size} is not aligned to the {}-byte page",
                    self.page_size
                ),
            ));
        }
        Ok(())
    }
}

pub(super) fn location(ordinal: i32) -> sys::CUmemLocation {
    sys::CUmemLocation {
        type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
        id: ordinal,
    }
}

/// Read and write access for device `ordinal`.
fn access_for(ordinal: i32) -> sys::CUmemAccessDesc {
    sys::CUmemAccessDesc {
        location: location(ordinal),
        flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
    }
}

fn allocation_prop(ordinal: i32, exportable: bool) -> sys::CUmemAllocationProp {
    // SAFETY: a plain C struct for which all-zero is a valid (default) value.
    let mut prop: sys::CUmemAllocationProp = unsafe { std::mem::zeroed() };
    prop.type_ = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location = location(ordinal);
    if exportable {
        prop.requestedHandleTypes =
            sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    }
    prop
}
