// The exchange's packing and unpacking in bulk: one launch copies every piece of a message
// (thousands of small tensors into or out of a staging buffer), where copying tensor by
// tensor costs one PyTorch call, or one driver call, per tensor.
//
// A launch gets a table of pieces: source and destination addresses, lengths, and for each
// piece the index of its first chunk of CHUNK bytes (a prefix sum, so `first[count]` is the
// end). Each warp copies one chunk: it finds its piece by binary search over `first`, then
// copies with the widest unit that source and destination alignment allow (16, 8, 4, 2 or 1
// bytes; chunks start at multiples of 16 bytes into a piece, so every chunk of a piece has
// its alignment). Chunking spreads a large piece over many warps, and many small pieces
// fill the grid.
//
// This file is compiled twice: by NVRTC for the GPU (streamalloc._p2p_copy), and as plain
// C++ by benches/gpu/p2p/copy_kernel_check.py, which runs every warp's lanes in turn on the
// CPU. Lanes touch disjoint bytes and no piece's source overlaps any destination, so that
// order computes what the GPU computes.
#ifndef STREAMALLOC_P2P_COPY_KERNEL_H
#define STREAMALLOC_P2P_COPY_KERNEL_H

#define SA_CHUNK_BYTES 8192ULL
#define SA_WARPS_PER_BLOCK 8
#define SA_LANES 32

typedef unsigned long long sa_u64;

#if defined(__CUDACC__)
#define SA_DEVICE __device__ __forceinline__
#define SA_RESTRICT __restrict__
#else
#define SA_DEVICE static inline
#define SA_RESTRICT
#endif

struct alignas(16) sa_v16 {
  sa_u64 lo, hi;
};

// The piece that chunk `chunk` belongs to: the last i with first[i] <= chunk (pieces of zero
// chunks are never in a table).
SA_DEVICE unsigned sa_piece_of(const sa_u64* first, unsigned count, sa_u64 chunk) {
  unsigned lo = 0, hi = count;  // first[lo] <= chunk < first[hi]
  while (hi - lo > 1) {
    unsigned mid = lo + (hi - lo) / 2;
    if (first[mid] <= chunk) {
      lo = mid;
    } else {
      hi = mid;
    }
  }
  return lo;
}

// One lane's share of copying n bytes from s to d in units of T (s and d aligned to T): four
// loads in flight per lane, then the rest, then the bytes past the last whole unit.
template <typename T>
SA_DEVICE void sa_copy_units(const unsigned char* s, unsigned char* d, sa_u64 n, unsigned lane) {
  const T* SA_RESTRICT st = reinterpret_cast<const T*>(s);
  T* SA_RESTRICT dt = reinterpret_cast<T*>(d);
  const sa_u64 units = n / sizeof(T);
  sa_u64 u = lane;
  for (; u + 3 * SA_LANES < units; u += 4 * SA_LANES) {
    T a = st[u];
    T b = st[u + SA_LANES];
    T c = st[u + 2 * SA_LANES];
    T e = st[u + 3 * SA_LANES];
    dt[u] = a;
    dt[u + SA_LANES] = b;
    dt[u + 2 * SA_LANES] = c;
    dt[u + 3 * SA_LANES] = e;
  }
  for (; u < units; u += SA_LANES) {
    dt[u] = st[u];
  }
  for (sa_u64 b = units * sizeof(T) + lane; b < n; b += SA_LANES) {
    d[b] = s[b];
  }
}

// Lane `lane` of the warp that copies chunk `chunk` of the table.
SA_DEVICE void sa_copy_chunk(const sa_u64* src, const sa_u64* dst, const sa_u64* len,
                             const sa_u64* first, unsigned count, sa_u64 chunk, unsigned lane) {
  const unsigned i = sa_piece_of(first, count, chunk);
  const sa_u64 offset = (chunk - first[i]) * SA_CHUNK_BYTES;
  sa_u64 n = len[i] - offset;
  if (n > SA_CHUNK_BYTES) {
    n = SA_CHUNK_BYTES;
  }
  const unsigned char* s = reinterpret_cast<const unsigned char*>(src[i] + offset);
  unsigned char* d = reinterpret_cast<unsigned char*>(dst[i] + offset);
  const sa_u64 misaligned = (src[i] | dst[i]) & 15ULL;
  if (misaligned == 0) {
    sa_copy_units<sa_v16>(s, d, n, lane);
  } else if ((misaligned & 7ULL) == 0) {
    sa_copy_units<sa_u64>(s, d, n, lane);
  } else if ((misaligned & 3ULL) == 0) {
    sa_copy_units<unsigned int>(s, d, n, lane);
  } else if ((misaligned & 1ULL) == 0) {
    sa_copy_units<unsigned short>(s, d, n, lane);
  } else {
    sa_copy_units<unsigned char>(s, d, n, lane);
  }
}

#if defined(__CUDACC__)
// Grid: ceil((first[count] - first[0]) / SA_WARPS_PER_BLOCK) blocks of
// SA_WARPS_PER_BLOCK * SA_LANES threads; the table's arrays start at the launch's first piece.
extern "C" __global__ void __launch_bounds__(SA_WARPS_PER_BLOCK * SA_LANES)
    streamalloc_p2p_copy(const sa_u64* src, const sa_u64* dst, const sa_u64* len,
                         const sa_u64* first, unsigned count) {
  const unsigned warp = threadIdx.x / SA_LANES;
  const unsigned lane = threadIdx.x % SA_LANES;
  const sa_u64 chunk = first[0] + static_cast<sa_u64>(blockIdx.x) * SA_WARPS_PER_BLOCK + warp;
  if (chunk >= first[count]) {
    return;
  }
  sa_copy_chunk(src, dst, len, first, count, chunk, lane);
}
#else
// The CPU's stand-in for one launch: every chunk, every lane, in turn.
extern "C" void streamalloc_p2p_copy_cpu(const sa_u64* src, const sa_u64* dst, const sa_u64* len,
                                         const sa_u64* first, unsigned count) {
  for (sa_u64 chunk = first[0]; chunk < first[count]; ++chunk) {
    for (unsigned lane = 0; lane < SA_LANES; ++lane) {
      sa_copy_chunk(src, dst, len, first, count, chunk, lane);
    }
  }
}
#endif

#endif  // STREAMALLOC_P2P_COPY_KERNEL_H
