# Runs every (workload, allocator) of work.py in its own process with a timeout, one at a
# time, the columns of a workload back to back, and prints one markdown table, last.
#   python3 driver.py OUT
# Called by run.sh, which sets the common environment. OUT gets logs/, results/ and table.md.
# Knobs: TOTAL_S (no run starts after this many seconds, 450), FRAG_PYTHON (the Python with
# torch), FRAG_ROWS (comma-separated subset of gpt2,gpt2_varlen,resnet,infer), FRAG_ROUNDS
# (each row's columns this many times, 1): round k starts at column k, so no column always
# runs first, and speed is the median over rounds of each round's ratio to native (the first
# process of a row has read up to 45% faster or slower than the next, whatever it ran),
# FRAG_COLUMNS (comma-separated columns besides native, which every ratio needs; default
# pt_expandable,sa_default,sa_whole; sa_noreclaim adds streamalloc with reclaim:false).
import json
import os
import signal
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
from driverlib import last_error_line  # noqa: E402
OUT = os.path.abspath(sys.argv[1])
LOGS, RESULTS = os.path.join(OUT, "logs"), os.path.join(OUT, "results")
TOTAL_S = float(os.environ.get("TOTAL_S", 450))
PY = os.environ.get("FRAG_PYTHON", sys.executable)
ROUNDS = max(1, int(os.environ.get("FRAG_ROUNDS", 1)))

