// The native PyTorch door: streamalloc as PyTorch's CUDA allocator, plugged in the way
// PyTorch's own cudaMallocAsync backend is (a CUDAAllocator stored into
// c10::cuda::CUDACachingAllocator::allocator), so that every question PyTorch asks its
// allocator (statistics, snapshots, pools for CUDA graphs and MemPool, checkpoints, IPC)
// reaches streamalloc instead of failing as it does through CUDAPluggableAllocator.
//
// Policy lives in libstreamalloc.so; this file only translates PyTorch's calls into the C
// ABI of streamalloc.h. It keeps only what that ABI has no place for: which pool a
// capturing stream allocates to (PyTorch hands the allocator C++ filters), the memory
// history PyTorch's snapshot tools read (stack contexts are PyTorch objects), the IPC
// mappings opened for other processes' memory, and the allocators of
// MemPool(allocator=...) pools (PyTorch objects the library calls back into for segments).
// Statistics arrive under PyTorch's names from the library, which only need placing.
//
// Built at first use by streamalloc/_door.py against the installed PyTorch.

#include <torch/extension.h>

#include <c10/core/impl/GPUTrace.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/util/ApproximateClock.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstddef>
#include <cstring>
#include <iterator>
#include <memory>
#include <mutex>
#include <sstream>
#include <stack>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "streamalloc.h"

namespace streamalloc_door {
namespace {

namespace CCA = c10::cuda::CUDACachingAllocator;
using c10::DeviceIndex;
using c10::MempoolId_t;
using c10::CachingDeviceAllocator::AnnotationEntry;
using c10::CachingDeviceAllocator::BlockInfo;
using c10::CachingDeviceAllocator::DeviceStats;
using c10::CachingDeviceAllocator::RecordContext;
using c10::CachingDeviceAllocator::SegmentInfo;
using c10::CachingDeviceAllocator::TraceEntry;
using Context = std::shared_ptr<c10::GatheredContext>;

// The library's registry holds device ordinals 0..63.
constexpr int kMaxDevices = 64;
// CUDACachingAllocator's IPC handle format: a version byte, a type byte, then the type's
// payload. PyTorch up to 2.12 writes and accepts version 2; 'c' carries a
// cudaIpcMemHandle_t for a whole cudaMalloc'd (here: cuMemAlloc'd) segment, 'e' an
// expandable segment's mappings as file descriptors (written by PyTorch's allocator, or
// by streamalloc when the allocations have one size: a stitched range's pages always
// do), 's' streamalloc's variant for allocations of several sizes, 'x' a sender's reason
// for not sharing, which the receiver raises. The library encodes and decodes 'e', 's'
// and 'x'.
constexpr char kHandleVersion = 2;
constexpr char kHandleCudaMalloc = 'c';
constexpr char kHandleExpandable = 'e';
constexpr char kHandleStreamalloc = 's';
constexpr char kHandleFailedExport = 'x';

std::string last_error() {
  const char* m = streamalloc_last_error();
  return (m && *m) ? std::string(m) : std::string("(no message from libstreamalloc)");
}

[[noreturn]] void fail(const char* what) {
  TORCH_CHECK(false, "streamalloc: ", what, " failed: ", last_error());
  std::abort(); // not reached: TORCH_CHECK(false) throws
}

[[noreturn]] void unsupported(const char* name, const char* why) {
  TORCH_CHECK(false, "streamalloc: ", name, " is not supported: ", why);
  std::abort();
}

bool is_default(const MempoolId_t& id) {
  return id.first == 0 && id.second == 0;
}

struct Capture {
  MempoolId_t id;
  std::function<bool(cudaStream_t)> filter;
};

struct DeviceState {
  // Set by the first allocation: statistics and snapshots of a device never used answer
  // zeros without creating a CUDA context there.
  std::atomic<bool> used{false};
  // captures.size(), read without the lock so that malloc skips the filters when none
  // are active (as CUDACachingAllocator does with captures_underway).
  std::atomic<int> n_captures{0};
  std::mutex mu; // captures, fraction
  std::vector<Capture> captures;
  double fraction = -1; // < 0: never set through PyTorch
};

// One live allocation, known only while the memory history or a trace tracker is on.
struct Live {
  size_t requested;
  cudaStream_t stream;
  DeviceIndex device;
  MempoolId_t pool;
  Context ctx;
  bool other_streams; // record_stream named another stream: the free may be deferred
};

struct Pending {
  uint64_t addr;
  Live live;
};

template <class T>
struct Ring {
  std::vector<T> v;
  size_t next = 0;
  void insert(const T& e, size_t max) {
    if (v.size() < max) {
      v.push_back(e);
    } else {
      if (next >= v.size()) {
        next = 0;
      }
      v[next++] = e;
    }
  }
  std::vector<T> ordered() const {
    std::vector<T> out;
    out.reserve(v.size());
    size_t start = next < v.size() ? next : 0;
    out.insert(out.end(), v.begin() + start, v.end());
    out.insert(out.end(), v.begin(), v.begin() + start);
    return out;
  }
  void clear() {
    v.clear();
    v.shrink_to_fit();
    next = 0;
  }
};

struct Segments {
  std::vector<streamalloc_segment_info_t> segs;
  std::vector<streamalloc_block_state_t> blocks;
};

Segments fetch_segments(int device) {
  Segments s;
  s.segs.resize(16);
  s.blocks.resize(64);
  for (;;) {
    size_t ns = 0, nb = 0;
    int r = streamalloc_snapshot_segments(
        device, s.segs.data(), s.segs.size(), &ns, s.blocks.data(), s.blocks.size(), &nb);
    if (r < 0) {
      fail("snapshot");
    }
    if (r == 0) {
      s.segs.resize(ns);
      s.blocks.resize(nb);
      return s;
    }
    s.segs.resize(ns + ns / 4 + 8);
    s.blocks.resize(nb + nb / 4 + 32);
  }
}

// Where a statistic lands in DeviceStats: its byte offset, or kNoSlot.
using StatSlot = std::ptrdiff_t;
constexpr StatSlot kNoSlot = -1;

// The offset in DeviceStats of PyTorch's memory_stats() key `name` ("allocation.all.peak",
// "oversize_segments.current", "num_ooms"), or kNoSlot for a name DeviceStats lacks.
StatSlot stat_slot(const std::string& name) {
  using c10::CachingAllocator::Stat;
  using c10::CachingAllocator::StatArray;
  static const std::pair<const char*, StatArray DeviceStats::*> arrays[] = {
      {"allocation", &DeviceStats::allocation},
      {"segment", &DeviceStats::segment},
      {"active", &DeviceStats::active},
      {"inactive_split", &DeviceStats::inactive_split},
      {"allocated_bytes", &DeviceStats::allocated_bytes},
      {"reserved_bytes", &DeviceStats::reserved_bytes},
      {"active_bytes", &DeviceStats::active_bytes},
      {"inactive_split_bytes", &DeviceStats::inactive_split_bytes},
      {"requested_bytes", &DeviceStats::requested_bytes}};
  static const std::pair<const char*, Stat DeviceStats::*> single[] = {
      {"oversize_allocations", &DeviceStats::oversize_allocations},
      {"oversize_segments", &DeviceStats::oversize_segments}};
  static const std::pair<const char*, int64_t DeviceStats::*> scalars[] = {
      {"num_alloc_retries", &DeviceStats::num_alloc_retries},
      {"num_ooms", &DeviceStats::num_ooms},
      {"num_sync_all_streams", &DeviceStats::num_sync_all_streams},
      {"num_device_alloc", &DeviceStats::num_device_alloc},
      {"num_device_free", &DeviceStats::num_device_free},
      {"max_split_size", &DeviceStats::max_split_size}};
  static const char* const types[] = {"all", "small_pool", "large_pool"};
  static DeviceStats probe;
  const auto base = reinterpret_cast<const char*>(&probe);
  auto at = [base](const int64_t& field) { return reinterpret_cast<const char*>(&field) - base; };
  auto in_stat = [&at](const Stat& st, const std::string& f) -> StatSlot {
    return f == "current" ? at(st.current)
        : f == "peak"     ? at(st.peak)
        : f == "allocated" ? at(st.allocated)
        : f == "freed"     ? at(st.freed)
                           : kNoSlot;
  };
  std::vector<std::string> parts;
  for (size_t start = 0;;) {
    size_t dot = name.find('.', start);
    parts.push_back(name.substr(start, dot - start));
    if (dot == std::string::npos) {
      break;
    }
    start = dot + 1;
  }
  if (parts.size() == 1) {
    for (const auto& [n, member] : scalars) {
      if (parts[0] == n) {
        return at(probe.*member);
      }
    }
  } else if (parts.size() == 2) {
    for (const auto& [n, member] : single) {
      if (parts[0] == n) {
        return in_stat(probe.*member, parts[1]);
      }
    }
  } else if (parts.size() == 3) {
    for (const auto& [n, member] : arrays) {
      for (size_t t = 0; t < std::size(types) && parts[0] == n; ++t) {
        if (parts[1] == types[t]) {
          return in_stat((probe.*member)[t], parts[2]);
        }
      }
    }
  }
  return kNoSlot;
}

// The slot of each statistic the library lists, in its order; computed once.
const std::vector<StatSlot>& torch_stat_slots() {
  static const std::vector<StatSlot> slots = [] {
    std::vector<StatSlot> out;
    for (size_t i = 0;; ++i) {
      const char* name = streamalloc_torch_stat_name(i);
      if (name == nullptr) {
        return out;
      }
      out.push_back(stat_slot(name));
      if (out.back() == kNoSlot) {
        TORCH_WARN("streamalloc: PyTorch's DeviceStats has no statistic ", name);
      }
    }
  }();
  return slots;
}

// A pool's checkpoint: what streamalloc_pool_checkpoint listed, with the pool it names.
struct PoolState : CCA::AllocatorState {
  int device = 0;
  MempoolId_t id{0, 0};
  std::vector<streamalloc_pool_block_t> blocks;
};

void raw_free(void* ptr);

class StreamallocAllocator final : public CCA::CUDAAllocator {
 public:
  using CCA::CUDAAllocator::recordStream;

