#!/usr/bin/env python3
"""Writes a large PyTorch-shaped memory snapshot, byte for byte as Python's pickler would.

`torch.cuda.memory._dump_snapshot` pickles a dict of `segments`, `device_traces` and
`allocator_settings` with the default protocol (4), and PyTorch shares objects in it: every
frame dict is one object however many stacks name it, and the keys and action names are
the same string objects in every entry. The pickler writes a shared object once and refers
to it through the memo afterwards (`BINGET` / `LONG_BINGET`), so a trace of a million
entries with deep stacks is mostly memo references. These are the files the viewer must
open and the readers' memory budget must count correctly.

Building a million such entries as Python objects and calling `pickle.dump` would take
gigabytes; this script streams the same opcodes instead (protocol 4, `MEMOIZE`, 64 KiB
frames, batches of 1,000 items), and `--self-check` proves the stream identical to
`pickle.dumps(obj, protocol=4)` of the equivalent objects on small sizes.

Shapes (`--stacks-shared`):
- off (PyTorch's): each entry has its own `frames` list of `--depth` frame dicts drawn
  from `--frames` shared ones (memo references to the frame dicts);
- on (streamalloc's own pickle writer): the entries of one call stack share one `frames`
  list (a memo reference to the list).

Examples (from the repository root):
    python3 benches/snapshots/large_snapshot.py --events 1000000 --depth 20 big.pickle.gz
    python3 benches/snapshots/large_snapshot.py --events 1000000 --depth 60 \\
        --stacks-shared shared60.pickle.gz
    python3 benches/snapshots/large_snapshot.py --events 5000000 --depth 20 big5m.pickle.gz
    python3 benches/snapshots/large_snapshot.py --self-check
"""

import argparse
import functools
import gzip
import io
import pickle
import random
import struct
import sys

FRAME_TARGET = 64 * 1024  # pickle's _FRAME_SIZE_TARGET
FRAME_MIN = 4  # pickle's _FRAME_SIZE_MIN
BATCH = 1000  # pickle's _BATCHSIZE


def _int_bytes(v):
    """pickle's save_long at protocol 4."""
    if 0 <= v <= 0xFF:
        return b"K" + bytes([v])
    if 0 <= v <= 0xFFFF:
        return b"M" + struct.pack("<H", v)
    if -0x80000000 <= v <= 0x7FFFFFFF:
        return b"J" + struct.pack("<i", v)
    n = (v.bit_length() >> 3) + 1
    data = v.to_bytes(n, "little", signed=True)
    if v < 0 and n > 1 and data[-1] == 0xFF and data[-2] & 0x80:
        data = data[:-1]
    return b"\x8a" + bytes([len(data)]) + data


@functools.lru_cache(maxsize=1 << 16)
def _ref_bytes(idx):
    """BINGET or LONG_BINGET of memo entry `idx`."""
    return b"h" + bytes([idx]) if idx < 256 else b"j" + struct.pack("<I", idx)


