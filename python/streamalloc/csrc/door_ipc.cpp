// CUDA IPC: sharing an allocation with another process (torch.multiprocessing) and
// opening one shared by another, PyTorch's handles and streamalloc's, with the mappings
// opened here for other processes' memory.

#include "door.h"

namespace streamalloc_door {

// Any allocation: a whole segment through cudaIpcGetMemHandle, memory mapped through the
// VMM API (an expandable segment, a stitched range) as its physical allocations. A
// failure is not thrown here, where it would leave the receiver waiting for a tensor
// that never comes (torch.multiprocessing pickles in a queue's feeder thread): the
// sender warns, and the handle carries the reason, which the receiver raises.
CCA::ShareableHandle StreamallocAllocator::shareIpcHandle(void* ptr) {
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

std::shared_ptr<void> StreamallocAllocator::getIpcDevPtr(std::string handle) {
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

// The handle of an allocation in an expandable segment or a stitched range, from the
// library; false (the reason in last_error) if it could not export it.
bool StreamallocAllocator::share_mapped(void* ptr, CCA::ShareableHandle* shared) {
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
CCA::ShareableHandle StreamallocAllocator::failed_share(void* ptr, const std::string& why) {
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

void StreamallocAllocator::close_ipc(const std::string& handle, uint64_t generation) {
  std::lock_guard<std::mutex> g(ipc_mu_);
  auto it = ipc_.find(handle);
  if (it != ipc_.end() && it->second.generation == generation) {
    close_ipc_locked(it);
  }
}

// Runs in a shared_ptr deleter too: reports failures, never throws.
void StreamallocAllocator::close_ipc_locked(std::unordered_map<std::string, IpcEntry>::iterator it) {
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

} // namespace streamalloc_door
