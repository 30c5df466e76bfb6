# One process, two GPUs: what a program that splits its model over two devices, or works on
# a device other than the current one, asks of the allocator. Run once per allocator, each
# in its own process; every check prints a line and the last line is a JSON summary:
#   python3 benches/gpu/torch_door/two_devices.py ALLOC     (native | sa_native | sa_pluggable)
#   python3 benches/gpu/torch_door/two_devices.py --compare (each allocator in turn; the
#                                                            losses must match PyTorch's)
# Checks (every value read back):
#   pipeline   a model split over cuda:0 and cuda:1 trains 20 steps (activations and
#              gradients cross devices); its losses are compared with PyTorch's allocator;
#   elsewhere  tensors made on cuda:1 while cuda:0 is current, freed from there;
#   side       a tensor written on a side stream of cuda:1, used on its default stream,
#              record_stream()ed and freed while in use: the next allocation may not overwrite
#              it before that use ends;
#   copy_free  a cuda:1 tensor copied to cuda:0 without blocking, freed at once;
#   stats      memory_allocated / reserved / stats / mem_get_info per device, empty_cache;
#   fraction   a memory fraction on cuda:1 refuses a large tensor there, not on cuda:0,
#              with an error that reads "CUDA out of memory." (torch.OutOfMemoryError but
#              through the pluggable door, which can raise only a RuntimeError);
#   graph      a CUDA graph captured and replayed on cuda:1 while cuda:0 is current;
#   threads    one thread per device allocating and freeing at once.
# Exits 1 if a check fails. Needs two GPUs; prints SKIP and exits 0 with fewer.
import json
import threading

from checks_common import ALLOCATORS, MiB, install, main, run_each, verdict

# cuBLAS may pick other kernels for other addresses (alignment): losses agree to float32's
# last digits, not bit for bit.
LOSS_TOLERANCE = 1e-5


