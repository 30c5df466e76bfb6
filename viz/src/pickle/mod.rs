//! A small, bounded pickle decoder for plain data (dicts, lists, tuples, sets, strings,
//! bytes, numbers, booleans and `None`).
//!
//! PyTorch memory snapshots are pickles that share objects: recent versions reference the
//! same call-stack list or dict from many trace entries through the memo (`BINGET`), and
//! general-purpose decoders that reject any memo reference to a container (to rule out
//! cycles) cannot read them. This decoder follows Python's own semantics instead: the memo
//! refers to an object, not to a copy, so a later reference sees the object as finally
//! built, and only a container that ends up inside itself is refused.
//!
//! It is also the first thing to touch untrusted files, so it is written to fail cleanly:
//!
//! - no code runs: `GLOBAL`, `REDUCE`, `BUILD` and every other opcode that names or builds a
//!   Python object are refused with their name and byte offset;
//! - it is a stack machine over the input with no recursion, and the value tree is built
//!   iteratively, so no input can overflow the call stack;
//! - every limit is a named constant below, and every error is one line with the byte
//!   offset it concerns ([`PickleError`]);
//! - every byte it allocates (stack slots, containers, memo entries, strings; in [`decode`]
//!   also the values of the tree, where shared references are copied out) is charged to a
//!   [`Budget`] proportional to the input, so a "billion laughs" of memo references fails
//!   fast instead of exhausting memory.
//!
//! Decoding runs in two steps. The first executes the opcodes into an arena: scalars are
//! stored inline (strings behind reference counts, so `DUP` and memo references of a long
//! string cost nothing), containers are arena nodes that stack slots and the memo refer to
//! by index, mutable exactly as in Python. The second walks the arena from the top-level
//! object with an explicit stack and builds the [`serde_pickle::Value`] tree that the
//! snapshot reader consumes, copying shared containers, checking nesting depth and output
//! size, and detecting cycles.
//!
//! Integers wider than 64 bits are refused (nothing in a snapshot needs them), as are
//! protocol-0 text strings (`STRING`, `UNICODE`), which Python 3 never writes at protocol 2
//! or later.

use crate::limits::{Budget, OverBudget};
use serde_pickle::{HashableValue, Value};
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fmt;

/// Deepest nesting of containers accepted (the top-level object counts as one), and the
/// most `MARK`s open at once. Snapshots nest about six deep; the cap keeps the recursive
/// code that consumes the tree (comparison, conversion, drop) far from the thread's stack
/// limit.
pub const MAX_DEPTH: usize = 512;

/// Most memo entries. Each costs at least one input byte anyway; this caps the memo of a
/// huge input at a size a real snapshot never reaches (about 14 entries per trace entry).
pub const MAX_MEMO: usize = 1 << 26;

/// Highest pickle protocol known (Python 3.8+ writes up to 5).
pub const HIGHEST_PROTOCOL: u8 = 5;

/// Why bytes could not be decoded: what went wrong and at which byte of the input.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PickleError {
    /// Byte offset of the opcode (or container) concerned.
    pub offset: usize,
    /// What is wrong, in one line.
    pub message: String,
}

impl fmt::Display for PickleError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "byte {}: {}", self.offset, self.message)
    }
}

impl std::error::Error for PickleError {}

/// Decodes one pickle (protocols 2 to 5; the text opcodes of protocols 0 and 1 for
/// integers, floats and the memo are accepted too) into a value tree. Bytes after `STOP`
/// are ignored, as Python does.
pub fn decode(bytes: &[u8]) -> Result<Value, PickleError> {
    let arena = decode_arena(bytes, Budget::for_input(bytes.len()))?;
    Builder {
        arena: &arena,
        budget: arena.budget.clone(),
        used: Cost::default(),
        state: vec![State::New; arena.nodes.len()],
        cache: HashMap::new(),
    }
    .build(arena.root.clone())
}

/// Runs the pickle in `bytes` into an [`Arena`], charging what it allocates to `budget`.
pub(crate) fn decode_arena(bytes: &[u8], budget: Budget) -> Result<Arena, PickleError> {
    let mut machine = Machine {
        data: bytes,
        pos: 0,
        op_at: 0,
        stack: Vec::new(),
        marks: Vec::new(),
        memo: Memo::default(),
        nodes: Vec::new(),
        strings: Vec::new(),
        blobs: Vec::new(),
        budget,
    };
    let root = machine.run()?;
    // The stack and memo go now: only what they refer to is needed from here on.
    Ok(Arena {
        nodes: machine.nodes,
        strings: machine.strings,
        blobs: machine.blobs,
        root,
        budget: machine.budget,
    })
}

// ---- Step 1: the stack machine ----

