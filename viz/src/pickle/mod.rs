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
//! - every byte it allocates is charged to a [`Budget`] proportional to the input before
//!   it is allocated, at its real size, so a "billion laughs" of memo references fails
//!   fast instead of exhausting memory, while a file that merely shares a lot (a million
//!   trace entries referring to a few thousand frames) costs what it holds.
//!
//! Decoding runs in two steps. The first ([`machine`]) executes the opcodes into an
//! [`Arena`]: a value is an 8-byte [`Slot`] (small integers inline), containers are arena
//! nodes whose items lie in one shared pool (equal lists share theirs), and stack slots and the memo refer to nodes by index, mutable exactly as in
//! Python. A memo reference therefore costs one slot, however large what it refers to.
//! Readers walk the arena directly ([`crate::pytorch`]). The second step ([`tree`]), for
//! [`decode`], builds the [`serde_pickle::Value`] tree from the arena with an explicit
//! stack, copying shared containers, checking nesting depth and output size, and
//! detecting cycles.
//!
//! Integers wider than 64 bits are refused (nothing in a snapshot needs them), as are
//! protocol-0 text strings (`STRING`, `UNICODE`), which Python 3 never writes at protocol 2
//! or later.

mod machine;
mod tree;

use crate::input::SliceSource;
use crate::limits::Budget;
use serde_pickle::Value;
use std::fmt;

pub(crate) use machine::decode_arena;

/// Deepest nesting of containers accepted (the top-level object counts as one), and the
/// most `MARK`s open at once. Snapshots nest about six deep; the cap keeps the recursive
/// code that consumes the tree (comparison, conversion, drop) far from the thread's stack
/// limit.
pub const MAX_DEPTH: usize = 512;

/// Most memo entries. Each costs at least one input byte anyway; this caps the memo of a
/// huge input at a size a real snapshot never reaches (about 3 entries per trace entry).
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
    /// The input is readable but would build more than its budget.
    pub(crate) over_budget: bool,
}

impl PickleError {
    /// Whether decoding stopped because the input would build more than its memory budget
    /// ([`crate::limits::Budget`]), rather than because it is not a readable pickle.
    pub fn is_over_budget(&self) -> bool {
        self.over_budget
    }
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
    let arena = decode_arena(&mut SliceSource::new(bytes), Budget::for_input(0))?;
    tree::build(&arena)
}

// ---- The arena ----

/// Index of a container in the arena.
pub(crate) type NodeId = u32;

/// A stack, memo or container slot, in 8 bytes: the low three bits say what it is, the
/// other 61 hold the value (integers of up to 61 bits) or an index into the arena's tables
/// (wider integers, floats, strings, bytes, containers). Containers of a snapshot hold
/// tens of millions of slots, so their size is most of a reader's memory.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct Slot(u64);

const TAG_SPECIAL: u64 = 0;
const TAG_INT: u64 = 1;
const TAG_WIDE_INT: u64 = 2;
const TAG_FLOAT: u64 = 3;
const TAG_STR: u64 = 4;
const TAG_BYTES: u64 = 5;
const TAG_NODE: u64 = 6;

/// Payloads of [`TAG_SPECIAL`].
const NONE: u64 = 0;
const FALSE: u64 = 1;
const TRUE: u64 = 2;
/// A memo key that was never set (memo vectors only).
const UNSET: u64 = 3;

impl Slot {
    pub(crate) const NONE: Slot = Slot(NONE << 3 | TAG_SPECIAL);
    pub(crate) const UNSET: Slot = Slot(UNSET << 3 | TAG_SPECIAL);

    fn tag(self) -> u64 {
        self.0 & 7
    }

    fn payload(self) -> u64 {
        self.0 >> 3
    }

    fn index(tag: u64, i: usize) -> Slot {
        Slot((i as u64) << 3 | tag)
    }

    pub(crate) fn bool(b: bool) -> Slot {
        Slot((if b { TRUE } else { FALSE }) << 3 | TAG_SPECIAL)
    }

    /// An integer that fits in 61 bits, else `None` (it goes to the arena's table).
    fn small_int(v: i64) -> Option<Slot> {
        let packed = v.wrapping_shl(3);
        (packed >> 3 == v).then_some(Slot(packed as u64 | TAG_INT))
    }

    pub(crate) fn node(id: NodeId) -> Slot {
        Slot::index(TAG_NODE, id as usize)
    }

    /// The container this slot refers to, if it is one.
    pub(crate) fn as_node(self) -> Option<NodeId> {
        (self.tag() == TAG_NODE).then_some(self.payload() as NodeId)
    }

    pub(crate) fn is_unset(self) -> bool {
        self == Slot::UNSET
    }
}

impl fmt::Debug for Slot {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Slot(tag {}, {})", self.tag(), self.payload())
    }
}