class StreamPickler:
    """Protocol-4 opcodes written as pickle.py's Pickler writes them.

    Objects registered with `share` are memoised by identity and referred to by `BINGET`
    afterwards; every other container or string is written afresh (and takes a memo index,
    as the pickler gives it one), which is exactly the pickler's output for objects that
    are never referred to twice.
    """

    def __init__(self, out):
        self.out = out
        self.frame = bytearray()
        self.memo_len = 0
        self.memo = {}  # id(obj) -> index, for shared objects
        self.keep = []  # keeps shared objects alive, so their ids stay theirs
        self.shared_ids = set()
        out.write(b"\x80\x04")

    def share(self, obj):
        self.shared_ids.add(id(obj))
        self.keep.append(obj)
        return obj

    # -- framing --
    def _commit(self, force=False):
        if self.frame and (len(self.frame) >= FRAME_TARGET or force):
            if len(self.frame) >= FRAME_MIN:
                self.out.write(b"\x95" + struct.pack("<Q", len(self.frame)))
            self.out.write(self.frame)
            self.frame = bytearray()

    def finish(self):
        self.frame += b"."
        self._commit(force=True)

    # -- memo --
    def _memoize(self, obj):
        self.frame += b"\x94"
        if id(obj) in self.shared_ids:
            self.memo[id(obj)] = self.memo_len
        self.memo_len += 1

    def _get(self, idx):
        if idx < 256:
            self.frame += b"h" + bytes([idx])
        else:
            self.frame += b"j" + struct.pack("<I", idx)

    # -- values --
    def save(self, obj):
        """pickle.py's save(): a frame may end before any object."""
        self._commit()
        # The fast path: an object whose whole encoding is known (memo references, small
        # values, fresh containers of them) and cannot cross a frame boundary is written
        # at once.
        fast = self._fast(obj)
        if fast is not None and len(self.frame) + len(fast[0]) < FRAME_TARGET:
            self.frame += fast[0]
            self.memo_len += fast[1]
            return
        idx = self.memo.get(id(obj))
        if idx is not None:
            self._get(idx)
        elif obj is None:
            self.frame += b"N"
        elif obj is True or obj is False:
            self.frame += b"\x88" if obj else b"\x89"
        elif isinstance(obj, int):
            self._int(obj)
        elif isinstance(obj, float):
            self.frame += b"G" + struct.pack(">d", obj)
        elif isinstance(obj, str):
            data = obj.encode("utf-8")
            if len(data) < 256:
                self.frame += b"\x8c" + bytes([len(data)]) + data
            else:
                self.frame += b"X" + struct.pack("<I", len(data)) + data
            self._memoize(obj)
        elif isinstance(obj, tuple):
            self._tuple(obj)
        elif isinstance(obj, dict):
            self.frame += b"}"
            self._memoize(obj)
            self._items(list(obj.items()), len(obj), dict_items=True)
        elif isinstance(obj, (list, Lazy)):
            self.frame += b"]"
            self._memoize(obj)
            self._items(iter(obj), len(obj), dict_items=False)
        else:
            raise TypeError(f"cannot stream {type(obj).__name__}")

    def _fast(self, obj):
        """(bytes, memo entries taken) of `obj` if known without writing, else None."""
        idx = self.memo.get(id(obj))
        if idx is not None:
            return _ref_bytes(idx), 0
        if isinstance(obj, bool) or obj is None:
            return (b"N" if obj is None else b"\x88" if obj else b"\x89"), 0
        if isinstance(obj, int):
            return _int_bytes(obj), 0
        if id(obj) in self.shared_ids or not isinstance(obj, (list, dict)):
            return None
        if len(obj) > BATCH:
            return None
        if isinstance(obj, list) and len(obj) > 1:
            # The common case, a frames list of shared frames, in one pass.
            refs = [self.memo.get(id(x)) for x in obj]
            if None not in refs:
                return b"]\x94(" + b"".join(map(_ref_bytes, refs)) + b"e", 1
        parts = []
        taken = 1
        for item in (x for kv in obj.items() for x in kv) if isinstance(obj, dict) else obj:
            sub = self._fast(item)
            if sub is None:
                return None
            parts.append(sub[0])
            taken += sub[1]
        head = b"}\x94" if isinstance(obj, dict) else b"]\x94"
        if not obj:
            return head, taken
        if len(obj) == 1:
            return head + b"".join(parts) + (b"s" if isinstance(obj, dict) else b"a"), taken
        return head + b"(" + b"".join(parts) + (b"u" if isinstance(obj, dict) else b"e"), taken

    def _int(self, v):
        self.frame += _int_bytes(v)


    def _tuple(self, t):
        if not t:
            self.frame += b")"
            return
        if len(t) <= 3:
            for item in t:
                self.save(item)
            self.frame += bytes([0x84 + len(t)])
        else:
            self.frame += b"("
            for item in t:
                self.save(item)
            self.frame += b"t"
        self._memoize(t)

    def _items(self, items, n, dict_items):
        if n == 0:
            return
        if n == 1:
            for item in items:
                self._save_item(item, dict_items)
            self.frame += b"s" if dict_items else b"a"
            return
        items = iter(items)
        done = 0
        while done < n:
            self.frame += b"("
            batch = 0
            while done < n and batch < BATCH:
                self._save_item(next(items), dict_items)
                done += 1
                batch += 1
            self.frame += b"u" if dict_items else b"e"

    def _save_item(self, item, dict_items):
        if dict_items:
            self.save(item[0])
            self.save(item[1])
        else:
            self.save(item)