# (column, header, environment it runs under; None = unset)
COLUMNS = [
    ("native", "PyTorch native",
     {"PYTORCH_CUDA_ALLOC_CONF": None, "STREAMALLOC_CONF": None}),
    ("pt_expandable", "PyTorch expandable_segments:True",
     {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True", "STREAMALLOC_CONF": None}),
    ("sa_default", "streamalloc default (no STREAMALLOC_CONF)",
     {"PYTORCH_CUDA_ALLOC_CONF": None, "STREAMALLOC_CONF": None}),
    ("sa_whole", "streamalloc expandable_segments:false",
     {"PYTORCH_CUDA_ALLOC_CONF": None, "STREAMALLOC_CONF": "expandable_segments:false"}),
    ("sa_noreclaim", "streamalloc reclaim:false",
     {"PYTORCH_CUDA_ALLOC_CONF": None, "STREAMALLOC_CONF": "reclaim:false"}),
]
DEFAULT_COLUMNS = "pt_expandable,sa_default,sa_whole"
_chosen = os.environ.get("FRAG_COLUMNS") or DEFAULT_COLUMNS
_unknown = set(_chosen.split(",")) - {c for c, _, _ in COLUMNS}
if _unknown:
    sys.exit(f"FRAG_COLUMNS: unknown column(s) {', '.join(sorted(_unknown))}; "
             f"known: {', '.join(c for c, _, _ in COLUMNS)}")
ALL_COLUMNS = COLUMNS
COLUMNS = [c for c in ALL_COLUMNS if c[0] == "native" or c[0] in _chosen.split(",")]
# (work, label, timeout s)
ROWS = [
    ("gpt2", "1. GPT-2 small training, 8 x 1024", 180),
    ("gpt2_varlen", "2. GPT-2 small training, 8 x 256..1024 (per step, seeded)", 180),
    ("resnet", "3. ResNet-50 training, batch 64", 150),
    ("infer", "4. GPT-2 small bf16 generate, KV cache, batch 1-16, prompt 16-512, 32-128 new", 240),
]
DOOR_TIMEOUT = 300


class Job:
    def __init__(self, work, col, timeout, round_index=0):
        self.work, self.col, self.timeout, self.round = work, col, timeout, round_index
        self.name = f"{work}__{col}" + (f"__r{round_index}" if ROUNDS > 1 else "")
        self.log = os.path.join(LOGS, self.name + ".log")
        self.res = os.path.join(RESULTS, self.name + ".json")
        self.rc = self.seconds = None
        self.timed_out = self.skipped = False

    def run(self, env):
        env = dict(env)
        for k, v in dict((c, e) for c, _, e in ALL_COLUMNS)[self.col].items():
            if v is None:
                env.pop(k, None)
            else:
                env[k] = v
        argv = [PY, os.path.join(HERE, "work.py"), self.work, self.col, self.res]
        t0 = time.monotonic()
        with open(self.log, "w") as log:
            shown = " ".join(f"{k}={env.get(k, '')}" for k in ("PYTORCH_CUDA_ALLOC_CONF", "STREAMALLOC_CONF"))
            log.write(f"$ {shown} {' '.join(argv)}\n")
            log.flush()
            # Own session: a timeout kills the whole group, whatever it started.
            proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=HERE,
                                    start_new_session=True)
            try:
                self.rc = proc.wait(timeout=self.timeout)
            except subprocess.TimeoutExpired:
                self.timed_out = True
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # a timeout, or leftovers of a finished run
            except (ProcessLookupError, PermissionError):
                pass
            if self.rc is None:
                self.rc = proc.wait()
            self.seconds = time.monotonic() - t0
            log.write(f"\n[driver] rc={self.rc} seconds={self.seconds:.1f}{' TIMEOUT' if self.timed_out else ''}\n")


def load(job):
    """(result, None) or (None, the cell that says why there is none)."""
    if job.skipped:
        return None, "skipped (time budget)"
    try:
        with open(job.res) as f:
            r = json.load(f)
    except (OSError, ValueError):
        if job.timed_out:
            return None, f"error: timeout after {job.timeout}s"
        if job.rc is not None and job.rc < 0:
            return None, f"error: killed by signal {-job.rc}"
        return None, "error: " + last_error_line(job.log)[:60]
    if "error" in r:
        return None, "error: " + r["error"][:60]
    return r, None


def small(x):
    """1.2e-06 -> '1e-6'; 0 -> '0'."""
    if x != x:
        return "nan"
    return "0" if x == 0 else f"{x:.0e}".replace("e-0", "e-").replace("e+0", "e")


def ratio_text(r):
    return f"ratio {r['ratio_whole']:.3f} ({r['ratio_timed']:.3f})"


def median(values):
    values = sorted(values)
    n = len(values)
    return values[n // 2] if n % 2 else (values[n // 2 - 1] + values[n // 2]) / 2


def speed(rounds, native_rounds, key):
    """Median over rounds of (this column's `key` / native's in the same round), and how many
    rounds gave both; None if none did."""
    ratios = [r[key] / n[key] for r, n in zip(rounds, native_rounds) if r and n and n[key]]
    return (median(ratios), len(ratios)) if ratios else None


def rounds_note(count):
    return f" (median of {count} rounds)" if ROUNDS > 1 else ""


def train_cell(r, native, is_native, ratio=None):
    parts = [ratio_text(r)]
    if native is None:
        parts.append(f"{r['timed_s'] / (r['steps'] - r['warmup']) * 1e3:.1f} ms/step, no native time")
    elif is_native:
        parts.append(f"time 1.00x ({native['timed_s'] / (native['steps'] - native['warmup']) * 1e3:.1f} ms/step)")
    else:
        value, count = ratio or (r["timed_s"] / native["timed_s"], 1)
        parts.append(f"time {value:.2f}x{rounds_note(count)}")
        a, b = r["losses"], native["losses"]
        if len(a) != len(b):
            parts.append(f"Δloss n/a ({len(a)} vs {len(b)} steps)")
        else:
            diffs = [abs(x - y) for x, y in zip(a, b)]
            parts.append("Δloss " + small(float("nan") if any(d != d for d in diffs) else max(diffs)))
    return ", ".join(parts)


def infer_cell(r, native, is_native, ratio=None):
    parts = [ratio_text(r)]
    if native is None or is_native:
        parts.append(f"{r['tokens_per_s']:.0f} tok/s")
    else:
        value, count = ratio or (r["tokens_per_s"] / native["tokens_per_s"], 1)
        parts.append(f"tok/s {value:.2f}x{rounds_note(count)}")
        a, b = r["token_hashes"], native["token_hashes"]
        if len(a) != len(b):
            parts.append(f"Δtok n/a ({len(a)} vs {len(b)} requests)")
        else:
            parts.append(f"Δtok {sum(x != y for x, y in zip(a, b))}/{len(a)}")
    return ", ".join(parts)


def clean(cell):
    return cell.replace("|", "/").replace("\n", " ")


def main():
    os.makedirs(LOGS, exist_ok=True)
    os.makedirs(RESULTS, exist_ok=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    t0 = time.monotonic()
    wanted = os.environ.get("FRAG_ROWS")
    rows = [row for row in ROWS if not wanted or row[0] in wanted.split(",")]

    # The native door is compiled at the first install: done here, before anything is timed,
    # so that no workload's timeout has to cover it.
    door = Job("door", "sa_default", DOOR_TIMEOUT)
    jobs = [door]
    names = [col for col, _, _ in COLUMNS]
    for work, _, timeout in rows:
        for k in range(ROUNDS):
            order = names[k % len(names):] + names[:k % len(names)]
            jobs += [Job(work, col, timeout, k) for col in order]
    for j in jobs:
        if time.monotonic() - t0 > TOTAL_S:
            j.skipped = True
            print(f"[{time.monotonic() - t0:6.1f}s] skip {j.name} (TOTAL_S={TOTAL_S:.0f})", flush=True)
            continue
        print(f"[{time.monotonic() - t0:6.1f}s] start {j.name}", flush=True)
        j.run(env)
        r, why = load(j)
        status = why or "ok"
        print(f"[{time.monotonic() - t0:6.1f}s] done {j.name} rc={j.rc} in {j.seconds:.1f}s: {status}", flush=True)

    index = {(j.work, j.col, j.round): j for j in jobs}
    lines = ["| workload | " + " | ".join(h for _, h, _ in COLUMNS) + " |",
             "| --- |" + " --- |" * len(COLUMNS)]
    seen = {}  # streamalloc column -> rows where it mapped memory (expandable segments in use)
    doors = set()
    for work, label, _ in rows:
        native_rounds = [load(index[(work, "native", k)])[0] for k in range(ROUNDS)]
        native = next((n for n in native_rounds if n), None)
        cells = []
        for col, _, _ in COLUMNS:
            results = [load(index[(work, col, k)]) for k in range(ROUNDS)]
            r, why = next(((r, w) for r, w in results if r), results[0])
            if r is None:
                cells.append(why)
                continue
            try:
                cell = infer_cell if work == "infer" else train_cell
                key = "tokens_per_s" if work == "infer" else "timed_s"
                ratio = speed([x for x, _ in results], native_rounds, key) if ROUNDS > 1 else None
                cells.append(cell(r, native, col == "native", ratio))
            except (KeyError, TypeError, ValueError, ZeroDivisionError) as e:
                cells.append(f"error: table: {type(e).__name__}: {e}"[:67])
            if col.startswith("sa_"):
                doors.add(r.get("door"))
                if r.get("streamalloc", {}).get("expandable_seen"):
                    seen.setdefault(col, []).append(work)
        lines.append("| " + clean(label) + " | " + " | ".join(clean(c) for c in cells) + " |")
    table = "\n".join(lines)
    door_r, door_why = load(door)
    mapped = "; ".join(f"{col}: {', '.join(seen.get(col, [])) or 'none'}" for col, _, _ in COLUMNS
                       if col.startswith("sa_"))
    summary = "\n".join([
        f"wall {time.monotonic() - t0:.0f} s; logs and JSON in {OUT}; "
        f"door build: {door_why or 'ok, %.0f s' % door.seconds}; streamalloc doors seen: "
        f"{', '.join(sorted(str(d) for d in doors)) or 'none'}",
        f"rows where streamalloc mapped memory (expandable segments in use): {mapped}",
        "ratio: peak reserved / peak allocated (torch.cuda.max_memory_*) over the whole run "
        "(in brackets: peaks reset after the warm-up, as alloc_bench.py measures); time: timed "
        "steps' total vs PyTorch native (warm-up untimed, same steps, < 1 faster); tok/s: "
        "generated tokens per second vs native (> 1 faster); Δloss: max abs loss difference "
        "vs native over all steps; Δtok: requests whose generated tokens differ from native's",
    ])
    with open(os.path.join(OUT, "table.md"), "w") as f:
        f.write(summary + "\n\n" + table + "\n")
    print()
    print(summary)
    print()
    print(table)


if __name__ == "__main__":
    main()
