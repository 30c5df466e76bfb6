// PyTorch's statistics (torch.cuda.memory_stats() and friends): the library names each
// value by PyTorch's key, and this file only places it in DeviceStats.

#include "door.h"

namespace streamalloc_door {

namespace {


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

} // namespace

DeviceStats StreamallocAllocator::getDeviceStats(DeviceIndex device) {
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

void StreamallocAllocator::resetAccumulatedStats(DeviceIndex device) {
  if (dev(device).used.load() && streamalloc_reset_accumulated_stats(device) != 0) {
    fail("resetAccumulatedStats");
  }
}

void StreamallocAllocator::resetPeakStats(DeviceIndex device) {
  if (dev(device).used.load() && streamalloc_reset_peak_stats(device) != 0) {
    fail("resetPeakStats");
  }
}

} // namespace streamalloc_door
