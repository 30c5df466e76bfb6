//! Small helpers with no better home.

use std::hash::{BuildHasherDefault, Hasher};

/// A hasher for device addresses and stream handles: one multiply and a fold. Addresses
/// are 512-byte aligned, so the fold brings high, well-mixed bits down to where the hash
/// table indexes. SipHash would cost more than the rest of the fast path.
#[derive(Default, Clone, Copy, Debug)]
pub(crate) struct AddrHasher(u64);

impl Hasher for AddrHasher {
    #[inline]
    fn finish(&self) -> u64 {
        self.0
    }

    #[inline]
    fn write(&mut self, bytes: &[u8]) {
        for byte in bytes {
            self.write_u64(u64::from(*byte) ^ self.0.rotate_left(8));
        }
    }

    #[inline]
    fn write_u64(&mut self, value: u64) {
        let mixed = (value ^ self.0).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        self.0 = mixed ^ (mixed >> 29);
    }
}

/// `BuildHasher` for [`AddrHasher`].
pub(crate) type BuildAddrHasher = BuildHasherDefault<AddrHasher>;
