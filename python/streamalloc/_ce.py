"""Copy-engine transport for :mod:`streamalloc.p2p`: ranks on one host move each round's
bytes with one peer copy over CUDA IPC instead of an NCCL send/receive.

Why: with a bounded staging pool the messages are small (32 MiB at the default 128 MiB
budget), and NCCL point-to-point moves one 32 MiB message at ~116 GB/s on 2 x H200 over
NVLink, while the GPU's copy engine moves ~390 GB/s one way
(``benches/gpu/p2p/RESULTS.md``). When every rank of the group sits on one host and its GPU
can reach the others' (peer access), each rank maps its peers' receive buffers once and the
sender copies straight into them.

How one message moves (sender S, receiver R, R's receive buffer ``b``; ``seq`` counts the
uses of ``b``, see :class:`Slot`)::

    S copy stream:    wait   free[R][b]  (in S's memory)  >= seq - 1   R emptied the last use
                      copy   the message -> R's buffer b               one copy-engine copy
                      write  filled[b]   (in R's memory)   = seq       fenced after the copy
    R unpack stream:  wait   filled[b]                    >= seq
                      unpack buffer b into the destination tensors
                      write  free[R][b]  (in the memory of the next sender to use b) = seq

All synchronisation is on the device (``cuStreamWaitValue32`` / ``cuStreamWriteValue32``);
the host only enqueues. A write value has a system-scope memory fence before it by default,
so a receiver that sees ``filled[b] >= seq`` sees the copied bytes. Every wait of round ``k``
depends only on work of rounds ``<= k`` that the peer enqueued earlier, so the exchange
cannot deadlock even where the hardware runs several streams on one queue.

Counters are 32-bit and compared cyclically (``CU_STREAM_WAIT_VALUE_GEQ`` is
``(int32_t)(*addr - value) >= 0``), so they may wrap. ``seq`` grows with every ``run()`` of
an exchange (the run index is the epoch), so repeated runs need no reset.

This module imports neither torch nor CUDA at import time: the pure parts (slots,
layouts, the transport choice, the mapping cache) are checked on machines without a GPU
(``benches/gpu/p2p/ce_unit_check.py``).
"""

from __future__ import annotations

import ctypes
import os
import socket
from dataclasses import dataclass

__all__ = ["CeError", "TRANSPORTS", "Slot", "Layout", "receive_slots", "next_users",
           "reserve_bytes", "resolve_transport", "IpcMappings", "probe", "Link"]

TRANSPORTS = ("auto", "nccl", "ce")
MASK = 0xFFFF_FFFF
ALIGN = 256  # receive buffers start at multiples of this inside the shared region
FLAG_BYTES = 4
NO_ZERO_COPY = 1 << 62  # zero_copy_min for the planner: every tensor goes through a buffer
MIN_BUFFER_BYTES = 4096  # the planner's smallest buffer (plan.rs)


class CeError(RuntimeError):
    """The copy-engine transport cannot be set up here (a driver call failed, a symbol is
    missing, ...). Turned into an agreed fallback or a P2PError by the caller."""


# ---- Pure logic: counters, layout, the choice of transport ----

@dataclass(frozen=True)
class Slot:
    """Where one received message lands: receive buffer ``buffer``, its ``use``-th use of a
    run, out of ``uses`` uses of that buffer per run. ``seq(run)`` is the counter value
    written once the message is in the buffer (filled) and once it has been unpacked (free):
    1, 2, 3, ... over the uses of the buffer across runs, modulo 2**32."""

    buffer: int
    use: int
    uses: int

    def seq(self, run: int) -> int:
        return (run * self.uses + self.use + 1) & MASK

    def free_wait(self, run: int) -> int:
        """The value of the sender's free flag that lets it overwrite the buffer: the
        previous use (of this run, or the last of the previous run) has been unpacked."""
        return (self.seq(run) - 1) & MASK


