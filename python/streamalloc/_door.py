"""Builds and loads the native PyTorch door (``csrc/torch_door.cpp`` and its parts).

The door is a small C++ extension: a ``c10::cuda::CUDACachingAllocator::CUDAAllocator``
over ``libstreamalloc.so``'s C ABI (``csrc/streamalloc.h``), which
``streamalloc.torch.install()`` makes PyTorch's CUDA allocator. Its sources are one file
per seam, declared together in ``csrc/door.h`` (``SOURCES`` lists them). It is compiled
once per (PyTorch version, sources, library folder) with ``torch.utils.cpp_extension`` and
cached under ``$STREAMALLOC_CACHE`` (default ``~/.cache/streamalloc``); later processes
import the cached module without a compiler.

    python -c "import streamalloc._door as d; print(d.build())"   # build ahead of time

Needs, at build time only: a C++ compiler (``$CXX`` or ``c++``), ``ninja``, Python's
headers, and the CUDA runtime headers (from ``$CUDA_HOME``, or the ``nvidia`` pip packages
that PyTorch wheels install). Each missing piece is a one-line :class:`DoorUnavailable`.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import re
import shutil
import sys
import sysconfig
import time
from pathlib import Path

from . import _lib

CSRC = Path(__file__).resolve().parent / "csrc"
# The module first; then allocation, pools, statistics, the memory history, IPC.
SOURCES = tuple(
    CSRC / name
    for name in (
        "torch_door.cpp",
        "door_allocate.cpp",
        "door_pools.cpp",
        "door_stats.cpp",
        "door_history.cpp",
        "door_ipc.cpp",
    )
)
HEADERS = (CSRC / "streamalloc.h", CSRC / "door.h")
# Part of the cache key: change it when the flags below change.
_BUILD_RECIPE = "1"
_OK = "streamalloc-door.ok"

_module = None


class DoorUnavailable(RuntimeError):
    """The native door cannot be built or loaded here (the message says why)."""


def cache_dir() -> Path:
    """Where built doors are kept: ``$STREAMALLOC_CACHE`` or ``~/.cache/streamalloc``."""
    env = os.environ.get("STREAMALLOC_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "streamalloc"


def _cuda_major(include: Path) -> int | None:
    try:
        text = (include / "cuda_runtime_api.h").read_text(errors="replace")
    except OSError:
        return None
    m = re.search(r"#define\s+CUDART_VERSION\s+(\d+)", text)
    return int(m.group(1)) // 1000 if m else None


def _nvidia_roots(torch) -> list[Path]:
    roots = []
    try:
        import nvidia  # namespace package of the CUDA pip wheels

        roots += [Path(p) for p in nvidia.__path__]
    except ImportError:
        pass
    roots.append(Path(torch.__file__).resolve().parent.parent / "nvidia")
    seen, out = set(), []
    for r in roots:
        if r not in seen and r.is_dir():
            seen.add(r)
            out.append(r)
    return out


def cuda_include(torch) -> Path:
    """The folder holding ``cuda_runtime_api.h`` (and ``crt/``) for this PyTorch's CUDA."""
    want = None
    if getattr(torch.version, "cuda", None):
        want = int(torch.version.cuda.split(".")[0])
    candidates = []
    from torch.utils import cpp_extension

    home = cpp_extension.CUDA_HOME
    if home:
        candidates.append(Path(home) / "include")
    for root in _nvidia_roots(torch):
        candidates += [root / f"cu{want}" / "include"] if want else []
        candidates += sorted(root.glob("cu[0-9]*/include"), reverse=True)
        candidates.append(root / "cuda_runtime" / "include")
    usable = [c for c in candidates if (c / "cuda_runtime_api.h").is_file() and (c / "crt").is_dir()]
    # A toolkit of another major version than PyTorch's would declare a different runtime.
    for c in usable:
        if want is None or _cuda_major(c) == want:
            return c
    if usable:
        return usable[0]
    looked = ", ".join(str(c) for c in candidates) or "nowhere (no CUDA_HOME, no nvidia packages)"
    raise DoorUnavailable(
        "building the PyTorch door needs the CUDA runtime headers (cuda_runtime_api.h and crt/); "
        f"looked in {looked}; install a CUDA toolkit (set CUDA_HOME) or "
        "`pip install nvidia-cuda-runtime nvidia-cuda-crt`"
    )


