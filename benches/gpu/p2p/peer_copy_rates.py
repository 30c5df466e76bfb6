# Peer copies GPU 0 -> GPU 1 with the driver's cuMemcpyDtoDAsync, back to back, by chunk size and
# number of streams, one way and both ways at once: what the copy engines give without the
# exchange's flags and unpacking around them. Two GPUs with peer access:
#   python3 benches/gpu/p2p/peer_copy_rates.py
import ctypes, time, torch
cuda = ctypes.CDLL("libcuda.so.1")
memcpy = cuda.cuMemcpyDtoDAsync_v2
memcpy.argtypes = [ctypes.c_uint64, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p]
TOTAL = 640 << 20
a = torch.empty(TOTAL, dtype=torch.uint8, device="cuda:0")
b = torch.empty(TOTAL, dtype=torch.uint8, device="cuda:1")
a2 = torch.empty(TOTAL, dtype=torch.uint8, device="cuda:1")
b2 = torch.empty(TOTAL, dtype=torch.uint8, device="cuda:0")
b[:1 << 20].copy_(a[:1 << 20]); b2[:1 << 20].copy_(a2[:1 << 20]); torch.cuda.synchronize(0); torch.cuda.synchronize(1)
def run(chunk, nstreams, both=False, reps=5):
    streams0 = [torch.cuda.Stream(device=0) for _ in range(nstreams)]
    streams1 = [torch.cuda.Stream(device=1) for _ in range(nstreams)]
    best = 1e9
    for _ in range(reps):
        for d in (0, 1): torch.cuda.synchronize(d)
        t = time.perf_counter()
        n = TOTAL // chunk
        for i in range(n):
            s = streams0[i % nstreams]
            rc = memcpy(b.data_ptr() + i * chunk, a.data_ptr() + i * chunk, chunk, ctypes.c_void_p(s.cuda_stream))
            assert rc == 0, rc
            if both:
                s1 = streams1[i % nstreams]
                rc = memcpy(b2.data_ptr() + i * chunk, a2.data_ptr() + i * chunk, chunk, ctypes.c_void_p(s1.cuda_stream))
                assert rc == 0, rc
        for d in (0, 1): torch.cuda.synchronize(d)
        best = min(best, time.perf_counter() - t)
    return TOTAL / best / 1e9
print("chunk MiB | streams | one way GB/s | each way, both at once GB/s")
for chunk_mib in (8, 16, 32, 64, 640):
    for ns in (1, 2, 4):
        if chunk_mib == 640 and ns > 1: continue
        print(f"{chunk_mib} | {ns} | {run(chunk_mib << 20, ns):.0f} | {run(chunk_mib << 20, ns, both=True):.0f}", flush=True)
