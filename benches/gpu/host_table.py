"""The tables of benches/gpu/host_only.sh, from the files it wrote in OUT.

    python3 benches/gpu/host_table.py OUT

Prints the host's primitives, the C ABI's figures per setting, and last the four
acceptance figures against their targets. A figure whose run is missing or failed reads
"not run" and fails its row.
"""

import glob
import json
import os
import re
import sys

TARGETS = (
    ("C ABI malloc+free pair, 4 KiB, default configuration", "ns", 60.0),
    ("C ABI mixed sizes, default configuration", "ns/op", 100.0),
    ("host_cost.py mixed sizes, streamalloc / PyTorch", "x", 0.5),
    ("Python alloc/free loop, streamalloc / PyTorch", "x", 0.85),
)


def read(path):
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def abi(path):
    """host_abi's figures for the one library it timed: {pair4K, pair1M, pair64M, mixed}."""
    text = read(path)
    if not text:
        return None
    fields = re.findall(r"(pair4K|pair1M|pair64M|mixed) ([\d.]+)", text)
    return {name: float(value) for name, value in fields} or None


def best(pattern, key):
    values = []
    for path in sorted(glob.glob(pattern)):
        try:
            with open(path) as f:
                result = json.load(f)
        except (OSError, ValueError):
            continue
        if key in result:
            values.append(result[key])
    return min(values) if values else None, values


def main(out):
    print(f"primitives before: {read(os.path.join(out, 'primitives_before.txt')) or 'not run'}")
    print(f"primitives after:  {read(os.path.join(out, 'primitives_after.txt')) or 'not run'}")
    print()
    print("C ABI without PyTorch (host_abi.cpp, best of 7 rounds), ns per pair / per mixed op:")
    print(f"{'setting':<34}{'pair 4 KiB':>12}{'pair 1 MiB':>12}{'pair 64 MiB':>13}{'mixed':>10}")
    settings = (
        ("default (ring on, coarse clock)", "abi_default.txt"),
        ("trace_clock:precise (rdtsc)", "abi_precise_clock.txt"),
        ("trace_capacity:0 (ring off)", "abi_ring_off.txt"),
    )
    figures = {}
    for name, file in settings:
        row = abi(os.path.join(out, file))
        figures[file] = row
        cells = [f"{row[k]:.1f}" if row and k in row else "not run" for k in ("pair4K", "pair1M", "pair64M", "mixed")]
        print(f"{name:<34}{cells[0]:>12}{cells[1]:>12}{cells[2]:>13}{cells[3]:>10}")
    host_cost = None
    text = read(os.path.join(out, "host_cost.json"))
    if text:
        try:
            host_cost = json.loads(text)
        except ValueError:
            host_cost = None
    if host_cost:
        print()
        print("host_cost.py (C++ inside PyTorch, best of 5), ns: " + ", ".join(f"{k} {v}" for k, v in host_cost.items()))
    native, native_all = best(os.path.join(out, "loop_native_*.json"), "ns_per_op")
    ours, ours_all = best(os.path.join(out, "loop_streamalloc_*.json"), "ns_per_op")
    if native_all or ours_all:
        print()
        print(f"Python loop, ns per op (best pass of each process): PyTorch {[round(v) for v in native_all]}, "
              f"streamalloc {[round(v) for v in ours_all]}")
    default = figures.get("abi_default.txt") or {}
    measured = [
        (default.get("pair4K"), None),
        (default.get("mixed"), None),
        (None, None),
        (None, None),
    ]
    if host_cost and host_cost.get("native_mixed"):
        measured[2] = (host_cost["streamalloc_mixed"] / host_cost["native_mixed"],
                       f"{host_cost['streamalloc_mixed']} / {host_cost['native_mixed']} ns")
    if native and ours:
        measured[3] = (ours / native, f"{ours:.0f} / {native:.0f} ns")
    print()
    print(f"{'acceptance':<56}{'measured':>24}{'target':>14}  met")
    ok = True
    for (name, unit, target), (value, detail) in zip(TARGETS, measured):
        if value is None:
            shown, met = "not run", False
        elif unit == "x":
            shown, met = f"{value:.2f}x ({detail})", value <= target
        else:
            shown, met = f"{value:.1f} {unit}", value <= target
        ok &= met
        print(f"{name:<56}{shown:>24}{'<= ' + (f'{target:.2f}x' if unit == 'x' else f'{target:.0f} {unit}'):>14}  {'yes' if met else 'no'}")
    return 0 if ok else 1


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    sys.exit(main(sys.argv[1]))
