//! The C header the native PyTorch door compiles against
//! (`python/streamalloc/csrc/streamalloc.h`) and the ctypes classes Python reads the
//! structs with (`python/streamalloc/_lib.py`) carry structs generated from their Rust
//! definitions (`src/ffi/layout.rs`). These tests hold both texts to the Rust side: the
//! generated regions as generated (`STREAMALLOC_BLESS=1` rewrites them); every struct the
//! header declares, field for field (name, order, type, offset, size) by C's layout
//! rules; every function it declares, exported by the library; and the stats struct,
//! complete against the engine's counters.

use std::collections::BTreeSet;
use std::path::Path;
use streamalloc::ffi::layout::{c_typedefs, ctypes_classes, replace_generated, CLayout, SHARED};
use streamalloc::ffi::StreamallocStats;
use streamalloc_allocator::Stats;

fn read(relative: &str) -> String {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join(relative);
    std::fs::read_to_string(&path).unwrap_or_else(|err| panic!("{}: {err}", path.display()))
}

fn header() -> String {
    strip_comments(&read("python/streamalloc/csrc/streamalloc.h"))
}

fn strip_comments(text: &str) -> String {
    let mut out = String::new();
    let mut rest = text;
    while let Some(start) = rest.find("/*") {
        out.push_str(&rest[..start]);
        let end = rest[start..].find("*/").expect("unterminated comment") + start + 2;
        rest = &rest[end..];
    }
    out.push_str(rest);
    out.lines()
        .map(|line| line.split("//").next().unwrap())
        .collect::<Vec<_>>()
        .join("\n")
}

/// A struct as the header declares it: its typedef name and its fields (name, C type).
#[derive(Debug)]
struct CStruct {
    name: String,
    fields: Vec<(String, String)>,
}

/// Every `typedef struct tag { ... } name;` of the header.
fn header_structs(header: &str) -> Vec<CStruct> {
    let mut structs = Vec::new();
    let mut rest = header;
    while let Some(start) = rest.find("typedef struct") {
        let open = rest[start..].find('{').unwrap() + start;
        let close = rest[open..].find('}').unwrap() + open;
        let semicolon = rest[close..].find(';').unwrap() + close;
        let name = rest[close + 1..semicolon].trim().to_string();
        let mut fields = Vec::new();
        for declaration in rest[open + 1..close].split(';') {
            let declaration = declaration.split_whitespace().collect::<Vec<_>>().join(" ");
            if declaration.is_empty() {
                continue;
            }
            let (ty, names) = declaration
                .split_once(' ')
                .unwrap_or_else(|| panic!("{name}: cannot read `{declaration}`"));
            for field in names.split(',') {
                fields.push((field.trim().to_string(), ty.to_string()));
            }
        }
        structs.push(CStruct { name, fields });
        rest = &rest[semicolon..];
    }
    structs
}

/// The Rust type a C field type must be, with its size (and alignment).
fn rust_type(c_type: &str) -> (&'static str, usize) {
    match c_type {
        "uint64_t" => ("u64", 8),
        "int64_t" => ("i64", 8),
        "uint32_t" => ("u32", 4),
        "int32_t" | "int" => ("i32", 4),
        "size_t" => ("usize", 8),
        other => panic!("the test does not know the C type {other}"),
    }
}

/// Offsets and size by C's layout rules (natural alignment).
fn c_layout(fields: &[(String, String)]) -> (Vec<usize>, usize) {
    let (mut offset, mut align) = (0usize, 1usize);
    let mut offsets = Vec::new();
    for (_, ty) in fields {
        let size = rust_type(ty).1;
        offset = offset.next_multiple_of(size);
        offsets.push(offset);
        offset += size;
        align = align.max(size);
    }
    (offsets, offset.next_multiple_of(align))
}

