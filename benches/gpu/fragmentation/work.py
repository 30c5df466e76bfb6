# One workload on one allocator, in this process: step times (or tokens/s), losses (or
# generated tokens) and peak reserved / peak allocated, written as JSON.
#   python3 work.py WORK ALLOC OUT.json
# WORK:  door (install and allocate once: builds the native door before anything is timed) |
#        gpt2 (GPT-2 small training, 8 x 1024, as alloc_bench.py) | gpt2_varlen (same, sequence
#        length drawn from 256..1024 each step) | resnet (ResNet-50 training, batch 64, as
#        alloc_bench.py) | infer (GPT-2 small in bf16, transformers' generate with its KV cache,
#        a seeded stream of requests of varying batch, prompt and output lengths)
# ALLOC: native | pt_expandable | sa_default | sa_whole | sa_noreclaim. The environment
#        selects the configuration (driver.py sets it): pt_expandable needs
#        PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, sa_whole needs
#        STREAMALLOC_CONF=expandable_segments:false, sa_noreclaim STREAMALLOC_CONF=reclaim:false,
#        sa_default needs STREAMALLOC_CONF unset.
# Knobs: STEPS_GPT2 (20), STEPS_VARLEN (40), STEPS_RESNET (30), WARMUP (2 steps or requests,
#        untimed), REQUESTS (24 timed requests after the warm-up ones).
# Peaks: torch.cuda.max_memory_reserved / max_memory_allocated (answered by streamalloc for
# its columns) are read at the end of the warm-up, then reset, then read at the end: "whole"
# is the larger of the two readings (the whole run), "timed" the second alone.
# alloc_bench.py resets its peaks after step 2 and runs its work when imported, so its two
# training workloads are repeated here (same models, seeds and batches) to get both peaks.
import hashlib
import json
import os
import random
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
ALLOCS = ("native", "pt_expandable", "sa_default", "sa_whole", "sa_noreclaim")
# Counters of the allocator's own work (maps, unmaps, syncs), compared across the timed part.
CHURN = ("page_map_bytes", "page_unmap_bytes", "device_syncs", "segment_allocs", "segment_frees",
         "retries", "ooms", "allocs")
GPT2_VOCAB = 50257


def env_or(name, default):
    return int(os.environ.get(name) or default)


def check_env(alloc):
    """Refuses a column whose environment does not say what the column claims."""
    pt = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
    sa = os.environ.get("STREAMALLOC_CONF")
    want_pt = "expandable_segments:True" if alloc == "pt_expandable" else ""
    if pt != want_pt:
        raise RuntimeError(f"{alloc} needs PYTORCH_CUDA_ALLOC_CONF={want_pt!r}, found {pt!r}")
    want_sa = {"sa_whole": "expandable_segments:false", "sa_noreclaim": "reclaim:false"}.get(alloc)
    if alloc.startswith("sa_") and sa != want_sa:
        raise RuntimeError(f"{alloc} needs STREAMALLOC_CONF={want_sa!r}, found {sa!r}")
    return {"PYTORCH_CUDA_ALLOC_CONF": pt, "STREAMALLOC_CONF": sa}


def sa_stats():
    import streamalloc.torch as st
    return st.raw_stats()["stats"]


def churn(alloc):
    if not alloc.startswith("sa_"):
        return None
    s = sa_stats()
    return {k: s.get(k) for k in CHURN}


def churn_delta(a, b):
    if a is None or b is None:
        return None
    return {k: b[k] - a[k] for k in a if isinstance(a[k], int) and isinstance(b.get(k), int)}


def read_peaks(torch):
    return {"reserved": torch.cuda.max_memory_reserved(), "allocated": torch.cuda.max_memory_allocated()}


