/* The C ABI of libstreamalloc.so that the native PyTorch door calls.
 *
 * Every function contains its own errors: a failure is a null pointer or a negative
 * return, with the message in streamalloc_last_error() (this thread's; every call clears
 * it or sets it, and it stays valid until the thread's next call). No function throws or
 * unwinds, except streamalloc_malloc when an error thrower is registered (the door never
 * registers one: it calls streamalloc_malloc_in_pool, which never throws). After a panic
 * inside a device's engine (a bug), every call on that device fails with "streamalloc:
 * device N is unusable after an internal panic: ...".
 *
 * The structs below are generated from Rust's (src/ffi/layout.rs); tests/c_header.rs
 * fails when they differ from what it generates, and checks that every function declared
 * here is exported.
 *
 * A pool id is PyTorch's MempoolId_t, two unsigned 64-bit integers; (0, 0) is the
 * default pool. A block of a pool is only ever handed to an allocation in the same pool,
 * and a pool's memory goes back to the device only once its use count has dropped to
 * zero (or on streamalloc_empty_cache_pool naming it). */
#ifndef STREAMALLOC_H
#define STREAMALLOC_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* ---- structs: generated from src/ffi/layout.rs: do not edit (see tests/c_header.rs) ---- */
/* streamalloc_stats_t: the engine's Stats, flattened. Byte gauges come as *_current / *_peak pairs. */
typedef struct streamalloc_stats {
  uint64_t allocated_current; /* Bytes in blocks handed out (rounded sizes), now. */
  uint64_t allocated_peak; /* Peak of allocated_current. */
  uint64_t requested_current; /* Bytes callers asked for, now. */
  uint64_t requested_peak; /* Peak of requested_current. */
  uint64_t reserved_current; /* Bytes obtained from the device, now. */
  uint64_t reserved_peak; /* Peak of reserved_current. */
  uint64_t active_current; /* Allocated plus freed-but-pending bytes, now. */
  uint64_t active_peak; /* Peak of active_current. */
  uint64_t pending_free_current; /* Free bytes still carrying other streams' events, now. */
  uint64_t pending_free_peak; /* Peak of pending_free_current. */
  uint64_t allocs; /* Blocks handed out. */
  uint64_t frees; /* Blocks returned. */
  uint64_t segment_allocs; /* Segments obtained from the device. */
  uint64_t segment_frees; /* Segments returned to the device. */
  uint64_t cross_stream_waits; /* Device-side waits made to reuse blocks across streams. */
  uint64_t events_recorded; /* Events recorded. */
  uint64_t event_queries; /* Event queries. */
  uint64_t events_outstanding; /* Events recorded and still referenced. */
  uint64_t events_created; /* Event objects created. */
  uint64_t events_destroyed; /* Event objects destroyed. */
  uint64_t ooms; /* Requests that failed for lack of memory. */
  uint64_t retries; /* Requests served only after releasing cached memory. */
  uint64_t invalid_frees; /* Frees of unknown or already freed pointers. */
  uint64_t memory_limit; /* Reserved-bytes limit in force (0: none). */
  uint64_t device_syncs; /* Device-wide synchronisations made (to release memory or to unmap pages). */
  uint64_t page_map_bytes; /* Bytes mapped into expandable segments, in all. */
  uint64_t page_unmap_bytes; /* Bytes unmapped from expandable segments, in all. */
  uint64_t stitches; /* Stitched ranges made (free pages mapped a second time into one range). */
  uint64_t stitched_map_bytes; /* Bytes mapped into stitched ranges (no memory reserved by them). */
  uint64_t stitch_revivals; /* Stitched ranges taken again without mapping. */
  uint64_t stitch_evictions; /* Stitched ranges unmapped. */
  uint64_t vmm_ns; /* Host nanoseconds spent in the driver's virtual-memory calls (map, second map, unmap). */
  uint64_t slow_paths; /* Requests the stream's own ready blocks could not serve (the policy's slow path). */
  uint64_t slow_path_ns; /* Host nanoseconds those requests took, driver calls and synchronisations included. */
  uint64_t sleeping_bytes; /* Bytes sleeping memory pools gave back to the device, addresses kept. */
  uint64_t host_backup_bytes; /* Bytes of page-locked host memory held for sleeping pools' backups. */
} streamalloc_stats_t;

