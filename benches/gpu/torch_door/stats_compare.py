# torch.cuda.memory_stats() after the same small workload, PyTorch's allocator against
# streamalloc's native door, one fresh process each, on ONE GPU; about 30 s.
#   python3 stats_compare.py [OUT.json]     # PyTorch expandable_segments:True vs streamalloc's
#                                           # default, then PyTorch's default vs streamalloc
#                                           # expandable_segments:false
#   python3 stats_compare.py --dry-run      # the comparison's logic on canned statistics
# The workload: small and large tensors, frees, a tensor used on a side stream
# (record_stream) and freed while that stream works, an empty_cache, more allocations. For
# each pair it prints how many keys are non-zero under each allocator and, for every key
# non-zero under both, both values and whether they agree: exactly for what both count the
# same way (allocations, active blocks, allocated, active and requested bytes: both round
# requests to 512 bytes), within the mapping granularity for reserved bytes (PyTorch maps
# 20 MiB pages for large blocks, streamalloc 2 MiB and up: current and peak), and as
# information only for what the two policies decide differently (bytes mapped and unmapped
# over time, device calls, synchronisations, segments and inactive split blocks of whole
# segments). The verdict: at least as many non-zero keys as
# PyTorch's, and every compared key agrees. The table is printed last.
import json
import os
import subprocess
import sys

