"""Records the KV-cache generation workload of work.py under PyTorch's own allocator as a
memory snapshot with its trace, for `streamalloc replay` (the replay tests in CI use it).

    python3 capture_infer.py OUT.pickle [REQUESTS]   (writes OUT.pickle.gz)
"""

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import work  # noqa: E402


def main():
    out, count = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 6
    # From the start, weights included; no stacks, to keep the file small.
    torch.cuda.memory._record_memory_history(context=None, max_entries=2_000_000)
    model = work.gpt2_model(torch).to(device="cuda", dtype=torch.bfloat16).eval()
    eos = model.config.eos_token_id
    gen = torch.Generator().manual_seed(3)
    for batch, prompt, new in work.request_stream(count):
        ids = torch.randint(0, work.GPT2_VOCAB, (batch, prompt), generator=gen).cuda()
        with torch.inference_mode():
            model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                           min_new_tokens=new, do_sample=False, use_cache=True, pad_token_id=eos)
        del ids
    torch.cuda.synchronize()
    torch.cuda.memory._dump_snapshot(out)
    os.system(f"gzip -f {out}")
    print(out, "peak reserved / allocated",
          round(torch.cuda.max_memory_reserved() / torch.cuda.max_memory_allocated(), 4))


if __name__ == "__main__":
    main()
