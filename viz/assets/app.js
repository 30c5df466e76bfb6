// streamalloc memory viewer. No dependencies, no network beyond the local server.
//
// Data arrive as typed-array columns (see viz/src/wire.rs), turned into what drawing needs
// by prepare.js (decodeBlob, prepareData), linear in events and streams. Drawing is per pixel column
// (level of detail): for each column the allocations live at its right edge are stacked
// in allocation order into an ImageData, so the cost is O(visible events + width × live),
// whatever the number of events; allocations that lived and died inside one column show
// as the grey envelope of the column's maximum.
'use strict';

const $ = id => document.getElementById(id);
/** Streams named in the legend; the others are counted. */
const LEGEND_STREAMS = 20;
const PALETTE = ['#4e79a7', '#f28e2c', '#e15759', '#76b7b2', '#59a14f', '#edc949', '#af7aa1',
  '#ff9da7', '#9c755f', '#bab0ab'];
// State for tests and for the curious: window.__viz.
const V = window.__viz = {ready: false, openMs: null, drawMs: null, range: null, drawn: 0,
  error: null, hovered: null};

// Drawings over the timeline from other scripts of the page (replay.js registers one):
// each has load(file, device), yMax(d, bnd) and draw(ctx, geometry).
const overlays = window.__vizOverlays || (window.__vizOverlays = []);

let files = [];
let D = null; // current data
let C = null; // compare data
let view = {x0: 0, x1: 1};
let instant = 0;
let drag = null;

// ---- Formatting ----

function fmtBytes(b) {
  const u = ['B', 'KiB', 'MiB', 'GiB', 'TiB'];
  let i = 0;
  let v = b;
  while (Math.abs(v) >= 1024 && i < u.length - 1) { v /= 1024; i++; }
  return `${v.toFixed(i ? 1 : 0)} ${u[i]}`;
}
function fmtTime(ns) {
  if (ns >= 1e9) return `${(ns / 1e9).toFixed(3)} s`;
  if (ns >= 1e6) return `${(ns / 1e6).toFixed(3)} ms`;
  if (ns >= 1e3) return `${(ns / 1e3).toFixed(1)} µs`;
  return `${ns.toFixed(0)} ns`;
}
const hex = v => '0x' + v.toString(16);

// ---- Loading ----

async function fetchData(f, d) {
  const resp = await fetch(`/api/data?f=${f}&d=${d}`);
  if (!resp.ok) {
    const why = (await resp.text()).trim();
    throw new Error(`server answered ${resp.status} for file ${f} device ${d}${why ? `: ${why}` : ''}`);
  }
  const {h, c} = decodeBlob(await resp.arrayBuffer());
  return prepareData(h, c);
}

// ---- Coordinates ----

function domain(d) {
  return V.xmode === 'time' ? [0, Math.max(d.tEnd, 1)] : [0, Math.max(d.n, 1)];
}
// Number of events whose x is below `x`: the state after them is the state at `x`.
function eventsBefore(d, x) {
  if (V.xmode !== 'time') return Math.max(0, Math.min(d.n, Math.ceil(x)));
  const t = d.c.ev_time;
  let lo = 0, hi = d.n;
  while (lo < hi) { const mid = (lo + hi) >> 1; if (t[mid] < x) lo = mid + 1; else hi = mid; }
  return lo;
}
function xOfEvent(d, i) { return V.xmode === 'time' ? d.c.ev_time[i] : i + 0.5; }
// Column boundaries: bnd[c] events are applied at the left edge of column c.
function boundaries(d, W, x0, x1) {
  const b = new Int32Array(W + 1);
  for (let col = 0; col <= W; col++) b[col] = eventsBefore(d, x0 + (x1 - x0) * col / W);
  return b;
}
function valueAt(d, arr, init, b) { return b > 0 ? arr[b - 1] : init; }
// Per column maximum of a counter over the events the column covers (and its state on entry).
function columnMax(d, arr, init, bnd) {
  const W = bnd.length - 1, out = new Float64Array(W);
  for (let col = 0; col < W; col++) {
    let v = valueAt(d, arr, init, bnd[col]);
    for (let i = bnd[col]; i < bnd[col + 1]; i++) if (arr[i] > v) v = arr[i];
    out[col] = v;
  }
  return out;
}

// ---- Colours ----

function rgb(hexs) {
  const v = parseInt(hexs.slice(1), 16);
  return [(v >> 16) & 255, (v >> 8) & 255, v & 255];
}
const PAL = PALETTE.map(rgb);
function pack(r, g, b) { return (255 << 24 | b << 16 | g << 8 | r) >>> 0; }
function computeColours(d) {
  const m = d.m, col = new Uint32Array(m), pend = new Uint32Array(m);
  for (let a = 0; a < m; a++) {
    let base;
    if (V.colour === 'site') {
      const st = d.c.al_stack[a];
      base = PAL[(st >= 0 ? d.siteOf[st] : 9) % PAL.length];
    } else {
      base = PAL[d.c.al_stream[a] % PAL.length];
    }
    // Neighbouring bands differ slightly in shade so that they can be told apart.
    const f = 0.82 + ((Math.imul(a, 2654435761) >>> 0) % 1000) / 1000 * 0.3;
    const [r, g, b] = base.map(x => Math.min(255, Math.round(x * f)));
    col[a] = pack(r, g, b);
    pend[a] = pack((r + 255 * 3) >> 2, (g + 80) >> 2, (b + 80) >> 2);
  }
  d.col = col; d.pend = pend;
}

