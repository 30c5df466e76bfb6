// `streamalloc view --replay`: streamalloc's reserved memory, replayed on the simulated
// device, drawn over the recorded timeline, with a legend of each peak, the saving and the
// lowest cap under which the replay completes. The figures and the legend's words come
// from the server (viz/src/overlay.rs); this file fetches them with each file and device
// and draws. It plugs into app.js through window.__vizOverlays (load, yMax, draw), so the
// timeline's own drawing stays in app.js. Loaded before app.js.
'use strict';

(() => {
  // The plotter's colours (viz/src/plot.rs), so that pictures and page agree.
  const LINES = {
    recorded: {colour: '#141414', width: 2, dash: [6, 4]},
    replayed: {colour: '#c8008c', width: 2, dash: []},
    live: {colour: '#14328c', width: 1.5, dash: []},
  };
  let overlay = null; // the server's ReplayOverlay for the file and device shown
  let columns = null; // its per-column maxima for the last drawing

  // The most replayed reserved bytes over events first..end and on entry to them, at the
  // series' resolution (ReplayOverlay::column_max).
  function columnMax(o, first, end) {
    const b = Math.max(1, o.bucket), pts = o.reserved;
    const point = e => (Math.floor(e / b) < pts.length ? pts[Math.floor(e / b)] : o.initial_reserved);
    let v = first === 0 ? o.initial_reserved : point(first - 1);
    if (end > first) {
      const last = Math.min(Math.floor((end - 1) / b), pts.length - 1);
      for (let p = Math.floor(first / b); p <= last; p++) if (pts[p] > v) v = pts[p];
    }
    return v;
  }

  function el(tag, cls, text) {
    const e = document.createElement(tag);
    if (cls) e.className = cls;
    if (text !== undefined) e.textContent = text;
    return e;
  }

  // The legend above the timeline: one entry per line, then the verdict. Text goes in as
  // text only.
  function renderLegend() {
    let box = document.getElementById('replay-legend');
    if (!box) {
      box = el('div');
      box.id = 'replay-legend';
      const timeline = document.getElementById('timeline');
      timeline.parentNode.insertBefore(box, timeline);
    }
    box.replaceChildren();
    box.hidden = !overlay;
    if (!overlay) return;
    const entry = (kind, text) => {
      const item = el('span', 'replay-entry');
      item.dataset.line = kind;
      if (LINES[kind]) {
        const sw = el('span', 'replay-swatch');
        const l = LINES[kind];
        sw.style.borderTop = `${Math.ceil(l.width) + 1}px ${l.dash.length ? 'dashed' : 'solid'} ${l.colour}`;
        item.append(sw);
      }
      item.append(text);
      box.append(item);
    };
    const g = overlay.legend;
    entry('recorded', g.recorded);
    entry('replayed', g.replayed);
    entry('live', g.live);
    entry('saving', g.saving);
    if (g.cap) entry('cap', g.cap);
  }

  function line(ctx, geo, values, style) {
    ctx.save();
    ctx.strokeStyle = style.colour;
    ctx.lineWidth = style.width;
    ctx.setLineDash(style.dash);
    ctx.beginPath();
    for (let i = 0; i < geo.W; i++) ctx.lineTo(geo.left + i + 0.5, geo.yOf(values[i]));
    ctx.stroke();
    ctx.restore();
  }

  // A label at the right end of a line, on a white box so that it reads over the bands.
  function label(ctx, geo, text, y, colour) {
    ctx.save();
    ctx.font = 'bold 11px sans-serif';
    ctx.textAlign = 'right';
    const w = ctx.measureText(text).width;
    const x = geo.left + geo.W - 6;
    ctx.fillStyle = 'rgba(255,255,255,0.85)';
    ctx.fillRect(x - w - 3, y - 10, w + 6, 13);
    ctx.fillStyle = colour;
    ctx.fillText(text, x, y);
    ctx.restore();
  }

  const hooks = {
    async load(f, d) {
      overlay = null;
      columns = null;
      // No overlay (404: view without --replay) or none readable: the timeline as it is.
      try {
        const resp = await fetch(`/api/replay?f=${f}&d=${d}`);
        if (resp.ok) overlay = await resp.json();
      } catch (err) {
        overlay = null;
      }
      renderLegend();
      window.__viz.replay = overlay ? {legend: overlay.legend, drawn: null} : null;
    },
    yMax(d, bnd) {
      if (!overlay) return 0;
      const W = bnd.length - 1;
      columns = new Float64Array(W);
      let top = 0;
      for (let c = 0; c < W; c++) {
        columns[c] = columnMax(overlay, bnd[c], bnd[c + 1]);
        if (columns[c] > top) top = columns[c];
      }
      return top;
    },
    draw(ctx, geo) {
      if (!overlay || !columns) return;
      line(ctx, geo, geo.resMax, LINES.recorded);
      line(ctx, geo, geo.actMax, LINES.live);
      line(ctx, geo, columns, LINES.replayed);
      // Labels where the lines end, moved apart so that none hides another.
      const last = geo.W - 1;
      const wanted = [
        [overlay.recorded_by === 'PyTorch' ? 'PyTorch reserved' : 'recorded reserved', geo.yOf(geo.resMax[last]), LINES.recorded.colour],
        ['streamalloc reserved', geo.yOf(columns[last]), LINES.replayed.colour],
        ['live', geo.yOf(geo.actMax[last]), LINES.live.colour],
      ].sort((a, b) => a[1] - b[1]);
      let prev = -Infinity;
      for (const [text, y, colour] of wanted) {
        const at = Math.max(y - 4, prev + 14, 12);
        label(ctx, geo, text, at, colour);
        prev = at;
      }
      window.__viz.replay = {legend: overlay.legend, drawn: {
        recorded: geo.W, replayed: columns.length, live: geo.W,
        colours: {recorded: LINES.recorded.colour, replayed: LINES.replayed.colour, live: LINES.live.colour},
      }};
    },
  };
  (window.__vizOverlays = window.__vizOverlays || []).push(hooks);
})();
