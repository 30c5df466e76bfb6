# The copy-engine transport of streamalloc.p2p end to end on CPU processes (gloo), no GPU:
# the real Exchange code (plan, agreement, slots, views, packing, one copy per message,
# flags, unpacking, release) with three stand-ins for what only a GPU has:
#   - the shared region is a file in /dev/shm mapped by every rank (instead of CUDA IPC);
#   - the "driver" runs each operation at once on the host: a copy is memmove, a flag write
#     a store, a flag wait spins (10 s limit) until the peer's store arrives;
#   - streams and events are no-ops (the host executes in enqueue order).
# Because run() enqueues each round's send before its receive and every wait depends only on
# earlier work, host order is a valid schedule: a wrong slot, offset, counter or view shows
# up as corrupted data or a wait that never ends.
#   PYTHONPATH=python STREAMALLOC_LIB=... python benches/gpu/p2p/ce_cpu_sim.py [WORLD]
import contextlib, ctypes, os, random, sys, tempfile, time
import torch
import torch.distributed as dist
from streamalloc import p2p, _ce

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cpu_check import spawn_ranks, tensor  # noqa: E402  (the same random tensors as the gloo check)


class FakeStream:
    cuda_stream = 0

    def wait_stream(self, other): pass
    def wait_event(self, event): pass
    def record_event(self, event=None): return event
    def synchronize(self): pass


class HostDriver:
    """Runs the transport's per-round driver calls at once on the host (same signatures
    and return codes as the libcuda entry points that _ce.Driver binds)."""
    def _memcpy(self, dst, src, n, stream):
        ctypes.memmove(dst, src, n)
        return 0

    def _write32(self, stream, address, value, flags):
        ctypes.c_uint32.from_address(address).value = value
        return 0

    def _wait32(self, stream, address, value, flags):
        t0 = time.monotonic()
        while not _ce.cyclic_geq(ctypes.c_uint32.from_address(address).value, value):
            if time.monotonic() - t0 > 10:
                raise RuntimeError(f"flag wait for {value} never satisfied (hang)")
            time.sleep(0)
        return 0

    def check(self, rc, what):
        if rc:
            raise _ce.CeError(f"{what} failed: {rc}")


class FileLink(_ce.Link):
    """A Link whose region is a shared file instead of IPC-exported GPU memory."""
    opened = 0

    def export(self, buffers, buffer_bytes, recv_from, flush):
        layout = _ce.Layout(buffers, buffer_bytes, self.bpd, self.world)
        fd, path = tempfile.mkstemp(prefix="ce_sim_", dir="/dev/shm")
        os.close(fd)
        region = torch.from_file(path, shared=True, size=layout.size, dtype=torch.uint8)
        region.zero_()
        self.region, self.layout, self.base, self._path = region, layout, region.data_ptr(), path
        return {"handle": path.encode(), "offset": 0, "buffers": buffers,
                "buffer_bytes": buffer_bytes, "recv_from": recv_from}

    def connect(self, records, peers):
        self._maps = []
        for p in sorted(peers):
            rec = records[p]
            size = _ce.Layout(rec["buffers"], rec["buffer_bytes"], self.bpd, self.world).size
            m = torch.from_file(rec["handle"].decode(), shared=True, size=size, dtype=torch.uint8)
            self._maps.append(m)
            FileLink.opened += 1
            self.peers[p] = (m.data_ptr() + rec["offset"],
                             _ce.Layout(rec["buffers"], rec["buffer_bytes"], self.bpd, self.world))

    def close(self):
        FileLink.opened -= len(getattr(self, "_maps", []))
        self._maps = []
        self.peers = {}

    def free(self):
        self.region = None
        if getattr(self, "_path", None):
            os.unlink(self._path)
            self._path = None


def install_fakes(rank):
    probe = {"ok": True, "reason": "", "host": "sim", "pci": f"gpu{rank}", "peers": {},
             "flush": False}
    _ce.probe = lambda device: dict(probe, peers={f"gpu{r}": True for r in range(64)})
    _ce.Link = FileLink
    drv = HostDriver()
    _ce.driver = lambda: drv
    torch.cuda.stream = lambda s: contextlib.nullcontext()
    torch.cuda.set_stream = lambda s: None
    torch.cuda.device = lambda d: contextlib.nullcontext()
    torch.cuda.current_stream = lambda d=None: FakeStream()


def make(ex):
    ex._pack_stream, ex._copy_stream, ex._unpack_stream = FakeStream(), FakeStream(), FakeStream()
    return ex