// ---- Canvas helpers ----

function sized(canvas) {
  const w = Math.max(50, canvas.clientWidth | 0), h = Math.max(20, canvas.clientHeight | 0);
  if (canvas.width !== w || canvas.height !== h) { canvas.width = w; canvas.height = h; }
  return [w, h];
}
const PAD_L = 90; // left margin for the axis labels

// ---- The timeline ----

function drawTimeline() {
  const t0 = performance.now();
  const d = D, canvas = $('timeline'), ctx = canvas.getContext('2d');
  const [CW, CH] = sized(canvas);
  const W = CW - PAD_L, H = CH - 16;
  const bnd = boundaries(d, W, view.x0, view.x1);
  const actMax = columnMax(d, d.active, d.init.active, bnd);
  const resMax = columnMax(d, d.reserved, d.init.reserved, bnd);
  let ymax = 1;
  for (let i = 0; i < W; i++) ymax = Math.max(ymax, actMax[i], resMax[i]);
  let cmpAct = null, cmpRes = null;
  if (C) {
    const cb = boundaries(C, W, view.x0, view.x1);
    cmpAct = columnMax(C, C.active, C.init.active, cb);
    cmpRes = columnMax(C, C.reserved, C.init.reserved, cb);
    for (let i = 0; i < W; i++) ymax = Math.max(ymax, cmpAct[i], cmpRes[i]);
  }
  for (const o of overlays) ymax = Math.max(ymax, o.yMax(d, bnd));
  ymax *= 1.05;
  const bpr = ymax / H; // bytes per pixel row
  const img = ctx.createImageData(W, H);
  const px = new Uint32Array(img.data.buffer);
  px.fill(0xffffffff);
  const ENV = pack(220, 220, 225);

  // Live allocations in allocation order, as a linked list over allocation indices.
  const m = d.m, next = new Int32Array(m + 1), prev = new Int32Array(m + 1), HEAD = m;
  next[HEAD] = HEAD; prev[HEAD] = HEAD;
  const link = a => { const p = prev[HEAD]; next[p] = a; prev[a] = p; next[a] = HEAD; prev[HEAD] = a; };
  const unlink = a => { next[prev[a]] = next[a]; prev[next[a]] = prev[a]; next[a] = -1; };
  next.fill(-1, 0, m);
  const c = d.c, b0 = bnd[0];
  for (let a = 0; a < m; a++) {
    const s = c.al_start[a], e = c.al_end[a];
    if ((s < 0 || s < b0) && (e < 0 || e >= b0)) link(a);
  }
  let drawn = 0;
  let prevState = -1;
  for (let col = 0; col < W; col++) {
    const lo = bnd[col], hi = bnd[col + 1];
    for (let i = lo; i < hi; i++) {
      const e = d.endAt[i];
      if (e >= 0 && next[e] !== -1) unlink(e);
      const s = d.startAt[i];
      if (s >= 0) link(s);
    }
    if (hi === prevState && col > 0) {
      // Same state as the column before: copy it.
      for (let r = 0; r < H; r++) px[r * W + col] = px[r * W + col - 1];
      continue;
    }
    prevState = hi;
    let cum = 0, row = 0;
    for (let a = next[HEAD]; a !== HEAD && row < H; a = next[a]) {
      cum += c.al_size[a];
      const top = Math.min(H, Math.floor(cum / bpr));
      if (top > row) {
        const fr = c.al_fr[a];
        const colr = fr >= 0 && fr < hi ? d.pend[a] : d.col[a];
        for (; row < top; row++) px[(H - 1 - row) * W + col] = colr;
      }
    }
    drawn += row;
    const envTop = Math.min(H, Math.floor(actMax[col] / bpr));
    for (; row < envTop; row++) px[(H - 1 - row) * W + col] = ENV;
  }
  ctx.clearRect(0, 0, CW, CH);
  ctx.putImageData(img, PAD_L, 0);
  const yOf = v => H - v / ymax * H;
  // Reserved (segments) as a line.
  ctx.strokeStyle = '#333'; ctx.lineWidth = 1; ctx.setLineDash([4, 3]);
  ctx.beginPath();
  for (let i = 0; i < W; i++) ctx.lineTo(PAD_L + i + 0.5, yOf(resMax[i]));
  ctx.stroke(); ctx.setLineDash([]);
  if (C) {
    ctx.strokeStyle = '#c00'; ctx.lineWidth = 1.5; ctx.beginPath();
    for (let i = 0; i < W; i++) ctx.lineTo(PAD_L + i + 0.5, yOf(cmpAct[i]));
    ctx.stroke();
    ctx.strokeStyle = '#c00'; ctx.setLineDash([2, 2]); ctx.beginPath();
    for (let i = 0; i < W; i++) ctx.lineTo(PAD_L + i + 0.5, yOf(cmpRes[i]));
    ctx.stroke(); ctx.setLineDash([]);
  }
  for (const o of overlays) o.draw(ctx, {d, bnd, W, H, left: PAD_L, yOf, actMax, resMax});
  // Axes.
  ctx.fillStyle = '#333'; ctx.font = '10px sans-serif'; ctx.textAlign = 'right';
  for (let k = 0; k <= 4; k++) {
    const v = ymax / 1.05 * k / 4;
    ctx.fillText(fmtBytes(v), PAD_L - 4, yOf(v) + 3);
    ctx.fillRect(PAD_L - 3, Math.round(yOf(v)), 3, 1);
  }
  ctx.textAlign = 'center';
  for (let k = 0; k <= 5; k++) {
    const x = view.x0 + (view.x1 - view.x0) * k / 5;
    const label = V.xmode === 'time' ? fmtTime(x) : `#${Math.floor(x)}`;
    ctx.fillText(label, Math.min(CW - 30, PAD_L + W * k / 5 + (k === 0 ? 20 : 0)), CH - 3);
  }
  // The peak and the chosen instant.
  const mark = (i, colr) => {
    if (i < 0 || i >= d.n) return;
    const x = (xOfEvent(d, i) - view.x0) / (view.x1 - view.x0) * W;
    if (x < 0 || x > W) return;
    ctx.fillStyle = colr; ctx.fillRect(PAD_L + x, 0, 1, H);
  };
  if (d.h.peak.active) mark(d.h.peak.active[0], 'rgba(200,0,0,0.6)');
  mark(instant, 'rgba(0,0,0,0.8)');
  if (drag && drag.brush) {
    ctx.fillStyle = 'rgba(80,120,200,0.2)';
    const a = Math.min(drag.x, drag.cur) - PAD_L, b = Math.max(drag.x, drag.cur) - PAD_L;
    ctx.fillRect(PAD_L + a, 0, b - a, H);
  }
  const span = view.x1 - view.x0;
  $('range').textContent = V.xmode === 'time'
    ? `(${fmtTime(view.x0)} – ${fmtTime(view.x1)}, ${bnd[W] - bnd[0]} events)`
    : `(events ${Math.floor(view.x0)} – ${Math.ceil(view.x1)})`;
  V.range = [view.x0, view.x1];
  V.span = span;
  V.drawn = drawn;
  V.drawMs = performance.now() - t0;
  d.last = {bnd, W, H, ymax, bpr};
}