def _check_tools() -> None:
    cxx = os.environ.get("CXX", "c++")
    if shutil.which(cxx) is None:
        raise DoorUnavailable(
            f"building the PyTorch door needs a C++ compiler: `{cxx}` not found (install g++ or set CXX)"
        )
    from torch.utils import cpp_extension

    if not cpp_extension.is_ninja_available():
        raise DoorUnavailable("building the PyTorch door needs ninja: `pip install ninja`")
    python_h = Path(sysconfig.get_paths()["include"]) / "Python.h"
    if not python_h.is_file():
        raise DoorUnavailable(
            f"building the PyTorch door needs Python's headers: {python_h} is missing "
            "(install python3-dev or your Python's development package)"
        )


def _key(torch, libdir: Path) -> str:
    h = hashlib.sha256()
    for part in (
        torch.__version__,
        str(getattr(torch.version, "cuda", None)),
        sys.version,
        _BUILD_RECIPE,
        str(libdir),
    ):
        h.update(part.encode())
        h.update(b"\0")
    for f in SOURCES + HEADERS:
        h.update(f.read_bytes())
    return h.hexdigest()[:16]


def _paths(torch, libdir: Path) -> tuple[str, Path, Path]:
    key = _key(torch, libdir)
    name = f"streamalloc_door_{key}"
    build_dir = cache_dir() / f"torch-{torch.__version__}" / name
    return name, build_dir, build_dir / f"{name}{_ext_suffix()}"


def _ext_suffix() -> str:
    # torch.utils.cpp_extension.load names the library <name>.so on Linux.
    return ".so"


def build(force: bool = False, verbose: bool = False) -> Path:
    """Builds the door for the installed PyTorch (unless cached) and returns its path."""
    return _build(force, verbose)[0]


def _build(force: bool, verbose: bool):
    """(path, module imported by the build or None)."""
    import torch

    lib = _lib.library_path()
    libdir = lib.parent
    name, build_dir, so = _paths(torch, libdir)
    if not force and (build_dir / _OK).is_file() and so.is_file():
        return so, None
    _check_tools()
    include = cuda_include(torch)
    from torch.utils import cpp_extension

    build_dir.mkdir(parents=True, exist_ok=True)
    (build_dir / _OK).unlink(missing_ok=True)
    torch_lib = Path(torch.__file__).resolve().parent / "lib"
    ldflags = [f"-L{torch_lib}", "-lc10_cuda", f"-Wl,-rpath,{torch_lib}"]
    if lib.name == "libstreamalloc.so":
        ldflags += [f"-L{libdir}", "-lstreamalloc"]
    else:
        ldflags += [str(lib)]
    ldflags.append(f"-Wl,-rpath,{libdir}")
    sys.stderr.write("streamalloc: building the PyTorch door (once, ~1 min)...\n")
    sys.stderr.flush()
    start = time.monotonic()
    try:
        module = cpp_extension.load(
            name=name,
            sources=[str(source) for source in SOURCES],
            extra_cflags=["-O2"],
            extra_include_paths=[str(CSRC), str(include)],
            extra_ldflags=ldflags,
            build_directory=str(build_dir),
            with_cuda=False,  # no nvcc needed: the door is plain C++ over the CUDA runtime API
            verbose=verbose,
        )
    except ImportError as err:
        # Built, but does not load: typically an undefined symbol, the library predating a
        # function the door calls. Keep the build: it loads once the library has it.
        if so.is_file():
            (build_dir / _OK).write_text(f"{torch.__version__}\n{lib}\n")
        raise DoorUnavailable(f"the PyTorch door at {so} does not load with {lib}: {err}") from err
    except Exception as err:  # compiler output is in the exception; keep the first line short
        raise DoorUnavailable(
            f"building the PyTorch door failed in {build_dir}: {type(err).__name__}: "
            f"{_first_line(err)} (rerun streamalloc._door.build(force=True, verbose=True) for the log)"
        ) from err
    if not so.is_file():
        raise DoorUnavailable(f"building the PyTorch door produced no {so}")
    (build_dir / _OK).write_text(f"{torch.__version__}\n{lib}\n")
    sys.stderr.write(f"streamalloc: built the PyTorch door in {time.monotonic() - start:.0f} s ({so})\n")
    return so, module


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else ""


