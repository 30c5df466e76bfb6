// Fuzzes the page's input path (viz/assets/prepare.js): blobs as the server sends them
// (viz/src/wire.rs), valid ones with random traces and hostile ones made by mutating them.
//
// - A valid blob prepares, and each stream's cached bytes, kept as change points, equal a
//   plain per-event computation at every event and over every range of events; the lanes
//   are the streams with the most cached bytes, the rest summed.
// - Any blob prepares or is refused with MalformedData: no other exception, no NaN in
//   what would be drawn.
//
//   node tests/browser/fuzz_prepare.mjs [ITERATIONS] [SEED]      (defaults 2000, from the clock)
// A failure prints the seed that reproduces it.
import { createRequire } from 'node:module';
import path from 'node:path';

const require = createRequire(import.meta.url);
const here = path.dirname(new URL(import.meta.url).pathname);
const P = require(path.join(here, '../../viz/assets/prepare.js'));

const iterations = Number(process.argv[2] || 2000);
const seed0 = Number(process.argv[3] || Date.now() % 1e9);

function rng(seed) {
  let x = BigInt(seed) | 1n;
  const next = () => {
    x ^= (x << 13n) & 0xffffffffffffffffn;
    x ^= x >> 7n;
    x ^= (x << 17n) & 0xffffffffffffffffn;
    return Number(x & 0xffffffffn);
  };
  return { int: n => next() % Math.max(1, n), chance: p => next() / 2 ** 32 < p };
}

const ACTIONS = ['alloc', 'free_requested', 'free_completed', 'segment_alloc', 'segment_free', 'segment_map',
  'segment_unmap', 'oom', 'snapshot', 'user_defined', 'cross_stream_wait', 'staging_acquire', 'staging_release',
  'empty_cache', 'stitch', 'unstitch', 'sleep', 'wake'];

/** A random valid trace as the server encodes it. */
function randomData(r) {
  const ns = 1 + r.int(14), n = r.int(300), m = r.int(60), k = r.int(12), z = r.int(4);
  const idx = () => (n && r.chance(0.8) ? r.int(n) : -1);
  const h = {
    device: 0, source: 'fuzz', events: n, allocs: m, segments: k, sleeping: z, t0_ns: 0,
    streams: Array.from({ length: ns }, (_, s) => `0x${(0x5000 + s).toString(16)}`),
    actions: ACTIONS, frames: [['f', 'a.py', 1], ['g', 'torch/nn/x.py', 2]], stacks: [[0, 1], [1]],
    peak: { active: null, reserved: null }, trace_dropped: 0, config: null, stats: null,
  };
  let t = 0;
  const cols = {
    ev_time: ['f64', Array.from({ length: n }, () => (t += r.int(1000)))],
    ev_action: ['u8', Array.from({ length: n }, () => r.int(ACTIONS.length))],
    ev_stream: ['u32', Array.from({ length: n }, () => r.int(ns))],
    ev_addr: ['f64', Array.from({ length: n }, () => r.int(1 << 20) * 512)],
    ev_size: ['f64', Array.from({ length: n }, () => r.int(1 << 16) * 512)],
    al_start: ['i32', Array.from({ length: m }, idx)],
    al_fr: ['i32', Array.from({ length: m }, idx)],
    al_end: ['i32', Array.from({ length: m }, idx)],
    al_addr: ['f64', Array.from({ length: m }, () => r.int(1 << 20) * 512)],
    al_size: ['f64', Array.from({ length: m }, () => r.int(1 << 16) * 512)],
    al_stream: ['u32', Array.from({ length: m }, () => r.int(ns))],
    al_owner: ['u32', Array.from({ length: m }, () => r.int(ns))],
    al_stack: ['i32', Array.from({ length: m }, () => r.int(3) - 1)],
    sg_start: ['i32', Array.from({ length: k }, idx)],
    sg_end: ['i32', Array.from({ length: k }, idx)],
    sg_addr: ['f64', Array.from({ length: k }, () => r.int(1 << 20) * (1 << 21))],
    sg_size: ['f64', Array.from({ length: k }, () => (1 + r.int(64)) * (1 << 21))],
    sg_stream: ['u32', Array.from({ length: k }, () => r.int(ns))],
    sl_start: ['i32', Array.from({ length: z }, idx)],
    sl_end: ['i32', Array.from({ length: z }, idx)],
    sl_addr: ['f64', Array.from({ length: z }, () => r.int(1 << 20) * (1 << 21))],
    sl_size: ['f64', Array.from({ length: z }, () => (1 + r.int(64)) * (1 << 21))],
  };
  return { h, cols };
}

