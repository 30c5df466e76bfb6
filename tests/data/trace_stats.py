# The reference figures of a PyTorch memory snapshot, as PyTorch's own tooling computes them
# (plain pickle, no streamalloc): tests/viz_cli.rs checks that snapshots we write read the same.
# Reference numbers of a PyTorch snapshot trace: peak live bytes (alloc..free_completed)
# and the native caching allocator's peak reserved (segment_alloc/free) over the trace.
import gzip, pickle, sys
for f in sys.argv[1:]:
    d = pickle.load(gzip.open(f, "rb") if f.endswith(".gz") else open(f, "rb"))
    tr = [t for t in d["device_traces"] if t][0]
    live = res = peak_live = peak_res = 0
    n = 0
    for e in tr:
        a = e["action"]
        if a == "alloc": live += e["size"]; n += 1
        elif a == "free_completed": live -= e["size"]
        elif a in ("segment_alloc", "segment_map"): res += e["size"]
        elif a in ("segment_free", "segment_unmap"): res -= e["size"]
        peak_live = max(peak_live, live); peak_res = max(peak_res, res)
    print(f"{f.split('/')[-1]:28s} allocs={n:7d} peak_live_mib={peak_live/2**20:9.1f} native_peak_reserved_mib={peak_res/2**20:9.1f} ratio={peak_res/max(peak_live,1):.4f}")
