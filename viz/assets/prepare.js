// streamalloc memory viewer: from the blob the server sends (viz/src/wire.rs) to what the
// page draws. Kept apart from the drawing (app.js) so that node can run it too: the fuzz
// target tests/browser/fuzz_prepare.mjs feeds it hostile blobs.
//
// Everything here is linear in the trace: per-event arrays (counters) and per-allocation
// arrays, but nothing per stream and per event. Each stream's cached bytes are kept as the
// events where they change (a trace of 20,000 streams and 200,000 events holds a few
// hundred thousand change points, not four billion values), and only the streams shown
// in a lane are ever drawn.
'use strict';

/** Streams with a lane of their own (the most cached bytes); the rest share one lane. */
const MAX_STREAM_LANES = 8;

/** A blob the page cannot use: thrown by decodeBlob and prepareData. */
class MalformedData extends Error {
  constructor(what) { super(`malformed viewer data: ${what}`); this.name = 'MalformedData'; }
}

const COLUMN_TYPES = {f64: Float64Array, i32: Int32Array, u32: Uint32Array, u16: Uint16Array, u8: Uint8Array};

/** The header and the typed-array columns of a blob (an ArrayBuffer). */
function decodeBlob(buf) {
  if (!(buf instanceof ArrayBuffer) || buf.byteLength < 4) throw new MalformedData('shorter than its header length');
  const len = new DataView(buf).getUint32(0, true);
  if (4 + len > buf.byteLength) throw new MalformedData('header past the end');
  let h;
  try {
    h = JSON.parse(new TextDecoder().decode(new Uint8Array(buf, 4, len)));
  } catch (e) {
    throw new MalformedData(`header is not JSON (${e.message})`);
  }
  if (!h || typeof h !== 'object' || !h.columns || typeof h.columns !== 'object') throw new MalformedData('no column directory');
  const base = (4 + len + 7) & ~7;
  const c = Object.create(null);
  for (const [name, col] of Object.entries(h.columns)) {
    const T = col && Object.prototype.hasOwnProperty.call(COLUMN_TYPES, col.type) ? COLUMN_TYPES[col.type] : null;
    if (!T) throw new MalformedData(`column ${name}: unknown type`);
    const off = col.offset, n = col.len;
    if (!Number.isSafeInteger(off) || !Number.isSafeInteger(n) || off < 0 || n < 0 || off % 8 !== 0) {
      throw new MalformedData(`column ${name}: bad offset or length`);
    }
    if (base + off + n * T.BYTES_PER_ELEMENT > buf.byteLength) throw new MalformedData(`column ${name}: past the end`);
    c[name] = new T(buf, base + off, n);
  }
  return {h, c};
}

/** Checks what drawing relies on: counts, column lengths, indices in range. */
function validate(h, c) {
  const count = k => {
    if (!Number.isSafeInteger(h[k]) || h[k] < 0) throw new MalformedData(`${k} is not a count`);
    return h[k];
  };
  const n = count('events'), m = count('allocs'), k = count('segments');
  // Ranges of sleeping memory pools (streamalloc's sleep and wake): a blob without them
  // has none.
  if (h.sleeping === undefined) h.sleeping = 0;
  const z = count('sleeping');
  if (!Array.isArray(h.streams) || !Array.isArray(h.actions) || !Array.isArray(h.frames) || !Array.isArray(h.stacks)) {
    throw new MalformedData('streams, actions, frames or stacks missing');
  }
  if (!h.peak || typeof h.peak !== 'object') throw new MalformedData('peak missing');
  const want = {
    ev_time: n, ev_action: n, ev_stream: n, ev_addr: n, ev_size: n,
    al_start: m, al_fr: m, al_end: m, al_addr: m, al_size: m, al_stream: m, al_owner: m, al_stack: m,
    sg_start: k, sg_end: k, sg_addr: k, sg_size: k, sg_stream: k,
  };
  if (z > 0) Object.assign(want, {sl_start: z, sl_end: z, sl_addr: z, sl_size: z});
  for (const [name, len] of Object.entries(want)) {
    if (!c[name] || c[name].length !== len) throw new MalformedData(`column ${name} missing or of the wrong length`);
  }
  const ns = h.streams.length;
  const inRange = (col, hi, what) => {
    for (let i = 0; i < col.length; i++) {
      const v = col[i];
      if (!(v >= -1 && v < hi)) throw new MalformedData(`${what}[${i}] = ${v} out of range`);
    }
  };
  inRange(c.al_start, n, 'al_start'); inRange(c.al_fr, n, 'al_fr'); inRange(c.al_end, n, 'al_end');
  inRange(c.sg_start, n, 'sg_start'); inRange(c.sg_end, n, 'sg_end');
  if (z > 0) { inRange(c.sl_start, n, 'sl_start'); inRange(c.sl_end, n, 'sl_end'); }
  inRange(c.al_stack, h.stacks.length, 'al_stack');
  for (const [col, what] of [[c.al_stream, 'al_stream'], [c.al_owner, 'al_owner'], [c.sg_stream, 'sg_stream'], [c.ev_stream, 'ev_stream']]) {
    for (let i = 0; i < col.length; i++) if (col[i] >= ns) throw new MalformedData(`${what}[${i}] = ${col[i]} out of range`);
  }
  const sizes = [['al_size', c.al_size], ['sg_size', c.sg_size], ['ev_size', c.ev_size], ['ev_time', c.ev_time]];
  if (z > 0) sizes.push(['sl_size', c.sl_size], ['sl_addr', c.sl_addr]);
  for (const [name, col] of sizes) {
    for (let i = 0; i < col.length; i++) if (!(col[i] >= 0 && col[i] <= Number.MAX_SAFE_INTEGER * 2048)) throw new MalformedData(`${name}[${i}] is not a size`);
  }
  for (let s = 0; s < h.stacks.length; s++) {
    const st = h.stacks[s];
    if (!Array.isArray(st)) throw new MalformedData(`stack ${s} is not a list`);
    for (const f of st) if (!Number.isInteger(f) || f < 0 || f >= h.frames.length) throw new MalformedData(`stack ${s}: frame ${f} out of range`);
  }
  for (const f of h.frames) {
    if (!Array.isArray(f) || f.length !== 3) throw new MalformedData('a frame is not [name, file, line]');
  }
  return {n, m, k, ns};
}

