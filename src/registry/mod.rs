//! The allocators of a process, one per device, shared by every door into it.
//!
//! The C ABI (PyTorch's hooks, the native door, a C program), the LD_PRELOAD interposer and
//! in-process Rust callers name a device by ordinal on every call. Which devices exist,
//! which failed to start, which were made unusable by a panic, and where each request's
//! memory comes from (the pool the pluggable door routes to, a pool's segment source, the
//! pools that back the default one at out-of-memory: see [`Device`]) are the process's
//! state, not any backend's and not any door's: so the registry is generic over the
//! engine's [`Backend`], the doors only translate, and the same code runs on simulated
//! devices ([`Registry::simulated`], for tests, `replay` and the fuzz target) and on CUDA
//! ([`global`], the process's `Registry<WithSources<CudaBackend>>`: CUDA, with the pools
//! whose segments come from another allocator, see [`sources`]).
//!
//! | file | what it decides |
//! | --- | --- |
//! | `mod.rs` | which devices exist; frees and `record_stream`, which may name no device |
//! | `device.rs` | one device: poisoning, and a request's way to memory |
//! | `routes.rs` | the pool a pluggable-door request goes to |
//! | `sources.rs` | where a pool's segments come from |
//! | `fallback.rs` | which pools serve the default pool's requests it has no memory for |
//! | `baseline.rs` | where PyTorch's accumulated statistics count from |
//!
//! # Cost
//! A fixed array of [`OnceLock`]s indexed by ordinal, each filled on first use with a
//! [`Device`] built by the registry's backend constructor and the configuration read once
//! (from `STREAMALLOC_CONF` unless given). After the first call for a device, finding it is
//! a bounds check and one atomic load, and [`Device::run`] adds one load of the device's
//! poison flag (never written unless a panic happened); no allocation, no lock, no
//! formatting. A free also loads which devices exist, to know whether it must look beyond
//! the device it names.
//!
//! # Failure
//! A device whose set-up failed (no driver, bad configuration) keeps its error: every later
//! call gets the same [`RegistryError`] without retrying.
//!
//! A panic inside a device's allocator (caught by [`Device::run`]) may leave its state half
//! updated, and the engine's lock does not poison. The device is then **poisoned**: every
//! later call on it fails with [`RegistryError::Poisoned`], naming the first panic, instead
//! of running on that state. Other devices carry on.
//!
//! # Calls that name no device, or the wrong one
//! `record_stream` names no device, and a free may name the wrong one (another device
//! current): both are resolved by asking each device in turn; a process typically has one.
//! A wrong-device free that finds its block is served where the block lives and counted
//! nowhere as invalid. Poisoned devices are not searched.

mod baseline;
mod device;
mod fallback;
mod routes;
pub mod sources;

pub use self::device::{panic_message, Device};

use self::sources::WithSources;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;
use streamalloc_allocator::backend::cuda::CudaBackend;
use streamalloc_allocator::backend::sim::SimBackend;
use streamalloc_allocator::{
    AllocError, Allocation, Allocator, Backend, Config, ConfigError, DevicePtr, PoolId, StreamId,
};

/// Device ordinals a registry can hold (`0..MAX_DEVICES`).
pub const MAX_DEVICES: usize = 64;

/// Creates the backend of a device from its ordinal; the error is a readable reason.
pub type CreateBackend<B> = fn(i32) -> Result<B, String>;

/// The allocator of one CUDA device.
pub type CudaAllocator = Allocator<WithSources<CudaBackend>>;

/// Why a device cannot serve a call.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum RegistryError {
    /// The ordinal is negative or beyond [`MAX_DEVICES`].
    #[error("device index {0} is out of range 0..{MAX_DEVICES}")]
    BadOrdinal(i32),
    /// `STREAMALLOC_CONF` does not parse.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// The device's backend could not be created (e.g. no CUDA driver).
    #[error("{0}")]
    Backend(String),
    /// The allocator refused the configuration (e.g. resolving `memory_fraction`).
    #[error("creating the allocator failed: {0}")]
    Alloc(#[from] AllocError),
    /// A panic inside the device's allocator left its state unknown (see the module docs).
    #[error("device {ordinal} is unusable after an internal panic: {message}")]
    Poisoned {
        /// The device.
        ordinal: i32,
        /// The first panic's message.
        message: String,
    },
}