class Meter:
    """Peaks of the warm-up and of the timed part, and the allocator's work in the timed part."""

    def __init__(self, torch, alloc):
        self.torch, self.alloc = torch, alloc
        self.warm = self.churn0 = None

    def end_warmup(self):
        self.torch.cuda.synchronize()
        self.warm = read_peaks(self.torch)
        self.churn0 = churn(self.alloc)
        self.torch.cuda.reset_peak_memory_stats()

    def finish(self):
        self.torch.cuda.synchronize()
        timed = read_peaks(self.torch)
        warm = self.warm or timed
        whole = {k: max(warm[k], timed[k]) for k in timed}
        r = {
            "peaks_mib": {name: {k: v / 2**20 for k, v in p.items()}
                          for name, p in (("warmup", warm), ("timed", timed), ("whole", whole))},
            "ratio_whole": whole["reserved"] / whole["allocated"],
            "ratio_timed": timed["reserved"] / timed["allocated"],
        }
        if self.alloc.startswith("sa_"):
            end = sa_stats()
            r["streamalloc"] = {
                "churn_timed": churn_delta(self.churn0, {k: end.get(k) for k in CHURN}),
                "stats_end": end,
                # whether this configuration really mapped memory (expandable segments)
                "expandable_seen": (end.get("page_map_bytes") or 0) > 0,
            }
        return r


