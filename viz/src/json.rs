//! Reading JSON within a budget of what is built.
//!
//! JSON has no references, but it still builds more than it reads: `[[0],[0],…]` is four
//! bytes an element and a `serde_json::Value` tree of about 100 bytes an element, and a
//! vector that grows by doubling holds up to twice what it needs. So the parts of our
//! snapshot that grow with the file (the free-form `config` and `stats`, the lists of
//! devices, segments, blocks and events, the stacks' strings) are read through the
//! helpers here, which charge what they allocate to the [`Budget`] of the read being
//! done ([`parse_within`]) before they allocate it. The budget lives in a thread-local
//! for the duration of one parse, because serde's derived readers cannot carry it; read
//! outside [`parse_within`], the helpers charge nothing. Other JSON readers of the project
//! (the trace loader of `streamalloc replay`) use the same helpers.

use crate::limits::{Budget, OverBudget};
use serde::de::{self, DeserializeOwned, Deserializer, MapAccess, SeqAccess, Visitor};
use serde::Deserialize;
use std::cell::RefCell;
use std::fmt;

thread_local! {
    /// The budget of the parse running on this thread, and why it ran out if it did.
    static CURRENT: RefCell<Option<(Budget, Option<OverBudget>)>> = const { RefCell::new(None) };
}

/// What the budget calls reading JSON.
const STAGE: &str = "reading the JSON";

/// Why [`parse_within`] failed.
#[derive(Debug)]
pub enum ParseError {
    /// The JSON is invalid or not of the expected shape.
    Json(serde_json::Error),
    /// What it would build does not fit the budget.
    Over(OverBudget),
}

/// What a JSON object's top level holds, read without building it: whether it has the
/// keys the readers look for, its first few keys (for a message) and how many there are.
/// Its memory is bounded whatever the object.
#[derive(Debug, Default)]
pub struct ObjectKeys {
    /// The object has a `format` key.
    pub format: bool,
    /// The object has a `trace` key.
    pub trace: bool,
    /// Its first keys, at most [`ObjectKeys::SHOWN`].
    pub first: Vec<String>,
    /// How many keys it has.
    pub count: usize,
}

impl ObjectKeys {
    /// Keys kept in [`ObjectKeys::first`].
    pub const SHOWN: usize = 8;

    /// The top-level keys of the JSON object `bytes` (an error if it is not one).
    pub fn of(bytes: &[u8]) -> Result<Self, serde_json::Error> {
        struct Keys;
        impl<'de> Visitor<'de> for Keys {
            type Value = ObjectKeys;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<ObjectKeys, A::Error> {
                let mut keys = ObjectKeys::default();
                while let Some(key) = map.next_key::<std::borrow::Cow<'de, str>>()? {
                    map.next_value::<de::IgnoredAny>()?;
                    keys.format |= key == "format";
                    keys.trace |= key == "trace";
                    if keys.first.len() < ObjectKeys::SHOWN {
                        keys.first.push(key.into_owned());
                    }
                    keys.count += 1;
                }
                Ok(keys)
            }
        }
        serde_json::Deserializer::from_slice(bytes).deserialize_map(Keys)
    }
}

/// Parses `bytes` as `T`, charging what the helpers of this module build to `budget`;
/// returns the value and the budget charged with it.
pub fn parse_within<T: DeserializeOwned>(
    bytes: &[u8],
    budget: Budget,
) -> Result<(T, Budget), ParseError> {
    let previous = CURRENT.with(|c| c.borrow_mut().replace((budget, None)));
    let parsed = serde_json::from_slice::<T>(bytes);
    let (budget, over) = CURRENT
        .with(|c| std::mem::replace(&mut *c.borrow_mut(), previous))
        .unwrap_or_default();
    match (parsed, over) {
        (_, Some(over)) => Err(ParseError::Over(over)),
        (Ok(value), None) => Ok((value, budget)),
        (Err(e), None) => Err(ParseError::Json(e)),
    }
}

/// Charges `bytes` to the current parse's budget (nothing outside a parse). The error is
/// a deserialisation error that ends the parse; [`parse_within`] reports the budget's.
pub fn charge<E: de::Error>(bytes: usize) -> Result<(), E> {
    CURRENT.with(|c| match &mut *c.borrow_mut() {
        Some((budget, over)) => budget.charge_for(STAGE, bytes as u64).map_err(|o| {
            *over = Some(o);
            E::custom(o)
        }),
        None => Ok(()),
    })
}

