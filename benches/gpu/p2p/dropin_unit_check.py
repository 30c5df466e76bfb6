# Unit checks of the batch_isend_irecv drop-in's pure parts (streamalloc.p2p), no GPU, no
# torch: P2POp-like objects with fake tensors.
#   1. translation: per-peer lists in list order (the k-th isend to B is B's k-th irecv
#      from this rank, as NCCL matches them), global ranks mapped to group ranks, 2-D
#      tensors flattened, the shape signature;
#   2. validation: bad op, peer out of range, non-contiguous tensor, several devices: each
#      a P2PError naming the op (ops to this rank itself are kept, as NCCL runs them);
#   3. the shape digest: the same list gives the same digest, any change of peer, order,
#      size, dtype or budget another one; empty lists are the empty digest.
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


def translate(ops, rank=0, world=3, group_rank=None):
    return p2p.translate_ops(ops, rank, world, group_rank, isend, irecv)


def raises(needle, call):
    try:
        call()
    except p2p.P2PError as err:
        return needle in str(err)
    return False


# ---- 1. translation ----
a, b, c, d = (FakeTensor(n, (4,)) for n in "abcd")
m = FakeTensor("m", (2, 3), BF16)
ops = [Op(irecv, a, 2), Op(isend, b, 1), Op(isend, m, 2), Op(irecv, c, 2), Op(isend, d, 1)]
out = translate(ops)
names = lambda lists: [[t.name for t in ts] for ts in lists]
check(names(out.send_lists) == [[], ["b", "d"], ["m.flat"]],
      "sends grouped per peer in list order, 2-D tensors flattened")
check(names(out.recv_lists) == [[], [], ["a", "c"]], "receives grouped per peer in list order")
check(out.signature == [5, 16, 0, 2, 16, 0, 4, 12, 2, 5, 16, 0, 2, 16, 0],
      "signature: (peer * 2 + is_recv, bytes, dtype code) per op, in list order")
check(out.device == "cuda:0", "the device of the ops")
empty = translate([])
check(empty.send_lists == [[], [], []] and empty.signature == [], "an empty list")
# A subgroup: ops name global ranks; the group's ranks are 10 -> 0, 20 -> 1, 30 -> 2.
global_to_group = {10: 0, 20: 1, 30: 2}
out = translate([Op(isend, a, 30), Op(irecv, b, 20)], rank=0, group_rank=global_to_group.__getitem__)
check(names(out.send_lists) == [[], [], ["a"]] and names(out.recv_lists) == [[], ["b"], []],
      "global peers mapped to group ranks")
named = lambda: None
named.__name__ = "irecv"
check(names(translate([Op(named, a, 1)]).recv_lists) == [[], ["a"], []],
      "an op named irecv (another module's function) is a receive")

# ---- 2. validation ----
check(raises("op 1: P2POp.op must be", lambda: translate([Op(isend, a, 1), Op(print, b, 1)])),
      "an op that is neither isend nor irecv")
check(raises("op 0: peer 3 is not a rank of the group (0..2)", lambda: translate([Op(isend, a, 3)])),
      "a peer out of range")
check(raises("op 0: peer -1 is not a rank", lambda: translate([Op(isend, a, -1)])),
      "a negative peer")
check(raises("op 0: peer None", lambda: translate([Op(isend, a, None)])), "no peer")
self_ops = translate([Op(isend, a, 1), Op(irecv, b, 0), Op(isend, c, 0)])
check(names(self_ops.send_lists) == [["c"], ["a"], []] and names(self_ops.recv_lists) == [["b"], [], []],
      "ops to and from this rank itself are kept, as NCCL runs them")
bent = FakeTensor("bent", (3, 3), contiguous=False)
check(raises("op 0 (peer 2): the tensor is not contiguous", lambda: translate([Op(isend, bent, 2)])),
      "a non-contiguous tensor")
other = FakeTensor("other", (4,), device=1)
check(raises("op 1 (peer 1): the tensor is on cuda:1, the first op's is on cuda:0",
             lambda: translate([Op(isend, a, 2), Op(isend, other, 1)])), "tensors on two devices")

# ---- 3. the shape digest ----
budget = 128 << 20
base = [Op(isend, a, 1), Op(irecv, b, 2), Op(isend, m, 2)]
digest = lambda ops, budget=budget: p2p.signature_digest(translate(ops), budget)
d0 = digest(base)
check(d0 == digest([Op(op, FakeTensor(n, s.shape, s.dtype), p)
                    for op, n, s, p in ((isend, "x", a, 1), (irecv, "y", b, 2), (isend, "z", m, 2))]),
      "new tensors of the same shapes: the same digest")
check(d0 not in (p2p._EMPTY_DIGEST, p2p._FAILED_DIGEST) and 0 < d0 < 2**62, "digest range")
changed = {
    "another peer": [Op(isend, a, 2), Op(irecv, b, 2), Op(isend, m, 2)],
    "another order": [Op(irecv, b, 2), Op(isend, a, 1), Op(isend, m, 2)],
    "another size": [Op(isend, FakeTensor("a", (5,)), 1), Op(irecv, b, 2), Op(isend, m, 2)],
    "another dtype": [Op(isend, a, 1), Op(irecv, b, 2), Op(isend, FakeTensor("m", (3, 2)), 2)],
    "a send turned receive": [Op(isend, a, 1), Op(isend, b, 2), Op(isend, m, 2)],
    "one op fewer": base[:2],
}
for what, ops in changed.items():
    check(digest(ops) != d0, f"the digest sees {what}")
check(digest(base, budget // 2) != d0, "the digest sees the budget")
check(p2p.signature_digest(translate(base), budget, "ce") != d0, "the digest sees the transport")
check(p2p.signature_digest(translate([]), budget) == p2p._EMPTY_DIGEST, "an empty list is the empty digest")

if failures:
    print(f"{len(failures)} failure(s)")
    sys.exit(1)
print("drop-in unit checks: all passed")
