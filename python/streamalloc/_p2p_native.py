"""Reading a ``P2POp`` list in native code: the drop-in's per-call cost.

Why: the drop-in reads every op of its list on every call (58,000 of them in the
reproduction's pattern at scale), and in Python each op costs several attribute reads and
tensor method calls (1-3 µs). ``csrc/p2p_door.cpp`` reads the same fields through
CPython's and PyTorch's C++ APIs, checks them and sorts the tensors into lanes in one pass.
It is compiled against the installed PyTorch at first use, the way the PyTorch door is
(``streamalloc._door``: a C++ compiler, ninja and Python's headers; no CUDA), and cached
under ``$STREAMALLOC_CACHE``; where it cannot be built, or with
``STREAMALLOC_P2P_NATIVE=0``, :func:`read_ops` reads the list in Python
(``_p2p_checks.translate_ops``), with the same result and the same messages.

    python3 -m streamalloc._p2p_native build   # ahead of time: the reader, and the copy
                                               # kernel for this machine's GPU
"""

from __future__ import annotations

import array
import hashlib
import importlib.util
import os
import sys
import time
from pathlib import Path

from . import _p2p_checks
from ._p2p_plan import Lanes, P2PError, _flat, dtype_code

SOURCE = Path(__file__).resolve().parent / "csrc" / "p2p_door.cpp"
HEADERS = (SOURCE.with_name("p2p_ops.h"),)  # included by SOURCE: part of the cache key
_RECIPE = "1"  # part of the cache key: change it when the build flags change
_STATE = {"module": None, "failure": None, "codes": None}


def read_ops(ops, rank: int, world: int, group_rank, isend, irecv, groups=None) -> Lanes:
    """The list's :class:`~streamalloc._p2p_plan.Lanes`, with the tensors' addresses where
    read natively (raises ``P2PError`` naming the first bad op; with ``groups``, also an op
    whose ``group`` is none of them)."""
    module = load()
    if module is None:
        return _p2p_checks.translate_ops(ops, rank, world, group_rank, isend, irecv,
                                         groups=groups)
    try:
        counts, tensors, nbytes, codes, addresses, where = module.scan(
            ops, world, isend, irecv, group_rank, _codes(module),
            None if groups is None else tuple(groups))
    except ValueError as err:
        raise P2PError(str(err)) from None
    return _lanes(world, counts, tensors, nbytes, codes, addresses, where)


# Below this many tensors an Exchange reads its lists in Python unless the native module is
# already loaded: building it takes a minute once, reading in Python ~1.7 µs per tensor.
NATIVE_LISTS_MIN = 4096


def read_lists(world: int, send_lists, recv_lists) -> Lanes | None:
    """An ``Exchange``'s :class:`~streamalloc._p2p_plan.Lanes` read natively from its
    per-peer lists (their shape already checked), or None: the native module is not to be
    had or built for so few tensors, or a tensor needs the Python checks, which say why."""
    if _STATE["module"] is None:
        count = sum(len(ts) for ts in send_lists) + sum(len(ts) for ts in recv_lists)
        if count < NATIVE_LISTS_MIN:
            return None
    module = load()
    if module is None:
        return None
    out = module.lists(list(send_lists) + list(recv_lists), _codes(module))
    if out is None:
        return None
    return _lanes(world, *out)


def _lanes(world, counts, tensors, nbytes, codes, addresses, where) -> Lanes:
    """Lanes from the native module's columns (bytes of int64 each)."""
    columns = []
    for raw in (nbytes, codes, addresses):
        column = array.array("q")
        column.frombytes(raw)
        columns.append(column)
    device = None
    if where is not None:
        import torch

        device = torch.device(where)
    return Lanes(world, counts, tensors, columns[0], columns[1], device, columns[2])


