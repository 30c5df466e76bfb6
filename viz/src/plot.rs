//! The active-memory timeline rendered without a browser, as SVG or PNG.
//!
//! For CI logs, reports and bug trackers, where nobody opens a viewer. The picture is the
//! viewer's main plot, drawn the same way: per pixel column, the allocations live at the
//! column's right edge stacked in allocation order and coloured by stream, a grey
//! envelope up to the column's maximum (allocations born and dead within the column), and
//! reserved bytes as a dark dashed line. A picture read on its own must explain itself, so
//! it carries a title, a legend (what each colour and line is, with the peaks), axis
//! titles with units, and a label at the end of each line. With a replay overlay
//! ([`crate::overlay`]) it also draws the reserved memory streamalloc reaches on the same
//! requests and the live memory, with the saving in the legend.
//!
//! Both renderers draw one [`Figure`]: its texts, then a layout for the image's size (the
//! legend wraps), then the grid of the plot area: [`crate::plot_svg`] and
//! [`crate::plot_png`] draw it.
//!
//! A plot is a stage built from the file like the viewer's data: its timeline and its
//! per-event tables are charged to what is left of the file's memory budget
//! ([`crate::limits::Budget`]); the pixels are bounded by [`MAX_PIXELS`], not by the file.

use crate::error::VizError;
use crate::limits::{Budget, OverBudget};
use crate::model::{DeviceSnapshot, Snapshot};
use crate::overlay::ReplayOverlay;
use crate::timeline::{Counter, Timeline};
use std::collections::BTreeSet;
use std::io::Write;
use std::path::Path;

pub(crate) use crate::plot_axes::{byte_unit, count, event_ticks, spread, ticks};

/// The viewer's palette (Tableau 10), by stream index.
pub(crate) const PALETTE: [[u8; 3]; 10] = [
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
pub(crate) const WHITE: [u8; 3] = [255, 255, 255];
pub(crate) const ENVELOPE: [u8; 3] = [220, 220, 225];
pub(crate) const INK: [u8; 3] = [30, 30, 30];

/// What a pixel of the plot area holds.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum Cell {
    Empty,
    Envelope,
    /// An allocation: its stream and its index (for the shade).
    Alloc(u32, u32),
}

/// The plot area, column-major, row 0 at the bottom.
pub(crate) struct Grid {
    pub(crate) w: usize,
    pub(crate) h: usize,
    pub(crate) cells: Vec<Cell>,
    /// Per column: the largest reserved value of the column.
    pub(crate) reserved: Vec<u64>,
    /// Per column: the largest active (live) value of the column.
    pub(crate) active: Vec<u64>,
    /// Per column: the largest replayed reserved value, with an overlay.
    pub(crate) replayed: Option<Vec<u64>>,
    /// Bytes at the top row.
    pub(crate) ymax: u64,
}

/// What the budget calls drawing a plot.
const STAGE: &str = "drawing the plot";
/// What one allocation live in a pixel column costs in the set that stacks them (a B-tree
/// of `u32`, its nodes at least half full).
const LIVE_SET_ENTRY_BYTES: u64 = 16;

/// The grid of a plot area `w` × `h` of `t`, its per-event tables charged to `budget` while
/// it is drawn (and given back once it is).
fn build_grid(
    t: &Timeline,
    w: usize,
    h: usize,
    overlay: Option<&ReplayOverlay>,
    budget: &mut Budget,
) -> Result<Grid, OverBudget> {
    let n = t.len();
    // Which allocation starts and ends at each event, and the set of those live.
    let tables =
        2 * size_of::<u32>() as u64 * n as u64 + LIVE_SET_ENTRY_BYTES * t.allocs.len() as u64;
    budget.charge_for(STAGE, tables)?;
    let grid = draw_grid(t, w, h, overlay);
    budget.release(tables);
    Ok(grid)
}

