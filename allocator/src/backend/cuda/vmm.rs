//! Virtual-memory mapping for expandable segments (`cuMemAddressReserve`, `cuMemCreate`,
//! `cuMemMap`, `cuMemSetAccess`, `cuMemUnmap`, `cuMemRelease`, `cuMemAddressFree`).
//!
//! The engine reserves address space once and maps physical pages into it as it grows,
//! so a segment can grow and shrink page by page instead of being allocated whole
//! (PyTorch's `expandable_segments`). Every page is its own physical allocation, so any
//! page can be unmapped on its own: `cuMemUnmap` must cover whole mappings. The handle of
//! each mapped page is kept here, keyed by the page's address, to release it later.
//!
//! Unlike `cuMemFree`, `cuMemUnmap` does not synchronise; the engine synchronises before
//! it unmaps a page any stream may still touch.

use super::driver;
use super::sys;
use crate::backend::BackendResult;
use crate::error::BackendError;
use crate::types::DevicePtr;
use parking_lot::Mutex;
use std::collections::HashMap;

/// The physical pages mapped into reservations of one device.
#[derive(Debug)]
pub(super) struct PageMap {
    /// The device the pages live on.
    ordinal: i32,
    /// Bytes per page: the driver's granularity, at least 2 MiB.
    page_size: u64,
    /// Page address → its physical allocation.
    pages: Mutex<HashMap<u64, sys::CUmemGenericAllocationHandle>>,
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
        let prop = allocation_prop(ordinal);
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
            page_size,
            pages: Mutex::new(HashMap::new()),
        })
    }

    pub(super) fn page_size(&self) -> u64 {
        self.page_size
    }

    pub(super) fn reserve(&self, size: u64) -> BackendResult<DevicePtr> {
        let mut ptr: sys::CUdeviceptr = 0;
        // SAFETY: valid out pointer; no fixed address requested.
        driver::check(
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

    /// Maps fresh pages over `[ptr, ptr + size)`; on failure, unmaps what it mapped.
    pub(super) fn map(&self, ptr: DevicePtr, size: u64) -> BackendResult<()> {
        self.check_range(ptr, size, "cuMemMap")?;
        let prop = allocation_prop(self.ordinal);
        let mut mapped = Vec::new();
        let mut result = Ok(());
        for page in (ptr.0..ptr.0 + size).step_by(self.page_size as usize) {
            let mut handle: sys::CUmemGenericAllocationHandle = 0;
            // SAFETY: valid out pointer and property struct.
            if let Err(err) = driver::check(
                unsafe { sys::cuMemCreate(&mut handle, self.page_size as usize, &prop, 0) },
                "cuMemCreate",
            ) {
                result = Err(err);
                break;
            }
            // SAFETY: `page` lies in a reservation and is not mapped (the engine maps each
            // page once); `handle` is a fresh allocation of exactly one page.
            if let Err(err) = driver::check(
                unsafe { sys::cuMemMap(page, self.page_size as usize, 0, handle, 0) },
                "cuMemMap",
            ) {
                // SAFETY: the handle was created above and never mapped.
                unsafe { sys::cuMemRelease(handle) };
                result = Err(err);
                break;
            }
            mapped.push((page, handle));
        }
        if result.is_ok() {
            let access = sys::CUmemAccessDesc {
                location: location(self.ordinal),
                flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
            };
            // SAFETY: the whole range was just mapped; one valid descriptor.
            result = driver::check(
                unsafe { sys::cuMemSetAccess(ptr.0, size as usize, &access, 1) },
                "cuMemSetAccess",
            );
        }
        match result {
            Ok(()) => {
                self.pages.lock().extend(mapped);
                Ok(())
            }
            Err(err) => {
                for (page, handle) in mapped {
                    // SAFETY: mapped above and never handed out.
                    unsafe {
                        sys::cuMemUnmap(page, self.page_size as usize);
                        sys::cuMemRelease(handle);
                    }
                }
                Err(err)
            }
        }
    }

    /// Unmaps and releases the pages over `[ptr, ptr + size)`.
    pub(super) fn unmap(&self, ptr: DevicePtr, size: u64) -> BackendResult<()> {
        self.check_range(ptr, size, "cuMemUnmap")?;
        let mut pages = self.pages.lock();
        for page in (ptr.0..ptr.0 + size).step_by(self.page_size as usize) {
            let handle = pages.remove(&page).ok_or_else(|| {
                BackendError::new("cuMemUnmap", format!("page {page:#x} is not mapped"))
            })?;
            // SAFETY: `page` was mapped by `map` with exactly one page-sized mapping, and
            // the engine synchronised so no stream can still touch it.
            driver::check(
                unsafe { sys::cuMemUnmap(page, self.page_size as usize) },
                "cuMemUnmap",
            )?;
            // SAFETY: the handle's only mapping was just removed.
            driver::check(unsafe { sys::cuMemRelease(handle) }, "cuMemRelease")?;
        }
        Ok(())
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

fn location(ordinal: i32) -> sys::CUmemLocation {
    sys::CUmemLocation {
        type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
        id: ordinal,
    }
}

fn allocation_prop(ordinal: i32) -> sys::CUmemAllocationProp {
    // SAFETY: a plain C struct for which all-zero is a valid (default) value.
    let mut prop: sys::CUmemAllocationProp = unsafe { std::mem::zeroed() };
    prop.type_ = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location = location(ordinal);
    prop
}
