# The native P2POp reader (python/streamalloc/csrc/p2p_door.cpp) against the Python one
# (streamalloc._p2p_checks.translate_ops), on CPU tensors: random lists of ops with several
# peers, directions, dtypes and shapes read into the same lanes (tensors, bytes, dtype codes,
# addresses, device, the 1-D views PyTorch's packing uses), and every invalid input refused
# with the same message; an Exchange's per-peer lists likewise (`lists`, its
# `Exchange._lanes_of`). Then both timed on the reproduction's pattern at ~58,000 ops.
# Builds the reader if needed (a C++ compiler, ninja, Python's headers); prints SKIP and
# exits 0 without torch.
#   PYTHONPATH=python python3 benches/gpu/p2p/native_check.py
import random
import struct
import sys
import time

try:
    import torch
except ImportError:
    print("SKIP: torch is not installed")
    sys.exit(0)

from streamalloc import _p2p_checks, _p2p_native, _p2p_plan
from streamalloc.p2p import P2PError

failures = []


def check(cond, what):
    if not cond:
        failures.append(what)
        print("FAIL:", what, flush=True)


def isend():
    pass


def irecv():
    pass


class Op:  # the fields of torch.distributed.P2POp that the readers use
    def __init__(self, op, tensor, peer, group_peer="same"):
        self.op, self.tensor, self.peer = op, tensor, peer
        self.group_peer = peer if group_peer == "same" else group_peer


def outcomes(*reads):
    """Each read's result, or the message of the P2PError it raised."""
    out = []
    for read in reads:
        try:
            out.append(read())
        except P2PError as err:
            out.append(str(err))
    return out


def both(ops, world=4, group_rank=None, groups=None):
    """(Python result or message, native result or message); with ``groups``, every op's
    ``group`` must be one of them."""
    return outcomes(lambda: _p2p_checks.translate_ops(ops, 0, world, group_rank, isend, irecv,
                                                      True, groups=groups),
                    lambda: _p2p_native.read_ops(ops, 0, world, group_rank, isend, irecv,
                                                 groups=groups))


def same(a, b):
    if isinstance(a, str) or isinstance(b, str):
        return a == b
    return (a.counts == b.counts and len(a.tensors) == len(b.tensors)
            and all(x is y for x, y in zip(a.tensors, b.tensors))
            and list(a.nbytes) == list(b.nbytes) and list(a.codes) == list(b.codes)
            and list(a.addresses) == list(b.addresses) and a.device == b.device
            and [t.shape for t in _p2p_native.flat_tensors(b.tensors)]
            == [_p2p_plan._flat(t).shape for t in a.tensors])


def main():
    if _p2p_native.load() is None:
        print(f"FAIL: the native reader could not be built: {_p2p_native.failure()}")
        return 1
    rng = random.Random(7)
    dtypes = [torch.float32, torch.bfloat16, torch.int8, torch.int64, torch.bool, torch.float64,
              torch.complex64, torch.uint8, torch.float16]
    for case in range(200):
        ops = []
        for _ in range(rng.randint(0, 60)):
            shape = rng.choice([(rng.randint(0, 9),), (2, rng.randint(0, 5)), ()])
            t = torch.zeros(shape, dtype=rng.choice(dtypes))
            ops.append(Op(rng.choice([isend, irecv]), t, rng.randrange(4)))
        a, b = both(ops)
        check(same(a, b), f"case {case}: the readers disagree")
    # Subgroups: peers named by global rank, mapped by the group (no group_peer).
    mapping = {10: 0, 20: 1, 30: 2}
    ops = [Op(isend, torch.ones(3), 30, None), Op(irecv, torch.ones(2), 10, None)]
    a, b = both(ops, 3, mapping.__getitem__)
    check(same(a, b) and not isinstance(b, str) and b.counts == [0, 0, 1, 1, 0, 0],
          "global peers mapped through the group")
    named = lambda: None
    named.__name__ = "isend"
    bad = {
        "not a P2POp": [Op(isend, torch.ones(1), 1), 7],
        "None": [None],
        "a None tensor": [Op(isend, None, 1)],
        "a string tensor": [Op(isend, "x", 1)],
        "a bad op": [Op(print, torch.ones(1), 1)],
        "a peer out of range": [Op(isend, torch.ones(1), 4)],
        "a negative peer": [Op(isend, torch.ones(1), -1)],
        "a bool peer": [Op(isend, torch.ones(1), True)],
        "no peer": [Op(isend, torch.ones(1), None, None)],
        "not contiguous": [Op(isend, torch.ones(3, 3).t(), 2)],
        "two devices": [Op(isend, torch.ones(1), 1), Op(isend, torch.ones(1, device="meta"), 1)],
    }
    for what, ops in bad.items():
        a, b = both(ops)
        check(isinstance(a, str) and a == b, f"{what}: the same message ({a!r} / {b!r})")
    class Sub(torch.Tensor):
        pass

    a, b = both([Op(isend, torch.zeros(2, 3).as_subclass(Sub), 1), Op(irecv, torch.zeros(4, 1), 2),
                 Op(isend, torch.zeros(5), 3)])
    check(same(a, b), "a tensor subclass and 2-D tensors: the same lanes and 1-D views")
    a, b = both([Op(named, torch.ones(2), 1)])
    check(same(a, b) and b.counts[1] == 1, "an op named isend (another module's function)")
    # Process groups: an op without `group` counts as None (the default group).
    mine, other = object(), object()
    in_group = Op(isend, torch.ones(2), 1)
    in_group.group = mine
    strayed = Op(irecv, torch.ones(2), 2)
    strayed.group = other
    a, b = both([in_group, Op(isend, torch.ones(1), 1)], groups=(mine, None))
    check(same(a, b) and not isinstance(b, str), "ops of the caller's group are read")
    a, b = both([in_group, strayed], groups=(mine,))
    check(isinstance(a, str) and a == b and "mixes process groups" in b,
          f"an op of another group: the same message ({a!r} / {b!r})")
    exchange_lists(rng, dtypes)
    if failures:
        print(f"{len(failures)} failure(s)")
        return 1

    # The reproduction's pattern at ~58,000 ops (one rank of 4; float32 of 1-66 KB, on the
    # meta device: no memory), shuffled as callers do.
    world, scale = 4, 1000
    g = torch.Generator().manual_seed(42)
    T = ((1 + torch.randperm(world * world, generator=g)) * scale).reshape(world, world).tolist()
    ops = [Op(isend, torch.empty(256 + (j * 104729) % 16384, device="meta"), j)
           for j in range(1, world) for _ in range(T[0][j])]
    ops += [Op(irecv, torch.empty(256 + (j * 7919) % 16384, device="meta"), j)
            for j in range(1, world) for _ in range(T[j][0])]
    random.Random(0).shuffle(ops)
    rows = []
    for label, read in (("Python (translate_ops)", lambda: _p2p_checks.translate_ops(
                            ops, 0, world, None, isend, irecv, True)),
                        ("native (p2p_door.cpp)", lambda: _p2p_native.read_ops(
                            ops, 0, world, None, isend, irecv))):
        best = min(_timed(read) for _ in range(5))
        rows.append((label, best))
    print(f"reading a shuffled list of {len(ops):,} ops into lanes (best of 5, one thread):")
    for label, best in rows:
        print(f"  {label:<24} {best * 1e3:8.2f} ms  {best / len(ops) * 1e9:7.0f} ns per op")
    print("native reader checks: all passed")
    return 0


