#!/usr/bin/env python3
"""Memory under pressure: the lowest memory cap at which each allocator still trains, and how
fast each is when memory is plentiful. PyTorch's expandable segments against streamalloc's
default configuration; one table.

    python3 caps.py OUT --phase dist [--ngpu N] [--dry-run]   # 4-rank rows (every GPU)
    python3 caps.py OUT --phase single [--gpus 0,1] [--dry-run]  # one-GPU rows side by side

Per row (workloads.py says what each trains):
  1. uncapped: the two allocators alternately, CAPS_REPEATS launches each (3): the median of
     their median step times (machines' step times drift between launches, so only
     alternating launches of one call are compared), peak reserved / peak allocated (worst
     rank), losses;
  2. live: the largest peak allocated of any rank over those launches;
  3. caps: for each allocator, the lowest of 1.000, 1.005, ..., 1.050 x live under which it
     trains, bisected from 1.020 in at most CAPS_PROBES launches (4); the cap is
     `torch.cuda.set_per_process_memory_fraction` before the first allocation (PyTorch's own
     limit; streamalloc's through its door), or with DIST_CAP_MODE=device the device's other
     memory held by a driver allocation, no limit set (as when another process holds it),
     leaving RATIO x live plus what the process used outside its allocator uncapped; its
     caps run from 0.900 to 1.050, bisected from 1.000. A launch in which any rank runs out of memory
     fails the cap, unless the program alone needed more than the cap there (the bytes live
     when it asked plus its request exceed the limit: no allocator could serve it, and the
     peak of some programs differs between launches): such a probe is launched again,
     CAPS_RETRY times (1), for either allocator, and the table names the caps where that
     happened. streamalloc's step time under 1.020 x live is reported against its own
     uncapped time.
Phase dist runs fsdp2_gpt2, fsdp2_ckpt and ddp_gpt2 (CAPS_ROWS) on every GPU, one after the
other; phase single runs gpt2_varlen and generate, each on its own GPU of --gpus (two).

Knobs: CAPS_ROWS, CAPS_SEARCH (the allocators whose lowest cap is searched: pt_expandable,sa),
CAPS_REPEATS (3), CAPS_PROBES (4), CAPS_RETRY (1), DIST_WARMUP (2), DIST_STEPS (8, the same
in every launch of a row so that its sequence lengths and its peak are the same),
DIST_TIMEOUT (s per launch, 150), TOTAL_S (no launch starts after it, 540). Results in
OUT/caps_PHASE.json, logs in OUT/logs, the table printed last and saved as
OUT/caps_PHASE.md; both are also written after every launch, marked partial, so that a run
stopped from outside leaves what it measured.
"""

import argparse
import datetime
import json
import os
import statistics
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from bench import Launch, clean, collect, loss_diff, machine_name, size_text  # noqa: E402
from workloads import COMMON_ENV, COLUMNS, env_int, out_of_memory, write_json  # noqa: E402

WORKLOADS = os.path.join(HERE, "workloads.py")
PHASE_ROWS = {"dist": ["fsdp2_gpt2", "fsdp2_ckpt", "ddp_gpt2"], "single": ["gpt2_varlen", "generate"]}
ALLOCATORS = ["pt_expandable", "sa"]
HEADERS = {"pt_expandable": "PyTorch expandable", "sa": "streamalloc"}

# The caps tried, in steps of 0.005 of the live peak, and the first one. A device-level cap
# (DIST_CAP_MODE=device) leaves the process what it used outside its allocator on top of
# RATIO x live, measured at the end of an uncapped launch; part of that may not be needed at
# the peak, so its caps go below 1.000 and its bisection starts at 1.000.
def caps_for(mode):
    low = 0.9 if mode == "device" else 1.0
    caps = [round(low + 0.005 * k, 3) for k in range(round((1.05 - low) / 0.005) + 1)]
    return caps, caps.index(1.0 if mode == "device" else 1.02)


