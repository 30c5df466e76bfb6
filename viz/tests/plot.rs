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

/// A plot is built within the file's budget: the timeline stays charged while the picture
/// exists, the per-event tables of the drawing are given back once it is drawn, the
/// picture is the one drawn without a budget, and a budget that cannot afford the timeline
/// is an error, not a panic or a partial picture.
#[test]
fn a_plot_is_drawn_within_the_files_budget() {
    use streamalloc_viz::limits::Budget;
    use streamalloc_viz::timeline::Timeline;
    let snap = model::from_engine(&common::engine::engine_snapshot());
    let device = plot::shown_device(&snap).unwrap();
    let mut for_timeline = Budget::new(1 << 30);
    Timeline::build_within(device, &mut for_timeline).unwrap();
    let options = plot::PlotOptions::default();
    for draw in ["svg", "png"] {
        let mut budget = Budget::new(1 << 30);
        let same = match draw {
            "svg" => {
                let svg = plot::render_svg_within(&snap, 600, 300, &options, &mut budget).unwrap();
                svg == plot::render_svg(&snap, 600, 300)
            }
            _ => {
                let rgb = plot::render_rgb_within(&snap, 600, 300, &options, &mut budget).unwrap();
                rgb == plot::render_rgb(&snap, 600, 300)
            }
        };
        assert!(
            same,
            "{draw}: the picture differs from the one drawn without a budget"
        );
        assert_eq!(
            budget.used(),
            for_timeline.used(),
            "{draw}: only the timeline stays charged"
        );
    }
    let over = plot::render_svg_within(&snap, 600, 300, &options, &mut Budget::new(1024));
    assert_eq!(over.unwrap_err().stage, "building the timeline");
    let over = plot::render_rgb_within(&snap, 600, 300, &options, &mut Budget::new(1024));
    assert_eq!(over.unwrap_err().stage, "building the timeline");
}
