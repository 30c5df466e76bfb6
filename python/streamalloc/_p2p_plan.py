"""The exchange's plan, as every rank computes it: the Rust planner (``p2p/src/staging/plan.rs``
in ``libstreamalloc.so``, through ``src/ffi/p2p.rs``), the descriptions ranks gather before
planning, and this rank's rounds grouped into messages.

Why a module of its own: everything here is a pure function of what the ranks gathered, so
every rank gets the same result; what runs the rounds (``_p2p_rounds``), agrees on them
(``_p2p_exchange``) and reads a ``P2POp`` list (``_p2p_dropin``) builds on it.

A rank's lists are kept *lane-major*: lane ``direction * world + peer`` (direction 0 sends,
1 receives), each lane's tensors in order, lanes back to back. That is the order of the
planner's description, and the order in which a ``P2POp`` list's ops to one peer carry
meaning: how the ops of different peers interleave does not.
"""

from __future__ import annotations

import array
import ctypes
import os
import struct
import sys
import zlib
from dataclasses import dataclass, field

_MAGIC = 0x5350_3250  # "SP2P", as in plan.rs
_ROW = 9  # columns of a plan row (src/ffi/p2p.rs)
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
        """This rank's rows, flat (``_ROW`` int64 each): (round, direction, peer, kind,
        tensor, tensor_offset, buffer_offset, len, message_len)."""
        n = self._lib.streamalloc_p2p_plan_rows(self._handle, rank, None, 0)
        if n < 0:
            raise P2PError(_last_error(self._lib))
        flat = array.array("q", [0]) * (_ROW * n)
        address, _ = flat.buffer_info()
        out = ctypes.cast(address, ctypes.POINTER(ctypes.c_int64)) if n else None
        self._lib.streamalloc_p2p_plan_rows(self._handle, rank, out, n)
        return flat

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
    # The tensors' bytes (an int64 array): PyTorch's packing splits the run's view by
    # them; the other packings never need them per tensor, so no Python int is made here.
    nbytes: array.array = None
    view: object = None  # the run's typed view of its staging buffer (set on first run)
    parts: list = None  # that view split per tensor (receive side)
    # Where the tensors come from: ``lists[direction][peer][first:first + len(tensors)]``
    # (the planner packs each peer's list in order), so new tensors of the same shapes
    # rebind by slicing (:meth:`Exchange._rebind`).
    source: tuple = None  # (direction, peer, first)


@dataclass
class _Msg:
    peer: int  # global rank for P2POp
    rank: int = -1  # the peer's rank in the group
    zero_copy: object = None  # the tensor's uint8 view
    length: int = 0
    runs: list = field(default_factory=list)
    pieces: list = field(default_factory=list)  # (uint8 view of tensor slice, buffer offset)
    # (direction, peer, tensor index, tensor offset) of the zero-copy tensor and of each piece
    zero_copy_source: tuple = None
    piece_sources: list = field(default_factory=list)
    buffer: int = -1  # index of the staging buffer it uses (packed only)
    wire: object = None  # the staging bytes on the wire (set on first run)
    staged: list = None  # the staging slices of ``pieces`` (set on first run)
    # Copy-engine transport (set on first run): the slot in the receiver's buffers, the
    # addresses of the copy and of the two flags, and the bytes copied.
    slot: object = None
    dst: int = 0
    src: int = 0
    nbytes: int = 0
    filled_flag: int = 0
    free_flag: int = 0
    # A received message that is one region of one tensor (:meth:`Exchange._direct`) is
    # unpacked with one driver copy from ``unpack_src`` to ``unpack_dst`` (0: unpacked
    # through PyTorch).
    unpack_dst: int = 0
    unpack_src: int = 0


def _flat(t):
    return t if t.dim() == 1 else t.view(-1)


def _bytes_view(t):
    import torch

    return _flat(t).view(torch.uint8)


