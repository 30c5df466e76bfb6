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

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, MutexGuard};
use std::thread::ThreadId;
use streamalloc_allocator::PoolId;

/// One pool being allocated to through the pluggable door: begun on `device` by `thread`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Route {
    pub(crate) device: i32,
    pub(crate) pool: PoolId,
    pub(crate) thread: ThreadId,
}

/// The pools a registry's pluggable door is allocating to, oldest first. PyTorch's
/// pluggable hooks say "allocate to this pool" and "stop", not which requests: where a
/// request goes is the registry's state (see `ffi::pools` for the rule's reasons).
#[derive(Debug)]
pub(crate) struct Routes {
    list: Mutex<Vec<Route>>,
    /// `list.len()`, read without the lock by every malloc.
    active: AtomicUsize,
}

impl Routes {
    pub(crate) const fn new() -> Self {
        Self {
            list: Mutex::new(Vec::new()),
            active: AtomicUsize::new(0),
        }
    }

    /// True while some pool is being allocated to.
    #[inline]
    pub(crate) fn active(&self) -> bool {
        self.active.load(Ordering::Acquire) != 0
    }

    /// Starts routing to `route.pool` (the newest route wins).
    pub(crate) fn begin(&self, route: Route) {
        let mut list = self.lock();
        list.push(route);
        self.active.store(list.len(), Ordering::Release);
    }

    /// Stops the newest route to `pool` on `device`, if any.
    pub(crate) fn end(&self, device: i32, pool: PoolId) {
        let mut list = self.lock();
        if let Some(index) = list
            .iter()
            .rposition(|route| route.device == device && route.pool == pool)
        {
            list.remove(index);
        }
        self.active.store(list.len(), Ordering::Release);
    }

    /// The pool a request of `thread` on `device` goes to, if any: see [`choose_route`].
    /// `capturing` says whether the request's stream is capturing a graph.
    pub(crate) fn choose(
        &self,
        device: i32,
        thread: ThreadId,
        capturing: impl FnOnce() -> Result<bool, String>,
    ) -> Result<Option<PoolId>, String> {
        choose_route(&self.lock(), device, thread, capturing)
    }

    /// The routes; a panic while they were held cannot have left them half-updated (each
    /// change is one push or remove), so a poisoned lock is used as it is.
    fn lock(&self) -> MutexGuard<'_, Vec<Route>> {
        self.list
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

/// The routing rule: the newest route of `device` begun by `thread`; otherwise, if the
/// stream is capturing (asked only then: it is a driver call), the newest route of
/// `device`.
fn choose_route(
    routes: &[Route],
    device: i32,
    thread: ThreadId,
    capturing: impl FnOnce() -> Result<bool, String>,
) -> Result<Option<PoolId>, String> {
    let on_device = || routes.iter().filter(|route| route.device == device);
    if let Some(route) = on_device().rfind(|route| route.thread == thread) {
        return Ok(Some(route.pool));
    }
    let Some(newest) = on_device().next_back() else {
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
                device: 0,
                pool: graph,
                thread: elsewhere,
            },
            Route {
                device: 0,
                pool: user,
                thread: here,
            },
            Route {
                device: 1,
                pool: PoolId(9, 9),
                thread: here,
            },
        ];
        let never = || -> Result<bool, String> { panic!("asked the driver needlessly") };
        assert_eq!(choose_route(&routes, 0, here, never), Ok(Some(user)));
        assert_eq!(
            choose_route(&routes[..1], 0, here, || Ok(true)),
            Ok(Some(graph))
        );
        assert_eq!(choose_route(&routes[..1], 0, here, || Ok(false)), Ok(None));
        assert_eq!(choose_route(&routes, 2, here, never), Ok(None));
        assert_eq!(
            choose_route(&routes[..1], 0, here, || Err("no driver".into())),
            Err("no driver".into())
        );
    }
}
