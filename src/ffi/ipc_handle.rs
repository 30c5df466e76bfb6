//! The handle formats of CUDA IPC of mapped memory: what `streamalloc_ipc_export` writes
//! and `streamalloc_ipc_open` reads, and the handle a sender writes when it could not
//! export (so that the receiver raises the sender's reason instead of waiting).
//!
//! # Handle formats
//! Every one starts like every handle of PyTorch's `CUDACachingAllocator`: a version byte
//! (2) and a type byte, so that a receiver recognises or refuses it by those two bytes.
//!
//! - **PyTorch's `'e'`** (`SHAREABLE_CUDA_EXPANDABLE_SEGMENT`), written whenever every
//!   allocation shared has the same size, which is what it can express: its `ShareHeader`
//!   (`pid_t pid`, 4 zero bytes of padding, `size_t segment_size`, `size_t num_handles`, in
//!   the host's byte order, 24 bytes), then `num_handles` descriptors as `int`. A receiver
//!   running PyTorch's own allocator opens it (`ExpandableSegment::fromShared`), and so
//!   does streamalloc. The padding stays zero, as PyTorch writes it, so one allocation's
//!   handle is byte-identical on every export (receivers cache opened handles by their
//!   bytes). A stitched range (one allocation per page) is always written this way.
//! - **Ours, `'s'`**, for allocations of different sizes (PyTorch's format assumes one
//!   size): `u32 pid`, `u32 0`, `u64 count`, then per allocation `u64 size`, `i32 fd`,
//!   `u32 0`, all little-endian. Only streamalloc opens it; PyTorch's allocator refuses the
//!   unknown type with its own error.
//! - **A failed export, `'x'`**: the sender's reason, UTF-8, at most
//!   [`MAX_FAILURE_MESSAGE`] bytes. The receiver raises it (PyTorch's allocator refuses the
//!   unknown type, raising too): a send whose memory could not be shared never leaves the
//!   receiver waiting for a tensor that will not come.
//!
//! 'e' and 's' give the allocations' sizes and descriptors in the order they appear in
//! the shared range; the receiver maps them back to back, and the export's `offset`
//! locates the allocation from the first byte. PyTorch's fabric-handle variant of `'e'`
//! (64-byte `CUmemFabricHandle`s, on systems with an IMEX channel) is recognised by its
//! length and refused with a clear error.
//!
//! Decoding never trusts the handle: lengths, counts and sizes are checked (against the
//! bytes actually present) before anything is allocated or imported.

use streamalloc_allocator::backend::ipc::{ExportedMapping, ForeignMapping, MAX_IMPORT_MAPPINGS};

/// The version byte PyTorch 2.x writes and accepts.
pub const HANDLE_VERSION: u8 = 2;
/// PyTorch's `SHAREABLE_CUDA_EXPANDABLE_SEGMENT`.
pub const TYPE_TORCH_EXPANDABLE: u8 = b'e';
/// Ours: mappings of any sizes.
pub const TYPE_STREAMALLOC_EXPANDABLE: u8 = b's';
/// Ours: the sender could not export; the message follows.
pub const TYPE_FAILED_EXPORT: u8 = b'x';
/// Most bytes of a failed export's message (longer ones are cut at a character boundary).
pub const MAX_FAILURE_MESSAGE: usize = 1024;

/// PyTorch's `ShareHeader`: `pid_t`, padding, two `size_t`s.
const TORCH_HEADER: usize = 24;
/// A `CUmemFabricHandle`.
const FABRIC_HANDLE: usize = 64;
/// Our header: pid, reserved, count.
const OURS_HEADER: usize = 16;
/// Our per-mapping record: size, fd, reserved.
const OURS_RECORD: usize = 16;
/// Most mappings a handle may name.
const MAX_MAPPINGS: u64 = MAX_IMPORT_MAPPINGS as u64;

/// A decoded handle: the sender and its mappings, in address order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SharedMappings {
    /// The sending process.
    pub pid: i32,
    /// Sizes and the sender's descriptors.
    pub mappings: Vec<ForeignMapping>,
}

/// Why a handle could not be decoded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HandleError {
    /// Too short for its header.
    #[error("IPC handle of {0} bytes is truncated")]
    Truncated(usize),
    /// A version this library does not know.
    #[error("IPC handle version {0} is not supported (version {HANDLE_VERSION} expected)")]
    Version(u8),
    /// Not a handle of mapped memory.
    #[error("IPC handle type {0:#04x} is not a handle of mapped memory ('e', 's' or 'x')")]
    Type(u8),
    /// The sender could not export the memory, and said why.
    #[error("the sending process could not share this memory: {0}")]
    SenderFailed(String),
    /// PyTorch's fabric-handle variant.
    #[error("the IPC handle carries fabric handles (PyTorch with an IMEX channel); streamalloc imports POSIX file descriptors only")]
    Fabric,
    /// The header's counts disagree with the bytes present, or are absurd.
    #[error("ill-formed IPC handle: {0}")]
    Malformed(String),
}

