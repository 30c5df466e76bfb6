//! Step 1 of decoding: the stack machine that runs a pickle's opcodes into an [`Arena`].
//!
//! Everything it allocates (the stack, the marks, the memo, containers and their items,
//! the tables of strings, bytes, wide integers and floats) grows through
//! [`Budget::reserve`], which charges the new capacity before the allocation happens: what
//! is charged is what is held, and a hostile input runs out of budget, never out of memory.

use super::{Arena, Kind, Node, NodeId, PickleError, Slot, MAX_MEMO};
use super::{TAG_BYTES, TAG_FLOAT, TAG_STR, TAG_WIDE_INT};
use crate::input::{Shortfall, Source};
use crate::limits::{Budget, OverBudget};
use std::collections::HashMap;

mod opcodes;

use opcodes::{long_to_i64, short, slot_type, truncate_for_message, with_article};

/// What the budget calls this step.
const STAGE: &str = "decoding";

/// Runs the pickle read from `source` into an [`Arena`], charging what it allocates to
/// `budget`, which grows with the input received ([`Budget::add_input`]).
pub(crate) fn decode_arena<S: Source>(
    source: &mut S,
    budget: Budget,
) -> Result<Arena, PickleError> {
    let start = budget.used();
    let mut machine = Machine {
        src: source,
        received: 0,
        op_at: 0,
        stack: Vec::new(),
        marks: Vec::new(),
        memo: Memo::default(),
        ranges: Ranges::new(),
        arena: Arena {
            nodes: Vec::new(),
            pool: Vec::new(),
            owned: Vec::new(),
            text: String::new(),
            strings: Vec::new(),
            blob_bytes: Vec::new(),
            blobs: Vec::new(),
            wide_ints: Vec::new(),
            floats: Vec::new(),
            root: Slot::NONE,
            budget,
            bytes: 0,
        },
    };
    let root = machine.run()?;
    // The stack, the marks, the memo and the shared ranges' index go now: only what they
    // refer to is needed from here on.
    let transient = machine.stack.capacity() * size_of::<Slot>()
        + machine.marks.capacity() * size_of::<usize>()
        + machine.memo.bytes()
        + machine.ranges.bytes();
    let mut arena = machine.arena;
    arena.budget.release(transient as u64);
    arena.root = root;
    arena.bytes = arena.budget.used().saturating_sub(start);
    Ok(arena)
}

/// The memo: Python numbers its entries 0, 1, 2, ... so they are kept in a vector indexed
/// by key ([`Slot::UNSET`] where a key was skipped); a key far past the others (possible,
/// never written by Python) goes to a map, so a single key of 4 billion does not allocate
/// 4 billion slots.
#[derive(Default)]
struct Memo {
    dense: Vec<Slot>,
    sparse: HashMap<u32, Slot>,
    len: usize,
}

/// What a sparse memo entry costs: key, slot and the map's own overhead.
const SPARSE_ENTRY_BYTES: usize = 32;

impl Memo {
    fn get(&self, key: u32) -> Option<Slot> {
        match self.dense.get(key as usize) {
            Some(slot) if !slot.is_unset() => Some(*slot),
            _ => self.sparse.get(&key).copied(),
        }
    }

    fn bytes(&self) -> usize {
        self.dense.capacity() * size_of::<Slot>() + self.sparse.len() * SPARSE_ENTRY_BYTES
    }
}

/// The item ranges of the lists and tuples built so far, by a hash of their items, so that
/// a list equal to an earlier one shares its items instead of holding a copy. PyTorch gives
/// every trace entry a `frames` list of its own, equal to the lists of every other entry
/// with the same call stack: a million entries of 20 frames are 20 million slots without
/// this, a few thousand stacks' worth with it. Sharing is safe because items in the pool
/// never change: a container only ever appends, and one whose items no longer end the
/// pool moves them to a vector of its own first.
struct Ranges {
    /// One range per hash: a list whose hash is taken by a different list is simply not
    /// shared, so hashes that collide (even on purpose) cost no time.
    by_hash: HashMap<u64, (u32, u32)>,
    /// A secret per process, so that which lists collide cannot be chosen.
    seed: u64,
}

