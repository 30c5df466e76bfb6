//! The active-memory timeline rendered without a browser, as SVG or PNG.
//!
//! For CI logs, reports and bug trackers, where nobody opens a viewer. The picture is the
//! viewer's main plot, drawn the same way: per pixel column, the allocations live at the
//! column's right edge stacked in allocation order and coloured by stream, a grey
//! envelope up to the column's maximum (allocations born and dead within the column), and
//! reserved bytes as a dark line. The x axis is the event index.

use crate::error::VizError;
use crate::limits::{Budget, OverBudget};
use crate::model::{DeviceSnapshot, Snapshot};
use crate::timeline::{Counter, Timeline};
use std::collections::BTreeSet;
use std::fmt::Write as _;
use std::io::Write;
use std::path::Path;

/// The viewer's palette (Tableau 10), by stream index.
const PALETTE: [[u8; 3]; 10] = [
    [0x4e, 0x79, 0xa7],
    [0xf2, 0x8e, 0x2c],
    [0xe1, 0x57, 0x59],
    [0x76, 0xb7, 0xb2],
    [0x59, 0xa1, 0x4f],
    [0xed, 0xc9, 0x49],
    [0xaf, 0x7a, 0xa1],
    [0xff, 0x9d, 0xa7],
    [0x9c, 0x75, 0x5f],
    [0xba, 0xb0, 0xab],
];
const WHITE: [u8; 3] = [255, 255, 255];
const ENVELOPE: [u8; 3] = [220, 220, 225];

/// What a pixel of the plot area holds.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Cell {
    Empty,
    Envelope,
    /// An allocation: its stream and its index (for the shade).
    Alloc(u32, u32),
}

/// The plot area, column-major, row 0 at the bottom.
struct Grid {
    w: usize,
    h: usize,
    cells: Vec<Cell>,
    /// Per column: the largest reserved value of the column.
    reserved: Vec<u64>,
    /// Bytes at the top row.
    ymax: u64,
}

fn build_grid(device: &DeviceSnapshot, t: &Timeline, w: usize, h: usize) -> Grid {
    let n = t.len();
    let bnd: Vec<usize> = (0..=w).map(|c| (n * c).div_ceil(w)).collect();
    let counter_max = |k: Counter, initial: u64| -> Vec<u64> {
        (0..w)
            .map(|c| {
                let entry = if bnd[c] > 0 {
                    t.value(k, bnd[c] - 1)
                } else {
                    initial
                };
                (bnd[c]..bnd[c + 1])
                    .map(|i| t.value(k, i))
                    .fold(entry, u64::max)
            })
            .collect()
    };
    let act = counter_max(Counter::Active, t.initial[Counter::Active as usize]);
    let reserved = counter_max(Counter::Reserved, t.initial[Counter::Reserved as usize]);
    let ymax = act
        .iter()
        .chain(&reserved)
        .copied()
        .max()
        .unwrap_or(0)
        .max(1);
    let ymax = ymax.saturating_add(ymax / 20);
    let bpr = ymax as f64 / h as f64;

    // Which allocation starts and ends at each event.
    let mut start_at = vec![u32::MAX; n];
    let mut end_at = vec![u32::MAX; n];
    let mut live: BTreeSet<u32> = BTreeSet::new();
    for (k, a) in t.allocs.iter().enumerate() {
        match a.start {
            Some(s) => start_at[s as usize] = k as u32,
            None => {
                live.insert(k as u32);
            }
        }
        if let Some(e) = a.end {
            end_at[e as usize] = k as u32;
        }
    }
    let _ = device;
    let mut cells = vec![Cell::Empty; w * h];
    for c in 0..w {
        for i in bnd[c]..bnd[c + 1] {
            if end_at[i] != u32::MAX {
                live.remove(&end_at[i]);
            }
            if start_at[i] != u32::MAX {
                live.insert(start_at[i]);
            }
        }
        let col = &mut cells[c * h..(c + 1) * h];
        let (mut cum, mut row) = (0u64, 0usize);
        for &k in &live {
            if row >= h {
                break;
            }
            let a = &t.allocs[k as usize];
            cum += a.size;
            let top = ((cum as f64 / bpr) as usize).min(h);
            while row < top {
                col[row] = Cell::Alloc(a.stream, k);
                row += 1;
            }
        }
        let env = ((act[c] as f64 / bpr) as usize).min(h);
        while row < env {
            col[row] = Cell::Envelope;
            row += 1;
        }
    }
    Grid {
        w,
        h,
        cells,
        reserved,
        ymax,
    }
}