fn draw_grid(t: &Timeline, w: usize, h: usize, overlay: Option<&ReplayOverlay>) -> Grid {
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
    let replayed: Option<Vec<u64>> =
        overlay.map(|o| (0..w).map(|c| o.column_max(bnd[c], bnd[c + 1])).collect());
    let ymax = act
        .iter()
        .chain(&reserved)
        .chain(replayed.iter().flatten())
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
        active: act,
        replayed,
        ymax,
    }
}

pub(crate) fn shade(stream: u32, k: u32) -> [u8; 3] {
    let f = 0.82 + (k.wrapping_mul(2_654_435_761) % 1000) as f64 / 1000.0 * 0.3;
    PALETTE[stream as usize % PALETTE.len()].map(|x| (x as f64 * f).min(255.0) as u8)
}

pub(crate) fn fmt_bytes(b: f64) -> String {
    let units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let (mut v, mut i) = (b, 0);
    while v >= 1024.0 && i < units.len() - 1 {
        v /= 1024.0;
        i += 1;
    }
    format!("{v:.1} {}", units[i])
}

/// The device a plot shows: the first one with events, else the first. `plot --replay`
/// replays this one.
pub fn shown_device(snapshot: &Snapshot) -> Option<&DeviceSnapshot> {
    snapshot
        .devices
        .iter()
        .find(|d| !d.trace.is_empty())
        .or(snapshot.devices.first())
}

/// What a plot shows besides the snapshot.
#[derive(Clone, Copy, Debug, Default)]
pub struct PlotOptions<'a> {
    /// The snapshot's name (its file name), for the title.
    pub name: Option<&'a str>,
    /// A replayed allocator to draw over the recording, for [`shown_device`].
    pub overlay: Option<&'a ReplayOverlay>,
}

/// How a line of the plot is drawn.
#[derive(Clone, Debug)]
pub(crate) struct Line {
    /// Its SVG element's id.
    pub(crate) id: &'static str,
    /// The label at its right end.
    pub(crate) label: &'static str,
    pub(crate) colour: [u8; 3],
    pub(crate) width: f64,
    pub(crate) dashed: bool,
    /// Per column of the plot area, bytes.
    pub(crate) values: Vec<u64>,
}

/// The sample drawn before a legend entry's text.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Swatch {
    /// A filled square of this colour.
    Fill([u8; 3]),
    /// A short stretch of [`Figure::lines`]' line of this index.
    Line(usize),
    /// None: the entry is a remark.
    Text,
}

/// Everything a plot says, before it is laid out and drawn.
pub(crate) struct Figure {
    pub(crate) title: String,
    pub(crate) legend: Vec<(Swatch, String)>,
    pub(crate) y_title: String,
    pub(crate) x_title: &'static str,
    pub(crate) lines: Vec<Line>,
    /// Events of the trace (the x axis runs from 0 to this).
    pub(crate) events: usize,
}

const RECORDED_COLOUR: [u8; 3] = [20, 20, 20];
const REPLAYED_COLOUR: [u8; 3] = [200, 0, 140];
const LIVE_COLOUR: [u8; 3] = [20, 50, 140];
/// Streams named one by one in the legend; the rest are counted.
const LEGEND_STREAMS: usize = 6;

