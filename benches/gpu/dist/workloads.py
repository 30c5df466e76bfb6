#!/usr/bin/env python3
"""The workloads of the GPU training benches, one rank each: what `bench.py` (three
allocators side by side) and `caps.py` (the same under memory caps) launch.

    torchrun --standalone --nproc-per-node N workloads.py --worker ROW COLUMN PREFIX
    python3 workloads.py --door RESULT.json        # builds streamalloc's native door

Rows (workloads):
  fsdp2_gpt2    FSDP2 (fully_shard per block and the root, bf16 parameters, fp32 gradient
                reduction) on GPT-2 small, AdamW, batch 8, sequence length drawn per step
                from 128..1024 (seeded, the same on every rank)
  fsdp2_ckpt    the same with activation checkpointing on every block of a Llama-style model
                (hidden 1024, 12 layers, 16 heads, vocabulary 32000), batch 4, 128..2048
  ddp_gpt2      DDP on GPT-2 small (fp32), batch 8 x 512
  tp_allreduce  a tensor-parallel MLP (x @ W1 shard, gelu, @ W2 shard, all_reduce of the
                output), bf16, hidden 4096, 8192 tokens
  gpt2_varlen   one GPU: GPT-2 small (fp32), AdamW, batch 8, length drawn per step from
                256..1024
  generate      one GPU: GPT-2 small (bf16) generating greedily with its KV cache, a batch
                of 8 prompts of 64..512 tokens (drawn per step) growing by 256 new tokens
Columns: pt (PyTorch's allocator), pt_expandable (PYTORCH_CUDA_ALLOC_CONF=
expandable_segments:True), sa (streamalloc, default configuration).

Models are built from configs with random weights (no network), the same seed on every
rank; each rank draws its own tokens from a seeded generator, the same in every column, so
losses (for `generate`: a checksum of the generated tokens) are comparable across columns.
Dropout is off for the same reason. Every rank writes PREFIX.rankR.json.

Environment: DIST_STEPS (timed steps; default per row), DIST_WARMUP (untimed steps first,
3); DIST_CAP_RATIO and DIST_LIVE_BYTES: cap the process's memory at RATIO x LIVE bytes
through `torch.cuda.set_per_process_memory_fraction` before the first allocation (PyTorch's
own limit, or streamalloc's through its door), so the run trains or runs out of memory;
with DIST_CAP_MODE=device, by holding the device's other memory instead (no limit set),
leaving RATIO x LIVE bytes plus DIST_OUTSIDE_BYTES (what the process uses outside its
allocator: context, kernels, communication buffers).
DIST_SNAPSHOT=PREFIX records the memory history of the timed steps and writes it as
PREFIX.rankR.pickle.gz (a trace for `streamalloc replay`); with DIST_SNAPSHOT_FROM=start,
of the whole process from before the model is built (its lasting allocations included:
the optimizer's state lands among the first step's freed activations, as on the device;
replayed as one step, not `--steps N`). DIST_PROFILE=DIR writes the last step's
torch.profiler trace (host and device) of every rank under DIR.
"""

import gzip
import json
import os
import random
import resource
import shutil
import statistics
import sys
import time
import traceback

