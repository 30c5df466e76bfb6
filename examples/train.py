"""A small PyTorch training loop to try streamalloc on.

    streamalloc run -- python examples/train.py
    streamalloc run --conf memory_fraction:0.9 --stats -- torchrun --nproc_per_node=2 examples/train.py

Trains a small MLP on random data for a few steps on one GPU (under torchrun, each process
on its own, the GPU of its LOCAL_RANK), with a side stream that reads the activations the
way a communication kernel would (`record_stream`), then prints the losses and what
PyTorch's memory functions report: under `streamalloc run` those are streamalloc's figures,
and `get_allocator_backend()` names the allocator in use. Needs PyTorch and a CUDA GPU.
"""

import os
import sys

import torch


def main() -> int:
    if not torch.cuda.is_available():
        print("examples/train.py: no CUDA GPU visible to PyTorch", file=sys.stderr)
        return 2
    rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
    torch.manual_seed(0)

    model = torch.nn.Sequential(
        torch.nn.Linear(1024, 4096),
        torch.nn.GELU(),
        torch.nn.Linear(4096, 1024),
    ).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    side = torch.cuda.Stream(device)

    losses = []
    for step in range(20):
        # Batches of varying size, as with variable-length inputs.
        batch = 256 * (1 + step % 4)
        x = torch.randn(batch, 1024, device=device)
        target = torch.randn(batch, 1024, device=device)
        loss = torch.nn.functional.mse_loss(model(x), target)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        # Another stream still reads `x` after the step frees it.
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            x.sum()
        x.record_stream(side)
        losses.append(loss.item())

    torch.cuda.synchronize(device)
    mib = 1 << 20
    print(f"device {device.index}: allocator {torch.cuda.memory.get_allocator_backend()}")
    print(f"  losses: first {losses[0]:.4f}, last {losses[-1]:.4f}")
    print(
        f"  peak allocated {torch.cuda.max_memory_allocated(device) / mib:.1f} MiB, "
        f"peak reserved {torch.cuda.max_memory_reserved(device) / mib:.1f} MiB"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