  // ---- allocation ----------------------------------------------------------------

  c10::DataPtr allocate(size_t size) override {
    constexpr size_t one_exa_bytes = 1152921504606846976ULL;
    TORCH_CHECK_WITH(
        OutOfMemoryError,
        size < one_exa_bytes,
        "CUDA out of memory. Tried to allocate more than 1EB memory.");
    DeviceIndex device = 0;
    C10_CUDA_CHECK(c10::cuda::GetDevice(&device));
    void* p = nullptr;
    if (size != 0) {
      p = malloc_on(size, device, c10::cuda::getCurrentCUDAStream(device).stream());
    }
    return {p, p, &raw_free, c10::Device(c10::DeviceType::CUDA, device)};
  }

  c10::DeleterFnPtr raw_deleter() const override {
    return &raw_free;
  }

  void* raw_alloc(size_t nbytes) override {
    if (nbytes == 0) {
      return nullptr;
    }
    DeviceIndex device = 0;
    C10_CUDA_CHECK(c10::cuda::GetDevice(&device));
    return malloc_on(nbytes, device, c10::cuda::getCurrentCUDAStream(device).stream());
  }

  void* raw_alloc_with_stream(size_t nbytes, cudaStream_t stream) override {
    if (nbytes == 0) {
      return nullptr;
    }
    DeviceIndex device = 0;
    C10_CUDA_CHECK(c10::cuda::GetDevice(&device));
    return malloc_on(nbytes, device, stream);
  }

  void raw_delete(void* ptr) override {
    raw_free(ptr);
  }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    C10_CUDA_CHECK(cudaMemcpy(dest, src, count, cudaMemcpyDeviceToDevice));
  }

  void recordStream(const c10::DataPtr& ptr, c10::cuda::CUDAStream stream) override {
    // Null (empty tensors) and memory that is not ours (received over IPC, wrapped by
    // PyTorch's IPC refcounting) have nothing to record, as in CUDACachingAllocator.
    if (!ptr.get() || ptr.get_deleter() != &raw_free) {
      return;
    }
    streamalloc_record_stream(ptr.get(), stream.stream());
    if (C10_UNLIKELY(tracing_.load(std::memory_order_relaxed))) {
      std::lock_guard<std::mutex> g(hist_mu_);
      auto it = live_.find(reinterpret_cast<uint64_t>(ptr.get()));
      if (it != live_.end() && it->second.stream != stream.stream()) {
        it->second.other_streams = true;
      }
    }
  }

  // The DataPtr deleter's work.
  void free_ptr(void* ptr) {
    if (C10_UNLIKELY(tracing_.load(std::memory_order_relaxed))) {
      traced_free(ptr);
    }
    const c10::impl::PyInterpreter* interp = c10::impl::GPUTrace::get_trace();
    if (C10_UNLIKELY(interp)) {
      (*interp)->trace_gpu_memory_deallocation(
          c10::DeviceType::CUDA, reinterpret_cast<uintptr_t>(ptr));
    }
    // The profiler is told the block's size, which only the live block knows.
    int device = -1;
    uint64_t size = 0;
    const bool profiling = C10_UNLIKELY(c10::memoryProfilingEnabled()) &&
        streamalloc_allocation_usage(ptr, &device, &size, nullptr, nullptr) == 0;
    // A deleter gets only the pointer: device -1 lets the library find its owner.
    streamalloc_free(ptr, 0, -1, nullptr);
    streamalloc_stats_t r{};
    if (profiling && streamalloc_get_stats(device, &r) == 0) {
      report_to_profiler(ptr, -static_cast<int64_t>(size), r.allocated_current, r.reserved_current, device);
    }
  }

  // ---- devices, limits, cache ------------------------------------------------------

  void init(int device_count) override {
    int prev = device_count_.load();
    while (device_count > prev && !device_count_.compare_exchange_weak(prev, device_count)) {
    }
  }

  bool initialized() override {
    return device_count_.load() > 0;
  }

  void enable(bool value) override {
    if (!value) {
      unsupported(
          "enable(false)",
          "streamalloc has no uncached mode; every allocation goes through its cache");
    }
  }

  bool isEnabled() const override {
    return true;
  }

  double getMemoryFraction(DeviceIndex device) override {
    DeviceState& d = dev(device);
    {
      std::lock_guard<std::mutex> g(d.mu);
      if (d.fraction >= 0) {
        return d.fraction;
      }
    }
    uint64_t limit = d.used.load() ? streamalloc_memory_limit(device) : 0;
    if (limit == 0) {
      return 1.0;
    }
    cudaDeviceProp prop{};
    C10_CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
    return std::min(1.0, static_cast<double>(limit) / static_cast<double>(prop.totalGlobalMem));
  }