# (column, header, allocator environment; None = unset)
COLUMNS = [
    ("pt", "PyTorch", {"PYTORCH_CUDA_ALLOC_CONF": None, "STREAMALLOC_CONF": None}),
    ("pt_expandable", "PyTorch expandable_segments:True",
     {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True", "STREAMALLOC_CONF": None}),
    ("sa", "streamalloc default", {"PYTORCH_CUDA_ALLOC_CONF": None, "STREAMALLOC_CONF": None}),
    # A configuration other than the default, named by DIST_SA_CONF (for comparisons).
    ("sa_conf", "streamalloc DIST_SA_CONF",
     {"PYTORCH_CUDA_ALLOC_CONF": None, "STREAMALLOC_CONF": os.environ.get("DIST_SA_CONF") or None}),
]
# NVLink multicast stays off in every launch: it is not available on every host.
COMMON_ENV = {
    "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1",
    "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
    "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "4",
}
# streamalloc's counters of its own work, compared before and after the timed steps.
SA_COUNTERS = ("page_map_bytes", "page_unmap_bytes", "device_syncs", "stitches", "stitch_revivals",
               "stitched_map_bytes", "stitch_evictions", "segment_allocs", "segment_frees", "retries", "ooms",
               "cross_stream_waits", "vmm_ns", "allocs", "events_recorded", "event_queries",
               "slow_paths", "slow_path_ns")
# Timed steps of each row unless DIST_STEPS says otherwise.
DEFAULT_STEPS = {"fsdp2_gpt2": 12, "fsdp2_ckpt": 12, "ddp_gpt2": 12, "tp_allreduce": 30,
                 "gpt2_varlen": 12, "generate": 6}
GPT2_VOCAB = 50257
LLAMA_VOCAB = 32000


def env_int(name, default):
    value = os.environ.get(name)
    if not value:
        return default
    try:
        return int(value)
    except ValueError:
        raise SystemExit(f"{name}={value!r} is not an integer")


def timed_steps(row):
    return env_int("DIST_STEPS", DEFAULT_STEPS[row])


def check_env(col):
    """Refuses a column whose environment does not say what the column claims."""
    pt = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
    want = "expandable_segments:True" if col == "pt_expandable" else ""
    if pt != want:
        raise RuntimeError(f"column {col} needs PYTORCH_CUDA_ALLOC_CONF={want!r}, found {pt!r}")
    sa = os.environ.get("STREAMALLOC_CONF")
    if col == "sa" and sa:
        raise RuntimeError(f"column sa measures streamalloc's default: unset STREAMALLOC_CONF (found {sa!r})")
    if col == "sa_conf" and not sa:
        raise RuntimeError("column sa_conf needs a configuration: set DIST_SA_CONF")
    return {"PYTORCH_CUDA_ALLOC_CONF": pt, "STREAMALLOC_CONF": sa}


class Meter:
    """Peaks of the warm-up and of the timed steps; streamalloc's counters across the timed steps."""

    def __init__(self, torch, col):
        self.torch, self.col = torch, col
        self.warm = self.counters0 = None

    def peaks(self):
        return {"reserved": self.torch.cuda.max_memory_reserved(),
                "allocated": self.torch.cuda.max_memory_allocated()}

    def counters(self):
        if not self.col.startswith("sa"):
            return None
        import streamalloc.torch as st
        stats = st.raw_stats()["stats"]
        return {k: stats.get(k) for k in SA_COUNTERS}

    def end_warmup(self):
        self.torch.cuda.synchronize()
        self.warm = self.peaks()
        self.counters0 = self.counters()
        self.torch.cuda.reset_peak_memory_stats()

    def finish(self):
        self.torch.cuda.synchronize()
        timed = self.peaks()
        warm = self.warm or timed
        whole = {k: max(warm[k], timed[k]) for k in timed}
        r = {"peaks_bytes": {"warmup": warm, "timed": timed, "whole": whole},
             "ratio_whole": whole["reserved"] / whole["allocated"] if whole["allocated"] else None,
             "ratio_timed": timed["reserved"] / timed["allocated"] if timed["allocated"] else None}
        # Device memory this process uses beyond its allocator's (the context, loaded kernels,
        # communication buffers; memory held by DIST_CAP_MODE=device included): what a
        # device-level cap must leave besides the allocator's share.
        free, total = self.torch.cuda.mem_get_info()
        r["outside_allocator_bytes"] = total - free - self.torch.cuda.memory_reserved()
        end = self.counters()
        if end is not None:
            # None where this build has no such counter.
            r["sa_timed"] = {k: (end[k] - self.counters0[k]
                                 if isinstance(end[k], int) and isinstance(self.counters0[k], int) else None)
                             for k in SA_COUNTERS}
            r["sa_end"] = end
        return r


def run_steps(torch, col, step, warmup, steps):
    """step(i) runs step i and returns its loss tensor; steps >= warmup are timed."""
    meter = Meter(torch, col)
    times, losses = [], []
    # streamalloc's work in each step (its counters' change), to set beside each step's time.
    per_step, before = [], meter.counters()
    # The process's CPU time and voluntary context switches in each step (every thread),
    # and the time the host took to issue the step (until the step's loss was queued,
    # before the synchronisation). CUDA's synchronisation spins, so CPU time counts the wait
    # for the device too: a step whose issue time is its whole time was bound by the host,
    # one that issued early and then waited was bound by the device.
    host = []
    snapshot = os.environ.get("DIST_SNAPSHOT")
    for i in range(warmup + steps):
        if i == warmup:
            meter.end_warmup()
            if snapshot and not recording_from_start():
                # From the first timed step: the warm-up's lasting allocations (optimizer
                # state) are made, so each recorded step frees what it allocates.
                torch.cuda.memory._record_memory_history(max_entries=2_000_000, context=None)
        torch.cuda.synchronize()
        profiler = profiler_for(torch, col, i, warmup + steps)
        u0 = resource.getrusage(resource.RUSAGE_SELF)
        t0 = time.perf_counter()
        loss = step(i)
        issued = time.perf_counter() - t0
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        if profiler is not None:
            profiler.__exit__(None, None, None)
            profiler.export_chrome_trace(profiler.trace_path)
        u1 = resource.getrusage(resource.RUSAGE_SELF)
        host.append({"cpu_ms": round((u1.ru_utime + u1.ru_stime - u0.ru_utime - u0.ru_stime) * 1e3, 1),
                     "switches": u1.ru_nvcsw - u0.ru_nvcsw, "issue_ms": round(issued * 1e3, 1)})
        losses.append(float(loss.item()))
        del loss
        if before is not None:
            after = meter.counters()
            per_step.append({k: after[k] - before[k] for k in after
                             if isinstance(after[k], int) and isinstance(before[k], int) and after[k] != before[k]})
            before = after
    if snapshot:
        dump_snapshot(torch, snapshot)
    timed = times[warmup:]
    r = {"warmup": warmup, "steps": steps, "losses": losses, "step_ms": [round(t * 1e3, 3) for t in times],
         "step_ms_median": statistics.median(timed) * 1e3, "step_host": host}
    if per_step:
        r["sa_steps"] = per_step
    r.update(meter.finish())
    return r


def profiler_for(torch, col, i, total):
    """With DIST_PROFILE=DIR, a started torch.profiler (host and device) for the last step
    on every rank, its Chrome trace to be written to DIR/COLUMN.rankR.N.json (N: the first
    number not yet written); else None."""
    folder = os.environ.get("DIST_PROFILE")
    if not folder or i != total - 1:
        return None
    from torch.profiler import ProfilerActivity, profile

    os.makedirs(folder, exist_ok=True)
    profiler = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
    rank, n = os.environ.get("RANK", "0"), 0
    while os.path.exists(os.path.join(folder, f"{col}.rank{rank}.{n}.json")):
        n += 1
    profiler.trace_path = os.path.join(folder, f"{col}.rank{rank}.{n}.json")
    profiler.__enter__()
    return profiler


def recording_from_start():
    return bool(os.environ.get("DIST_SNAPSHOT")) and os.environ.get("DIST_SNAPSHOT_FROM") == "start"


def dump_snapshot(torch, prefix):
    """Writes the memory history of the timed steps as PREFIX.rankR.pickle.gz, a trace that
    `streamalloc replay` reads, and stops recording."""
    rank = int(os.environ.get("RANK", "0"))
    raw = f"{prefix}.rank{rank}.pickle"
    torch.cuda.memory._dump_snapshot(raw)
    torch.cuda.memory._record_memory_history(enabled=None)
    with open(raw, "rb") as src, gzip.open(raw + ".gz", "wb") as dst:
        shutil.copyfileobj(src, dst)
    os.remove(raw)


def lengths_of(count, low, high, seed):
    """Sequence length per step: the same on every rank and in every column."""
    rng = random.Random(seed)
    return [rng.randint(low, high) for _ in range(count)]


def token_batches(torch, rank, vocab, batch, lengths):
    """Step i's tokens: drawn on the host from this rank's own seeded generator."""
    gen = torch.Generator().manual_seed(1000 + rank)

    def batch_of(i):
        return torch.randint(0, vocab, (batch, lengths[i]), generator=gen).cuda()

    return batch_of


def lm_training(torch, col, model, batch_of, warmup, steps):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step(i):
        ids = batch_of(i)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return run_steps(torch, col, step, warmup, steps)


def gpt2_model(torch):
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    cfg = GPT2Config(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False)
    return GPT2LMHeadModel(cfg)


def llama_model(torch):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=1024, intermediate_size=2816, num_hidden_layers=12, num_attention_heads=16,
                      num_key_value_heads=16, vocab_size=LLAMA_VOCAB, max_position_embeddings=2048,
                      use_cache=False)
    return LlamaForCausalLM(cfg)


def fsdp2(torch, model, blocks):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in blocks:
        fully_shard(block, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    devices = {p.device.type for p in model.parameters()}
    if devices != {"cuda"}:
        raise RuntimeError(f"fully_shard left parameters on {sorted(devices)}")
    return model


def work_fsdp2_gpt2(torch, dist, col, rank, warmup, steps):
    model = gpt2_model(torch)
    fsdp2(torch, model, list(model.transformer.h))
    lengths = lengths_of(warmup + steps, 128, 1024, seed=1)
    r = lm_training(torch, col, model, token_batches(torch, rank, GPT2_VOCAB, 8, lengths), warmup, steps)
    r["lengths"] = lengths
    return r


def work_fsdp2_ckpt(torch, dist, col, rank, warmup, steps):
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper
    model = llama_model(torch)
    layers = model.model.layers
    for i in range(len(layers)):
        # Wrapped before sharding, so FSDP's hooks sit outside the recomputed region.
        layers[i] = checkpoint_wrapper(layers[i], checkpoint_impl=CheckpointImpl.NO_REENTRANT)
    fsdp2(torch, model, list(layers))
    lengths = lengths_of(warmup + steps, 128, 2048, seed=2)
    r = lm_training(torch, col, model, token_batches(torch, rank, LLAMA_VOCAB, 4, lengths), warmup, steps)
    r["lengths"] = lengths
    return r


def work_ddp_gpt2(torch, dist, col, rank, warmup, steps):
    from torch.nn.parallel import DistributedDataParallel
    model = gpt2_model(torch).cuda()
    model = DistributedDataParallel(model, device_ids=[torch.cuda.current_device()])
    batch_of = token_batches(torch, rank, GPT2_VOCAB, 8, [512] * (warmup + steps))
    return lm_training(torch, col, model, batch_of, warmup, steps)


def work_tp_allreduce(torch, dist, col, rank, warmup, steps):
    hidden, tokens, world = 4096, 8192, dist.get_world_size()
    ffn = 4 * hidden
    if ffn % world:
        raise ValueError(f"{ffn} columns do not split over {world} ranks")
    shard = ffn // world
    bf16, dev = torch.bfloat16, torch.device("cuda", torch.cuda.current_device())
    weights = torch.Generator(device=dev).manual_seed(100 + rank)  # each rank its own shard
    w1 = torch.randn(hidden, shard, device=dev, dtype=bf16, generator=weights) * hidden ** -0.5
    w2 = torch.randn(shard, hidden, device=dev, dtype=bf16, generator=weights) * ffn ** -0.5
    inputs = torch.Generator(device=dev).manual_seed(7)  # tokens replicated on every rank

    def step(i):
        x = torch.randn(tokens, hidden, device=dev, dtype=bf16, generator=inputs)
        y = torch.nn.functional.gelu(x @ w1) @ w2
        dist.all_reduce(y)
        return y.float().pow(2).mean()  # the step's "loss": a checksum of the reduced output

    return run_steps(torch, col, step, warmup, steps)


def work_gpt2_varlen(torch, dist, col, rank, warmup, steps):
    model = gpt2_model(torch).cuda()
    lengths = lengths_of(warmup + steps, 256, 1024, seed=3)
    r = lm_training(torch, col, model, token_batches(torch, rank, GPT2_VOCAB, 8, lengths), warmup, steps)
    r["lengths"] = lengths
    return r


def work_generate(torch, dist, col, rank, warmup, steps):
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    cfg = GPT2Config(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=True, n_positions=1024)
    model = GPT2LMHeadModel(cfg).to("cuda", torch.bfloat16).eval()
    lengths = lengths_of(warmup + steps, 64, 512, seed=4)
    batch_of = token_batches(torch, rank, GPT2_VOCAB, 8, lengths)

    def step(i):
        ids = batch_of(i)
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=256,
                                 min_new_tokens=256, do_sample=False, pad_token_id=0)
        # The step's "loss": a checksum of the generated tokens, equal under every allocator.
        return (out[:, ids.shape[1]:].double() * torch.arange(1, out.shape[1] - ids.shape[1] + 1,
                device=out.device, dtype=torch.float64)).sum() % 1_000_003

    r = run_steps(torch, col, step, warmup, steps)
    r["lengths"] = lengths
    return r


WORKS = {"fsdp2_gpt2": work_fsdp2_gpt2, "fsdp2_ckpt": work_fsdp2_ckpt, "ddp_gpt2": work_ddp_gpt2,
         "tp_allreduce": work_tp_allreduce, "gpt2_varlen": work_gpt2_varlen, "generate": work_generate}


def cap_memory(torch, device, res):
    """DIST_CAP_RATIO x DIST_LIVE_BYTES as the process's memory fraction, before any
    allocation: PyTorch's allocator enforces it itself, streamalloc through its door.
    With DIST_CAP_MODE=device, no limit is set: device memory is held outside any allocator
    (one driver allocation) so that RATIO x LIVE bytes are left free on the device, as when
    another process holds the rest; the allocator learns of the shortage only from the
    driver's refusals."""
    ratio, live = os.environ.get("DIST_CAP_RATIO"), os.environ.get("DIST_LIVE_BYTES")
    if not ratio:
        return
    ratio, live = float(ratio), int(live or 0)
    mode = os.environ.get("DIST_CAP_MODE") or "fraction"
    lowest = 0.5 if mode == "device" else 1.0  # a device cap adds what runs outside the allocator
    if not lowest <= ratio <= 10.0 or live <= 0:
        raise ValueError(f"DIST_CAP_RATIO={ratio} ({lowest}..10) needs DIST_LIVE_BYTES > 0, not {live}")
    if mode == "device":
        # What the process uses outside its allocator (measured by caps.py in the same
        # allocator's uncapped launches) is left on top of the allocator's share.
        outside = int(os.environ.get("DIST_OUTSIDE_BYTES") or 0)
        res["cap"] = hold_device_memory(torch, device, int(ratio * live) + outside)
        res["cap"].update(mode="device", ratio=ratio, live_bytes=live, outside_bytes=outside)
        return
    if mode != "fraction":
        raise ValueError(f"DIST_CAP_MODE={mode!r}: fraction or device")
    total = torch.cuda.get_device_properties(device).total_memory
    fraction = ratio * live / total
    torch.cuda.set_per_process_memory_fraction(fraction, device)
    res["cap"] = {"ratio": ratio, "live_bytes": live, "fraction": fraction, "limit_bytes": int(fraction * total)}
    watch_out_of_memory(torch, res)


def watch_out_of_memory(torch, res):
    """Notes in res["oom_seen"], at every out-of-memory the allocator reports (PyTorch's
    observer, called before the error unwinds the program's frames), the bytes asked for,
    the bytes live then and the limit: whether the program alone needed more than the cap
    (live + request > limit), which no allocator could serve, or the allocator failed
    within it. Some refusals are caught by PyTorch itself (a convolution retries with less
    workspace), so only the last one before a failed launch says why it failed."""

    def observed(device, request, limit, device_free):
        seen = res.get("oom_seen") or {"count": 0}
        res["oom_seen"] = {"request": int(request), "allocated": int(torch.cuda.memory_allocated(device)),
                           "limit": int(limit), "count": seen["count"] + 1}

    torch._C._cuda_attach_out_of_memory_observer(observed)


_HELD = []  # the driver allocation of DIST_CAP_MODE=device, kept until the process ends


def hold_device_memory(torch, device, leave):
    """Allocates, with the driver and outside every allocator, all of `device`'s free memory
    but `leave` bytes; returns what it held and what it left."""
    import ctypes

    free, total = torch.cuda.mem_get_info(device)  # makes the primary context current
    held = max(0, free - leave)
    if held:
        cuda = ctypes.CDLL("libcuda.so.1")
        ptr = ctypes.c_uint64(0)
        rc = cuda.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(held))
        if rc != 0:
            raise RuntimeError(f"cuMemAlloc of {held} bytes to hold the device failed: CUresult {rc}")
        _HELD.append(ptr.value)
    return {"held_bytes": held, "free_before": free, "free_after": torch.cuda.mem_get_info(device)[0]}


