# Runs every check of checks.py (and alloc_bench.py through bench_wrap.py) in its own
# process with a timeout, for each allocator, and prints one markdown table, last.
#   python3 driver.py OUT
# Called by run.sh, which sets the environment. OUT gets logs/, results/ and table.md.
# Correctness checks run JOBS (default 6) at a time on the one GPU; the timed ones
# (training, the Python loop) run afterwards, alone.
import json
import os
import signal
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
from driverlib import last_error_line  # noqa: E402
OUT = os.path.abspath(sys.argv[1])
LOGS, RESULTS = os.path.join(OUT, "logs"), os.path.join(OUT, "results")
JOBS = int(os.environ.get("JOBS", 6))
TOTAL_S = float(os.environ.get("TOTAL_S", 470))     # no job starts after this
PARALLEL_S = float(os.environ.get("PARALLEL_S", 280))  # no correctness check starts after this
ROUNDS = int(os.environ.get("MICRO_ROUNDS", 3))
PY = os.environ.get("TORCH_DOOR_PYTHON", sys.executable)  # the Python that has torch

COLUMNS = [
    ("native", "PyTorch native"),
    ("sa_native", "streamalloc native door"),
    ("sa_pluggable", "streamalloc pluggable door"),
    ("sa_expandable", "streamalloc native door, expandable_segments:true"),
]
ALL = [c for c, _ in COLUMNS]
SA = ALL[1:]
CONF = {"sa_expandable": "expandable_segments:true"}
BUILDS_DOOR = ("sa_native", "sa_expandable")  # columns that load the compiled native door

# (row, label, columns, timeout s)
CHECK_ROWS = [
    ("door", "0. install + first allocation (the native door compiles at first use)", ALL, 300),
    ("graph_default", "1a. graph replays x3 vs eager tensors on the default stream", ALL, 120),
    ("graph_capture_stream", "1b. graph replays x3 vs eager tensors on the capture stream", ALL, 120),
    ("graph_nopools", "1c. as 1a with STREAMALLOC_CONF=graph_pools:false (must corrupt)", ["sa_native", "sa_pluggable"], 120),
    ("graphed_callables", "2. make_graphed_callables MLP: outputs/grads, memory back", ALL, 150),
    ("shared_pool", "3. two graphs, one graph_pool_handle(): outputs, reserved drops", ALL, 120),
    ("compile_small", "4a. torch.compile reduce-overhead, small MLP (infer+train)", ALL, 240),
    ("compile_gpt2", "4b. torch.compile reduce-overhead, GPT-2 small (infer+train)", ALL, 400),
    ("spawn_child_streamalloc", "5a. spawn: child (streamalloc, same door) adds 1 in place", SA, 150),
    ("spawn_child_pytorch", "5b. spawn: child (PyTorch's allocator) adds 1 in place", ALL, 150),
    ("mempool", "6. MemPool + use_mem_pool: placement, empty_cache after delete", ALL, 120),
    ("memory_history", "7. _record_memory_history, _dump_snapshot, _memory_viz, streamalloc CLI", ALL, 150),
    ("cudnn_benchmark", "8. cudnn.benchmark ResNet-50 fwd/bwd", ALL, 200),
    ("memory_stats", "9. torch.cuda memory stats (native door: PyTorch's own functions)", ALL, 120),
]
TRAIN_ROWS = [
    ("train_gpt2", "10a. GPT-2 small training (alloc_bench.py): step vs native, peak res/alloc, losses", "gpt2"),
    ("train_resnet", "10b. ResNet-50 training (alloc_bench.py): step vs native, peak res/alloc, losses", "resnet"),
]
MICRO_COLUMNS = ["native", "sa_native", "sa_pluggable"]
MICRO_LABEL = (f"11. Python alloc/free loop (alloc_bench micro), median of {ROUNDS} alternating processes: "
               "PyTorch's allocator cannot be swapped inside a process")
GPU_TEST_LABEL = "12. streamalloc-gpu-test (engine, no PyTorch)"


