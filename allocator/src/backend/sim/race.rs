//! What the simulator reports: the byte ranges an operation touches, and the rules an
//! operation broke ([`Race`]).

use crate::types::DevicePtr;
use std::fmt;

/// One byte range an operation touches.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Access {
    /// First byte.
    pub ptr: DevicePtr,
    /// Bytes.
    pub len: u64,
    /// True for a write, false for a read.
    pub write: bool,
}

impl Access {
    /// A read of `[ptr, ptr + len)`.
    pub fn read(ptr: DevicePtr, len: u64) -> Self {
        Self {
            ptr,
            len,
            write: false,
        }
    }

    /// A write of `[ptr, ptr + len)`.
    pub fn write(ptr: DevicePtr, len: u64) -> Self {
        Self {
            ptr,
            len,
            write: true,
        }
    }
}

/// A violation found by the simulator.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Race {
    /// The earlier operation ("-" when the violation involves only one).
    pub earlier: String,
    /// The later operation.
    pub later: String,
    /// The bytes concerned.
    pub range: (u64, u64),
    /// What rule was broken.
    pub kind: RaceKind,
}

/// The rule a [`Race`] broke.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RaceKind {
    /// Two conflicting accesses on different streams with no happens-before between them.
    Unordered,
    /// An access to memory outside every live segment.
    OutOfBounds,
    /// A call forbidden while a stream is capturing a graph.
    Capture,
    /// A call naming a stream the program destroyed (on a GPU, a dangling handle: undefined
    /// behaviour, a crash in the driver at best).
    DeadStream,
}

impl fmt::Display for Race {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.kind {
            RaceKind::Unordered => write!(
                f,
                "race on bytes [{:#x}, {:#x}): `{}` does not happen-before `{}`",
                self.range.0, self.range.1, self.earlier, self.later
            ),
            RaceKind::OutOfBounds => write!(
                f,
                "`{}` touches [{:#x}, {:#x}), outside every live segment",
                self.later, self.range.0, self.range.1
            ),
            RaceKind::Capture => write!(f, "during graph capture: {}", self.later),
            RaceKind::DeadStream => write!(f, "{}", self.later),
        }
    }
}
