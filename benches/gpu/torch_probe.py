# streamalloc's PyTorch hooks, as a user would exercise them, with a 1 GiB limit
# (STREAMALLOC_CONF=memory_limit:1GiB):
# - out of memory: a 2 GiB request must raise an error carrying our report, and the
#   process must stay usable;
# - record_stream: Tensor.record_stream must reach us (an event is recorded at the free);
# - empty_cache and set_per_process_memory_fraction must reach us;
# - dump_snapshot writes our JSON.
#   STREAMALLOC_CONF=memory_limit:1GiB python torch_probe.py OUT.json
import json, os, sys
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "python"))
import torch
import streamalloc.torch
streamalloc.torch.install()
res = {}
raw = streamalloc.torch.raw_stats
a = torch.ones(256 << 20, dtype=torch.uint8, device="cuda")
try:
    b = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    res["oom_raised"] = None
    res["oom_tensor_data_ptr"] = b.data_ptr()
except Exception as e:
    res["oom_raised"] = type(e).__name__
    res["oom_message"] = str(e)[:300]
try:
    c = torch.ones(16 << 20, dtype=torch.uint8, device="cuda")
    res["usable_after_oom"] = int(c.sum().item()) == 16 << 20
except Exception as e:
    res["usable_after_oom"] = repr(e)[:200]
res["num_ooms"] = torch.cuda.memory_stats()["num_ooms"]

side = torch.cuda.Stream()
t = torch.ones(16 << 20, device="cuda")
side.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(side):
    u = t * 2
t.record_stream(side)
before = raw()["stats"]["events_recorded"]
del t
res["record_stream_events_at_free"] = raw()["stats"]["events_recorded"] - before
torch.cuda.synchronize()
del u, c, a

res["reserved_before_empty_cache"] = torch.cuda.memory_reserved()
torch.cuda.empty_cache()
res["reserved_after_empty_cache"] = torch.cuda.memory_reserved()
torch.cuda.set_per_process_memory_fraction(0.5)
res["limit_after_fraction_0.5_gib"] = raw()["memory_limit"] / 2**30
streamalloc.torch.dump_snapshot("/tmp/streamalloc_snapshot.json")
snap = json.load(open("/tmp/streamalloc_snapshot.json"))
res["snapshot"] = dict(segments=len(snap["segments"]), trace_entries=len(snap["trace"]), ooms=snap["stats"]["ooms"])
json.dump(res, open(sys.argv[1], "w")); print(json.dumps(res))
