//! Fences: events a stream records now and then as it frees blocks, so that another stream
//! taking one of those blocks waits on the device only for the work queued up to the free
//! — or not at all, once the fence is seen complete — instead of for everything queued on
//! the owner since.
//!
//! Without fences, a block freed by stream `s` and taken by stream `t` needs `t` to wait for
//! an event recorded on `s` at the moment of the take: every kernel `s` has queued since the
//! free, however unrelated (the next all-gather FSDP prefetched, say), then runs before
//! `t`'s next kernel, and the overlap the program arranged is lost.
//!
//! # Epochs
//! Each stream counts *epochs*: a block freed on it carries the epoch of its free
//! ([`Fences::epoch`]). Recording a fence covers the current epoch (everything queued so
//! far, so every block freed up to now) and starts the next. When a fence is seen complete,
//! every block freed in an epoch it covers is *idle*: no stream can still be using it, and
//! any stream may take it without waiting. Epoch 0 marks memory never used (fresh pages).
//! Epochs are 32 bits and compared with wrapping arithmetic; a comparison that wrapped
//! past half the range answers "not idle", which only costs a wait.

use super::EventKey;
use std::collections::VecDeque;

/// Fences in flight per stream that a slow path records at most (a take of an uncovered
/// block records one whatever the count).
const MAX_IN_FLIGHT: usize = 2;

/// What stream `t` must wait for to take a block another stream freed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum OwnerWork {
    /// Nothing: the owner's work up to the free has completed.
    Done,
    /// This fence, recorded on the owner after the free.
    Fence(EventKey),
    /// No fence covers the free yet: everything queued on the owner so far.
    Unfenced,
}

/// One stream's fences and free epochs.
#[derive(Debug)]
pub(crate) struct Fences {
    /// The epoch of frees made now.
    epoch: u32,
    /// Frees since the newest fence.
    frees_since: u32,
    /// Fences recorded and not yet seen complete, oldest first, each with the epoch it
    /// covers (frees in it or before it).
    in_flight: VecDeque<(EventKey, u32)>,
    /// Blocks freed in an epoch before this one are idle.
    idle_before: u32,
    /// The stream may be destroyed by its owner while blocks freed on it are cached (a
    /// library's own stream, not one of PyTorch's pool): every free records its fence at
    /// once, while the stream surely lives, and nothing records on it later.
    volatile: bool,
}

impl Default for Fences {
    fn default() -> Self {
        Self {
            epoch: 1,
            frees_since: 0,
            in_flight: VecDeque::new(),
            idle_before: 1,
            volatile: false,
        }
    }
}

/// True if epoch `a` comes after epoch `b` (wrapping).
#[inline]
fn after(a: u32, b: u32) -> bool {
    (a.wrapping_sub(b) as i32) > 0
}

/// The later of two free epochs (0, memory never used, is the earliest): what a block
/// merged from two free blocks carries.
#[inline]
pub(crate) fn later_epoch(a: u32, b: u32) -> u32 {
    match (a, b) {
        (0, other) | (other, 0) => other,
        _ if after(a, b) => a,
        _ => b,
    }
}

impl Fences {
    /// The epoch a block freed now carries.
    #[inline]
    pub(crate) fn epoch(&self) -> u32 {
        self.epoch
    }

    /// Counts a free; true if the free should record a fence: none is in flight. So a
    /// stream that frees and allocates on its own records one fence and then nothing until
    /// a slow path has seen it complete: the fast path stays free of driver calls.
    #[inline]
    pub(crate) fn note_free(&mut self) -> bool {
        self.frees_since = self.frees_since.saturating_add(1);
        self.in_flight.is_empty() || self.volatile
    }

    /// Makes the stream [volatile](Fences::is_volatile).
    pub(crate) fn set_volatile(&mut self) {
        self.volatile = true;
    }

    /// True if the stream may be destroyed while blocks freed on it are cached: each free
    /// fences itself, no slow path records on the stream, and a take its fences do not
    /// cover synchronises the device instead.
    #[inline]
    pub(crate) fn is_volatile(&self) -> bool {
        self.volatile
    }

    /// True if a slow path should record a fence: frees since the newest, and fewer than
    /// [`MAX_IN_FLIGHT`] in flight.
    pub(crate) fn wants_fence(&self) -> bool {
        self.frees_since > 0 && self.in_flight.len() < MAX_IN_FLIGHT && !self.volatile
    }

    /// Registers `event`, just recorded on the stream: it covers the current epoch, and
    /// frees from now on are in the next.
    pub(crate) fn push(&mut self, event: EventKey) {
        self.in_flight.push_back((event, self.epoch));
        self.epoch = self.epoch.wrapping_add(1).max(1);
        self.frees_since = 0;
    }

