// Writes a synthetic streamalloc JSON snapshot with about N events (default 1,000,000):
// a training loop on two streams (forward activations piling up, freed in reverse in the
// backward pass, gradients sent on a communication stream with cross-stream waits), so the
// viewer can be measured on a trace far larger than the shared real ones.
//   node gen_trace.mjs OUT.json [N]
import fs from 'node:fs';

const out = process.argv[2];
const target = Number(process.argv[3] || 1_000_000);
if (!out) { console.error('usage: node gen_trace.mjs OUT.json [EVENTS]'); process.exit(2); }

const fd = fs.openSync(out, 'w');
let buf = '';
const w = s => { buf += s; if (buf.length > 1 << 20) { fs.writeSync(fd, buf); buf = ''; } };

const COMPUTE = 0x5000, COMM = 0x5001;
const stacks = [
  [['forward', 'model.py', 41], ['train_step', 'train.py', 88]],
  [['backward', 'model.py', 77], ['train_step', 'train.py', 90]],
  [['all_reduce', 'comm.py', 12], ['train_step', 'train.py', 95]],
  [['step', 'optim.py', 30], ['train_step', 'train.py', 99]],
];
let n = 0, t = 1_000_000;
const events = [];
let first = true;
const ev = (action, addr, size, stream, stack) => {
  t += 1000 + (n * 7919) % 5000;
  w((first ? '' : ',') + `{"action":"${action}","addr":${addr},"size":${size},"stream":${stream},"time_ns":${t}` +
    (stack === undefined ? '' : `,"stack":${stack}`) + '}');
  first = false;
  n++;
};
w(`{"format":"streamalloc-snapshot","version":1,"source":"streamalloc","config":null,"stats":null,`);
w(`"stacks":${JSON.stringify(stacks.map(s => s.map(([name, filename, line]) => ({name, filename, line}))))},`);
w(`"devices":[{"device":0,"time_ns":null,"trace_dropped":0,"segments":[],"trace":[`);
const SEG = 12 * 2 ** 30; // one 12 GiB segment per stream, carved by a bump pointer per step
const base = {[COMPUTE]: 0x7f0000000000, [COMM]: 0x7f1000000000};
ev('segment_alloc', base[COMPUTE], SEG, COMPUTE);
ev('segment_alloc', base[COMM], SEG, COMM);
let step = 0;
while (n < target - 10) {
  const layers = 400 + (step % 5) * 40;
  const live = [];
  let off = 0;
  for (let l = 0; l < layers && n < target - 10; l++) {
    const size = 512 * (1 + ((l * 31 + step * 7) % 64)) * 1024;
    const addr = base[COMPUTE] + off;
    off += size;
    ev('alloc', addr, size, COMPUTE, 0);
    live.push([addr, size]);
  }
  while (live.length && n < target - 10) {
    const [addr, size] = live.pop();
    const sent = live.length % 4 === 0;
    if (sent) {
      const g = base[COMM] + (live.length % 64) * 65536 * 64;
      ev('alloc', g, size / 2, COMM, 2);
      ev('cross_stream_wait', g, size / 2, COMM);
      ev('free_requested', g, size / 2, COMM, 2);
      ev('free_completed', g, size / 2, COMM, 2);
    }
    ev('free_requested', addr, size, COMPUTE, 1);
    ev('free_completed', addr, size, COMPUTE, 1);
  }
  step++;
}
w(']}]}');
fs.writeSync(fd, buf);
fs.closeSync(fd);
console.log(`${out}: ${n} events, ${step} steps`);
