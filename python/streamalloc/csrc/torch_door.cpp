// The native PyTorch door's module: installing streamalloc as PyTorch's CUDA allocator and
// the Python bindings, with the helpers every part of the door shares (door.h lists the
// parts).
//
// Policy lives in libstreamalloc.so; the door only translates PyTorch's calls into the C
// ABI of streamalloc.h. It keeps only what that ABI has no place for: which pool a
// capturing stream allocates to (PyTorch hands the allocator C++ filters), the memory
// history PyTorch's snapshot tools read (stack contexts are PyTorch objects), the IPC
// mappings opened for other processes' memory, and the allocators of
// MemPool(allocator=...) pools (PyTorch objects the library calls back into for segments).
// Statistics arrive under PyTorch's names from the library, which only need placing.
//
// Built at first use by streamalloc/_door.py against the installed PyTorch.

#include <torch/extension.h>

#include "door.h"

namespace streamalloc_door {

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

namespace {


// Never destroyed: PyTorch holds a raw pointer to it until the process ends, and tensors
// freed during interpreter shutdown still come back through raw_free.
std::shared_ptr<StreamallocAllocator>* g_holder = nullptr;
StreamallocAllocator* g_allocator = nullptr;
std::mutex g_install_mu;

} // namespace

void raw_free(void* ptr) {
  if (ptr != nullptr) {
    g_allocator->free_ptr(ptr);
  }
}

namespace {

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
