//! Programs from arbitrary bytes: the cargo-fuzz target's input format, and running one.

use super::{Harness, Op};
use crate::config::{Config, ReusePolicy};

/// Memory limits the fuzz input may choose (bits 5-6 of its first byte, with bit 7 set).
const LIMITS: [u64; 4] = [64 << 20, 96 << 20, 160 << 20, 256 << 20];

/// Decodes arbitrary bytes into a configuration and a program (the fuzz target's input
/// format: the first two bytes choose the policy, event batch, memory limit and trace
/// ring, then 8 bytes an op).
pub fn decode(bytes: &[u8]) -> (Config, Vec<Op>) {
    let mut config = Config::default();
    if let Some(&first) = bytes.first() {
        config.reuse_policy = if first & 1 == 0 {
            ReusePolicy::StreamWait
        } else {
            ReusePolicy::Pytorch
        };
        config.event_batch = 1 + usize::from(first >> 1) % 16;
        if first & 0x80 != 0 {
            config.memory_limit = Some(LIMITS[usize::from(first >> 5) & 3]);
        }
    }
    if let Some(second) = bytes.get(1) {
        config.trace_capacity = usize::from(*second) * 4;
    }
    let ops = bytes
        .get(2..)
        .unwrap_or_default()
        .chunks_exact(8)
        .map(decode_op)
        .collect();
    (config, ops)
}

fn decode_op(chunk: &[u8]) -> Op {
    let word = u64::from_le_bytes(chunk.try_into().expect("chunks of 8"));
    let field = |shift: u32, bits: u32| (word >> shift) & ((1 << bits) - 1);
    let duration = (field(40, 16) as u32) * 100;
    match field(0, 3) {
        0 | 1 => Op::Malloc {
            stream: field(3, 2) as u8,
            // Sizes across both pools and every segment class, 1 B to 48 MiB.
            size: (1 + field(8, 26) % (48 << 20)) >> field(34, 4),
            duration,
        },
        2 => Op::Free {
            block: field(8, 16) as u16,
        },
        3 => Op::Use {
            block: field(8, 16) as u16,
            stream: field(3, 2) as u8,
            duration,
        },
        4 => Op::Work {
            block: field(8, 16) as u16,
            duration,
        },
        5 => Op::AdvanceHost { ns: duration },
        6 => Op::SyncStream {
            stream: field(3, 2) as u8,
        },
        // Opcode 7 is split by bits 3..6; graph and pool steps took five of the seven
        // values that used to mean Free, so older corpus inputs still decode to programs.
        _ => match field(3, 3) {
            0 => Op::EmptyCache,
            2 => Op::BeginCapture {
                stream: field(6, 2) as u8,
            },
            3 => Op::EndCapture,
            4 => Op::Replay {
                graph: field(8, 16) as u16,
                stream: field(6, 2) as u8,
            },
            5 => Op::DestroyGraph {
                graph: field(8, 16) as u16,
            },
            6 => Op::PoolMalloc {
                stream: field(6, 2) as u8,
                size: (1 + field(8, 26) % (48 << 20)) >> field(34, 4),
                duration,
            },
            _ => Op::Free {
                block: field(8, 16) as u16,
            },
        },
    }
}

/// Runs a decoded program on a 512 MiB device and reports the first violation; under a
/// memory limit every out-of-memory failure is held to the pressure bound
/// ([`Harness::check_pressure_bound`]).
pub fn run_bytes(bytes: &[u8]) -> Result<(), String> {
    let (config, ops) = decode(bytes);
    let limited = config.memory_limit.is_some();
    let mut harness = Harness::new(config, 512 << 20).map_err(|e| e.to_string())?;
    if limited {
        harness.check_pressure_bound();
    }
    for op in &ops {
        harness.apply(op)?;
    }
    harness.finish()
}
