//! The one guard and the one last-error slot of every C export: the C ABI of
//! `libstreamalloc.so` (allocation, pools, stats, IPC, the p2p planner, the exit hooks) and
//! the LD_PRELOAD interposer's CUDA functions. Also panic containment and warnings printed
//! once per kind.
//!
//! C callers see failures as a null pointer, a negative return code or (the interposer) a
//! CUDA error code; the message is then read with `streamalloc_last_error()`. Every export
//! runs its body through [`call`], which clears the slot on entry, so after a call that
//! succeeded it reads "" and never a stale message from an earlier failure, and which turns
//! a panic into the call's failure value: no panic unwinds into C.

use crate::registry::{panic_message, CallError, DeviceError, RegistryError};
use std::cell::{Cell, RefCell};
use std::ffi::{c_char, c_int, c_void, CString};
use std::fmt::Display;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, Ordering};

thread_local! {
    static LAST_ERROR: RefCell<CString> = RefCell::new(CString::default());
    /// Whether `LAST_ERROR` may hold a message. Const-initialised and without a destructor,
    /// so reading it is one load: the slot itself, lazily registered with a destructor,
    /// costs a registration check on every access, and every C call clears it.
    static ERROR_PENDING: Cell<bool> = const { Cell::new(false) };
}

// Every access goes through `try_with`: C calls also arrive from other libraries'
// thread-local and exit-time destructors (PyTorch frees IPC-shared tensors there), after
// this slot may be destroyed, and `with` would then panic where nothing may unwind.

/// Set once any thread stored an error. Until then no slot can hold a message, and clearing
/// costs one load of this flag instead of a thread-local access (in a shared library, a
/// call into the dynamic linker's `__tls_get_addr`). A thread sees its own store, which is
/// all `clear` needs.
static ANY_ERROR: AtomicBool = AtomicBool::new(false);

/// Stores `message` as this thread's last error.
#[cold]
pub fn set(message: impl Display) {
    let text = message.to_string().replace('\0', " ");
    let text = CString::new(text).unwrap_or_default();
    let _ = LAST_ERROR.try_with(|slot| *slot.borrow_mut() = text);
    ANY_ERROR.store(true, Ordering::Relaxed);
    ERROR_PENDING.set(true);
}

/// Empties this thread's last error: called on entry to every C call, so a success leaves
/// "" and a failure leaves its own message. Checks first so that the hot path, with no
/// error pending, writes nothing.
#[inline]
pub fn clear() {
    if ANY_ERROR.load(Ordering::Relaxed) {
        clear_if_pending();
    }
}

/// [`clear`] once some thread has stored an error: out of line, so that the fast path is
/// one load and one branch.
#[cold]
#[inline(never)]
fn clear_if_pending() {
    if ERROR_PENDING.get() {
        ERROR_PENDING.set(false);
        let _ = LAST_ERROR.try_with(|slot| *slot.borrow_mut() = CString::default());
    }
}

/// This thread's last error ("" if none), valid until the next C call on this thread.
pub fn last() -> *const c_char {
    LAST_ERROR
        .try_with(|slot| slot.borrow().as_ptr())
        .unwrap_or(c"".as_ptr())
}

/// This thread's last error as a Rust string.
pub fn last_string() -> String {
    LAST_ERROR
        .try_with(|slot| slot.borrow().to_string_lossy().into_owned())
        .unwrap_or_default()
}

/// One C call: clears this thread's last error, then runs `body`, which sets it on
/// failure. A panic becomes `on_panic` plus a last error naming it: no panic may unwind
/// into C. (A panic inside a device's allocator is caught closer, by the registry, which
/// also makes that device unusable.)
#[inline]
pub fn call<T>(on_panic: T, body: impl FnOnce() -> T) -> T {
    clear();
    match catch_unwind(AssertUnwindSafe(body)) {
        Ok(value) => value,
        Err(payload) => {
            set(format_args!(
                "streamalloc internal error (panic): {}",
                panic_message(payload.as_ref())
            ));
            on_panic
        }
    }
}

/// Kinds of misuse reported once per process, then only counted.
#[derive(Clone, Copy, Debug)]
pub enum Once {
    /// A device's allocator could not be created, or a panic made it unusable.
    Unavailable = 0,
    /// `free` of a pointer no allocator handed out, or already freed.
    InvalidFree = 1,
    /// `free` naming another device than the pointer's.
    WrongDevice = 2,
    /// `record_stream` on a pointer no allocator knows.
    UnknownRecordStream = 3,
}

static WARNED: [AtomicBool; 4] = [const { AtomicBool::new(false) }; 4];

/// Prints `message` on stderr (and to `tracing`) the first time `kind` happens.
#[cold]
pub fn warn_once(kind: Once, message: impl Display) {
    if !WARNED[kind as usize].swap(true, Ordering::Relaxed) {
        tracing::warn!(%message, "streamalloc");
        eprintln!(
            "streamalloc: {message} (reported once; later cases are only counted in the stats)"
        );
    }
}

/// What a C caller reads when `device` cannot serve a call.
#[cold]
#[inline(never)]
pub(crate) fn unavailable_message(device: c_int, err: &RegistryError) -> String {
    match err {
        RegistryError::Poisoned { .. } => format!("streamalloc: {err}"),
        _ => format!("streamalloc: device {device}: {err}"),
    }
}

/// Reports that `device` cannot serve a call: printed once per process, and the last error.
#[cold]
#[inline(never)]
pub(crate) fn unavailable(device: c_int, err: &RegistryError) {
    match err {
        RegistryError::Poisoned { .. } => warn_once(Once::Unavailable, err),
        _ => warn_once(
            Once::Unavailable,
            format_args!("device {device} unavailable: {err}"),
        ),
    }
    set(unavailable_message(device, err));
}

/// Reports a failed `streamalloc_malloc` and returns null. Printed too (an unavailable
/// device once): without a registered thrower, PyTorch's pluggable hook turns a null
/// pointer into a tensor at address 0, and the user would never see this report.
fn malloc_failed_unguarded(err: &DeviceError) -> *mut c_void {
    match &err.error {
        CallError::Unavailable(unusable) => unavailable(err.ordinal, unusable),
        _ => {
            set(format_args!("streamalloc: {err}"));
            eprintln!("streamalloc: {err}");
        }
    }
    std::ptr::null_mut()
}

/// [`malloc_failed_unguarded`] under the guard: the messages are formatted, and nothing
/// may unwind into C.
#[cold]
#[inline(never)]
pub(crate) fn malloc_failed(err: &DeviceError) -> *mut c_void {
    call(std::ptr::null_mut(), || malloc_failed_unguarded(err))
}

/// A failed malloc in a memory pool, under the guard: the last error only (the native door
/// raises it).
#[cold]
#[inline(never)]
pub(crate) fn pool_malloc_failed(err: &DeviceError) -> *mut c_void {
    call(std::ptr::null_mut(), || {
        set(format_args!("streamalloc: {err}"));
        std::ptr::null_mut()
    })
}
