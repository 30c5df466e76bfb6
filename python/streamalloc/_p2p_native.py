"""Reading a ``P2POp`` list in native code: the drop-in's per-call cost.

Why: the drop-in reads every op of its list on every call (58,000 of them in the
reproduction's pattern at scale), and in Python each op costs several attribute reads and
tensor method calls (1-3 µs). ``csrc/p2p_door.cpp`` reads the same fields through
CPython's and PyTorch's C++ APIs, checks them and sorts the tensors into lanes in one pass.
It is compiled against the installed PyTorch at first use, the way the PyTorch door is
(``streamalloc._door``), and cached under ``$STREAMALLOC_CACHE``; where it cannot be built,
:func:`read_ops` reads the list in Python (``_p2p_checks.translate_ops``), with the same
result and the same messages.
"""

from __future__ import annotations

from . import _p2p_checks

_STATE = {"module": None, "failure": None}


def read_ops(ops, rank: int, world: int, group_rank, isend, irecv):
    """The list's :class:`~streamalloc._p2p_plan.Lanes` (raises ``P2PError`` naming the
    first bad op)."""
    return _p2p_checks.translate_ops(ops, rank, world, group_rank, isend, irecv)
