# The torch.compile(mode="reduce-overhead") checks of checks.py: a nanoGPT model compiled
# with CUDA graphs, trained and run beside an eager copy on the allocator under test.
import copy
import time

from checks_common import MiB, clear_workspaces, result, settle


# ---- 4. torch.compile(mode="reduce-overhead") ----

def nanogpt(torch, n_layer=12, n_embd=768, n_head=12, vocab=50257, block=1024):
    """A self-contained GPT-2 small (nanoGPT's layout, no dropout, no weights downloaded)."""
    nn, F = torch.nn, torch.nn.functional

    class Attention(nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv = nn.Linear(n_embd, 3 * n_embd)
            self.proj = nn.Linear(n_embd, n_embd)

        def forward(self, x):
            b, t, c = x.shape
            q, k, v = self.qkv(x).split(n_embd, dim=2)
            q, k, v = (z.view(b, t, n_head, c // n_head).transpose(1, 2) for z in (q, k, v))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return self.proj(y.transpose(1, 2).contiguous().view(b, t, c))

    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1, self.attn = nn.LayerNorm(n_embd), Attention()
            self.ln2 = nn.LayerNorm(n_embd)
            self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(approximate="tanh"),
                                     nn.Linear(4 * n_embd, n_embd))

        def forward(self, x):
            x = x + self.attn(self.ln1(x))
            return x + self.mlp(self.ln2(x))

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.wte, self.wpe = nn.Embedding(vocab, n_embd), nn.Embedding(block, n_embd)
            self.layers = nn.ModuleList(Layer() for _ in range(n_layer))
            self.ln_f = nn.LayerNorm(n_embd)
            self.head = nn.Linear(n_embd, vocab, bias=False)
            self.head.weight = self.wte.weight

        def forward(self, idx, targets=None):
            pos = torch.arange(idx.shape[1], device=idx.device)
            x = self.wte(idx) + self.wpe(pos)
            for layer in self.layers:
                x = layer(x)
            logits = self.head(self.ln_f(x))
            if targets is None:
                return logits
            return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))

    return GPT()


def compile_check(alloc, which):
    import torch
    torch.manual_seed(0)
    clear_workspaces(torch)
    torch.cuda.synchronize()
    base_alloc = torch.cuda.memory_allocated()
    if which == "small":
        model = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 512),
                                    torch.nn.LayerNorm(512), torch.nn.Linear(512, 10)).cuda()
        make_batch = lambda: (torch.randn(64, 512, device="cuda"), torch.randint(0, 10, (64,), device="cuda"))
        loss_of = lambda m, x, y: torch.nn.functional.cross_entropy(m(x), y)
        infer = lambda m, x: m(x)
        steps, tol = 5, 1e-3
    else:
        model = nanogpt(torch).cuda()
        make_batch = lambda: (torch.randint(0, 50257, (4, 256), device="cuda"),
                              torch.randint(0, 50257, (4, 256), device="cuda"))
        loss_of = lambda m, x, y: m(x, y)
        infer = lambda m, x: m(x)
        steps, tol = 3, 2e-3
    ref = copy.deepcopy(model)
    compiled = torch.compile(model, mode="reduce-overhead")
    t0 = time.perf_counter()
    # Inference: cudagraph trees warm up, record, then replay; outputs are overwritten by
    # the next replay, so each is cloned before the next call.
    worst_inf = 0.0
    with torch.no_grad():
        for i in range(4):
            x, unused = make_batch()
            torch.compiler.cudagraph_mark_step_begin()
            got = infer(compiled, x).clone()
            want = infer(ref, x)
            worst_inf = max(worst_inf, float((got - want).abs().max().item()) / max(float(want.abs().max().item()), 1e-12))
            del got, want, unused
    # Training: the same steps on the compiled model and on an eager copy.
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-4)
    losses, losses_ref = [], []
    for i in range(steps):
        x, y = make_batch()
        torch.compiler.cudagraph_mark_step_begin()
        loss = loss_of(compiled, x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.item()))
        loss_ref = loss_of(ref, x, y)
        loss_ref.backward()
        opt_ref.step()
        opt_ref.zero_grad(set_to_none=True)
        losses_ref.append(float(loss_ref.item()))
        del loss, loss_ref
    seconds = time.perf_counter() - t0
    worst_train = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(losses, losses_ref))
    reserved_before = torch.cuda.memory_reserved()
    del compiled, model, ref, opt, opt_ref, x, y
    torch._dynamo.reset()
    try:  # cudagraph trees keep their pool until reset (dynamo's reset may not do it)
        from torch._inductor import cudagraph_trees
        cudagraph_trees.reset_cudagraph_trees()
    except (ImportError, AttributeError):
        pass
    settle(torch)
    torch.cuda.empty_cache()
    delta = torch.cuda.memory_allocated() - base_alloc
    reserved_after = torch.cuda.memory_reserved()
    ok = worst_inf < tol and worst_train < tol and delta <= 0 and reserved_after < reserved_before
    fig = (f"rel err inf {worst_inf:.0e} train {worst_train:.0e}, Δalloc {delta / MiB:+.0f} MiB, "
           f"reserved {reserved_before / MiB:.0f}->{reserved_after / MiB:.0f} MiB")
    return result(ok, fig, losses=losses, losses_eager=losses_ref, worst_rel_inference=worst_inf,
                  worst_rel_train=worst_train, delta_allocated=delta, reserved_before=reserved_before,
                  reserved_after=reserved_after, seconds=seconds)


def check_compile_small(alloc):
    return compile_check(alloc, "small")


def check_compile_gpt2(alloc):
    return compile_check(alloc, "gpt2")
