"""Sleep and wake on one GPU, as one command:

    python3 benches/gpu/sleep/bench.py [--sizes 1,8,40] [--json OUT.json]

(python3 with torch and streamalloc installed, or PYTHONPATH=python with STREAMALLOC_LIB
set; about 2 minutes on an H100.) For each size, a tagged region of that many GiB (large
tensors and small ones between them) is put to sleep and woken, with backup="none" and
backup="cpu", each twice or three times (the first CPU sleep pins the host buffer, later
ones reuse it), beside a plain pinned ``copy_`` of the same bytes (up to 8 GiB) between the
same GPU and host, measured in the same run. Checked on the way:

- the driver gets the memory back (``cuMemGetInfo`` before and after the sleep);
- an allocation of that size then succeeds in this process, and with backup="none" in
  another process (plain PyTorch);
- after wake every tensor keeps its ``data_ptr()`` and, with backup="cpu", its contents
  (checksums of every tensor);
- a CUDA graph captured over tagged weights and a tagged cache replays bit-identically
  after sleep and wake (backup="cpu", and backup="none" with the weights copied in again),
  and the eager model's outputs too;
- misuse is refused: a double sleep, waking an unknown tag, allocating into a sleeping tag,
  sleeping inside a region.

TorchMemorySaver and vLLM's CuMemAllocator are timed the same way in a subprocess when
installed (``tms_compare.py``); otherwise the table says so. The table is printed last; the
exit status is 1 if a check failed.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

import streamalloc
import streamalloc.torch as st

GIB = 1 << 30
HERE = Path(__file__).resolve().parent
failures: list[str] = []


def check(ok: bool, what: str) -> bool:
    if not ok:
        failures.append(what)
        print(f"FAIL {what}", flush=True)
    return ok


def sync() -> None:
    torch.cuda.synchronize()


def free_bytes() -> int:
    return torch.cuda.mem_get_info()[0]


def host_empty_cache() -> None:
    # PyTorch keeps freed pinned memory cached; give it back between measurements.
    fn = getattr(torch._C, "_host_emptyCache", None)
    if fn is not None:
        fn()


# ---- the plain pinned copy ------------------------------------------------------------------


def pinned_copy_rates(nbytes: int) -> tuple[float, float]:
    """GB/s of one device-to-host and one host-to-device ``copy_`` of ``nbytes`` between a
    CUDA tensor and a pinned CPU tensor (best of two)."""
    gpu = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    gpu.fill_(7)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    rates = []
    for dst, src in ((host, gpu), (gpu, host)):
        best = float("inf")
        for _ in range(2):
            sync()
            start = time.perf_counter()
            dst.copy_(src, non_blocking=True)
            sync()
            best = min(best, time.perf_counter() - start)
        rates.append(nbytes / best / 1e9)
    del gpu, host
    host_empty_cache()
    st.empty_cache()
    return rates[0], rates[1]


# ---- one size --------------------------------------------------------------------------------


def make_region(tag: str, nbytes: int) -> list[torch.Tensor]:
    """``nbytes`` in ``tag``: 256 MiB tensors with a small one (4 KiB to 1 MiB) after each,
    filled with random bytes."""
    tensors = []
    left, i = nbytes, 0
    with st.region(tag):
        while left > 0:
            big = min(256 << 20, left)
            small = min(4096 << (i % 9), max(left - big, 0))
            for size in (big, small):
                if size:
                    tensors.append(torch.empty(size, dtype=torch.uint8, device="cuda"))
            left -= big + small
            i += 1
    return tensors


def checksums(tensors: list[torch.Tensor]) -> list[int]:
    return torch.stack([t.sum(dtype=torch.int64) for t in tensors]).tolist()


def refill(tensors: list[torch.Tensor], seed: int) -> None:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    for t in tensors:
        t.random_(0, 256, generator=gen)
    sync()


OTHER_PROCESS = """
import sys, torch
x = torch.empty(int(sys.argv[1]), dtype=torch.uint8, device="cuda")
x.fill_(1)
torch.cuda.synchronize()
print("allocated", x.numel())
"""


def other_process_allocates(nbytes: int) -> bool:
    env = {k: v for k, v in os.environ.items() if not k.startswith("STREAMALLOC")}
    path = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and "_boot" not in p]
    env["PYTHONPATH"] = os.pathsep.join(path)
    out = subprocess.run([sys.executable, "-c", OTHER_PROCESS, str(nbytes)], env=env,
                         capture_output=True, text=True, timeout=120)
    if out.returncode != 0:
        print(f"other process: {out.stderr.strip().splitlines()[-1:]}")
    return out.returncode == 0 and "allocated" in out.stdout


def measure_size(gib: float, copy_rates: tuple[float, float]) -> list[dict]:
    nbytes = int(gib * GIB)
    tag = f"bench_{gib:g}gib"
    tensors = make_region(tag, nbytes)
    ptrs = [t.data_ptr() for t in tensors]
    mapped = next(t for t in st.tags() if t["tag"] == tag)["bytes"]
    rows = []
    for seed, (backup, cycles) in enumerate((("none", 2), ("cpu", 3))):
        refill(tensors, seed)
        before = checksums(tensors)
        row = {"size_gib": gib, "backup": backup, "sleep_s": [], "wake_s": [], "copied": 0}
        for cycle in range(cycles):
            sync()
            free_before = free_bytes()
            done = st.sleep(tag, backup=backup)
            returned = free_bytes() - free_before
            row["sleep_s"].append(done["seconds"])
            row["copied"] = done["copied"]
            if cycle == 0:
                row["returned"] = returned / mapped
                check(returned >= 0.98 * mapped,
                      f"{gib:g} GiB {backup}: the driver got {returned / GIB:.2f} of {mapped / GIB:.2f} GiB back")
                x = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
                x.fill_(3)
                sync()
                del x
                st.empty_cache()
                row["alloc_here"] = True
                if backup == "none":
                    row["alloc_other"] = check(other_process_allocates(nbytes),
                                               f"{gib:g} GiB: another process could not allocate it")
            woken = st.wake(tag)
            row["wake_s"].append(woken["seconds"])
            check([t.data_ptr() for t in tensors] == ptrs, f"{gib:g} GiB {backup}: addresses moved")
            if backup == "cpu":
                check(checksums(tensors) == before, f"{gib:g} GiB cpu: contents differ after wake")
                row["restored"] = True
        if backup == "cpu":
            steady_sleep, steady_wake = min(row["sleep_s"][1:]), min(row["wake_s"][1:])
            row["sleep_gbs"] = row["copied"] / steady_sleep / 1e9
            row["wake_gbs"] = row["copied"] / steady_wake / 1e9
            row["sleep_vs_copy"] = row["sleep_gbs"] / copy_rates[0]
            row["wake_vs_copy"] = row["wake_gbs"] / copy_rates[1]
            for what, ratio in (("sleep", row["sleep_vs_copy"]), ("wake", row["wake_vs_copy"])):
                check(ratio >= 0.8, f"{gib:g} GiB cpu: {what} at {ratio:.0%} of a pinned copy_")
        row["copy_d2h_gbs"], row["copy_h2d_gbs"] = copy_rates
        rows.append(row)
    # Give everything back: the pool keeps its memory while it has uses, so the tag sleeps
    # for good with nothing live in it.
    st.release_host_backup(tag)
    del tensors
    st.sleep(tag, backup="none")
    host_empty_cache()
    return rows


# ---- graphs, model outputs, misuse ---------------------------------------------------------


class Model(torch.nn.Module):
    def __init__(self, d: int = 1024, layers: int = 4):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(d, d) for _ in range(layers))

    def forward(self, x, cache):
        for i, layer in enumerate(self.layers):
            cache[i].copy_(x)  # the cache is written, then read, inside the graph
            x = torch.nn.functional.gelu(layer(cache[i])) + x
        return x


@torch.no_grad()
def graphs_and_outputs() -> dict:
    torch.manual_seed(0)
    with st.region("graph_weights"):
        model = Model().cuda()
    with st.region("graph_cache"):
        cache = torch.zeros(4, 64, 1024, device="cuda")
    static_x = torch.randn(64, 1024, device="cuda")
    eager_x = torch.randn(64, 1024, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            model(static_x, cache)  # warm up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = model(static_x, cache)
    graph.replay()
    reference = static_out.clone()
    eager_reference = model(eager_x, cache).clone()
    weights_on_host = [p.detach().cpu() for p in model.parameters()]
    result = {}
    for backup in ("cpu", "none"):
        st.sleep(["graph_weights", "graph_cache"], backup=backup)
        st.wake(["graph_weights", "graph_cache"])
        if backup == "none":
            with torch.no_grad():  # a weight sync, into the same addresses
                for p, saved in zip(model.parameters(), weights_on_host):
                    p.copy_(saved, non_blocking=True)
        static_out.zero_()
        graph.replay()
        replay_ok = torch.equal(static_out, reference)
        eager_ok = torch.equal(model(eager_x, cache), eager_reference)
        check(replay_ok, f"graph replay after sleep/wake ({backup}) differs")
        check(eager_ok, f"model output after sleep/wake ({backup}) differs")
        result[backup] = replay_ok and eager_ok
    del graph, model, cache, static_out
    st.sleep(["graph_weights", "graph_cache"])  # their memory back for the sizes below
    return result


def misuse() -> int:
    refused = 0
    with st.region("misuse"):
        t = torch.ones(1 << 20, device="cuda")
    st.sleep("misuse")
    for what, call, needle in (
        ("a double sleep", lambda: st.sleep("misuse"), "already asleep"),
        ("waking an unknown tag", lambda: st.wake("no_such_tag"), "no memory pool is tagged"),
    ):
        try:
            call()
            check(False, f"{what} was not refused")
        except st.SleepError as err:
            refused += check(needle in str(err), f"{what}: {err}")
    try:
        with st.region("misuse"):
            torch.empty(1 << 20, device="cuda")
        check(False, "allocating into a sleeping tag was not refused")
    except RuntimeError as err:
        refused += check("asleep" in str(err) and "out of memory" not in str(err),
                         f"allocating into a sleeping tag: {err}")
    st.wake("misuse")
    try:
        with st.region("misuse"):
            st.sleep("misuse")
        check(False, "sleeping inside a region was not refused")
    except st.SleepError as err:
        refused += check("being allocated to a pool" in str(err), f"sleep inside a region: {err}")
    del t
    st.sleep("misuse")
    return refused


# ---- the table --------------------------------------------------------------------------------


def others(sizes: list[float]) -> list[str]:
    lines = []
    for name in ("torch_memory_saver", "vllm"):
        try:
            __import__(name)
        except Exception as err:
            lines.append(f"{name}: not installed here ({type(err).__name__}); not measured")
            continue
        for gib in sizes:
            out = subprocess.run([sys.executable, str(HERE / "tms_compare.py"), name, str(gib)],
                                 capture_output=True, text=True, timeout=300)
            last = (out.stdout.strip().splitlines() or [out.stderr.strip()[-200:]])[-1]
            lines.append(f"{name} {gib:g} GiB: {last}")
    lines.append("published: vLLM sleep mode wakes a model in ~0.1-0.4 s (blog.vllm.ai, "
                 "2025-10-03, 'Zero-Reload Model Switching with vLLM Sleep Mode'; other models "
                 "and GPUs, not these sizes)")
    return lines


def table(rows: list[dict], graphs: dict, refused: int, other_lines: list[str]) -> str:
    props = torch.cuda.get_device_properties(0)
    out = [
        "",
        f"sleep and wake — {props.name}, torch {torch.__version__}, streamalloc {streamalloc.__version__}, "
        f"{datetime.date.today()}, `python3 {' '.join(sys.argv)}`",
        "| size | backup | sleep s (first / steady) | wake s (first / steady) | sleep GB/s | wake GB/s "
        "| pinned copy_ D2H / H2D GB/s | vs copy_ (sleep / wake) | returned | alloc here / other process | contents |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        s, w = r["sleep_s"], r["wake_s"]
        cpu = r["backup"] == "cpu"
        out.append(
            f"| {r['size_gib']:g} GiB | {r['backup']} | {s[0]:.3f} / {min(s[1:]):.3f} | {w[0]:.3f} / {min(w[1:]):.3f} "
            + (f"| {r['sleep_gbs']:.1f} | {r['wake_gbs']:.1f} " if cpu else "| — | — ")
            + f"| {r['copy_d2h_gbs']:.1f} / {r['copy_h2d_gbs']:.1f} "
            + (f"| {r['sleep_vs_copy']:.0%} / {r['wake_vs_copy']:.0%} " if cpu else "| — ")
            + f"| {r['returned']:.1%} | {'yes' if r.get('alloc_here') else 'no'} / "
            + ("—" if cpu else ("yes" if r.get("alloc_other") else "no"))
            + f" | {'restored' if r.get('restored') else 'fresh pages'} |"
        )
    none40 = [r for r in rows if r["backup"] == "none" and r["size_gib"] >= 40]
    for r in none40:
        total = min(r["sleep_s"][1:]) + min(r["wake_s"][1:])
        check(total <= 0.5, f"{r['size_gib']:g} GiB none: sleep + wake {total:.3f} s > 0.5 s")
        out.append(f"{r['size_gib']:g} GiB backup none: sleep + wake {total:.3f} s (goal <= 0.5 s)")
    out.append(f"CUDA graph replays and eager outputs bit-identical after wake: "
               f"backup cpu {'yes' if graphs.get('cpu') else 'NO'}, backup none + weights copied in "
               f"{'yes' if graphs.get('none') else 'NO'}; misuse refused: {refused} of 4")
    out += other_lines
    out.append("result: " + ("all checks passed" if not failures else f"{len(failures)} FAILED: " + "; ".join(failures)))
    return "\n".join(out)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1,8,40", help="GiB, comma-separated")
    parser.add_argument("--json", help="write the rows here too")
    args = parser.parse_args()
    sizes = [float(s) for s in args.sizes.split(",") if s]
    st.install()
    print(f"streamalloc {streamalloc.__version__} ({st.door()} door), torch {torch.__version__}, "
          f"{torch.cuda.get_device_name(0)}", flush=True)
    refused = misuse()
    graphs = graphs_and_outputs()
    rows = []
    for gib in sizes:
        free, total = torch.cuda.mem_get_info()
        if gib * GIB > free - 4 * GIB:
            print(f"{gib:g} GiB: skipped, {free / GIB:.1f} GiB free of {total / GIB:.1f}", flush=True)
            continue
        rates = pinned_copy_rates(int(min(gib, 8) * GIB))
        print(f"{gib:g} GiB: pinned copy_ {rates[0]:.1f} GB/s to host, {rates[1]:.1f} GB/s to the GPU", flush=True)
        started = time.perf_counter()
        rows += measure_size(gib, rates)
        print(f"{gib:g} GiB: measured in {time.perf_counter() - started:.1f} s", flush=True)
    other_lines = others([s for s in sizes if s <= 8])
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "graphs": graphs, "failures": failures}, indent=1))
    print(table(rows, graphs, refused, other_lines))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
