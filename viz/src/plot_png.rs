//! The plot as pixels, for PNG output: the same [`Figure`](crate::plot) as the SVG, drawn
//! with the bitmap font of [`crate::font`] (the title at twice its size).

use crate::font;
use crate::limits::{Budget, OverBudget};
use crate::model::Snapshot;
use crate::plot::{
    byte_unit, compose, count, event_ticks, shade, spread, ticks, Cell, Line, PlotOptions, Swatch,
    TextMetrics, ENVELOPE, INK, WHITE,
};

const PNG_METRICS: TextMetrics = TextMetrics {
    char_w: font::ADVANCE as f64,
    line_h: 14,
    title_h: 20,
    swatch_w: 26,
};

/// An RGB image being drawn, row-major, top row first; drawing outside it is ignored.
struct Canvas {
    width: usize,
    height: usize,
    px: Vec<u8>,
}

impl Canvas {
    fn put(&mut self, x: usize, y: usize, c: [u8; 3]) {
        if x < self.width && y < self.height {
            let i = (y * self.width + x) * 3;
            self.px[i..i + 3].copy_from_slice(&c);
        }
    }

    fn fill(&mut self, x: usize, y: usize, w: usize, h: usize, c: [u8; 3]) {
        for yy in y..y + h {
            for xx in x..x + w {
                self.put(xx, yy, c);
            }
        }
    }

    /// `text` with its top-left corner at `(x, y)`, each font pixel `scale` pixels wide.
    fn text(&mut self, x: usize, y: usize, text: &str, scale: usize, c: [u8; 3]) {
        for (k, ch) in text.chars().enumerate() {
            for (r, bits) in font::glyph(ch).iter().enumerate() {
                for b in 0..5 {
                    if bits & (0x10 >> b) != 0 {
                        let gx = x + (k * font::ADVANCE + b) * scale;
                        self.fill(gx, y + r * scale, scale, scale, c);
                    }
                }
            }
        }
    }

    /// A stretch of `line` from column `x0` to `x1` at row `y`, for a legend swatch.
    fn line_sample(&mut self, line: &Line, x0: usize, x1: usize, y: usize) {
        for x in x0..x1 {
            if !line.dashed || (x - x0) % 10 < 6 {
                self.fill(x, y, 1, line.width.round().max(1.0) as usize, line.colour);
            }
        }
    }
}

/// The timeline as RGB pixels (`width` × `height`, row-major, top row first), with
/// `options`.
pub fn render_rgb_with(
    snapshot: &Snapshot,
    width: usize,
    height: usize,
    options: &PlotOptions<'_>,
) -> Vec<u8> {
    render_rgb_within(snapshot, width, height, options, &mut Budget::default()).unwrap_or_default()
}

/// [`render_rgb_with`], what it builds per event charged to `budget` (the pixels are
/// bounded by [`crate::plot::MAX_PIXELS`], not by the file).
pub fn render_rgb_within(
    snapshot: &Snapshot,
    width: usize,
    height: usize,
    options: &PlotOptions<'_>,
    budget: &mut Budget,
) -> Result<Vec<u8>, OverBudget> {
    let mut cv = Canvas {
        width,
        height,
        px: vec![255u8; width * height * 3],
    };
    let Some((fig, l, g, _)) = compose(snapshot, width, height, options, &PNG_METRICS, budget)?
    else {
        return Ok(cv.px);
    };
    // The title at twice the font's size where it fits.
    let scale = if font::width(&fig.title, 2) + 16 <= width {
        2
    } else {
        1
    };
    cv.text(8, 6, &fig.title, scale, INK);
    for ((swatch, text), &(x, y)) in fig.legend.iter().zip(&l.legend_at) {
        let text_x = match *swatch {
            Swatch::Fill(c) => {
                cv.fill(x, y + 1, 18, 8, c);
                x + PNG_METRICS.swatch_w
            }
            Swatch::Line(k) => {
                cv.line_sample(&fig.lines[k], x, x + 20, y + 4);
                x + PNG_METRICS.swatch_w
            }
            Swatch::Text => x,
        };
        cv.text(text_x, y + 1, text, 1, INK);
    }
    // The allocations.
    for c in 0..g.w {
        for row in 0..g.h {
            let colour = match g.cells[c * g.h + row] {
                Cell::Empty => WHITE,
                Cell::Envelope => ENVELOPE,
                Cell::Alloc(st, k) => shade(st, k),
            };
            cv.put(l.x + c, l.y + g.h - 1 - row, colour);
        }
    }
    // The lines: each column joined to the previous one by a vertical run, so that steps
    // stay connected.
    let row_of = |v: u64| {
        let r = (v as f64 / g.ymax as f64 * g.h as f64) as usize;
        l.y + g.h - r.min(g.h)
    };
    for line in &fig.lines {
        let thick = line.width.round().max(1.0) as usize;
        let mut prev = None;
        for (c, &v) in line.values.iter().enumerate() {
            let y = row_of(v);
            if line.dashed && (c / 5) % 2 == 1 {
                prev = None;
                continue;
            }
            let (lo, hi) = prev.map_or((y, y), |p: usize| (p.min(y), p.max(y)));
            cv.fill(
                l.x + c,
                lo.saturating_sub(thick / 2),
                1,
                hi - lo + thick,
                line.colour,
            );
            prev = Some(y);
        }
    }
    let ends: Vec<f64> = fig
        .lines
        .iter()
        .map(|line| line.values.last().map_or(row_of(0), |&v| row_of(v)) as f64 - 3.0)
        .collect();
    for (line, y) in fig.lines.iter().zip(spread(&ends, 11.0)) {
        cv.text(
            l.x + g.w + 6,
            y.max(0.0) as usize,
            line.label,
            1,
            line.colour,
        );
    }
    // Axes, ticks and their titles.
    cv.fill(l.x - 1, l.y, 1, g.h + 1, [0, 0, 0]);
    cv.fill(l.x - 1, l.y + g.h, g.w + 1, 1, [0, 0, 0]);
    let (_, scale) = byte_unit(g.ymax);
    for (v, label) in ticks(g.ymax as f64 / 1.05 / scale, 5) {
        let y = row_of((v * scale) as u64);
        let x = (l.x - 5).saturating_sub(font::width(&label, 1));
        cv.text(x, y.saturating_sub(3), &label, 1, INK);
        cv.fill(l.x - 4, y, 3, 1, [0, 0, 0]);
    }
    cv.text(8, l.y.saturating_sub(14), &fig.y_title, 1, INK);
    for v in event_ticks(fig.events) {
        let cx = l.x + (v as f64 / fig.events.max(1) as f64 * g.w as f64) as usize;
        let label = count(v);
        let x = cx
            .saturating_sub(font::width(&label, 1) / 2)
            .min(width.saturating_sub(font::width(&label, 1)));
        cv.text(x, l.y + g.h + 6, &label, 1, INK);
        cv.fill(cx, l.y + g.h + 1, 1, 3, [0, 0, 0]);
    }
    let title_w = font::width(fig.x_title, 1);
    cv.text(
        (l.x + g.w / 2).saturating_sub(title_w / 2),
        l.y + g.h + 20,
        fig.x_title,
        1,
        INK,
    );
    Ok(cv.px)
}
