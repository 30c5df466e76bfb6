// Measures how long the viewer takes to open a large trace: generates a synthetic
// 1,000,000-event snapshot (gen_trace.mjs), or with --streams one of many streams
// (gen_streams.mjs: 20,000 streams, 200,000 events), starts `streamalloc view` on it, and
// times, in headless chromium, navigation to first complete draw and the renderer's peak
// memory, then a few pans and zooms.
//   STREAMALLOC_BIN=... node bench_open.mjs [EVENTS]
//   STREAMALLOC_BIN=... node bench_open.mjs --streams [STREAMS] [EVENTS]
import { execFileSync } from 'node:child_process';
import fs from 'node:fs';
import os from 'node:os';
import path from 'node:path';
import { writeStreams } from './gen_streams.mjs';
import { here, launch, openViewer, rendererPeakMiB, startViewer } from './lib.mjs';

const streamsMode = process.argv[2] === '--streams';
const streams = streamsMode ? Number(process.argv[3] || 20000) : 0;
const events = Number((streamsMode ? process.argv[4] : process.argv[2]) || (streamsMode ? 200_000 : 1_000_000));
const file = path.join(os.tmpdir(), streamsMode ? `sa-streams-${streams}-${events}.json` : `sa-synth-${events}.json`);
if (!fs.existsSync(file)) {
  if (streamsMode) writeStreams(file, streams, events);
  else execFileSync('node', [path.join(here, 'gen_trace.mjs'), file, String(events)], { stdio: 'inherit' });
}
let t = Date.now();
const { url, proc } = await startViewer([file]);
console.log(`server: loaded, paired and encoded ${events} events in ${Date.now() - t} ms`);
const browser = await launch();
try {
  const { page, ms } = await openViewer(browser.context, url);
  const v = await page.evaluate(() => window.__viz);
  console.log(`browser: navigation to first complete draw ${ms} ms (fetch+prepare+draw ${v.loadMs.toFixed(0)} ms, timeline draw ${v.drawMs.toFixed(0)} ms), renderer peak ${rendererPeakMiB().toFixed(0)} MiB`);
  const box = await page.locator('#timeline').boundingBox();
  await page.mouse.move(box.x + box.width / 2, box.y + box.height / 2);
  const frames = [];
  for (let i = 0; i < 10; i++) {
    await page.mouse.wheel(0, i < 5 ? -300 : 300);
    frames.push(await page.evaluate(() => new Promise(r => requestAnimationFrame(() => requestAnimationFrame(() => r(window.__viz.drawMs))))));
  }
  // Pan by dragging.
  await page.mouse.down();
  for (let i = 0; i < 10; i++) {
    await page.mouse.move(box.x + box.width / 2 - i * 40, box.y + box.height / 2);
    frames.push(await page.evaluate(() => new Promise(r => requestAnimationFrame(() => requestAnimationFrame(() => r(window.__viz.drawMs))))));
  }
  await page.mouse.up();
  frames.sort((a, b) => a - b);
  console.log(`redraw during zoom/pan: median ${frames[frames.length >> 1].toFixed(1)} ms, max ${frames[frames.length - 1].toFixed(1)} ms over ${frames.length} frames`);
  fs.mkdirSync(path.join(here, 'artifacts'), { recursive: true });
  await page.screenshot({ path: path.join(here, 'artifacts', `viewer-${streamsMode ? `${streams}-streams-` : ''}${events}.png`) });
} finally {
  await browser.close();
  proc.kill();
}