def pipeline(torch):
    torch.manual_seed(0)
    d0, d1 = torch.device("cuda", 0), torch.device("cuda", 1)
    first = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.GELU(),
                                torch.nn.Linear(4096, 1024)).to(d0)
    second = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.GELU(),
                                 torch.nn.Linear(4096, 10)).to(d1)
    opt = torch.optim.AdamW(list(first.parameters()) + list(second.parameters()), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    losses = []
    for step in range(20):
        rows = 64 * (1 + step % 4)  # varying shapes: new sizes every step
        x = torch.randn(rows, 1024, generator=g).to(d0, non_blocking=True)
        y = torch.randint(0, 10, (rows,), generator=g).to(d1, non_blocking=True)
        h = first(x).to(d1)
        loss = torch.nn.functional.cross_entropy(second(h), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(float(loss.item()))
    ok = all(l == l and l < 10 for l in losses)
    return ok, f"20 steps, last loss {losses[-1]:.6f}", {"losses": losses}


def elsewhere(torch):
    torch.cuda.set_device(0)
    ts = [torch.full((k * MiB // 4 + 17,), float(k), device="cuda:1") for k in range(1, 9)]
    good = all(bool((t == float(k)).all()) for k, t in enumerate(ts, 1))
    on_1 = all(t.device.index == 1 for t in ts)
    before = torch.cuda.memory_allocated(1)
    del ts
    after = torch.cuda.memory_allocated(1)
    ok = good and on_1 and after < before and torch.cuda.current_device() == 0
    return ok, f"8 tensors on cuda:1 from cuda:0, values {'ok' if good else 'WRONG'}, " \
               f"allocated {before // MiB} -> {after // MiB} MiB", {}


def side(torch):
    d1 = torch.device("cuda", 1)
    n = 64 * MiB // 4
    bad = 0
    with torch.cuda.device(1):
        main = torch.cuda.current_stream()
        side_stream = torch.cuda.Stream()
        for _ in range(5):
            with torch.cuda.stream(side_stream):
                t = torch.full((n,), 3.0, device=d1)
            main.wait_stream(side_stream)
            torch.cuda._sleep(50_000_000)  # ~25 ms of GPU time on main before the read
            total = t.sum()  # reads t on the main stream, after the sleep
            t.record_stream(main)
            del t
            with torch.cuda.stream(side_stream):
                u = torch.full((n,), 5.0, device=d1)  # may reuse t's memory only after the read
            torch.cuda.synchronize(1)
            bad += int(total.item() != 3.0 * n)
            del u
    return bad == 0, f"5 rounds, {bad} reads saw the next tensor's values", {}


def copy_free(torch):
    bad = 0
    for k in range(5):
        src = torch.full((32 * MiB // 4,), float(k + 1), device="cuda:1")
        dst = src.to("cuda:0", non_blocking=True)
        del src
        junk = torch.full((32 * MiB // 4,), -1.0, device="cuda:1")  # may take src's memory
        bad += int(not bool((dst == float(k + 1)).all()))
        del junk, dst
    return bad == 0, f"5 copies, {bad} wrong", {}


def stats(torch):
    a = torch.empty(256 * MiB, dtype=torch.uint8, device="cuda:1")
    alloc1, alloc0 = torch.cuda.memory_allocated(1), torch.cuda.memory_allocated(0)
    reserved1 = torch.cuda.memory_reserved(1)
    s1 = torch.cuda.memory_stats(1)
    free_before, total = torch.cuda.mem_get_info(1)
    del a
    torch.cuda.empty_cache()
    free_after, _ = torch.cuda.mem_get_info(1)
    ok = (alloc1 >= 256 * MiB and reserved1 >= alloc1
          and s1.get("allocated_bytes.all.current", 0) >= 256 * MiB
          and free_after >= free_before + 200 * MiB)
    return ok, (f"cuda:1 allocated {alloc1 // MiB} MiB (cuda:0 {alloc0 // MiB}), reserved "
                f"{reserved1 // MiB}; empty_cache gave back {(free_after - free_before) // MiB} MiB"), {}


def fraction(torch, alloc):
    total = torch.cuda.get_device_properties(1).total_memory
    torch.cuda.set_per_process_memory_fraction(0.05, 1)
    refused, kind = False, "nothing"
    try:
        torch.empty(int(total * 0.2), dtype=torch.uint8, device="cuda:1")
    except RuntimeError as err:
        # What batch size finders test: a RuntimeError of one argument saying "CUDA out of
        # memory." PyTorch's pluggable hook cannot raise its OutOfMemoryError subclass.
        kind = type(err).__name__
        worded = len(err.args) == 1 and "CUDA out of memory." in str(err.args[0])
        typed = isinstance(err, torch.cuda.OutOfMemoryError) or alloc == "sa_pluggable"
        refused = worded and typed
    big0 = torch.empty(int(total * 0.2), dtype=torch.uint8, device="cuda:0")  # no cap on 0
    small1 = torch.ones(MiB, device="cuda:1")
    ok = refused and big0.numel() > 0 and float(small1.sum()) == MiB
    del big0, small1
    torch.cuda.set_per_process_memory_fraction(1.0, 1)
    torch.cuda.empty_cache()
    return ok, (f"cap on cuda:1 raised {kind}{'' if refused else ' (NOT a CUDA out-of-memory)'} "
                f"for a fifth of it; cuda:0 served one"), {}


def graph(torch):
    torch.cuda.set_device(0)
    with torch.cuda.device(1):
        x = torch.randn(8 * MiB, device="cuda:1")
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(2):
                out = (x * 2 + 1).sum()
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=s):
            tmp = x * 2
            out = (tmp + 1).sum()
        del tmp
        eager = [torch.full((8 * MiB,), 7.0, device="cuda:1") for _ in range(3)]
        for _ in range(3):
            g.replay()
        torch.cuda.synchronize(1)
        want = float((x.double() * 2 + 1).sum())
        got = float(out)
        bad = sum(int((t != 7.0).sum()) for t in eager)
    ok = abs(got - want) <= 1e-4 * abs(want) + 1.0 and bad == 0
    return ok, f"3 replays on cuda:1, output {'ok' if abs(got - want) <= 1e-4 * abs(want) + 1.0 else 'WRONG'}, {bad} eager elements overwritten", {}


def threads(torch):
    errors, bad = [], [0, 0]

    def work(dev):
        try:
            torch.cuda.set_device(dev)
            for k in range(200):
                t = torch.full(((k % 7 + 1) * MiB // 4,), float(dev + 1), device=f"cuda:{dev}")
                if not bool((t == float(dev + 1)).all()):
                    bad[dev] += 1
        except Exception as err:  # reported below
            errors.append(f"cuda:{dev}: {err!r}")
    workers = [threading.Thread(target=work, args=(d,)) for d in (0, 1)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    ok = not errors and bad == [0, 0]
    return ok, f"200 allocations per device at once, {sum(bad)} wrong" + (
        f"; {errors[0]}" if errors else ""), {}


CHECKS = [pipeline, elsewhere, side, copy_free, stats, fraction, graph, threads]


def run_one(alloc):
    install(alloc)
    import torch
    if torch.cuda.device_count() < 2:
        print(f"SKIP: {torch.cuda.device_count()} GPU(s); two are needed")
        return 0
    results = {}
    for check in CHECKS:
        try:
            ok, figure, detail = check(torch, alloc) if check is fraction else check(torch)
        except Exception as err:  # a check's failure is its result, not the script's end
            ok, figure, detail = False, f"raised {type(err).__name__}: {err}"[:300], {}
        torch.cuda.synchronize(0)
        torch.cuda.synchronize(1)
        results[check.__name__] = {"ok": ok, "figure": figure, **detail}
        print(f"{alloc:13} {check.__name__:10} {'PASS' if ok else 'FAIL'}  {figure}", flush=True)
    if alloc != "native":
        import streamalloc.torch as st
        results["served"] = st.raw_stats()["stats"]["allocs"]
    print(json.dumps(results))
    return 0 if all(r["ok"] for r in results.values() if isinstance(r, dict)) else 1


def compare():
    losses, failed = {}, []
    for run in run_each(__file__, timeout=300):
        alloc, summary = run.alloc, run.summary
        if run.skipped:
            print(run.last)
            return 0
        for line in run.lines:
            print(line)
        run.count_failure(failed)
        if summary is None:
            continue
        losses[alloc] = summary["pipeline"]["losses"]
        if alloc != "native":
            print(f"{alloc:13} served      {summary['served']} allocations")
    if "native" in losses:
        for alloc in ALLOCATORS[1:]:
            if alloc in losses:
                diff = max(abs(a - b) for a, b in zip(losses[alloc], losses["native"]))
                same = diff <= LOSS_TOLERANCE
                print(f"{alloc:13} losses     {'PASS' if same else 'FAIL'}  largest difference "
                      f"from PyTorch's allocator {diff:.2e}")
                if not same:
                    failed.append(alloc)
    return verdict("two_devices", failed)


if __name__ == "__main__":
    main(__file__, run_one, compare)
