#!/usr/bin/env python3
"""Distributed training under three allocators on N GPUs of one host: peak reserved / peak
allocated, step time, losses, and whether streamalloc maps or unmaps pages once warm.

    python3 bench.py OUT [--ngpu N] [--dry-run]          # the driver (run.sh calls it)

Rows: fsdp2_gpt2, fsdp2_ckpt, ddp_gpt2 and tp_allreduce of `workloads.py` (which says what
each trains), in this order. Columns: pt (PyTorch's allocator), pt_expandable
(PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True), sa (streamalloc, default configuration),
and sa_conf (streamalloc configured by DIST_SA_CONF, when that is set).

Each (row, column) is its own torchrun launch of `workloads.py --worker` with a timeout; the
columns of a row run back to back. Every rank writes OUT/results/ROW__COLUMN.rankR.json; the
driver writes OUT/runs.json and OUT/table.md and prints the table last.

Knobs (environment): DIST_ROWS, DIST_COLUMNS (comma-separated subsets), DIST_STEPS (timed
steps of every row; default 12, tp_allreduce 30), DIST_WARMUP (untimed steps first, 3),
DIST_TIMEOUT (seconds per launch, 150), TOTAL_S (no launch starts after this many seconds,
480), DIST_PYTHON (the Python with torch; this one), DIST_COMMAND (the command shown in the
table's header; run.sh sets it).
"""

import argparse
import datetime
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
from driverlib import last_error_line as any_error_line  # noqa: E402

sys.path.insert(0, HERE)
from workloads import COLUMNS, COMMON_ENV, SA_COUNTERS, env_int, write_json  # noqa: E402

WORKLOADS = os.path.join(HERE, "workloads.py")

# (row, label, default timed steps)
ROWS = [
    ("fsdp2_gpt2", "FSDP2 GPT-2 small, bf16 params, 8 x 128..1024", 12),
    ("fsdp2_ckpt", "FSDP2 + activation checkpointing, Llama 12 x 1024, 4 x 128..2048", 12),
    ("ddp_gpt2", "DDP GPT-2 small, fp32, 8 x 512", 12),
    ("tp_allreduce", "TP MLP + all_reduce, bf16, 8192 x 4096", 30),
]
SA_SHOWN = (("page_map_bytes", "map"), ("page_unmap_bytes", "unmap"), ("device_syncs", "syncs"),
            ("stitches", "stitches"), ("stitch_revivals", "revivals"))
DOOR_TIMEOUT = 300


def pick(knob, known):
    """The names chosen by the comma-separated knob (all of `known` if unset), in `known`'s order."""
    wanted = os.environ.get(knob)
    if not wanted:
        return list(known)
    chosen = [w.strip() for w in wanted.split(",") if w.strip()]
    unknown = sorted(set(chosen) - set(known))
    if unknown or not chosen:
        raise SystemExit(f"{knob}={wanted!r}: unknown {', '.join(unknown) or 'empty list'}; known: {', '.join(known)}")
    return [k for k in known if k in chosen]


def timed_steps(row):
    return env_int("DIST_STEPS", dict((r, s) for r, _, s in ROWS)[row])


# ---------------------------------------------------------------- driver ---------------

class Launch:
    def __init__(self, name, argv, env_changes, timeout, result_files, log):
        self.name, self.argv, self.env_changes, self.timeout = name, argv, env_changes, timeout
        self.result_files, self.log = result_files, log
        self.rc = self.seconds = None
        self.timed_out = self.skipped = False

    def describe(self, shown_once=()):
        changes = " ".join(f"-u {k}" if v is None else f"{k}={v}" for k, v in self.env_changes.items()
                           if k not in shown_once)
        return f"{self.name}: timeout {self.timeout}s; env {changes}; {' '.join(self.argv)}"

    def run(self, base_env):
        env = dict(base_env)
        for k, v in self.env_changes.items():
            if v is None:
                env.pop(k, None)
            else:
                env[k] = v
        for f in self.result_files:
            if os.path.exists(f):
                os.remove(f)
        t0 = time.monotonic()
        with open(self.log, "w") as log:
            log.write(f"$ {self.describe()}\n")
            log.flush()
            # Own session: a timeout ends the whole group (torchrun and every rank).
            proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=HERE,
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
            log.write(f"\n[driver] rc={self.rc} seconds={self.seconds:.1f}"
                      f"{' TIMEOUT' if self.timed_out else ''}\n")


