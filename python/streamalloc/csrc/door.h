// The native PyTorch door's declarations, shared by its parts. The door is streamalloc as
// PyTorch's CUDA allocator, plugged in the way PyTorch's own cudaMallocAsync backend is (a
// CUDAAllocator stored into c10::cuda::CUDACachingAllocator::allocator), so that every
// question PyTorch asks its allocator reaches streamalloc. One file per seam:
//
//   torch_door.cpp     the module: installing the allocator, the Python bindings, helpers
//   door_allocate.cpp  allocation and freeing, devices, limits, the cache
//   door_pools.cpp     pools for CUDA graphs and torch.cuda.MemPool, checkpoints
//   door_stats.cpp     PyTorch's statistics, placed from the library's
//   door_history.cpp   snapshots and the memory history PyTorch's tools read
//   door_ipc.cpp       CUDA IPC of allocations to and from other processes
//
// Built together at first use by streamalloc/_door.py against the installed PyTorch.
#pragma once

#include <c10/core/impl/GPUTrace.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/util/ApproximateClock.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <iterator>
#include <memory>
#include <mutex>
#include <stack>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "streamalloc.h"

namespace streamalloc_door {

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

// ---- helpers (torch_door.cpp) ----------------------------------------------------------

// The library's last error, or a placeholder when it gave none.
std::string last_error();

// Messages that carry numbers are built with std::to_string and this, never with
// iostreams: formatting a number through an ostream inside the door crashed PyTorch 2.11's
// processes (a segfault in the stream's number formatting), where TORCH_CHECK with a single
// prebuilt string does not format at all.
std::string hex_address(const void* ptr);

// Raises PyTorch's error for a failed library call, with the library's message.
[[noreturn]] void fail(const char* what);

// Raises PyTorch's error for a request the door does not serve, saying why.
[[noreturn]] void unsupported(const char* name, const char* why);

bool is_default(const MempoolId_t& id);

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

// The segments and blocks of `device` now, as the library lists them.
Segments fetch_segments(int device);

// A pool's checkpoint: what streamalloc_pool_checkpoint listed, with the pool it names.
struct PoolState : CCA::AllocatorState {
  int device = 0;
  MempoolId_t id{0, 0};
  std::vector<streamalloc_pool_block_t> blocks;
};

void raw_free(void* ptr);

// The door: every method of PyTorch's CUDAAllocator over the library's C ABI.
class StreamallocAllocator final : public CCA::CUDAAllocator {
 public:
  using CCA::CUDAAllocator::recordStream;

  // ---- allocation and freeing, devices, limits, the cache (door_allocate.cpp) ---------

  c10::DataPtr allocate(size_t size) override;
  c10::DeleterFnPtr raw_deleter() const override;
  void* raw_alloc(size_t nbytes) override;
  void* raw_alloc_with_stream(size_t nbytes, cudaStream_t stream) override;
  void raw_delete(void* ptr) override;
  void copy_data(void* dest, const void* src, std::size_t count) const override;
  void recordStream(const c10::DataPtr& ptr, c10::cuda::CUDAStream stream) override;
  void free_ptr(void* ptr);
  void init(int device_count) override;
  bool initialized() override;
  void enable(bool value) override;
  bool isEnabled() const override;
  double getMemoryFraction(DeviceIndex device) override;
  void setMemoryFraction(double fraction, DeviceIndex device) override;
  std::vector<CCA::StreamSegmentSize> getExpandableSegmentSizes(DeviceIndex device) override;
  void cacheInfo(DeviceIndex device, size_t* largestBlock) override;
  void emptyCache(MempoolId_t mempool_id) override;
  void* getBaseAllocation(void* ptr, size_t* size) override;
  void enablePeerAccess(DeviceIndex dev_from, DeviceIndex dev_to_access) override;
  cudaError_t memcpyAsync(
      void* dst,
      int dstDevice,
      const void* src,
      int srcDevice,
      size_t count,
      cudaStream_t stream,
      bool p2p_enabled) override;
  std::string name() override;

  // ---- statistics (door_stats.cpp) ----------------------------------------------------

  DeviceStats getDeviceStats(DeviceIndex device) override;
  void resetAccumulatedStats(DeviceIndex device) override;
  void resetPeakStats(DeviceIndex device) override;

  // ---- snapshots and the memory history (door_history.cpp) ----------------------------

