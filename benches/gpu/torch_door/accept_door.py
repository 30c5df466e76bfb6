# Acceptance of the native door's PyTorch integration, one check per process:
#   python3 accept_door.py profile ALLOC OUT.json   # torch.profiler memory events of a training step
#   python3 accept_door.py stats ALLOC OUT.json     # memory_stats() keys, values, reset_accumulated
#   python3 accept_door.py use_on_oom ALLOC OUT.json  # a MemPool(use_on_oom=True) backs an OOM
#   python3 accept_door.py nccl ALLOC OUT.json [RANKS]  # NCCL-registered MemPool all_reduce (2 GPUs)
#   python3 accept_door.py no_split ALLOC OUT.json  # MemPool(no_split=True): a segment per tensor
#   python3 accept_door.py ipc ALLOC OUT.json       # CUDA IPC of 1 KiB, expandable and stitched
#                                                   # tensors to spawned and forkserver children
#   python3 accept_door.py table OUTDIR             # the table of every OUT.json in OUTDIR
# ALLOC: native (PyTorch's allocator) | sa_native (streamalloc.torch.install(door="native")).
# Each writes {"status": PASS|FAIL|info, "figure": short text, "detail": {...}}.
import json
import os
import sys
import tempfile
import traceback

MiB = 1 << 20


def install(alloc):
    if alloc == "sa_native":
        import streamalloc.torch as st
        st.install(door="native")
        assert st.door() == "native", st.door()
    elif alloc != "native":
        raise SystemExit(f"unknown allocator {alloc}")


def result(ok, figure, **detail):
    return {"status": "PASS" if ok else "FAIL", "figure": figure, "detail": detail}


def small_gpt(torch, layers=4, width=256, heads=4, vocab=8192, block=256):
    """A GPT-2-shaped model made here (no download): embeddings, causal blocks, head."""
    nn = torch.nn

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
            self.attn = nn.MultiheadAttention(width, heads, batch_first=True)
            self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

        def forward(self, x):
            n = x.shape[1]
            mask = torch.triu(torch.ones(n, n, dtype=torch.bool, device=x.device), 1)
            h = self.ln1(x)
            x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
            return x + self.mlp(self.ln2(x))

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok, self.pos = nn.Embedding(vocab, width), nn.Embedding(block, width)
            self.blocks = nn.Sequential(*[Block() for _ in range(layers)])
            self.ln, self.head = nn.LayerNorm(width), nn.Linear(width, vocab, bias=False)

        def forward(self, idx):
            pos = torch.arange(idx.shape[1], device=idx.device)
            return self.head(self.ln(self.blocks(self.tok(idx) + self.pos(pos))))

    return GPT().cuda(), vocab, block


# ---- profiler memory timeline ----

def check_profile(alloc):
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    torch.manual_seed(0)
    model, vocab, block = small_gpt(torch)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randint(vocab, (8, block), device="cuda")

    def step():
        loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), x.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()  # optimizer state and workspaces exist before the profiled step
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], profile_memory=True,
                 record_shapes=True, with_stack=True) as prof:
        step()
        torch.cuda.synchronize()
    # The profiler's raw records: each allocation and free the allocator reported.
    records = [e for e in prof.profiler.kineto_results.events()
               if e.name() == "[memory]" and e.device_type() == DeviceType.CUDA]
    allocs = sum(1 for e in records if e.nbytes() > 0)
    frees = sum(1 for e in records if e.nbytes() < 0)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "timeline.json")
        prof.export_memory_timeline(path, device="cuda:0")
        with open(path) as f:
            times, sizes = json.load(f)
    ok = allocs > 0 and frees > 0 and len(times) > 0
    return result(ok, f"{allocs} allocs, {frees} frees, timeline {len(times)} points",
                  allocs=allocs, frees=frees, timeline_points=len(times),
                  timeline_peak=max((sum(s) for s in sizes), default=0))


# ---- memory_stats ----

