//! The browserless plot: the SVG and the PNG pixels show the timeline of a real engine run.

mod common;

use streamalloc_viz::{model, plot};

#[test]
fn svg_and_rgb_draw_the_timeline() {
    let snap = model::from_engine(&common::engine::engine_snapshot());
    let svg = plot::render_svg(&snap, 600, 300);
    assert!(svg.starts_with("<svg") && svg.ends_with("</svg>"));
    assert!(svg.matches("<rect").count() > 20);
    assert!(svg.contains("<polyline"), "reserved line");

    let (w, h) = (600, 300);
    let rgb = plot::render_rgb(&snap, w, h);
    assert_eq!(rgb.len(), w * h * 3);
    let coloured = rgb
        .chunks(3)
        .filter(|p| u16::from(p[2]) > u16::from(p[0]) + 40) // the first stream's blue
        .count();
    assert!(coloured > w * h / 50, "only {coloured} blue pixels");

    // An empty snapshot still gives a picture, not a panic.
    let empty = model::Snapshot::new("streamalloc");
    assert!(plot::render_svg(&empty, 200, 100).contains("empty snapshot"));
    assert_eq!(plot::render_rgb(&empty, 200, 100).len(), 200 * 100 * 3);
}
