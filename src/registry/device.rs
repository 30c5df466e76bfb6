//! One device: its allocator, whether a panic made it unusable, and where its requests'
//! memory comes from.
//!
//! # A request's way
//! A request names a device, a stream and, from the native door, a pool. In order:
//! 1. **The route** (`routes`): a request of the pluggable door, which names no pool, goes
//!    to the pool PyTorch is allocating to, if the routing rule says so; otherwise to the
//!    default pool. One atomic load while no pool is being allocated to.
//! 2. **The pool's source** (`sources`): a pool whose segments come from a caller's
//!    allocator has them taken from there while its request runs.
//! 3. **The engine** serves the request in the pool (`Allocator::malloc_in`).
//! 4. **The use_on_oom pools** (`fallback`): the default pool's out-of-memory error is
//!    answered by the first marked pool that can serve the request.
//!
//! Every engine call goes through [`Device::run`], which contains a panic and poisons the
//! device (see the registry's docs).

use super::baseline::Baseline;
use super::fallback::MarkedPools;
use super::routes::Routes;
use super::sources::Sources;
use super::{CallError, RegistryError};
use std::any::Any;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::OnceLock;
use streamalloc_allocator::{
    AllocError, Allocation, Allocator, Backend, DevicePtr, PoolId, StreamId,
};

/// One device's allocator, whether a panic made it unusable, and the rules that say where
/// its requests' memory comes from (see the module docs).
#[derive(Debug)]
pub struct Device<B: Backend> {
    ordinal: i32,
    allocator: Allocator<B>,
    poison: OnceLock<RegistryError>,
    /// Pools the pluggable door is allocating to.
    pub(super) routes: Routes,
    /// Pools whose segments come from a caller's allocator.
    pub(super) sources: Sources,
    /// Pools that back the default pool at out-of-memory.
    pub(super) marked: MarkedPools,
    /// Where PyTorch's accumulated statistics count from.
    pub(super) baseline: Baseline,
}

impl<B: Backend> Device<B> {
    /// Device `ordinal`, served by `allocator`.
    pub(super) fn new(ordinal: i32, allocator: Allocator<B>) -> Self {
        Self {
            ordinal,
            allocator,
            poison: OnceLock::new(),
            routes: Routes::default(),
            sources: Sources::default(),
            marked: MarkedPools::default(),
            baseline: Baseline::default(),
        }
    }

    /// Allocates at least `size` bytes for `stream` for a door that names no pool (PyTorch's
    /// pluggable hook): in the pool the route says, else the default pool (see the module
    /// docs).
    #[inline]
    pub fn malloc(&self, size: u64, stream: StreamId) -> Result<Allocation, CallError> {
        flatten(self.run(|allocator| self.serve_routed(allocator, size, stream)))
    }

    /// Allocates at least `size` bytes for `stream` in `pool` (see the module docs).
    #[inline]
    pub fn malloc_in(
        &self,
        size: u64,
        stream: StreamId,
        pool: PoolId,
    ) -> Result<Allocation, CallError> {
        flatten(self.run(|allocator| self.serve(allocator, size, stream, pool)))
    }

    /// [`Device::malloc`] for a door that needs only the address (the C ABI's fast path): a
    /// failure comes boxed, built only then, so that the answer travels in registers.
    #[inline]
    pub fn malloc_ptr(&self, size: u64, stream: StreamId) -> Result<DevicePtr, Box<CallError>> {
        self.run_boxed(|allocator| {
            self.serve_routed(allocator, size, stream)
                .map(|block| block.ptr)
        })
    }

    /// [`Device::malloc_in`] for a door that needs only the address, as
    /// [`Device::malloc_ptr`].
    #[inline]
    pub fn malloc_in_ptr(
        &self,
        size: u64,
        stream: StreamId,
        pool: PoolId,
    ) -> Result<DevicePtr, Box<CallError>> {
        self.run_boxed(|allocator| {
            self.serve(allocator, size, stream, pool)
                .map(|block| block.ptr)
        })
    }