def exchange_lists(rng, dtypes):
    """An Exchange's {peer: [tensors]} lists read natively and in Python: the same lanes,
    parameters detached; and every refused input refused with the Python checks' message."""
    from streamalloc._p2p_exchange import Exchange

    def read_both(sends, recvs, world=4):
        return outcomes(lambda: Exchange._lanes_in_python(sends, recvs, world),
                        lambda: Exchange._lanes_of(sends, recvs, world))

    def same_lanes(a, b):
        if isinstance(a, str) or isinstance(b, str):
            return a == b
        # Detached parameters are new tensor objects on each side: compare what they view.
        return (a.counts == b.counts and list(a.nbytes) == list(b.nbytes)
                and list(a.codes) == list(b.codes) and a.device == b.device
                and list(b.addresses) == [t.data_ptr() for t in a.tensors]
                and all(x.data_ptr() == y.data_ptr() and not y.requires_grad
                        for x, y in zip(a.tensors, b.tensors)))

    for case in range(100):
        sides = []
        for _ in range(2):
            side = {}
            for peer in rng.sample(range(4), rng.randint(0, 4)):
                side[peer] = [torch.zeros(rng.randint(0, 9), dtype=rng.choice(dtypes))
                              for _ in range(rng.randint(0, 20))]
            sides.append(side)
        a, b = read_both(*sides)
        check(same_lanes(a, b) and not isinstance(b, str), f"exchange lists {case}: the readers disagree")
    weight = torch.nn.Parameter(torch.ones(3))
    a, b = read_both({1: [weight, torch.ones(2)]}, {2: (torch.ones(1),)})
    check(same_lanes(a, b) and b.tensors[0] is not weight, "a parameter is read detached")
    bad = {
        "not a tensor": ({1: [torch.ones(1), 3]}, None),
        "not contiguous": ({1: [torch.ones(3, 3).t()]}, None),
        "a non-contiguous receive": (None, {2: [torch.ones(1), torch.ones(4, 4).t()]}),
        "two devices": ({1: [torch.ones(1)]}, {2: [torch.ones(1, device="meta")]}),
        "a tensor for a list": ({1: torch.ones(2)}, None),
        "a peer out of range": ({4: [torch.ones(1)]}, None),
    }
    for what, (sends, recvs) in bad.items():
        a, b = read_both(sends, recvs)
        check(a == b, f"exchange lists, {what}: the same result ({a!r} / {b!r})")
    # The planner's description of long lanes (interleaved in bulk) is byte for byte the
    # one packed entry by entry.
    import array
    sizes = array.array("q", [rng.randrange(1 << 40) for _ in range(9000)])
    codes = array.array("q", [rng.choice([0, 7, 0x7FFF_FFFF, 0x4000_0001]) for _ in range(9000)])
    for at, n in ((0, 9000), (17, 5000), (100, 4096), (3, 4095)):
        bulk = _p2p_plan._entries(sizes, codes, at, n)
        flat = [v for pair in zip(sizes[at:at + n], codes[at:at + n]) for v in pair]
        check(bulk == struct.pack("<" + "QI" * n, *flat),
              f"description entries {at}..{at + n}: the bulk interleaving differs")


def _timed(fn):
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


if __name__ == "__main__":
    torch.set_num_threads(1)
    sys.exit(main())