class Runner:
    """Launches of one phase: the plan, the clock, and what each launch left."""

    def __init__(self, out, phase, ngpu, dry_run):
        self.out, self.phase, self.ngpu, self.dry_run = out, phase, ngpu, dry_run
        self.py = os.environ.get("DIST_PYTHON") or sys.executable
        self.timeout = env_int("DIST_TIMEOUT", 150)
        self.total_s = float(os.environ.get("TOTAL_S") or 540)
        self.t0 = time.monotonic()
        self.lock = threading.Lock()
        self.write_lock = threading.Lock()
        self.count = 0
        self.results = self.placements = None  # set by main once the plan is known
        self.overran = {}  # launch name -> the out-of-memory the program alone caused
        self.steps = {"DIST_WARMUP": str(env_int("DIST_WARMUP", 2)), "DIST_STEPS": str(env_int("DIST_STEPS", 8))}
        self.caps, self.first_cap = caps_for(cap_mode())

    def checkpoint(self):
        """Writes the table as it stands, marked partial, so that a run stopped from outside
        (a timeout) still leaves what it measured; the end of the run writes it whole."""
        if self.dry_run or self.results is None:
            return
        with self.write_lock:
            save(self, partial=True)

    def log(self, text):
        with self.lock:
            print(f"[{time.monotonic() - self.t0:6.1f}s] {text}", flush=True)

    def launch(self, row, col, name, gpus, extra_env=None):
        """Runs one launch of `row` under `col` on `gpus`; returns (per-rank results or None,
        the failure or None, whether it ran out of memory, seconds). The out-of-memory a
        launch ended with is noted in `self.overran[name]` when the program alone needed more
        than the cap ([`overran_cap`])."""
        given = name
        with self.lock:
            self.count += 1
            name = f"{self.count:02d}_{name}"
        prefix = os.path.join(self.out, "results", name)
        nproc = len(gpus.split(","))
        argv = [self.py, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
                WORKLOADS, "--worker", row, col, prefix]
        env = {**COMMON_ENV, **dict((c, e) for c, _, e in COLUMNS)[col], **self.steps,
               "CUDA_VISIBLE_DEVICES": gpus, "DIST_CAP_RATIO": None, "DIST_LIVE_BYTES": None,
               "DIST_OUTSIDE_BYTES": None, "DIST_CAP_MODE": cap_mode(),
               **(extra_env or {})}
        launch = Launch(name, argv, env, self.timeout, [f"{prefix}.rank{r}.json" for r in range(nproc)],
                        os.path.join(self.out, "logs", name + ".log"))
        if self.dry_run:
            print("  " + launch.describe(shown_once=COMMON_ENV))
            return None, "dry run", False, 0.0
        if time.monotonic() - self.t0 > self.total_s:
            self.log(f"skip {name} (TOTAL_S={self.total_s:.0f})")
            return None, SKIPPED, False, 0.0
        self.log(f"start {name}")
        launch.run(dict(os.environ))
        ranks, why = collect(launch, nproc)
        oom = why is not None and out_of_memory(why)
        over = overran_cap(launch.result_files) if oom else None
        if over:
            with self.lock:
                self.overran[given] = over
        self.log(f"done {name} in {launch.seconds:.1f}s: {'out of memory' if oom else why or 'ok'}"
                 + (f" (live {size_text(over['allocated'])} + {size_text(over['request'])} asked > "
                    f"limit {size_text(over['limit'])})" if over else ""))
        return ranks, why, oom, launch.seconds


# The failure of a launch that never started: the script's time budget (TOTAL_S) ran out.
SKIPPED = "skipped (TOTAL_S)"


def overran_cap(result_files):
    """The last out-of-memory of a failed launch's ranks, if the program alone needed more than
    the cap there: the bytes live when it asked plus the bytes it asked for exceed the limit
    (workloads.py notes them with PyTorch's out-of-memory observer, under a memory fraction
    only). No allocator can serve such a request; the cap failed by the program's peak, which
    can differ between launches (a warm-up transient that only some launches meet). None
    when no rank noted one, or when the request fit within the limit (the allocator's failure)."""
    for path in result_files:
        try:
            with open(path) as f:
                seen = json.load(f).get("oom_seen")
        except (OSError, ValueError):
            continue
        if seen and seen["allocated"] + seen["request"] > seen["limit"]:
            return seen
    return None


def worst(ranks, key):
    return max(r["peaks_bytes"]["whole"][key] for r in ranks)


