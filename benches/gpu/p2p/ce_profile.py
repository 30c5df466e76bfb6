# Where the time of a first call (p2p.exchange: construct, run, release) goes, per transport
# (and for ce once more with new tensors every call, as bench.py does):
# wraps the phases of streamalloc.p2p with host timers (no change to the library) and prints
# rank 0's milliseconds per phase, best of the last 3 of 4 calls, for the parameter-shaped
# workload of bench.py (torchrun --nproc_per_node=2).
import collections, json, os, sys, time
import torch
import torch.distributed as dist
from streamalloc import p2p, _ce

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_worker import param_sizes  # noqa: E402

TIMES = collections.defaultdict(float)


def timed(owner, name, label):
    fn = getattr(owner, name)

    def wrapper(*a, **k):
        t0 = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            TIMES[label] += time.perf_counter() - t0
    setattr(owner, name, wrapper)


for owner, name, label in [
    (p2p.Exchange, "__init__", "construct (total)"),
    (p2p.Exchange, "_agree", "  plan + digest vote"),
    (p2p.Exchange, "_establish_ce", "  ce: export + connect + 2 gathers"),
    (_ce.Link, "export", "    ce: allocate, zero, sync, export handle"),
    (_ce.Link, "connect", "    ce: open peer handles"),
    (p2p.Exchange, "run", "run (total)"),
    (p2p.Exchange, "_setup_buffers", "  buffers and views"),
    (p2p.Exchange, "release", "release (total)"),
    (p2p.Exchange, "_release_ce", "  ce: barrier (gather) + close"),
    (_ce.Link, "close", "    ce: close peer handles"),
    (_ce.Driver, "export", "      cuMemGetAddressRange + cuIpcGetMemHandle"),
    (_ce.Driver, "ipc_open", "      cuIpcOpenMemHandle"),
    (_ce.Driver, "ipc_close", "      cuIpcCloseMemHandle"),
]:
    timed(owner, name, label)


def main():
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    peer = 1 - rank
    make = lambda: ({peer: [torch.ones(n, dtype=torch.bfloat16, device=dev) for n in param_sizes(1024, rank)]},
                    {peer: [torch.empty(n, dtype=torch.bfloat16, device=dev) for n in param_sizes(1024, peer)]})
    sends, recvs = make()
    out = {}
    # "fresh": new tensors every call, as bench.py makes them (the freed ones stay cached).
    for transport in ("nccl", "ce", "ce fresh"):
        best = None
        for it in range(4):
            if transport.endswith("fresh"):
                del sends, recvs
                sends, recvs = make()
            TIMES.clear()
            torch.cuda.synchronize(); dist.barrier(); torch.cuda.synchronize()
            t0 = time.perf_counter()
            p2p.exchange(sends, recvs, transport=transport.split()[0])
            torch.cuda.synchronize()
            total = time.perf_counter() - t0
            if it and (best is None or total < best[0]):
                best = (total, dict(TIMES))
        out[transport] = {"total": round(best[0] * 1e3, 2),
                          **{k: round(v * 1e3, 2) for k, v in best[1].items()}}
    if rank == 0:
        for transport, phases in out.items():
            print(f"first call, {transport}, ms (rank 0):", json.dumps(phases, indent=0), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
