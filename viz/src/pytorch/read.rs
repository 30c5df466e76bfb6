//! Reading PyTorch snapshots: typed records straight from the pickle decoder's arena.
//!
//! The records are read key by key, every key and value checked, so a truncated, corrupt,
//! hostile or foreign file gives one [`VizError`] naming the file and the offending key.
//! What the arena shares stays shared: a frame dict or a `frames` list the pickle refers
//! to many times is read once (remembered by its container), equal frames and stacks are
//! kept once ([`Stacks`]), and what a dict key or an action name means is worked out once
//! per distinct string. Everything built is charged to the input's [`Budget`]; what only
//! reading needs (the arena, the maps above) is given back when reading ends, so the
//! budget the snapshot keeps counts what it holds.

use super::{BlockState, TraceAction};
use crate::error::VizError;
use crate::input::Source;
use crate::limits::{Budget, OverBudget};
use crate::model::{Block, Frame, Segment, Stacks};
use crate::pickle::{Arena, Item, Kind, Slot};
use std::collections::HashMap;
use std::path::Path;

/// A trace entry as read, its stack an index into [`Records::stacks`].
pub(super) struct RawEntry {
    pub(super) action: TraceAction,
    pub(super) addr: u64,
    pub(super) size: u64,
    pub(super) stream: u64,
    pub(super) time_us: Option<u64>,
    pub(super) stack: Option<u32>,
    pub(super) device_free: Option<u64>,
}

pub(super) struct RawBlock {
    pub(super) address: u64,
    pub(super) size: u64,
    pub(super) requested_size: u64,
    pub(super) state: BlockState,
    pub(super) stack: Option<u32>,
}

pub(super) struct RawSegment {
    pub(super) device: u32,
    pub(super) address: u64,
    pub(super) total_size: u64,
    pub(super) stream: u64,
    pub(super) segment_type: String,
    pub(super) is_expandable: bool,
    pub(super) blocks: Vec<RawBlock>,
}

/// What a snapshot holds besides its trace entries, which [`read_records`] hands over one
/// at a time.
pub(super) struct Records {
    pub(super) segments: Vec<RawSegment>,
    /// Length of `device_traces`.
    pub(super) device_traces: usize,
    pub(super) stacks: Stacks,
    pub(super) settings: Option<serde_json::Value>,
    /// The input's budget, charged with what the records hold (the arena and the reader's
    /// maps given back).
    pub(super) budget: Budget,
}

mod records;

/// In-memory bytes of what the readers build per record, charged to the budget.
const BLOCK_BYTES: u64 = std::mem::size_of::<Block>() as u64;
const SEGMENT_BYTES: u64 = std::mem::size_of::<Segment>() as u64;
const FRAME_BYTES: u64 = std::mem::size_of::<Frame>() as u64 + 64;
const JSON_BYTES: u64 = std::mem::size_of::<serde_json::Value>() as u64 + 16;

/// What the budget calls reading the records.
const STAGE: &str = "reading the snapshot";

/// Where [`read_records`] puts trace entries as it reads them.
pub(super) trait Sink {
    /// Device `d`'s trace holds `entries` entries: room for them, charged to `budget`.
    fn device(&mut self, d: usize, entries: usize, budget: &mut Budget) -> Result<(), OverBudget>;
    /// Entry `i` of device `d`'s trace.
    fn entry(&mut self, d: usize, i: usize, entry: RawEntry);
}

/// Decodes the pickle read from `source` and reads its records: segments and stacks into
/// the result, each trace entry into `sink` as it is read. The source must start with the
/// pickle's `PROTO` opcode (the caller has sniffed it). A source that fails gives the error
/// "the input could not be read": the caller replaces it with the source's own.
pub(super) fn read_records<S: Source>(
    path: &Path,
    source: &mut S,
    sink: &mut dyn Sink,
) -> Result<Records, VizError> {
    let mut arena = crate::pickle::decode_arena(source, Budget::for_input(0)).map_err(|e| {
        if e.is_over_budget() {
            VizError::Limit {
                path: path.into(),
                what: e.to_string(),
            }
        } else {
            VizError::Pickle {
                path: path.into(),
                message: e.to_string(),
            }
        }
    })?;
    let budget = std::mem::take(&mut arena.budget);
    let mut reader = Reader {
        path,
        arena: &arena,
        budget,
        transient: 0,
        stacks: Stacks::default(),
        stack_of_node: Vec::new(),
        frame_of_node: Vec::new(),
        stack_of_items: HashMap::new(),
        stack_of_frames: HashMap::new(),
        keys: Vec::new(),
        actions: HashMap::new(),
    };
    let records = reader.snapshot(sink)?;
    let mut budget = reader.budget;
    budget.release(arena.bytes.saturating_add(reader.transient));
    Ok(Records { budget, ..records })
}