  void setMemoryFraction(double fraction, DeviceIndex device) override {
    TORCH_CHECK(
        0 <= fraction && fraction <= 1,
        "invalid fraction:",
        fraction,
        ". Please set within [0, 1].");
    DeviceState& d = touch(device);
    streamalloc_set_memory_fraction(fraction, device);
    std::lock_guard<std::mutex> g(d.mu);
    d.fraction = fraction;
  }

  std::vector<CCA::StreamSegmentSize> getExpandableSegmentSizes(DeviceIndex device) override {
    dev(device);
    return {};
  }

  void cacheInfo(DeviceIndex device, size_t* largestBlock) override {
    DeviceState& d = dev(device);
    // As CUDACachingAllocator: a zero asks for the device's free memory as the first
    // guess, then the largest cached free block counts if larger.
    if (*largestBlock == 0) {
      c10::cuda::CUDAGuard g(device);
      size_t free = 0, total = 0;
      C10_CUDA_CHECK(cudaMemGetInfo(&free, &total));
      *largestBlock = free;
    }
    if (d.used.load()) {
      uint64_t largest = 0;
      if (streamalloc_cache_info(device, &largest) != 0) {
        fail("cacheInfo");
      }
      *largestBlock = std::max<size_t>(*largestBlock, largest);
    }
  }

  void emptyCache(MempoolId_t mempool_id) override {
    bool tracing = tracing_.load();
    std::vector<std::pair<int, Segments>> before;
    if (tracing) {
      for (int i = 0; i < kMaxDevices; ++i) {
        if (devices_[i].used.load()) {
          before.emplace_back(i, fetch_segments(i));
        }
      }
    }
    int calls = 0, failures = 0;
    for (int i = 0; i < kMaxDevices; ++i) {
      if (!devices_[i].used.load()) {
        continue;
      }
      ++calls;
      if (streamalloc_empty_cache_pool(i, mempool_id.first, mempool_id.second) != 0) {
        // A private pool lives on one device; the others do not know its id.
        if (is_default(mempool_id)) {
          fail("emptyCache");
        }
        ++failures;
      }
    }
    if (calls > 0 && failures == calls) {
      fail("emptyCache");
    }
    if (tracing) {
      record_segment_frees(before);
    }
  }

  void* getBaseAllocation(void* ptr, size_t* size) override {
    int device = 0, expandable = 0;
    uint64_t base = 0, seg_size = 0;
    if (streamalloc_block_info(ptr, &device, &base, &seg_size, &expandable) != 0) {
      fail("getBaseAllocation");
    }
    if (expandable) {
      // As PyTorch's allocator for its expandable segments: mapped memory has no base
      // cudaMalloc allocation. Sharing it with other processes goes through
      // shareIpcHandle, which torch.multiprocessing calls.
      unsupported(
          "getBaseAllocation",
          "the memory lies in an expandable segment or a stitched range, which has no base "
          "cudaMalloc allocation; shareIpcHandle shares it with other processes");
    }
    if (size) {
      *size = seg_size;
    }
    return reinterpret_cast<void*>(base);
  }

  void enablePeerAccess(DeviceIndex dev_from, DeviceIndex dev_to_access) override {
    c10::cuda::CUDAGuard g(dev_from);
    cudaError_t err = cudaDeviceEnablePeerAccess(dev_to_access, 0);
    if (err == cudaErrorPeerAccessAlreadyEnabled) {
      (void)cudaGetLastError();
    } else {
      C10_CUDA_CHECK(err);
    }
  }

  cudaError_t memcpyAsync(
      void* dst,
      int dstDevice,
      const void* src,
      int srcDevice,
      size_t count,
      cudaStream_t stream,
      bool p2p_enabled) override {
    if (dstDevice == srcDevice) {
      return cudaMemcpyAsync(dst, src, count, cudaMemcpyDeviceToDevice, stream);
    }
    // Across devices always the peer copy, even with p2p_enabled: with expandable
    // segments the memory is mapped through the VMM API, which plain cudaMemcpyAsync
    // cannot copy between devices unless the peer was given access to every mapping, and
    // the C ABI has no call for that. With peer access on, the peer copy is direct too.
    (void)p2p_enabled;
    return cudaMemcpyPeerAsync(dst, dstDevice, src, srcDevice, count, stream);
  }

  std::string name() override {
    return "streamalloc";
  }

  // ---- statistics ------------------------------------------------------------------

  DeviceStats getDeviceStats(DeviceIndex device) override {
    DeviceStats s;
    if (!dev(device).used.load()) {
      return s;
    }
    // The library names each value by PyTorch's memory_stats() key; torch_stat_slots
    // says where each lands in DeviceStats.
    const std::vector<StatSlot>& slots = torch_stat_slots();
    std::vector<int64_t> values(slots.size());
    int64_t n = streamalloc_torch_stats(device, values.data(), values.size());
    if (n < 0) {
      fail("getDeviceStats");
    }
    for (size_t i = 0; i < slots.size() && i < static_cast<size_t>(n); ++i) {
      if (slots[i] != kNoSlot) {
        *reinterpret_cast<int64_t*>(reinterpret_cast<char*>(&s) + slots[i]) = values[i];
      }
    }
    return s;
  }

  void resetAccumulatedStats(DeviceIndex device) override {
    if (dev(device).used.load() && streamalloc_reset_accumulated_stats(device) != 0) {
      fail("resetAccumulatedStats");
    }
  }

  void resetPeakStats(DeviceIndex device) override {
    if (dev(device).used.load() && streamalloc_reset_peak_stats(device) != 0) {
      fail("resetPeakStats");
    }
  }

  // ---- snapshots and memory history --------------------------------------------------

  CCA::SnapshotInfo snapshot(MempoolId_t mempool_id, bool include_traces) override {
    CCA::SnapshotInfo out;
    const bool all_pools = is_default(mempool_id);
    const bool tracing = tracing_.load();
    std::vector<std::pair<int, Segments>> per_device;
    for (int i = 0; i < kMaxDevices; ++i) {
      if (devices_[i].used.load()) {
        per_device.emplace_back(i, fetch_segments(i));
      }
    }
    std::unique_lock<std::mutex> hist(hist_mu_, std::defer_lock);
    if (tracing) {
      hist.lock();
      settle_pending(per_device);
    }
    for (const auto& [device, s] : per_device) {
      for (const auto& seg : s.segs) {
        MempoolId_t pool{seg.pool_id0, seg.pool_id1};
        if (!all_pools && pool != mempool_id) {
          continue;
        }
        SegmentInfo si;
        si.device = static_cast<DeviceIndex>(device);
        si.address = seg.address;
        si.total_size = seg.total_size;
        si.stream = reinterpret_cast<void*>(seg.stream);
        si.is_large = seg.is_large != 0;
        si.is_expandable = seg.is_expandable != 0;
        si.owner_private_pool_id = pool;
        for (uint64_t b = seg.first_block; b < seg.first_block + seg.block_count; ++b) {
          if (b >= s.blocks.size()) {
            break;
          }
          const streamalloc_block_state_t& bs = s.blocks[b];
          BlockInfo bi;
          bi.size = bs.size;
          bi.requested_size = bs.requested_size;
          bi.allocated = bs.state == 1;
          bi.active = bs.state != 0;
          if (bi.allocated) {
            si.allocated_size += bi.size;
          }
          if (bi.active) {
            si.active_size += bi.size;
            si.requested_size += bi.requested_size;
          }
          if (tracing && bi.allocated) {
            auto it = live_.find(bs.address);
            if (it != live_.end()) {
              bi.context_when_allocated = it->second.ctx;
            }
          }
          si.blocks.push_back(std::move(bi));
        }
        out.segments.push_back(std::move(si));
      }
    }
    std::sort(out.segments.begin(), out.segments.end(), [](const auto& a, const auto& b) {
      return a.address < b.address;
    });
    // ProcessGroupNCCL registers a pool's segments in registration_counter order, which
    // must agree across ranks: address order, the one order the library knows.
    for (size_t i = 0; i < out.segments.size(); ++i) {
      out.segments[i].registration_counter = static_cast<int32_t>(i);
    }
    if (include_traces) {
      if (!tracing) {
        hist.lock();
      }
      auto tsc_to_ns = clock_.makeConverter();
      int n = std::max(device_count_.load(), highest_used() + 1);
      out.device_traces.resize(static_cast<size_t>(std::max(n, 0)));
      for (int i = 0; i < n && i < kMaxDevices; ++i) {
        out.device_traces[i] = rings_[i].ordered();
        for (auto& te : out.device_traces[i]) {
          te.time_.t_ = tsc_to_ns(te.time_.approx_t_) / 1000;
        }
      }
      out.external_annotations = annotations_.ordered();
      for (auto& ae : out.external_annotations) {
        ae.time_.t_ = tsc_to_ns(ae.time_.approx_t_) / 1000;
      }
    }
    auto& md = out.config_metadata;
    const char* conf = std::getenv("STREAMALLOC_CONF");
    md.last_allocator_settings = std::string("streamalloc:") + (conf ? conf : "");
    md.expandable_segments =
        conf && std::string(conf).find("expandable_segments:true") != std::string::npos;
    md.garbage_collection_threshold = 0;
    md.max_split_size = 0;
    md.pinned_num_register_threads = 0;
    md.release_lock_on_malloc = false;
    md.pinned_use_host_register = false;
    md.graph_capture_record_stream_reuse = false;
    return out;
  }

