// Snapshots (torch.cuda.memory._snapshot()) and the memory history PyTorch's tools read
// (_record_memory_history, trace trackers, annotations): stack contexts are PyTorch
// objects, so the history is kept here; segments and blocks come from the library.

#include "door.h"

namespace streamalloc_door {

CCA::SnapshotInfo StreamallocAllocator::snapshot(MempoolId_t mempool_id, bool include_traces) {
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

void StreamallocAllocator::recordHistory(
    bool enabled,
    CCA::CreateContextFn context_recorder,
    size_t alloc_trace_max_entries,
    RecordContext when,
    bool clearHistory,
    const std::vector<std::string>& skip_actions) {
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

bool StreamallocAllocator::isHistoryEnabled() {
  std::lock_guard<std::mutex> g(hist_mu_);
  return record_;
}

void StreamallocAllocator::recordAnnotation(const std::vector<std::pair<std::string, std::string>>& md) {
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

void StreamallocAllocator::pushCompileContext(std::string& md) {
  if (isHistoryEnabled()) {
    compile_context().push(md);
  }
}

void StreamallocAllocator::popCompileContext() {
  if (!compile_context().empty()) {
    compile_context().pop();
  }
}

void StreamallocAllocator::setUserMetadata(const std::string& metadata) {
  user_metadata() = metadata;
}

std::string StreamallocAllocator::getUserMetadata() {
  return user_metadata();
}

void StreamallocAllocator::attachOutOfMemoryObserver(CCA::OutOfMemoryObserver observer) {
  std::lock_guard<std::mutex> g(oom_mu_);
  oom_observers_.push_back(std::move(observer));
}

void StreamallocAllocator::attachAllocatorTraceTracker(CCA::AllocatorTraceTracker tracker) {
  std::lock_guard<std::mutex> g(hist_mu_);
  trackers_.push_back(std::move(tracker));
  update_tracing_locked();
}

uint64_t StreamallocAllocator::segment_allocs(DeviceIndex device) {
  streamalloc_stats_t r{};
  return streamalloc_get_stats(device, &r) == 0 ? r.segment_allocs : 0;
}

Context StreamallocAllocator::gather(RecordContext level) {
  if (when_.load() < static_cast<int>(level)) {
    return nullptr;
  }
  CCA::CreateContextFn fn = recorder_.load();
  return fn ? fn() : nullptr;
}

std::stack<std::string>& StreamallocAllocator::compile_context() {
  thread_local std::stack<std::string> s;
  return s;
}

std::string& StreamallocAllocator::user_metadata() {
  thread_local std::string s;
  return s;
}

// Caller holds hist_mu_.
void StreamallocAllocator::record(
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
void StreamallocAllocator::update_tracing_locked() {
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

void StreamallocAllocator::traced_alloc(
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

void StreamallocAllocator::traced_free(void* ptr) {
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
void StreamallocAllocator::settle_pending(const std::vector<std::pair<int, Segments>>& per_device) {
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

void StreamallocAllocator::record_segment_frees(const std::vector<std::pair<int, Segments>>& before) {
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

void StreamallocAllocator::traced_restore(
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

} // namespace streamalloc_door