fn check_struct(declared: &CStruct, rust: &CLayout) -> Result<(), String> {
    let c_fields: Vec<(&str, &str)> = declared
        .fields
        .iter()
        .map(|(name, ty)| (name.as_str(), rust_type(ty).0))
        .collect();
    let rust_fields: Vec<(&str, &str)> = rust.fields.iter().map(|f| (f.name, f.ty)).collect();
    if c_fields != rust_fields {
        return Err(format!(
            "{}: the header has\n  {c_fields:?}\nRust has\n  {rust_fields:?}",
            rust.c_name
        ));
    }
    let (offsets, size) = c_layout(&declared.fields);
    let rust_offsets: Vec<usize> = rust.fields.iter().map(|f| f.offset).collect();
    if offsets != rust_offsets || size != rust.size {
        return Err(format!(
            "{}: C lays it out at {offsets:?} ({size} bytes), Rust at {rust_offsets:?} ({} bytes)",
            rust.c_name, rust.size
        ));
    }
    Ok(())
}

#[test]
fn every_struct_of_the_header_matches_its_rust_definition_field_for_field() {
    let declared = header_structs(&header());
    let names: BTreeSet<&str> = declared.iter().map(|s| s.name.as_str()).collect();
    let shared: BTreeSet<&str> = SHARED.iter().map(|l| l.c_name).collect();
    assert_eq!(
        names, shared,
        "structs declared in the header vs shared by Rust"
    );
    for layout in &SHARED {
        let c = declared.iter().find(|s| s.name == layout.c_name).unwrap();
        check_struct(c, layout).unwrap();
    }
}

#[test]
fn the_header_check_catches_a_missing_a_reordered_and_a_retyped_field() {
    let declared = header_structs(&header());
    let stats = declared
        .iter()
        .find(|s| s.name == "streamalloc_stats_t")
        .unwrap();
    let layout = StreamallocStats::C_LAYOUT;
    let mut missing = CStruct {
        name: stats.name.clone(),
        fields: stats.fields.clone(),
    };
    missing.fields.pop();
    assert!(check_struct(&missing, &layout).is_err());
    let mut swapped = CStruct {
        name: stats.name.clone(),
        fields: stats.fields.clone(),
    };
    swapped.fields.swap(0, 1);
    assert!(check_struct(&swapped, &layout).is_err());
    let mut retyped = CStruct {
        name: stats.name.clone(),
        fields: stats.fields.clone(),
    };
    retyped.fields[3].1 = "uint32_t".to_string();
    assert!(check_struct(&retyped, &layout).is_err());
}

#[test]
fn the_stats_struct_carries_every_counter_of_the_engine_from_its_source() {
    // Every engine counter with a distinct value: gauges as `{current, peak}`.
    let keys = serde_json::to_value(Stats::default()).unwrap();
    let mut next = 1u64;
    let mut distinct = serde_json::Map::new();
    for (key, value) in keys.as_object().unwrap() {
        // PyTorch's view of the same counters crosses the C ABI key by key, through
        // `streamalloc_torch_stat_name` / `streamalloc_torch_stats` (tests/torch_stats.rs).
        if key == "torch" {
            continue;
        }
        let value = if value.is_object() {
            next += 2;
            serde_json::json!({ "current": next - 1, "peak": next })
        } else {
            next += 1;
            serde_json::json!(next)
        };
        distinct.insert(key.clone(), value);
    }
    let stats: Stats = serde_json::from_value(serde_json::Value::Object(distinct.clone())).unwrap();
    let limit = 987_654_321;
    let flat = StreamallocStats::new(&stats, Some(limit));
    // SAFETY: StreamallocStats is plain old data of `size` bytes.
    let bytes = unsafe {
        std::slice::from_raw_parts(
            (&flat as *const StreamallocStats).cast::<u8>(),
            std::mem::size_of::<StreamallocStats>(),
        )
    };
    let field = |name: &str| {
        let f = StreamallocStats::C_LAYOUT
            .fields
            .iter()
            .find(|f| f.name == name)
            .unwrap_or_else(|| panic!("streamalloc_stats_t has no field {name}"));
        assert_eq!(f.ty, "u64");
        u64::from_ne_bytes(bytes[f.offset..f.offset + 8].try_into().unwrap())
    };
    let mut covered = BTreeSet::from(["memory_limit".to_string()]);
    assert_eq!(field("memory_limit"), limit);
    for (key, value) in &distinct {
        if let Some(gauge) = value.as_object() {
            let base = key.strip_suffix("_bytes").unwrap_or(key);
            for half in ["current", "peak"] {
                let name = format!("{base}_{half}");
                assert_eq!(Some(field(&name)), gauge[half].as_u64(), "{name}");
                covered.insert(name);
            }
        } else {
            assert_eq!(Some(field(key)), value.as_u64(), "{key}");
            covered.insert(key.clone());
        }
    }
    let all: BTreeSet<String> = StreamallocStats::C_LAYOUT
        .fields
        .iter()
        .map(|f| f.name.to_string())
        .collect();
    assert_eq!(all, covered, "fields with no engine counter behind them");
}

