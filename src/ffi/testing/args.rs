//! Reading a program's hostile arguments out of its bytes: device numbers that exist, do
//! not or cannot, sizes from 0 to beyond any device, bogus streams, pools, and pointers
//! live, freed, interior or foreign.

use super::{Harness, DEVICES};
use std::ffi::{c_int, c_void};

/// Reads the program's bytes; past the end, every read is 0.
pub(super) struct Reader<'a> {
    pub(super) bytes: &'a [u8],
    pub(super) at: usize,
}

impl Reader<'_> {
    pub(super) fn done(&self) -> bool {
        self.at >= self.bytes.len()
    }

    pub(super) fn u8(&mut self) -> u8 {
        let byte = self.bytes.get(self.at).copied().unwrap_or(0);
        self.at += 1;
        byte
    }

    pub(super) fn u64(&mut self) -> u64 {
        (0..8).fold(0, |word, _| (word << 8) | u64::from(self.u8()))
    }

    pub(super) fn below(&mut self, n: usize) -> usize {
        usize::from(self.u8()) % n
    }
}

impl Harness {
    pub(super) fn device(&self, r: &mut Reader<'_>) -> c_int {
        DEVICES[r.below(DEVICES.len())]
    }

    pub(super) fn size(&self, r: &mut Reader<'_>) -> usize {
        match r.below(8) {
            0 => 0,
            1 => 1 + r.u8() as usize * 16,
            2 | 3 => 1 + (r.u64() as usize % (4 << 20)),
            4 => (1 + r.below(64)) << 20,
            5 => (1 + r.below(4)) << 30,
            6 => usize::MAX - r.u8() as usize,
            _ => (1usize << 40) + r.u8() as usize,
        }
    }

    pub(super) fn stream(&self, r: &mut Reader<'_>) -> *mut c_void {
        let id = match r.below(6) {
            0 => 0,
            1..=3 => r.below(4) as u64 + 1,
            4 => u64::MAX,
            _ => r.u64(),
        };
        id as usize as *mut c_void
    }

    pub(super) fn pool(&self, r: &mut Reader<'_>) -> (u64, u64) {
        match r.below(6) {
            0 => (0, 0),
            1 | 2 => (1, 0),
            3 => (0, 2),
            4 => (u64::MAX, u64::MAX),
            _ => (u64::from(r.u8()), u64::from(r.u8())),
        }
    }

    pub(super) fn pointer(&self, r: &mut Reader<'_>) -> u64 {
        let pick = r.below(8);
        let nth = r.u8() as usize;
        match pick {
            0..=3 if !self.live.is_empty() => *self.live.keys().nth(nth % self.live.len()).unwrap(),
            4 if !self.dead.is_empty() => self.dead[nth % self.dead.len()],
            6 if !self.live.is_empty() => {
                self.live.keys().nth(nth % self.live.len()).unwrap() + 1 + r.u8() as u64
            }
            7 => r.u64(),
            5 => 0,
            _ => 0x1000,
        }
    }
}
