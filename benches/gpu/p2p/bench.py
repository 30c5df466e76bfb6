# The many-tensor exchange on N GPUs, every method side by side, in one table:
#   * the reproduction's pattern (seed000_scale.py: every rank sends T[i][j] float32 tensors
#     of 1-66 KB to every other rank j, posted in random order in one batch), scaled to
#     ~58,000 ops per rank: one merged buffer per peer, streamalloc.p2p.batch_isend_irecv
#     (the drop-in: first call, then steady), Exchange over the copy engine and over NCCL
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
import random
import signal
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
# Every environment this bench starts: no NVLink SHARP / multicast paths.
SAFE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
            "NVSHMEM_DISABLE_NVLS": "1"}
NETWORK_ENV = {"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1"}
CELL_TIMEOUT_S = 20  # a cell that has not finished by then is hung
PER_TENSOR_OPS = (1_410, 5_800, 58_000)
PATTERN_OPS = 58_000
NETWORK_OPS = 5_500
PARAMS_BYTES = 560 << 20  # ~587 MB of bf16 per rank


# ---- Workloads ----

def pattern_T(world, scale):
    """seed000_scale.py's T: (1 + randperm(N*N)) * scale, seeded 42, no sends to oneself."""
    import torch

    g = torch.Generator().manual_seed(42)
    T = ((1 + torch.randperm(world * world, generator=g)) * scale).reshape(world, world).tolist()
    for j in range(world):
        T[j][j] = 0
    return T


def ops_per_rank(world, scale):
    T = pattern_T(world, scale)
    return max(sum(T[r]) + sum(T[j][r] for j in range(world)) for r in range(world))


def scale_for(world, ops):
    """The scale whose busiest rank posts about `ops` operations."""
    return max(1, round(ops / ops_per_rank(world, 1)))


def elements(i, j):
    return 256 + ((i * 7919 + j * 104729) % 16384)  # float32: 1-66 KB


def param_sizes(seed, factor=1.0):
    """Parameter-shaped bf16 element counts (norms, matrices, a few large), PARAMS_BYTES."""
    import torch

    g = torch.Generator().manual_seed(seed)
    sizes, total = [], 0
    while total < PARAMS_BYTES * factor:
        r = torch.rand(1, generator=g).item()
        if r < 0.5:
            n = int(torch.randint(256, 8192, (1,), generator=g))
        elif r < 0.85:
            n = int(torch.randint(65536, 1 << 21, (1,), generator=g))
        else:
            n = int(torch.randint(1 << 22, 1 << 25, (1,), generator=g))
        sizes.append(n)
        total += 2 * n
    return sizes


# ---- Worker (one per GPU, under torchrun) ----

class _NoGpu:
    """What the worker asks of torch.cuda, on CPU (--dry-run-cpu): nothing to wait for, no
    device memory to count."""

    def synchronize(self):
        pass

    def memory_allocated(self):
        return 0

    max_memory_allocated = memory_allocated

    def reset_peak_memory_stats(self):
        pass

    def empty_cache(self):
        pass


