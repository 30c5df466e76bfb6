# What the checks share: installing the allocator under test, its allocation count,
# settling the device, the result record, and running a script once per allocator, each in
# a process of its own, reading back the JSON line it prints last.
import gc
import json
import os
import subprocess
import sys

MiB = 1 << 20
# PyTorch's allocator, then streamalloc through each door.
ALLOCATORS = ("native", "sa_native", "sa_pluggable")


def door_of(alloc):
    return "pluggable" if alloc.startswith("sa_pluggable") else "native"


def install(alloc):
    """Makes ALLOC PyTorch's allocator (before any CUDA tensor); returns what it found."""
    import torch
    info = {"torch": torch.__version__}
    if alloc != "native":
        import streamalloc.torch as st
        want = door_of(alloc)
        st.install(door=want)
        got = st.door()
        info["door"] = got
        if got != want:
            raise RuntimeError(f"asked for door {want!r}, streamalloc.torch.door() says {got!r}")
    return info


def served(alloc):
    """streamalloc's allocation count in this process (None for PyTorch's allocator)."""
    if alloc == "native":
        return None
    import streamalloc.torch as st
    return st.raw_stats()["stats"]["allocs"]


def clear_workspaces(torch):
    # cuBLAS keeps a workspace per (handle, stream) through the caching allocator; graph
    # capture drops them the same way, so measurements before/after compare like with like.
    fn = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if fn is not None:
        fn()


def settle(torch):
    gc.collect()
    torch.cuda.synchronize()
    clear_workspaces(torch)
    gc.collect()
    torch.cuda.synchronize()


def result(ok, figure, **detail):
    return {"status": "PASS" if ok else "FAIL", "figure": figure, "detail": detail}


class Run:
    """One allocator's process: the lines it printed before the last, the last line's
    JSON (None if it did not end with one), and what went wrong (None if nothing did)."""

    def __init__(self, alloc, completed):
        self.alloc = alloc
        lines = completed.stdout.strip().splitlines()
        self.last = lines[-1] if lines else ""
        self.lines = lines[:-1]
        self.summary = json.loads(self.last) if self.last.startswith("{") else None
        self.failure = None
        if completed.returncode != 0 or self.summary is None:
            self.failure = f"exit {completed.returncode}: {completed.stderr.strip()[-1500:]}"

    def count_failure(self, failed):
        """Adds the allocator to FAILED, saying why, if its process went wrong."""
        if self.failure:
            failed.append(self.alloc)
            print(f"{self.alloc:13} FAIL  {self.failure}")

    @property
    def skipped(self):
        return self.summary is None and self.last.startswith("SKIP")


def run_each(script, timeout):
    """Runs SCRIPT with each of ALLOCATORS as its argument, each in a process of its own,
    and yields a Run for each."""
    for alloc in ALLOCATORS:
        completed = subprocess.run([sys.executable, os.path.abspath(script), alloc],
                                   capture_output=True, text=True, timeout=timeout)
        yield Run(alloc, completed)


def verdict(name, failed):
    """Prints NAME's last line (all passed, or the allocators that failed); the exit status."""
    print(f"{name}: " + ("all passed" if not failed else f"failed: {', '.join(failed)}"))
    return 1 if failed else 0


def main(script, run_one, compare):
    """The command line of a script with one process per allocator: ALLOC runs it under one
    allocator, --compare under each in turn (run_each). Exits with what they return."""
    if len(sys.argv) != 2:
        sys.exit(f"usage: {os.path.basename(script)} {'|'.join(ALLOCATORS)}|--compare")
    sys.exit(compare() if sys.argv[1] == "--compare" else run_one(sys.argv[1]))
