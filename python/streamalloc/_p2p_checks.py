"""Checking what a rank was handed, and agreeing on the verdict, before any data moves.

Why a module of its own: an exchange is a collective, so a rank that refuses its input alone
leaves the others waiting in the next collective. Every check here runs before the first
collective of an exchange, any exception it meets (of any type) becomes a message, and the
messages travel with the first all-gather, so every rank raises the same
:class:`~streamalloc.p2p.P2PError`.

The gathers go over a host-side (gloo) group beside the caller's: they move a few bytes to
a few hundred kilobytes of Python objects, and over NCCL each would cost device copies and
a synchronisation of the caller's stream.

This module imports torch only where a tensor is checked; reading a ``P2POp`` list
(:func:`translate_ops`) works on any objects with the same fields, which is how
``benches/gpu/p2p/dropin_unit_check.py`` checks it without torch.
"""

from __future__ import annotations

import array
import math
import numbers

from . import _ce
from ._p2p_plan import P2PError, Lanes, dtype_code

MAX_BUDGET_BYTES = 1 << 62


def message_of(err: BaseException) -> str:
    """One line for an exception met while checking: a :class:`P2PError`'s own message,
    anything else with its type (it is a bug in the caller's input we did not foresee)."""
    if isinstance(err, P2PError):
        return str(err)
    return f"{type(err).__name__}: {err}"


def budget_bytes(budget_mib) -> int:
    """``budget_mib`` in bytes: a finite, positive number of MiB (not a bool or a string)."""
    if isinstance(budget_mib, bool) or not isinstance(budget_mib, numbers.Real):
        raise P2PError(f"budget_mib must be a number of MiB, not {type(budget_mib).__name__} "
                       f"{budget_mib!r}")
    value = float(budget_mib)
    if not math.isfinite(value) or value <= 0:
        raise P2PError(f"budget_mib must be finite and positive (got {budget_mib!r})")
    nbytes = int(value * 2**20)
    if not 0 < nbytes < MAX_BUDGET_BYTES:
        raise P2PError(f"budget_mib of {budget_mib!r} is outside 1 byte .. 2^62 bytes")
    return nbytes


def check_options(rounds_per_group, zero_copy_min, transport) -> None:
    if isinstance(rounds_per_group, bool) or not isinstance(rounds_per_group, int) \
            or rounds_per_group < 1:
        raise P2PError(f"rounds_per_group must be an integer of at least 1 (got "
                       f"{rounds_per_group!r})")
    if zero_copy_min is not None and (isinstance(zero_copy_min, bool)
                                      or not isinstance(zero_copy_min, int)
                                      or not 0 < zero_copy_min < MAX_BUDGET_BYTES):
        raise P2PError(f"zero_copy_min must be None or a positive number of bytes (got "
                       f"{zero_copy_min!r})")
    if not isinstance(transport, str) or transport not in _ce.TRANSPORTS:
        raise P2PError(f"transport must be one of {', '.join(_ce.TRANSPORTS)} (got "
                       f"{transport!r})")


def peer_lists(mapping, world: int, name: str, tensors: bool = True) -> list:
    """``mapping`` ({peer: [tensors]}, or None) as one list per peer, each tensor checked:
    a ``torch.Tensor``, contiguous; parameters detached (the exchange moves their data, as
    ``p.data`` would). With ``tensors=False`` only the mapping's shape is checked and each
    peer's list is returned as given (the native reader checks the tensors)."""
    import torch

    lists = [[] for _ in range(world)]
    if mapping is None:
        return lists
    if not hasattr(mapping, "items"):
        raise P2PError(f"{name} must be a dict {{peer: [tensors]}}, not "
                       f"{type(mapping).__name__}")
    for peer, ts in mapping.items():
        if isinstance(peer, bool) or not isinstance(peer, int) or not 0 <= peer < world:
            raise P2PError(f"{name}: peer {peer!r} is not a rank in 0..{world - 1}")
        if isinstance(ts, torch.Tensor) or not isinstance(ts, (list, tuple)):
            raise P2PError(f"{name}[{peer}] must be a list of tensors, not "
                           f"{type(ts).__name__} (wrap one tensor as [t])")
        if not tensors:
            lists[peer] = ts
            continue
        for i, t in enumerate(ts):
            if not isinstance(t, torch.Tensor):
                raise P2PError(f"{name}[{peer}][{i}] is {type(t).__name__}, not a torch.Tensor")
            if not t.is_contiguous():
                raise P2PError(f"{name}[{peer}][{i}] is not contiguous; pass t.contiguous()")
        lists[peer] = [t.detach() if t.requires_grad else t for t in ts]
    return lists


def one_device(*sides):
    """The device every tensor is on (None without tensors); several is a P2PError."""
    devices = {}
    for lists in sides:
        for ts in lists:
            for t in ts:
                devices.setdefault(t.get_device(), t.device)
    if len(devices) > 1:
        names = ", ".join("cpu" if d < 0 else f"cuda:{d}" for d in sorted(devices))
        raise P2PError(f"tensors are on several devices ({names}); use one")
    return next(iter(devices.values()), None)