ERROR_LINE = re.compile(r"\b\w*(Error|Exception)\b.*:")
# torchrun's own report of a failed rank, which names no cause.
LAUNCHER_NOISE = ("ChildFailedError", "torch.distributed.elastic", "error_file", "traceback :", "To enable traceback")


def last_error_line(path):
    """The last line of the log naming an error that is not torchrun's wrapper of it."""
    try:
        lines = [l.strip() for l in open(path, errors="replace") if l.strip() and not l.startswith("[driver]")]
    except OSError:
        return "no log"
    for l in reversed(lines):
        if ERROR_LINE.search(l) and not any(n in l for n in LAUNCHER_NOISE):
            return l
    return any_error_line(path)


def collect(launch, ngpu):
    """(per-rank results, None) or (None, the 'fail: ...' cell saying why there are none)."""
    if launch.skipped:
        return None, "skipped (TOTAL_S)"
    ranks, missing = [], []
    for r, path in enumerate(launch.result_files):
        try:
            with open(path) as f:
                ranks.append(json.load(f))
        except (OSError, ValueError):
            ranks.append(None)
            missing.append(r)
    errors = sorted((x for x in ranks if x and "error" in x), key=lambda x: x.get("failed_at", 0))
    if errors:
        where = f"rank {errors[0]['rank']}: " if "rank" in errors[0] else ""
        return None, f"fail: {where}{errors[0]['error']}"
    if launch.timed_out:
        return None, f"fail: timeout after {launch.timeout}s"
    if missing:
        return None, "fail: " + last_error_line(launch.log)
    if launch.rc != 0:
        return None, f"fail: rc {launch.rc}: " + last_error_line(launch.log)
    return ranks, None


def small(x):
    """1.2e-06 -> '1e-6'; 0 -> '0'."""
    if x != x:
        return "nan"
    return "0" if x == 0 else f"{x:.0e}".replace("e-0", "e-").replace("e+0", "e")


def size_text(n):
    if n is None:
        return "n/a"
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def summarise(ranks):
    ratios = [(x["ratio_whole"], x["rank"]) for x in ranks if x.get("ratio_whole") is not None]
    worst = max(ratios) if ratios else (None, None)
    first = next(x for x in ranks if x["rank"] == 0)
    s = {"ratio_worst": worst[0], "ratio_worst_rank": worst[1],
         "ratio_timed_worst": max((x["ratio_timed"] for x in ranks if x.get("ratio_timed") is not None), default=None),
         "peak_reserved_max": max(x["peaks_bytes"]["whole"]["reserved"] for x in ranks),
         "peak_allocated_max": max(x["peaks_bytes"]["whole"]["allocated"] for x in ranks),
         "step_ms_median_rank0": first["step_ms_median"], "losses_rank0": first["losses"],
         "door": first.get("door")}
    if all("sa_timed" in x for x in ranks):
        sums = {}
        for k in SA_COUNTERS:
            values = [x["sa_timed"].get(k) for x in ranks]
            sums[k] = None if any(v is None for v in values) else sum(values)
        s["sa_timed_all_ranks"] = sums
    return s


def loss_diff(a, b):
    if len(a) != len(b):
        return f"Δloss n/a ({len(a)} vs {len(b)} steps)"
    diffs = [abs(x - y) for x, y in zip(a, b)]
    return "Δloss " + small(float("nan") if any(d != d for d in diffs) else max(diffs))


def cell(s, base, is_base):
    parts = [f"ratio {s['ratio_worst']:.3f} (r{s['ratio_worst_rank']})" if s["ratio_worst"] else "ratio n/a",
             f"{size_text(s['peak_reserved_max'])} res",
             f"{s['step_ms_median_rank0']:.1f} ms"]
    if base and not is_base:
        parts[-1] += f" ({s['step_ms_median_rank0'] / base['step_ms_median_rank0']:.2f}x)"
        parts.append(loss_diff(s["losses_rank0"], base["losses_rank0"]))
    elif not base and not is_base:
        parts.append("Δloss n/a (no pt run)")
    return ", ".join(parts)