/* streamalloc_segment_info_t: one segment of a snapshot; an expandable segment appears as one of these per run of mapped pages. */
typedef struct streamalloc_segment_info {
  uint64_t address; /* First byte. */
  uint64_t total_size; /* Bytes. */
  uint64_t stream; /* The cudaStream_t whose request created it. */
  uint64_t pool_id0; /* Its pool's id, first half. */
  uint64_t pool_id1; /* Its pool's id, second half. */
  uint32_t is_large; /* 0: small pool, 1: large. */
  uint32_t is_expandable; /* 1 for memory mapped into an expandable segment. */
  uint64_t first_block; /* Index of its first block in the blocks array. */
  uint64_t block_count; /* Its blocks. */
} streamalloc_segment_info_t;

/* streamalloc_block_state_t: one block of a snapshot. */
typedef struct streamalloc_block_state {
  uint64_t address; /* First byte. */
  uint64_t size; /* Bytes. */
  uint64_t requested_size; /* Bytes asked for (0 unless allocated). */
  uint64_t stream; /* Owning cudaStream_t. */
  uint32_t state; /* 0 inactive (free), 1 active_allocated, 2 active_pending_free. */
  uint32_t reserved; /* Zero. */
} streamalloc_block_state_t;

/* streamalloc_pool_block_t: one live allocation of a pool checkpoint. */
typedef struct streamalloc_pool_block {
  uint64_t address; /* First byte. */
  uint64_t size; /* Bytes reserved (rounded). */
  uint64_t requested; /* Bytes asked for. */
  uint64_t stream; /* The cudaStream_t it belongs to. */
} streamalloc_pool_block_t;

/* streamalloc_sleep_report_t: what one streamalloc_sleep or streamalloc_wake did. */
typedef struct streamalloc_sleep_report {
  uint64_t bytes; /* Bytes of device memory given back (sleep) or mapped again (wake). */
  uint64_t copied; /* Bytes copied to host memory (sleep) or back from it (wake). */
  uint64_t copies; /* Copies made. */
} streamalloc_sleep_report_t;
/* ---- end of generated text ---- */

/* ---- allocation ---------------------------------------------------------------- */

/* Allocates size bytes on device for use on stream, from pool (pool_id0, pool_id1).
 * The pool must exist (streamalloc_pool_incref) unless it is (0, 0). Null for size 0 and
 * on failure (unknown pool, out of memory: the message says which); never throws. */
void* streamalloc_malloc_in_pool(size_t size, int device, void* stream, uint64_t pool_id0,
                                 uint64_t pool_id1);
/* Returns ptr; size and stream are ignored. Null is ignored. A negative device means
 * "whichever device handed it out" (no wrong-device warning). */
void streamalloc_free(void* ptr, size_t size, int device, void* stream);
/* Notes that stream uses ptr (record_stream). */
void streamalloc_record_stream(void* ptr, void* stream);
/* Marks stream of device as one its owner may destroy while blocks freed on it are cached
 * (an external stream): each free on it fences itself, no later call names it. 0, or -1. */
int streamalloc_stream_volatile(int device, void* stream);

/* ---- pools --------------------------------------------------------------------- */

/* A graph capture into the pool, or a use_mem_pool context, begins (PyTorch's
 * beginAllocateToPool): creates the pool or adds a use to it. Until the matching end, the
 * engine makes none of the calls a capture forbids (event queries, waits on a capturing
 * stream's events, synchronisation) on any stream. Returns the new use count, or -1. */
int streamalloc_pool_begin_allocate(int device, uint64_t pool_id0, uint64_t pool_id1);
/* Ends the newest begin of the pool (endAllocateToPool); the pool keeps its use until
 * released. 0, or -1 (no begin to end). */
int streamalloc_pool_end_allocate(int device, uint64_t pool_id0, uint64_t pool_id1);
/* Creates the pool, or adds a use to it (createOrIncrefPool). Returns the new use count,
 * or -1. */
int streamalloc_pool_incref(int device, uint64_t pool_id0, uint64_t pool_id1);
/* Drops a use. At zero, the pool's free memory is returned by the next empty cache (or
 * out-of-memory retry), and its blocks still allocated follow when freed. Returns the
 * remaining use count, or -1 (unknown pool). */
int streamalloc_pool_release(int device, uint64_t pool_id0, uint64_t pool_id1);
/* Makes the pool take its segments from another allocator (torch.cuda.MemPool(allocator=
 * ...)): the engine calls alloc(ctx, size, device) for each segment it needs, whole, with
 * or without expandable segments for the other pools, splits and caches it for this pool
 * only, and calls free(ctx, ptr, size, device) when it releases it (empty_cache of the
 * pool after its last release, or an out-of-memory retry). The pool must not have
 * allocated yet. alloc and free must stay callable with ctx until every segment is freed.
 * 0, or -1. */