def uncapped(runner, row, gpus, result):
    """CAPS_REPEATS launches of each allocator, alternating; fills result['uncapped']."""
    runs = result["uncapped"] = {col: [] for col in ALLOCATORS}
    for i in range(env_int("CAPS_REPEATS", 3)):
        for col in ALLOCATORS:
            ranks, why, _, _ = runner.launch(row, col, f"{row}__{col}__uncapped{i}", gpus)
            runs[col].append({"failure": why} if ranks is None else {
                "step_ms": next(r for r in ranks if r["rank"] == 0)["step_ms_median"],
                "reserved": worst(ranks, "reserved"), "allocated": worst(ranks, "allocated"),
                "ratio": max(r["ratio_whole"] for r in ranks if r.get("ratio_whole")),
                "losses": next(r for r in ranks if r["rank"] == 0)["losses"],
                "outside": max((r.get("outside_allocator_bytes") or 0) for r in ranks),
                "sa_timed": sum_counters(ranks)})
            ok = [run for c in ALLOCATORS for run in runs[c] if "failure" not in run]
            result["live_bytes"] = max((run["allocated"] for run in ok), default=None)
            runner.checkpoint()


def sum_counters(ranks):
    if not all("sa_timed" in r for r in ranks):
        return None
    keys = ("page_map_bytes", "page_unmap_bytes", "device_syncs", "stitches", "stitch_revivals", "vmm_ns")
    return {k: sum((r["sa_timed"].get(k) or 0) for r in ranks) for k in keys}


def counter_text(key, value):
    """One of streamalloc's summed counters, as the table shows it."""
    if key.endswith("_bytes"):
        return f"{key.replace('_bytes', '')} {size_text(value)}"
    if key == "vmm_ns":
        return f"driver {value / 1e6:.0f} ms (all ranks)"
    return f"{key} {value}"