impl Ranges {
    fn new() -> Self {
        use std::hash::BuildHasher;
        Ranges {
            by_hash: HashMap::new(),
            seed: std::hash::RandomState::new().hash_one(0x5eed_u64) | 1,
        }
    }

    /// A quick hash of `items` (a few cycles a slot; the map hashes the result again).
    fn hash(&self, items: &[Slot]) -> u64 {
        items.iter().fold(self.seed, |h, s| {
            (h.rotate_left(23) ^ s.0).wrapping_mul(0x9e37_79b9_7f4a_7c15)
        })
    }
}

/// What an entry of [`Ranges`] costs: hash, range and the map's own overhead.
const RANGE_ENTRY_BYTES: usize = 24;
/// Longer lists are not looked up (the trace itself, its segments): they rarely repeat.
const SHARED_RANGE_MAX: usize = 1024;

impl Ranges {
    fn bytes(&self) -> usize {
        self.by_hash.capacity() * RANGE_ENTRY_BYTES
    }
}

struct Machine<'s, S: Source> {
    src: &'s mut S,
    /// Input bytes the budget has grown by so far.
    received: usize,
    /// Offset of the opcode being executed.
    op_at: usize,
    stack: Vec<Slot>,
    /// Stack lengths at each open `MARK`.
    marks: Vec<usize>,
    memo: Memo,
    ranges: Ranges,
    arena: Arena,
}