/// Checks that `relative`'s generated region is `generated`, or rewrites it when
/// `STREAMALLOC_BLESS=1`.
fn check_generated(relative: &str, generated: &str) {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join(relative);
    let text = read(relative);
    let expected =
        replace_generated(&text, generated).unwrap_or_else(|err| panic!("{relative}: {err}"));
    if expected == text {
        return;
    }
    if std::env::var_os("STREAMALLOC_BLESS").is_some_and(|v| v == "1") {
        std::fs::write(&path, expected).unwrap();
        return;
    }
    panic!(
        "{relative}: its generated structs differ from src/ffi/layout.rs's; run \
         `STREAMALLOC_BLESS=1 cargo test --test c_header` to rewrite them"
    );
}

#[test]
fn the_headers_typedefs_and_pythons_ctypes_classes_are_the_generated_ones() {
    check_generated("python/streamalloc/csrc/streamalloc.h", &c_typedefs());
    check_generated("python/streamalloc/_lib.py", &ctypes_classes());
}

#[test]
fn a_field_added_on_the_rust_side_only_is_caught_in_the_generated_text() {
    let header = read("python/streamalloc/csrc/streamalloc.h");
    let generated = c_typedefs();
    let grown = generated.replacen(
        "  uint64_t allocated_current;",
        "  uint64_t added_on_one_side;\n  uint64_t allocated_current;",
        1,
    );
    assert_ne!(grown, generated);
    assert_ne!(replace_generated(&header, &grown).unwrap(), header);
    let python = read("python/streamalloc/_lib.py");
    assert!(python.contains("(\"allocated_current\", ctypes.c_uint64),"));
    assert!(ctypes_classes().contains("class StreamallocStats(ctypes.Structure):"));
    assert!(replace_generated("no markers", &generated).is_err());
}

#[test]
fn every_function_the_header_declares_is_exported() {
    let header = header();
    let mut sources = String::new();
    for dir in ["src/ffi", "src"] {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join(dir);
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            if path.extension().is_some_and(|e| e == "rs") {
                sources.push_str(&std::fs::read_to_string(path).unwrap());
            }
        }
    }
    let mut declared = 0;
    for (at, _) in header.match_indices("streamalloc_") {
        let identifier = |c: char| c.is_ascii_alphanumeric() || c == '_';
        if header[..at].chars().next_back().is_some_and(identifier) {
            continue;
        }
        let name: String = header[at..]
            .chars()
            .take_while(|&c| identifier(c))
            .collect();
        if !header[at + name.len()..].starts_with('(') {
            continue;
        }
        declared += 1;
        let exported = [
            format!("extern \"C\" fn {name}("),
            format!("extern \"C-unwind\" fn {name}("),
        ]
        .iter()
        .any(|signature| sources.contains(signature.as_str()));
        assert!(
            exported,
            "{name} is declared in the header but not exported"
        );
    }
    assert!(declared >= 25, "found only {declared} declarations");
}