/**
 * What drawing needs, from a blob's header `h` and columns `c`: counters after each event,
 * which allocation starts and ends at each event, each stream's cached bytes as change
 * points, the lanes to draw, call-site labels.
 */
function prepareData(h, c) {
  const {n, m, k, ns} = validate(h, c);
  const d = {h, c, n, m};
  // Stacks arrive as frame indices (each frame is sent once): resolve them to the frames.
  h.stacks = h.stacks.map(st => st.map(i => h.frames[i]));
  const dAct = new Float64Array(n), dPend = new Float64Array(n), dRes = new Float64Array(n);
  const dStag = new Float64Array(n);
  let act0 = 0, pend0 = 0, res0 = 0;
  d.startAt = new Int32Array(n).fill(-1);
  d.endAt = new Int32Array(n).fill(-1);
  // Cached bytes per stream change where its allocations and segments start and end: at
  // most two changes each. Collected as (event, stream, delta), then grouped by stream in
  // event order with two counting passes.
  const changes = 2 * (m + k);
  const chEv = new Int32Array(changes), chSt = new Int32Array(changes), chD = new Float64Array(changes);
  let nch = 0;
  const cachedInit = new Float64Array(ns);
  const change = (at, st, delta) => { chEv[nch] = at; chSt[nch] = st; chD[nch] = delta; nch++; };
  for (let a = 0; a < m; a++) {
    const s = c.al_start[a], e = c.al_end[a], fr = c.al_fr[a], size = c.al_size[a];
    const o = c.al_owner[a];
    if (s >= 0) { dAct[s] += size; d.startAt[s] = a; change(s, o, -size); } else { act0 += size; cachedInit[o] -= size; }
    if (e >= 0) { dAct[e] -= size; d.endAt[e] = a; change(e, o, size); }
    if (fr >= 0) { dPend[fr] += size; if (e >= 0) dPend[e] -= size; }
  }
  for (let g = 0; g < k; g++) {
    const s = c.sg_start[g], e = c.sg_end[g], size = c.sg_size[g], st = c.sg_stream[g];
    if (s >= 0) { dRes[s] += size; change(s, st, size); } else { res0 += size; cachedInit[st] += size; }
    if (e >= 0) { dRes[e] -= size; change(e, st, -size); }
  }
  const A = h.actions;
  const code = name => A.indexOf(name);
  const cWait = code('cross_stream_wait'), cOom = code('oom');
  const cSA = code('staging_acquire'), cSR = code('staging_release');
  d.waits = []; d.ooms = [];
  for (let i = 0; i < n; i++) {
    const a = c.ev_action[i];
    if (a === cWait) d.waits.push(i);
    else if (a === cOom) d.ooms.push(i);
    else if (a === cSA) dStag[i] += c.ev_size[i];
    else if (a === cSR) dStag[i] -= c.ev_size[i];
  }
  const prefix = (delta, init) => {
    let v = init;
    for (let i = 0; i < n; i++) { v += delta[i]; delta[i] = v; }
    return delta;
  };
  d.active = prefix(dAct, act0); d.pending = prefix(dPend, pend0);
  d.reserved = prefix(dRes, res0); d.staging = prefix(dStag, 0);
  d.init = {active: act0, pending: pend0, reserved: res0, staging: 0};
  d.cached = cachedSeries(n, ns, nch, chEv, chSt, chD, cachedInit);
  // Call-site label of each stack: the innermost frame outside torch's own modules.
  d.site = h.stacks.map(st => {
    const f = st.find(fr => !/torch\/(nn|_|autograd|utils|optim|cuda)/.test(fr[1])) || st[0];
    return f ? `${f[1]}:${f[2]} ${f[0]}` : '?';
  });
  d.siteIds = new Map();
  d.siteOf = d.site.map(s => {
    if (!d.siteIds.has(s)) d.siteIds.set(s, d.siteIds.size);
    return d.siteIds.get(s);
  });
  d.tEnd = n ? c.ev_time[n - 1] : 1;
  return d;
}