  CCA::SnapshotInfo snapshot(MempoolId_t mempool_id, bool include_traces) override;
  void recordHistory(
      bool enabled,
      CCA::CreateContextFn context_recorder,
      size_t alloc_trace_max_entries,
      RecordContext when,
      bool clearHistory,
      const std::vector<std::string>& skip_actions) override;
  bool isHistoryEnabled() override;
  void recordAnnotation(const std::vector<std::pair<std::string, std::string>>& md) override;
  void pushCompileContext(std::string& md) override;
  void popCompileContext() override;
  void setUserMetadata(const std::string& metadata) override;
  std::string getUserMetadata() override;
  void attachOutOfMemoryObserver(CCA::OutOfMemoryObserver observer) override;
  void attachAllocatorTraceTracker(CCA::AllocatorTraceTracker tracker) override;

  // ---- pools: CUDA graphs, torch.cuda.MemPool, checkpoints (door_pools.cpp) -----------

  void beginAllocateToPool(
      DeviceIndex device,
      MempoolId_t mempool_id,
      std::function<bool(cudaStream_t)> filter) override;
  void endAllocateToPool(DeviceIndex device, MempoolId_t mempool_id) override;
  void releasePool(DeviceIndex device, MempoolId_t mempool_id) override;
  void createOrIncrefPool(
      DeviceIndex device,
      MempoolId_t mempool_id,
      std::shared_ptr<CCA::CUDAAllocator> allocator) override;
  static void* segment_alloc(void* source, size_t size, int device);
  static void segment_free(void* source, void* ptr, size_t size, int device);
  int getPoolUseCount(DeviceIndex device, MempoolId_t mempool_id) override;
  void setUseOnOOM(DeviceIndex device, MempoolId_t mempool_id, bool use_on_oom) override;
  void setNoSplit(DeviceIndex device, MempoolId_t mempool_id) override;
  bool checkPoolLiveAllocations(
      DeviceIndex device,
      MempoolId_t mempool_id,
      const std::unordered_set<void*>& expected_live_allocations) override;
  std::shared_ptr<CCA::AllocatorState> getCheckpointState(
      DeviceIndex device,
      MempoolId_t id) override;
  CCA::CheckpointDelta setCheckpointPoolState(
      DeviceIndex device,
      std::shared_ptr<CCA::AllocatorState> as) override;

  // ---- CUDA IPC (door_ipc.cpp) --------------------------------------------------------

  CCA::ShareableHandle shareIpcHandle(void* ptr) override;
  std::shared_ptr<void> getIpcDevPtr(std::string handle) override;

 private:
  struct IpcEntry {
    DeviceIndex device;
    void* ptr;
    uint64_t generation;
    std::weak_ptr<void> wp;
    bool expandable; // opened by streamalloc_ipc_open, not cudaIpcOpenMemHandle
  };

  // ---- allocation and freeing, devices, limits, the cache (door_allocate.cpp) ---------

  void* malloc_on(size_t size, DeviceIndex device, cudaStream_t stream);
  static void report_to_profiler(
      void* ptr,
      int64_t size,
      uint64_t allocated,
      uint64_t reserved,
      int device);
  [[noreturn]] void alloc_failed(
      size_t size,
      DeviceIndex device,
      cudaStream_t stream,
      MempoolId_t pool,
      const Context& ctx);
  DeviceState& dev(DeviceIndex device);
  DeviceState& touch(DeviceIndex device);
  int highest_used() const;

  // ---- snapshots and the memory history (door_history.cpp) ----------------------------

  uint64_t segment_allocs(DeviceIndex device);
  Context gather(RecordContext level);
  static std::stack<std::string>& compile_context();
  static std::string& user_metadata();
  void record(
      TraceEntry::Action action,
      DeviceIndex device,
      uint64_t addr,
      size_t size,
      cudaStream_t stream,
      MempoolId_t pool,
      const Context& ctx);
  void update_tracing_locked();
  void traced_alloc(
      void* p,
      size_t size,
      DeviceIndex device,
      cudaStream_t stream,
      MempoolId_t pool,
      Context ctx,
      uint64_t segments_before);
  void traced_free(void* ptr);
  void settle_pending(const std::vector<std::pair<int, Segments>>& per_device);
  void record_segment_frees(const std::vector<std::pair<int, Segments>>& before);
  void traced_restore(
      DeviceIndex device,
      MempoolId_t pool,
      const std::vector<uint64_t>& freed,
      const std::vector<streamalloc_pool_block_t>& allocated);

  // ---- pools: CUDA graphs, torch.cuda.MemPool, checkpoints (door_pools.cpp) -----------

  MempoolId_t pool_for(DeviceState& d, cudaStream_t stream);

  // ---- CUDA IPC (door_ipc.cpp) --------------------------------------------------------

  bool share_mapped(void* ptr, CCA::ShareableHandle* shared);
  CCA::ShareableHandle failed_share(void* ptr, const std::string& why);
  void close_ipc(const std::string& handle, uint64_t generation);
  void close_ipc_locked(std::unordered_map<std::string, IpcEntry>::iterator it);

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

} // namespace streamalloc_door