def flat_tensors(tensors: list) -> list:
    """``tensors``, each 1-D (a view where it is not): what PyTorch's packing copies. The
    native module, where already loaded, finds the few that are not 1-D: one Python call
    per tensor is most of the cost of a rebind at tens of thousands. (It is not built here:
    the drop-in's reading has loaded it, or found that it cannot be had.)"""
    module = _STATE["module"]
    if module is None:
        return [_flat(t) for t in tensors]
    bent = array.array("q")
    bent.frombytes(module.bent(tensors))
    out = list(tensors)
    for i in bent:
        out[i] = out[i].view(-1)
    return out


def _codes(module) -> list:
    """``codes[c10::ScalarType index]``: the dtype code of the planner's descriptions."""
    if _STATE["codes"] is None:
        import torch

        dtypes = {v for v in vars(torch).values() if isinstance(v, torch.dtype)}
        pairs = [(module.scalar_type(d), dtype_code(d)) for d in dtypes]
        table = [-1] * (max(i for i, _ in pairs) + 1)
        for i, code in pairs:
            table[i] = code
        _STATE["codes"] = table
    return _STATE["codes"]


def failure() -> str | None:
    """Why the native reader is not in use (None when it is, or was not tried yet)."""
    return _STATE["failure"]


def load():
    """The native module, built if needed; None (and :func:`failure` says why) where it
    cannot be had."""
    if _STATE["module"] is not None or _STATE["failure"] is not None:
        return _STATE["module"]
    if os.environ.get("STREAMALLOC_P2P_NATIVE", "1").strip() == "0":
        _STATE["failure"] = "STREAMALLOC_P2P_NATIVE=0"
        return None
    try:
        _STATE["module"] = _build_and_import()
    except Exception as err:  # a missing compiler, headers, ...: the Python reader serves
        _STATE["failure"] = f"{type(err).__name__}: {str(err).strip().splitlines()[0] if str(err).strip() else ''}"
    return _STATE["module"]


def _paths():
    import torch

    from . import _door

    h = hashlib.sha256()
    for part in (torch.__version__, sys.version, _RECIPE):
        h.update(part.encode() + b"\0")
    for path in (SOURCE, *HEADERS):
        h.update(path.read_bytes())
    name = f"streamalloc_p2p_{h.hexdigest()[:16]}"
    folder = _door.cache_dir() / f"torch-{torch.__version__}" / name
    return name, folder, folder / f"{name}.so"


def _build_and_import():
    import torch  # noqa: F401  (the module links libtorch_python: load it first)

    name, folder, so = _paths()
    if not so.is_file():
        from torch.utils import cpp_extension

        from . import _door

        _door._check_tools()
        folder.mkdir(parents=True, exist_ok=True)
        sys.stderr.write("streamalloc: building the native P2POp reader (once, ~1 min)...\n")
        start = time.monotonic()
        cpp_extension.load(name=name, sources=[str(SOURCE)], extra_cflags=["-O2"],
                           build_directory=str(folder), with_cuda=False, verbose=False)
        sys.stderr.write(f"streamalloc: built it in {time.monotonic() - start:.0f} s ({so})\n")
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, so)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {so}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules[name] = module
    return module


def _main(argv) -> int:
    if argv[:1] != ["build"]:
        sys.stderr.write("usage: python -m streamalloc._p2p_native build\n")
        return 2
    if load() is None:
        sys.stderr.write(f"streamalloc: the native P2POp reader is unavailable: {failure()}\n")
        return 1
    print(f"native P2POp reader: {_paths()[2]}")
    import torch

    if torch.cuda.is_available():
        from . import _p2p_copy

        major, minor = torch.cuda.get_device_capability()
        try:
            _p2p_copy.cubin_for(f"{major}{minor}")
        except _p2p_copy.CopyUnavailable as err:
            sys.stderr.write(f"streamalloc: the p2p copy kernel is unavailable: {err}\n")
            return 1
        print(f"p2p copy kernel: sm_{major}{minor}, cached in {_p2p_copy.cache_dir()}")
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
