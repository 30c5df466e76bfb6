# Unit checks of the copy-engine transport's pure logic (streamalloc._ce), no GPU, no torch:
#   1. receive slots and counters: buffers used in turn, seq 1, 2, 3, ... per buffer across
#      runs, cyclic comparison across the 2**32 wrap;
#   2. the flag protocol, simulated: random rounds on 2-5 ranks, each rank's copy and unpack
#      streams as queues of the operations run() enqueues (wait/copy/write, wait/unpack/
#      write), executed in any order the waits allow, over several runs of one exchange:
#      every queue drains (no deadlock), no copy overwrites a buffer before it was unpacked,
#      every unpack reads the message meant for it; also with each rank's streams merged
#      into one hardware queue;
#   3. the region layout and the budget reserve keep staging within the budget;
#   4. the transport choice (auto / nccl / ce) from the ranks' probes;
#   5. the IPC mapping cache opens each handle once and closes it with its last user.
#   PYTHONPATH=python python3 benches/gpu/p2p/ce_unit_check.py
import random
import sys

from streamalloc import _ce

failures = []


def check(cond, what):
    if not cond:
        failures.append(what)
        print("FAIL:", what, flush=True)


# ---- 1. slots and counters ----
slots = _ce.receive_slots(5, 2)
check([(s.buffer, s.use, s.uses) for s in slots] == [(0, 0, 3), (1, 0, 2), (0, 1, 3), (1, 1, 2), (0, 2, 3)],
      "receive_slots(5, 2)")
check([s.seq(0) for s in slots] == [1, 1, 2, 2, 3], "seq of run 0")
check([s.seq(1) for s in slots] == [4, 3, 5, 4, 6], "seq of run 1 continues per buffer")
check(slots[0].free_wait(0) == 0 and slots[0].free_wait(1) == 3, "free_wait waits on the last use")
check(_ce.next_users(["a", "b", "c", "d", "e"], 2) == ["c", "d", "e", "b", "a"], "next_users")
check(_ce.cyclic_geq(5, 5) and _ce.cyclic_geq(6, 5) and not _ce.cyclic_geq(4, 5), "cyclic_geq")
check(_ce.cyclic_geq(3, 0xFFFF_FFFE) and not _ce.cyclic_geq(0xFFFF_FFFE, 3), "cyclic_geq wraps")
big = _ce.Slot(0, 0, 1)
check(big.seq(0xFFFF_FFFF) == 0 and big.free_wait(0xFFFF_FFFF) == 0xFFFF_FFFF and big.seq(0x1_0000_0000) == 1,
      "seq wraps at 2**32")
try:
    _ce.receive_slots(3, 0)
    check(False, "messages with no buffer must fail")
except ValueError:
    pass