  void recordHistory(
      bool enabled,
      CCA::CreateContextFn context_recorder,
      size_t alloc_trace_max_entries,
      RecordContext when,
      bool clearHistory,
      const std::vector<std::string>& skip_actions) override {
    TORCH_CHECK(when == RecordContext::NEVER || context_recorder);
    std::lock_guard<std::mutex> g(hist_mu_);
    record_ = enabled;
    recorder_.store(enabled ? context_recorder : nullptr);
    when_.store(static_cast<int>(enabled ? when : RecordContext::NEVER));
    max_entries_ = std::max<size_t>(1, alloc_trace_max_entries);
    skip_.clear();
    for (const auto& a : skip_actions) {
      try {
        skip_.insert(static_cast<int>(c10::CachingDeviceAllocator::parseTraceEntryAction(a)));
      } catch (const c10::Error&) {
        // unknown names are ignored, as CUDACachingAllocator ignores them
      }
    }
    if (!enabled || clearHistory) {
      for (auto& r : rings_) {
        r.clear();
      }
      annotations_.clear();
    }
    update_tracing_locked();
  }

  bool isHistoryEnabled() override {
    std::lock_guard<std::mutex> g(hist_mu_);
    return record_;
  }

  void recordAnnotation(const std::vector<std::pair<std::string, std::string>>& md) override {
    std::lock_guard<std::mutex> g(hist_mu_);
    if (!record_) {
      return;
    }
    DeviceIndex device = 0;
    C10_CUDA_CHECK(c10::cuda::GetDevice(&device));
    AnnotationEntry ae(device, c10::getApproximateTime());
    for (const auto& [k, v] : md) {
      ae.recordUserMetadata(k, v);
    }
    annotations_.insert(ae, max_entries_);
  }

  void pushCompileContext(std::string& md) override {
    if (isHistoryEnabled()) {
      compile_context().push(md);
    }
  }

  void popCompileContext() override {
    if (!compile_context().empty()) {
      compile_context().pop();
    }
  }

  void setUserMetadata(const std::string& metadata) override {
    user_metadata() = metadata;
  }

  std::string getUserMetadata() override {
    return user_metadata();
  }

  void attachOutOfMemoryObserver(CCA::OutOfMemoryObserver observer) override {
    std::lock_guard<std::mutex> g(oom_mu_);
    oom_observers_.push_back(std::move(observer));
  }

  void attachAllocatorTraceTracker(CCA::AllocatorTraceTracker tracker) override {
    std::lock_guard<std::mutex> g(hist_mu_);
    trackers_.push_back(std::move(tracker));
    update_tracing_locked();
  }

  // ---- pools (CUDA graphs, torch.cuda.MemPool) ---------------------------------------

  void beginAllocateToPool(
      DeviceIndex device,
      MempoolId_t mempool_id,
      std::function<bool(cudaStream_t)> filter) override {
    DeviceState& d = touch(device);
    std::lock_guard<std::mutex> g(d.mu);
    for (const auto& c : d.captures) {
      TORCH_CHECK(c.id != mempool_id, "beginAllocateToPool: already recording to mempool_id");
    }
    // Also tells the engine a capture may be under way (no event queries, waits on
    // capturing streams or synchronisation anywhere until the end).
    if (streamalloc_pool_begin_allocate(device, mempool_id.first, mempool_id.second) < 0) {
      fail("beginAllocateToPool");
    }
    d.captures.push_back({mempool_id, std::move(filter)});
    d.n_captures.store(static_cast<int>(d.captures.size()), std::memory_order_release);
  }

  void endAllocateToPool(DeviceIndex device, MempoolId_t mempool_id) override {
    DeviceState& d = dev(device);
    std::lock_guard<std::mutex> g(d.mu);
    for (auto it = d.captures.begin(); it != d.captures.end(); ++it) {
      if (it->id == mempool_id) {
        d.captures.erase(it);
        d.n_captures.store(static_cast<int>(d.captures.size()), std::memory_order_release);
        if (streamalloc_pool_end_allocate(device, mempool_id.first, mempool_id.second) < 0) {
          fail("endAllocateToPool");
        }
        return;
      }
    }
    TORCH_CHECK(false, "endAllocatePool: not currently recording to mempool_id");
  }

  void releasePool(DeviceIndex device, MempoolId_t mempool_id) override {
    touch(device);
    if (streamalloc_pool_release(device, mempool_id.first, mempool_id.second) < 0) {
      fail("releasePool");
    }
  }

  void createOrIncrefPool(
      DeviceIndex device,
      MempoolId_t mempool_id,
      std::shared_ptr<CCA::CUDAAllocator> allocator) override {
    touch(device);
    const int uses = streamalloc_pool_incref(device, mempool_id.first, mempool_id.second);
    if (uses < 0) {
      fail("createOrIncrefPool");
    }
    if (!allocator || allocator.get() == this || uses != 1) {
      return;
    }
    // torch.cuda.MemPool(allocator=...): the engine takes the pool's segments from that
    // allocator and gives them back to it. Kept for the life of the process: the engine
    // may return a segment through it whenever the pool's cache is emptied.
    auto* source = new std::shared_ptr<CCA::CUDAAllocator>(std::move(allocator));
    if (streamalloc_pool_set_segment_source(
            device, mempool_id.first, mempool_id.second, &segment_alloc, &segment_free, source) !=
        0) {
      const std::string why = last_error();
      delete source;
      streamalloc_pool_release(device, mempool_id.first, mempool_id.second);
      TORCH_CHECK(false, "streamalloc: torch.cuda.MemPool(allocator=...) failed: ", why);
    }
  }

