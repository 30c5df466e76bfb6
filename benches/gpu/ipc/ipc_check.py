# CUDA IPC of any tensor through streamalloc's native door, under the default configuration
# (expandable segments and stitching on).
#   python3 ipc_check.py [OUT_DIR]            # the GPU check, about a minute
#   python3 ipc_check.py --dry-run            # the table's logic on canned rows, no GPU
# The parent installs the native door and makes int32 CUDA tensors with known contents: one
# of 1 KiB, one of 3 MiB in an expandable segment, and one of 40 MiB stitched from the free
# pages of two holes around a live block (checked through the library's stitch counter; if
# the policy grew memory instead, it is stitched again under a memory limit that leaves no
# room to grow). Each goes through a torch.multiprocessing Queue to a child that adds 1 in
# place and synchronises; the parent then checks every element. Children: the native door
# and PyTorch's own allocator (which opens PyTorch's 'e' format; streamalloc's 's', for
# allocations of several sizes, is refused by design), each started both ways
# torch.multiprocessing starts CUDA children: spawn and forkserver. A failure raises in the
# child (reported) and never leaves it waiting. Prints the table last; exit 1 on a failure.
import ctypes
import json
import os
import sys
import time
import traceback

KiB, MiB = 1 << 10, 1 << 20
TENSORS = ["1 KiB", "3 MiB expandable", "40 MiB stitched"]
CHILDREN = [(kind, start) for start in ("spawn", "forkserver") for kind in ("streamalloc", "pytorch")]
TIMEOUT_S = 120


def expected(torch, n):
    return (torch.arange(n, dtype=torch.int64, device="cuda") % 1000003).to(torch.int32)


def child_main(kind, inbox, outbox):
    try:
        if kind == "streamalloc":
            import streamalloc.torch as st
            st.install(door="native")
            mode = "streamalloc " + st.door()
        else:
            mode = "pytorch " + os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "(default)")
        import torch
        outbox.put(("ready", mode, ""))
        while True:
            try:
                item = inbox.get(timeout=TIMEOUT_S)
            except Exception as err:  # unpickling raised: the handle could not be opened
                outbox.put(("error", "?", f"{type(err).__name__}: {str(err).splitlines()[0][:300]}"))
                continue
            if item is None:
                break
            name, t = item
            t.add_(1)
            torch.cuda.synchronize()
            del t  # the receiver's mapping is closed here
            outbox.put(("ok", name, ""))
    except Exception as err:
        outbox.put(("error", "?", f"{type(err).__name__}: {err}"[:300]))


