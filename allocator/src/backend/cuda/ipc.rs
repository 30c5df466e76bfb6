//! CUDA IPC of expandable-segment memory: exporting mappings as POSIX file descriptors,
//! importing another process's mappings, and closing an import.
//!
//! `cudaIpcGetMemHandle` only shares `cudaMalloc`'d memory. Memory of an expandable
//! segment is a set of physical allocations (`cuMemCreate`) mapped into reserved address
//! space; each allocation is shared on its own, as PyTorch does for its expandable
//! segments:
//! - **Export**: `cuMemExportToShareableHandle` turns an allocation (created with
//!   `requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR`, see `vmm`) into a
//!   file descriptor of the exporting process. Only its number travels; the descriptor
//!   stays open in the exporter (one per mapping, however often shared) until the mapping
//!   is unmapped.
//! - **Import**: the receiver copies each descriptor out of the sender with
//!   `pidfd_open(pid)` + `pidfd_getfd` (Linux 5.6; the caller needs ptrace access to the
//!   sender, which `kernel.yama.ptrace_scope` or a container may deny), imports it with
//!   `cuMemImportFromShareableHandle`, closes its copy, reserves address space for the
//!   whole range and maps each allocation at its offset, readable and writable by the
//!   device.
//! - **Close**: synchronises the device (unmapping does not), unmaps, releases each
//!   allocation and frees the address range.
//!
//! This is no allocation policy, so it is not part of the engine's `Backend` trait: the C
//! ABI (`streamalloc_ipc_*`) reaches these methods of [`CudaBackend`] through
//! [`IpcBackend`](crate::backend::ipc::IpcBackend).

use super::{driver, sys, vmm, CudaBackend};
use crate::types::DevicePtr;
use std::collections::HashMap;
use std::os::fd::AsRawFd;

pub use crate::backend::ipc::{
    check_import, ExportedMapping, ForeignMapping, IpcBackend, IpcError, MAX_IMPORT_MAPPINGS,
};

/// An opened import: its bytes and, per mapping, offset, bytes and allocation.
#[derive(Debug)]
pub(super) struct Import {
    size: u64,
    mappings: Vec<(u64, u64, sys::CUmemGenericAllocationHandle)>,
}

/// Address → opened import.
pub(super) type Imports = parking_lot::Mutex<HashMap<u64, Import>>;

impl CudaBackend {
    /// True if this device's expandable-segment memory can be exported.
    pub fn can_export_ipc(&self) -> bool {
        self.pages.as_deref().is_some_and(vmm::PageMap::exportable)
    }

    /// The mappings covering `[ptr, ptr + size)` (an expandable segment's memory), in
    /// address order, each with its POSIX file descriptor. Descriptors are made on first
    /// export and stay open, owned by the backend, until their mapping is unmapped.
    pub fn ipc_export(&self, ptr: DevicePtr, size: u64) -> Result<Vec<ExportedMapping>, IpcError> {
        let pages = self.pages.as_ref().ok_or(IpcError::NoVirtualMemory {
            ordinal: self.ordinal,
        })?;
        let _ctx = self.enter()?;
        pages.export(ptr, size)
    }