def counters_cell(s):
    sums = s.get("sa_timed_all_ranks")
    if sums is None:
        return "n/a"
    shown = []
    for key, label in SA_SHOWN:
        v = sums.get(key)
        value = "n/a" if v is None else (size_text(v) if key.endswith("_bytes") else str(v))
        shown.append(f"{label} {value}")
    return ", ".join(shown)


def clean(text):
    return str(text).replace("|", "/").replace("\n", " ")


def machine_name():
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=30).stdout
        return out.strip().splitlines()[0] if out.strip() else "unknown GPU"
    except (OSError, subprocess.SubprocessError):
        return "unknown GPU (no nvidia-smi)"


def gpu_count():
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return sum(1 for l in out.splitlines() if l.startswith("GPU ")) or None


def plan(out, ngpu, rows, cols):
    py = os.environ.get("DIST_PYTHON") or sys.executable
    logs, results = os.path.join(out, "logs"), os.path.join(out, "results")
    timeout = env_int("DIST_TIMEOUT", 150)
    launches = []
    if "sa" in cols:
        # Builds the native door once, on one GPU, so that no timed launch pays for it.
        res = os.path.join(results, "door.json")
        launches.append(Launch("door", [py, WORKLOADS, "--door", res],
                               {"CUDA_VISIBLE_DEVICES": "0", **COMMON_ENV,
                                "PYTORCH_CUDA_ALLOC_CONF": None, "STREAMALLOC_CONF": None},
                               DOOR_TIMEOUT, [res], os.path.join(logs, "door.log")))
    col_env = {c: e for c, _, e in COLUMNS}
    for row in rows:
        for col in cols:
            name = f"{row}__{col}"
            prefix = os.path.join(results, name)
            argv = [py, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ngpu}",
                    WORKLOADS, "--worker", row, col, prefix]
            launches.append(Launch(name, argv, {**COMMON_ENV, **col_env[col]}, timeout,
                                   [f"{prefix}.rank{r}.json" for r in range(ngpu)],
                                   os.path.join(logs, name + ".log")))
    return launches


