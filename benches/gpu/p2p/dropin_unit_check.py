# Unit checks of the batch_isend_irecv drop-in's pure parts (streamalloc.p2p), no GPU, no
# torch: P2POp-like objects with fake tensors.
#   1. reading a list: lanes (peer and direction) in list order (the k-th isend to B is B's
#      k-th irecv from this rank, as NCCL matches them), global ranks mapped to group ranks;
#   2. validation: an element that is not a P2POp, a None tensor, a bad op, a peer out of
#      range, a non-contiguous tensor, several devices: each a P2PError naming the op (ops
#      to this rank itself are kept, as NCCL runs them); budgets that are not finite
#      positive numbers of MiB, options out of range;
#   3. the shape digest (the cache key): any interleaving of the peers' ops gives the same
#      digest; a change of order within one peer and direction, of peer, size, dtype,
#      direction, count, budget or transport gives another; empty lists are the empty digest;
#   4. the works: one dropped before wait() keeps its ops (so its tensors) until the
#      exchange's event completes; a waited or finished one keeps nothing.
#   PYTHONPATH=python python3 benches/gpu/p2p/dropin_unit_check.py
import sys

from streamalloc import p2p

failures = []


def check(cond, what):
    if not cond:
        failures.append(what)
        print("FAIL:", what, flush=True)


class FakeDtype:
    def __init__(self, name, itemsize):
        self.name, self.itemsize = name, itemsize

    def __str__(self):
        return "torch." + self.name


F32, BF16 = FakeDtype("float32", 4), FakeDtype("bfloat16", 2)


class FakeTensor:
    """What translate_ops reads of a tensor."""

    def __init__(self, name, shape, dtype=F32, device=0, contiguous=True):
        self.name, self.shape, self.dtype = name, shape, dtype
        self.device_index, self.contiguous = device, contiguous
        self.device = f"cuda:{device}" if device >= 0 else "cpu"
        self.numel = 1
        for n in shape:
            self.numel *= n
        self.nbytes = self.numel * dtype.itemsize

    def is_contiguous(self):
        return self.contiguous

    def get_device(self):
        return self.device_index

    def data_ptr(self):
        return id(self)

    def dim(self):
        return len(self.shape)

    def view(self, *shape):
        assert shape == (-1,) and self.contiguous
        return FakeTensor(self.name + ".flat", (self.numel,), self.dtype, self.device_index)


def isend(*_):
    raise AssertionError("the drop-in never calls the op")


def irecv(*_):
    raise AssertionError("the drop-in never calls the op")


class Op:
    def __init__(self, op, tensor, peer):
        self.op, self.tensor, self.peer = op, tensor, peer


def translate(ops, rank=0, world=3, group_rank=None, addresses=False):
    return p2p.translate_ops(ops, rank, world, group_rank, isend, irecv, addresses)


def raises(needle, call):
    try:
        call()
    except p2p.P2PError as err:
        return needle in str(err)
    return False


# ---- 1. reading a list ----
a, b, c, d = (FakeTensor(n, (4,)) for n in "abcd")
m = FakeTensor("m", (2, 3), BF16)
ops = [Op(irecv, a, 2), Op(isend, b, 1), Op(isend, m, 2), Op(irecv, c, 2), Op(isend, d, 1)]
out = translate(ops)
names = lambda lists: [[t.name for t in ts] for ts in lists]
check(names(out.lists(0)) == [[], ["b", "d"], ["m"]], "sends grouped per peer in list order")
check(names(out.lists(1)) == [[], [], ["a", "c"]], "receives grouped per peer in list order")
check(out.counts == [0, 2, 1, 0, 0, 2], "lane counts: sends to peers 0..2, then receives")
check(list(out.nbytes) == [16, 16, 12, 16, 16] and list(out.codes) == [0, 0, 2, 0, 0],
      "bytes and dtype codes, lane-major")
check(out.device == "cuda:0", "the device of the ops")
empty = translate([])
check(empty.lists(0) == [[], [], []] and not empty.tensors, "an empty list")
# A subgroup: ops name global ranks; the group's ranks are 10 -> 0, 20 -> 1, 30 -> 2.
global_to_group = {10: 0, 20: 1, 30: 2}
out = translate([Op(isend, a, 30), Op(irecv, b, 20)], rank=0, group_rank=global_to_group.__getitem__)
check(names(out.lists(0)) == [[], [], ["a"]] and names(out.lists(1)) == [[], ["b"], []],
      "global peers mapped to group ranks")