class Job:
    def __init__(self, row, col, argv, timeout, conf=None, after=(), name=None):
        self.row, self.col, self.argv, self.timeout, self.conf = row, col, argv, timeout, conf
        self.after = list(after)
        self.name = name or f"{row}__{col}"
        self.log = os.path.join(LOGS, self.name + ".log")
        self.res = os.path.join(RESULTS, self.name + ".json")
        self.proc = self.start_t = None
        self.state = "pending"  # pending | running | done | skipped
        self.rc = self.seconds = None
        self.timed_out = False

    def start(self, env):
        env = dict(env)
        if self.conf is None:
            env.pop("STREAMALLOC_CONF", None)
        else:
            env["STREAMALLOC_CONF"] = self.conf
        self.logf = open(self.log, "w")
        self.logf.write(f"$ STREAMALLOC_CONF={self.conf or ''} {' '.join(self.argv)}\n")
        self.logf.flush()
        self.start_t = time.monotonic()
        # Own session: a timeout kills the whole group (spawned children included).
        self.proc = subprocess.Popen(self.argv, stdout=self.logf, stderr=subprocess.STDOUT, env=env,
                                     cwd=HERE, start_new_session=True)
        self.state = "running"

    def poll(self):
        rc = self.proc.poll()
        elapsed = time.monotonic() - self.start_t
        if rc is None and elapsed > self.timeout:
            self.kill()
            self.timed_out = True
            rc = self.proc.wait()
        elif rc is not None:
            self.kill()  # leftovers of a finished check (a stuck spawned child)
        if rc is None:
            return False
        self.rc, self.seconds, self.state = rc, elapsed, "done"
        self.logf.write(f"\n[driver] rc={rc} seconds={elapsed:.1f}{' TIMEOUT' if self.timed_out else ''}\n")
        self.logf.close()
        return True

    def kill(self):
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def run_jobs(jobs, parallel, deadline, t0, env):
    by_name = {j.name: j for j in jobs}
    while True:
        running = [j for j in jobs if j.state == "running"]
        for j in running:
            if j.poll():
                print(f"[{time.monotonic() - t0:6.1f}s] done {j.name} rc={j.rc} in {j.seconds:.1f}s"
                      f"{' (timeout)' if j.timed_out else ''}", flush=True)
        pending = [j for j in jobs if j.state == "pending"]
        running = [j for j in jobs if j.state == "running"]
        if not pending and not running:
            return
        if time.monotonic() - t0 > deadline:
            for j in pending:
                j.state = "skipped"
            pending = []
        for j in pending:
            if len(running) >= parallel:
                break
            if all(by_name[a].state in ("done", "skipped") for a in j.after if a in by_name):
                j.start(env)
                running.append(j)
                print(f"[{time.monotonic() - t0:6.1f}s] start {j.name}", flush=True)
        time.sleep(0.2)


def check_job(row, col, timeout, after=()):
    alloc = col
    conf = CONF.get(col)
    if row == "graph_nopools":
        conf = "graph_pools:false"
    return Job(row, col, [PY, os.path.join(HERE, "checks.py"), row, alloc, ""], timeout, conf, after)


def failure_cell(j):
    if j.state == "skipped":
        return "skipped (time budget)"
    if j.timed_out:
        return f"error: timeout after {j.timeout}s"
    if j.rc is not None and j.rc < 0:
        return f"error: killed by signal {-j.rc}"
    return "error: " + last_error_line(j.log)[:60]


def load(j):
    try:
        with open(j.res) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def clean(cell):
    return cell.replace("|", "/").replace("\n", " ")


def check_cell(j):
    r = load(j)
    if r is None:
        return failure_cell(j)
    if "error" in r:
        return "error: " + r["error"][:60]
    return f"{r.get('status', '?')}: {r.get('figure', '')}"


def train_cell(j, native):
    r = load(j)
    if r is None:
        return failure_cell(j), None
    if "error" in r:
        return "error: " + r["error"][:60], None
    peak = f"peak {r['peak_reserved_mib']:.0f}/{r['peak_allocated_mib']:.0f} MiB"
    if j.col == "native" or native is None or "step_ms" not in native:
        return f"{r['step_ms']:.1f} ms, {peak}", r
    diff = max(abs(a - b) for a, b in zip(r["losses"], native["losses"]))
    ok = diff <= 1e-3 and len(r["losses"]) == len(native["losses"])
    return (f"{'PASS' if ok else 'FAIL'}: {r['step_ms'] / native['step_ms']:.3f}x, {peak}, "
            f"Δloss {diff:.1e}"), r


