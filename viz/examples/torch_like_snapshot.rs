//! Writes a PyTorch-like memory snapshot for measuring the readers:
//! `cargo run --release -p streamalloc-viz --example torch_like_snapshot -- OUT.pickle.gz
//! [EVENTS] [STACKS]`.
//!
//! It is pickled as PyTorch pickles its snapshots: every dict and list is memoised, so a
//! frame dict is written once and then referred to from every stack that holds it, and a
//! stack list once and then referred to from every entry with the same traceback. The
//! trace is training-like: allocations of varied sizes on four streams, each freed
//! (requested, then completed) a while later, with segments growing as needed; each entry
//! carries one of STACKS call stacks (default 5000) of 20 to 40 frames drawn from 800
//! frames.

use std::io::Write;

/// A pickle writer that memoises as Python does (`BINPUT` after every container and
/// string, `BINGET` for a second reference).
struct Pickler {
    out: Vec<u8>,
    next_memo: u32,
    strings: std::collections::HashMap<String, u32>,
}

impl Pickler {
    fn memoise(&mut self) -> u32 {
        let id = self.next_memo;
        self.out.push(b'r');
        self.out.extend(id.to_le_bytes());
        self.next_memo += 1;
        id
    }

    fn get(&mut self, id: u32) {
        self.out.push(b'j');
        self.out.extend(id.to_le_bytes());
    }

    fn str(&mut self, s: &str) {
        if let Some(&id) = self.strings.get(s) {
            return self.get(id);
        }
        self.out.push(0x8c);
        self.out.push(s.len() as u8);
        self.out.extend(s.as_bytes());
        let id = self.memoise();
        self.strings.insert(s.to_string(), id);
    }

    fn int(&mut self, v: i64) {
        self.out.extend([0x8a, 8]);
        self.out.extend(v.to_le_bytes());
    }
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let Some(out_path) = args.get(1) else {
        eprintln!("usage: torch_like_snapshot OUT.pickle.gz [EVENTS] [STACKS]");
        std::process::exit(2);
    };
    let events: usize = args
        .get(2)
        .map_or(1_000_000, |s| s.parse().expect("EVENTS"));
    let stack_count: usize = args.get(3).map_or(5000, |s| s.parse().expect("STACKS"));
    let mut rng = 0x2545_f491_4f6c_dd1du64;
    let mut next = move || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng
    };
    let mut p = Pickler {
        out: Vec::with_capacity(events * 64),
        next_memo: 0,
        strings: Default::default(),
    };
    p.out.extend([0x80, 4]);
    p.out.extend(b"}");
    p.memoise();
    p.out.push(b'(');

    // Frames: one memoised dict each.
    let frame_count = 800;
    let mut frame_memo = Vec::with_capacity(frame_count);
    for f in 0..frame_count {
        p.out.push(b'}');
        let id = p.memoise();
        p.out.push(b'(');
        p.str("name");
        p.str(&format!("layer_{}_forward", f % 97));
        p.str("filename");
        p.str(&format!("/src/model/block_{}.py", f % 41));
        p.str("line");
        p.int((f * 7 % 900) as i64 + 1);
        p.out.push(b'u');
        // Off the stack again: only the memo keeps it, for the stacks to refer to.
        p.out.push(b'0');
        frame_memo.push(id);
    }
    // Stacks are built the first time an entry uses them, as Python would meet them.
    let mut stack_memo: Vec<Option<u32>> = vec![None; stack_count];

    p.str("segments");
    p.out.push(b']');
    p.memoise();
    p.str("device_traces");
    p.out.push(b']');
    p.memoise();
    p.out.push(b'(');
    p.out.push(b']');
    p.memoise();

    let streams = [0i64, 0x7f00_1000, 0x7f00_2000, 0x7f00_3000];
    let mut live: Vec<(u64, u64, i64)> = Vec::new();
    let mut pending: Vec<(u64, u64, i64)> = Vec::new();
    let (mut next_addr, mut reserved_end) = (0x7f10_0000_0000u64, 0x7f10_0000_0000u64);
    let mut written = 0usize;
    let mut time_us = 1_700_000_000_000_000i64;
    while written < events {
        p.out.push(b'(');
        let batch_end = (written + 1000).min(events);
        while written < batch_end {
            let r = next();
            let (action, addr, size, stream) = if !pending.is_empty() && r % 5 == 0 {
                let (a, s, st) = pending.swap_remove((r as usize / 5) % pending.len());
                ("free_completed", a, s, st)
            } else if live.len() > 2000 || (!live.is_empty() && r % 3 == 0) {
                let (a, s, st) = live.swap_remove((r as usize / 3) % live.len());
                pending.push((a, s, st));
                ("free_requested", a, s, st)
            } else {
                let size = 512 * (1 + (next() % 4096));
                let stream = streams[(next() % 4) as usize];
                if next_addr + size > reserved_end {
                    let seg = size.div_ceil(2 << 20) * (20 << 20);
                    write_entry(
                        &mut p,
                        "segment_alloc",
                        reserved_end,
                        seg,
                        stream,
                        time_us,
                        None,
                    );
                    written += 1;
                    next_addr = reserved_end;
                    reserved_end += seg;
                }
                let a = next_addr;
                next_addr += size;
                live.push((a, size, stream));
                ("alloc", a, size, stream)
            };
            time_us += 1 + (next() % 50) as i64;
            let s = (next() as usize) % stack_count;
            let memo = match stack_memo[s] {
                Some(id) => StackRef::Shared(id),
                None => {
                    let depth = 20 + (s * 13 % 21);
                    let frames: Vec<u32> = (0..depth)
                        .map(|k| frame_memo[(s * 31 + k * 17) % frame_count])
                        .collect();
                    StackRef::New(frames)
                }
            };
            if let Some(id) = write_entry(&mut p, action, addr, size, stream, time_us, Some(memo)) {
                stack_memo[s] = Some(id);
            }
            written += 1;
        }
        p.out.push(b'e');
    }
    p.out.push(b'e');
    p.out.push(b'u');
    p.out.push(b'.');

    let file = std::fs::File::create(out_path).expect("create the output file");
    let mut gz = flate2::write::GzEncoder::new(file, flate2::Compression::fast());
    gz.write_all(&p.out).expect("write");
    gz.finish().expect("finish");
    eprintln!(
        "{out_path}: {events} events, {stack_count} stacks, {} bytes of pickle",
        p.out.len()
    );
}

/// The stack of an entry: one written before, or a new one (its frames' memo ids).
enum StackRef {
    Shared(u32),
    New(Vec<u32>),
}

/// Writes one trace entry; returns the memo id of a stack list written for it.
fn write_entry(
    p: &mut Pickler,
    action: &str,
    addr: u64,
    size: u64,
    stream: i64,
    time_us: i64,
    stack: Option<StackRef>,
) -> Option<u32> {
    p.out.push(b'}');
    p.memoise();
    p.out.push(b'(');
    p.str("action");
    p.str(action);
    p.str("addr");
    p.int(addr as i64);
    p.str("size");
    p.int(size as i64);
    p.str("stream");
    p.int(stream);
    p.str("time_us");
    p.int(time_us);
    p.str("frames");
    let mut new_stack = None;
    match stack {
        None => p.out.push(b']'),
        Some(StackRef::Shared(id)) => p.get(id),
        Some(StackRef::New(frames)) => {
            p.out.push(b']');
            new_stack = Some(p.memoise());
            p.out.push(b'(');
            for f in frames {
                p.get(f);
            }
            p.out.push(b'e');
        }
    }
    p.out.push(b'u');
    new_stack
}