// The allocation under pixel (x, y) of the timeline, if any.
function allocAt(x, y) {
  const d = D, L = d.last;
  if (!L) return null;
  const col = Math.floor(x - PAD_L);
  if (col < 0 || col >= L.W || y < 0 || y >= L.H) return null;
  const b = L.bnd[col + 1];
  const bytes = (L.H - y) * L.bpr;
  const c = d.c;
  let cum = 0;
  for (let a = 0; a < d.m; a++) {
    const s = c.al_start[a], e = c.al_end[a];
    if ((s < 0 || s < b) && (e < 0 || e >= b)) {
      cum += c.al_size[a];
      if (cum > bytes) return {a, b};
    }
  }
  return null;
}

function describeAlloc(d, a, b) {
  const c = d.c, h = d.h;
  const ev = i => (i < 0 ? 'before the trace' : `event #${i} (${fmtTime(c.ev_time[i])})`);
  const st = c.al_stack[a];
  const frames = st >= 0 ? h.stacks[st].map(f => `  ${f[1]}:${f[2]} ${f[0]}`).join('\n') : '  (no call stack recorded)';
  const fr = c.al_fr[a];
  const state = b === undefined ? '' : (fr >= 0 && fr < b ? ' — freed, awaiting other streams' : '');
  return `allocation ${hex(c.al_addr[a])}${state}\n` +
    `size      ${fmtBytes(c.al_size[a])} (${c.al_size[a]} bytes)\n` +
    `stream    ${h.streams[c.al_stream[a]]}` +
    (c.al_owner[a] !== c.al_stream[a] ? ` (segment of ${h.streams[c.al_owner[a]]})` : '') + '\n' +
    `allocated ${ev(c.al_start[a])}\n` +
    `freed     ${fr >= 0 ? ev(fr) : c.al_end[a] >= 0 ? ev(c.al_end[a]) : 'never (live at the end)'}\n` +
    `reusable  ${c.al_end[a] >= 0 ? ev(c.al_end[a]) : 'not in the trace'}\n` +
    `frames:\n${frames}`;
}

// ---- Overview (whole range, with the current view as a brush) ----

