// Allocation and freeing (PyTorch's allocate, raw_alloc and the DataPtr deleter), devices,
// memory fractions and the cache: the calls every tensor makes. The only work beyond the
// library's call is what PyTorch's profiler, memory history and trace trackers ask to be
// told, skipped at the cost of a load each while they are off.

#include "door.h"

namespace streamalloc_door {

c10::DataPtr StreamallocAllocator::allocate(size_t size) {
  constexpr size_t one_exa_bytes = 1152921504606846976ULL;
  TORCH_CHECK_WITH(
      OutOfMemoryError,
      size < one_exa_bytes,
      "CUDA out of memory. Tried to allocate more than 1EB memory.");
  DeviceIndex device = 0;
  C10_CUDA_CHECK(c10::cuda::GetDevice(&device));
  void* p = nullptr;
  if (size != 0) {
    const c10::cuda::CUDAStream stream = c10::cuda::getCurrentCUDAStream(device);
    // An external stream (ExternalStream, getStreamFromExternal) has its handle as its id,
    // whose low bit is 0; PyTorch's own streams have it set. Its owner may destroy it
    // while blocks freed on it are cached, so the library must not name it later.
    const c10::StreamId id = stream.id();
    if (C10_UNLIKELY(id != 0 && (id & 1) == 0)) {
      streamalloc_stream_volatile(device, stream.stream());
    }
    p = malloc_on(size, device, stream.stream());
  }
  return {p, p, &raw_free, c10::Device(c10::DeviceType::CUDA, device)};
}

c10::DeleterFnPtr StreamallocAllocator::raw_deleter() const {
  return &raw_free;
}

void* StreamallocAllocator::raw_alloc(size_t nbytes) {
  if (nbytes == 0) {
    return nullptr;
  }
  DeviceIndex device = 0;
  C10_CUDA_CHECK(c10::cuda::GetDevice(&device));
  return malloc_on(nbytes, device, c10::cuda::getCurrentCUDAStream(device).stream());
}

void* StreamallocAllocator::raw_alloc_with_stream(size_t nbytes, cudaStream_t stream) {
  if (nbytes == 0) {
    return nullptr;
  }
  DeviceIndex device = 0;
  C10_CUDA_CHECK(c10::cuda::GetDevice(&device));
  return malloc_on(nbytes, device, stream);
}

void StreamallocAllocator::raw_delete(void* ptr) {
  raw_free(ptr);
}

void StreamallocAllocator::copy_data(void* dest, const void* src, std::size_t count) const {
  C10_CUDA_CHECK(cudaMemcpy(dest, src, count, cudaMemcpyDeviceToDevice));
}

void StreamallocAllocator::recordStream(const c10::DataPtr& ptr, c10::cuda::CUDAStream stream) {
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
void StreamallocAllocator::free_ptr(void* ptr) {
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

void* StreamallocAllocator::malloc_on(size_t size, DeviceIndex device, cudaStream_t stream) {
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
void StreamallocAllocator::report_to_profiler(
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

void StreamallocAllocator::alloc_failed(
    size_t size,
    DeviceIndex device,
    cudaStream_t stream,
    MempoolId_t pool,
    const Context& ctx) {
  std::string msg = last_error();
  if (msg.find("out of memory") == std::string::npos) {
    TORCH_CHECK(
        false,
        "streamalloc: allocating " + std::to_string(size) + " bytes on device " +
            std::to_string(static_cast<int>(device)) + " failed: " + msg);
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
  // Begun as PyTorch's own message: programs that catch an out-of-memory to retry with
  // less (batch size finders) look for "CUDA out of memory." in its text.
  TORCH_CHECK_WITH(OutOfMemoryError, false, "CUDA out of memory. " + msg);
  std::abort();
}

void StreamallocAllocator::init(int device_count) {
  int prev = device_count_.load();
  while (device_count > prev && !device_count_.compare_exchange_weak(prev, device_count)) {
  }
}

bool StreamallocAllocator::initialized() {
  return device_count_.load() > 0;
}

void StreamallocAllocator::enable(bool value) {
  if (!value) {
    unsupported(
        "enable(false)",
        "streamalloc has no uncached mode; every allocation goes through its cache");
  }
}

bool StreamallocAllocator::isEnabled() const {
  return true;
}

double StreamallocAllocator::getMemoryFraction(DeviceIndex device) {
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

void StreamallocAllocator::setMemoryFraction(double fraction, DeviceIndex device) {
  TORCH_CHECK(
      0 <= fraction && fraction <= 1,
      "invalid fraction:" + std::to_string(fraction) + ". Please set within [0, 1].");
  DeviceState& d = touch(device);
  streamalloc_set_memory_fraction(fraction, device);
  std::lock_guard<std::mutex> g(d.mu);
  d.fraction = fraction;
}

std::vector<CCA::StreamSegmentSize> StreamallocAllocator::getExpandableSegmentSizes(DeviceIndex device) {
  dev(device);
  return {};
}

void StreamallocAllocator::cacheInfo(DeviceIndex device, size_t* largestBlock) {
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

void StreamallocAllocator::emptyCache(MempoolId_t mempool_id) {
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

void* StreamallocAllocator::getBaseAllocation(void* ptr, size_t* size) {
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

void StreamallocAllocator::enablePeerAccess(DeviceIndex dev_from, DeviceIndex dev_to_access) {
  c10::cuda::CUDAGuard g(dev_from);
  cudaError_t err = cudaDeviceEnablePeerAccess(dev_to_access, 0);
  if (err == cudaErrorPeerAccessAlreadyEnabled) {
    (void)cudaGetLastError();
  } else {
    C10_CUDA_CHECK(err);
  }
}

cudaError_t StreamallocAllocator::memcpyAsync(
    void* dst,
    int dstDevice,
    const void* src,
    int srcDevice,
    size_t count,
    cudaStream_t stream,
    bool p2p_enabled) {
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

std::string StreamallocAllocator::name() {
  return "streamalloc";
}

DeviceState& StreamallocAllocator::dev(DeviceIndex device) {
  TORCH_CHECK(
      0 <= device && device < kMaxDevices,
      "streamalloc: invalid device " + std::to_string(static_cast<int>(device)) +
          " (devices 0.." + std::to_string(kMaxDevices - 1) + " are supported)");
  return devices_[device];
}

DeviceState& StreamallocAllocator::touch(DeviceIndex device) {
  DeviceState& d = dev(device);
  if (C10_UNLIKELY(!d.used.load(std::memory_order_relaxed))) {
    d.used.store(true, std::memory_order_relaxed);
  }
  return d;
}

int StreamallocAllocator::highest_used() const {
  for (int i = kMaxDevices - 1; i >= 0; --i) {
    if (devices_[i].used.load()) {
      return i;
    }
  }
  return -1;
}

} // namespace streamalloc_door