def check_stats(alloc):
    import torch
    model, vocab, block = small_gpt(torch, layers=2)
    x = torch.randint(vocab, (4, block), device="cuda")
    small = [torch.empty(4096, device="cuda") for _ in range(8)]
    model(x).sum().backward()
    del small
    torch.cuda.synchronize()
    before = torch.cuda.memory_stats()
    torch.cuda.reset_accumulated_memory_stats()
    after = torch.cuda.memory_stats()
    accumulated = [k for k in after if k.endswith((".allocated", ".freed")) or k.startswith("num_")]
    reset_ok = all(after[k] == 0 for k in accumulated) and \
        after["allocated_bytes.all.current"] == before["allocated_bytes.all.current"] and \
        after["allocated_bytes.all.peak"] == before["allocated_bytes.all.peak"]
    y = torch.empty(MiB, device="cuda")
    del y
    later = torch.cuda.memory_stats()
    counts_again = later["allocation.all.allocated"] >= 1 and later["allocation.all.freed"] >= 1
    zero = sorted(k for k, v in before.items() if v == 0)
    ok = reset_ok and counts_again
    return result(ok, f"{len(before)} keys, {len(before) - len(zero)} nonzero; reset "
                  f"{'ok' if reset_ok else 'WRONG'}", keys=sorted(before), zero=zero,
                  values=before, reset_ok=reset_ok, counts_again=counts_again)


# ---- MemPool(use_on_oom=True) ----

def check_use_on_oom(alloc):
    import torch
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(0.25)
    limit = total // 4
    pool = torch.cuda.MemPool(use_on_oom=True)
    with torch.cuda.use_mem_pool(pool):
        held = torch.empty(int(limit * 0.6), dtype=torch.uint8, device="cuda")
    address = held.data_ptr()
    del held  # cached in the pool, which keeps it
    # Outside the pool: no room under the limit except the pool's cached block.
    try:
        outside = torch.empty(int(limit * 0.55), dtype=torch.uint8, device="cuda")
    except torch.OutOfMemoryError as err:
        return result(False, "OOM: the pool's cache was not used", error=str(err)[:300])
    reused = outside.data_ptr() == address
    del outside
    return result(reused, "served from the pool's cached block" if reused else "another block",
                  limit=limit)


# ---- NCCL user-buffer registration through MemPool(allocator=...) ----

def nccl_rank(rank, alloc, port, queue, world):
    try:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                          WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
        install(alloc)
        import torch
        import torch.distributed as dist
        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
        backend = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cuda"))
        n = 32 * MiB // 4
        plain = torch.full((n,), float(rank + 1), device="cuda")
        dist.all_reduce(plain)
        pool = torch.cuda.MemPool(backend.mem_allocator)
        with torch.cuda.use_mem_pool(pool):
            registered = torch.full((n,), float(rank + 1), device="cuda")
        backend.register_mem_pool(pool)
        for _ in range(3):
            registered.fill_(float(rank + 1))
            dist.all_reduce(registered)
        torch.cuda.synchronize()
        total = float(world * (world + 1) // 2)
        same = bool(torch.equal(plain, registered)) and float(plain[0]) == total
        backend.deregister_mem_pool(pool)
        del registered
        del pool
        dist.destroy_process_group()
        queue.put((rank, {"ok": same, "value": float(plain[0])}))
    except Exception as err:
        traceback.print_exc()
        queue.put((rank, {"ok": False, "error": f"{type(err).__name__}: {str(err)[:300]}"}))


def check_nccl(alloc, ranks="2"):
    import torch
    import torch.multiprocessing as mp
    world = int(ranks)
    if torch.cuda.device_count() < world:
        return {"status": "skipped", "figure": f"skipped: needs {world} GPUs", "detail": {}}
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = 29500 + os.getpid() % 1000
    procs = [ctx.Process(target=nccl_rank, args=(r, alloc, port, queue, world))
             for r in range(world)]
    for p in procs:
        p.start()
    got = {}
    for _ in procs:
        try:
            rank, res = queue.get(timeout=150)
            got[rank] = res
        except Exception:
            break
    for p in procs:
        p.join(timeout=30)
        if p.is_alive():
            p.kill()
    ok = len(got) == world and all(r["ok"] for r in got.values())
    errors = [r.get("error") for r in got.values() if r.get("error")]
    fig = (f"{world} ranks: registered all_reduce equals unregistered" if ok
           else (errors[0][:120] if errors else "wrong result or hang"))
    return result(ok, fig, ranks=got, conf=os.environ.get("STREAMALLOC_CONF", "(default)"))


# ---- MemPool(no_split=True) ----

def check_no_split(alloc):
    import torch
    pool = torch.cuda.MemPool(no_split=True)
    with torch.cuda.use_mem_pool(pool):
        held = [torch.empty(n, dtype=torch.uint8, device="cuda") for n in (4096, 3 * MiB, 3 * MiB)]
    segments = [s for s in torch.cuda.memory._snapshot()["segments"]
                if tuple(s.get("segment_pool_id", (0, 0))) == tuple(pool.id)]
    blocks = [sum(1 for b in s["blocks"] if b["state"] == "active_allocated") for s in segments]
    ok = len(held) == len(segments) and all(count == 1 for count in blocks)
    del held
    return result(ok, f"{len(segments)} segments for 3 tensors, blocks per segment {blocks}",
                  segments=len(segments), blocks=blocks)


# ---- CUDA IPC of every kind of tensor ----

def check_ipc(alloc):
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "ipc"))
    import ipc_check
    if alloc != "sa_native":
        return {"status": "skipped", "figure": "streamalloc's door only", "detail": {}}
    rows, failed = ipc_check.main(None)
    passed = sum(1 for r in rows if r["status"] == "PASS")
    return result(not failed, f"{passed} of {len(rows)} sends pass", rows=rows)