function drawOverview() {
  const d = D, canvas = $('overview'), ctx = canvas.getContext('2d');
  const [CW, CH] = sized(canvas);
  const W = CW - PAD_L;
  const [x0, x1] = domain(d);
  if (!d.ovBnd || d.ovBnd.length !== W + 1 || d.ovMode !== V.xmode) {
    d.ovBnd = boundaries(d, W, x0, x1);
    d.ovMode = V.xmode;
    d.ovAct = columnMax(d, d.active, d.init.active, d.ovBnd);
    d.ovRes = columnMax(d, d.reserved, d.init.reserved, d.ovBnd);
  }
  let ymax = 1;
  for (let i = 0; i < W; i++) ymax = Math.max(ymax, d.ovAct[i], d.ovRes[i]);
  ctx.clearRect(0, 0, CW, CH);
  ctx.fillStyle = '#9bb3d1';
  for (let i = 0; i < W; i++) {
    const hgt = d.ovAct[i] / ymax * (CH - 2);
    ctx.fillRect(PAD_L + i, CH - hgt, 1, hgt);
  }
  ctx.fillStyle = '#333';
  for (let i = 0; i < W; i++) ctx.fillRect(PAD_L + i, CH - 1 - d.ovRes[i] / ymax * (CH - 2), 1, 1);
  const a = (view.x0 - x0) / (x1 - x0) * W, b = (view.x1 - x0) / (x1 - x0) * W;
  ctx.fillStyle = 'rgba(80,120,200,0.25)';
  ctx.fillRect(PAD_L + a, 0, Math.max(2, b - a), CH);
  ctx.fillStyle = '#333'; ctx.font = '10px sans-serif'; ctx.textAlign = 'right';
  ctx.fillText('whole trace', PAD_L - 4, CH / 2 + 3);
}

// ---- Lanes ----

function drawLanes() {
  const d = D, canvas = $('lanes'), ctx = canvas.getContext('2d');
  const [CW] = sized(canvas);
  const W = CW - PAD_L;
  const bnd = d.last ? d.last.bnd : boundaries(d, W, view.x0, view.x1);
  const lanes = [];
  // The streams with the most cached bytes get a lane each; the others share one.
  const cs = d.cached;
  for (const s of cs.lanes) lanes.push({label: `cached ${d.h.streams[s]}`, max: b => cachedColumnMax(cs, s, b), colr: PALETTE[s % 10]});
  if (cs.others) lanes.push({label: `cached, ${cs.others} more`, arr: cs.rest, init: cs.rest0, colr: '#bab0ab'});
  lanes.push({label: 'pending frees', arr: d.pending, init: d.init.pending, colr: '#e15759'});
  lanes.push({label: 'staging', arr: d.staging, init: 0, colr: '#59a14f'});
  lanes.push({label: 'waits / OOM', ticks: true});
  const LH = 22;
  const CH = lanes.length * LH + 2;
  if (canvas.height !== CH) { canvas.style.height = CH + 'px'; canvas.height = CH; }
  ctx.clearRect(0, 0, CW, CH);
  ctx.font = '10px sans-serif'; ctx.textAlign = 'right';
  V.laneLabels = [];
  lanes.forEach((lane, k) => {
    const y0 = k * LH;
    ctx.fillStyle = '#f3f3f6'; ctx.fillRect(PAD_L, y0 + 1, W, LH - 2);
    ctx.fillStyle = '#333';
    const lines = fitLabel(ctx, lane.label, PAD_L - 8);
    lines.forEach((text, i) => ctx.fillText(text, PAD_L - 4, y0 + LH / 2 + 3 + (i - (lines.length - 1) / 2) * 10));
    V.laneLabels.push({label: lane.label, lines, width: Math.max(...lines.map(t => ctx.measureText(t).width)), right: PAD_L - 4});
    if (lane.ticks) {
      const tick = (i, colr) => {
        const x = (xOfEvent(d, i) - view.x0) / (view.x1 - view.x0) * W;
        if (x >= 0 && x <= W) { ctx.fillStyle = colr; ctx.fillRect(PAD_L + x, y0 + 2, 1, LH - 4); }
      };
      for (const i of d.waits) tick(i, '#f28e2c');
      for (const i of d.ooms) tick(i, '#c00');
      return;
    }
    const mx = lane.max ? lane.max(bnd) : columnMax(d, lane.arr, lane.init, bnd);
    let top = 0;
    for (let i = 0; i < W; i++) top = Math.max(top, mx[i]);
    ctx.fillStyle = lane.colr;
    if (top > 0) {
      for (let i = 0; i < W; i++) {
        const hgt = mx[i] / top * (LH - 4);
        if (hgt > 0) ctx.fillRect(PAD_L + i, y0 + LH - 2 - hgt, 1, hgt);
      }
    }
    const label = `max ${fmtBytes(top)}`;
    ctx.textAlign = 'left';
    const tw = ctx.measureText(label).width;
    ctx.fillStyle = 'rgba(255,255,255,0.85)'; ctx.fillRect(PAD_L + W - tw - 8, y0 + 2, tw + 6, 12);
    ctx.fillStyle = '#333'; ctx.fillText(label, PAD_L + W - tw - 5, y0 + 12);
    ctx.textAlign = 'right';
  });
}