# ---- Reading a P2POp list ----

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
    if isinstance(p, bool) or not isinstance(p, int) or not 0 <= p < world:
        raise P2PError(f"op {n}: peer {peer!r} is not a rank of the group (0..{world - 1})")
    return p


def translate_ops(ops, rank: int, world: int, group_rank=None, isend=None, irecv=None,
                  addresses: bool = False, groups=None) -> Lanes:
    """Reads a P2POp list into :class:`Lanes`: each op's tensor goes to lane
    ``direction * world + peer`` (group ranks; ``group_rank`` maps ``peer``, a global rank,
    where ``group_peer`` is missing), in list order within the lane. Ops to and from this
    rank itself are kept (NCCL runs them too): the k-th isend to itself is copied into the
    k-th irecv from itself. Raises :class:`P2PError` naming the first bad op: not a
    ``P2POp``, an op that is not isend or irecv, a peer out of range, a tensor that is None
    or not contiguous, tensors on several devices, and with ``groups`` (the objects that
    name the caller's group) an op whose ``group`` is none of them. With ``addresses``: the
    tensors' data addresses too (the copy kernel's tables).

    The pure-Python reader, where the native one (``_p2p_native``) cannot be had: one plain
    loop with everything it touches bound to locals."""
    lanes = [[] for _ in range(2 * world)]
    appends = [lane.append for lane in lanes]
    device_index, device = None, None
    group_ranks = {}  # peer as the op names it -> the group's rank
    for n, op in enumerate(ops):
        try:
            fn, peer, t = op.op, op.peer, op.tensor
        except AttributeError:
            raise P2PError(f"op {n} is a {type(op).__name__}, not a torch.distributed.P2POp") \
                from None
        if groups is not None and getattr(op, "group", None) not in groups:
            raise P2PError("the P2POp list mixes process groups; pass one group's ops")
        if fn is isend:
            direction = 0
        elif fn is irecv:
            direction = 1
        else:
            direction = _op_direction(n, fn, isend, irecv)
        p = group_ranks.get(peer) if isinstance(peer, int) else None
        if p is None:
            p = _group_rank(n, op, peer, world, group_rank)
            if isinstance(peer, int):
                group_ranks[peer] = p
        if t is None or not hasattr(t, "is_contiguous"):
            raise P2PError(f"op {n} (peer {peer}): the tensor is {type(t).__name__}, not a "
                           "torch.Tensor")
        if not t.is_contiguous():
            raise P2PError(f"op {n} (peer {peer}): the tensor is not contiguous; pass "
                           "t.contiguous() and copy the result back after wait()")
        index = t.get_device()
        if index != device_index or (index < 0 and t.device != device):  # cpu vs meta: -1
            if device_index is not None:
                raise P2PError(f"op {n} (peer {peer}): the tensor is on {t.device}, the "
                               f"first op's is on {device}; use one device")
            device_index, device = index, t.device
        appends[direction * world + p](t)
    tensors = [t for lane in lanes for t in lane]
    out = Lanes(world, [len(lane) for lane in lanes], tensors,
                array.array("q", [t.nbytes for t in tensors]),
                array.array("q", [dtype_code(t.dtype) for t in tensors]), device)
    if addresses:
        out.addresses = array.array("q", [t.data_ptr() for t in tensors])
    return out


# ---- Host-side gathers ----

_HOST_GROUPS: dict = {}


def host_group(group):
    """A gloo group over ``group``'s ranks (``group`` itself where it is gloo already, or
    where gloo is missing). Made once per group: a collective, on first use."""
    import torch.distributed as dist

    key = None if group is None or group is dist.group.WORLD else group
    cached = _HOST_GROUPS.get(key)
    if cached is not None:
        return cached
    backend = str(dist.get_backend(group)).lower()
    if ("gloo" in backend and "nccl" not in backend) or not dist.is_gloo_available():
        out = group
    else:
        ranks = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
        out = dist.new_group(ranks=ranks, backend="gloo", use_local_synchronization=True)
    _HOST_GROUPS[key] = out
    return out


def gather(obj, group, world: int) -> list:
    """Every rank's ``obj`` (a Python object), through :func:`host_group`."""
    import torch.distributed as dist

    out = [None] * world
    dist.all_gather_object(out, obj, group=host_group(group))
    return out


def refusals(gathered_errors) -> str | None:
    """The one message every rank raises when some ranks refused their input (None when
    none did): each refusing rank and its reason, in rank order."""
    failed = [(r, e) for r, e in enumerate(gathered_errors) if e is not None]
    if not failed:
        return None
    return "; ".join(f"rank {r} cannot take part in the p2p exchange: {e}" for r, e in failed)
