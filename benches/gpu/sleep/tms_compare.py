"""Times another allocator's sleep and wake the way ``bench.py`` times streamalloc's, in a
process of its own (each replaces PyTorch's allocator): TorchMemorySaver's ``pause`` /
``resume`` or vLLM's ``CuMemAllocator.sleep`` / ``wake_up``, for one size, with a CPU
backup and without, beside a plain pinned ``copy_`` of the same bytes. Run by ``bench.py``
when the package is installed:

    python3 benches/gpu/sleep/tms_compare.py torch_memory_saver|vllm GIB

Prints one line last: the seconds of each sleep and wake (steady: the second of two), the
backup's GB/s, and the pinned ``copy_``'s.
"""

from __future__ import annotations

import sys
import time

import torch

GIB = 1 << 30


def sync():
    torch.cuda.synchronize()


def timed(fn) -> float:
    sync()
    start = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - start


def pinned_copy(nbytes: int) -> tuple[float, float]:
    gpu = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    d2h = min(timed(lambda: host.copy_(gpu, non_blocking=True)) for _ in range(2))
    h2d = min(timed(lambda: gpu.copy_(host, non_blocking=True)) for _ in range(2))
    del gpu, host
    torch.cuda.empty_cache()
    return nbytes / d2h / 1e9, nbytes / h2d / 1e9


def torch_memory_saver(nbytes: int) -> dict:
    import torch_memory_saver as tms

    saver = getattr(tms, "torch_memory_saver", None) or getattr(tms, "memory_saver", None)
    if saver is None:
        saver = tms.TorchMemorySaver()
    if hasattr(saver, "hook_mode"):
        saver.hook_mode = "torch"  # no LD_PRELOAD needed
    out = {}
    for backup in (False, True):
        tag = f"bench_{int(backup)}"
        with saver.region(tag=tag, enable_cpu_backup=backup):
            x = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        x.fill_(5)
        times = [(timed(lambda: saver.pause(tag)), timed(lambda: saver.resume(tag))) for _ in range(2)]
        out["cpu" if backup else "none"] = times[-1]
        del x
    return out


def vllm(nbytes: int) -> dict:
    from vllm.device_allocator.cumem import CuMemAllocator

    allocator = CuMemAllocator.get_instance()
    out = {}
    for backup in (False, True):
        tag = f"bench_{int(backup)}"
        with allocator.use_memory_pool(tag=tag):
            x = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        x.fill_(5)
        offload = (tag,) if backup else ()
        times = [(timed(lambda: allocator.sleep(offload_tags=offload)),
                  timed(lambda: allocator.wake_up(tags=[tag]))) for _ in range(2)]
        out["cpu" if backup else "none"] = times[-1]
        del x
    return out


def main() -> int:
    name, gib = sys.argv[1], float(sys.argv[2])
    nbytes = int(gib * GIB)
    d2h, h2d = pinned_copy(int(min(gib, 8) * GIB))
    measured = {"torch_memory_saver": torch_memory_saver, "vllm": vllm}[name](nbytes)
    (ns, nw), (cs, cw) = measured["none"], measured["cpu"]
    print(f"backup none sleep {ns:.3f} s wake {nw:.3f} s; backup cpu sleep {cs:.3f} s wake {cw:.3f} s "
          f"({nbytes / cs / 1e9:.1f} / {nbytes / cw / 1e9:.1f} GB/s; pinned copy_ {d2h:.1f} / {h2d:.1f} GB/s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
