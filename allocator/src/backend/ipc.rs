//! CUDA IPC of mapped memory, as a backend offers it: exporting the physical allocations
//! behind a range as descriptors another process can import, importing another process's
//! allocations back to back into fresh address space, and closing an import.
//!
//! This is no allocation policy, so it is not part of [`Backend`](super::Backend): the C
//! ABI's IPC calls (`streamalloc_ipc_*`) reach it through [`IpcBackend`], which the CUDA
//! backend implements with POSIX file descriptors (`cuda::ipc`) and the simulator with
//! descriptors of its own, mapped to its physical pages so that the race detector sees
//! the sender's and the receiver's accesses to one byte as accesses to one byte.
//!
//! Only whole allocations travel: an export covers the allocations that back a range
//! (a stitched range is exported as its sources, each page its own allocation, since a
//! second mapping has no allocation of its own), and an import maps each allocation whole,
//! in the order given.

use crate::error::BackendError;
use crate::types::DevicePtr;

/// Most mappings one import may name (a 128 MiB mapping each would be 128 TiB; a hostile
/// count is refused before any work).
pub const MAX_IMPORT_MAPPINGS: usize = 1 << 20;

/// One exported allocation: where it is mapped in the exporting process, its bytes, and
/// its descriptor, a number valid in the exporting process only.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExportedMapping {
    /// First byte of the allocation's mapping in the exporting process.
    pub address: u64,
    /// Bytes (a multiple of the allocation granularity).
    pub size: u64,
    /// The descriptor, owned by the exporter and open until the mapping is unmapped.
    pub fd: i32,
}

/// One allocation of another process to import: its bytes and its descriptor's number in
/// that process. Allocations are mapped back to back, in the order given.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ForeignMapping {
    /// Bytes.
    pub size: u64,
    /// The descriptor's number in the sending process.
    pub fd: i32,
}

/// Why an IPC export, import or close failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum IpcError {
    /// The device cannot export allocations as POSIX file descriptors.
    #[error(
        "CUDA device {ordinal} cannot export memory as POSIX file descriptors \
         (CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED is 0), so its \
         expandable-segment memory cannot be shared between processes; use \
         STREAMALLOC_CONF=expandable_segments:false in processes that send CUDA tensors"
    )]
    Unsupported {
        /// The device.
        ordinal: i32,
    },
    /// The device has no virtual memory management (no expandable segments either).
    #[error("CUDA device {ordinal} does not support virtual memory management")]
    NoVirtualMemory {
        /// The device.
        ordinal: i32,
    },
    /// The range is not covered by whole allocations mapped there first (a second mapping,
    /// as a stitched range's, has no allocation of its own to export).
    #[error("[{ptr:#x}, +{size} bytes) is not covered by mapped pages of an expandable segment")]
    NotMapped {
        /// First byte asked for.
        ptr: u64,
        /// Bytes asked for.
        size: u64,
    },
    /// A driver call failed.
    #[error(transparent)]
    Driver(#[from] BackendError),
    /// A system call failed.
    #[error("{call} failed: {message}")]
    Os {
        /// The system call.
        call: &'static str,
        /// `errno`.
        errno: i32,
        /// What it means here.
        message: String,
    },
    /// The mappings to import are ill-formed (sizes, count).
    #[error("invalid IPC import: {0}")]
    Invalid(String),
    /// `ipc_close` of an address no import returned.
    #[error("{ptr:#x} is not an address opened by an IPC import on CUDA device {ordinal}")]
    UnknownImport {
        /// The address given.
        ptr: u64,
        /// The device asked.
        ordinal: i32,
    },
}

/// CUDA IPC of mapped memory (see the module docs).
pub trait IpcBackend {
    /// The allocations backing `[ptr, ptr + size)`, mapped there first, in address order,
    /// each with its descriptor (made on first export, open until its mapping goes).
    fn ipc_export(&self, ptr: DevicePtr, size: u64) -> Result<Vec<ExportedMapping>, IpcError>;

    /// Imports process `pid`'s allocations, back to back, into fresh address space of this
    /// device and returns its first byte; readable and writable by the device. On failure
    /// nothing stays imported or mapped.
    fn ipc_import(&self, pid: i32, mappings: &[ForeignMapping]) -> Result<DevicePtr, IpcError>;

    /// The bytes of the import opened at `ptr`, if any.
    fn ipc_import_size(&self, ptr: DevicePtr) -> Option<u64>;

    /// Closes the import opened at `ptr`: waits for the device (the receiver's work on it
    /// must be done: unmapping does not wait), unmaps and releases it.
    fn ipc_close(&self, ptr: DevicePtr) -> Result<(), IpcError>;
}

/// Checks the allocations of an import against the device's `granularity` and returns
/// their total bytes.
pub fn check_import(mappings: &[ForeignMapping], granularity: u64) -> Result<u64, IpcError> {
    if mappings.is_empty() || mappings.len() > MAX_IMPORT_MAPPINGS {
        return Err(IpcError::Invalid(format!(
            "{} mappings (1..={MAX_IMPORT_MAPPINGS} expected)",
            mappings.len()
        )));
    }
    let mut total: u64 = 0;
    for (i, mapping) in mappings.iter().enumerate() {
        if mapping.size == 0 || granularity == 0 || !mapping.size.is_multiple_of(granularity) {
            return Err(IpcError::Invalid(format!(
                "mapping {i} has {} bytes, not a positive multiple of the {granularity}-byte granularity",
                mapping.size
            )));
        }
        if mapping.fd < 0 {
            return Err(IpcError::Invalid(format!(
                "mapping {i} names descriptor {}",
                mapping.fd
            )));
        }
        total = total
            .checked_add(mapping.size)
            .filter(|&t| t <= isize::MAX as u64)
            .ok_or_else(|| IpcError::Invalid("the mappings' sizes overflow".to_string()))?;
    }
    Ok(total)
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB2: u64 = 2 << 20;

    #[test]
    fn import_checks_sizes_before_any_work() {
        let ok = [
            ForeignMapping { size: MIB2, fd: 3 },
            ForeignMapping {
                size: 64 * MIB2,
                fd: 4,
            },
        ];
        assert_eq!(check_import(&ok, MIB2).unwrap(), 65 * MIB2);
        assert!(matches!(check_import(&[], MIB2), Err(IpcError::Invalid(_))));
        let odd = [ForeignMapping {
            size: MIB2 + 1,
            fd: 3,
        }];
        assert!(matches!(
            check_import(&odd, MIB2),
            Err(IpcError::Invalid(_))
        ));
        let zero = [ForeignMapping { size: 0, fd: 3 }];
        assert!(matches!(
            check_import(&zero, MIB2),
            Err(IpcError::Invalid(_))
        ));
        let negative = [ForeignMapping { size: MIB2, fd: -1 }];
        assert!(matches!(
            check_import(&negative, MIB2),
            Err(IpcError::Invalid(_))
        ));
        let huge = [
            ForeignMapping {
                size: u64::MAX - MIB2 + 1,
                fd: 3,
            },
            ForeignMapping { size: MIB2, fd: 4 },
        ];
        assert!(matches!(
            check_import(&huge, MIB2),
            Err(IpcError::Invalid(_))
        ));
    }
}
