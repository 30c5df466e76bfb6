"""Does `streamalloc view/plot --replay` tell a PyTorch user the truth about their own run?

One GPU, one command, under 8 minutes:

    python3 benches/gpu/replay_check/check.py OUTDIR            # on a GPU machine
    python3 benches/gpu/replay_check/check.py OUTDIR --dry-run  # anywhere: CPU, no GPU rows

1. Trains a small transformer on batches whose sequence length varies per step (the shape
   that makes PyTorch's allocator fragment) under PyTorch's own allocator, recording a
   memory snapshot from process start, as the README's quick start tells users to.
2. Runs `streamalloc plot SNAPSHOT --replay` on it (the picture, OUTDIR/replay.png and
   .svg) and `streamalloc replay --json`: the predicted peak reserved and the lowest cap.
3. Trains the same steps under `streamalloc run` (measured peak reserved, through
   `torch.cuda.max_memory_reserved`, which streamalloc answers).
4. Trains them once more under `streamalloc run --conf memory_limit:CAP`, the lowest cap
   the replay found: does the real run complete under it?

Prints one table last. `--dry-run` checks the script's logic without a GPU: two tiny
training steps on the CPU (skipped where PyTorch is missing), the sample trace
(`streamalloc demo --write-trace`) in place of the recorded snapshot, and no GPU rows.

The `streamalloc` command is taken from STREAMALLOC_BIN, else PATH (the installed wheel),
else a checkout's target/release/streamalloc.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
GIB = float(1 << 30)


def streamalloc_bin() -> str:
    explicit = os.environ.get("STREAMALLOC_BIN")
    if explicit:
        return explicit
    found = shutil.which("streamalloc")
    if found:
        return found
    built = ROOT / "target" / "release" / "streamalloc"
    if built.is_file():
        return str(built)
    sys.exit("check.py: no streamalloc command (install the wheel, or set STREAMALLOC_BIN)")


# ---- The training run (a phase of its own process, so each allocator starts fresh) ----


def train(args) -> int:
    try:
        import torch
    except ModuleNotFoundError:
        if not args.dry_run:
            raise
        # A dry run without PyTorch checks the driver's logic only.
        Path(args.stats).write_text(json.dumps({"steps": 0, "step_ms": 0.0, "loss": None}))
        print("check.py: no PyTorch here: the dry run's training phase is skipped")
        return 0

    device = "cpu" if args.dry_run else "cuda"
    if args.snapshot and not args.dry_run:
        # From process start, before the model exists: the trace then holds every segment.
        torch.cuda.memory._record_memory_history(max_entries=1_000_000)
    torch.manual_seed(0)
    width, layers, heads = (64, 2, 4) if args.dry_run else (1024, 12, 16)
    vocab = 1000 if args.dry_run else 30522
    layer = torch.nn.TransformerEncoderLayer(
        width, heads, 4 * width, dropout=0.0, batch_first=True, norm_first=True
    )
    model = torch.nn.Sequential(
        torch.nn.Embedding(vocab, width),
        torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False),
        torch.nn.Linear(width, vocab),
    ).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    steps = 2 if args.dry_run else args.steps
    generator = torch.Generator().manual_seed(1)
    times = []
    for step in range(steps):
        # Sequence length and batch vary per step, as with real variable-length data.
        low, high = (8, 33) if args.dry_run else (128, 1025)
        length = int(torch.randint(low, high, (1,), generator=generator))
        batch = 2 if args.dry_run else max(1, 16384 // length)
        tokens = torch.randint(0, vocab, (batch, length), generator=generator).to(device)
        started = time.perf_counter()
        logits = model(tokens)
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, vocab), tokens.reshape(-1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if device == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - started) * 1e3)
    stats = {"steps": steps, "loss": float(loss), "step_ms": sorted(times)[len(times) // 2]}
    if device == "cuda":
        stats["peak_reserved"] = torch.cuda.max_memory_reserved()
        stats["peak_allocated"] = torch.cuda.max_memory_allocated()
        backend = getattr(torch.cuda.memory, "get_allocator_backend", lambda: "?")()
        stats["allocator"] = backend
    if args.snapshot and not args.dry_run:
        torch.cuda.memory._dump_snapshot(args.snapshot)
    Path(args.stats).write_text(json.dumps(stats))
    return 0


# ---- The driver ----


def run(cmd, **kw) -> subprocess.CompletedProcess:
    print("+", " ".join(str(c) for c in cmd), flush=True)
    return subprocess.run([str(c) for c in cmd], text=True, capture_output=True, **kw)


def must(proc: subprocess.CompletedProcess, what: str) -> subprocess.CompletedProcess:
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout + proc.stderr)
        sys.exit(f"check.py: {what} failed with status {proc.returncode}")
    return proc


def figures(plot_stdout: str) -> dict:
    """The replay's figures from `plot --replay`'s lines."""
    out = {}
    for key, pattern in [
        ("recorded", r"reserved \(recorded\): peak ([\d.]+) GiB"),
        ("replayed", r"streamalloc reserved \(replayed\): peak ([\d.]+) GiB"),
        ("live", r"live: peak ([\d.]+) GiB"),
        ("saving", r"saving ([\d.]+) GiB \(([\d.]+)%\)"),
        ("cap", r"lowest cap that completes: ([\d.]+) x peak live \(([\d.]+) GiB\)"),
    ]:
        m = re.search(pattern, plot_stdout)
        if m:
            out[key] = tuple(float(g) for g in m.groups())
    return out


def drive(args) -> int:
    out = Path(args.outdir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    sa = streamalloc_bin()
    me = [sys.executable, str(Path(__file__).resolve())]
    dry = ["--dry-run"] if args.dry_run else []
    rows = []
    snapshot = out / ("sample.pickle.gz" if args.dry_run else "pytorch.pickle")

    # 1. PyTorch's allocator, recorded.
    if args.dry_run:
        if snapshot.exists():
            snapshot.unlink()
        must(run([sa, "demo", "--write-trace", snapshot]), "demo --write-trace")
    pytorch = out / "pytorch.json"
    must(run(me + ["--stats", pytorch, "--snapshot", snapshot, "--steps", args.steps] + dry), "PyTorch's run")
    base = json.loads(pytorch.read_text())

    # 2. The replay: the picture, the figures, the cap.
    plot = must(run([sa, "plot", snapshot, "--replay", "-o", out / "replay.png"]), "plot --replay")
    must(run([sa, "plot", snapshot, "--replay", "-o", out / "replay.svg"]), "plot --replay (svg)")
    (out / "replay.txt").write_text(plot.stdout)
    fig = figures(plot.stdout)
    replay = must(run([sa, "replay", "--json", snapshot]), "replay --json")
    replayed = json.loads(replay.stdout.splitlines()[0])

    gib = lambda b: f"{b / GIB:.2f}" if isinstance(b, (int, float)) else "n/a"  # noqa: E731
    ratio = lambda r, a: f"{r / a:.3f}" if a else "n/a"  # noqa: E731
    rows.append(("PyTorch's allocator, recorded", gib(base.get("peak_reserved")),
                 gib(base.get("peak_allocated")), ratio(base.get("peak_reserved", 0), base.get("peak_allocated", 0)),
                 f"{base['step_ms']:.1f}", "run 1 (snapshot)"))
    rows.append(("streamalloc, predicted by the replay", gib(replayed["peak_reserved_bytes"]),
                 gib(replayed["peak_live_bytes"]), f"{replayed['ratio']:.3f}", "-",
                 "saving {} GiB ({}%)".format(*fig["saving"]) if "saving" in fig else "no saving line"))

    cap_note = "no cap found"
    if not args.dry_run:
        # 3. The same steps under streamalloc.
        ours = out / "streamalloc.json"
        must(run([sa, "build-torch-ext"]), "build-torch-ext")
        must(run([sa, "run", "--"] + me + ["--stats", ours, "--steps", args.steps]), "streamalloc's run")
        measured = json.loads(ours.read_text())
        rows.append(("streamalloc, measured", gib(measured["peak_reserved"]), gib(measured["peak_allocated"]),
                     ratio(measured["peak_reserved"], measured["peak_allocated"]), f"{measured['step_ms']:.1f}",
                     f"backend {measured.get('allocator')}, predicted/measured "
                     f"{replayed['peak_reserved_bytes'] / measured['peak_reserved']:.3f}"))
        # 4. Under the lowest cap the replay found.
        if "cap" in fig:
            cap_ratio, _ = fig["cap"]
            cap = int(replayed["peak_live_bytes"] * cap_ratio) + 1
            capped = out / "capped.json"
            proc = run([sa, "run", "--conf", f"memory_limit:{cap}", "--"] + me
                       + ["--stats", capped, "--steps", args.steps])
            if proc.returncode == 0:
                c = json.loads(capped.read_text())
                rows.append((f"streamalloc, capped at {cap_ratio:.3f} x peak live", gib(c["peak_reserved"]),
                             gib(c["peak_allocated"]), ratio(c["peak_reserved"], c["peak_allocated"]),
                             f"{c['step_ms']:.1f}", "completes"))
            else:
                last = (proc.stderr.strip().splitlines() or ["?"])[-1][:90]
                rows.append((f"streamalloc, capped at {cap_ratio:.3f} x peak live", gib(cap), "-", "-", "-",
                             f"FAILS: {last}"))
            cap_note = f"{cap_ratio:.3f} x peak live ({gib(cap)} GiB)"
    elif "cap" in fig:
        cap_note = "{} x peak live ({} GiB)".format(*fig["cap"])

    print()
    print(f"replay's figures ({snapshot.name}):")
    print(plot.stdout.rstrip())
    print(f"pictures: {out / 'replay.png'}, {out / 'replay.svg'}; lowest cap: {cap_note}")
    print()
    header = ("run", "peak reserved GiB", "peak allocated/live GiB", "reserved/allocated", "step ms", "note")
    print("| " + " | ".join(header) + " |")
    print("|" + " --- |" * len(header))
    for row in rows:
        print("| " + " | ".join(row) + " |")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("outdir", nargs="?", default="replay-check")
    parser.add_argument("--steps", type=int, default=12, help="training steps per run")
    parser.add_argument("--dry-run", action="store_true", help="CPU only, the sample trace, no GPU rows")
    # One training run, a phase of the check: its figures go to --stats.
    parser.add_argument("--stats", help=argparse.SUPPRESS)
    parser.add_argument("--snapshot", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.stats:
        return train(args)
    return drive(args)


if __name__ == "__main__":
    sys.exit(main())
