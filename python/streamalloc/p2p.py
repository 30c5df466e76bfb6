"""Many-tensor point-to-point exchange through a bounded staging pool.

``exchange(sends={peer: [tensors]}, recvs={peer: [tensors]}, budget_mib=128)`` moves any
number of tensors (any dtype, shape and count; empty lists fine) between the ranks of a
``torch.distributed`` job without one NCCL operation per tensor (slow, and it can hang
across nodes) and without one concatenated buffer per peer (doubles memory):

1. every rank all-gathers a compact description of its lists (bytes and dtype per tensor);
2. every rank plans with the Rust planner in ``libstreamalloc.so`` (the same code the CI
   tests: ``allocator/src/staging/plan.rs``): rounds in which each rank exchanges at most
   one message with one partner (circle-method pairing), large tensors zero-copy, small
   ones packed into staging buffers, tensors larger than the room left split;
3. every rank all-gathers the plan digest: a mismatch in sizes, dtypes or counts, or a
   different budget, raises the same :class:`P2PError` on every rank before any data moves;
4. per round: pack (one batched copy per same-dtype run: ``torch.cat(..., out=)``) on a
   packing stream, one ``batch_isend_irecv`` group of at most two operations, unpack
   (``torch._foreach_copy_`` from ``torch.split`` views) on an unpacking stream. Staging
   buffers rotate (two per direction by default), ordered with events, so packing round
   k+1 and unpacking round k-1 overlap the transfer of round k.

Staging memory is at most ``budget_mib`` per rank, whatever the number and size of the
tensors. :class:`Exchange` keeps the agreed plan to run the same exchange again (weight
sync every step) without planning again.
"""

from __future__ import annotations

import array
import ctypes
import os
import struct
import zlib
from dataclasses import dataclass, field

__all__ = ["exchange", "Exchange", "P2PError"]

_MAGIC = 0x5350_3250  # "SP2P", as in plan.rs
_ROW = 9  # columns of a plan row (src/ffi_p2p.rs)
_DTYPE_NAMES = [
    "float32", "float16", "bfloat16", "float64", "int8", "uint8", "int16", "int32", "int64",
    "bool", "complex64", "complex128", "float8_e4m3fn", "float8_e5m2", "uint16", "uint32",
    "uint64", "complex32",
]
_DTYPE_CODES = {name: i for i, name in enumerate(_DTYPE_NAMES)}


class P2PError(RuntimeError):
    """The exchange cannot run: raised with the same message on every rank."""


# ---- The library ----

_LIB = None


def _load_library():
    """libstreamalloc.so through ``streamalloc._lib.load()``, else ``STREAMALLOC_LIB``, else
    next to this file."""
    global _LIB
    if _LIB is not None:
        return _LIB
    lib = None
    try:
        from . import _lib  # the shared loader, where the package has it

        lib = _lib.load()
    except (ImportError, AttributeError, OSError, RuntimeError):
        lib = None
    if lib is None or not hasattr(lib, "streamalloc_p2p_plan_new"):
        path = os.environ.get("STREAMALLOC_LIB") or os.path.join(
            os.path.dirname(os.path.abspath(__file__)), "libstreamalloc.so"
        )
        try:
            lib = ctypes.CDLL(path)
        except OSError as err:
            raise P2PError(
                f"cannot load libstreamalloc.so from {path} ({err}); set STREAMALLOC_LIB"
            ) from None
    c = ctypes
    lib.streamalloc_p2p_last_error.restype = c.c_char_p
    lib.streamalloc_p2p_last_error.argtypes = []
    lib.streamalloc_p2p_plan_new.restype = c.c_void_p
    lib.streamalloc_p2p_plan_new.argtypes = [
        c.c_uint32, c.POINTER(c.c_char_p), c.POINTER(c.c_size_t), c.c_uint64, c.c_uint32,
        c.c_uint64,
    ]
    lib.streamalloc_p2p_plan_free.restype = None
    lib.streamalloc_p2p_plan_free.argtypes = [c.c_void_p]
    lib.streamalloc_p2p_plan_digest.restype = c.c_uint64
    lib.streamalloc_p2p_plan_digest.argtypes = [c.c_void_p]
    lib.streamalloc_p2p_plan_summary.restype = c.c_int32
    lib.streamalloc_p2p_plan_summary.argtypes = [c.c_void_p, c.c_uint32, c.POINTER(c.c_uint64)]
    lib.streamalloc_p2p_plan_rows.restype = c.c_int64
    lib.streamalloc_p2p_plan_rows.argtypes = [
        c.c_void_p, c.c_uint32, c.POINTER(c.c_int64), c.c_size_t,
    ]
    _LIB = lib
    return lib