  // A segment of a MemPool(allocator=...) pool, from its allocator. The library calls
  // these and must see no exception.
  static void* segment_alloc(void* source, size_t size, int device) {
    try {
      c10::cuda::CUDAGuard g(static_cast<DeviceIndex>(device));
      return (*static_cast<std::shared_ptr<CCA::CUDAAllocator>*>(source))->raw_alloc(size);
    } catch (const std::exception& err) {
      try {
        TORCH_WARN("streamalloc: the MemPool's allocator failed: ", err.what());
      } catch (...) {
      }
    } catch (...) {
    }
    return nullptr;
  }

  static void segment_free(void* source, void* ptr, size_t size, int device) {
    (void)size;
    try {
      c10::cuda::CUDAGuard g(static_cast<DeviceIndex>(device));
      (*static_cast<std::shared_ptr<CCA::CUDAAllocator>*>(source))->raw_delete(ptr);
    } catch (const std::exception& err) {
      try {
        TORCH_WARN("streamalloc: the MemPool's allocator failed to free a segment: ", err.what());
      } catch (...) {
      }
    } catch (...) {
    }
  }

  int getPoolUseCount(DeviceIndex device, MempoolId_t mempool_id) override {
    touch(device);
    return streamalloc_pool_use_count(device, mempool_id.first, mempool_id.second);
  }

  void setUseOnOOM(DeviceIndex device, MempoolId_t mempool_id, bool use_on_oom) override {
    touch(device);
    if (streamalloc_pool_set_use_on_oom(
            device, mempool_id.first, mempool_id.second, use_on_oom ? 1 : 0) != 0) {
      fail("setUseOnOOM (torch.cuda.MemPool(use_on_oom=True))");
    }
  }

  void setNoSplit(DeviceIndex device, MempoolId_t mempool_id) override {
    touch(device);
    if (streamalloc_pool_set_no_split(device, mempool_id.first, mempool_id.second) != 0) {
      fail("setNoSplit (torch.cuda.MemPool(no_split=True))");
    }
  }

  bool checkPoolLiveAllocations(
      DeviceIndex device,
      MempoolId_t mempool_id,
      const std::unordered_set<void*>& expected_live_allocations) override {
    touch(device);
    std::vector<uint64_t> live(expected_live_allocations.size() + 1);
    int64_t n = 0;
    for (;;) {
      n = streamalloc_pool_live_allocations(
          device, mempool_id.first, mempool_id.second, live.data(), live.size());
      if (n < 0) {
        fail("checkPoolLiveAllocations");
      }
      if (static_cast<size_t>(n) <= live.size()) {
        break;
      }
      live.resize(static_cast<size_t>(n) + 16);
    }
    if (static_cast<size_t>(n) != expected_live_allocations.size()) {
      return false;
    }
    for (int64_t i = 0; i < n; ++i) {
      if (!expected_live_allocations.count(reinterpret_cast<void*>(live[i]))) {
        return false;
      }
    }
    return true;
  }

  std::shared_ptr<CCA::AllocatorState> getCheckpointState(
      DeviceIndex device,
      MempoolId_t id) override {
    touch(device);
    auto state = std::make_shared<PoolState>();
    state->device = device;
    state->id = id;
    state->blocks.resize(64);
    for (;;) {
      int64_t n = streamalloc_pool_checkpoint(
          device, id.first, id.second, state->blocks.data(), state->blocks.size());
      if (n < 0) {
        fail("getCheckpointState");
      }
      if (static_cast<size_t>(n) <= state->blocks.size()) {
        state->blocks.resize(static_cast<size_t>(n));
        return state;
      }
      state->blocks.resize(static_cast<size_t>(n) + 16);
    }
  }

  CCA::CheckpointDelta setCheckpointPoolState(
      DeviceIndex device,
      std::shared_ptr<CCA::AllocatorState> as) override {
    auto state = std::dynamic_pointer_cast<PoolState>(as);
    TORCH_CHECK(
        state, "streamalloc: setCheckpointPoolState needs a state from its getCheckpointState");
    TORCH_CHECK(
        state->device == device,
        "streamalloc: setCheckpointPoolState: the checkpoint is of device ",
        state->device,
        ", not ",
        static_cast<int>(device));
    touch(device);
    const MempoolId_t id = state->id;
    std::vector<uint64_t> freed;
    int64_t n = -1;
    for (int attempt = 0; n < 0; ++attempt) {
      uint64_t probe = 0;
      int64_t live = streamalloc_pool_live_allocations(device, id.first, id.second, &probe, 0);
      if (live < 0) {
        fail("setCheckpointPoolState");
      }
      freed.resize(static_cast<size_t>(live) + 64);
      n = streamalloc_pool_restore(
          device,
          id.first,
          id.second,
          state->blocks.data(),
          state->blocks.size(),
          freed.data(),
          freed.size());
      if (n < 0) {
        // Retried only when other threads allocated into the pool meanwhile and the room
        // for the freed addresses ran out; anything else is the library's error.
        int64_t now = streamalloc_pool_live_allocations(device, id.first, id.second, &probe, 0);
        if (attempt >= 3 || now < 0 || static_cast<size_t>(now) <= freed.size()) {
          fail("setCheckpointPoolState");
        }
      }
    }
    freed.resize(static_cast<size_t>(n));
    CCA::CheckpointDelta delta;
    for (uint64_t p : freed) {
      delta.ptrs_freed.push_back(reinterpret_cast<void*>(p));
    }
    for (const auto& b : state->blocks) {
      void* p = reinterpret_cast<void*>(b.address);
      delta.dataptrs_allocd.emplace_back(
          p, p, &raw_free, c10::Device(c10::DeviceType::CUDA, device));
    }
    if (tracing_.load()) {
      traced_restore(device, id, freed, state->blocks);
    }
    return delta;
  }

  // ---- IPC ---------------------------------------------------------------------------

  // Any allocation: a whole segment through cudaIpcGetMemHandle, memory mapped through the
  // VMM API (an expandable segment, a stitched range) as its physical allocations. A
  // failure is not thrown here, where it would leave the receiver waiting for a tensor
  // that never comes (torch.multiprocessing pickles in a queue's feeder thread): the
  // sender warns, and the handle carries the reason, which the receiver raises.
  CCA::ShareableHandle shareIpcHandle(void* ptr) override {
    std::string why;
    try {
      int device = 0, expandable = 0;
      uint64_t base = 0, seg_size = 0;
      if (streamalloc_block_info(ptr, &device, &base, &seg_size, &expandable) != 0) {
        why = last_error();
      } else if (expandable) {
        CCA::ShareableHandle shared;
        if (share_mapped(ptr, &shared)) {
          return shared;
        }
        why = last_error();
      } else {
        c10::cuda::CUDAGuard g(static_cast<DeviceIndex>(device));
        cudaIpcMemHandle_t handle;
        const cudaError_t err = cudaIpcGetMemHandle(&handle, reinterpret_cast<void*>(base));
        if (err == cudaSuccess) {
          std::string s;
          s.reserve(2 + CUDA_IPC_HANDLE_SIZE);
          s.push_back(kHandleVersion);
          s.push_back(kHandleCudaMalloc);
          s.append(reinterpret_cast<const char*>(&handle), CUDA_IPC_HANDLE_SIZE);
          return {static_cast<ptrdiff_t>(reinterpret_cast<uint64_t>(ptr) - base), s};
        }
        (void)cudaGetLastError();
        why = std::string("cudaIpcGetMemHandle: ") + cudaGetErrorString(err);
      }
    } catch (const std::exception& err) {
      why = err.what();
    }
    return failed_share(ptr, why);
  }

