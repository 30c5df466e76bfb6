//! Reading an untrusted file into memory, within the limits of [`crate::limits`].
//!
//! Every reader starts here: the file is read only as far as its size limit (so
//! `/dev/zero` or a huge file is refused, not read until memory runs out), refused at once
//! when its first bytes are no format any reader knows, and gunzipped within the
//! decompressed-size limit when it is gzip.

use crate::error::VizError;
use crate::limits;
use crate::sniff::{sniff, Content};
use std::io::Read;
use std::path::Path;

/// How many bytes are read before the content is sniffed.
const SNIFF_BYTES: usize = 4096;

/// What [`read_file`] says of content that no reader takes.
pub const UNRECOGNISED: &str = "unrecognised content (expected a streamalloc JSON snapshot \
     or a PyTorch memory snapshot pickle, optionally gzip-compressed)";

/// The bytes of the file at `path`, at most [`limits::input_limit`] of them: a longer file
/// (or an endless one, such as a device) is refused with [`VizError::Limit`], and one whose
/// first bytes are no format of this crate ([`Content::Other`]) is refused before it is
/// read further.
pub fn read_file(path: &Path) -> Result<Vec<u8>, VizError> {
    let (limit, how) = limits::input_limit(path)?;
    let file = std::fs::File::open(path).map_err(|e| VizError::io(path, e))?;
    let too_large = || VizError::Limit {
        path: path.into(),
        what: format!("the file holds more than {limit} bytes (limit: {how})"),
    };
    let known = file
        .metadata()
        .ok()
        .filter(|m| m.is_file())
        .map(|m| m.len());
    if known.is_some_and(|len| len > limit) {
        return Err(too_large());
    }
    let mut reader = file.take(limit.saturating_add(1));
    let mut out = Vec::new();
    let wanted = known.unwrap_or(0).min(limit) as usize;
    // A file the system will not give the memory for is an error, not an abort.
    out.try_reserve_exact(wanted).map_err(|_| VizError::Limit {
        path: path.into(),
        what: format!("reading it takes {wanted} bytes of memory, more than the system gives"),
    })?;
    let mut head = [0u8; SNIFF_BYTES];
    let mut got = 0;
    while got < SNIFF_BYTES {
        match reader.read(&mut head[got..]) {
            Ok(0) => break,
            Ok(n) => got += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(VizError::io(path, e)),
        }
    }
    out.extend_from_slice(&head[..got]);
    // Content that is no format at all (zeros, random bytes, text) is refused before the
    // rest is read: an endless device would otherwise be read up to the limit.
    if got == SNIFF_BYTES && sniff(&out) == Content::Other {
        return Err(VizError::format(path, UNRECOGNISED));
    }
    reader
        .read_to_end(&mut out)
        .map_err(|e| VizError::io(path, e))?;
    if out.len() as u64 > limit {
        return Err(too_large());
    }
    Ok(out)
}

/// Decompresses `raw` if it starts with the gzip magic, else returns it unchanged. The
/// output is capped ([`limits::gunzip_limit`]): past the cap the file is refused with one
/// line naming it and the limit.
pub fn maybe_gunzip(path: &Path, raw: Vec<u8>) -> Result<Vec<u8>, VizError> {
    if sniff(&raw) != Content::Gzip {
        return Ok(raw);
    }
    let (limit, how) = limits::gunzip_limit(path, raw.len())?;
    gunzip_within(path, &raw, limit, &how)
}

/// Decompresses the gzip stream `raw` (every member, as `gzip -d` does) into at most
/// `limit` bytes: a stream that would give more is refused with [`VizError::Limit`], whose
/// message says `how` the limit was set. Corrupt or truncated data is [`VizError::Gzip`].
/// `path` only names the source in errors.
pub fn gunzip_within(path: &Path, raw: &[u8], limit: u64, how: &str) -> Result<Vec<u8>, VizError> {
    let mut out = Vec::new();
    // No room is reserved ahead: a guess from the compressed size would cost its whole
    // before the header is even checked (a file that merely starts with the magic);
    // `read_to_end` grows the buffer to what arrives and reports running out as an error.
    // One byte past the limit tells "exactly at the limit" from "over it".
    flate2::read::MultiGzDecoder::new(raw)
        .take(limit.saturating_add(1))
        .read_to_end(&mut out)
        .map_err(|source| VizError::Gzip {
            path: path.into(),
            source,
        })?;
    if out.len() as u64 > limit {
        return Err(VizError::Limit {
            path: path.into(),
            what: format!("decompresses to more than {limit} bytes (limit: {how})"),
        });
    }
    Ok(out)
}