/// The memo: Python numbers its entries 0, 1, 2, ... so they are kept in a vector indexed
/// by key; a key far past the others (possible, never written by Python) goes to a map, so
/// a single key of 4 billion does not allocate 4 billion slots.
#[derive(Default)]
struct Memo {
    dense: Vec<Option<Slot>>,
    sparse: HashMap<u32, Slot>,
    len: usize,
}

impl Memo {
    fn len(&self) -> usize {
        self.len
    }

    fn get(&self, key: u32) -> Option<&Slot> {
        self.dense
            .get(key as usize)
            .and_then(Option::as_ref)
            .or_else(|| self.sparse.get(&key))
    }

    fn insert(&mut self, key: u32, value: Slot) {
        let k = key as usize;
        let old = if k < self.dense.len() {
            self.dense[k]
                .replace(value)
                .or_else(|| self.sparse.remove(&key))
        } else if k == self.dense.len() {
            self.dense.push(Some(value));
            self.sparse.remove(&key)
        } else {
            self.sparse.insert(key, value)
        };
        if old.is_none() {
            self.len += 1;
        }
    }
}

/// Index of a container in the arena.
type NodeId = u32;

/// A stack, memo or container slot: a scalar, or a reference to a container.
#[derive(Clone, Debug)]
pub(crate) enum Slot {
    None,
    Bool(bool),
    Int(i64),
    Float(f64),
    /// Index into [`Arena::strings`].
    Str(u32),
    /// Index into [`Arena::blobs`].
    Bytes(u32),
    Node(NodeId),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Kind {
    List,
    Tuple,
    /// Items alternate key, value.
    Dict,
    Set,
    FrozenSet,
}

impl Kind {
    fn name(self) -> &'static str {
        match self {
            Kind::List => "list",
            Kind::Tuple => "tuple",
            Kind::Dict => "dict",
            Kind::Set => "set",
            Kind::FrozenSet => "frozenset",
        }
    }
}

#[derive(Debug)]
pub(crate) struct Node {
    pub(crate) kind: Kind,
    /// Byte offset of the opcode that created it, for errors found later.
    pub(crate) offset: usize,
    pub(crate) items: Vec<Slot>,
}

/// What the stack machine built: every container, string and byte string of the pickle,
/// each once however often the pickle refers to it, and the top-level object. Readers walk
/// it directly ([`crate::pytorch`]), so sharing in the file stays sharing in memory.
#[derive(Debug)]
pub(crate) struct Arena {
    pub(crate) nodes: Vec<Node>,
    pub(crate) strings: Vec<Box<str>>,
    pub(crate) blobs: Vec<Box<[u8]>>,
    pub(crate) root: Slot,
    /// What is left of the budget the arena was built within, for what is built from it.
    pub(crate) budget: Budget,
}

/// In-memory bytes of a stack or container slot, of a container, of a memo entry.
const SLOT_BYTES: u64 = std::mem::size_of::<Slot>() as u64;
const NODE_BYTES: u64 = std::mem::size_of::<Node>() as u64;
const MEMO_ENTRY_BYTES: u64 = 2 * SLOT_BYTES;

struct Machine<'a> {
    data: &'a [u8],
    /// Next byte to read.
    pos: usize,
    /// Offset of the opcode being executed.
    op_at: usize,
    stack: Vec<Slot>,
    /// Stack lengths at each open `MARK`.
    marks: Vec<usize>,
    memo: Memo,
    nodes: Vec<Node>,
    strings: Vec<Box<str>>,
    blobs: Vec<Box<[u8]>>,
    budget: Budget,
}

