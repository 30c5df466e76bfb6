# Correctness of streamalloc.p2p.exchange on real GPUs (torchrun --nproc_per_node=N), every
# check under both transports (transport="nccl" and "ce", the copy engine over CUDA IPC):
#   1. mixed dtypes and shapes (0-d, empty, bool, complex), self-sends, tiny and default
#      budgets (tiny forces splitting and many rounds);
#   2. empty lists;
#   3. a mismatched rank: every rank raises the same P2PError, quickly;
#   4. a different budget on one rank: the same digest-mismatch error everywhere;
#   5. the first seed's pattern at scale: >= 10,000 tensors per rank to every peer in
#      random order, intact;
#   6. one Exchange run several times with new data each time, and again after release()
#      (the copy engine's counters carry across runs; its mappings are made again);
#   7. ranks asking for different transports: the same P2PError everywhere; "auto" picks
#      the copy engine here (all ranks on one host with peer access).
# Prints one JSON line per check from rank 0 and exits non-zero on any failure. SMOKE=1 runs
# only two quick copy-engine checks (a first look before the whole suite, or under another
# allocator configuration); STREAMALLOC=1 installs streamalloc as PyTorch's allocator first.
import json, os, random, sys, time
import torch
if os.environ.get("STREAMALLOC") == "1":
    import streamalloc.torch
    streamalloc.torch.install()
import torch.distributed as dist
from streamalloc import p2p

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int8, torch.int64, torch.bool,
          torch.complex64, torch.uint8, torch.float64]


def value(shape, dtype, src, dst, i, device):
    n = 1
    for s in shape:
        n *= s
    base = torch.arange(n, device=device, dtype=torch.int64) * (i + 3) + src * 7 + dst * 13
    if dtype == torch.bool:
        t = (base % 3) == 0
    elif dtype.is_complex:
        t = torch.complex((base % 1000).float(), -(base % 777).float()).to(dtype)
    elif dtype.is_floating_point:
        t = (base % 2048).to(dtype)
    else:
        t = (base % 100).to(dtype)
    return t.reshape(shape)


