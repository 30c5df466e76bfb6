"""A colocated reinforcement-learning loop on 2 to 4 GPUs, as one command:

    python3 benches/gpu/sleep/rl_loop.py [--gpus 4] [--iters 20] [--kv-gib 4]

(python3 with torch and streamalloc installed, or PYTHONPATH=python with STREAMALLOC_LIB
set; about a minute.) Each process (one GPU) holds a trainer (a small transformer policy,
AdamW, data parallel over NCCL) and a generator: a copy of the policy in region
"weights" and its KV cache in region "kv_cache", decode steps replayed from one CUDA graph
captured before the first iteration. Every iteration:

1. generate (the graph, replayed once per token);
2. ``sleep(["weights", "kv_cache"])``: the generator's memory goes back to the driver;
3. a trainer step (policy gradient on the generations), gradients averaged over the ranks;
4. ``wake(["weights", "kv_cache"])``: the same addresses, fresh memory;
5. weight sync: every rank's trainer sends its parameters to the next rank's generator
   with one ``streamalloc.p2p.Exchange`` agreed before the loop and run every iteration,
   into the addresses the graph captured.

The same loop runs first without sleeping (steps 2 and 4 skipped). The losses and the
generations of every iteration must be bit-identical, the generator's memory given back
at every sleep, and the device's memory steady over the iterations. The table is printed
last; the exit status is 1 if a check failed.

``--cpu`` runs the same loop's logic on CPU processes over gloo, with eager decode steps
and no sleeping (a dry run of everything but the GPU).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import math
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

GIB = 1 << 30


# ---- the policy -----------------------------------------------------------------------------


class Block(torch.nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = torch.nn.LayerNorm(d), torch.nn.LayerNorm(d)
        self.qkv, self.proj = torch.nn.Linear(d, 3 * d), torch.nn.Linear(d, d)
        self.fc1, self.fc2 = torch.nn.Linear(d, 4 * d), torch.nn.Linear(4 * d, d)

    def forward(self, x):  # [B, T, d], causal; plain matmuls, so that the backward is deterministic
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        scores = q @ k.transpose(-1, -2) / math.sqrt(d // self.heads)
        causal = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
        att = scores.masked_fill(causal, float("-inf")).softmax(-1) @ v
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))

    def decode(self, x, pos, positions, k_cache, v_cache):  # x [B, d]; caches [B, H, T, dh]
        b, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, 3, self.heads, d // self.heads).unbind(1)
        k_cache.index_copy_(2, pos.view(1), k.unsqueeze(2))
        v_cache.index_copy_(2, pos.view(1), v.unsqueeze(2))
        scores = torch.einsum("bhd,bhtd->bht", q, k_cache) / math.sqrt(d // self.heads)
        scores = scores.masked_fill(positions > pos, float("-inf"))
        out = torch.einsum("bht,bhtd->bhd", scores.softmax(-1), v_cache)
        x = x + self.proj(out.reshape(b, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class Policy(torch.nn.Module):
    def __init__(self, vocab: int, d: int, layers: int, heads: int, max_len: int):
        super().__init__()
        self.tok, self.pos = torch.nn.Embedding(vocab, d), torch.nn.Embedding(max_len, d)
        self.blocks = torch.nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln, self.head = torch.nn.LayerNorm(d), torch.nn.Linear(d, vocab, bias=False)

    def forward(self, tokens):  # [B, T] -> logits [B, T, V]
        x = self.tok(tokens) + self.pos(torch.arange(tokens.shape[1], device=tokens.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))

    def decode(self, tok, pos, positions, k_caches, v_caches):  # tok [B] -> logits [B, V]
        x = self.tok(tok) + self.pos(pos)
        for i, block in enumerate(self.blocks):
            x = block.decode(x, pos, positions, k_caches[i], v_caches[i])
        return self.head(self.ln(x))


# ---- one run of the loop -------------------------------------------------------------------


class Generator:
    """The generator: the policy's copy in region "weights", its KV cache in "kv_cache", and
    a decode step captured once as a CUDA graph (eager on the CPU)."""

    def __init__(self, cfg, device, regions):
        self.cfg, self.device, self.graph = cfg, device, None
        with regions("weights"):
            self.model = Policy(cfg.vocab, cfg.d, cfg.layers, cfg.heads, cfg.max_len).to(device)
        self.model.requires_grad_(False)
        shape = (cfg.layers, cfg.batch, cfg.heads, cfg.max_len, cfg.d // cfg.heads)
        with regions("kv_cache"):
            self.k, self.v = torch.zeros(shape, device=device), torch.zeros(shape, device=device)
        # Static inputs and outputs of the decode step (the default pool).
        self.positions = torch.arange(cfg.max_len, device=device)
        self.tok = torch.zeros(cfg.batch, dtype=torch.long, device=device)
        self.pos = torch.zeros((), dtype=torch.long, device=device)
        self.noise = torch.full((cfg.batch, cfg.vocab), 0.5, device=device)
        self.next = torch.zeros(cfg.batch, dtype=torch.long, device=device)

    def step(self):
        logits = self.model.decode(self.tok, self.pos, self.positions, self.k, self.v)
        gumbel = -torch.log(-torch.log(self.noise.clamp(1e-9, 1 - 1e-9)))
        self.next.copy_(torch.argmax(logits + gumbel, dim=-1))

    def capture(self):
        if self.device.type != "cuda":
            return
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                self.step()
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.step()

    def generate(self, prompts, seed: int):
        self.k.zero_()
        self.v.zero_()
        rng = torch.Generator(device=self.device).manual_seed(seed)
        tokens, tok = [prompts], prompts
        for t in range(self.cfg.steps):
            self.tok.copy_(tok)
            self.pos.fill_(t)
            self.noise.uniform_(0, 1, generator=rng)
            if self.graph is not None:
                self.graph.replay()
            else:
                self.step()
            tok = self.next.clone()
            tokens.append(tok)
        return torch.stack(tokens, dim=1)


def run_loop(cfg, rank: int, world: int, device, sleeping: bool) -> dict:
    import streamalloc.p2p as p2p
    import streamalloc.torch as st

    gpu = device.type == "cuda"
    regions = st.region if gpu else (lambda tag: contextlib.nullcontext())
    torch.manual_seed(0)
    trainer = Policy(cfg.vocab, cfg.d, cfg.layers, cfg.heads, cfg.max_len).to(device)
    optimizer = torch.optim.AdamW(trainer.parameters(), lr=1e-4)
    generator = Generator(cfg, device, regions)
    with torch.no_grad():
        for g, t in zip(generator.model.parameters(), trainer.parameters()):
            g.copy_(t)
    generator.capture()
    send = list(trainer.parameters())
    recv = list(generator.model.parameters())
    exchange = None
    if world > 1:
        exchange = p2p.Exchange(sends={(rank + 1) % world: send}, recvs={(rank - 1) % world: recv},
                                budget_mib=64, transport=cfg.transport if gpu else "nccl")
    sync = torch.cuda.synchronize if gpu else (lambda: None)
    out = {"loss": [], "tokens": [], "released": [], "free_in_train": [], "used_end": [],
           "trainer_peak": [], "times": {k: 0.0 for k in ("generate", "sleep", "train", "wake", "sync")},
           "synced_equal": True}

    def phase(name, fn):
        sync()
        start = time.perf_counter()
        result = fn()
        sync()
        out["times"][name] += time.perf_counter() - start
        return result

    for it in range(cfg.iters):
        prompts = torch.randint(0, cfg.vocab, (cfg.batch,), device=device,
                                generator=torch.Generator(device=device).manual_seed(1000 * it + rank))
        seqs = phase("generate", lambda: generator.generate(prompts, seed=7 * it + rank))
        out["tokens"].append(seqs.tolist())  # plain lists cross the process boundary
        if sleeping:
            done = phase("sleep", lambda: st.sleep(["weights", "kv_cache"], backup="none"))
            out["released"].append(done["bytes"])
            out["free_in_train"].append(torch.cuda.mem_get_info()[0])
        if gpu:
            torch.cuda.reset_peak_memory_stats()

        def train():
            reward = (seqs[:, 1:] == cfg.target).float().mean(1)
            advantage = reward - reward.mean()
            logits = trainer(seqs[:, :-1])
            logp = torch.log_softmax(logits.float(), -1).gather(-1, seqs[:, 1:, None]).squeeze(-1).sum(1)
            loss = -(advantage * logp).mean() + 1e-3 * logp.mean().neg()
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            for p in trainer.parameters():
                dist.all_reduce(p.grad)
                p.grad.div_(world)
            optimizer.step()
            total = loss.detach().clone()
            dist.all_reduce(total)
            return total.item() / world

        out["loss"].append(phase("train", train))
        if gpu:
            out["trainer_peak"].append(torch.cuda.max_memory_allocated())
        if sleeping:
            phase("wake", lambda: st.wake(["weights", "kv_cache"]))

        def weight_sync():
            with torch.no_grad():
                if exchange is not None:
                    exchange.run()
                else:
                    for g, t in zip(recv, send):
                        g.copy_(t)

        phase("sync", weight_sync)
        # Data parallel: every trainer holds the same weights, so the previous rank's are ours.
        out["synced_equal"] &= all(torch.equal(g, t) for g, t in zip(recv, send))
        if gpu:
            free, total = torch.cuda.mem_get_info()
            out["used_end"].append(total - free)
    if exchange is not None:
        exchange.release()
    del generator, trainer, optimizer, exchange
    if gpu:
        torch.cuda.synchronize()
        st.empty_cache()
    return out


# ---- the processes ---------------------------------------------------------------------------


def worker(rank: int, world: int, cfg, port: int, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    # The two runs must agree bit for bit: deterministic kernels (cuBLAS needs this too).
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=True)
    if cfg.cpu:
        device = torch.device("cpu")
        dist.init_process_group("gloo", rank=rank, world_size=world)
    else:
        import streamalloc.torch as st

        st.install()  # before the first CUDA tensor
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
        dist.init_process_group("nccl", rank=rank, world_size=world, device_id=device)
    try:
        reference = run_loop(cfg, rank, world, device, sleeping=False)
        slept = run_loop(cfg, rank, world, device, sleeping=not cfg.cpu)
        result = {"rank": rank, "reference": reference, "slept": slept, "error": None}
    except Exception as err:  # reported in the table, not as a hang
        import traceback

        traceback.print_exc()
        result = {"rank": rank, "error": f"{type(err).__name__}: {err}"}
    queue.put(result)
    dist.destroy_process_group()


def table(cfg, results: list[dict], elapsed: float) -> tuple[str, bool]:
    failures = [f"rank {r['rank']}: {r['error']}" for r in results if r["error"]]
    lines = [""]
    name = "CPU (gloo)" if cfg.cpu else torch.cuda.get_device_name(0)
    lines.append(f"colocated RL loop — {len(results)} x {name}, torch {torch.__version__}, "
                 f"{datetime.date.today()}, `python3 {' '.join(sys.argv)}`")
    if failures:
        lines.append("result: FAILED: " + "; ".join(failures))
        return "\n".join(lines), False
    same_loss = all(r["reference"]["loss"] == r["slept"]["loss"] for r in results)
    same_tokens = all(r["reference"]["tokens"] == r["slept"]["tokens"] for r in results)
    synced = all(r["reference"]["synced_equal"] and r["slept"]["synced_equal"] for r in results)
    ok = same_loss and same_tokens and synced
    r0 = results[0]["slept"]
    ref0 = results[0]["reference"]
    per = lambda t, k: t["times"][k] / cfg.iters * 1e3  # noqa: E731
    lines.append("| phase (rank 0, ms per iteration) | generate | sleep | train | wake | weight sync |")
    lines.append("| --- | --- | --- | --- | --- | --- |")
    for label, t in (("without sleeping", ref0), ("with sleep / wake", r0)):
        lines.append(f"| {label} | {per(t, 'generate'):.1f} | {per(t, 'sleep'):.1f} | {per(t, 'train'):.1f} "
                     f"| {per(t, 'wake'):.1f} | {per(t, 'sync'):.1f} |")
    if not cfg.cpu:
        released = [b for r in results for b in r["slept"]["released"]]
        used = [r["slept"]["used_end"][2:] for r in results]
        drift = max(max(u) - min(u) for u in used) if all(used) else 0
        steady = drift <= 256 << 20
        every = min(released) > 0
        ok &= steady and every
        lines.append(f"given back at every sleep: {min(released) / GIB:.2f}-{max(released) / GIB:.2f} GiB per rank "
                     f"({'yes' if every else 'NO'}); trainer peak {max(r0['trainer_peak']) / GIB:.2f} GiB "
                     f"allocated while the generator slept")
        lines.append(f"device memory at the end of iterations 3-{cfg.iters}: varies by {drift / 2**20:.0f} MiB "
                     f"at most ({'steady' if steady else 'NOT steady'})")
    lines.append(f"{cfg.iters} iterations: losses {'bit-identical' if same_loss else 'DIFFER'}, generations "
                 f"{'bit-identical' if same_tokens else 'DIFFER'} to the run without sleeping; generator weights "
                 f"equal to the trainer's after every sync: {'yes' if synced else 'NO'} "
                 f"(transport {cfg.transport if not cfg.cpu else 'gloo'}); {elapsed:.0f} s")
    lines.append("result: " + ("all checks passed" if ok else "FAILED"))
    return "\n".join(lines), ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", type=int, default=None, help="processes (default: up to 4 GPUs)")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--kv-gib", type=float, default=4.0, help="KV cache per GPU")
    parser.add_argument("--transport", default="auto", choices=("auto", "ce", "nccl"))
    parser.add_argument("--cpu", action="store_true", help="a dry run of the logic on CPU processes (gloo)")
    cfg = parser.parse_args()
    small = cfg.cpu
    cfg.vocab, cfg.d, cfg.layers, cfg.heads = (512, 64, 2, 4) if small else (8192, 1024, 8, 16)
    cfg.batch, cfg.steps, cfg.target = (8, 12, 7) if small else (32, 64, 7)
    per_position = cfg.layers * cfg.batch * cfg.d * 4 * 2  # K and V, fp32
    cfg.max_len = 32 if small else max(cfg.steps + 1, int(cfg.kv_gib * GIB / per_position))
    world = cfg.gpus or (2 if cfg.cpu else min(4, torch.cuda.device_count()))
    if not cfg.cpu and world > torch.cuda.device_count():
        print(f"rl_loop: {world} GPUs asked for, {torch.cuda.device_count()} visible", file=sys.stderr)
        return 2
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    if not cfg.cpu and os.environ.get("STREAMALLOC_DOOR", "auto") != "pluggable":
        from streamalloc import _door

        try:
            _door.build()  # once here, not in every worker at the same time
        except Exception as err:  # the workers fall back to the pluggable door, saying why
            print(f"rl_loop: the native door could not be built: {err}", file=sys.stderr)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = 29500 + os.getpid() % 1000
    start = time.perf_counter()
    procs = [ctx.Process(target=worker, args=(r, world, cfg, port, queue)) for r in range(world)]
    for p in procs:
        p.start()
    results = []
    for _ in procs:
        results.append(queue.get(timeout=420))
    for p in procs:
        p.join(timeout=60)
    text, ok = table(cfg, sorted(results, key=lambda r: r["rank"]), time.perf_counter() - start)
    print(text)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