MiB = 1 << 20
HERE = os.path.dirname(os.path.abspath(__file__))
PAIRS = [
    ("PyTorch expandable_segments:True", {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"},
     "streamalloc default", {}),
    ("PyTorch default", {}, "streamalloc expandable_segments:false",
     {"STREAMALLOC_CONF": "expandable_segments:false"}),
]
EXACT = ("allocation.", "active.", "allocated_bytes.", "active_bytes.", "requested_bytes.",
         "oversize_allocations.")
POLICY = ("segment.", "inactive_split", "num_", "oversize_segments.")


def workload():
    """Runs in a fresh process (argv: --run streamalloc|pytorch); prints memory_stats()."""
    alloc = sys.argv[2]
    if alloc == "streamalloc":
        import streamalloc.torch as st
        st.install(door="native")
    import torch
    keep = [torch.empty(n, dtype=torch.uint8, device="cuda") for n in (512, 4096, 100_000, 1 << 20)]
    large = [torch.empty(n * MiB, dtype=torch.uint8, device="cuda") for n in (3, 12, 30)]
    scratch = [torch.empty(n, dtype=torch.uint8, device="cuda") for n in (3000, 700_000)]
    del scratch
    del large[1]
    side = torch.cuda.Stream()
    shared = torch.empty(5 * MiB, dtype=torch.uint8, device="cuda")
    with torch.cuda.stream(side):
        torch.cuda._sleep(50_000_000)  # keeps the side stream busy past the free below
        shared.add_(1)
    shared.record_stream(side)
    del shared
    mid = torch.cuda.memory_stats()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    keep += [torch.empty(n * MiB, dtype=torch.uint8, device="cuda") for n in (6, 64)]
    keep.append(torch.empty(2048, dtype=torch.uint8, device="cuda"))
    torch.cuda.synchronize()
    out = {"final": torch.cuda.memory_stats(), "active_while_side_stream_works":
           mid.get("active.all.current", 0) - mid.get("allocation.all.current", 0)}
    print("STATS " + json.dumps(out))


def measure(env_extra, alloc):
    env = dict(os.environ)
    for key in ("PYTORCH_CUDA_ALLOC_CONF", "STREAMALLOC_CONF"):
        env.pop(key, None)
    env.update(env_extra)
    proc = subprocess.run([sys.executable, __file__, "--run", alloc], env=env, text=True,
                          capture_output=True, timeout=240)
    for line in proc.stdout.splitlines():
        if line.startswith("STATS "):
            return json.loads(line[6:])
    raise RuntimeError(f"{alloc} ({env_extra}) printed no statistics: {proc.stderr[-800:]}")


def agree(key, theirs, mine):
    """'exact' / 'within ...' / 'policy' and whether the values agree."""
    if key.startswith(EXACT):
        return "exact", theirs == mine
    if key.startswith("reserved_bytes.") and key.endswith((".current", ".peak")):
        slack = max(20 * MiB, abs(theirs) // 10)
        return "within 20 MiB or 10%", abs(theirs - mine) <= slack
    if key == "max_split_size":
        return "exact", theirs == mine
    return "policy", True


def compare(name_a, a, name_b, b):
    """Rows and verdict for the statistics `a` (PyTorch's) and `b` (streamalloc's)."""
    nz_a = {k for k, v in a["final"].items() if v != 0}
    nz_b = {k for k, v in b["final"].items() if v != 0}
    rows, bad = [], []
    for key in sorted(nz_a & nz_b):
        how, ok = agree(key, a["final"][key], b["final"][key])
        rows.append((key, a["final"][key], b["final"][key], how, ok))
        if not ok:
            bad.append(key)
    only_a, only_b = sorted(nz_a - nz_b), sorted(nz_b - nz_a)
    verdict = len(nz_b) >= len(nz_a) and not bad
    return dict(pair=f"{name_a} vs {name_b}", nonzero=(len(nz_a), len(nz_b)), keys=len(a["final"]),
                rows=rows, bad=bad, only_pytorch=only_a, only_streamalloc=only_b,
                active_waiting=(a["active_while_side_stream_works"], b["active_while_side_stream_works"]),
                verdict=verdict)


def report(results):
    for r in results:
        print(f"\n## {r['pair']}")
        print("| key | PyTorch | streamalloc | compared | agrees |")
        print("|---|---|---|---|---|")
        for key, x, y, how, ok in r["rows"]:
            print(f"| {key} | {x} | {y} | {how} | {'yes' if ok else 'NO'} |")
        print(f"non-zero only under PyTorch: {', '.join(r['only_pytorch']) or 'none'}")
        print(f"non-zero only under streamalloc: {', '.join(r['only_streamalloc']) or 'none'}")
    print("\n| pair | non-zero keys (PyTorch / streamalloc, of N) | disagreeing keys | "
          "blocks awaiting the side stream | verdict |")
    print("|---|---|---|---|---|")
    for r in results:
        a, b = r["nonzero"]
        print(f"| {r['pair']} | {a} / {b} of {r['keys']} | {', '.join(r['bad']) or 'none'} | "
              f"{r['active_waiting'][0]} / {r['active_waiting'][1]} | "
              f"{'PASS' if r['verdict'] else 'FAIL'} |")


def canned(extra):
    final = {f"allocation.all.{f}": 3 for f in ("current", "peak", "allocated", "freed")}
    final.update({"reserved_bytes.all.current": 40 * MiB, "num_device_alloc": 2,
                  "max_split_size": -1})
    final.update(extra)
    return {"final": final, "active_while_side_stream_works": 1}


def main():
    if "--run" in sys.argv:
        workload()
        return 0
    if "--dry-run" in sys.argv:
        results = [compare("PyTorch", canned({}), "streamalloc",
                           canned({"reserved_bytes.all.current": 42 * MiB, "num_device_alloc": 5,
                                   "segment.all.current": 1})),
                   compare("PyTorch", canned({"active_bytes.all.current": 512}), "streamalloc",
                           canned({"active_bytes.all.current": 1024}))]
        report(results)
        assert results[0]["verdict"] and not results[1]["verdict"], results
        return 0
    results = []
    for name_a, env_a, name_b, env_b in PAIRS:
        a = measure(env_a, "pytorch")
        b = measure(env_b, "streamalloc")
        results.append(compare(name_a, a, name_b, b))
    out = next((arg for arg in sys.argv[1:] if not arg.startswith("--")), None)
    if out:
        with open(out, "w") as f:
            json.dump(results, f, indent=1)
    report(results)
    return 0 if all(r["verdict"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
