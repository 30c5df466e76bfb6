//! One device's allocator, and whether a panic made it unusable.

use super::RegistryError;
use std::any::Any;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::OnceLock;
use streamalloc_allocator::{Allocator, Backend};

/// One device's allocator and whether a panic made it unusable.
#[derive(Debug)]
pub struct Device<B: Backend> {
    ordinal: i32,
    allocator: Allocator<B>,
    poison: OnceLock<RegistryError>,
}

impl<B: Backend> Device<B> {
    /// Device `ordinal`, served by `allocator`.
    pub(super) fn new(ordinal: i32, allocator: Allocator<B>) -> Self {
        Self {
            ordinal,
            allocator,
            poison: OnceLock::new(),
        }
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
    /// [`RegistryError::Poisoned`].
    #[inline]
    pub fn run<T>(&self, body: impl FnOnce(&Allocator<B>) -> T) -> Result<T, RegistryError> {
        if let Some(poisoned) = self.poison.get() {
            return Err(poisoned.clone());
        }
        catch_unwind(AssertUnwindSafe(|| body(&self.allocator)))
            .map_err(|payload| self.poison_with(panic_message(payload.as_ref())))
    }

    #[cold]
    #[inline(never)]
    fn poison_with(&self, message: String) -> RegistryError {
        let poisoned = self.poison.get_or_init(|| {
            tracing::error!(ordinal = self.ordinal, %message, "streamalloc: device poisoned by a panic");
            RegistryError::Poisoned {
                ordinal: self.ordinal,
                message,
            }
        });
        poisoned.clone()
    }

    /// The error every call gets once a panic made the device unusable, if one did.
    pub fn poisoned(&self) -> Option<&RegistryError> {
        self.poison.get()
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
