# One acceptance check of streamalloc's PyTorch doors, in this process, on one allocator.
#   python3 checks.py CHECK ALLOC OUT.json
# ALLOC: native (PyTorch's own) | sa_native (streamalloc.torch.install(), the native door) |
#        sa_pluggable (install(door="pluggable")) | sa_expandable (native door; the driver sets
#        STREAMALLOC_CONF=expandable_segments:true) | sa_nopools (native door, driver sets
#        STREAMALLOC_CONF=graph_pools:false) | sa_pluggable_nopools
# Writes {"status": PASS|FAIL|n/a|info, "figure": short text, "detail": {...}} to OUT.json.
# An exception is written as {"error": ...}; a crash or timeout leaves no file and the
# driver reports it from the log. driver.py runs every check in its own process.
import contextlib
import copy
import gc
import json
import math
import os
import pickle
import subprocess
import sys
import time
import traceback

from checks_common import MiB, clear_workspaces, door_of, install, result, served, settle
from checks_compile import check_compile_gpt2, check_compile_small

# ---- 1. graph replays must not touch eager tensors ----

def graph_corruption(alloc, eager_on):
    import torch
    torch.manual_seed(0)
    n = 16 * MiB  # float32: 64 MiB per tensor
    x = torch.randn(n, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up on the capture stream, as PyTorch asks
        for _ in range(2):
            tmp = x * 2
            tmp2 = tmp + 1
            out = (tmp2 * 3).sum()
    torch.cuda.current_stream().wait_stream(side)
    del tmp, tmp2, out
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=side):
        tmp = x * 2
        tmp2 = tmp + 1
        out = (tmp2 * 3).sum()
    del tmp, tmp2  # their memory stays the graph's: replays write it
    torch.cuda.synchronize()
    where = contextlib.nullcontext() if eager_on == "default" else torch.cuda.stream(side)
    with where:
        eager = [torch.full((n,), 7.0, device="cuda") for _ in range(4)]
    torch.cuda.synchronize()
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    bad = sum(int((t != 7.0).sum().item()) for t in eager)  # every element
    want = float(((x.double() * 2 + 1) * 3).sum().item())
    got = float(out.item())
    out_ok = math.isclose(got, want, rel_tol=1e-4, abs_tol=1.0)
    ptrs = [t.data_ptr() for t in eager]
    return bad, out_ok, dict(corrupted=bad, out=got, out_expected=want, eager_ptrs=[hex(p) for p in ptrs])


def check_graph_default(alloc):
    bad, out_ok, d = graph_corruption(alloc, "default")
    return result(bad == 0 and out_ok, f"{bad} corrupted" + ("" if out_ok else ", wrong output"), **d)


def check_graph_capture_stream(alloc):
    bad, out_ok, d = graph_corruption(alloc, "capture")
    return result(bad == 0 and out_ok, f"{bad} corrupted" + ("" if out_ok else ", wrong output"), **d)


def check_graph_nopools(alloc):
    # The same scenario with streamalloc's graph pools off: it must corrupt, which shows
    # that the check above can fail.
    try:
        bad, out_ok, d = graph_corruption(alloc, "default")
    except Exception as e:  # the key may not exist in this build: the conf is refused
        if "graph_pools" in str(e):
            return {"status": "n/a", "figure": "n/a (graph_pools refused)", "detail": {"error": str(e)[:300]}}
        raise
    status = "caught" if bad > 0 else "FAIL"
    return {"status": status, "figure": f"{bad} corrupted (expected > 0)", "detail": d}


# ---- 2. make_graphed_callables ----

def check_graphed_callables(alloc):
    import torch
    torch.manual_seed(0)
    clear_workspaces(torch)

    def cycle(seed):
        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.Linear(512, 64)).cuda()
        ref = copy.deepcopy(model)
        sample = torch.randn(32, 256, device="cuda", requires_grad=True)
        graphed = torch.cuda.make_graphed_callables(model, (sample,))
        worst = 0.0
        for i in range(4):
            inp = torch.randn(32, 256, device="cuda", requires_grad=True)
            inp_ref = inp.detach().clone().requires_grad_()
            out = graphed(inp)
            out.square().mean().backward()
            out_ref = ref(inp_ref)
            out_ref.square().mean().backward()
            pairs = [(out, out_ref), (inp.grad, inp_ref.grad)]
            pairs += [(p.grad, q.grad) for p, q in zip(model.parameters(), ref.parameters())]
            for a, b in pairs:
                worst = max(worst, float((a - b).abs().max().item()) / max(float(b.abs().max().item()), 1e-12))
            for p in list(model.parameters()) + list(ref.parameters()):
                p.grad = None
        del graphed, model, ref, sample, inp, inp_ref, out, out_ref, pairs
        settle(torch)
        return worst

    # The first cycle creates what stays for the process (the capture stream, its
    # handles); the second must leave memory_allocated where it found it.
    cycle(1)
    base = torch.cuda.memory_allocated()
    worst = cycle(2)
    delta = torch.cuda.memory_allocated() - base
    ok = worst < 1e-4 and delta == 0
    return result(ok, f"rel err {worst:.1e}, Δalloc {delta / MiB:+.1f} MiB", worst_rel_err=worst, delta_bytes=delta,
                  base=base)