impl<S: Source> Machine<'_, S> {
    fn err(&self, message: impl Into<String>) -> PickleError {
        PickleError {
            over_budget: false,
            offset: self.op_at,
            message: message.into(),
        }
    }

    fn over(&self, over: OverBudget) -> PickleError {
        PickleError {
            over_budget: true,
            ..self.err(over.to_string())
        }
    }

    fn array<const N: usize>(&mut self, what: &str) -> Result<[u8; N], PickleError> {
        let op_at = self.op_at;
        let bytes = self.src.take(N).map_err(|e| short(op_at, what, N, e))?;
        let mut out = [0; N];
        out.copy_from_slice(bytes);
        Ok(out)
    }

    fn u8(&mut self, what: &str) -> Result<u8, PickleError> {
        Ok(self.array::<1>(what)?[0])
    }

    fn u32(&mut self, what: &str) -> Result<u32, PickleError> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }

    /// A length read as `u64`.
    fn len8(&mut self, what: &str) -> Result<usize, PickleError> {
        let n = u64::from_le_bytes(self.array(what)?);
        usize::try_from(n).map_err(|_| {
            self.err(format!(
                "truncated: {what} needs {n} more bytes, more than any input holds"
            ))
        })
    }

    /// A text argument of the protocol-0 opcodes: up to the next newline.
    fn line(&mut self, what: &str) -> Result<String, PickleError> {
        let op_at = self.op_at;
        let bytes = self.src.take_line().map_err(|e| match e {
            Shortfall::Ended { .. } => PickleError {
                over_budget: false,
                offset: op_at,
                message: format!("truncated: {what} argument has no newline"),
            },
            Shortfall::Failed => short(op_at, what, 0, e),
        })?;
        std::str::from_utf8(bytes)
            .map(str::to_owned)
            .map_err(|_| self.err(format!("{what} argument is not ASCII")))
    }

    fn int_line(&mut self, what: &str) -> Result<i64, PickleError> {
        let line = self.line(what)?;
        let line = line.trim();
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

    fn underflow(&self, what: &str) -> PickleError {
        self.err(format!("{what} on an empty stack (stack underflow)"))
    }

    /// Makes room for `n` more items in one of the machine's vectors, charged.
    fn reserve<T>(budget: &mut Budget, v: &mut Vec<T>, n: usize) -> Result<(), OverBudget> {
        budget.reserve(STAGE, v, n)
    }

    fn push(&mut self, slot: Slot) -> Result<(), PickleError> {
        if self.stack.len() == self.stack.capacity() {
            Self::reserve(&mut self.arena.budget, &mut self.stack, 1).map_err(|o| self.over(o))?;
        }
        self.stack.push(slot);
        Ok(())
    }

    fn pop(&mut self, what: &str) -> Result<Slot, PickleError> {
        if self.stack.len() <= self.base() {
            return Err(self.underflow(what));
        }
        self.stack.pop().ok_or_else(|| self.underflow(what))
    }

    fn top(&self, what: &str) -> Result<Slot, PickleError> {
        if self.stack.len() <= self.base() {
            return Err(self.underflow(what));
        }
        self.stack
            .last()
            .copied()
            .ok_or_else(|| self.underflow(what))
    }

    /// Closes the last `MARK`: the stack length it was set at.
    fn pop_mark(&mut self, what: &str) -> Result<usize, PickleError> {
        let Some(mark) = self.marks.pop() else {
            return Err(self.err(format!("{what} without a MARK")));
        };
        Ok(mark.min(self.stack.len()))
    }

    fn new_node(&mut self, kind: Kind) -> Result<NodeId, PickleError> {
        let id = NodeId::try_from(self.arena.nodes.len())
            .ok()
            .filter(|&id| id < NodeId::MAX)
            .ok_or_else(|| self.err(format!("more than {} containers", NodeId::MAX)))?;
        Self::reserve(&mut self.arena.budget, &mut self.arena.nodes, 1)
            .map_err(|o| self.over(o))?;
        self.arena.nodes.push(Node::new(kind, self.op_at));
        Ok(id)
    }

    /// Moves the stack's items from `from` on into container `id`, after its items.
    fn move_items(&mut self, id: NodeId, from: usize) -> Result<(), PickleError> {
        let n = self.stack.len() - from;
        if n == 0 {
            return Ok(());
        }
        let op_at = self.op_at;
        let fail = |message: String| PickleError {
            over_budget: false,
            offset: op_at,
            message,
        };
        let over = |o: OverBudget| PickleError {
            over_budget: true,
            ..fail(o.to_string())
        };
        let too_many = || fail(format!("a container of more than {} items", u32::MAX));
        let items = &self.stack[from..];
        let arena = &mut self.arena;
        let node = arena.nodes[id as usize];
        let len = (node.len as usize)
            .checked_add(n)
            .filter(|&l| l <= u32::MAX as usize)
            .ok_or_else(too_many)?;
        let (start, end) = (node.start as usize, node.start as usize + node.len as usize);
        if node.owned() {
            let v = &mut arena.owned[start];
            arena.budget.reserve(STAGE, v, n).map_err(over)?;
            v.extend_from_slice(items);
        } else if node.len == 0
            && matches!(node.kind(), Kind::List | Kind::Tuple)
            && (2..=SHARED_RANGE_MAX).contains(&n)
        {
            // A new list or tuple: the items of an equal one if there is one, else its own
            // at the end of the pool, remembered for the next equal one.
            let hash = self.ranges.hash(items);
            let found = self
                .ranges
                .by_hash
                .get(&hash)
                .copied()
                .filter(|&(s, l)| arena.pool[s as usize..s as usize + l as usize] == *items);
            let start = match found {
                Some((s, _)) => s,
                None => {
                    let s = u32::try_from(arena.pool.len()).map_err(|_| too_many())?;
                    arena
                        .budget
                        .reserve(STAGE, &mut arena.pool, n)
                        .map_err(over)?;
                    arena.pool.extend_from_slice(items);
                    let map = &mut self.ranges.by_hash;
                    if map.len() == map.capacity() {
                        let more = map.capacity().max(64);
                        arena
                            .budget
                            .charge_for(STAGE, (more * RANGE_ENTRY_BYTES) as u64)
                            .map_err(over)?;
                        map.reserve(more);
                    }
                    map.entry(hash).or_insert((s, n as u32));
                    s
                }
            };
            arena.nodes[id as usize].start = start;
        } else if node.len == 0 || end == arena.pool.len() {
            // The usual case: a container's items follow the items of the containers built
            // inside it, at the end of the pool.
            let start = if node.len == 0 {
                arena.pool.len()
            } else {
                start
            };
            let start = u32::try_from(start).map_err(|_| too_many())?;
            arena
                .budget
                .reserve(STAGE, &mut arena.pool, n)
                .map_err(over)?;
            arena.pool.extend_from_slice(items);
            arena.nodes[id as usize].start = start;
        } else {
            // It grows after others were built: its items move to a vector of their own
            // (once), leaving their old place in the pool unused (and still charged).
            let index = u32::try_from(arena.owned.len()).map_err(|_| too_many())?;
            let mut v = Vec::new();
            arena.budget.reserve(STAGE, &mut v, len).map_err(over)?;
            arena
                .budget
                .reserve(STAGE, &mut arena.owned, 1)
                .map_err(over)?;
            v.extend_from_slice(&arena.pool[start..end]);
            v.extend_from_slice(items);
            arena.owned.push(v);
            let node = &mut arena.nodes[id as usize];
            node.meta |= super::OWNED;
            node.start = index;
        }
        arena.nodes[id as usize].len = len as u32;
        self.stack.truncate(from);
        Ok(())
    }

    /// A new container of `kind` holding the stack's items from `from` on, pushed in their
    /// place.
    fn build(&mut self, kind: Kind, from: usize) -> Result<(), PickleError> {
        let id = self.new_node(kind)?;
        self.move_items(id, from)?;
        self.push(Slot::node(id))
    }

    /// The container at stack index `at`, which `what` adds items to; it must be `kind`.
    fn target(&self, at: usize, kind: Kind, what: &str) -> Result<NodeId, PickleError> {
        let slot = self.stack[at];
        let Some(id) = slot.as_node() else {
            return Err(self.err(format!(
                "{what} into {}, expected a {}",
                with_article(slot_type(slot)),
                kind.name()
            )));
        };
        let found = self.arena.nodes[id as usize].kind();
        if found != kind {
            return Err(self.err(format!(
                "{what} into {}, expected a {}",
                with_article(found.name()),
                kind.name()
            )));
        }
        Ok(id)
    }

    /// `APPEND`, `SETITEM`: the `n` items on top go into the container below them.
    fn add_top(&mut self, n: usize, kind: Kind, what: &str) -> Result<(), PickleError> {
        if self.stack.len() < self.base() + n + 1 {
            return Err(self.underflow(what));
        }
        let from = self.stack.len() - n;
        let id = self.target(from - 1, kind, what)?;
        self.move_items(id, from)
    }

    /// `APPENDS`, `SETITEMS`, `ADDITEMS`: the items since the last `MARK` go into the
    /// container below it.
    fn add_marked(&mut self, kind: Kind, what: &str) -> Result<(), PickleError> {
        let from = self.pop_mark(what)?;
        if kind == Kind::Dict && !(self.stack.len() - from).is_multiple_of(2) {
            return Err(self.err("SETITEMS with an odd number of items"));
        }
        if from == 0 || from <= self.base() {
            return Err(self.underflow(what));
        }
        let id = self.target(from - 1, kind, what)?;
        self.move_items(id, from)
    }

    fn memo_put(&mut self, key: u32, what: &str) -> Result<(), PickleError> {
        let value = self.top(what)?;
        let new = self.memo.get(key).is_none();
        if new && self.memo.len >= MAX_MEMO {
            return Err(self.err(format!("memo holds more than {MAX_MEMO} entries")));
        }
        let op_at = self.op_at;
        let over = |o: OverBudget| PickleError {
            over_budget: true,
            offset: op_at,
            message: o.to_string(),
        };
        let (memo, budget) = (&mut self.memo, &mut self.arena.budget);
        let k = key as usize;
        if k < memo.dense.len().saturating_add(1024) {
            // Dense keys, and small gaps in them, live in the vector.
            if k >= memo.dense.len() {
                let grow = k + 1 - memo.dense.len();
                budget.reserve(STAGE, &mut memo.dense, grow).map_err(over)?;
                memo.dense.resize(k + 1, Slot::UNSET);
            }
            memo.dense[k] = value;
            if memo.sparse.remove(&key).is_some() {
                budget.release(SPARSE_ENTRY_BYTES as u64);
            }
        } else {
            match memo.sparse.entry(key) {
                std::collections::hash_map::Entry::Occupied(mut e) => {
                    e.insert(value);
                }
                std::collections::hash_map::Entry::Vacant(e) => {
                    budget.charge(SPARSE_ENTRY_BYTES as u64).map_err(over)?;
                    e.insert(value);
                }
            }
        }
        if new {
            self.memo.len += 1;
        }
        Ok(())
    }

    fn memo_get(&mut self, key: u32) -> Result<(), PickleError> {
        let value = self
            .memo
            .get(key)
            .ok_or_else(|| self.err(format!("memo key {key} is not defined")))?;
        self.push(value)
    }

    fn string(&mut self, n: usize, what: &str) -> Result<(), PickleError> {
        let op_at = self.op_at;
        let over = |o: OverBudget| PickleError {
            over_budget: true,
            offset: op_at,
            message: o.to_string(),
        };
        // The bytes first: a length past the end of the input is a truncation, not a
        // string too large for the budget.
        let bytes = self.src.take(n).map_err(|e| short(op_at, what, n, e))?;
        let s = std::str::from_utf8(bytes).map_err(|e| PickleError {
            over_budget: false,
            offset: op_at,
            message: format!("{what}: invalid UTF-8 ({e})"),
        })?;
        let arena = &mut self.arena;
        if arena.text.capacity() - arena.text.len() < n {
            let more = n.max(arena.text.capacity() / 2).max(256);
            let charged = arena.budget.charge_for(STAGE, more as u64);
            charged.map_err(over)?;
            arena.text.reserve_exact(more);
        }
        let charged = arena.budget.reserve(STAGE, &mut arena.strings, 1);
        charged.map_err(over)?;
        let id = arena.strings.len();
        let start = arena.text.len();
        arena.text.push_str(s);
        arena.strings.push((start, arena.text.len()));
        self.push(Slot::index(TAG_STR, id))
    }

    fn bytes(&mut self, n: usize, what: &str) -> Result<(), PickleError> {
        let op_at = self.op_at;
        let over = |o: OverBudget| PickleError {
            over_budget: true,
            offset: op_at,
            message: o.to_string(),
        };
        let bytes = self.src.take(n).map_err(|e| short(op_at, what, n, e))?;
        let arena = &mut self.arena;
        let charged = arena.budget.reserve(STAGE, &mut arena.blob_bytes, n);
        charged.map_err(over)?;
        let charged = arena.budget.reserve(STAGE, &mut arena.blobs, 1);
        charged.map_err(over)?;
        let id = arena.blobs.len();
        let start = arena.blob_bytes.len();
        arena.blob_bytes.extend_from_slice(bytes);
        arena.blobs.push((start, arena.blob_bytes.len()));
        self.push(Slot::index(TAG_BYTES, id))
    }

    fn int(&mut self, v: i64) -> Result<(), PickleError> {
        if let Some(slot) = Slot::small_int(v) {
            return self.push(slot);
        }
        let id = self.arena.wide_ints.len();
        Self::reserve(&mut self.arena.budget, &mut self.arena.wide_ints, 1)
            .map_err(|o| self.over(o))?;
        self.arena.wide_ints.push(v);
        self.push(Slot::index(TAG_WIDE_INT, id))
    }

    fn float(&mut self, v: f64) -> Result<(), PickleError> {
        let id = self.arena.floats.len();
        Self::reserve(&mut self.arena.budget, &mut self.arena.floats, 1)
            .map_err(|o| self.over(o))?;
        self.arena.floats.push(v);
        self.push(Slot::index(TAG_FLOAT, id))
    }

    fn long(&mut self, n: usize, what: &str) -> Result<(), PickleError> {
        let op_at = self.op_at;
        let bytes = self.src.take(n).map_err(|e| short(op_at, what, n, e))?;
        match long_to_i64(bytes) {
            Some(v) => self.int(v),
            None => Err(self.err(format!(
                "{what}: integer of {n} bytes does not fit in 64 bits (the limit of this reader)"
            ))),
        }
    }

    fn tuple(&mut self, n: usize, what: &str) -> Result<(), PickleError> {
        if self.stack.len() < self.base() + n {
            return Err(self.err(format!("{what} on a stack of fewer than {n} items")));
        }
        self.build(Kind::Tuple, self.stack.len() - n)
    }
}
