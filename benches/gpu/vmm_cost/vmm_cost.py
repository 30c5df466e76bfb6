#!/usr/bin/env python3
"""Host cost of the CUDA virtual memory calls that expandable segments are made of.

    python3 benches/gpu/vmm_cost/vmm_cost.py [--reps N] [--device D]

Through the driver API alone (ctypes over libcuda.so.1, no PyTorch), on one GPU: the host
time of cuMemCreate, cuMemMap, cuMemSetAccess, cuMemUnmap and cuMemRelease for allocations
of 1, 8 and 64 pages (a page: the driver's minimum granularity, 2 MiB on current GPUs),
the median of --reps repetitions each, per call and per page; runs of --runs pages made of
one allocation per page, as the engine maps them while stitching is on (growth: create and
map each page, one access call; a stitch: each page mapped again, one access call), timed
whole (a fifth of --reps repetitions, at least 3). Then the cost of mapping an
existing allocation a second time, whole, into another reserved range (cuMemMap +
cuMemSetAccess): what stitching free pages into one range costs. (Drivers refuse a second
mapping of part of an allocation or at a non-zero offset, CUDA_ERROR_NOT_SUPPORTED; the
script records whether this one does.) That second mapping is checked: bytes written through the first mapping are read back through the
second, and still read back after the first mapping is unmapped and its handle released
(the allocation lives while any mapping of it remains).

The times include the ctypes call itself; the "ctypes floor" row (cuDriverGetVersion)
says how much that is; "exportable" rows repeat one page with requestedHandleTypes = POSIX
file descriptor, as the engine creates pages where the device can export them. One
markdown table is printed last, with date, GPU and command. Exit status 1 if a second
mapping read back other bytes than were written, 2 if the driver is missing or a call failed.
"""

import argparse
import ctypes
import datetime
import os
import statistics
import sys
import time

# cuda.h (CUDA 12 and 13): CUmemAllocationProp is 32 bytes, CUmemAccessDesc 12.
CU_MEM_ALLOCATION_TYPE_PINNED = 1
CU_MEM_LOCATION_TYPE_DEVICE = 1
CU_MEM_HANDLE_TYPE_NONE = 0
CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR = 1
CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 3
CU_MEM_ALLOC_GRANULARITY_MINIMUM = 0

CUdeviceptr = ctypes.c_ulonglong  # unsigned long long on 64-bit hosts
CUmemGenericAllocationHandle = ctypes.c_ulonglong


class CUmemLocation(ctypes.Structure):
    # { CUmemLocationType type; int id; } (in CUDA 13.4 id shares a 4-byte union)
    _fields_ = [("type", ctypes.c_uint), ("id", ctypes.c_int)]


class CUmemAllocFlags(ctypes.Structure):
    _fields_ = [("compressionType", ctypes.c_ubyte), ("gpuDirectRDMACapable", ctypes.c_ubyte),
                ("usage", ctypes.c_ushort), ("reserved", ctypes.c_ubyte * 4)]


class CUmemAllocationProp(ctypes.Structure):
    _fields_ = [("type", ctypes.c_uint), ("requestedHandleTypes", ctypes.c_uint),
                ("location", CUmemLocation), ("win32HandleMetaData", ctypes.c_void_p),
                ("allocFlags", CUmemAllocFlags)]


class CUmemAccessDesc(ctypes.Structure):
    _fields_ = [("location", CUmemLocation), ("flags", ctypes.c_uint)]


def check_layouts():
    """The struct layouts of cuda.h; a mismatch would hand the driver garbage."""
    expected = [
        (ctypes.sizeof(CUmemLocation), 8), (ctypes.sizeof(CUmemAllocFlags), 8),
        (ctypes.sizeof(CUmemAllocationProp), 32), (CUmemAllocationProp.location.offset, 8),
        (CUmemAllocationProp.win32HandleMetaData.offset, 16), (CUmemAllocationProp.allocFlags.offset, 24),
        (ctypes.sizeof(CUmemAccessDesc), 12), (CUmemAccessDesc.flags.offset, 8),
        (ctypes.sizeof(CUdeviceptr), 8), (ctypes.sizeof(ctypes.c_size_t), 8),
    ]
    for got, want in expected:
        if got != want:
            die(f"unexpected ctypes layout ({got} != {want}); needs a 64-bit host")


def die(message):
    print(f"vmm_cost: {message}", file=sys.stderr)
    sys.exit(2)


class CudaError(RuntimeError):
    pass


