"""Sleep and wake: tagged memory gives its GPU memory back and takes it again at the same
addresses (``streamalloc.torch.region``, ``sleep``, ``wake``).

    import streamalloc.torch as sa
    sa.install()
    with sa.region("weights"):
        model = build_model().cuda()
    with sa.region("kv_cache"):
        cache = torch.empty(blocks, block_bytes, dtype=torch.uint8, device="cuda")
    ...
    sa.sleep(["weights", "kv_cache"], backup="cpu")  # the memory goes back to the driver
    train_step()                                      # the trainer has the GPU
    sa.wake(["weights", "kv_cache"])                  # same data_ptr()s, contents back

A tag is a memory pool of its own (a ``torch.cuda.MemPool`` created for it on first use
and kept for the life of the process), so its pages are never shared with untagged
tensors. ``sleep`` waits for the streams that use the pool (events, then host waits; the
rest of the GPU runs on), copies live tensors to page-locked host memory with
``backup="cpu"`` (one copy per contiguous run; the buffer is kept for the next sleep until
``release_host_backup``), and unmaps every page, keeping addresses and tensors; ``wake``
maps fresh pages at the same addresses and copies the backup back. CUDA graphs that
captured these addresses replay correctly after ``wake``.

While a tag sleeps, allocating in it raises, and touching its tensors from a kernel is an
illegal memory access: the program's bug, found with ``compute-sanitizer``. Needs
``expandable_segments:true`` (the default under ``install()``).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import signal
import sys
import time

from . import _lib
from ._install_state import device as _device
from ._install_state import installed as _installed

BACKUPS = {"none": 0, "cpu": 1}

# (device, tag) -> the torch.cuda.MemPool that holds the tag's memory.
_pools: dict = {}


class SleepError(RuntimeError):
    """A tag, sleep or wake call was refused (nothing changed), or failed."""


def _declare(lib):
    """Declares the sleep functions' signatures on the loaded library, once."""
    if getattr(lib, "_sleep_declared", False):
        return lib
    c, i, u64, sz = ctypes.c_char_p, ctypes.c_int, ctypes.c_uint64, ctypes.c_size_t
    tags = ctypes.POINTER(ctypes.c_char_p)
    report = ctypes.POINTER(_lib.StreamallocSleepReport)
    for name, args, result in (
        ("streamalloc_tag_pool", [i, u64, u64, c], i),
        ("streamalloc_sleep", [i, tags, sz, i, report], i),
        ("streamalloc_wake", [i, tags, sz, report], i),
        ("streamalloc_release_host_backup", [i, tags, sz], ctypes.c_int64),
        ("streamalloc_tags_json", [i], c),
        ("streamalloc_pool_incref", [i, u64, u64], i),
    ):
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, result
    lib._sleep_declared = True
    return lib


def _library():
    return _declare(_lib.load())


def _check_tag(tag) -> bytes:
    if not isinstance(tag, str):
        raise TypeError(f"a tag is a str, not {type(tag).__name__}")
    raw = tag.encode()
    if not raw or b"\0" in raw or len(raw) > 256:
        shown = repr(tag) if len(tag) <= 40 else repr(tag[:40]) + "..."
        raise ValueError(f"invalid tag {shown}: a tag is 1 to 256 bytes with no NUL")
    return raw


def _tag_list(tags) -> list[bytes]:
    if isinstance(tags, str):
        tags = [tags]
    try:
        names = list(tags)
    except TypeError:
        raise TypeError(f"tags must be a str or an iterable of str, not {type(tags).__name__}") from None
    if not names:
        raise ValueError("no tags given")
    return [_check_tag(tag) for tag in names]


def _c_tags(names: list[bytes]):
    return (ctypes.c_char_p * len(names))(*names)


def _require_installed() -> None:
    if not _installed():
        raise SleepError(
            "streamalloc is not PyTorch's allocator in this process: call "
            "streamalloc.torch.install() first (or run under `streamalloc run`)"
        )


def _fail(what: str):
    raise SleepError(_lib.last_error() or f"{what} failed")


def _pool(tag: str, device: int):
    """The ``torch.cuda.MemPool`` of ``tag`` on ``device``, made and tagged on first use."""
    key = (device, tag)
    pool = _pools.get(key)
    if pool is not None:
        return pool
    import torch

    raw = _check_tag(tag)
    lib = _library()
    with torch.cuda.device(device):
        pool = torch.cuda.MemPool()
    id0, id1 = pool.id
    # The region holds a use of its own: whichever door created the pool, it lives as long
    # as the process (the pluggable door creates pools only when they are first entered).
    if lib.streamalloc_pool_incref(device, id0, id1) < 0:
        _fail("creating the pool")
    if lib.streamalloc_tag_pool(device, id0, id1, raw) != 0:
        _fail(f"tagging pool {pool.id}")
    _pools[key] = pool
    return pool


@contextlib.contextmanager
def region(tag: str, device=None):
    """Allocations made inside (on ``device``, default the current one, by this thread) go
    to ``tag``'s memory pool, which :func:`sleep` and :func:`wake` name. Yields the pool
    (a ``torch.cuda.MemPool``). Nothing can be put to sleep while a region is open."""
    _require_installed()
    _check_tag(tag)
    import torch

    index = _device(device)
    pool = _pool(tag, index)
    with torch.cuda.use_mem_pool(pool, device=index):
        yield pool


