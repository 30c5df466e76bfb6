"""streamalloc as PyTorch's CUDA allocator.

    import streamalloc.torch
    streamalloc.torch.install()       # before the first CUDA tensor
    ...
    torch.cuda.memory_stats()         # answered by streamalloc
    streamalloc.torch.dump_snapshot("snap.json")
    with streamalloc.torch.region("kv_cache"):   # tagged memory, see streamalloc._sleep
        cache = torch.empty(...)
    streamalloc.torch.sleep(["kv_cache"], backup="cpu")  # GPU memory back to the driver
    streamalloc.torch.wake(["kv_cache"])                 # same addresses, contents back

Two doors lead into PyTorch:

* **native** (the default): a small C++ ``CUDAAllocator`` (``csrc/torch_door.cpp``),
  compiled once against the installed PyTorch (``streamalloc._door``) and installed the
  way PyTorch's own ``cudaMallocAsync`` backend is. PyTorch then asks streamalloc
  everything it asks its own allocator: ``torch.cuda.memory_stats()`` and friends,
  ``torch.cuda.memory._snapshot()`` / ``_record_memory_history()``, CUDA graph and
  ``MemPool`` pools, checkpoints (cudagraph trees), IPC handles, ``cudnn.benchmark``'s
  cache query. Nothing in ``torch.cuda`` is replaced.
* **pluggable**: ``torch.cuda.memory.CUDAPluggableAllocator`` over the C ABI, no
  compiler needed. PyTorch drops most questions for pluggable allocators; ``install()``
  registers the hooks it does take (``record_stream``, ``empty_cache``,
  ``set_per_process_memory_fraction``, pools when the library exports them) and replaces
  ``torch.cuda``'s statistics functions with this module's.

``install(door="auto")`` tries native and falls back to pluggable with a one-line warning
saying why; ``STREAMALLOC_DOOR`` sets the default. ``door()`` says which one is in use.

Out of memory through the pluggable door: PyTorch's pluggable hook does not check for a
null pointer (it would make a tensor at address 0). ``install()`` therefore registers
libc10's ``torchCheckFail`` as the library's error thrower: a failed allocation raises
``RuntimeError`` with our report. The native door raises ``torch.OutOfMemoryError`` itself,
after PyTorch's OOM observers ran. Both messages begin ``CUDA out of memory.`` as
PyTorch's do, which is what batch size finders look for.
"""

from __future__ import annotations

import ctypes
import os
import warnings

from . import _install_state as _state
from . import _lib
from ._install_state import InstallError, TorchNotFound, door, installed
from ._install_state import device as _device
from ._install_state import import_torch as _import_torch
from ._sleep import SleepError, region, region_pool, release_host_backup, sleep, tags, wake

__all__ = [
    "InstallError", "TorchNotFound", "install", "installed", "door", "memory_stats", "memory_allocated",
    "max_memory_allocated", "memory_reserved", "max_memory_reserved",
    "reset_peak_memory_stats", "reset_accumulated_memory_stats", "empty_cache", "dump_snapshot",
    "last_error", "raw_stats",
    # sleep and wake of tagged memory (streamalloc._sleep)
    "SleepError", "region", "region_pool", "sleep", "wake", "release_host_backup", "tags",
]

# setter on PyTorch's _CUDAPluggableAllocator -> our symbol
_HOOKS = {
    "set_record_stream_fn": "streamalloc_record_stream",
    "set_reset_fn": "streamalloc_empty_cache",
    "set_memory_fraction_fn": "streamalloc_set_memory_fraction",
}

_PATCHED = (
    "memory_stats", "memory_allocated", "max_memory_allocated", "memory_reserved",
    "max_memory_reserved", "reset_peak_memory_stats", "reset_max_memory_allocated",
    "reset_accumulated_memory_stats",
)

# setter on PyTorch's _CUDAPluggableAllocator -> our symbol, registered when both exist
_POOL_HOOKS = {
    "set_begin_allocate_to_pool": "streamalloc_begin_allocate_to_pool",
    "set_end_allocate_to_pool_fn": "streamalloc_end_allocate_to_pool",
    "set_release_pool": "streamalloc_release_pool",
}

DOORS = ("auto", "native", "pluggable")

