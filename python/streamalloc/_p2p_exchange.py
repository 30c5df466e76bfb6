"""Agreeing on an exchange: every rank's lists checked and gathered, the transport chosen,
the plan made and its digest compared, the copy engine's shared buffers mapped, and at the
end let go of.

Why a module of its own: this is the collective half of :class:`Exchange`, done once per set
of shapes; running the agreed rounds (``_p2p_rounds``) is the half paid every step. Every
collective here is reached by every rank whatever its input, and every failure is decided
from gathered data, so every rank raises the same :class:`P2PError`.
"""

from __future__ import annotations

from . import _ce
from . import _p2p_checks as checks
from . import _p2p_copy
from . import _p2p_native
from ._p2p_plan import P2PError, Plan, _flat, _prepare, lanes_from_lists
from ._p2p_rounds import _Rounds


class Exchange(_Rounds):
    """An agreed exchange between the ranks of ``group``: construct it on every rank (a
    collective), then :meth:`run` it, as often as the same tensors need moving.

    ``transport``: ``"nccl"`` moves each round with one ``batch_isend_irecv`` group of the
    process group's backend; ``"ce"`` with one copy-engine copy into the receiver's buffer
    over CUDA IPC (every rank on one host, GPUs with peer access; see
    ``streamalloc._ce``); ``"auto"`` (default) picks ``"ce"`` when every rank can, else
    ``"nccl"``. Every rank must pass the same value; the choice is agreed before any data
    moves (``self.transport``, and ``self.transport_note`` says why ``"auto"`` did not pick
    ``"ce"``).

    Everything a rank was handed (the lists, the budget, the options) is checked before the
    first collective, and a refusal on any rank is raised as the same :class:`P2PError` on
    every rank."""

    def __init__(self, sends: dict, recvs: dict, budget_mib: float = 128, group=None,
                 rounds_per_group: int = 1, zero_copy_min: int | None = None,
                 transport: str = "auto", _lanes=None):
        import torch
        import torch.distributed as dist

        self._buffers = None
        self._link = None
        self._copier = None
        self._runs = 0
        self._group = group
        rank = dist.get_rank(group)
        world = dist.get_world_size(group)
        self.rank, self.world = rank, world
        checks.host_group(group)  # a collective on first use: every rank gets here
        # Local checks fail on every rank alike: their verdict travels with the description,
        # so no rank is left waiting in a collective that another rank has abandoned.
        probe, lanes = None, None
        try:
            budget = checks.budget_bytes(budget_mib)
            checks.check_options(rounds_per_group, zero_copy_min, transport)
            lanes = _lanes if _lanes is not None else self._lanes_of(sends, recvs, world)
            device = lanes.device
            if device is None:
                device = (torch.device("cuda", torch.cuda.current_device())
                          if torch.cuda.is_available() else torch.device("cpu"))
            if transport != "nccl":
                probe = _ce.probe(device)
            packing = _pack_mode(device)
            local = (None, lanes.description(rank), transport, probe,
                     (packing[0], len(lanes.tensors), sum(lanes.nbytes)))
        except Exception as err:  # any type: it must reach the agreement
            local = (checks.message_of(err), b"", repr(transport), None, ("", 0, 0))
        gathered = checks.gather(local, group, world)
        refused = checks.refusals([g[0] for g in gathered])
        if refused is not None:
            raise P2PError(refused)
        requests = [g[2] for g in gathered]
        if any(t != requests[0] for t in requests):
            listed = ", ".join(f"rank {r}: {t}" for r, t in enumerate(requests))
            raise P2PError(f"p2p transport mismatch across ranks ({listed}): pass the same "
                           "transport= on every rank")
        # K rounds fused in one group need K buffers in flight per direction, times two so
        # that packing the next group overlaps sending this one.
        bpd = 2 * rounds_per_group
        self._per_group, self._bpd = rounds_per_group, bpd
        self.device = device
        self.budget_bytes = budget
        # Every copy table in device memory fits the same reserve, taken from the budget
        # before planning (the same figure on every rank: it comes from gathered counts).
        self._table_reserve = max([_p2p_copy.reserve_bytes(n, b, budget, bpd, world)
                                   for *_, (mode, n, b) in gathered if mode == "kernel"],
                                  default=0)
        chosen, why = _ce.resolve_transport(transport, [g[3] for g in gathered], world,
                                            budget - self._table_reserve, bpd)
        if chosen is None:
            raise P2PError(f"p2p transport 'ce' is not possible: {why}")
        self.transport_note = why
        self._pack_mode, self.pack_note = packing
        descriptions = [g[1] for g in gathered]
        to_global = (lambda p: p) if group is None else (lambda p: dist.get_global_rank(group, p))
        self._lanes = lanes
        plan_budget = budget - self._table_reserve
        if chosen == "ce":
            self._agree(descriptions, plan_budget - _ce.reserve_bytes(bpd, world),
                        _ce.NO_ZERO_COPY, "ce", to_global)
            if self.summary["rounds"]:
                failure = self._establish_ce(probe)
                if failure is not None:
                    if transport == "ce":
                        raise P2PError(f"p2p transport 'ce' failed: {failure}")
                    # Every rank saw the same failures: every rank falls back.
                    self.transport_note = failure
                    chosen = None
        if chosen != "ce":
            self._agree(descriptions, plan_budget, zero_copy_min, "nccl", to_global)
        if self.device.type == "cuda":
            self._pack_stream = torch.cuda.Stream(self.device)
            self._unpack_stream = torch.cuda.Stream(self.device)
            if self.transport == "ce":
                self._copy_stream = torch.cuda.Stream(self.device)

    @staticmethod
    def _lanes_of(sends, recvs, world):
        lanes = _p2p_native.read_lists(world, checks.peer_lists(sends, world, "sends", False),
                                       checks.peer_lists(recvs, world, "recvs", False))
        return lanes if lanes is not None else Exchange._lanes_in_python(sends, recvs, world)

    @staticmethod
    def _lanes_in_python(sends, recvs, world):
        """The lists read and checked in Python: what the native reader leaves to it (few
        tensors, no native module, or a tensor it refuses, whose message is said here)."""
        send_lists = checks.peer_lists(sends, world, "sends")
        recv_lists = checks.peer_lists(recvs, world, "recvs")
        device = checks.one_device(send_lists, recv_lists)
        return lanes_from_lists(world, send_lists, recv_lists, device)

    def _agree(self, descriptions, budget, zero_copy_min, transport, to_global):
        """Plans, and checks that every rank planned the same (digest and transport)."""
        world, group = self.world, self._group
        plan, vote = None, None
        try:
            plan = Plan(descriptions, budget, self._bpd, zero_copy_min)
            vote = (0, plan.digest, transport)
        except P2PError as err:
            vote = (1, str(err), transport)
        votes = checks.gather(vote, group, world)
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
        self.summary = dict(plan.summary(self.rank), transport=transport,
                            packing=self._pack_mode)
        self._plan_budget = budget
        self._rows = plan.rows(self.rank)
        lanes = self._lanes
        lists = (lanes.lists(0), lanes.lists(1))
        if self._pack_mode == "torch":
            lists = tuple([[_flat(t) for t in ts] for ts in side] for side in lists)
        # Only PyTorch's packing copies through views of the split tensors' pieces; the
        # copy table takes their addresses.
        self._rounds = _prepare(self._rows, lists, lanes, to_global,
                                piece_views=self._pack_mode == "torch")
        self._self_copies = (lists[1][self.rank], lists[0][self.rank])

    def _establish_ce(self, probe) -> str | None:
        """Exports this rank's region, maps the peers' (a collective). Returns None, or the
        first failure (the same on every rank)."""
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
        records = checks.gather(record, group, world)
        failure = next((f"rank {r}: {x}" for r, x in enumerate(records) if isinstance(x, str)),
                       None)
        if failure is None:
            try:
                link.connect(records, peers)
                ok = None
            except _ce.CeError as err:
                ok = str(err)
            oks = checks.gather(ok, group, world)
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

    @property
    def staging_bytes(self) -> int:
        """Device bytes one :meth:`run` holds: staging buffers and copy table (at most the
        budget)."""
        table = self._copier.device_bytes if self._copier is not None else 0
        if self.transport == "ce":
            return self._ce_staging_bytes() + table
        s = self.summary
        return (s["send_buffers"] * s["send_buffer_bytes"]
                + s["recv_buffers"] * s["recv_buffer_bytes"]) + table

    def release(self):
        """Returns the staging buffers and the copy table (kept between runs otherwise; at
        most the budget). With the copy-engine transport a collective: peers write into this
        rank's memory until they are done, so every rank waits for every rank before
        letting go."""
        link = self._link
        if link is not None:
            for s in (self._pack_stream, self._copy_stream, self._unpack_stream):
                s.synchronize()
        # Local buffers go first: the barrier below then allocates on top of the shared
        # region alone, not of all the staging.
        self._buffers = None
        self._copier = None
        for pair in self._rounds:
            for msg in pair:
                if msg is not None:
                    msg.wire = None
                    msg.staged = None
                    for run in msg.runs:
                        run.view = run.parts = None
        if link is not None:
            self._barrier()  # every rank's copies into this rank's region are done
            self._link = None
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
        checks.gather(True, self._group, self.world)  # host-blocking