def export_info(lib, ptr):
    """The library's handle for ptr: (type byte, what it maps, offset) or the error."""
    buf = ctypes.create_string_buffer(1 << 16)
    off = ctypes.c_uint64(0)
    n = lib.streamalloc_ipc_export(ctypes.c_void_p(ptr), buf, len(buf), ctypes.byref(off))
    if n < 0:
        return "-", lib.streamalloc_last_error().decode(errors="replace")[:80], 0
    raw = buf.raw[:n]
    kind = chr(raw[1])
    if kind == "e":
        count = int.from_bytes(raw[18:26], sys.byteorder)
        seg = int.from_bytes(raw[10:18], sys.byteorder)
        return kind, f"{count} x {seg // MiB} MiB", off.value
    count = int.from_bytes(raw[10:18], "little")
    sizes = [int.from_bytes(raw[18 + 16 * i:26 + 16 * i], "little") // MiB for i in range(count)]
    return kind, "+".join(str(s) for s in sizes) + " MiB", off.value


def allow_children_to_ptrace():
    """pidfd_getfd needs ptrace access to the sender; under Yama ptrace_scope 1 only
    descendants may trace it (a forkserver's children are not the sender's) unless the
    sender allows any process (PR_SET_PTRACER_ANY)."""
    try:
        scope = open("/proc/sys/kernel/yama/ptrace_scope").read().strip()
    except OSError:
        return "no Yama"
    if scope == "1":
        libc = ctypes.CDLL(None, use_errno=True)
        pr_set_ptracer, any_ = 0x59616D61, ctypes.c_ulong(-1 & 0xFFFFFFFFFFFFFFFF)
        rc = libc.prctl(pr_set_ptracer, any_, ctypes.c_ulong(0), ctypes.c_ulong(0), ctypes.c_ulong(0))
        return f"Yama ptrace_scope 1, PR_SET_PTRACER_ANY {'set' if rc == 0 else 'FAILED'}"
    return f"Yama ptrace_scope {scope}"


def stitch_count(st):
    stats = st.raw_stats()["stats"]
    return stats["stitches"] + stats["stitch_revivals"]


def make_stitched(torch, st, keep):
    """A 40 MiB int32 tensor stitched from free pages around a live block, or None."""
    n = 40 * MiB // 4
    # An earlier stitched tensor, once freed, stays mapped as a dormant range that serves
    # the same request again without stitching: give the cache back first.
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    for attempt in ("policy", "limit"):
        below = torch.empty(30 * MiB // 4, dtype=torch.int32, device="cuda")
        live = torch.empty(4 * MiB // 4, dtype=torch.int32, device="cuda")
        above = torch.empty(26 * MiB // 4, dtype=torch.int32, device="cuda")
        keep.append(live)
        del below, above
        before = stitch_count(st)
        if attempt == "limit":
            # No room to grow: a request no free block fits must be stitched.
            total = torch.cuda.get_device_properties(0).total_memory
            torch.cuda.set_per_process_memory_fraction((torch.cuda.memory_reserved() + MiB) / total)
        try:
            t = torch.empty(n, dtype=torch.int32, device="cuda")
        finally:
            if attempt == "limit":
                torch.cuda.set_per_process_memory_fraction(1.0)
        if stitch_count(st) > before:
            return t, attempt
        del t
    return None, "not stitched"


def row_line(r):
    return (f"| {r['child']} | {r['start']} | {r['tensor']} | '{r['format']}' {r['mappings']} | "
            f"{r['status']} | {r['detail']} | {r['ms']} |")


def table(rows):
    head = ["| child | start | tensor | handle | status | detail | round trip ms |",
            "|" + "---|" * 7]
    return "\n".join(head + [row_line(r) for r in rows])


def run_child(ctx, kind, start, lib, torch, st):
    rows, failed = [], False
    inbox, outbox = ctx.Queue(), ctx.Queue()
    env_before = os.environ.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    proc = ctx.Process(target=child_main, args=(kind, inbox, outbox))
    proc.start()
    if env_before is not None:
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = env_before
    state, mode, msg = outbox.get(timeout=TIMEOUT_S)
    if state != "ready":
        print(f"child {kind} ({start}): {msg}")
        proc.join(10)
        return [dict(child=kind, start=start, tensor="-", format="-", mappings="", status="FAIL",
                     detail=msg, ms=0)], True
    keep = []
    for name in TENSORS:
        how = ""
        if name == "1 KiB":
            t = expected(torch, KiB // 4)
        elif name == "3 MiB expandable":
            t = expected(torch, 3 * MiB // 4)
        else:
            t, how = make_stitched(torch, st, keep)
            if t is None:
                rows.append(dict(child=kind, start=start, tensor=name, format="-", mappings="",
                                 status="FAIL", detail="could not make a stitched tensor", ms=0))
                failed = True
                continue
            t.copy_(expected(torch, t.numel()))
        torch.cuda.synchronize()
        n = t.numel()
        fmt, what, off = export_info(lib, t.data_ptr())
        begin = time.perf_counter()
        inbox.put((name, t))
        try:
            state, _, msg = outbox.get(timeout=TIMEOUT_S)
        except Exception:
            state, msg = "error", "no answer from the child (timeout)"
        ms = (time.perf_counter() - begin) * 1e3
        torch.cuda.synchronize()
        wrong = int((t != expected(torch, n) + 1).sum().item())
        if state == "ok":
            status, detail = ("PASS" if wrong == 0 else "FAIL"), f"{wrong} wrong of {n}"
        elif kind == "pytorch" and fmt == "s":
            status, detail = "n/a", "'s' refused by PyTorch (as designed)"
        else:
            status, detail = "FAIL", msg
        if how:
            detail += f" (stitched: {how})"
        failed |= status == "FAIL"
        rows.append(dict(child=kind, start=start, tensor=name, format=fmt, mappings=what,
                         offset=off, status=status, detail=detail, ms=round(ms, 1)))
        print("  " + row_line(rows[-1]), flush=True)
        del t
    inbox.put(None)
    proc.join(TIMEOUT_S)
    if proc.exitcode != 0:
        print(f"child {kind} ({start}) exit code {proc.exitcode}")
        failed = True
    del keep
    return rows, failed


def main(out_dir):
    import streamalloc.torch as st
    st.install(door="native")
    import torch
    import torch.multiprocessing as mp
    from streamalloc import _lib
    lib = _lib.load()
    lib.streamalloc_ipc_export.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t,
                                           ctypes.POINTER(ctypes.c_uint64)]
    lib.streamalloc_ipc_export.restype = ctypes.c_int64
    ptrace = allow_children_to_ptrace()
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name(0)}, door {st.door()}, "
          f"STREAMALLOC_CONF={os.environ.get('STREAMALLOC_CONF', '(default)')}, {ptrace}", flush=True)
    rows, failed = [], False
    for kind, start in CHILDREN:
        got, bad = run_child(mp.get_context(start), kind, start, lib, torch, st)
        rows += got
        failed |= bad
    text = table(rows)
    print("\n" + text)
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, "table.md"), "w") as f:
            f.write(text + "\n")
        with open(os.path.join(out_dir, "results.json"), "w") as f:
            json.dump(rows, f, indent=1)
    print("\nIPC check:", "FAILED" if failed else "passed")
    return rows, failed


def dry_run():
    rows = [dict(child=k, start=s, tensor=t, format="e", mappings="20 x 2 MiB", status="PASS",
                 detail="0 wrong of 10485760", ms=1.0) for k, s in CHILDREN for t in TENSORS]
    print(table(rows))
    return 0


if __name__ == "__main__":
    if "--dry-run" in sys.argv:
        sys.exit(dry_run())
    try:
        _, failed = main(sys.argv[1] if len(sys.argv) > 1 else None)
        sys.exit(1 if failed else 0)
    except Exception:
        traceback.print_exc()
        sys.exit(1)
