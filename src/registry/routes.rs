//! Where the pluggable door's requests go while pools are being allocated to.
//!
//! PyTorch's pluggable hooks say "allocate to this pool" and "stop", not which requests:
//! where a request goes is the registry's state. PyTorch hands `beginAllocateToPool` a C++
//! `std::function` filter that C cannot call, so the rule stands for what the filter
//! stands for: a request from the thread that began the pool, or on any stream being
//! captured into a graph, goes to that pool. That covers graph capture (the capturing
//! thread; side streams joined to the capture) and `torch.cuda.use_mem_pool` (the thread),
//! and errs towards the pool: an allocation wrongly kept in a pool costs memory, one
//! wrongly kept out of a graph's pool costs data. The native door evaluates the real
//! filters and never routes.

use super::{CallError, Device};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, MutexGuard};
use std::thread::ThreadId;
use streamalloc_allocator::{Backend, PoolId};

impl<B: Backend> Device<B> {
    /// PyTorch's pluggable `beginAllocateToPool`: begins allocating to `pool`
    /// (`Allocator::begin_allocate_to_pool`) and routes this thread's requests, and those
    /// on capturing streams, to it until [`Device::end_routing`]. Returns the pool's use
    /// count.
    pub fn begin_routing(&self, pool: PoolId) -> Result<u32, CallError> {
        let uses = self.run(|allocator| allocator.begin_allocate_to_pool(pool))??;
        self.routes.begin(pool);
        Ok(uses)
    }

    /// PyTorch's pluggable `endAllocateToPool`: requests stop going to `pool`, whose memory
    /// stays reserved for it until released.
    pub fn end_routing(&self, pool: PoolId) -> Result<(), CallError> {
        self.routes.end(pool);
        Ok(self.run(|allocator| allocator.end_allocate_to_pool(pool))??)
    }
}

/// One pool being allocated to through the pluggable door, begun by `thread`.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Route {
    pool: PoolId,
    thread: ThreadId,
}

/// The pools a device's pluggable door is allocating to, oldest first (see the module
/// docs).
#[derive(Debug, Default)]
pub(super) struct Routes {
    list: Mutex<Vec<Route>>,
    /// `list.len()`, read without the lock by every malloc.
    active: AtomicUsize,
}

impl Routes {
    /// Starts routing this thread's requests, and those on capturing streams, to `pool`
    /// (the newest route wins).
    pub(super) fn begin(&self, pool: PoolId) {
        let mut list = self.lock();
        list.push(Route {
            pool,
            thread: std::thread::current().id(),
        });
        self.active.store(list.len(), Ordering::Release);
    }

    /// Stops the newest route to `pool`, if any.
    pub(super) fn end(&self, pool: PoolId) {
        let mut list = self.lock();
        if let Some(index) = list.iter().rposition(|route| route.pool == pool) {
            list.remove(index);
        }
        self.active.store(list.len(), Ordering::Release);
    }

    /// The pool a request of this thread is routed to, `None` for the default pool: one
    /// load while nothing is being allocated to, so that a caller goes straight to the
    /// default pool's code, else what [`choose_route`] says. `capturing` says whether the
    /// request's stream is capturing a graph.
    #[inline]
    pub(super) fn route<E>(
        &self,
        capturing: impl FnOnce() -> Result<bool, E>,
    ) -> Result<Option<PoolId>, E> {
        if self.active.load(Ordering::Acquire) == 0 {
            return Ok(None);
        }
        self.choose(capturing)
    }

    #[cold]
    fn choose<E>(&self, capturing: impl FnOnce() -> Result<bool, E>) -> Result<Option<PoolId>, E> {
        choose_route(&self.lock(), std::thread::current().id(), capturing)
    }

    /// The routes; a panic while they were held cannot have left them half-updated (each
    /// change is one push or remove), so a poisoned lock is used as it is.
    fn lock(&self) -> MutexGuard<'_, Vec<Route>> {
        self.list
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

/// The routing rule: the newest route begun by `thread`; otherwise, if the stream is
/// capturing (asked only then: it is a driver call), the newest route.
fn choose_route<E>(
    routes: &[Route],
    thread: ThreadId,
    capturing: impl FnOnce() -> Result<bool, E>,
) -> Result<Option<PoolId>, E> {
    if let Some(route) = routes.iter().rfind(|route| route.thread == thread) {
        return Ok(Some(route.pool));
    }
    let Some(newest) = routes.last() else {
        return Ok(None);
    };
    Ok(capturing()?.then_some(newest.pool))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_pluggable_door_routes_the_beginning_thread_and_capturing_streams() {
        let here = std::thread::current().id();
        let elsewhere = std::thread::spawn(|| std::thread::current().id())
            .join()
            .unwrap();
        let (graph, user) = (PoolId(1, 0), PoolId(0, 2));
        let routes = [
            Route {
                pool: graph,
                thread: elsewhere,
            },
            Route {
                pool: user,
                thread: here,
            },
        ];
        let never = || -> Result<bool, String> { panic!("asked the driver needlessly") };
        assert_eq!(choose_route(&routes, here, never), Ok(Some(user)));
        assert_eq!(
            choose_route(&routes[..1], here, || Ok::<_, String>(true)),
            Ok(Some(graph))
        );
        assert_eq!(
            choose_route(&routes[..1], here, || Ok::<_, String>(false)),
            Ok(None)
        );
        assert_eq!(choose_route(&[], here, never), Ok(None));
        assert_eq!(
            choose_route(&routes[..1], here, || Err("no driver".to_string())),
            Err("no driver".to_string())
        );
    }

    #[test]
    fn nothing_is_routed_once_every_route_ended() {
        let routes = Routes::default();
        let never = || -> Result<bool, String> { panic!("asked the driver needlessly") };
        assert_eq!(routes.route(never), Ok(None));
        routes.begin(PoolId(3, 1));
        routes.begin(PoolId(3, 2));
        assert_eq!(routes.route(never), Ok(Some(PoolId(3, 2))));
        routes.end(PoolId(3, 2));
        assert_eq!(routes.route(never), Ok(Some(PoolId(3, 1))));
        routes.end(PoolId(3, 1));
        assert_eq!(routes.route(never), Ok(None));
    }
}
