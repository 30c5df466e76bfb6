//! A plot read on its own explains itself: the SVG carries a title, a legend saying what
//! each colour and line is with the peaks, axis titles with units, and a label at the end
//! of every line; with a replay overlay, three lines (recorded reserved, replayed reserved,
//! live) and a legend with both peaks, the saving and the cap. The PNG draws the same texts.

mod common;

use streamalloc_viz::model::{self, Snapshot};
use streamalloc_viz::overlay::{Cap, CapOutcome, Recorded, ReplayOverlay, SeriesBuilder};
use streamalloc_viz::plot::{self, PlotOptions};
use streamalloc_viz::timeline::{Counter, Timeline};

fn snapshot() -> Snapshot {
    model::from_engine(&common::engine::engine_snapshot())
}

/// The text of the SVG element with id `id`.
fn text_of<'a>(svg: &'a str, id: &str) -> &'a str {
    let at = svg
        .find(&format!(r#"id="{id}""#))
        .unwrap_or_else(|| panic!("no element {id} in {svg}"));
    let rest = &svg[at..];
    let start = rest.find('>').unwrap() + 1;
    let end = rest.find("</text>").unwrap();
    &rest[start..end]
}

/// Every legend entry's text, in order.
fn legend(svg: &str) -> Vec<&str> {
    let start = svg.find(r#"<g id="legend">"#).expect("a legend");
    let body = &svg[start..start + svg[start..].find("</g>").unwrap()];
    body.split("<text ")
        .skip(1)
        .map(|t| &t[t.find('>').unwrap() + 1..t.find("</text>").unwrap()])
        .collect()
}

#[test]
fn the_svg_has_a_title_legend_axis_titles_and_labelled_lines() {
    let snap = snapshot();
    let device = plot::shown_device(&snap).unwrap();
    let t = Timeline::build(device);
    let options = PlotOptions {
        name: Some("engine.json"),
        overlay: None,
    };
    let svg = plot::render_svg_with(&snap, 900, 400, &options);
    let title = format!(
        "engine.json, cuda:{}: memory over {} events",
        device.device,
        t.len()
    );
    assert!(svg.contains(&format!("<title>{title}</title>")), "{svg}");
    assert_eq!(text_of(&svg, "title"), title);

    let entries = legend(&svg);
    let peak = t.peak(Counter::Reserved).unwrap().1;
    assert!(
        entries[0].starts_with("reserved (in segments): peak ") && peak > 0,
        "{entries:?}"
    );
    assert!(
        entries.iter().any(|e| e.starts_with("peak active (live) ")),
        "{entries:?}"
    );
    assert!(
        entries.iter().any(|e| *e == "allocations on stream 0x0"
            || e.starts_with("allocations on stream 0x")),
        "{entries:?}"
    );
    assert!(entries.contains(&"allocations shorter than a pixel column"));

    let y_title = text_of(&svg, "y-title");
    assert!(
        [
            "memory (bytes)",
            "memory (KiB)",
            "memory (MiB)",
            "memory (GiB)"
        ]
        .contains(&y_title),
        "{y_title}"
    );
    assert!(text_of(&svg, "x-title").starts_with("trace events in recorded order"));
    assert!(svg.contains(r#"<polyline id="line-reserved""#));
    assert_eq!(text_of(&svg, "label-reserved"), "reserved");
}

/// An overlay of made-up figures: the plot shows them as the overlay words them.
fn overlay_for(snap: &Snapshot) -> ReplayOverlay {
    let device = plot::shown_device(snap).unwrap();
    let t = Timeline::build(device);
    let mut series = SeriesBuilder::new(t.len() as u64, 0);
    for i in 0..t.len() {
        series.push(t.value(Counter::Active, i) + (1 << 20));
    }
    ReplayOverlay::new(
        Recorded {
            by: "PyTorch".into(),
            peak_reserved: t.peak(Counter::Reserved).unwrap().1,
            peak_live: t.peak(Counter::Active).unwrap().1,
            segment_events: true,
        },
        series,
        CapOutcome::Searched {
            lowest: Some(Cap {
                ratio: 1.01,
                bytes: 1 << 20,
            }),
            highest: 1.5,
        },
        String::new(),
    )
}

#[test]
fn with_a_replay_three_lines_and_the_legend_give_both_peaks_and_the_saving() {
    let snap = snapshot();
    let overlay = overlay_for(&snap);
    let options = PlotOptions {
        name: Some("run.pickle"),
        overlay: Some(&overlay),
    };
    let svg = plot::render_svg_with(&snap, 1200, 500, &options);
    assert!(text_of(&svg, "title")
        .starts_with("run.pickle, cuda:0: PyTorch's reserved memory against streamalloc's"));
    let entries = legend(&svg);
    let words = &overlay.legend;
    assert_eq!(entries[0], words.recorded);
    assert_eq!(entries[1], words.replayed);
    assert_eq!(entries[2], words.live);
    assert_eq!(entries[3], format!("{}; {}", words.saving, words.cap));
    assert!(words.recorded.contains("peak") && words.replayed.contains("peak"));
    for (line, label) in [
        ("recorded-reserved", "PyTorch reserved"),
        ("replayed-reserved", "streamalloc reserved"),
        ("live", "live"),
    ] {
        assert!(
            svg.contains(&format!(r#"<polyline id="line-{line}""#)),
            "{line}"
        );
        assert_eq!(text_of(&svg, &format!("label-{line}")), label);
    }
}

#[test]
fn the_png_draws_its_texts() {
    let snap = snapshot();
    let overlay = overlay_for(&snap);
    let (w, h) = (1000, 400);
    let options = PlotOptions {
        name: Some("run.pickle"),
        overlay: Some(&overlay),
    };
    let rgb = plot::render_rgb_with(&snap, w, h, &options);
    assert_eq!(rgb.len(), w * h * 3);
    let dark = |x: usize, y: usize| {
        let i = (y * w + x) * 3;
        rgb[i] < 80 && rgb[i + 1] < 80 && rgb[i + 2] < 80
    };
    // The title's band (its first 20 rows) holds ink across most of its first half.
    let inked = (0..w / 2).filter(|&x| (0..20).any(|y| dark(x, y))).count();
    assert!(inked > w / 4, "title: {inked} inked columns");
    // The replayed line's colour appears in most columns of the plot area.
    let magenta = (0..w)
        .filter(|&x| {
            (0..h).any(|y| {
                let i = (y * w + x) * 3;
                rgb[i] == 200 && rgb[i + 1] == 0 && rgb[i + 2] == 140
            })
        })
        .count();
    assert!(magenta > w / 2, "replayed line in {magenta} columns");
}
