// The viewer in a real browser: headless Debian chromium driven by playwright-core opens a
// real PyTorch trace, and we check that the timeline draws, hovering shows an allocation's
// details, and zooming changes the visible range. A screenshot is kept in artifacts/.
import { test } from 'node:test';
import assert from 'node:assert/strict';
import fs from 'node:fs';
import os from 'node:os';
import path from 'node:path';
import { ARTIFACTS, BIN, CHROMIUM, launch, openViewer, rendererPeakMiB, sharedTrace, startViewer } from './lib.mjs';
import { writeStreams } from './gen_streams.mjs';

function missing() {
  if (!fs.existsSync(BIN)) return `streamalloc binary not found at ${BIN} (set STREAMALLOC_BIN)`;
  if (!fs.existsSync(CHROMIUM)) return `chromium not found at ${CHROMIUM}`;
  if (!sharedTrace('gpt2.pickle.gz')) return 'tests/data/traces/gpt2.pickle.gz not found';
  return null;
}

test('viewer draws a real trace, hover shows details, zoom changes the range', async t => {
  const why = missing();
  if (why) { t.skip(why); return; }
  const { url, proc } = await startViewer([sharedTrace('gpt2.pickle.gz'), sharedTrace('bert_varlen.pickle.gz')]);
  const browser = await launch();
  try {
    const { page, ms } = await openViewer(browser.context, url);
    console.log(`gpt2.pickle.gz (14,042 events) opened and drawn in ${ms} ms`);

    // The timeline draws: most of the plot's columns have coloured pixels.
    const coloured = await page.evaluate(() => {
      const c = document.getElementById('timeline');
      const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
      let n = 0;
      for (let i = 0; i < d.length; i += 4) if (d[i] < 200 || d[i + 1] < 200 || d[i + 2] < 200) n++;
      return n / (c.width * c.height);
    });
    assert.ok(coloured > 0.2, `only ${(coloured * 100).toFixed(1)}% of the timeline is drawn`);
    assert.ok(await page.evaluate(() => window.__viz.drawn) > 1000);

    // Hover near the bottom of the plot, where the model's weights live all along.
    const box = await page.locator('#timeline').boundingBox();
    await page.mouse.move(box.x + box.width * 0.5, box.y + box.height - 40);
    await page.waitForFunction(() => window.__viz.hovered !== null);
    const details = await page.locator('#details').textContent();
    assert.match(details, /allocation 0x[0-9a-f]+/);
    assert.match(details, /size +\d/);
    assert.match(details, /stream +0x/);
    assert.match(details, /frames:\n +\S+\.py:\d+/);

    // Zoom in with the wheel: the visible range shrinks.
    const before = await page.evaluate(() => window.__viz.range);
    await page.mouse.wheel(0, -400);
    await page.waitForFunction(r => window.__viz.range[1] - window.__viz.range[0] < r[1] - r[0], before);
    const after = await page.evaluate(() => window.__viz.range);
    assert.ok(after[1] - after[0] < before[1] - before[0], `range ${before} -> ${after}`);
    assert.ok(after[0] >= before[0] && after[1] <= before[1]);

    // Jump to the peak: the summary names the peak instant and lists the largest blocks.
    await page.click('#peak');
    const peakAt = await page.locator('#sumat').textContent();
    await page.keyboard.press('ArrowRight');
    assert.notEqual(await page.locator('#sumat').textContent(), peakAt, 'arrow steps the instant');
    await page.keyboard.press('ArrowLeft');
    const summary = await page.locator('#summary').textContent();
    assert.match(summary, /peak active/);
    assert.match(summary, /Largest allocations/);

    // Compare with the second file: its curve is overlaid and its peak listed.
    await page.selectOption('#compare', '1');
    await page.waitForFunction(() => /compare: peak active/.test(document.getElementById('summary').textContent));
    assert.ok(await page.locator('#compare-table tr').count() > 0, 'per-call-site comparison at the peaks');

    // Time axis and colours by call site still draw; the segment map's blocks hover too.
    await page.selectOption('#xmode', 'time');
    await page.waitForFunction(() => /µs|ms| s/.test(document.getElementById('range').textContent));
    await page.selectOption('#colour', 'site');
    assert.ok(await page.evaluate(() => window.__viz.drawn) > 1000);
    const seg = await page.locator('#segmap').boundingBox();
    await page.mouse.move(seg.x + 20, seg.y + 10);
    assert.match(await page.locator('#details').textContent(), /allocation 0x[0-9a-f]+/);
    await page.selectOption('#colour', 'stream');
    await page.selectOption('#xmode', 'event');

    fs.mkdirSync(ARTIFACTS, { recursive: true });
    const shot = path.join(ARTIFACTS, 'viewer.png');
    await page.screenshot({ path: shot });
    console.log(`screenshot: ${shot}`);
  } finally {
    await browser.close();
    proc.kill();
  }
});