def shapes_for(src, dst, count, seed):
    rng = random.Random(seed * 1000003 + src * 1009 + dst)
    out = []
    for _ in range(count):
        nd = rng.choice([0, 1, 1, 2, 3])
        r = rng.random()
        numel = rng.randint(1, 8) if r < 0.6 else (rng.randint(8, 4096) if r < 0.9 else rng.randint(4096, 1 << 21))
        if rng.random() < 0.05:
            numel = 0
        shape = []
        for _ in range(max(nd - 1, 0)):
            d = rng.randint(1, 4)
            shape.append(d)
        rest = 1
        for d in shape:
            rest *= d
        shape = tuple(shape + [max(numel // rest, 0)]) if nd > 0 else ()
        out.append((shape, rng.choice(DTYPES)))
    return out


def mixed(rank, world, dev, budget_mib, seed, transport, count=200):
    sends, recvs, expect = {}, {}, {}
    for p in range(world):
        sends[p] = [value(s, d, rank, p, i, dev) for i, (s, d) in enumerate(shapes_for(rank, p, count, seed))]
        meta = shapes_for(p, rank, count, seed)
        recvs[p] = [torch.empty(s, dtype=d, device=dev) for s, d in meta]
        expect[p] = [value(s, d, p, rank, i, dev) for i, (s, d) in enumerate(meta)]
    stats = p2p.exchange(sends, recvs, budget_mib=budget_mib, transport=transport)
    torch.cuda.synchronize()
    ok = all(torch.equal(a, b) for p in recvs for a, b in zip(recvs[p], expect[p]))
    ok = ok and stats["transport"] == transport
    return ok, stats


def expect_error(fn):
    t0 = time.perf_counter()
    try:
        fn()
        return None, time.perf_counter() - t0
    except p2p.P2PError as e:
        return str(e), time.perf_counter() - t0


def seed_pattern(rank, world, dev, budget_mib, transport):
    g = torch.Generator().manual_seed(42)
    T = (10_000 + torch.randint(0, 5_000, (world, world), generator=g)).tolist()
    sz = lambda i, j, k: 256 + ((i * 7919 + j * 104729 + k * 31) % 16384)
    def order(i, j):
        idx = list(range(T[i][j]))
        random.Random(i * 131 + j).shuffle(idx)
        return idx
    sends = {j: [torch.full((sz(rank, j, k),), float((rank + 1) * (j + 1) + k % 7), device=dev)
                 for k in order(rank, j)] for j in range(world) if j != rank}
    recvs = {j: [torch.empty(sz(j, rank, k), device=dev) for k in order(j, rank)]
             for j in range(world) if j != rank}
    torch.cuda.synchronize(); dist.barrier()
    t0 = time.perf_counter()
    stats = p2p.exchange(sends, recvs, budget_mib=budget_mib, transport=transport)
    torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    ok = True
    for j, ts in recvs.items():
        for k, t in zip(order(j, rank), ts):
            ok &= bool((t == float((j + 1) * (rank + 1) + k % 7)).all())
    n = sum(len(v) for v in sends.values())
    return ok, dict(stats, seconds=dt, tensors_sent=n)


def repeated(rank, world, dev, transport, budget_mib=1):
    """One Exchange, run 3 times with new data, released, run twice more."""
    g = torch.Generator().manual_seed(5)
    counts = torch.randint(0, 300, (world, world), generator=g).tolist()
    size = lambda s, d, i: 1 + (s * 7 + d * 131 + i * 977) % 70_000
    sends = {d: [torch.empty(size(rank, d, i), dtype=torch.float32, device=dev)
                 for i in range(counts[rank][d])] for d in range(world)}
    recvs = {s: [torch.empty(size(s, rank, i), dtype=torch.float32, device=dev)
                 for i in range(counts[s][rank])] for s in range(world)}
    ex = p2p.Exchange(sends, recvs, budget_mib=budget_mib, transport=transport)
    ok = True
    for it in range(5):
        if it == 3:
            ex.release()
        for d, ts in sends.items():
            for i, t in enumerate(ts):
                t.fill_(float(it * 1000 + rank * 10 + d + i % 3))
        for ts in recvs.values():
            for t in ts:
                t.fill_(-1)
        ex.run()
        torch.cuda.synchronize()
        for s, ts in recvs.items():
            ok &= all(bool((t == float(it * 1000 + s * 10 + rank + i % 3)).all())
                      for i, t in enumerate(ts))
    ex.release()
    return ok, dict(rounds=ex.summary["rounds"], staging_bytes=ex.staging_bytes,
                    budget_bytes=ex.budget_bytes)


def checks(rank, world, dev, transport, report):
    for budget in (1, 128):
        ok, stats = mixed(rank, world, dev, budget, seed=budget, transport=transport)
        report(f"[{transport}] mixed dtypes/shapes, budget {budget} MiB", ok,
               rounds=stats["rounds"], max_ops_per_group=stats["max_ops_per_group"])

    stats = p2p.exchange({}, {}, transport=transport)
    report(f"[{transport}] empty lists", stats["rounds"] == 0)

    def mismatched():
        sends = {p: [torch.ones(10, device=dev)] * 3 for p in range(world) if p != rank}
        recvs = {p: [torch.empty(10, device=dev) for _ in range(3 - (rank == 1 and p == 0))]
                 for p in range(world) if p != rank}
        p2p.exchange(sends, recvs, transport=transport)
    err, dt = expect_error(mismatched)
    errs = [None] * world
    dist.all_gather_object(errs, err)
    report(f"[{transport}] mismatched rank: same error everywhere", err is not None
           and "mismatch" in err and all(e == errs[0] for e in errs) and dt < 30,
           error=err, seconds=dt)

    def other_budget():
        sends = {p: [torch.ones(10, device=dev)] for p in range(world) if p != rank}
        recvs = {p: [torch.empty(10, device=dev)] for p in range(world) if p != rank}
        p2p.exchange(sends, recvs, budget_mib=64 if rank == 0 else 128, transport=transport)
    err, dt = expect_error(other_budget)
    errs = [None] * world
    dist.all_gather_object(errs, err)
    report(f"[{transport}] different budget: digest mismatch everywhere", err is not None
           and "digest" in err and all(e == errs[0] for e in errs), error=err)

    ok, info = seed_pattern(rank, world, dev, 128, transport)
    report(f"[{transport}] seed pattern, >=10,000 tensors per rank, random order", ok, **info)

    ok, info = repeated(rank, world, dev, transport)
    report(f"[{transport}] one Exchange run 5 times, released after 3", ok, **info)


def main():
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    results = []

    def report(name, ok, **info):
        oks = [None] * world
        dist.all_gather_object(oks, bool(ok))
        results.append(all(oks))
        if rank == 0:
            print(json.dumps(dict(check=name, ok=all(oks), **info)), flush=True)

    if os.environ.get("SMOKE"):  # a quick first look at the copy engine: one exchange, reused
        ok, stats = mixed(rank, world, dev, 1, seed=1, transport="ce", count=20)
        report("[ce] smoke: mixed dtypes/shapes, budget 1 MiB", ok, rounds=stats["rounds"])
        ok, info = repeated(rank, world, dev, "ce")
        report("[ce] smoke: one Exchange run 5 times, released after 3", ok, **info)
        dist.destroy_process_group()
        sys.exit(0 if all(results) else 1)

    for transport in ("nccl", "ce"):
        checks(rank, world, dev, transport, report)

    def mixed_transports():
        sends = {p: [torch.ones(10, device=dev)] for p in range(world) if p != rank}
        recvs = {p: [torch.empty(10, device=dev)] for p in range(world) if p != rank}
        p2p.exchange(sends, recvs, transport="ce" if rank == 0 else "nccl")
    err, dt = expect_error(mixed_transports)
    errs = [None] * world
    dist.all_gather_object(errs, err)
    report("ranks asking for different transports: same error everywhere", err is not None
           and "transport mismatch" in err and all(e == errs[0] for e in errs), error=err)

    sends = {p: [torch.ones(10, device=dev)] for p in range(world) if p != rank}
    recvs = {p: [torch.empty(10, device=dev)] for p in range(world) if p != rank}
    ex = p2p.Exchange(sends, recvs)
    ex.run()
    ex.release()
    report("auto picks the copy engine on one host", ex.transport == "ce",
           transport=ex.transport, note=ex.transport_note)

    dist.barrier()
    dist.destroy_process_group()
    if not all(results):
        sys.exit(1)


if __name__ == "__main__":
    main()
