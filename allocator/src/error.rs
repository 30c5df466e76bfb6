//! Every way the engine can fail, as typed errors (`thiserror`).
//!
//! The C ABI turns these into a null pointer plus `streamalloc_last_error()`, so each
//! message is written to be read by a user who only sees that string.

use crate::types::{DevicePtr, PoolId, StreamId};

/// A failure reported by a [`crate::Backend`] (the CUDA driver or the simulator).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{operation} failed: {message}")]
pub struct BackendError {
    /// The backend call that failed, e.g. `cuMemAlloc`.
    pub operation: &'static str,
    /// What the backend said.
    pub message: String,
    /// True when the failure is the device being out of memory, which the allocator
    /// answers by freeing cached memory and retrying.
    pub out_of_memory: bool,
}

impl BackendError {
    /// A failure that is not an out-of-memory condition.
    pub fn new(operation: &'static str, message: impl Into<String>) -> Self {
        Self {
            operation,
            message: message.into(),
            out_of_memory: false,
        }
    }

    /// The device had no memory left for `operation`.
    pub fn out_of_memory(operation: &'static str, message: impl Into<String>) -> Self {
        Self {
            operation,
            message: message.into(),
            out_of_memory: true,
        }
    }
}

/// What the allocator knew when it gave up on a request: enough to tell fragmentation
/// (much cached, small largest block) from a real shortage (little cached).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OutOfMemory {
    /// Bytes the caller asked for.
    pub requested: u64,
    /// The stream that asked.
    pub stream: StreamId,
    /// Bytes cached in free blocks, all streams together.
    pub free_cached: u64,
    /// The largest single free block.
    pub largest_free_block: u64,
    /// Bytes obtained from the device and not yet returned.
    pub reserved: u64,
    /// Bytes handed out to callers.
    pub allocated: u64,
    /// The configured limit, if any.
    pub limit: Option<u64>,
    /// Expandable segments were in use (they map memory where a request needs it, so
    /// scattered free memory hurts them far less).
    pub expandable: bool,
    /// Bytes of live allocations made of pages stitched from several holes (see
    /// `pool::stitch`): memory fragmentation would otherwise have stranded.
    pub stitched: u64,
    /// Bytes of free cached memory in partly used mappings (a page under a memory limit, a
    /// piece of up to 128 MiB otherwise), which neither a stitch nor an unmap can take
    /// (only with expandable segments; 0 otherwise).
    pub stranded: u64,
    /// Of `stranded`, the free whole pages: they lie in pieces that a live block shares,
    /// which one physical allocation per page (`page_allocations:true`, or a memory limit)
    /// would have left free to unmap or stitch.
    pub pinned_in_pieces: u64,
    /// Bytes growing for the request would have reserved: the request in whole pages (or
    /// the segment it needs).
    pub growth: u64,
}

impl OutOfMemory {
    /// Reserved bytes that are free but could not serve the request: the cost of
    /// fragmentation at the moment of failure (cached memory is released before giving
    /// up, so what is left lies in segments or mappings that live blocks keep).
    pub fn fragmented(&self) -> u64 {
        self.free_cached
    }

    /// What would help, in one clause.
    pub fn advice(&self) -> String {
        use crate::config::format_bytes as b;
        let frag = self.fragmented();
        if frag > 0 && !self.expandable {
            format!(
                "{} of reserved memory is free but fragmented; STREAMALLOC_CONF=expandable_segments:true \
                 maps memory where requests need it",
                b(frag)
            )
        } else if frag >= self.requested {
            format!(
                "{} of reserved memory is free but fragmented (pinned by live blocks, other streams' \
                 pending work or memory pools)",
                b(frag)
            )
        } else if self
            .limit
            .is_some_and(|limit| self.reserved + self.growth.max(self.requested) > limit)
        {
            "the memory limit is reached (raise memory_limit or memory_fraction)".to_string()
        } else if self.pinned_in_pieces > 0 && self.limit.is_none() {
            format!(
                "the device is full: live tensors hold {}, and {} of free pages lie in pieces \
                 that live blocks share; STREAMALLOC_CONF=page_allocations:true maps every page \
                 alone",
                b(self.allocated),
                b(self.pinned_in_pieces)
            )
        } else {
            format!(
                "the device is full: live tensors hold {}",
                b(self.allocated)
            )
        }
    }
}

