//! The pluggable door marks every `torch.cuda.ExternalStream` made after `install()` as
//! volatile in the library (its owner may destroy it while blocks freed on it are cached),
//! without a GPU or PyTorch: a stand-in `torch` whose `ExternalStream` defines `__new__`
//! as PyTorch's does. With no driver the library refuses the mark, naming device 0, which
//! shows the call was made; the stream object is still built as the original `__new__`
//! builds it. Passes, saying why, without `python3`.

use std::path::Path;

mod cli;

/// An `ExternalStream`, defining `__new__` as PyTorch's does, added to
/// `cli::PLUGGABLE_TORCH`.
const EXTERNAL_STREAM: &str = r#"
class Stream:
    pass
class ExternalStream(Stream):
    def __new__(cls, stream_ptr, device=None, **kwargs):
        self = object.__new__(cls)
        self.cuda_stream, self.device_index = stream_ptr, 0 if device is None else device
        return self
cuda.Stream, cuda.ExternalStream = Stream, ExternalStream
"#;

const PROGRAM: &str = r#"
import streamalloc.torch as st
st.install(door="pluggable")
import torch
before = st.last_error()
s = torch.cuda.ExternalStream(0x5000, device=0)
print("built" if isinstance(s, torch.cuda.ExternalStream) and s.cuda_stream == 0x5000 else "WRONG")
after = st.last_error()
print("marked" if "device 0" in after and after != before else "not marked: " + repr(after))
"#;

#[test]
fn the_pluggable_door_marks_each_external_stream_volatile() {
    if !cli::python3_available() {
        return;
    }
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("external_streams");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(dir.join("torch")).unwrap();
    std::fs::write(
        dir.join("torch/__init__.py"),
        format!("{}{EXTERNAL_STREAM}", cli::PLUGGABLE_TORCH),
    )
    .unwrap();
    let path = std::env::join_paths([root.join("python"), dir.clone()]).unwrap();
    let out = cli::python3(path)
        .arg("-c")
        .arg(PROGRAM)
        .output()
        .expect("spawn python3");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && stdout.trim() == "built\nmarked",
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
}
