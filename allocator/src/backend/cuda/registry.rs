//! The process-wide allocators, one per CUDA device, shared by every in-process user.
//!
//! A C ABI (PyTorch's pluggable hook, the LD_PRELOAD interposer, a C program) names a
//! device by ordinal on every call, so the lookup must cost nothing: a fixed array of
//! [`OnceLock`]s indexed by ordinal, each filled on first use with an
//! [`Allocator<CudaBackend>`] built from the configuration read once from
//! `STREAMALLOC_CONF`. After the first call for a device, a lookup is one bounds check and
//! one atomic load; no allocation, no lock, no formatting.
//!
//! A device whose set-up failed (no driver, bad configuration) keeps its error: every
//! later call gets the same [`RegistryError`] without retrying.
//!
//! Calls that do not name a device (`record_stream`) or name the wrong one (a free with
//! another device current) are resolved by asking each initialised allocator in turn; a
//! process typically has one.

use super::{CudaBackend, CudaError};
use crate::config::Config;
use crate::error::{AllocError, ConfigError};
use crate::types::{DevicePtr, StreamId};
use crate::Allocator;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;

/// Device ordinals the registry can hold (`0..MAX_DEVICES`).
pub const MAX_DEVICES: usize = 64;

/// The allocator of one CUDA device.
pub type CudaAllocator = Allocator<CudaBackend>;

/// Why a device's allocator is unavailable.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum RegistryError {
    /// The ordinal is negative or beyond [`MAX_DEVICES`].
    #[error("device index {0} is out of range 0..{MAX_DEVICES}")]
    BadOrdinal(i32),
    /// `STREAMALLOC_CONF` does not parse.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// The driver or device could not be set up.
    #[error(transparent)]
    Cuda(#[from] CudaError),
    /// The allocator refused the configuration (e.g. resolving `memory_fraction`).
    #[error("creating the allocator failed: {0}")]
    Alloc(#[from] AllocError),
}

/// Where a free went. See [`Registry::free`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Freed {
    /// The named device's allocator owned the pointer.
    Here,
    /// Another device's allocator owned it (the caller named the wrong device).
    OnDevice(i32),
}

/// One allocator per device, created on first use. See the module docs.
#[derive(Debug)]
pub struct Registry {
    config: OnceLock<Result<Config, ConfigError>>,
    devices: [OnceLock<Result<CudaAllocator, RegistryError>>; MAX_DEVICES],
    /// Frees naming no valid device, or a pointer no allocator knows: counted here as well
    /// as in the named device's `invalid_frees` when that device exists.
    invalid_frees: AtomicU64,
    /// `record_stream` calls on pointers no allocator knows.
    unknown_record_streams: AtomicU64,
}

impl Default for Registry {
    fn default() -> Self {
        Self::new()
    }
}

/// The registry of this process.
pub fn global() -> &'static Registry {
    static GLOBAL: Registry = Registry::new();
    &GLOBAL
}

impl Registry {
    /// An empty registry (tests may build their own; everything else uses [`global`]).
    pub const fn new() -> Self {
        Self {
            config: OnceLock::new(),
            devices: [const { OnceLock::new() }; MAX_DEVICES],
            invalid_frees: AtomicU64::new(0),
            unknown_record_streams: AtomicU64::new(0),
        }
    }

    /// The configuration, parsed from `STREAMALLOC_CONF` on first use.
    pub fn config(&self) -> Result<&Config, &ConfigError> {
        self.config.get_or_init(Config::from_env).as_ref()
    }

    /// Sets the defaults `STREAMALLOC_CONF` is read over, if the configuration was not read
    /// yet (a door whose defaults differ, e.g. the LD_PRELOAD interposer's whole segments).
    /// Returns the configuration in force.
    pub fn config_over(&self, base: Config) -> Result<&Config, &ConfigError> {
        self.config
            .get_or_init(|| Config::from_env_over(base))
            .as_ref()
    }

    /// The allocator of device `ordinal`, created (with the driver loaded and the primary
    /// context retained) on first use.
    #[inline]
    pub fn device(&self, ordinal: i32) -> Result<&CudaAllocator, &RegistryError> {
        static BAD: OnceLock<RegistryError> = OnceLock::new();
        match usize::try_from(ordinal)
            .ok()
            .and_then(|i| self.devices.get(i))
        {
            Some(slot) => slot.get_or_init(|| self.create(ordinal)).as_ref(),
            None => Err(BAD.get_or_init(|| RegistryError::BadOrdinal(ordinal))),
        }
    }

    #[cold]
    fn create(&self, ordinal: i32) -> Result<CudaAllocator, RegistryError> {
        let config = self.config().map_err(Clone::clone)?.clone();
        let backend = CudaBackend::new(ordinal)?;
        let allocator = Allocator::new(backend, config)?;
        tracing::info!(ordinal, "streamalloc allocator ready");
        Ok(allocator)
    }

    /// The allocator of `ordinal` if it was already created successfully; never creates.
    #[inline]
    pub fn get(&self, ordinal: i32) -> Option<&CudaAllocator> {
        let slot = self.devices.get(usize::try_from(ordinal).ok()?)?;
        slot.get()?.as_ref().ok()
    }

    /// Every allocator created so far, with its ordinal.
    pub fn initialized(&self) -> impl Iterator<Item = (i32, &CudaAllocator)> + '_ {
        self.devices
            .iter()
            .enumerate()
            .filter_map(|(i, slot)| Some((i as i32, slot.get()?.as_ref().ok()?)))
    }

    /// Frees `ptr`, which the caller says belongs to device `ordinal`. A pointer unknown
    /// there is looked for on the other devices (a wrong-device free is then served, and
    /// reported as [`Freed::OnDevice`]). A pointer nobody knows is
    /// [`AllocError::UnknownPointer`], counted in the named device's `invalid_frees` and in
    /// [`Registry::invalid_frees`].
    pub fn free(&self, ptr: DevicePtr, ordinal: i32) -> Result<Freed, AllocError> {
        let named = self.get(ordinal);
        if let Some(allocator) = named {
            match allocator.free(ptr) {
                Err(AllocError::UnknownPointer(_)) => {}
                other => return other.map(|()| Freed::Here),
            }
        }
        for (other, allocator) in self.initialized() {
            if other == ordinal {
                continue;
            }
            if allocator.owns(ptr) {
                return allocator.free(ptr).map(|()| Freed::OnDevice(other));
            }
        }
        self.invalid_frees.fetch_add(1, Ordering::Relaxed);
        Err(AllocError::UnknownPointer(ptr))
    }

    /// Records that `stream` uses `ptr` (PyTorch's `record_stream`), on whichever device
    /// owns it. Returns that device.
    pub fn record_use(&self, ptr: DevicePtr, stream: StreamId) -> Result<i32, AllocError> {
        for (ordinal, allocator) in self.initialized() {
            match allocator.record_use(ptr, stream) {
                Err(AllocError::UnknownPointer(_)) => continue,
                other => return other.map(|()| ordinal),
            }
        }
        self.unknown_record_streams.fetch_add(1, Ordering::Relaxed);
        Err(AllocError::UnknownPointer(ptr))
    }

    /// Frees that named no allocator's pointer (see [`Registry::free`]).
    pub fn invalid_frees(&self) -> u64 {
        self.invalid_frees.load(Ordering::Relaxed)
    }

    /// `record_use` calls on pointers no allocator knows.
    pub fn unknown_record_streams(&self) -> u64 {
        self.unknown_record_streams.load(Ordering::Relaxed)
    }
}
