//! Giving freed memory back to the system. glibc's allocator keeps the pages of freed blocks
//! (a pair's request, roster and rendezvous values, a refused connect's parsed body) unless
//! told otherwise: a gateway that connected and forgot thousands of pairs kept twice its
//! starting size. Whatever frees a pair's bulk calls [`Trim::freed`]; one task, at most once per
//! [`Trim::DELAY`], then asks the allocator to return its free pages (`malloc_trim`). Counted by
//! `awex_gateway_memory_trims_total`.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

/// Coalesces the gateway's requests to give memory back.
#[derive(Default)]
pub(crate) struct Trim {
    /// A trim is scheduled (the next `freed` need not schedule another).
    scheduled: AtomicBool,
    /// Trims done.
    pub(crate) done: AtomicU64,
}

impl Trim {
    /// How long a trim waits after the first release it covers (releases meanwhile join it).
    pub(crate) const DELAY: Duration = Duration::from_millis(500);

    /// Notes that a pair's bulk (or a large request) was freed: schedules one trim unless one
    /// is scheduled. Needs a Tokio runtime (every handler has one).
    pub(crate) fn freed(self: &Arc<Self>) {
        if self.scheduled.swap(true, Ordering::AcqRel) {
            return;
        }
        let me = Arc::downgrade(self);
        tokio::spawn(async move {
            tokio::time::sleep(Self::DELAY).await;
            let Some(me) = me.upgrade() else { return };
            // cleared before the trim: a release during it schedules the next one
            me.scheduled.store(false, Ordering::Release);
            // the trim walks the heap (milliseconds for a large one): off the async workers
            let _ = tokio::task::spawn_blocking(give_back).await;
            me.done.fetch_add(1, Ordering::Relaxed);
        });
    }

    /// Calls [`Trim::freed`] when dropped (at the end of a handler, whichever way it returns).
    pub(crate) fn on_drop(self: &Arc<Self>) -> OnDrop {
        OnDrop(self.clone())
    }
}

/// See [`Trim::on_drop`].
pub(crate) struct OnDrop(Arc<Trim>);

impl Drop for OnDrop {
    fn drop(&mut self) {
        self.0.freed();
    }
}

/// Returns the allocator's free pages to the system.
fn give_back() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only releases free memory of the process's own heap.
    unsafe {
        libc::malloc_trim(0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn settle() {
        // lets the spawned task and its blocking trim run (paused clock: no real wait)
        for _ in 0..50 {
            tokio::task::yield_now().await;
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    }

    #[tokio::test(start_paused = true)]
    async fn releases_close_together_share_one_trim_and_a_later_release_gets_its_own() {
        let t = Arc::new(Trim::default());
        for _ in 0..5 {
            t.freed();
        }
        assert_eq!(t.done.load(Ordering::Relaxed), 0, "not before the delay");
        tokio::time::sleep(Trim::DELAY).await;
        settle().await;
        assert_eq!(t.done.load(Ordering::Relaxed), 1);
        drop(t.on_drop());
        tokio::time::sleep(Trim::DELAY).await;
        settle().await;
        assert_eq!(t.done.load(Ordering::Relaxed), 2);
        settle().await;
        assert_eq!(t.done.load(Ordering::Relaxed), 2, "nothing freed: no trim");
    }
}