/// The name of an opcode, for errors.
fn opcode_name(op: u8) -> Option<&'static str> {
    Some(match op {
        b'(' => "MARK",
        b'.' => "STOP",
        b'0' => "POP",
        b'1' => "POP_MARK",
        b'2' => "DUP",
        b'F' => "FLOAT",
        b'I' => "INT",
        b'J' => "BININT",
        b'K' => "BININT1",
        b'L' => "LONG",
        b'M' => "BININT2",
        b'N' => "NONE",
        b'P' => "PERSID",
        b'Q' => "BINPERSID",
        b'R' => "REDUCE",
        b'S' => "STRING",
        b'T' => "BINSTRING",
        b'U' => "SHORT_BINSTRING",
        b'V' => "UNICODE",
        b'X' => "BINUNICODE",
        b'a' => "APPEND",
        b'b' => "BUILD",
        b'c' => "GLOBAL",
        b'd' => "DICT",
        b'}' => "EMPTY_DICT",
        b'e' => "APPENDS",
        b'g' => "GET",
        b'h' => "BINGET",
        b'i' => "INST",
        b'j' => "LONG_BINGET",
        b'l' => "LIST",
        b']' => "EMPTY_LIST",
        b'o' => "OBJ",
        b'p' => "PUT",
        b'q' => "BINPUT",
        b'r' => "LONG_BINPUT",
        b's' => "SETITEM",
        b't' => "TUPLE",
        b')' => "EMPTY_TUPLE",
        b'u' => "SETITEMS",
        b'G' => "BINFLOAT",
        b'B' => "BINBYTES",
        b'C' => "SHORT_BINBYTES",
        0x80 => "PROTO",
        0x81 => "NEWOBJ",
        0x82 => "EXT1",
        0x83 => "EXT2",
        0x84 => "EXT4",
        0x85 => "TUPLE1",
        0x86 => "TUPLE2",
        0x87 => "TUPLE3",
        0x88 => "NEWTRUE",
        0x89 => "NEWFALSE",
        0x8a => "LONG1",
        0x8b => "LONG4",
        0x8c => "SHORT_BINUNICODE",
        0x8d => "BINUNICODE8",
        0x8e => "BINBYTES8",
        0x8f => "EMPTY_SET",
        0x90 => "ADDITEMS",
        0x91 => "FROZENSET",
        0x92 => "NEWOBJ_EX",
        0x93 => "STACK_GLOBAL",
        0x94 => "MEMOIZE",
        0x95 => "FRAME",
        0x96 => "BYTEARRAY8",
        0x97 => "NEXT_BUFFER",
        0x98 => "READONLY_BUFFER",
        _ => return None,
    })
}

/// Little-endian two's-complement integer of any width (`LONG1`, `LONG4`) as an `i64`, if
/// it fits.
fn long_to_i64(bytes: &[u8]) -> Option<i64> {
    let Some(&last) = bytes.last() else {
        return Some(0);
    };
    let negative = last & 0x80 != 0;
    let fill = if negative { 0xff } else { 0 };
    if bytes.len() > 8 && bytes[8..].iter().any(|&b| b != fill) {
        return None;
    }
    let mut buf = [fill; 8];
    let n = bytes.len().min(8);
    buf[..n].copy_from_slice(&bytes[..n]);
    let v = i64::from_le_bytes(buf);
    // Wider encodings only fit if their sign survives the truncation.
    ((v < 0) == negative).then_some(v)
}