def load():
    """Builds if needed, then imports the door module (once per process)."""
    global _module
    if _module is not None:
        return _module
    import torch  # noqa: F401  (the door links libc10 and torch's bindings: load them first)

    _lib.load()  # the door must use the very library the ctypes side has loaded
    so, module = _build(False, False)
    if module is not None:  # the build imported it already
        _module = module
        return module
    name = so.name[: -len(_ext_suffix())]
    spec = importlib.util.spec_from_file_location(name, so)
    if spec is None or spec.loader is None:
        raise DoorUnavailable(f"cannot import the PyTorch door from {so}")
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except ImportError as err:
        # Typically an undefined symbol: the library predates a function the door calls.
        raise DoorUnavailable(
            f"the PyTorch door at {so} does not load with {_lib.library_path()}: {err}"
        ) from err
    sys.modules[name] = module
    _module = module
    return module


def syntax_check(torch_include: str | None = None, cuda_include_dir: str | None = None) -> int:
    """Compiles every source of the door with ``-fsyntax-only -Wall -Werror`` (no link, no
    GPU, no torch import needed when both folders are given). Returns 0 on success or when skipped (no PyTorch
    or CUDA headers here: CI machines without torch), 1 on compiler errors; says which on
    stderr.

    Folders: ``torch_include`` (PyTorch's ``include``), ``cuda_include_dir``; default
    ``$TORCH_INCLUDE`` / ``$CUDA_INCLUDE``, else found through an importable torch.
    """
    import subprocess

    torch_include = torch_include or os.environ.get("TORCH_INCLUDE")
    cuda_include_dir = cuda_include_dir or os.environ.get("CUDA_INCLUDE")
    if not torch_include or not cuda_include_dir:
        try:
            import torch
        except ImportError:
            torch = None
        if torch is not None:
            torch_include = torch_include or str(Path(torch.__file__).resolve().parent / "include")
            if not cuda_include_dir:
                try:
                    cuda_include_dir = str(cuda_include(torch))
                except DoorUnavailable as err:
                    sys.stderr.write(f"streamalloc: door syntax check skipped: {err}\n")
                    return 0
    if not torch_include or not Path(torch_include, "c10", "cuda", "CUDACachingAllocator.h").is_file():
        sys.stderr.write(
            "streamalloc: door syntax check skipped: no PyTorch headers (set TORCH_INCLUDE and "
            "CUDA_INCLUDE, or install torch)\n"
        )
        return 0
    if not cuda_include_dir or not Path(cuda_include_dir, "cuda_runtime_api.h").is_file():
        sys.stderr.write("streamalloc: door syntax check skipped: no CUDA runtime headers (set CUDA_INCLUDE)\n")
        return 0
    cxx = os.environ.get("CXX", "c++")
    cmd = [
        cxx, "-std=c++17", "-fsyntax-only", "-Wall", "-Werror",
        "-DTORCH_EXTENSION_NAME=streamalloc_door_check",
        f"-I{torch_include}", f"-I{Path(torch_include, 'torch', 'csrc', 'api', 'include')}",
        f"-I{cuda_include_dir}", f"-I{sysconfig.get_paths()['include']}", f"-I{CSRC}",
    ]
    failed = []
    for source in SOURCES:
        sys.stderr.write(f"streamalloc: checking {source.name}\n")
        if subprocess.run(cmd + [str(source)]).returncode != 0:
            failed.append(source.name)
    verdict = f"FAILED in {', '.join(failed)}" if failed else "passed"
    sys.stderr.write(f"streamalloc: door syntax check {verdict}\n")
    return 1 if failed else 0


def _main(argv: list[str]) -> int:
    usage = "usage: python -m streamalloc._door build [--force] [--verbose] | check"
    if not argv or argv[0] not in ("build", "check"):
        sys.stderr.write(usage + "\n")
        return 2
    if argv[0] == "check":
        return syntax_check()
    try:
        print(build(force="--force" in argv, verbose="--verbose" in argv))
    except DoorUnavailable as err:
        sys.stderr.write(f"streamalloc: {err}\n")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
