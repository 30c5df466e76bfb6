"""Finds ``libstreamalloc.so``, loads it once with ctypes and declares its C ABI.

Search order: the ``STREAMALLOC_LIB`` environment variable (a file), then the package's
own folder (where ``pip install`` puts it), its parent, and the Cargo build folders of a
source checkout (``$CARGO_TARGET_DIR/release``, ``target/release``). The first file that
exists wins; a missing library is a ``LibraryNotFound`` naming every place looked at.
"""

from __future__ import annotations

import ctypes
import json
import os
from pathlib import Path

ENV_VAR = "STREAMALLOC_LIB"
LIB_NAME = "libstreamalloc.so"

_lib: ctypes.CDLL | None = None
_path: Path | None = None


class LibraryNotFound(RuntimeError):
    """libstreamalloc.so is nowhere this module looks."""


# ---- structs: generated from src/ffi/layout.rs: do not edit (see tests/c_header.rs) ----
class StreamallocStats(ctypes.Structure):
    """streamalloc_stats_t: the engine's Stats, flattened. Byte gauges come as *_current / *_peak pairs."""

    _fields_ = [
        ("allocated_current", ctypes.c_uint64),
        ("allocated_peak", ctypes.c_uint64),
        ("requested_current", ctypes.c_uint64),
        ("requested_peak", ctypes.c_uint64),
        ("reserved_current", ctypes.c_uint64),
        ("reserved_peak", ctypes.c_uint64),
        ("active_current", ctypes.c_uint64),
        ("active_peak", ctypes.c_uint64),
        ("pending_free_current", ctypes.c_uint64),
        ("pending_free_peak", ctypes.c_uint64),
        ("allocs", ctypes.c_uint64),
        ("frees", ctypes.c_uint64),
        ("segment_allocs", ctypes.c_uint64),
        ("segment_frees", ctypes.c_uint64),
        ("cross_stream_waits", ctypes.c_uint64),
        ("events_recorded", ctypes.c_uint64),
        ("event_queries", ctypes.c_uint64),
        ("events_outstanding", ctypes.c_uint64),
        ("events_created", ctypes.c_uint64),
        ("events_destroyed", ctypes.c_uint64),
        ("ooms", ctypes.c_uint64),
        ("retries", ctypes.c_uint64),
        ("invalid_frees", ctypes.c_uint64),
        ("memory_limit", ctypes.c_uint64),
        ("device_syncs", ctypes.c_uint64),
        ("page_map_bytes", ctypes.c_uint64),
        ("page_unmap_bytes", ctypes.c_uint64),
        ("stitches", ctypes.c_uint64),
        ("stitched_map_bytes", ctypes.c_uint64),
        ("stitch_revivals", ctypes.c_uint64),
        ("stitch_evictions", ctypes.c_uint64),
        ("vmm_ns", ctypes.c_uint64),
        ("slow_paths", ctypes.c_uint64),
        ("slow_path_ns", ctypes.c_uint64),
        ("sleeping_bytes", ctypes.c_uint64),
        ("host_backup_bytes", ctypes.c_uint64),
    ]


class StreamallocSegmentInfo(ctypes.Structure):
    """streamalloc_segment_info_t: one segment of a snapshot; an expandable segment appears as one of these per run of mapped pages."""

    _fields_ = [
        ("address", ctypes.c_uint64),
        ("total_size", ctypes.c_uint64),
        ("stream", ctypes.c_uint64),
        ("pool_id0", ctypes.c_uint64),
        ("pool_id1", ctypes.c_uint64),
        ("is_large", ctypes.c_uint32),
        ("is_expandable", ctypes.c_uint32),
        ("first_block", ctypes.c_uint64),
        ("block_count", ctypes.c_uint64),
    ]


class StreamallocBlockState(ctypes.Structure):
    """streamalloc_block_state_t: one block of a snapshot."""

    _fields_ = [
        ("address", ctypes.c_uint64),
        ("size", ctypes.c_uint64),
        ("requested_size", ctypes.c_uint64),
        ("stream", ctypes.c_uint64),
        ("state", ctypes.c_uint32),
        ("reserved", ctypes.c_uint32),
    ]


class StreamallocPoolBlock(ctypes.Structure):
    """streamalloc_pool_block_t: one live allocation of a pool checkpoint."""

    _fields_ = [
        ("address", ctypes.c_uint64),
        ("size", ctypes.c_uint64),
        ("requested", ctypes.c_uint64),
        ("stream", ctypes.c_uint64),
    ]


