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
    let mut out = Vec::with_capacity(known.unwrap_or(0).min(limit) as usize);
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
    let capacity = (raw.len() as u64).saturating_mul(8).min(limit) as usize;
    let mut out = Vec::with_capacity(capacity);
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
