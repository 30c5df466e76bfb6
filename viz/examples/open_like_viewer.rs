//! Opens snapshots the way `streamalloc view` does before it serves them (read, then
//! encode every device for the page) and prints how long that took, for measuring the
//! viewer's load path: `cargo run --release -p streamalloc-viz --example open_like_viewer
//! -- FILE...`.

use std::sync::Arc;
use streamalloc_viz::{files, server};

fn main() {
    let started = std::time::Instant::now();
    let mut loaded = Vec::new();
    for path in std::env::args_os().skip(1).map(std::path::PathBuf::from) {
        match files::load(&path) {
            Ok(snapshot) => loaded.push((path.display().to_string(), snapshot)),
            Err(err) => eprintln!("{err}"),
        }
    }
    let events: usize = loaded.iter().map(|(_, s)| s.event_count()).sum();
    let viewer = Arc::new(server::Viewer::new(loaded));
    if let Err(err) = viewer.warm() {
        eprintln!("{err}");
    }
    eprintln!(
        "{events} events opened and encoded in {:.2} s",
        started.elapsed().as_secs_f64()
    );
}