  std::shared_ptr<void> getIpcDevPtr(std::string handle) override {
    std::lock_guard<std::mutex> g(ipc_mu_);
    auto it = ipc_.find(handle);
    if (it != ipc_.end()) {
      if (auto sp = it->second.wp.lock()) {
        return sp;
      }
      // Its last user is being released on another thread, which waits for this lock:
      // close it here so that it can be opened again; that thread then finds nothing.
      close_ipc_locked(it);
    }
    size_t payload = 0; // a bare cudaIpcMemHandle_t predates the versioned format
    char type = kHandleCudaMalloc;
    if (handle.size() != CUDA_IPC_HANDLE_SIZE) {
      TORCH_CHECK(handle.size() >= 2, "streamalloc: getIpcDevPtr: ill-formed handle");
      TORCH_CHECK(
          static_cast<unsigned char>(handle[0]) <= static_cast<unsigned char>(kHandleVersion),
          "received sharable handle from a future version of torch that this version does "
          "not know how to handle");
      type = handle[1];
      payload = 2;
    }
    if (type == kHandleExpandable || type == kHandleStreamalloc || type == kHandleFailedExport) {
      DeviceIndex device = 0;
      C10_CUDA_CHECK(c10::cuda::GetDevice(&device));
      void* p = streamalloc_ipc_open(
          reinterpret_cast<const uint8_t*>(handle.data()), handle.size(), device);
      if (p == nullptr) {
        fail("getIpcDevPtr");
      }
      const uint64_t gen = ++ipc_generation_;
      std::shared_ptr<void> sp(p, [this, handle, gen](void*) { close_ipc(handle, gen); });
      ipc_[handle] = IpcEntry{device, p, gen, sp, true};
      return sp;
    }
    TORCH_CHECK(
        type == kHandleCudaMalloc,
        "streamalloc: getIpcDevPtr: unknown handle type ",
        static_cast<int>(static_cast<unsigned char>(type)));
    TORCH_CHECK(
        handle.size() == payload + CUDA_IPC_HANDLE_SIZE,
        "streamalloc: getIpcDevPtr: ill-formed handle of ",
        handle.size(),
        " bytes");
    cudaIpcMemHandle_t h;
    std::memcpy(&h, handle.data() + payload, CUDA_IPC_HANDLE_SIZE);
    DeviceIndex device = 0;
    C10_CUDA_CHECK(c10::cuda::GetDevice(&device));
    void* p = nullptr;
    C10_CUDA_CHECK(cudaIpcOpenMemHandle(&p, h, cudaIpcMemLazyEnablePeerAccess));
    const uint64_t gen = ++ipc_generation_;
    std::shared_ptr<void> sp(p, [this, handle, gen](void*) { close_ipc(handle, gen); });
    ipc_[handle] = IpcEntry{device, p, gen, sp, false};
    return sp;
  }

  // ---- internals ---------------------------------------------------------------------

 private:
  struct IpcEntry {
    DeviceIndex device;
    void* ptr;
    uint64_t generation;
    std::weak_ptr<void> wp;
    bool expandable; // opened by streamalloc_ipc_open, not cudaIpcOpenMemHandle
  };

  // The handle of an allocation in an expandable segment or a stitched range, from the
  // library; false (the reason in last_error) if it could not export it.
  bool share_mapped(void* ptr, CCA::ShareableHandle* shared) {
    std::string s(512, '\0');
    uint64_t offset = 0;
    auto out = [&s] { return reinterpret_cast<uint8_t*>(&s[0]); };
    int64_t n = streamalloc_ipc_export(ptr, out(), s.size(), &offset);
    if (n > static_cast<int64_t>(s.size())) {
      s.resize(static_cast<size_t>(n));
      n = streamalloc_ipc_export(ptr, out(), s.size(), &offset);
    }
    if (n < 0 || n > static_cast<int64_t>(s.size())) {
      return false;
    }
    s.resize(static_cast<size_t>(n));
    *shared = {static_cast<ptrdiff_t>(offset), s};
    return true;
  }

  // A handle that makes the receiver raise `why` (see shareIpcHandle), after a warning
  // here.
  CCA::ShareableHandle failed_share(void* ptr, const std::string& why) {
    std::ostringstream reason;
    reason << "sharing the CUDA memory at " << ptr << " with another process failed: " << why;
    TORCH_WARN(
        "streamalloc: ",
        reason.str(),
        "; the receiving process raises this error when it opens the tensor");
    std::string s(2 + 1024 + 16, '\0');
    const int64_t n = streamalloc_ipc_failure_handle(
        reason.str().c_str(), reinterpret_cast<uint8_t*>(&s[0]), s.size());
    TORCH_CHECK(
        n > 0 && n <= static_cast<int64_t>(s.size()),
        "streamalloc: shareIpcHandle failed: ",
        why);
    s.resize(static_cast<size_t>(n));
    return {0, s};
  }

  DeviceState& dev(DeviceIndex device) {
    TORCH_CHECK(
        0 <= device && device < kMaxDevices,
        "streamalloc: invalid device ",
        static_cast<int>(device),
        " (devices 0..",
        kMaxDevices - 1,
        " are supported)");
    return devices_[device];
  }

  DeviceState& touch(DeviceIndex device) {
    DeviceState& d = dev(device);
    if (C10_UNLIKELY(!d.used.load(std::memory_order_relaxed))) {
      d.used.store(true, std::memory_order_relaxed);
    }
    return d;
  }

  int highest_used() const {
    for (int i = kMaxDevices - 1; i >= 0; --i) {
      if (devices_[i].used.load()) {
        return i;
      }
    }
    return -1;
  }

  // The pool a capturing stream allocates to: the most recent matching begin first, as
  // CUDACachingAllocator searches captures_underway.
  MempoolId_t pool_for(DeviceState& d, cudaStream_t stream) {
    std::lock_guard<std::mutex> g(d.mu);
    for (auto it = d.captures.rbegin(); it != d.captures.rend(); ++it) {
      if (it->filter(stream)) {
        return it->id;
      }
    }
    return {0, 0};
  }

  void* malloc_on(size_t size, DeviceIndex device, cudaStream_t stream) {
    DeviceState& d = touch(device);
    MempoolId_t pool{0, 0};
    if (C10_UNLIKELY(d.n_captures.load(std::memory_order_acquire) != 0)) {
      pool = pool_for(d, stream);
    }
    const bool tracing = C10_UNLIKELY(tracing_.load(std::memory_order_relaxed));
    Context ctx;
    uint64_t segments_before = 0;
    if (tracing) {
      ctx = gather(RecordContext::STATE);
      segments_before = segment_allocs(device);
    }
    void* p = streamalloc_malloc_in_pool(size, device, stream, pool.first, pool.second);
    if (C10_UNLIKELY(p == nullptr)) {
      alloc_failed(size, device, stream, pool, ctx);
    }
    if (tracing) {
      traced_alloc(p, size, device, stream, pool, std::move(ctx), segments_before);
    }
    const c10::impl::PyInterpreter* interp = c10::impl::GPUTrace::get_trace();
    if (C10_UNLIKELY(interp)) {
      (*interp)->trace_gpu_memory_allocation(
          c10::DeviceType::CUDA, reinterpret_cast<uintptr_t>(p));
    }
    if (C10_UNLIKELY(c10::memoryProfilingEnabled())) {
      int owner = device;
      uint64_t block = 0, allocated = 0, reserved = 0;
      if (streamalloc_allocation_usage(p, &owner, &block, &allocated, &reserved) == 0) {
        report_to_profiler(p, static_cast<int64_t>(block), allocated, reserved, owner);
      }
    }
    return p;
  }

