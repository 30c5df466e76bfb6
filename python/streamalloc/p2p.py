"""Many-tensor point-to-point exchange through a bounded staging pool.

``exchange(sends={peer: [tensors]}, recvs={peer: [tensors]}, budget_mib=128)`` moves any
number of tensors (any dtype, shape and count; empty lists fine) between the ranks of a
``torch.distributed`` job without one NCCL operation per tensor (slow, and it can hang
across nodes) and without one concatenated buffer per peer (doubles memory):

1. every rank all-gathers a compact description of its lists (bytes and dtype per tensor);
2. every rank plans with the Rust planner in ``libstreamalloc.so`` (the same code the CI
   tests: ``p2p/src/staging/plan.rs``): rounds in which each rank exchanges at most
   one message with one partner (circle-method pairing), large tensors zero-copy, small
   ones packed into staging buffers, tensors larger than the room left split;
3. every rank all-gathers the plan digest: a mismatch in sizes, dtypes or counts, or a
   different budget, raises the same :class:`P2PError` on every rank before any data moves;
4. per round: pack (one batched copy per same-dtype run: ``torch.cat(..., out=)``) on a
   packing stream, one ``batch_isend_irecv`` group of at most two operations, unpack
   (``torch._foreach_copy_`` from ``torch.split`` views) on an unpacking stream. Staging
   buffers rotate (two per direction by default), ordered with events, so packing round
   k+1 and unpacking round k-1 overlap the transfer of round k.

Step 4 above is the ``"nccl"`` transport (the process group's backend; gloo on CPU). When
every rank of the group is on one host and the GPUs have peer access, the ``"ce"``
transport (``streamalloc._ce``; ``transport="auto"``, the default, picks it) moves each
message with one copy-engine copy straight into the receiver's staging buffer over CUDA
IPC, ordered by flags that the streams write and wait on (no NCCL launch per round, no host
wait). Every rank must ask for the same transport; the choice is part of what the ranks
agree on before any data moves, and a failure to set the copy engine up is either the same
:class:`P2PError` everywhere (``"ce"``) or the same fallback to ``"nccl"`` (``"auto"``).

Staging memory is at most ``budget_mib`` per rank, whatever the number and size of the
tensors. :class:`Exchange` keeps the agreed plan to run the same exchange again (weight
sync every step) without planning again.

:func:`batch_isend_irecv` takes what ``torch.distributed.batch_isend_irecv`` takes (a list of
``P2POp``) and runs it as such an exchange, keeping the agreed exchange per shape of every
rank's list: code that already writes P2POp lists changes one import.

This module is the exchange's only executor: Rust plans, Python runs the rounds
(``docs/design.md``, "One executor for the P2P exchange").
"""

from __future__ import annotations

import array
import ctypes
import os
import struct
import zlib
from dataclasses import dataclass, field

from . import _ce

__all__ = ["batch_isend_irecv", "exchange", "Exchange", "P2PError"]

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
        flat = array.array("q", bytes(8 * _ROW * n))
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
    numels: list = field(default_factory=list)
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