/// Encodes `mappings` (in address order) of process `pid`: PyTorch's `'e'` when every
/// mapping has one size, ours otherwise. See the module docs.
pub fn encode(pid: i32, mappings: &[ExportedMapping]) -> Vec<u8> {
    let uniform = mappings
        .first()
        .is_some_and(|first| mappings.iter().all(|m| m.size == first.size));
    if uniform {
        let mut out = Vec::with_capacity(2 + TORCH_HEADER + 4 * mappings.len());
        out.extend_from_slice(&[HANDLE_VERSION, TYPE_TORCH_EXPANDABLE]);
        out.extend_from_slice(&pid.to_ne_bytes());
        out.extend_from_slice(&[0; 4]);
        out.extend_from_slice(&mappings[0].size.to_ne_bytes());
        out.extend_from_slice(&(mappings.len() as u64).to_ne_bytes());
        for m in mappings {
            out.extend_from_slice(&m.fd.to_ne_bytes());
        }
        out
    } else {
        let mut out = Vec::with_capacity(2 + OURS_HEADER + OURS_RECORD * mappings.len());
        out.extend_from_slice(&[HANDLE_VERSION, TYPE_STREAMALLOC_EXPANDABLE]);
        out.extend_from_slice(&(pid as u32).to_le_bytes());
        out.extend_from_slice(&0u32.to_le_bytes());
        out.extend_from_slice(&(mappings.len() as u64).to_le_bytes());
        for m in mappings {
            out.extend_from_slice(&m.size.to_le_bytes());
            out.extend_from_slice(&m.fd.to_le_bytes());
            out.extend_from_slice(&0u32.to_le_bytes());
        }
        out
    }
}

/// Decodes a handle of either format. See the module docs.
pub fn decode(handle: &[u8]) -> Result<SharedMappings, HandleError> {
    let [version, kind, body @ ..] = handle else {
        return Err(HandleError::Truncated(handle.len()));
    };
    if *version != HANDLE_VERSION {
        return Err(HandleError::Version(*version));
    }
    match *kind {
        TYPE_TORCH_EXPANDABLE => decode_torch(body),
        TYPE_STREAMALLOC_EXPANDABLE => decode_ours(body),
        TYPE_FAILED_EXPORT => Err(HandleError::SenderFailed(
            String::from_utf8_lossy(body).into_owned(),
        )),
        other => Err(HandleError::Type(other)),
    }
}

/// The handle of a failed export: `message`, cut to [`MAX_FAILURE_MESSAGE`] bytes.
pub fn encode_failure(message: &str) -> Vec<u8> {
    let mut end = message.len().min(MAX_FAILURE_MESSAGE);
    while !message.is_char_boundary(end) {
        end -= 1;
    }
    let mut out = Vec::with_capacity(2 + end);
    out.extend_from_slice(&[HANDLE_VERSION, TYPE_FAILED_EXPORT]);
    out.extend_from_slice(&message.as_bytes()[..end]);
    out
}

fn decode_torch(body: &[u8]) -> Result<SharedMappings, HandleError> {
    if body.len() < TORCH_HEADER {
        return Err(HandleError::Truncated(body.len() + 2));
    }
    let pid = i32::from_ne_bytes(array(&body[0..4]));
    let segment_size = u64::from_ne_bytes(array(&body[8..16]));
    let count = u64::from_ne_bytes(array(&body[16..24]));
    let rest = body.len() - TORCH_HEADER;
    check_count(count)?;
    if segment_size == 0 {
        return Err(HandleError::Malformed("segment size 0".to_string()));
    }
    // `count` is at most MAX_MAPPINGS, so these products cannot overflow.
    if rest as u64 == count * FABRIC_HANDLE as u64 {
        return Err(HandleError::Fabric);
    }
    if rest as u64 != count * 4 {
        return Err(HandleError::Malformed(format!(
            "{count} descriptors announced, {rest} bytes follow the header"
        )));
    }
    segment_size
        .checked_mul(count)
        .ok_or_else(|| HandleError::Malformed("the mappings' sizes overflow".to_string()))?;
    let mappings = body[TORCH_HEADER..]
        .chunks_exact(4)
        .map(|fd| ForeignMapping {
            size: segment_size,
            fd: i32::from_ne_bytes(array(fd)),
        })
        .collect();
    Ok(SharedMappings { pid, mappings })
}