def main():
    os.makedirs(LOGS, exist_ok=True)
    os.makedirs(RESULTS, exist_ok=True)
    env = dict(os.environ, CHECK_OUT_DIR=OUT, PYTHONUNBUFFERED="1")
    t0 = time.monotonic()

    # ---- correctness checks, JOBS at a time ----
    # Every streamalloc check waits for the first native-door process, which builds the
    # door's extension; the others then load it from the extension cache.
    door = {"sa_native": check_job("door", "sa_native", 300)}
    first = door["sa_native"].name
    gpt2_native = check_job("compile_gpt2", "native", 400)
    jobs = [door["sa_native"], gpt2_native]  # GPT-2's inductor cache speeds up the other columns
    for col in ALL:
        if col != "sa_native":
            door[col] = check_job("door", col, 300, [first] if col in BUILDS_DOOR else [])
            jobs.append(door[col])
    later = []
    for row, _, cols, timeout in CHECK_ROWS:
        if row == "door":
            continue
        for col in cols:
            if row == "compile_gpt2" and col == "native":
                continue
            after = [first] if col in BUILDS_DOOR else []
            if row == "compile_gpt2":
                later.append(check_job(row, col, timeout, after + [gpt2_native.name]))
            else:
                jobs.append(check_job(row, col, timeout, after))
    jobs += later
    gpu_test = None
    if os.environ.get("STREAMALLOC_GPU_TEST"):
        gpu_test = Job("gpu_test", "sa_native", [os.environ["STREAMALLOC_GPU_TEST"]], 240)
        jobs.append(gpu_test)
    for j in jobs:  # the result path goes last on the command line
        if j.argv[-1] == "":
            j.argv[-1] = j.res
    run_jobs(jobs, JOBS, PARALLEL_S, t0, env)

    # ---- timed work, one process at a time ----
    timed = []
    wrap = os.path.join(HERE, "bench_wrap.py")
    for row, _, work in TRAIN_ROWS:
        for col in ALL:
            j = Job(row, col, [PY, wrap, col, work, ""], 240, CONF.get(col))
            j.argv[-1] = j.res
            timed.append(j)
    micro = []
    for k in range(ROUNDS):
        order = MICRO_COLUMNS[k % len(MICRO_COLUMNS):] + MICRO_COLUMNS[:k % len(MICRO_COLUMNS)]
        for col in order:
            j = Job("micro", col, [PY, wrap, col, "micro", ""], 120, CONF.get(col), name=f"micro__{col}__{k}")
            j.argv[-1] = j.res
            micro.append(j)
    run_jobs(timed + micro, 1, TOTAL_S, t0, env)

    # ---- the table ----
    rows = []
    index = {(j.row, j.col): j for j in jobs + timed}
    for row, label, cols, _ in CHECK_ROWS:
        cells = []
        for col in ALL:
            j = index.get((row, col))
            cells.append(check_cell(j) if j and col in cols else "-")
        rows.append((label, cells))
    for row, label, _ in TRAIN_ROWS:
        native = load(index[(row, "native")])
        if native is not None and "error" in native:
            native = None
        rows.append((label, [train_cell(index[(row, col)], native)[0] for col in ALL]))
    per_col = {}
    for j in micro:
        r = load(j)
        if r and "ns_per_op" in r:
            per_col.setdefault(j.col, []).append(r["ns_per_op"])
    micro_cells = []
    base = statistics.median(per_col["native"]) if per_col.get("native") else None
    for col in ALL:
        if col not in MICRO_COLUMNS:
            micro_cells.append("-")
        elif per_col.get(col):
            v = statistics.median(per_col[col])
            ratio = f" ({v / base:.3f}x)" if base and col != "native" else ""
            micro_cells.append(f"{v:.0f} ns/op{ratio}, {len(per_col[col])} runs")
        else:
            failed = [j for j in micro if j.col == col]
            micro_cells.append(failure_cell(failed[0]) if failed else "-")
    rows.append((MICRO_LABEL, micro_cells))
    if gpu_test is not None:
        try:
            text = open(gpu_test.log, errors="replace").read()
        except OSError:
            text = ""
        passes, fails = text.count("\nPASS "), text.count("\nFAIL ")
        if gpu_test.state == "done" and not gpu_test.timed_out:
            cell = f"{'PASS' if gpu_test.rc == 0 and fails == 0 else 'FAIL'}: {passes} PASS, {fails} FAIL, rc {gpu_test.rc}"
            if "SKIP" in text and passes == 0:
                cell = "FAIL: SKIP (no device seen)"
        else:
            cell = failure_cell(gpu_test)
    else:
        cell = "not run (STREAMALLOC_GPU_TEST unset)"
    rows.append((GPU_TEST_LABEL, ["-", cell, "-", "-"]))

    lines = ["| check | " + " | ".join(name for _, name in COLUMNS) + " |",
             "| --- |" + " --- |" * len(COLUMNS)]
    for label, cells in rows:
        lines.append("| " + clean(label) + " | " + " | ".join(clean(c) for c in cells) + " |")
    table = "\n".join(lines)
    doors = {}
    for col in ALL:
        r = load(door[col]) if door[col].state == "done" else None
        if r:
            doors[col] = r.get("install", {}).get("door", "pytorch")
    summary = (f"wall {time.monotonic() - t0:.0f} s; doors seen: {doors}; logs and JSON in {OUT}; "
               f"cells: PASS/FAIL/caught/n/a: figure, or error: first 60 characters")
    with open(os.path.join(OUT, "table.md"), "w") as f:
        f.write(summary + "\n\n" + table + "\n")
    print()
    print(summary)
    print()
    print(table)


if __name__ == "__main__":
    main()
