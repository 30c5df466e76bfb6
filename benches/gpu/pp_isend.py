# record_stream bloat on a pipeline stage: rank 0
# computes a 64 MiB activation, isends it to rank 1 and drops it, 32 times; rank 1 is slow.
# With STREAMALLOC=1 every rank installs streamalloc first. With STAGED=MiB rank 0 sends
# through streamalloc.bounded_send.BoundedSender(budget_mib=MiB) instead of dist.isend (the
# one line that changes), so its activations are freed at `del y`.
#   [STREAMALLOC=1] [STAGED=128] torchrun --nproc_per_node=2 pp_isend.py OUT.json
import json, os, sys, time
import torch
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "python"))
if os.environ.get("STREAMALLOC") == "1":
    import streamalloc.torch
    streamalloc.torch.install()
import torch.distributed as dist
from streamalloc.bounded_send import BoundedSender
STAGED = float(os.environ.get("STAGED", 0))

OUT = sys.argv[1]
dist.init_process_group("nccl")
rank = dist.get_rank(); torch.cuda.set_device(rank)
torch.manual_seed(rank)
dim, batch, micro = 8192, 4096, 32
w = torch.randn(dim, dim, dtype=torch.bfloat16, device="cuda")
x = torch.randn(batch, dim, dtype=torch.bfloat16, device="cuda")
for _ in range(2):  # warm NCCL
    if rank == 0: dist.send(x, 1)
    else: dist.recv(x, 0)
torch.cuda.synchronize(); dist.barrier()
torch.cuda.reset_peak_memory_stats()
base = torch.cuda.memory_allocated()
t0 = time.perf_counter()
reqs = []
checksum = 0.0
if rank == 0:
    isend = BoundedSender(budget_mib=STAGED).isend if STAGED else dist.isend
    for i in range(micro):
        y = x @ w
        reqs.append(isend(y, 1))
        del y
else:
    buf = torch.empty(batch, dim, dtype=torch.bfloat16, device="cuda")
    for i in range(micro):
        dist.recv(buf, 0)
        checksum += float(buf[0, :64].float().sum())  # every message must be x @ w
        for _ in range(6):
            buf2 = buf @ w
torch.cuda.synchronize()
for r in reqs: r.wait()
torch.cuda.synchronize()
dt = time.perf_counter() - t0
res = dict(rank=rank, seconds=dt, staged_mib=STAGED, extra_peak_allocated_mib=(torch.cuda.max_memory_allocated() - base) / 2**20,
           peak_reserved_mib=torch.cuda.max_memory_reserved() / 2**20, base_mib=base / 2**20)
if rank == 1:
    # Expected checksum, recomputed from rank 0's inputs (same seed).
    torch.manual_seed(0)
    w0 = torch.randn(dim, dim, dtype=torch.bfloat16, device="cuda")
    x0 = torch.randn(batch, dim, dtype=torch.bfloat16, device="cuda")
    expect = float((x0 @ w0)[0, :64].float().sum()) * micro
    res["checksum_ok"] = abs(checksum - expect) <= 1e-3 * max(1.0, abs(expect))
if os.environ.get("STREAMALLOC") == "1":
    s = streamalloc.torch.raw_stats()
    res["streamalloc"] = dict(cross_stream_waits=s["stats"]["cross_stream_waits"],
                              events_recorded=s["stats"]["events_recorded"],
                              unknown_record_streams=s["process"]["unknown_record_streams"],
                              invalid_frees=s["stats"]["invalid_frees"])
allr = [None, None]; dist.all_gather_object(allr, res)
if rank == 0:
    json.dump(allr, open(OUT, "w")); print(json.dumps(allr))
dist.barrier(); dist.destroy_process_group()