    /// True if a block freed in epoch `freed` is idle: its owner's work up to the free has
    /// completed.
    #[inline]
    pub(crate) fn is_idle(&self, freed: u32) -> bool {
        freed == 0 || after(self.idle_before, freed)
    }

    /// What another stream must wait for to take a block freed in epoch `freed`.
    pub(crate) fn work_for(&self, freed: u32) -> OwnerWork {
        if self.is_idle(freed) {
            return OwnerWork::Done;
        }
        self.in_flight
            .iter()
            .find(|&&(_, covered)| !after(freed, covered))
            .map_or(OwnerWork::Unfenced, |&(event, _)| OwnerWork::Fence(event))
    }

    /// True if a completion or fence pass has anything to do here: fences in flight, or
    /// frees no fence covers yet.
    pub(crate) fn busy(&self) -> bool {
        !self.in_flight.is_empty() || self.frees_since > 0
    }

    /// The oldest fence in flight.
    pub(crate) fn oldest(&self) -> Option<EventKey> {
        self.in_flight.front().map(|&(event, _)| event)
    }

    /// The oldest fence completed: the blocks it covers are idle. Returns its event, for
    /// the caller to release.
    pub(crate) fn complete_oldest(&mut self) -> Option<EventKey> {
        let (event, covered) = self.in_flight.pop_front()?;
        self.idle_before = covered.wrapping_add(1).max(1);
        Some(event)
    }

    /// The device was synchronised: every block freed so far is idle, and every fence in
    /// flight is returned for the caller to release.
    pub(crate) fn synchronised(&mut self) -> impl Iterator<Item = EventKey> + '_ {
        self.idle_before = self.epoch.wrapping_add(1).max(1);
        self.epoch = self.idle_before;
        self.frees_since = 0;
        self.in_flight.drain(..).map(|(event, _)| event)
    }

    /// The fences in flight, for the invariants' event count.
    pub(crate) fn events(&self) -> impl Iterator<Item = EventKey> + '_ {
        self.in_flight.iter().map(|&(event, _)| event)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_fence_covers_the_frees_before_it_and_makes_them_idle_once_complete() {
        let mut fences = Fences::default();
        let before = fences.epoch();
        assert_eq!(fences.work_for(before), OwnerWork::Unfenced);
        assert_eq!(fences.work_for(0), OwnerWork::Done, "memory never used");
        fences.push(7);
        let after_fence = fences.epoch();
        assert_eq!(fences.work_for(before), OwnerWork::Fence(7));
        assert_eq!(fences.work_for(after_fence), OwnerWork::Unfenced);
        fences.push(8);
        assert_eq!(fences.work_for(after_fence), OwnerWork::Fence(8));
        assert_eq!(fences.complete_oldest(), Some(7));
        assert_eq!(fences.work_for(before), OwnerWork::Done);
        assert_eq!(fences.work_for(after_fence), OwnerWork::Fence(8));
        let events: Vec<_> = fences.synchronised().collect();
        assert_eq!(events, [8]);
        assert_eq!(fences.work_for(after_fence), OwnerWork::Done);
        assert_eq!(fences.work_for(fences.epoch()), OwnerWork::Unfenced);
    }

    #[test]
    fn frees_record_a_fence_when_none_is_in_flight_and_slow_paths_a_second() {
        let mut fences = Fences::default();
        assert!(!fences.wants_fence(), "nothing freed");
        assert!(fences.note_free(), "none in flight");
        fences.push(1);
        assert!((0..100).all(|_| !fences.note_free()));
        assert!(fences.wants_fence());
        fences.push(2);
        assert!(!fences.wants_fence(), "two in flight");
        fences.complete_oldest();
        assert!(!fences.wants_fence(), "no free since the newest");
        assert!(!fences.note_free());
        assert!(fences.wants_fence());
    }

    #[test]
    fn a_volatile_stream_fences_every_free_and_never_a_slow_path() {
        let mut fences = Fences::default();
        fences.set_volatile();
        for event in 1..5 {
            assert!(fences.note_free(), "free {event} fences itself");
            fences.push(event);
            assert!(
                !fences.wants_fence(),
                "nothing left for a slow path to record"
            );
        }
        assert!(fences.note_free());
        assert!(!fences.wants_fence(), "not even when a free's fence failed");
    }

    #[test]
    fn epochs_wrap_and_skip_zero() {
        let mut fences = Fences {
            epoch: u32::MAX,
            ..Fences::default()
        };
        fences.idle_before = u32::MAX;
        fences.push(1);
        assert_eq!(fences.epoch(), 1, "0 is reserved for memory never used");
        assert_eq!(fences.work_for(u32::MAX), OwnerWork::Fence(1));
        fences.complete_oldest();
        assert!(fences.is_idle(u32::MAX));
        assert!(!fences.is_idle(1));
        assert_eq!(later_epoch(u32::MAX, 1), 1);
        assert_eq!(later_epoch(0, 5), 5);
    }
}