named = lambda: None
named.__name__ = "irecv"
check(names(translate([Op(named, a, 1)]).lists(1)) == [[], ["a"], []],
      "an op named irecv (another module's function) is a receive")
check(list(translate([Op(isend, a, 1)], addresses=True).addresses) == [id(a)],
      "the tensors' addresses where asked for")

# ---- 2. validation ----
check(raises("op 1: P2POp.op must be", lambda: translate([Op(isend, a, 1), Op(print, b, 1)])),
      "an op that is neither isend nor irecv")
check(raises("op 0: peer 3 is not a rank of the group (0..2)", lambda: translate([Op(isend, a, 3)])),
      "a peer out of range")
check(raises("op 0: peer -1 is not a rank", lambda: translate([Op(isend, a, -1)])),
      "a negative peer")
check(raises("op 0: peer None", lambda: translate([Op(isend, a, None)])), "no peer")
check(raises("op 0: peer True", lambda: translate([Op(isend, a, True)])), "a bool is no peer")
check(raises("op 1 is a int, not a torch.distributed.P2POp", lambda: translate([Op(isend, a, 1), 7])),
      "an element that is not a P2POp")
check(raises("op 0 is a NoneType, not", lambda: translate([None])), "None in the list")
check(raises("op 0 (peer 1): the tensor is NoneType, not a torch.Tensor",
             lambda: translate([Op(isend, None, 1)])), "a None tensor")
check(raises("op 0 (peer 1): the tensor is str", lambda: translate([Op(isend, "t", 1)])),
      "a tensor that is a string")
self_ops = translate([Op(isend, a, 1), Op(irecv, b, 0), Op(isend, c, 0)])
check(names(self_ops.lists(0)) == [["c"], ["a"], []] and names(self_ops.lists(1)) == [["b"], [], []],
      "ops to and from this rank itself are kept, as NCCL runs them")
bent = FakeTensor("bent", (3, 3), contiguous=False)
check(raises("op 0 (peer 2): the tensor is not contiguous", lambda: translate([Op(isend, bent, 2)])),
      "a non-contiguous tensor")
other = FakeTensor("other", (4,), device=1)
check(raises("op 1 (peer 1): the tensor is on cuda:1, the first op's is on cuda:0",
             lambda: translate([Op(isend, a, 2), Op(isend, other, 1)])), "tensors on two devices")
from streamalloc import _p2p_checks as checks  # noqa: E402

for bad, needle in [(0, "finite and positive (got 0)"), (-1, "finite and positive (got -1)"),
                    (float("nan"), "(got nan)"), (float("inf"), "(got inf)"),
                    (float("-inf"), "(got -inf)"), (None, "not NoneType None"),
                    ("128", "not str '128'"), (True, "not bool True"), (2.0**50, "outside"),
                    (1e-9, "outside")]:
    check(raises(needle, lambda: checks.budget_bytes(bad)), f"budget_mib={bad!r} is refused")
check(checks.budget_bytes(128) == 128 << 20 and checks.budget_bytes(0.5) == 1 << 19,
      "finite positive budgets in bytes")
for args, needle in [((0, None, "auto"), "rounds_per_group"), ((1.5, None, "auto"), "rounds_per_group"),
                     ((1, 0, "auto"), "zero_copy_min"), ((1, -4, "auto"), "zero_copy_min"),
                     ((1, None, "rdma"), "transport must be one of"),
                     ((1, None, None), "transport must be one of")]:
    check(raises(needle, lambda: checks.check_options(*args)), f"options {args} are refused")
check(checks.message_of(KeyError("x")) == "KeyError: 'x'" and
      checks.message_of(p2p.P2PError("plain")) == "plain",
      "an unforeseen exception keeps its type in the agreed message")
check(checks.refusals([None, "bad", None, "worse"]) ==
      "rank 1 cannot take part in the p2p exchange: bad; "
      "rank 3 cannot take part in the p2p exchange: worse" and checks.refusals([None]) is None,
      "the agreed message names every refusing rank")

# ---- 3. the shape digest ----
budget = 128 << 20
digest = lambda ops, budget=budget, transport="auto": p2p.signature_digest(translate(ops), budget,
                                                                             transport)
x = [FakeTensor(f"x{i}", (4 + i,)) for i in range(3)]  # to peer 1: 16, 20, 24 bytes
y = [FakeTensor(f"y{i}", (9,), BF16) for i in range(2)]  # to peer 2
z = [FakeTensor(f"z{i}", (7 - i,)) for i in range(2)]  # from peer 2: 28, 24 bytes
lanes_of = [[Op(isend, t, 1) for t in x], [Op(isend, t, 2) for t in y], [Op(irecv, t, 2) for t in z]]