impl std::fmt::Display for OutOfMemory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        use crate::config::format_bytes as b;
        write!(
            f,
            "out of memory: tried to allocate {} on {}; {} free in cache (largest free block {}, \
             {} stranded in partly used mappings), {} reserved, {} allocated ({} of it stitched \
             from scattered pages), limit {}; {}",
            b(self.requested),
            self.stream,
            b(self.free_cached),
            b(self.largest_free_block),
            b(self.stranded),
            b(self.reserved),
            b(self.allocated),
            b(self.stitched),
            self.limit.map_or_else(|| "none".to_string(), b),
            self.advice(),
        )
    }
}

/// An error from the allocator's public API.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum AllocError {
    /// The request cannot be served even after freeing every cached block. Boxed: the
    /// report is large, and every successful malloc returns a `Result` of this type.
    #[error("{0}")]
    OutOfMemory(Box<OutOfMemory>),
    /// `free` or `record_use` named a pointer this allocator did not hand out, or that
    /// was already freed.
    #[error("unknown pointer {0}: not allocated by streamalloc, or already freed")]
    UnknownPointer(DevicePtr),
    /// A request of zero bytes or beyond what a device can address.
    #[error("invalid allocation size {0}")]
    InvalidSize(u64),
    /// The stream is being captured into a CUDA graph and the only blocks available
    /// would need an event query or a cross-stream wait, which capture forbids.
    #[error(
        "stream {0} is capturing a CUDA graph and no block is free on it; \
         growing the pool during capture is refused (allocate outside the capture, or warm it up first)"
    )]
    CaptureForbidsGrowth(StreamId),
    /// An allocation or pool call named a pool that does not exist, or whose uses were all
    /// released.
    #[error("{0} does not exist or was released; create it (or add a use) first")]
    UnknownPool(PoolId),
    /// A call the default pool does not take (it always exists and is never released).
    #[error("the default pool cannot be {0}")]
    DefaultPool(&'static str),
    /// A pool's rules (how it grows, whether it splits) are set before it allocates.
    #[error("{pool} already holds memory; {rule} must be set before the pool allocates")]
    PoolHoldsMemory {
        /// The pool.
        pool: PoolId,
        /// The rule asked for.
        rule: &'static str,
    },
    /// A pool checkpoint cannot be restored (nothing was changed).
    #[error("cannot restore {pool}: {reason}")]
    Checkpoint {
        /// The pool.
        pool: PoolId,
        /// Why.
        reason: String,
    },
    /// An allocation named a memory pool whose tag is asleep.
    #[error(
        "cannot allocate {} in memory pool {tag:?}: it is asleep (wake it first)",
        crate::config::format_bytes(*.size)
    )]
    PoolAsleep {
        /// The pool's tag.
        tag: String,
        /// Bytes asked for.
        size: u64,
    },
    /// A tag, sleep or wake call was refused (nothing changed), or failed part way
    /// (boxed: the other variants stay small).
    #[error(transparent)]
    Sleep(Box<SleepError>),
    /// The backend failed.
    #[error(transparent)]
    Backend(#[from] BackendError),
}

impl From<SleepError> for AllocError {
    fn from(err: SleepError) -> Self {
        AllocError::Sleep(Box::new(err))
    }
}

