"""Many-tensor point-to-point exchange through a bounded staging pool.

``exchange(sends={peer: [tensors]}, recvs={peer: [tensors]}, budget_mib=128)`` moves any
number of tensors (any dtype, shape and count; empty lists fine) between the ranks of a
``torch.distributed`` job without one NCCL operation per tensor (slow, and it can hang
across nodes) and without one concatenated buffer per peer (doubles memory):

1. every rank checks what it was handed and all-gathers a compact description of its lists
   (bytes and dtype per tensor) with its verdict: a refusal on any rank is the same
   :class:`P2PError` on every rank, before any data moves;
2. every rank plans with the Rust planner in ``libstreamalloc.so`` (the same code the CI
   tests: ``p2p/src/staging/plan.rs``): rounds in which each rank exchanges at most
   one message with one partner (circle-method pairing), small tensors packed into staging
   buffers, tensors larger than the room left split;
3. every rank all-gathers the plan digest: a mismatch in sizes, dtypes or counts, or a
   different budget, raises the same :class:`P2PError` on every rank;
4. per round: pack (one launch of a copy kernel over a table of pieces, see
   ``_p2p_copy``), move, unpack (one launch) on streams of their own, staging buffers
   rotating so that packing round k+1 and unpacking round k-1 overlap moving round k.

The ``"nccl"`` transport moves a round with one ``batch_isend_irecv`` group of the process
group's backend (gloo on CPU). When every rank of the group is on one host and the GPUs have
peer access, the ``"ce"`` transport (``streamalloc._ce``; ``transport="auto"``, the
default, picks it) moves each message with one copy-engine copy straight into the
receiver's staging buffer over CUDA IPC, ordered by flags that the streams write and wait
on. Every rank must ask for the same transport; the choice is agreed before any data moves.

Staging memory (buffers and copy tables) is at most ``budget_mib`` per rank, whatever the
number and size of the tensors. :class:`Exchange` keeps the agreed plan to run the same
exchange again (weight sync every step) without planning again.

:func:`batch_isend_irecv` takes what ``torch.distributed.batch_isend_irecv`` takes (a list of
``P2POp``) and runs it as such an exchange, keeping the agreed exchange per shape of every
rank's list (per peer and direction: how the peers' ops interleave does not matter): code
that already writes P2POp lists changes one import.

The modules behind this one: ``_p2p_plan`` (descriptions, the planner, messages),
``_p2p_checks`` (validation and agreement), ``_p2p_exchange`` (agreeing), ``_p2p_rounds``
(running), ``_p2p_copy`` (the copy kernel and its tables), ``_p2p_dropin`` (the drop-in)
and ``_p2p_native`` (its native list reader). ``docs/design.md``, "One executor", says why
Python runs the rounds.
"""

from __future__ import annotations

from ._p2p_checks import translate_ops  # noqa: F401  (the checks and benches use these)
from ._p2p_dropin import (  # noqa: F401
    _CACHED_EXCHANGES,
    _EMPTY_DIGEST,
    _FAILED_DIGEST,
    _GROUPS,
    batch_isend_irecv,
    signature_digest,
)
from ._p2p_exchange import Exchange, exchange
from ._p2p_plan import (  # noqa: F401
    Lanes, P2PError, Plan, _prepare, dtype_code, encode_description,
)

__all__ = ["batch_isend_irecv", "exchange", "Exchange", "P2PError"]