impl<'a> Machine<'a> {
    fn err(&self, message: impl Into<String>) -> PickleError {
        PickleError {
            offset: self.op_at,
            message: message.into(),
        }
    }

    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8], PickleError> {
        let left = self.data.len() - self.pos;
        if n > left {
            return Err(self.err(format!(
                "truncated: {what} needs {n} more bytes, only {left} left"
            )));
        }
        let data: &'a [u8] = self.data;
        let bytes = &data[self.pos..self.pos + n];
        self.pos += n;
        Ok(bytes)
    }

    fn array<const N: usize>(&mut self, what: &str) -> Result<[u8; N], PickleError> {
        let mut out = [0; N];
        out.copy_from_slice(self.take(N, what)?);
        Ok(out)
    }

    fn u8(&mut self, what: &str) -> Result<u8, PickleError> {
        Ok(self.array::<1>(what)?[0])
    }

    fn u32(&mut self, what: &str) -> Result<u32, PickleError> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }

    /// A length read as `u64`: anything beyond the input is a truncation.
    fn len8(&mut self, what: &str) -> Result<usize, PickleError> {
        let n = u64::from_le_bytes(self.array(what)?);
        let left = self.data.len() - self.pos;
        usize::try_from(n)
            .ok()
            .filter(|&n| n <= left)
            .ok_or_else(|| {
                self.err(format!(
                    "truncated: {what} needs {n} more bytes, only {left} left"
                ))
            })
    }

    /// A text argument of the protocol-0 opcodes: up to the next newline.
    fn line(&mut self, what: &str) -> Result<&'a str, PickleError> {
        let data: &'a [u8] = self.data;
        let rest = &data[self.pos..];
        let Some(end) = rest.iter().position(|&b| b == b'\n') else {
            return Err(self.err(format!("truncated: {what} argument has no newline")));
        };
        self.pos += end + 1;
        std::str::from_utf8(&rest[..end])
            .map_err(|_| self.err(format!("{what} argument is not ASCII")))
    }

    fn int_line(&mut self, what: &str) -> Result<i64, PickleError> {
        let line = self.line(what)?.trim();
        let digits = line.strip_suffix('L').unwrap_or(line);
        digits.parse::<i64>().map_err(|_| {
            self.err(format!(
                "{what} argument {:?} is not an integer that fits in 64 bits",
                truncate_for_message(line)
            ))
        })
    }

    fn memo_key_line(&mut self, what: &str) -> Result<u32, PickleError> {
        let v = self.int_line(what)?;
        u32::try_from(v).map_err(|_| self.err(format!("{what}: memo key {v} out of range")))
    }

    /// The stack length below which the current `MARK` protects items.
    fn base(&self) -> usize {
        self.marks.last().copied().unwrap_or(0)
    }

    fn charge(&mut self, bytes: u64) -> Result<(), PickleError> {
        self.budget
            .charge(bytes)
            .map_err(|over| self.err(over.to_string()))
    }

    /// Pushes `slot`, charged to the budget: a slot moves from the stack into a container
    /// but is never charged again, so the charges bound the high-water mark.
    fn push(&mut self, slot: Slot) -> Result<(), PickleError> {
        self.charge(SLOT_BYTES)?;
        self.stack.push(slot);
        Ok(())
    }

    fn pop(&mut self, what: &str) -> Result<Slot, PickleError> {
        if self.stack.len() <= self.base() {
            return Err(self.err(format!("{what} on an empty stack (stack underflow)")));
        }
        self.stack
            .pop()
            .ok_or_else(|| self.err(format!("{what} on an empty stack (stack underflow)")))
    }

    fn top(&self, what: &str) -> Result<&Slot, PickleError> {
        if self.stack.len() <= self.base() {
            return Err(self.err(format!("{what} on an empty stack (stack underflow)")));
        }
        self.stack
            .last()
            .ok_or_else(|| self.err(format!("{what} on an empty stack (stack underflow)")))
    }

    /// Items pushed since the last `MARK`, which is closed.
    fn pop_mark(&mut self, what: &str) -> Result<Vec<Slot>, PickleError> {
        let Some(mark) = self.marks.pop() else {
            return Err(self.err(format!("{what} without a MARK")));
        };
        let mark = mark.min(self.stack.len());
        // The items move to a vector of their own while the stack keeps its capacity: both
        // are memory, so the copy is charged before it is made, and a stack far larger than
        // what it still holds gives its memory back.
        self.charge((self.stack.len() - mark) as u64 * SLOT_BYTES)?;
        let items = self.stack.split_off(mark);
        if self.stack.capacity() > 4096 && self.stack.capacity() > 4 * self.stack.len() {
            self.stack.shrink_to(2 * self.stack.len());
        }
        Ok(items)
    }

    /// Adds `items` to the container on top of the stack, which must be `kind`; an empty
    /// container takes the vector as it is rather than a copy.
    fn append(&mut self, kind: Kind, items: Vec<Slot>, what: &str) -> Result<(), PickleError> {
        let target = self.target(kind, what)?;
        if target.is_empty() {
            *target = items;
        } else {
            target.extend(items);
        }
        Ok(())
    }

    fn index(&self, len: usize) -> Result<u32, PickleError> {
        u32::try_from(len)
            .ok()
            .filter(|&id| id < u32::MAX)
            .ok_or_else(|| self.err(format!("more than {} strings", u32::MAX)))
    }

    fn new_node(&mut self, kind: Kind, items: Vec<Slot>) -> Result<Slot, PickleError> {
        let id = NodeId::try_from(self.nodes.len())
            .ok()
            .filter(|&id| id < NodeId::MAX)
            .ok_or_else(|| self.err(format!("more than {} containers", NodeId::MAX)))?;
        self.charge(NODE_BYTES)?;
        self.nodes.push(Node {
            kind,
            offset: self.op_at,
            items,
        });
        Ok(Slot::Node(id))
    }

    /// The container on top of the stack, which `what` adds items to; it must be `kind`.
    fn target(&mut self, kind: Kind, what: &str) -> Result<&mut Vec<Slot>, PickleError> {
        let id = match self.top(what)? {
            Slot::Node(id) => *id as usize,
            other => {
                return Err(self.err(format!(
                    "{what} into {}, expected a {}",
                    with_article(slot_type(other)),
                    kind.name()
                )))
            }
        };
        let found = self.nodes[id].kind;
        if found != kind {
            return Err(self.err(format!(
                "{what} into {}, expected a {}",
                with_article(found.name()),
                kind.name()
            )));
        }
        Ok(&mut self.nodes[id].items)
    }

    fn memo_put(&mut self, key: u32, what: &str) -> Result<(), PickleError> {
        let value = self.top(what)?.clone();
        if self.memo.len() >= MAX_MEMO && self.memo.get(key).is_none() {
            return Err(self.err(format!("memo holds more than {MAX_MEMO} entries")));
        }
        self.charge(MEMO_ENTRY_BYTES)?;
        self.memo.insert(key, value);
        Ok(())
    }

    fn memo_get(&mut self, key: u32) -> Result<(), PickleError> {
        let value = self
            .memo
            .get(key)
            .cloned()
            .ok_or_else(|| self.err(format!("memo key {key} is not defined")))?;
        self.push(value)?;
        Ok(())
    }

    fn string(&mut self, n: usize, what: &str) -> Result<(), PickleError> {
        let bytes = self.take(n, what)?;
        match std::str::from_utf8(bytes) {
            Ok(s) => {
                self.charge(s.len() as u64 + 16)?;
                let id = self.index(self.strings.len())?;
                self.strings.push(s.into());
                self.push(Slot::Str(id))
            }
            Err(e) => Err(self.err(format!("{what}: invalid UTF-8 ({e})"))),
        }
    }

    fn bytes(&mut self, n: usize, what: &str) -> Result<(), PickleError> {
        let bytes = self.take(n, what)?;
        self.charge(bytes.len() as u64 + 16)?;
        let id = self.index(self.blobs.len())?;
        self.blobs.push(bytes.into());
        self.push(Slot::Bytes(id))
    }

    fn long(&mut self, n: usize, what: &str) -> Result<(), PickleError> {
        let bytes = self.take(n, what)?;
        match long_to_i64(bytes) {
            Some(v) => {
                self.push(Slot::Int(v))?;
                Ok(())
            }
            None => Err(self.err(format!(
                "{what}: integer of {n} bytes does not fit in 64 bits (the limit of this reader)"
            ))),
        }
    }

    fn tuple(&mut self, n: usize, what: &str) -> Result<(), PickleError> {
        if self.stack.len() < self.base() + n {
            return Err(self.err(format!("{what} on a stack of fewer than {n} items")));
        }
        let items = self.stack.split_off(self.stack.len() - n);
        let t = self.new_node(Kind::Tuple, items)?;
        self.push(t)?;
        Ok(())
    }

    /// Runs the opcodes up to `STOP` and returns the object it pops.
    fn run(&mut self) -> Result<Slot, PickleError> {
        loop {
            self.op_at = self.pos;
            let Some(&op) = self.data.get(self.pos) else {
                return Err(self.err("truncated: the pickle ends before its STOP opcode"));
            };
            self.pos += 1;
            let name = opcode_name(op).unwrap_or("?");
            match op {
                0x80 => {
                    let v = self.u8(name)?;
                    if v > HIGHEST_PROTOCOL {
                        return Err(self.err(format!(
                            "unsupported pickle protocol {v} (the highest known is \
                             {HIGHEST_PROTOCOL})"
                        )));
                    }
                }
                // FRAME only announces how many bytes follow, as a read-ahead hint; each
                // opcode checks its own bytes, so a wrong announcement is harmless.
                0x95 => {
                    self.array::<8>(name)?;
                }
                b'.' => return self.pop(name),
                b'(' => {
                    if self.marks.len() >= MAX_DEPTH {
                        return Err(self.err(format!(
                            "more than {MAX_DEPTH} nested MARKs (the nesting limit)"
                        )));
                    }
                    self.marks.push(self.stack.len());
                }
                b'0' => {
                    // As in Python: with nothing above the mark, POP removes the mark.
                    if self.stack.len() > self.base() {
                        self.stack.pop();
                    } else if self.marks.pop().is_none() {
                        return Err(self.err("POP on an empty stack (stack underflow)"));
                    }
                }
                b'1' => {
                    self.pop_mark(name)?;
                }
                b'2' => {
                    let v = self.top(name)?.clone();
                    self.push(v)?;
                }
                b'N' => self.push(Slot::None)?,
                0x88 => self.push(Slot::Bool(true))?,
                0x89 => self.push(Slot::Bool(false))?,
                b'K' => {
                    let v = self.u8(name)?;
                    self.push(Slot::Int(i64::from(v)))?;
                }
                b'M' => {
                    let v = u16::from_le_bytes(self.array(name)?);
                    self.push(Slot::Int(i64::from(v)))?;
                }
                b'J' => {
                    let v = i32::from_le_bytes(self.array(name)?);
                    self.push(Slot::Int(i64::from(v)))?;
                }
                0x8a => {
                    let n = self.u8(name)?;
                    self.long(usize::from(n), name)?;
                }
                0x8b => {
                    let n = i32::from_le_bytes(self.array(name)?);
                    let n = usize::try_from(n)
                        .map_err(|_| self.err(format!("{name}: negative length {n}")))?;
                    self.long(n, name)?;
                }
                b'I' => {
                    let line = self.line(name)?.trim();
                    // Protocol 0 spells booleans as INT 01 and 00.
                    let slot = match line {
                        "01" => Slot::Bool(true),
                        "00" => Slot::Bool(false),
                        _ => Slot::Int(line.parse::<i64>().map_err(|_| {
                            self.err(format!(
                                "INT argument {:?} is not an integer that fits in 64 bits",
                                truncate_for_message(line)
                            ))
                        })?),
                    };
                    self.push(slot)?;
                }
                b'L' => {
                    let v = self.int_line(name)?;
                    self.push(Slot::Int(v))?;
                }
                b'F' => {
                    let line = self.line(name)?.trim();
                    let v = line.parse::<f64>().map_err(|_| {
                        self.err(format!(
                            "FLOAT argument {:?} is not a number",
                            truncate_for_message(line)
                        ))
                    })?;
                    self.push(Slot::Float(v))?;
                }
                b'G' => {
                    let v = f64::from_be_bytes(self.array(name)?);
                    self.push(Slot::Float(v))?;
                }
                0x8c => {
                    let n = self.u8(name)?;
                    self.string(usize::from(n), name)?;
                }
                b'X' => {
                    let n = self.u32(name)?;
                    self.string(n as usize, name)?;
                }
                0x8d => {
                    let n = self.len8(name)?;
                    self.string(n, name)?;
                }
                // Python 2 `str` and bytes-like opcodes all decode to bytes.
                b'U' | b'C' => {
                    let n = self.u8(name)?;
                    self.bytes(usize::from(n), name)?;
                }
                b'B' => {
                    let n = self.u32(name)?;
                    self.bytes(n as usize, name)?;
                }
                b'T' => {
                    let n = i32::from_le_bytes(self.array(name)?);
                    let n = usize::try_from(n)
                        .map_err(|_| self.err(format!("{name}: negative length {n}")))?;
                    self.bytes(n, name)?;
                }
                0x8e | 0x96 => {
                    let n = self.len8(name)?;
                    self.bytes(n, name)?;
                }
                b']' => {
                    let v = self.new_node(Kind::List, Vec::new())?;
                    self.push(v)?;
                }
                b'}' => {
                    let v = self.new_node(Kind::Dict, Vec::new())?;
                    self.push(v)?;
                }
                b')' => {
                    let v = self.new_node(Kind::Tuple, Vec::new())?;
                    self.push(v)?;
                }
                0x8f => {
                    let v = self.new_node(Kind::Set, Vec::new())?;
                    self.push(v)?;
                }
                b'l' => {
                    let items = self.pop_mark(name)?;
                    let v = self.new_node(Kind::List, items)?;
                    self.push(v)?;
                }
                b't' => {
                    let items = self.pop_mark(name)?;
                    let v = self.new_node(Kind::Tuple, items)?;
                    self.push(v)?;
                }
                0x91 => {
                    let items = self.pop_mark(name)?;
                    let v = self.new_node(Kind::FrozenSet, items)?;
                    self.push(v)?;
                }
                b'd' => {
                    let items = self.pop_mark(name)?;
                    if items.len() % 2 != 0 {
                        return Err(self.err("DICT with an odd number of items"));
                    }
                    let v = self.new_node(Kind::Dict, items)?;
                    self.push(v)?;
                }
                0x85 => self.tuple(1, name)?,
                0x86 => self.tuple(2, name)?,
                0x87 => self.tuple(3, name)?,
                b'a' => {
                    let v = self.pop(name)?;
                    self.target(Kind::List, name)?.push(v);
                }
                b'e' => {
                    let items = self.pop_mark(name)?;
                    self.append(Kind::List, items, name)?;
                }
                b's' => {
                    let v = self.pop(name)?;
                    let k = self.pop(name)?;
                    let dict = self.target(Kind::Dict, name)?;
                    dict.push(k);
                    dict.push(v);
                }
                b'u' => {
                    let items = self.pop_mark(name)?;
                    if items.len() % 2 != 0 {
                        return Err(self.err("SETITEMS with an odd number of items"));
                    }
                    self.append(Kind::Dict, items, name)?;
                }
                0x90 => {
                    let items = self.pop_mark(name)?;
                    self.append(Kind::Set, items, name)?;
                }
                0x94 => {
                    let key = u32::try_from(self.memo.len())
                        .map_err(|_| self.err("memo index overflow"))?;
                    self.memo_put(key, name)?;
                }
                b'q' => {
                    let key = self.u8(name)?;
                    self.memo_put(u32::from(key), name)?;
                }
                b'r' => {
                    let key = self.u32(name)?;
                    self.memo_put(key, name)?;
                }
                b'p' => {
                    let key = self.memo_key_line(name)?;
                    self.memo_put(key, name)?;
                }
                b'h' => {
                    let key = self.u8(name)?;
                    self.memo_get(u32::from(key))?;
                }
                b'j' => {
                    let key = self.u32(name)?;
                    self.memo_get(key)?;
                }
                b'g' => {
                    let key = self.memo_key_line(name)?;
                    self.memo_get(key)?;
                }
                b'S' | b'V' => {
                    return Err(self.err(format!(
                        "opcode {name} (protocol-0 text string) is not supported: \
                         expected a pickle of protocol 2 or later"
                    )))
                }
                _ => {
                    return Err(self.err(match opcode_name(op) {
                        Some(name) => format!(
                            "opcode {name} (0x{op:02x}) refused: it constructs a Python \
                             object, and a memory snapshot holds only plain data"
                        ),
                        None => format!("unknown opcode 0x{op:02x}"),
                    }))
                }
            }
        }
    }
}

