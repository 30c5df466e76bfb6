# The host side of the drop-in and of Exchange, timed in one process with no GPU: the
# reproduction's pattern (seed000_scale.py's sizes and T) for one rank of WORLD, every rank's
# description built locally, tensors on PyTorch's "meta" device (no memory, no copies: only
# the Python and dispatch costs a GPU run also pays).
#   PYTHONPATH=python STREAMALLOC_LIB=target/release/libstreamalloc.so \
#     python3 benches/gpu/p2p/host_profile.py [WORLD] [SCALE] [BUDGET_MIB]   (default 4 1000 128)
# Prints one line per phase: seconds, and per op or per round where that is the unit. (The
# rounds' packing is device work: benches/gpu/p2p/profile.py times it on GPUs.) Builds the
# native P2POp reader if it can (streamalloc._p2p_native). The ops are read twice natively:
# as objects with __slots__, and with a __dict__ (as torch.distributed.P2POp keeps its fields)
# and their group checked, as the drop-in reads them. The line before the last adds to the
# rebind what the drop-in does after each run: letting go of the caller's tensors. The last
# line is the drop-in's host work on a cached shape before its run: reading the list, its
# digest, and rebinding the agreed exchange (kernel packing: its copy table's addresses,
# written to host memory here).
import random
import sys
import time

import torch

from streamalloc import _ce, _p2p_checks, _p2p_copy, _p2p_native, _p2p_rounds, p2p

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


GROUP = object()  # the ops' process group


class DictOp:  # P2POp's fields, in a __dict__ as P2POp keeps them
    def __init__(self, op, tensor, peer):
        self.op, self.tensor, self.group, self.peer = op, tensor, GROUP, peer
        self.tag, self.group_peer = 0, peer


def ops_of(rank, cls=Op):
    sends = [cls(isend, torch.empty(size(rank, j), device="meta"), j)
             for j in range(WORLD) for _ in range(T[rank][j])]
    recvs = [cls(irecv, torch.empty(size(j, rank), device="meta"), j)
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
read_py = timed("read the P2POp list (Python)", lambda: _p2p_checks.translate_ops(
    ops, RANK, WORLD, None, isend, irecv), "op", n_ops)
native = _p2p_native.load()
if native is not None:
    read = timed("read the P2POp list (native)", lambda: _p2p_native.read_ops(
        ops, RANK, WORLD, None, isend, irecv), "op", n_ops)
    dict_ops = ops_of(RANK, DictOp)
    timed("read it (native), ops with __dict__, group", lambda: _p2p_native.read_ops(
        dict_ops, RANK, WORLD, None, isend, irecv, groups=(None, GROUP)), "op", n_ops)
    del dict_ops
else:
    print(f"(no native reader: {_p2p_native.failure()})")
    read = read_py
budget_bytes = BUDGET << 20
timed("shape digest (per peer and direction)", lambda: p2p.signature_digest(read, budget_bytes),
      "op", n_ops)
timed("describe the lists for the planner", lambda: read.description(RANK), "op", n_ops)
descriptions = [read.description(RANK) if r == RANK else _p2p_checks.translate_ops(
    ops_of(r), r, WORLD, None, isend, irecv).description(r) for r in range(WORLD)]
reserve = _p2p_copy.reserve_bytes(n_ops, sum(read.nbytes), budget_bytes, 2, WORLD)
budget = budget_bytes - _ce.reserve_bytes(2, WORLD) - reserve
plan = timed("plan (Rust, every rank's lists)", lambda: p2p.Plan(descriptions, budget, 2, _ce.NO_ZERO_COPY))
rows = timed("plan rows of this rank (ctypes)", lambda: plan.rows(RANK), "op", n_ops)
lists = (read.lists(0), read.lists(1))
rounds = timed("group rows into messages (_prepare)", lambda: p2p._prepare(rows, lists, read, lambda p: p),
               "op", n_ops)
bases = {(k, d): (1 + k % 2) << 40 for k, pair in enumerate(rounds) for d, m in enumerate(pair)
         if m is not None}
table = timed("build the copy table", lambda: _p2p_copy.build_table(rows, 9, read.starts(), WORLD, bases),
              "op", n_ops)
print(f"  {len(rounds)} rounds, {len(table)} pieces ({table.device_bytes / 2**20:.2f} MiB of table, "
      f"reserve {reserve / 2**20:.2f} MiB), summary {plan.summary(RANK)}")
addresses = torch.arange(n_ops, dtype=torch.int64) * 4096
timed("bind the table to new tensors", lambda: table.bind(addresses), "round", len(rounds))




def exchange_like():
    """What ``_rebind`` reads of an agreed Exchange (kernel packing over NCCL), host side:
    the copy table's addresses go to plain host memory where a GPU run has pinned memory."""
    ex = _p2p_rounds._Rounds()
    ex.rank, ex.world, ex.transport, ex._pack_mode = RANK, WORLD, "nccl", "kernel"
    ex._rounds, ex._lanes, ex._buffers = rounds, read, ([], [])
    copier = _p2p_copy.DeviceCopier.__new__(_p2p_copy.DeviceCopier)
    copier.table, copier._n, copier._uploaded = table, len(table), None
    copier._host = torch.empty(4 * len(table) + 1, dtype=torch.int64)
    ex._copier = copier
    return ex


ex = exchange_like()
timed("rebind the cached exchange (_rebind)", lambda: ex._rebind(read), "op", n_ops)


def unbind_then_rebind():
    ex._unbind()
    ex._rebind(read)


timed("let go of the tensors after the run, and rebind (_unbind, _rebind)", unbind_then_rebind,
      "op", n_ops)


def cached_call():
    lanes = _p2p_native.read_ops(ops, RANK, WORLD, None, isend, irecv) if native else \
        _p2p_checks.translate_ops(ops, RANK, WORLD, None, isend, irecv, True)
    p2p.signature_digest(lanes, budget_bytes)
    ex._rebind(lanes)


timed("drop-in call, cached shape, before the run", cached_call, "op", n_ops)
