//! The structs the C ABI shares with C, each declared once.
//!
//! C sees them through a header (`python/streamalloc/csrc/streamalloc.h`, compiled into
//! the native PyTorch door) and Python through ctypes (`python/streamalloc/_lib.py`). A
//! copy drifts when a field is added on one side only, and C then reads garbage without
//! any error. So each struct is declared with `c_struct!`, which defines the `#[repr(C)]`
//! struct together with its [`CLayout`] (field names, Rust types, offsets and docs, read
//! off the struct itself), and the C typedefs and ctypes classes are generated from
//! [`SHARED`] ([`c_typedefs`], [`ctypes_classes`]) into marked regions of those two
//! files. `tests/c_header.rs` fails when a checked-in region differs from what is
//! generated, and rewrites both with `STREAMALLOC_BLESS=1`.

use super::pools::{StreamallocBlockState, StreamallocPoolBlock, StreamallocSegmentInfo};
use super::sleep::StreamallocSleepReport;
use super::stats::StreamallocStats;

/// One field of a struct shared with C.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CField {
    /// Its name, the same in C.
    pub name: &'static str,
    /// Its Rust type, e.g. `u64`.
    pub ty: &'static str,
    /// Its offset in bytes.
    pub offset: usize,
    /// Its doc comment.
    pub doc: &'static str,
}

/// The layout of a struct shared with C.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CLayout {
    /// Its C name (the `typedef`'s, e.g. `streamalloc_stats_t`).
    pub c_name: &'static str,
    /// Its Rust name, also the ctypes class's.
    pub rust_name: &'static str,
    /// Its doc comment.
    pub doc: &'static str,
    /// Its size in bytes.
    pub size: usize,
    /// Its fields, in order.
    pub fields: &'static [CField],
}

/// Defines a `#[repr(C)]` struct shared with C, and its [`CLayout`] as the associated
/// constant `C_LAYOUT`. The struct's doc comes first, then its `derive`; fields
/// are `pub name: type,` with a plain type name and a doc comment.
macro_rules! c_struct {
    (
        $(#[doc = $doc:literal])*
        #[derive($($derive:path),*)]
        pub struct $name:ident as $c_name:literal {
            $( $(#[doc = $field_doc:literal])* pub $field:ident : $ty:ident, )*
        }
    ) => {
        $(#[doc = $doc])*
        #[derive($($derive),*)]
        #[repr(C)]
        pub struct $name {
            $( $(#[doc = $field_doc])* pub $field: $ty, )*
        }

        impl $name {
            /// The layout C sees (see `ffi::layout`).
            pub const C_LAYOUT: $crate::ffi::layout::CLayout = $crate::ffi::layout::CLayout {
                c_name: $c_name,
                rust_name: stringify!($name),
                doc: concat!($($doc, "\n",)*),
                size: ::std::mem::size_of::<$name>(),
                fields: &[$(
                    $crate::ffi::layout::CField {
                        name: stringify!($field),
                        ty: stringify!($ty),
                        offset: ::std::mem::offset_of!($name, $field),
                        doc: concat!($($field_doc, "\n",)*),
                    },
                )*],
            };
        }
    };
}
pub(crate) use c_struct;

/// Every struct the C ABI shares with C.
pub const SHARED: [CLayout; 5] = [
    StreamallocStats::C_LAYOUT,
    StreamallocSegmentInfo::C_LAYOUT,
    StreamallocBlockState::C_LAYOUT,
    StreamallocPoolBlock::C_LAYOUT,
    StreamallocSleepReport::C_LAYOUT,
];

// ---- Generated text -------------------------------------------------------------------

/// The first and last lines of the generated region in the header and in `_lib.py`.
pub const GENERATED_BEGIN: &str =
    "generated from src/ffi/layout.rs: do not edit (see tests/c_header.rs)";
/// See [`GENERATED_BEGIN`].
pub const GENERATED_END: &str = "end of generated text";

/// A field's C type and ctypes type.
fn field_types(rust_type: &str) -> (&'static str, &'static str) {
    match rust_type {
        "u64" => ("uint64_t", "ctypes.c_uint64"),
        "i64" => ("int64_t", "ctypes.c_int64"),
        "u32" => ("uint32_t", "ctypes.c_uint32"),
        "i32" => ("int32_t", "ctypes.c_int32"),
        "usize" => ("size_t", "ctypes.c_size_t"),
        other => panic!("c_struct!: no C type for the Rust type {other}"),
    }
}

/// A doc comment as one line of prose (the lines joined, Markdown's backticks dropped).
fn one_line(doc: &str) -> String {
    doc.split_whitespace()
        .collect::<Vec<_>>()
        .join(" ")
        .replace(['`', '[', ']'], "")
}

/// The C typedef of every struct of [`SHARED`], each field with its doc.
pub fn c_typedefs() -> String {
    let mut out = String::new();
    for layout in &SHARED {
        let tag = layout.c_name.strip_suffix("_t").unwrap_or(layout.c_name);
        out.push_str(&format!("/* {} */\n", one_line(layout.doc)));
        out.push_str(&format!("typedef struct {tag} {{\n"));
        for field in layout.fields {
            let (c_type, _) = field_types(field.ty);
            out.push_str(&format!(
                "  {c_type} {}; /* {} */\n",
                field.name,
                one_line(field.doc)
            ));
        }
        out.push_str(&format!("}} {};\n\n", layout.c_name));
    }
    out.pop();
    out
}

/// The ctypes class of every struct of [`SHARED`], named as in Rust.
pub fn ctypes_classes() -> String {
    let mut out = String::new();
    for layout in &SHARED {
        out.push_str(&format!(
            "class {}(ctypes.Structure):\n    \"\"\"{}\"\"\"\n\n    _fields_ = [\n",
            layout.rust_name,
            one_line(layout.doc)
        ));
        for field in layout.fields {
            let (_, ctype) = field_types(field.ty);
            out.push_str(&format!("        (\"{}\", {ctype}),\n", field.name));
        }
        out.push_str("    ]\n\n\n");
    }
    out.truncate(out.trim_end().len());
    out.push('\n');
    out
}

/// `text` with the lines between the line containing [`GENERATED_BEGIN`] and the one
/// containing [`GENERATED_END`] replaced by `generated`; an error if either is missing.
pub fn replace_generated(text: &str, generated: &str) -> Result<String, String> {
    let begin = text
        .find(GENERATED_BEGIN)
        .ok_or_else(|| format!("no line with `{GENERATED_BEGIN}`"))?;
    let body = begin
        + text[begin..]
            .find('\n')
            .ok_or("nothing after the first marker")?
        + 1;
    let end = body
        + text[body..]
            .find(GENERATED_END)
            .ok_or_else(|| format!("no line with `{GENERATED_END}`"))?;
    let end_line = text[..end].rfind('\n').map_or(0, |at| at + 1);
    Ok(format!("{}{generated}{}", &text[..body], &text[end_line..]))
}