def worker(rank, world, port, failures):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    install_fakes(rank)
    ok = True
    cases = [(1, 0.05, 1), (2, 1, 1), (3, 0.05, 2), (4, 128, 1), (5, 0.1, 1), (6, 0.1, 1)]
    for seed, budget, k in cases:
        counts = random.Random(seed)
        n = {(s, d): counts.randint(0, 60) for s in range(world) for d in range(world)}
        # Seed 5: large tensors split across many messages, sent straight from the tensor;
        # seed 6: one tensor per peer that fits a buffer, a message of its own sent whole.
        count, arange_numel = {5: (3, lambda i: 100_000 + 7 * i),
                               6: (1, lambda i: 5_000)}.get(seed, (None, None))
        if arange_numel is not None:
            n = {(s, d): count for s in range(world) for d in range(world)}
        sends = {d: [tensor(rank, d, i, seed) for i in range(n[(rank, d)])] for d in range(world)}
        if arange_numel is not None:
            sends = {d: [torch.arange(arange_numel(i), dtype=torch.float32) + rank + d
                         for i in range(n[(rank, d)])] for d in range(world)}
        recvs = {s: [torch.empty_like(t) for t in
                     ([tensor(s, rank, i, seed) for i in range(n[(s, rank)])]
                      if arange_numel is None
                      else [torch.arange(arange_numel(i), dtype=torch.float32)
                            for i in range(n[(s, rank)])])]
                 for s in range(world)}
        ex = make(p2p.Exchange(sends, recvs, budget_mib=budget, rounds_per_group=k,
                               transport="ce"))
        ok &= ex.transport == "ce"
        ok &= ex.staging_bytes <= ex.budget_bytes
        for it in range(3):  # the counters carry across runs; the data changes each run
            for ts in sends.values():
                for t in ts:
                    if t.dtype != torch.bool and t.numel():
                        t.add_(1)
            for ts in recvs.values():
                for t in ts:
                    t.zero_()
            ex.run()
            for s in range(world):
                for i, t in enumerate(recvs[s]):
                    if arange_numel is not None:
                        want = torch.arange(arange_numel(i), dtype=torch.float32) + s + rank + it + 1
                    else:
                        want = tensor(s, rank, i, seed)
                        if want.dtype != torch.bool and want.numel():
                            want = want + (it + 1)
                    if not torch.equal(t, want.to(t.dtype)):
                        print(f"rank {rank}: seed {seed} run {it} tensor {i} from {s} differs",
                              flush=True)
                        ok = False
        if ex.summary["rounds"] and rank == 0 and seed in (1, 5):
            print(f"seed {seed}: {ex.summary['rounds']} rounds, staging {ex.staging_bytes} of "
                  f"{ex.budget_bytes} bytes", flush=True)
        ex.release()
        ok &= FileLink.opened == 0
        # Run again after release: the peers' regions are mapped again (collective).
        ex.run()
        ex.release()
    ok &= dropin_over_ce(rank, world)
    if not ok:
        failures.put(rank)
    dist.destroy_process_group()


def dropin_over_ce(rank, world):
    """batch_isend_irecv over the simulated copy engine: fresh tensors every step rebind the
    cached plan (including the addresses of messages copied straight from a tensor), and a
    change of shape releases the active exchange's staging and maps the peers again."""
    original = p2p.Exchange.__init__

    def with_fake_streams(self, *args, **kwargs):
        original(self, *args, **kwargs)
        make(self)

    p2p.Exchange.__init__ = with_fake_streams
    ok = True
    try:
        shapes = ["small", "small", "large", "large", "medium", "medium", "small"]
        for step, shape in enumerate(shapes):
            value = lambda s, d, i: float(s * 100 + d * 10 + i + step)
            # Small tensors packed; large ones split into messages copied from the tensor;
            # medium ones a message each, copied whole from the tensor.
            numel = {"small": lambda i: 1 + (i * 7) % 30, "large": lambda i: 40_000 + i,
                     "medium": lambda i: 3_000 + i}[shape]
            streams, expect = [], []  # one list per peer and direction, in matching order
            for j in range(world):
                streams.append([dist.P2POp(dist.isend, torch.full((numel(i),), value(rank, j, i)), j)
                                for i in range(5)])
                boxes = [torch.zeros(numel(i)) for i in range(5)]
                streams.append([dist.P2POp(dist.irecv, box, j) for box in boxes])
                expect += [(box, value(j, rank, i)) for i, box in enumerate(boxes)]
            # Interleaved at random, each peer's sends and receives still in order.
            rng, ops = random.Random(shapes.index(shape) * 10 + rank), []  # one order per shape
            while any(streams):
                ops.append(rng.choice([q for q in streams if q]).pop(0))
            for w in p2p.batch_isend_irecv(ops, budget_mib=0.1, transport="ce"):
                w.wait()
            good = all(bool((box == v).all()) for box, v in expect)
            if not good:
                print(f"rank {rank}: drop-in step {step} over ce: values differ", flush=True)
            ok &= good
        state = p2p._GROUPS[None]
        ok &= len(state.exchanges) == 3 and all(ex.transport == "ce" for ex in state.exchanges.values())
        while state.exchanges:
            state.exchanges.pop(next(iter(state.exchanges))).release()
        ok &= FileLink.opened == 0
    finally:
        p2p.Exchange.__init__ = original
    return ok


if __name__ == "__main__":
    spawn_ranks(worker, "ce cpu simulation")
