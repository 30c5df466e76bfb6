"""The ``streamalloc`` command of an installed wheel, and the Python half of
``streamalloc doctor`` and ``streamalloc build-torch-ext``.

The wheel carries the Rust command-line program at ``streamalloc/bin/streamalloc``, next to
the libraries it finds (``streamalloc/libstreamalloc.so``, ...). The ``streamalloc``
console script runs :func:`main`, which replaces this process with that program and tells
it which Python started it (``STREAMALLOC_PYTHON_EXE``), so that ``doctor`` and
``build-torch-ext`` look at this environment's PyTorch.
"""

from __future__ import annotations

import json
import os
import platform
import sys
from pathlib import Path

BIN = Path(__file__).resolve().parent / "bin" / "streamalloc"


def main() -> int:
    """Entry point of the ``streamalloc`` console script."""
    if not BIN.is_file():
        sys.stderr.write(f"streamalloc: the bundled program {BIN} is missing; reinstall streamalloc\n")
        return 2
    os.environ.setdefault("STREAMALLOC_PYTHON_EXE", sys.executable)
    os.execv(str(BIN), [str(BIN), *sys.argv[1:]])
    return 2  # not reached: execv replaces the process or raises


def probe() -> dict:
    """What ``streamalloc doctor`` reports about this Python: PyTorch and the door's cache."""
    out: dict = {
        "python": sys.executable,
        "python_version": platform.python_version(),
        "package": str(Path(__file__).resolve().parent),
    }
    try:
        import torch
    except Exception as err:  # a broken install is as much an answer as a missing one
        out["torch_error"] = _one_line(err)
        return out
    out["torch"] = str(torch.__version__)
    out["torch_cuda"] = getattr(torch.version, "cuda", None)
    try:
        from . import _door, _lib

        _, build_dir, so = _door._paths(torch, _lib.library_path().parent)
        out["door"] = str(so)
        out["door_built"] = (build_dir / _door._OK).is_file() and so.is_file()
    except Exception as err:
        out["door_error"] = _one_line(err)
    return out


def build_torch_ext(force: bool = False, verbose: bool = False) -> int:
    """Builds the native door now, step by step; one line naming what is missing on failure."""
    say = lambda text: (sys.stderr.write(f"streamalloc: {text}\n"), sys.stderr.flush())  # noqa: E731
    try:
        import torch
    except Exception as err:
        say(f"build-torch-ext: PyTorch is not importable in {sys.executable}: {_one_line(err)} (pip install torch)")
        return 1
    from . import _door, _lib

    try:
        lib = _lib.library_path()
        say(f"[1/4] PyTorch {torch.__version__} (CUDA {torch.version.cuda}) in {sys.executable}")
        if not getattr(torch.version, "cuda", None):
            raise _door.DoorUnavailable("this PyTorch is a CPU-only build: install a CUDA build of torch")
        say(f"[2/4] library {lib}")
        _, build_dir, so = _door._paths(torch, lib.parent)
        if not force and (build_dir / _door._OK).is_file() and so.is_file():
            say(f"[3/4] already built for this PyTorch: {so}")
            say("[4/4] done")
            print(so)
            return 0
        _door._check_tools()
        say(f"[3/4] compiler, ninja and Python headers found; CUDA headers in {_door.cuda_include(torch)}")
        say("[4/4] compiling (about a minute; --verbose shows the compiler)")
        so = _door.build(force=force, verbose=verbose)
    except (_door.DoorUnavailable, _lib.LibraryNotFound) as err:
        say(f"build-torch-ext: {_one_line(err)}")
        return 1
    print(so)
    return 0


def tool(argv: list[str]) -> int:
    """``streamalloc doctor`` / ``build-torch-ext`` call this through ``python -c``."""
    if argv[:1] == ["probe"]:
        print(json.dumps(probe()))
        return 0
    if argv[:1] == ["build-torch-ext"]:
        return build_torch_ext(force="--force" in argv, verbose="--verbose" in argv)
    sys.stderr.write("usage: python -m streamalloc._cli probe | build-torch-ext [--force] [--verbose]\n")
    return 2


def _one_line(err: BaseException) -> str:
    text = str(err).strip()
    first = text.splitlines()[0] if text else ""
    return f"{type(err).__name__}: {first}" if not isinstance(err, RuntimeError) else first


if __name__ == "__main__":
    sys.exit(tool(sys.argv[1:]))
