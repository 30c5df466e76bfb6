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

#[cfg(doc)]
use streamalloc_allocator::Stats;

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

c_struct! {
/// `streamalloc_stats_t`: the engine's [`Stats`], flattened. Byte gauges come as
/// `*_current` / `*_peak` pairs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StreamallocStats as "streamalloc_stats_t" {
    /// Bytes in blocks handed out (rounded sizes), now.
    pub allocated_current: u64,
    /// Peak of `allocated_current`.
    pub allocated_peak: u64,
    /// Bytes callers asked for, now.
    pub requested_current: u64,
    /// Peak of `requested_current`.
    pub requested_peak: u64,
    /// Bytes obtained from the device, now.
    pub reserved_current: u64,
    /// Peak of `reserved_current`.
    pub reserved_peak: u64,
    /// Allocated plus freed-but-pending bytes, now.
    pub active_current: u64,
    /// Peak of `active_current`.
    pub active_peak: u64,
    /// Free bytes still carrying other streams' events, now.
    pub pending_free_current: u64,
    /// Peak of `pending_free_current`.
    pub pending_free_peak: u64,
    /// Blocks handed out.
    pub allocs: u64,
    /// Blocks returned.
    pub frees: u64,
    /// Segments obtained from the device.
    pub segment_allocs: u64,
    /// Segments returned to the device.
    pub segment_frees: u64,
    /// Device-side waits made to reuse blocks across streams.
    pub cross_stream_waits: u64,
    /// Events recorded.
    pub events_recorded: u64,
    /// Event queries.
    pub event_queries: u64,
    /// Events recorded and still referenced.
    pub events_outstanding: u64,
    /// Event objects created.
    pub events_created: u64,
    /// Event objects destroyed.
    pub events_destroyed: u64,
    /// Requests that failed for lack of memory.
    pub ooms: u64,
    /// Requests served only after releasing cached memory.
    pub retries: u64,
    /// Frees of unknown or already freed pointers.
    pub invalid_frees: u64,
    /// Reserved-bytes limit in force (0: none).
    pub memory_limit: u64,
    /// Device-wide synchronisations made (to release memory or to unmap pages).
    pub device_syncs: u64,
    /// Bytes mapped into expandable segments, in all.
    pub page_map_bytes: u64,
    /// Bytes unmapped from expandable segments, in all.
    pub page_unmap_bytes: u64,
    /// Stitched ranges made (free pages mapped a second time into one range).
    pub stitches: u64,
    /// Bytes mapped into stitched ranges (no memory reserved by them).
    pub stitched_map_bytes: u64,
    /// Stitched ranges taken again without mapping.
    pub stitch_revivals: u64,
    /// Stitched ranges unmapped.
    pub stitch_evictions: u64,
    /// Host nanoseconds spent in the driver's virtual-memory calls (map, second map, unmap).
    pub vmm_ns: u64,
    /// Requests the stream's own ready blocks could not serve (the policy's slow path).
    pub slow_paths: u64,
    /// Host nanoseconds those requests took, driver calls and synchronisations included.
    pub slow_path_ns: u64,
    /// Bytes sleeping memory pools gave back to the device, addresses kept.
    pub sleeping_bytes: u64,
    /// Bytes of page-locked host memory held for sleeping pools' backups.
    pub host_backup_bytes: u64,
}
}

c_struct! {
/// `streamalloc_pool_block_t`: one live allocation of a pool checkpoint.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StreamallocPoolBlock as "streamalloc_pool_block_t" {
    /// First byte.
    pub address: u64,
    /// Bytes reserved (rounded).
    pub size: u64,
    /// Bytes asked for.
    pub requested: u64,
    /// The `cudaStream_t` it belongs to.
    pub stream: u64,
}
}

c_struct! {
/// `streamalloc_segment_info_t`: one segment of a snapshot; an expandable segment
/// appears as one of these per run of mapped pages.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StreamallocSegmentInfo as "streamalloc_segment_info_t" {
    /// First byte.
    pub address: u64,
    /// Bytes.
    pub total_size: u64,
    /// The `cudaStream_t` whose request created it.
    pub stream: u64,
    /// Its pool's id, first half.
    pub pool_id0: u64,
    /// Its pool's id, second half.
    pub pool_id1: u64,
    /// 0: small pool, 1: large.
    pub is_large: u32,
    /// 1 for memory mapped into an expandable segment.
    pub is_expandable: u32,
    /// Index of its first block in the blocks array.
    pub first_block: u64,
    /// Its blocks.
    pub block_count: u64,
}
}

c_struct! {
/// `streamalloc_block_state_t`: one block of a snapshot.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StreamallocBlockState as "streamalloc_block_state_t" {
    /// First byte.
    pub address: u64,
    /// Bytes.
    pub size: u64,
    /// Bytes asked for (0 unless allocated).
    pub requested_size: u64,
    /// Owning `cudaStream_t`.
    pub stream: u64,
    /// 0 inactive (free), 1 active_allocated, 2 active_pending_free.
    pub state: u32,
    /// Zero.
    pub reserved: u32,
}
}

c_struct! {
/// `streamalloc_sleep_report_t`: what one `streamalloc_sleep` or `streamalloc_wake` did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StreamallocSleepReport as "streamalloc_sleep_report_t" {
    /// Bytes of device memory given back (sleep) or mapped again (wake).
    pub bytes: u64,
    /// Bytes copied to host memory (sleep) or back from it (wake).
    pub copied: u64,
    /// Copies made.
    pub copies: u64,
}
}

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
