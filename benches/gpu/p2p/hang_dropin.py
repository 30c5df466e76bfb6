# multi_tensor_hang.py (a user's reproduction of the many-tensor hang: every rank sends
# T[i][j] one-element tensors to every rank j, itself included, in one batch_isend_irecv),
# with one import changed: `from streamalloc.p2p import batch_isend_irecv`. Random and
# sorted order, T x1, x100 and x1000 (T = 1 + randperm(N*N), times the factor), two
# iterations each as in the reproduction (a new T each), then the second T again with fresh
# tensors (the cached agreement). Every received value is checked and the staging the
# exchange holds must stay within the budget. Beside each, an Exchange over the same lists
# (agreed and run once, then run again): each drop-in iteration must take at most twice the
# Exchange's time for the same work (a new T, as in the reproduction: its agreement and run;
# printed apart, the cached T against its steady run). Also: a list that does not match on
# one rank and an invalid list raise the same P2PError on every rank; empty lists work; the
# drop-in keeps none of the caller's tensors once they are dropped (device memory comes back).
#   torchrun --nproc-per-node N benches/gpu/p2p/hang_dropin.py [--budget-mib 128] [--json OUT]
# Rank 0 prints one table; the exit status is non-zero on any failure.
import argparse
import json
import os
import random
import sys
import time
from collections import defaultdict

import torch
from torch import distributed as dist

from streamalloc import p2p
from streamalloc.p2p import batch_isend_irecv


def send_recv(rank, world, T, shuffle):
    """The reproduction's random_send_recv / sorted_send_recv."""
    send_ops = []
    for j in range(world):
        for _ in range(T[rank][j]):
            send_ops.append(dist.P2POp(dist.isend, torch.ones(1, device="cuda") * (rank + 1) * (j + 1),
                                       peer=j))
    recv_ops = []
    recv_datas = defaultdict(list)
    for j in range(world):
        for _ in range(T[j][rank]):
            recv_datas[j].append(torch.empty(1, device="cuda"))
            recv_ops.append(dist.P2POp(dist.irecv, recv_datas[j][-1], peer=j))
    if shuffle:
        random.shuffle(send_ops)
        random.shuffle(recv_ops)
    return recv_datas, send_ops + recv_ops


def landed(rank, datas):
    return all(not bool((torch.stack(data_list) != (rank + 1) * (src + 1)).any())
               for src, data_list in datas.items())


def held_staging():
    """Staging bytes the drop-in's cached exchanges hold (device memory, at most the budget
    each)."""
    state = p2p._GROUPS.get(None)
    return max((ex.staging_bytes for ex in state.exchanges.values()), default=0) if state else 0


def timed_call(ops):
    torch.cuda.synchronize()
    dist.barrier()
    t0 = time.perf_counter()
    for req in batch_isend_irecv(ops, budget_mib=ARGS.budget_mib):
        req.wait()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def release_dropin():
    state = p2p._GROUPS.get(None)
    while state is not None and state.exchanges:  # the same order on every rank
        state.exchanges.pop(next(iter(state.exchanges))).release()


def exchange_times(rank, world, T):
    """An Exchange over the lists of `T` (the reproduction's tensors, as dicts): seconds of
    its agreement and first run, and of a steady run (median of 3)."""
    sends = {j: [torch.ones(1, device="cuda") * (rank + 1) * (j + 1) for _ in range(T[rank][j])]
             for j in range(world) if T[rank][j]}
    recvs = {j: [torch.empty(1, device="cuda") for _ in range(T[j][rank])]
             for j in range(world) if T[j][rank]}
    torch.cuda.synchronize()
    dist.barrier()
    t0 = time.perf_counter()
    ex = p2p.Exchange(sends, recvs, budget_mib=ARGS.budget_mib)
    ex.run()
    torch.cuda.synchronize()
    first = time.perf_counter() - t0
    steady = []
    for _ in range(3):
        dist.barrier()
        t0 = time.perf_counter()
        ex.run()
        torch.cuda.synchronize()
        steady.append(time.perf_counter() - t0)
    ok = landed(rank, recvs)
    ex.release()
    return dict(exchange_first_s=first, exchange_steady_s=sorted(steady)[1], exchange_ok=ok)