    /// Imports another process's mappings, back to back, into fresh address space of this
    /// device and returns its first byte. `pid` is the sending process; each descriptor is
    /// copied out of it (`pidfd_getfd`) and closed here once imported. On failure nothing
    /// stays imported or mapped.
    pub fn ipc_import(&self, pid: i32, mappings: &[ForeignMapping]) -> Result<DevicePtr, IpcError> {
        let pages = self.pages.as_ref().ok_or(IpcError::NoVirtualMemory {
            ordinal: self.ordinal,
        })?;
        let total = check_import(mappings, pages.granularity())?;
        if pid <= 0 {
            return Err(IpcError::Invalid(format!("sender pid {pid}")));
        }
        let _ctx = self.enter()?;
        let pidfd = os::pidfd_open(pid)?;
        let mut opened = Opened {
            handles: Vec::with_capacity(mappings.len()),
            base: 0,
            size: 0,
            mapped: Vec::with_capacity(mappings.len()),
        };
        for mapping in mappings {
            let local = os::pidfd_getfd(&pidfd, mapping.fd)?;
            let mut handle: sys::CUmemGenericAllocationHandle = 0;
            driver::check(
                // SAFETY: valid out pointer; for POSIX descriptors the driver takes the
                // descriptor's number in place of the pointer. `local` is open for the call.
                unsafe {
                    sys::cuMemImportFromShareableHandle(
                        &mut handle,
                        local.as_raw_fd() as usize as *mut std::ffi::c_void,
                        sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                    )
                },
                "cuMemImportFromShareableHandle",
            )?;
            drop(local);
            opened.handles.push(handle);
        }
        drop(pidfd);
        let mut base: sys::CUdeviceptr = 0;
        driver::check(
            // SAFETY: valid out pointer; no fixed address requested.
            unsafe {
                sys::cuMemAddressReserve(
                    &mut base,
                    total as usize,
                    pages.page_size() as usize,
                    0,
                    0,
                )
            },
            "cuMemAddressReserve",
        )?;
        opened.base = base;
        opened.size = total;
        let mut offset = 0;
        let mut record = Vec::with_capacity(mappings.len());
        for (mapping, &handle) in mappings.iter().zip(&opened.handles) {
            driver::check(
                // SAFETY: `[base + offset, + size)` lies in the reservation just made and is
                // not mapped; `handle` is an imported allocation of `size` bytes (the driver
                // refuses a size that does not match).
                unsafe { sys::cuMemMap(base + offset, mapping.size as usize, 0, handle, 0) },
                "cuMemMap",
            )?;
            opened.mapped.push((base + offset, mapping.size));
            record.push((offset, mapping.size, handle));
            offset += mapping.size;
        }
        let access = sys::CUmemAccessDesc {
            location: vmm::location(self.ordinal),
            flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
        };
        driver::check(
            // SAFETY: the whole range was just mapped; one valid descriptor.
            unsafe { sys::cuMemSetAccess(base, total as usize, &access, 1) },
            "cuMemSetAccess",
        )?;
        opened.disarm();
        self.imports.lock().insert(
            base,
            Import {
                size: total,
                mappings: record,
            },
        );
        Ok(DevicePtr(base))
    }

    /// The bytes of the import opened at `ptr`, if any.
    pub fn ipc_import_size(&self, ptr: DevicePtr) -> Option<u64> {
        self.imports.lock().get(&ptr.0).map(|import| import.size)
    }

    /// Closes the import opened at `ptr`: synchronises the device (the receiver's work on
    /// it must be done), unmaps, releases and frees the address range.
    pub fn ipc_close(&self, ptr: DevicePtr) -> Result<(), IpcError> {
        let import = self
            .imports
            .lock()
            .remove(&ptr.0)
            .ok_or(IpcError::UnknownImport {
                ptr: ptr.0,
                ordinal: self.ordinal,
            })?;
        let _ctx = self.enter()?;
        // SAFETY: the primary context is current.
        driver::check(unsafe { sys::cuCtxSynchronize() }, "cuCtxSynchronize")?;
        let mut first_error = None;
        for &(offset, size, handle) in &import.mappings {
            // SAFETY: mapped by `ipc_import` with exactly this length; the device is idle.
            let unmapped = driver::check(
                unsafe { sys::cuMemUnmap(ptr.0 + offset, size as usize) },
                "cuMemUnmap",
            );
            // SAFETY: the import's only reference to the allocation.
            let released = driver::check(unsafe { sys::cuMemRelease(handle) }, "cuMemRelease");
            first_error = first_error.or(unmapped.err()).or(released.err());
        }
        // SAFETY: the reservation made by `ipc_import`, now wholly unmapped.
        let freed = driver::check(
            unsafe { sys::cuMemAddressFree(ptr.0, import.size as usize) },
            "cuMemAddressFree",
        );
        match first_error.or(freed.err()) {
            Some(err) => Err(err.into()),
            None => Ok(()),
        }
    }
}

impl IpcBackend for CudaBackend {
    fn ipc_export(&self, ptr: DevicePtr, size: u64) -> Result<Vec<ExportedMapping>, IpcError> {
        CudaBackend::ipc_export(self, ptr, size)
    }
    fn ipc_import(&self, pid: i32, mappings: &[ForeignMapping]) -> Result<DevicePtr, IpcError> {
        CudaBackend::ipc_import(self, pid, mappings)
    }
    fn ipc_import_size(&self, ptr: DevicePtr) -> Option<u64> {
        CudaBackend::ipc_import_size(self, ptr)
    }
    fn ipc_close(&self, ptr: DevicePtr) -> Result<(), IpcError> {
        CudaBackend::ipc_close(self, ptr)
    }
}

