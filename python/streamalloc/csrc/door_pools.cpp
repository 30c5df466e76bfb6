// Pools: CUDA graph captures and torch.cuda.MemPool (which pool a capturing stream
// allocates to is decided here: PyTorch hands the allocator C++ filters), MemPool rules and
// allocators, and the checkpoints of cudagraph trees.

#include "door.h"

namespace streamalloc_door {

void StreamallocAllocator::beginAllocateToPool(
    DeviceIndex device,
    MempoolId_t mempool_id,
    std::function<bool(cudaStream_t)> filter) {
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

void StreamallocAllocator::endAllocateToPool(DeviceIndex device, MempoolId_t mempool_id) {
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

void StreamallocAllocator::releasePool(DeviceIndex device, MempoolId_t mempool_id) {
  touch(device);
  if (streamalloc_pool_release(device, mempool_id.first, mempool_id.second) < 0) {
    fail("releasePool");
  }
}

void StreamallocAllocator::createOrIncrefPool(
    DeviceIndex device,
    MempoolId_t mempool_id,
    std::shared_ptr<CCA::CUDAAllocator> allocator) {
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
void* StreamallocAllocator::segment_alloc(void* source, size_t size, int device) {
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

void StreamallocAllocator::segment_free(void* source, void* ptr, size_t size, int device) {
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

int StreamallocAllocator::getPoolUseCount(DeviceIndex device, MempoolId_t mempool_id) {
  touch(device);
  return streamalloc_pool_use_count(device, mempool_id.first, mempool_id.second);
}

void StreamallocAllocator::setUseOnOOM(DeviceIndex device, MempoolId_t mempool_id, bool use_on_oom) {
  touch(device);
  if (streamalloc_pool_set_use_on_oom(
          device, mempool_id.first, mempool_id.second, use_on_oom ? 1 : 0) != 0) {
    fail("setUseOnOOM (torch.cuda.MemPool(use_on_oom=True))");
  }
}

void StreamallocAllocator::setNoSplit(DeviceIndex device, MempoolId_t mempool_id) {
  touch(device);
  if (streamalloc_pool_set_no_split(device, mempool_id.first, mempool_id.second) != 0) {
    fail("setNoSplit (torch.cuda.MemPool(no_split=True))");
  }
}

bool StreamallocAllocator::checkPoolLiveAllocations(
    DeviceIndex device,
    MempoolId_t mempool_id,
    const std::unordered_set<void*>& expected_live_allocations) {
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

std::shared_ptr<CCA::AllocatorState> StreamallocAllocator::getCheckpointState(
    DeviceIndex device,
    MempoolId_t id) {
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

CCA::CheckpointDelta StreamallocAllocator::setCheckpointPoolState(
    DeviceIndex device,
    std::shared_ptr<CCA::AllocatorState> as) {
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

// The pool a capturing stream allocates to: the most recent matching begin first, as
// CUDACachingAllocator searches captures_underway.
MempoolId_t StreamallocAllocator::pool_for(DeviceState& d, cudaStream_t stream) {
  std::lock_guard<std::mutex> g(d.mu);
  for (auto it = d.captures.rbegin(); it != d.captures.rend(); ++it) {
    if (it->filter(stream)) {
      return it->id;
    }
  }
  return {0, 0};
}

} // namespace streamalloc_door