fn decode_ours(body: &[u8]) -> Result<SharedMappings, HandleError> {
    if body.len() < OURS_HEADER {
        return Err(HandleError::Truncated(body.len() + 2));
    }
    let pid = u32::from_le_bytes(array(&body[0..4])) as i32;
    let count = u64::from_le_bytes(array(&body[8..16]));
    check_count(count)?;
    let rest = body.len() - OURS_HEADER;
    if rest as u64 != count * OURS_RECORD as u64 {
        return Err(HandleError::Malformed(format!(
            "{count} mappings announced, {rest} bytes follow the header"
        )));
    }
    let mut total: u64 = 0;
    let mut mappings = Vec::with_capacity(count as usize);
    for record in body[OURS_HEADER..].chunks_exact(OURS_RECORD) {
        let size = u64::from_le_bytes(array(&record[0..8]));
        total = total
            .checked_add(size)
            .ok_or_else(|| HandleError::Malformed("the mappings' sizes overflow".to_string()))?;
        mappings.push(ForeignMapping {
            size,
            fd: i32::from_le_bytes(array(&record[8..12])),
        });
    }
    Ok(SharedMappings { pid, mappings })
}

fn check_count(count: u64) -> Result<(), HandleError> {
    if count == 0 || count > MAX_MAPPINGS {
        return Err(HandleError::Malformed(format!(
            "{count} mappings (1..={MAX_MAPPINGS} expected)"
        )));
    }
    Ok(())
}

