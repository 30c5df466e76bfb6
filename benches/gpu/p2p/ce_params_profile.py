# The parameter workload (bench.py's ~88 bf16 tensors, 589 MB to the next rank) through an
# Exchange over the copy engine on 2 GPUs: wall time and host enqueue time per run, and the
# device time per run by kind (peer copies, local copies, the copy kernel) from torch.profiler.
#   STREAMALLOC_P2P_PACK=kernel python3 -m torch.distributed.run --standalone --nproc-per-node=2 \
#     benches/gpu/p2p/ce_params_profile.py
import os, sys, time, collections
import torch, torch.distributed as dist
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_worker import param_sizes
from streamalloc import p2p, _p2p_rounds
dist.init_process_group("nccl"); rank, world = dist.get_rank(), dist.get_world_size()
torch.cuda.set_device(rank); dev = torch.device("cuda", rank)
dst, src = (rank + 1) % world, (rank - 1) % world
sends = {dst: [torch.full((n,), 1.0, dtype=torch.bfloat16, device=dev) for n in param_sizes(dst * 1000 + rank, 1.0)]}
recvs = {src: [torch.empty(n, dtype=torch.bfloat16, device=dev) for n in param_sizes(rank * 1000 + src, 1.0)]}
nbytes = sum(t.numel() * 2 for t in sends[dst])
ex = p2p.Exchange(sends, recvs, budget_mib=128, transport="ce")
host = []
orig = _p2p_rounds._Rounds._run_ce
def timed(self, cur):
    t = time.perf_counter(); r = orig(self, cur); host.append(time.perf_counter() - t); return r
_p2p_rounds._Rounds._run_ce = timed
msgs = [m for pair in ex._rounds for m in pair if m is not None]
direct = sum(1 for m in msgs if _p2p_rounds._Rounds._direct(m))
for _ in range(3): ex.run()
torch.cuda.synchronize(); dist.barrier()
walls = []
for _ in range(8):
    dist.barrier(); torch.cuda.synchronize(); t = time.perf_counter(); ex.run(); torch.cuda.synchronize(); walls.append(time.perf_counter() - t)
from torch.profiler import profile, ProfilerActivity
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
    for _ in range(3):
        ex.run()
    torch.cuda.synchronize()
kinds = collections.defaultdict(float)
for e in prof.key_averages():
    if e.device_time_total > 0 and e.device_type == torch.autograd.DeviceType.CUDA:
        kinds[e.key[:60]] += e.device_time_total / 3 / 1000
if rank == 0:
    walls.sort(); host.sort()
    print(f"packing {ex._pack_mode}; rounds {len(ex._rounds)}; messages {len(msgs)}, direct {direct}; {nbytes/1e6:.0f} MB")
    print(f"wall median {walls[4]*1e3:.2f} ms ({nbytes/walls[4]/1e9:.0f} GB/s); host enqueue median {host[len(host)//2]*1e3:.2f} ms")
    for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])[:8]:
        print(f"  device {v:7.2f} ms per run  {k}")
ex.release(); dist.destroy_process_group()
