# Where the time of the drop-in and of Exchange goes, on N GPUs of one host: the reproduction's
# pattern at ~58,000 ops per rank (bench.py's tensors, shuffled lists), after two warm-up
# calls, three calls of each method timed on the host phase by phase (streamalloc's functions
# wrapped with timers, no change to the library) and on the device (torch.profiler: the copy
# kernel, copy-engine copies, NCCL, and each round's named range). Rank 0 prints one table.
#   python3 -m torch.distributed.run --standalone --nproc-per-node=4 benches/gpu/p2p/profile.py \
#     [--budget-mib 128] [--trace DIR]     (--trace: a Chrome trace per rank and method)
import argparse
import collections
import os
import sys
import time

import torch
import torch.distributed as dist

from streamalloc import _p2p_copy, _p2p_dropin, _p2p_native, _p2p_rounds, p2p

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_worker import elements, pattern_T, scale_for  # noqa: E402

HOST = collections.defaultdict(float)
PHASES = [
    (_p2p_native, "read_ops", "read the P2POp list"),
    (_p2p_dropin._GroupState, "gather_digests", "gather shape digests (gloo)"),
    (_p2p_rounds._Rounds, "_rebind", "rebind the plan to new tensors"),
    (_p2p_copy.DeviceCopier, "upload", "upload the copy table's addresses"),
    (_p2p_rounds._Rounds, "_run_ce", "enqueue the rounds (copy engine)"),
    (_p2p_rounds._Rounds, "_run_nccl", "enqueue the rounds (NCCL)"),
    (_p2p_rounds._Rounds, "run", "run (total)"),
]


def wrap(owner, name, label):
    fn = getattr(owner, name)

    def timed(*a, **k):
        t0 = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            HOST[label] += time.perf_counter() - t0
    setattr(owner, name, timed)


for owner, name, label in PHASES:
    wrap(owner, name, label)


def device_times(prof):
    """Milliseconds of device time by kind over the profiled calls."""
    out = collections.defaultdict(float)
    for e in prof.key_averages():
        t = getattr(e, "device_time_total", getattr(e, "cuda_time_total", 0)) / 1e3
        if t <= 0 or e.key.startswith("p2p round") or e.key.startswith("ProfilerStep"):
            continue
        name = e.key
        if "streamalloc_p2p_copy" in name:
            out["copy kernel (pack + unpack)"] += t
        elif "Memcpy" in name or "memcpy" in name:
            out[f"copies: {name}"] += t
        elif "nccl" in name.lower():
            out["NCCL kernels"] += t
        else:
            out["other device work"] += t
    return out


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--budget-mib", type=float, default=128)
    parser.add_argument("--trace", default=None)
    args = parser.parse_args()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", torch.cuda.current_device())
    T = pattern_T(world, scale_for(world, 58_000))
    sends = {j: [torch.full((elements(rank, j),), float(j), device=dev) for _ in range(T[rank][j])]
             for j in range(world) if T[rank][j]}
    recvs = {j: [torch.empty(elements(j, rank), device=dev) for _ in range(T[j][rank])]
             for j in range(world) if T[j][rank]}
    n_ops = sum(map(len, sends.values())) + sum(map(len, recvs.values()))
    import random

    def ops():
        out = [dist.P2POp(dist.isend, t, j) for j, ts in sends.items() for t in ts]
        out += [dist.P2POp(dist.irecv, t, j) for j, ts in recvs.items() for t in ts]
        random.Random(len(HOST)).shuffle(out)
        return out

    holder = {}

    def exchange_call():
        if "ex" not in holder:
            holder["ex"] = p2p.Exchange(sends, recvs, budget_mib=args.budget_mib)
        holder["ex"].run()

    def dropin_call():
        for w in p2p.batch_isend_irecv(ops(), budget_mib=args.budget_mib):
            w.wait()

    results = {}
    for label, call in (("Exchange", exchange_call), ("drop-in", dropin_call)):
        for _ in range(2):  # warm-up: agreement, buffers, kernel module
            call()
        torch.cuda.synchronize()
        dist.barrier()
        HOST.clear()
        walls = []
        acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=acts) as prof:
            for _ in range(3):
                dist.barrier()
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                call()
                torch.cuda.synchronize()
                walls.append(time.perf_counter() - t0)
        if args.trace:
            os.makedirs(args.trace, exist_ok=True)
            prof.export_chrome_trace(os.path.join(args.trace, f"{label}_rank{rank}.json"))
        ex = holder.get("ex") or next(reversed(p2p._GROUPS[None].exchanges.values()))
        results[label] = dict(wall=sum(walls) / 3 * 1e3,
                              host={k: v / 3 * 1e3 for k, v in HOST.items()},
                              device={k: v / 3 for k, v in device_times(prof).items()},
                              rounds=len(ex._rounds), transport=ex.transport,
                              packing=ex.summary.get("packing"))
    everyone = [None] * world
    dist.all_gather_object(everyone, results)
    if rank == 0:
        print(f"\nwhere the time goes: {world} x {torch.cuda.get_device_name()}, pattern at "
              f"{n_ops:,} ops on rank 0, budget {args.budget_mib:g} MiB; ms per call, mean of 3 "
              "after 2 warm-up calls; each rank's figure, slowest first")
        for label in ("Exchange", "drop-in"):
            r0 = everyone[0][label]
            print(f"\n{label} [{r0['transport']}, packing: {r0['packing']}, "
                  f"{r0['rounds']} rounds on rank 0]")
            print("| phase | where | ms per call (ranks 0..N-1) |")
            print("| --- | --- | --- |")
            cells = lambda values: ", ".join(f"{v:.2f}" for v in values)
            walls = [e[label]["wall"] for e in everyone]
            print(f"| call to last wait (wall) | host | {cells(walls)} |")
            for side, where in (("host", "host"), ("device", "device (sum over streams)")):
                keys = list(dict.fromkeys(k for e in everyone for k in e[label][side]))
                for k in keys:
                    values = [e[label][side].get(k, 0) for e in everyone]
                    print(f"| {k} | {where} | {cells(values)} |")
        print("\n(waits: wall time less the host's enqueueing is time the host spends waiting "
              "for the device; device sums overlap across streams)")
    holder["ex"].release()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