def train(torch, alloc, model, batch_of, steps, warmup):
    """AdamW steps; batch_of(i) -> (inputs, loss function). Step i >= warmup is timed."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    meter = Meter(torch, alloc)
    times, losses = [], []
    for i in range(steps):
        if i == warmup:
            meter.end_warmup()
        batch, loss_fn = batch_of(i)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = loss_fn(model, batch)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        losses.append(float(loss.item()))
        del loss, batch
    timed = times[warmup:]
    r = {"steps": steps, "warmup": warmup, "losses": losses, "steps_ms": [round(t * 1e3, 2) for t in times],
         "timed_s": sum(timed), "step_ms_median": sorted(timed)[len(timed) // 2] * 1e3}
    r.update(meter.finish())
    return r


def gpt2_model(torch):
    import transformers
    from transformers import GPT2Config, GPT2LMHeadModel
    print("transformers", transformers.__version__, flush=True)
    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=12, n_embd=768, n_head=12, n_positions=1024)
    return GPT2LMHeadModel(cfg)


def lm_loss(model, ids):
    return model(input_ids=ids, labels=ids).loss


def work_gpt2(torch, alloc, warmup):
    model = gpt2_model(torch).cuda()
    ids = torch.randint(0, GPT2_VOCAB, (8, 1024), device="cuda")  # as alloc_bench.py
    return train(torch, alloc, model, lambda i: (ids, lm_loss), env_or("STEPS_GPT2", 20), warmup)


def varlen_lengths(steps, seed=1):
    return [random.Random(seed * 1000 + i).randint(256, 1024) for i in range(steps)]


def work_gpt2_varlen(torch, alloc, warmup):
    steps = env_or("STEPS_VARLEN", 40)
    lengths = varlen_lengths(steps)
    model = gpt2_model(torch).cuda()
    gen = torch.Generator().manual_seed(1)  # on the host: the same tokens whatever the device does

    def batch_of(i):
        return torch.randint(0, GPT2_VOCAB, (8, lengths[i]), generator=gen).cuda(), lm_loss

    r = train(torch, alloc, model, batch_of, steps, warmup)
    r["lengths"] = lengths
    return r


def work_resnet(torch, alloc, warmup):
    import torchvision
    torch.manual_seed(0)
    model = torchvision.models.resnet50().cuda()
    x = torch.randn(64, 3, 224, 224, device="cuda")
    y = torch.randint(0, 1000, (64,), device="cuda")

    def loss_fn(m, batch):
        return torch.nn.functional.cross_entropy(m(batch[0]), batch[1])

    return train(torch, alloc, model, lambda i: ((x, y), loss_fn), env_or("STEPS_RESNET", 30), warmup)


def request_stream(count, seed=2):
    """(batch, prompt length, new tokens) for each request, the same for every allocator."""
    rng = random.Random(seed)
    return [(rng.randint(1, 16), rng.randint(16, 512), rng.randint(32, 128)) for _ in range(count)]


def work_infer(torch, alloc, warmup):
    model = gpt2_model(torch).to(device="cuda", dtype=torch.bfloat16).eval()
    eos = model.config.eos_token_id
    requests = request_stream(warmup + env_or("REQUESTS", 24))
    gen = torch.Generator().manual_seed(3)
    meter = Meter(torch, alloc)
    times, hashes = [], []
    for i, (batch, prompt, new) in enumerate(requests):
        if i == warmup:
            meter.end_warmup()
        ids = torch.randint(0, GPT2_VOCAB, (batch, prompt), generator=gen).cuda()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.inference_mode():
            # Greedy, exactly `new` tokens (EOS held back until then); the default cache
            # grows each layer's keys and values by one token per step.
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                                 min_new_tokens=new, do_sample=False, use_cache=True,
                                 pad_token_id=eos)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        if tuple(out.shape) != (batch, prompt + new):
            raise RuntimeError(f"request {i}: generate returned {tuple(out.shape)}, "
                               f"expected {(batch, prompt + new)}")
        hashes.append(hashlib.sha1(str(out[:, prompt:].tolist()).encode()).hexdigest()[:16])
        del out, ids
    timed = times[warmup:]
    new_tokens = sum(b * n for b, _, n in requests[warmup:])
    r = {"requests": requests, "warmup": warmup, "request_ms": [round(t * 1e3, 2) for t in times],
         "timed_s": sum(timed), "new_tokens_timed": new_tokens, "tokens_per_s": new_tokens / sum(timed),
         "token_hashes": hashes}
    r.update(meter.finish())
    return r


def work_door(torch, alloc, warmup):
    t0 = time.perf_counter()
    x = torch.ones(1 << 20, device="cuda")
    ok = float(x.sum().item()) == float(1 << 20)
    return {"ok": ok, "first_alloc_s": time.perf_counter() - t0}


WORKS = {"door": work_door, "gpt2": work_gpt2, "gpt2_varlen": work_gpt2_varlen, "resnet": work_resnet,
         "infer": work_infer}


def main():
    work, alloc, out = sys.argv[1], sys.argv[2], sys.argv[3]
    res = {"work": work, "alloc": alloc}
    t0 = time.perf_counter()
    try:
        if work not in WORKS or alloc not in ALLOCS:
            raise ValueError(f"usage: work.py {'|'.join(WORKS)} {'|'.join(ALLOCS)} OUT.json")
        res["env"] = check_env(alloc)
        import torch
        res["torch"] = torch.__version__
        if alloc.startswith("sa_"):
            import streamalloc.torch as st
            t_install = time.perf_counter()
            st.install()  # the door a user gets by default (native, else pluggable with a warning)
            res["door"] = st.door()
            res["install_s"] = time.perf_counter() - t_install
        res["device"] = torch.cuda.get_device_name(0)
        res.update(WORKS[work](torch, alloc, env_or("WARMUP", 2)))
        if alloc.startswith("sa_") and sa_stats().get("allocs", 1) == 0:
            raise RuntimeError("streamalloc served no allocation")
    except Exception as e:  # recorded for the table; the traceback goes to the log
        traceback.print_exc()
        res["error"] = f"{type(e).__name__}: {e}"
    res["seconds"] = round(time.perf_counter() - t0, 1)
    with open(out, "w") as f:
        json.dump(res, f, default=str)
    brief = {k: v for k, v in res.items() if k not in ("losses", "steps_ms", "request_ms", "token_hashes",
                                                         "requests", "lengths", "streamalloc")}
    print(json.dumps(brief, default=str))


if __name__ == "__main__":
    main()