def install(
    door: str | None = None,
    path: str | os.PathLike | None = None,
    patch_torch: bool | None = None,
) -> None:
    """Makes streamalloc PyTorch's CUDA allocator. Call it before any CUDA tensor exists.

    ``door``: ``"native"`` (the C++ door, built at first use), ``"pluggable"`` (PyTorch's
    CUDAPluggableAllocator), or ``"auto"``: native, else pluggable with a one-line warning.
    Default: ``$STREAMALLOC_DOOR``, else ``"auto"``. ``path`` overrides where
    ``libstreamalloc.so`` is found. ``patch_torch`` (pluggable door only, default True)
    replaces ``torch.cuda``'s memory statistics functions with this module's; the native
    door never needs it. Calling it again is a no-op.
    """
    if _state.allocator is not None:
        return
    if door is None:
        door = os.environ.get("STREAMALLOC_DOOR") or "auto"
    if door not in DOORS:
        raise ValueError(f"door must be one of {', '.join(DOORS)}, not {door!r}")
    torch = _import_torch()

    _lib.load(path)
    native_unavailable = None
    if door in ("auto", "native"):
        try:
            module = _install_native(torch)
        except InstallError:
            raise
        except Exception as err:  # the door could not be built or loaded
            if door == "native":
                raise InstallError(f"streamalloc: the native PyTorch door is unavailable: {err}") from err
            native_unavailable = _one_line(err)
        else:
            _state.allocator, _state.door_in_use = module, "native"
            return
    try:
        _state.allocator = _install_pluggable(torch)
    except InstallError as err:
        if native_unavailable is None:
            raise
        raise InstallError(f"{err} (and the native door is unavailable: {native_unavailable})") from err
    _state.door_in_use = "pluggable"
    if native_unavailable is not None:
        warnings.warn(
            f"streamalloc: using the pluggable door (native door unavailable: {native_unavailable})",
            stacklevel=2,
        )
    if patch_torch is None or patch_torch:
        _patch_torch(torch)


def _one_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def _install_native(torch):
    if torch.cuda.is_initialized():
        raise InstallError(_ALREADY + " (torch.cuda is already initialized)")
    from . import _door as door_module

    module = door_module.load()
    try:
        module.install()
    except RuntimeError as err:
        if "already initialized" in str(err):
            raise InstallError(f"{_ALREADY}. PyTorch said: {err}") from err
        raise
    return module


_ALREADY = (
    "PyTorch has already initialised its own CUDA allocator (a CUDA tensor was created "
    "before streamalloc.torch.install()); call install() first, e.g. at the top of the program"
)


def _install_pluggable(torch):
    lib = _lib.load()
    so = str(_lib.library_path())
    pluggable = torch.cuda.memory.CUDAPluggableAllocator(so, "streamalloc_malloc", "streamalloc_free")
    raw = pluggable.allocator()
    for setter, symbol in _HOOKS.items():
        register = getattr(raw, setter, None)
        if register is None:
            raise InstallError(
                f"PyTorch {torch.__version__} has no {setter} on its pluggable allocator; "
                "streamalloc needs it (without record_stream, isend buffers could be reused early)"
            )
        register(ctypes.cast(getattr(lib, symbol), ctypes.c_void_p).value)
    for setter, symbol in _POOL_HOOKS.items():
        register = getattr(raw, setter, None)
        if register is not None and hasattr(lib, symbol):
            register(ctypes.cast(getattr(lib, symbol), ctypes.c_void_p).value)
    thrower = _c10_thrower(torch)
    if thrower is None:
        warnings.warn(
            "streamalloc: libc10's torchCheckFail not found; an out-of-memory will return a null "
            "pointer to PyTorch (reported on stderr) instead of raising"
        )
    else:
        lib.streamalloc_set_error_thrower(thrower)
    try:
        torch.cuda.memory.change_current_allocator(pluggable)
    except RuntimeError as err:
        raise InstallError(f"{_ALREADY}. PyTorch said: {err}") from err
    _mark_external_streams(torch, lib)
    return pluggable