// A lane's label within `max` pixels: whole, else on two lines at its first space, each
// shortened in the middle (where a stream handle's digits matter least) until it fits.
function fitLabel(ctx, label, max) {
  const fits = t => ctx.measureText(t).width <= max;
  if (fits(label)) return [label];
  const cut = label.indexOf(' ');
  const lines = cut > 0 ? [label.slice(0, cut), label.slice(cut + 1)] : [label];
  return lines.map(t => {
    let keep = t.length;
    while (keep > 2 && !fits(shorten(t, keep))) keep--;
    return shorten(t, keep);
  });
}
function shorten(text, keep) {
  if (keep >= text.length) return text;
  const head = Math.ceil((keep - 1) / 2);
  return text.slice(0, head) + '…' + text.slice(text.length - (keep - 1 - head));
}

// ---- Segment map and summary at the chosen instant ----

function liveAt(d, b) {
  const c = d.c, out = [];
  for (let a = 0; a < d.m; a++) {
    const s = c.al_start[a], e = c.al_end[a];
    if ((s < 0 || s < b) && (e < 0 || e >= b)) out.push(a);
  }
  return out;
}

function drawSegmap() {
  const d = D, canvas = $('segmap'), ctx = canvas.getContext('2d');
  const [CW, CH] = sized(canvas);
  const b = Math.min(d.n, instant + 1);
  const c = d.c;
  const segs = [];
  for (let g = 0; g < d.h.segments; g++) {
    const s = c.sg_start[g], e = c.sg_end[g];
    if ((s < 0 || s < b) && (e < 0 || e >= b)) segs.push(g);
  }
  segs.sort((x, y) => c.sg_addr[x] - c.sg_addr[y]);
  // Contiguous mappings of one stream (an expandable segment's pages) show as one segment.
  const shown = [];
  for (const g of segs) {
    const last = shown[shown.length - 1];
    if (last && last.addr + last.size === c.sg_addr[g] && last.stream === c.sg_stream[g]) {
      last.size += c.sg_size[g];
    } else {
      shown.push({addr: c.sg_addr[g], size: c.sg_size[g], stream: c.sg_stream[g]});
    }
  }
  // Ranges of sleeping memory pools: no memory, addresses and blocks kept (hatched).
  for (const z of sleepingAt(d, b)) shown.push(z);
  shown.sort((x, y) => x.addr - y.addr);
  let total = 0, asleep = 0, maxSeg = 1;
  for (const sg of shown) {
    if (sg.asleep) asleep += sg.size; else total += sg.size;
    maxSeg = Math.max(maxSeg, sg.size);
  }
  const rowBytes = Math.max(maxSeg, total / 8);
  let row = 0, used = 0;
  const gap = rowBytes * 0.004;
  for (const sg of shown) {
    if (used + sg.size > rowBytes && used > 0) { row++; used = 0; }
    sg.row = row; sg.off = used;
    used += sg.size + gap;
  }
  const rows = row + 1, rh = Math.min(28, (CH - 4) / rows);
  const sx = (CW - 8) / rowBytes;
  ctx.clearRect(0, 0, CW, CH);
  for (const sg of shown) {
    sg.x = 4 + sg.off * sx; sg.y = 2 + sg.row * rh;
    ctx.fillStyle = sg.asleep ? hatch(ctx) : '#f4f4f4';
    ctx.fillRect(sg.x, sg.y, sg.size * sx, rh - 3);
    ctx.strokeStyle = sg.asleep ? '#77a' : '#999';
    ctx.strokeRect(sg.x + 0.5, sg.y + 0.5, Math.max(1, sg.size * sx - 1), rh - 4);
  }
  const live = liveAt(d, b);
  const segOf = addr => {
    let lo = 0, hi = shown.length - 1;
    while (lo <= hi) {
      const mid = (lo + hi) >> 1, sg = shown[mid];
      if (addr < sg.addr) hi = mid - 1;
      else if (addr >= sg.addr + sg.size) lo = mid + 1;
      else return sg;
    }
    return null;
  };
  const blocks = [];
  for (const a of live) {
    const w = segOf(c.al_addr[a]);
    if (!w) continue;
    const x = w.x + (c.al_addr[a] - w.addr) * sx;
    const pending = c.al_fr[a] >= 0 && c.al_fr[a] < b;
    ctx.fillStyle = pending ? '#e15759' : '#' + (d.col[a] & 0xffffff).toString(16).padStart(6, '0').replace(/(..)(..)(..)/, '$3$2$1');
    ctx.globalAlpha = w.asleep ? 0.35 : 1;
    ctx.fillRect(x, w.y + 1, Math.max(1, c.al_size[a] * sx), rh - 5);
    ctx.globalAlpha = 1;
    if (pending) { ctx.fillStyle = '#000'; ctx.fillRect(x, w.y + rh - 6, Math.max(1, c.al_size[a] * sx), 2); }
    blocks.push({a, x, y: w.y, w: Math.max(1, c.al_size[a] * sx)});
  }
  d.segLayout = {rh, sx, blocks, segs: shown.length, total, asleep};
  const sleeping = asleep ? `, ${fmtBytes(asleep)} asleep (hatched: given back, addresses kept)` : '';
  $('instant').textContent = `#${instant} — ${shown.length} segments, ${fmtBytes(total)} reserved${sleeping} (red: freed, awaiting other streams' events)`;
}

