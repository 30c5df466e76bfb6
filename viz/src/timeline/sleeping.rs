//! The ranges sleeping memory pools gave back, apart from the segments: a sleeping range
//! keeps its addresses and blocks but holds no memory, so the viewer hatches it rather than
//! counting it as reserved.

use super::{SegmentSpan, STAGE};
use crate::limits::{Budget, OverBudget};
use crate::model::{DeviceSnapshot, TraceAction};
use std::collections::BTreeMap;

/// What one entry of the map of open sleeping ranges costs while pairing.
const OPEN_ENTRY_BYTES: u64 = 48;

/// The ranges sleeping memory pools gave back over `device`'s trace: each `sleep` opens
/// one, the `wake` that maps any of it closes it; a sleeping segment of the snapshot that
/// no `sleep` of the trace explains was asleep before it. The spans are charged to
/// `budget`, the map of open ones through `charge_transient` (given back by the caller).
pub(super) fn sleeping_spans(
    device: &DeviceSnapshot,
    budget: &mut Budget,
    charge_transient: &mut dyn FnMut(&mut Budget, u64) -> Result<(), OverBudget>,
    stream: &mut dyn FnMut(u64) -> u32,
) -> Result<Vec<SegmentSpan>, OverBudget> {
    let mut spans: Vec<SegmentSpan> = Vec::new();
    let mut open: BTreeMap<u64, usize> = BTreeMap::new();
    for (i, e) in device.trace.iter().enumerate() {
        match e.action {
            TraceAction::Sleep => {
                budget.reserve(STAGE, &mut spans, 1)?;
                charge_transient(budget, OPEN_ENTRY_BYTES)?;
                spans.push(SegmentSpan {
                    start: Some(i as u32),
                    end: None,
                    addr: e.addr,
                    size: e.size,
                    stream: stream(e.stream),
                });
                open.insert(e.addr, spans.len() - 1);
            }
            TraceAction::Wake => {
                let hi = e.addr.saturating_add(e.size);
                let woken: Vec<u64> = open
                    .range(..hi)
                    .filter(|(_, &k)| spans[k].addr.saturating_add(spans[k].size) > e.addr)
                    .map(|(&addr, _)| addr)
                    .collect();
                for addr in woken {
                    if let Some(k) = open.remove(&addr) {
                        spans[k].end = Some(i as u32);
                    }
                }
            }
            _ => {}
        }
    }
    let mut early = Vec::new();
    for seg in device.segments.iter().filter(|seg| seg.asleep) {
        let hi = seg.addr.saturating_add(seg.size);
        let explained = open
            .range(..hi)
            .any(|(_, &k)| spans[k].addr.saturating_add(spans[k].size) > seg.addr);
        if !explained {
            budget.reserve(STAGE, &mut early, 1)?;
            early.push(SegmentSpan {
                start: None,
                end: None,
                addr: seg.addr,
                size: seg.size,
                stream: stream(seg.stream),
            });
        }
    }
    budget.reserve(STAGE, &mut early, spans.len())?;
    early.append(&mut spans);
    // The spans moved: what held them goes back.
    budget.release((spans.capacity() * size_of::<SegmentSpan>()) as u64);
    Ok(early)
}