def _prepare(rows, tensors, sizes, codes, to_global):
    """Groups this rank's plan rows (:meth:`Plan.rows`) into per-round messages with the
    tensors they touch (done once per agreed exchange). ``tensors[direction][peer]`` are
    1-D; ``sizes`` and ``codes`` hold their bytes and dtype codes alike.

    A message packs thousands of small tensors, one row each, but what packing needs is
    the runs: whole tensors of one list and dtype back to back in the buffer. So the rows
    are compared with their predecessors as columns (torch on the CPU), and Python visits
    only the first row of each run (and each zero-copy tensor or split piece): at 58,000
    tensors this is what brings an agreement from a Python loop over every row to a loop
    over a few hundred runs."""
    import torch

    n = len(rows) // _ROW
    if n == 0:
        return []
    table = torch.frombuffer(rows, dtype=torch.int64).view(n, _ROW)
    rnd, direction, peer, kind, ti, t_off, b_off, length, _ = table.unbind(1)
    world = len(sizes[0])
    bases, all_sizes, all_codes = [], [], []
    for d in (0, 1):
        for p in range(world):
            bases.append(len(all_sizes))
            all_sizes.extend(sizes[d][p])
            all_codes.extend(codes[d][p])
    column = lambda values: torch.frombuffer(array.array("q", values), dtype=torch.int64)
    at = column(bases)[direction * world + peer] + ti
    whole = (kind == 0) & (t_off == 0) & (length == column(all_sizes)[at])
    code = column(all_codes)[at]
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
    heads = table[starts].tolist()
    counts = (ends - starts).tolist()
    run_ends = (b_off[last] + length[last]).tolist()
    rounds, slot, current = [], None, None
    for (r, d, p, k, i, t_off_, b_off_, length_, wire), count, end in zip(heads, counts,
                                                                           run_ends):
        if r != current:
            slot, current = [None, None], r
            rounds.append(slot)
        msg = slot[d]
        if msg is None:
            msg = slot[d] = _Msg(peer=to_global(p), rank=p, length=wire)
        listed = tensors[d][p]
        if k == 1:
            msg.zero_copy = _bytes_view(listed[i])
            msg.zero_copy_source = (d, p, i)
        elif t_off_ == 0 and length_ == sizes[d][p][i]:
            t = listed[i]
            itemsize = t.element_size()
            msg.runs.append(_Run(start=b_off_, end=end, dtype=t.dtype, itemsize=itemsize,
                                 tensors=listed[i:i + count],
                                 numels=[x // itemsize for x in sizes[d][p][i:i + count]],
                                 source=(d, p, i)))
        else:
            msg.pieces.append((_bytes_view(listed[i])[t_off_:t_off_ + length_], b_off_,
                               length_))
            msg.piece_sources.append((d, p, i, t_off_))
    return rounds


# ---- The exchange ----

class Exchange:
    """An agreed exchange between the ranks of ``group``: construct it on every rank (a
    collective), then :meth:`run` it, as often as the same tensors need moving.

    ``transport``: ``"nccl"`` moves each round with one ``batch_isend_irecv`` group of the
    process group's backend; ``"ce"`` with one copy-engine copy into the receiver's buffer
    over CUDA IPC (every rank on one host, GPUs with peer access; see
    ``streamalloc._ce``); ``"auto"`` (default) picks ``"ce"`` when every rank can, else
    ``"nccl"``. Every rank must pass the same value; the choice is agreed before any data
    moves (``self.transport``, and ``self.transport_note`` says why ``"auto"`` did not pick
    ``"ce"``)."""

    def __init__(self, sends: dict, recvs: dict, budget_mib: float = 128, group=None,
                 rounds_per_group: int = 1, zero_copy_min: int | None = None,
                 transport: str = "auto", _translated: "_Translated | None" = None):
        import torch
        import torch.distributed as dist

        # K rounds fused in one group need K buffers in flight per direction, times two so
        # that packing the next group overlaps sending this one.
        buffers_per_direction = 2 * rounds_per_group
        self._per_group = rounds_per_group
        self._bpd = buffers_per_direction
        self._buffers = None
        self._link = None
        self._runs = 0
        self._group = group
        rank = dist.get_rank(group)
        world = dist.get_world_size(group)
        self.rank, self.world = rank, world
        # Local checks fail on every rank alike: their verdict travels with the description,
        # so no rank is left waiting in a collective that another rank has abandoned.
        probe = None
        try:
            if rounds_per_group < 1:
                raise P2PError(f"rounds_per_group must be at least 1 (got {rounds_per_group})")
            if transport not in _ce.TRANSPORTS:
                raise P2PError(f"transport must be one of {', '.join(_ce.TRANSPORTS)} "
                               f"(got {transport!r})")
            if _translated is None:
                send_lists, recv_lists, metas, description = self._describe(sends, recvs,
                                                                            rank, world)
            else:  # the drop-in has read and checked its lists already
                send_lists, recv_lists, metas, description = self._from_translated(
                    _translated, rank, world)
            if transport != "nccl":
                probe = _ce.probe(self.device)
            local = (None, description, transport, probe)
        except P2PError as err:
            local = (str(err), b"", transport, None)
        gathered = [None] * world
        dist.all_gather_object(gathered, local, group=group)
        for r, (error, *_) in enumerate(gathered):
            if error is not None:
                raise P2PError(f"rank {r} cannot take part in the p2p exchange: {error}")
        requests = [g[2] for g in gathered]
        if any(t != requests[0] for t in requests):
            listed = ", ".join(f"rank {r}: {t}" for r, t in enumerate(requests))
            raise P2PError(f"p2p transport mismatch across ranks ({listed}): pass the same "
                           "transport= on every rank")
        budget = int(budget_mib * 2**20)
        chosen, why = _ce.resolve_transport(transport, [g[3] for g in gathered], world, budget,
                                            buffers_per_direction)
        if chosen is None:
            raise P2PError(f"p2p transport 'ce' is not possible: {why}")
        self.transport_note = why
        descriptions = [g[1] for g in gathered]
        to_global = (lambda p: p) if group is None else (lambda p: dist.get_global_rank(group, p))
        sizes = [[[m[0] for m in ms] for ms in side] for side in metas]
        self._codes = [[[m[1] for m in ms] for ms in side] for side in metas]
        lists = (send_lists, recv_lists)
        self.budget_bytes = budget
        if chosen == "ce":
            self._agree(descriptions, budget - _ce.reserve_bytes(buffers_per_direction, world),
                        _ce.NO_ZERO_COPY, "ce", lists, sizes, to_global)
            if self.summary["rounds"]:
                failure = self._establish_ce(probe)
                if failure is not None:
                    if transport == "ce":
                        raise P2PError(f"p2p transport 'ce' failed: {failure}")
                    # Every rank saw the same failures: every rank falls back.
                    self.transport_note = failure
                    chosen = None
        if chosen != "ce":
            self._agree(descriptions, budget, zero_copy_min, "nccl", lists, sizes, to_global)
        self._self_copies = (
            [_flat(t) for t in recv_lists[rank]], [_flat(t) for t in send_lists[rank]]
        )
        if self.device.type == "cuda":
            self._pack_stream = torch.cuda.Stream(self.device)
            self._unpack_stream = torch.cuda.Stream(self.device)
            if self.transport == "ce":
                self._copy_stream = torch.cuda.Stream(self.device)

    def _agree(self, descriptions, budget, zero_copy_min, transport, lists, sizes, to_global):
        """Plans, and checks that every rank planned the same (digest and transport)."""
        import torch.distributed as dist

        world, group = self.world, self._group
        plan, vote = None, None
        try:
            plan = Plan(descriptions, budget, self._bpd, zero_copy_min)
            vote = (0, plan.digest, transport)
        except P2PError as err:
            vote = (1, str(err), transport)
        votes = [None] * world
        dist.all_gather_object(votes, vote, group=group)
        failures = [(r, v[1]) for r, v in enumerate(votes) if v[0] == 1]
        if failures:
            if len(failures) == world and all(m == failures[0][1] for _, m in failures):
                raise P2PError(failures[0][1])
            r, message = failures[0]
            raise P2PError(f"rank {r} could not plan the p2p exchange: {message}")
        if any(v[2] != votes[0][2] for v in votes):
            listed = ", ".join(f"rank {r}: {v[2]}" for r, v in enumerate(votes))
            raise P2PError(f"p2p transport mismatch across ranks ({listed})")
        digests = [v[1] for v in votes]
        if any(d != digests[0] for d in digests):
            listed = ", ".join(f"{d:016x}" for d in digests)
            raise P2PError(
                f"p2p plan digest mismatch across ranks [{listed}]: ranks planned differently "
                "(different staging budgets or streamalloc versions)"
            )
        if self._link is not None:  # a collective: every rank is here
            self._unlink(self._link)
            self._link = None
        self.plan = plan
        self.transport = transport
        self.summary = dict(plan.summary(self.rank), transport=transport)
        self._plan_budget = budget
        self._rounds = _prepare(plan.rows(self.rank), lists, sizes, self._codes, to_global)

    def _establish_ce(self, probe) -> str | None:
        """Exports this rank's region, maps the peers' (a collective). Returns None, or the
        first failure (the same on every rank)."""
        import torch.distributed as dist

        world, group = self.world, self._group
        recvs = [m for _, m in self._rounds if m is not None]
        peers = {m.rank for pair in self._rounds for m in pair if m is not None}
        s = self.summary
        link = _ce.Link(self.device, self.rank, world, self._bpd)
        try:
            record = link.export(s["recv_buffers"], s["recv_buffer_bytes"],
                                 [m.rank for m in recvs], bool(probe and probe.get("flush")))
        except _ce.CeError as err:
            record = str(err)
        records = [None] * world
        dist.all_gather_object(records, record, group=group)
        failure = next((f"rank {r}: {x}" for r, x in enumerate(records) if isinstance(x, str)),
                       None)
        if failure is None:
            try:
                link.connect(records, peers)
                ok = None
            except _ce.CeError as err:
                ok = str(err)
            oks = [None] * world
            dist.all_gather_object(oks, ok, group=group)
            failure = next((f"rank {r}: {x}" for r, x in enumerate(oks) if x), None)
        if failure is not None:  # the same on every rank
            try:
                self._unlink(link)
            except _ce.CeError:
                pass  # the failure reported is the first one
            return failure
        self._link = link
        self._records = records
        # Memory PyTorch's statistics do not see (``torch.cuda.memory_allocated``): the
        # region is a cuMemAlloc of its own (see ``_ce.DeviceAllocation``).
        self.summary["unpooled_bytes"] = link.layout.size
        return None

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
        # Flat views (contiguous, checked above): packing and unpacking see 1-D tensors.
        send_lists, recv_lists = ([[_flat(t) for t in ts] for ts in lists]
                                  for lists in (send_lists, recv_lists))
        if device is None:
            device = (torch.device("cuda", torch.cuda.current_device())
                      if torch.cuda.is_available() else torch.device("cpu"))
        self.device = device
        metas = [[[(t.nbytes, dtype_code(t.dtype)) for t in ts] for ts in lists]
                 for lists in (send_lists, recv_lists)]
        description = encode_description(rank, world, metas[0], metas[1])
        return send_lists, recv_lists, metas, description

    def _from_translated(self, translated, rank, world):
        """:meth:`_describe` for lists the drop-in has read (:func:`translate_ops`): the
        metadata regrouped per list from its per-op columns, no tensor touched again."""
        import torch

        codes = {d: dtype_code(d) for d in set(translated.dtypes)}
        metas = [[[] for _ in range(world)] for _ in range(2)]
        adds = [m.append for p in range(world) for m in (metas[0][p], metas[1][p])]
        for key, nbytes, dtype in zip(translated.keys, translated.nbytes, translated.dtypes):
            adds[key]((nbytes, codes[dtype]))
        device = translated.device
        if device is None:
            device = (torch.device("cuda", torch.cuda.current_device())
                      if torch.cuda.is_available() else torch.device("cpu"))
        self.device = device
        description = encode_description(rank, world, metas[0], metas[1])
        return translated.send_lists, translated.recv_lists, metas, description

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
        if self.transport == "ce":
            return self._ce_staging_bytes()
        s = self.summary
        return (s["send_buffers"] * s["send_buffer_bytes"]
                + s["recv_buffers"] * s["recv_buffer_bytes"])

    def _setup_buffers(self):
        """Allocates the staging buffers and caches every view of them the rounds use: the
        buffer each packed message takes is fixed by its order, so this is done once."""
        import torch

        if self.transport == "ce":
            return self._setup_ce()
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
                _bind(msg, bufs[msg.buffer], direction)
        self._buffers = (sbufs, rbufs)

    # ---- Copy-engine transport ----

    def _ce_sends(self):
        return [m for m, _ in self._rounds if m is not None]

    @staticmethod
    def _direct(msg) -> bool:
        """A message that is one contiguous region of one tensor: copied from the tensor."""
        return ((not msg.pieces and len(msg.runs) == 1 and len(msg.runs[0].tensors) == 1)
                or (not msg.runs and len(msg.pieces) == 1))

    @staticmethod
    def _direct_source(msg):
        """(tensor, offset in the message, bytes) of a :meth:`_direct` message."""
        if msg.runs:
            run = msg.runs[0]
            return run.tensors[0], run.start, run.end - run.start
        return msg.pieces[0]

    def _ce_send_buffers(self):
        """(count, bytes) of the local send buffers: only messages of several tensors (or
        pieces) are packed locally before their one copy."""
        packed = [m.length for m in self._ce_sends() if not self._direct(m)]
        if not packed:
            return 0, 0
        return min(len(packed), self.summary["send_buffers"]), max(packed)

    def _ce_staging_bytes(self) -> int:
        count, nbytes = self._ce_send_buffers()
        region = _ce.Layout(self.summary["recv_buffers"], self.summary["recv_buffer_bytes"],
                            self._bpd, self.world).size
        return count * nbytes + (region if self.summary["rounds"] else 0)

    def _setup_ce(self):
        import torch

        link = self._link
        if self.staging_bytes > self.budget_bytes:  # reserve_bytes() keeps this from happening
            raise P2PError(f"copy-engine staging of {self.staging_bytes} bytes exceeds the "
                           f"budget of {self.budget_bytes}")
        count, nbytes = self._ce_send_buffers()
        sbufs = [torch.empty(nbytes, dtype=torch.uint8, device=self.device)
                 for _ in range(count)]
        layout, region, base = link.layout, link.region, link.base
        rbufs = [region[layout.buffer(b):layout.buffer(b) + layout.buffer_bytes]
                 for b in range(layout.buffers)]
        # Receiving: the slots of this rank's messages, and who writes each buffer next.
        recvs = [m for _, m in self._rounds if m is not None]
        slots = _ce.receive_slots(len(recvs), layout.buffers)
        nexts = _ce.next_users([m.rank for m in recvs], layout.buffers)
        for msg, slot, nxt in zip(recvs, slots, nexts):
            msg.slot, msg.buffer = slot, slot.buffer
            _bind(msg, rbufs[slot.buffer], 1)
            if self._direct(msg):
                dst, off, msg.nbytes = self._direct_source(msg)
                msg.unpack_dst, msg.unpack_src = dst.data_ptr(), msg.wire.data_ptr() + off
            msg.filled_flag = base + layout.filled(slot.buffer)
            peer_base, peer_layout = link.peers[nxt]
            msg.free_flag = peer_base + peer_layout.free(self.rank, slot.buffer)
        # Sending: the slot each message takes in its receiver's buffers. The messages of
        # one ordered pair arrive in the order they are sent, so this rank's j-th message to
        # R is the j-th that R's list of senders attributes to this rank.
        positions, peer_slots, sent = {}, {}, {}
        for r, rec in enumerate(self._records):
            if r in link.peers:
                senders = rec["recv_from"]
                positions[r] = [u for u, s in enumerate(senders) if s == self.rank]
                peer_slots[r] = _ce.receive_slots(len(senders), rec["buffers"])
        packed = 0
        for msg in self._ce_sends():
            j = sent.get(msg.rank, 0)
            sent[msg.rank] = j + 1
            slot = peer_slots[msg.rank][positions[msg.rank][j]]
            peer_base, peer_layout = link.peers[msg.rank]
            msg.slot = slot
            remote = peer_base + peer_layout.buffer(slot.buffer)
            msg.filled_flag = peer_base + peer_layout.filled(slot.buffer)
            msg.free_flag = base + layout.free(msg.rank, slot.buffer)
            if self._direct(msg):
                msg.buffer = -1
                src, off, n = self._direct_source(msg)
                msg.src, msg.dst, msg.nbytes = src.data_ptr(), remote + off, n
            else:
                msg.buffer = packed % count
                packed += 1
                _bind(msg, sbufs[msg.buffer], 0)
                msg.src, msg.dst, msg.nbytes = msg.wire.data_ptr(), remote, msg.length
        self._ce_events = ([None] * count, [None] * count)
        self._buffers = (sbufs, rbufs)

    def _run_ce(self, cur):
        """One run over the copy engine: the host enqueues everything, the streams order
        themselves with the flags (see ``streamalloc._ce``). Each round's send is enqueued
        before its receive, so every wait depends only on work enqueued earlier (the
        no-deadlock argument in ``streamalloc._ce``). The loop is the host's whole cost of
        a run, so it switches PyTorch's current stream with ``set_stream`` rather than
        stream contexts and calls the driver directly."""
        import torch

        d = _ce.driver()
        run = self._runs
        self._runs += 1
        pack, copy, unpack = self._pack_stream, self._copy_stream, self._unpack_stream
        for s in (pack, copy, unpack):
            s.wait_stream(cur)
        cs, us = copy.cuda_stream, unpack.cuda_stream
        memcpy, write, wait = d._memcpy, d._write32, d._wait32
        geq, wait_flags = _ce.CU_STREAM_WAIT_VALUE_GEQ, self._link.wait_flags
        set_stream = torch.cuda.set_stream
        # Per send buffer, one event object each for "packed" and "copied out", recorded
        # again every use rather than created per round (a new event costs more host time
        # than the driver calls of a round); ``copied[b]``: buffer b was copied out in this
        # run, so packing into it again waits for that.
        packed_events, copied_events = self._ce_events
        copied = [False] * len(self._buffers[0])
        active = None
        try:
            for send, recv in self._rounds:
                if send is not None:
                    slot = send.slot
                    if send.buffer >= 0:
                        if active is not pack:
                            set_stream(pack)
                            active = pack
                        b = send.buffer
                        if copied[b]:
                            pack.wait_event(copied_events[b])
                        _pack(send)
                        packed_events[b] = pack.record_event(packed_events[b])
                        copy.wait_event(packed_events[b])
                    rc = (wait(cs, send.free_flag, slot.free_wait(run), geq)
                          or memcpy(send.dst, send.src, send.nbytes, cs)
                          or write(cs, send.filled_flag, slot.seq(run), 0))
                    if rc:
                        d.check(rc, "enqueueing a copy-engine send")
                    if send.buffer >= 0:
                        copied_events[send.buffer] = copy.record_event(copied_events[send.buffer])
                        copied[send.buffer] = True
                if recv is not None:
                    seq = recv.slot.seq(run)
                    rc = wait(us, recv.filled_flag, seq, wait_flags)
                    if rc:
                        d.check(rc, "cuStreamWaitValue32")
                    if recv.unpack_dst:
                        # One tensor (or one piece of one): a driver copy, a few µs of host
                        # time, where PyTorch's copy_ and a stream switch cost several times
                        # that; with parameter-sized tensors most rounds are such rounds.
                        rc = memcpy(recv.unpack_dst, recv.unpack_src, recv.nbytes, us)
                        if rc:
                            d.check(rc, "enqueueing a copy-engine unpack")
                    else:
                        if active is not unpack:
                            set_stream(unpack)
                            active = unpack
                        _unpack(recv)
                    rc = write(us, recv.free_flag, seq, 0)
                    if rc:
                        d.check(rc, "cuStreamWriteValue32")
        finally:
            set_stream(cur)
        for s in (pack, copy, unpack):
            cur.wait_stream(s)

    def _rebind(self, send_lists, recv_lists):
        """Points the agreed plan at new tensors of the same shapes, dtypes and order (the
        drop-in's cached plans): ``lists[peer]`` of 1-D contiguous tensors. Costs a few
        slices per message, not per tensor: staging buffers and their views stay as they
        are."""
        lists = (send_lists, recv_lists)
        ce = self.transport == "ce" and self._buffers is not None
        for pair in self._rounds:
            for msg in pair:
                if msg is None:
                    continue
                if msg.zero_copy_source is not None:
                    d, p, i = msg.zero_copy_source
                    msg.zero_copy = _bytes_view(lists[d][p][i])
                for run in msg.runs:
                    d, p, first = run.source
                    run.tensors = lists[d][p][first:first + len(run.tensors)]
                if msg.piece_sources:
                    msg.pieces = [(_bytes_view(lists[d][p][i])[o:o + n], b, n)
                                  for (d, p, i, o), (_, b, n) in zip(msg.piece_sources,
                                                                     msg.pieces)]
                if ce and msg is pair[0] and msg.buffer < 0:
                    msg.src = self._direct_source(msg)[0].data_ptr()
                if ce and msg is pair[1] and msg.unpack_dst:
                    msg.unpack_dst = self._direct_source(msg)[0].data_ptr()
        self._self_copies = (list(recv_lists[self.rank]), list(send_lists[self.rank]))

    def release(self):
        """Returns the staging buffers (kept between runs otherwise; at most the budget).
        With the copy-engine transport a collective: peers write into this rank's memory
        until they are done, so every rank waits for every rank before letting go."""
        link = self._link
        if link is not None:
            for s in (self._pack_stream, self._copy_stream, self._unpack_stream):
                s.synchronize()
        # Local buffers go first: the barrier below (an all-gather through device memory)
        # then allocates on top of the shared region alone, not of all the staging.
        self._buffers = None
        for pair in self._rounds:
            for msg in pair:
                if msg is not None:
                    msg.wire = None
                    msg.staged = None
                    for run in msg.runs:
                        run.view = run.parts = None
        if link is not None:
            self._release_ce()

    def _release_ce(self):
        self._barrier()  # every rank's copies into this rank's region are done
        link, self._link = self._link, None
        try:
            self._unlink(link)
        except _ce.CeError as err:
            raise P2PError(f"p2p transport 'ce': {err}") from None

    def _unlink(self, link):
        """A collective: unmaps the peers' regions, then, once every rank has, frees this
        rank's (freeing memory a peer still maps is undefined in CUDA)."""
        try:
            link.close()
        finally:
            self._barrier()
            link.free()

    def _barrier(self):
        import torch.distributed as dist

        done = [None] * self.world
        dist.all_gather_object(done, True, group=self._group)  # host-blocking

    def run(self) -> dict:
        """Moves the bytes. Returns the plan's figures for this rank."""
        import torch

        # Parameters and other leaves that require grad are moved as ``p.data`` would be:
        # packing with ``out=`` and unpacking in place are not differentiable operations.
        with torch.no_grad():
            return self._run()

    def _run(self) -> dict:
        import torch
        import torch.distributed as dist

        dst, src = self._self_copies
        if dst:
            torch._foreach_copy_(dst, src)
        if not self._rounds and (self.transport != "ce" or not self.summary["rounds"]):
            return dict(self.summary)
        if self.transport == "ce":
            if self._link is None:  # after release(): map the peers again (collective)
                self._runs = 0
                failure = self._establish_ce(_ce.probe(self.device))
                if failure is not None:
                    raise P2PError(f"p2p transport 'ce' failed: {failure}")
            if self._buffers is None:
                self._setup_buffers()
            with torch.cuda.device(self.device):
                self._run_ce(torch.cuda.current_stream(self.device))
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


def _bind(msg, buf, direction):
    """Caches the views of staging buffer ``buf`` that packing or unpacking ``msg`` uses."""
    import torch

    msg.wire = buf[:msg.length]
    for run in msg.runs:
        run.view = buf[run.start:run.end].view(run.dtype)
        if direction == 1 and len(run.tensors) > 1:
            run.parts = list(torch.split(run.view, run.numels))
    msg.staged = [buf[o:o + n] for _, o, n in msg.pieces]


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


def exchange(sends: dict, recvs: dict, budget_mib: float = 128, group=None,
             transport: str = "nccl", **options) -> dict:
    """Sends ``sends[peer]`` to each peer and fills ``recvs[peer]`` from each, through at
    most ``budget_mib`` of staging memory. A collective: every rank of ``group`` calls it.
    Returns this rank's plan figures (rounds, max ops per group, bytes moved, buffers).

    One call sets everything up and tears it down, so its transport defaults to
    ``"nccl"``: the copy engine's IPC mapping and collective release cost more than they
    save in one run (``benches/gpu/p2p/RESULTS.md``). To move the same tensors again, keep
    an :class:`Exchange` (default ``transport="auto"``)."""
    ex = Exchange(sends, recvs, budget_mib=budget_mib, group=group, transport=transport,
                  **options)
    try:
        return ex.run()
    finally:
        ex.release()


# ---- The drop-in for torch.distributed.batch_isend_irecv ----
#
# Users already write lists of ``torch.distributed.P2POp``. The drop-in turns such a list into
# per-peer lists (the k-th isend to B is B's k-th irecv from this rank, as NCCL matches them)
# and runs them through an :class:`Exchange`. The expensive part of an exchange is agreeing on
# it (gathering descriptions, planning, mapping the copy engine's buffers), so the agreed
# exchange is cached by the shape of every rank's list: a loop that sends the same shapes every
# step agrees once. What remains per call is one pass over the list (it has to be read), one
# 8-byte all-gather of each rank's shape digest on a host-side group (so a changed list on
# any rank sends every rank back to agreement together, never one rank into a collective the
# others skip) and rebinding the plan to the new tensors (a few slices per message).

_EMPTY_DIGEST = 0  # a rank with nothing to send or receive
_FAILED_DIGEST = -1  # a rank whose list is invalid: every rank then raises its message
_CACHED_EXCHANGES = 8  # agreed exchanges kept per group (each holds its staging buffers)


class _Work:
    """One handle for the whole batch. ``wait()`` makes the caller's current stream wait for
    the exchange (on the device: the host does not block), as NCCL's works do."""

    def __init__(self, event, device):
        self._event = event
        self._device = device

    def wait(self, timeout=None) -> bool:
        if self._event is not None:
            import torch

            torch.cuda.current_stream(self._device).wait_event(self._event)
        return True

    def is_completed(self) -> bool:
        return self._event is None or self._event.query()

    def is_success(self) -> bool:
        return True

    def exception(self):
        return None

    def synchronize(self) -> None:
        if self._event is not None:
            self._event.synchronize()

    def result(self) -> list:
        return []


@dataclass
class _Translated:
    """A P2POp list read once: per-peer lists (group ranks) and the list's shape, one entry
    per op in list order: ``keys`` (peer * 2 + 1 for a receive), ``nbytes``, ``dtypes``."""
    send_lists: list
    recv_lists: list
    keys: list
    nbytes: list
    dtypes: list
    device: object

    @property
    def signature(self) -> list:
        """(key, bytes, dtype code) per op, flattened."""
        return [v for k, n, d in zip(self.keys, self.nbytes, self.dtypes)
                for v in (k, n, dtype_code(d))]


def _op_direction(n, fn, isend, irecv) -> int:
    """0 for a send, 1 for a receive: the functions of torch.distributed, or anything named
    ``isend``/``irecv`` (``P2POp`` checks the same)."""
    if fn is isend:
        return 0
    if fn is irecv:
        return 1
    name = getattr(fn, "__name__", None)
    if name == "isend":
        return 0
    if name == "irecv":
        return 1
    raise P2PError(f"op {n}: P2POp.op must be torch.distributed.isend or irecv, not {fn!r}")


def translate_ops(ops, rank: int, world: int, group_rank=None, isend=None, irecv=None):
    """Reads a P2POp list (objects with ``op``, ``tensor`` and ``peer``, and ``group_peer``
    where PyTorch has it; ``group_rank`` maps ``peer``, a global rank, to the group's rank)
    into per-peer lists in list order. Ops to and from this rank itself are kept (NCCL runs
    them too): the k-th isend to itself is copied into the k-th irecv from itself, which
    must match it like any pair's. Raises :class:`P2PError` naming the first bad operation.
    Pure Python: works on any objects with those fields and tensor methods
    (``is_contiguous``, ``get_device``, ``dim``, ``view``, ``nbytes``, ``dtype``).

    This runs on every call of the drop-in, over every op: one plain loop with everything it
    touches bound to locals. (Reading each field of the whole list with ``map`` was measured
    slower: five passes over the tensors cost more than one.)"""
    send_lists = [[] for _ in range(world)]
    recv_lists = [[] for _ in range(world)]
    keys, nbytes, dtypes = [], [], []
    add_key, add_nbytes, add_dtype = keys.append, nbytes.append, dtypes.append
    # appends[peer * 2 + direction]: where an op's tensor goes.
    appends = [f for s, r in zip(send_lists, recv_lists) for f in (s.append, r.append)]
    device_index, device = None, None
    group_ranks = {}  # peer as the op names it -> the group's rank
    for n, op in enumerate(ops):
        fn = op.op
        if fn is isend:
            direction = 0
        elif fn is irecv:
            direction = 1
        else:
            direction = _op_direction(n, fn, isend, irecv)
        peer = op.peer
        p = group_ranks.get(peer)
        if p is None:
            p = group_ranks[peer] = _group_rank(n, op, peer, world, group_rank)
        t = op.tensor
        if not t.is_contiguous():
            raise P2PError(f"op {n} (peer {peer}): the tensor is not contiguous; pass "
                           "t.contiguous() and copy the result back after wait()")
        index = t.get_device()
        if index != device_index:
            if device_index is not None:
                raise P2PError(f"op {n} (peer {peer}): the tensor is on {t.device}, the "
                               f"first op's is on {device}; use one device")
            device_index, device = index, t.device
        key = p * 2 + direction
        appends[key](t if t.dim() == 1 else t.view(-1))
        add_key(key)
        add_nbytes(t.nbytes)
        add_dtype(t.dtype)
    return _Translated(send_lists, recv_lists, keys, nbytes, dtypes, device)


def _group_rank(n, op, peer, world, group_rank) -> int:
    # PyTorch's P2POp carries the group rank as ``group_peer`` (2.6 and later).
    p = getattr(op, "group_peer", None)
    if p is None:
        p = peer
        if group_rank is not None and isinstance(peer, int) and peer >= 0:
            try:
                p = group_rank(peer)
            except (ValueError, RuntimeError):
                p = None
    if not isinstance(p, int) or not 0 <= p < world:
        raise P2PError(f"op {n}: peer {peer!r} is not a rank of the group (0..{world - 1})")
    return p


def signature_digest(translated: _Translated, budget_bytes: int, transport: str = "auto") -> int:
    """A 62-bit digest of a list's shape (peers, directions, sizes, dtypes, order), the
    budget and the transport asked for, never :data:`_EMPTY_DIGEST` or
    :data:`_FAILED_DIGEST`; an empty list with any budget is :data:`_EMPTY_DIGEST`.

    Only this process compares it, with its own earlier digests (the key of the cached
    exchanges, gathered from every rank), so Python's own tuple hash serves: stable within a
    process, 64 bits, and about ten times cheaper than a cryptographic hash of the packed
    columns (1 ms against 12 ms at 58,000 ops). The options are in it so that a rank that
    changes them alone misses the cache with every other rank (and the agreement then names
    the difference), instead of running a cached exchange the others have left."""
    if not translated.keys:
        return _EMPTY_DIGEST
    digest = hash((tuple(translated.keys), tuple(translated.nbytes), tuple(translated.dtypes),
                   budget_bytes, transport))
    return (digest & (2**62 - 1)) or 1


class _GroupState:
    """Per process group: the host-side group that gathers digests and the cached
    exchanges (the same entries, added and evicted in the same order, on every rank)."""

    def __init__(self, group):
        import torch.distributed as dist

        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.exchanges = {}  # (digests, budget, transport) -> Exchange, oldest first
        self.active = None  # the key of the one exchange holding staging memory
        self.check_group, self.check_device = self._check_group(group)

    @staticmethod
    def _check_group(group):
        """A gloo group over the same ranks, so gathering digests costs no device sync;
        the group itself where it is already gloo or gloo is missing."""
        import torch
        import torch.distributed as dist

        backend = str(dist.get_backend(group)).lower()
        if "gloo" in backend and "nccl" not in backend:
            return group, torch.device("cpu")
        if dist.is_gloo_available():
            ranks = dist.get_process_group_ranks(group if group is not None
                                                 else dist.group.WORLD)
            gloo = dist.new_group(ranks=ranks, backend="gloo", use_local_synchronization=True)
            return gloo, torch.device("cpu")
        return group, torch.device("cuda", torch.cuda.current_device())

    def gather_digests(self, digest: int) -> tuple:
        import torch
        import torch.distributed as dist

        mine = torch.tensor([digest], dtype=torch.int64, device=self.check_device)
        everyone = [torch.empty_like(mine) for _ in range(self.world)]
        dist.all_gather(everyone, mine, group=self.check_group)
        return tuple(int(t.item()) for t in everyone)


_GROUPS: dict = {}


def batch_isend_irecv(p2p_op_list, group=None, budget_mib: float = 128, *,
                      transport: str = "auto"):
    """:func:`torch.distributed.batch_isend_irecv` through a bounded staging exchange: the
    same list of ``P2POp``, any number of them, at most ``budget_mib`` of staging memory per
    rank. Returns a list of works whose ``wait()`` orders the caller's current stream after
    the received data has landed.

    A collective: every rank of ``group`` (default: the ops' group, else the world) calls
    it, including ranks with an empty list. Sends and receives between two ranks match in
    order, as NCCL's do: the k-th isend from A to B fills the k-th irecv on B from A, so
    both must have the same size and dtype; a rank's ops to itself are copied, in the same
    order. Invalid lists (a peer out of range, a non-contiguous tensor, several devices, an
    op that is not isend or irecv) and lists that do not match across ranks (counts, sizes
    or dtypes, a self-send without its receive included) raise the same :class:`P2PError`
    on every rank instead of hanging.

    The exchange agreed for one set of shapes is kept (``_CACHED_EXCHANGES`` per group,
    with their staging buffers): a loop sending the same shapes every step agrees on the
    first step only. ``transport`` is :class:`Exchange`'s."""
    import torch
    import torch.distributed as dist

    ops = list(p2p_op_list)
    world_group = dist.group.WORLD
    if group is None and ops:
        group = getattr(ops[0], "group", None)
    if group is world_group:
        group = None  # one state, and one digest group, for the world however it is named
    state = _GROUPS.get(group)
    if state is None:
        state = _GROUPS[group] = _GroupState(group)
    rank, world = state.rank, state.world
    budget = int(budget_mib * 2**20)
    error = None
    try:
        if budget_mib <= 0:
            raise P2PError(f"budget_mib must be positive (got {budget_mib})")
        own = (None, world_group) if group is None else (group,)
        if any(getattr(op, "group", None) not in own for op in ops):
            raise P2PError("the P2POp list mixes process groups; pass one group's ops")
        group_rank = None if group is None else (lambda p: dist.get_group_rank(group, p))
        ops_in = translate_ops(ops, rank, world, group_rank, dist.isend, dist.irecv)
        digest = signature_digest(ops_in, budget, transport)
    except P2PError as err:
        error, digest = str(err), _FAILED_DIGEST
    digests = state.gather_digests(digest)
    if _FAILED_DIGEST in digests:
        messages = [None] * world
        dist.all_gather_object(messages, error, group=group)
        failed = "; ".join(f"rank {r}: {m}" for r, m in enumerate(messages) if m is not None)
        raise P2PError(f"batch_isend_irecv: invalid P2POp list ({failed})")
    if all(d == _EMPTY_DIGEST for d in digests):
        return []
    key = (digests, budget, transport)
    # Only one cached exchange holds staging at a time, so staging never exceeds the budget
    # however many shapes are cached; switching shapes costs a new allocation (and, over the
    # copy engine, mapping the peers' buffers again), not a new agreement. Every rank sees
    # the same keys in the same order, so the releases (collectives over the copy engine)
    # happen at the same call everywhere.
    if state.active is not None and state.active != key and state.active in state.exchanges:
        state.exchanges[state.active].release()
    state.active = key
    exchange_ = state.exchanges.get(key)
    if exchange_ is None:
        if len(state.exchanges) >= _CACHED_EXCHANGES:  # the same eviction on every rank
            state.exchanges.pop(next(iter(state.exchanges))).release()
        sends = {p: ts for p, ts in enumerate(ops_in.send_lists) if ts}
        recvs = {p: ts for p, ts in enumerate(ops_in.recv_lists) if ts}
        exchange_ = Exchange(sends, recvs, budget_mib=budget_mib, group=group,
                             transport=transport, _translated=ops_in)
        state.exchanges[key] = exchange_
    else:
        exchange_._rebind(ops_in.send_lists, ops_in.recv_lists)
    exchange_.run()
    device = exchange_.device
    if device.type != "cuda":
        return [_Work(None, device)]
    return [_Work(torch.cuda.current_stream(device).record_event(), device)]
