# streamalloc.p2p.batch_isend_irecv on CPU tensors over gloo, WORLD ranks as processes: the
# drop-in's translation, plan cache, rebinding (keeping none of a caller's tensors) and
# error agreement, minus the GPU.
#   PYTHONPATH=python STREAMALLOC_LIB=target/debug/libstreamalloc.so \
#     python3 benches/gpu/p2p/dropin_cpu_check.py [WORLD ...]     (default: 2 3 4)
# Exits non-zero on any failure. Without torch it prints SKIP and exits 0.
import gc
import os
import random
import sys
import time
import weakref

try:
    import torch
    import torch.distributed as dist
    import torch.multiprocessing as mp
except ImportError:
    print("SKIP: torch is not installed")
    sys.exit(0)

from streamalloc import _p2p_copy, p2p
from streamalloc.p2p import batch_isend_irecv


def hang_pattern(rank, world, scale, order, seed):
    """multi_tensor_hang.py's pattern: T[i][j] sends of value (i + 1) * (j + 1) from i to
    j (i itself included), here of 1-40 elements of one size per ordered pair, posted in
    random or sorted order. Returns (ops, received lists per peer, expected value per peer)."""
    g = torch.Generator().manual_seed(seed)
    T = ((1 + torch.randperm(world * world, generator=g)) * scale).reshape(world, world)
    size = lambda i, j: 1 + (i * 7 + j * 13) % 40
    # As in the reproduction, every rank also sends T[i][i] tensors to itself.
    sends = [dist.P2POp(dist.isend, torch.full((size(rank, j),), float((rank + 1) * (j + 1))), j)
             for j in range(world) for _ in range(int(T[rank][j]))]
    recvs = {j: [torch.empty(size(j, rank)) for _ in range(int(T[j][rank]))]
             for j in range(world)}
    rops = [dist.P2POp(dist.irecv, t, j) for j, ts in recvs.items() for t in ts]
    if order == "random":
        rng = random.Random(seed * 100 + rank)
        rng.shuffle(sends)
        rng.shuffle(rops)
    return sends + rops, recvs


def landed(recvs, rank):
    return all(bool((t == (rank + 1) * (j + 1)).all()) for j, ts in recvs.items() for t in ts)


def same_error_everywhere(rank, world, needle, call):
    """call() raises a P2PError containing `needle`, with the same message on every rank."""
    try:
        call()
        message = None
    except p2p.P2PError as err:
        message = str(err)
    messages = [None] * world
    dist.all_gather_object(messages, message)
    ok = messages[0] is not None and needle in messages[0] and len(set(messages)) == 1
    if rank == 0 and not ok:
        print("  got:", messages, flush=True)
    return ok