/**
 * Each stream's cached bytes as change points: `at` (event indices, increasing within a
 * stream) and `val` (bytes after that event) from `off[s]` to `off[s + 1]`, with `init` and
 * `peak` per stream; and the lanes to draw: the streams with the most cached bytes, and
 * one lane for all the others together (a dense per-event array, one for all of them).
 */
function cachedSeries(n, ns, nch, chEv, chSt, chD, init) {
  // Counting sort by event, then stably by stream: each stream's changes in event order.
  const byEv = countingOrder(nch, n, i => chEv[i], null);
  const order = countingOrder(nch, ns, i => chSt[i], byEv);
  const off = new Int32Array(ns + 1);
  for (let i = 0; i < nch; i++) off[chSt[i] + 1]++;
  for (let s = 0; s < ns; s++) off[s + 1] += off[s];
  const at = new Int32Array(nch), val = new Float64Array(nch);
  const peak = Float64Array.from(init);
  const end = new Int32Array(ns);
  let w = 0;
  for (let s = 0, r = 0; s < ns; s++) {
    let v = init[s];
    const stop = off[s + 1];
    const first = w;
    for (; r < stop; r++) {
      const i = order[r];
      v += chD[i];
      if (w > first && at[w - 1] === chEv[i]) { val[w - 1] = v; } else { at[w] = chEv[i]; val[w] = v; w++; }
    }
    // The peak of the values after each event (not of the sums within one event).
    for (let p = first; p < w; p++) if (val[p] > peak[s]) peak[s] = val[p];
    off[s] = first;
    end[s] = w;
  }
  const series = {at, val, start: off.subarray(0, ns), end, init, peak};
  // Lanes: the streams with the most cached bytes (ties: first seen), the rest summed.
  const ranked = [];
  for (let s = 0; s < ns; s++) if (end[s] > off[s] || init[s] !== 0) ranked.push(s);
  ranked.sort((a, b) => peak[b] - peak[a] || a - b);
  series.lanes = ranked.slice(0, MAX_STREAM_LANES);
  series.others = ranked.length - series.lanes.length;
  if (series.others > 0) {
    const shown = new Uint8Array(ns);
    for (const s of series.lanes) shown[s] = 1;
    const rest = new Float64Array(n);
    let rest0 = 0;
    for (let s = 0; s < ns; s++) if (!shown[s]) rest0 += init[s];
    for (let i = 0; i < nch; i++) if (!shown[chSt[i]]) rest[chEv[i]] += chD[i];
    let v = rest0;
    for (let i = 0; i < n; i++) { v += rest[i]; rest[i] = v; }
    series.rest = rest;
    series.rest0 = rest0;
  }
  return series;
}

/** Indices 0..count-1 (or those of `within`, in its order) sorted stably by key(i) < buckets. */
function countingOrder(count, buckets, key, within) {
  const start = new Int32Array(buckets + 1);
  for (let i = 0; i < count; i++) start[key(i) + 1]++;
  for (let b = 0; b < buckets; b++) start[b + 1] += start[b];
  const out = new Int32Array(count);
  for (let r = 0; r < count; r++) {
    const i = within ? within[r] : r;
    out[start[key(i)]++] = i;
  }
  return out;
}

/** Stream `s`'s cached bytes after the first `b` events. */
function cachedAt(series, s, b) {
  let lo = series.start[s], hi = series.end[s];
  while (lo < hi) { const mid = (lo + hi) >> 1; if (series.at[mid] < b) lo = mid + 1; else hi = mid; }
  return lo > series.start[s] ? series.val[lo - 1] : series.init[s];
}

/**
 * Per pixel column, the most cached bytes stream `s` had over the events the column covers
 * (and on entering it): O(change points in view + columns).
 */
function cachedColumnMax(series, s, bnd) {
  const W = bnd.length - 1, out = new Float64Array(W);
  const stop = series.end[s];
  let p = series.start[s];
  let lo = p, hi = stop;
  while (lo < hi) { const mid = (lo + hi) >> 1; if (series.at[mid] < bnd[0]) lo = mid + 1; else hi = mid; }
  p = lo;
  let v = p > series.start[s] ? series.val[p - 1] : series.init[s];
  for (let col = 0; col < W; col++) {
    let mx = v;
    while (p < stop && series.at[p] < bnd[col + 1]) { v = series.val[p++]; if (v > mx) mx = v; }
    out[col] = mx;
  }
  return out;
}

if (typeof module !== 'undefined') {
  module.exports = {decodeBlob, prepareData, cachedAt, cachedColumnMax, MalformedData, MAX_STREAM_LANES};
}