def lowest_cap(runner, row, col, gpus, live, result):
    """Bisects the runner's caps from its first for the lowest cap under which `col` trains."""
    caps = runner.caps
    probes, low_fail, high_ok, index = {}, -1, None, runner.first_cap
    unfinished = False
    # A device-level cap leaves each allocator what its own process used outside it in its
    # uncapped launches (the most of them) on top of the cap.
    outside = max((run.get("outside") or 0 for run in result["uncapped"][col]), default=0)

    def record():
        result.setdefault("caps", {})[col] = {
            "probes": probes,
            "lowest": caps[high_ok] if high_ok is not None else None,
            # Exact when the step below was tried and failed (or the lowest cap trains).
            "exact": high_ok is not None and (high_ok == 0 or caps[high_ok - 1] in probes),
            "unfinished": unfinished,
        }

    retries = env_int("CAPS_RETRY", 1)
    for _ in range(env_int("CAPS_PROBES", 4)):
        cap = caps[index]
        overran = []
        for attempt in range(1 + max(0, retries)):
            name = f"{row}__{col}__cap{cap:.3f}" + (f"_again{attempt}" if attempt else "")
            ranks, why, oom, _ = runner.launch(row, col, name, gpus,
                                               {"DIST_CAP_RATIO": f"{cap}", "DIST_LIVE_BYTES": str(live),
                                                "DIST_OUTSIDE_BYTES": str(outside)})
            over = runner.overran.get(name)
            if not over:
                break
            # The program alone needed more than the cap: a peak other launches need not
            # meet. Launched again (CAPS_RETRY times), for either allocator alike.
            overran.append(over)
        if why == SKIPPED:
            unfinished = True  # a probe not made is neither a pass nor a failure
            break
        if ranks is not None:
            probes[cap] = {"trains": True, "step_ms": next(r for r in ranks if r["rank"] == 0)["step_ms_median"],
                           "reserved": worst(ranks, "reserved"), "sa_timed": sum_counters(ranks)}
            high_ok = index
        else:
            probes[cap] = {"trains": False, "oom": oom, "failure": why}
        if overran:
            probes[cap]["program_overran"] = overran
            probes[cap]["launches"] = attempt + 1
        if ranks is None:
            if not oom:
                break  # not a memory failure: no bisection on it
            low_fail = index
        record()
        runner.checkpoint()
        if high_ok is None:
            index = low_fail + max(1, (len(caps) - low_fail) // 2)
        else:
            index = (low_fail + high_ok) // 2
        if index >= len(caps) or index in (low_fail, high_ok) or caps[index] in probes:
            break
    record()


def run_row(runner, row, gpus, results):
    result = results.setdefault(row, {"gpus": gpus})
    uncapped(runner, row, gpus, result)
    live = result.get("live_bytes") or (1 if runner.dry_run else None)
    if live is None:
        runner.log(f"{row}: no uncapped launch trained: no caps tried")
        return
    search = os.environ.get("CAPS_SEARCH", ",".join(ALLOCATORS)).split(",")
    for col in ALLOCATORS:
        if col in search:
            lowest_cap(runner, row, col, gpus, live, result)


def med(values):
    return statistics.median(values) if values else None


def cap_text(c):
    """The lowest cap, and the caps where the program's live bytes and its request alone
    exceeded the cap in some launch (in how many of that cap's launches)."""
    text = lowest_text(c)
    notes = []
    for cap, probe in sorted((c or {}).get("probes", {}).items()):
        over = len(probe.get("program_overran") or [])
        if over:
            notes.append(f"{cap:.3f} in {over} of {probe.get('launches', over)} launches")
    if notes:
        text += f" (the program alone exceeded the cap at {', '.join(notes)})"
    return text


def lowest_text(c):
    if not c:
        return "not reached"
    if c["lowest"] is None:
        if not c["probes"]:
            return "not reached"
        tried = ", ".join(f"{k:.3f}" for k in sorted(c["probes"]))
        failures = [p for p in c["probes"].values() if not p.get("oom")]
        text = f"none of {tried}"
        if failures:
            text += f" (fail: {clean(failures[0]['failure'])[:80]})"
        return text + ("; higher caps not reached" if c.get("unfinished") else "")
    if c["exact"]:
        return f"{c['lowest']:.3f}"
    return f"{c['lowest']:.3f} (" + ("lower caps not reached" if c.get("unfinished") else "below untried") + ")"


# How a cap is applied (DIST_CAP_MODE, passed on to every launch; workloads.py does it).
CAP_HOW = {"fraction": ", set with torch.cuda.set_per_process_memory_fraction",
           "device": ", left free on the device, with what the process used outside its allocator "
                     "uncapped, the rest held by a driver allocation (DIST_CAP_MODE=device: no limit "
                     "is set, the allocator meets the driver's refusals)"}



def caps_text():
    """Where the bisection starts and the range it searches, as the legend says it."""
    caps, first = caps_for(cap_mode())
    return f"{caps[first]:.3f} by bisection in steps of 0.005 ({caps[0]:.3f}-{caps[-1]:.3f})"


def cap_mode():
    mode = os.environ.get("DIST_CAP_MODE") or "fraction"
    if mode not in CAP_HOW:
        raise SystemExit(f"caps.py: DIST_CAP_MODE={mode!r}: fraction or device")
    return mode


def table(results, rows, header):
    lines = ["| workload | live peak | expandable: ms, reserved/live | streamalloc: ms (x expandable), "
             "reserved/live | lowest cap that trains: expandable | streamalloc | streamalloc at 1.020: "
             "ms (x own uncapped) | Δloss | streamalloc page work, uncapped timed steps |",
             "| --- |" + " --- |" * 8]
    for row in rows:
        r = results.get(row, {})
        un = r.get("uncapped", {})
        ok = {col: [x for x in un.get(col, []) if "failure" not in x] for col in ALLOCATORS}
        ms = {col: med([x["step_ms"] for x in ok[col]]) for col in ALLOCATORS}
        ratio = {col: med([x["ratio"] for x in ok[col]]) for col in ALLOCATORS}
        cells = [size_text(r.get("live_bytes"))]
        for col in ALLOCATORS:
            if ms[col] is None:
                failures = [x["failure"] for x in un.get(col, [])]
                cells.append(clean(failures[0] if failures else "not run")[:120])
                continue
            text = f"{ms[col]:.1f} ms"
            if col == "sa" and ms["pt_expandable"]:
                text += f" ({ms['sa'] / ms['pt_expandable']:.3f}x)"
            cells.append(f"{text}, {ratio[col]:.3f} (n={len(ok[col])})")
        caps = r.get("caps", {})
        cells += [cap_text(caps.get("pt_expandable")), cap_text(caps.get("sa"))]
        at = caps.get("sa", {}).get("probes", {}).get(1.02)
        if at is None:
            cells.append("not reached" if caps.get("sa", {}).get("unfinished", True) else "not tried")
        elif at.get("trains") and ms["sa"]:
            cells.append(f"{at['step_ms']:.1f} ms ({at['step_ms'] / ms['sa']:.3f}x)")
        elif at.get("trains"):
            cells.append(f"{at['step_ms']:.1f} ms")
        else:
            cells.append("out of memory" if at.get("oom") else clean(at.get("failure") or "failed")[:80])
        if ok["sa"] and ok["pt_expandable"]:
            cells.append(loss_diff(ok["sa"][0]["losses"], ok["pt_expandable"][0]["losses"]))
        else:
            cells.append("n/a")
        counters = [x.get("sa_timed") for x in ok["sa"] if x.get("sa_timed")]
        cells.append(", ".join(counter_text(k, v) for k, v in counters[-1].items()) if counters else "n/a")
        lines.append(f"| {row} | " + " | ".join(clean(c) for c in cells) + " |")
    legend = ("ms: median over launches of each launch's median step time (rank 0, synchronised), launches "
              "alternating between the allocators; reserved/live: peak reserved / peak allocated, worst rank, "
              f"median over launches; caps are multiples of the live peak, tried from {caps_text()}"
              + CAP_HOW[cap_mode()] + "; Δloss: max abs difference of rank 0's losses (generate: a "
              "checksum of the generated tokens) between the first launch of each allocator.")
    return header + "\n" + legend + "\n\n" + "\n".join(lines) + "\n"


def main():
    parser = argparse.ArgumentParser(description="Lowest memory cap that trains, and uncapped speed (see the module doc).")
    parser.add_argument("out")
    parser.add_argument("--phase", choices=sorted(PHASE_ROWS), required=True)
    parser.add_argument("--ngpu", type=int, default=None, help="ranks of the dist rows (default: every GPU)")
    parser.add_argument("--gpus", default="0,1", help="the single phase's GPUs, one per row (default 0,1)")
    parser.add_argument("--dry-run", action="store_true")
    args = parser.parse_args()
    cap_mode()  # an unknown mode stops here, before any launch
    out = os.path.abspath(args.out)
    rows = PHASE_ROWS[args.phase]
    wanted = os.environ.get("CAPS_ROWS")
    if wanted:
        rows = [r for r in rows if r in wanted.split(",")]
        if not rows:
            parser.error(f"CAPS_ROWS={wanted!r} names none of {PHASE_ROWS[args.phase]}")
    if args.phase == "dist":
        ngpu = args.ngpu or env_int("CAPS_NGPU", 0) or 4
        placements = [(row, ",".join(str(g) for g in range(ngpu))) for row in rows]
    else:
        gpus = [g.strip() for g in args.gpus.split(",") if g.strip()]
        if len(gpus) < len(rows) or not all(g.isdigit() for g in gpus):
            parser.error(f"--gpus {args.gpus!r}: one GPU index per row ({', '.join(rows)})")
        placements = list(zip(rows, gpus))
    os.makedirs(os.path.join(out, "logs"), exist_ok=True)
    os.makedirs(os.path.join(out, "results"), exist_ok=True)
    runner = Runner(out, args.phase, None, args.dry_run)
    results = {}
    runner.results, runner.placements = results, placements
    if args.dry_run:
        print(f"plan: phase {args.phase}, rows {', '.join(r for r, _ in placements)}; each: "
              f"{env_int('CAPS_REPEATS', 3)} x 2 uncapped launches, then up to {env_int('CAPS_PROBES', 4)} "
              f"capped launches per allocator; no launch starts after {runner.total_s:.0f} s")
        for row, gpus in placements:
            run_row(runner, row, gpus, results)
        return 0
    if args.phase == "dist":
        for row, gpus in placements:
            run_row(runner, row, gpus, results)
    else:
        threads = [threading.Thread(target=run_row, args=(runner, row, gpus, results)) for row, gpus in placements]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    text = save(runner, partial=False)
    print()
    print(text, end="")
    return 0


def save(runner, partial):
    """Writes OUT/caps_PHASE.json and .md from the results so far; returns the table."""
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    command = os.environ.get("CAPS_COMMAND") or " ".join(["python3", "benches/gpu/dist/caps.py"] + sys.argv[2:])
    placements = runner.placements
    header = (f"{date}; {machine_name()}; phase {runner.phase} ({', '.join(f'{r} on GPU {g}' for r, g in placements)}); "
              f"command: {command}; wall {time.monotonic() - runner.t0:.0f} s"
              + ("; PARTIAL: written after a launch, the run had not ended" if partial else ""))
    write_json(os.path.join(runner.out, f"caps_{runner.phase}.json"), runner.results)
    text = table(runner.results, [r for r, _ in placements], header)
    with open(os.path.join(runner.out, f"caps_{runner.phase}.md"), "w") as f:
        f.write(text)
    return text


if __name__ == "__main__":
    sys.exit(main())
