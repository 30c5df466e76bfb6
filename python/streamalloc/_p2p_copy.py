"""Packing and unpacking in bulk: one launch of a copy kernel per message (and one for the
copies a rank sends itself), from a table of pieces built once per agreed exchange.

Why: a round of the many-tensor pattern packs ~1,650 tensors and unpacks as many; through
PyTorch that is ``torch.cat`` and ``torch._foreach_copy_`` over lists, whose host cost is per
tensor (about 0.6 µs each, 35 ms per run at 58,000 tensors), and one driver copy per tensor
costs more. The kernel (``csrc/p2p_copy_kernel.h``) reads its pieces from a table in device
memory, so a launch costs the same few microseconds whatever the number of tensors.

The table holds, per piece, where it is read and written: a tensor (its index in the rank's
lane-major list, plus an offset) or a staging buffer (a fixed address). Binding new tensors
of the same shapes (the drop-in's cached plans) recomputes the addresses of every piece
with a few vectorised operations on the CPU and uploads them with one host-to-device copy.
Device memory for the table is counted in the staging budget (:func:`reserve_bytes`).

On the CPU (gloo) the same tables are run by :class:`HostCopier`, one ``memmove`` per piece,
so the table logic is checked on machines with no GPU. The kernel is compiled with NVRTC
(shipped with PyTorch's CUDA wheels) once per GPU architecture and cached under
``$STREAMALLOC_CACHE`` (default ``~/.cache/streamalloc``); where it cannot be had, the
exchange packs with PyTorch's batched copies instead (:func:`kernel_for` says why).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
from pathlib import Path

from . import _ce

CHUNK_BYTES = 8192  # SA_CHUNK_BYTES in the kernel
CHUNK_SHIFT = CHUNK_BYTES.bit_length() - 1
assert CHUNK_BYTES == 1 << CHUNK_SHIFT
WARPS_PER_BLOCK = 8  # SA_WARPS_PER_BLOCK
THREADS = WARPS_PER_BLOCK * 32
ENTRY_BYTES = 32  # per piece: src, dst, len, first (int64 each)
KERNEL_NAME = b"streamalloc_p2p_copy"
SOURCE = Path(__file__).resolve().parent / "csrc" / "p2p_copy_kernel.h"
MODES = ("auto", "kernel", "torch")


class CopyUnavailable(RuntimeError):
    """The copy kernel cannot be built or loaded here (the message says why)."""


def mode() -> str:
    """How packing is done: ``STREAMALLOC_P2P_PACK`` = ``auto`` (the kernel on GPUs, the
    table's memmoves on the CPU), ``kernel`` (the same, failing where the kernel cannot be
    had) or ``torch`` (PyTorch's batched copies)."""
    value = os.environ.get("STREAMALLOC_P2P_PACK", "auto").strip().lower() or "auto"
    if value not in MODES:
        raise ValueError(f"STREAMALLOC_P2P_PACK must be one of {', '.join(MODES)} (got {value!r})")
    return value


def reserve_bytes(tensors: int, nbytes: int, budget: int, buffers_per_direction: int,
                  world: int) -> int:
    """Bytes of the budget one rank's copy table may take: a piece per tensor, plus one per
    message boundary (a tensor split across buffers), counted with buffers of a quarter of
    the budget's share, so the bound holds whatever the planner makes of the rest. Every
    rank computes this from gathered figures, so every rank plans with the same budget."""
    buffer_low = max(1, budget // (4 * buffers_per_direction))
    messages = (nbytes + 16 * tensors) // buffer_low + 4 * world + 4
    return ENTRY_BYTES * (tensors + 2 * messages) + 8


# ---- The table ----

class CopyTable:
    """Pieces of one rank's exchange: ``ranges[key] = (a, b)`` are the pieces one launch
    copies (``key``: ``(round, direction)`` of a packed message, or ``"self"``); columns are
    int64 CPU tensors. A piece reads at ``addresses[src_slot] + src_fixed`` where
    ``src_slot >= 0`` (a tensor, by lane-major index), else at ``src_fixed`` (a staging
    buffer); it writes likewise."""

    def __init__(self, src_slot, src_fixed, dst_slot, dst_fixed, lengths, ranges):
        import torch

        self.src_slot, self.src_fixed = src_slot, src_fixed
        self.dst_slot, self.dst_fixed = dst_slot, dst_fixed
        self.lengths = lengths
        self.ranges = ranges
        chunks = (lengths + (CHUNK_BYTES - 1)) >> CHUNK_SHIFT
        self.first = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(chunks, 0)])
        # The pieces that read (write) a tensor, and which: fixed for the table, so binding
        # new tensors is one gather and one add per side.
        self._src_at = torch.nonzero(src_slot >= 0).flatten()
        self._src_slots = src_slot.index_select(0, self._src_at)
        self._dst_at = torch.nonzero(dst_slot >= 0).flatten()
        self._dst_slots = dst_slot.index_select(0, self._dst_at)
        self.src = self.dst = None  # bound addresses (:meth:`bind`)

    def __len__(self):
        return int(self.lengths.numel())

    @property
    def device_bytes(self) -> int:
        return 8 * (4 * len(self) + 1)

    def chunks(self, key) -> int:
        a, b = self.ranges[key]
        return int(self.first[b] - self.first[a])

    def bind(self, addresses, out=None) -> None:
        """Addresses of every piece for the tensors at ``addresses`` (int64, lane-major),
        into ``out`` (two int64 tensors of the table's length) where given."""
        import torch

        src, dst = out if out is not None else (torch.empty_like(self.src_fixed),
                                                 torch.empty_like(self.dst_fixed))
        for side, fixed, at, slots in ((src, self.src_fixed, self._src_at, self._src_slots),
                                       (dst, self.dst_fixed, self._dst_at, self._dst_slots)):
            side.copy_(fixed)
            side.index_add_(0, at, addresses.index_select(0, slots))
        self.src, self.dst = src, dst


