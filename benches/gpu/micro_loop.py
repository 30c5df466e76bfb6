# The Python alloc/free loop (alloc_bench.py's micro workload), in one place for
# alloc_bench.py and loop_ab.py so that both time the same loop.
import time

LIVE = 64  # tensors kept alive; each allocation beyond them frees one at random


def micro_sizes(rng, count=20000):
    """`count` sizes in bytes from `rng`: 60% under 256 KiB, 35% up to 16 MiB, 5% up to 64 MiB
    (the loop allocates `size // 4 + 1` float32 elements of each)."""
    def size():
        r = rng.random()
        if r < 0.6: return rng.randint(1, 1 << 18)
        if r < 0.95: return rng.randint(1 << 18, 1 << 24)
        return rng.randint(1 << 24, 1 << 26)
    return [size() for _ in range(count)]


def micro_pass(torch, sizes, pops):
    """One pass: allocates every size, freeing one of the live tensors chosen by `pops`
    whenever more than LIVE are alive, then frees the rest and synchronises.
    Returns (ns per operation, operations), where an allocation or a pop is an operation."""
    live, ops = [], 0
    t0 = time.perf_counter()
    for s in sizes:
        live.append(torch.empty(s // 4 + 1, dtype=torch.float32, device="cuda")); ops += 1
        if len(live) > LIVE:
            live.pop(pops.randrange(len(live))); ops += 1
    live.clear()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / ops * 1e9, ops
