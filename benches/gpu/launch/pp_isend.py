# A user's program as its author wrote it (only this line added): run.sh starts it with `streamalloc run -- torchrun`.
# Anchor: record_stream bloat that PyTorch >= 2.8 still has for point-to-point ops.
# Pipeline-style stage: rank 0 computes an activation, isends it to rank 1 and drops it;
# rank 1 is the slow consumer. PyTorch records the NCCL stream on every p2p tensor, so
# rank 0's caching allocator holds each activation until its send completes on the GPU.
#   torchrun --nproc_per_node=2 pp_isend.py OUT.json [SNAPSHOT]
import json, sys, time
import torch
import torch.distributed as dist

OUT = sys.argv[1]
SNAP = sys.argv[2] if len(sys.argv) > 2 else ""
dist.init_process_group("nccl")
rank = dist.get_rank(); torch.cuda.set_device(rank)
dim, batch, micro = 8192, 4096, 32
w = torch.randn(dim, dim, dtype=torch.bfloat16, device="cuda")
x = torch.randn(batch, dim, dtype=torch.bfloat16, device="cuda")
for _ in range(2):  # warm NCCL
    if rank == 0: dist.send(x, 1)
    else: dist.recv(x, 0)
torch.cuda.synchronize(); dist.barrier()
torch.cuda.reset_peak_memory_stats()
base = torch.cuda.memory_allocated()
if SNAP and rank == 0:
    torch.cuda.memory._record_memory_history(max_entries=100000, stacks="python")
t0 = time.perf_counter()
reqs = []
if rank == 0:
    for i in range(micro):
        y = x @ w                      # 64 MiB activation
        reqs.append(dist.isend(y, 1))  # PyTorch keeps y alive via record_stream
        del y
else:
    buf = torch.empty(batch, dim, dtype=torch.bfloat16, device="cuda")
    for i in range(micro):
        dist.recv(buf, 0)
        for _ in range(6):             # slow consumer
            buf2 = buf @ w
torch.cuda.synchronize()
for r in reqs: r.wait()
torch.cuda.synchronize()
dt = time.perf_counter() - t0
if SNAP and rank == 0:
    torch.cuda.memory._dump_snapshot(SNAP); torch.cuda.memory._record_memory_history(enabled=None)
res = dict(rank=rank, seconds=dt, live_activation_mib=batch * dim * 2 / 2**20,
           extra_peak_allocated_mib=(torch.cuda.max_memory_allocated() - base) / 2**20,
           peak_reserved_mib=torch.cuda.max_memory_reserved() / 2**20, base_mib=base / 2**20)
allr = [None, None]; dist.all_gather_object(allr, res)
if rank == 0:
    json.dump(allr, open(OUT, "w")); print(json.dumps(allr))
dist.barrier(); dist.destroy_process_group()
