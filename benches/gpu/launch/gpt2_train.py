# A user's training script that knows nothing of streamalloc: GPT-2 small (12 layers,
# 768 wide, batch 8 x 1024 tokens), 4 AdamW steps, fixed seed (alloc_bench.py's gpt2
# workload as a plain script).
#   python3 gpt2_train.py OUT.json
# run.sh starts it twice: plainly (PyTorch's allocator) and under `streamalloc run`.
# It reports which allocator served it the way any program could: streamalloc's
# torch.cuda.memory_stats() carries `streamalloc.*` keys.
import json, sys, time
import torch

OUT = sys.argv[1]
STEPS = 4
torch.manual_seed(0)


def model_and_batch():
    try:
        from transformers import GPT2Config, GPT2LMHeadModel
    except ImportError:  # same shape of work without the transformers package
        return small_gpt2()
    cfg = GPT2Config(n_layer=12, n_embd=768, n_head=12, n_positions=1024)
    m = GPT2LMHeadModel(cfg).cuda()
    ids = torch.randint(0, cfg.vocab_size, (8, 1024), device="cuda")
    return m, lambda: m(input_ids=ids, labels=ids).loss, "transformers GPT2LMHeadModel"


def small_gpt2():
    import torch.nn as nn
    vocab, dim, layers, heads, seq = 50257, 768, 12, 12, 1024

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok = nn.Embedding(vocab, dim)
            self.pos = nn.Embedding(seq, dim)
            layer = nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout=0.1, activation="gelu",
                                               batch_first=True, norm_first=True)
            self.blocks = nn.TransformerEncoder(layer, layers)
            self.head = nn.Linear(dim, vocab, bias=False)

        def forward(self, ids):
            x = self.tok(ids) + self.pos(torch.arange(ids.shape[1], device=ids.device))
            mask = nn.Transformer.generate_square_subsequent_mask(ids.shape[1], device=ids.device)
            return self.head(self.blocks(x, mask=mask, is_causal=True))

    m = Model().cuda()
    ids = torch.randint(0, vocab, (8, seq), device="cuda")
    loss = lambda: nn.functional.cross_entropy(m(ids)[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    return m, loss, "torch.nn GPT-2-shaped model"


model, loss_fn, kind = model_and_batch()
opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
losses, times = [], []
for i in range(STEPS):
    if i == 2:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    loss = loss_fn()
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    times.append(time.perf_counter() - t0)
    losses.append(loss.item())

stats = torch.cuda.memory_stats()
res = dict(
    model=kind,
    allocator="streamalloc" if "streamalloc.allocs" in stats else "pytorch",
    losses=losses,
    step_ms=sorted(times[2:])[len(times[2:]) // 2] * 1e3,
    peak_allocated_mib=torch.cuda.max_memory_allocated() / 2**20,
    peak_reserved_mib=torch.cuda.max_memory_reserved() / 2**20,
    allocs=stats.get("streamalloc.allocs", stats.get("allocation.all.allocated")),
)
with open(OUT, "w") as f:
    json.dump(res, f)
print(json.dumps(res))
