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

use crate::registry::panic_message;
use std::cell::{Cell, RefCell};
use std::ffi::{c_char, CString};
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
    if ANY_ERROR.load(Ordering::Relaxed) && ERROR_PENDING.get() {
        clear_message();
    }
}

#[cold]
#[inline(never)]
fn clear_message() {
    ERROR_PENDING.set(false);
    let _ = LAST_ERROR.try_with(|slot| *slot.borrow_mut() = CString::default());
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
