//! Writing PyTorch snapshots: the pickle PyTorch's own viewers read.

use super::{BlockState, Frame, Stack, TorchBlock, TorchSegment, TorchSnapshot, TorchTraceEntry};
use crate::error::VizError;
use std::collections::HashMap;
use std::io::Write;

/// Integers must fit in a signed 64-bit integer: `MemoryViz.js` turns a `LONG1` of more
/// than 8 bytes into a `BigInt`, which breaks its arithmetic.
fn as_i64(v: u64, what: &str) -> Result<i64, VizError> {
    i64::try_from(v).map_err(|_| VizError::Unrepresentable {
        format: "PyTorch pickle",
        what: format!("{what} {v:#x} exceeds a signed 64-bit integer"),
    })
}

/// A pickle emitter limited to what PyTorch's viewers read: protocol 4 (unframed); dicts, lists,
/// 2-tuples, strings, integers of at most 8 bytes, floats, booleans, `None`. Strings are memoised
/// (`BINPUT`/`BINGET`, as Python's own pickler does), so the keys and call-stack strings
/// repeated in every trace entry are written once: files shrink several times over. Call
/// stacks are memoised too, by their shared allocation: an entry whose stack was written
/// before refers to it, as in the pickles PyTorch writes.
struct PickleWriter<W: Write> {
    out: W,
    /// Memo index of every string written so far.
    memo: HashMap<String, u32>,
    /// Memo index of every call stack written so far, by its shared allocation: a stack is
    /// written once and referred to from every other entry with it, as PyTorch's own
    /// snapshots do.
    stacks: HashMap<*const Frame, u32>,
}

/// Strings longer than this are not memoised (they rarely repeat).
const MEMO_MAX_LEN: usize = 256;
/// Bound on memo entries, so the memo stays small whatever the input.
const MEMO_MAX_ENTRIES: usize = 1 << 20;

impl<W: Write> PickleWriter<W> {
    fn raw(&mut self, bytes: &[u8]) -> Result<(), VizError> {
        self.out.write_all(bytes).map_err(pickle_io)
    }

    fn op(&mut self, op: u8) -> Result<(), VizError> {
        self.raw(&[op])
    }

    fn int(&mut self, v: i64) -> Result<(), VizError> {
        match v {
            0..=0xff => self.raw(&[b'K', v as u8]),
            0x100..=0xffff => {
                self.op(b'M')?;
                self.raw(&(v as u16).to_le_bytes())
            }
            _ if i32::try_from(v).is_ok() => {
                self.op(b'J')?;
                self.raw(&(v as i32).to_le_bytes())
            }
            _ => {
                // LONG1: little-endian two's complement, here always 8 bytes.
                self.raw(&[0x8a, 8])?;
                self.raw(&v.to_le_bytes())
            }
        }
    }

    fn bool(&mut self, v: bool) -> Result<(), VizError> {
        self.op(if v { 0x88 } else { 0x89 })
    }

    fn str(&mut self, v: &str) -> Result<(), VizError> {
        if let Some(&id) = self.memo.get(v) {
            return self.memo_get(id);
        }
        let bytes = v.as_bytes();
        if bytes.len() < 256 {
            self.raw(&[0x8c, bytes.len() as u8])?;
        } else {
            self.op(b'X')?;
            self.raw(&(bytes.len() as u32).to_le_bytes())?;
        }
        self.raw(bytes)?;
        if bytes.len() <= MEMO_MAX_LEN {
            if let Some(id) = self.memoise()? {
                self.memo.insert(v.to_owned(), id);
            }
        }
        Ok(())
    }

    /// Stores the object on top of the stack under the next memo index (`BINPUT`), and
    /// returns it; `None` once the memo holds [`MEMO_MAX_ENTRIES`].
    fn memoise(&mut self) -> Result<Option<u32>, VizError> {
        let id = self.memo.len() + self.stacks.len();
        if id >= MEMO_MAX_ENTRIES {
            return Ok(None);
        }
        let id = id as u32;
        if id < 256 {
            self.raw(&[b'q', id as u8])?;
        } else {
            self.op(b'r')?;
            self.raw(&id.to_le_bytes())?;
        }
        Ok(Some(id))
    }

    /// Pushes memo entry `id` (`BINGET`).
    fn memo_get(&mut self, id: u32) -> Result<(), VizError> {
        if id < 256 {
            self.raw(&[b'h', id as u8])
        } else {
            self.op(b'j')?;
            self.raw(&id.to_le_bytes())
        }
    }

    /// A list of `n` items written by `item(self, i)`, appended in batches of 1000.
    fn list(
        &mut self,
        n: usize,
        mut item: impl FnMut(&mut Self, usize) -> Result<(), VizError>,
    ) -> Result<(), VizError> {
        self.op(b']')?;
        for start in (0..n).step_by(1000) {
            self.op(b'(')?;
            for i in start..n.min(start + 1000) {
                item(self, i)?;
            }
            self.op(b'e')?;
        }
        Ok(())
    }

