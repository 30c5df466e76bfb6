#!/usr/bin/env python3
"""Each step's time beside streamalloc's work in that step, from the result files of
`bench.py` / `caps.py` launches (`workloads.py --worker` writes them):

    python3 benches/gpu/dist/steps.py OUT/results/*.rank0.json

Per file: the allocator column, the median of the timed steps, then one line per step
(warm-up steps marked) with its time and what streamalloc's counters say it did in it:
bytes mapped and unmapped, stitches made and revived, device synchronisations,
cross-stream waits, and the host time spent in the driver's virtual-memory calls
(`Stats::vmm_ns`), and the process's CPU time and voluntary context switches in the step
(every thread; any allocator), and the time the host took to issue the step. A step
whose excess over its neighbours matches its driver time lost that time to mapping; one
issued in its whole time was bound by the host, one issued early waited for the device
(CUDA's synchronisation spins, so CPU time alone counts that wait too). Exit status 1 if a file cannot be read as a worker's result.
"""

import argparse
import json
import sys

# Counters shown, in this order, and how.
SHOWN = (
    ("page_map_bytes", "mapped"), ("page_unmap_bytes", "unmapped"), ("stitches", "stitches"),
    ("stitched_map_bytes", "stitched"), ("stitch_revivals", "revived"), ("device_syncs", "syncs"),
    ("cross_stream_waits", "waits"), ("vmm_ns", "driver"), ("allocs", "allocations"),
    ("events_recorded", "events recorded"), ("event_queries", "event queries"),
    ("slow_paths", "slow paths"), ("slow_path_ns", "in slow paths"),
)


def amount(key, value):
    if key.endswith("_bytes"):
        return f"{value / 2**20:.0f} MiB"
    if key.endswith("_ns"):
        return f"{value / 1e6:.1f} ms"
    return str(value)


def describe(path):
    """The lines for one result file; raises ValueError if it is not a worker's result."""
    try:
        with open(path) as f:
            result = json.load(f)
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"{path}: {err}") from None
    if not isinstance(result, dict) or "step_ms" not in result:
        why = result.get("error") if isinstance(result, dict) else None
        raise ValueError(f"{path}: no step times" + (f" (the launch failed: {why})" if why else ""))
    warmup = result.get("warmup", 0)
    lines = [f"{path}: {result.get('row', '?')} under {result.get('column', '?')}, rank "
             f"{result.get('rank', '?')}: median of the timed steps {result.get('step_ms_median', 0):.1f} ms"]
    work = result.get("sa_steps") or []
    host = result.get("step_host") or []
    for index, ms in enumerate(result["step_ms"]):
        did = work[index] if index < len(work) else {}
        parts = [f"{label} {amount(key, did[key])}" for key, label in SHOWN if did.get(key)]
        if index < len(host):
            issue = host[index].get("issue_ms")  # absent in results of earlier builds
            parts.insert(0, f"cpu {host[index]['cpu_ms']:.0f} ms, {host[index]['switches']} switches"
                         + (f", issued in {issue:.0f} ms" if issue is not None else ""))
        mark = " (warm-up)" if index < warmup else ""
        lines.append(f"  step {index}{mark}: {ms:8.1f} ms" + (f"   {', '.join(parts)}" if parts else ""))
    return lines


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", nargs="+", help="result files (OUT/results/NAME.rankR.json)")
    args = parser.parse_args(argv)
    failed = False
    for path in args.results:
        try:
            print("\n".join(describe(path)))
        except ValueError as err:
            print(f"steps.py: {err}", file=sys.stderr)
            failed = True
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
