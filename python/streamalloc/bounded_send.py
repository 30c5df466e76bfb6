"""Point-to-point sends that keep at most a fixed budget of memory in flight.

Why this exists: PyTorch 2.11 keeps every ``isend``'s tensor alive in the returned ``Work``
until ``wait()`` (its "tensor stash"; ``record_stream`` is no longer called). So no
allocator ever sees the tensor freed: a pipeline stage that isends 32 activations of 64 MiB
to a slow consumer peaks at 2080 MiB extra with PyTorch's allocator and with ours alike
(``benches/gpu/pp_isend.py``).

:meth:`BoundedSender.isend` copies the tensor into one of a few staging slots, on the
caller's current stream, and sends the copy. The caller's tensor is then used on its own
stream only, so its memory is reused as soon as it is dropped, and the bytes in flight
never exceed the slots. Before a slot is refilled, the caller's stream waits for the send
that last used it through that send's ``Work.wait()``, which for NCCL is a wait on the
device: the host keeps running ahead. The receiver is unchanged (``recv``/``irecv`` of the
same shape and dtype).

The price: one device copy per send (64 MiB: ~30 µs on an H200), and a sender whose slots
are all in flight waits for its consumer on the device instead of running ahead of it.
"""

from __future__ import annotations

#: Staging slots start at multiples of this many bytes, enough for any dtype's alignment.
SLOT_ALIGN = 512


class BoundedSender:
    """Sends through ``slots`` staging buffers of ``budget_mib / slots`` each, allocated on
    the first :meth:`isend` on the device of its tensor.

    A tensor larger than a slot is sent as it is and counted in :attr:`stats`
    ``["direct"]``: as with a plain ``isend``, it must stay unchanged until its send is
    waited for (:meth:`wait` waits for those too). One sender serves one thread and one
    device.
    """

    def __init__(self, budget_mib: float = 128, slots: int = 2):
        if slots < 1:
            raise ValueError(f"a BoundedSender needs at least one slot, not {slots}")
        slot_bytes = int(budget_mib * 2**20) // slots // SLOT_ALIGN * SLOT_ALIGN
        if slot_bytes <= 0:
            raise ValueError(
                f"a budget of {budget_mib} MiB leaves nothing for each of {slots} slots")
        self.slot_bytes = slot_bytes
        self.slots = slots
        self._buffer = None  # slots * slot_bytes bytes, on the first tensor's device
        self._in_flight = [None] * slots  # the Work that last sent from each slot
        self._direct = []  # Works of tensors sent as they are, until wait()
        self._next = 0
        self.stats = {"staged": 0, "staged_bytes": 0, "direct": 0, "slot_waits": 0}

    @property
    def budget_bytes(self) -> int:
        """Device memory the slots take once allocated."""
        return self.slot_bytes * self.slots

    def isend(self, tensor, dst: int, group=None, tag: int = 0):
        """``torch.distributed.isend(tensor, dst, group, tag)`` through a staging slot;
        returns the ``Work``. ``tensor`` may be dropped (or overwritten) as soon as this
        returns: the slot holds the bytes being sent."""
        import torch.distributed as dist

        nbytes = tensor.numel() * tensor.element_size()
        if nbytes > self.slot_bytes:
            self.stats["direct"] += 1
            work = dist.isend(tensor, dst, group=group, tag=tag)
            self._direct.append(work)
            return work
        slot = self._next
        self._next = (slot + 1) % self.slots
        previous = self._in_flight[slot]
        if previous is not None:
            # NCCL: the current stream waits on the device for that send to finish reading
            # the slot; gloo: the host waits.
            previous.wait()
            self.stats["slot_waits"] += 1
        staged = self._slot(slot, tensor.device)[:nbytes].view(tensor.dtype).view(tensor.shape)
        staged.copy_(tensor)
        work = dist.isend(staged, dst, group=group, tag=tag)
        self._in_flight[slot] = work
        self.stats["staged"] += 1
        self.stats["staged_bytes"] += nbytes
        return work

    def wait(self) -> None:
        """Waits for every send made so far (as ``Work.wait()`` does: on the device for
        NCCL)."""
        for slot, work in enumerate(self._in_flight):
            if work is not None:
                work.wait()
                self._in_flight[slot] = None
        for work in self._direct:
            work.wait()
        self._direct = []

    def release(self) -> None:
        """Waits for the staged sends, then drops the slots (a later send allocates them
        again)."""
        self.wait()
        self._buffer = None

    def _slot(self, slot: int, device):
        import torch

        if self._buffer is None:
            self._buffer = torch.empty(self.budget_bytes, dtype=torch.uint8, device=device)
        elif self._buffer.device != device:
            raise ValueError(
                f"this BoundedSender's slots are on {self._buffer.device}, the tensor is on "
                f"{device}; use one sender per device")
        start = slot * self.slot_bytes
        return self._buffer[start:start + self.slot_bytes]
