//! The CUDA backend's trace clock: the kernel's coarse monotonic clock by default, the
//! time-stamp counter on request (`trace_clock`). Its own module because it is no driver
//! call: only the time base the engine stamps its trace with.

use crate::config::TraceClock;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

/// Trace timestamps, from the clock the configuration names ([`TraceClock`]):
/// - coarse (the default): a tick is a nanosecond of `CLOCK_MONOTONIC_COARSE`, which the
///   kernel updates once a tick (1–4 ms) and the vDSO reads in a few ns without a system
///   call;
/// - precise: on x86-64, a raw reading of the time-stamp counter, which the hot path stores
///   as read and [`Clock::ticks_to_ns`] scales to nanoseconds by a rate measured at
///   creation, only when the trace is read. `rdtsc` costs 16–20 ns on the GPU hosts (KVM
///   guests), against ~20 for `Instant::now`, and a malloc/free pair takes two timestamps.
///   Elsewhere, or where the counter cannot be calibrated, a tick is a nanosecond of
///   `Instant`.
///
/// Both read back as nanoseconds since the backend was created.
#[derive(Debug)]
pub(super) struct Clock {
    start: Instant,
    /// The coarse clock's reading at creation, in ns.
    coarse_start: u64,
    /// The precise clock is in use (set once, before the first reading).
    precise: AtomicBool,
    #[cfg(target_arch = "x86_64")]
    tsc: TscRate,
}

#[cfg(target_arch = "x86_64")]
#[derive(Debug)]
struct TscRate {
    start: u64,
    /// Nanoseconds per tick, in 32.32 fixed point; 0 if the counter is unusable.
    ns_per_tick_q32: u64,
}

/// `CLOCK_MONOTONIC_COARSE` in nanoseconds.
#[inline]
fn coarse_ns() -> u64 {
    let mut now = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `now` is a valid, writable timespec for the call.
    let code = unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC_COARSE, &mut now) };
    if code != 0 {
        return 0;
    }
    now.tv_sec as u64 * 1_000_000_000 + now.tv_nsec as u64
}

impl Clock {
    pub(super) fn new() -> Self {
        let start = Instant::now();
        let coarse_start = coarse_ns();
        let precise = AtomicBool::new(false);
        #[cfg(target_arch = "x86_64")]
        {
            let tsc_start = rdtsc();
            // Calibrate over ~2 ms: one-off, next to the ~100 ms of context creation.
            while start.elapsed().as_micros() < 2_000 {
                std::hint::spin_loop();
            }
            let (ticks, ns) = (
                rdtsc().wrapping_sub(tsc_start),
                start.elapsed().as_nanos() as u64,
            );
            let ns_per_tick_q32 = if ticks > 0 {
                ((u128::from(ns) << 32) / u128::from(ticks)) as u64
            } else {
                0
            };
            Self {
                start,
                coarse_start,
                precise,
                tsc: TscRate {
                    start: tsc_start,
                    ns_per_tick_q32,
                },
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        Self {
            start,
            coarse_start,
            precise,
        }
    }

    /// Switches to `clock`; set once, before the first reading.
    pub(super) fn set(&self, clock: TraceClock) {
        self.precise
            .store(clock == TraceClock::Precise, Ordering::Relaxed);
    }

    /// The raw reading: the coarse clock's nanoseconds, or (precise) the time-stamp
    /// counter or nanoseconds since creation.
    #[inline]
    pub(super) fn now_ticks(&self) -> u64 {
        if !self.precise.load(Ordering::Relaxed) {
            return coarse_ns();
        }
        #[cfg(target_arch = "x86_64")]
        if self.tsc.ns_per_tick_q32 != 0 {
            return rdtsc();
        }
        self.precise_ns()
    }

    /// Nanoseconds since creation, read from `Instant` whatever the trace clock.
    pub(super) fn precise_ns(&self) -> u64 {
        self.start.elapsed().as_nanos() as u64
    }

    /// Nanoseconds since creation at the reading `ticks`.
    pub(super) fn ticks_to_ns(&self, ticks: u64) -> u64 {
        if !self.precise.load(Ordering::Relaxed) {
            return ticks.saturating_sub(self.coarse_start);
        }
        #[cfg(target_arch = "x86_64")]
        if self.tsc.ns_per_tick_q32 != 0 {
            // A core whose counter lags the creating core's reads as the start.
            let ticks = ticks.saturating_sub(self.tsc.start);
            return ((u128::from(ticks) * u128::from(self.tsc.ns_per_tick_q32)) >> 32) as u64;
        }
        ticks
    }
}

#[cfg(target_arch = "x86_64")]
#[inline]
fn rdtsc() -> u64 {
    // SAFETY: RDTSC is available on every x86-64 CPU and has no memory effects.
    #[allow(unused_unsafe)]
    unsafe {
        core::arch::x86_64::_rdtsc()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What `clock` measures of `ms` milliseconds of spinning.
    fn measure(clock: &Clock, ms: u128) -> u64 {
        let a = clock.ticks_to_ns(clock.now_ticks());
        let begin = Instant::now();
        while begin.elapsed().as_millis() < ms {
            std::hint::spin_loop();
        }
        let b = clock.ticks_to_ns(clock.now_ticks());
        assert!(b >= a, "the clock went back: {a} then {b}");
        b - a
    }

    #[test]
    fn the_precise_clock_is_monotonic_and_close_to_instant() {
        let clock = Clock::new();
        clock.set(TraceClock::Precise);
        let elapsed = measure(&clock, 5);
        assert!(
            (4_000_000..50_000_000).contains(&elapsed),
            "5 ms measured as {elapsed} ns"
        );
    }

    #[test]
    fn the_coarse_clock_is_monotonic_and_right_to_a_tick() {
        let clock = Clock::new();
        clock.set(TraceClock::Coarse);
        // A kernel tick is at most 10 ms (HZ=100).
        let elapsed = measure(&clock, 50);
        assert!(
            (40_000_000..500_000_000).contains(&elapsed),
            "50 ms measured as {elapsed} ns"
        );
    }
}