  // What CUDACachingAllocator tells torch.profiler (profile_memory=True) of every
  // allocation (+block size) and free (-block size): the device's allocated and reserved
  // bytes after it.
  static void report_to_profiler(
      void* ptr,
      int64_t size,
      uint64_t allocated,
      uint64_t reserved,
      int device) {
    c10::reportMemoryUsageToProfiler(
        ptr,
        size,
        static_cast<size_t>(allocated),
        static_cast<size_t>(reserved),
        c10::Device(c10::DeviceType::CUDA, static_cast<DeviceIndex>(device)));
  }

  [[noreturn]] void alloc_failed(
      size_t size,
      DeviceIndex device,
      cudaStream_t stream,
      MempoolId_t pool,
      const Context& ctx) {
    std::string msg = last_error();
    if (msg.find("out of memory") == std::string::npos) {
      TORCH_CHECK(
          false,
          "streamalloc: allocating ",
          size,
          " bytes on device ",
          static_cast<int>(device),
          " failed: ",
          msg);
    }
    size_t device_free = 0, device_total = 0;
    {
      c10::cuda::CUDAGuard g(device);
      if (cudaMemGetInfo(&device_free, &device_total) != cudaSuccess) {
        (void)cudaGetLastError();
      }
    }
    if (tracing_.load()) {
      std::lock_guard<std::mutex> g(hist_mu_);
      record(TraceEntry::OOM, device, device_free, size, stream, pool, ctx);
    }
    streamalloc_stats_t totals{};
    if (streamalloc_get_stats(device, &totals) == 0) {
      c10::reportOutOfMemoryToProfiler(
          static_cast<int64_t>(size),
          static_cast<size_t>(totals.allocated_current),
          static_cast<size_t>(totals.reserved_current),
          c10::Device(c10::DeviceType::CUDA, device));
    }
    uint64_t limit = streamalloc_memory_limit(device);
    std::vector<CCA::OutOfMemoryObserver> observers;
    {
      std::lock_guard<std::mutex> g(oom_mu_);
      observers = oom_observers_;
    }
    for (const auto& obs : observers) {
      obs(device, size, limit ? static_cast<size_t>(limit) : device_total, device_free);
    }
    TORCH_CHECK_WITH(OutOfMemoryError, false, "CUDA out of memory (streamalloc). ", msg);
    std::abort();
  }

  uint64_t segment_allocs(DeviceIndex device) {
    streamalloc_stats_t r{};
    return streamalloc_get_stats(device, &r) == 0 ? r.segment_allocs : 0;
  }

  Context gather(RecordContext level) {
    if (when_.load() < static_cast<int>(level)) {
      return nullptr;
    }
    CCA::CreateContextFn fn = recorder_.load();
    return fn ? fn() : nullptr;
  }

  static std::stack<std::string>& compile_context() {
    thread_local std::stack<std::string> s;
    return s;
  }

  static std::string& user_metadata() {
    thread_local std::string s;
    return s;
  }

  // Caller holds hist_mu_.
  void record(
      TraceEntry::Action action,
      DeviceIndex device,
      uint64_t addr,
      size_t size,
      cudaStream_t stream,
      MempoolId_t pool,
      const Context& ctx) {
    if (!record_ && trackers_.empty()) {
      return;
    }
    const auto& cc = compile_context();
    TraceEntry te(
        action,
        device,
        static_cast<size_t>(addr),
        size,
        stream,
        pool,
        c10::getApproximateTime(),
        when_.load() >= static_cast<int>(RecordContext::ALLOC) ? ctx : nullptr,
        cc.empty() ? std::string("N/A") : cc.top(),
        user_metadata());
    for (const auto& cb : trackers_) {
      cb(te);
    }
    if (record_ && !skip_.count(static_cast<int>(action)) && device >= 0 &&
        device < kMaxDevices) {
      rings_[device].insert(te, max_entries_);
    }
  }

  // Caller holds hist_mu_. Turning the bookkeeping on learns the allocations already live
  // (so that their frees have sizes); turning it off forgets everything.
  void update_tracing_locked() {
    const bool on = record_ || !trackers_.empty();
    const bool was = tracing_.load();
    if (on && !was) {
      live_.clear();
      pending_.clear();
      for (int i = 0; i < kMaxDevices; ++i) {
        if (!devices_[i].used.load()) {
          continue;
        }
        Segments s = fetch_segments(i);
        for (const auto& seg : s.segs) {
          for (uint64_t b = seg.first_block;
               b < seg.first_block + seg.block_count && b < s.blocks.size();
               ++b) {
            const auto& bs = s.blocks[b];
            if (bs.state == 1) {
              live_[bs.address] = Live{
                  bs.requested_size,
                  reinterpret_cast<cudaStream_t>(bs.stream),
                  static_cast<DeviceIndex>(i),
                  {seg.pool_id0, seg.pool_id1},
                  nullptr,
                  false};
            }
          }
        }
      }
    } else if (!on) {
      live_.clear();
      pending_.clear();
    }
    tracing_.store(on);
  }

  void traced_alloc(
      void* p,
      size_t size,
      DeviceIndex device,
      cudaStream_t stream,
      MempoolId_t pool,
      Context ctx,
      uint64_t segments_before) {
    const uint64_t addr = reinterpret_cast<uint64_t>(p);
    // A new segment is known only from the counter; its range comes from block_info.
    // Expandable segments grow by mappings, whose ranges the C ABI does not report.
    int seg_device = 0, expandable = 0;
    uint64_t base = 0, seg_size = 0;
    const bool new_segment = segment_allocs(device) > segments_before &&
        streamalloc_block_info(p, &seg_device, &base, &seg_size, &expandable) == 0 &&
        !expandable;
    std::lock_guard<std::mutex> g(hist_mu_);
    if (new_segment) {
      record(TraceEntry::SEGMENT_ALLOC, device, base, seg_size, stream, pool, ctx);
    }
    // Reuse of a deferred free's memory shows that free completed.
    for (auto it = pending_.begin(); it != pending_.end();) {
      const uint64_t end = it->addr + std::max<uint64_t>(it->live.requested, 1);
      if (it->live.device == device && it->addr < addr + size && addr < end) {
        record(
            TraceEntry::FREE_COMPLETED,
            device,
            it->addr,
            it->live.requested,
            it->live.stream,
            it->live.pool,
            it->live.ctx);
        it = pending_.erase(it);
      } else {
        ++it;
      }
    }
    record(TraceEntry::ALLOC, device, addr, size, stream, pool, ctx);
    live_[addr] = Live{size, stream, device, pool, std::move(ctx), false};
  }

  void traced_free(void* ptr) {
    Context ctx = gather(RecordContext::ALL);
    std::lock_guard<std::mutex> g(hist_mu_);
    const uint64_t addr = reinterpret_cast<uint64_t>(ptr);
    auto it = live_.find(addr);
    if (it == live_.end()) {
      return;
    }
    Live l = std::move(it->second);
    live_.erase(it);
    const Context& c = ctx ? ctx : l.ctx;
    record(TraceEntry::FREE_REQUESTED, l.device, addr, l.requested, l.stream, l.pool, c);
    if (l.other_streams) {
      // The library holds the block until the other streams' work is done; its
      // completion is recorded when a snapshot or a reuse shows it.
      pending_.push_back(Pending{addr, std::move(l)});
    } else {
      record(TraceEntry::FREE_COMPLETED, l.device, addr, l.requested, l.stream, l.pool, c);
    }
  }