fn array<const N: usize>(bytes: &[u8]) -> [u8; N] {
    bytes.try_into().expect("caller sliced exactly N bytes")
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB2: u64 = 2 << 20;

    fn exported(sizes: &[u64]) -> Vec<ExportedMapping> {
        let mut address = 0x7f00_0000_0000;
        sizes
            .iter()
            .enumerate()
            .map(|(i, &size)| {
                let m = ExportedMapping {
                    address,
                    size,
                    fd: 40 + i as i32,
                };
                address += size;
                m
            })
            .collect()
    }

    fn foreign(mappings: &[ExportedMapping]) -> Vec<ForeignMapping> {
        mappings
            .iter()
            .map(|m| ForeignMapping {
                size: m.size,
                fd: m.fd,
            })
            .collect()
    }

    #[test]
    fn equal_sizes_use_pytorchs_format_byte_for_byte() {
        let mappings = exported(&[64 * MIB2, 64 * MIB2, 64 * MIB2]);
        let handle = encode(4242, &mappings);
        // What PyTorch's ExpandableSegment::share writes after its version and type bytes.
        let mut expected = vec![2u8, b'e'];
        expected.extend_from_slice(&4242i32.to_ne_bytes());
        expected.extend_from_slice(&[0, 0, 0, 0]);
        expected.extend_from_slice(&(64 * MIB2).to_ne_bytes());
        expected.extend_from_slice(&3u64.to_ne_bytes());
        for fd in [40i32, 41, 42] {
            expected.extend_from_slice(&fd.to_ne_bytes());
        }
        assert_eq!(handle, expected);
        let decoded = decode(&handle).unwrap();
        assert_eq!(decoded.pid, 4242);
        assert_eq!(decoded.mappings, foreign(&mappings));
    }

    #[test]
    fn mixed_sizes_use_ours_and_round_trip() {
        let mappings = exported(&[MIB2, 64 * MIB2, 3 * MIB2]);
        let handle = encode(77, &mappings);
        assert_eq!(&handle[..2], &[2, b's']);
        assert_eq!(handle.len(), 2 + OURS_HEADER + 3 * OURS_RECORD);
        let decoded = decode(&handle).unwrap();
        assert_eq!(decoded.pid, 77);
        assert_eq!(decoded.mappings, foreign(&mappings));
    }

    #[test]
    fn a_single_mapping_is_pytorchs_format() {
        let mappings = exported(&[MIB2]);
        let handle = encode(1, &mappings);
        assert_eq!(handle[1], b'e');
        assert_eq!(decode(&handle).unwrap().mappings, foreign(&mappings));
    }

    #[test]
    fn truncated_handles_are_refused_at_every_length() {
        for handle in [
            encode(5, &exported(&[MIB2, MIB2])),
            encode(5, &exported(&[MIB2, 2 * MIB2])),
        ] {
            for len in 0..handle.len() {
                assert!(
                    decode(&handle[..len]).is_err(),
                    "{len} of {} bytes decoded",
                    handle.len()
                );
            }
            let mut longer = handle.clone();
            longer.push(0);
            assert!(matches!(decode(&longer), Err(HandleError::Malformed(_))));
        }
    }

    #[test]
    fn a_failed_exports_reason_reaches_the_receiver_cut_at_a_character() {
        let handle = encode_failure("device 0: cuMemExportToShareableHandle failed");
        assert_eq!(&handle[..2], &[2, b'x']);
        match decode(&handle) {
            Err(HandleError::SenderFailed(why)) => {
                assert_eq!(why, "device 0: cuMemExportToShareableHandle failed")
            }
            other => panic!("{other:?}"),
        }
        let long = "é".repeat(MAX_FAILURE_MESSAGE);
        let handle = encode_failure(&long);
        assert!(handle.len() <= 2 + MAX_FAILURE_MESSAGE);
        match decode(&handle) {
            Err(HandleError::SenderFailed(why)) => assert!(why.chars().all(|c| c == 'é')),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn wrong_version_and_type_are_refused() {
        let mut handle = encode(5, &exported(&[MIB2]));
        handle[0] = 3;
        assert_eq!(decode(&handle), Err(HandleError::Version(3)));
        handle[0] = 2;
        handle[1] = b'c';
        assert_eq!(decode(&handle), Err(HandleError::Type(b'c')));
        assert_eq!(decode(&[]), Err(HandleError::Truncated(0)));
        assert_eq!(decode(&[2]), Err(HandleError::Truncated(1)));
    }

    #[test]
    fn absurd_counts_and_sizes_are_refused_before_allocating() {
        // PyTorch's format announcing 2^63 descriptors with four bytes present.
        let mut handle = vec![2u8, b'e'];
        handle.extend_from_slice(&1i32.to_ne_bytes());
        handle.extend_from_slice(&[0; 4]);
        handle.extend_from_slice(&MIB2.to_ne_bytes());
        handle.extend_from_slice(&(1u64 << 63).to_ne_bytes());
        handle.extend_from_slice(&3i32.to_ne_bytes());
        assert!(matches!(decode(&handle), Err(HandleError::Malformed(_))));
        // Zero mappings.
        let mut zero = handle.clone();
        zero[18..26].copy_from_slice(&0u64.to_ne_bytes());
        zero.truncate(26);
        assert!(matches!(decode(&zero), Err(HandleError::Malformed(_))));
        // A segment size whose total overflows.
        let mut overflow = handle.clone();
        overflow[10..18].copy_from_slice(&u64::MAX.to_ne_bytes());
        overflow[18..26].copy_from_slice(&2u64.to_ne_bytes());
        overflow.extend_from_slice(&4i32.to_ne_bytes());
        assert!(matches!(decode(&overflow), Err(HandleError::Malformed(_))));
        // A segment size of zero.
        let mut empty = handle.clone();
        empty[10..18].copy_from_slice(&0u64.to_ne_bytes());
        empty[18..26].copy_from_slice(&1u64.to_ne_bytes());
        assert!(matches!(decode(&empty), Err(HandleError::Malformed(_))));
        // Ours announcing u64::MAX mappings.
        let mut ours = encode(5, &exported(&[MIB2, 2 * MIB2]));
        ours[10..18].copy_from_slice(&u64::MAX.to_le_bytes());
        assert!(matches!(decode(&ours), Err(HandleError::Malformed(_))));
        // Ours whose sizes overflow.
        let mut sizes = encode(5, &exported(&[MIB2, 2 * MIB2]));
        sizes[18..26].copy_from_slice(&u64::MAX.to_le_bytes());
        assert!(matches!(decode(&sizes), Err(HandleError::Malformed(_))));
    }

    #[test]
    fn pytorchs_fabric_variant_is_named() {
        let mut handle = vec![2u8, b'e'];
        handle.extend_from_slice(&1i32.to_ne_bytes());
        handle.extend_from_slice(&2i32.to_ne_bytes());
        handle.extend_from_slice(&MIB2.to_ne_bytes());
        handle.extend_from_slice(&2u64.to_ne_bytes());
        handle.extend_from_slice(&[7u8; 2 * FABRIC_HANDLE]);
        assert_eq!(decode(&handle), Err(HandleError::Fabric));
    }

    #[test]
    fn hostile_bytes_never_panic() {
        // A cheap deterministic fuzz: every prefix of varied garbage decodes or errs.
        let mut state = 0x2545_f491_4f6c_dd1du64;
        for _ in 0..2000 {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            let len = (state % 96) as usize;
            let mut bytes: Vec<u8> = (0..len)
                .map(|i| (state.rotate_left(i as u32 % 64) & 0xff) as u8)
                .collect();
            if len >= 2 {
                bytes[0] = 2;
                bytes[1] = [b'e', b's', b'x'][(state % 3) as usize];
            }
            let _ = decode(&bytes);
        }
    }
}
