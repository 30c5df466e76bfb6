# The many-tensor exchange on N GPUs, every method side by side, in one table:
#   * the reproduction's pattern (seed000_scale.py: every rank sends T[i][j] float32 tensors
#     of 1-66 KB to every other rank j, posted in random order in one batch), scaled to
#     ~58,000 ops per rank: one merged buffer per peer, streamalloc.p2p.batch_isend_irecv
#     (the drop-in: first run of a shape, then steady), Exchange over the copy engine and over NCCL
#     (agreed once, then run() every step);
#   * PyTorch's one op per tensor at ~1,410, ~5,800 and ~58,000 ops per rank, each cell
#     under a watchdog: a cell that does not finish reads "hang" and the bench goes on;
#   * ~85 parameter-shaped bf16 tensors (587 MB) to the next rank of a ring: GB/s;
#   * NCCL's network transport (NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1) at ~5,500 ops per
#     rank: merged, Exchange and the drop-in over NCCL, then one op per tensor.
# Every received value is checked. Usage (plain python3: it starts torchrun itself, one
# process per GPU, several times, so that a hung cell can be killed):
#   python3 benches/gpu/p2p/bench.py N [--quick] [--only CELLS] [--out DIR] [--budget-mib 128]
# --quick: two per-tensor cells, fewer timed steps. --only: a comma-separated list of cells
# (pt_1410, pt_5800, pt_58000, dropin, exchange_ce, exchange_nccl, merged, params_merged,
# params_exchange_ce, params_exchange_nccl, net_merged, net_dropin, net_exchange_nccl,
# net_per_tensor); benches/gpu/p2p/accept.sh runs the acceptance's cells this way. DIR gets p2p_bench.jsonl (one record
# per cell) and the workers' logs. The table is printed last.
import argparse
import datetime
import json
import os
import signal
import subprocess
import sys
import time

from bench_worker import NETWORK_OPS, PATTERN_OPS, Worker

# Every environment this bench starts: no NVLink SHARP / multicast paths.
SAFE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
            "NVSHMEM_DISABLE_NVLS": "1"}
NETWORK_ENV = {"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1"}
CELL_TIMEOUT_S = 20  # a cell that has not finished by then is hung
PER_TENSOR_OPS = (1_410, 5_800, 58_000)


# ---- Launcher ----

def read_records(path):
    records = []
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                try:
                    records.append(json.loads(line))
                except ValueError:
                    pass  # a line being written
    return records


