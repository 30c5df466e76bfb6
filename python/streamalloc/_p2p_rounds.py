"""Running an agreed exchange: staging buffers, packing, the rounds over NCCL or the copy
engine, unpacking.

Why a module of its own: agreeing on an exchange (``_p2p_exchange``) happens once, running it
every step; this is the part whose host cost is paid per run, so it is kept to a few driver
calls and kernel launches per round (``docs/design.md``, "One executor").

Packing, per rank and without agreement (ranks may differ): ``"kernel"``, one launch of the
copy kernel per message (``_p2p_copy``); ``"table"``, the same tables run by ``memmove`` on
the CPU; ``"torch"``, PyTorch's batched copies (``torch.cat`` and ``torch._foreach_copy_``
per run of same-dtype tensors), where the kernel cannot be had.

Each round is a named range for the profiler (``p2p round K``, through
``torch.profiler.record_function`` while a profiler records, and NVTX always), so a trace
shows where the exchange spends its time.
"""

from __future__ import annotations

from . import _ce
from . import _p2p_copy
from . import _p2p_native
from ._p2p_plan import _ROW, P2PError, _flat


#: What an unbound zero-copy message holds instead of its tensor (see ``_Rounds._unbind``).
_UNBOUND = object()


class _Rounds:
    """The running half of :class:`streamalloc.p2p.Exchange` (its agreement builds the
    attributes used here: ``_rounds``, ``summary``, ``transport``, ``_lanes``, ...)."""

    # ---- Staging buffers and the copy table ----

    def _setup_buffers(self):
        """Allocates the staging buffers and binds the messages to them: the buffer each
        packed message takes is fixed by its order, so this is done once."""
        import torch

        if self.transport == "ce":
            if self._link is not None:
                return self._setup_ce()
            # No round anywhere: nothing crosses ranks, only this rank's own copies.
            self._buffers, self._ce_events = ([], []), ([], [])
            return self._setup_copier({})
        s = self.summary
        u8 = torch.uint8
        sbufs = [torch.empty(s["send_buffer_bytes"], dtype=u8, device=self.device)
                 for _ in range(s["send_buffers"])]
        rbufs = [torch.empty(s["recv_buffer_bytes"], dtype=u8, device=self.device)
                 for _ in range(s["recv_buffers"])]
        counters = [0, 0]
        bases = {}
        for k, pair in enumerate(self._rounds):
            for direction, msg in enumerate(pair):
                if msg is None or msg.zero_copy is not None:
                    continue
                bufs = sbufs if direction == 0 else rbufs
                msg.buffer = counters[direction] % len(bufs)
                counters[direction] += 1
                _bind(msg, bufs[msg.buffer], direction, self._pack_mode == "torch")
                bases[(k, direction)] = msg.wire.data_ptr()
        self._buffers = (sbufs, rbufs)
        self._setup_copier(bases)

    def _setup_copier(self, bases):
        """The copy table of this rank's packed pieces (not in ``"torch"`` packing)."""
        if self._pack_mode == "torch":
            self._copier = None
            return
        lanes, w, me = self._lanes, self.world, self.rank
        starts = lanes.starts()
        own = (starts[me], starts[w + me], lanes.counts[me], lanes.nbytes)
        # Over the copy engine, single-region messages are one driver copy (`_direct`);
        # every other packed message must have its staging buffer in `bases`.
        direct = {(k, d) for k, pair in enumerate(self._rounds) for d, msg in enumerate(pair)
                  if msg is not None and msg.zero_copy is None and self._direct(msg)
                  } if self.transport == "ce" else set()
        table = _p2p_copy.build_table(self._rows, _ROW, starts, w, bases, own, skip=direct)
        if self.device.type == "cuda" and table.device_bytes > self._table_reserve:
            # reserve_bytes() bounds every table: this is a bug, not an input to refuse
            raise P2PError(f"the copy table of {table.device_bytes} bytes exceeds its reserve "
                           f"of {self._table_reserve}")
        self._copier = _p2p_copy.copier_for(table, self.device)
        self._copier.bind(self._addresses())
        self.summary["table_bytes"] = self._copier.device_bytes

    def _addresses(self):
        import torch

        lanes = self._lanes
        if lanes.addresses is None:
            import array

            lanes.addresses = array.array("q", [t.data_ptr() for t in lanes.tensors])
        if not len(lanes.addresses):
            return torch.zeros(0, dtype=torch.int64)
        return torch.frombuffer(lanes.addresses, dtype=torch.int64)

    # ---- Copy-engine staging ----

    def _ce_sends(self):
        return [m for m, _ in self._rounds if m is not None]

    @staticmethod
    def _direct(msg) -> bool:
        """A message that is one contiguous region of one tensor: the copy engine copies it
        straight from (or into) the tensor, with any packing, so it needs no send buffer
        and no pass of the copy kernel over its bytes."""
        return ((not msg.pieces and len(msg.runs) == 1 and len(msg.runs[0].tensors) == 1)
                or (not msg.runs and len(msg.pieces) == 1))

    def _direct_source(self, msg):
        """(device address, offset in the message, bytes) of a :meth:`_direct` message's
        tensor region, for the tensors bound now."""
        if self._pack_mode == "torch":
            # The runs' and pieces' views are rebound to the new tensors.
            if msg.runs:
                run = msg.runs[0]
                return run.tensors[0].data_ptr(), run.start, run.end - run.start
            view, offset, nbytes = msg.pieces[0]
            return view.data_ptr(), offset, nbytes
        # The table's packings keep the plan's first tensors in the runs and pieces: the
        # address comes from the lanes' addresses, as the copy table's do.
        lanes, w = self._lanes, self.world
        if lanes.addresses is None:
            self._addresses()
        starts = lanes.starts()
        if msg.runs:
            run = msg.runs[0]
            d, p, first = run.source
            return lanes.addresses[starts[d * w + p] + first], run.start, run.end - run.start
        d, p, i, t_off = msg.piece_sources[0]
        _, offset, nbytes = msg.pieces[0]
        return lanes.addresses[starts[d * w + p] + i] + t_off, offset, nbytes

    def _ce_send_buffers(self):
        """(count, bytes) of the local send buffers: messages that are not :meth:`_direct`
        are packed locally before their one copy."""
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
        count, nbytes = self._ce_send_buffers()
        sbufs = [torch.empty(nbytes, dtype=torch.uint8, device=self.device)
                 for _ in range(count)]
        layout, region, base = link.layout, link.region, link.base
        rbufs = [region[layout.buffer(b):layout.buffer(b) + layout.buffer_bytes]
                 for b in range(layout.buffers)]
        views = self._pack_mode == "torch"
        bases = {}
        # Receiving: the slots of this rank's messages, and who writes each buffer next.
        received = [(k, m) for k, (_, m) in enumerate(self._rounds) if m is not None]
        slots = _ce.receive_slots(len(received), layout.buffers)
        nexts = _ce.next_users([m.rank for _, m in received], layout.buffers)
        for (k, msg), slot, nxt in zip(received, slots, nexts):
            msg.slot, msg.buffer = slot, slot.buffer
            _bind(msg, rbufs[slot.buffer], 1, views)
            if self._direct(msg):
                dst, off, msg.nbytes = self._direct_source(msg)
                msg.unpack_dst, msg.unpack_src = dst, msg.wire.data_ptr() + off
            else:
                bases[(k, 1)] = msg.wire.data_ptr()
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
        for k, (msg, _) in enumerate(self._rounds):
            if msg is None:
                continue
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
                msg.src, msg.dst, msg.nbytes = src, remote + off, n
            else:
                msg.buffer = packed % count
                packed += 1
                _bind(msg, sbufs[msg.buffer], 0, views)
                bases[(k, 0)] = msg.wire.data_ptr()
                msg.src, msg.dst, msg.nbytes = msg.wire.data_ptr(), remote, msg.length
        self._ce_events = ([None] * count, [None] * count)
        self._buffers = (sbufs, rbufs)
        self._setup_copier(bases)
        if self.staging_bytes > self.budget_bytes:  # the reserves keep this from happening
            raise P2PError(f"copy-engine staging of {self.staging_bytes} bytes exceeds the "
                           f"budget of {self.budget_bytes}")

    # ---- Binding new tensors (the drop-in's cached plans) ----

    def _rebind(self, lanes):
        """Points the agreed plan at new tensors of the same shapes, dtypes and order per
        lane. With the copy kernel (or its host twin): one vectorised recomputation of the
        table's addresses (uploaded at the next run); zero-copy messages take their new
        tensors. With ``"torch"`` packing: a few slices per message.

        Nothing here visits every tensor in Python: at tens of thousands of tensors, one
        Python call per tensor costs more than the rest of a cached call's host work."""
        self._lanes = lanes
        w, me = self.world, self.rank
        starts, counts = lanes.starts(), lanes.counts
        torch_mode = self._pack_mode == "torch"
        tensors = _p2p_native.flat_tensors(lanes.tensors) if torch_mode else lanes.tensors
        lane = lambda d, p: tensors[starts[d * w + p]:starts[d * w + p] + counts[d * w + p]]
        at = lambda d, p, i: tensors[starts[d * w + p] + i]
        ce = self.transport == "ce" and self._buffers is not None
        for pair in self._rounds:
            for msg in pair:
                if msg is None:
                    continue
                if msg.zero_copy_source is not None:
                    msg.zero_copy = _bytes_of(at(*msg.zero_copy_source))
                if not torch_mode:
                    continue
                for run in msg.runs:
                    d, p, first = run.source
                    base = starts[d * w + p] + first
                    run.tensors = tensors[base:base + len(run.tensors)]
                if msg.piece_sources:
                    msg.pieces = [(_bytes_of(at(d, p, i))[o:o + n], b, n)
                                  for (d, p, i, o), (_, b, n) in zip(msg.piece_sources,
                                                                     msg.pieces)]
        self._self_copies = (lane(1, me), lane(0, me))
        if self._copier is not None:
            self._copier.bind(self._addresses())
        if ce:
            for send, recv in self._rounds:
                if send is not None and send.buffer < 0:
                    send.src = self._direct_source(send)[0]
                if recv is not None and recv.unpack_dst:
                    recv.unpack_dst = self._direct_source(recv)[0]

    def _unbind(self):
        """Lets go of the tensors the plan was last bound to: a cached exchange must not keep
        a caller's tensors (and their memory) alive until its next call of the same shape.
        What :meth:`_rebind` needs stays (counts, offsets, sources); every tensor reference
        becomes a placeholder, and running before the next :meth:`_rebind` raises."""
        for pair in self._rounds:
            for msg in pair:
                if msg is None:
                    continue
                if msg.zero_copy is not None:
                    msg.zero_copy = _UNBOUND  # still marks the message as zero-copy
                for run in msg.runs:
                    run.tensors = [None] * len(run.tensors)
                msg.pieces = [(None, offset, nbytes) for _, offset, nbytes in msg.pieces]
        self._self_copies = None
        self._lanes = None

    # ---- Running ----

    def run(self) -> dict:
        """Moves the bytes. Returns the plan's figures for this rank."""
        import torch

        if self._lanes is None:
            raise P2PError("this exchange let go of its tensors (_unbind): bind new ones first")

        # Parameters and other leaves that require grad are moved as ``p.data`` would be:
        # packing with ``out=`` and unpacking in place are not differentiable operations.
        with torch.no_grad():
            return self._run()

    def _run(self) -> dict:
        import torch

        cuda = self.device.type == "cuda"
        if self.transport == "ce" and self._link is None and self.summary["rounds"]:
            self._runs = 0  # after release(): map the peers again (collective)
            failure = self._establish_ce(_ce.probe(self.device))
            if failure is not None:
                raise P2PError(f"p2p transport 'ce' failed: {failure}")
        if self._buffers is None and (self._rounds or self._pack_mode != "torch"):
            self._setup_buffers()
        cur = torch.cuda.current_stream(self.device) if cuda else None
        if self._copier is not None:
            self._copier.upload(cur)
            self._copier.launch("self", cur.cuda_stream if cuda else None)
        else:
            dst, src = self._self_copies
            if dst:
                torch._foreach_copy_(dst, src)
        if not self._rounds:
            return dict(self.summary)
        if self.transport == "ce":
            with torch.cuda.device(self.device):
                self._run_ce(cur if cur is not None else torch.cuda.current_stream(self.device))
        else:
            self._run_nccl(cur)
        return dict(self.summary)

    def _run_nccl(self, cur):
        import torch
        import torch.distributed as dist

        sbufs, rbufs = self._buffers
        cuda = cur is not None
        copier = self._copier
        send_free = [None] * len(sbufs)
        recv_free = [None] * len(rbufs)
        if cuda:
            pack, unpack = self._pack_stream, self._unpack_stream
            pack.wait_stream(cur)
            unpack.wait_stream(cur)
        group = self._group
        isend, irecv, P2POp = dist.isend, dist.irecv, dist.P2POp
        K = self._per_group
        rounds = self._rounds
        ranges = _RoundRanges()
        for g in range(0, len(rounds), K):
            chunk = rounds[g:g + K]
            ranges.enter(g)
            packed = [(g + i, m) for i, (m, _) in enumerate(chunk)
                      if m is not None and m.zero_copy is None]
            landed = [(g + i, m) for i, (_, m) in enumerate(chunk)
                      if m is not None and m.zero_copy is None]
            if packed:
                if cuda:
                    with torch.cuda.stream(pack):
                        for k, m in packed:
                            if send_free[m.buffer] is not None:
                                pack.wait_event(send_free[m.buffer])
                            _pack(m, copier, (k, 0), pack)
                        ready = pack.record_event()
                    cur.wait_event(ready)
                else:
                    for k, m in packed:
                        _pack(m, copier, (k, 0), None)
            if cuda:
                for _, m in landed:
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
                    for _, m in packed:
                        send_free[m.buffer] = done
                if landed:
                    arrived = cur.record_event()
                    with torch.cuda.stream(unpack):
                        unpack.wait_event(arrived)
                        for k, m in landed:
                            _unpack(m, copier, (k, 1), unpack)
                        emptied = unpack.record_event()
                    for _, m in landed:
                        recv_free[m.buffer] = emptied
            else:
                for k, m in landed:
                    _unpack(m, copier, (k, 1), None)
        ranges.leave()
        if cuda:
            cur.wait_stream(pack)
            cur.wait_stream(unpack)

    def _run_ce(self, cur):
        """One run over the copy engine: the host enqueues everything, the streams order
        themselves with the flags (see ``streamalloc._ce``). Each round's send is enqueued
        before its receive, so every wait depends only on work enqueued earlier (the
        no-deadlock argument in ``streamalloc._ce``). The loop is the host's whole cost of
        a run: raw driver calls and one kernel launch per packed or unpacked message."""
        import torch

        d = _ce.driver()
        run = self._runs
        self._runs += 1
        pack, copy, unpack = self._pack_stream, self._copy_stream, self._unpack_stream
        for s in (pack, copy, unpack):
            s.wait_stream(cur)
        cs, us, ps = copy.cuda_stream, unpack.cuda_stream, pack.cuda_stream
        memcpy, write, wait = d._memcpy, d._write32, d._wait32
        geq, wait_flags = _ce.CU_STREAM_WAIT_VALUE_GEQ, self._link.wait_flags
        set_stream = torch.cuda.set_stream
        copier = self._copier
        # Per send buffer, one event object each for "packed" and "copied out", recorded
        # again every use rather than created per round (a new event costs more host time
        # than the driver calls of a round); ``copied[b]``: buffer b was copied out in this
        # run, so packing into it again waits for that.
        packed_events, copied_events = self._ce_events
        copied = [False] * len(self._buffers[0])
        active = None
        ranges = _RoundRanges()
        try:
            for k, (send, recv) in enumerate(self._rounds):
                ranges.enter(k)
                if send is not None:
                    slot = send.slot
                    if send.buffer >= 0:
                        b = send.buffer
                        if copied[b]:
                            pack.wait_event(copied_events[b])
                        if copier is not None:
                            copier.launch((k, 0), ps)
                        else:
                            if active is not pack:
                                set_stream(pack)
                                active = pack
                            _pack(send, None, None, pack)
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
                        # that.
                        rc = memcpy(recv.unpack_dst, recv.unpack_src, recv.nbytes, us)
                        if rc:
                            d.check(rc, "enqueueing a copy-engine unpack")
                    elif copier is not None:
                        copier.launch((k, 1), us)
                    else:
                        if active is not unpack:
                            set_stream(unpack)
                            active = unpack
                        _unpack(recv, None, None, unpack)
                    rc = write(us, recv.free_flag, seq, 0)
                    if rc:
                        d.check(rc, "cuStreamWriteValue32")
        finally:
            ranges.leave()
            set_stream(cur)
        for s in (pack, copy, unpack):
            cur.wait_stream(s)