# ---- 3. two graphs sharing one pool ----

def check_shared_pool(alloc):
    import torch
    n = 16 * MiB
    x = torch.zeros(n, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            t = x * 2
            y1 = t + 1
            u = y1 * 3
            y2 = u - x
    torch.cuda.current_stream().wait_stream(side)
    del t, y1, u, y2
    torch.cuda.synchronize()
    pool = torch.cuda.graph_pool_handle()
    g1, g2 = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
    with torch.cuda.graph(g1, pool=pool, stream=side):
        t = x * 2          # freed at the end of capture: g2 may reuse it (replayed after g1)
        y1 = t + 1
        del t
    with torch.cuda.graph(g2, pool=pool, stream=side):
        u = y1 * 3         # y1 is g1's live output: g2 must not take its memory
        y2 = u - x
        del u
    torch.cuda.synchronize()
    worst = 0.0
    for k in range(3):
        x.copy_(torch.full((n,), float(k + 1), device="cuda"))
        g1.replay()
        g2.replay()
        torch.cuda.synchronize()
        v = float(k + 1)
        e1 = float((y1 - (2 * v + 1)).abs().max().item())
        e2 = float((y2 - ((2 * v + 1) * 3 - v)).abs().max().item())
        worst = max(worst, e1, e2)
    outputs_ok = worst == 0.0
    reserved_before = torch.cuda.memory_reserved()
    del g1, g2, y1, y2, pool
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    reserved_after = torch.cuda.memory_reserved()
    drop = reserved_before - reserved_after
    ok = outputs_ok and drop > 0
    return result(ok, f"outputs {'ok' if outputs_ok else f'wrong ({worst:g})'}, reserved -{drop / MiB:.0f} MiB",
                  worst_abs_err=worst, reserved_before=reserved_before, reserved_after=reserved_after)



# ---- 5. a CUDA tensor sent to a spawned child ----

def child_main(alloc, child_installs, inbox, outbox):
    try:
        import torch
        if child_installs and alloc != "native":
            import streamalloc.torch as st
            st.install(door=door_of(alloc))
            mode = "streamalloc " + st.door()
        else:
            mode = "pytorch"
        t = inbox.get(timeout=60)
        t.add_(1)
        # The child's own allocations, through its allocator.
        scratch = torch.ones(MiB, device="cuda")
        total = float(scratch.sum().item())
        torch.cuda.synchronize()
        del t, scratch
        outbox.put(("ok", mode, total))
        inbox.get(timeout=60)  # the parent has read the result: the tensor may go
    except Exception as e:
        outbox.put(("error", repr(e)[:300], 0.0))


def spawn_check(alloc, child_installs):
    import torch
    import torch.multiprocessing as mp
    t = torch.zeros(4 * MiB, device="cuda")
    torch.cuda.synchronize()
    ctx = mp.get_context("spawn")
    inbox, outbox = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=child_main, args=(alloc, child_installs, inbox, outbox))
    p.start()
    inbox.put(t)
    state, mode, total = outbox.get(timeout=120)
    torch.cuda.synchronize()
    wrong = int((t != 1).sum().item()) if state == "ok" else -1
    inbox.put("done")
    p.join(60)
    code = p.exitcode
    ok = state == "ok" and wrong == 0 and code == 0 and total == float(MiB)
    if state != "ok":
        fig = f"child: {mode}"
    else:
        fig = f"{wrong} wrong, child {mode}, exit {code}"
    return result(ok, fig, child_state=state, child_mode=mode, wrong=wrong, exitcode=code)


def check_spawn_child_streamalloc(alloc):
    return spawn_check(alloc, True)


def check_spawn_child_pytorch(alloc):
    return spawn_check(alloc, False)


# ---- 6. torch.cuda.MemPool ----