def launch(n, cells, args, env_extra, log_path, total_timeout):
    """Runs one torchrun over `cells` with the watchdog. Returns (outcome, open cell):
    outcome "exit:<code>", "hang" (a cell ran past CELL_TIMEOUT_S) or "timeout"."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={n}", os.path.abspath(__file__), "--worker",
           "--cells", ",".join(cells), "--results", args.results, "--steps", str(args.steps),
           "--budget-mib", str(args.budget_mib), "--ops-factor", str(args.ops_factor)]
    if args.dry_run_cpu:
        cmd.append("--dry-run-cpu")
    env = dict(os.environ, **SAFE_ENV, **env_extra)
    seen = len(read_records(args.results))
    with open(log_path, "a") as log:
        log.write(f"== {' '.join(cmd)}\n")
        log.flush()
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        start = time.time()
        outcome = None
        while proc.poll() is None:
            time.sleep(0.5)
            open_cell = None
            for rec in read_records(args.results)[seen:]:
                if rec.get("status") == "start":
                    open_cell = rec
                elif rec.get("status") == "done":
                    open_cell = None
            now = time.time()
            if open_cell is not None and now - open_cell["t"] > CELL_TIMEOUT_S:
                outcome = "hang"
            elif now - start > total_timeout:
                outcome = "timeout"
            if outcome:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                return outcome, open_cell and open_cell["cell"]
        open_cell = None
        for rec in read_records(args.results)[seen:]:
            if rec.get("status") == "start":
                open_cell = rec["cell"]
            elif rec.get("status") == "done":
                open_cell = None
        return f"exit:{proc.returncode}", open_cell


def run_cells(n, cells, args, env_extra, log_path, total_timeout, outcome_of):
    """Runs `cells`, relaunching after a hung or crashed cell with the cells still to run."""
    pending = list(cells)
    for _ in range(len(cells) + 1):
        if not pending:
            return
        outcome, open_cell = launch(n, pending, args, env_extra, log_path, total_timeout)
        done = {r["cell"] for r in read_records(args.results) if r.get("status") == "done"}
        if open_cell is not None:
            outcome_of[open_cell] = ("hang" if outcome == "hang" else
                                     "timeout" if outcome == "timeout" else "crash")
        pending = [c for c in pending if c not in done and c not in outcome_of]
        if outcome.startswith("exit:") and open_cell is None and pending:
            for c in pending:  # the worker failed outside any cell: see the log
                outcome_of[c] = f"not run ({outcome})"
            return


def fmt_ms(s):
    return f"{s * 1e3:,.1f} ms"


def table(args, n, outcome_of, started):
    recs = read_records(args.results)
    meta = next((r for r in recs if r.get("status") == "meta"), {})
    done = {r["cell"]: r for r in recs if r.get("status") == "done"}
    errors = {r["cell"]: f"rank {r['rank']}: {r['error']}" for r in recs if r.get("status") == "error"}
    lines = []
    quick = " --quick" if args.quick else ""
    lines.append(f"p2p bench, {started:%Y-%m-%d %H:%M} UTC: {n} x {meta.get('gpu', '?')}, "
                 f"torch {meta.get('torch', '?')}, NCCL {meta.get('nccl', '?')}, staging budget "
                 f"{args.budget_mib:g} MiB")
    lines.append(f"command: python3 benches/gpu/p2p/bench.py {n}{quick}; slowest rank; steady = "
                 "median of the timed steps after the first; 'ok' = every received value checked")
    lines.append("")
    lines.append("| workload | method | first run of a shape | steady | extra memory | ok |")
    lines.append("| --- | --- | --- | --- | --- | --- |")

    def row(workload, method, cell, rate=False):
        r = done.get(cell)
        if r is None:
            why = outcome_of.get(cell, "not run")
            if cell in errors:
                why = f"error: {errors[cell]}"
            elif why == "hang":
                why = f"hang (no completion in {CELL_TIMEOUT_S} s)"
            lines.append(f"| {workload} | {method} | {why} | | | |")
            return
        steady = fmt_ms(r["steady_s"])
        if rate:
            steady += f" ({r['gb_per_s']:.0f} GB/s)"
        transport = f" [{r['transport']}]" if "dropin" in cell else ""
        if r.get("packing") not in (None, "-"):
            transport += f" (packing: {r['packing']})"
        lines.append(f"| {workload} | {method}{transport} | {fmt_ms(r['first_s'])} | {steady} | "
                     f"+{r['extra_mib']:,.0f} MiB | {'ok' if r['ok'] else 'WRONG'} |")

    def ops_label(cell, target):
        r = done.get(cell)
        return f"{r['ops']:,} ops/rank" if r else f"~{target:,} ops/rank"

    pattern = ops_label("dropin", PATTERN_OPS)
    per_tensor = [c for c in ("pt_1410", "pt_5800", "pt_58000") if c in outcome_of or c in done]
    for cell in per_tensor:
        target = int(cell[3:])
        row(f"pattern, {ops_label(cell, target)}", "one P2POp per tensor (torch)", cell)
    row(f"pattern, {pattern}", "merged buffer per peer", "merged")
    row(f"pattern, {pattern}", "streamalloc batch_isend_irecv", "dropin")
    row(f"pattern, {pattern}", "Exchange, copy engine", "exchange_ce")
    row(f"pattern, {pattern}", "Exchange, NCCL", "exchange_nccl")
    p = done.get("params_exchange_ce") or done.get("params_merged")
    params = (f"{p['tensors']} params, {p['bytes_sent'] / 1e6:.0f} MB to the next rank" if p
              else "parameter-shaped tensors, 587 MB")
    row(params, "merged buffer", "params_merged", rate=True)
    row(params, "Exchange, copy engine", "params_exchange_ce", rate=True)
    row(params, "Exchange, NCCL", "params_exchange_nccl", rate=True)
    net = "network (P2P, SHM off), " + ops_label("net_dropin", NETWORK_OPS)
    row(net, "merged buffer per peer", "net_merged")
    row(net, "streamalloc batch_isend_irecv", "net_dropin")
    row(net, "Exchange, NCCL", "net_exchange_nccl")
    row(net, "one P2POp per tensor (torch)", "net_per_tensor")
    return "\n".join(lines)


def launcher(args):
    n = args.nproc
    os.makedirs(args.out, exist_ok=True)
    args.results = os.path.join(args.out, "p2p_bench.jsonl")
    if os.path.exists(args.results):
        os.remove(args.results)
    args.steps = 3 if args.quick else 5
    started = datetime.datetime.now(datetime.timezone.utc)
    log = os.path.join(args.out, "p2p_bench.log")
    outcome_of = {}
    t0 = time.time()
    only = set(filter(None, args.only.split(","))) if args.only else None
    pick = lambda cells: [c for c in cells if only is None or c in only]
    per_tensor = [f"pt_{ops}" for ops in (PER_TENSOR_OPS[:2] if args.quick else PER_TENSOR_OPS)]
    if only is not None:
        per_tensor = [f"pt_{ops}" for ops in PER_TENSOR_OPS]
    if pick(per_tensor):
        run_cells(n, pick(per_tensor), args, {}, log, 120, outcome_of)
    main_cells = ["dropin", "exchange_ce", "exchange_nccl", "merged",
                  "params_merged", "params_exchange_ce", "params_exchange_nccl"]
    if pick(main_cells):
        run_cells(n, pick(main_cells), args, {}, log, 150, outcome_of)
    net_cells = ["net_merged", "net_dropin", "net_exchange_nccl", "net_per_tensor"]
    if pick(net_cells):
        run_cells(n, pick(net_cells), args, NETWORK_ENV, log, 120, outcome_of)
    text = table(args, n, outcome_of, started)
    with open(os.path.join(args.out, "p2p_bench.md"), "w") as f:
        f.write(text + "\n")
    errored = {r["cell"] for r in read_records(args.results) if r.get("status") == "error"}
    failed = [c for c, why in outcome_of.items() if why != "hang" or c in errored]
    if failed:
        print(f"cells that failed ({', '.join(failed)}); the last lines of {log}:")
        with open(log) as f:
            print("".join(f.readlines()[-25:]))
    print(f"(whole bench: {time.time() - t0:.0f} s)")
    print(text)
    wrong = [r["cell"] for r in read_records(args.results) if r.get("status") == "done" and not r["ok"]]
    return 1 if wrong or failed else 0


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("nproc", type=int, nargs="?", default=None, help="GPUs (ranks)")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", default="p2p_bench_out")
    parser.add_argument("--budget-mib", type=float, default=128)
    parser.add_argument("--only", default="", help="comma-separated cells to run (default: all)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--cells", default="", help=argparse.SUPPRESS)
    parser.add_argument("--results", default="", help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, default=5, help=argparse.SUPPRESS)
    # A dry run of the bench's plumbing (cells, watchdog, table) on CPU over gloo, with the
    # op counts scaled by --ops-factor; the copy-engine cells then fail, as they must.
    parser.add_argument("--dry-run-cpu", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--ops-factor", type=float, default=1.0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        Worker(args).main()
        return 0
    if not args.nproc or args.nproc < 2:
        parser.error("give the number of GPUs (2 or more): bench.py N")
    return launcher(args)


if __name__ == "__main__":
    sys.exit(main())