/// The keys the reader knows, by what they name.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
enum Key {
    /// Not yet looked at.
    Unknown,
    Other,
    Segments,
    DeviceTraces,
    AllocatorSettings,
    Action,
    Addr,
    Size,
    Stream,
    TimeUs,
    Frames,
    DeviceFree,
    Name,
    Filename,
    Line,
    Device,
    Address,
    TotalSize,
    SegmentType,
    IsExpandable,
    Blocks,
    RequestedSize,
    State,
}

impl Key {
    fn of(name: &str) -> Key {
        match name {
            "segments" => Key::Segments,
            "device_traces" => Key::DeviceTraces,
            "allocator_settings" => Key::AllocatorSettings,
            "action" => Key::Action,
            "addr" => Key::Addr,
            "size" => Key::Size,
            "stream" => Key::Stream,
            "time_us" => Key::TimeUs,
            "frames" => Key::Frames,
            "device_free" => Key::DeviceFree,
            "name" => Key::Name,
            "filename" => Key::Filename,
            "line" => Key::Line,
            "device" => Key::Device,
            "address" => Key::Address,
            "total_size" => Key::TotalSize,
            "segment_type" => Key::SegmentType,
            "is_expandable" => Key::IsExpandable,
            "blocks" => Key::Blocks,
            "requested_size" => Key::RequestedSize,
            "state" => Key::State,
            _ => Key::Other,
        }
    }
}

/// A container not yet read, in the reader's per-container maps.
const NOT_READ: u32 = u32::MAX;
/// A `frames` list that was empty.
const NO_STACK: u32 = u32::MAX - 1;

/// Reads typed records from the arena, checking every key it uses.
struct Reader<'b> {
    /// The file, for error messages.
    path: &'b Path,
    arena: &'b Arena,
    budget: Budget,
    /// Bytes of `budget` taken by what only reading needs (the maps below).
    transient: u64,
    stacks: Stacks,
    /// The stack read from each `frames` list, by the list's container ([`NOT_READ`]
    /// until read, [`NO_STACK`] for an empty one).
    stack_of_node: Vec<u32>,
    /// The frame read from each frame dict, by its container.
    frame_of_node: Vec<u32>,
    /// The stack read from each `frames` list's items, by where they lie in the arena:
    /// PyTorch gives every entry a list of its own, equal lists share their items.
    stack_of_items: HashMap<u64, u32>,
    /// Each distinct stack, by its frame indices.
    stack_of_frames: HashMap<Box<[u32]>, u32>,
    /// What each string means as a dict key.
    keys: Vec<Key>,
    /// The action each string names, once looked up.
    actions: HashMap<u32, TraceAction>,
}

