//! Step 2 of [`super::decode`]: the [`Value`] tree of an [`Arena`], built with an explicit
//! stack. A container the pickle shares is built once and copied wherever it is referred
//! to again; every value and byte of text built, copies included, is charged to the
//! arena's budget, so copies cannot outgrow the input.

use super::{Arena, Item, Kind, NodeId, PickleError, Slot, MAX_DEPTH};
use crate::limits::{Budget, OverBudget};
use serde_pickle::{HashableValue, Value};
use std::collections::{BTreeMap, BTreeSet, HashMap};

/// The value tree of `arena`'s top-level object.
pub(super) fn build(arena: &Arena) -> Result<Value, PickleError> {
    Builder {
        arena,
        budget: arena.budget.clone(),
        used: Cost::default(),
        state: vec![State::New; arena.nodes.len()],
        cache: HashMap::new(),
    }
    .build(arena.root)
}

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

struct Builder<'b> {
    arena: &'b Arena,
    budget: Budget,
    /// Values and text built so far.
    used: Cost,
    state: Vec<State>,
    /// Finished containers referenced more than once, with what they cost to build.
    cache: HashMap<NodeId, (Value, Cost)>,
}

impl Builder<'_> {
    fn charge(&mut self, cost: Cost, offset: usize) -> Result<(), PickleError> {
        let bytes = cost
            .values
            .saturating_mul(VALUE_BYTES)
            .saturating_add(cost.text);
        self.budget
            .charge(bytes)
            .map_err(|over: OverBudget| PickleError {
                over_budget: true,
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
        slot: Slot,
        offset: usize,
        path: &mut Vec<Open>,
    ) -> Result<Option<Value>, PickleError> {
        if let Some(id) = slot.as_node() {
            return self.enter_node(id, path);
        }
        let (value, text) = match self.arena.item(slot) {
            Item::None => (Value::None, 0),
            Item::Bool(b) => (Value::Bool(b), 0),
            Item::Int(i) => (Value::I64(i), 0),
            Item::Float(f) => (Value::F64(f), 0),
            Item::Str(s) => (Value::String(String::new()), s.len()),
            Item::Bytes(b) => (Value::Bytes(Vec::new()), b.len()),
            Item::Container(..) => unreachable!("containers are nodes"),
        };
        // Charged before the text is copied.
        self.charge(
            Cost {
                values: 1,
                text: text as u64,
            },
            offset,
        )?;
        Ok(Some(match (value, self.arena.item(slot)) {
            (Value::String(_), Item::Str(s)) => Value::String(s.to_owned()),
            (Value::Bytes(_), Item::Bytes(b)) => Value::Bytes(b.to_vec()),
            (value, _) => value,
        }))
    }

    fn enter_node(
        &mut self,
        id: NodeId,
        path: &mut Vec<Open>,
    ) -> Result<Option<Value>, PickleError> {
        let node = self.arena.nodes[id as usize];
        let offset = node.offset();
        match self.state[id as usize] {
            State::Open => Err(PickleError {
                over_budget: false,
                offset,
                message: format!(
                    "recursive structure: the {} created here contains itself",
                    node.kind().name()
                ),
            }),
            State::Done => {
                let Some((_, cost)) = self.cache.get(&id) else {
                    // Only containers referenced once are left uncached, and a second
                    // visit of one is impossible; refuse rather than panic all the same.
                    return Err(PickleError {
                        over_budget: false,
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
                        over_budget: false,
                        offset,
                        message: format!(
                            "containers nested more than {MAX_DEPTH} deep (the nesting limit)"
                        ),
                    });
                }
                let used = self.used;
                let items = self.arena.items(id).len();
                self.charge(Cost { values: 1, text: 0 }, offset)?;
                self.state[id as usize] = State::Open;
                path.push(Open {
                    id,
                    next: 0,
                    out: Vec::with_capacity(items),
                    used,
                });
                Ok(None)
            }
        }
    }

    /// How many times each container is referenced (from containers and the root), so
    /// that only shared ones are kept for copying.
    fn shared(&self, root: Slot) -> Vec<bool> {
        let mut refs = vec![0u8; self.arena.nodes.len()];
        let mut count = |slot: &Slot| {
            if let Some(id) = slot.as_node() {
                let r = &mut refs[id as usize];
                *r = r.saturating_add(1);
            }
        };
        count(&root);
        for id in 0..self.arena.nodes.len() {
            self.arena.items(id as NodeId).iter().for_each(&mut count);
        }
        refs.into_iter().map(|r| r > 1).collect()
    }

    fn finish(&self, open: Open) -> Result<Value, PickleError> {
        let node = self.arena.nodes[open.id as usize];
        let offset = node.offset();
        let hashable = |v: Value| {
            let kind = value_type(&v);
            let err = |what: &str| PickleError {
                over_budget: false,
                offset,
                message: format!(
                    "{what} used as a key or set item in the {} created here",
                    node.kind().name()
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
        Ok(match node.kind() {
            Kind::List => Value::List(open.out),
            Kind::Tuple => Value::Tuple(open.out),
            Kind::Set | Kind::FrozenSet => {
                let set = open
                    .out
                    .into_iter()
                    .map(hashable)
                    .collect::<Result<BTreeSet<_>, _>>()?;
                if node.kind() == Kind::Set {
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
        let shared = self.shared(root);
        let mut path: Vec<Open> = Vec::new();
        if let Some(v) = self.enter(root, 0, &mut path)? {
            return Ok(v);
        }
        loop {
            let Some(top) = path.last_mut() else {
                return Err(PickleError {
                    over_budget: false,
                    offset: 0,
                    message: "internal error: empty build path".into(),
                });
            };
            let arena = self.arena;
            let (id, next) = (top.id, top.next);
            if let Some(&slot) = arena.items(id).get(next) {
                top.next += 1;
                let offset = arena.nodes[id as usize].offset();
                if let Some(v) = self.enter(slot, offset, &mut path)? {
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
                self.charge(cost, arena.nodes[id as usize].offset())?;
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