int streamalloc_pool_set_segment_source(int device, uint64_t pool_id0, uint64_t pool_id1,
                                        void* (*alloc)(void* ctx, size_t size, int device),
                                        void (*free)(void* ctx, void* ptr, size_t size,
                                                     int device),
                                        void* ctx);
/* Marks the pool (on != 0) as serving, from its memory, the default pool's requests that
 * find no memory (torch.cuda.MemPool(use_on_oom=True)), or unmarks it. The pool must
 * exist. 0, or -1. */
int streamalloc_pool_set_use_on_oom(int device, uint64_t pool_id0, uint64_t pool_id1, int on);
/* Makes the pool never split a block (torch.cuda.MemPool(no_split=True)): each block is a
 * whole segment of its own, its request rounded to 2 MiB. The pool must exist and not have
 * allocated yet. 0, or -1. */
int streamalloc_pool_set_no_split(int device, uint64_t pool_id0, uint64_t pool_id1);
/* The pool's use count; 0 for a pool that does not exist. */
int streamalloc_pool_use_count(int device, uint64_t pool_id0, uint64_t pool_id1);
/* Writes the addresses of the pool's live allocations (up to capacity of them) and
 * returns how many there are (call again with more room if that is more than capacity);
 * -1 on error. */
int64_t streamalloc_pool_live_allocations(int device, uint64_t pool_id0, uint64_t pool_id1,
                                          uint64_t* out, size_t capacity);
/* The pool's live allocations, as streamalloc_pool_live_allocations but with sizes and
 * streams: what a checkpoint keeps. */
int64_t streamalloc_pool_checkpoint(int device, uint64_t pool_id0, uint64_t pool_id1,
                                    streamalloc_pool_block_t* out, size_t capacity);
/* Puts the pool back to a checkpoint: synchronises the device, frees every live
 * allocation of the pool (their addresses go to freed_out, which must have room for all
 * of them: see streamalloc_pool_live_allocations) and allocates exactly the checkpoint's
 * blocks again, at their addresses. Returns the number of addresses freed, or -1 (then
 * nothing changed when the message says the room was too small or a checkpoint block no
 * longer lies in the pool's free memory). */
int64_t streamalloc_pool_restore(int device, uint64_t pool_id0, uint64_t pool_id1,
                                 const streamalloc_pool_block_t* blocks, size_t count,
                                 uint64_t* freed_out, size_t freed_capacity);

/* ---- sleep and wake of tagged pools ----------------------------------------------- */

/* Tags the pool (live, not the default one) with tag, a NUL-terminated UTF-8 name of 1 to
 * 256 bytes, so that sleep and wake can name it; a tag names one pool, a pool carries one
 * tag. From then on the pool's memory is mapped in whole allocations and never stitched.
 * Needs expandable_segments:true and graph_pools:true. 0, or -1. */
int streamalloc_tag_pool(int device, uint64_t pool_id0, uint64_t pool_id1, const char* tag);
/* Puts the count tags to sleep: waits on the host for the streams that may still use their
 * pools (an event per stream, not a device synchronisation), copies their live blocks to
 * page-locked host memory when backup is 1 (0: no copy), and returns every page to the
 * device, keeping addresses and blocks: live pointers stay valid for wake, allocations
 * into a sleeping pool fail, and touching its memory from a kernel is an illegal access.
 * Fills *report if not null. Refused with nothing changed (-1) for an unknown or sleeping
 * tag, or while a pool is being allocated to (a graph capture or use_mem_pool context). */
int streamalloc_sleep(int device, const char* const* tags, size_t count, int backup,
                      streamalloc_sleep_report_t* report);
/* Wakes the count sleeping tags: maps fresh memory at the addresses they left and copies
 * their backups back, then waits for the copies. Refused with nothing changed (-1) for an
 * unknown or awake tag, or when the limit or the device has no room. */
int streamalloc_wake(int device, const char* const* tags, size_t count,
                     streamalloc_sleep_report_t* report);
/* Frees the page-locked host buffers the awake tags keep for their next backup. Returns
 * the bytes freed, or -1. */
int64_t streamalloc_release_host_backup(int device, const char* const* tags, size_t count);
/* The device's tags as a JSON array: [{"tag", "pool": [id0, id1], "asleep", "bytes",
 * "allocated", "backed_up", "host_bytes"}]. Valid until the next call on the thread; null
 * on error. */
const char* streamalloc_tags_json(int device);