/// The name of a pickle value's type, for error messages.
fn type_name(v: &Item<'_>) -> &'static str {
    match v {
        Item::None => "None",
        Item::Bool(_) => "bool",
        Item::Int(_) => "int",
        Item::Float(_) => "float",
        Item::Bytes(_) => "bytes",
        Item::Str(_) => "str",
        Item::Container(Kind::List, ..) => "list",
        Item::Container(Kind::Tuple, ..) => "tuple",
        Item::Container(Kind::Set | Kind::FrozenSet, ..) => "set",
        Item::Container(Kind::Dict, ..) => "dict",
    }
}

type At<'c> = &'c dyn Fn() -> String;

impl<'b> Reader<'b> {
    fn err(&self, what: String) -> VizError {
        VizError::format(self.path, what)
    }

    fn over(&self, over: OverBudget) -> VizError {
        VizError::Limit {
            path: self.path.into(),
            what: over.to_string(),
        }
    }

    fn charge(&mut self, bytes: u64) -> Result<(), VizError> {
        self.budget
            .charge_for(STAGE, bytes)
            .map_err(|o| self.over(o))
    }

    /// Charges `bytes` that only reading needs.
    fn charge_transient(&mut self, bytes: u64) -> Result<(), VizError> {
        self.charge(bytes)?;
        self.transient += bytes;
        Ok(())
    }

    fn item(&self, slot: Slot) -> Item<'b> {
        let arena: &'b Arena = self.arena;
        arena.item(slot)
    }

    /// The items of a dict whose keys are all strings, as (key, value) pairs; a key set
    /// twice keeps its last value when the caller reads the pairs in order, as in Python.
    fn dict(&self, slot: Slot, at: At<'_>) -> Result<&'b [Slot], VizError> {
        match self.item(slot) {
            Item::Container(Kind::Dict, items) => Ok(items),
            other => Err(self.err(format!(
                "{}: expected a dict, found {}",
                at(),
                type_name(&other)
            ))),
        }
    }

    /// What the dict key `slot` names.
    fn key(&mut self, slot: Slot, at: At<'_>) -> Result<Key, VizError> {
        let Some((id, name)) = self.arena.str_id(slot) else {
            return Err(self.err(format!(
                "{}: dict key of type {} is not a string",
                at(),
                type_name(&self.item(slot))
            )));
        };
        if self.keys.is_empty() {
            let n = self.arena.string_count();
            self.charge_transient(n as u64)?;
            self.keys = vec![Key::Unknown; n];
        }
        let key = &mut self.keys[id as usize];
        if *key == Key::Unknown {
            *key = Key::of(name);
        }
        Ok(*key)
    }

    fn list(&self, slot: Slot, at: At<'_>) -> Result<&'b [Slot], VizError> {
        match self.item(slot) {
            Item::Container(Kind::List | Kind::Tuple, items) => Ok(items),
            other => Err(self.err(format!(
                "{}: expected a list, found {}",
                at(),
                type_name(&other)
            ))),
        }
    }

    fn int(&self, slot: Slot, at: At<'_>) -> Result<i64, VizError> {
        match self.item(slot) {
            Item::Int(i) => Ok(i),
            Item::Bool(b) => Ok(i64::from(b)),
            other => Err(self.err(format!(
                "{}: expected an int, found {}",
                at(),
                type_name(&other)
            ))),
        }
    }

    fn uint(&self, slot: Slot, at: At<'_>) -> Result<u64, VizError> {
        let i = self.int(slot, at)?;
        u64::try_from(i).map_err(|_| self.err(format!("{}: negative value {i}", at())))
    }

    /// Stream handles are pointers: keep their bit pattern even if printed negative.
    fn stream(&self, slot: Slot, at: At<'_>) -> Result<u64, VizError> {
        Ok(self.int(slot, at)? as u64)
    }

    fn string(&self, slot: Slot, at: At<'_>) -> Result<&'b str, VizError> {
        match self.item(slot) {
            Item::Str(s) => Ok(s),
            other => Err(self.err(format!(
                "{}: expected a str, found {}",
                at(),
                type_name(&other)
            ))),
        }
    }

    /// The action `slot` names.
    fn action(&mut self, slot: Slot, at: At<'_>) -> Result<TraceAction, VizError> {
        let Some((id, name)) = self.arena.str_id(slot) else {
            return Err(self.err(format!(
                "{}: expected a str, found {}",
                at(),
                type_name(&self.item(slot))
            )));
        };
        if let Some(&action) = self.actions.get(&id) {
            return Ok(action);
        }
        let action = TraceAction::from_pytorch_name(name)
            .ok_or_else(|| self.err(format!("{}: unknown action {name:?}", at())))?;
        self.charge_transient(16)?;
        self.actions.insert(id, action);
        Ok(action)
    }

    /// A per-container map of the reader, allocated (and charged) on first use.
    fn node_map(&mut self, which: fn(&mut Self) -> &mut Vec<u32>) -> Result<(), VizError> {
        if which(self).is_empty() {
            let n = self.arena.nodes.len();
            self.charge_transient(4 * n as u64)?;
            *which(self) = vec![NOT_READ; n];
        }
        Ok(())
    }

    /// The stack a `frames` list names, `None` when empty. A list the pickle shares is read
    /// once; equal stacks get one index.
    fn frames(&mut self, slot: Slot, at: At<'_>) -> Result<Option<u32>, VizError> {
        let node = slot.as_node();
        let mut items_key = None;
        if let Some(id) = node {
            self.node_map(|r| &mut r.stack_of_node)?;
            match self.stack_of_node[id as usize] {
                NOT_READ => {}
                NO_STACK => return Ok(None),
                known => return Ok(Some(known)),
            }
            items_key = self.arena.items_key(id);
            if let Some(&known) = items_key.and_then(|k| self.stack_of_items.get(&k)) {
                self.stack_of_node[id as usize] = known;
                return Ok((known != NO_STACK).then_some(known));
            }
        }
        let items = self.list(slot, at)?;
        let stack = if items.is_empty() {
            None
        } else {
            let mut ids = Vec::with_capacity(items.len());
            for (i, &item) in items.iter().enumerate() {
                ids.push(self.frame(item, &|| format!("{}[{i}]", at()))?);
            }
            match self.stack_of_frames.get(ids.as_slice()) {
                Some(&s) => Some(s),
                None => {
                    // The stack, and its key in the map.
                    let bytes = 4 * ids.len() as u64 + 32;
                    self.charge(bytes)?;
                    self.charge_transient(bytes)?;
                    let ids: Box<[u32]> = ids.into();
                    let s = self.stacks.push_ids(ids.clone());
                    self.stack_of_frames.insert(ids, s);
                    Some(s)
                }
            }
        };
        if let Some(id) = node {
            self.stack_of_node[id as usize] = stack.unwrap_or(NO_STACK);
        }
        if let Some(key) = items_key {
            self.charge_transient(24)?;
            self.stack_of_items.insert(key, stack.unwrap_or(NO_STACK));
        }
        Ok(stack)
    }

    fn frame(&mut self, slot: Slot, at: At<'_>) -> Result<u32, VizError> {
        let node = slot.as_node();
        if let Some(id) = node {
            self.node_map(|r| &mut r.frame_of_node)?;
            let known = self.frame_of_node[id as usize];
            if known != NOT_READ {
                return Ok(known);
            }
        }
        let (mut name, mut filename, mut line) = ("", "", 0);
        let items = self.dict(slot, at)?;
        for kv in items.chunks_exact(2) {
            match self.key(kv[0], at)? {
                Key::Name => name = self.string(kv[1], &|| format!("{}.name", at()))?,
                Key::Filename => filename = self.string(kv[1], &|| format!("{}.filename", at()))?,
                Key::Line => line = self.int(kv[1], &|| format!("{}.line", at()))?,
                _ => {}
            }
        }
        let before = self.stacks.frames().len();
        let frame = Frame {
            name: self.stacks.string(name),
            filename: self.stacks.string(filename),
            line,
        };
        let id = self.stacks.frame(frame);
        if self.stacks.frames().len() > before {
            self.charge(FRAME_BYTES + name.len() as u64 + filename.len() as u64)?;
        }
        if let Some(n) = node {
            self.frame_of_node[n as usize] = id;
        }
        Ok(id)
    }

    /// A pickle value as JSON (for settings we carry but do not interpret). Shared
    /// containers are copied out, charged to the budget; a container inside itself, or
    /// nesting deeper than the pickle decoder allows, is refused.
    fn json_at(&mut self, slot: Slot, depth: usize) -> Result<serde_json::Value, VizError> {
        use serde_json::Value as J;
        if depth > crate::pickle::MAX_DEPTH {
            return Err(self.err(format!(
                "allocator_settings: nested more than {} deep",
                crate::pickle::MAX_DEPTH
            )));
        }
        self.charge(JSON_BYTES)?;
        Ok(match self.item(slot) {
            Item::None => J::Null,
            Item::Bool(b) => J::Bool(b),
            Item::Int(i) => J::from(i),
            Item::Float(f) => serde_json::Number::from_f64(f).map_or(J::Null, J::Number),
            Item::Bytes(b) => {
                self.charge(b.len() as u64)?;
                J::String(String::from_utf8_lossy(b).into_owned())
            }
            Item::Str(s) => {
                self.charge(s.len() as u64)?;
                J::String(s.to_string())
            }
            Item::Container(Kind::Dict, items) => {
                let mut map = serde_json::Map::new();
                for kv in items.chunks_exact(2) {
                    let key = match self.item(kv[0]) {
                        Item::Str(s) => s.to_string(),
                        Item::Int(i) => i.to_string(),
                        other => type_name(&other).to_string(),
                    };
                    self.charge(key.len() as u64)?;
                    let value = self.json_at(kv[1], depth + 1)?;
                    map.insert(key, value);
                }
                J::Object(map)
            }
            Item::Container(_, items) => {
                let mut out = Vec::with_capacity(items.len());
                for &item in items {
                    out.push(self.json_at(item, depth + 1)?);
                }
                J::Array(out)
            }
        })
    }
}