def drive(out, ngpu, dry_run):
    rows = pick("DIST_ROWS", [r for r, _, _ in ROWS])
    cols = pick("DIST_COLUMNS", [c for c, _, _ in COLUMNS if c != "sa_conf" or os.environ.get("DIST_SA_CONF")])
    total_s = float(os.environ.get("TOTAL_S") or 480)
    launches = plan(out, ngpu, rows, cols)
    command = os.environ.get("DIST_COMMAND") or " ".join(["python3", os.path.relpath(__file__)] + sys.argv[1:])
    if dry_run:
        print(f"plan: {len(launches)} launches on {ngpu} GPU(s), rows {','.join(rows)}, columns {','.join(cols)}, "
              f"warm-up {env_int('DIST_WARMUP', 3)}, timed steps "
              + ", ".join(f"{r} {timed_steps(r)}" for r in rows) + f"; no launch starts after {total_s:.0f} s")
        print("every launch: " + " ".join(f"{k}={v}" for k, v in COMMON_ENV.items()))
        for launch in launches:
            print("  " + launch.describe(shown_once=COMMON_ENV))
        return 0
    if shutil.which(launches[-1].argv[0]) is None and not os.path.exists(launches[-1].argv[0]):
        raise SystemExit(f"no Python at {launches[-1].argv[0]}")
    os.makedirs(os.path.join(out, "logs"), exist_ok=True)
    os.makedirs(os.path.join(out, "results"), exist_ok=True)
    base_env = dict(os.environ)
    t0 = time.monotonic()
    door_fallback = None
    for launch in launches:
        elapsed = time.monotonic() - t0
        if elapsed > total_s:
            launch.skipped = True
            print(f"[{elapsed:6.1f}s] skip {launch.name} (TOTAL_S={total_s:.0f})", flush=True)
            continue
        if door_fallback and launch.name.endswith("__sa"):
            # Every rank would try to build the native door again, at once, into one folder.
            launch.env_changes["STREAMALLOC_DOOR"] = "pluggable"
        print(f"[{elapsed:6.1f}s] start {launch.name}", flush=True)
        launch.run(base_env)
        results, why = collect(launch, ngpu)
        if launch.name == "door" and (why or results[0].get("door") != "native"):
            door_fallback = why or f"the door in use is {results[0].get('door')}"
            print(f"native door unavailable ({door_fallback}): the sa launches use the pluggable door",
                  flush=True)
        print(f"[{time.monotonic() - t0:6.1f}s] done {launch.name} rc={launch.rc} in {launch.seconds:.1f}s: "
              f"{why or 'ok'}", flush=True)

    by_name = {l.name: l for l in launches}
    summaries, runs = {}, {}
    for row in rows:
        for col in cols:
            launch = by_name[f"{row}__{col}"]
            ranks, why = collect(launch, ngpu)
            if ranks is not None:
                try:
                    summaries[(row, col)] = summarise(ranks)
                except (KeyError, TypeError, ValueError, StopIteration) as e:
                    why = f"fail: table: {type(e).__name__}: {e}"
            runs[launch.name] = {"row": row, "column": col, "seconds": launch.seconds, "rc": launch.rc,
                                 "failure": why, "summary": summaries.get((row, col))}
    door_launch = by_name.get("door")
    door_note = ""
    if door_launch is not None:
        _, door_why = collect(door_launch, 1)
        door_note = f"; native door build: {door_why or 'ok, %.0f s' % door_launch.seconds}"
        if door_fallback:
            door_note = f"; native door unavailable ({door_fallback}): sa launches used the pluggable door"
    doors = sorted({str(s.get("door")) for (_, col), s in summaries.items() if col == "sa"})
    if doors:
        door_note += f"; streamalloc door in use: {', '.join(doors)}"
    write_json(os.path.join(out, "runs.json"), runs)

    headers = {c: h for c, h, _ in COLUMNS}
    show_counters = "sa" in cols
    lines = ["| workload | " + " | ".join(headers[c] for c in cols) + " |"
             + (" sa: page work in timed steps, all ranks |" if show_counters else ""),
             "| --- |" + " --- |" * (len(cols) + show_counters)]
    labels = {r: l for r, l, _ in ROWS}
    for row in rows:
        base = summaries.get((row, "pt"))
        cells = []
        for col in cols:
            s = summaries.get((row, col))
            cells.append(cell(s, base, col == "pt") if s else runs[f"{row}__{col}"]["failure"][:160])
        if show_counters:
            s = summaries.get((row, "sa"))
            cells.append(counters_cell(s) if s else "n/a")
        label = f"{row}: {labels[row]}, {timed_steps(row)} timed steps"
        lines.append("| " + clean(label) + " | " + " | ".join(clean(c) for c in cells) + " |")
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    header = f"{date}; {machine_name()} x {ngpu}; command: {command}"
    legend = ("ratio: peak reserved / peak allocated over the whole run, the worst rank (rN); res: the "
              "largest peak reserved of any rank; ms: median step time of rank 0 (synchronised), in "
              "brackets vs PyTorch; Δloss: max abs difference of rank 0's losses from PyTorch's, every step; "
              "page work: streamalloc's bytes mapped and unmapped, device syncs, stitched ranges made and "
              f"revived, between the end of the warm-up and the end (0 = no remapping once warm). "
              f"wall {time.monotonic() - t0:.0f} s{door_note}; logs and JSON in {out}")
    text = header + "\n" + legend + "\n\n" + "\n".join(lines) + "\n"
    with open(os.path.join(out, "table.md"), "w") as f:
        f.write(text)
    print()
    print(text, end="")
    return 0


def main():
    parser = argparse.ArgumentParser(description="Distributed training under PyTorch's allocator, its "
                                                 "expandable segments and streamalloc (see the module doc).")
    parser.add_argument("out", help="folder for logs/, results/, runs.json and table.md")
    parser.add_argument("--ngpu", type=int, help="GPUs (ranks) per launch; default: every GPU nvidia-smi lists")
    parser.add_argument("--dry-run", action="store_true", help="print the launch plan and exit")
    args = parser.parse_args()
    ngpu = args.ngpu if args.ngpu is not None else gpu_count()
    if ngpu is None:
        parser.error("no GPU listed by nvidia-smi: give --ngpu")
    if ngpu < 1:
        parser.error(f"--ngpu must be at least 1, not {ngpu}")
    return drive(os.path.abspath(args.out), ngpu, args.dry_run)


if __name__ == "__main__":
    sys.exit(main())