/// A file's content `raw`, decompressed if it is gzip (within the limits of
/// [`maybe_gunzip`]), with what the result holds. `path` only names the file in errors. A
/// gzip stream inside the gzip stream is not opened again: it is reported as
/// [`Content::Gzip`].
pub fn open(path: &Path, raw: Vec<u8>) -> Result<(Content, Vec<u8>), VizError> {
    let bytes = maybe_gunzip(path, raw)?;
    Ok((sniff(&bytes), bytes))
}

// ---- Reading in order, from memory or as it is decompressed ----

/// Why a [`Source`] could not give the bytes asked for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Shortfall {
    /// The input ends first: `left` bytes remained.
    Ended {
        /// Bytes that were left.
        left: usize,
    },
    /// The input could not be read (corrupt gzip data, over the decompressed-size limit):
    /// the source keeps the error ([`GzipSource::error`]).
    Failed,
}

/// Bytes read front to back by a decoder, from memory ([`SliceSource`]) or decompressed on
/// another thread while the decoder runs ([`GzipSource`]), so that neither waits for the
/// other and the decompressed file is never held whole.
pub(crate) trait Source {
    /// The next `n` bytes, consumed.
    fn take(&mut self, n: usize) -> Result<&[u8], Shortfall>;
    /// The bytes up to the next newline, consumed with it; the newline is not returned.
    fn take_line(&mut self) -> Result<&[u8], Shortfall>;
    /// Bytes consumed so far: the offset of the next byte.
    fn position(&self) -> usize;
    /// Bytes received so far, consumed or not: what the memory budget may be proportional
    /// to at this point.
    fn received(&self) -> usize;
}

/// A [`Source`] over bytes in memory.
#[derive(Debug)]
pub(crate) struct SliceSource<'a> {
    data: &'a [u8],
    pos: usize,
}

impl<'a> SliceSource<'a> {
    pub(crate) fn new(data: &'a [u8]) -> Self {
        SliceSource { data, pos: 0 }
    }
}

impl Source for SliceSource<'_> {
    #[inline]
    fn take(&mut self, n: usize) -> Result<&[u8], Shortfall> {
        let left = self.data.len() - self.pos;
        if n > left {
            return Err(Shortfall::Ended { left });
        }
        let bytes = &self.data[self.pos..self.pos + n];
        self.pos += n;
        Ok(bytes)
    }

    fn take_line(&mut self) -> Result<&[u8], Shortfall> {
        let rest = &self.data[self.pos..];
        let Some(end) = rest.iter().position(|&b| b == b'\n') else {
            return Err(Shortfall::Ended { left: rest.len() });
        };
        self.pos += end + 1;
        Ok(&rest[..end])
    }

    fn position(&self) -> usize {
        self.pos
    }

    fn received(&self) -> usize {
        self.data.len()
    }
}

/// Decompressed bytes handed from the decompressing thread: a buffer and how much of it
/// is filled.
type Chunk = (Vec<u8>, usize);

/// How much the decompressing thread hands over at a time.
const CHUNK_BYTES: usize = 1 << 20;

/// A [`Source`] of a gzip stream decompressed by another thread ([`with_gzip_source`]),
/// within the decompressed-size limit of [`gunzip_limit`](crate::limits::gunzip_limit).
#[derive(Debug)]
pub(crate) struct GzipSource {
    chunks: std::sync::mpsc::Receiver<Result<Chunk, VizError>>,
    /// Buffers handed back to the decompressing thread, so that it reuses memory already
    /// touched rather than faulting in new pages for every chunk.
    spent: std::sync::mpsc::Sender<Vec<u8>>,
    /// Received bytes not yet consumed start at `pos`.
    window: Vec<u8>,
    pos: usize,
    /// Offset in the stream of `window[0]`.
    base: usize,
    received: usize,
    ended: bool,
    error: Option<VizError>,
}

impl GzipSource {
    /// Receives chunks until at least `n` bytes are unconsumed or the stream ends.
    fn fill(&mut self, n: usize) -> Result<(), Shortfall> {
        while self.window.len() - self.pos < n {
            if self.ended {
                return Err(match self.error {
                    Some(_) => Shortfall::Failed,
                    None => Shortfall::Ended {
                        left: self.window.len() - self.pos,
                    },
                });
            }
            match self.chunks.recv() {
                Ok(Ok((mut chunk, len))) => {
                    self.received += len;
                    if self.pos == self.window.len() {
                        // Nothing left over: the chunk becomes the window.
                        self.base += self.window.len();
                        chunk.truncate(len);
                        let old = std::mem::replace(&mut self.window, chunk);
                        self.pos = 0;
                        let _ = self.spent.send(old);
                    } else {
                        // An item straddles chunks: keep what is left, then the chunk.
                        self.base += self.pos;
                        self.window.drain(..self.pos);
                        self.pos = 0;
                        self.window.extend_from_slice(&chunk[..len]);
                        let _ = self.spent.send(chunk);
                    }
                }
                Ok(Err(err)) => {
                    self.error = Some(err);
                    self.ended = true;
                }
                Err(_) => self.ended = true,
            }
        }
        Ok(())
    }