def memory_returns(rank, world):
    """The drop-in keeps none of the caller's tensors: after it agrees on a new shape (1 MiB
    tensors, 16 MiB per peer each way, a 4 MiB budget) and after it reuses that shape, once
    the caller drops its ops, works and tensors, device memory is back where it was but for
    the exchange's own staging and copy table. Returns (ok, MiB left beyond those once the
    shape was new, MiB added once it was reused)."""
    def call():
        sends = [dist.P2POp(dist.isend,
                            torch.full((2**18,), float(rank * world + j), device="cuda"), j)
                 for j in range(world) for _ in range(16)]
        recvs = [torch.empty(2**18, device="cuda") for j in range(world) for _ in range(16)]
        ops = sends + [dist.P2POp(dist.irecv, t, j // 16) for j, t in enumerate(recvs)]
        works = batch_isend_irecv(ops, budget_mib=4)
        for work in works:
            work.wait()
        ok = all(bool((t == float((j // 16) * world + rank)).all()) for j, t in enumerate(recvs))
        del ops, sends, recvs, works, work
        torch.cuda.synchronize()
        return ok

    release_dropin()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    ok = call()
    state = p2p._GROUPS.get(None)
    ex = next(reversed(state.exchanges.values()))
    own = ex.staging_bytes  # its staging buffers and its copy table
    after_first = torch.cuda.memory_allocated() - base - own
    ok &= call()
    after_cached = torch.cuda.memory_allocated() - base - own
    release_dropin()
    # The allocator rounds each block: a MiB of slack for the staging and the table.
    return (ok and after_first <= 2**20 and after_cached <= after_first,
            after_first / 2**20, (after_cached - after_first) / 2**20)


def same_error_everywhere(rank, world, needle, call):
    try:
        call()
        message = None
    except p2p.P2PError as err:
        message = str(err)
    messages = [None] * world
    dist.all_gather_object(messages, message)
    return messages[0] is not None and needle in messages[0] and len(set(messages)) == 1, messages[0]


def main():
    rank, world = dist.get_rank(), dist.get_world_size()
    budget = int(ARGS.budget_mib * 2**20)
    rows = []
    for mode in ("random", "sorted"):
        for factor in (1, 100, 1000):
            torch.manual_seed(42)
            random.seed(1234 + rank)
            row = dict(mode=mode, factor=factor, ok=True)
            shapes = []
            for i in range(2):
                T = ((1 + torch.randperm(world ** 2)) * factor).reshape(world, -1).tolist()
                shapes.append(T)
                datas, ops = send_recv(rank, world, T, mode == "random")
                seconds = timed_call(ops)
                row["ok"] &= landed(rank, datas)
                row[f"iter{i}_s"] = seconds
            row["ops_per_rank"] = len(ops)
            # The second T again, fresh tensors: the agreed exchange is reused.
            random.seed(99 + rank)
            datas, ops = send_recv(rank, world, shapes[1], mode == "random")
            row["cached_s"] = timed_call(ops)
            row["ok"] &= landed(rank, datas)
            row["staging_bytes"] = held_staging()
            row["ok"] &= row["staging_bytes"] <= budget
            row["transport"] = next(reversed(p2p._GROUPS[None].exchanges.values())).transport
            release_dropin()
            row.update(exchange_times(rank, world, shapes[1]))
            row["ok"] &= row.pop("exchange_ok")
            rows.append(row)
            del datas, ops
            if rank == 0:
                print("done:", json.dumps(row), flush=True)

    errors = {}
    # A list that does not match: the last rank drops one of its sends.
    def mismatched():
        T = [[2] * world for _ in range(world)]
        _, ops = send_recv(rank, world, T, False)
        if rank == world - 1:
            ops = ops[1:]
        batch_isend_irecv(ops, budget_mib=ARGS.budget_mib)

    errors["a missing send on one rank"] = same_error_everywhere(rank, world, "mismatch", mismatched)

    def invalid():
        bad = torch.ones(4, 4, device="cuda").t()  # not contiguous
        peer = (rank + 1) % world
        ops = [dist.P2POp(dist.isend, bad if rank == 0 else torch.ones(4, 4, device="cuda"), peer),
               dist.P2POp(dist.irecv, torch.empty(4, 4, device="cuda"), (rank - 1) % world)]
        batch_isend_irecv(ops)

    errors["a non-contiguous tensor on rank 0"] = same_error_everywhere(
        rank, world, "not contiguous", invalid)
    empty_ok = batch_isend_irecv([]) == []
    memory = memory_returns(rank, world)
    # After the errors, the group still works.
    T = [[3] * world for _ in range(world)]
    datas, ops = send_recv(rank, world, T, True)
    for req in batch_isend_irecv(ops):
        req.wait()
    after_ok = landed(rank, datas)

    everyone = [None] * world
    dist.all_gather_object(everyone, dict(rows=rows, errors={k: v[0] for k, v in errors.items()},
                                          empty_ok=empty_ok, after_ok=after_ok, memory=memory))
    if rank != 0:
        return 0
    failed = 0
    print()
    print(f"multi_tensor_hang pattern through streamalloc.p2p.batch_isend_irecv, {world} ranks, "
          f"budget {ARGS.budget_mib} MiB; slowest rank; 'ok' = every value checked on every rank "
          "and staging within the budget")
    print("| order | T x | ops/rank | iter 0 (agree + run) | iter 1 (new T) | same T again | "
          "Exchange first / steady | new T / Exchange first | same T / Exchange steady | "
          "staging held | transport | ok |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for k, row in enumerate(rows):
        per = [r["rows"][k] for r in everyone]
        ok = all(p["ok"] for p in per)
        failed += not ok
        ms = lambda key: max(p[key] for p in per) * 1e3
        # A new T means agreeing for both (the reproduction's iterations); the same T again
        # is a steady run for both.
        new_t = max(ms("iter0_s"), ms("iter1_s")) / ms("exchange_first_s")
        same_t = ms("cached_s") / ms("exchange_steady_s")
        for p in per:
            p["ratio_new_t"], p["ratio_same_t"] = new_t, same_t
        print(f"| {row['mode']} | {row['factor']} | {max(p['ops_per_rank'] for p in per):,} "
              f"| {ms('iter0_s'):.1f} ms | {ms('iter1_s'):.1f} ms | {ms('cached_s'):.1f} ms "
              f"| {ms('exchange_first_s'):.1f} / {ms('exchange_steady_s'):.1f} ms | {new_t:.2f}x "
              f"| {same_t:.2f}x "
              f"| {max(p['staging_bytes'] for p in per) / 2**20:.1f} MiB | {row['transport']} "
              f"| {'ok' if ok else 'FAIL'} |")
    for name in errors:
        ok = all(r["errors"][name] for r in everyone)
        failed += not ok
        print(f"{name}: the same P2PError on every rank: {'ok' if ok else 'FAIL'}")
    ok = all(r["empty_ok"] for r in everyone) and all(r["after_ok"] for r in everyone)
    failed += not ok
    print(f"empty lists, and a run after the errors: {'ok' if ok else 'FAIL'}")
    ok = all(r["memory"][0] for r in everyone)
    failed += not ok
    print("the drop-in keeps none of the caller's tensors (device memory back after a new and "
          f"a reused shape): {'ok' if ok else 'FAIL'} (left beyond its staging: "
          f"{max(r['memory'][1] for r in everyone):.1f} MiB after the new shape, "
          f"{max(r['memory'][2] for r in everyone):+.1f} MiB after the reused one)")
    if ARGS.json:
        with open(ARGS.json, "w") as f:
            json.dump(everyone, f, indent=1)
    print("hang_dropin:", "all passed" if not failed else f"{failed} FAILED")
    return 1 if failed else 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--budget-mib", type=float, default=128)
    parser.add_argument("--json", default=None)
    ARGS = parser.parse_args()
    torch.cuda.set_device(int(os.getenv("LOCAL_RANK", "0")))
    dist.init_process_group(backend="nccl")
    rc = main()
    codes = [None] * dist.get_world_size()
    dist.all_gather_object(codes, rc)
    dist.destroy_process_group()
    sys.exit(max(codes))
