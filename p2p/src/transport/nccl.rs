//! [`NcclTransport`]: the [`Transport`] trait over NCCL, for running the staged exchange
//! between real GPUs from Rust (feature `nccl`).
//!
//! The staging executor speaks [`Transport`] with host byte slices; this module is the
//! piece that lets it run across processes and GPUs without Python. It lets the Rust side of
//! the staged exchange run on real hardware (`streamalloc p2p-nccl`) with the same planner
//! and executor CI tests on the simulated transport.
//!
//! # What a call does
//! - [`Transport::group`] copies each send's bytes into one device buffer, runs
//!   `ncclGroupStart`, one `ncclSend`/`ncclRecv` per non-empty operation, `ncclGroupEnd` on
//!   one stream of its own, waits for the stream, and copies what arrived back into the
//!   receive slices. Empty operations are skipped on both sides (they move nothing).
//! - [`Transport::all_gather`] gathers every rank's length first (a fixed-size
//!   `ncclAllGather` of 8 bytes), then every payload padded to the longest one.
//!
//! # No hangs, no panics
//! - The communicator is **non-blocking** (`ncclConfig_t::blocking = 0`): initialisation
//!   and every group return at once and are polled with `ncclCommGetAsyncError`; stream
//!   completion is polled with an event. Each wait has a deadline (the `timeout` given at
//!   construction, per call); past it the communicator is aborted (`ncclCommAbort`, which
//!   also stops NCCL's kernels) and the call returns [`TransportError::Timeout`]. NCCL does
//!   not say which peer is missing: a group names its first peer, an all-gather this rank's
//!   ring predecessor, the rendezvous rank 0 (rank 0 itself names rank 1).
//! - NCCL failures become [`TransportError::Backend`] with NCCL's own message
//!   (`ncclGetErrorString` and `ncclGetLastError`). After any failure the communicator is
//!   aborted and every later call fails at once.
//! - cudarc's dynamic loading panics when `libnccl` or a symbol is missing; [`load`] probes
//!   the library first through the driver's shared loader
//!   ([`streamalloc_allocator::backend::cuda::driver::probe_library`], the one `libcuda`
//!   goes through too), and NCCL's result codes go through the same result layer
//!   ([`Status`]). A machine without NCCL or CUDA gets a typed [`NcclError`].
//!
//! # Bootstrap
//! Ranks share NCCL's 128-byte unique id through a file ([`NcclTransport::from_file`]):
//! rank 0 creates it and writes it atomically (temporary file, then rename); the others
//! poll for the file until their deadline. The path must be fresh for each job (a stale
//! file from an earlier job would be read as this job's id). Any other channel (a TCP
//! store, `torch.distributed`) can hand the bytes to [`NcclTransport::from_unique_id`].
//!
//! The transport works in the device's primary context (the one PyTorch uses), made current
//! on the calling thread at every call.

use super::{P2pOp, Transport, TransportError};
use cudarc::nccl::sys as nc;
use std::ffi::{c_char, c_int, c_void, CStr};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::time::{Duration, Instant};
use streamalloc_allocator::backend::cuda::driver::{self, Library, LibraryError, Status};
use streamalloc_allocator::backend::cuda::sys as cu;
use streamalloc_allocator::backend::cuda::{
    device_count as cuda_device_count, retain_primary_context, CudaError,
};

/// Size of an NCCL unique id, bytes.
pub const UNIQUE_ID_BYTES: usize = 128;

/// Every NCCL symbol this module calls, under the names cudarc's loader asks `dlsym` for.
const SYMBOLS: &[&str] = &[
    "ncclGetVersion",
    "ncclGetUniqueId",
    "ncclCommInitRankConfig",
    "ncclCommGetAsyncError",
    "ncclCommAbort",
    "ncclCommFinalize",
    "ncclCommDestroy",
    "ncclGroupStart",
    "ncclGroupEnd",
    "ncclSend",
    "ncclRecv",
    "ncclAllGather",
    "ncclGetErrorString",
    "ncclGetLastError",
];

