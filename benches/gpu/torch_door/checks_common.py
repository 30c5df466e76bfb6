# What every check of checks.py and checks_compile.py shares: installing the allocator
# under test, its allocation count, settling the device, and the result record.
import gc

MiB = 1 << 20


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
