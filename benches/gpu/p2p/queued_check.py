# Does an Exchange's agreement and first run wait on the host for work the caller queued on
# its stream? A training step queues its kernels and moves on; an exchange agreed in the
# middle of the step should enqueue its copies behind that work, not stall the host until
# the device has drained it. Each pass queues about QUEUED_MS of GPU sleep on the caller's
# current stream, then builds an Exchange of the reproduction's pattern (~5,000 ops per
# rank) and runs it once, and prints how long the host took to come back, beside the time
# until the queued work and the exchange were done; the values received are checked.
#   python3 -m torch.distributed.run --standalone --nproc-per-node=2 \
#       benches/gpu/p2p/queued_check.py [QUEUED_MS]      (default 300)
# Exits 1 if the host waited for most of the queued work in the last pass, or a value is
# wrong.
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_worker import elements, pattern_T, scale_for  # noqa: E402

QUEUED_MS = float(sys.argv[1]) if len(sys.argv) > 1 else 300.0
SLEEP_CYCLES_PER_MS = 1.98e6  # torch.cuda._sleep spins cycles: about an H100/H200's clock


def main():
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    from streamalloc import p2p

    T = pattern_T(world, scale_for(world, 5000))
    sends = {j: [torch.full((elements(rank, j),), float((rank + 1) * (j + 1)), device=dev)
                 for _ in range(T[rank][j])] for j in range(world) if T[rank][j]}
    recvs = {j: [torch.empty(elements(j, rank), device=dev) for _ in range(T[j][rank])]
             for j in range(world) if T[j][rank]}
    waited = ok = False
    for k in range(2):  # the first pass also pays the process's one-time set-up
        torch.cuda.synchronize()
        dist.barrier()
        t0 = time.perf_counter()
        torch.cuda._sleep(int(QUEUED_MS * SLEEP_CYCLES_PER_MS))
        t1 = time.perf_counter()
        ex = p2p.Exchange(sends, recvs, budget_mib=128, transport="ce")
        ex.run()
        t2 = time.perf_counter()
        torch.cuda.synchronize()
        t3 = time.perf_counter()
        ok = all(bool((t == float((j + 1) * (rank + 1))).all())
                 for j, ts in recvs.items() for t in ts)
        waited = (t2 - t1) * 1e3 >= 0.8 * QUEUED_MS
        if rank == 0:
            print(f"pass {k}: the host came back from the agreement and first run after "
                  f"{(t2 - t1) * 1e3:.1f} ms; the queued work and the exchange were done "
                  f"after {(t3 - t0) * 1e3:.1f} ms; values {'ok' if ok else 'WRONG'}",
                  flush=True)
        ex.release()
    flags = [None] * world
    dist.all_gather_object(flags, (waited, ok))
    dist.destroy_process_group()
    if rank == 0:
        bad_wait = [r for r, (w, _) in enumerate(flags) if w]
        bad_values = [r for r, (_, v) in enumerate(flags) if not v]
        print("queued_check: " + ("the host waited for the caller's queued work on ranks "
                                  f"{bad_wait}" if bad_wait else "no wait on the caller's work")
              + (f"; wrong values on ranks {bad_values}" if bad_values else ""))
    if any(w or not v for w, v in flags):
        sys.exit(1)


if __name__ == "__main__":
    main()