# ---- 2. the protocol, simulated ----
def simulate(world, rounds, nbufs, runs, merged, rng, run0=0):
    """rounds: list of {src: dst}. nbufs[r]: receive buffers of rank r. Builds the ops of
    run() and executes them; returns None or a failure description."""
    recv = [[(k, s) for k, pairs in enumerate(rounds) for s, d in pairs.items() if d == r]
            for r in range(world)]
    slots = [_ce.receive_slots(len(recv[r]), nbufs[r]) for r in range(world)]
    nexts = [_ce.next_users([s for _, s in recv[r]], nbufs[r]) for r in range(world)]
    pos = [{k: u for u, (k, _) in enumerate(recv[r])} for r in range(world)]
    # flags: filled[r][b] in r's memory; free[s][(r, b)] in s's memory
    filled = [[0] * nbufs[r] for r in range(world)]
    free = [dict() for _ in range(world)]
    if run0:  # the flags as runs 0..run0-1 left them: every write of run run0-1 applied
        for r in range(world):
            for u, (k, s) in enumerate(recv[r]):
                sl = slots[r][u]
                filled[r][sl.buffer] = sl.seq(run0 - 1)
                free[nexts[r][u]][(r, sl.buffer)] = sl.seq(run0 - 1)
    content = [[None] * nbufs[r] for r in range(world)]  # what sits in each buffer
    queues = {}
    for r in range(world):
        cq, uq = [], []
        for run in range(run0, run0 + runs):
            for k, pairs in enumerate(rounds):
                if r in pairs:  # r sends in round k
                    d = pairs[r]
                    sl = slots[d][pos[d][k]]
                    cq.append(("wait", ("free", r, (d, sl.buffer)), sl.free_wait(run)))
                    cq.append(("copy", d, sl.buffer, (run, k, r)))
                    cq.append(("write", ("filled", d, sl.buffer), sl.seq(run)))
                if k in pos[r]:  # r receives in round k
                    u = pos[r][k]
                    sl = slots[r][u]
                    uq.append(("wait", ("filled", r, sl.buffer), sl.seq(run)))
                    uq.append(("unpack", r, sl.buffer, (run, k, recv[r][u][1])))
                    uq.append(("write", ("free", nexts[r][u], (r, sl.buffer)), sl.seq(run)))
        if merged:  # one hardware queue: the host's enqueue order, round by round
            q, i, j = [], 0, 0
            # run() enqueues a round's send ops, then its receive ops
            for run in range(run0, run0 + runs):
                for k, pairs in enumerate(rounds):
                    if r in pairs:
                        q += cq[i:i + 3]; i += 3
                    if k in pos[r]:
                        q += uq[j:j + 3]; j += 3
            queues[(r, "all")] = q
        else:
            queues[(r, "copy")], queues[(r, "unpack")] = cq, uq

    def read(flag):
        kind, who, idx = flag
        return filled[who][idx] if kind == "filled" else free[who].get(idx, 0)

    def do(op):
        if op[0] == "wait":
            return _ce.cyclic_geq(read(op[1]), op[2])
        if op[0] == "write":
            kind, who, idx = op[1]
            if kind == "filled":
                filled[who][idx] = op[2]
            else:
                free[who][idx] = op[2]
        elif op[0] == "copy":
            _, d, b, tag = op
            if content[d][b] is not None:
                raise AssertionError(f"copy {tag} overwrites {content[d][b]} in rank {d} buffer {b}")
            content[d][b] = tag
        elif op[0] == "unpack":
            _, r, b, tag = op
            if content[r][b] != tag:
                raise AssertionError(f"rank {r} unpacks {content[r][b]} from buffer {b}, expected {tag}")
            content[r][b] = None
        return True

    heads = {q: 0 for q in queues}
    try:
        while True:
            ready = [q for q in queues if heads[q] < len(queues[q])]
            if not ready:
                return None
            rng.shuffle(ready)
            progressed = False
            for q in ready:
                if do(queues[q][heads[q]]):
                    heads[q] += 1
                    progressed = True
                    break
            if not progressed:
                stuck = {q: queues[q][heads[q]] for q in ready}
                return f"deadlock: {stuck}"
    except AssertionError as err:
        return str(err)


def random_rounds(world, n, rng):
    """Rounds in the planner's shape: disjoint pairs, both directions optional."""
    out = []
    for _ in range(n):
        ranks = list(range(world))
        rng.shuffle(ranks)
        pairs = {}
        for a, b in zip(ranks[::2], ranks[1::2]):
            if rng.random() < 0.8:
                pairs[a] = b
            if rng.random() < 0.8:
                pairs[b] = a
        out.append(pairs)
    return out


rng = random.Random(7)
cases = 0
for trial in range(300):
    world = rng.randint(2, 5)
    rounds = random_rounds(world, rng.randint(0, 12), rng)
    bpd = rng.randint(1, 4)
    nbufs = [bpd] * world
    merged = trial % 3 == 0
    run0 = 0 if trial % 5 else (1 << 32) // max(1, rng.randint(1, 6)) - rng.randint(0, 3)
    err = simulate(world, rounds, nbufs, runs=3, merged=merged, rng=rng, run0=run0)
    check(err is None, f"protocol trial {trial} (world {world}, {len(rounds)} rounds, {bpd} buffers, "
                       f"merged={merged}, run0={run0}): {err}")
    cases += 1

# A protocol with the wrong free wait (not waiting for the previous use) must be caught:
# one buffer, two messages into it in a row from different senders.
orig = _ce.Slot.free_wait
_ce.Slot.free_wait = lambda self, run: 0
err = simulate(3, [{0: 2}, {1: 2}, {0: 2}], [1, 1, 1], runs=2, merged=False, rng=random.Random(1))
_ce.Slot.free_wait = orig
bad_caught = err is not None
if not bad_caught:  # the random order may have been lucky: try several orders
    _ce.Slot.free_wait = lambda self, run: 0
    bad_caught = any(simulate(3, [{0: 2}, {1: 2}, {0: 2}], [1, 1, 1], runs=2, merged=False,
                              rng=random.Random(s)) for s in range(50))
    _ce.Slot.free_wait = orig