/// A protocol-0 text argument, shortened for an error message.
fn truncate_for_message(s: &str) -> String {
    s.chars().take(40).collect()
}

fn with_article(name: &str) -> String {
    match name.as_bytes().first() {
        Some(b'a' | b'e' | b'i' | b'o' | b'u') => format!("an {name}"),
        _ => format!("a {name}"),
    }
}

fn slot_type(slot: &Slot) -> &'static str {
    match slot {
        Slot::None => "None",
        Slot::Bool(_) => "bool",
        Slot::Int(_) => "int",
        Slot::Float(_) => "float",
        Slot::Str(_) => "str",
        Slot::Bytes(_) => "bytes",
        Slot::Node(_) => "container",
    }
}

// ---- Step 2: building the value tree ----

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    New,
    /// On the path from the root: meeting it again means it contains itself.
    Open,
    Done,
}

/// How much of the output budget a subtree used, so that copies of it can be charged.
#[derive(Clone, Copy, Debug, Default)]
struct Cost {
    values: u64,
    text: u64,
}

/// In-memory bytes of one value of the tree.
const VALUE_BYTES: u64 = std::mem::size_of::<Value>() as u64;

/// A container being built: its node, the next item to visit, the values built so far.
struct Open {
    id: NodeId,
    next: usize,
    out: Vec<Value>,
    /// What had been built when it was entered, to measure its cost.
    used: Cost,
}

