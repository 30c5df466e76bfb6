"""Splits callgrind's instruction counts of benches/host_path.rs by component.

    python3 benches/callgrind_split.py BINARY OUT.cg OPS [OUT.cg OPS ...]

Each OUT.cg is a callgrind profile of BINARY recorded with `--dump-instr=yes`, OPS the
operations its measured loop ran. Every instruction executed in BINARY is traced back
through its inline chain (`addr2line -i`) to the innermost function that is not the standard
library's: a crate the engine uses for one job (hashbrown: the address map, slab: the
arena, spin: the lock) counts under that job wherever it was inlined, the standard
library's helpers under the code that called them, project code under its module (and,
for the streams' table, its type). Calls into other objects (libc's memcpy) count at their call
site. Prints one column per profile, instructions per operation.
"""

import collections
import os
import re
import subprocess
import sys

# (prefix of the frame's function, component), first match wins. A frame of the
# standard library (or of a primitive type's impl) is skipped: its cost is its caller's.
COMPONENTS = [
    ("hashbrown::", "address map (hash lookup)"),
    ("std::collections::hash", "address map (hash lookup)"),
    ("slab::", "arena: blocks and their states"),
    ("spin::", "engine lock"),
    ("thin_vec::", "engine policy: allocate, free, lists"),
    ("streamalloc::ffi::error::", "C ABI guard, last-error slot"),
    ("streamalloc::ffi::", "C ABI translation (exports, pools, sources)"),
    ("streamalloc::registry", "registry: device lookup, poison flag"),
    ("streamalloc_allocator::lock::", "engine lock"),
    ("streamalloc_allocator::trace::", "trace ring"),
    ("streamalloc_allocator::backend::", "simulated device (its clock; slow paths' calls)"),
    ("streamalloc_allocator::stats::", "statistics"),
    ("streamalloc_allocator::counters::", "statistics"),
    ("streamalloc_allocator::allocator::torch_stats::", "statistics"),
    ("streamalloc_allocator::lifetime::streams::HotList", "hot list"),
    ("streamalloc_allocator::lifetime::streams::", "streams: slot lookup"),
    ("streamalloc_allocator::lifetime::fences::", "fences"),
    ("streamalloc_allocator::util::", "address map (hash lookup)"),
    ("streamalloc_allocator::pool::arena::", "arena: blocks and their states"),
    ("streamalloc_allocator::pool::free_list::", "free lists (best fit)"),
    ("streamalloc_allocator::pool::size::", "sizes and rounding"),
    ("streamalloc_allocator::pool::", "pool: other"),
    ("streamalloc_allocator::allocator::", "engine policy: allocate, free, lists"),
    ("streamalloc_allocator::", "engine: other"),
    ("host_path::", "the benchmark's own loop"),
]
SKIPPED = ("core::", "alloc::", "std::")


# libc functions whose whole cost is their caller's: what they do is on its behalf.
LIBC_LEAVES = r"^__(mem(cpy|move|set|cmp)|str)|^(malloc|free|realloc|calloc|_int_)"


def parse(path, binary):
    """Self cost per address of `binary`, plus the inclusive cost of calls from `binary`
    into other objects, counted at the call site."""
    costs = collections.Counter()
    names = {"ob": {}, "fn": {}}
    ob = cob = cfn = None
    addr = 0
    pending_call = False
    call_foreign = False
    positions = 1  # position columns before the cost: the address, then maybe the line
    for line in open(path):
        line = line.rstrip("\n")
        if line.startswith("positions:"):
            positions = len(line.split()) - 1
            continue
        m = re.match(r"^(c?ob)=\((\d+)\)(?: (.*))?$", line)
        if m:
            kind, ident, name = m.groups()
            table = names["ob"]  # object ids are shared between ob= and cob=
            if name:
                table[ident] = os.path.realpath(name)
            if kind == "ob":
                ob = table.get(ident)
                cob = None
            else:
                cob = table.get(ident)
            continue
        m = re.match(r"^(c?fn)=\((\d+)\)(?: (.*))?$", line)
        if m:
            kind, ident, name = m.groups()
            if name:
                names["fn"][ident] = name
            if kind == "cfn":
                cfn = names["fn"].get(ident, "")
            continue
        if line.startswith("calls="):
            pending_call = True
            # Only leaves of libc: a call that comes back into the binary (the program's
            # start) is counted where it lands.
            call_foreign = cob is not None and cob != binary and re.search(LIBC_LEAVES, cfn or "")
            continue
        fields = line.split()
        if len(fields) <= positions or not re.match(r"^(0x[0-9a-f]+|[+-]\d+|\*)$", fields[0]):
            continue
        where, cost = fields[0], int(fields[positions])
        if where.startswith("0x"):
            addr = int(where, 16)
        elif where != "*":
            addr += int(where)
        if pending_call:
            pending_call = False
            if call_foreign and ob == binary:
                costs[addr] += cost
            cob = cfn = None
            continue
        if ob == binary:
            costs[addr] += cost
    return costs


def chains(binary, addresses):
    """address -> [(function, file)], innermost frame first."""
    out = {}
    addresses = sorted(addresses)
    text = subprocess.run(
        ["addr2line", "-e", binary, "-i", "-f", "-C", "-a"] + [hex(a) for a in addresses],
        capture_output=True, text=True, check=True,
    ).stdout.splitlines()
    current = None
    i = 0
    while i < len(text):
        line = text[i]
        if line.startswith("0x") and i + 1 < len(text):
            current = int(line, 16)
            out[current] = []
            i += 1
            continue
        function, location = line, text[i + 1] if i + 1 < len(text) else "??:0"
        out[current].append((function, location.split(":")[0]))
        i += 2
    return out


def component(chain):
    for function, _ in chain:
        name = function.lstrip("<")
        for prefix, part in COMPONENTS:
            if name.startswith(prefix):
                return part
        if name.startswith(SKIPPED) or " as core::" in name or " as alloc::" in name or " as std::" in name:
            continue
        if name.split("::")[0] in ("usize", "u64", "u32", "i64", "i32", "u8", "bool", "T", "[T]"):
            continue
    return "other (the standard library alone: slow paths' collections)"


def main(argv):
    if len(argv) < 4 or len(argv) % 2:
        sys.exit(__doc__)
    binary, runs = os.path.realpath(argv[1]), [(argv[i], int(argv[i + 1])) for i in range(2, len(argv), 2)]
    profiles = [(path, ops, parse(path, binary)) for path, ops in runs]
    addresses = set().union(*(costs.keys() for _, _, costs in profiles))
    chain = chains(binary, addresses)
    table = []
    for path, ops, costs in profiles:
        parts = collections.Counter()
        for addr, cost in costs.items():
            parts[component(chain.get(addr, []))] += cost
        table.append((path, ops, parts))
    names = sorted({n for _, _, p in table for n in p}, key=lambda n: -max(p[n] / o for _, o, p in table))
    names = [n for n in names if max(p[n] / o for _, o, p in table) >= 0.05]
    heads = [path.rsplit("/", 1)[-1].rsplit(".", 1)[0] for path, _, _ in table]
    width = max(12, *(len(h) + 2 for h in heads))
    print(f"{'instructions per operation':<44}" + "".join(f"{h:>{width}}" for h in heads))
    for n in names:
        print(f"{n:<44}" + "".join(f"{p[n] / o:>{width}.1f}" for _, o, p in table))
    print(f"{'total':<44}" + "".join(f"{sum(p.values()) / o:>{width}.1f}" for _, o, p in table))


if __name__ == "__main__":
    main(sys.argv)
