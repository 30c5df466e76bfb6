//! The native PyTorch door's C++ sources, read as text: every error or warning it raises
//! hands PyTorch one finished message, so that c10 never formats one through an iostream.
//! Formatting a number through an ostream inside the door crashed PyTorch 2.11 processes
//! (a segfault in the stream's number formatting, on the path that reports a refused
//! allocation); a single `std::string` or literal is passed through untouched.

use std::path::Path;

/// (macro, arguments before the message). "TORCH_CHECK(" does not match inside
/// "TORCH_CHECK_WITH(": the character after the name differs.
const CHECKS: [(&str, usize); 3] = [
    ("TORCH_CHECK_WITH(", 2),
    ("TORCH_CHECK(", 1),
    ("TORCH_WARN(", 0),
];

/// The top-level comma-separated arguments of the call whose '(' ends `text[..open]`.
fn arguments(text: &str, open: usize) -> Vec<String> {
    let (mut depth, mut args, mut current) = (0usize, Vec::new(), String::new());
    let mut chars = text[open..].chars();
    let mut in_string = false;
    while let Some(c) = chars.next() {
        if in_string {
            current.push(c);
            match c {
                '\\' => current.extend(chars.next()),
                '"' => in_string = false,
                _ => {}
            }
            continue;
        }
        match c {
            '"' => {
                in_string = true;
                current.push(c);
            }
            '(' | '[' | '{' => {
                depth += 1;
                current.push(c);
            }
            ')' | ']' | '}' if depth == 0 => break,
            ')' | ']' | '}' => {
                depth -= 1;
                current.push(c);
            }
            ',' if depth == 0 => args.push(std::mem::take(&mut current)),
            _ => current.push(c),
        }
    }
    args.push(current);
    args.into_iter().map(|a| a.trim().to_string()).collect()
}

/// Adjacent string literals ("a" "b") are one literal.
fn is_literal(arg: &str) -> bool {
    arg.starts_with('"') && arg.ends_with('"')
}

/// `(file:line, macro, message arguments)` of every call passing PyTorch more than one
/// message argument, or a message that streams (`<<`).
fn streamed_messages(name: &str, text: &str) -> Vec<String> {
    let mut found = Vec::new();
    for (check, before) in CHECKS {
        let mut from = 0;
        while let Some(at) = text[from..].find(check) {
            let start = from + at;
            from = start + check.len();
            let args = arguments(text, from);
            let message = &args[before.min(args.len())..];
            let line = text[..start].lines().count();
            if message.len() > 1 && !message.iter().all(|a| is_literal(a)) {
                found.push(format!("{name}:{line}: {check}..., {}", message.join(", ")));
            }
        }
    }
    if text.contains("stringstream") || text.contains("std::cout") || text.contains("std::cerr") {
        found.push(format!("{name}: uses an iostream"));
    }
    found
}

#[test]
fn the_door_hands_pytorch_finished_messages() {
    let csrc = Path::new(env!("CARGO_MANIFEST_DIR")).join("python/streamalloc/csrc");
    let mut sources = 0;
    let mut found = Vec::new();
    for entry in std::fs::read_dir(&csrc).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        if !(name.starts_with("door") || name == "torch_door.cpp") {
            continue;
        }
        sources += 1;
        found.extend(streamed_messages(
            &name,
            &std::fs::read_to_string(&path).unwrap(),
        ));
    }
    assert!(
        sources >= 6,
        "the door's sources were not found in {csrc:?}"
    );
    assert!(
        found.is_empty(),
        "messages c10 would format through an iostream (build one std::string with \
         std::to_string instead):\n{}",
        found.join("\n")
    );
}

#[test]
fn a_number_among_the_message_arguments_is_caught() {
    let planted = r#"TORCH_CHECK(ok, "allocating ", size, " bytes failed: ", msg);"#;
    assert_eq!(streamed_messages("x.cpp", planted).len(), 1);
    let finished = r#"TORCH_CHECK(ok, "allocating " + std::to_string(size) + " bytes");"#;
    assert!(streamed_messages("x.cpp", finished).is_empty());
    let literals = r#"TORCH_CHECK_WITH(OutOfMemoryError, ok, "a " "b");"#;
    assert!(streamed_messages("x.cpp", literals).is_empty());
}