struct Builder<'a> {
    arena: &'a Arena,
    budget: Budget,
    /// Values and text built so far.
    used: Cost,
    state: Vec<State>,
    /// Finished containers referenced more than once, with what they cost to build.
    cache: HashMap<NodeId, (Value, Cost)>,
}

impl Builder<'_> {
    fn node(&self, id: NodeId) -> &Node {
        &self.arena.nodes[id as usize]
    }

    fn charge(&mut self, cost: Cost, offset: usize) -> Result<(), PickleError> {
        let bytes = cost
            .values
            .saturating_mul(VALUE_BYTES)
            .saturating_add(cost.text);
        self.budget
            .charge(bytes)
            .map_err(|over: OverBudget| PickleError {
                offset,
                message: over.to_string(),
            })?;
        self.used.values += cost.values;
        self.used.text += cost.text;
        Ok(())
    }

    /// Turns `slot` into a value if it is a scalar or an already built container, or opens
    /// it on `path` (and returns `None`) if it is a container to build. `offset` names the
    /// container holding it, for errors.
    fn enter(
        &mut self,
        slot: &Slot,
        offset: usize,
        path: &mut Vec<Open>,
    ) -> Result<Option<Value>, PickleError> {
        let value = match slot {
            Slot::None => Value::None,
            Slot::Bool(b) => Value::Bool(*b),
            Slot::Int(i) => Value::I64(*i),
            Slot::Float(f) => Value::F64(*f),
            Slot::Str(id) => {
                let s = &self.arena.strings[*id as usize];
                self.charge(
                    Cost {
                        values: 1,
                        text: s.len() as u64,
                    },
                    offset,
                )?;
                return Ok(Some(Value::String(s.to_string())));
            }
            Slot::Bytes(id) => {
                let b = &self.arena.blobs[*id as usize];
                self.charge(
                    Cost {
                        values: 1,
                        text: b.len() as u64,
                    },
                    offset,
                )?;
                return Ok(Some(Value::Bytes(b.to_vec())));
            }
            Slot::Node(id) => return self.enter_node(*id, path),
        };
        self.charge(Cost { values: 1, text: 0 }, offset)?;
        Ok(Some(value))
    }

    fn enter_node(
        &mut self,
        id: NodeId,
        path: &mut Vec<Open>,
    ) -> Result<Option<Value>, PickleError> {
        let offset = self.node(id).offset;
        match self.state[id as usize] {
            State::Open => Err(PickleError {
                offset,
                message: format!(
                    "recursive structure: the {} created here contains itself",
                    self.node(id).kind.name()
                ),
            }),
            State::Done => {
                let Some((_, cost)) = self.cache.get(&id) else {
                    // Only containers referenced once are left uncached, and a second
                    // visit of one is impossible; refuse rather than panic all the same.
                    return Err(PickleError {
                        offset,
                        message: "internal error: container visited twice".into(),
                    });
                };
                let cost = *cost;
                self.charge(cost, offset)?;
                Ok(self.cache.get(&id).map(|(v, _)| v.clone()))
            }
            State::New => {
                if path.len() >= MAX_DEPTH {
                    return Err(PickleError {
                        offset,
                        message: format!(
                            "containers nested more than {MAX_DEPTH} deep (the nesting limit)"
                        ),
                    });
                }
                let used = self.used;
                self.charge(Cost { values: 1, text: 0 }, offset)?;
                self.state[id as usize] = State::Open;
                path.push(Open {
                    id,
                    next: 0,
                    out: Vec::with_capacity(self.node(id).items.len()),
                    used,
                });
                Ok(None)
            }
        }
    }

    /// How many times each container is referenced (from containers and the root), so
    /// that only shared ones are kept for copying.
    fn shared(&self, root: &Slot) -> Vec<bool> {
        let mut refs = vec![0u8; self.arena.nodes.len()];
        let mut count = |slot: &Slot| {
            if let Slot::Node(id) = slot {
                let r = &mut refs[*id as usize];
                *r = r.saturating_add(1);
            }
        };
        count(root);
        for node in &self.arena.nodes {
            node.items.iter().for_each(&mut count);
        }
        refs.into_iter().map(|r| r > 1).collect()
    }

    fn finish(&self, open: Open) -> Result<Value, PickleError> {
        let node = self.node(open.id);
        let offset = node.offset;
        let hashable = |v: Value| {
            let kind = value_type(&v);
            let err = |what: &str| PickleError {
                offset,
                message: format!(
                    "{what} used as a key or set item in the {} created here",
                    node.kind.name()
                ),
            };
            let h = v
                .into_hashable()
                .map_err(|_| err(&format!("unhashable {kind}")))?;
            // NaN has no consistent order, which the B-tree maps of `Value` need.
            if contains_nan(&h) {
                return Err(err("NaN"));
            }
            Ok(h)
        };
        Ok(match node.kind {
            Kind::List => Value::List(open.out),
            Kind::Tuple => Value::Tuple(open.out),
            Kind::Set | Kind::FrozenSet => {
                let set = open
                    .out
                    .into_iter()
                    .map(hashable)
                    .collect::<Result<BTreeSet<_>, _>>()?;
                if node.kind == Kind::Set {
                    Value::Set(set)
                } else {
                    Value::FrozenSet(set)
                }
            }
            Kind::Dict => {
                let mut map: BTreeMap<HashableValue, Value> = BTreeMap::new();
                let mut items = open.out.into_iter();
                while let (Some(k), Some(v)) = (items.next(), items.next()) {
                    map.insert(hashable(k)?, v);
                }
                Value::Dict(map)
            }
        })
    }

    fn build(mut self, root: Slot) -> Result<Value, PickleError> {
        let shared = self.shared(&root);
        let mut path: Vec<Open> = Vec::new();
        if let Some(v) = self.enter(&root, 0, &mut path)? {
            return Ok(v);
        }
        loop {
            let Some(top) = path.last_mut() else {
                return Err(PickleError {
                    offset: 0,
                    message: "internal error: empty build path".into(),
                });
            };
            let arena = self.arena;
            let node = &arena.nodes[top.id as usize];
            if let Some(slot) = node.items.get(top.next) {
                top.next += 1;
                if let Some(v) = self.enter(slot, node.offset, &mut path)? {
                    if let Some(top) = path.last_mut() {
                        top.out.push(v);
                    }
                }
                continue;
            }
            let Some(open) = path.pop() else { continue };
            let id = open.id;
            let cost = Cost {
                values: self.used.values - open.used.values,
                text: self.used.text - open.used.text,
            };
            let value = self.finish(open)?;
            self.state[id as usize] = State::Done;
            if shared[id as usize] {
                // The kept copy is memory too: charge it, so that copies kept but never
                // used cannot outgrow the budget.
                self.charge(cost, self.node(id).offset)?;
                self.cache.insert(id, (value.clone(), cost));
            }
            match path.last_mut() {
                Some(parent) => parent.out.push(value),
                None => return Ok(value),
            }
        }
    }
}

fn value_type(v: &Value) -> &'static str {
    match v {
        Value::List(_) => "list",
        Value::Dict(_) => "dict",
        Value::Set(_) => "set",
        Value::Tuple(_) => "tuple",
        _ => "value",
    }
}

/// Whether a key holds a NaN, directly or inside tuples (frozensets were checked when they
/// were built).
fn contains_nan(key: &HashableValue) -> bool {
    let mut todo = vec![key];
    while let Some(k) = todo.pop() {
        match k {
            HashableValue::F64(f) if f.is_nan() => return true,
            HashableValue::Tuple(items) => todo.extend(items),
            _ => {}
        }
    }
    false
}
