# streamalloc.p2p.exchange on CPU tensors over gloo: the same plan, packing and unpacking as
# on GPUs, minus the streams, so the Python side can be checked on a machine with no GPU.
#   python benches/gpu/p2p/cpu_check.py [WORLD]   (PYTHONPATH=python, STREAMALLOC_LIB set)
# Exits non-zero on any failure; with PROFILE=1 also times the phases of a 15,000-tensor
# exchange. The copy-engine transport's own logic is checked by ce_unit_check.py.
import os, random, sys, time
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from streamalloc import p2p

DTYPES = [torch.float32, torch.bfloat16, torch.int8, torch.int64, torch.bool, torch.complex64,
          torch.float64, torch.uint8]


def tensor(src, dst, i, rng_seed):
    rng = random.Random(rng_seed * 7919 + src * 131 + dst * 17 + i)
    dtype = rng.choice(DTYPES)
    numel = rng.choice([0, 1, 3, rng.randint(1, 300), rng.randint(300, 40000)])
    shape = (numel,) if rng.random() < 0.5 else (1, numel)
    base = torch.arange(numel, dtype=torch.int64) * (i + 1) + src * 3 + dst
    if dtype == torch.bool:
        t = base % 2 == 1
    elif dtype.is_complex:
        t = torch.complex((base % 999).float(), (base % 5).float()).to(dtype)
    else:
        t = (base % 100).to(dtype)
    return t.reshape(shape)


def fails_alike(rank, world, label, needle, call):
    """True if `call()` raises a P2PError, the same on every rank, whose message contains
    `needle` (rank 0 prints it after `label`)."""
    try:
        call()
    except p2p.P2PError as e:
        errs = [None] * world
        dist.all_gather_object(errs, str(e))
        if rank == 0:
            print(f"{label}:", errs[0], flush=True)
        return all(x == errs[0] for x in errs) and needle in errs[0]
    return False


def worker(rank, world, port, failures):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    ok = True
    for seed, budget, k in [(1, 0.05, 1), (2, 1, 1), (3, 0.05, 3), (4, 128, 1)]:
        counts = random.Random(seed)
        n = {(s, d): counts.randint(0, 60) for s in range(world) for d in range(world)}
        sends = {d: [tensor(rank, d, i, seed) for i in range(n[(rank, d)])] for d in range(world)}
        recvs = {s: [torch.empty_like(tensor(s, rank, i, seed)) for i in range(n[(s, rank)])]
                 for s in range(world)}
        p2p.exchange(sends, recvs, budget_mib=budget, rounds_per_group=k)
        for s in range(world):
            for i, t in enumerate(recvs[s]):
                if not torch.equal(t, tensor(s, rank, i, seed)):
                    print(f"rank {rank}: seed {seed} tensor {i} from {s} differs", flush=True)
                    ok = False
    # Parameters (requires_grad) move like plain tensors.
    src = torch.nn.Parameter(torch.arange(10.0) + rank)
    dst = torch.nn.Parameter(torch.zeros(10))
    p2p.exchange({(rank + 1) % world: [src]}, {(rank - 1) % world: [dst]}, budget_mib=1)
    ok &= torch.equal(dst.detach(), torch.arange(10.0) + (rank - 1) % world)
    # A mismatch: the same error everywhere.
    ok &= fails_alike(rank, world, "mismatch error", "mismatch", lambda: p2p.exchange(
        {(rank + 1) % world: [torch.ones(3)]},
        {(rank - 1) % world: [torch.empty(4 if rank == 0 else 3)]}))
    # A local error on one rank (a non-contiguous tensor): every rank fails alike, no hang.
    bad = torch.ones(4, 4).t() if rank == world - 1 else torch.ones(4, 4)
    ok &= fails_alike(rank, world, "local error", "not contiguous", lambda: p2p.exchange(
        {(rank + 1) % world: [bad]}, {(rank - 1) % world: [torch.empty(4, 4)]}))
    # Transports: ranks asking for different ones, and "ce" where it cannot work (CPU
    # tensors), fail alike everywhere before any data moves; "auto" on CPU is "nccl".
    for name, choice, expect in [
        ("transport mismatch", "ce" if rank == 0 else "nccl", "transport mismatch"),
        ("ce on cpu", "ce", "transport 'ce' is not possible"),
    ]:
        ok &= fails_alike(rank, world, name, expect, lambda: p2p.exchange(
            {(rank + 1) % world: [torch.ones(3)]}, {(rank - 1) % world: [torch.empty(3)]},
            transport=choice))
    src = torch.arange(5.0) + rank
    dst = torch.zeros(5)
    ex = p2p.Exchange({(rank + 1) % world: [src]}, {(rank - 1) % world: [dst]})
    ok &= ex.transport == "nccl" and "cpu" in (ex.transport_note or "")
    for i in range(2):  # an exchange runs again with new values
        src += 10
        ex.run()
        ok &= torch.equal(dst, torch.arange(5.0) + (rank - 1) % world + 10 * (i + 1))
    ex.release()
    if os.environ.get("PROFILE"):
        profile(rank, world)
    dist.destroy_process_group()
    if not ok:
        failures.put(rank)


def profile(rank, world):
    import cProfile, pstats
    sends = {d: [torch.full((256 + (k * 31) % 16384,), 1.0) for k in range(15000 // (world - 1))]
             for d in range(world) if d != rank}
    recvs = {s: [torch.empty(256 + (k * 31) % 16384) for k in range(15000 // (world - 1))]
             for s in range(world) if s != rank}
    pr = cProfile.Profile()
    t0 = time.perf_counter()
    pr.enable()
    ex = p2p.Exchange(sends, recvs)
    t1 = time.perf_counter()
    ex.run()
    t2 = time.perf_counter()
    ex.run()
    t3 = time.perf_counter()
    pr.disable()
    if rank == 0:
        print(f"construct {1e3*(t1-t0):.1f} ms, first run {1e3*(t2-t1):.1f} ms, second run {1e3*(t3-t2):.1f} ms")
        pstats.Stats(pr).sort_stats("tottime").print_stats(12)


def spawn_ranks(worker, name):
    """Runs ``worker(rank, world, port, failures)`` on ``argv[1]`` (default 3) CPU ranks;
    exits non-zero if any rank reported a failure."""
    world = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    failures = mp.get_context("spawn").SimpleQueue()
    mp.spawn(worker, args=(world, 29500 + random.randint(0, 999), failures), nprocs=world)
    if not failures.empty():
        sys.exit(f"{name} FAILED")
    print(f"{name}: {world} ranks ok")


if __name__ == "__main__":
    spawn_ranks(worker, "p2p cpu check")