# ---- table ----

def table(outdir):
    rows = {}
    for name in sorted(os.listdir(outdir)):
        if not name.endswith(".json"):
            continue
        with open(os.path.join(outdir, name)) as f:
            res = json.load(f)
        if not isinstance(res, dict) or "check" not in res:
            continue  # another script's result (stats_compare.json), tabled by that script
        rows.setdefault(res["check"], {})[res["alloc"]] = res
    # memory_stats keys: the same set, and the keys PyTorch fills that streamalloc leaves 0.
    st = rows.get("stats", {})
    if "native" in st and "sa_native" in st and "keys" in st["native"].get("detail", {}):
        mine, theirs = st["sa_native"]["detail"], st["native"]["detail"]
        same = mine["keys"] == theirs["keys"]
        unfilled = sorted(set(mine["zero"]) - set(theirs["zero"]))
        rows["stats_keys"] = {"sa_native": {
            "status": "PASS" if same else "FAIL",
            "figure": f"key set {'equal' if same else 'DIFFERS'}; 0 here, nonzero under PyTorch: "
                      f"{len(unfilled)}"}}
        print("keys PyTorch fills that streamalloc leaves 0:", ", ".join(unfilled) or "none")
    pr = rows.get("profile", {})
    if "native" in pr and "sa_native" in pr and "allocs" in pr["native"].get("detail", {}):
        a, b = pr["native"]["detail"]["allocs"], pr["sa_native"]["detail"]["allocs"]
        close = b > 0 and abs(a - b) <= max(2, a // 10)
        rows["profile_counts"] = {"sa_native": {"status": "PASS" if close else "FAIL",
                                                "figure": f"{b} allocation events vs PyTorch's {a}"}}
    cols = ("native", "sa_native")
    print(f"| check | {' | '.join(cols)} |")
    print("|---|" + "---|" * len(cols))
    for check, by in rows.items():
        cells = []
        for col in cols:
            r = by.get(col)
            if r is None:
                cells.append("-")
            elif "error" in r:
                cells.append(f"ERROR {r['error'][:80]}")
            else:
                cells.append(f"{r['status']} {r.get('figure', '')}")
        print(f"| {check} | {' | '.join(cells)} |")


CHECKS = {"profile": check_profile, "stats": check_stats, "use_on_oom": check_use_on_oom,
          "nccl": check_nccl, "ipc": check_ipc, "no_split": check_no_split}


def main():
    if sys.argv[1] == "table":
        table(sys.argv[2])
        return
    check, alloc, out, extra = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]
    res = {"check": check + "".join(extra), "alloc": alloc}
    try:
        if check not in ("nccl", "ipc"):
            install(alloc)
        res.update(CHECKS[check](alloc, *extra))
    except Exception as err:
        traceback.print_exc()
        res["error"] = f"{type(err).__name__}: {err}"
    with open(out, "w") as f:
        json.dump(res, f, default=str)
    print(json.dumps(res, default=str)[:1500])


if __name__ == "__main__":
    main()