/// What a failed import must undo, undone on drop unless disarmed.
struct Opened {
    handles: Vec<sys::CUmemGenericAllocationHandle>,
    base: sys::CUdeviceptr,
    size: u64,
    mapped: Vec<(u64, u64)>,
}

impl Opened {
    fn disarm(&mut self) {
        self.handles.clear();
        self.mapped.clear();
        self.base = 0;
    }
}

impl Drop for Opened {
    fn drop(&mut self) {
        // Best effort: the first error is what the caller reports. Nothing was handed out,
        // so no work can be using these mappings.
        for &(address, size) in &self.mapped {
            // SAFETY: mapped by the failed import, never handed out.
            unsafe { sys::cuMemUnmap(address, size as usize) };
        }
        for &handle in &self.handles {
            // SAFETY: imported by the failed import; its mapping (if any) is gone.
            unsafe { sys::cuMemRelease(handle) };
        }
        if self.base != 0 {
            // SAFETY: the reservation of the failed import, with nothing mapped.
            unsafe { sys::cuMemAddressFree(self.base, self.size as usize) };
        }
    }
}

/// `pidfd_open` and `pidfd_getfd` (Linux 5.6), called through libc's `syscall` (libc has no
/// wrappers for them).
mod os {
    use super::IpcError;
    use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

    /// A system call that takes two integers and a zero flags word and returns a new
    /// descriptor, or errno.
    fn descriptor_syscall(
        number: libc::c_long,
        a: libc::c_long,
        b: libc::c_long,
    ) -> Result<OwnedFd, i32> {
        // SAFETY: both system calls take integer arguments only (the trailing flags are 0)
        // and return a new descriptor or -1 with errno set.
        let ret = unsafe { libc::syscall(number, a, b, 0 as libc::c_long) };
        if ret < 0 {
            return Err(std::io::Error::last_os_error().raw_os_error().unwrap_or(0));
        }
        // SAFETY: a fresh descriptor this process now owns.
        Ok(unsafe { OwnedFd::from_raw_fd(ret as i32) })
    }

    fn failure(call: &'static str, errno: i32) -> IpcError {
        let text = std::io::Error::from_raw_os_error(errno).to_string();
        let hint = match errno {
            libc::ENOSYS => " (the kernel lacks it: Linux 5.6 or later is needed to import expandable-segment memory)",
            libc::EPERM => " (no ptrace access to the sending process: kernel.yama.ptrace_scope, CAP_SYS_PTRACE or a container's seccomp profile denies it)",
            libc::ESRCH => " (the sending process has exited)",
            libc::EBADF => " (the sender no longer has that descriptor: its memory was released)",
            _ => "",
        };
        IpcError::Os {
            call,
            errno,
            message: format!("{text}{hint}"),
        }
    }

    pub(super) fn pidfd_open(pid: i32) -> Result<OwnedFd, IpcError> {
        descriptor_syscall(libc::SYS_pidfd_open, pid.into(), 0)
            .map_err(|e| failure("pidfd_open", e))
    }

    pub(super) fn pidfd_getfd(pidfd: &OwnedFd, target: i32) -> Result<OwnedFd, IpcError> {
        descriptor_syscall(
            libc::SYS_pidfd_getfd,
            pidfd.as_raw_fd().into(),
            target.into(),
        )
        .map_err(|e| failure("pidfd_getfd", e))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pidfd_errors_are_typed() {
        // pid 0 is refused by pidfd_open (EINVAL), or ENOSYS on old kernels: an error
        // either way, never a descriptor.
        match os::pidfd_open(0) {
            Err(IpcError::Os {
                call: "pidfd_open", ..
            }) => {}
            other => panic!("expected an OS error, got {other:?}"),
        }
    }

    #[test]
    fn pidfd_copies_a_descriptor_out_of_a_process() {
        // This process is its own sender: no ptrace permission is involved.
        let file = std::fs::File::open("/proc/self/stat").unwrap();
        let pidfd = match os::pidfd_open(std::process::id() as i32) {
            Ok(pidfd) => pidfd,
            Err(err) => return eprintln!("skipped: {err}"),
        };
        match os::pidfd_getfd(&pidfd, file.as_raw_fd()) {
            Ok(copy) => assert_ne!(copy.as_raw_fd(), file.as_raw_fd()),
            Err(err) => eprintln!("skipped: {err}"),
        }
        match os::pidfd_getfd(&pidfd, -1) {
            Err(IpcError::Os {
                call: "pidfd_getfd",
                ..
            }) => {}
            other => panic!("expected an OS error, got {other:?}"),
        }
    }
}
