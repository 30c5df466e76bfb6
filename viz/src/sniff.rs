//! What a snapshot or trace file holds, told from its first bytes.
//!
//! Every reader here recognises files by content, not by name: the viewer's loader, the
//! PyTorch pickle parser and the root crate's trace loader for `streamalloc replay` all
//! accept a PyTorch pickle or our JSON, gzip-compressed or not.
//! This module is the one place that decides which of those a file is, so that every
//! reader agrees on it.

/// The first two bytes of every gzip member.
pub const GZIP_MAGIC: [u8; 2] = [0x1f, 0x8b];

/// The first byte of a pickle of protocol 2 or later (the `PROTO` opcode).
pub const PICKLE_PROTO: u8 = 0x80;

/// What a file's bytes look like.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Content {
    /// A gzip stream.
    Gzip,
    /// A pickle, protocol 2 or later: a PyTorch memory snapshot.
    Pickle,
    /// JSON whose first value is an object.
    JsonObject,
    /// JSON whose first value is an array.
    JsonArray,
    /// Nothing but white space.
    Empty,
    /// Anything else.
    Other,
}

/// Tells what `bytes` hold: gzip and pickles by their first bytes, JSON by its first
/// character after white space.
pub fn sniff(bytes: &[u8]) -> Content {
    if bytes.starts_with(&GZIP_MAGIC) {
        return Content::Gzip;
    }
    if bytes.first() == Some(&PICKLE_PROTO) {
        return Content::Pickle;
    }
    match bytes.iter().find(|b| !b.is_ascii_whitespace()) {
        None => Content::Empty,
        Some(b'{') => Content::JsonObject,
        Some(b'[') => Content::JsonArray,
        Some(_) => Content::Other,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tells_the_formats_apart() {
        assert_eq!(sniff(&[0x1f, 0x8b, 8]), Content::Gzip);
        assert_eq!(sniff(&[0x80, 4, b'}']), Content::Pickle);
        assert_eq!(sniff(b" \n{\"format\": 1}"), Content::JsonObject);
        assert_eq!(sniff(b"\t[]"), Content::JsonArray);
        assert_eq!(sniff(b" \r\n"), Content::Empty);
        assert_eq!(sniff(b""), Content::Empty);
        assert_eq!(sniff(b"42"), Content::Other);
        // A pickle is recognised only at the very start, as the pickle reader needs it.
        assert_eq!(sniff(b" \x80\x04"), Content::Other);
    }
}