def _pack_mode(device):
    """(packing, why not the kernel) for this rank: local, ranks need not agree."""
    try:
        wanted = _p2p_copy.mode()
    except ValueError as err:
        raise P2PError(str(err)) from None
    if wanted == "torch":
        return "torch", "STREAMALLOC_P2P_PACK=torch"
    if device.type == "cpu":
        return "table", None
    try:
        _p2p_copy.kernel_for(device)
        return "kernel", None
    except _p2p_copy.CopyUnavailable as err:
        if wanted == "kernel":
            raise P2PError(f"STREAMALLOC_P2P_PACK=kernel: {err}") from None
        return "torch", str(err)


def exchange(sends: dict, recvs: dict, budget_mib: float = 128, group=None,
             transport: str = "nccl", **options) -> dict:
    """Sends ``sends[peer]`` to each peer and fills ``recvs[peer]`` from each, through at
    most ``budget_mib`` of staging memory. A collective: every rank of ``group`` calls it.
    Returns this rank's plan figures (rounds, max ops per group, bytes moved, buffers).

    One call sets everything up and tears it down, so its transport defaults to
    ``"nccl"``: the copy engine's IPC mapping and collective release cost more than they
    save in one run. To move the same tensors again, keep an :class:`Exchange` (default
    ``transport="auto"``)."""
    ex = Exchange(sends, recvs, budget_mib=budget_mib, group=group, transport=transport,
                  **options)
    try:
        return ex.run()
    finally:
        ex.release()