class Driver:
    """The driver calls used here, each with its exact C argument types."""

    SIGNATURES = {
        "cuInit": [ctypes.c_uint],
        "cuDriverGetVersion": [ctypes.POINTER(ctypes.c_int)],
        "cuDeviceGet": [ctypes.POINTER(ctypes.c_int), ctypes.c_int],
        "cuDeviceGetName": [ctypes.c_char_p, ctypes.c_int, ctypes.c_int],
        "cuDevicePrimaryCtxRetain": [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int],
        "cuDevicePrimaryCtxRelease": [ctypes.c_int],
        "cuCtxSetCurrent": [ctypes.c_void_p],
        "cuCtxSynchronize": [],
        "cuGetErrorName": [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)],
        "cuMemGetAllocationGranularity": [ctypes.POINTER(ctypes.c_size_t), ctypes.POINTER(CUmemAllocationProp),
                                          ctypes.c_uint],
        "cuMemAddressReserve": [ctypes.POINTER(CUdeviceptr), ctypes.c_size_t, ctypes.c_size_t, CUdeviceptr,
                                ctypes.c_ulonglong],
        "cuMemAddressFree": [CUdeviceptr, ctypes.c_size_t],
        "cuMemCreate": [ctypes.POINTER(CUmemGenericAllocationHandle), ctypes.c_size_t,
                        ctypes.POINTER(CUmemAllocationProp), ctypes.c_ulonglong],
        "cuMemRelease": [CUmemGenericAllocationHandle],
        "cuMemMap": [CUdeviceptr, ctypes.c_size_t, ctypes.c_size_t, CUmemGenericAllocationHandle,
                     ctypes.c_ulonglong],
        "cuMemUnmap": [CUdeviceptr, ctypes.c_size_t],
        "cuMemSetAccess": [CUdeviceptr, ctypes.c_size_t, ctypes.POINTER(CUmemAccessDesc), ctypes.c_size_t],
        "cuMemsetD32": [CUdeviceptr, ctypes.c_uint, ctypes.c_size_t],
        "cuMemcpyHtoD": [CUdeviceptr, ctypes.c_void_p, ctypes.c_size_t],
        "cuMemcpyDtoH": [ctypes.c_void_p, CUdeviceptr, ctypes.c_size_t],
    }
    # cuda.h maps these names onto versioned symbols (#define cuMemsetD32 cuMemsetD32_v2, ...).
    VERSIONED = {"cuDevicePrimaryCtxRelease": "_v2", "cuMemsetD32": "_v2", "cuMemcpyHtoD": "_v2",
                 "cuMemcpyDtoH": "_v2"}

    def __init__(self):
        try:
            self.lib = ctypes.CDLL("libcuda.so.1")
        except OSError as err:
            die(f"cannot load libcuda.so.1 (no NVIDIA driver here?): {err}")
        self.fns = {}
        for name, argtypes in self.SIGNATURES.items():
            symbol = name + self.VERSIONED.get(name, "")
            try:
                fn = getattr(self.lib, symbol)
            except AttributeError:
                die(f"libcuda.so.1 has no {symbol}")
            fn.argtypes, fn.restype = argtypes, ctypes.c_int
            self.fns[name] = fn

    def raw(self, name):
        """The bare function, for timing without the checking wrapper around it."""
        return self.fns[name]

    def error_name(self, code):
        text = ctypes.c_char_p()
        if self.fns["cuGetErrorName"](code, ctypes.byref(text)) == 0 and text.value:
            return text.value.decode()
        return f"CUresult {code}"

    def check(self, name, code):
        if code != 0:
            raise CudaError(f"{name} failed: {self.error_name(code)} ({code})")

    def __call__(self, name, *args):
        self.check(name, self.fns[name](*args))


def median_us(samples_ns):
    return statistics.median(samples_ns) / 1e3


def quantile_us(samples_ns, q):
    ordered = sorted(samples_ns)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] / 1e3