def worker(rank, world, port, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    checks = {}
    state = lambda: p2p._GROUPS[None]

    # 1. The reproduction's pattern, random and sorted order, several sizes, two steps each:
    #    every value lands; the second step of each shape reuses the agreed exchange.
    shapes = []  # this rank's list shape at every step
    for order in ("random", "sorted"):
        for scale in (1, 20):
            for step in range(2):
                ops, recvs = hang_pattern(rank, world, scale, order, seed=scale)
                shapes.append(p2p.signature_digest(p2p.translate_ops(ops, rank, world), 2**20))
                works = batch_isend_irecv(ops, budget_mib=1)
                for w in works:
                    w.wait()
                checks[f"{order} x{scale} step {step}: every value lands"] = landed(recvs, rank)
    # (On two ranks the random order is the sorted one: each rank has one peer.)
    every_shape = [None] * world
    dist.all_gather_object(every_shape, shapes)
    distinct = len(set(zip(*every_shape)))  # the steps that differ on some rank
    checks["one agreed exchange per shape"] = len(state().exchanges) == distinct
    ex = next(iter(state().exchanges.values()))
    checks["staging within the budget"] = ex.staging_bytes <= 2**20

    # 2. Agreement is paid once per shape: the same shapes again build no Exchange.
    built = []
    original = p2p.Exchange.__init__

    def counting(self, *args, **kwargs):
        built.append(1)
        original(self, *args, **kwargs)

    p2p.Exchange.__init__ = counting
    ops, recvs = hang_pattern(rank, world, 20, "random", seed=20)
    t0 = time.perf_counter()
    for w in batch_isend_irecv(ops, budget_mib=1):
        w.wait()
    cached_s = time.perf_counter() - t0
    checks["a cached shape builds no exchange and lands"] = not built and landed(recvs, rank)
    ops, recvs = hang_pattern(rank, world, 3, "random", seed=3)
    for w in batch_isend_irecv(ops, budget_mib=1):
        w.wait()
    checks["a new shape agrees again and lands"] = len(built) == 1 and landed(recvs, rank)

    # 2b. A new shape of many tensors leaves the caller's garbage collector alone: the
    #     agreement builds no Python object per tensor, so it starts no collection (a full
    #     one, in a program holding this many tensors, outlasts the whole call). PyTorch's
    #     packing (STREAMALLOC_P2P_PACK=torch) needs a view per tensor: not checked there.
    if _p2p_copy.mode() != "torch":
        ops, recvs = hang_pattern(rank, world, 1000, "random", seed=1000)
        collections = []
        gc.collect()
        gc.callbacks.append(lambda phase, info: collections.append(info["generation"]))
        try:
            for w in batch_isend_irecv(ops, budget_mib=4):
                w.wait()
        finally:
            gc.callbacks.pop()
        checks["a new shape of 1000x the pattern starts no garbage collection"] = (
            not collections and landed(recvs, rank))
        del ops, recvs

    # The key is the shape per peer and direction: another interleaving of the peers' ops
    # hits the cached exchange; another order of sizes within one peer is another shape.
    def per_peer_sizes(order_seed, swap):
        ops, boxes = [], []
        for j in range(world):
            sizes = [3, 5, 7] if not (swap and j == (rank + 1) % world) else [5, 3, 7]
            back = [3, 5, 7] if not (swap and rank == (j + 1) % world) else [5, 3, 7]
            ops += [dist.P2POp(dist.isend, torch.full((n,), float(rank * 10 + j)), j) for n in sizes]
            boxes += [(torch.empty(n), float(j * 10 + rank)) for n in back]
            ops += [dist.P2POp(dist.irecv, b, j) for b, _ in boxes[-3:]]
        # Shuffle across peers, keeping each (peer, direction)'s own order.
        streams = {}
        for op in ops:
            streams.setdefault((op.peer, op.op.__name__), []).append(op)
        rng, out = random.Random(order_seed * 31 + rank), []
        while any(streams.values()):
            out.append(rng.choice([q for q in streams.values() if q]).pop(0))
        for w in batch_isend_irecv(out, budget_mib=1):
            w.wait()
        return all(bool((b == v).all()) for b, v in boxes)

    before = len(built)
    good = per_peer_sizes(1, False) and per_peer_sizes(2, False) and per_peer_sizes(3, False)
    checks["other interleavings of the peers' ops hit the cached exchange"] = (
        good and len(built) == before + 1)
    good = per_peer_sizes(4, True)
    checks["another order of sizes within one peer misses the cache"] = (
        good and len(built) == before + 2)
    p2p.Exchange.__init__ = original

    # 2b. The cache keeps none of a caller's tensors: once the caller drops its ops, works
    #     and tensors, their memory goes back, when a shape is new (its plan is built from
    #     those tensors) and when it is cached, with the host twin of the copy kernel
    #     ("auto" on the CPU) and with PyTorch's packing.
    def released_after_call(shape_seed):
        ops, recvs = hang_pattern(rank, world, 2, "random", seed=shape_seed)
        works = batch_isend_irecv(ops, budget_mib=1)
        for work in works:
            work.wait()
        ok = landed(recvs, rank)
        watched = [weakref.ref(op.tensor) for op in ops]
        del ops, recvs, works, work
        gc.collect()
        return ok and not any(ref() is not None for ref in watched)

    for pack in ("auto", "torch"):
        os.environ["STREAMALLOC_P2P_PACK"] = pack
        seed = 501 if pack == "auto" else 502
        first = released_after_call(seed)
        cached = released_after_call(seed)
        checks[f"{pack} packing: a call keeps none of the caller's tensors (first, cached)"] = (
            first and cached)
    os.environ.pop("STREAMALLOC_P2P_PACK")

    # 3. Mixed dtypes, 2-D tensors, a tensor larger than a staging buffer, leaves that
    #    require grad, several ops to the same peer in both directions.
    dtypes = [torch.float32, torch.bfloat16, torch.int64, torch.bool, torch.uint8, torch.float64]

    def mixed():
        ops, expect = [], []
        for j in range(world):
            if j == rank:
                continue
            for k in range(12):
                dtype, n = dtypes[k % len(dtypes)], 1 + (k * 37 + rank + j) % 90
                shape = (n,) if k % 2 else (n, 3)
                if k == 5:
                    shape = (300_000,)  # 2.4 MB of float64: split across 1 MiB buffers
                value = lambda src, dst: (src * 5 + dst * 3 + k) % 2 if dtype == torch.bool else src * 5 + dst * 3 + k
                src = torch.full(shape, value(rank, j), dtype=dtype)
                if dtype.is_floating_point and k % 3 == 0:
                    src.requires_grad_(True)
                dst = torch.empty(shape, dtype=dtype)
                if dtype.is_floating_point and k % 4 == 0:
                    dst.requires_grad_(True)
                ops += [dist.P2POp(dist.isend, src, j), dist.P2POp(dist.irecv, dst, j)]
                expect.append((dst, value(j, rank)))
        for w in batch_isend_irecv(ops, budget_mib=1):
            w.wait()
        return all(bool((d.detach() == v).all()) for d, v in expect)

    checks["mixed dtypes, shapes, split tensors and leaves requiring grad land"] = mixed()
    # The same shapes with new tensors: the cached exchange is rebound to them.
    checks["... and land again through the rebound exchange"] = mixed()

    # 4. Empty lists: everywhere (nothing to do), and on some ranks only.
    checks["empty lists everywhere"] = batch_isend_irecv([]) == []
    ops = []
    if rank in (0, 1):
        peer = 1 - rank
        box = torch.empty(7)
        ops = [dist.P2POp(dist.isend, torch.full((7,), 40.0 + rank), peer),
               dist.P2POp(dist.irecv, box, peer)]
    for w in batch_isend_irecv(ops):
        w.wait()
    checks["empty lists on some ranks"] = rank > 1 or bool((box == 40.0 + (1 - rank)).all())

    # 5. Mismatched lists raise the same P2PError everywhere, then the group still works.
    def mismatched():
        ops, _ = hang_pattern(rank, world, 2, "sorted", seed=7)
        if rank == world - 1:
            ops = ops[1:]  # one send fewer than its receiver expects
        batch_isend_irecv(ops)

    checks["a missing op: the same error everywhere"] = same_error_everywhere(
        rank, world, "mismatch", mismatched)

    def wrong_size():
        peer = (rank + 1) % world
        src = (rank - 1) % world
        n = 9 if rank == 0 else 8
        batch_isend_irecv([dist.P2POp(dist.isend, torch.ones(n), peer),
                           dist.P2POp(dist.irecv, torch.empty(8), src)])

    checks["a size that differs: the same error everywhere"] = same_error_everywhere(
        rank, world, "mismatch", wrong_size)

    # 6. Invalid lists on one rank: every rank raises that rank's message.
    def bad_on_one(op):
        def call():
            peer = (rank + 1) % world
            good = [dist.P2POp(dist.isend, torch.ones(4), peer),
                    dist.P2POp(dist.irecv, torch.empty(4), (rank - 1) % world)]
            batch_isend_irecv(good + ([op()] if rank == 1 else []))
        return call

    cases = {
        "non-contiguous": (lambda: dist.P2POp(dist.isend, torch.ones(4, 4).t(), 0),
                           "rank 1: op 2 (peer 0): the tensor is not contiguous"),
        "a self-send without its receive": (lambda: dist.P2POp(dist.isend, torch.ones(4), 1),
                                            "mismatch between rank 1 (sender) and rank 1"),
    }
    for name, (make, needle) in cases.items():
        checks[f"{name} on rank 1: the same error everywhere"] = same_error_everywhere(
            rank, world, needle, bad_on_one(make))
    # Whatever one rank alone was handed, every rank raises the same P2PError (and none
    # waits in a collective the others left).
    class NotAnOp:
        pass

    def one_rank(bad_ops=None, budget=1.0):
        def call():
            peer = (rank + 1) % world
            ops = [dist.P2POp(dist.isend, torch.ones(4), peer),
                   dist.P2POp(dist.irecv, torch.empty(4), (rank - 1) % world)]
            if rank == 1 and bad_ops is not None:
                ops = ops + bad_ops()
            batch_isend_irecv(ops, budget_mib=budget if rank == 1 else 1.0)
        return call

    def none_tensor():
        op = dist.P2POp(dist.isend, torch.ones(4), 0)
        op.tensor = None
        return [op]

    def another_group():
        op = dist.P2POp(dist.isend, torch.ones(4), 0)
        op.group = NotAnOp()  # stands for a process group other than the list's
        return [op]

    refused = {
        "a budget of 0": (one_rank(budget=0), "budget_mib must be finite and positive (got 0)"),
        "a budget of -1": (one_rank(budget=-1), "budget_mib must be finite and positive (got -1)"),
        "a budget of NaN": (one_rank(budget=float("nan")), "(got nan)"),
        "a budget of inf": (one_rank(budget=float("inf")), "(got inf)"),
        "a budget of None": (one_rank(budget=None), "not NoneType None"),
        'a budget of "128"': (one_rank(budget="128"), "not str '128'"),
        "an element that is not a P2POp": (one_rank(lambda: [NotAnOp()]),
                                           "rank 1: op 2 is a NotAnOp, not a torch.distributed.P2POp"),
        "an element that is an int": (one_rank(lambda: [7]), "rank 1: op 2 is a int"),
        "a None tensor": (one_rank(none_tensor), "rank 1: op 2 (peer 0): the tensor is NoneType"),
        "an op of another group": (one_rank(another_group),
                                   "rank 1: the P2POp list mixes process groups"),
    }
    for name, (call, needle) in refused.items():
        checks[f"{name} on rank 1: the same error everywhere"] = same_error_everywhere(
            rank, world, needle, call)

    def exchange_given(sends, budget=1.0, **options):
        def call():
            peer, src = (rank + 1) % world, (rank - 1) % world
            good = ({peer: [torch.ones(4)]}, {src: [torch.empty(4)]})
            mine = (sends(), good[1]) if rank == 1 else good
            p2p.Exchange(*mine, budget_mib=budget if rank == 1 else 1.0,
                         **(options if rank == 1 else {}))
        return call

    exchange_refused = {
        "Exchange(sends={1: tensor})": (exchange_given(lambda: {1: torch.ones(4)}),
                                        "sends[1] must be a list of tensors, not Tensor"),
        "Exchange with a None tensor": (exchange_given(lambda: {2 % world: [None]}),
                                        "is NoneType, not a torch.Tensor"),
        "Exchange(budget_mib=-1)": (exchange_given(lambda: {2 % world: [torch.ones(4)]}, -1),
                                    "budget_mib must be finite and positive (got -1)"),
        "Exchange(budget_mib=nan)": (exchange_given(lambda: {2 % world: [torch.ones(4)]},
                                                    float("nan")), "(got nan)"),
        "Exchange(rounds_per_group=0)": (exchange_given(lambda: {2 % world: [torch.ones(4)]},
                                                        rounds_per_group=0),
                                         "rounds_per_group must be an integer of at least 1"),
    }
    for name, (call, needle) in exchange_refused.items():
        checks[f"{name} on rank 1: the same error everywhere"] = same_error_everywhere(
            rank, world, "rank 1 cannot take part in the p2p exchange: ", call) and \
            same_error_everywhere(rank, world, needle, call)

    # A cached shape, with another transport asked for on one rank: every rank misses the
    # cache together and the agreement names the difference.
    def other_transport():
        ops, _ = hang_pattern(rank, world, 20, "random", seed=20)
        batch_isend_irecv(ops, budget_mib=1, transport="ce" if rank == 1 else "auto")

    checks["another transport on one rank: the same error everywhere"] = same_error_everywhere(
        rank, world, "transport mismatch", other_transport)

    # 7. After all the errors, the cached shapes still run.
    ops, recvs = hang_pattern(rank, world, 20, "random", seed=20)
    for w in batch_isend_irecv(ops, budget_mib=1):
        w.wait()
    checks["after errors, a cached shape still lands"] = landed(recvs, rank)

    gathered = [None] * world
    dist.all_gather_object(gathered, (checks, cached_s))
    if rank == 0:
        results.put(gathered)
    dist.barrier()
    dist.destroy_process_group()


def main():
    worlds = [int(w) for w in sys.argv[1:]] or [2, 3, 4]
    failed = 0
    ctx = mp.get_context("spawn")
    for world in worlds:
        results = ctx.Queue()
        port = 29500 + random.Random().randint(0, 20000)
        procs = [ctx.Process(target=worker, args=(r, world, port, results)) for r in range(world)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout=300)
        if any(p.exitcode != 0 for p in procs):
            print(f"world {world}: FAIL: exit codes {[p.exitcode for p in procs]}")
            failed += 1
            for p in procs:
                if p.is_alive():
                    p.kill()
            continue
        gathered = results.get(timeout=10)
        for name in gathered[0][0]:
            bad = [r for r, (c, _) in enumerate(gathered) if not c[name]]
            if bad:
                failed += 1
            print(f"world {world}: {'FAIL' if bad else 'ok  '} {name}"
                  + (f" (ranks {bad})" if bad else ""))
        print(f"world {world}: a cached 20x step took {max(s for _, s in gathered) * 1e3:.1f} ms")
    if failed:
        print(f"{failed} failure(s)")
        sys.exit(1)
    print("drop-in CPU checks: all passed")


if __name__ == "__main__":
    main()
