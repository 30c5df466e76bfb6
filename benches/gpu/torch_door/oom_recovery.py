# What a batch size finder does (accelerate's find_executable_batch_size, Lightning's
# scaler): train, and on an out-of-memory collect garbage, empty the cache, halve the batch
# and try again, then keep training. Run once per allocator, each in its own process, under
# a memory fraction so that the search is short:
#   python3 benches/gpu/torch_door/oom_recovery.py ALLOC    (native | sa_native | sa_pluggable)
#   python3 benches/gpu/torch_door/oom_recovery.py --compare
# The out-of-memory is recognised as those libraries do (a RuntimeError of one argument
# containing "CUDA out of memory."), whether it comes in the forward pass or in the
# backward pass (raised on autograd's device thread). After the search, 10 steps at the
# batch found must train, and with the model deleted and the cache emptied the allocated
# bytes must come back to what they were before it. Prints a line per allocator and a
# summary; exits 1 if an allocator fails or finds a batch smaller than PyTorch's.
import gc
import json

from checks_common import ALLOCATORS, MiB, install, main, run_each, verdict

LIMIT_GIB = 6.0  # the memory fraction, in GiB of the device
START_BATCH = 1 << 16


def is_cuda_out_of_memory(err):
    """accelerate's test (accelerate.utils.memory.should_reduce_batch_size)."""
    return isinstance(err, RuntimeError) and len(err.args) == 1 and \
        "CUDA out of memory." in str(err.args[0])


def run_one(alloc):
    install(alloc)
    import torch
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(LIMIT_GIB * (1 << 30) / total)
    torch.manual_seed(0)
    baseline = torch.cuda.memory_allocated()
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(2048, 2048), torch.nn.GELU())
                                  for _ in range(8)], torch.nn.Linear(2048, 16)).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step(batch):
        x = torch.randn(batch, 2048, device="cuda")
        y = torch.randint(0, 16, (batch,), device="cuda")
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return float(loss.item())

    batch, tries = START_BATCH, []
    while batch >= 1:
        try:
            step(batch)
            tries.append((batch, "ok"))
            break
        except Exception as err:  # only an out-of-memory may be retried
            if not is_cuda_out_of_memory(err):
                raise
            del err  # its traceback holds the failed step's tensors
            tries.append((batch, "oom"))
            gc.collect()
            torch.cuda.empty_cache()
            batch //= 2
    losses = [step(batch) for _ in range(10)]
    peak = torch.cuda.max_memory_reserved()
    del model, opt
    gc.collect()
    # cuBLAS keeps a workspace per handle and stream through the allocator: not ours to
    # count as left behind.
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None:
        clear()
    torch.cuda.empty_cache()
    after = torch.cuda.memory_allocated()
    ok = batch >= 1 and all(l == l for l in losses) and after <= baseline
    out = {"alloc": alloc, "ok": ok, "batch": batch, "tries": tries,
           "peak_reserved_mib": peak // MiB, "allocated_after_mib": (after - baseline) / MiB,
           "last_loss": losses[-1]}
    print(json.dumps(out))
    return 0 if ok else 1


def compare():
    found, failed = {}, []
    for run in run_each(__file__, timeout=600):
        alloc, r = run.alloc, run.summary
        run.count_failure(failed)
        if r is None:
            continue
        found[alloc] = r["batch"]
        ooms = sum(1 for _, what in r["tries"] if what == "oom")
        print(f"{alloc:13} {'PASS' if r['ok'] else 'FAIL'}  batch {r['batch']} after {ooms} "
              f"out-of-memory errors caught and retried; 10 steps trained (last loss "
              f"{r['last_loss']:.4f}); peak reserved {r['peak_reserved_mib']} MiB under "
              f"{LIMIT_GIB:.0f} GiB; allocated after the model's deletion "
              f"{r['allocated_after_mib']:+.1f} MiB")
    if "native" in found:
        for alloc in ALLOCATORS[1:]:
            if alloc in found and found[alloc] < found["native"]:
                failed.append(alloc)
                print(f"{alloc:13} FAIL  found a smaller batch than PyTorch's allocator")
    return verdict("oom_recovery", failed)


if __name__ == "__main__":
    main(__file__, run_one, compare)
