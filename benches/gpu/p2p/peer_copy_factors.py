# What slows the exchange's peer copies below the copy engine's rate: each factor of the
# copy-engine transport alone, 2 ranks (one process per GPU, as the exchange runs). Rank 0
# copies 32 MiB chunks into rank 1's memory, back to back on one stream, timed by events:
#   ipc          into a cuMemAlloc region of rank 1 opened with cuIpcOpenMemHandle (the
#                exchange's receive buffers)
#   in-process   into memory of GPU 1 that rank 0's own process allocated (peer access on)
#   both ways    ipc, with rank 1 copying into rank 0's region at the same time
#   odd size     ipc, 33,550,656-byte chunks at 64-byte offsets (the exchange's messages)
#   + kernel     ipc, while rank 0 runs a memory-bound kernel on another stream
#   + flags      ipc, a wait on a satisfied local flag before and a fenced flag write into
#                rank 1's region after each copy (the exchange's protocol)
#   python3 -m torch.distributed.run --standalone --nproc-per-node=2 benches/gpu/p2p/peer_copy_factors.py
import ctypes
import torch
import torch.distributed as dist
from streamalloc import _ce

CHUNK, ODD, COUNT, REGION = 32 << 20, 33_550_656, 8, 320 << 20

dist.init_process_group("nccl")
rank = dist.get_rank()
torch.cuda.set_device(rank)
drv = _ce.driver()
drv.use_device(rank)
local = drv.mem_alloc(REGION)
recv = drv.mem_alloc(REGION)
handles = [None, None]
dist.all_gather_object(handles, drv.export(recv))
peer = 1 - rank
peer_recv = drv.ipc_open(handles[peer][0]) + handles[peer][1]
flag_local = torch.zeros(16, dtype=torch.int32, device="cuda")
stream = torch.cuda.Stream()
side = torch.cuda.Stream()
raw = ctypes.c_void_p(stream.cuda_stream)
in_process = torch.empty(REGION, dtype=torch.uint8, device=f"cuda:{peer}") if rank == 0 else None
torch.cuda.set_device(rank)
hot = torch.ones(1 << 28, dtype=torch.float32, device="cuda")  # 1 GiB for the side kernel


seqs = torch.arange(1, COUNT + 1, dtype=torch.int32, device="cuda")


def copies(dst, size, offset=0, flags=False):
    # flags: True (wait and write), "wait", "write", or "copy" (the flag written by a 4-byte
    # copy on the same stream instead of a write-value)
    for i in range(COUNT):
        if flags in (True, "wait"):
            drv.check(drv._wait32(raw, flag_local.data_ptr(), 0, 0), "cuStreamWaitValue32")
        drv.check(drv._memcpy(dst + i * CHUNK + offset, local + i * CHUNK + offset, size, raw),
                  "cuMemcpyDtoDAsync")
        if flags in (True, "write"):
            drv.check(drv._write32(raw, peer_recv + REGION - 64, i + 1, 0), "cuStreamWriteValue32")
        if flags == "copy":
            drv.check(drv._memcpy(peer_recv + REGION - 64, seqs.data_ptr() + 4 * i, 4, raw),
                      "cuMemcpyDtoDAsync")


class _Raw:
    # device memory at an address, as a float32 tensor of PyTorch's (no ownership)
    def __init__(self, ptr, nbytes):
        self.__cuda_array_interface__ = {"shape": (nbytes // 4,), "typestr": "<f4",
                                         "data": (ptr, False), "version": 3}


def sm_push(dst, reps=5):
    # the same bytes written by a kernel over NVLink (an elementwise multiply by 1)
    try:
        src_t = torch.as_tensor(_Raw(local, COUNT * CHUNK), device=f"cuda:{rank}")
        dst_t = torch.as_tensor(_Raw(dst, COUNT * CHUNK), device=f"cuda:{rank}")
    except Exception as err:  # noqa: BLE001 - an experiment: say why and go on
        print(f"rank {rank}: no kernel push ({err})", flush=True)
        return 0.0
    best = 0.0
    for _ in range(reps):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(stream):
            start.record()
            torch.mul(src_t, 1.0, out=dst_t)
            end.record()
        torch.cuda.synchronize()
        best = max(best, COUNT * CHUNK / start.elapsed_time(end) / 1e6)
    return best


def timed(active, dst, size=CHUNK, offset=0, flags=False, kernel=False, reps=5):
    best = 0.0
    for _ in range(reps):
        torch.cuda.synchronize()
        dist.barrier()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if kernel and (active or kernel == "both"):
            with torch.cuda.stream(side):
                for _ in range(4):
                    hot.mul_(1.0)
        with torch.cuda.stream(stream):
            start.record()
            if active:
                copies(dst, size, offset, flags)
            end.record()
        torch.cuda.synchronize()
        ms = start.elapsed_time(end)
        if active and ms > 0:
            best = max(best, COUNT * size / ms / 1e6)
    return best


rows = []
for name, kw, both in [("ipc", {}, False), ("both ways", {}, True),
                       ("odd size", {"size": ODD, "offset": 64}, False),
                       ("+ kernel", {"kernel": True}, False), ("+ flags", {"flags": True}, False),
                       ("both ways + kernels", {"kernel": "both"}, True),
                       ("both ways + kernels + flags", {"kernel": "both", "flags": True}, True),
                       ("both ways + kernels + wait only", {"kernel": "both", "flags": "wait"}, True),
                       ("both ways + kernels + write only", {"kernel": "both", "flags": "write"}, True),
                       ("both ways + kernels + flag by a 4-byte copy", {"kernel": "both", "flags": "copy"}, True),
                       ("both ways + flags", {"flags": True}, True)]:
    rate = timed(rank == 0 or both, peer_recv, **kw)
    rows.append((name, rate))
rows.insert(1, ("in-process", timed(rank == 0, in_process.data_ptr() if rank == 0 else 0)))
dist.barrier()
rows.append(("kernel push (SM writes over NVLink), one way", sm_push(peer_recv) if rank == 0 else 0.0))
dist.barrier()
if rank == 0:
    print("| rank 0 -> rank 1, 32 MiB chunks | GB/s (best of 5) |\n| --- | --- |")
    for name, rate in rows:
        print(f"| {name} | {rate:.0f} |", flush=True)
dist.barrier()
dist.destroy_process_group()