  // Caller holds hist_mu_.
  void settle_pending(const std::vector<std::pair<int, Segments>>& per_device) {
    for (auto it = pending_.begin(); it != pending_.end();) {
      bool still = false;
      for (const auto& [device, s] : per_device) {
        if (device != it->live.device) {
          continue;
        }
        for (const auto& b : s.blocks) {
          if (b.address == it->addr && b.state == 2) {
            still = true;
            break;
          }
        }
      }
      if (still) {
        ++it;
        continue;
      }
      record(
          TraceEntry::FREE_COMPLETED,
          it->live.device,
          it->addr,
          it->live.requested,
          it->live.stream,
          it->live.pool,
          it->live.ctx);
      it = pending_.erase(it);
    }
  }

  void record_segment_frees(const std::vector<std::pair<int, Segments>>& before) {
    std::vector<std::pair<int, Segments>> after;
    for (const auto& [device, s] : before) {
      after.emplace_back(device, fetch_segments(device));
    }
    std::lock_guard<std::mutex> g(hist_mu_);
    for (size_t i = 0; i < before.size(); ++i) {
      const int device = before[i].first;
      std::unordered_set<uint64_t> kept;
      for (const auto& seg : after[i].second.segs) {
        kept.insert(seg.address);
      }
      for (const auto& seg : before[i].second.segs) {
        if (!kept.count(seg.address) && !seg.is_expandable) {
          record(
              TraceEntry::SEGMENT_FREE,
              static_cast<DeviceIndex>(device),
              seg.address,
              seg.total_size,
              reinterpret_cast<cudaStream_t>(seg.stream),
              {seg.pool_id0, seg.pool_id1},
              nullptr);
        }
      }
    }
    settle_pending(after);
  }

  void traced_restore(
      DeviceIndex device,
      MempoolId_t pool,
      const std::vector<uint64_t>& freed,
      const std::vector<streamalloc_pool_block_t>& allocated) {
    std::lock_guard<std::mutex> g(hist_mu_);
    for (uint64_t addr : freed) {
      auto it = live_.find(addr);
      size_t requested = it != live_.end() ? it->second.requested : 0;
      cudaStream_t stream = it != live_.end() ? it->second.stream : nullptr;
      record(TraceEntry::FREE_REQUESTED, device, addr, requested, stream, pool, nullptr);
      record(TraceEntry::FREE_COMPLETED, device, addr, requested, stream, pool, nullptr);
      if (it != live_.end()) {
        live_.erase(it);
      }
    }
    for (const auto& b : allocated) {
      auto stream = reinterpret_cast<cudaStream_t>(b.stream);
      record(TraceEntry::ALLOC, device, b.address, b.requested, stream, pool, nullptr);
      live_[b.address] = Live{b.requested, stream, device, pool, nullptr, false};
    }
  }

  void close_ipc(const std::string& handle, uint64_t generation) {
    std::lock_guard<std::mutex> g(ipc_mu_);
    auto it = ipc_.find(handle);
    if (it != ipc_.end() && it->second.generation == generation) {
      close_ipc_locked(it);
    }
  }

  // Runs in a shared_ptr deleter too: reports failures, never throws.
  void close_ipc_locked(std::unordered_map<std::string, IpcEntry>::iterator it) {
    IpcEntry e = it->second;
    ipc_.erase(it);
    try {
      if (e.expandable) {
        if (streamalloc_ipc_close(e.ptr) != 0) {
          TORCH_WARN("streamalloc: closing an IPC mapping failed: ", last_error());
        }
        return;
      }
      c10::cuda::CUDAGuard g(e.device);
      C10_CUDA_CHECK_WARN(cudaIpcCloseMemHandle(e.ptr));
    } catch (const std::exception& err) {
      TORCH_WARN("streamalloc: closing an IPC mapping failed: ", err.what());
    }
  }

  std::atomic<int> device_count_{0};
  DeviceState devices_[kMaxDevices];

  // Memory history and trace trackers. tracing_ is the only part malloc and free read
  // when both are off.
  std::atomic<bool> tracing_{false};
  std::mutex hist_mu_;
  bool record_ = false;
  std::atomic<int> when_{static_cast<int>(RecordContext::NEVER)};
  std::atomic<CCA::CreateContextFn> recorder_{nullptr};
  size_t max_entries_ = 1;
  std::unordered_set<int> skip_;
  std::vector<CCA::AllocatorTraceTracker> trackers_;
  Ring<TraceEntry> rings_[kMaxDevices];
  Ring<AnnotationEntry> annotations_;
  std::unordered_map<uint64_t, Live> live_;
  std::vector<Pending> pending_;
  c10::ApproximateClockToUnixTimeConverter clock_;

  std::mutex oom_mu_;
  std::vector<CCA::OutOfMemoryObserver> oom_observers_;

  std::mutex ipc_mu_;
  std::unordered_map<std::string, IpcEntry> ipc_;
  uint64_t ipc_generation_ = 0;
};

// Never destroyed: PyTorch holds a raw pointer to it until the process ends, and tensors
// freed during interpreter shutdown still come back through raw_free.
std::shared_ptr<StreamallocAllocator>* g_holder = nullptr;
StreamallocAllocator* g_allocator = nullptr;
std::mutex g_install_mu;

void raw_free(void* ptr) {
  if (ptr != nullptr) {
    g_allocator->free_ptr(ptr);
  }
}

// What torch::cuda::CUDAPluggableAllocator::changeCurrentAllocator does, plus
// c10::SetAllocator so that c10::GetAllocator(kCUDA) and torch.accelerator's memory calls
// see the same allocator.
void install() {
  std::lock_guard<std::mutex> g(g_install_mu);
  CCA::CUDAAllocator* current = CCA::allocator.load();
  if (g_allocator != nullptr && current == g_allocator) {
    return;
  }
  TORCH_CHECK(
      current == nullptr || !current->initialized(),
      "streamalloc: PyTorch's CUDA allocator (",
      current ? current->name() : std::string("none"),
      ") is already initialized: CUDA was used before streamalloc.torch.install(); call "
      "install() before the first CUDA tensor");
  if (g_holder == nullptr) {
    g_holder = new std::shared_ptr<StreamallocAllocator>(std::make_shared<StreamallocAllocator>());
    g_allocator = g_holder->get();
  }
  CCA::allocator.store(g_allocator);
  c10::SetAllocator(c10::DeviceType::CUDA, g_allocator);
}

} // namespace
} // namespace streamalloc_door

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "streamalloc's native PyTorch door (a CUDAAllocator over libstreamalloc.so)";
  m.def(
      "install",
      [] {
        try {
          streamalloc_door::install();
        } catch (const c10::Error& e) {
          throw std::runtime_error(e.what_without_backtrace());
        }
      },
      "Makes streamalloc PyTorch's CUDA allocator; call before CUDA is used.");
  m.def(
      "installed",
      [] {
        return streamalloc_door::g_allocator != nullptr &&
            c10::cuda::CUDACachingAllocator::allocator.load() == streamalloc_door::g_allocator;
      },
      "True while streamalloc is PyTorch's CUDA allocator through this door.");
  m.def(
      "library_version",
      [] {
        const char* v = streamalloc_version();
        return std::string(v ? v : "");
      },
      "libstreamalloc.so's version string, as linked.");
}