/* ---- IPC of expandable-segment memory ---------------------------------------------- */

/* ---- IPC of mapped memory ---------------------------------------------------------- */

/* Writes the IPC handle of the live allocation at ptr, which lies in an expandable segment
 * or a stitched range (whole segments are shared with cudaIpcGetMemHandle), into out, and
 * the allocation's offset from the first byte the handle opens into *offset. A stitched
 * range is shared as its pages, in order. The handle is PyTorch's own expandable-segment
 * format (version 2, type 'e') when every allocation shared has one size, so PyTorch's
 * allocator can open it; otherwise streamalloc's (type 's'). Returns the handle's length;
 * if that exceeds capacity nothing is written (call again with more room). -1 on error. */
int64_t streamalloc_ipc_export(void* ptr, uint8_t* out, size_t capacity, uint64_t* offset);
/* Writes a failed export's handle (type 'x') carrying message, the sender's reason for not
 * sharing, into out: the receiver's streamalloc_ipc_open fails with it. Returns the
 * handle's length (nothing written if it exceeds capacity), or -1. */
int64_t streamalloc_ipc_failure_handle(const char* message, uint8_t* out, size_t capacity);
/* Opens a handle of type 'e' (from PyTorch's allocator or streamalloc) or 's' sent by
 * another process, on device: copies the sender's file descriptors (pidfd_getfd; needs
 * ptrace access to the sender) and maps them. Returns the first byte (add the sender's
 * offset), or null (for an 'x' handle, with the sender's reason). */
void* streamalloc_ipc_open(const uint8_t* handle, size_t len, int device);
/* Synchronises the device and unmaps what streamalloc_ipc_open returned. 0, or -1. */
int streamalloc_ipc_close(void* base);

/* ---- cache, limits, introspection ------------------------------------------------ */

/* Synchronises the device and returns cached memory: with pool (0, 0), every wholly free
 * segment of the default pool and of pools whose use count is zero; otherwise the wholly
 * free segments of that pool only. 0, or -1. */
int streamalloc_empty_cache_pool(int device, uint64_t pool_id0, uint64_t pool_id1);
/* Every device in use, as empty_cache_pool with (0, 0). */
void streamalloc_empty_cache(void);
void streamalloc_set_memory_fraction(double fraction, int device);
/* The largest free cached block of the default pool, in *largest. 0, or -1. */
int streamalloc_cache_info(int device, uint64_t* largest);
/* For a live allocation at ptr (the address malloc returned): its device, the base and
 * size of the segment it lies in (the cuMemAlloc'd range) and whether that segment is
 * expandable (mapped through the VMM API, not shareable with cuIpcGetMemHandle).
 * 0, or -1 (not a live allocation of any device). */
int streamalloc_block_info(void* ptr, int* device, uint64_t* segment_base,
                           uint64_t* segment_size, int* expandable);
int streamalloc_get_stats(int device, streamalloc_stats_t* out);
int streamalloc_reset_peak_stats(int device);
/* PyTorch's memory_stats() keys that streamalloc fills ("allocated_bytes.all.peak", ...):
 * the i-th, or null past the last. Static strings. */
const char* streamalloc_torch_stat_name(size_t i);
/* device's value of each key streamalloc_torch_stat_name lists, in that order, up to
 * capacity of them. Returns how many keys there are, or -1. */
int64_t streamalloc_torch_stats(int device, int64_t* out, size_t capacity);
/* Starts PyTorch's accumulated statistics (allocated, freed, retries, OOMs, ...) of device
 * from zero again (reset_accumulated_memory_stats). 0, or -1. */
int streamalloc_reset_accumulated_stats(int device);
/* For the live allocation at ptr: its device, its block's size and the device's allocated
 * and reserved bytes now (what PyTorch's profiler is told). 0, or -1. */
int streamalloc_allocation_usage(void* ptr, int* device, uint64_t* block_size,
                                 uint64_t* allocated, uint64_t* reserved);
/* Fills up to the capacities and always writes the true counts. Returns 0 if everything
 * fitted, 1 if the arrays were too small (call again with larger ones), -1 on error. */
int streamalloc_snapshot_segments(int device, streamalloc_segment_info_t* segments,
                                  size_t segment_capacity, size_t* segment_count,
                                  streamalloc_block_state_t* blocks, size_t block_capacity,
                                  size_t* block_count);
/* The memory limit in bytes (0: none). */
uint64_t streamalloc_memory_limit(int device);
const char* streamalloc_last_error(void);
const char* streamalloc_version(void);

#ifdef __cplusplus
}
#endif

#endif