// Sleeping ranges at instant b (streamalloc's sleep/wake), as segments flagged asleep.
function sleepingAt(d, b) {
  const c = d.c, out = [];
  for (let z = 0; z < (d.h.sleeping || 0); z++) {
    const s = c.sl_start[z], e = c.sl_end[z];
    if ((s < 0 || s < b) && (e < 0 || e >= b)) {
      out.push({addr: c.sl_addr[z], size: c.sl_size[z], stream: -1, asleep: true});
    }
  }
  return out;
}

// A diagonal hatch for sleeping ranges.
function hatch(ctx) {
  if (!hatch.pattern) {
    const tile = document.createElement('canvas');
    tile.width = tile.height = 6;
    const t = tile.getContext('2d');
    t.fillStyle = '#eef'; t.fillRect(0, 0, 6, 6);
    t.strokeStyle = '#99b'; t.beginPath(); t.moveTo(0, 6); t.lineTo(6, 0); t.stroke();
    hatch.pattern = ctx.createPattern(tile, 'repeat');
  }
  return hatch.pattern;
}

function drawSummary() {
  const d = D, c = d.c, b = Math.min(d.n, instant + 1);
  const live = liveAt(d, b);
  let act = 0, pend = 0;
  for (const a of live) { act += c.al_size[a]; if (c.al_fr[a] >= 0 && c.al_fr[a] < b) pend += c.al_size[a]; }
  const res = valueAt(d, d.reserved, d.init.reserved, b);
  live.sort((x, y) => c.al_size[y] - c.al_size[x]);
  const sites = new Map();
  for (const a of live) {
    const st = c.al_stack[a];
    const key = st >= 0 ? d.site[st] : '(no stack)';
    const s = sites.get(key) || {bytes: 0, count: 0};
    s.bytes += c.al_size[a]; s.count++;
    sites.set(key, s);
  }
  // Every text from a file (stream names, call sites) goes in through textContent, never
  // as HTML: a snapshot is anyone's file.
  const box = $('summary');
  box.replaceChildren();
  const table = (id) => {
    const t = el('table');
    if (id) t.id = id;
    box.append(t);
    return t;
  };
  const title = text => box.append(el('div', 'title', text));
  let t = table();
  row(t, ['active', fmtBytes(act)], [1]);
  row(t, ['reserved', fmtBytes(res)], [1]);
  const asleep = sleepingAt(d, b).reduce((sum, z) => sum + z.size, 0);
  if (asleep) row(t, ['asleep (given back)', fmtBytes(asleep)], [1]);
  row(t, ['pending frees', fmtBytes(pend)], [1]);
  row(t, ['live allocations', String(live.length)], [1]);
  if (d.h.peak.active) row(t, ['peak active', `${fmtBytes(d.h.peak.active[1])} at #${d.h.peak.active[0]}`], [1]);
  if (d.h.peak.reserved) row(t, ['peak reserved', fmtBytes(d.h.peak.reserved[1])], [1]);
  if (C && C.h.peak.active) {
    row(t, ['compare: peak active', fmtBytes(C.h.peak.active[1])], [1]);
    row(t, ['compare: peak reserved', fmtBytes(C.h.peak.reserved ? C.h.peak.reserved[1] : 0)], [1]);
  }
  title('Largest allocations');
  t = table();
  for (const a of live.slice(0, 10)) {
    const st = c.al_stack[a];
    row(t, [fmtBytes(c.al_size[a]), d.h.streams[c.al_stream[a]], st >= 0 ? d.site[st] : '(no stack)'], [0]);
  }
  title('By call site');
  t = table();
  for (const [k, s] of [...sites].sort((x, y) => y[1].bytes - x[1].bytes).slice(0, 10)) {
    row(t, [fmtBytes(s.bytes), `${s.count}×`, k], [0, 1]);
  }
  if (C && C.h.peak.active && d.h.peak.active) {
    // Bytes by call site at each snapshot's own peak, largest differences first.
    const bySite = (x, b) => {
      const m = new Map();
      for (const a of liveAt(x, b)) {
        const st = x.c.al_stack[a];
        const key = st >= 0 ? x.site[st] : '(no stack)';
        m.set(key, (m.get(key) || 0) + x.c.al_size[a]);
      }
      return m;
    };
    const mine = bySite(d, d.h.peak.active[0] + 1), theirs = bySite(C, C.h.peak.active[0] + 1);
    const keys = new Set([...mine.keys(), ...theirs.keys()]);
    const rows = [...keys].map(k => [k, mine.get(k) || 0, theirs.get(k) || 0])
      .sort((x, y) => Math.abs(y[1] - y[2]) - Math.abs(x[1] - x[2])).slice(0, 10);
    title('At each peak, by call site: this file vs. compared');
    t = table('compare-table');
    for (const [k, a, b] of rows) row(t, [fmtBytes(a), fmtBytes(b), k], [0, 1]);
  }
  $('sumat').textContent = `#${instant}` + (d.n ? ` (${fmtTime(c.ev_time[Math.min(instant, d.n - 1)])})` : '');
}

