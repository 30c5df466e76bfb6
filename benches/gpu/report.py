# Prints the goal table from the JSON files benches/gpu/run.sh wrote.
#   python report.py OUTDIR
import json, os, sys

D = sys.argv[1]

def load(name):
    try:
        return json.load(open(os.path.join(D, name + ".json")))
    except Exception as e:
        return {"error": f"missing: {e.__class__.__name__}"}

def f(v, fmt="{:.1f}"):
    return fmt.format(v) if isinstance(v, (int, float)) else "n/a"

rows = []
def row(what, native, ours, goal, ok):
    rows.append((what, native, ours, goal, "yes" if ok is True else ("NO" if ok is False else "?")))

def pairs_and_mixed(h, who):
    """`host_cost.py`'s pair figures for 4K/1M/64M, then its mixed figure, of `who`."""
    pairs = " / ".join(f(h[f"{who}_pair_{sz}"]) for sz in (4096, 1 << 20, 64 << 20))
    return f"{pairs}; {f(h[f'{who}_mixed'])}"

for work in ("gpt2", "resnet"):
    n, s = load(f"{work}_native"), load(f"{work}_streamalloc")
    if "error" in n or "error" in s:
        row(f"{work}: step", n.get("error", ""), s.get("error", ""), "", None); continue
    ratio = s["step_ms"] / n["step_ms"]
    row(f"{work}: step time ms", f(n["step_ms"]), f"{s['step_ms']:.1f} ({ratio:.3f}x)", "within 2% of native", ratio <= 1.02)
    rn = n["peak_reserved_mib"] / n["peak_allocated_mib"]; rs = s["peak_reserved_mib"] / s["peak_allocated_mib"]
    row(f"{work}: peak reserved / peak allocated", f"{rn:.3f} ({n['peak_reserved_mib']:.0f}/{n['peak_allocated_mib']:.0f} MiB)",
        f"{rs:.3f} ({s['peak_reserved_mib']:.0f}/{s['peak_allocated_mib']:.0f} MiB)", "<= 1.02", rs <= 1.02)
    diff = max(abs(a - b) for a, b in zip(n["losses"], s["losses"]))
    row(f"{work}: losses, max |ours - native|", " ".join(f"{x:.4f}" for x in n["losses"]), f"{diff:.2e}", "same losses", diff <= 1e-3)

mn, ms, mf = load("micro_native"), load("micro_streamalloc"), load("micro_floor")
if all("ns_per_op" in m for m in (mn, ms, mf)):
    row("Python alloc/free loop, ns/op", f(mn["ns_per_op"], "{:.0f}"), f"{ms['ns_per_op']:.0f} (hook floor {mf['ns_per_op']:.0f})",
        "<= hook floor + 10%", ms["ns_per_op"] <= 1.1 * mf["ns_per_op"])
else:
    row("Python alloc/free loop", mn.get("error", ""), ms.get("error", "") + mf.get("error", ""), "", None)

h = load("host_cost")
if "native_mixed" in h:
    for sz, label in ((4096, "4 KiB"), (1 << 20, "1 MiB"), (64 << 20, "64 MiB")):
        row(f"C++ malloc+free pair, {label}, ns", f(h[f"native_pair_{sz}"]), f(h[f"streamalloc_pair_{sz}"]), "<= 100", h[f"streamalloc_pair_{sz}"] <= 100)
    row(f"C++ mixed sizes, 64 live, ns/op (loops {h.get('harness', '-O0')})", f(h["native_mixed"]), f(h["streamalloc_mixed"]), "<= 150", h["streamalloc_mixed"] <= 150)
else:
    row("C++ host cost", h.get("error", ""), "", "", None)
h = load("host_cost_O0")
if "native_mixed" in h:
    row("same loops at -O0 (alloc_cpp.py's harness): pairs 4K/1M/64M; mixed", pairs_and_mixed(h, "native"),
        pairs_and_mixed(h, "streamalloc"), "", None)
h = load("host_cost_notrace")
if "native_mixed" in h:
    row("same, trace ring off (trace_capacity:0): pairs 4K/1M/64M; mixed", "", pairs_and_mixed(h, "streamalloc"), "", None)

# PyTorch 2.11 stashes isend tensors until wait() whatever the allocator (rs1, rs0); with
# BoundedSender (one line of the program changed) the activation is freed at `del y`. Time
# is compared with native PyTorch running the program unchanged.
plain = load("pp_native_rs1")
for variant, label in (("rs1", "PyTorch default: isend tensors stashed until wait()"),
                       ("rs0", "TORCH_NCCL_AVOID_RECORD_STREAMS=0: record_stream"),
                       ("staged", "rank 0 sends through streamalloc's BoundedSender, 128 MiB")):
    pn, ps = load(f"pp_native_{variant}"), load(f"pp_streamalloc_{variant}")
    if isinstance(pn, list) and isinstance(ps, list):
        n0, s0 = pn[0], ps[0]
        row(f"pp_isend ({label}): sender's extra peak MiB", f(n0["extra_peak_allocated_mib"], "{:.0f}"), f(s0["extra_peak_allocated_mib"], "{:.0f}"), "<= 256", s0["extra_peak_allocated_mib"] <= 256)
        base = plain[0] if isinstance(plain, list) else n0
        ratio = s0["seconds"] / base["seconds"]
        row(f"pp_isend ({label}): time s (native: the unchanged program)", f(base["seconds"], "{:.3f}"), f"{s0['seconds']:.3f} ({ratio:.3f}x)", "within 5%", ratio <= 1.05)
        row(f"pp_isend ({label}): data intact; our sender stats", str(pn[1].get("checksum_ok")), f"{ps[1].get('checksum_ok')}; {json.dumps(s0.get('streamalloc', {}))}", "True", ps[1].get("checksum_ok") is True)
    else:
        row(f"pp_isend ({label})", str(pn.get("error", "")) if isinstance(pn, dict) else "", str(ps.get("error", "")) if isinstance(ps, dict) else "", "", None)

o = load("torch_probe")
msg = o.get("oom_message", "")
row("OOM through PyTorch: exception, message", "", f"{o.get('oom_raised')}: {msg[:150]}", "our message", o.get("oom_raised") is not None and "out of memory: tried to allocate" in msg)
row("OOM: process usable afterwards; num_ooms", "", f"{o.get('usable_after_oom')}; {o.get('num_ooms')}", "True", o.get("usable_after_oom") is True)
row("record_stream hook: events recorded at the free", "", str(o.get("record_stream_events_at_free")), ">= 1", (o.get("record_stream_events_at_free") or 0) >= 1)
row("empty_cache hook: reserved MiB before / after", "", f"{f(o.get('reserved_before_empty_cache', 0) / 2**20, '{:.0f}')} / {f(o.get('reserved_after_empty_cache', 0) / 2**20, '{:.0f}')}", "drops", o.get("reserved_after_empty_cache", 1) < o.get("reserved_before_empty_cache", 0))
row("memory-fraction hook: limit GiB after set_per_process_memory_fraction(0.5)", "", f(o.get("limit_after_fraction_0.5_gib"), "{:.1f}"), "half the device", None)
row("dump_snapshot", "", json.dumps(o.get("snapshot")), "", o.get("snapshot") is not None)

print("| what | native PyTorch | streamalloc | goal | met |")
print("| --- | --- | --- | --- | --- |")
for r in rows:
    print("| " + " | ".join(str(c).replace("|", "/") for c in r) + " |")
