//! The plot as an SVG document: the [`Figure`](crate::plot) drawn with text the reader can
//! select and search, each line an element with an id (`line-replayed-reserved`, ...) and
//! a label (`label-replayed-reserved`), so that tests and scripts can read what is drawn.

use crate::limits::{Budget, OverBudget};
use crate::model::Snapshot;
use crate::plot::{
    byte_unit, compose, count, event_ticks, spread, ticks, Cell, Line, PlotOptions, Swatch,
    TextMetrics, ENVELOPE, PALETTE,
};
use std::fmt::Write as _;

const SVG_METRICS: TextMetrics = TextMetrics {
    char_w: 6.4,
    line_h: 16,
    title_h: 20,
    swatch_w: 26,
};

/// `text` with XML's special characters escaped.
fn xml(text: &str) -> String {
    text.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

/// The timeline as an SVG document, `width` × `height` pixels, with `options`.
pub fn render_svg_with(
    snapshot: &Snapshot,
    width: usize,
    height: usize,
    options: &PlotOptions<'_>,
) -> String {
    render_svg_within(snapshot, width, height, options, &mut Budget::default()).unwrap_or_default()
}

/// [`render_svg_with`], what it builds per event charged to `budget` (the document is
/// bounded by the image's pixels, not by the file).
pub fn render_svg_within(
    snapshot: &Snapshot,
    width: usize,
    height: usize,
    options: &PlotOptions<'_>,
    budget: &mut Budget,
) -> Result<String, OverBudget> {
    let mut s = String::new();
    let _ = write!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" font-size="11"><rect width="100%" height="100%" fill="white"/>"#
    );
    let Some((fig, l, g, _)) = compose(snapshot, width, height, options, &SVG_METRICS, budget)?
    else {
        s.push_str(
            "<title>empty snapshot</title><text x=\"10\" y=\"20\">empty snapshot</text></svg>",
        );
        return Ok(s);
    };
    // The title at 14 pixels, smaller where that would not fit.
    let size = ((width.saturating_sub(16)) as f64 / (0.62 * fig.title.chars().count() as f64))
        .clamp(9.0, 14.0);
    let title = xml(&fig.title);
    let _ = write!(
        s,
        r#"<title>{title}</title><text id="title" x="8" y="18" font-size="{size:.0}" font-weight="bold">{title}</text>"#
    );
    let rgb = |c: [u8; 3]| format!("rgb({},{},{})", c[0], c[1], c[2]);
    let stroke = |line: &Line| {
        format!(
            r#"fill="none" stroke="{}" stroke-width="{}"{}"#,
            rgb(line.colour),
            line.width,
            if line.dashed {
                r#" stroke-dasharray="6 4""#
            } else {
                ""
            }
        )
    };
    // The legend.
    s.push_str(r#"<g id="legend">"#);
    for ((swatch, text), &(x, y)) in fig.legend.iter().zip(&l.legend_at) {
        let text_x = match *swatch {
            Swatch::Fill(c) => {
                let _ = write!(
                    s,
                    r#"<rect x="{x}" y="{}" width="18" height="10" fill="{}"/>"#,
                    y + 2,
                    rgb(c)
                );
                x + SVG_METRICS.swatch_w
            }
            Swatch::Line(k) => {
                let _ = write!(
                    s,
                    r#"<line x1="{x}" y1="{0}" x2="{1}" y2="{0}" {2}/>"#,
                    y + 7,
                    x + 20,
                    stroke(&fig.lines[k])
                );
                x + SVG_METRICS.swatch_w
            }
            Swatch::Text => x,
        };
        let _ = write!(
            s,
            r#"<text x="{text_x}" y="{}">{}</text>"#,
            y + 11,
            xml(text)
        );
    }
    s.push_str("</g>");
    // The allocations: one rect per run of same-stream cells in a column (shades are for
    // the PNG).
    let y_of = |row: usize| l.y + g.h - row;
    for c in 0..g.w {
        let col = &g.cells[c * g.h..(c + 1) * g.h];
        let mut row = 0;
        while row < g.h {
            let key = match col[row] {
                Cell::Empty => {
                    row += 1;
                    continue;
                }
                Cell::Envelope => None,
                Cell::Alloc(st, _) => Some(st),
            };
            let start = row;
            while row < g.h
                && match col[row] {
                    Cell::Alloc(st, _) => Some(st) == key,
                    Cell::Envelope => key.is_none(),
                    Cell::Empty => false,
                }
            {
                row += 1;
            }
            let [r, gg, b] = key.map_or(ENVELOPE, |st| PALETTE[st as usize % PALETTE.len()]);
            let _ = write!(
                s,
                r#"<rect x="{}" y="{}" width="1" height="{}" fill="rgb({r},{gg},{b})"/>"#,
                l.x + c,
                y_of(row),
                row - start
            );
        }
    }
    // The lines, each labelled at its right end.
    let yv = |v: u64| l.y as f64 + g.h as f64 - v as f64 / g.ymax as f64 * g.h as f64;
    for line in &fig.lines {
        let _ = write!(s, r#"<polyline id="{}" {} points=""#, line.id, stroke(line));
        for (c, &v) in line.values.iter().enumerate() {
            let _ = write!(s, "{:.1},{:.1} ", l.x as f64 + c as f64 + 0.5, yv(v));
        }
        s.push_str("\"/>");
    }
    let ends: Vec<f64> = fig
        .lines
        .iter()
        .map(|line| line.values.last().map_or(yv(0), |&v| yv(v)) + 4.0)
        .collect();
    for (line, y) in fig.lines.iter().zip(spread(&ends, 13.0)) {
        let _ = write!(
            s,
            r#"<text id="label-{}" x="{}" y="{y:.1}" fill="{}">{}</text>"#,
            line.id.trim_start_matches("line-"),
            l.x + g.w + 6,
            rgb(line.colour),
            line.label
        );
    }
    // Axes, ticks and their titles.
    let _ = write!(
        s,
        "<path d=\"M{0} {1}V{2}H{3}\" fill=\"none\" stroke=\"#000\"/>",
        l.x,
        l.y,
        l.y + g.h,
        l.x + g.w
    );
    let (_, scale) = byte_unit(g.ymax);
    for (v, label) in ticks(g.ymax as f64 / 1.05 / scale, 5) {
        let y = yv((v * scale) as u64);
        let _ = write!(
            s,
            r##"<text x="{}" y="{:.1}" text-anchor="end">{label}</text><line x1="{}" y1="{y:.1}" x2="{}" y2="{y:.1}" stroke="#000"/>"##,
            l.x - 5,
            y + 4.0,
            l.x - 3,
            l.x
        );
    }
    let _ = write!(
        s,
        r#"<text id="y-title" x="{}" y="{}" font-weight="bold">{}</text>"#,
        8,
        l.y - 8,
        xml(&fig.y_title)
    );
    for v in event_ticks(fig.events) {
        let x = l.x as f64 + v as f64 / fig.events.max(1) as f64 * g.w as f64;
        let label = count(v);
        let _ = write!(
            s,
            r##"<text x="{x:.1}" y="{}" text-anchor="middle">{label}</text><line x1="{x:.1}" y1="{}" x2="{x:.1}" y2="{}" stroke="#000"/>"##,
            l.y + g.h + 15,
            l.y + g.h,
            l.y + g.h + 3
        );
    }
    let _ = write!(
        s,
        r#"<text id="x-title" x="{}" y="{}" text-anchor="middle" font-weight="bold">{}</text></svg>"#,
        l.x + g.w / 2,
        l.y + g.h + 31,
        fig.x_title
    );
    Ok(s)
}