const TYPES = { f64: Float64Array, i32: Int32Array, u32: Uint32Array, u8: Uint8Array };

/** The blob of `h` and `cols`, laid out as viz/src/wire.rs lays it out. */
function encode(h, cols) {
  let at = 0;
  h.columns = {};
  for (const [name, [type, values]] of Object.entries(cols)) {
    h.columns[name] = { type, offset: at, len: values.length };
    at = (at + values.length * TYPES[type].BYTES_PER_ELEMENT + 7) & ~7;
  }
  const header = new TextEncoder().encode(JSON.stringify(h));
  const base = (4 + header.length + 7) & ~7;
  const buf = new ArrayBuffer(base + at);
  new DataView(buf).setUint32(0, header.length, true);
  new Uint8Array(buf, 4, header.length).set(header);
  for (const [name, [type, values]] of Object.entries(cols)) {
    new TYPES[type](buf, base + h.columns[name].offset, values.length).set(values);
  }
  return buf;
}

/** Each stream's cached bytes after each event, computed plainly (a row per stream). */
function denseCached(d) {
  const { c, n, m } = d, ns = d.h.streams.length;
  const rows = Array.from({ length: ns }, () => new Float64Array(n + 1));
  const init = new Float64Array(ns);
  const delta = Array.from({ length: ns }, () => new Float64Array(n));
  for (let a = 0; a < m; a++) {
    const o = c.al_owner[a], s = c.al_start[a], e = c.al_end[a], size = c.al_size[a];
    if (s >= 0) delta[o][s] -= size; else init[o] -= size;
    if (e >= 0) delta[o][e] += size;
  }
  for (let g = 0; g < d.h.segments; g++) {
    const st = c.sg_stream[g], s = c.sg_start[g], e = c.sg_end[g], size = c.sg_size[g];
    if (s >= 0) delta[st][s] += size; else init[st] += size;
    if (e >= 0) delta[st][e] -= size;
  }
  for (let s = 0; s < ns; s++) {
    let v = init[s];
    rows[s][0] = v;
    for (let i = 0; i < n; i++) { v += delta[s][i]; rows[s][i + 1] = v; }
  }
  return rows;
}

function checkValid(d) {
  const rows = denseCached(d);
  const cs = d.cached, ns = d.h.streams.length, n = d.n;
  for (let s = 0; s < ns; s++) {
    for (let b = 0; b <= n; b++) {
      const got = P.cachedAt(cs, s, b), want = rows[s][b];
      if (Math.abs(got - want) > 1e-6 * Math.max(1, Math.abs(want))) {
        throw new Error(`stream ${s} after ${b} events: ${got}, plainly ${want}`);
      }
    }
    // Over columns of every width: the most cached bytes in each.
    for (const W of [1, 3, 7, Math.max(1, n)]) {
      const bnd = Int32Array.from({ length: W + 1 }, (_, col) => Math.round(n * col / W));
      const got = P.cachedColumnMax(cs, s, bnd);
      for (let col = 0; col < W; col++) {
        let want = rows[s][bnd[col]];
        for (let i = bnd[col]; i < bnd[col + 1]; i++) want = Math.max(want, rows[s][i + 1]);
        if (Math.abs(got[col] - want) > 1e-6 * Math.max(1, Math.abs(want))) {
          throw new Error(`stream ${s}, column ${col} of ${W}: ${got[col]}, plainly ${want}`);
        }
      }
    }
  }
  if (cs.lanes.length > P.MAX_STREAM_LANES) throw new Error(`${cs.lanes.length} lanes`);
  const peak = s => Math.max(...rows[s]);
  for (let i = 1; i < cs.lanes.length; i++) {
    if (peak(cs.lanes[i]) > peak(cs.lanes[i - 1]) + 1e-6) throw new Error('lanes not by peak');
  }
  if (cs.others) {
    const shown = new Set(cs.lanes);
    for (let b = 1; b <= n; b++) {
      let want = 0;
      for (let s = 0; s < ns; s++) if (!shown.has(s)) want += rows[s][b];
      if (Math.abs(cs.rest[b - 1] - want) > 1e-6 * Math.max(1, Math.abs(want))) throw new Error(`others after ${b}`);
    }
  }
}

/** What drawing reads of prepared data is there: counters are numbers, every index an
 * allocation or event holds names an existing stream, stack or event. */