    /// A request that names no pool, in the pool its route says: step 1 of a request's way,
    /// then [`Device::serve`] (the default pool's code directly when nothing is routed).
    #[inline]
    fn serve_routed(
        &self,
        allocator: &Allocator<B>,
        size: u64,
        stream: StreamId,
    ) -> Result<Allocation, AllocError> {
        match self
            .routes
            .route(|| allocator.backend().is_capturing(stream))?
        {
            None => self.serve_default(allocator, size, stream),
            Some(pool) => self.serve(allocator, size, stream, pool),
        }
    }

    /// Steps 2 to 4 of a request's way. The default pool has no source and, served, needs
    /// no fallback: its request is one engine call, as on the fast path it must be.
    #[inline]
    fn serve(
        &self,
        allocator: &Allocator<B>,
        size: u64,
        stream: StreamId,
        pool: PoolId,
    ) -> Result<Allocation, AllocError> {
        if pool.is_default() {
            return self.serve_default(allocator, size, stream);
        }
        match self.serve_in(allocator, size, stream, pool) {
            Ok(block) => Ok(block),
            Err(err) => self.marked.or_marked(allocator, pool, err, |marked| {
                self.serve_in(allocator, size, stream, marked)
            }),
        }
    }

    /// [`Device::serve`] of the default pool.
    #[inline]
    fn serve_default(
        &self,
        allocator: &Allocator<B>,
        size: u64,
        stream: StreamId,
    ) -> Result<Allocation, AllocError> {
        match allocator.malloc(size, stream) {
            Ok(block) => Ok(block),
            Err(err) => self
                .marked
                .or_marked(allocator, PoolId::DEFAULT, err, |marked| {
                    self.serve_in(allocator, size, stream, marked)
                }),
        }
    }

    /// A request of `pool`, with the pool's segment source active if it has one.
    fn serve_in(
        &self,
        allocator: &Allocator<B>,
        size: u64,
        stream: StreamId,
        pool: PoolId,
    ) -> Result<Allocation, AllocError> {
        self.sources
            .with_source(pool, || allocator.malloc_in(size, stream, pool))
    }

    /// The device's ordinal.
    pub fn ordinal(&self) -> i32 {
        self.ordinal
    }

    /// The allocator, for in-process Rust callers. Unlike [`Device::run`], this neither
    /// checks nor sets the poison flag.
    pub fn allocator(&self) -> &Allocator<B> {
        &self.allocator
    }

    /// Runs `body` on the allocator, unless the device is poisoned. A panic in `body` is
    /// caught and poisons the device; this call and every later one get
    /// [`RegistryError::Poisoned`]. No panic leaves this function, so a C export may call
    /// it outside any other guard.
    #[inline]
    pub fn run<T>(&self, body: impl FnOnce(&Allocator<B>) -> T) -> Result<T, RegistryError> {
        if let Some(poisoned) = self.poison.get() {
            return Err(self.refusal(poisoned));
        }
        catch_unwind(AssertUnwindSafe(|| body(&self.allocator)))
            .map_err(|payload| self.poison_with(payload))
    }

    /// [`Device::run`] of an engine call, both failures as one boxed [`CallError`]: for the
    /// doors' fast paths, whose answer then fits in registers.
    #[inline]
    pub fn run_boxed<T>(
        &self,
        body: impl FnOnce(&Allocator<B>) -> Result<T, AllocError>,
    ) -> Result<T, Box<CallError>> {
        match self.run(|allocator| body(allocator).map_err(boxed_engine_error)) {
            Ok(result) => result,
            Err(refusal) => Err(Box::new(CallError::Unavailable(refusal))),
        }
    }

    /// The error of a call on the poisoned device.
    #[cold]
    #[inline(never)]
    fn refusal(&self, poisoned: &RegistryError) -> RegistryError {
        poisoned.clone()
    }

    /// Poisons the device with the panic `payload` carried; returns the error calls get.
    #[cold]
    #[inline(never)]
    fn poison_with(&self, payload: Box<dyn Any + Send>) -> RegistryError {
        let poison = || {
            let message = panic_message(payload.as_ref());
            self.poison
                .get_or_init(|| {
                    tracing::error!(ordinal = self.ordinal, %message, "streamalloc: device poisoned by a panic");
                    RegistryError::Poisoned {
                        ordinal: self.ordinal,
                        message,
                    }
                })
                .clone()
        };
        // Even a panic while reporting the first one stays here.
        catch_unwind(AssertUnwindSafe(poison)).unwrap_or_else(|_| RegistryError::Poisoned {
            ordinal: self.ordinal,
            message: "a panic while reporting a panic".to_string(),
        })
    }