    /// Why the stream failed, once a read returned [`Shortfall::Failed`].
    pub(crate) fn error(&mut self) -> Option<VizError> {
        self.error.take()
    }
}

impl Source for GzipSource {
    #[inline]
    fn take(&mut self, n: usize) -> Result<&[u8], Shortfall> {
        if self.window.len() - self.pos < n {
            self.fill(n)?;
        }
        let bytes = &self.window[self.pos..self.pos + n];
        self.pos += n;
        Ok(bytes)
    }

    fn take_line(&mut self) -> Result<&[u8], Shortfall> {
        let mut searched = 0;
        loop {
            let rest = &self.window[self.pos + searched..];
            if let Some(at) = rest.iter().position(|&b| b == b'\n') {
                let end = self.pos + searched + at;
                let start = self.pos;
                self.pos = end + 1;
                return Ok(&self.window[start..end]);
            }
            searched = self.window.len() - self.pos;
            self.fill(searched + 1)?;
        }
    }

    fn position(&self) -> usize {
        self.base + self.pos
    }

    fn received(&self) -> usize {
        self.received
    }
}

/// Runs `read` on the decompressed content of the gzip stream `raw`, decompressed by a
/// second thread as `read` consumes it (every member, as `gzip -d` does), within the
/// decompressed-size limit for `path`. The bytes `read` does not consume are not
/// decompressed. `path` only names the file in errors.
pub(crate) fn with_gzip_source<T>(
    path: &Path,
    raw: &[u8],
    read: impl FnOnce(&mut GzipSource) -> T,
) -> Result<T, VizError> {
    let (limit, how) = limits::gunzip_limit(path, raw.len())?;
    let (chunk_tx, chunk_rx) = std::sync::mpsc::sync_channel::<Result<Chunk, VizError>>(4);
    let (spent_tx, spent_rx) = std::sync::mpsc::channel::<Vec<u8>>();
    Ok(std::thread::scope(|scope| {
        scope.spawn(move || {
            let mut decoder = flate2::read::MultiGzDecoder::new(raw);
            let mut total: u64 = 0;
            loop {
                let mut buf = spent_rx
                    .try_recv()
                    .unwrap_or_else(|_| Vec::with_capacity(CHUNK_BYTES));
                buf.resize(CHUNK_BYTES, 0);
                let mut len = 0;
                let failed = loop {
                    match decoder.read(&mut buf[len..]) {
                        Ok(0) => break None,
                        Ok(n) => {
                            len += n;
                            if len == buf.len() {
                                break None;
                            }
                        }
                        Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                        Err(source) => {
                            break Some(VizError::Gzip {
                                path: path.into(),
                                source,
                            })
                        }
                    }
                };
                total += len as u64;
                let over = (total > limit).then(|| VizError::Limit {
                    path: path.into(),
                    what: format!("decompresses to more than {limit} bytes (limit: {how})"),
                });
                if len > 0 && over.is_none() && chunk_tx.send(Ok((buf, len))).is_err() {
                    return; // The reader stopped.
                }
                if let Some(err) = failed.or(over) {
                    let _ = chunk_tx.send(Err(err));
                    return;
                }
                if len < CHUNK_BYTES {
                    return; // The end of the stream.
                }
            }
        });
        let mut source = GzipSource {
            chunks: chunk_rx,
            spent: spent_tx,
            window: Vec::new(),
            pos: 0,
            base: 0,
            received: 0,
            ended: false,
            error: None,
        };
        let out = read(&mut source);
        // Dropping the source ends the decompressing thread at its next chunk.
        drop(source);
        out
    }))
}

/// What a file's content holds once decompressed, told from the first bytes of the
/// decompressed stream for gzip (the rest is not decompressed) and from `raw` itself
/// otherwise. Corrupt gzip data reads as [`Content::Other`]; the reader that follows says
/// what is wrong with it.
pub fn peek_content(raw: &[u8]) -> Content {
    if sniff(raw) != Content::Gzip {
        return sniff(raw);
    }
    let mut head = Vec::with_capacity(64);
    let mut decoder = flate2::read::MultiGzDecoder::new(raw);
    // White space before JSON is skipped by the sniffer: read on until something else.
    let mut chunk = [0u8; 64];
    while head.len() < 4096 {
        match decoder.read(&mut chunk) {
            Ok(0) | Err(_) => break,
            Ok(n) => {
                head.extend_from_slice(&chunk[..n]);
                if head.iter().any(|b| !b.is_ascii_whitespace()) {
                    break;
                }
            }
        }
    }
    match sniff(&head) {
        // A gzip stream inside a gzip stream is not opened again.
        Content::Gzip => Content::Other,
        Content::Empty if head.len() >= 4096 => Content::Other,
        content => content,
    }
}
