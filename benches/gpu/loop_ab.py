# The Python alloc/free loop of alloc_bench.py (micro) with the hook floor and builds of
# libstreamalloc.so alternating pass by pass in one process, behind pluggable_switch.c.
# Why one process: see pluggable_switch.c; on the GPU host a process's speed moves by up to
# 2x with the host's load, so separate processes mostly compare the host with itself.
#   python loop_ab.py SWITCH.so OUT.json NAME=LIB[@CONF] [NAME=LIB[@CONF] ...]
# CONF is that build's STREAMALLOC_CONF (e.g. new_untraced=new.so@trace_capacity:0): each
# build is loaded from its own copy, so one library can appear with several settings, and
# reads its configuration at its first allocation, in its warm-up pass.
# LOOP_ROUNDS (default 40) rounds, each one pass of every mode in a rotated order, after one
# warm-up pass each. Prints per mode the best and median ns/op, and for builds the median
# over rounds of (build's pass / floor's pass in the same round) - 1.
import ctypes, json, os, random, shutil, statistics, sys, tempfile
from micro_loop import micro_pass, micro_sizes

SWITCH, OUT, SPECS = sys.argv[1], sys.argv[2], sys.argv[3:]
if not SPECS:
    sys.exit("usage: loop_ab.py SWITCH.so OUT.json NAME=LIB[@CONF] [NAME=LIB[@CONF] ...]")
ROUNDS = int(os.environ.get("LOOP_ROUNDS", 40))
if ROUNDS < 1:
    sys.exit("LOOP_ROUNDS must be at least 1")
import torch

torch.cuda.memory.change_current_allocator(
    torch.cuda.memory.CUDAPluggableAllocator(SWITCH, "ps_malloc", "ps_free"))
switch = ctypes.CDLL(SWITCH)  # the handle PyTorch opened: same library, same state
switch.ps_load.argtypes = [ctypes.c_char_p]
variants = []
for spec in SPECS:
    name, _, rest = spec.partition("=")
    lib, _, conf = rest.partition("@")
    if not name or name == "floor" or name in [v[0] for v in variants] or not os.path.isfile(lib):
        sys.exit(f"bad variant {spec!r}: NAME=LIB[@CONF] with a new name and an existing file")
    variants.append((name, lib, conf))
names, confs = ["floor"], [None]
copies = tempfile.mkdtemp(prefix="loop_ab_")
for name, lib, conf in variants:
    # A second dlopen of a path already loaded would return the first build's handle.
    copy = os.path.join(copies, f"{name}.so")
    shutil.copy(lib, copy)
    if switch.ps_load(copy.encode()) != len(names):
        sys.exit(f"cannot load {name}={lib} (see stderr)")
    names.append(name)
    confs.append(conf)

sizes = micro_sizes(random.Random(7))

def one_pass(mode):
    """One pass of the loop on `mode`; ns per operation. Every pass pops the same indices."""
    assert switch.ps_set_mode(mode) == 0
    return micro_pass(torch, sizes, random.Random(11))[0]

outer_conf = os.environ.get("STREAMALLOC_CONF")
for mode in range(len(names)):  # warm-up: configuration, segments, caches, the interpreter
    conf = confs[mode] if confs[mode] else outer_conf
    if conf is None:
        os.environ.pop("STREAMALLOC_CONF", None)
    else:
        os.environ["STREAMALLOC_CONF"] = conf
    one_pass(mode)
shutil.rmtree(copies)
passes = {name: [] for name in names}
for r in range(ROUNDS):
    order = [(r + k) % len(names) for k in range(len(names))]
    for mode in order:
        passes[names[mode]].append(one_pass(mode))

floor = passes["floor"]
rows = []
for name in names:
    v = passes[name]
    row = dict(name=name, best=min(v), median=statistics.median(v))
    if name != "floor":
        row["best_over_floor_best"] = min(v) / min(floor) - 1
        row["median_paired_over_floor"] = statistics.median(x / f - 1 for x, f in zip(v, floor))
    rows.append(row)
with open(OUT, "w") as f:
    json.dump(dict(rounds=ROUNDS, rows=rows, passes=passes), f)
print(f"| mode | best ns/op | median ns/op | best over floor's best | median of paired (pass / floor's pass) |")
print("| --- | --- | --- | --- | --- |")
for row in rows:
    extra = ("| | |" if row["name"] == "floor" else
             f"| {row['best_over_floor_best'] * 100:+.1f}% | {row['median_paired_over_floor'] * 100:+.1f}% |")
    print(f"| {row['name']} | {row['best']:.1f} | {row['median']:.1f} {extra}")