    /// A JSON value as the equivalent Python value (dict keys as strings).
    fn json(&mut self, v: &serde_json::Value) -> Result<(), VizError> {
        use serde_json::Value as J;
        match v {
            J::Null => self.op(b'N'),
            J::Bool(b) => self.bool(*b),
            J::Number(n) => match (n.as_i64(), n.as_f64()) {
                (Some(i), _) => self.int(i),
                (None, Some(f)) => {
                    self.op(b'G')?;
                    self.raw(&f.to_be_bytes())
                }
                (None, None) => self.op(b'N'),
            },
            J::String(s) => self.str(s),
            J::Array(items) => self.list(items.len(), |w, i| w.json(&items[i])),
            J::Object(map) => {
                self.op(b'}')?;
                if !map.is_empty() {
                    self.op(b'(')?;
                    for (k, v) in map {
                        self.str(k)?;
                        self.json(v)?;
                    }
                    self.op(b'u')?;
                }
                Ok(())
            }
        }
    }

    /// A call stack: written in full the first time, then referred to through the memo.
    fn frames(&mut self, stack: &Stack) -> Result<(), VizError> {
        if stack.is_empty() {
            return self.op(b']');
        }
        if let Some(&id) = self.stacks.get(&stack.as_ptr()) {
            return self.memo_get(id);
        }
        self.list(stack.len(), |w, i| {
            let f = &stack[i];
            w.op(b'}')?;
            w.op(b'(')?;
            w.str("name")?;
            w.str(&f.name)?;
            w.str("filename")?;
            w.str(&f.filename)?;
            w.str("line")?;
            w.int(f.line)?;
            w.op(b'u')
        })?;
        if let Some(id) = self.memoise()? {
            self.stacks.insert(stack.as_ptr(), id);
        }
        Ok(())
    }

    fn block(&mut self, b: &TorchBlock) -> Result<(), VizError> {
        self.op(b'}')?;
        self.op(b'(')?;
        self.str("address")?;
        self.int(as_i64(b.address, "block address")?)?;
        self.str("size")?;
        self.int(as_i64(b.size, "block size")?)?;
        self.str("requested_size")?;
        self.int(as_i64(b.requested_size, "requested size")?)?;
        self.str("state")?;
        self.str(b.state.name())?;
        self.str("frames")?;
        self.frames(&b.frames)?;
        self.op(b'u')
    }

    fn segment(&mut self, s: &TorchSegment) -> Result<(), VizError> {
        let (mut allocated, mut active, mut requested) = (0u64, 0u64, 0u64);
        for b in &s.blocks {
            if b.state != BlockState::Inactive {
                active += b.size;
            }
            if b.state == BlockState::ActiveAllocated {
                allocated += b.size;
                requested += b.requested_size;
            }
        }
        self.op(b'}')?;
        self.op(b'(')?;
        self.str("device")?;
        self.int(i64::from(s.device))?;
        self.str("address")?;
        self.int(as_i64(s.address, "segment address")?)?;
        self.str("total_size")?;
        self.int(as_i64(s.total_size, "segment size")?)?;
        self.str("allocated_size")?;
        self.int(as_i64(allocated, "allocated size")?)?;
        self.str("active_size")?;
        self.int(as_i64(active, "active size")?)?;
        self.str("requested_size")?;
        self.int(as_i64(requested, "requested size")?)?;
        self.str("stream")?;
        self.int(s.stream as i64)?;
        self.str("segment_type")?;
        self.str(&s.segment_type)?;
        self.str("segment_pool_id")?;
        self.int(0)?;
        self.int(0)?;
        self.op(0x86)?; // TUPLE2
        self.str("is_expandable")?;
        self.bool(s.is_expandable)?;
        self.str("frames")?;
        self.op(b']')?;
        self.str("blocks")?;
        self.list(s.blocks.len(), |w, i| w.block(&s.blocks[i]))?;
        self.op(b'u')
    }

    fn entry(&mut self, e: &TorchTraceEntry) -> Result<(), VizError> {
        self.op(b'}')?;
        self.op(b'(')?;
        self.str("action")?;
        self.str(e.action.name())?;
        self.str("addr")?;
        self.int(as_i64(e.addr, "address")?)?;
        self.str("size")?;
        self.int(as_i64(e.size, "size")?)?;
        self.str("stream")?;
        self.int(e.stream as i64)?;
        if let Some(t) = e.time_us {
            self.str("time_us")?;
            self.int(as_i64(t, "time")?)?;
        }
        if let Some(f) = e.device_free {
            self.str("device_free")?;
            self.int(as_i64(f, "device_free")?)?;
        }
        self.str("frames")?;
        self.frames(&e.frames)?;
        self.op(b'u')
    }
}

fn pickle_io(e: std::io::Error) -> VizError {
    VizError::Unrepresentable {
        format: "PyTorch pickle",
        what: e.to_string(),
    }
}

/// Writes `snapshot` as an uncompressed PyTorch-compatible pickle (protocol 4). Pass a
/// buffered writer: the pickle is written in many small pieces.
pub fn write_pickle(snapshot: &TorchSnapshot, out: &mut impl Write) -> Result<(), VizError> {
    let mut w = PickleWriter {
        out,
        memo: HashMap::new(),
        stacks: HashMap::new(),
    };
    w.raw(&[0x80, 4])?;
    w.op(b'}')?;
    w.op(b'(')?;
    w.str("segments")?;
    w.list(snapshot.segments.len(), |w, i| {
        w.segment(&snapshot.segments[i])
    })?;
    w.str("device_traces")?;
    w.list(snapshot.device_traces.len(), |w, d| {
        let trace = &snapshot.device_traces[d];
        w.list(trace.len(), |w, i| w.entry(&trace[i]))
    })?;
    if let Some(settings) = &snapshot.allocator_settings {
        w.str("allocator_settings")?;
        w.json(settings)?;
    }
    w.op(b'u')?;
    w.op(b'.')?;
    Ok(())
}