/// Why tagging a memory pool, putting it to sleep or waking it failed. Refusals change
/// nothing; [`SleepError::PartWay`] says what was done.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SleepError {
    /// No memory pool carries this tag.
    #[error("no memory pool is tagged {tag:?} (tags: {})", list(.known))]
    UnknownTag {
        /// The tag asked for.
        tag: String,
        /// Every tag there is.
        known: Vec<String>,
    },
    /// Sleep of a tag that is asleep.
    #[error("memory pool {0:?} is already asleep")]
    AlreadyAsleep(String),
    /// Wake of a tag that is awake.
    #[error("memory pool {0:?} is not asleep: nothing to wake")]
    NotAsleep(String),
    /// Releasing the backup of a sleeping tag, which holds its contents.
    #[error("memory pool {0:?} is asleep and its host backup holds its contents: wake it first")]
    BackupInUse(String),
    /// A name that cannot be a tag.
    #[error(
        "invalid tag {0:?}: a tag is 1 to {max} bytes with no control characters",
        max = crate::pool::sleep::MAX_TAG_LEN
    )]
    BadTag(String),
    /// The tag already names another pool.
    #[error("tag {tag:?} already names {pool}")]
    TagTaken {
        /// The tag.
        tag: String,
        /// The pool it names.
        pool: PoolId,
    },
    /// The pool already carries another tag.
    #[error("{pool} is already tagged {tag:?}")]
    PoolTagged {
        /// The pool.
        pool: PoolId,
        /// Its tag.
        tag: String,
    },
    /// The allocator uses whole segments.
    #[error(
        "sleeping memory needs expandable_segments:true: whole segments cannot give their \
         memory back and keep their addresses"
    )]
    NeedsExpandableSegments,
    /// Memory pools are switched off.
    #[error("tags need graph_pools:true: with memory pools off every allocation shares the default pool")]
    NeedsGraphPools,
    /// A pool is being allocated to.
    #[error(
        "cannot sleep or wake while memory is being allocated to a pool (a CUDA graph \
         capture, or a use_mem_pool or region block, is open)"
    )]
    CaptureUnderway,
    /// The pool holds stitched ranges, made before it was tagged.
    #[error(
        "memory pool {tag:?} holds {count} stitched ranges made before it was tagged: free \
         them first, or run with stitch:false"
    )]
    Stitched {
        /// The pool's tag.
        tag: String,
        /// Its live stitched ranges.
        count: usize,
    },
    /// The pool holds whole segments (`MemPool(allocator=...)`).
    #[error(
        "memory pool {tag:?} holds whole segments (from its own allocator), which cannot \
         give their memory back and keep their addresses"
    )]
    WholeSegments {
        /// The pool's tag.
        tag: String,
    },
    /// Waking found no room: nothing was mapped, the tags stay asleep.
    #[error("cannot wake {tags}: {} do not fit ({why})", crate::config::format_bytes(*.bytes))]
    NoRoom {
        /// The tags, quoted and joined.
        tags: String,
        /// Bytes to map.
        bytes: u64,
        /// What refused.
        why: String,
    },
    /// The driver failed after part of the work was done: `done` bytes of `tag` were
    /// unmapped (sleeping: the tag is asleep with them, wake maps them again) or its
    /// contents could not all be restored (waking: the tag is awake).
    #[error("{what} memory pool {tag:?} failed part way ({} done): {source}", crate::config::format_bytes(*.done))]
    PartWay {
        /// `"sleeping"` or `"restoring"`.
        what: &'static str,
        /// The tag.
        tag: String,
        /// Bytes done.
        done: u64,
        /// The driver's failure.
        source: BackendError,
    },
    /// A sleep or wake with no tag.
    #[error("no tags given")]
    NoTags,
}

/// `"a", "b"`, or `none`.
fn list(names: &[String]) -> String {
    if names.is_empty() {
        return "none".into();
    }
    names
        .iter()
        .map(|n| format!("{n:?}"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// Configuration errors belong to the configuration (`crate::config`); re-exported here
/// with every other error type.
pub use crate::config::ConfigError;