/// Makes room for one more item in `v`, charging its growth.
fn grow<T, E: de::Error>(v: &mut Vec<T>) -> Result<(), E> {
    if v.len() == v.capacity() {
        let more = v.capacity().max(4);
        charge::<E>(more * size_of::<T>())?;
        v.reserve_exact(more);
    }
    Ok(())
}

/// A list of `T` read with its growth charged: for `#[serde(deserialize_with)]`.
pub fn vec<'de, D: Deserializer<'de>, T: Deserialize<'de>>(d: D) -> Result<Vec<T>, D::Error> {
    struct Items<T>(std::marker::PhantomData<T>);
    impl<'de, T: Deserialize<'de>> Visitor<'de> for Items<T> {
        type Value = Vec<T>;
        fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("a list")
        }
        fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Vec<T>, A::Error> {
            let mut out = Vec::new();
            loop {
                grow::<T, A::Error>(&mut out)?;
                match seq.next_element()? {
                    Some(item) => out.push(item),
                    None => return Ok(out),
                }
            }
        }
    }
    d.deserialize_seq(Items(std::marker::PhantomData))
}

/// A string read with its bytes charged.
pub fn string<'de, D: Deserializer<'de>>(d: D) -> Result<String, D::Error> {
    let s = String::deserialize(d)?;
    charge::<D::Error>(s.len())?;
    Ok(s)
}

/// An optional free-form value (`config`, `stats`) read with every value, string and list
/// charged as it is built.
pub fn value<'de, D: Deserializer<'de>>(d: D) -> Result<Option<serde_json::Value>, D::Error> {
    Option::<Charged>::deserialize(d).map(|v| v.map(|c| c.0))
}

/// In-memory bytes of one value in a list or map, beside what it owns.
const VALUE_BYTES: usize = size_of::<serde_json::Value>();
/// What a map entry costs besides its key's text and its value: the key's header and the
/// B-tree's share of a node.
const MAP_ENTRY_BYTES: usize = size_of::<String>() + VALUE_BYTES + 16;

/// A `serde_json::Value` built with its cost charged.
struct Charged(serde_json::Value);

impl<'de> Deserialize<'de> for Charged {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(ChargedVisitor).map(Charged)
    }
}

struct ChargedVisitor;

impl<'de> Visitor<'de> for ChargedVisitor {
    type Value = serde_json::Value;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("any JSON value")
    }

    fn visit_bool<E: de::Error>(self, v: bool) -> Result<Self::Value, E> {
        Ok(v.into())
    }

    fn visit_i64<E: de::Error>(self, v: i64) -> Result<Self::Value, E> {
        Ok(v.into())
    }

    fn visit_u64<E: de::Error>(self, v: u64) -> Result<Self::Value, E> {
        Ok(v.into())
    }

    fn visit_f64<E: de::Error>(self, v: f64) -> Result<Self::Value, E> {
        Ok(serde_json::Number::from_f64(v).map_or(serde_json::Value::Null, Into::into))
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
        charge::<E>(v.len())?;
        Ok(v.into())
    }

    fn visit_string<E: de::Error>(self, v: String) -> Result<Self::Value, E> {
        charge::<E>(v.len())?;
        Ok(v.into())
    }

    fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
        Ok(serde_json::Value::Null)
    }

    fn visit_none<E: de::Error>(self) -> Result<Self::Value, E> {
        Ok(serde_json::Value::Null)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        let mut out: Vec<serde_json::Value> = Vec::new();
        loop {
            grow::<serde_json::Value, A::Error>(&mut out)?;
            match seq.next_element::<Charged>()? {
                Some(Charged(v)) => out.push(v),
                None => return Ok(serde_json::Value::Array(out)),
            }
        }
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let mut out = serde_json::Map::new();
        while let Some(key) = map.next_key::<String>()? {
            charge::<A::Error>(MAP_ENTRY_BYTES + key.len())?;
            let Charged(value) = map.next_value()?;
            out.insert(key, value);
        }
        Ok(serde_json::Value::Object(out))
    }
}
