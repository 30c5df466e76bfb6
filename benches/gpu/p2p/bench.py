# The issue's goal table, measured side by side in one run (torchrun --nproc_per_node=2):
#   A. ~85 parameter-shaped bf16 tensors each way (TOTAL_MIB=560: ~587 MB), as in
#      shared/baselines/p2p.py: GB/s each way and extra peak memory.
#   B. the first seed's pattern at SCALE=3000 (15,000 tensors of 1-66 KB, 321 MB), as in
#      shared/baselines/seed000_scale.py: exchange time and extra peak memory.
# Modes: one P2POp per tensor; one merged buffer per peer; streamalloc.p2p.exchange (first
# call: gathers descriptions, plans, checks the digest, runs); streamalloc.p2p.Exchange
# reused (the plan agreed once, then run() timed: weight sync every step). The streamalloc
# modes run under both transports: "nccl" (batch_isend_irecv per round) and "ce" (one
# copy-engine copy per round over CUDA IPC, device-side flags).
# Every mode's result is checked. Rank 0 prints a markdown table and writes JSON to $1.
import json, os, random, sys, time
import torch
import torch.distributed as dist
from streamalloc import p2p

BUDGET_MIB = int(os.environ.get("BUDGET_MIB", "128"))
TOTAL_MIB = int(os.environ.get("TOTAL_MIB", "1024"))  # bytes sent: ~TOTAL_MIB/2 MiB, as p2p.py
SCALE = int(os.environ.get("SCALE", "3000"))
ITERS = int(os.environ.get("ITERS", "4"))


def param_sizes(total_mib, seed):
    g = torch.Generator().manual_seed(seed)
    sizes, tot = [], 0
    while tot < total_mib * 2**20 // 2:
        r = torch.rand(1, generator=g).item()
        if r < 0.5:
            n = int(torch.randint(256, 8192, (1,), generator=g))
        elif r < 0.85:
            n = int(torch.randint(65536, 1 << 21, (1,), generator=g))
        else:
            n = int(torch.randint(1 << 22, 1 << 25, (1,), generator=g))
        sizes.append(n); tot += n * 2
    return sizes


def per_tensor(sends, recvs):
    ops = [dist.P2POp(dist.isend, t, p) for p, ts in sends.items() for t in ts]
    ops += [dist.P2POp(dist.irecv, t, p) for p, ts in recvs.items() for t in ts]
    if ops:
        for w in dist.batch_isend_irecv(ops):
            w.wait()


def merged(sends, recvs, unpack=True):
    ops, rb = [], {}
    for p, ts in sends.items():
        if ts:
            ops.append(dist.P2POp(dist.isend, torch.cat(ts), p))  # 1-D tensors, as in the baselines
    for p, ts in recvs.items():
        if ts:
            rb[p] = torch.empty(sum(t.numel() for t in ts), dtype=ts[0].dtype, device=ts[0].device)
            ops.append(dist.P2POp(dist.irecv, rb[p], p))
    for w in dist.batch_isend_irecv(ops):
        w.wait()
    if unpack:
        for p, ts in recvs.items():
            if ts:
                torch._foreach_copy_(ts, list(torch.split(rb[p], [t.numel() for t in ts])))


class Reused:
    """An Exchange agreed (and run once, untimed) before the timed run: weight sync every
    step."""
    def __init__(self, **options):
        self.ex = None
        self.options = options

    def setup(self, sends, recvs):
        self.ex = p2p.Exchange(sends, recvs, **{"budget_mib": BUDGET_MIB, **self.options})
        self.ex.run()

    def __call__(self, sends, recvs):
        return self.ex.run()


def nccl_sweep(rank, world, dev):
    """One send and one receive each way per group, by message size: NCCL's own curve."""
    out = {}
    peer = 1 - rank
    for mib in (1, 8, 32, 128, 512):
        a = torch.empty(mib << 20, dtype=torch.uint8, device=dev)
        b = torch.empty(mib << 20, dtype=torch.uint8, device=dev)
        times = []
        for _ in range(4):
            torch.cuda.synchronize(); dist.barrier()
            t0 = time.perf_counter()
            for w in dist.batch_isend_irecv([dist.P2POp(dist.isend, a, peer), dist.P2POp(dist.irecv, b, peer)]):
                w.wait()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        out[mib] = (mib << 20) / min(times[1:]) / 1e9
        # the same bytes as 4 messages in one group
        q = (mib << 20) // 4
        times = []
        for _ in range(4):
            torch.cuda.synchronize(); dist.barrier()
            t0 = time.perf_counter()
            ops = []
            for i in range(4):
                ops += [dist.P2POp(dist.isend, a[i * q:(i + 1) * q], peer), dist.P2POp(dist.irecv, b[i * q:(i + 1) * q], peer)]
            for w in dist.batch_isend_irecv(ops):
                w.wait()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        out[f"{mib}x4"] = (mib << 20) / min(times[1:]) / 1e9
        del a, b
    return out