/// What kind of container a node is.
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
    pub(crate) fn name(self) -> &'static str {
        match self {
            Kind::List => "list",
            Kind::Tuple => "tuple",
            Kind::Dict => "dict",
            Kind::Set => "set",
            Kind::FrozenSet => "frozenset",
        }
    }

    fn code(self) -> u64 {
        self as u64
    }

    fn from_code(code: u64) -> Kind {
        match code {
            0 => Kind::List,
            1 => Kind::Tuple,
            2 => Kind::Dict,
            3 => Kind::Set,
            _ => Kind::FrozenSet,
        }
    }
}

/// A container: its items are `len` slots of the arena's pool from `start`, or, for one
/// that grew after others were built (lists of more than 1,000 items, which Python appends
/// in batches), a vector of its own.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Node {
    /// Byte offset of the opcode that created it (high bits), whether its items are a
    /// vector of its own (bit 3) and its kind (low 3 bits).
    meta: u64,
    /// Index of its first item in the pool, or of its vector in the arena's `owned`.
    start: u32,
    len: u32,
}

const OWNED: u64 = 1 << 3;

impl Node {
    fn new(kind: Kind, offset: usize) -> Node {
        Node {
            meta: (offset as u64) << 4 | kind.code(),
            start: 0,
            len: 0,
        }
    }

    pub(crate) fn kind(&self) -> Kind {
        Kind::from_code(self.meta & 7)
    }

    /// Byte offset of the opcode that created it, for errors found later.
    pub(crate) fn offset(&self) -> usize {
        (self.meta >> 4) as usize
    }

    fn owned(&self) -> bool {
        self.meta & OWNED != 0
    }
}

/// A slot as a reader sees it.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Item<'a> {
    None,
    Bool(bool),
    Int(i64),
    Float(f64),
    Str(&'a str),
    Bytes(&'a [u8]),
    Container(Kind, &'a [Slot]),
}

/// What the stack machine built: every container once however often the pickle refers
/// to it, every string and byte string once, and the top-level object. Readers walk it directly, so sharing in the file stays sharing in
/// memory.
#[derive(Debug)]
pub(crate) struct Arena {
    pub(crate) nodes: Vec<Node>,
    /// Items of the containers that are not `owned`.
    pool: Vec<Slot>,
    owned: Vec<Vec<Slot>>,
    /// Every string, back to back; `strings` holds each one's range.
    text: String,
    strings: Vec<(usize, usize)>,
    /// Every byte string, back to back; `blobs` holds each one's range.
    blob_bytes: Vec<u8>,
    blobs: Vec<(usize, usize)>,
    wide_ints: Vec<i64>,
    floats: Vec<f64>,
    pub(crate) root: Slot,
    /// The budget the arena was built within: what it holds is charged to it.
    pub(crate) budget: Budget,
    /// Bytes of `budget` the arena's own tables take (given back when it is dropped by a
    /// reader that keeps the budget going).
    pub(crate) bytes: u64,
}

impl Arena {
    /// The items of container `id`.
    pub(crate) fn items(&self, id: NodeId) -> &[Slot] {
        let node = &self.nodes[id as usize];
        if node.owned() {
            &self.owned[node.start as usize]
        } else {
            &self.pool[node.start as usize..(node.start as usize + node.len as usize)]
        }
    }

    /// Where container `id`'s items lie, for a container whose items are shared with
    /// every equal list or tuple ([`machine`]): two containers with the same key hold
    /// the same items. `None` for a container with items of its own.
    pub(crate) fn items_key(&self, id: NodeId) -> Option<u64> {
        let node = &self.nodes[id as usize];
        (!node.owned()).then_some(u64::from(node.start) << 32 | u64::from(node.len))
    }

    /// What `slot` holds.
    pub(crate) fn item(&self, slot: Slot) -> Item<'_> {
        let i = slot.payload() as usize;
        match slot.tag() {
            TAG_INT => Item::Int(slot.0 as i64 >> 3),
            TAG_WIDE_INT => Item::Int(self.wide_ints[i]),
            TAG_FLOAT => Item::Float(self.floats[i]),
            TAG_STR => Item::Str(self.string(i)),
            TAG_BYTES => {
                let (start, end) = self.blobs[i];
                Item::Bytes(&self.blob_bytes[start..end])
            }
            TAG_NODE => Item::Container(self.nodes[i].kind(), self.items(i as NodeId)),
            _ => match slot.payload() {
                FALSE => Item::Bool(false),
                TRUE => Item::Bool(true),
                _ => Item::None,
            },
        }
    }

    /// The string `slot` holds, if it is one; its index, so that readers can remember what
    /// they made of a string they meet again (a dict key, an action name).
    pub(crate) fn str_id(&self, slot: Slot) -> Option<(u32, &str)> {
        (slot.tag() == TAG_STR).then(|| {
            let i = slot.payload() as usize;
            (i as u32, self.string(i))
        })
    }

    fn string(&self, i: usize) -> &str {
        let (start, end) = self.strings[i];
        &self.text[start..end]
    }

    /// Number of distinct strings.
    pub(crate) fn string_count(&self) -> usize {
        self.strings.len()
    }
}