// A snapshot is anyone's file: its name and its call stacks reach the page as text only.
// A file named like markup, with frames named like markup, must show those strings
// literally and run nothing (the page would set window.__pwned, or CSP would report a
// blocked inline handler).
test('file names and call stacks that look like markup stay text', async t => {
  if (!fs.existsSync(BIN)) { t.skip(`streamalloc binary not found at ${BIN}`); return; }
  if (!fs.existsSync(CHROMIUM)) { t.skip(`chromium not found at ${CHROMIUM}`); return; }
  const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'sa-hostile-'));
  const markup = '<img src=x onerror="window.__pwned=1">';
  const file = path.join(dir, `${markup}.json`);
  const frame = { name: markup, filename: `<script>window.__pwned=2</script>.py`, line: 1 };
  fs.writeFileSync(file, JSON.stringify({
    format: 'streamalloc-snapshot', version: 1, source: 'streamalloc',
    stacks: [[frame]],
    devices: [{
      device: 0, segments: [], trace: [
        { action: 'segment_alloc', addr: 4096, size: 1 << 20, stream: 0, time_ns: 0 },
        { action: 'alloc', addr: 4096, size: 4096, stream: 0, time_ns: 1, stack: 0 },
        { action: 'alloc', addr: 8192, size: 8192, stream: 0, time_ns: 2, stack: 0 },
      ],
    }],
  }));
  const { url, proc } = await startViewer([file, file]);
  const browser = await launch();
  try {
    const { page } = await openViewer(browser.context, url);
    await page.selectOption('#colour', 'site');
    await page.selectOption('#compare', '1');
    await page.waitForFunction(() => /compare: peak active/.test(document.getElementById('summary').textContent));
    assert.equal(await page.evaluate(() => window.__pwned), undefined, 'markup from the file ran');
    assert.equal(await page.locator('img').count(), 0, 'an element was made from file text');
    assert.equal(await page.locator('aside script').count(), 0);
    assert.equal(await page.locator('#file option').first().textContent(), `${markup}.json`);
    assert.ok((await page.locator('#summary').textContent()).includes(markup), 'call site shown as text');
    assert.ok((await page.locator('#legend').textContent()).includes(markup), 'legend shows it as text');
  } finally {
    await browser.close();
    proc.kill();
    fs.rmSync(dir, { recursive: true, force: true });
  }
});

// The page is linear in streams: 20,000 streams of 200,000 events open, draw their lanes
// (the streams with the most cached bytes, the rest together) and name a few in the
// legend, within 600 MB of renderer memory (one array per stream and event would be 30 GB).
// How fast it opens is measured by bench_open.mjs, not asserted here.
test('twenty thousand streams open within bounded memory', async t => {
  if (!fs.existsSync(BIN)) { t.skip(`streamalloc binary not found at ${BIN}`); return; }
  if (!fs.existsSync(CHROMIUM)) { t.skip(`chromium not found at ${CHROMIUM}`); return; }
  const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'sa-streams-'));
  const file = path.join(dir, 'streams.json');
  const events = writeStreams(file, 20000, 200000);
  const { url, proc } = await startViewer([file]);
  const browser = await launch();
  try {
    const { page, ms } = await openViewer(browser.context, url);
    const peak = rendererPeakMiB();
    console.log(`20,000 streams, ${events} events: opened and drawn in ${ms} ms, renderer peak ${peak.toFixed(0)} MiB`);
    assert.ok(peak > 0 && peak <= 600, `renderer peak ${peak.toFixed(0)} MiB`);
    assert.match(await page.locator('#status').textContent(), /200000 events, \d+ allocations, 20000 streams/);
    const lanes = await page.evaluate(() => document.getElementById('lanes').height);
    assert.ok(lanes < 22 * 16, `lanes canvas ${lanes} px high`);
    const legend = await page.locator('#legend').textContent();
    assert.match(legend, /and 19980 more streams/);
    fs.mkdirSync(ARTIFACTS, { recursive: true });
    await page.screenshot({ path: path.join(ARTIFACTS, 'viewer-streams.png') });
  } finally {
    await browser.close();
    proc.kill();
    fs.rmSync(dir, { recursive: true, force: true });
  }
});