class Lazy:
    """A list whose items are made as they are written (the million trace entries)."""

    def __init__(self, n, make):
        self.n = n
        self.make = make

    def __len__(self):
        return self.n

    def __iter__(self):
        return (self.make(i) for i in range(self.n))


def snapshot(args, share):
    """The snapshot as (mostly lazy) objects; `share` registers an object shared by identity."""
    rng = random.Random(args.seed)
    key = {k: share(k) for k in (
        "segments", "device_traces", "allocator_settings", "action", "addr", "size",
        "stream", "time_us", "compile_context", "user_metadata", "frames", "name",
        "filename", "line", "device", "address", "total_size", "allocated_size",
        "active_size", "requested_size", "segment_type", "segment_pool_id",
        "is_expandable", "blocks", "state")}
    action = {a: share(a) for a in (
        "alloc", "free_requested", "free_completed", "segment_alloc")}
    na, empty = share("N/A"), share("")
    # Literals of the snapshot code are one object each, as in Python.
    large, inactive, pool0 = share("large"), share("inactive"), share((0, 0))
    files = [share(f"site-packages/pkg{k}/module{k % 37}.py") for k in range(max(1, args.frames // 8))]
    frames = [
        share({key["name"]: share(f"function_{k}"), key["filename"]: files[k % len(files)],
               key["line"]: 1 + (k * 37) % 5000})
        for k in range(args.frames)
    ]
    stacks = [
        [rng.randrange(args.frames) for _ in range(args.depth)] for _ in range(args.stacks)
    ]
    shared_lists = [share([frames[f] for f in s]) for s in stacks] if args.stacks_shared else None
    # Training repeats itself: the call stacks of one step come back in the same order
    # every step.
    step = [rng.randrange(args.stacks) for _ in range(args.step)]

    def frames_of(stack):
        if shared_lists is not None:
            return shared_lists[stack]
        return [frames[f] for f in stacks[stack]]

    # The trace: allocations of a few sizes, freed mostly in LIFO order, on a few
    # streams, inside 1 GiB segments allocated as the bump pointer reaches them.
    segment_bytes = 1 << 30
    base = 0x7F0000000000
    state = {"bump": 0, "segments": 0, "time": 1_795_300_000_000_000, "pending": []}
    live = []
    free_addrs = {}
    sizes = [512, 4096, 65536, 1 << 20, 4 << 20, 16 << 20]
    streams = [0] * 12 + [0x5555A0000000 + k for k in range(1, 4)]

    def entry(act, addr, size, stream, stack):
        state["time"] += rng.randrange(1, 50)
        return {key["action"]: action[act], key["addr"]: addr, key["size"]: size,
                key["stream"]: stream, key["time_us"]: state["time"],
                key["compile_context"]: na, key["user_metadata"]: empty,
                key["frames"]: frames_of(stack)}

    def make(i):
        if state["pending"]:
            return state["pending"].pop()
        stack = step[i % len(step)]
        if live and (len(live) > 400 or rng.random() < 0.45):
            addr, size, stream = live.pop(rng.randrange(max(0, len(live) - 4), len(live)))
            free_addrs.setdefault(size, []).append(addr)
            # free_completed follows its free_requested.
            state["pending"].append(entry("free_completed", addr, size, stream, stack))
            return entry("free_requested", addr, size, stream, stack)
        size = rng.choice(sizes)
        stream = rng.choice(streams)
        reuse = free_addrs.get(size)
        if reuse:
            addr = reuse.pop()
        else:
            addr = base + state["bump"]
            state["bump"] += size
            if state["bump"] > state["segments"] * segment_bytes:
                seg = base + state["segments"] * segment_bytes
                state["segments"] += 1
                live.append((addr, size, stream))
                state["pending"].append(entry("alloc", addr, size, stream, stack))
                return entry("segment_alloc", seg, segment_bytes, stream, stack)
        live.append((addr, size, stream))
        return entry("alloc", addr, size, stream, stack)

    trace = Lazy(args.events, make)
    segments = [
        {key["device"]: 0, key["address"]: base + k * segment_bytes,
         key["total_size"]: segment_bytes, key["allocated_size"]: 0, key["active_size"]: 0,
         key["requested_size"]: 0, key["stream"]: 0, key["segment_type"]: large,
         key["segment_pool_id"]: pool0, key["is_expandable"]: False, key["frames"]: [],
         key["blocks"]: [{key["address"]: base + k * segment_bytes,
                          key["size"]: segment_bytes, key["requested_size"]: 0,
                          key["state"]: inactive, key["frames"]: []}]}
        for k in range(args.segments)
    ]
    return {key["segments"]: segments, key["device_traces"]: [trace],
            key["allocator_settings"]: {"PYTORCH_CUDA_ALLOC_CONF": "",
                                        "max_split_size": -1,
                                        "expandable_segments": False}}


def write(args, out):
    p = StreamPickler(out)
    p.save(snapshot(args, p.share))
    p.finish()


def materialise(snap):
    """The same objects with the lazy trace made a list (for `pickle.dumps`); shared
    objects stay the same objects."""
    for k, v in snap.items():
        if k == "device_traces":
            snap[k] = [list(t) for t in v]
    return snap


def self_check():
    """The streamed bytes equal pickle.dumps(protocol=4) of the same objects."""
    cases = [
        dict(events=0, depth=1, frames=1, stacks=1, segments=0, step=1),
        dict(events=1, depth=1, frames=3, stacks=2, segments=1, step=1),
        dict(events=2500, depth=5, frames=300, stacks=50, segments=3, step=700),
        dict(events=6000, depth=20, frames=2000, stacks=400, segments=2, step=5000),
    ]
    for case in cases:
        for shared in (False, True):
            args = argparse.Namespace(seed=7, stacks_shared=shared, **case)
            streamed = io.BytesIO()
            write(args, streamed)
            # The same objects, built whole: the pickler memoises by identity, as the
            # stream does for shared objects.
            keep = []
            obj = materialise(snapshot(args, lambda o: keep.append(o) or o))
            for dumps in (pickle.dumps, pickle._dumps):
                expected = dumps(obj, protocol=4)
                if streamed.getvalue() != expected:
                    at = next((i for i, (a, b) in enumerate(zip(streamed.getvalue(), expected))
                               if a != b), min(len(expected), len(streamed.getvalue())))
                    sys.exit(f"self-check failed for {case}, shared={shared}, "
                             f"{dumps.__name__}: first difference at byte {at}")
            assert pickle.loads(streamed.getvalue()) == obj
    print("self-check: streamed pickles equal pickle.dumps(protocol=4)")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("output", nargs="?", help="file to write (.gz: gzip-compressed)")
    ap.add_argument("--events", type=int, default=1_000_000)
    ap.add_argument("--depth", type=int, default=20, help="frames per call stack")
    ap.add_argument("--frames", type=int, default=2000, help="distinct frames")
    ap.add_argument("--stacks", type=int, default=20000, help="distinct call stacks")
    ap.add_argument("--step", type=int, default=5000,
                    help="events per training step (their stacks repeat every step)")
    ap.add_argument("--segments", type=int, default=8)
    ap.add_argument("--stacks-shared", action="store_true",
                    help="entries of one stack share one frames list")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--self-check", action="store_true")
    args = ap.parse_args()
    if args.self_check:
        self_check()
        return
    if not args.output:
        ap.error("an output file is required")
    if min(args.depth, args.frames, args.stacks, args.step) < 1:
        ap.error("--depth, --frames, --stacks and --step must be at least 1")
    if args.output.endswith(".gz"):
        f = gzip.open(args.output, "wb", compresslevel=6)
    else:
        f = open(args.output, "wb", buffering=1 << 20)
    with f:
        write(args, f)
    print(f"{args.output}: {args.events} events, depth {args.depth}, "
          f"{'shared' if args.stacks_shared else 'own'} frames lists")


if __name__ == "__main__":
    main()