/// Why a call the registry resolves ([`Registry::free`], [`Registry::record_use`]) failed.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum CallError {
    /// The device cannot serve calls.
    #[error(transparent)]
    Unavailable(#[from] RegistryError),
    /// The engine refused the call.
    #[error(transparent)]
    Engine(#[from] AllocError),
}

/// A call on one device that failed: the device, and why. Displayed as a caller is told:
/// `device N: <why>`, or the poisoning message alone (it names the device).
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("{}", self.describe())]
pub struct DeviceError {
    /// The device named.
    pub ordinal: i32,
    /// Why it failed.
    pub error: CallError,
}

impl DeviceError {
    fn describe(&self) -> String {
        match &self.error {
            CallError::Unavailable(poisoned @ RegistryError::Poisoned { .. }) => {
                poisoned.to_string()
            }
            error => format!("device {}: {error}", self.ordinal),
        }
    }

    /// True when the device itself cannot serve calls (rather than the engine refusing
    /// this one).
    pub fn unavailable(&self) -> bool {
        matches!(self.error, CallError::Unavailable(_))
    }
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
pub struct Registry<B: Backend> {
    create_backend: CreateBackend<B>,
    config: OnceLock<Result<Config, ConfigError>>,
    devices: [OnceLock<Result<Device<B>, RegistryError>>; MAX_DEVICES],
    /// Bit `i` is set once device `i`'s allocator exists: a free needs to look beyond the
    /// device it names only when another device exists.
    live: AtomicU64,
    /// Frees of pointers no allocator knows: counted here as well as in the named device's
    /// `invalid_frees` when that device exists.
    invalid_frees: AtomicU64,
    /// `record_stream` calls on pointers no allocator knows.
    unknown_record_streams: AtomicU64,
}

/// The registry of this process: one CUDA allocator per device.
pub fn global() -> &'static Registry<WithSources<CudaBackend>> {
    static GLOBAL: Registry<WithSources<CudaBackend>> = Registry::new(cuda_backend);
    &GLOBAL
}

fn cuda_backend(ordinal: i32) -> Result<WithSources<CudaBackend>, String> {
    let backend = CudaBackend::new(ordinal).map_err(|err| err.to_string())?;
    Ok(WithSources::new(backend, ordinal))
}

/// Memory of each simulated device of [`Registry::simulated`].
pub const SIMULATED_DEVICE_BYTES: u64 = 1 << 30;

/// A simulated device for `ordinal` of [`SIMULATED_DEVICE_BYTES`], its addresses apart
/// from every other ordinal's (a pointer names one device, as on real GPUs).
pub fn simulated_device(ordinal: i32) -> Result<SimBackend, String> {
    let ordinal = u64::try_from(ordinal).map_err(|_| format!("no simulated device {ordinal}"))?;
    Ok(SimBackend::with_base_address(
        SIMULATED_DEVICE_BYTES,
        0x7f00_0000_0000 + (ordinal << 44),
    ))
}

impl Registry<SimBackend> {
    /// A registry of simulated devices ([`simulated_device`]) running `config`: the C ABI's
    /// code on the simulator, for tests and the fuzz target.
    pub fn simulated(config: Config) -> Self {
        Self::with_config(simulated_device, config)
    }
}

const fn bit(ordinal: i32) -> u64 {
    if ordinal >= 0 && (ordinal as usize) < MAX_DEVICES {
        1 << ordinal
    } else {
        0
    }
}

impl<B: Backend> Registry<B> {
    /// An empty registry whose devices come from `create_backend`, configured from
    /// `STREAMALLOC_CONF` on first use.
    pub const fn new(create_backend: CreateBackend<B>) -> Self {
        Self {
            create_backend,
            config: OnceLock::new(),
            devices: [const { OnceLock::new() }; MAX_DEVICES],
            live: AtomicU64::new(0),
            invalid_frees: AtomicU64::new(0),
            unknown_record_streams: AtomicU64::new(0),
        }
    }

