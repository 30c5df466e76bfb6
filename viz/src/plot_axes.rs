//! The axes of a plot: round ticks, the unit the byte axis counts in, event counts written
//! with separators, and labels moved apart so they do not overlap. Shared by the SVG and
//! PNG renderers ([`crate::plot_svg`], [`crate::plot_png`]) so both read alike.

/// `n` with thousands separated by commas.
pub(crate) fn count(n: usize) -> String {
    let digits = n.to_string();
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

/// Ticks from 0 to `max` at a round step, about `target` of them: `(value, label)`.
pub(crate) fn ticks(max: f64, target: usize) -> Vec<(f64, String)> {
    if max <= 0.0 || !max.is_finite() {
        return vec![(0.0, "0".into())];
    }
    let raw = max / target.max(1) as f64;
    let magnitude = 10f64.powf(raw.log10().floor());
    let step = [1.0, 2.0, 2.5, 5.0, 10.0]
        .iter()
        .map(|m| m * magnitude)
        .find(|s| *s >= raw)
        .unwrap_or(10.0 * magnitude);
    // As many decimals as the step needs (2.5 needs one, 0.25 two).
    let decimals = (0..6)
        .find(|&d| {
            let scaled = step * 10f64.powi(d);
            (scaled - scaled.round()).abs() < 1e-6 * scaled.max(1.0)
        })
        .unwrap_or(6) as usize;
    (0..)
        .map(|k| k as f64 * step)
        .take_while(|v| *v <= max * (1.0 + 1e-9))
        .map(|v| (v, format!("{v:.decimals$}")))
        .collect()
}

/// Ticks of the event axis: whole events from 0 to `events`.
pub(crate) fn event_ticks(events: usize) -> Vec<usize> {
    ticks(events as f64, 6)
        .into_iter()
        .filter(|(v, _)| v.fract() == 0.0)
        .map(|(v, _)| v as usize)
        .collect()
}

/// The unit the y axis counts in for values up to `max` bytes, and its size.
pub(crate) fn byte_unit(max: u64) -> (&'static str, f64) {
    let units = ["bytes", "KiB", "MiB", "GiB", "TiB"];
    let mut i = 0;
    while i + 1 < units.len() && max as f64 >= 1024f64.powi(i as i32 + 1) {
        i += 1;
    }
    (units[i], 1024f64.powi(i as i32))
}

/// Vertical positions for labels wanted at `ys`, moved apart to at least `gap` pixels.
pub(crate) fn spread(ys: &[f64], gap: f64) -> Vec<f64> {
    let mut order: Vec<usize> = (0..ys.len()).collect();
    order.sort_by(|&a, &b| ys[a].total_cmp(&ys[b]));
    let mut out = ys.to_vec();
    for k in 1..order.len() {
        let (prev, cur) = (order[k - 1], order[k]);
        if out[cur] < out[prev] + gap {
            out[cur] = out[prev] + gap;
        }
    }
    out
}
