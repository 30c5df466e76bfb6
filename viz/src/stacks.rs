//! Call stacks held once: every distinct frame (and every distinct string of one) stored
//! once, and stacks as lists of frame indices.
//!
//! Traces repeat a few hundred frames in millions of stacks; PyTorch's pickles share frame
//! dicts between stacks and our JSON shares stacks between events. Keeping them by index
//! is what makes a stack cost four bytes a frame rather than a copy of each frame.

use serde::{Deserialize, Deserializer, Serialize, Serializer};
use std::collections::HashMap;
use std::sync::Arc;

/// One frame of a call stack. Its strings are shared by every frame that names the same
/// function or file.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Frame {
    /// Function name.
    pub name: Arc<str>,
    /// Source file.
    pub filename: Arc<str>,
    /// Line number.
    pub line: i64,
}

/// The call stacks of a snapshot, innermost frame first. Each distinct frame is stored
/// once and stacks hold frame indices: traces repeat a few hundred frames in millions of
/// stacks, so a stack costs four bytes a frame, not a copy of each. Serialised, it is the
/// schema's `stacks` (a list of lists of frame objects).
#[derive(Clone, Debug, Default)]
pub struct Stacks {
    frames: Vec<Frame>,
    stacks: Vec<Box<[u32]>>,
    /// Index of each frame in `frames`.
    frame_ids: HashMap<Frame, u32>,
    /// Each distinct string of `frames`, shared.
    strings: std::collections::HashSet<Arc<str>>,
}

impl PartialEq for Stacks {
    fn eq(&self, other: &Self) -> bool {
        self.len() == other.len()
            && (0..self.len() as u32).all(|i| self.frames_of(i).eq(other.frames_of(i)))
    }
}

impl Stacks {
    /// Number of stacks.
    pub fn len(&self) -> usize {
        self.stacks.len()
    }

    /// Whether there are no stacks.
    pub fn is_empty(&self) -> bool {
        self.stacks.is_empty()
    }

    /// Every distinct frame; [`Stacks::frame_ids`] index it.
    pub fn frames(&self) -> &[Frame] {
        &self.frames
    }

    /// The frame indices of stack `i` (empty if there is no such stack).
    pub fn frame_ids(&self, i: u32) -> &[u32] {
        self.stacks.get(i as usize).map_or(&[], |s| s)
    }

    /// The frames of stack `i`, innermost first (none if there is no such stack).
    pub fn frames_of(&self, i: u32) -> impl ExactSizeIterator<Item = &Frame> + '_ {
        self.frame_ids(i).iter().map(|&f| &self.frames[f as usize])
    }

    /// `text`, shared with every equal string already in these stacks.
    pub fn string(&mut self, text: &str) -> Arc<str> {
        if let Some(s) = self.strings.get(text) {
            return s.clone();
        }
        let s: Arc<str> = Arc::from(text);
        self.strings.insert(s.clone());
        s
    }

    /// The index of `frame`, added if new.
    pub fn frame(&mut self, frame: Frame) -> u32 {
        if let Some(&i) = self.frame_ids.get(&frame) {
            return i;
        }
        let frame = Frame {
            name: self.string(&frame.name),
            filename: self.string(&frame.filename),
            line: frame.line,
        };
        let i = self.frames.len() as u32;
        self.frames.push(frame.clone());
        self.frame_ids.insert(frame, i);
        i
    }

    /// Adds a stack of the frames at `ids` (indices from [`Stacks::frame`]) and returns
    /// its index.
    pub fn push_ids(&mut self, ids: Box<[u32]>) -> u32 {
        debug_assert!(ids.iter().all(|&f| (f as usize) < self.frames.len()));
        self.stacks.push(ids);
        (self.stacks.len() - 1) as u32
    }

    /// Adds a stack of `frames`, innermost first, and returns its index.
    pub fn push(&mut self, frames: impl IntoIterator<Item = Frame>) -> u32 {
        let ids: Box<[u32]> = frames.into_iter().map(|f| self.frame(f)).collect();
        self.push_ids(ids)
    }
}

impl Serialize for Stacks {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeSeq;
        struct One<'a>(&'a Stacks, u32);
        impl Serialize for One<'_> {
            fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
                serializer.collect_seq(self.0.frames_of(self.1))
            }
        }
        let mut seq = serializer.serialize_seq(Some(self.len()))?;
        for i in 0..self.len() as u32 {
            seq.serialize_element(&One(self, i))?;
        }
        seq.end()
    }
}

impl<'de> Deserialize<'de> for Stacks {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        /// Reads the stacks one frame at a time into the tables, so equal frames and
        /// strings are kept once while reading.
        struct StacksVisitor;
        struct StackSeed<'a>(&'a mut Stacks);
        impl<'de> serde::de::DeserializeSeed<'de> for StackSeed<'_> {
            type Value = ();
            fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
                d.deserialize_seq(self)
            }
        }
        impl<'de> serde::de::Visitor<'de> for StackSeed<'_> {
            type Value = ();
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a list of frames")
            }
            fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
                // What is kept is charged to the read's budget ([`crate::json`]): the
                // stack's frame indices, and each frame (with its strings) the first time.
                let mut ids = Vec::new();
                while let Some(frame) = seq.next_element::<Frame>()? {
                    let before = self.0.frames.len();
                    let text = frame.name.len() + frame.filename.len();
                    ids.push(self.0.frame(frame));
                    if self.0.frames.len() > before {
                        crate::json::charge::<A::Error>(size_of::<Frame>() + 64 + text)?;
                    }
                }
                crate::json::charge::<A::Error>(4 * ids.len() + 32)?;
                self.0.push_ids(ids.into());
                Ok(())
            }
        }
        impl<'de> serde::de::Visitor<'de> for StacksVisitor {
            type Value = Stacks;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a list of call stacks")
            }
            fn visit_seq<A: serde::de::SeqAccess<'de>>(
                self,
                mut seq: A,
            ) -> Result<Stacks, A::Error> {
                let mut stacks = Stacks::default();
                while seq.next_element_seed(StackSeed(&mut stacks))?.is_some() {}
                Ok(stacks)
            }
        }
        deserializer.deserialize_seq(StacksVisitor)
    }
}