fn shade(stream: u32, k: u32) -> [u8; 3] {
    let f = 0.82 + (k.wrapping_mul(2_654_435_761) % 1000) as f64 / 1000.0 * 0.3;
    PALETTE[stream as usize % PALETTE.len()].map(|x| (x as f64 * f).min(255.0) as u8)
}

fn fmt_bytes(b: f64) -> String {
    let units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let (mut v, mut i) = (b, 0);
    while v >= 1024.0 && i < units.len() - 1 {
        v /= 1024.0;
        i += 1;
    }
    format!("{v:.1} {}", units[i])
}

/// The device a plot shows: the first one with events, else the first.
fn pick(snapshot: &Snapshot) -> Option<&DeviceSnapshot> {
    snapshot
        .devices
        .iter()
        .find(|d| !d.trace.is_empty())
        .or(snapshot.devices.first())
}

const MARGIN_L: usize = 80;
const MARGIN_B: usize = 24;
const MARGIN_T: usize = 24;

/// The timeline as an SVG document, `width` × `height` pixels.
pub fn render_svg(snapshot: &Snapshot, width: usize, height: usize) -> String {
    render_svg_within(snapshot, width, height, &mut Budget::default()).unwrap_or_default()
}

/// [`render_svg`], what it builds per event charged to `budget`.
pub fn render_svg_within(
    snapshot: &Snapshot,
    width: usize,
    height: usize,
    budget: &mut Budget,
) -> Result<String, OverBudget> {
    let mut s = String::new();
    let _ = write!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" font-size="11"><rect width="100%" height="100%" fill="white"/>"#
    );
    let Some(device) = pick(snapshot) else {
        s.push_str("<text x=\"10\" y=\"20\">empty snapshot</text></svg>");
        return Ok(s);
    };
    let t = timeline_within(device, budget)?;
    let (w, h) = (
        width.saturating_sub(MARGIN_L + 8).max(10),
        height.saturating_sub(MARGIN_T + MARGIN_B).max(10),
    );
    let g = build_grid(device, &t, w, h);
    let y_of = |row: usize| MARGIN_T + h - row;
    // One rect per run of same-stream cells in a column (shades are for the PNG).
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
                MARGIN_L + c,
                y_of(row),
                row - start
            );
        }
    }
    let yv = |v: u64| MARGIN_T as f64 + h as f64 - v as f64 / g.ymax as f64 * h as f64;
    s.push_str(r##"<polyline fill="none" stroke="#333" stroke-dasharray="4 3" points=""##);
    for (c, &v) in g.reserved.iter().enumerate() {
        let _ = write!(s, "{},{:.1} ", MARGIN_L + c, yv(v));
    }
    s.push_str("\"/>");
    for k in 0..=4 {
        let v = g.ymax as f64 / 1.05 * k as f64 / 4.0;
        let y = yv(v as u64);
        let _ = write!(
            s,
            r#"<text x="{}" y="{:.1}" text-anchor="end">{}</text>"#,
            MARGIN_L - 4,
            y + 4.0,
            fmt_bytes(v)
        );
    }
    let n = t.len();
    for k in 0..=5 {
        let _ = write!(
            s,
            r#"<text x="{}" y="{}" text-anchor="{}">#{}</text>"#,
            MARGIN_L + w * k / 5,
            height - 6,
            if k == 5 { "end" } else { "middle" },
            n * k / 5
        );
    }
    let peak = t.peak(Counter::Active).map_or(0, |p| p.1);
    let res = t.peak(Counter::Reserved).map_or(0, |p| p.1);
    let _ = write!(
        s,
        r#"<text x="{MARGIN_L}" y="16">cuda:{} — {} events, peak active {}, peak reserved {} (dashed); colours: streams {}</text></svg>"#,
        device.device,
        n,
        fmt_bytes(peak as f64),
        fmt_bytes(res as f64),
        t.streams
            .iter()
            .map(|s| format!("{s:#x}"))
            .collect::<Vec<_>>()
            .join(", ")
    );
    Ok(s)
}