def ce_sweep(rank, world, dev):
    """The ce transport's own curve: one tensor each way, Exchange reused (budget
    BUDGET_MIB, so tensors above a buffer are split into buffer-sized copies)."""
    out = {}
    peer = 1 - rank
    for mib in (1, 8, 32, 128, 512):
        a = torch.empty(mib << 20, dtype=torch.uint8, device=dev)
        b = torch.empty(mib << 20, dtype=torch.uint8, device=dev)
        ex = p2p.Exchange({peer: [a]}, {peer: [b]}, budget_mib=BUDGET_MIB, transport="ce")
        times = []
        for _ in range(4):
            torch.cuda.synchronize(); dist.barrier()
            t0 = time.perf_counter()
            ex.run()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        ex.release()
        out[mib] = (mib << 20) / min(times[1:]) / 1e9
        del a, b
    return out


def recvs_zero(recvs):
    for ts in recvs.values():
        for t in ts:
            t.zero_()


def measure(make, modes, rank, world):
    """make() -> (sends, recvs, check); returns {mode: dict}."""
    out = {}
    for name, fn in modes:
        times, issues, ok, extra, note = [], [], True, 0, {}
        for it in range(ITERS):
            sends, recvs, check = make()
            reused = isinstance(fn, Reused)
            if reused:
                torch.cuda.synchronize()
                base0 = torch.cuda.memory_allocated()
                fn.setup(sends, recvs)
                recvs_zero(recvs)
            torch.cuda.synchronize(); dist.barrier(); torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated() if not reused else base0
            t0 = time.perf_counter()
            res = fn(sends, recvs)
            issue = time.perf_counter() - t0
            torch.cuda.synchronize()
            dt = time.perf_counter() - t0
            if it > 0:
                times.append(dt)
                issues.append(issue)
            # The copy engine's shared region is outside the allocator: counted here.
            unpooled = res.get("unpooled_bytes", 0) if isinstance(res, dict) else 0
            extra = max(extra, torch.cuda.max_memory_allocated() - base + unpooled)
            ok = ok and check(recvs)
            if isinstance(res, dict):
                note = {k: res[k] for k in ("rounds", "max_ops_per_group") if k in res}
            nbytes = sum(t.numel() * t.element_size() for v in sends.values() for t in v)
            del sends, recvs
            if reused:
                fn.ex.release()  # collective with the copy engine: peers write into our memory
                fn.ex = None
        t = min(times)
        out[name] = dict(seconds=t, host_issue_seconds=min(issues), gb_per_s=nbytes / t / 1e9, extra_peak_mib=extra / 2**20,
                         correct=ok, bytes_sent=nbytes, **note)
        if rank == 0:
            print(name, json.dumps(out[name]), flush=True)
    return out