impl Figure {
    /// The texts and line styles of a plot of `device` (timeline `t`).
    fn new(device: &DeviceSnapshot, t: &Timeline, options: &PlotOptions<'_>) -> Figure {
        let name = options.name.unwrap_or("snapshot");
        let n = t.len();
        let peak_active = t.peak(Counter::Active).map_or(0, |p| p.1);
        let peak_reserved = t.peak(Counter::Reserved).map_or(0, |p| p.1);
        let mut legend = Vec::new();
        let mut lines = Vec::new();
        let title;
        match options.overlay {
            Some(o) => {
                let whose = match o.recorded_by.as_str() {
                    "PyTorch" => "PyTorch's",
                    _ => "the recorded",
                };
                title = format!(
                    "{name}, cuda:{}: {whose} reserved memory against streamalloc's, replayed \
                     on the same {} events",
                    device.device,
                    count(n)
                );
                let line = |id, label, colour, width, dashed| Line {
                    id,
                    label,
                    colour,
                    width,
                    dashed,
                    values: Vec::new(),
                };
                lines.push(line(
                    "line-recorded-reserved",
                    if o.recorded_by == "PyTorch" {
                        "PyTorch reserved"
                    } else {
                        "recorded reserved"
                    },
                    RECORDED_COLOUR,
                    2.0,
                    true,
                ));
                lines.push(line(
                    "line-replayed-reserved",
                    "streamalloc reserved",
                    REPLAYED_COLOUR,
                    2.0,
                    false,
                ));
                lines.push(line("line-live", "live", LIVE_COLOUR, 1.5, false));
                legend.push((Swatch::Line(0), o.legend.recorded.clone()));
                legend.push((Swatch::Line(1), o.legend.replayed.clone()));
                legend.push((Swatch::Line(2), o.legend.live.clone()));
                let verdict = if o.legend.cap.is_empty() {
                    o.legend.saving.clone()
                } else {
                    format!("{}; {}", o.legend.saving, o.legend.cap)
                };
                legend.push((Swatch::Text, verdict));
            }
            None => {
                title = format!(
                    "{name}, cuda:{}: memory over {} events",
                    device.device,
                    count(n)
                );
                lines.push(Line {
                    id: "line-reserved",
                    label: "reserved",
                    colour: RECORDED_COLOUR,
                    width: 1.5,
                    dashed: true,
                    values: Vec::new(),
                });
                legend.push((
                    Swatch::Line(0),
                    format!(
                        "reserved (in segments): peak {}",
                        fmt_bytes(peak_reserved as f64)
                    ),
                ));
                legend.push((
                    Swatch::Text,
                    format!("peak active (live) {}", fmt_bytes(peak_active as f64)),
                ));
            }
        }
        for (i, s) in t.streams.iter().take(LEGEND_STREAMS).enumerate() {
            legend.push((
                Swatch::Fill(PALETTE[i % PALETTE.len()]),
                format!("allocations on stream {s:#x}"),
            ));
        }
        if t.streams.len() > LEGEND_STREAMS {
            legend.push((
                Swatch::Text,
                format!("and {} more streams", t.streams.len() - LEGEND_STREAMS),
            ));
        }
        legend.push((
            Swatch::Fill(ENVELOPE),
            "allocations shorter than a pixel column".to_string(),
        ));
        Figure {
            title,
            legend,
            y_title: String::new(),
            x_title: "trace events in recorded order (allocations, frees, segment changes)",
            lines,
            events: n,
        }
    }

    /// Fills the lines' values from `grid`, in the order [`Figure::new`] made them.
    fn fill_lines(&mut self, grid: &Grid) {
        let overlay = grid.replayed.is_some();
        for (i, line) in self.lines.iter_mut().enumerate() {
            line.values = match (overlay, i) {
                (true, 1) => grid.replayed.clone().unwrap_or_default(),
                (true, 2) => grid.active.clone(),
                _ => grid.reserved.clone(),
            };
        }
    }
}

/// Where things go in an image of a given size.
pub(crate) struct Layout {
    /// Legend entries' top-left corners.
    pub(crate) legend_at: Vec<(usize, usize)>,
    /// The plot area.
    pub(crate) x: usize,
    pub(crate) y: usize,
    pub(crate) w: usize,
    pub(crate) h: usize,
}

/// Sizes of text, per renderer.
pub(crate) struct TextMetrics {
    /// Width of a character of legend and label text, pixels.
    pub(crate) char_w: f64,
    /// Height of a line of such text.
    pub(crate) line_h: usize,
    /// Height of the title's line.
    pub(crate) title_h: usize,
    /// Width of a legend swatch and the gap after it.
    pub(crate) swatch_w: usize,
}