def region_pool(tag: str, device=None):
    """The ``torch.cuda.MemPool`` of ``tag`` (made on first use), e.g. for
    ``torch.cuda.graph(..., pool=...)``."""
    _require_installed()
    return _pool(tag, _device(device))


def _report(out, seconds: float) -> dict:
    return {"bytes": out.bytes, "copied": out.copied, "copies": out.copies, "seconds": seconds}


def sleep(tags, backup: str = "none", device=None) -> dict:
    """Puts ``tags`` (a tag or a list of them) to sleep on ``device``: their GPU memory goes
    back to the driver, their tensors keep their addresses. ``backup="cpu"`` copies live
    tensors to page-locked host memory first (``wake`` restores them); ``"none"`` keeps
    nothing (for memory rewritten before it is read, like a KV cache). Returns
    ``{"bytes", "copied", "copies", "seconds"}``. Raises :class:`SleepError` for an unknown
    or sleeping tag, inside a region or graph capture, with nothing changed."""
    if backup not in BACKUPS:
        raise ValueError(f"backup must be one of {', '.join(map(repr, BACKUPS))}, not {backup!r}")
    names = _tag_list(tags)
    _require_installed()
    lib, index = _library(), _device(device)
    out = _lib.StreamallocSleepReport()
    start = time.perf_counter()
    if lib.streamalloc_sleep(index, _c_tags(names), len(names), BACKUPS[backup], ctypes.byref(out)) != 0:
        _fail("sleep")
    return _report(out, time.perf_counter() - start)


def wake(tags, device=None) -> dict:
    """Wakes the sleeping ``tags`` on ``device``: fresh GPU memory at the addresses they
    left, their backup copied back. Returns ``{"bytes", "copied", "copies", "seconds"}``.
    Raises :class:`SleepError` for an unknown or awake tag, inside a region or graph
    capture, or when the memory does not fit, with nothing changed."""
    names = _tag_list(tags)
    _require_installed()
    lib, index = _library(), _device(device)
    out = _lib.StreamallocSleepReport()
    start = time.perf_counter()
    if lib.streamalloc_wake(index, _c_tags(names), len(names), ctypes.byref(out)) != 0:
        _fail("wake")
    return _report(out, time.perf_counter() - start)


def release_host_backup(tags, device=None) -> int:
    """Frees the page-locked host memory that the awake ``tags`` keep for their next
    backup. Returns the bytes freed."""
    names = _tag_list(tags)
    _require_installed()
    freed = _library().streamalloc_release_host_backup(_device(device), _c_tags(names), len(names))
    if freed < 0:
        _fail("release_host_backup")
    return freed


def tags(device=None) -> list[dict]:
    """The tags of ``device``: ``[{"tag", "pool", "asleep", "bytes", "allocated",
    "backed_up", "host_bytes"}]`` (``bytes``: mapped now if awake, given back if asleep)."""
    _require_installed()
    text = _library().streamalloc_tags_json(_device(device))
    if text is None:
        _fail("tags")
    return json.loads(text)


# ---- streamalloc run --sleep-signals ------------------------------------------------------


def _every(asleep: bool):
    """(device, [tag names]) of the tags this process made, asleep or awake."""
    devices = sorted({device for device, _ in _pools})
    out = []
    for device in devices:
        names = [t["tag"] for t in tags(device) if t["asleep"] == asleep]
        if names:
            out.append((device, names))
    return out


def _say(line: str) -> None:
    sys.stderr.write(f"streamalloc: {line}\n")
    sys.stderr.flush()


def install_signal_handlers(backup: str = "cpu", sleep_signal=signal.SIGUSR1, wake_signal=signal.SIGUSR2) -> None:
    """Makes ``sleep_signal`` put every tag of this process to sleep (with ``backup``) and
    ``wake_signal`` wake them, each saying what it did in one line on stderr: for a program
    that tags its memory with :func:`region` and is driven from outside (``streamalloc run
    --sleep-signals``). The handlers run in the main thread between Python statements,
    so send the signal while the program is idle (not inside a region or graph capture)."""
    if backup not in BACKUPS:
        raise ValueError(f"backup must be one of {', '.join(map(repr, BACKUPS))}, not {backup!r}")

    def on_sleep(signum, frame):
        try:
            every = _every(asleep=False)
            if not every:
                _say("sleep: no awake tag in this process")
            for device, names in every:
                done = sleep(names, backup=backup, device=device)
                _say(
                    f"device {device}: {', '.join(names)} asleep, {done['bytes'] / 2**30:.2f} GiB "
                    f"released in {done['seconds']:.3f} s"
                )
        except Exception as err:  # a handler must not kill the program
            _say(f"sleep failed: {err}")

    def on_wake(signum, frame):
        try:
            every = _every(asleep=True)
            if not every:
                _say("wake: no sleeping tag in this process")
            for device, names in every:
                done = wake(names, device=device)
                _say(
                    f"device {device}: {', '.join(names)} awake, {done['bytes'] / 2**30:.2f} GiB "
                    f"mapped in {done['seconds']:.3f} s"
                )
        except Exception as err:
            _say(f"wake failed: {err}")

    signal.signal(sleep_signal, on_sleep)
    signal.signal(wake_signal, on_wake)