def interleaved(seed):
    """The three lanes' ops interleaved at random, each lane in its own order."""
    import random

    queues, out, rng = [list(q) for q in lanes_of], [], random.Random(seed)
    while any(queues):
        out.append(rng.choice([q for q in queues if q]).pop(0))
    return out


d0 = digest(interleaved(0))
check(all(digest(interleaved(seed)) == d0 for seed in range(1, 40)),
      "any interleaving of the peers' ops: the same digest (shuffled lists hit the cache)")
check(d0 == digest([Op(op.op, FakeTensor("new", op.tensor.shape, op.tensor.dtype), op.peer)
                    for op in interleaved(5)]),
      "new tensors of the same shapes: the same digest")
check(d0 not in (p2p._EMPTY_DIGEST, p2p._FAILED_DIGEST) and 0 < d0 < 2**62, "digest range")
swapped = [Op(isend, x[1], 1), Op(isend, x[0], 1), Op(isend, x[2], 1)] + lanes_of[1] + lanes_of[2]
changed = {
    "another order within one peer": swapped,
    "another order of receives within one peer": lanes_of[0] + lanes_of[1] + lanes_of[2][::-1],
    "another peer": [Op(isend, x[0], 2)] + lanes_of[0][1:] + lanes_of[1] + lanes_of[2],
    "another size": [Op(isend, FakeTensor("a", (5,)), 1)] + lanes_of[0][1:] + lanes_of[1] + lanes_of[2],
    "another dtype": lanes_of[0] + [Op(isend, FakeTensor("y", (9,)), 2), lanes_of[1][1]] + lanes_of[2],
    "a send turned receive": lanes_of[0] + lanes_of[1] + [Op(isend, t, 2) for t in z],
    "one op fewer": lanes_of[0] + lanes_of[1] + lanes_of[2][:1],
    "an op moved to another lane of the same size": lanes_of[0][:2] + [Op(isend, x[2], 0)]
    + lanes_of[1] + lanes_of[2],
}
for what, ops in changed.items():
    check(digest(ops) != d0, f"the digest sees {what}")
check(digest(interleaved(0), budget // 2) != d0, "the digest sees the budget")
check(digest(interleaved(0), transport="ce") != d0, "the digest sees the transport")
check(p2p.signature_digest(translate([]), budget) == p2p._EMPTY_DIGEST,
      "an empty list is the empty digest")

# 4. The tensors of a work dropped before wait(): kept (with the op list) until the
#    exchange's event completes, then let go; a waited work or a finished exchange keeps
#    nothing. (The cached exchange itself keeps none of a caller's tensors.)
from streamalloc import _p2p_dropin as dropin  # noqa: E402


class FakeEvent:
    def __init__(self, done):
        self.done = done

    def query(self):
        return self.done


class FakeStream:
    def wait_event(self, event):
        pass


class FakeCuda:
    @staticmethod
    def current_stream(device):
        return FakeStream()


class FakeTorch:  # what _Work.wait() touches
    cuda = FakeCuda


def dropped(event, waited):
    ops = ["op"]
    work = dropin._Work(event, "cuda:0", ops)
    if waited:
        saved = sys.modules.get("torch")
        sys.modules["torch"] = FakeTorch
        try:
            work.wait()
        finally:
            if saved is None:
                del sys.modules["torch"]
            else:
                sys.modules["torch"] = saved
    del work
    return ops


dropin._IN_FLIGHT.clear()
running = FakeEvent(False)
ops = dropped(running, waited=False)
check([o for _, o in dropin._IN_FLIGHT] == [ops],
      "a work dropped unwaited while its exchange runs keeps its ops in flight")
dropin._prune_in_flight()
check(len(dropin._IN_FLIGHT) == 1, "ops in flight stay while the exchange runs")
running.done = True
dropin._prune_in_flight()
check(not dropin._IN_FLIGHT, "ops in flight go once the exchange is done")
dropped(FakeEvent(True), waited=False)
check(not dropin._IN_FLIGHT, "a work dropped after its exchange is done keeps nothing")
dropped(FakeEvent(False), waited=True)
check(not dropin._IN_FLIGHT, "a waited work keeps nothing once dropped")
dropped(None, waited=False)
check(not dropin._IN_FLIGHT, "a work of a CPU exchange (no event) keeps nothing")

if failures:
    print(f"{len(failures)} failure(s)")
    sys.exit(1)
print("drop-in unit checks: all passed")
