"""The drop-in for ``torch.distributed.batch_isend_irecv``.

Users already write lists of ``torch.distributed.P2POp``. The drop-in reads such a list into
per-peer lists (the k-th isend to B is B's k-th irecv from this rank, as NCCL matches them)
and runs them through an :class:`~streamalloc.p2p.Exchange`. Agreeing on an exchange
(gathering descriptions, planning, mapping the copy engine's buffers) is the expensive
part, so agreed exchanges are cached by the shape of every rank's list, and a call whose
shapes were seen before pays only: reading its list (native code where it can be built,
``_p2p_native``), one 8-byte all-gather of each rank's shape digest on a host-side group
(so that a changed list on any rank sends every rank back to agreement together, never one
rank into a collective the others skip), rebinding the plan's copy table to the new tensors,
and the run.

The shape is what the exchange means: per peer and direction, the sequence of sizes and
dtypes. The order in which the ops of different peers interleave carries no meaning (callers
build their lists in whatever order they iterate, often shuffled), so it is not in the key.
"""

from __future__ import annotations

from . import _p2p_checks as checks
from . import _p2p_native
from ._p2p_exchange import Exchange
from ._p2p_plan import P2PError

_EMPTY_DIGEST = 0  # a rank with nothing to send or receive
_FAILED_DIGEST = -1  # a rank whose input is invalid: every rank then raises its message
_CACHED_EXCHANGES = 8  # agreed exchanges kept per group (one holds staging at a time)


#: Op lists of works dropped before ``wait()`` while their exchange may still be running on
#: the device, with the event that marks its end: their tensors must not go back to the
#: allocator (and be reused on the caller's stream) before the exchange is done with them.
#: Pruned at every call, once each event has completed.
_IN_FLIGHT: list = []


def _prune_in_flight() -> None:
    _IN_FLIGHT[:] = [(event, ops) for event, ops in _IN_FLIGHT if not event.query()]


class _Work:
    """One handle for the whole batch. ``wait()`` makes the caller's current stream wait for
    the exchange (on the device: the host does not block), as NCCL's works do. It holds the
    op list, so the tensors live as long as the handle; a handle dropped before ``wait()``
    hands them to ``_IN_FLIGHT`` until the exchange is done with them, as PyTorch keeps a
    work's tensors until it is waited for. (The cached exchange itself keeps none.)"""

    def __init__(self, event, device, ops):
        self._event = event
        self._device = device
        self._ops = ops
        self._waited = False

    def wait(self, timeout=None) -> bool:
        if self._event is not None:
            import torch

            torch.cuda.current_stream(self._device).wait_event(self._event)
            self._waited = True
        return True

    def __del__(self):
        try:
            if not self._waited and not self.is_completed():
                _IN_FLIGHT.append((self._event, self._ops))
        except Exception:  # interpreter shutdown: nothing left to protect
            pass

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


def signature_digest(lanes, budget_bytes: int, transport: str = "auto") -> int:
    """A 62-bit digest of a list's shape: per lane (peer and direction) the sequence of
    sizes and dtypes; the budget and the transport asked for. Never :data:`_EMPTY_DIGEST`
    or :data:`_FAILED_DIGEST`; a list with no op is :data:`_EMPTY_DIGEST`.

    The lanes are lane-major (``streamalloc._p2p_plan.Lanes``), so any interleaving of the
    peers' ops gives the same columns. Only this process compares the digest, with its own
    earlier ones (the key of the cached exchanges, gathered from every rank), so Python's
    hash of the packed columns serves. The options are in it so that a rank that changes
    them alone misses the cache with every other rank (and the agreement then names the
    difference), instead of running a cached exchange the others have left."""
    if not lanes.tensors:
        return _EMPTY_DIGEST
    digest = hash((tuple(lanes.counts), lanes.nbytes.tobytes(), lanes.codes.tobytes(),
                   budget_bytes, transport))
    return (digest & (2**62 - 1)) or 1


class _GroupState:
    """Per process group: the host-side group that gathers digests and the cached
    exchanges (the same entries, added and evicted in the same order, on every rank)."""

    def __init__(self, group):
        import torch
        import torch.distributed as dist

        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.exchanges = {}  # (digests, budget, transport) -> Exchange, oldest first
        self.active = None  # the key of the one exchange holding staging memory
        self.check_group = checks.host_group(group)
        backend = str(dist.get_backend(self.check_group)).lower()
        self.check_device = (torch.device("cpu") if "gloo" in backend else
                             torch.device("cuda", torch.cuda.current_device()))

    def gather_digests(self, digest: int) -> tuple:
        import torch
        import torch.distributed as dist

        mine = torch.tensor([digest], dtype=torch.int64, device=self.check_device)
        everyone = [torch.empty_like(mine) for _ in range(self.world)]
        dist.all_gather(everyone, mine, group=self.check_group)
        return tuple(torch.cat(everyone).tolist())


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
    order. Invalid input on any rank (an element that is not a ``P2POp``, a tensor that is
    None or not contiguous, several devices, a peer out of range, an op that is not isend
    or irecv, a budget that is not a finite positive number of MiB) and lists that do not
    match across ranks raise the same :class:`P2PError` on every rank instead of hanging.

    The exchange agreed for one shape is kept (``_CACHED_EXCHANGES`` per group, one holding
    staging at a time): a loop sending the same shapes every step agrees on the first step
    only, whatever order it lists its ops in. It keeps none of the caller's tensors: the
    works hold them (see :class:`_Work`). ``transport`` is :class:`Exchange`'s."""
    import torch
    import torch.distributed as dist

    error = None
    try:
        ops = list(p2p_op_list)
    except Exception as err:  # not iterable: refused below, with every rank
        ops, error = [], checks.message_of(err)
    world_group = dist.group.WORLD
    if group is None and ops:
        group = getattr(ops[0], "group", None)
    if group is world_group:
        group = None  # one state, and one digest group, for the world however it is named
    state = _GROUPS.get(group)
    if state is None:
        state = _GROUPS[group] = _GroupState(group)
    rank, world = state.rank, state.world
    digest = _FAILED_DIGEST
    if error is None:
        try:
            budget = checks.budget_bytes(budget_mib)
            checks.check_options(1, None, transport)
            group_rank = None if group is None else (lambda p: dist.get_group_rank(group, p))
            own = (None, world_group) if group is None else (group,)
            lanes = _p2p_native.read_ops(ops, rank, world, group_rank, dist.isend, dist.irecv,
                                         groups=own)
            digest = signature_digest(lanes, budget, transport)
        except Exception as err:  # any type: it must reach the agreement
            error = checks.message_of(err)
    digests = state.gather_digests(digest)
    if _FAILED_DIGEST in digests:
        messages = checks.gather(error, group, world)
        failed = "; ".join(f"rank {r}: {m}" for r, m in enumerate(messages) if m is not None)
        raise P2PError(f"batch_isend_irecv: invalid input ({failed})")
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
        exchange_ = Exchange(None, None, budget_mib=budget_mib, group=group,
                             transport=transport, _lanes=lanes)
        state.exchanges[key] = exchange_
    else:
        exchange_._rebind(lanes)
    try:
        exchange_.run()
    finally:
        # The works hold the tensors from here on (the exchange keeps none of a caller's).
        exchange_._unbind()
    device = exchange_.device
    if device.type != "cuda":
        return [_Work(None, device, ops)]
    work = _Work(torch.cuda.current_stream(device).record_event(), device, ops)
    # Tensors of earlier calls whose works were dropped unwaited go back once their exchange
    # is done; after this call's device work is queued, so that freeing them overlaps it.
    _prune_in_flight()
    return [work]