    /// The error every call gets once a panic made the device unusable, if one did.
    pub fn poisoned(&self) -> Option<&RegistryError> {
        self.poison.get()
    }
}

/// The engine's refusal, boxed.
#[cold]
#[inline(never)]
fn boxed_engine_error(err: AllocError) -> Box<CallError> {
    Box::new(CallError::Engine(err))
}

/// A device call's two failures as one.
#[inline]
fn flatten<T>(result: Result<Result<T, AllocError>, RegistryError>) -> Result<T, CallError> {
    match result {
        Ok(Ok(value)) => Ok(value),
        Ok(Err(err)) => Err(CallError::Engine(err)),
        Err(err) => Err(CallError::Unavailable(err)),
    }
}

/// The message a panic was raised with.
#[cold]
pub fn panic_message(payload: &(dyn Any + Send)) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "unknown panic".to_string())
}

#[cfg(test)]
mod tests {
    use super::super::Registry;
    use streamalloc_allocator::backend::sim::SimBackend;
    use streamalloc_allocator::{AllocError, Config, PoolId, StreamId};

    const MIB: u64 = 1 << 20;
    const POOL: PoolId = PoolId(4, 2);

    fn registry() -> Registry<SimBackend> {
        Registry::simulated(Config {
            expandable_segments: false,
            ..Config::default()
        })
    }

    #[test]
    fn a_routed_request_lands_in_the_routed_pool_until_the_route_ends() {
        let registry = registry();
        let device = registry.device(0).unwrap();
        assert_eq!(device.begin_routing(POOL), Ok(1));
        let routed = registry.malloc(0, MIB, StreamId(0)).unwrap();
        assert_eq!(device.allocator().pool_live_allocations(POOL), [routed.ptr]);
        device.end_routing(POOL).unwrap();
        let home = registry.malloc(0, MIB, StreamId(0)).unwrap();
        assert_eq!(device.allocator().pool_live_allocations(POOL), [routed.ptr]);
        assert_ne!(home.ptr, routed.ptr);
    }

    #[test]
    fn a_default_pool_request_of_either_door_falls_back_to_a_marked_pool() {
        let registry = registry();
        let device = registry.device(0).unwrap();
        device.allocator().create_or_incref_pool(POOL).unwrap();
        let cached = registry.malloc_in(0, 700 * MIB, StreamId(0), POOL).unwrap();
        registry.free(cached.ptr, 0).unwrap();
        let refused = registry.malloc(0, 600 * MIB, StreamId(0)).unwrap_err();
        assert!(
            matches!(
                refused.error,
                super::CallError::Engine(AllocError::OutOfMemory(_))
            ),
            "{refused}"
        );
        device.set_use_on_oom(POOL, true).unwrap();
        // The pluggable door (no pool named) and the native door (the default pool named).
        let pluggable = registry.malloc(0, 600 * MIB, StreamId(0)).unwrap();
        assert_eq!(pluggable.ptr, cached.ptr, "the marked pool's cached block");
        registry.free(pluggable.ptr, 0).unwrap();
        let native = registry
            .malloc_in(0, 600 * MIB, StreamId(0), PoolId::DEFAULT)
            .unwrap();
        assert_eq!(native.ptr, cached.ptr);
        assert_eq!(device.allocator().pool_live_allocations(POOL), [native.ptr]);
    }

    #[test]
    fn a_failure_names_its_device_unless_the_poisoning_already_does() {
        let registry = registry();
        let err = registry.malloc_in(0, MIB, StreamId(0), POOL).unwrap_err();
        assert!(err.to_string().starts_with("device 0: "), "{err}");
        let device = registry.device(1).unwrap();
        device.allocator().backend().panic_on_next("alloc_segment");
        let err = registry.malloc(1, MIB, StreamId(0)).unwrap_err();
        assert!(err.unavailable());
        assert!(
            err.to_string()
                .starts_with("device 1 is unusable after an internal panic"),
            "{err}"
        );
    }
}
