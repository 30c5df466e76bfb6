# The host side of the drop-in and of Exchange, timed in one process with no GPU: the
# reproduction's pattern (seed000_scale.py's sizes and T) for one rank of WORLD, every rank's
# description built locally, tensors on PyTorch's "meta" device (no memory, no copies: only
# the Python and dispatch costs a GPU run also pays).
#   PYTHONPATH=python STREAMALLOC_LIB=target/release/libstreamalloc.so \
#     python3 benches/gpu/p2p/host_profile.py [WORLD] [SCALE] [BUDGET_MIB]   (default 4 1000 128)
# Prints one line per phase: seconds, and per op or per round where that is the unit. (The
# rounds' packing is device work: benches/gpu/p2p/bench.py times it.)
import random
import sys
import time

import torch

from streamalloc import p2p, _ce

torch.set_num_threads(1)  # as under torchrun (OMP_NUM_THREADS=1)

WORLD = int(sys.argv[1]) if len(sys.argv) > 1 else 4
SCALE = int(sys.argv[2]) if len(sys.argv) > 2 else 1000
BUDGET = int(sys.argv[3]) if len(sys.argv) > 3 else 128

g = torch.Generator().manual_seed(42)
T = ((1 + torch.randperm(WORLD * WORLD, generator=g)) * SCALE).reshape(WORLD, WORLD).tolist()
for j in range(WORLD):
    T[j][j] = 0
size = lambda i, j: 256 + ((i * 7919 + j * 104729) % 16384)  # float32 elements
ops_per_rank = [sum(T[r]) + sum(T[j][r] for j in range(WORLD)) for r in range(WORLD)]
RANK = max(range(WORLD), key=ops_per_rank.__getitem__)


def isend():
    pass


def irecv():
    pass


class Op:  # the fields of torch.distributed.P2POp that the drop-in reads
    __slots__ = ("op", "tensor", "peer", "group_peer")

    def __init__(self, op, tensor, peer):
        self.op, self.tensor, self.peer, self.group_peer = op, tensor, peer, peer


def ops_of(rank):
    sends = [Op(isend, torch.empty(size(rank, j), device="meta"), j)
             for j in range(WORLD) for _ in range(T[rank][j])]
    recvs = [Op(irecv, torch.empty(size(j, rank), device="meta"), j)
             for j in range(WORLD) for _ in range(T[j][rank])]
    rng = random.Random(rank)
    rng.shuffle(sends)
    rng.shuffle(recvs)
    return sends + recvs


def timed(label, fn, unit=None, count=1, repeat=3):
    best = min(_once(fn) for _ in range(repeat))
    per = f", {best / count * 1e6:.2f} us per {unit}" if unit else ""
    print(f"{label:<44} {best * 1e3:9.2f} ms{per}", flush=True)
    return fn()


def _once(fn):
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


ops = ops_of(RANK)
n_ops = len(ops)
print(f"world {WORLD}, SCALE {SCALE}: rank {RANK} posts {n_ops} ops; budget {BUDGET} MiB")
tr = timed("translate the P2POp list", lambda: p2p.translate_ops(ops, RANK, WORLD, None, isend, irecv),
           "op", n_ops)
timed("shape digest", lambda: p2p.signature_digest(tr, BUDGET << 20), "op", n_ops)
probe = object.__new__(p2p.Exchange)
timed("describe the lists for the planner", lambda: probe._from_translated(tr, RANK, WORLD), "op", n_ops)
descriptions = []
for r in range(WORLD):
    t = tr if r == RANK else p2p.translate_ops(ops_of(r), r, WORLD, None, isend, irecv)
    metas = [[[(x.nbytes, p2p.dtype_code(x.dtype)) for x in ts] for ts in lists]
             for lists in (t.send_lists, t.recv_lists)]
    descriptions.append(p2p.encode_description(r, WORLD, metas[0], metas[1]))
budget = (BUDGET << 20) - _ce.reserve_bytes(2, WORLD)
plan = timed("plan (Rust, every rank's lists)", lambda: p2p.Plan(descriptions, budget, 2, _ce.NO_ZERO_COPY))
rows = timed("plan rows of this rank (ctypes)", lambda: plan.rows(RANK), "op", n_ops)
lists = (tr.send_lists, tr.recv_lists)
sizes = [[[x.nbytes for x in ts] for ts in side] for side in lists]
codes = [[[p2p.dtype_code(x.dtype) for x in ts] for ts in side] for side in lists]
rounds = timed("group rows into messages (_prepare)", lambda: p2p._prepare(rows, lists, sizes, codes, lambda p: p),
               "op", n_ops)
print(f"  {len(rounds)} rounds, summary {plan.summary(RANK)}")
ex = object.__new__(p2p.Exchange)
ex._rounds, ex.transport, ex._buffers, ex.rank = rounds, "nccl", None, RANK
timed("rebind a cached plan to new tensors", lambda: ex._rebind(*lists), "round", len(rounds))