def _prepare(rows, tensors, lanes, to_global, piece_views=True):
    """Groups this rank's plan rows (:meth:`Plan.rows`) into per-round messages with the
    tensors they touch (done once per agreed exchange). ``tensors[direction][peer]`` are
    1-D; ``lanes`` (:class:`Lanes`) holds their bytes and dtype codes, lane-major, read in
    place (no per-tensor Python list is built from them).

    A message packs thousands of small tensors, one row each, but what packing needs is
    the runs: whole tensors of one list and dtype back to back in the buffer. So the rows
    are compared with their predecessors as columns (torch on the CPU), and Python visits
    only the first row of each run (and each zero-copy tensor or split piece): at 58,000
    tensors this is what brings an agreement from a Python loop over every row to a loop
    over a few hundred runs. ``piece_views``: keep a byte view of each split piece (what
    PyTorch's packing copies through); without it a piece holds None in its place, as
    after ``_Rounds._unbind``."""
    import torch

    n = len(rows) // _ROW
    if n == 0:
        return []
    table = torch.frombuffer(rows, dtype=torch.int64).view(n, _ROW)
    rnd, direction, peer, kind, ti, t_off, b_off, length, _ = table.unbind(1)
    world, nbytes = lanes.world, lanes.nbytes
    bases = lanes.starts()
    column = lambda values: torch.frombuffer(values, dtype=torch.int64)
    # (index_select: PyTorch's advanced indexing costs several times as much on the CPU)
    at = column(array.array("q", bases)).index_select(0, direction * world + peer) + ti
    whole = (kind == 0) & (t_off == 0) & (length == column(nbytes).index_select(0, at))
    code = column(lanes.codes).index_select(0, at)
    # A row continues its predecessor's run: both whole tensors of the same message and
    # list, the next tensor of that list, the same dtype, right after it in the buffer.
    continues = torch.zeros(n, dtype=torch.bool)
    continues[1:] = (whole[1:] & whole[:-1] & (rnd[1:] == rnd[:-1])
                     & (direction[1:] == direction[:-1]) & (peer[1:] == peer[:-1])
                     & (ti[1:] == ti[:-1] + 1) & (code[1:] == code[:-1])
                     & (b_off[1:] == b_off[:-1] + length[:-1]))
    starts = torch.nonzero(~continues).flatten()
    ends = torch.cat([starts[1:], torch.tensor([n])])
    last = ends - 1
    heads = table.index_select(0, starts).tolist()
    counts = (ends - starts).tolist()
    run_ends = (b_off.index_select(0, last) + length.index_select(0, last)).tolist()
    rounds, slot, current = [], None, None
    for (r, d, p, k, i, t_off_, b_off_, length_, wire), count, end in zip(heads, counts,
                                                                           run_ends):
        if r != current:
            slot, current = [None, None], r
            rounds.append(slot)
        msg = slot[d]
        if msg is None:
            msg = slot[d] = _Msg(peer=to_global(p), rank=p, length=wire)
        listed, base = tensors[d][p], bases[d * world + p]
        if k == 1:
            msg.zero_copy = _bytes_view(listed[i])
            msg.zero_copy_source = (d, p, i)
        elif t_off_ == 0 and length_ == nbytes[base + i]:
            t = listed[i]
            itemsize = t.element_size()
            msg.runs.append(_Run(start=b_off_, end=end, dtype=t.dtype, itemsize=itemsize,
                                 tensors=listed[i:i + count],
                                 nbytes=nbytes[base + i:base + i + count],
                                 source=(d, p, i)))
        else:
            view = _bytes_view(listed[i])[t_off_:t_off_ + length_] if piece_views else None
            msg.pieces.append((view, b_off_, length_))
            msg.piece_sources.append((d, p, i, t_off_))
    return rounds


# ---- Lane-major lists ----

@dataclass
class Lanes:
    """One rank's send and receive lists, lane-major (see the module doc): ``tensors`` in
    lane order, ``counts[lane]`` of them per lane, and their bytes and dtype codes alike.
    ``addresses`` (device addresses, lane order) is filled where the copy kernel needs
    them; ``device`` is the tensors' device (None: no tensor)."""
    world: int
    counts: list
    tensors: list
    nbytes: array.array
    codes: array.array
    device: object = None
    addresses: array.array = None

    def starts(self) -> list:
        out, at = [], 0
        for n in self.counts:
            out.append(at)
            at += n
        return out

    def lists(self, direction: int) -> list:
        """``[tensors of peer p]`` for one direction."""
        starts, w = self.starts(), self.world
        return [self.tensors[starts[direction * w + p]:starts[direction * w + p]
                             + self.counts[direction * w + p]] for p in range(w)]

    def description(self, rank: int) -> bytes:
        """The planner's encoding of these lists (``LocalDescription`` in plan.rs)."""
        parts = [struct.pack("<III", _MAGIC, rank, self.world)]
        at = 0
        for n in self.counts:
            parts.append(struct.pack("<I", n))
            if n:
                parts.append(_entries(self.nbytes, self.codes, at, n))
                at += n
        return b"".join(parts)


# From this many entries a lane's (bytes, dtype) pairs are interleaved by PyTorch's CPU
# copies, where it is installed, instead of packed one by one (1.8 ms for 58,000 entries).
_BULK_ENTRIES = 4096


def _entries(nbytes, codes, at: int, n: int) -> bytes:
    """Entries ``at`` to ``at + n`` as the planner reads them: ``<QI`` each (bytes, code)."""
    if n >= _BULK_ENTRIES and sys.byteorder == "little":
        try:
            import torch
        except ImportError:
            torch = None
        if torch is not None:
            buffer = bytearray(12 * n)
            out = torch.frombuffer(buffer, dtype=torch.uint8).view(n, 12)
            sizes = torch.frombuffer(nbytes, dtype=torch.int64, offset=8 * at, count=n)
            kinds = torch.frombuffer(codes, dtype=torch.int64, offset=8 * at, count=n)
            out[:, :8] = sizes.view(torch.uint8).view(n, 8)
            out[:, 8:] = kinds.to(torch.int32).view(torch.uint8).view(n, 4)
            return bytes(buffer)
    flat = [0] * (2 * n)
    flat[0::2] = nbytes[at:at + n]
    flat[1::2] = codes[at:at + n]
    return struct.pack("<" + "QI" * n, *flat)


def lanes_from_lists(world: int, send_lists, recv_lists, device=None) -> Lanes:
    """:class:`Lanes` from per-peer lists of tensors (already checked)."""
    counts, tensors = [], []
    for lists in (send_lists, recv_lists):
        for ts in lists:
            counts.append(len(ts))
            tensors.extend(ts)
    nbytes = array.array("q", [t.nbytes for t in tensors])
    codes = array.array("q", [dtype_code(t.dtype) for t in tensors])
    return Lanes(world, counts, tensors, nbytes, codes, device)
