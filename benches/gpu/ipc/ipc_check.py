# CUDA IPC of expandable-segment memory through streamalloc's native door.
#   python3 ipc_check.py [OUT_DIR]
# The parent installs the native door (run.sh sets STREAMALLOC_CONF=expandable_segments:true),
# makes int32 CUDA tensors of 1 KiB, 3 MiB and 300 MiB with known contents and sends each
# through a torch.multiprocessing Queue to a spawned child, which adds 1 in place and
# synchronises. The parent then checks every element. Two children: one with the native
# door (opens streamalloc's handles), one with PyTorch's own allocator (opens PyTorch's
# 'e' format; streamalloc's 's' format, for mappings of several sizes, is refused by design).
# Prints a table and writes it (with JSON) to OUT_DIR if given. Exit 1 on any failure.
import ctypes
import json
import os
import sys
import time
import traceback

KiB, MiB = 1 << 10, 1 << 20
SIZES = [("1 KiB", KiB), ("3 MiB", 3 * MiB), ("300 MiB", 300 * MiB)]
CHILDREN = ["streamalloc", "pytorch"]
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
            except Exception as err:  # unpickling failed: the handle could not be opened
                outbox.put(("error", "?", f"{type(err).__name__}: {str(err).splitlines()[0][:300]}"))
                continue
            if item is None:
                break
            name, t = item
            t.add_(1)
            torch.cuda.synchronize()
            del t
            outbox.put(("ok", name, ""))
    except Exception as err:
        outbox.put(("error", "?", f"{type(err).__name__}: {err}"[:300]))


def export_info(lib, ptr):
    """The library's handle for ptr: (type byte, mappings, offset) or the error."""
    buf = ctypes.create_string_buffer(1 << 16)
    off = ctypes.c_uint64(0)
    n = lib.streamalloc_ipc_export(ctypes.c_void_p(ptr), buf, len(buf), ctypes.byref(off))
    if n < 0:
        return None, 0, 0, lib.streamalloc_last_error().decode(errors="replace")
    raw = buf.raw[:n]
    kind = chr(raw[1])
    if kind == "e":
        count = int.from_bytes(raw[18:26], sys.byteorder)
        seg = int.from_bytes(raw[10:18], sys.byteorder)
        what = f"{count} x {seg // MiB} MiB"
    else:
        count = int.from_bytes(raw[10:18], "little")
        sizes = [int.from_bytes(raw[18 + 16 * i:26 + 16 * i], "little") // MiB for i in range(count)]
        what = "+".join(str(s) for s in sizes) + " MiB"
    return kind, count, off.value, what


def allow_children_to_ptrace():
    """pidfd_getfd needs ptrace access to the sender; under Yama ptrace_scope 1 a child
    may not trace its parent unless the parent allows it (PR_SET_PTRACER)."""
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


def main():
    out_dir = sys.argv[1] if len(sys.argv) > 1 else None
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
          f"STREAMALLOC_CONF={os.environ.get('STREAMALLOC_CONF')}, {ptrace}", flush=True)

    rows, failed = [], False
    ctx = mp.get_context("spawn")
    for kind in CHILDREN:
        inbox, outbox = ctx.Queue(), ctx.Queue()
        env_before = os.environ.pop("PYTORCH_CUDA_ALLOC_CONF", None)
        proc = ctx.Process(target=child_main, args=(kind, inbox, outbox))
        proc.start()
        if env_before is not None:
            os.environ["PYTORCH_CUDA_ALLOC_CONF"] = env_before
        state, mode, msg = outbox.get(timeout=TIMEOUT_S)
        if state != "ready":
            print(f"child {kind}: {msg}")
            failed = True
            proc.join(10)
            continue
        for name, nbytes in SIZES:
            n = nbytes // 4
            t = expected(torch, n)
            torch.cuda.synchronize()
            fmt, count, off, what = export_info(lib, t.data_ptr())
            start = time.perf_counter()
            inbox.put((name, t))
            state, _, msg = outbox.get(timeout=TIMEOUT_S)
            ms = (time.perf_counter() - start) * 1e3
            torch.cuda.synchronize()
            wrong = int((t != expected(torch, n) + 1).sum().item())
            if state == "ok":
                status = "PASS" if wrong == 0 else "FAIL"
                detail = f"{wrong} wrong of {n}"
            elif kind == "pytorch" and fmt == "s":
                status, detail = "n/a", "'s' refused by PyTorch (as designed)"
            else:
                status, detail = "FAIL", msg
            failed |= status == "FAIL"
            rows.append(dict(child=kind, mode=mode, size=name, format=fmt, mappings=what,
                             offset=off, status=status, detail=detail, ms=round(ms, 1)))
            print(f"  {kind:11s} {name:8s} {status:4s} format {fmt} ({what}, offset {off}) "
                  f"{detail} [{ms:.0f} ms]", flush=True)
            del t
        inbox.put(None)
        proc.join(TIMEOUT_S)
        if proc.exitcode != 0:
            print(f"child {kind} exit code {proc.exitcode}")
            failed = True

    head = "| child | size | handle | mappings | status | detail | round trip ms |"
    lines = [head, "|" + "---|" * 7]
    for r in rows:
        lines.append(f"| {r['child']} | {r['size']} | '{r['format']}' | {r['mappings']} | "
                     f"{r['status']} | {r['detail']} | {r['ms']} |")
    table = "\n".join(lines)
    print("\n" + table)
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, "table.md"), "w") as f:
            f.write(table + "\n")
        with open(os.path.join(out_dir, "results.json"), "w") as f:
            json.dump(rows, f, indent=1)
    print("\nIPC check:", "FAILED" if failed else "passed")
    return 1 if failed else 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except Exception:
        traceback.print_exc()
        sys.exit(1)
