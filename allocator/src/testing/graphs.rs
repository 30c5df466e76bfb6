//! The harness's graph rules: ordering replays after the eager work on their memory and
//! eager work after the replays, captures into fresh pools, replays, destruction and the
//! release of a capture's pool (see the module docs of [`super`]).

use super::{Graph, Harness, Live};
use crate::backend::{Events, Streams};
use crate::types::PoolId;
use std::collections::BTreeSet;

impl Harness {
    /// Makes stream `later` wait on the device for the work enqueued on `earlier` so far.
    pub(super) fn order(&self, earlier: usize, later: usize) -> Result<(), String> {
        if earlier == later {
            return Ok(());
        }
        let event = self.device.create_event().map_err(|e| e.to_string())?;
        self.device
            .record_event(event, self.streams[earlier])
            .map_err(|e| e.to_string())?;
        self.device
            .stream_wait_event(self.streams[later], event)
            .map_err(|e| e.to_string())?;
        self.device.destroy_event(event).map_err(|e| e.to_string())
    }

    /// The streams a replay of graph `key` must be ordered after: the eager work on its
    /// memory and the latest replays of every graph that ever shared that memory, live or
    /// destroyed, whether or not the block they shared is still allocated.
    pub(super) fn replay_dependencies(&self, key: u64) -> BTreeSet<usize> {
        let graph = &self.graphs[&key];
        let mut after: BTreeSet<usize> = graph.touchers.clone();
        for other in graph.shares_memory_with.iter().chain([&key]) {
            after.extend(self.graphs[other].last_replay);
        }
        after
    }

    /// The streams whose replays an eager touch of the `index`-th live block must follow.
    pub(super) fn touch_dependencies(&self, index: usize) -> impl Iterator<Item = usize> + '_ {
        self.live[index]
            .graphs
            .iter()
            .filter_map(|key| self.graphs[key].last_replay)
    }

    /// Before `stream` touches the `index`-th live block eagerly: orders it after the
    /// latest replays over the block, and notes it for the next ones to wait on.
    pub(super) fn touch_graph_memory(&mut self, index: usize, stream: usize) -> Result<(), String> {
        for key in self.live[index].graphs.clone() {
            if let Some(replayed) = self.graphs[&key].last_replay {
                self.order(replayed, stream)?;
            }
            self.graphs
                .get_mut(&key)
                .expect("graphs are kept")
                .touchers
                .insert(stream);
        }
        Ok(())
    }

    /// True if a live graph other than the one of the block's pool reads the block.
    pub(super) fn is_graph_input(&self, live: &Live) -> bool {
        live.graphs.iter().any(|key| {
            let graph = &self.graphs[key];
            graph.alive && graph.pool != live.pool
        })
    }

    /// The key of the `index`-th (modulo) replayable graph.
    pub(super) fn pick_graph(&self, index: u16) -> Option<u64> {
        let replayable: Vec<u64> = self
            .graphs
            .iter()
            .filter(|(_, g)| g.alive && g.id.is_some())
            .map(|(&key, _)| key)
            .collect();
        (!replayable.is_empty()).then(|| replayable[index as usize % replayable.len()])
    }

    pub(super) fn begin_capture(&mut self, stream: usize) -> Result<(), String> {
        let key = self.next_graph;
        self.next_graph += 1;
        let pool = PoolId(key, 0);
        self.allocator
            .begin_allocate_to_pool(pool)
            .map_err(|err| format!("begin_allocate_to_pool: {err}"))?;
        self.pool_ranges.insert(pool, Vec::new());
        self.device.begin_capture(self.streams[stream]);
        self.graphs.insert(
            key,
            Graph {
                id: None,
                pool,
                alive: true,
                last_replay: None,
                touchers: BTreeSet::new(),
                shares_memory_with: BTreeSet::new(),
            },
        );
        self.capture = Some((stream, key));
        Ok(())
    }

    pub(super) fn end_capture(&mut self) -> Result<(), String> {
        if let Some((stream, key)) = self.capture.take() {
            let id = self.device.end_capture(self.streams[stream]);
            let graph = self.graphs.get_mut(&key).expect("captured");
            graph.id = Some(id);
            self.allocator
                .end_allocate_to_pool(graph.pool)
                .map_err(|err| format!("end_allocate_to_pool: {err}"))?;
        }
        Ok(())
    }

    /// Replays graph `key` on `stream`, ordered after the eager work on its memory and the
    /// latest replays of every graph sharing that memory.
    pub(super) fn replay(&mut self, key: u64, stream: usize) -> Result<(), String> {
        let touched: Vec<usize> = (0..self.live.len())
            .filter(|&i| self.live[i].graphs.contains(&key))
            .collect();
        for earlier in self.replay_dependencies(key) {
            self.order(earlier, stream)?;
        }
        let id = self.graphs[&key].id.expect("replayable");
        self.device.replay(id, self.streams[stream]);
        // Like record_stream on the tensors a replay on another stream touched.
        for &i in &touched {
            if self.live[i].stream != stream {
                self.allocator
                    .record_use(self.live[i].ptr, self.streams[stream])
                    .map_err(|err| format!("record_use after replay: {err}"))?;
            }
        }
        let graph = self.graphs.get_mut(&key).expect("live");
        graph.last_replay = Some(stream);
        graph.touchers.clear();
        Ok(())
    }

    pub(super) fn destroy_graph(&mut self, key: u64) -> Result<(), String> {
        let graph = self.graphs.get_mut(&key).expect("live");
        graph.alive = false;
        let (id, pool) = (graph.id.expect("captured"), graph.pool);
        self.device.destroy_graph(id);
        self.release_pool(pool)
    }

    pub(super) fn release_pool(&mut self, pool: PoolId) -> Result<(), String> {
        let left = self
            .allocator
            .release_pool(pool)
            .map_err(|err| format!("release_pool({pool:?}): {err}"))?;
        if left != 0 {
            return Err(format!(
                "{pool:?} has {left} uses left after its last release"
            ));
        }
        self.pool_ranges.remove(&pool);
        Ok(())
    }
}
