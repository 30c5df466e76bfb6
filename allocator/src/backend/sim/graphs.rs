//! CUDA graphs on the simulated device: capture records launches instead of running them,
//! replay enqueues them again, each checked like a launch (see the module docs of
//! [`super`]).

use super::{Access, SimBackend};
use crate::types::StreamId;
use std::fmt;

/// A graph captured by [`SimBackend::end_capture`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct GraphId(pub u64);

impl fmt::Display for GraphId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// One launch recorded during capture.
#[derive(Clone, Debug)]
pub(super) struct CapturedOp {
    pub(super) label: String,
    pub(super) accesses: Vec<Access>,
    pub(super) duration_ns: u64,
}

/// A captured graph.
#[derive(Debug, Default)]
pub(super) struct SimGraph {
    ops: Vec<CapturedOp>,
    /// Replays enqueued so far, to number them in labels.
    replays: u64,
}

impl SimBackend {
    /// Turns the capture rules on or off for `stream` without recording a graph: launches
    /// still execute at once. [`SimBackend::begin_capture`] records one.
    ///
    /// # Panics
    /// If `stream` is recording a graph (end it with [`SimBackend::end_capture`]).
    pub fn set_capturing(&self, stream: StreamId, capturing: bool) {
        let mut state = self.state.lock();
        let index = state.stream_of(stream);
        assert!(
            !state.recording.contains_key(&index),
            "stream {index} records a graph: end_capture ends it"
        );
        if capturing {
            state.capturing.insert(index);
        } else {
            state.capturing.remove(&index);
        }
    }

    /// Starts capturing a graph on `stream` (`cudaStreamBeginCapture`): launches on it are
    /// recorded, not executed, until [`SimBackend::end_capture`], and the capture rules
    /// apply ([`Streams::is_capturing`](super::Streams::is_capturing) answers true).
    ///
    /// # Panics
    /// If `stream` is already capturing.
    pub fn begin_capture(&self, stream: StreamId) {
        let mut state = self.state.lock();
        let index = state.stream_of(stream);
        assert!(
            state.capturing.insert(index),
            "stream {index} is already capturing"
        );
        state.recording.insert(index, Vec::new());
    }

    /// Ends the capture on `stream` (`cudaStreamEndCapture`) and returns the graph.
    ///
    /// # Panics
    /// If `stream` is not recording a graph.
    pub fn end_capture(&self, stream: StreamId) -> GraphId {
        let mut state = self.state.lock();
        let index = state.stream_of(stream);
        let ops = state
            .recording
            .remove(&index)
            .unwrap_or_else(|| panic!("stream {index} is not recording a graph"));
        state.capturing.remove(&index);
        let id = state.next_graph;
        state.next_graph += 1;
        state.graphs.insert(id, SimGraph { ops, replays: 0 });
        GraphId(id)
    }

    /// Enqueues every operation of `graph`, in capture order, on `stream`
    /// (`cudaGraphLaunch`), each checked like a [`SimBackend::launch`] and labelled
    /// `replay N of graph G: <label>`.
    ///
    /// # Panics
    /// If `graph` does not exist (never captured, or destroyed).
    pub fn replay(&self, graph: GraphId, stream: StreamId) {
        let mut state = self.state.lock();
        let recorded = state
            .graphs
            .get_mut(&graph.0)
            .unwrap_or_else(|| panic!("graph {graph} does not exist"));
        recorded.replays += 1;
        let (replay, ops) = (recorded.replays, recorded.ops.clone());
        for op in ops {
            let label = format!("replay {replay} of graph {graph}: {}", op.label);
            state.launch(stream, &op.accesses, op.duration_ns, &label);
        }
    }

    /// Destroys `graph` (`cudaGraphExecDestroy`): it can no longer be replayed. Replays
    /// already enqueued still count as the work they are.
    ///
    /// # Panics
    /// If `graph` does not exist.
    pub fn destroy_graph(&self, graph: GraphId) {
        let removed = self.state.lock().graphs.remove(&graph.0);
        assert!(removed.is_some(), "graph {graph} does not exist");
    }

    /// Operations recorded in `graph` (`None` if it does not exist).
    pub fn graph_len(&self, graph: GraphId) -> Option<usize> {
        self.state.lock().graphs.get(&graph.0).map(|g| g.ops.len())
    }

    /// Graphs captured and not destroyed.
    pub fn live_graphs(&self) -> usize {
        self.state.lock().graphs.len()
    }
}