impl Layout {
    pub(crate) fn new(fig: &Figure, width: usize, height: usize, m: &TextMetrics) -> Layout {
        let text_w = |s: &str| (s.chars().count() as f64 * m.char_w).ceil() as usize;
        let (pad, gap) = (8, 14);
        let mut legend_at = Vec::with_capacity(fig.legend.len());
        let (mut x, mut y) = (pad, pad + m.title_h);
        for (swatch, text) in &fig.legend {
            let w = text_w(text)
                + if matches!(swatch, Swatch::Text) {
                    0
                } else {
                    m.swatch_w
                };
            if x > pad && x + w > width.saturating_sub(pad) {
                x = pad;
                y += m.line_h;
            }
            legend_at.push((x, y));
            x += w + gap;
        }
        // The y axis' title goes on its own line above the plot area.
        let top = y + m.line_h + m.line_h + 4;
        let left = 62;
        let right = fig
            .lines
            .iter()
            .map(|l| text_w(l.label) + 10)
            .max()
            .unwrap_or(0)
            .min(width / 3);
        let bottom = 2 * m.line_h + 10;
        Layout {
            legend_at,
            x: left,
            y: top,
            w: width.saturating_sub(left + right + 4).max(10),
            h: height.saturating_sub(top + bottom).max(10),
        }
    }
}

/// A figure of `snapshot`'s shown device, laid out for `width` × `height` with `metrics`,
/// and its grid; `None` for a snapshot with no device. The timeline and the grid's tables
/// are charged to `budget`.
pub(crate) fn compose(
    snapshot: &Snapshot,
    width: usize,
    height: usize,
    options: &PlotOptions<'_>,
    metrics: &TextMetrics,
    budget: &mut Budget,
) -> Result<Option<(Figure, Layout, Grid, Timeline)>, OverBudget> {
    let Some(device) = shown_device(snapshot) else {
        return Ok(None);
    };
    let t = Timeline::build_within(device, budget)?;
    let mut fig = Figure::new(device, &t, options);
    let layout = Layout::new(&fig, width, height, metrics);
    let grid = build_grid(&t, layout.w, layout.h, options.overlay, budget)?;
    fig.fill_lines(&grid);
    let (unit, _) = byte_unit(grid.ymax);
    fig.y_title = format!("memory ({unit})");
    Ok(Some((fig, layout, grid, t)))
}

/// The timeline as an SVG document, `width` × `height` pixels.
pub fn render_svg(snapshot: &Snapshot, width: usize, height: usize) -> String {
    render_svg_with(snapshot, width, height, &PlotOptions::default())
}

/// The timeline as RGB pixels (`width` × `height`, row-major, top row first), with its
/// title, legend, axes and labels.
pub fn render_rgb(snapshot: &Snapshot, width: usize, height: usize) -> Vec<u8> {
    render_rgb_with(snapshot, width, height, &PlotOptions::default())
}

/// The most pixels an image may have (`width * height`): rendering holds about 16 bytes
/// per pixel, so this keeps a plot within a few hundred MB.
pub const MAX_PIXELS: usize = 16_000_000;

/// Writes the timeline of `snapshot` to `path`: SVG or PNG by the name's extension. An
/// image of more than [`MAX_PIXELS`] is refused before anything is drawn.
pub fn plot(snapshot: &Snapshot, path: &Path, width: usize, height: usize) -> Result<(), VizError> {
    plot_with(snapshot, path, width, height, &PlotOptions::default())
}

/// [`plot`] with `options` (a title's name, a replay overlay).
pub fn plot_with(
    snapshot: &Snapshot,
    path: &Path,
    width: usize,
    height: usize,
    options: &PlotOptions<'_>,
) -> Result<(), VizError> {
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
            let svg =
                render_svg_within(snapshot, width, height, options, &mut budget).map_err(over)?;
            crate::output::write_whole(path, |out| {
                out.write_all(svg.as_bytes())
                    .map_err(|e| VizError::io(path, e))
            })
        }
        Some("png") => {
            let rgb =
                render_rgb_within(snapshot, width, height, options, &mut budget).map_err(over)?;
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

pub use crate::plot_png::{render_rgb_with, render_rgb_within};
pub use crate::plot_svg::{render_svg_with, render_svg_within};