function drawLegend() {
  const d = D;
  const box = $('legend');
  box.replaceChildren();
  const item = (colour, text) => {
    const swatch = el('span', 'sw');
    if (colour) swatch.style.background = colour;
    const div = el('div');
    div.append(swatch, text);
    box.append(div);
  };
  if (V.colour === 'site') {
    [...d.siteIds.keys()].slice(0, 10).forEach((s, i) => item(PALETTE[i % 10], s));
  } else {
    // A trace may have thousands of streams: the first few name their colours.
    const shown = Math.min(d.h.streams.length, LEGEND_STREAMS);
    d.h.streams.slice(0, shown).forEach((s, i) => item(PALETTE[i % 10], `stream ${s}`));
    if (d.h.streams.length > shown) box.append(el('div', null, `… and ${d.h.streams.length - shown} more streams (colours repeat every 10)`));
  }
  item('#dcdce1', 'short-lived (within one pixel)');
  box.append(el('div', null, 'dashed line: reserved' + (C ? '; red: compared snapshot (active, reserved dotted)' : '')));
}

/** An element with an optional class and text (set as text, never parsed as HTML). */
function el(tag, cls, text) {
  const e = document.createElement(tag);
  if (cls) e.className = cls;
  if (text !== undefined) e.textContent = text;
  return e;
}

/** Appends a row of text cells to `table`; the cells at `numeric` are right-aligned. */
function row(table, cells, numeric) {
  const tr = el('tr');
  cells.forEach((text, i) => tr.append(el('td', numeric.includes(i) ? 'n' : null, String(text))));
  table.append(tr);
}

/** Replaces the options of `select` with `[value, label]` pairs. */
function setOptions(select, pairs) {
  select.replaceChildren(...pairs.map(([value, label]) => {
    const o = el('option', null, label);
    o.value = value;
    return o;
  }));
}

function drawAll() {
  if (!D) return;
  drawTimeline();
  drawOverview();
  drawLanes();
  drawSegmap();
  drawSummary();
  drawLegend();
}

let pending = false;
function redraw() {
  if (pending) return;
  pending = true;
  requestAnimationFrame(() => { pending = false; if (D) { drawTimeline(); drawOverview(); drawLanes(); } });
}

// ---- Interaction ----

function clampView() {
  const [a, b] = domain(D);
  const minSpan = V.xmode === 'time' ? 1000 : 4;
  let span = Math.max(minSpan, Math.min(b - a, view.x1 - view.x0));
  let x0 = Math.max(a, Math.min(view.x0, b - span));
  view = {x0, x1: x0 + span};
}
function xAtPixel(px) {
  const W = $('timeline').width - PAD_L;
  return view.x0 + (px - PAD_L) / W * (view.x1 - view.x0);
}
function zoomAt(px, factor) {
  const x = xAtPixel(px);
  view = {x0: x - (x - view.x0) * factor, x1: x + (view.x1 - x) * factor};
  clampView();
  redraw();
}
function eventAtPixel(px) {
  const b = eventsBefore(D, xAtPixel(px));
  return Math.max(0, Math.min(D.n - 1, b - 1));
}
function setInstant(i) {
  instant = Math.max(0, Math.min(D.n - 1, i));
  drawSegmap(); drawSummary(); redraw();
}
function jumpToPeak() {
  if (!D.h.peak.active) return;
  const i = D.h.peak.active[0];
  const x = xOfEvent(D, i), span = view.x1 - view.x0;
  view = {x0: x - span / 2, x1: x + span / 2};
  clampView();
  setInstant(i);
}

