# What a PyTorch user gets from each allocator on the same work: a common allocator
# benchmark's workloads with streamalloc added through streamalloc.torch.install(), fixed
# seeds and the training losses, so allocators can be compared loss for loss.
#   python alloc_bench.py ALLOC WORK OUT.json
# ALLOC: native | async | streamalloc | so:PATH:MALLOC:FREE (a bare pluggable .so, e.g. the hook floor)
# WORK:  micro (random alloc/free mix, host ns per op) | gpt2 | resnet (step ms, peak memory, losses)
import json, os, sys, time, random
from micro_loop import micro_pass, micro_sizes

ALLOC, WORK, OUT = sys.argv[1], sys.argv[2], sys.argv[3]
if ALLOC == "async":
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "backend:cudaMallocAsync"
import torch
if ALLOC == "streamalloc":
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "python"))
    import streamalloc.torch
    streamalloc.torch.install()  # also routes torch.cuda's memory stats to ours
elif ALLOC.startswith("so:"):
    _, path, mfn, ffn = ALLOC.split(":")
    torch.cuda.memory.change_current_allocator(torch.cuda.memory.CUDAPluggableAllocator(path, mfn, ffn))

def micro():
    rng = random.Random(7)
    sizes = micro_sizes(rng)  # then rng picks which tensor each free takes
    passes = []
    for rep in range(6):  # the first pass warms the cache; the best of the other five counts
        ns_per_op, ops = micro_pass(torch, sizes, rng)
        passes.append(ns_per_op)
    return dict(ns_per_op=min(passes[1:]), passes_ns_per_op=[round(p, 1) for p in passes], ops=ops)

# CAPTURE=PATH (native allocator only): also write steps 2.. as a PyTorch memory snapshot
# (.pickle.gz) for `streamalloc replay --steps N`; recording slows those steps.
CAPTURE = os.environ.get("CAPTURE")
CHURN = ("page_map_bytes", "page_unmap_bytes", "device_syncs", "segment_allocs", "cross_stream_waits", "retries")

def train(model, batch_fn, steps=int(os.environ.get("STEPS", 6))):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    times, losses, steps_churn = [], [], []
    for i in range(steps):
        if i == 2:
            torch.cuda.synchronize(); torch.cuda.reset_peak_memory_stats()
            if ALLOC == "streamalloc":  # the allocator's own work in the timed steps
                churn0 = {k: streamalloc.torch.raw_stats()["stats"][k] for k in CHURN}
            if CAPTURE:  # record steps 2.. as a PyTorch memory snapshot for `streamalloc replay`
                torch.cuda.memory._record_memory_history(max_entries=1_000_000, context=None)
        t0 = time.perf_counter()
        loss = batch_fn(model)
        loss.backward(); opt.step(); opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
        if ALLOC == "streamalloc":  # per-step syncs and mapped MiB, to see where time went
            st = streamalloc.torch.raw_stats()["stats"]
            steps_churn.append((st["device_syncs"], st["page_map_bytes"] >> 20))
    if CAPTURE:
        import gzip, pickle
        with gzip.open(CAPTURE, "wb") as f:
            pickle.dump(torch.cuda.memory._snapshot(), f)
        torch.cuda.memory._record_memory_history(enabled=None)
    r = dict(step_ms=sorted(times[2:])[len(times[2:]) // 2] * 1e3, losses=losses,
             steps_ms=[round(t * 1e3, 1) for t in times])
    if steps_churn:
        r["steps_syncs_mapped_mib"] = steps_churn
    if ALLOC == "streamalloc" and os.environ.get("SNAPSHOT"):  # our trace, for `streamalloc replay`
        streamalloc.torch.dump_snapshot(os.environ["SNAPSHOT"])
    if ALLOC == "streamalloc" and steps > 2:
        s = streamalloc.torch.raw_stats()["stats"]
        r["per_timed_step"] = {k: (s[k] - churn0[k]) / (steps - 2) for k in CHURN}
    r["peak_allocated_mib"] = torch.cuda.max_memory_allocated() / 2**20
    r["peak_reserved_mib"] = torch.cuda.max_memory_reserved() / 2**20
    return r

def gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=12, n_embd=768, n_head=12, n_positions=1024)
    m = GPT2LMHeadModel(cfg).cuda()
    ids = torch.randint(0, cfg.vocab_size, (8, 1024), device="cuda")
    return train(m, lambda m: m(input_ids=ids, labels=ids).loss)

def resnet():
    import torchvision
    torch.manual_seed(0)
    m = torchvision.models.resnet50().cuda()
    x = torch.randn(64, 3, 224, 224, device="cuda"); y = torch.randint(0, 1000, (64,), device="cuda")
    return train(m, lambda m: torch.nn.functional.cross_entropy(m(x), y))

res = dict(alloc=ALLOC if not ALLOC.startswith("so:") else os.path.basename(ALLOC.split(":")[1]),
           work=WORK, torch=torch.__version__)
try:
    res.update({"micro": micro, "gpt2": gpt2, "resnet": resnet}[WORK]())
    if ALLOC == "streamalloc":
        s = streamalloc.torch.raw_stats()["stats"]
        res["streamalloc"] = {k: s[k] for k in ("cross_stream_waits", "events_recorded", "event_queries",
                                                "segment_allocs", "ooms", "retries", "invalid_frees")}
except Exception as e:  # record the failure, do not hide it
    res["error"] = repr(e)[:500]
with open(OUT, "w") as f:
    json.dump(res, f)
print(json.dumps(res))