def check_mempool(alloc):
    import torch
    pool = torch.cuda.MemPool()
    with torch.cuda.use_mem_pool(pool):
        a = torch.empty(64 * MiB, dtype=torch.uint8, device="cuda")
        b = torch.randn(MiB, device="cuda")
    c = torch.empty(64 * MiB, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    detail = {"pool_id": list(pool.id)}
    ranges = None
    try:
        segs = pool.snapshot()
        ranges = [(s["address"], s["address"] + s["total_size"]) for s in segs]
        detail["pool_snapshot_segments"] = len(segs)
    except Exception as e:
        detail["pool_snapshot_error"] = repr(e)[:200]
        try:  # older MemPool without snapshot(): the whole snapshot's segments of this pool
            segs = [s for s in torch.cuda.memory._snapshot()["segments"]
                    if tuple(s.get("segment_pool_id", ())) == tuple(pool.id)]
            ranges = [(s["address"], s["address"] + s["total_size"]) for s in segs]
            detail["pool_segments_from_full_snapshot"] = len(segs)
        except Exception as e2:
            detail["full_snapshot_error"] = repr(e2)[:200]
    inside = lambda t: any(lo <= t.data_ptr() < hi for lo, hi in ranges)
    placed = None
    if ranges is not None:
        placed = inside(a) and inside(b) and not inside(c)
        detail["placed_by_snapshot"] = [inside(a), inside(b), inside(c)]
    if alloc != "native":  # streamalloc's own view of the pool, through its C ABI
        try:
            import ctypes
            from streamalloc import _lib
            lib = _lib.load()
            fn = lib.streamalloc_pool_live_allocations
            fn.restype = ctypes.c_int64
            fn.argtypes = [ctypes.c_int, ctypes.c_uint64, ctypes.c_uint64, ctypes.POINTER(ctypes.c_uint64), ctypes.c_size_t]
            out = (ctypes.c_uint64 * 64)()
            n = fn(torch.cuda.current_device(), pool.id[0], pool.id[1], out, 64)
            live = set(out[:max(0, min(n, 64))])
            mine = [a.data_ptr() in live, b.data_ptr() in live, c.data_ptr() in live]
            detail["placed_by_streamalloc"] = mine
            by_lib = mine[0] and mine[1] and not mine[2]
            placed = by_lib if placed is None else placed and by_lib
        except Exception as e:
            detail["streamalloc_pool_query_error"] = repr(e)[:200]
    reserved_before = torch.cuda.memory_reserved()
    del a, b, pool
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    reserved_after = torch.cuda.memory_reserved()
    returned = reserved_before - reserved_after
    detail.update(reserved_before=reserved_before, reserved_after=reserved_after)
    ok = bool(placed) and returned >= 64 * MiB and c.data_ptr() != 0
    where = {True: "in pool", False: "NOT in pool", None: "placement unknown"}[placed]
    return result(ok, f"{where}, -{returned / MiB:.0f} MiB after delete+empty_cache", **detail)


# ---- 7. memory history, snapshot, viewers ----

def check_memory_history(alloc):
    import torch
    out_dir = os.environ.get("CHECK_OUT_DIR", "/tmp")
    path = os.path.join(out_dir, f"history_{alloc}.pickle")
    torch.cuda.memory._record_memory_history(max_entries=100000)
    keep = []
    for i in range(50):
        t = torch.empty((i % 7 + 1) * MiB, dtype=torch.uint8, device="cuda")
        if i % 3 == 0:
            keep.append(t)
    y = torch.randn(1024, 1024, device="cuda") @ torch.randn(1024, 1024, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.memory._dump_snapshot(path)
    torch.cuda.memory._record_memory_history(enabled=None)
    written = os.path.getsize(path)
    with open(path, "rb") as f:
        snap = pickle.load(f)
    events = sum(len(t) for t in snap.get("device_traces", []))
    segments = len(snap.get("segments", []))
    from torch.cuda import _memory_viz
    viz = []
    for name in ("trace_plot", "segment_plot"):
        fn = getattr(_memory_viz, name, None)
        if fn is None:
            viz.append(f"{name} missing")
            continue
        try:
            html = fn(snap)
            viz.append(f"{name} {len(html)} chars")
        except Exception as e:
            viz.append(f"{name} error {repr(e)[:80]}")
    viz_ok = all(" chars" in v for v in viz)
    detail = dict(path=path, bytes=written, events=events, segments=segments, viz=viz)
    cli = ""
    binary = os.environ.get("STREAMALLOC_BIN")
    cli_ok = True
    if binary:
        converted = path + ".json"
        r = subprocess.run([binary, "snapshot", "convert", path, converted, "--to", "json"],
                           capture_output=True, text=True, timeout=60)
        cli_ok = r.returncode == 0 and os.path.isfile(converted)
        detail["cli"] = dict(rc=r.returncode, stderr=r.stderr[-300:])
        cli = ", cli ok" if cli_ok else f", cli rc={r.returncode}"
    ok = written > 0 and events > 0 and segments > 0 and viz_ok and cli_ok
    return result(ok, f"{events} events, {segments} segs, viz {'ok' if viz_ok else 'FAIL'}{cli}", **detail)


# ---- 8. cudnn.benchmark ----

def check_cudnn_benchmark(alloc):
    import torch
    import torchvision
    torch.backends.cudnn.benchmark = True
    torch.manual_seed(0)
    m = torchvision.models.resnet50().cuda()
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    x = torch.randn(32, 3, 224, 224, device="cuda")
    y = torch.randint(0, 1000, (32,), device="cuda")
    losses, times = [], []
    for i in range(4):
        t0 = time.perf_counter()
        loss = torch.nn.functional.cross_entropy(m(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        losses.append(float(loss.item()))
    ok = all(math.isfinite(v) for v in losses)
    peak = torch.cuda.max_memory_reserved()
    return result(ok, f"loss {losses[0]:.4f}->{losses[-1]:.4f}, step {times[-1] * 1e3:.0f} ms",
                  losses=losses, steps_ms=[t * 1e3 for t in times], peak_reserved=peak)


# ---- 9. torch.cuda memory statistics ----

NAMES = ("memory_stats", "memory_allocated", "max_memory_reserved")


def check_memory_stats(alloc, originals):
    import torch
    x = torch.empty(256 * MiB, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    a = torch.cuda.memory_allocated()
    r = torch.cuda.max_memory_reserved()
    s = torch.cuda.memory_stats()
    del x
    a2 = torch.cuda.memory_allocated()
    values_ok = a >= 256 * MiB and r >= a and s.get("allocated_bytes.all.current") == a and a - a2 >= 256 * MiB
    untouched = {n: getattr(torch.cuda, n) is originals[n] and getattr(torch.cuda.memory, n) is originals[n]
                 for n in NAMES}
    modules = {n: getattr(getattr(torch.cuda, n), "__module__", "?") for n in NAMES}
    original = all(untouched.values()) and all(m == "torch.cuda.memory" for m in modules.values())
    # The native door must leave PyTorch's functions alone; the pluggable door replaces them.
    ok = values_ok and (original or door_of(alloc) == "pluggable" and alloc != "native")
    fig = f"values {'ok' if values_ok else 'wrong'}, {'original functions' if original else 'patched'}"
    return result(ok, fig, allocated=a, allocated_after_del=a2, max_reserved=r, untouched=untouched, modules=modules)


CHECKS = {
    "graph_default": check_graph_default,
    "graph_capture_stream": check_graph_capture_stream,
    "graph_nopools": check_graph_nopools,
    "graphed_callables": check_graphed_callables,
    "shared_pool": check_shared_pool,
    "compile_small": check_compile_small,
    "compile_gpt2": check_compile_gpt2,
    "spawn_child_streamalloc": check_spawn_child_streamalloc,
    "spawn_child_pytorch": check_spawn_child_pytorch,
    "mempool": check_mempool,
    "memory_history": check_memory_history,
    "cudnn_benchmark": check_cudnn_benchmark,
    "memory_stats": check_memory_stats,
}


def door_probe(alloc):
    """Installs, times the first allocation (the native door is compiled at first use)."""
    import torch
    t0 = time.perf_counter()
    x = torch.ones(MiB, device="cuda")
    ok = float(x.sum().item()) == float(MiB)
    ms = (time.perf_counter() - t0) * 1e3
    try:
        backend = torch.cuda.memory.get_allocator_backend()
    except Exception as e:
        backend = repr(e)[:100]
    return result(ok, f"first allocation after {ms / 1e3:.1f} s", first_alloc_ms=ms, backend=backend)


def main():
    check, alloc, out = sys.argv[1], sys.argv[2], sys.argv[3]
    res = {"check": check, "alloc": alloc}
    t0 = time.perf_counter()
    try:
        import torch
        originals = {n: getattr(torch.cuda, n) for n in NAMES}
        t_install = time.perf_counter()
        res["install"] = install(alloc)
        res["install_s"] = time.perf_counter() - t_install
        if check == "door":
            r = door_probe(alloc)
        elif check == "memory_stats":
            r = check_memory_stats(alloc, originals)
        else:
            r = CHECKS[check](alloc)
        res.update(r)
        n = served(alloc)
        if n is not None:
            res.setdefault("detail", {})["streamalloc_allocs"] = n
            if n == 0 and res.get("status") == "PASS":
                res["status"], res["figure"] = "FAIL", "streamalloc served no allocation"
    except Exception as e:
        traceback.print_exc()
        if check == "graph_nopools" and "graph_pools" in str(e):  # this build lacks the key
            res.update(status="n/a", figure="n/a (graph_pools refused)", detail={"error": str(e)[:300]})
        else:
            res["error"] = f"{type(e).__name__}: {e}"
    res["seconds"] = round(time.perf_counter() - t0, 1)
    with open(out, "w") as f:
        json.dump(res, f, default=str)
    print(json.dumps(res, default=str)[:2000])


if __name__ == "__main__":
    main()
