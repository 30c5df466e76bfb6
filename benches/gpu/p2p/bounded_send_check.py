# streamalloc.bounded_send.BoundedSender on CPU tensors over gloo: every rank sends mixed
# dtypes and shapes (empty, oversize for a slot, 0-d) to every other rank through a small
# budget and overwrites each staged source tensor right after isend; receivers use plain recv and
# must get the original bytes. Also: the slots never exceed the budget, oversize tensors
# go direct, bad budgets are refused.
#   PYTHONPATH=python python benches/gpu/p2p/bounded_send_check.py [WORLD]
import os, random
import torch
import torch.distributed as dist
from cpu_check import spawn_ranks, tensor
from streamalloc.bounded_send import BoundedSender


def message(src, dst, i):
    """The i-th tensor src sends dst: cpu_check's mix, every 13th made 0-d."""
    t = tensor(src, dst, i, 5)
    return t.reshape(-1)[:1].reshape(()) if i % 13 == 0 and t.numel() else t


def refuses(**kwargs):
    try:
        BoundedSender(**kwargs)
    except ValueError:
        return True
    return False


def worker(rank, world, port, failures):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    problems = []
    sender = BoundedSender(budget_mib=0.25, slots=3)  # slots of 87,040 bytes
    count = 40
    # Every pair in the same global order, so each rank's recvs match its peers' sends.
    for src in range(world):
        for dst in range(world):
            if src == dst or rank not in (src, dst):
                continue
            for i in range(count):
                expect = message(src, dst, i)
                if rank == src:
                    sent = expect.clone()
                    sender.isend(sent, dst)
                    if sent.numel() * sent.element_size() <= sender.slot_bytes:
                        sent.zero_()  # staged: the slot holds the bytes being sent
                else:
                    got = torch.empty_like(expect)
                    dist.recv(got, src)
                    if not torch.equal(got, expect):
                        problems.append(f"tensor {i} from {src} differs")
    sender.wait()
    stats = sender.stats
    sent = [message(rank, d, i) for d in range(world) if d != rank for i in range(count)]
    oversize = sum(t.numel() * t.element_size() > sender.slot_bytes for t in sent)
    if stats["direct"] != oversize or stats["staged"] != (world - 1) * count - oversize:
        problems.append(f"stats {stats}, expected {oversize} direct")
    if oversize == 0 or stats["slot_waits"] == 0:
        problems.append(f"the check exercised no oversize tensor or no slot reuse: {stats}")
    buffer = sender._buffer
    if buffer is None or buffer.numel() != sender.budget_bytes or sender.budget_bytes > 2**18:
        problems.append("slots not within the budget")
    sender.release()
    if sender._buffer is not None:
        problems.append("release kept the slots")
    if not (refuses(slots=0) and refuses(budget_mib=0.0001, slots=8)):
        problems.append("a bad budget was accepted")
    for p in problems:
        print(f"rank {rank}: {p}", flush=True)
    if problems:
        failures.put(rank)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    random.seed()
    spawn_ranks(worker, "bounded send cpu check")