def main():
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    staged = lambda s, r: p2p.exchange(s, r, budget_mib=BUDGET_MIB, transport="nccl")
    staged_ce = lambda s, r: p2p.exchange(s, r, budget_mib=BUDGET_MIB, transport="ce")

    def make_params():
        fill = lambda src, dst: float((src + 1) * (dst + 1) % 251)
        sends = {p: [torch.full((n,), fill(rank, p), dtype=torch.bfloat16, device=dev)
                     for n in param_sizes(TOTAL_MIB, p * 1000 + rank)] for p in range(world) if p != rank}
        recvs = {p: [torch.empty(n, dtype=torch.bfloat16, device=dev)
                     for n in param_sizes(TOTAL_MIB, rank * 1000 + p)] for p in range(world) if p != rank}
        check = lambda rv: all(bool((t == fill(p, rank)).all()) for p, ts in rv.items() for t in ts)
        return sends, recvs, check

    sweep = nccl_sweep(rank, world, dev)
    if rank == 0:
        print("nccl one op each way, GB/s by MiB (and as 4 ops in one group):", json.dumps(sweep), flush=True)
    ce_sweep_out = ce_sweep(rank, world, dev)
    if rank == 0:
        print("ce transport, one tensor each way, Exchange reused, GB/s by MiB:", json.dumps(ce_sweep_out), flush=True)
    extra_modes = [("staged_reused_k4", Reused(rounds_per_group=4, transport="nccl")),
                   ("staged_reused_512MiB", Reused(budget_mib=512, transport="nccl")),
                   ("ce_reused_k2", Reused(rounds_per_group=2, transport="ce"))]
    ce_modes = [("staged_ce", staged_ce), ("staged_reused_ce", Reused(transport="ce"))]
    modes = [("per_tensor", per_tensor), ("merged", merged), ("staged", staged),
             ("staged_reused", Reused(transport="nccl"))] + ce_modes + extra_modes
    a = measure(make_params, modes, rank, world)

    g = torch.Generator().manual_seed(42)
    T = ((1 + torch.randperm(world * world, generator=g)) * SCALE).reshape(world, world)
    for j in range(world):
        T[j][j] = 0
    sz = lambda i, j, k: 256 + ((i * 7919 + j * 104729) % 16384)

    def make_seed():
        sends = {j: [torch.full((sz(rank, j, k),), float((rank + 1) * (j + 1)), device=dev)
                     for k in range(int(T[rank][j]))] for j in range(world) if j != rank}
        recvs = {j: [torch.empty(sz(j, rank, k), device=dev) for k in range(int(T[j][rank]))]
                 for j in range(world) if j != rank}
        check = lambda rv: all(bool((t == (rank + 1) * (j + 1)).all()) for j, ts in rv.items() for t in ts)
        return sends, recvs, check

    def per_tensor_random(sends, recvs):
        sops = [dist.P2POp(dist.isend, t, j) for j, ts in sends.items() for t in ts]
        rops = [dist.P2POp(dist.irecv, t, j) for j, ts in recvs.items() for t in ts]
        random.seed(rank); random.shuffle(sops); random.shuffle(rops)
        for w in dist.batch_isend_irecv(sops + rops):
            w.wait()

    seed_modes = [("per_tensor", per_tensor_random),
                  ("merged_no_unpack", lambda s, r: merged(s, r, unpack=False)),
                  ("merged", merged), ("staged", staged), ("staged_reused", Reused(transport="nccl"))
                  ] + ce_modes + extra_modes
    b = measure(make_seed, seed_modes, rank, world)

    allres = [None] * world
    dist.all_gather_object(allres, dict(params=a, seed=b))
    if rank == 0:
        A = [r["params"] for r in allres]; B = [r["seed"] for r in allres]
        gbs = lambda m: min(x[m]["gb_per_s"] for x in A)
        mib = lambda X, m: max(x[m]["extra_peak_mib"] for x in X)
        ms = lambda m: max(x[m]["seconds"] for x in B) * 1e3
        ok = lambda X, m: all(x[m]["correct"] for x in X)
        nA = len(param_sizes(TOTAL_MIB, 1000))
        print()
        print(f"2 ranks, budget {BUDGET_MIB} MiB; slowest rank shown; 'ok' = every byte checked")
        print("| workload | per-tensor P2POp | merged buffer | exchange() nccl | Exchange reused nccl "
              "| exchange() ce | Exchange reused ce | goal |")
        print("| --- | --- | --- | --- | --- | --- | --- | --- |")
        print(f"| ~{nA} parameter-shaped tensors, {A[0]['staged']['bytes_sent']/1e6:.0f} MB each way "
              f"| {gbs('per_tensor'):.0f} GB/s, +{mib(A,'per_tensor'):.0f} MiB "
              f"| {gbs('merged'):.0f} GB/s, +{mib(A,'merged'):.0f} MiB "
              f"| {gbs('staged'):.0f} GB/s, +{mib(A,'staged'):.0f} MiB "
              f"| {gbs('staged_reused'):.0f} GB/s, +{mib(A,'staged_reused'):.0f} MiB "
              f"| {gbs('staged_ce'):.0f} GB/s, +{mib(A,'staged_ce'):.0f} MiB "
              f"| {gbs('staged_reused_ce'):.0f} GB/s, +{mib(A,'staged_reused_ce'):.0f} MiB "
              f"| >= 250 GB/s, <= {BUDGET_MIB} MiB |")
        nB = int(T.sum())
        print(f"| seed000_scale SCALE={SCALE}: {nB} tensors, {B[0]['staged']['bytes_sent']/1e6:.0f} MB (rank 0 sends) "
              f"| {ms('per_tensor'):.1f} ms, +{mib(B,'per_tensor'):.0f} MiB "
              f"| {ms('merged'):.1f} ms (no unpack: {ms('merged_no_unpack'):.1f}), +{mib(B,'merged'):.0f} MiB "
              f"| {ms('staged'):.1f} ms, +{mib(B,'staged'):.0f} MiB "
              f"| {ms('staged_reused'):.1f} ms, +{mib(B,'staged_reused'):.0f} MiB "
              f"| {ms('staged_ce'):.1f} ms, +{mib(B,'staged_ce'):.0f} MiB "
              f"| {ms('staged_reused_ce'):.1f} ms, +{mib(B,'staged_reused_ce'):.0f} MiB "
              f"| <= 12 ms, <= {BUDGET_MIB} MiB |")
        print("other settings (slowest rank): "
              f"nccl rounds_per_group=4: {gbs('staged_reused_k4'):.0f} GB/s, {ms('staged_reused_k4'):.1f} ms; "
              f"nccl 512 MiB budget: {gbs('staged_reused_512MiB'):.0f} GB/s, {ms('staged_reused_512MiB'):.1f} ms; "
              f"ce rounds_per_group=2 (4 x 16 MiB buffers per direction): {gbs('ce_reused_k2'):.0f} GB/s, "
              f"{ms('ce_reused_k2'):.1f} ms")
        print("all correct:", all(ok(A, m) for m in A[0]) and all(ok(B, m) for m in B[0]))
        if len(sys.argv) > 1:
            with open(sys.argv[1], "w") as f:
                json.dump(dict(world=world, budget_mib=BUDGET_MIB, total_mib=TOTAL_MIB, scale=SCALE,
                               ranks=allres, torch=torch.__version__), f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
