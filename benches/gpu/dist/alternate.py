#!/usr/bin/env python3
"""Alternating launches of one row of `workloads.py` under several allocators, each step's
time beside what the allocator did in it: for telling a slower allocator from a slower
launch, since a host's step times drift from one launch to the next.

    python3 alternate.py OUT ROW NGPU COLUMN...

COLUMN is a column of `workloads.py` (pt, pt_expandable, sa) or `sa_conf=KEY:VALUE,...`
(streamalloc configured so). The columns run in the order given, one torchrun launch each
on GPUs 0..NGPU-1: repeat them to alternate (`pt_expandable sa pt_expandable sa`).
Every rank writes OUT/NN_ROW_COLUMN.rankR.json; `steps.py` prints any of them step by step.
Printed last: each launch's median timed step (rank 0), then each column's median over its
launches and its ratio to the first column's. DIST_WARMUP (2) and DIST_STEPS (8) as in
`workloads.py`; DIST_TIMEOUT (150 s per launch). Exit status 1 if a launch gave no result.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from workloads import COLUMNS, COMMON_ENV, env_int  # noqa: E402

KNOWN = {name for name, _, _ in COLUMNS}


def parse_column(text):
    """(column, streamalloc configuration or None); ValueError for an unknown column."""
    column, _, conf = text.partition("=")
    if column not in KNOWN or (column == "sa_conf") != bool(conf):
        raise ValueError(f"unknown column '{text}' (one of {sorted(KNOWN - {'sa_conf'})} or sa_conf=CONF)")
    return column, conf or None


def launch(out, index, row, column, conf, ngpu, timeout):
    """Runs one launch; returns rank 0's result (a dict) or None, and the seconds it took."""
    env = dict(os.environ, **COMMON_ENV, CUDA_VISIBLE_DEVICES=",".join(map(str, range(ngpu))))
    env["DIST_WARMUP"] = str(env_int("DIST_WARMUP", 2))
    env["DIST_STEPS"] = str(env_int("DIST_STEPS", 8))
    for key in ("STREAMALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF", "DIST_SA_CONF"):
        env.pop(key, None)
    env.update({k: v for k, v in dict((c, e) for c, _, e in COLUMNS)[column].items() if v is not None})
    if conf:
        env["STREAMALLOC_CONF"] = env["DIST_SA_CONF"] = conf
    prefix = os.path.join(out, f"{index:02d}_{row}_{column}")
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ngpu}",
            os.path.join(HERE, "workloads.py"), "--worker", row, column, prefix]
    started = time.monotonic()
    with open(prefix + ".log", "w") as log:
        try:
            subprocess.run(argv, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=timeout, check=False)
        except subprocess.TimeoutExpired:
            log.write(f"\nalternate.py: launch stopped after {timeout} s\n")
    seconds = time.monotonic() - started
    try:
        with open(prefix + ".rank0.json") as f:
            result = json.load(f)
    except (OSError, json.JSONDecodeError):
        return None, seconds
    return (result if "step_ms_median" in result else None), seconds


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out")
    parser.add_argument("row")
    parser.add_argument("ngpu", type=int)
    parser.add_argument("columns", nargs="+")
    args = parser.parse_args(argv)
    try:
        plan = [(text, *parse_column(text)) for text in args.columns]
    except ValueError as err:
        parser.error(str(err))
    os.makedirs(args.out, exist_ok=True)
    timeout = env_int("DIST_TIMEOUT", 150)
    medians, failed = {}, False
    for index, (text, column, conf) in enumerate(plan):
        result, seconds = launch(args.out, index, args.row, column, conf, args.ngpu, timeout)
        if result is None:
            print(f"{index:02d} {text}: no result after {seconds:.0f} s (see the launch's log)", flush=True)
            failed = True
            continue
        medians.setdefault(text, []).append(result["step_ms_median"])
        print(f"{index:02d} {text}: median step {result['step_ms_median']:.1f} ms ({seconds:.0f} s)", flush=True)
    if medians:
        first = statistics.median(next(iter(medians.values())))
        print(f"\n| {args.row}, {args.ngpu} GPUs | launches | median of their medians | × first |")
        print("| --- | --- | --- | --- |")
        for text, values in medians.items():
            median = statistics.median(values)
            listed = ", ".join(f"{v:.1f}" for v in values)
            print(f"| {text} | {listed} | {median:.1f} ms | {median / first:.3f} |")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