function drawable(d) {
  const { c, h, n, m } = d, ns = h.streams.length;
  for (const arr of [d.active, d.pending, d.reserved, d.staging]) {
    if (arr.length !== n || arr.some(v => !Number.isFinite(v))) throw new Error('a counter that is not a number');
  }
  for (let a = 0; a < m; a++) {
    for (const i of [c.al_start[a], c.al_end[a], c.al_fr[a]]) if (i < -1 || i >= n) throw new Error(`event ${i} of ${n}`);
    if (c.al_stack[a] >= 0 && !Array.isArray(h.stacks[c.al_stack[a]])) throw new Error(`stack ${c.al_stack[a]}`);
    if (h.streams[c.al_stream[a]] === undefined || h.streams[c.al_owner[a]] === undefined) throw new Error('stream');
    if (c.al_stack[a] >= 0 && typeof d.site[c.al_stack[a]] !== 'string') throw new Error('call site');
  }
  for (let s = 0; s < ns; s++) if (!Number.isFinite(P.cachedAt(d.cached, s, n))) throw new Error(`cached ${s}`);
  // Sleeping ranges, as the segment map reads them.
  if (!Number.isSafeInteger(h.sleeping) || h.sleeping < 0) throw new Error(`sleeping ${h.sleeping}`);
  for (let z = 0; z < h.sleeping; z++) {
    for (const i of [c.sl_start[z], c.sl_end[z]]) if (!(i >= -1 && i < n)) throw new Error(`sleeping event ${i} of ${n}`);
    if (!Number.isFinite(c.sl_size[z]) || !Number.isFinite(c.sl_addr[z])) throw new Error(`sleeping range ${z}`);
  }
}

/** A hostile variant of a valid blob. */
function mutate(r, buf, h, cols) {
  const bytes = new Uint8Array(buf.slice(0));
  switch (r.int(6)) {
    case 0: // flip bytes anywhere
      for (let i = 0, flips = 1 + r.int(8); i < flips && bytes.length; i++) bytes[r.int(bytes.length)] ^= 1 << r.int(8);
      return bytes.buffer;
    case 1: // truncate
      return bytes.buffer.slice(0, r.int(bytes.length + 1));
    case 2: { // a counter or a column's length that does not match
      const key = ['events', 'allocs', 'segments', 'sleeping'][r.int(4)];
      h[key] = [-1, 1e12, h[key] + 1, 'x', null, 2.5][r.int(6)];
      return encode(h, cols);
    }
    case 3: { // an index out of range
      const name = ['al_start', 'al_end', 'al_fr', 'sg_start', 'al_owner', 'al_stream', 'al_stack', 'sg_stream', 'ev_stream',
        'sl_start', 'sl_end'][r.int(11)];
      const [, values] = cols[name];
      if (values.length) values[r.int(values.length)] = [1e6, -7, 0x7fffffff][r.int(3)];
      return encode(h, cols);
    }
    case 4: { // a size that is no size
      const name = ['al_size', 'sg_size', 'ev_size', 'ev_time', 'sl_size'][r.int(5)];
      const [, values] = cols[name];
      if (values.length) values[r.int(values.length)] = [NaN, -1, Infinity][r.int(3)];
      return encode(h, cols);
    }
    default: { // header fields of the wrong shape
      const key = ['streams', 'frames', 'stacks', 'actions', 'peak', 'columns'][r.int(6)];
      h[key] = [null, 7, 'x', {}, [[99]], [null]][r.int(6)];
      try { return encode(h, cols); } catch { return bytes.buffer; }
    }
  }
}

let valid = 0, refused = 0, hostileOk = 0;
for (let i = 0; i < iterations; i++) {
  const seed = seed0 + i;
  const r = rng(seed);
  try {
    const { h, cols } = randomData(r);
    const buf = encode(structuredClone(h), cols);
    const { h: hh, c } = P.decodeBlob(buf);
    checkValid(P.prepareData(hh, c));
    valid++;
    const { h: h2, cols: cols2 } = randomData(rng(seed));
    const bad = mutate(r, encode(h2, cols2), h2, cols2);
    try {
      const { h: h3, c: c3 } = P.decodeBlob(bad);
      const d = P.prepareData(h3, c3);
      drawable(d);
      hostileOk++;
    } catch (e) {
      if (!(e instanceof P.MalformedData)) throw e;
      refused++;
    }
  } catch (e) {
    console.error(`fuzz_prepare: failed at seed ${seed} (node tests/browser/fuzz_prepare.mjs 1 ${seed}): ${e.stack || e}`);
    process.exit(1);
  }
}
console.log(`fuzz_prepare: ${valid} valid blobs matched the plain computation; of ${iterations} hostile ones ${refused} refused, ${hostileOk} prepared`);