def _last_error(lib) -> str:
    msg = lib.streamalloc_p2p_last_error()
    return msg.decode("utf-8", "replace") if msg else "unknown error"


_CODE_CACHE: dict = {}


def dtype_code(dtype) -> int:
    """The dtype's code in descriptions (a fixed table; other dtypes by name hash)."""
    code = _CODE_CACHE.get(dtype)
    if code is None:
        code = _CODE_CACHE[dtype] = _dtype_code(dtype)
    return code


def _dtype_code(dtype) -> int:
    name = str(dtype).replace("torch.", "")
    code = _DTYPE_CODES.get(name)
    if code is None:
        code = 0x4000_0000 | (zlib.crc32(name.encode()) & 0x3FFF_FFFF)
    return code


def encode_description(rank: int, world: int, send_lists, recv_lists) -> bytes:
    """The planner's ``LocalDescription`` encoding (plan.rs): lists of ``(bytes, dtype)``."""
    parts = [struct.pack("<III", _MAGIC, rank, world)]
    for lists in (send_lists, recv_lists):
        for metas in lists:
            parts.append(struct.pack("<I", len(metas)))
            if metas:
                flat = [v for m in metas for v in m]
                parts.append(struct.pack("<" + "QI" * len(metas), *flat))
    return b"".join(parts)


class Plan:
    """A plan from the Rust planner, for one rank."""

    def __init__(self, descriptions, budget_bytes: int, buffers_per_direction: int = 2,
                 zero_copy_min: int | None = None):
        self._lib = lib = _load_library()
        world = len(descriptions)
        blobs = (ctypes.c_char_p * world)(*descriptions)
        lens = (ctypes.c_size_t * world)(*[len(d) for d in descriptions])
        handle = lib.streamalloc_p2p_plan_new(
            world, blobs, lens, budget_bytes, buffers_per_direction, zero_copy_min or 0
        )
        if not handle:
            raise P2PError(_last_error(lib))
        self._handle = handle
        self.world = world
        self.digest = lib.streamalloc_p2p_plan_digest(handle)

    def summary(self, rank: int) -> dict:
        out = (ctypes.c_uint64 * 8)()
        if self._lib.streamalloc_p2p_plan_summary(self._handle, rank, out) != 0:
            raise P2PError(_last_error(self._lib))
        keys = ["rounds", "max_ops_per_group", "bytes_moved", "send_buffers",
                "send_buffer_bytes", "recv_buffers", "recv_buffer_bytes", "rank_rounds"]
        return dict(zip(keys, list(out)))

    def rows(self, rank: int):
        """This rank's rows: (round, direction, peer, kind, tensor, tensor_offset,
        buffer_offset, len, message_len)."""
        n = self._lib.streamalloc_p2p_plan_rows(self._handle, rank, None, 0)
        if n < 0:
            raise P2PError(_last_error(self._lib))
        flat = array.array("q", bytes(8 * _ROW * n))
        address, _ = flat.buffer_info()
        out = ctypes.cast(address, ctypes.POINTER(ctypes.c_int64)) if n else None
        self._lib.streamalloc_p2p_plan_rows(self._handle, rank, out, n)
        it = iter(flat)
        return list(zip(*[it] * _ROW))

    def close(self):
        if self._handle:
            self._lib.streamalloc_p2p_plan_free(self._handle)
            self._handle = None

    def __del__(self):
        try:
            self.close()
        except Exception:  # interpreter teardown
            pass


# ---- Preparing one rank's rounds ----

@dataclass
class _Run:
    """Whole same-dtype tensors back to back at ``[start, end)`` of a staging buffer."""
    start: int
    end: int
    dtype: object
    itemsize: int
    tensors: list = field(default_factory=list)  # flat (1-D) views
    numels: list = field(default_factory=list)
    view: object = None  # the run's typed view of its staging buffer (set on first run)
    parts: list = None  # that view split per tensor (receive side)