class Bench:
    def __init__(self, cu, device, reps):
        self.cu, self.device, self.reps = cu, device, reps
        self.prop = self.allocation_prop(CU_MEM_HANDLE_TYPE_NONE)
        self.access = CUmemAccessDesc()
        self.access.location.type = CU_MEM_LOCATION_TYPE_DEVICE
        self.access.location.id = device
        self.access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        granularity = ctypes.c_size_t()
        cu("cuMemGetAllocationGranularity", ctypes.byref(granularity), ctypes.byref(self.prop),
           CU_MEM_ALLOC_GRANULARITY_MINIMUM)
        self.page = granularity.value
        self.reserved = []  # (address, bytes) to free at the end
        self.rows = []  # (operation, pages, samples in ns)

    def allocation_prop(self, handle_types):
        prop = CUmemAllocationProp()  # zeroed: win32HandleMetaData NULL, allocFlags 0
        prop.type = CU_MEM_ALLOCATION_TYPE_PINNED
        prop.requestedHandleTypes = handle_types
        prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = self.device
        return prop

    def reserve(self, nbytes):
        va = CUdeviceptr()
        self.cu("cuMemAddressReserve", ctypes.byref(va), nbytes, self.page, 0, 0)
        self.reserved.append((va.value, nbytes))
        return va.value

    def free_reservations(self):
        while self.reserved:
            va, nbytes = self.reserved.pop()
            self.cu("cuMemAddressFree", va, nbytes)

    def create(self, nbytes, prop=None):
        handle = CUmemGenericAllocationHandle()
        self.cu("cuMemCreate", ctypes.byref(handle), nbytes, ctypes.byref(prop or self.prop), 0)
        return handle.value

    def timed(self, name, *args):
        fn = self.cu.raw(name)
        t0 = time.perf_counter_ns()
        code = fn(*args)
        t1 = time.perf_counter_ns()
        self.cu.check(name, code)
        return t1 - t0

    def ctypes_floor(self):
        version = ctypes.c_int()
        samples = [self.timed("cuDriverGetVersion", ctypes.byref(version)) for _ in range(self.reps + 3)][3:]
        self.rows.append(("ctypes floor (cuDriverGetVersion)", 0, samples))

    def lifecycle(self, pages, prop=None, label=""):
        """create, map, set access, unmap, release of one allocation of `pages` pages."""
        nbytes = pages * self.page
        va = self.reserve(nbytes)
        prop = prop or self.prop
        times = {k: [] for k in ("cuMemCreate", "cuMemMap", "cuMemSetAccess", "cuMemUnmap", "cuMemRelease")}
        for rep in range(self.reps + 3):  # the first three are warm-up
            handle = CUmemGenericAllocationHandle()
            t = {"cuMemCreate": self.timed("cuMemCreate", ctypes.byref(handle), nbytes, ctypes.byref(prop), 0)}
            try:
                t["cuMemMap"] = self.timed("cuMemMap", va, nbytes, 0, handle.value, 0)
                try:
                    t["cuMemSetAccess"] = self.timed("cuMemSetAccess", va, nbytes, ctypes.byref(self.access), 1)
                finally:
                    t["cuMemUnmap"] = self.timed("cuMemUnmap", va, nbytes)
            finally:
                t["cuMemRelease"] = self.timed("cuMemRelease", handle.value)
            if rep >= 3:
                for k, v in t.items():
                    times[k].append(v)
        for k, v in times.items():
            self.rows.append((k + label, pages, v))

    def second_mapping(self, pages, offset_pages, mapped_pages):
        """Maps `mapped_pages` of a `pages`-page allocation, from page `offset_pages`, into a
        second range while the first mapping stays: timed map + set access, then checked."""
        page = self.page
        first_bytes, second_bytes, offset = pages * page, mapped_pages * page, offset_pages * page
        if offset_pages < 0 or offset_pages + mapped_pages > pages:
            raise ValueError(f"offset {offset_pages} + {mapped_pages} pages do not fit {pages}")
        va1, va2 = self.reserve(first_bytes), self.reserve(second_bytes)
        handle = self.create(first_bytes)
        released = False
        try:
            self.cu("cuMemMap", va1, first_bytes, 0, handle, 0)
            self.cu("cuMemSetAccess", va1, first_bytes, ctypes.byref(self.access), 1)
            maps, accesses = [], []
            for rep in range(self.reps + 3):
                m = self.timed("cuMemMap", va2, second_bytes, offset, handle, 0)
                a = self.timed("cuMemSetAccess", va2, second_bytes, ctypes.byref(self.access), 1)
                self.cu("cuMemUnmap", va2, second_bytes)
                if rep >= 3:
                    maps.append(m)
                    accesses.append(a)
            where = f" (2nd mapping, offset {offset_pages} of {pages} pages)"
            self.rows.append(("cuMemMap" + where, mapped_pages, maps))
            self.rows.append(("cuMemSetAccess" + where, mapped_pages, accesses))
            self.rows.append(("cuMemMap + cuMemSetAccess" + where, mapped_pages,
                              [m + a for m, a in zip(maps, accesses)]))

            # The check: a second mapping that stays, read through after the first is gone.
            self.cu("cuMemMap", va2, second_bytes, offset, handle, 0)
            self.cu("cuMemSetAccess", va2, second_bytes, ctypes.byref(self.access), 1)
            pattern = os.urandom(first_bytes)
            self.cu("cuMemcpyHtoD", va1, pattern, first_bytes)
            marker = 0x5A17C0DE
            self.cu("cuMemsetD32", va1 + offset, marker, page // 4)  # first page seen by va2
            self.cu("cuCtxSynchronize")
            expected = bytearray(pattern[offset:offset + second_bytes])
            expected[:page] = marker.to_bytes(4, "little") * (page // 4)
            read = ctypes.create_string_buffer(second_bytes)
            self.cu("cuMemcpyDtoH", read, va2, second_bytes)
            same_while_both = read.raw == bytes(expected)
            self.cu("cuMemUnmap", va1, first_bytes)
            self.cu("cuMemRelease", handle)
            released = True
            read = ctypes.create_string_buffer(second_bytes)
            self.cu("cuMemcpyDtoH", read, va2, second_bytes)
            same_after_release = read.raw == bytes(expected)
            self.cu("cuMemUnmap", va2, second_bytes)
        except Exception:
            if not released:
                self.cu.raw("cuMemUnmap")(va1, first_bytes)
                self.cu.raw("cuMemRelease")(handle)
            self.cu.raw("cuMemUnmap")(va2, second_bytes)
            raise
        return (f"{mapped_pages} pages at offset {offset_pages} of {pages}: read through the 2nd mapping "
                f"{'ok' if same_while_both else 'MISMATCH'}, after unmap + release of the 1st "
                f"{'ok' if same_after_release else 'MISMATCH'}"), same_while_both and same_after_release

    def page_runs(self, pages, prop=None, label=""):
        """What the engine does with one allocation per page: a run of `pages` pages, each
        created and mapped on its own, access granted to the run at once (growth); the same
        allocations mapped a second time back to back into another range, with one access
        call (a stitch); both unmapped, the pages released. Whole runs timed, per run."""
        nbytes = pages * self.page
        va1, va2 = self.reserve(nbytes), self.reserve(nbytes)
        prop = prop or self.prop
        keys = ("grow: cuMemCreate + cuMemMap per page, one cuMemSetAccess",
                "stitch: cuMemMap per page, one cuMemSetAccess",
                "unmap the stitch (one cuMemUnmap)", "unmap the run (cuMemUnmap per page)",
                "cuMemRelease per page")
        times = {k: [] for k in keys}
        reps = max(3, self.reps // 5)
        for rep in range(reps + 1):  # the first is warm-up
            handles, t = [], {}
            t0 = time.perf_counter_ns()
            for i in range(pages):
                handles.append(self.create(self.page, prop))
                self.cu("cuMemMap", va1 + i * self.page, self.page, 0, handles[-1], 0)
            self.cu("cuMemSetAccess", va1, nbytes, ctypes.byref(self.access), 1)
            t1 = time.perf_counter_ns()
            for i, handle in enumerate(handles):
                self.cu("cuMemMap", va2 + i * self.page, self.page, 0, handle, 0)
            self.cu("cuMemSetAccess", va2, nbytes, ctypes.byref(self.access), 1)
            t2 = time.perf_counter_ns()
            self.cu("cuMemUnmap", va2, nbytes)
            t3 = time.perf_counter_ns()
            for i in range(pages):
                self.cu("cuMemUnmap", va1 + i * self.page, self.page)
            t4 = time.perf_counter_ns()
            for handle in handles:
                self.cu("cuMemRelease", handle)
            t5 = time.perf_counter_ns()
            if rep >= 1:
                for k, v in zip(keys, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4)):
                    times[k].append(v)
        for k, v in times.items():
            self.rows.append((f"{k}, a run{label}", pages, v))

    def partial_second_mapping(self):
        """Whether the driver maps part of an allocation (page 1 of 2) a second time."""
        page = self.page
        va1, va2 = self.reserve(2 * page), self.reserve(page)
        handle = self.create(2 * page)
        try:
            self.cu("cuMemMap", va1, 2 * page, 0, handle, 0)
            code = self.cu.raw("cuMemMap")(va2, page, page, handle, 0)
            if code == 0:
                self.cu("cuMemUnmap", va2, page)
            self.cu("cuMemUnmap", va1, 2 * page)
        finally:
            self.cu("cuMemRelease", handle)
        return "part of an allocation (page 1 of 2): " + ("mapped" if code == 0 else f"refused (error {code})")

    def exportable_supported(self):
        prop = self.allocation_prop(CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)
        handle = CUmemGenericAllocationHandle()
        code = self.cu.raw("cuMemCreate")(ctypes.byref(handle), self.page, ctypes.byref(prop), 0)
        if code != 0:
            return None
        self.cu("cuMemRelease", handle.value)
        return prop


def table(rows, page):
    mib = page / 2**20
    lines = [f"| operation | pages of {mib:g} MiB | µs / call (median) | µs / page | p10 - p90 µs / call |",
             "| --- | ---: | ---: | ---: | ---: |"]
    for name, pages, samples in rows:
        med = median_us(samples)
        per_page = f"{med / pages:.2f}" if pages else "-"
        lines.append(f"| {name} | {pages or '-'} | {med:.2f} | {per_page} | "
                     f"{quantile_us(samples, 0.1):.2f} - {quantile_us(samples, 0.9):.2f} |")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=50, help="timed repetitions per measurement (50)")
    parser.add_argument("--device", type=int, default=0, help="CUDA device ordinal (0)")
    parser.add_argument("--sizes", default="1,8,64", help="allocation sizes in pages (1,8,64)")
    parser.add_argument("--runs", default="64,512",
                        help="runs of one-page allocations, in pages (64,512; empty: none)")
    args = parser.parse_args()
    if args.reps < 1:
        parser.error("--reps must be at least 1")
    try:
        sizes = [int(s) for s in args.sizes.split(",")]
    except ValueError:
        parser.error(f"--sizes: not a comma-separated list of integers: {args.sizes!r}")
    if any(s < 1 for s in sizes):
        parser.error("--sizes: every size must be at least 1 page")
    try:
        runs = [int(s) for s in args.runs.split(",") if s.strip()]
    except ValueError:
        parser.error(f"--runs: not a comma-separated list of integers: {args.runs!r}")
    if any(r < 1 for r in runs):
        parser.error("--runs: every run must be at least 1 page")
    check_layouts()
    command = "python3 " + " ".join([os.path.relpath(sys.argv[0])] + sys.argv[1:])
    t_start = time.monotonic()

    cu = Driver()
    cu("cuInit", 0)
    version = ctypes.c_int()
    cu("cuDriverGetVersion", ctypes.byref(version))
    dev = ctypes.c_int()
    cu("cuDeviceGet", ctypes.byref(dev), args.device)
    name = ctypes.create_string_buffer(256)
    cu("cuDeviceGetName", name, len(name), dev.value)
    ctx = ctypes.c_void_p()
    cu("cuDevicePrimaryCtxRetain", ctypes.byref(ctx), dev.value)
    bench = Bench(cu, args.device, args.reps)
    checks, all_ok = [], True
    try:
        cu("cuCtxSetCurrent", ctx)
        bench.ctypes_floor()
        for pages in sizes:
            bench.lifecycle(pages)
        exportable = bench.exportable_supported()
        if exportable is not None:
            bench.lifecycle(1, exportable, " (exportable: POSIX fd)")
        for pages in runs:
            bench.page_runs(pages)
        if exportable is not None and runs:
            bench.page_runs(runs[-1], exportable, " (exportable: POSIX fd)")
        checks.append(bench.partial_second_mapping())
        for pages, offset, mapped in ((1, 0, 1), (8, 0, 8), (64, 0, 64)):
            note, ok = bench.second_mapping(pages, offset, mapped)
            checks.append(note)
            all_ok &= ok
    finally:
        bench.free_reservations()
        cu("cuDevicePrimaryCtxRelease", dev.value)

    drv = f"{version.value // 1000}.{version.value % 1000 // 10}"
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    print(f"CUDA virtual memory calls, host time per call: {date}; {name.value.decode()} (device "
          f"{args.device}), driver API {drv}, page {bench.page / 2**20:g} MiB (minimum granularity); "
          f"{args.reps} timed repetitions after 3 warm-up; command: {command}")
    print("second mappings: " + "; ".join(checks))
    print(f"wall {time.monotonic() - t_start:.1f} s")
    print()
    print(table(bench.rows, bench.page))
    return 0 if all_ok else 1


if __name__ == "__main__":
    try:
        sys.exit(main())
    except CudaError as err:
        die(str(err))