class StreamallocSleepReport(ctypes.Structure):
    """streamalloc_sleep_report_t: what one streamalloc_sleep or streamalloc_wake did."""

    _fields_ = [
        ("bytes", ctypes.c_uint64),
        ("copied", ctypes.c_uint64),
        ("copies", ctypes.c_uint64),
    ]
# ---- end of generated text ----


def _candidates() -> list[Path]:
    here = Path(__file__).resolve().parent
    found = []
    env = os.environ.get(ENV_VAR)
    if env:
        found.append(Path(env))
    found += [here / LIB_NAME, here.parent / LIB_NAME]
    target = os.environ.get("CARGO_TARGET_DIR")
    if target:
        found.append(Path(target) / "release" / LIB_NAME)
    found.append(here.parent.parent / "target" / "release" / LIB_NAME)
    return found


def library_path() -> Path:
    """The library file :func:`load` uses (or would use)."""
    if _path is not None:
        return _path
    candidates = _candidates()
    if os.environ.get(ENV_VAR) and not candidates[0].is_file():
        raise LibraryNotFound(f"{ENV_VAR}={candidates[0]} is not a file")
    for candidate in candidates:
        if candidate.is_file():
            return candidate.resolve()
    raise LibraryNotFound(
        f"{LIB_NAME} not found; looked at: {', '.join(map(str, candidates))}. "
        f"Install streamalloc with `pip install .`, build it with `cargo build --release`, or set {ENV_VAR}."
    )


def load(path: str | os.PathLike | None = None) -> ctypes.CDLL:
    """Loads the library once (``path`` overrides the search) and returns it."""
    global _lib, _path
    if _lib is not None:
        if path is not None and Path(path).resolve() != _path:
            raise RuntimeError(f"streamalloc is already loaded from {_path}, not {path}")
        return _lib
    resolved = Path(path).resolve() if path is not None else library_path()
    lib = ctypes.CDLL(str(resolved))
    vp, i, sz, d = ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t, ctypes.c_double
    signatures = {
        "streamalloc_malloc": ([sz, i, vp], vp),
        "streamalloc_free": ([vp, sz, i, vp], None),
        "streamalloc_record_stream": ([vp, vp], None),
        "streamalloc_stream_volatile": ([i, vp], i),
        "streamalloc_empty_cache": ([], None),
        "streamalloc_set_memory_fraction": ([d, i], None),
        "streamalloc_reset_peak_stats": ([i], i),
        "streamalloc_get_stats": ([i, ctypes.POINTER(StreamallocStats)], i),
        "streamalloc_stats_json": ([i], ctypes.c_char_p),
        "streamalloc_dump_snapshot": ([ctypes.c_char_p, i], i),
        "streamalloc_last_error": ([], ctypes.c_char_p),
        "streamalloc_version": ([], ctypes.c_char_p),
        "streamalloc_set_error_thrower": ([vp], None),
        "streamalloc_torch_stat_name": ([sz], ctypes.c_char_p),
        "streamalloc_torch_stats": ([i, ctypes.POINTER(ctypes.c_int64), sz], ctypes.c_int64),
        "streamalloc_reset_accumulated_stats": ([i], i),
    }
    for name, (args, result) in signatures.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, result
    _lib, _path = lib, resolved
    return lib


def last_error() -> str:
    """The last failure's message on this thread ("" if none)."""
    return load().streamalloc_last_error().decode(errors="replace")


def stats(device: int) -> dict:
    """The engine's counters for ``device`` (see ``streamalloc_stats_json``)."""
    text = load().streamalloc_stats_json(device)
    if text is None:
        raise RuntimeError(last_error())
    return json.loads(text)


def torch_stat_names() -> list[str]:
    """PyTorch's ``memory_stats()`` keys the library fills, in its order."""
    lib, names = load(), []
    while (name := lib.streamalloc_torch_stat_name(len(names))) is not None:
        names.append(name.decode())
    return names


def torch_stats(device: int) -> dict:
    """``device``'s statistics under PyTorch's ``memory_stats()`` keys."""
    names = torch_stat_names()
    values = (ctypes.c_int64 * len(names))()
    n = load().streamalloc_torch_stats(device, values, len(names))
    if n < 0:
        raise RuntimeError(last_error())
    return dict(zip(names[:n], values[:n]))


def dump_snapshot(path: str | os.PathLike, device: int) -> None:
    """Writes ``device``'s snapshot as JSON to ``path``."""
    if load().streamalloc_dump_snapshot(os.fsencode(path), device) != 0:
        raise RuntimeError(last_error())
