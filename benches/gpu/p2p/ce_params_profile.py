# The parameter workload (bench.py's ~88 bf16 tensors, 589 MB to the next rank) through an
# Exchange over the copy engine on 2 GPUs: wall time and host enqueue time per run, and the
# device time per run by kind (peer copies, local copies, the copy kernel) from torch.profiler.
#   STREAMALLOC_P2P_PACK=kernel python3 -m torch.distributed.run --standalone --nproc-per-node=2 \
#     benches/gpu/p2p/ce_params_profile.py [BUDGET_MIB] [TRACE_DIR]
# With TRACE_DIR, each rank also writes the profiled runs' Chrome trace there
# (ce_params.<budget>.rank<r>.json) and prints the peer copies' timeline of one run: when
# each copy starts after the previous one ends, and its own rate.
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
budget = int(sys.argv[1]) if len(sys.argv) > 1 else 128
trace_dir = sys.argv[2] if len(sys.argv) > 2 else None
ex = p2p.Exchange(sends, recvs, budget_mib=budget, transport="ce")
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
if trace_dir:
    os.makedirs(trace_dir, exist_ok=True)
    prof.export_chrome_trace(os.path.join(trace_dir, f"ce_params.{budget}.rank{rank}.json"))
    # The last run's peer copies (device-to-device between two devices), in start order.
    memcpys = [(e.time_range.start, e.time_range.end, e.name) for e in prof.events()
               if e.device_type == torch.autograd.DeviceType.CUDA and "emcpy" in e.name]
    copies = sorted(c for c in memcpys if "PtoP" in c[2]) or sorted(memcpys)
    last = copies[-(len(copies) // 3):] if copies else []
    lines, prev_end = [], None
    for start, end, name in last:
        gap = (start - prev_end) if prev_end is not None else 0.0
        lines.append(f"    copy {end - start:7.1f} us, gap before {gap:7.1f} us  {name[:40]}")
        prev_end = end
    busy = sum(e - s for s, e, _ in last)
    span = (last[-1][1] - last[0][0]) if last else 0.0
    print(f"rank {rank} budget {budget} MiB: {len(last)} peer copies in the last run, busy {busy/1e3:.2f} ms "
          f"over {span/1e3:.2f} ms\n" + "\n".join(lines), flush=True)
dist.barrier()
if rank == 0:
    walls.sort(); host.sort()
    print(f"budget {budget} MiB; packing {ex._pack_mode}; rounds {len(ex._rounds)}; messages {len(msgs)}, direct {direct}; {nbytes/1e6:.0f} MB")
    print(f"wall median {walls[4]*1e3:.2f} ms ({nbytes/walls[4]/1e9:.0f} GB/s); host enqueue median {host[len(host)//2]*1e3:.2f} ms")
    for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])[:8]:
        print(f"  device {v:7.2f} ms per run  {k}")
ex.release(); dist.destroy_process_group()