// `view --replay`, the question a PyTorch user arrives with: on their own snapshot, the
// recorded reserved memory, streamalloc's replayed reserved memory and the live memory
// are drawn as three lines, and the legend gives both peaks, the saving in GiB and
// percent, and the lowest cap under which the replay completes. The screenshot is kept.
test('view --replay draws three lines and a legend with both peaks and the saving', async t => {
  const why = missing() || (sharedTrace('bert_varlen.pickle.gz') ? null : 'bert_varlen.pickle.gz not found');
  if (why) { t.skip(why); return; }
  const { url, proc, printed } = await startViewer([sharedTrace('bert_varlen.pickle.gz')], ['--replay']);
  assert.match(printed, /saving \d+\.\d+ GiB \(\d+\.\d%\)/, 'the figures are printed too');
  const browser = await launch();
  try {
    const { page } = await openViewer(browser.context, url);
    const legend = await page.locator('#replay-legend').textContent();
    assert.match(legend, /PyTorch reserved \(recorded\): peak \d+\.\d\d GiB/);
    assert.match(legend, /streamalloc reserved \(replayed\): peak \d+\.\d\d GiB/);
    assert.match(legend, /live: peak \d+\.\d\d GiB/);
    assert.match(legend, /saving \d+\.\d\d GiB \(\d+\.\d%\) of PyTorch's peak reserved/);
    assert.match(legend, /lowest cap that completes: 1\.\d{3} x peak live \(\d+\.\d\d GiB\)/);
    // The page's figures are the printed ones.
    const figures = printed.split('\n').filter(l => l.startsWith('  ')).map(l => l.trim());
    assert.equal(figures.length, 5, printed);
    for (const line of figures) {
      assert.ok(legend.includes(line), `legend lacks "${line}"`);
    }

    // Each line is on the canvas: a pixel near its colour in most columns of the plot
    // (the recorded line is dashed: in fewer).
    const replay = await page.evaluate(() => window.__viz.replay);
    assert.ok(replay && replay.drawn, 'the overlay drew');
    const share = await page.evaluate(colours => {
      const c = document.getElementById('timeline');
      const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
      const rgb = h => [1, 3, 5].map(i => parseInt(h.slice(i, i + 2), 16));
      const out = {};
      const left = 90;
      for (const [name, hex] of Object.entries(colours)) {
        const [r, g, b] = rgb(hex);
        let hit = 0;
        for (let x = left; x < c.width; x++) {
          for (let y = 0; y < c.height - 16; y++) {
            const i = (y * c.width + x) * 4;
            if (Math.abs(d[i] - r) + Math.abs(d[i + 1] - g) + Math.abs(d[i + 2] - b) < 40) { hit++; break; }
          }
        }
        out[name] = hit / (c.width - left);
      }
      return out;
    }, replay.drawn.colours);
    assert.ok(share.replayed > 0.9, `streamalloc's line in ${(share.replayed * 100).toFixed(0)}% of the columns`);
    assert.ok(share.live > 0.8, `the live line in ${(share.live * 100).toFixed(0)}% of the columns`);
    assert.ok(share.recorded > 0.4, `PyTorch's dashed line in ${(share.recorded * 100).toFixed(0)}% of the columns`);

    fs.mkdirSync(ARTIFACTS, { recursive: true });
    const shot = path.join(ARTIFACTS, 'viewer-replay.png');
    await page.screenshot({ path: shot });
    console.log(`screenshot: ${shot}`);
  } finally {
    await browser.close();
    proc.kill();
  }
});

// Lane labels name streams by handle (`cached 0x16006310`): a long handle must still fit
// left of the lanes, whole or shortened, never cut at the page's edge.
test('lane labels fit left of the lanes', async t => {
  if (!fs.existsSync(BIN)) { t.skip(`streamalloc binary not found at ${BIN}`); return; }
  if (!fs.existsSync(CHROMIUM)) { t.skip(`chromium not found at ${CHROMIUM}`); return; }
  const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'sa-lanes-'));
  const file = path.join(dir, 'streams.json');
  const streams = [0x16006310, 0x7f3a2b1c0d00, 0];
  const trace = [];
  streams.forEach((s, k) => {
    const base = 0x100000000 * (k + 1);
    trace.push({ action: 'segment_alloc', addr: base, size: 4 << 20, stream: s, time_ns: 3 * k });
    trace.push({ action: 'alloc', addr: base, size: 1 << 20, stream: s, time_ns: 3 * k + 1 });
    trace.push({ action: 'free_completed', addr: base, size: 1 << 20, stream: s, time_ns: 3 * k + 2 });
  });
  fs.writeFileSync(file, JSON.stringify({ format: 'streamalloc-snapshot', version: 1, source: 'streamalloc', stacks: [], devices: [{ device: 0, segments: [], trace }] }));
  const { url, proc } = await startViewer([file]);
  const browser = await launch();
  try {
    const { page } = await openViewer(browser.context, url);
    const labels = await page.evaluate(() => window.__viz.laneLabels);
    const cached = labels.filter(l => l.label.startsWith('cached'));
    assert.equal(cached.length, streams.length, JSON.stringify(labels));
    for (const l of labels) {
      assert.ok(l.right - l.width >= 0, `"${l.label}" drawn as ${JSON.stringify(l.lines)} is ${l.width.toFixed(1)} px wide, right edge at ${l.right}`);
    }
    const long = cached.find(l => l.label.includes('0x7f3a2b1c0d00'));
    assert.ok(long.lines.join(' ').includes('cached'), JSON.stringify(long));
  } finally {
    await browser.close();
    proc.kill();
    fs.rmSync(dir, { recursive: true, force: true });
  }
});

