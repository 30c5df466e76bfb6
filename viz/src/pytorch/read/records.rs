//! Reading the snapshot's records from the arena: the top level, each segment with its
//! blocks, each trace entry, key by key.

use super::super::{BlockState, TraceAction};
use super::{
    Item, Key, RawBlock, RawEntry, RawSegment, Reader, Records, Sink, BLOCK_BYTES, SEGMENT_BYTES,
    STAGE,
};
use crate::error::VizError;
use crate::limits::{Budget, MAX_DEVICE_INDEX};
use crate::pickle::Slot;

impl Reader<'_> {
    pub(super) fn snapshot(&mut self, sink: &mut dyn Sink) -> Result<Records, VizError> {
        let (mut segments, mut traces, mut settings) = (None, None, None);
        let root = self.arena.root;
        let top = || "top level".to_string();
        for kv in self.dict(root, &top)?.chunks_exact(2) {
            match self.key(kv[0], &top)? {
                Key::Segments => segments = Some(kv[1]),
                Key::DeviceTraces => traces = Some(kv[1]),
                Key::AllocatorSettings => settings = Some(kv[1]),
                _ => {}
            }
        }
        let (Some(segments), Some(traces)) = (segments, traces) else {
            return Err(self.err(
                "top level: missing key \"segments\" or \"device_traces\" \
                 (not a torch.cuda.memory._dump_snapshot file)"
                    .into(),
            ));
        };
        let settings = match settings {
            Some(v) => Some(self.json_at(v, 0)?),
            None => None,
        };
        let segment_list = self.list(segments, &|| "segments".into())?;
        let mut read_segments = Vec::new();
        self.budget
            .reserve(STAGE, &mut read_segments, segment_list.len())
            .map_err(|o| self.over(o))?;
        for (i, &s) in segment_list.iter().enumerate() {
            let seg = self.segment(s, i)?;
            read_segments.push(seg);
        }
        let traces = self.list(traces, &|| "device_traces".into())?;
        self.charge(24 * traces.len() as u64)?;
        // Entries of devices past the limit would become devices past the limit.
        let with_entries = traces
            .iter()
            .rposition(|&t| !matches!(self.item(t), Item::Container(_, items) if items.is_empty()))
            .map_or(0, |d| d + 1);
        if with_entries > MAX_DEVICE_INDEX as usize + 1 {
            return Err(self.err(format!(
                "device_traces: entries for device {} exceed the device index limit of \
                 {MAX_DEVICE_INDEX}",
                with_entries - 1
            )));
        }
        for (d, &trace) in traces.iter().enumerate() {
            let entries = self.list(trace, &|| format!("device_traces[{d}]"))?;
            // Room for the whole trace, charged before anything is built, so a trace the
            // budget cannot hold is refused at once.
            sink.device(d, entries.len(), &mut self.budget)
                .map_err(|o| self.over(o))?;
            for (i, &e) in entries.iter().enumerate() {
                let read = self.entry(e, d, i)?;
                sink.entry(d, i, read);
            }
        }
        Ok(Records {
            segments: read_segments,
            device_traces: traces.len(),
            stacks: std::mem::take(&mut self.stacks),
            settings,
            budget: Budget::default(),
        })
    }

    fn segment(&mut self, v: Slot, i: usize) -> Result<RawSegment, VizError> {
        let at = || format!("segments[{i}]");
        self.charge(SEGMENT_BYTES)?;
        let mut seg = RawSegment {
            device: 0,
            address: 0,
            total_size: 0,
            stream: 0,
            segment_type: "large".into(),
            is_expandable: false,
            blocks: Vec::new(),
        };
        let (mut have_address, mut have_size) = (false, false);
        let mut blocks: &[Slot] = &[];
        for kv in self.dict(v, &at)?.chunks_exact(2) {
            let key = self.key(kv[0], &at)?;
            let name = self.arena.str_id(kv[0]).map_or("", |(_, k)| k);
            let key_at = || format!("{}.{name}", at());
            let v = kv[1];
            match key {
                Key::Device => {
                    // Bounded here, before the per-device loops see it.
                    let max = MAX_DEVICE_INDEX;
                    seg.device = u32::try_from(self.uint(v, &key_at)?)
                        .ok()
                        .filter(|&d| d <= max)
                        .ok_or_else(|| {
                            self.err(format!(
                                "{}: device index exceeds the limit of {max}",
                                key_at()
                            ))
                        })?
                }
                Key::Address => {
                    seg.address = self.uint(v, &key_at)?;
                    have_address = true;
                }
                Key::TotalSize => {
                    seg.total_size = self.uint(v, &key_at)?;
                    have_size = true;
                }
                Key::Stream => seg.stream = self.stream(v, &key_at)?,
                Key::SegmentType => {
                    let t = self.string(v, &key_at)?;
                    self.charge(t.len() as u64)?;
                    seg.segment_type = t.to_string();
                }
                Key::IsExpandable => seg.is_expandable = matches!(self.item(v), Item::Bool(true)),
                Key::Blocks => blocks = self.list(v, &key_at)?,
                _ => {}
            }
        }
        if !have_address || !have_size {
            return Err(self.err(format!("{}: missing \"address\" or \"total_size\"", at())));
        }
        self.budget
            .reserve(STAGE, &mut seg.blocks, blocks.len())
            .map_err(|o| self.over(o))?;
        let mut addr = seg.address;
        for (j, &b) in blocks.iter().enumerate() {
            let at = || format!("segments[{i}].blocks[{j}]");
            self.charge(BLOCK_BYTES)?;
            let mut block = RawBlock {
                address: addr,
                size: 0,
                requested_size: 0,
                state: BlockState::Inactive,
                stack: None,
            };
            let (mut have_size, mut have_state, mut have_requested) = (false, false, false);
            for kv in self.dict(b, &at)?.chunks_exact(2) {
                let key = self.key(kv[0], &at)?;
                let name = self.arena.str_id(kv[0]).map_or("", |(_, k)| k);
                let key_at = || format!("{}.{name}", at());
                let v = kv[1];
                match key {
                    Key::Address => block.address = self.uint(v, &key_at)?,
                    Key::Size => {
                        block.size = self.uint(v, &key_at)?;
                        have_size = true;
                    }
                    Key::RequestedSize => {
                        block.requested_size = self.uint(v, &key_at)?;
                        have_requested = true;
                    }
                    Key::State => {
                        let name = self.string(v, &key_at)?;
                        block.state = BlockState::from_name(name).ok_or_else(|| {
                            self.err(format!("{}: unknown block state {name:?}", key_at()))
                        })?;
                        have_state = true;
                    }
                    Key::Frames => block.stack = self.frames(v, &key_at)?,
                    _ => {}
                }
            }
            if !have_size || !have_state {
                return Err(self.err(format!("{}: missing \"size\" or \"state\"", at())));
            }
            if !have_requested {
                block.requested_size = block.size;
            }
            addr = block.address.wrapping_add(block.size);
            seg.blocks.push(block);
        }
        Ok(seg)
    }

    fn entry(&mut self, v: Slot, d: usize, i: usize) -> Result<RawEntry, VizError> {
        let at = || format!("device_traces[{d}][{i}]");
        let mut entry = RawEntry {
            action: TraceAction::Alloc,
            addr: 0,
            size: 0,
            stream: 0,
            time_us: None,
            stack: None,
            device_free: None,
        };
        let mut have_action = false;
        for kv in self.dict(v, &at)?.chunks_exact(2) {
            let key = self.key(kv[0], &at)?;
            let v = kv[1];
            let key_at = || {
                let name = self.arena.str_id(kv[0]).map_or("", |(_, k)| k);
                format!("{}.{name}", at())
            };
            match key {
                Key::Action => {
                    entry.action = self.action(v, &key_at)?;
                    have_action = true;
                }
                Key::Addr => entry.addr = self.uint(v, &key_at)?,
                Key::Size => entry.size = self.uint(v, &key_at)?,
                Key::Stream => entry.stream = self.stream(v, &key_at)?,
                Key::TimeUs => entry.time_us = Some(self.uint(v, &key_at)?),
                Key::Frames => entry.stack = self.frames(v, &key_at)?,
                Key::DeviceFree => entry.device_free = Some(self.uint(v, &key_at)?),
                _ => {}
            }
        }
        if !have_action {
            return Err(self.err(format!("{}: missing \"action\"", at())));
        }
        Ok(entry)
    }
}
