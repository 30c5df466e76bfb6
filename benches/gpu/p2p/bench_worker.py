# bench.py's worker: one process per GPU under torchrun, running the cells it is given
# (the workloads, the methods, the checks of every received value) and appending one
# record per cell to the results file. bench.py starts it; it is not run by hand.
import json
import os
import random
import time

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

    def m_method(self, method, sends, recvs, steps, dropin_transport="auto"):
        """Runs one method ("merged", "dropin", "exchange_ce" or "exchange_nccl"): (seconds
        of the first call, steady seconds, peak extra bytes, transport used)."""
        if method == "merged":
            return (*self.m_merged(sends, recvs, steps), "nccl")
        if method == "dropin":
            return self.m_dropin(sends, recvs, steps, dropin_transport)
        return self.m_exchange(sends, recvs, steps, "ce" if method == "exchange_ce" else "nccl")

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
                first, steady, extra, transport = self.m_method(
                    method, sends, recvs, steps, "nccl" if network else "auto")
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
                first, steady, extra, transport = self.m_method(method, sends, recvs, steps)
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
