// Writes a synthetic streamalloc JSON snapshot of many streams: each stream allocates its
// own segment, then a few blocks in it, freed in turn, so that every stream has cached
// bytes that change over the trace (what the viewer's lanes show per stream).
//   node gen_streams.mjs OUT.json [STREAMS] [EVENTS]     (defaults 20,000 and 200,000)
import fs from 'node:fs';

export function writeStreams(out, streams = 20000, events = 200000) {
  const fd = fs.openSync(out, 'w');
  let buf = '';
  const w = s => { buf += s; if (buf.length > 1 << 20) { fs.writeSync(fd, buf); buf = ''; } };
  w('{"format":"streamalloc-snapshot","version":1,"source":"streamalloc","config":null,"stats":null,');
  w('"stacks":[[{"name":"step","filename":"train.py","line":1}]],');
  w('"devices":[{"device":0,"time_ns":null,"trace_dropped":0,"segments":[],"trace":[');
  let n = 0, t = 1000, first = true;
  const ev = (action, addr, size, stream) => {
    t += 100 + (n * 7919) % 900;
    w((first ? '' : ',') + `{"action":"${action}","addr":${addr},"size":${size},"stream":${stream},"time_ns":${t},"stack":0}`);
    first = false;
    n++;
  };
  const perStream = Math.max(4, Math.floor(events / streams));
  const SEG = 2 ** 24;
  // Streams take turns, so that their lifetimes interleave over the whole trace.
  const base = s => 0x7f0000000000 + s * SEG;
  const handle = s => 0x5000_0000 + s;
  const next = new Array(streams).fill(0);
  for (let s = 0; s < streams; s++) ev('segment_alloc', base(s), SEG, handle(s));
  while (n < events) {
    for (let s = 0; s < streams && n < events; s++) {
      const k = next[s]++;
      if (1 + 3 * k + 3 > perStream) continue;
      const addr = base(s) + (k % 8) * 65536;
      ev('alloc', addr, 65536, handle(s));
      ev('free_requested', addr, 65536, handle(s));
      ev('free_completed', addr, 65536, handle(s));
    }
    if (next.every(k => 1 + 3 * k + 3 > perStream)) break;
  }
  w(']}]}');
  fs.writeSync(fd, buf);
  fs.closeSync(fd);
  return n;
}

if (import.meta.url === `file://${process.argv[1]}`) {
  const [out, streams, events] = process.argv.slice(2);
  if (!out) { console.error('usage: node gen_streams.mjs OUT.json [STREAMS] [EVENTS]'); process.exit(2); }
  const n = writeStreams(out, Number(streams || 20000), Number(events || 200000));
  console.log(`${out}: ${n} events on ${streams || 20000} streams`);
}
