# Streams that are not PyTorch's: a library's own CUDA stream (CuPy, TensorRT, DALI, a
# custom extension) wrapped with torch.cuda.ExternalStream, used for a while and destroyed,
# as such libraries do, while the blocks freed on it are still in the cache. PyTorch's
# pooled streams live as long as the process; these do not. Each round creates a stream
# with the driver, allocates and frees tensors on it, synchronises and destroys it, then
# allocates tensors of the same and other sizes on the default stream (which may reuse the
# dead stream's blocks) and on a PyTorch side stream, reading every value back; the last
# rounds run under a memory fraction, so that the slow paths (waits on other streams,
# stitching, out-of-memory retries) meet the dead streams' blocks too.
#   python3 benches/gpu/torch_door/foreign_streams.py ALLOC   (native | sa_native | sa_pluggable)
#   python3 benches/gpu/torch_door/foreign_streams.py --compare
# Exits 1 if a value is wrong or an error is raised.
import ctypes
import json

from checks_common import MiB, install, main, run_each, verdict

ROUNDS = 30


def run_one(alloc):
    install(alloc)
    import torch
    torch.cuda.init()
    keep = torch.empty(1, device="cuda")  # the context is current on this thread
    cuda = ctypes.CDLL("libcuda.so.1")
    total = torch.cuda.get_device_properties(0).total_memory
    side = torch.cuda.Stream()
    bad = errors = 0
    first_error = None
    for r in range(ROUNDS):
        if r == ROUNDS * 2 // 3:
            # Tight from here: about what the rounds need, so the slow paths run.
            torch.cuda.set_per_process_memory_fraction(3.0 * (1 << 30) / total)
        try:
            handle = ctypes.c_void_p()
            rc = cuda.cuStreamCreate(ctypes.byref(handle), 1)  # CU_STREAM_NON_BLOCKING
            if rc != 0:
                raise RuntimeError(f"cuStreamCreate: {rc}")
            foreign = torch.cuda.ExternalStream(handle.value)
            sizes = [(r * 37 + k * 11) % 97 + 1 for k in range(12)]
            with torch.cuda.stream(foreign):
                ts = [torch.full((n * MiB // 4,), float(k), device="cuda") for k, n in enumerate(sizes)]
                sums = [t.sum() for t in ts]
            foreign.synchronize()
            bad += sum(int(float(s) != float(k) * t.numel()) for k, (s, t) in enumerate(zip(sums, ts)))
            del ts, sums
            rc = cuda.cuStreamDestroy_v2(handle)
            if rc != 0:
                raise RuntimeError(f"cuStreamDestroy: {rc}")
            us = [torch.full((n * MiB // 4,), -2.0, device="cuda") for n in sizes + [5, 150]]
            with torch.cuda.stream(side):
                vs = [torch.full((n * MiB // 4,), 3.0, device="cuda") for n in reversed(sizes)]
            side.synchronize()
            bad += sum(int(not bool((u == -2.0).all())) for u in us)
            bad += sum(int(not bool((v == 3.0).all())) for v in vs)
            del us, vs
        except Exception as err:  # counted: any error is a failure of the allocator here
            errors += 1
            first_error = first_error or f"round {r}: {type(err).__name__}: {err}"[:400]
        torch.cuda.synchronize()
    torch.cuda.set_per_process_memory_fraction(1.0)
    torch.cuda.empty_cache()
    del keep
    out = {"alloc": alloc, "ok": bad == 0 and errors == 0, "bad": bad, "errors": errors,
           "first_error": first_error}
    print(json.dumps(out))
    return 0 if out["ok"] else 1


def compare():
    failed = []
    for run in run_each(__file__, timeout=600):
        alloc, r = run.alloc, run.summary
        run.count_failure(failed)
        if r is None:
            continue
        print(f"{alloc:13} {'PASS' if r['ok'] else 'FAIL'}  {ROUNDS} foreign streams made, used "
              f"and destroyed: {r['bad']} wrong values, {r['errors']} errors"
              + (f" (first: {r['first_error']})" if r["first_error"] else ""))
    return verdict("foreign_streams", failed)


if __name__ == "__main__":
    main(__file__, run_one, compare)