@dataclass
class _Msg:
    peer: int  # global rank for P2POp
    zero_copy: object = None  # the tensor's uint8 view
    length: int = 0
    runs: list = field(default_factory=list)
    pieces: list = field(default_factory=list)  # (uint8 view of tensor slice, buffer offset)
    buffer: int = -1  # index of the staging buffer it uses (packed only)
    wire: object = None  # the staging bytes on the wire (set on first run)
    staged: list = None  # the staging slices of ``pieces`` (set on first run)


def _flat(t):
    return t if t.dim() == 1 else t.view(-1)


def _bytes_view(t):
    import torch

    return _flat(t).view(torch.uint8)


def _prepare(rows, tensors, sizes, to_global):
    """Groups rows into per-round messages with the tensors they touch (done once).
    ``sizes[direction][peer][i]`` is the byte size of ``tensors[direction][peer][i]``."""
    rounds = {}
    for (rnd, direction, peer, kind, ti, t_off, b_off, length, wire) in rows:
        slot = rounds.setdefault(rnd, [None, None])
        t = tensors[direction][peer][ti]
        msg = slot[direction]
        if msg is None:
            msg = slot[direction] = _Msg(peer=to_global(peer), length=wire)
        if kind == 1:
            msg.zero_copy = _bytes_view(t)
            continue
        whole = t_off == 0 and length == sizes[direction][peer][ti]
        runs = msg.runs
        if whole and runs and runs[-1].dtype == t.dtype and runs[-1].end == b_off:
            run = runs[-1]
        elif whole:
            run = _Run(start=b_off, end=b_off, dtype=t.dtype, itemsize=t.element_size())
            runs.append(run)
        else:
            msg.pieces.append((_bytes_view(t)[t_off:t_off + length], b_off, length))
            continue
        run.tensors.append(_flat(t))
        run.numels.append(length // run.itemsize)
        run.end += length
    return [rounds[k] for k in sorted(rounds)]


# ---- The exchange ----

class Exchange:
    """An agreed exchange between the ranks of ``group``: construct it on every rank (a
    collective), then :meth:`run` it, as often as the same tensors need moving."""

    def __init__(self, sends: dict, recvs: dict, budget_mib: float = 128, group=None,
                 rounds_per_group: int = 1, zero_copy_min: int | None = None):
        import torch
        import torch.distributed as dist

        # K rounds fused in one group need K buffers in flight per direction, times two so
        # that packing the next group overlaps sending this one.
        buffers_per_direction = 2 * rounds_per_group
        self._per_group = rounds_per_group
        self._buffers = None
        self._group = group
        rank = dist.get_rank(group)
        world = dist.get_world_size(group)
        self.rank, self.world = rank, world
        # Local checks fail on every rank alike: their verdict travels with the description,
        # so no rank is left waiting in a collective that another rank has abandoned.
        try:
            if rounds_per_group < 1:
                raise P2PError(f"rounds_per_group must be at least 1 (got {rounds_per_group})")
            send_lists, recv_lists, metas, description = self._describe(sends, recvs, rank, world)
            local = (None, description)
        except P2PError as err:
            local = (str(err), b"")
        gathered = [None] * world
        dist.all_gather_object(gathered, local, group=group)
        for r, (error, _) in enumerate(gathered):
            if error is not None:
                raise P2PError(f"rank {r} cannot take part in the p2p exchange: {error}")
        gathered = [d for _, d in gathered]
        budget = int(budget_mib * 2**20)
        plan, vote = None, None
        try:
            plan = Plan(gathered, budget, buffers_per_direction, zero_copy_min)
            vote = (0, plan.digest)
        except P2PError as err:
            vote = (1, str(err))
        votes = [None] * world
        dist.all_gather_object(votes, vote, group=group)
        failures = [(r, v[1]) for r, v in enumerate(votes) if v[0] == 1]
        if failures:
            if len(failures) == world and all(m == failures[0][1] for _, m in failures):
                raise P2PError(failures[0][1])
            r, message = failures[0]
            raise P2PError(f"rank {r} could not plan the p2p exchange: {message}")
        digests = [v[1] for v in votes]
        if any(d != digests[0] for d in digests):
            listed = ", ".join(f"{d:016x}" for d in digests)
            raise P2PError(
                f"p2p plan digest mismatch across ranks [{listed}]: ranks planned differently "
                "(different staging budgets or streamalloc versions)"
            )
        self.plan = plan
        self.summary = plan.summary(rank)
        self.budget_bytes = budget
        to_global = (lambda p: p) if group is None else (lambda p: dist.get_global_rank(group, p))
        sizes = [[[m[0] for m in ms] for ms in side] for side in metas]
        self._rounds = _prepare(plan.rows(rank), (send_lists, recv_lists), sizes, to_global)
        self._self_copies = (
            [_flat(t) for t in recv_lists[rank]], [_flat(t) for t in send_lists[rank]]
        )
        if self.device.type == "cuda":
            self._pack_stream = torch.cuda.Stream(self.device)
            self._unpack_stream = torch.cuda.Stream(self.device)

    def _describe(self, sends, recvs, rank, world):
        """Checks this rank's lists and encodes its description."""
        import torch

        send_lists = self._lists(sends, world, "sends")
        recv_lists = self._lists(recvs, world, "recvs")
        device, devices = None, set()
        for side, lists in (("sends", send_lists), ("recvs", recv_lists)):
            for p, ts in enumerate(lists):
                if not all(t.is_contiguous() for t in ts):
                    i = next(i for i, t in enumerate(ts) if not t.is_contiguous())
                    raise P2PError(f"{side}[{p}][{i}] is not contiguous; pass t.contiguous()")
                devices |= {t.get_device() for t in ts}
                if device is None and ts:
                    device = ts[0].device
        if len(devices) > 1:
            names = ", ".join("cpu" if d < 0 else f"cuda:{d}" for d in sorted(devices))
            raise P2PError(f"tensors are on several devices ({names}); use one")
        if device is None:
            device = (torch.device("cuda", torch.cuda.current_device())
                      if torch.cuda.is_available() else torch.device("cpu"))
        self.device = device
        metas = [[[(t.nbytes, dtype_code(t.dtype)) for t in ts] for ts in lists]
                 for lists in (send_lists, recv_lists)]
        description = encode_description(rank, world, metas[0], metas[1])
        return send_lists, recv_lists, metas, description

    @staticmethod
    def _lists(mapping, world, name):
        lists = [[] for _ in range(world)]
        for peer, ts in (mapping or {}).items():
            if not isinstance(peer, int) or not 0 <= peer < world:
                raise P2PError(f"{name}: peer {peer!r} is not a rank in 0..{world - 1}")
            # Parameters require grad; the exchange moves their data, as ``p.data`` would.
            lists[peer] = [t.detach() if t.requires_grad else t for t in ts]
        return lists

    @property
    def staging_bytes(self) -> int:
        """Staging bytes one :meth:`run` holds (at most the budget)."""
        s = self.summary
        return (s["send_buffers"] * s["send_buffer_bytes"]
                + s["recv_buffers"] * s["recv_buffer_bytes"])

    def _setup_buffers(self):
        """Allocates the staging buffers and caches every view of them the rounds use: the
        buffer each packed message takes is fixed by its order, so this is done once."""
        import torch

        s = self.summary
        u8 = torch.uint8
        sbufs = [torch.empty(s["send_buffer_bytes"], dtype=u8, device=self.device)
                 for _ in range(s["send_buffers"])]
        rbufs = [torch.empty(s["recv_buffer_bytes"], dtype=u8, device=self.device)
                 for _ in range(s["recv_buffers"])]
        counters = [0, 0]
        for pair in self._rounds:
            for direction, msg in enumerate(pair):
                if msg is None or msg.zero_copy is not None:
                    continue
                bufs = sbufs if direction == 0 else rbufs
                msg.buffer = counters[direction] % len(bufs)
                counters[direction] += 1
                buf = bufs[msg.buffer]
                msg.wire = buf[:msg.length]
                for run in msg.runs:
                    run.view = buf[run.start:run.end].view(run.dtype)
                    if direction == 1 and len(run.tensors) > 1:
                        run.parts = list(torch.split(run.view, run.numels))
                msg.staged = [buf[o:o + n] for _, o, n in msg.pieces]
        self._buffers = (sbufs, rbufs)

    def release(self):
        """Returns the staging buffers (kept between runs otherwise; at most the budget)."""
        self._buffers = None
        for pair in self._rounds:
            for msg in pair:
                if msg is not None:
                    msg.wire = None
                    msg.staged = None
                    for run in msg.runs:
                        run.view = run.parts = None

    def run(self) -> dict:
        """Moves the bytes. Returns the plan's figures for this rank."""
        import torch
        import torch.distributed as dist

        dst, src = self._self_copies
        if dst:
            torch._foreach_copy_(dst, src)
        if not self._rounds:
            return dict(self.summary)
        if self._buffers is None:
            self._setup_buffers()
        sbufs, rbufs = self._buffers
        cuda = self.device.type == "cuda"
        send_free = [None] * len(sbufs)
        recv_free = [None] * len(rbufs)
        if cuda:
            cur = torch.cuda.current_stream(self.device)
            pack, unpack = self._pack_stream, self._unpack_stream
            pack.wait_stream(cur)
            unpack.wait_stream(cur)
        group = self._group
        isend, irecv, P2POp = dist.isend, dist.irecv, dist.P2POp
        K = self._per_group
        rounds = self._rounds
        for g in range(0, len(rounds), K):
            chunk = rounds[g:g + K]
            packed = [m for m, _ in chunk if m is not None and m.zero_copy is None]
            landed = [m for _, m in chunk if m is not None and m.zero_copy is None]
            if packed:
                if cuda:
                    with torch.cuda.stream(pack):
                        for m in packed:
                            if send_free[m.buffer] is not None:
                                pack.wait_event(send_free[m.buffer])
                            _pack(m)
                        ready = pack.record_event()
                    cur.wait_event(ready)
                else:
                    for m in packed:
                        _pack(m)
            if cuda:
                for m in landed:
                    if recv_free[m.buffer] is not None:
                        cur.wait_event(recv_free[m.buffer])
            ops = []
            for send, recv in chunk:
                if send is not None:
                    t = send.zero_copy if send.zero_copy is not None else send.wire
                    ops.append(P2POp(isend, t, send.peer, group))
                if recv is not None:
                    t = recv.zero_copy if recv.zero_copy is not None else recv.wire
                    ops.append(P2POp(irecv, t, recv.peer, group))
            for work in dist.batch_isend_irecv(ops):
                work.wait()
            if cuda:
                if packed:
                    done = cur.record_event()
                    for m in packed:
                        send_free[m.buffer] = done
                if landed:
                    arrived = cur.record_event()
                    with torch.cuda.stream(unpack):
                        unpack.wait_event(arrived)
                        for m in landed:
                            _unpack(m)
                        emptied = unpack.record_event()
                    for m in landed:
                        recv_free[m.buffer] = emptied
            else:
                for m in landed:
                    _unpack(m)
        if cuda:
            cur.wait_stream(pack)
            cur.wait_stream(unpack)
        return dict(self.summary)


def _pack(msg):
    import torch

    for run in msg.runs:
        if len(run.tensors) == 1:
            run.view.copy_(run.tensors[0])
        else:
            torch.cat(run.tensors, out=run.view)
    for (piece, _, _), staged in zip(msg.pieces, msg.staged):
        staged.copy_(piece)


def _unpack(msg):
    import torch

    for run in msg.runs:
        if len(run.tensors) == 1:
            run.tensors[0].copy_(run.view)
        else:
            torch._foreach_copy_(run.tensors, run.parts)
    for (piece, _, _), staged in zip(msg.pieces, msg.staged):
        piece.copy_(staged)


def exchange(sends: dict, recvs: dict, budget_mib: float = 128, group=None, **options) -> dict:
    """Sends ``sends[peer]`` to each peer and fills ``recvs[peer]`` from each, through at
    most ``budget_mib`` of staging memory. A collective: every rank of ``group`` calls it.
    Returns this rank's plan figures (rounds, max ops per group, bytes moved, buffers)."""
    ex = Exchange(sends, recvs, budget_mib=budget_mib, group=group, **options)
    try:
        return ex.run()
    finally:
        ex.release()