// Sleeping memory (streamalloc's sleep and wake): between a `sleep` and its `wake` the
// range is drawn hatched in the segment map, its memory leaves the reserved figure and the
// summary counts it as asleep; after the wake it is an ordinary segment again.
test('a sleeping range is hatched and counted apart until its wake', async t => {
  if (!fs.existsSync(BIN)) { t.skip(`streamalloc binary not found at ${BIN}`); return; }
  if (!fs.existsSync(CHROMIUM)) { t.skip(`chromium not found at ${CHROMIUM}`); return; }
  const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'sa-sleep-'));
  const file = path.join(dir, 'sleep.json');
  const mib = 1 << 20;
  fs.writeFileSync(file, JSON.stringify({
    format: 'streamalloc-snapshot', version: 1, source: 'streamalloc', stacks: [],
    devices: [{
      device: 0, segments: [], trace: [
        { action: 'segment_map', addr: 64 * mib, size: 8 * mib, stream: 0, time_ns: 0 },
        { action: 'alloc', addr: 64 * mib, size: 6 * mib, stream: 0, time_ns: 1 },
        { action: 'sleep', addr: 64 * mib, size: 8 * mib, stream: 0, time_ns: 2 },
        { action: 'wake', addr: 64 * mib, size: 8 * mib, stream: 0, time_ns: 3 },
      ],
    }],
  }));
  const { url, proc } = await startViewer([file]);
  const browser = await launch();
  try {
    const { page } = await openViewer(browser.context, url);
    const text = () => page.locator('#instant').textContent();
    assert.match(await text(), /^#1 — 1 segments, 8\.0 MiB reserved \(/, 'the peak: awake');
    await page.keyboard.press('ArrowRight');
    assert.match(await text(), /^#2 — 1 segments, 0 B reserved, 8\.0 MiB asleep/);
    assert.match(await page.locator('#summary').textContent(), /asleep \(given back\)8\.0 MiB/);
    const hatched = await page.evaluate(() => {
      const c = document.getElementById('segmap');
      const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
      let n = 0;
      for (let i = 0; i < d.length; i += 4) if (d[i] === 0x99 && d[i + 1] === 0x99 && d[i + 2] === 0xbb) n++;
      return n;
    });
    assert.ok(hatched > 0, 'the sleeping range is hatched');
    await page.keyboard.press('ArrowRight');
    assert.match(await text(), /^#3 — 1 segments, 8\.0 MiB reserved \(/, 'awake again');
  } finally {
    await browser.close();
    proc.kill();
    fs.rmSync(dir, { recursive: true, force: true });
  }
});