/// A 5×7 bitmap font for the axis labels of PNGs: rows top to bottom, bit 4 leftmost.
fn glyph(c: char) -> Option<[u8; 7]> {
    Some(match c {
        '0' => [0x0E, 0x11, 0x13, 0x15, 0x19, 0x11, 0x0E],
        '1' => [0x04, 0x0C, 0x04, 0x04, 0x04, 0x04, 0x0E],
        '2' => [0x0E, 0x11, 0x01, 0x02, 0x04, 0x08, 0x1F],
        '3' => [0x1F, 0x02, 0x04, 0x02, 0x01, 0x11, 0x0E],
        '4' => [0x02, 0x06, 0x0A, 0x12, 0x1F, 0x02, 0x02],
        '5' => [0x1F, 0x10, 0x1E, 0x01, 0x01, 0x11, 0x0E],
        '6' => [0x06, 0x08, 0x10, 0x1E, 0x11, 0x11, 0x0E],
        '7' => [0x1F, 0x01, 0x02, 0x04, 0x08, 0x08, 0x08],
        '8' => [0x0E, 0x11, 0x11, 0x0E, 0x11, 0x11, 0x0E],
        '9' => [0x0E, 0x11, 0x11, 0x0F, 0x01, 0x02, 0x0C],
        '.' => [0, 0, 0, 0, 0, 0x0C, 0x0C],
        '#' => [0x0A, 0x0A, 0x1F, 0x0A, 0x1F, 0x0A, 0x0A],
        'K' => [0x11, 0x12, 0x14, 0x18, 0x14, 0x12, 0x11],
        'M' => [0x11, 0x1B, 0x15, 0x15, 0x11, 0x11, 0x11],
        'G' => [0x0E, 0x11, 0x10, 0x17, 0x11, 0x11, 0x0F],
        'T' => [0x1F, 0x04, 0x04, 0x04, 0x04, 0x04, 0x04],
        'i' => [0x04, 0x00, 0x0C, 0x04, 0x04, 0x04, 0x0E],
        'B' => [0x1E, 0x11, 0x11, 0x1E, 0x11, 0x11, 0x1E],
        _ => return None, // drawn as a space
    })
}

/// Draws `text` with its top-left corner at `(x, y)`, 6 pixels per character.
fn draw_text(put: &mut impl FnMut(usize, usize, [u8; 3]), x: usize, y: usize, text: &str) {
    for (k, c) in text.chars().enumerate() {
        let Some(rows) = glyph(c) else { continue };
        for (r, bits) in rows.iter().enumerate() {
            for b in 0..5 {
                if bits & (0x10 >> b) != 0 {
                    put(x + k * 6 + b, y + r, [30, 30, 30]);
                }
            }
        }
    }
}

/// The timeline as RGB pixels (`width` × `height`, row-major, top row first), with byte
/// and event-index labels on the axes.
pub fn render_rgb(snapshot: &Snapshot, width: usize, height: usize) -> Vec<u8> {
    render_rgb_within(snapshot, width, height, &mut Budget::default()).unwrap_or_default()
}