class Worker:
    def __init__(self, args):
        import torch
        import torch.distributed as dist

        self.torch, self.dist = torch, dist
        self.args = args
        self.budget_mib = args.budget_mib
        self.ops_factor = args.ops_factor
        if args.dry_run_cpu:  # the bench's own plumbing over gloo, for machines with no GPU
            self.cuda = _NoGpu()
            dist.init_process_group("gloo")
            self.dev = torch.device("cpu")
        else:
            self.cuda = torch.cuda
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
            dist.init_process_group("nccl")
            self.dev = torch.device("cuda", torch.cuda.current_device())
        self.rank, self.world = dist.get_rank(), dist.get_world_size()

    def record(self, **rec):
        """Rank 0 appends one JSON line (the launcher's watchdog reads them)."""
        if self.rank == 0:
            rec["t"] = time.time()
            with open(self.args.results, "a") as f:
                f.write(json.dumps(rec) + "\n")

    def sync(self):
        self.cuda.synchronize()
        self.dist.barrier()
        self.cuda.synchronize()

    def run_cell(self, name, fn):
        """Runs one cell on every rank; rank 0 records its start, then every rank's result
        aggregated (slowest rank, most memory, all correct)."""
        self.sync()
        self.record(cell=name, status="start")
        try:
            out = fn()
        except Exception as err:  # every rank that fails says why; the others may hang
            with open(self.args.results, "a") as f:
                f.write(json.dumps(dict(cell=name, status="error", rank=self.rank,
                                        error=repr(err)[:300], t=time.time())) + "\n")
            raise
        everyone = [None] * self.world
        self.dist.all_gather_object(everyone, out)
        agg = {}
        for key in everyone[0]:
            values = [e[key] for e in everyone]
            if isinstance(values[0], bool):
                agg[key] = all(values)
            elif isinstance(values[0], (int, float)):
                agg[key] = max(values)
            else:
                agg[key] = values[0]
        self.record(cell=name, status="done", **agg)

    # -- the reproduction's pattern --

    def pattern(self, ops):
        torch = self.torch
        rank, world = self.rank, self.world
        scale = scale_for(world, ops * self.ops_factor)
        T = pattern_T(world, scale)
        sends = {j: [torch.full((elements(rank, j),), float((rank + 1) * (j + 1)), device=self.dev)
                     for _ in range(T[rank][j])] for j in range(world) if T[rank][j]}
        recvs = {j: [torch.empty(elements(j, rank), device=self.dev) for _ in range(T[j][rank])]
                 for j in range(world) if T[j][rank]}
        n_ops = sum(map(len, sends.values())) + sum(map(len, recvs.values()))
        return sends, recvs, n_ops, scale

    def ops_of(self, sends, recvs):
        """seed000_scale.py's random order: sends shuffled, then receives shuffled."""
        dist = self.dist
        sops = [dist.P2POp(dist.isend, t, j) for j, ts in sends.items() for t in ts]
        rops = [dist.P2POp(dist.irecv, t, j) for j, ts in recvs.items() for t in ts]
        rng = random.Random(self.rank)
        rng.shuffle(sops)
        rng.shuffle(rops)
        return sops + rops

    def check(self, recvs, value):
        torch = self.torch
        return all(bool((torch.cat(ts) == value(j)).all()) for j, ts in recvs.items() if ts)

    def zero(self, recvs):
        ts = [t for v in recvs.values() for t in v]
        if ts:
            self.torch._foreach_zero_(ts)

    def warm_pairs(self):
        dist, torch = self.dist, self.torch
        for p in range(self.world):
            if p != self.rank:
                ops = [dist.P2POp(dist.isend, torch.ones(1, device=self.dev), p),
                       dist.P2POp(dist.irecv, torch.empty(1, device=self.dev), p)]
                for w in dist.batch_isend_irecv(ops):
                    w.wait()
        self.sync()

    def timed(self, fn, steps):
        """(seconds of the first call, median of `steps` further calls, peak extra bytes)."""
        cuda = self.cuda
        self.sync()
        base = cuda.memory_allocated()
        cuda.reset_peak_memory_stats()
        times = []
        for k in range(steps + 1):
            self.sync()
            t0 = time.perf_counter()
            fn()
            cuda.synchronize()
            times.append(time.perf_counter() - t0)
        extra = cuda.max_memory_allocated() - base
        steady = sorted(times[1:])[len(times[1:]) // 2] if steps else times[0]
        return times[0], steady, extra

    # Methods. Each returns what run_cell gathers.

    def m_per_tensor(self, ops_target):
        dist = self.dist
        sends, recvs, n_ops, _ = self.pattern(ops_target)
        ops = self.ops_of(sends, recvs)
        self.warm_pairs()

        def call():
            for w in dist.batch_isend_irecv(ops):
                w.wait()

        first, _, extra = self.timed(call, 0)
        ok = self.check(recvs, lambda j: (self.rank + 1) * (j + 1))
        return dict(ops=n_ops, first_s=first, steady_s=first, extra_mib=extra / 2**20, ok=ok)

    def m_merged(self, sends, recvs, steps):
        torch, dist = self.torch, self.dist
        self.held, self.packing = 0, "-"

        def call():
            ops, landing = [], {}
            for j, ts in sends.items():
                ops.append(dist.P2POp(dist.isend, torch.cat(ts), j))
            for j, ts in recvs.items():
                landing[j] = torch.empty(sum(t.numel() for t in ts), dtype=ts[0].dtype, device=self.dev)
                ops.append(dist.P2POp(dist.irecv, landing[j], j))
            for w in dist.batch_isend_irecv(ops):
                w.wait()
            for j, ts in recvs.items():
                torch._foreach_copy_(ts, list(torch.split(landing[j], [t.numel() for t in ts])))

        return self.timed(call, steps)

    def m_dropin(self, sends, recvs, steps, transport="auto"):
        from streamalloc import p2p

        ops = self.ops_of(sends, recvs)
        self.release_dropin()

        def call():
            for w in p2p.batch_isend_irecv(ops, budget_mib=self.budget_mib, transport=transport):
                w.wait()

        first, steady, extra = self.timed(call, steps)
        ex = next(reversed(p2p._GROUPS[None].exchanges.values()))
        held = ex.staging_bytes
        extra += ex.summary.get("unpooled_bytes", 0)  # the copy engine's region: outside torch's stats
        self.held = held
        self.packing = ex.summary.get("packing", "?")
        self.release_dropin()
        return first, steady, max(extra, held), ex.transport

    def release_dropin(self):
        from streamalloc import p2p

        state = p2p._GROUPS.get(None)
        if state is not None:
            while state.exchanges:  # the same order on every rank: a collective for "ce"
                state.exchanges.pop(next(iter(state.exchanges))).release()

    def m_exchange(self, sends, recvs, steps, transport):
        from streamalloc import p2p

        holder = {}

        def call():
            if "ex" not in holder:
                holder["ex"] = p2p.Exchange(sends, recvs, budget_mib=self.budget_mib,
                                            transport=transport)
            holder["ex"].run()

        first, steady, extra = self.timed(call, steps)
        ex = holder["ex"]
        extra += ex.summary.get("unpooled_bytes", 0)  # the copy engine's region
        chosen, held = ex.transport, ex.staging_bytes
        self.held = held
        self.packing = ex.summary.get("packing", "?")
        ex.release()
        return first, steady, max(extra, held), chosen

    def pattern_cells(self, cells, ops_target, steps, network=False):
        sends, recvs, n_ops, scale = self.pattern(ops_target)
        value = lambda j: (self.rank + 1) * (j + 1)
        self.warm_pairs()
        nbytes = sum(t.numel() * 4 for ts in sends.values() for t in ts)

        def cell(method):
            def fn():
                self.zero(recvs)
                if method == "merged":
                    first, steady, extra = self.m_merged(sends, recvs, steps)
                    transport = "nccl"
                elif method == "dropin":
                    first, steady, extra, transport = self.m_dropin(
                        sends, recvs, steps, "nccl" if network else "auto")
                elif method == "exchange_ce":
                    first, steady, extra, transport = self.m_exchange(sends, recvs, steps, "ce")
                else:
                    first, steady, extra, transport = self.m_exchange(sends, recvs, steps, "nccl")
                return dict(ops=n_ops, scale=scale, bytes_sent=nbytes, first_s=first,
                            steady_s=steady, extra_mib=extra / 2**20, transport=transport,
                            staging_mib=self.held / 2**20, packing=self.packing,
                            ok=self.check(recvs, value))
            return fn

        prefix = "net_" if network else ""
        for name in cells:
            if name.startswith(prefix) and name[len(prefix):] in ("merged", "dropin", "exchange_ce", "exchange_nccl"):
                self.run_cell(name, cell(name[len(prefix):]))
        sends.clear()  # the tensors go before the next workload's are made
        recvs.clear()
        self.cuda.empty_cache()

    def params_cells(self, cells, steps):
        torch = self.torch
        rank, world = self.rank, self.world
        dst, src = (rank + 1) % world, (rank - 1) % world
        fill = lambda s, d: float((s + 1) * (d + 1) % 251)
        sends = {dst: [torch.full((n,), fill(rank, dst), dtype=torch.bfloat16, device=self.dev)
                       for n in param_sizes(dst * 1000 + rank, self.ops_factor)]}
        recvs = {src: [torch.empty(n, dtype=torch.bfloat16, device=self.dev)
                       for n in param_sizes(rank * 1000 + src, self.ops_factor)]}
        nbytes = sum(t.numel() * 2 for t in sends[dst])
        self.warm_pairs()

        def cell(method):
            def fn():
                self.zero(recvs)
                if method == "merged":
                    first, steady, extra = self.m_merged(sends, recvs, steps)
                    transport = "nccl"
                elif method == "exchange_ce":
                    first, steady, extra, transport = self.m_exchange(sends, recvs, steps, "ce")
                else:
                    first, steady, extra, transport = self.m_exchange(sends, recvs, steps, "nccl")
                ok = all(bool((t == fill(src, rank)).all()) for t in recvs[src])
                return dict(tensors=len(sends[dst]), bytes_sent=nbytes, first_s=first,
                            steady_s=steady, gb_per_s=nbytes / steady / 1e9,
                            extra_mib=extra / 2**20, transport=transport,
                            staging_mib=self.held / 2**20, packing=self.packing, ok=ok)
            return fn

        for name in cells:
            if name in ("params_merged", "params_exchange_ce", "params_exchange_nccl"):
                self.run_cell(name, cell(name[len("params_"):]))

    def main(self):
        torch = self.torch
        cells = self.args.cells.split(",")
        steps = self.args.steps
        if self.args.dry_run_cpu:
            self.record(status="meta", world=self.world, gpu="CPU (dry run over gloo)",
                        torch=torch.__version__, nccl="-")
        else:
            self.record(status="meta", world=self.world, gpu=torch.cuda.get_device_name(),
                        torch=torch.__version__, nccl=".".join(map(str, torch.cuda.nccl.version())))
        for name in cells:
            if name.startswith("pt_"):
                target = int(name[3:])
                self.run_cell(name, lambda: self.m_per_tensor(target))
            if name == "net_per_tensor":
                self.run_cell(name, lambda: self.m_per_tensor(NETWORK_OPS))
        if any(c in cells for c in ("merged", "dropin", "exchange_ce", "exchange_nccl")):
            self.pattern_cells(cells, PATTERN_OPS, steps)
        if any(c.startswith("params_") for c in cells):
            self.params_cells(cells, steps)
        if any(c in cells for c in ("net_merged", "net_dropin", "net_exchange_nccl")):
            self.pattern_cells(cells, NETWORK_OPS, steps, network=True)
        self.sync()
        self.dist.destroy_process_group()


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
    lines.append("| workload | method | first call | steady | extra memory | ok |")
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
