"""The table run.sh prints last, from the files its steps left in WORKDIR.

    python3 summary.py WORKDIR NGPU

Exits 1 if any check failed.
"""
import json, os, re, sys
W, ngpu = sys.argv[1], int(sys.argv[2])
rows, failed = [], []

def read(name, ext):
    p = os.path.join(W, f"{name}.{ext}")
    return open(p).read() if os.path.exists(p) else ""

def load(name):
    try:
        return json.load(open(os.path.join(W, name)))
    except Exception:
        return None

def exit_lines(name):
    out = []
    for line in read(name, "err").splitlines():
        if line.startswith("streamalloc: exit pid=") and "allocs=" in line:
            out.append(dict(re.findall(r"(\w+)=(\S+)", line)))
    return out

def row(what, ok, detail):
    rows.append((what, "PASS" if ok else "FAIL", detail))
    if not ok:
        failed.append(what)

mib = lambda b: f"{int(b) / 2**20:.0f} MiB"

# (a)
nat, sa = load("gpt2_native.json"), load("gpt2_sa.json")
lines = exit_lines("gpt2_sa")
served = [l for l in lines if int(l["allocs"]) > 0]
snap = os.path.join(W, "gpt2_snapshot.json")
snapped = os.path.exists(snap) and os.path.getsize(snap) > 0
ok = (read("gpt2_sa", "rc").strip() == "0" and sa is not None and sa.get("allocator") == "streamalloc"
      and len(served) >= 1 and snapped)
detail = f"no result; exit lines: {len(lines)}"
if sa:
    same = nat is not None and all(abs(a - b) < 1e-3 for a, b in zip(sa["losses"], nat["losses"]))
    detail = (f"allocator={sa['allocator']}; exit line allocs={served[0]['allocs'] if served else 'NONE'}; "
              f"snapshot {'written' if snapped else 'MISSING'}; step {sa['step_ms']:.1f} ms")
    detail += f" (native {nat['step_ms']:.1f})" if nat else ""
    detail += f"; peak reserved/allocated {sa['peak_reserved_mib']:.0f}/{sa['peak_allocated_mib']:.0f} MiB"
    detail += f" (native {nat['peak_reserved_mib']:.0f}/{nat['peak_allocated_mib']:.0f})" if nat else ""
    detail += f"; losses {'match' if same else 'DIFFER from'} native: {[round(x, 4) for x in sa['losses']]}"
row("(a) streamalloc run -- python3 gpt2_train.py", ok, detail)

# (b)
if ngpu >= 2:
    res = load("pp_sa.json") or []
    nat = load("pp_native.json") or []
    lines = exit_lines("pp_sa")
    for rank in (0, 1):
        mine = [l for l in lines if l.get("rank") == str(rank) and int(l["allocs"]) > 0]
        snap = os.path.join(W, f"pp_snapshot.rank{rank}.json")
        r = next((x for x in res if x and x.get("rank") == rank), None)
        n = next((x for x in nat if x and x.get("rank") == rank), None)
        ok = read("pp_sa", "rc").strip() == "0" and len(mine) >= 1 and os.path.exists(snap)
        detail = (f"exit line allocs={mine[0]['allocs'] if mine else 'NONE'} device={mine[0]['device'] if mine else '-'}; "
                  f"snapshot {os.path.basename(snap)} {'written' if os.path.exists(snap) else 'MISSING'}")
        if r:
            detail += (f"; extra peak {r['extra_peak_allocated_mib']:.0f} MiB, {r['seconds']:.3f} s"
                       + (f" (native {n['extra_peak_allocated_mib']:.0f} MiB, {n['seconds']:.3f} s)" if n else ""))
        row(f"(b) streamalloc run -- torchrun: rank {rank}", ok, detail)
else:
    rows.append(("(b) torchrun --nproc_per_node=2", "SKIP", f"{ngpu} GPU(s)"))

# (c)
def preload(name, expect_pass=True):
    out, err = read(name, "out"), read(name, "err")
    m = re.search(r"streamalloc stats: (\{.*\})", out)
    stats = json.loads(m.group(1))["stats"] if m else None
    bad = re.search(r"bad_words_malloc_free=(\d+) bad_words_async=(\d+)", out)
    return out, err, stats, bad

if os.path.exists(os.path.join(W, "nvcc.failed")):
    row("(c) nvcc -cudart shared preload_test.cu", False, "nvcc failed")
else:
    out, _, stats, _ = preload("preload_native")
    row("(c) preload_test without preload", "PASS" in out and "loaded: no" in out,
        "the test's own checks hold on CUDA's allocator")
    for name, how in (("preload_sa", "LD_PRELOAD=libstreamalloc_preload.so"),
                      ("preload_run", "streamalloc run --preload")):
        out, err, stats, bad = preload(name)
        lines = exit_lines(name)
        ok = ("\nPASS" in out and "loaded: yes" in out and stats is not None and stats["allocs"] >= 400
              and bool(lines))
        detail = (f"{bad.group(0) if bad else 'no result'}; allocs={stats['allocs'] if stats else '-'} "
                  f"frees={stats['frees'] if stats else '-'} cross_stream_waits={stats['cross_stream_waits'] if stats else '-'} "
                  f"segments={stats['segment_allocs'] if stats else '-'}")
        row(f"(c) preload_test under {how}", ok, detail)
    out, _, stats, bad = preload("preload_racy")
    caught = "FAIL" in out and bad is not None and int(bad.group(2)) > 0
    rows.append(("(c) preload_test --racy (user error: free on the wrong stream)",
                 "caught" if caught else "not caught",
                 (bad.group(0) if bad else "no result") + " (the check can fail; informational)"))

w = max(len(r[0]) for r in rows)
print()
print(f"| {'check'.ljust(w)} | result | detail |")
print(f"| {'-' * w} | ------ | ------ |")
for what, res, detail in rows:
    print(f"| {what.ljust(w)} | {res:6} | {detail} |")
print()
print("ALL PASS" if not failed else f"FAILED: {', '.join(failed)}")
sys.exit(1 if failed else 0)