function install() {
  const tl = $('timeline');
  tl.addEventListener('wheel', e => { e.preventDefault(); zoomAt(e.offsetX, e.deltaY > 0 ? 1.25 : 0.8); }, {passive: false});
  tl.addEventListener('mousedown', e => { drag = {x: e.offsetX, cur: e.offsetX, view: {...view}, brush: e.shiftKey, moved: false}; });
  window.addEventListener('mouseup', e => {
    if (!drag) return;
    const dd = drag;
    drag = null;
    if (dd.brush && Math.abs(dd.cur - dd.x) > 3) {
      const a = xAtPixel(Math.min(dd.x, dd.cur)), b = xAtPixel(Math.max(dd.x, dd.cur));
      view = {x0: a, x1: b}; clampView(); redraw();
    } else if (!dd.moved && e.target === tl) {
      setInstant(eventAtPixel(dd.x));
    }
    redraw();
  });
  tl.addEventListener('mousemove', e => {
    if (drag) {
      drag.cur = e.offsetX;
      if (Math.abs(drag.cur - drag.x) > 3) drag.moved = true;
      if (!drag.brush && drag.moved) {
        const W = tl.width - PAD_L, dx = (e.offsetX - drag.x) / W * (drag.view.x1 - drag.view.x0);
        view = {x0: drag.view.x0 - dx, x1: drag.view.x1 - dx}; clampView();
      }
      redraw();
      return;
    }
    const hit = allocAt(e.offsetX, e.offsetY);
    V.hovered = hit ? hit.a : null;
    $('details').textContent = hit ? describeAlloc(D, hit.a, hit.b)
      : `event #${eventAtPixel(e.offsetX)}: active ${fmtBytes(valueAt(D, D.active, D.init.active, eventAtPixel(e.offsetX) + 1))}, ` +
        `reserved ${fmtBytes(valueAt(D, D.reserved, D.init.reserved, eventAtPixel(e.offsetX) + 1))}`;
  });
  tl.addEventListener('dblclick', () => { view = {x0: domain(D)[0], x1: domain(D)[1]}; redraw(); });
  const ov = $('overview');
  const ovX = px => { const [a, b] = domain(D); return a + (px - PAD_L) / (ov.width - PAD_L) * (b - a); };
  ov.addEventListener('mousedown', e => { drag = {ov: true, x: e.offsetX}; });
  ov.addEventListener('mousemove', e => {
    if (!drag || !drag.ov) return;
    const a = ovX(Math.min(drag.x, e.offsetX)), b = ovX(Math.max(drag.x, e.offsetX));
    if (Math.abs(e.offsetX - drag.x) > 2) { view = {x0: a, x1: b}; clampView(); redraw(); }
  });
  $('segmap').addEventListener('mousemove', e => {
    const L = D && D.segLayout;
    if (!L) return;
    const hit = L.blocks.find(bk => e.offsetX >= bk.x && e.offsetX <= bk.x + bk.w && e.offsetY >= bk.y && e.offsetY <= bk.y + L.rh);
    if (hit) $('details').textContent = describeAlloc(D, hit.a, Math.min(D.n, instant + 1));
  });
  // Arrow keys step the chosen instant one event (ten with shift).
  window.addEventListener('keydown', e => {
    if (!D || e.target.tagName === 'SELECT') return;
    const step = {ArrowLeft: -1, ArrowRight: 1}[e.key];
    if (step) { e.preventDefault(); setInstant(instant + step * (e.shiftKey ? 10 : 1)); }
  });
  $('peak').onclick = jumpToPeak;
  $('reset').onclick = () => { view = {x0: domain(D)[0], x1: domain(D)[1]}; redraw(); };
  $('xmode').onchange = e => {
    // Keep the same events in view when switching axes.
    const i0 = eventsBefore(D, view.x0), i1 = Math.max(i0 + 1, eventsBefore(D, view.x1));
    V.xmode = e.target.value;
    view = {x0: V.xmode === 'time' ? D.c.ev_time[Math.min(i0, D.n - 1)] : i0,
      x1: V.xmode === 'time' ? D.c.ev_time[Math.min(i1, D.n - 1)] : i1};
    clampView(); D.ovBnd = null; drawAll();
  };
  $('colour').onchange = e => { V.colour = e.target.value; computeColours(D); drawAll(); };
  $('file').onchange = () => loadSelected();
  $('device').onchange = () => loadSelected(true);
  $('compare').onchange = async e => {
    const f = e.target.value;
    C = f === '' ? null : await fetchData(Number(f), 0);
    drawAll();
  };
  window.addEventListener('resize', () => { if (D) { D.ovBnd = null; drawAll(); } });
}

async function loadSelected(keepDevice) {
  const f = Number($('file').value);
  const file = files[f];
  const dsel = $('device');
  if (!keepDevice) {
    setOptions(dsel, file.devices.map((d, i) => [String(i), `cuda:${d.device} (${d.events} events)`]));
  }
  const di = Number(dsel.value || 0);
  $('status').textContent = `loading ${file.name}…`;
  const t0 = performance.now();
  D = await fetchData(f, di);
  for (const o of overlays) await o.load(f, di, D);
  computeColours(D);
  view = {x0: domain(D)[0], x1: domain(D)[1]};
  instant = D.h.peak.active ? D.h.peak.active[0] : Math.max(0, D.n - 1);
  drawAll();
  const ms = performance.now() - t0;
  $('status').textContent = `${file.name}: ${D.n} events, ${D.m} allocations, ${D.h.streams.length} streams (${D.h.source}); loaded and drawn in ${ms.toFixed(0)} ms`;
  V.loadMs = ms;
}

async function main() {
  V.xmode = 'event';
  V.colour = 'stream';
  install();
  try {
    files = await (await fetch('/api/files')).json();
    if (!files.length) { $('status').textContent = 'no files'; return; }
    setOptions($('file'), files.map((f, i) => [String(i), f.name]));
    setOptions($('compare'), [['', 'none'], ...files.map((f, i) => [String(i), f.name])]);
    await loadSelected();
    V.openMs = performance.now();
    V.ready = true;
  } catch (err) {
    V.error = String(err);
    $('status').textContent = `error: ${err}`;
    throw err;
  }
}
main();