def out_of_memory(error):
    """True if a worker's recorded error is the allocator running out of memory."""
    text = (error or "").lower()
    return "outofmemoryerror" in text or "out of memory" in text


def write_json(path, obj):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, default=str)
    os.replace(tmp, path)


def worker(row, col, prefix):
    rank = int(os.environ.get("RANK", "0"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    res = {"row": row, "column": col, "rank": rank, "world": int(os.environ.get("WORLD_SIZE", "1"))}
    out = f"{prefix}.rank{rank}.json"
    t0 = time.perf_counter()
    dist = None
    try:
        if row not in WORKS or col not in [c for c, _, _ in COLUMNS]:
            raise ValueError(f"usage: bench.py --worker {'|'.join(WORKS)} {'|'.join(c for c, _, _ in COLUMNS)} PREFIX")
        res["env"] = check_env(col)
        import torch
        res["torch"] = torch.__version__
        if col.startswith("sa"):
            import streamalloc.torch as st
            t = time.perf_counter()
            st.install()  # before the first CUDA tensor: the door a user gets by default
            res["door"], res["install_s"] = st.door(), round(time.perf_counter() - t, 2)
        torch.cuda.set_device(local)
        cap_memory(torch, local, res)
        if recording_from_start():
            torch.cuda.memory._record_memory_history(max_entries=2_000_000, context=None)
        import torch.distributed as dist
        dist.init_process_group("nccl", device_id=torch.device("cuda", local))
        res["device"] = torch.cuda.get_device_name(local)
        warmup, steps = env_int("DIST_WARMUP", 3), timed_steps(row)
        if warmup < 0 or steps < 1:
            raise ValueError(f"DIST_WARMUP={warmup} must be >= 0 and DIST_STEPS={steps} >= 1")
        res.update(WORKS[row](torch, dist, col, rank, warmup, steps))
        sa_end = res.get("sa_end") or {}
        # Expandable segments map pages and allocate no segment: either shows memory came
        # from streamalloc.
        if col.startswith("sa") and sa_end.get("segment_allocs", 1) == 0 and sa_end.get("page_map_bytes", 1) == 0:
            raise RuntimeError("streamalloc obtained no memory: it did not serve this run")
    except BaseException as e:  # recorded for the table; the traceback goes to the log
        traceback.print_exc()
        res["error"] = f"{type(e).__name__}: {e}".strip()[:400]
        res["failed_at"] = time.time()  # the first rank to fail names the cause; the others follow it
        res["seconds"] = round(time.perf_counter() - t0, 1)
        write_json(out, res)
        sys.stdout.flush()
        sys.stderr.flush()
        # The other ranks may wait in a collective for this one: torchrun ends them once
        # this process is gone.
        os._exit(1)
    res["seconds"] = round(time.perf_counter() - t0, 1)
    write_json(out, res)
    if rank == 0:
        brief = {k: v for k, v in res.items() if k not in ("losses", "step_ms", "lengths", "sa_end")}
        print(json.dumps(brief, default=str), flush=True)
    dist.barrier()
    dist.destroy_process_group()


def door(result):
    """Installs streamalloc and allocates once on one GPU: the native door is built (and
    cached under STREAMALLOC_CACHE) here, before any timed launch needs it."""
    res = {}
    t0 = time.perf_counter()
    try:
        import streamalloc.torch as st
        import torch
        st.install()
        x = torch.ones(1 << 20, device="cuda")
        if float(x.sum().item()) != float(1 << 20):
            raise RuntimeError("a tensor of ones does not sum to its size")
        res["door"] = st.door()
    except Exception as e:
        traceback.print_exc()
        res["error"] = f"{type(e).__name__}: {e}".strip()[:400]
    res["seconds"] = round(time.perf_counter() - t0, 1)
    write_json(result, res)
    print(json.dumps(res), flush=True)
    return 0 if "error" not in res else 1


def main():
    if len(sys.argv) == 5 and sys.argv[1] == "--worker":
        worker(*sys.argv[2:5])
        return 0
    if len(sys.argv) == 3 and sys.argv[1] == "--door":
        return door(sys.argv[2])
    raise SystemExit("usage: workloads.py --worker ROW COLUMN PREFIX | --door RESULT.json")


if __name__ == "__main__":
    sys.exit(main())