check(bad_caught, "the simulation catches a sender that does not wait for the buffer")

# ---- 3. layout and reserve ----
for bpd in (2, 4, 8):
    for world in (2, 3, 8):
        for budget in (1 << 20, 128 << 20, (128 << 20) + 12345):
            plan_budget = budget - _ce.reserve_bytes(bpd, world)
            per = (plan_budget // (2 * bpd)) // 16 * 16  # the planner's buffer_bytes()
            worst = per - 1 if per % 2 else per - 15  # odd sizes exercise the stride padding
            lay = _ce.Layout(bpd, worst, bpd, world)
            rounded = lambda n: (n + 511) // 512 * 512  # PyTorch's caching allocator rounding
            total = bpd * rounded(per) + rounded(lay.size)
            check(total <= budget, f"staging {total} > budget {budget} (bpd {bpd}, world {world})")
            check(lay.stride % _ce.ALIGN == 0 and lay.filled_offset % 4 == 0, "alignment")
            offs = {lay.filled(b) for b in range(bpd)} | {lay.free(r, b) for r in range(world) for b in range(bpd)}
            check(len(offs) == bpd * (world + 1) and max(offs) + 4 <= lay.size
                  and min(offs) >= lay.buffers * lay.stride, "flags distinct, inside the region, after the buffers")

# ---- 4. transport choice ----
ok = lambda pci, peers, host="h/1": {"ok": True, "reason": "", "host": host, "pci": pci, "peers": peers, "flush": False}
two = [ok("a", {"b": True}), ok("b", {"a": True})]
B = 128 << 20
check(_ce.resolve_transport("auto", two, 2, B, 2) == ("ce", None), "auto picks ce")
check(_ce.resolve_transport("nccl", two, 2, B, 2) == ("nccl", None), "nccl stays nccl")
t, why = _ce.resolve_transport("auto", [ok("a", {"b": True}), ok("b", {"a": False})], 2, B, 2)
check(t == "nccl" and "peer access" in why, f"no peer access: nccl ({why})")
t, why = _ce.resolve_transport("ce", [ok("a", {"b": True}), ok("b", {"a": True}, host="h/2")], 2, B, 2)
check(t is None and "one host" in why, f"two hosts: explicit ce fails ({why})")
t, why = _ce.resolve_transport("auto", [{"ok": False, "reason": "tensors are on cpu"}] * 2, 2, B, 2)
check(t == "nccl" and why.startswith("rank 0: tensors are on cpu"), "cpu: nccl")
check(_ce.resolve_transport("auto", [ok("a", {}), ok("a", {})], 2, B, 2) == ("ce", None),
      "two ranks on one GPU need no peer access")
t, why = _ce.resolve_transport("auto", two, 2, 20000, 2)
check(t == "nccl" and "too small" in why, "tiny budget: nccl")
try:
    _ce.resolve_transport("tcp", two, 2, B, 2)
    check(False, "unknown transport must fail")
except ValueError:
    pass

# ---- 5. mapping cache ----
log = []
m = _ce.IpcMappings(lambda h: log.append(("open", h)) or 1000 + len(log), lambda base: log.append(("close", base)))
a1 = m.acquire(b"x"); a2 = m.acquire(b"x"); b1 = m.acquire(b"y")
check(a1 == a2 and a1 != b1 and log == [("open", b"x"), ("open", b"y")], "one open per handle")
m.release(b"x")
check(len(log) == 2, "still mapped while used")
m.release(b"x"); m.release(b"y")
check(log[2:] == [("close", a1), ("close", b1)] and len(m) == 0, "closed with the last user")

# ---- 6. IPC handles survive the trip through all_gather_object whole ----
raw = b"ab\0cd" + bytes(range(59))
h = _ce._IpcHandle.from_buffer_copy(raw)
check(bytes(h) == raw and len(bytes(h)) == 64, "a 64-byte handle with NUL bytes round-trips")

if failures:
    sys.exit(f"ce unit check FAILED ({len(failures)} failures)")
print(f"ce unit check ok ({cases} protocol simulations)")