def _mark_external_streams(torch, lib) -> None:
    """Marks every ``torch.cuda.ExternalStream`` made from now on volatile in the library.

    The pluggable hook gets a bare stream handle, and an external stream's owner (CuPy,
    TensorRT, DALI, an extension) may destroy it while blocks freed on it are cached: the
    library must then never name it again (the native door tells the two kinds apart by
    PyTorch's stream id)."""
    cls = getattr(torch.cuda, "ExternalStream", None)
    if not isinstance(cls, type):
        return  # a PyTorch without it (or a stand-in): nothing to mark
    original = cls.__new__
    if getattr(original, "_streamalloc_marks", False):
        return

    def __new__(klass, stream_ptr, device=None, **kwargs):
        stream = original(klass, stream_ptr, device=device, **kwargs)
        lib.streamalloc_stream_volatile(stream.device_index, stream_ptr)
        return stream

    __new__._streamalloc_marks = True
    cls.__new__ = staticmethod(__new__)


# c10::detail::torchCheckFail(const char* func, const char* file, uint32_t line, const char* msg):
# throws c10::Error, which PyTorch turns into a Python RuntimeError.
_TORCH_CHECK_FAIL = "_ZN3c106detail14torchCheckFailEPKcS2_jS2_"


def _c10_thrower(torch):
    path = os.path.join(os.path.dirname(torch.__file__), "lib", "libc10.so")
    try:
        c10 = ctypes.CDLL(path)
        return ctypes.cast(getattr(c10, _TORCH_CHECK_FAIL), ctypes.c_void_p).value
    except (OSError, AttributeError):
        return None


def _patch_torch(torch) -> None:
    mine = globals()
    for name in _PATCHED:
        for module in (torch.cuda, torch.cuda.memory):
            if hasattr(module, name):
                setattr(module, name, mine[name])


def raw_stats(device=None) -> dict:
    """Our counters, as the library reports them (``streamalloc_stats_json``)."""
    return _lib.stats(_device(device))


def memory_stats(device=None) -> dict:
    """Counters under ``torch.cuda.memory_stats()``'s flat keys (the library names them),
    plus the engine's own under ``streamalloc.*``."""
    index = _device(device)
    out = _lib.torch_stats(index)
    raw = _lib.stats(index)
    for key, value in raw["stats"].items():
        if key == "torch":  # PyTorch's view of the same counters: the keys above
            continue
        if isinstance(value, dict):
            for sub, v in value.items():
                out[f"streamalloc.{key}.{sub}"] = v
        else:
            out[f"streamalloc.{key}"] = value
    out["streamalloc.memory_limit"] = raw["memory_limit"] or 0
    out["streamalloc.process.invalid_frees"] = raw["process"]["invalid_frees"]
    out["streamalloc.process.unknown_record_streams"] = raw["process"]["unknown_record_streams"]
    return dict(sorted(out.items()))


def memory_allocated(device=None) -> int:
    """Bytes in blocks handed to tensors (``torch.cuda.memory_allocated``)."""
    return raw_stats(device)["stats"]["allocated_bytes"]["current"]


def max_memory_allocated(device=None) -> int:
    """Peak of :func:`memory_allocated` since the last reset."""
    return raw_stats(device)["stats"]["allocated_bytes"]["peak"]


def memory_reserved(device=None) -> int:
    """Bytes obtained from the driver (``torch.cuda.memory_reserved``)."""
    return raw_stats(device)["stats"]["reserved_bytes"]["current"]


def max_memory_reserved(device=None) -> int:
    """Peak of :func:`memory_reserved` since the last reset."""
    return raw_stats(device)["stats"]["reserved_bytes"]["peak"]


def reset_peak_memory_stats(device=None) -> None:
    """Sets every peak to its current value."""
    if _lib.load().streamalloc_reset_peak_stats(_device(device)) != 0:
        raise RuntimeError(_lib.last_error())


reset_max_memory_allocated = reset_peak_memory_stats


def reset_accumulated_memory_stats(device=None) -> None:
    """Starts the accumulated counters (every ``allocated``/``freed``, retries, OOMs, ...)
    from zero again; current values and peaks stay."""
    if _lib.load().streamalloc_reset_accumulated_stats(_device(device)) != 0:
        raise RuntimeError(_lib.last_error())


def empty_cache() -> None:
    """Returns wholly free cached segments to the driver (every device in use)."""
    _lib.load().streamalloc_empty_cache()


def dump_snapshot(path: str | os.PathLike, device=None) -> None:
    """Writes the device's snapshot (segments, blocks, trace ring, stats) as JSON."""
    _lib.dump_snapshot(path, _device(device))


def last_error() -> str:
    """The library's last failure message on this thread (e.g. the out-of-memory report)."""
    return _lib.last_error()
