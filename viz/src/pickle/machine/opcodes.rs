//! The opcodes: their names, the helpers that read their arguments, and the loop that runs
//! them on a [`Machine`].

use super::super::{PickleError, Slot, HIGHEST_PROTOCOL, MAX_DEPTH};
use super::super::{FALSE, TAG_BYTES, TAG_FLOAT, TAG_INT, TAG_NODE, TAG_STR, TAG_WIDE_INT, TRUE};
use super::{Kind, Machine};
use crate::input::{Shortfall, Source};

/// Every opcode's name, for errors ("?" for bytes that are no opcode), looked up by
/// index on every opcode.
const OPCODE_NAMES: [&str; 256] = {
    let mut names = ["?"; 256];
    let mut op = 0;
    while op < 256 {
        if let Some(name) = opcode_name(op as u8) {
            names[op] = name;
        }
        op += 1;
    }
    names
};

/// The name of an opcode, for errors.
const fn opcode_name(op: u8) -> Option<&'static str> {
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
pub(super) fn long_to_i64(bytes: &[u8]) -> Option<i64> {
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

/// A protocol-0 text argument, shortened for an error message.
pub(super) fn truncate_for_message(s: &str) -> String {
    s.chars().take(40).collect()
}

pub(super) fn with_article(name: &str) -> String {
    match name.as_bytes().first() {
        Some(b'a' | b'e' | b'i' | b'o' | b'u') => format!("an {name}"),
        _ => format!("a {name}"),
    }
}

/// The error for a read of `n` bytes for `what` that fell short.
pub(super) fn short(op_at: usize, what: &str, n: usize, shortfall: Shortfall) -> PickleError {
    PickleError {
        over_budget: false,
        offset: op_at,
        message: match shortfall {
            Shortfall::Ended { left } => {
                format!("truncated: {what} needs {n} more bytes, only {left} left")
            }
            Shortfall::Failed => "the input could not be read".into(),
        },
    }
}

impl<S: Source> Machine<'_, S> {
    /// Runs the opcodes up to `STOP` and returns the object it pops.
    pub(super) fn run(&mut self) -> Result<Slot, PickleError> {
        loop {
            self.op_at = self.src.position();
            if self.src.received() > self.received {
                // The budget grows with the input received so far.
                let more = self.src.received() - self.received;
                self.arena.budget.add_input(more);
                self.received += more;
            }
            let op_at = self.op_at;
            let op = match self.src.take(1) {
                Ok(op) => op[0],
                Err(Shortfall::Ended { .. }) => {
                    return Err(self.err("truncated: the pickle ends before its STOP opcode"))
                }
                Err(e) => return Err(short(op_at, "the next opcode", 1, e)),
            };
            let name = OPCODE_NAMES[op as usize];
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
                    Self::reserve(&mut self.arena.budget, &mut self.marks, 1)
                        .map_err(|o| self.over(o))?;
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
                    let from = self.pop_mark(name)?;
                    self.stack.truncate(from);
                }
                b'2' => {
                    let v = self.top(name)?;
                    self.push(v)?;
                }
                b'N' => self.push(Slot::NONE)?,
                0x88 => self.push(Slot::bool(true))?,
                0x89 => self.push(Slot::bool(false))?,
                b'K' => {
                    let v = self.u8(name)?;
                    self.int(i64::from(v))?;
                }
                b'M' => {
                    let v = u16::from_le_bytes(self.array(name)?);
                    self.int(i64::from(v))?;
                }
                b'J' => {
                    let v = i32::from_le_bytes(self.array(name)?);
                    self.int(i64::from(v))?;
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
                    let line = self.line(name)?;
                    let line = line.trim();
                    // Protocol 0 spells booleans as INT 01 and 00.
                    match line {
                        "01" => self.push(Slot::bool(true))?,
                        "00" => self.push(Slot::bool(false))?,
                        _ => {
                            let v = line.parse::<i64>().map_err(|_| {
                                self.err(format!(
                                    "INT argument {:?} is not an integer that fits in 64 bits",
                                    truncate_for_message(line)
                                ))
                            })?;
                            self.int(v)?;
                        }
                    }
                }
                b'L' => {
                    let v = self.int_line(name)?;
                    self.int(v)?;
                }
                b'F' => {
                    let line = self.line(name)?;
                    let line = line.trim();
                    let v = line.parse::<f64>().map_err(|_| {
                        self.err(format!(
                            "FLOAT argument {:?} is not a number",
                            truncate_for_message(line)
                        ))
                    })?;
                    self.float(v)?;
                }
                b'G' => {
                    let v = f64::from_be_bytes(self.array(name)?);
                    self.float(v)?;
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
                b']' => self.build(Kind::List, self.stack.len())?,
                b'}' => self.build(Kind::Dict, self.stack.len())?,
                b')' => self.build(Kind::Tuple, self.stack.len())?,
                0x8f => self.build(Kind::Set, self.stack.len())?,
                b'l' => {
                    let from = self.pop_mark(name)?;
                    self.build(Kind::List, from)?;
                }
                b't' => {
                    let from = self.pop_mark(name)?;
                    self.build(Kind::Tuple, from)?;
                }
                0x91 => {
                    let from = self.pop_mark(name)?;
                    self.build(Kind::FrozenSet, from)?;
                }
                b'd' => {
                    let from = self.pop_mark(name)?;
                    if !(self.stack.len() - from).is_multiple_of(2) {
                        return Err(self.err("DICT with an odd number of items"));
                    }
                    self.build(Kind::Dict, from)?;
                }
                0x85 => self.tuple(1, name)?,
                0x86 => self.tuple(2, name)?,
                0x87 => self.tuple(3, name)?,
                b'a' => self.add_top(1, Kind::List, name)?,
                b'e' => self.add_marked(Kind::List, name)?,
                b's' => self.add_top(2, Kind::Dict, name)?,
                b'u' => self.add_marked(Kind::Dict, name)?,
                0x90 => self.add_marked(Kind::Set, name)?,
                0x94 => {
                    let key = u32::try_from(self.memo.len)
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

pub(super) fn slot_type(slot: Slot) -> &'static str {
    match slot.tag() {
        TAG_INT | TAG_WIDE_INT => "int",
        TAG_FLOAT => "float",
        TAG_STR => "str",
        TAG_BYTES => "bytes",
        TAG_NODE => "container",
        _ => match slot.payload() {
            FALSE | TRUE => "bool",
            _ => "None",
        },
    }
}