/// Why an [`NcclTransport`] could not be made.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum NcclError {
    /// `libnccl` is missing, or lacks a symbol this module calls (an NCCL older than
    /// 2.14).
    #[error(transparent)]
    Library(#[from] LibraryError),
    /// The CUDA driver could not be loaded, or the device is missing or unusable.
    #[error(transparent)]
    Device(#[from] CudaError),
    /// Bad arguments or an unusable bootstrap file.
    #[error("NCCL bootstrap: {0}")]
    Bootstrap(String),
    /// Setting up the communicator failed or timed out.
    #[error(transparent)]
    Transport(#[from] TransportError),
}

impl NcclError {
    /// Whether the error means "no NCCL or no GPU here" (a reason to skip), rather than a
    /// failure of a machine that has both.
    pub fn is_unavailable(&self) -> bool {
        matches!(
            self,
            NcclError::Library(_)
                | NcclError::Device(CudaError::Driver(_) | CudaError::NoSuchDevice { .. })
        )
    }
}

impl From<NcclError> for TransportError {
    fn from(err: NcclError) -> Self {
        match err {
            NcclError::Transport(inner) => inner,
            other => TransportError::Backend(other.to_string()),
        }
    }
}

/// Loads `libnccl` once and returns its version code (e.g. 22803 for 2.28.3); later calls
/// return the first answer. Never panics.
pub fn load() -> Result<i32, NcclError> {
    static LOADED: OnceLock<Result<i32, NcclError>> = OnceLock::new();
    LOADED.get_or_init(load_uncached).clone()
}

fn load_uncached() -> Result<i32, NcclError> {
    driver::probe_library(NCCL, nc::is_culib_present, nc::culib, SYMBOLS)?;
    let mut version: c_int = 0;
    // SAFETY: every symbol exists; `version` is a valid out-pointer.
    Nccl(unsafe { nc::ncclGetVersion(&mut version) })
        .check()
        .map_err(|code| {
            NcclError::Bootstrap(format!("ncclGetVersion failed: {}", code.describe()))
        })?;
    Ok(version)
}

/// Number of CUDA devices visible to this process (loading the driver first). Never
/// panics: no driver is [`NcclError::Device`].
pub fn device_count() -> Result<i32, NcclError> {
    Ok(cuda_device_count()?)
}

/// NCCL, as [`LibraryError`]s name it.
const NCCL: Library = Library {
    name: "NCCL (libnccl.so)",
    absent: "it is not installed or not on the library path",
    needs: "NCCL 2.14 or newer",
};

/// An NCCL result code in the driver's result layer ([`Status`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Nccl(nc::ncclResult_t);

impl Status for Nccl {
    fn is_success(self) -> bool {
        self.0 == nc::ncclResult_t::ncclSuccess
    }

    /// `ncclX (NCCL's text)`.
    fn describe(self) -> String {
        let code = self.0;
        // SAFETY: the library is loaded (a code exists only then); the call returns a
        // static string or null.
        let text = unsafe { nc::ncclGetErrorString(code) };
        if text.is_null() {
            format!("{code:?}")
        } else {
            // SAFETY: non-null pointers from NCCL are static NUL-terminated strings.
            let text = unsafe { CStr::from_ptr(text) }.to_string_lossy();
            format!("{code:?} ({text})")
        }
    }
}

impl Nccl {
    /// As [`Status::check`], but `ncclInProgress` is also `Ok`: on a non-blocking
    /// communicator it means the call was queued.
    fn queued(self) -> Result<(), Self> {
        if self.0 == nc::ncclResult_t::ncclInProgress {
            Ok(())
        } else {
            self.check()
        }
    }
}

/// A fresh unique id from NCCL (what rank 0 shares with the others).
pub fn new_unique_id() -> Result<[u8; UNIQUE_ID_BYTES], NcclError> {
    load()?;
    let mut id = nc::ncclUniqueId {
        internal: [0; UNIQUE_ID_BYTES],
    };
    // SAFETY: the library is loaded; `id` is a valid out-pointer.
    Nccl(unsafe { nc::ncclGetUniqueId(&mut id) })
        .check()
        .map_err(|code| {
            NcclError::Bootstrap(format!("ncclGetUniqueId failed: {}", code.describe()))
        })?;
    Ok(id.internal.map(|c| c as u8))
}

/// Writes `id` to `path` atomically: a temporary file next to it, then a rename, so a
/// reader sees either no file or all 128 bytes.
pub fn write_unique_id(path: &Path, id: &[u8; UNIQUE_ID_BYTES]) -> Result<(), NcclError> {
    let name = path
        .file_name()
        .ok_or_else(|| NcclError::Bootstrap(format!("{} is not a file path", path.display())))?;
    let mut temp_name = name.to_os_string();
    temp_name.push(format!(".tmp.{}", std::process::id()));
    let temp: PathBuf = path.with_file_name(temp_name);
    let io = |what: &str, p: &Path, e: std::io::Error| {
        NcclError::Bootstrap(format!("cannot {what} {}: {e}", p.display()))
    };
    std::fs::write(&temp, id).map_err(|e| io("write", &temp, e))?;
    std::fs::rename(&temp, path).map_err(|e| {
        let _ = std::fs::remove_file(&temp);
        io("rename a temporary file to", path, e)
    })
}

/// Waits for rank 0's unique id at `path`, polling until `timeout` has passed; then
/// [`TransportError::Timeout`] (waiting on rank 0).
pub fn read_unique_id(
    path: &Path,
    rank: u32,
    timeout: Duration,
) -> Result<[u8; UNIQUE_ID_BYTES], NcclError> {
    let start = Instant::now();
    loop {
        match std::fs::read(path) {
            Ok(bytes) => {
                return <[u8; UNIQUE_ID_BYTES]>::try_from(bytes.as_slice()).map_err(|_| {
                    NcclError::Bootstrap(format!(
                        "{} holds {} bytes, not a {UNIQUE_ID_BYTES}-byte NCCL unique id",
                        path.display(),
                        bytes.len()
                    ))
                });
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => {
                return Err(NcclError::Bootstrap(format!(
                    "cannot read {}: {e}",
                    path.display()
                )))
            }
        }
        let waited = start.elapsed();
        if waited >= timeout {
            return Err(TransportError::Timeout {
                rank,
                peer: 0,
                seconds: waited.as_secs_f64(),
            }
            .into());
        }
        std::thread::sleep((timeout - waited).min(Duration::from_millis(10)));
    }
}

/// A growable device buffer.
#[derive(Debug, Default)]
struct DeviceBuffer {
    ptr: cu::CUdeviceptr,
    capacity: usize,
}

/// One rank's NCCL communicator, with the stream, event and device buffers it moves host
/// bytes through. Not `Sync`: one thread uses it at a time (it may move between threads).
#[derive(Debug)]
pub struct NcclTransport {
    rank: u32,
    world: u32,
    ctx: cu::CUcontext,
    /// Null once aborted or destroyed.
    comm: nc::ncclComm_t,
    stream: cu::CUstream,
    done: cu::CUevent,
    send_buf: DeviceBuffer,
    recv_buf: DeviceBuffer,
    timeout: Duration,
    /// Why the communicator was aborted, if it was.
    broken: Option<String>,
    bytes_sent: u64,
}

// SAFETY: the handles are plain driver/NCCL handles, valid from any thread once the
// context is current (every entry point makes it current). The type is not `Sync`, so
// only one thread uses the communicator at a time, as NCCL requires.
unsafe impl Send for NcclTransport {}

impl NcclTransport {
    /// Bootstraps through a file: rank 0 creates a unique id and writes it to `path`
    /// (atomically); the other ranks wait for it at most `timeout`. Then every rank joins
    /// the communicator on CUDA device `device`, also within `timeout`. `path` must not
    /// exist from an earlier job.
    pub fn from_file(
        path: &Path,
        rank: u32,
        world: u32,
        device: i32,
        timeout: Duration,
    ) -> Result<Self, NcclError> {
        check_rank(rank, world)?;
        let id = if rank == 0 {
            let id = new_unique_id()?;
            write_unique_id(path, &id)?;
            id
        } else {
            read_unique_id(path, rank, timeout)?
        };
        Self::from_unique_id(&id, rank, world, device, timeout)
    }

    /// Joins the communicator named by `id` as `rank` of `world`, on CUDA device `device`.
    /// Every wait of this transport, this one included, gives up after `timeout`.
    pub fn from_unique_id(
        id: &[u8; UNIQUE_ID_BYTES],
        rank: u32,
        world: u32,
        device: i32,
        timeout: Duration,
    ) -> Result<Self, NcclError> {
        check_rank(rank, world)?;
        let version = load()?;
        let (_, ctx) = retain_primary_context(device)?;
        // SAFETY: `ctx` is a retained primary context.
        cuda(unsafe { cu::cuCtxSetCurrent(ctx) }, "cuCtxSetCurrent")?;
        let mut transport = NcclTransport {
            rank,
            world,
            ctx,
            comm: std::ptr::null_mut(),
            stream: std::ptr::null_mut(),
            done: std::ptr::null_mut(),
            send_buf: DeviceBuffer::default(),
            recv_buf: DeviceBuffer::default(),
            timeout,
            broken: None,
            bytes_sent: 0,
        };
        // SAFETY: the context is current; the out-pointers are fields of `transport`,
        // which `Drop` destroys if set.
        unsafe {
            cuda(
                cu::cuStreamCreate(
                    &mut transport.stream,
                    cu::CUstream_flags::CU_STREAM_NON_BLOCKING as u32,
                ),
                "cuStreamCreate",
            )?;
            cuda(
                cu::cuEventCreate(
                    &mut transport.done,
                    cu::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32,
                ),
                "cuEventCreate",
            )?;
        }
        let mut config = nonblocking_config(version);
        let unique = nc::ncclUniqueId {
            internal: id.map(|b| b as c_char),
        };
        let deadline = Instant::now() + timeout;
        // SAFETY: valid out-pointer and config; the id is passed by value. With a
        // non-blocking config the call returns at once (ncclInProgress) and the
        // communicator handle is already written.
        let code = unsafe {
            nc::ncclCommInitRankConfig(
                &mut transport.comm,
                world as c_int,
                unique,
                rank as c_int,
                &mut config,
            )
        };
        if let Err(code) = Nccl(code).queued() {
            return Err(transport.fail("ncclCommInitRankConfig", code).into());
        }
        // Rank 0 hosts the rendezvous and waits for everyone: it names rank 1.
        let awaited = if rank == 0 { 1.min(world - 1) } else { 0 };
        transport.wait_comm("communicator initialisation", awaited, deadline)?;
        tracing::debug!(rank, world, device, version, "NCCL communicator ready");
        Ok(transport)
    }

    /// Bytes this rank has sent point-to-point so far.
    pub fn bytes_sent(&self) -> u64 {
        self.bytes_sent
    }

    /// Fails at once if an earlier call aborted the communicator; makes the context
    /// current.
    fn enter(&self) -> Result<(), TransportError> {
        if let Some(why) = &self.broken {
            return Err(TransportError::Backend(format!(
                "rank {}: NCCL communicator unusable after an earlier failure ({why})",
                self.rank
            )));
        }
        // SAFETY: `ctx` is the retained primary context.
        cuda(unsafe { cu::cuCtxSetCurrent(self.ctx) }, "cuCtxSetCurrent")
    }

    /// Aborts the communicator (if any) and remembers why.
    fn abort(&mut self, why: String) {
        if !self.comm.is_null() {
            // SAFETY: `comm` is a live communicator; abort is allowed in any state,
            // including in-progress initialisation and stuck operations.
            unsafe { nc::ncclCommAbort(self.comm) };
            self.comm = std::ptr::null_mut();
        }
        self.broken.get_or_insert(why);
    }

    /// A failed NCCL call: abort, and the error with NCCL's messages.
    fn fail(&mut self, what: &str, code: Nccl) -> TransportError {
        let last = if self.comm.is_null() {
            String::new()
        } else {
            // SAFETY: `comm` is live; the call returns a string owned by NCCL, or null.
            let text = unsafe { nc::ncclGetLastError(self.comm) };
            if text.is_null() {
                String::new()
            } else {
                // SAFETY: non-null, NUL-terminated, valid until the next NCCL call; copied.
                let text = unsafe { CStr::from_ptr(text) }.to_string_lossy();
                if text.is_empty() {
                    String::new()
                } else {
                    format!(": {text}")
                }
            }
        };
        let message = format!(
            "rank {}: NCCL {what} failed: {}{last}",
            self.rank,
            code.describe()
        );
        self.abort(message.clone());
        TransportError::Backend(message)
    }

    /// A wait past its deadline: abort, and a timeout naming `peer`.
    fn time_out(&mut self, what: &str, peer: u32) -> TransportError {
        self.abort(format!("timed out in {what}"));
        TransportError::Timeout {
            rank: self.rank,
            peer,
            seconds: self.timeout.as_secs_f64(),
        }
    }

    /// Polls the communicator until its pending operation (initialisation, group end,
    /// collective launch) is done, failed, or `deadline` passed.
    fn wait_comm(
        &mut self,
        what: &str,
        peer: u32,
        deadline: Instant,
    ) -> Result<(), TransportError> {
        let mut spins = 0u32;
        loop {
            if self.comm.is_null() {
                return Err(TransportError::Backend(format!(
                    "rank {}: NCCL gave no communicator ({what})",
                    self.rank
                )));
            }
            let mut state = nc::ncclResult_t::ncclSuccess;
            // SAFETY: `comm` is live; `state` is a valid out-pointer.
            let code = unsafe { nc::ncclCommGetAsyncError(self.comm, &mut state) };
            if let Err(code) = Nccl(code).check() {
                return Err(self.fail(what, code));
            }
            match state {
                nc::ncclResult_t::ncclSuccess => return Ok(()),
                nc::ncclResult_t::ncclInProgress => {}
                failed => return Err(self.fail(what, Nccl(failed))),
            }
            if Instant::now() >= deadline {
                return Err(self.time_out(what, peer));
            }
            backoff(&mut spins);
        }
    }

    /// Records the event on the stream and polls it until the stream's work is done,
    /// watching the communicator for asynchronous errors, until `deadline`.
    fn wait_stream(
        &mut self,
        what: &str,
        peer: u32,
        deadline: Instant,
    ) -> Result<(), TransportError> {
        cuda(
            // SAFETY: event and stream are live, in the current context.
            unsafe { cu::cuEventRecord(self.done, self.stream) },
            "cuEventRecord",
        )?;
        let mut spins = 0u32;
        loop {
            // SAFETY: the event is live.
            let code = unsafe { cu::cuEventQuery(self.done) };
            match code {
                cu::CUresult::CUDA_SUCCESS => return Ok(()),
                cu::CUresult::CUDA_ERROR_NOT_READY => {}
                other => {
                    let err = cuda(other, "cuEventQuery").unwrap_err();
                    self.abort(err.to_string());
                    return Err(err);
                }
            }
            let mut state = nc::ncclResult_t::ncclSuccess;
            // SAFETY: `comm` is live (checked by the callers' `enter`); valid out-pointer.
            let code = unsafe { nc::ncclCommGetAsyncError(self.comm, &mut state) };
            if let Err(code) = Nccl(code).check() {
                return Err(self.fail(what, code));
            }
            if let Err(code) = Nccl(state).queued() {
                return Err(self.fail(what, code));
            }
            if Instant::now() >= deadline {
                return Err(self.time_out(what, peer));
            }
            backoff(&mut spins);
        }
    }

    /// Makes `buf` hold at least `bytes` (contents are not kept).
    fn reserve(which: &mut DeviceBuffer, bytes: usize) -> Result<(), TransportError> {
        if which.capacity >= bytes {
            return Ok(());
        }
        if which.ptr != 0 {
            // SAFETY: `ptr` came from cuMemAlloc and no work on it is pending (every call
            // waits for its stream before returning).
            cuda(unsafe { cu::cuMemFree_v2(which.ptr) }, "cuMemFree")?;
            *which = DeviceBuffer::default();
        }
        let size = bytes.next_power_of_two().max(1 << 20);
        let mut ptr: cu::CUdeviceptr = 0;
        // SAFETY: valid out-pointer; the context is current.
        cuda(unsafe { cu::cuMemAlloc_v2(&mut ptr, size) }, "cuMemAlloc")?;
        *which = DeviceBuffer {
            ptr,
            capacity: size,
        };
        Ok(())
    }

    fn stream(&self) -> nc::cudaStream_t {
        self.stream as nc::cudaStream_t
    }
}

impl Transport for NcclTransport {
    fn rank(&self) -> u32 {
        self.rank
    }

    fn world(&self) -> u32 {
        self.world
    }

    fn all_gather(&mut self, data: &[u8]) -> Result<Vec<Vec<u8>>, TransportError> {
        self.enter()?;
        let world = self.world as usize;
        let predecessor = (self.rank + self.world - 1) % self.world;
        let deadline = Instant::now() + self.timeout;

        // Lengths: 8 bytes from every rank.
        Self::reserve(&mut self.send_buf, 8)?;
        Self::reserve(&mut self.recv_buf, 8 * world)?;
        let len = (data.len() as u64).to_le_bytes();
        cuda(
            // SAFETY: the buffer holds at least 8 bytes; `len` is 8 readable bytes.
            unsafe { cu::cuMemcpyHtoD_v2(self.send_buf.ptr, len.as_ptr().cast(), 8) },
            "cuMemcpyHtoD",
        )?;
        self.gather(8, predecessor, deadline)?;
        let mut lens = vec![0u8; 8 * world];
        cuda(
            // SAFETY: the stream is done; the receive buffer holds `8 * world` bytes.
            unsafe { cu::cuMemcpyDtoH_v2(lens.as_mut_ptr().cast(), self.recv_buf.ptr, 8 * world) },
            "cuMemcpyDtoH",
        )?;
        let lens: Vec<usize> = lens
            .chunks_exact(8)
            .map(|c| u64::from_le_bytes(c.try_into().expect("8-byte chunk")) as usize)
            .collect();
        if lens[self.rank as usize] != data.len() {
            return Err(TransportError::Backend(format!(
                "rank {}: NCCL all-gather returned length {} for this rank, which sent {}",
                self.rank,
                lens[self.rank as usize],
                data.len()
            )));
        }
        let longest = lens.iter().copied().max().unwrap_or(0);
        if longest == 0 {
            return Ok(vec![Vec::new(); world]);
        }

        // Payloads, padded to the longest.
        let total = longest.checked_mul(world).ok_or_else(|| {
            TransportError::Backend(format!(
                "rank {}: all-gather of {world} × {longest} bytes overflows",
                self.rank
            ))
        })?;
        Self::reserve(&mut self.send_buf, longest)?;
        Self::reserve(&mut self.recv_buf, total)?;
        if !data.is_empty() {
            cuda(
                // SAFETY: the buffer holds at least `longest >= data.len()` bytes.
                unsafe { cu::cuMemcpyHtoD_v2(self.send_buf.ptr, data.as_ptr().cast(), data.len()) },
                "cuMemcpyHtoD",
            )?;
        }
        self.gather(longest, predecessor, deadline)?;
        let mut all = vec![0u8; total];
        cuda(
            // SAFETY: the stream is done; the receive buffer holds `total` bytes.
            unsafe { cu::cuMemcpyDtoH_v2(all.as_mut_ptr().cast(), self.recv_buf.ptr, total) },
            "cuMemcpyDtoH",
        )?;
        Ok(all
            .chunks_exact(longest)
            .zip(&lens)
            .map(|(chunk, &n)| chunk[..n].to_vec())
            .collect())
    }

    fn group(&mut self, ops: &mut [P2pOp<'_>]) -> Result<(), TransportError> {
        self.enter()?;
        let (mut send_total, mut recv_total) = (0usize, 0usize);
        for op in ops.iter() {
            let (peer, len, total) = match op {
                P2pOp::Send { peer, data } => (*peer, data.len(), &mut send_total),
                P2pOp::Recv { peer, buf } => (*peer, buf.len(), &mut recv_total),
            };
            if peer >= self.world {
                return Err(TransportError::BadPeer {
                    rank: self.rank,
                    peer,
                    world: self.world,
                });
            }
            *total += len;
        }
        let first_peer = ops
            .iter()
            .map(|op| match op {
                P2pOp::Send { peer, .. } | P2pOp::Recv { peer, .. } => *peer,
            })
            .next()
            .unwrap_or(self.rank);
        if send_total + recv_total == 0 {
            return Ok(());
        }
        Self::reserve(&mut self.send_buf, send_total)?;
        Self::reserve(&mut self.recv_buf, recv_total)?;
        let deadline = Instant::now() + self.timeout;

        // Stage the sends.
        let mut at = 0usize;
        for op in ops.iter() {
            if let P2pOp::Send { data, .. } = op {
                if !data.is_empty() {
                    cuda(
                        // SAFETY: offsets stay within `send_total` bytes of the buffer.
                        unsafe {
                            cu::cuMemcpyHtoD_v2(
                                self.send_buf.ptr + at as u64,
                                data.as_ptr().cast(),
                                data.len(),
                            )
                        },
                        "cuMemcpyHtoD",
                    )?;
                    at += data.len();
                }
            }
        }

        // One NCCL group.
        // SAFETY: group calls only queue work; the library is loaded.
        let started = unsafe { nc::ncclGroupStart() };
        if let Err(code) = Nccl(started).check() {
            return Err(self.fail("ncclGroupStart", code));
        }
        let (mut send_at, mut recv_at) = (0usize, 0usize);
        let mut queued = Ok(());
        for op in ops.iter() {
            // SAFETY: pointers stay within the device buffers (sized above), which live
            // until the stream is done; `comm` and the stream are live.
            let code = unsafe {
                match op {
                    P2pOp::Send { peer, data } if !data.is_empty() => {
                        let ptr = self.send_buf.ptr + send_at as u64;
                        send_at += data.len();
                        nc::ncclSend(
                            ptr as *const c_void,
                            data.len(),
                            nc::ncclDataType_t::ncclUint8,
                            *peer as c_int,
                            self.comm,
                            self.stream(),
                        )
                    }
                    P2pOp::Recv { peer, buf } if !buf.is_empty() => {
                        let ptr = self.recv_buf.ptr + recv_at as u64;
                        recv_at += buf.len();
                        nc::ncclRecv(
                            ptr as *mut c_void,
                            buf.len(),
                            nc::ncclDataType_t::ncclUint8,
                            *peer as c_int,
                            self.comm,
                            self.stream(),
                        )
                    }
                    _ => nc::ncclResult_t::ncclSuccess,
                }
            };
            if let Err(code) = Nccl(code).queued() {
                queued = Err(("ncclSend/ncclRecv", code));
                break;
            }
        }
        // The group is always closed, even after a failed enqueue.
        // SAFETY: closes the group opened above.
        let ended = unsafe { nc::ncclGroupEnd() };
        if let Err((what, code)) = queued {
            return Err(self.fail(what, code));
        }
        if let Err(code) = Nccl(ended).queued() {
            return Err(self.fail("ncclGroupEnd", code));
        }
        self.wait_comm("group", first_peer, deadline)?;
        self.wait_stream("group", first_peer, deadline)?;

        // Unstage the receives.
        let mut at = 0usize;
        for op in ops.iter_mut() {
            if let P2pOp::Recv { buf, .. } = op {
                if !buf.is_empty() {
                    cuda(
                        // SAFETY: the stream is done; offsets stay within `recv_total` bytes.
                        unsafe {
                            cu::cuMemcpyDtoH_v2(
                                buf.as_mut_ptr().cast(),
                                self.recv_buf.ptr + at as u64,
                                buf.len(),
                            )
                        },
                        "cuMemcpyDtoH",
                    )?;
                    at += buf.len();
                }
            }
        }
        self.bytes_sent += send_total as u64;
        Ok(())
    }
}

impl NcclTransport {
    /// `ncclAllGather` of `count` bytes per rank from the send buffer into the receive
    /// buffer, waited for.
    fn gather(&mut self, count: usize, peer: u32, deadline: Instant) -> Result<(), TransportError> {
        // SAFETY: the send buffer holds `count` bytes and the receive buffer
        // `count * world` (reserved by the caller); `comm` and the stream are live.
        let code = unsafe {
            nc::ncclAllGather(
                self.send_buf.ptr as *const c_void,
                self.recv_buf.ptr as *mut c_void,
                count,
                nc::ncclDataType_t::ncclUint8,
                self.comm,
                self.stream(),
            )
        };
        if let Err(code) = Nccl(code).queued() {
            return Err(self.fail("ncclAllGather", code));
        }
        self.wait_comm("all-gather", peer, deadline)?;
        self.wait_stream("all-gather", peer, deadline)
    }
}

impl Drop for NcclTransport {
    fn drop(&mut self) {
        // SAFETY: the retained primary context stays valid for the process.
        unsafe { cu::cuCtxSetCurrent(self.ctx) };
        if !self.comm.is_null() && self.broken.is_none() {
            // A healthy communicator is finalised (bounded wait), then destroyed.
            let deadline = Instant::now() + self.timeout.min(Duration::from_secs(10));
            // SAFETY: `comm` is live and idle (every call waited for its work).
            let code = unsafe { nc::ncclCommFinalize(self.comm) };
            let finalised = if Nccl(code).queued().is_ok() {
                self.wait_comm("finalisation", self.rank, deadline).is_ok()
            } else {
                false
            };
            if finalised && !self.comm.is_null() {
                // SAFETY: finalised, so destroy only frees resources.
                unsafe { nc::ncclCommDestroy(self.comm) };
                self.comm = std::ptr::null_mut();
            }
        }
        if !self.comm.is_null() {
            // SAFETY: `comm` is live; abort never waits on peers.
            unsafe { nc::ncclCommAbort(self.comm) };
            self.comm = std::ptr::null_mut();
        }
        // SAFETY: each handle is destroyed once, if it was created.
        unsafe {
            for buf in [&self.send_buf, &self.recv_buf] {
                if buf.ptr != 0 {
                    cu::cuMemFree_v2(buf.ptr);
                }
            }
            if !self.done.is_null() {
                cu::cuEventDestroy_v2(self.done);
            }
            if !self.stream.is_null() {
                cu::cuStreamDestroy_v2(self.stream);
            }
        }
    }
}

/// `rank < world` and `world >= 1`.
fn check_rank(rank: u32, world: u32) -> Result<(), NcclError> {
    if world == 0 || rank >= world || world > c_int::MAX as u32 {
        return Err(NcclError::Bootstrap(format!(
            "rank {rank} is not in a world of {world} ranks"
        )));
    }
    Ok(())
}

/// A driver result as a [`TransportError::Backend`].
fn cuda(code: cu::CUresult, operation: &'static str) -> Result<(), TransportError> {
    driver::check(code, operation).map_err(|e| TransportError::Backend(e.to_string()))
}

/// A non-blocking communicator configuration: NCCL's `NCCL_CONFIG_INITIALIZER` with
/// `blocking = 0`. NCCL reads at most its own `sizeof(ncclConfig_t)` bytes, so a newer
/// struct than the loaded library's is accepted.
fn nonblocking_config(version: i32) -> nc::ncclConfig_t {
    const UNDEF: c_int = c_int::MIN;
    nc::ncclConfig_t {
        size: std::mem::size_of::<nc::ncclConfig_t>(),
        magic: 0xcafe_beef,
        version: version as u32,
        blocking: 0,
        cgaClusterSize: UNDEF,
        minCTAs: UNDEF,
        maxCTAs: UNDEF,
        netName: std::ptr::null(),
        splitShare: UNDEF,
        trafficClass: UNDEF,
        commName: std::ptr::null(),
        collnetEnable: UNDEF,
        CTAPolicy: UNDEF,
        shrinkShare: UNDEF,
        nvlsCTAs: UNDEF,
        nChannelsPerNetPeer: UNDEF,
        nvlinkCentricSched: UNDEF,
        graphUsageMode: UNDEF,
        numRmaCtx: UNDEF,
        maxP2pPeers: UNDEF,
    }
}

/// Spin briefly, then yield, then sleep: cheap for short waits, idle for long ones.
fn backoff(spins: &mut u32) {
    *spins += 1;
    if *spins < 256 {
        std::hint::spin_loop();
    } else if *spins < 4096 {
        std::thread::yield_now();
    } else {
        std::thread::sleep(Duration::from_micros(50));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!(
            "streamalloc-nccl-test-{}-{name}",
            std::process::id()
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    #[test]
    fn unique_id_round_trips_through_a_file() {
        let dir = scratch("roundtrip");
        let path = dir.join("id");
        let id: [u8; UNIQUE_ID_BYTES] = std::array::from_fn(|i| (i * 7 + 3) as u8);
        write_unique_id(&path, &id).unwrap();
        assert_eq!(
            read_unique_id(&path, 1, Duration::from_millis(10)).unwrap(),
            id
        );
        // No temporary file is left behind.
        assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 1);
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn unique_id_arriving_late_is_picked_up() {
        let dir = scratch("late");
        let path = dir.join("id");
        let writer = {
            let path = path.clone();
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(50));
                write_unique_id(&path, &[9; UNIQUE_ID_BYTES]).unwrap();
            })
        };
        let id = read_unique_id(&path, 2, Duration::from_secs(10)).unwrap();
        writer.join().unwrap();
        assert_eq!(id, [9; UNIQUE_ID_BYTES]);
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn a_short_file_is_a_bootstrap_error() {
        let dir = scratch("short");
        let path = dir.join("id");
        std::fs::write(&path, b"nope").unwrap();
        let err = read_unique_id(&path, 1, Duration::from_millis(10)).unwrap_err();
        assert!(
            matches!(&err, NcclError::Bootstrap(m) if m.contains("4 bytes")),
            "{err}"
        );
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn bootstrap_times_out_when_rank_0_never_writes() {
        let dir = scratch("timeout");
        let path = dir.join("never");
        let start = Instant::now();
        let err = NcclTransport::from_file(&path, 1, 2, 0, Duration::from_millis(200)).unwrap_err();
        let waited = start.elapsed();
        match err {
            NcclError::Transport(TransportError::Timeout {
                rank,
                peer,
                seconds,
            }) => {
                assert_eq!((rank, peer), (1, 0));
                assert!(seconds >= 0.2, "{seconds}");
            }
            other => panic!("expected a timeout, got {other}"),
        }
        assert!(waited >= Duration::from_millis(200), "{waited:?}");
        assert!(waited < Duration::from_secs(5), "{waited:?}");
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn bad_rank_is_rejected_before_touching_nccl() {
        let err = NcclTransport::from_file(Path::new("/nonexistent/id"), 2, 2, 0, Duration::ZERO)
            .unwrap_err();
        assert!(matches!(err, NcclError::Bootstrap(_)), "{err}");
    }

    /// On a machine without NCCL or a GPU (CI) this is a typed error, not a panic; on one
    /// with both, a one-rank communicator must really move bytes.
    #[test]
    fn one_rank_works_or_is_typed_unavailable() {
        let dir = scratch("one-rank");
        let path = dir.join("id");
        match NcclTransport::from_file(&path, 0, 1, 0, Duration::from_secs(60)) {
            Err(err) => {
                assert!(err.is_unavailable(), "unexpected failure: {err}");
                let as_transport = TransportError::from(err.clone());
                assert!(matches!(as_transport, TransportError::Backend(_)));
            }
            Ok(mut t) => {
                let gathered = t.all_gather(b"hello").unwrap();
                assert_eq!(gathered, vec![b"hello".to_vec()]);
                let data = vec![7u8; 1000];
                let mut buf = vec![0u8; 1000];
                t.group(&mut [
                    P2pOp::Send {
                        peer: 0,
                        data: &data,
                    },
                    P2pOp::Recv {
                        peer: 0,
                        buf: &mut buf,
                    },
                ])
                .unwrap();
                assert_eq!(buf, data);
                let err = t
                    .group(&mut [P2pOp::Send {
                        peer: 1,
                        data: &data,
                    }])
                    .unwrap_err();
                assert!(matches!(err, TransportError::BadPeer { .. }));
            }
        }
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn load_never_panics_and_is_stable() {
        let first = load();
        assert_eq!(first, load());
        if let Err(err) = first {
            assert!(err.is_unavailable(), "{err}");
        }
    }
}