/// [`render_rgb`], what it builds per event charged to `budget`.
pub fn render_rgb_within(
    snapshot: &Snapshot,
    width: usize,
    height: usize,
    budget: &mut Budget,
) -> Result<Vec<u8>, OverBudget> {
    let mut px = vec![255u8; width * height * 3];
    let Some(device) = pick(snapshot) else {
        return Ok(px);
    };
    let t = timeline_within(device, budget)?;
    let (ml, mr, mt, mb) = (66, 24, 8, 16);
    let (w, h) = (
        width.saturating_sub(ml + mr).max(1),
        height.saturating_sub(mt + mb).max(1),
    );
    let g = build_grid(device, &t, w, h);
    let mut put = |x: usize, y: usize, c: [u8; 3]| {
        if x < width && y < height {
            let i = (y * width + x) * 3;
            px[i..i + 3].copy_from_slice(&c);
        }
    };
    for c in 0..g.w {
        for row in 0..g.h {
            let colour = match g.cells[c * g.h + row] {
                Cell::Empty => WHITE,
                Cell::Envelope => ENVELOPE,
                Cell::Alloc(st, k) => shade(st, k),
            };
            put(ml + c, mt + g.h - 1 - row, colour);
        }
        let r = (g.reserved[c] as f64 / g.ymax as f64 * g.h as f64) as usize;
        if (c / 4) % 2 == 0 {
            put(ml + c, mt + g.h - r.min(g.h), [40, 40, 40]);
        }
    }
    // Axes.
    for y in mt..mt + g.h {
        put(ml - 1, y, [0, 0, 0]);
    }
    for x in ml - 1..ml + g.w {
        put(x, mt + g.h, [0, 0, 0]);
    }
    for k in 0..=4 {
        let v = g.ymax as f64 / 1.05 * k as f64 / 4.0;
        let y = mt + g.h - ((v / g.ymax as f64) * g.h as f64) as usize;
        let label = fmt_bytes(v);
        let x = (ml - 4).saturating_sub(label.len() * 6);
        draw_text(&mut put, x, y.saturating_sub(3), &label);
        for dx in 1..4 {
            put(ml - 1 - dx, y, [0, 0, 0]);
        }
    }
    let n = t.len();
    for k in 0..=5 {
        let label = format!("#{}", n * k / 5);
        let cx = ml + g.w * k / 5;
        let x = cx
            .saturating_sub(label.len() * 3)
            .min(width.saturating_sub(label.len() * 6));
        draw_text(&mut put, x, mt + g.h + 5, &label);
        for dy in 1..4 {
            put(cx, mt + g.h + dy, [0, 0, 0]);
        }
    }
    Ok(px)
}

/// The timeline of `device` and the plot's per-event tables, charged to `budget` (the
/// pixels are bounded by [`MAX_PIXELS`], not by the file).
fn timeline_within(device: &DeviceSnapshot, budget: &mut Budget) -> Result<Timeline, OverBudget> {
    let t = Timeline::build_within(device, budget)?;
    budget.charge_for("drawing the plot", 8 * t.len() as u64)?;
    Ok(t)
}

/// The most pixels an image may have (`width * height`): rendering holds about 16 bytes
/// per pixel, so this keeps a plot within a few hundred MB.
pub const MAX_PIXELS: usize = 16_000_000;

/// Writes the timeline of `snapshot` to `path`: SVG or PNG by the name's extension. An
/// image of more than [`MAX_PIXELS`] is refused before anything is drawn.
pub fn plot(snapshot: &Snapshot, path: &Path, width: usize, height: usize) -> Result<(), VizError> {
    if width.checked_mul(height).is_none_or(|n| n > MAX_PIXELS) {
        return Err(VizError::Write {
            path: path.into(),
            what: format!(
                "an image of {width} x {height} pixels exceeds the limit of {MAX_PIXELS} \
                 pixels (width times height)"
            ),
        });
    }
    let ext = path
        .extension()
        .and_then(|e| e.to_str())
        .map(str::to_ascii_lowercase);
    // What a plot builds per event is charged to what is left of the file's budget.
    let mut budget = snapshot.budget.clone();
    let over = |over: OverBudget| VizError::Limit {
        path: path.into(),
        what: over.to_string(),
    };
    match ext.as_deref() {
        Some("svg") => {
            let svg = render_svg_within(snapshot, width, height, &mut budget).map_err(over)?;
            crate::output::write_whole(path, |out| {
                out.write_all(svg.as_bytes())
                    .map_err(|e| VizError::io(path, e))
            })
        }
        Some("png") => {
            let rgb = render_rgb_within(snapshot, width, height, &mut budget).map_err(over)?;
            crate::output::write_whole(path, |out| {
                let mut enc = png::Encoder::new(out, width as u32, height as u32);
                enc.set_color(png::ColorType::Rgb);
                enc.set_depth(png::BitDepth::Eight);
                let io = |e: png::EncodingError| VizError::io(path, std::io::Error::other(e));
                let mut writer = enc.write_header().map_err(io)?;
                writer.write_image_data(&rgb).map_err(io)?;
                writer.finish().map_err(io)
            })
        }
        _ => Err(VizError::Unrepresentable {
            format: "plot",
            what: format!(
                "{}: the output name must end in .svg or .png",
                path.display()
            ),
        }),
    }
}