class _RoundRanges:
    """Names each round for the profiler: ``p2p round K`` as an NVTX range (cheap when no
    tool listens) and, while PyTorch's profiler records, as a ``record_function`` range."""

    def __init__(self):
        import torch

        self._nvtx = None
        if torch.cuda.is_available():
            try:
                from torch.cuda import nvtx

                self._nvtx = nvtx
            except ImportError:
                pass
        recording = getattr(torch.autograd, "_profiler_enabled", lambda: False)()
        self._record = torch.profiler.record_function if recording else None
        self._open = None
        self._pushed = False

    def enter(self, k):
        self.leave()
        name = f"p2p round {k}"
        if self._nvtx is not None:
            try:
                self._nvtx.range_push(name)
                self._pushed = True
            except RuntimeError:  # a PyTorch built without NVTX
                self._nvtx = None
        if self._record is not None:
            self._open = self._record(name)
            self._open.__enter__()

    def leave(self):
        if self._open is not None:
            self._open.__exit__(None, None, None)
            self._open = None
        if self._pushed:
            self._nvtx.range_pop()
            self._pushed = False


def _bytes_of(t):
    import torch

    return _flat(t).view(torch.uint8)


def _bind(msg, buf, direction, views=True):
    """Caches the views of staging buffer ``buf`` that moving ``msg`` uses (with
    ``views``: also those PyTorch's packing uses)."""
    import torch

    msg.wire = buf[:msg.length]
    if not views:
        return
    for run in msg.runs:
        run.view = buf[run.start:run.end].view(run.dtype)
        if direction == 1 and len(run.tensors) > 1:
            run.parts = list(torch.split(run.view, [n // run.itemsize for n in run.nbytes]))
    msg.staged = [buf[o:o + n] for _, o, n in msg.pieces]


def _pack(msg, copier, key, stream):
    """Packs ``msg`` into its staging buffer: one launch of the copier's range ``key``, or
    PyTorch's batched copies (on the current stream)."""
    import torch

    if copier is not None:
        copier.launch(key, stream.cuda_stream if stream is not None else None)
        return
    for run in msg.runs:
        if len(run.tensors) == 1:
            run.view.copy_(run.tensors[0])
        else:
            torch.cat(run.tensors, out=run.view)
    for (piece, _, _), staged in zip(msg.pieces, msg.staged):
        staged.copy_(piece)


def _unpack(msg, copier, key, stream):
    import torch

    if copier is not None:
        copier.launch(key, stream.cuda_stream if stream is not None else None)
        return
    for run in msg.runs:
        if len(run.tensors) == 1:
            run.tensors[0].copy_(run.view)
        else:
            torch._foreach_copy_(run.tensors, run.parts)
    for (piece, _, _), staged in zip(msg.pieces, msg.staged):
        piece.copy_(staged)