def receive_slots(count: int, buffers: int) -> list[Slot]:
    """Slots of a rank's ``count`` received messages (in round order) over ``buffers``
    receive buffers, used in turn."""
    if count and buffers < 1:
        raise ValueError("messages to receive but no receive buffer")
    uses = [(count - b + buffers - 1) // buffers for b in range(buffers)]
    return [Slot(u % buffers, u // buffers, uses[u % buffers]) for u in range(count)]


def next_users(senders: list, buffers: int) -> list:
    """For each received message (in round order, ``senders[u]`` sent it), the rank that
    next writes into the same buffer: the sender of message ``u + buffers``, or for the last
    uses of a run the sender of the buffer's first use (the next run)."""
    n = len(senders)
    return [senders[u + buffers] if u + buffers < n else senders[u % buffers] for u in range(n)]


def cyclic_geq(value: int, target: int) -> bool:
    """``CU_STREAM_WAIT_VALUE_GEQ`` on 32-bit values: ``(int32_t)(value - target) >= 0``."""
    d = (value - target) & MASK
    return d < 0x8000_0000


def _align(n: int, a: int) -> int:
    return (n + a - 1) // a * a


class Layout:
    """A rank's shared region: its receive buffers, then the flags peers write into.

    ``[0, buffers*stride)``: receive buffers, each ``stride`` apart (``buffer_bytes``
    rounded up to :data:`ALIGN`, so typed views stay aligned);
    then ``filled[buffers_per_direction]`` (written by senders);
    then ``free[world][buffers_per_direction]`` (``free[r][b]``: receiver ``r`` emptied its
    buffer ``b``; written by receivers)."""

    def __init__(self, buffers: int, buffer_bytes: int, buffers_per_direction: int, world: int):
        if buffers > buffers_per_direction:
            raise ValueError("more receive buffers than buffers per direction")
        self.buffers = buffers
        self.buffer_bytes = buffer_bytes
        self.bpd = buffers_per_direction
        self.stride = _align(buffer_bytes, ALIGN)
        self.filled_offset = buffers * self.stride
        self.free_offset = self.filled_offset + FLAG_BYTES * buffers_per_direction
        self.size = self.free_offset + FLAG_BYTES * buffers_per_direction * world
        self.flag_bytes = self.size - self.filled_offset

    def buffer(self, b: int) -> int:
        return b * self.stride

    def filled(self, b: int) -> int:
        return self.filled_offset + FLAG_BYTES * b

    def free(self, receiver: int, b: int) -> int:
        return self.free_offset + FLAG_BYTES * (receiver * self.bpd + b)


def reserve_bytes(buffers_per_direction: int, world: int) -> int:
    """Budget bytes the copy-engine transport keeps back from the planner for its flags and
    the alignment of its buffers, so that all staging memory stays within the budget."""
    # Per buffer: up to ALIGN - 1 bytes of stride padding and 511 of allocator rounding.
    need = 1024 * buffers_per_direction + FLAG_BYTES * buffers_per_direction * (world + 1)
    return _align(need, 4096)


def resolve_transport(request: str, probes: list, world: int, budget: int,
                      buffers_per_direction: int):
    """The transport every rank uses, from the request (the same on every rank) and every
    rank's :func:`probe`: ``("ce", None)``, ``("nccl", why_not_ce)`` or, for an explicit
    ``"ce"`` that cannot work, ``(None, why)``. A pure function of gathered data, so every
    rank decides the same."""
    if request not in TRANSPORTS:
        raise ValueError(f"transport must be one of {', '.join(TRANSPORTS)} (got {request!r})")
    if request == "nccl":
        return "nccl", None
    reason = _why_not_ce(probes, world, budget, buffers_per_direction)
    if reason is None:
        return "ce", None
    return (None, reason) if request == "ce" else ("nccl", reason)


def _why_not_ce(probes, world, budget, bpd):
    if world < 2:
        return "only one rank"
    for r, p in enumerate(probes):
        if not p or not p.get("ok"):
            return f"rank {r}: {(p or {}).get('reason', 'no probe')}"
    hosts = {p["host"] for p in probes}
    if len(hosts) > 1:
        return "the ranks are on " + ", ".join(sorted(hosts)) + ", not one host"
    for r, p in enumerate(probes):
        for s, q in enumerate(probes):
            if r != s and p["pci"] != q["pci"] and not p["peers"].get(q["pci"], False):
                return (f"rank {r}'s GPU {p['pci']} has no peer access to rank {s}'s GPU "
                        f"{q['pci']}")
    if budget - reserve_bytes(bpd, world) < 2 * bpd * MIN_BUFFER_BYTES:
        return f"a staging budget of {budget} bytes is too small for its flags"
    return None


class IpcMappings:
    """Peer allocations opened in this process, counted: a CUDA IPC handle may be opened
    only once per process, and two exchanges (or two peers' buffers) can share one
    allocation. ``open_fn(handle) -> base address`` and ``close_fn(base)`` do the work."""

    def __init__(self, open_fn, close_fn):
        self._open, self._close = open_fn, close_fn
        self._maps: dict = {}  # handle bytes -> [base, count]

    def acquire(self, handle: bytes) -> int:
        entry = self._maps.get(handle)
        if entry is None:
            entry = self._maps[handle] = [self._open(handle), 0]
        entry[1] += 1
        return entry[0]

    def release(self, handle: bytes) -> None:
        entry = self._maps.get(handle)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            del self._maps[handle]
            self._close(entry[0])

    def __len__(self):
        return len(self._maps)


# ---- The CUDA driver, through ctypes ----

CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS = 1
CU_STREAM_WAIT_VALUE_GEQ = 0
CU_STREAM_WAIT_VALUE_FLUSH = 1 << 30
CU_DEVICE_ATTRIBUTE_CAN_FLUSH_REMOTE_WRITES = 98


class _IpcHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * 64)]


class Driver:
    """The few libcuda entry points the transport needs, resolved once. A missing library or
    symbol is a :class:`CeError` naming it."""

    def __init__(self):
        try:
            lib = ctypes.CDLL("libcuda.so.1")
        except OSError as err:
            raise CeError(f"cannot load libcuda.so.1 ({err})") from None
        self._lib = lib
        c = ctypes
        u64, ptr, uint, size_t = c.c_uint64, c.c_void_p, c.c_uint, c.c_size_t
        P = c.POINTER
        self._error_string = self._sym(["cuGetErrorString"], [c.c_int, P(c.c_char_p)])
        self._ctx_get_current = self._sym(["cuCtxGetCurrent"], [P(ptr)])
        self._ctx_set_current = self._sym(["cuCtxSetCurrent"], [ptr])
        self._ctx_get_device = self._sym(["cuCtxGetDevice"], [P(c.c_int)])
        self._primary_retain = self._sym(["cuDevicePrimaryCtxRetain"], [P(ptr), c.c_int])
        self._device_get = self._sym(["cuDeviceGet"], [P(c.c_int), c.c_int])
        self._device_count = self._sym(["cuDeviceGetCount"], [P(c.c_int)])
        self._pci = self._sym(["cuDeviceGetPCIBusId"], [c.c_char_p, c.c_int, c.c_int])
        self._can_peer = self._sym(["cuDeviceCanAccessPeer"], [P(c.c_int), c.c_int, c.c_int])
        self._attribute = self._sym(["cuDeviceGetAttribute"], [P(c.c_int), c.c_int, c.c_int])
        self._range = self._sym(["cuMemGetAddressRange_v2", "cuMemGetAddressRange"],
                                [P(u64), P(size_t), u64])
        self._ipc_get = self._sym(["cuIpcGetMemHandle"], [P(_IpcHandle), u64])
        self._ipc_open = self._sym(["cuIpcOpenMemHandle_v2", "cuIpcOpenMemHandle"],
                                   [P(u64), _IpcHandle, uint])
        self._ipc_close = self._sym(["cuIpcCloseMemHandle"], [u64])
        self._mem_alloc = self._sym(["cuMemAlloc_v2"], [P(u64), size_t])
        self._mem_free = self._sym(["cuMemFree_v2"], [u64])
        self._memcpy = self._sym(["cuMemcpyDtoDAsync_v2", "cuMemcpyDtoDAsync"],
                                 [u64, u64, size_t, ptr])
        # The v2 stream memory operations are available by default on every platform.
        self._write32 = self._sym(["cuStreamWriteValue32_v2"], [ptr, u64, c.c_uint32, uint])
        self._wait32 = self._sym(["cuStreamWaitValue32_v2"], [ptr, u64, c.c_uint32, uint])
        # The p2p copy kernel (streamalloc._p2p_copy): loaded from a cubin, launched per message.
        self._module_load = self._sym(["cuModuleLoadData"], [P(ptr), c.c_char_p])
        self._module_function = self._sym(["cuModuleGetFunction"], [P(ptr), ptr, c.c_char_p])
        self._launch_kernel = self._sym(["cuLaunchKernel"], [ptr, uint, uint, uint, uint, uint, uint,
                                                            uint, ptr, P(ptr), P(ptr)])

    def _sym(self, names, argtypes):
        for name in names:
            fn = getattr(self._lib, name, None)
            if fn is not None:
                fn.argtypes = argtypes
                fn.restype = ctypes.c_int
                fn.__name__ = name
                return fn
        raise CeError(f"libcuda has no {names[0]}")

    def check(self, rc: int, what: str) -> None:
        if rc != 0:
            msg = ctypes.c_char_p()
            self._error_string(rc, ctypes.byref(msg))
            text = msg.value.decode("utf-8", "replace") if msg.value else "unknown error"
            raise CeError(f"{what} failed: CUDA error {rc} ({text})")

    def use_device(self, ordinal: int) -> None:
        """Makes sure the calling thread's current context is the primary context of
        ``ordinal`` (the one PyTorch uses), so that IPC mappings land in it."""
        ctx = ctypes.c_void_p()
        self.check(self._ctx_get_current(ctypes.byref(ctx)), "cuCtxGetCurrent")
        if ctx.value:
            dev = ctypes.c_int()
            self.check(self._ctx_get_device(ctypes.byref(dev)), "cuCtxGetDevice")
            if dev.value == self.device(ordinal):
                return
        primary = ctypes.c_void_p()
        self.check(self._primary_retain(ctypes.byref(primary), self.device(ordinal)),
                   "cuDevicePrimaryCtxRetain")
        self.check(self._ctx_set_current(primary), "cuCtxSetCurrent")

    def device(self, ordinal: int) -> int:
        dev = ctypes.c_int()
        self.check(self._device_get(ctypes.byref(dev), ordinal), "cuDeviceGet")
        return dev.value

    def device_count(self) -> int:
        n = ctypes.c_int()
        self.check(self._device_count(ctypes.byref(n)), "cuDeviceGetCount")
        return n.value

    def pci_bus_id(self, ordinal: int) -> str:
        buf = ctypes.create_string_buffer(64)
        self.check(self._pci(buf, 64, self.device(ordinal)), "cuDeviceGetPCIBusId")
        return buf.value.decode().lower()

    def can_access_peer(self, ordinal: int, peer: int) -> bool:
        out = ctypes.c_int()
        self.check(self._can_peer(ctypes.byref(out), self.device(ordinal), self.device(peer)),
                   "cuDeviceCanAccessPeer")
        return bool(out.value)

    def attribute(self, attribute: int, ordinal: int) -> int:
        out = ctypes.c_int()
        self.check(self._attribute(ctypes.byref(out), attribute, self.device(ordinal)),
                   "cuDeviceGetAttribute")
        return out.value

    def export(self, address: int):
        """``(handle bytes, offset of address in its allocation)``."""
        base, size = ctypes.c_uint64(), ctypes.c_size_t()
        self.check(self._range(ctypes.byref(base), ctypes.byref(size), address),
                   "cuMemGetAddressRange")
        handle = _IpcHandle()
        self.check(self._ipc_get(ctypes.byref(handle), base.value), "cuIpcGetMemHandle")
        # bytes(handle), not handle.reserved: a c_char array field stops at the first NUL.
        return bytes(handle), address - base.value

    def mem_alloc(self, nbytes: int) -> int:
        out = ctypes.c_uint64()
        self.check(self._mem_alloc(ctypes.byref(out), nbytes), f"cuMemAlloc of {nbytes} bytes")
        return out.value

    def mem_free(self, address: int) -> None:
        self.check(self._mem_free(address), "cuMemFree")

    def ipc_open(self, handle: bytes) -> int:
        if len(handle) != ctypes.sizeof(_IpcHandle):
            raise CeError(f"an IPC handle of {len(handle)} bytes (expected 64)")
        h = _IpcHandle.from_buffer_copy(handle)
        out = ctypes.c_uint64()
        self.check(self._ipc_open(ctypes.byref(out), h, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS),
                   "cuIpcOpenMemHandle")
        return out.value

    def ipc_close(self, base: int) -> None:
        self.check(self._ipc_close(base), "cuIpcCloseMemHandle")

    # The per-round calls are used raw (``_memcpy``, ``_write32``, ``_wait32``: they return
    # the CUresult, which the caller passes to :meth:`check`): the host's enqueueing loop is
    # the whole host cost of a run.


_DRIVER = None
_MAPPINGS = None
_PROBES: dict = {}


def driver() -> Driver:
    global _DRIVER, _MAPPINGS
    if _DRIVER is None:
        _DRIVER = Driver()
        _MAPPINGS = IpcMappings(_DRIVER.ipc_open, _DRIVER.ipc_close)
    return _DRIVER


def _host_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "?"
    return f"{socket.gethostname()}/{boot}"


def probe(device) -> dict:
    """What this rank can do for the copy-engine transport (no allocation): its host, its
    GPU's PCI bus id, which other GPUs it reaches with peer access. ``ok`` False with a
    ``reason`` when it cannot take part at all."""
    if device.type != "cuda":
        return {"ok": False, "reason": f"tensors are on {device.type}, not on a GPU"}
    key = (os.getpid(), device.index)
    cached = _PROBES.get(key)
    if cached is not None:
        return cached
    try:
        d = driver()
        ordinal = device.index
        d.use_device(ordinal)
        peers = {}
        for other in range(d.device_count()):
            if other != ordinal:
                peers[d.pci_bus_id(other)] = d.can_access_peer(ordinal, other)
        out = {"ok": True, "reason": "", "host": _host_id(), "pci": d.pci_bus_id(ordinal),
               "peers": peers,
               "flush": d.attribute(CU_DEVICE_ATTRIBUTE_CAN_FLUSH_REMOTE_WRITES, ordinal) == 1}
    except CeError as err:
        out = {"ok": False, "reason": str(err)}
    _PROBES[key] = out
    return out


class DeviceAllocation:
    """``nbytes`` of device memory from ``cuMemAlloc``, freed when the last tensor viewing it
    is gone; PyTorch views it through ``__cuda_array_interface__`` (``torch.as_tensor``).

    Why not ``torch.empty``: ``cuIpcGetMemHandle`` exports only ``cuMemAlloc`` memory, and
    with expandable segments (PyTorch's or streamalloc's) the allocator's memory is mapped
    through the VMM API instead, so the copy-engine transport failed under the very setting
    memory-bound training turns on. A dedicated allocation shares the same way under any
    allocator configuration."""

    def __init__(self, drv: "Driver", nbytes: int):
        self._driver = drv
        self.address = drv.mem_alloc(nbytes)
        self.nbytes = nbytes

    @property
    def __cuda_array_interface__(self) -> dict:
        # stream None: the memory is not being written by any stream yet.
        return {"shape": (self.nbytes,), "typestr": "|u1", "data": (self.address, False),
                "version": 3, "strides": None, "stream": None}

    def __del__(self):
        try:
            self._driver.mem_free(self.address)
        except Exception:  # interpreter teardown: the driver may already be gone
            pass


class Link:
    """One exchange's shared staging: this rank's region (receive buffers and flags, a
    :class:`DeviceAllocation`) exported over CUDA IPC, and the peers' regions mapped here.
    :meth:`export` and :meth:`connect` on every rank, between them an all-gather of the
    export records; once every rank has finished using the peers' memory, :meth:`close`
    on every rank, then (after every rank closed: CUDA leaves freeing exported memory
    that a peer still maps undefined) :meth:`free`."""

    def __init__(self, device, rank: int, world: int, buffers_per_direction: int):
        self.device = device
        self.rank, self.world, self.bpd = rank, world, buffers_per_direction
        self.region = None
        self.layout = None
        self.base = 0
        self.peers: dict = {}  # rank -> (address of its region here, its Layout)
        self._handles: list = []
        self.wait_flags = CU_STREAM_WAIT_VALUE_GEQ

    def export(self, buffers: int, buffer_bytes: int, recv_from: list, flush: bool) -> dict:
        """Allocates and exports this rank's region; ``recv_from``: the sender of each
        message this rank receives, in order (peers derive their slots from it)."""
        import torch

        d = driver()
        d.use_device(self.device.index)
        layout = Layout(buffers, buffer_bytes, self.bpd, self.world)
        region = torch.as_tensor(DeviceAllocation(d, layout.size), device=self.device)
        # Peers may write the flags as soon as they have the handle: the zeros go first,
        # on a stream of their own (the region is not the caching allocator's), so the host
        # waits for the zeros alone and not for the work queued on the caller's stream.
        zeroing = torch.cuda.Stream(self.device)
        with torch.cuda.stream(zeroing):
            region[layout.filled_offset:].zero_()
        zeroing.synchronize()
        handle, offset = d.export(region.data_ptr())
        self.region, self.layout, self.base = region, layout, region.data_ptr()
        if flush:
            self.wait_flags = CU_STREAM_WAIT_VALUE_GEQ | CU_STREAM_WAIT_VALUE_FLUSH
        return {"handle": handle, "offset": offset, "buffers": buffers,
                "buffer_bytes": buffer_bytes, "recv_from": recv_from}

    def connect(self, records: list, peers) -> None:
        d = driver()
        d.use_device(self.device.index)
        for p in sorted(peers):
            rec = records[p]
            base = _MAPPINGS.acquire(rec["handle"])
            self._handles.append(rec["handle"])
            self.peers[p] = (base + rec["offset"],
                             Layout(rec["buffers"], rec["buffer_bytes"], self.bpd, self.world))

    def close(self) -> None:
        """Unmaps the peers' regions."""
        if self._handles:
            driver().use_device(self.device.index)
        errors = []
        for h in self._handles:
            try:
                _MAPPINGS.release(h)
            except CeError as err:
                errors.append(str(err))
        self._handles = []
        self.peers = {}
        if errors:
            raise CeError("; ".join(errors))

    def free(self) -> None:
        """Lets go of this rank's region (freed with its last view)."""
        self.region = None