    /// An empty registry whose devices run `config` (the environment is not read).
    pub fn with_config(create_backend: CreateBackend<B>, config: Config) -> Self {
        let registry = Self::new(create_backend);
        let _ = registry.config.set(Ok(config));
        registry
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

    /// Device `ordinal`, created on first use (for CUDA: the driver loaded and the primary
    /// context retained). A poisoned device is returned too: [`Device::run`] refuses it.
    #[inline]
    pub fn device(&self, ordinal: i32) -> Result<&Device<B>, RegistryError> {
        let Some(slot) = usize::try_from(ordinal)
            .ok()
            .and_then(|i| self.devices.get(i))
        else {
            return Err(RegistryError::BadOrdinal(ordinal));
        };
        match slot.get_or_init(|| self.create_contained(ordinal)) {
            Ok(device) => Ok(device),
            Err(err) => Err(err.clone()),
        }
    }

    /// [`Registry::create`] with a panic contained: the device is then unusable, as after
    /// a panic inside its allocator, and no panic leaves the registry.
    #[cold]
    #[inline(never)]
    fn create_contained(&self, ordinal: i32) -> Result<Device<B>, RegistryError> {
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.create(ordinal)))
            .unwrap_or_else(|payload| {
                Err(RegistryError::Poisoned {
                    ordinal,
                    message: panic_message(payload.as_ref()),
                })
            })
    }

    #[cold]
    fn create(&self, ordinal: i32) -> Result<Device<B>, RegistryError> {
        let config = self.config().map_err(Clone::clone)?.clone();
        let backend = (self.create_backend)(ordinal).map_err(RegistryError::Backend)?;
        let allocator = Allocator::new(backend, config)?;
        tracing::info!(ordinal, "streamalloc allocator ready");
        self.live.fetch_or(bit(ordinal), Ordering::AcqRel);
        Ok(Device::new(ordinal, allocator))
    }

    /// Device `ordinal` if its allocator was already created (poisoned or not); never
    /// creates one.
    #[inline]
    pub fn get(&self, ordinal: i32) -> Option<&Device<B>> {
        let slot = self.devices.get(usize::try_from(ordinal).ok()?)?;
        slot.get()?.as_ref().ok()
    }

    /// The device a pointer freed on `ordinal` can only belong to, if there is one: device
    /// `ordinal` when it is the only device created, or, for a negative `ordinal` (a free
    /// that names no device), the only device created. `None` when the pointer's owner
    /// needs looking for ([`Registry::free`]). Never creates a device.
    #[inline]
    pub fn sole_device(&self, ordinal: i32) -> Option<&Device<B>> {
        let live = self.live.load(Ordering::Acquire);
        let only = if ordinal < 0 {
            live.count_ones() == 1
        } else {
            live == bit(ordinal) && live != 0
        };
        if only {
            self.get(live.trailing_zeros() as i32)
        } else {
            None
        }
    }

    /// Every device whose allocator was created, poisoned or not, in ordinal order.
    pub fn initialized(&self) -> impl Iterator<Item = &Device<B>> + '_ {
        self.devices
            .iter()
            .filter_map(|slot| slot.get()?.as_ref().ok())
    }

    /// Runs `body` on device `ordinal` (created on first use); a failure, the device's or
    /// `body`'s, names the device.
    #[inline]
    pub fn on<T>(
        &self,
        ordinal: i32,
        body: impl FnOnce(&Device<B>) -> Result<T, CallError>,
    ) -> Result<T, DeviceError> {
        self.device(ordinal)
            .map_err(CallError::from)
            .and_then(body)
            .map_err(|error| DeviceError { ordinal, error })
    }

    /// Allocates at least `size` bytes on device `ordinal` for `stream`, for a door that
    /// names no pool: see [`Device::malloc`]. The whole way, the device created on first
    /// use: a door's fast path takes [`Registry::get`]'s device first, and comes here only
    /// when there is none.
    #[cold]
    #[inline(never)]
    pub fn malloc(
        &self,
        ordinal: i32,
        size: u64,
        stream: StreamId,
    ) -> Result<Allocation, DeviceError> {
        self.on(ordinal, |device| device.malloc(size, stream))
    }

    /// Allocates at least `size` bytes on device `ordinal` for `stream` in `pool`: see
    /// [`Device::malloc_in`]. The whole way, as [`Registry::malloc`].
    #[cold]
    #[inline(never)]
    pub fn malloc_in(
        &self,
        ordinal: i32,
        size: u64,
        stream: StreamId,
        pool: PoolId,
    ) -> Result<Allocation, DeviceError> {
        self.on(ordinal, |device| device.malloc_in(size, stream, pool))
    }

    /// Frees `ptr`, which the caller says belongs to device `ordinal`. A pointer that is
    /// not the named device's is looked for on the other devices: a wrong-device free is
    /// served there and reported as [`Freed::OnDevice`], and counts as invalid nowhere. A
    /// pointer nobody knows is [`AllocError::UnknownPointer`], counted in the named
    /// device's `invalid_frees` and in [`Registry::invalid_frees`]. A poisoned named device
    /// refuses the call.
    pub fn free(&self, ptr: DevicePtr, ordinal: i32) -> Result<Freed, CallError> {
        let named = self.get(ordinal);
        if let Some(device) = named {
            // With no other device, the pointer is this one's or nobody's: one engine call.
            // Otherwise ask first, so that a block of another device is not counted as an
            // invalid free here.
            let others = self.live.load(Ordering::Acquire) & !bit(ordinal);
            if others == 0 || device.run(|allocator| allocator.owns(ptr))? {
                return self.free_on(device, ptr).map(|()| Freed::Here);
            }
        }
        for device in self.initialized() {
            if device.ordinal() != ordinal && device.run(|a| a.owns(ptr)).unwrap_or(false) {
                return self
                    .free_on(device, ptr)
                    .map(|()| Freed::OnDevice(device.ordinal()));
            }
        }
        match named {
            // Nobody's: the named device's engine counts it, and so does the registry.
            Some(device) => self.free_on(device, ptr).map(|()| Freed::Here),
            None => {
                self.invalid_frees.fetch_add(1, Ordering::Relaxed);
                Err(AllocError::UnknownPointer(ptr).into())
            }
        }
    }

    fn free_on(&self, device: &Device<B>, ptr: DevicePtr) -> Result<(), CallError> {
        match device.run(|allocator| allocator.free(ptr))? {
            Ok(()) => Ok(()),
            Err(err) => {
                if matches!(err, AllocError::UnknownPointer(_)) {
                    self.invalid_frees.fetch_add(1, Ordering::Relaxed);
                }
                Err(err.into())
            }
        }
    }

    /// Records that `stream` uses `ptr` (PyTorch's `record_stream`), on whichever device
    /// owns it. Returns that device.
    pub fn record_use(&self, ptr: DevicePtr, stream: StreamId) -> Result<i32, CallError> {
        for device in self.initialized() {
            match device.run(|allocator| allocator.record_use(ptr, stream)) {
                Ok(Err(AllocError::UnknownPointer(_))) | Err(_) => continue,
                Ok(result) => return result.map(|()| device.ordinal()).map_err(Into::into),
            }
        }
        self.unknown_record_streams.fetch_add(1, Ordering::Relaxed);
        Err(AllocError::UnknownPointer(ptr).into())
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

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    fn two_devices() -> Registry<SimBackend> {
        let whole_segments = Config {
            expandable_segments: false,
            ..Config::default()
        };
        let registry = Registry::simulated(whole_segments);
        registry.device(0).unwrap();
        registry.device(1).unwrap();
        registry
    }

    fn invalid_frees(registry: &Registry<SimBackend>, ordinal: i32) -> u64 {
        let device = registry.get(ordinal).unwrap();
        device.allocator().stats().invalid_frees
    }

    #[test]
    fn a_wrong_device_free_is_served_where_the_block_lives_and_is_no_invalid_free() {
        let registry = two_devices();
        let allocator = registry.get(1).unwrap().allocator();
        let block = allocator.malloc(MIB, StreamId(0)).unwrap();
        assert_eq!(registry.free(block.ptr, 0), Ok(Freed::OnDevice(1)));
        assert!(!allocator.owns(block.ptr));
        assert_eq!(invalid_frees(&registry, 0), 0, "named device");
        assert_eq!(invalid_frees(&registry, 1), 0, "owning device");
        assert_eq!(registry.invalid_frees(), 0);
    }

    #[test]
    fn a_free_nobody_owns_is_counted_on_the_named_device_and_the_registry() {
        let registry = two_devices();
        let allocator = registry.get(0).unwrap().allocator();
        let block = allocator.malloc(MIB, StreamId(0)).unwrap();
        assert_eq!(registry.free(block.ptr, 0), Ok(Freed::Here));
        assert_eq!(
            registry.free(block.ptr, 0),
            Err(CallError::Engine(AllocError::UnknownPointer(block.ptr)))
        );
        assert_eq!(invalid_frees(&registry, 0), 1);
        assert_eq!(invalid_frees(&registry, 1), 0);
        assert_eq!(registry.invalid_frees(), 1);
        // Naming no device: the registry alone counts it.
        assert!(registry.free(block.ptr, -1).is_err());
        assert_eq!(registry.invalid_frees(), 2);
        assert_eq!(invalid_frees(&registry, 0), 1);
    }

    #[test]
    fn simulated_devices_hand_out_disjoint_addresses() {
        let registry = two_devices();
        let a = registry
            .get(0)
            .unwrap()
            .allocator()
            .malloc(MIB, StreamId(0));
        let b = registry
            .get(1)
            .unwrap()
            .allocator()
            .malloc(MIB, StreamId(0));
        assert_ne!(a.unwrap().ptr, b.unwrap().ptr);
    }

    #[test]
    fn bad_ordinals_name_themselves() {
        let registry = Registry::simulated(Config::default());
        assert_eq!(
            registry.device(-3).err(),
            Some(RegistryError::BadOrdinal(-3))
        );
        assert_eq!(
            registry.device(1000).err(),
            Some(RegistryError::BadOrdinal(1000))
        );
    }

    #[test]
    fn a_panic_while_creating_a_device_is_contained_and_makes_it_unusable() {
        fn panicking(_ordinal: i32) -> Result<SimBackend, String> {
            panic!("injected panic creating the backend")
        }
        let registry = Registry::with_config(panicking, Config::default());
        let poisoned = RegistryError::Poisoned {
            ordinal: 2,
            message: "injected panic creating the backend".to_string(),
        };
        assert_eq!(registry.device(2).err(), Some(poisoned.clone()));
        // Created once: a later call is refused without trying again.
        let later = registry.malloc(2, MIB, StreamId(0));
        assert_eq!(
            later.err().map(|err| err.error),
            Some(CallError::Unavailable(poisoned))
        );
    }

    #[test]
    fn a_panic_inside_the_allocator_poisons_its_device_only() {
        let registry = two_devices();
        let device = registry.get(0).unwrap();
        device.allocator().backend().panic_on_next("alloc_segment");
        let poisoned = RegistryError::Poisoned {
            ordinal: 0,
            message: "injected panic in alloc_segment".to_string(),
        };
        let first = device.run(|allocator| allocator.malloc(MIB, StreamId(0)));
        assert_eq!(first.err(), Some(poisoned.clone()));
        // Later calls never reach the engine, even ones that would have worked.
        let reached = std::cell::Cell::new(false);
        let later = device.run(|_| reached.set(true));
        assert_eq!(later.err(), Some(poisoned.clone()));
        assert!(!reached.get());
        assert_eq!(
            registry.free(DevicePtr(0x1000), 0),
            Err(CallError::Unavailable(poisoned))
        );
        // The other device carries on.
        let other = registry.get(1).unwrap();
        assert!(other.run(|a| a.malloc(MIB, StreamId(0))).unwrap().is_ok());
    }
}
