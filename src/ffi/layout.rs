//! The structs the C ABI shares with C, each declared once.
//!
//! C sees them through a hand-written header (`python/streamalloc/csrc/streamalloc.h`,
//! compiled into the native PyTorch door) and Python through ctypes. A copy drifts when a
//! field is added on one side only, and C then reads garbage without any error. So each
//! struct is declared with `c_struct!`, which defines the `#[repr(C)]` struct together
//! with its [`CLayout`] (field names, Rust types and offsets, read off the struct itself),
//! and `tests/c_header.rs` checks the header and the ctypes definition against
//! [`super::SHARED`], the list of them. This module defines the description only; it names
//! no struct, so the modules that declare them depend on it and not the other way round.

/// One field of a struct shared with C.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CField {
    /// Its name, the same in C.
    pub name: &'static str,
    /// Its Rust type, e.g. `u64`.
    pub ty: &'static str,
    /// Its offset in bytes.
    pub offset: usize,
}

/// The layout of a struct shared with C.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CLayout {
    /// Its C name (the `typedef`'s, e.g. `streamalloc_stats_t`).
    pub c_name: &'static str,
    /// Its size in bytes.
    pub size: usize,
    /// Its fields, in order.
    pub fields: &'static [CField],
}

/// Defines a `#[repr(C)]` struct shared with C, and its [`CLayout`] as the associated
/// constant `C_LAYOUT`. Fields are `pub name: type,` with a plain type name.
macro_rules! c_struct {
    (
        $(#[$meta:meta])*
        pub struct $name:ident as $c_name:literal {
            $( $(#[$field_meta:meta])* pub $field:ident : $ty:ident, )*
        }
    ) => {
        $(#[$meta])*
        #[repr(C)]
        pub struct $name {
            $( $(#[$field_meta])* pub $field: $ty, )*
        }

        impl $name {
            /// The layout C sees (see `ffi::layout`).
            pub const C_LAYOUT: $crate::ffi::layout::CLayout = $crate::ffi::layout::CLayout {
                c_name: $c_name,
                size: ::std::mem::size_of::<$name>(),
                fields: &[$(
                    $crate::ffi::layout::CField {
                        name: stringify!($field),
                        ty: stringify!($ty),
                        offset: ::std::mem::offset_of!($name, $field),
                    },
                )*],
            };
        }
    };
}
pub(crate) use c_struct;
