// Shared by the browser test and the open-time benchmark: start `streamalloc view`, and
// launch Debian's chromium through playwright-core with no network and a fresh profile.
import { spawn } from 'node:child_process';
import fs from 'node:fs';
import os from 'node:os';
import path from 'node:path';
import { chromium } from 'playwright-core';

export const here = path.dirname(new URL(import.meta.url).pathname);
export const root = path.resolve(here, '../..');
export const BIN = process.env.STREAMALLOC_BIN || path.join(root, 'target/debug/streamalloc');
export const CHROMIUM = process.env.CHROMIUM || '/usr/bin/chromium';
export const ARTIFACTS = process.env.ARTIFACTS_DIR || path.join(here, 'artifacts');

// The PyTorch traces kept in the repository (tests/data/traces).
export function sharedTrace(name) {
  const p = path.resolve(root, 'tests/data/traces', name);
  return fs.existsSync(p) ? p : null;
}

// Starts the viewer on a free port (with `extra` arguments); resolves with its URL and
// what it printed before, once it prints the URL.
export function startViewer(files, extra = []) {
  return new Promise((resolve, reject) => {
    const proc = spawn(BIN, ['view', ...files, '--port', '0', ...extra], { stdio: ['ignore', 'pipe', 'pipe'] });
    let out = '', err = '';
    const timer = setTimeout(() => { proc.kill(); reject(new Error(`viewer did not start: ${err}`)); }, 120000);
    proc.stdout.on('data', d => {
      out += d;
      const m = out.match(/http:\/\/127\.0\.0\.1:\d+\//);
      if (m) { clearTimeout(timer); resolve({ url: m[0], proc, printed: out }); }
    });
    proc.stderr.on('data', d => { err += d; });
    proc.on('exit', code => { clearTimeout(timer); reject(new Error(`viewer exited with ${code}: ${err}`)); });
  });
}

export async function launch() {
  const profile = fs.mkdtempSync(path.join(os.tmpdir(), 'sa-chromium-'));
  const context = await chromium.launchPersistentContext(profile, {
    executablePath: CHROMIUM,
    headless: true,
    viewport: { width: 1500, height: 950 },
    args: ['--headless', '--no-sandbox', '--disable-gpu', '--disable-quic', '--no-first-run',
      '--disable-background-networking', '--disable-component-update', '--disable-sync'],
  });
  return { context, close: async () => { await context.close(); fs.rmSync(profile, { recursive: true, force: true }); } };
}

// Opens `url` and waits for the viewer's first complete draw; returns the page and the
// milliseconds from navigation to that draw.
export async function openViewer(context, url) {
  const page = await context.newPage();
  const errors = [];
  page.on('pageerror', e => errors.push(String(e)));
  const t0 = Date.now();
  await page.goto(url);
  await page.waitForFunction(() => window.__viz && (window.__viz.ready || window.__viz.error), null, { timeout: 120000 });
  const ms = Date.now() - t0;
  const error = await page.evaluate(() => window.__viz.error);
  if (error || errors.length) throw new Error(`viewer failed: ${error || errors.join('; ')}`);
  return { page, ms };
}

// The peak resident memory (VmHWM, MiB) of the largest renderer process among this
// process's descendants: the page's memory, as the operating system counts it.
export function rendererPeakMiB() {
  const parent = new Map();
  for (const pid of fs.readdirSync('/proc').filter(p => /^\d+$/.test(p))) {
    try {
      const stat = fs.readFileSync(`/proc/${pid}/stat`, 'utf8');
      parent.set(Number(pid), Number(stat.slice(stat.lastIndexOf(')') + 2).split(' ')[1]));
    } catch { /* gone */ }
  }
  const descends = pid => {
    for (let p = pid; p > 1; p = parent.get(p)) if (p === process.pid) return true;
    return false;
  };
  let peak = 0;
  for (const pid of parent.keys()) {
    if (!descends(pid)) continue;
    try {
      if (!fs.readFileSync(`/proc/${pid}/cmdline`, 'utf8').includes('--type=renderer')) continue;
      const m = fs.readFileSync(`/proc/${pid}/status`, 'utf8').match(/VmHWM:\s+(\d+) kB/);
      if (m) peak = Math.max(peak, Number(m[1]) / 1024);
    } catch { /* gone */ }
  }
  return peak;
}