def build_table(rows, row_columns: int, lane_starts, world: int, message_base: dict,
                self_lane=None, skip=()) -> CopyTable:
    """The table of this rank's packed pieces from its plan rows (``Plan.rows``: round,
    direction, peer, kind, tensor, tensor offset, buffer offset, length, message length),
    ``message_base[(round, direction)]``: the address of the staging buffer the message
    uses, and ``self_lane``: ``(send slot, receive slot, count, nbytes)``, the ``count``
    tensors this rank sends itself, from those two lane-major slots on, with ``nbytes``
    the lanes' byte column (an int64 array). Zero-copy rows, empty pieces and the rows of
    the messages in ``skip`` (``(round, direction)``: moved by one driver copy, not
    packed) have no entry.

    Every column is built as a tensor, with no Python object per piece: at tens of
    thousands of pieces, objects made here would each be counted towards the caller's
    garbage collections, and a full collection of a program holding that many tensors
    takes longer than the whole agreement."""
    import torch

    n = len(rows) // row_columns
    i64 = torch.int64
    if n:
        table = torch.frombuffer(rows, dtype=i64).view(n, row_columns)
        keep = (table[:, 3] == 0) & (table[:, 7] > 0)
        if skip:
            skipped = torch.tensor([2 * k + d for k, d in skip], dtype=i64)
            keep &= ~torch.isin(table[:, 0] * 2 + table[:, 1], skipped)
        if not bool(keep.all()):
            table = table.index_select(0, torch.nonzero(keep).flatten())
    else:
        table = torch.zeros((0, row_columns), dtype=i64)
    rnd, direction, peer, _, tensor, t_off, b_off, length, _ = table.unbind(1)
    starts = torch.tensor(list(lane_starts) or [0], dtype=i64)
    slot = starts.index_select(0, direction * world + peer) + tensor if len(table) else tensor
    keys = sorted(message_base)
    key_index = {k: i for i, k in enumerate(keys)}
    bases = torch.tensor([message_base[k] for k in keys] or [0], dtype=i64)
    if len(table):
        rounds = int(rnd.max()) + 1
        lookup = torch.full((2 * rounds,), -1, dtype=i64)
        for k, i in key_index.items():
            if k[0] < rounds:
                lookup[2 * k[0] + k[1]] = i
        which = lookup.index_select(0, rnd * 2 + direction)
        if bool((which < 0).any()):
            raise ValueError("a packed piece belongs to a message without a staging buffer")
        buffer_at = bases.index_select(0, which) + b_off
    else:
        buffer_at = b_off
    sending = direction == 0
    none = torch.full_like(slot, -1)
    src_slot = torch.where(sending, slot, none)
    dst_slot = torch.where(sending, none, slot)
    src_fixed = torch.where(sending, t_off, buffer_at)
    dst_fixed = torch.where(sending, buffer_at, t_off)
    ranges = {}
    if len(table):
        # Rows come in (round, direction) order: each message's pieces are one range.
        key = rnd * 2 + direction
        bounds = torch.nonzero(torch.diff(key, prepend=key[:1] - 1)).flatten().tolist()
        bounds.append(len(table))
        for a, b in zip(bounds, bounds[1:]):
            k = int(key[a])
            ranges[(k // 2, k % 2)] = (a, b)
    send_at, recv_at, count, nbytes = self_lane or (0, 0, 0, None)
    if count:
        nb = torch.frombuffer(nbytes, dtype=i64)[send_at:send_at + count]
        moves = torch.nonzero(nb > 0).flatten()
        s, r, nb = moves + send_at, moves + recv_at, nb[moves]
    if count and len(moves):
        zeros = torch.zeros_like(s)
        ranges["self"] = (len(table), len(table) + len(moves))
        src_slot = torch.cat([src_slot, s])
        dst_slot = torch.cat([dst_slot, r])
        src_fixed = torch.cat([src_fixed, zeros])
        dst_fixed = torch.cat([dst_fixed, zeros])
        length = torch.cat([length, nb])
    return CopyTable(src_slot.contiguous(), src_fixed.contiguous(), dst_slot.contiguous(),
                     dst_fixed.contiguous(), length.contiguous(), ranges)


# ---- Running a table ----

class HostCopier:
    """Runs a table's ranges on the CPU, one ``memmove`` per piece (gloo; the checks)."""

    def __init__(self, table: CopyTable):
        self.table = table
        self._src = self._dst = self._len = None

    @property
    def device_bytes(self) -> int:
        return 0

    def bind(self, addresses) -> None:
        self.table.bind(addresses)
        self._src, self._dst = self.table.src.tolist(), self.table.dst.tolist()
        if self._len is None:
            self._len = self.table.lengths.tolist()

    def upload(self, stream=None) -> None:
        pass

    def launch(self, key, stream=None) -> None:
        if key not in self.table.ranges:
            return
        a, b = self.table.ranges[key]
        move, src, dst, lens = ctypes.memmove, self._src, self._dst, self._len
        for i in range(a, b):
            move(dst[i], src[i], lens[i])


class DeviceCopier:
    """Runs a table's ranges on a GPU: the table in device memory, one kernel launch per
    range. :meth:`bind` writes addresses into pinned host memory and :meth:`upload` copies
    them on a stream that every launch is ordered after."""

    def __init__(self, table: CopyTable, device, function):
        import torch

        self.table = table
        self.device = device
        self._function = function
        n = len(table)
        self._n = n
        self._device_table = torch.empty(4 * n + 1, dtype=torch.int64, device=device)
        self._host = torch.empty(4 * n + 1, dtype=torch.int64, pin_memory=True)
        self._host[2 * n:3 * n] = table.lengths
        self._host[3 * n:] = table.first
        # The lengths and chunk offsets travel with the first upload, on the stream the
        # launches are ordered after: a blocking copy here would wait for all the work the
        # caller has queued on its stream.
        self._uploaded_all = False
        self._pending = False
        self._uploaded = None  # event after the last upload of the pinned addresses
        base = self._device_table.data_ptr()
        self._launches = {}
        for key, (a, b) in table.ranges.items():
            chunks = int(table.first[b] - table.first[a])
            if b == a or chunks == 0:
                continue
            values = [ctypes.c_uint64(base + 8 * (col * n + a)) for col in range(4)]
            values.append(ctypes.c_uint(b - a))
            params = (ctypes.c_void_p * 5)(*[ctypes.addressof(v) for v in values])
            grid = (chunks + WARPS_PER_BLOCK - 1) // WARPS_PER_BLOCK
            self._launches[key] = (grid, params, values)
        self._launch = _ce.driver()._launch_kernel

    @property
    def device_bytes(self) -> int:
        return 8 * (4 * self._n + 1)

    def bind(self, addresses) -> None:
        if self._uploaded is not None:
            self._uploaded.synchronize()  # the last upload has read the pinned memory
        n = self._n
        self.table.bind(addresses, out=(self._host[:n], self._host[n:2 * n]))
        self._pending = True

    def upload(self, stream) -> None:
        """Copies the bound addresses to the device on ``stream`` (a torch stream)."""
        import torch

        if not self._pending:
            return
        end = 2 * self._n if self._uploaded_all else 4 * self._n + 1
        with torch.cuda.stream(stream):
            self._device_table[:end].copy_(self._host[:end], non_blocking=True)
            self._uploaded = stream.record_event()
        self._pending = False
        self._uploaded_all = True

    def launch(self, key, stream) -> None:
        """One launch copying range ``key`` on ``stream`` (a raw ``CUstream`` handle)."""
        entry = self._launches.get(key)
        if entry is None:
            return
        grid, params, _ = entry
        rc = self._launch(self._function, grid, 1, 1, THREADS, 1, 1, 0, stream, params, None)
        if rc:
            _ce.driver().check(rc, "launching the p2p copy kernel")


def copier_for(table: CopyTable, device):
    """The copier for ``device``'s tensors: :class:`DeviceCopier` where the kernel can be
    had, :class:`HostCopier` on the CPU. Raises :class:`CopyUnavailable`."""
    if device.type == "cpu":
        return HostCopier(table)
    return DeviceCopier(table, device, kernel_for(device))


# ---- The kernel: NVRTC, cached per architecture ----

_FUNCTIONS: dict = {}
_NVRTC = None


def kernel_for(device):
    """The loaded kernel (a ``CUfunction``) for ``device``; raises :class:`CopyUnavailable`."""
    index = device.index
    cached = _FUNCTIONS.get(index)
    if isinstance(cached, CopyUnavailable):
        raise cached
    if cached is not None:
        return cached
    try:
        import torch

        major, minor = torch.cuda.get_device_capability(index)
        arch = f"{major}{minor}"
        d = _ce.driver()
        d.use_device(index)
        module = ctypes.c_void_p()
        if d._module_load(ctypes.byref(module), cubin_for(arch)) != 0:
            # A cached kernel this driver refuses (built by a newer NVRTC): build it again.
            d.check(d._module_load(ctypes.byref(module), cubin_for(arch, fresh=True)),
                    "cuModuleLoadData (p2p copy kernel)")
        function = ctypes.c_void_p()
        d.check(d._module_function(ctypes.byref(function), module, KERNEL_NAME),
                "cuModuleGetFunction (p2p copy kernel)")
        _FUNCTIONS[index] = function
        return function
    except (CopyUnavailable, _ce.CeError, OSError) as err:
        failure = err if isinstance(err, CopyUnavailable) else CopyUnavailable(str(err))
        _FUNCTIONS[index] = failure
        raise failure from None


def cache_dir() -> Path:
    env = os.environ.get("STREAMALLOC_CACHE")
    return (Path(env).expanduser() if env else Path.home() / ".cache" / "streamalloc") / "p2p"


def cubin_for(arch: str, fresh: bool = False) -> bytes:
    """The kernel compiled for ``sm_<arch>``, from the cache or compiled now (and cached);
    ``fresh``: compiled now whatever the cache holds. The cache is keyed by the source, the
    architecture and the CUDA version PyTorch was built with, not by NVRTC's own version:
    reading that means loading NVRTC, which costs milliseconds of a process's first
    exchange when the kernel is cached (``kernel_for`` rebuilds a cached kernel the driver
    refuses)."""
    import torch

    source = SOURCE.read_bytes()
    cuda = getattr(torch.version, "cuda", None) or "none"
    key = hashlib.sha256(source + f"|cuda {cuda}|sm_{arch}".encode()).hexdigest()[:16]
    path = cache_dir() / f"copy-{key}-sm_{arch}.cubin"
    if not fresh:
        try:
            return path.read_bytes()
        except OSError:
            pass
    cubin = _compile(_nvrtc(), source, arch)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_bytes(cubin)
        os.replace(tmp, path)
    except OSError:
        pass  # an unwritable cache costs a compile per process, nothing else
    return cubin


def _nvrtc():
    global _NVRTC
    if _NVRTC is not None:
        return _NVRTC
    names = []
    try:
        import torch

        cuda = getattr(torch.version, "cuda", None)
        if cuda:
            names.append(f"libnvrtc.so.{cuda.split('.')[0]}")
        for root in _nvidia_roots(torch):
            names += [str(p) for p in sorted(root.glob("*/lib/libnvrtc.so*"))]
    except ImportError:
        pass
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if home:
        names.append(os.path.join(home, "lib64", "libnvrtc.so"))
    names.append("libnvrtc.so")
    tried = []
    for name in names:
        try:
            lib = ctypes.CDLL(name)
        except OSError as err:
            tried.append(f"{name} ({err})")
            continue
        _NVRTC = lib
        return lib
    raise CopyUnavailable("the p2p copy kernel needs NVRTC (libnvrtc, in PyTorch's CUDA wheels "
                          f"or a CUDA toolkit); tried {'; '.join(tried[:4])}")


def _nvidia_roots(torch) -> list:
    roots = []
    try:
        import nvidia

        roots += [Path(p) for p in nvidia.__path__]
    except ImportError:
        pass
    roots.append(Path(torch.__file__).resolve().parent.parent / "nvidia")
    return [r for r in dict.fromkeys(roots) if r.is_dir()]


def _compile(nvrtc, source: bytes, arch: str) -> bytes:
    c = ctypes
    program = c.c_void_p()
    _nvrtc_check(nvrtc, nvrtc.nvrtcCreateProgram(c.byref(program), source, b"p2p_copy_kernel.cu",
                                                 0, None, None), "nvrtcCreateProgram")
    try:
        options = [f"--gpu-architecture=sm_{arch}".encode(), b"-std=c++17"]
        rc = nvrtc.nvrtcCompileProgram(program, len(options), (c.c_char_p * len(options))(*options))
        if rc != 0:
            size = c.c_size_t()
            nvrtc.nvrtcGetProgramLogSize(program, c.byref(size))
            log = c.create_string_buffer(size.value)
            nvrtc.nvrtcGetProgramLog(program, log)
            text = log.value.decode("utf-8", "replace").strip().splitlines()
            raise CopyUnavailable(f"NVRTC could not compile the p2p copy kernel for sm_{arch}: "
                                  f"{text[0] if text else rc}")
        size = c.c_size_t()
        _nvrtc_check(nvrtc, nvrtc.nvrtcGetCUBINSize(program, c.byref(size)), "nvrtcGetCUBINSize")
        out = c.create_string_buffer(size.value)
        _nvrtc_check(nvrtc, nvrtc.nvrtcGetCUBIN(program, out), "nvrtcGetCUBIN")
        return out.raw
    finally:
        nvrtc.nvrtcDestroyProgram(c.byref(program))


def _nvrtc_check(nvrtc, rc: int, what: str) -> None:
    if rc != 0:
        nvrtc.nvrtcGetErrorString.restype = ctypes.c_char_p
        text = nvrtc.nvrtcGetErrorString(rc)
        raise CopyUnavailable(f"{what} failed: {text.decode() if text else rc}")
