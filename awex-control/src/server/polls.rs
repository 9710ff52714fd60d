//! The per-pair bound on long-polls: every request that waits (an event poll, a join waiting
//! for the other ranks, an update status or a kv read with `timeout_ms`) holds a permit of its
//! pair while it runs; beyond the pair's bound the request is refused with 503 at once, so one
//! pair's flood of waiting requests cannot pile up tasks and memory without end. A permit is
//! released when its request ends, including when the client goes away mid-wait (the handler is
//! dropped).

use crate::server::error::ApiError;
use crate::server::state::PairEntry;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

/// Long-polls per rank in the default bound (an event poll, a join or kv wait, an update wait,
/// and one to spare while a poll is being replaced).
pub(crate) const PER_RANK: usize = 4;
/// Long-polls on top of the ranks' in the default bound (controllers, operators, monitors).
pub(crate) const EXTRA: usize = 16;

/// The long-polls open on every pair, by pair id (one connect).
#[derive(Default)]
pub(crate) struct LongPolls {
    open: Mutex<HashMap<u64, usize>>,
}

/// One open long-poll; dropping it closes it.
pub(crate) struct Permit {
    polls: Arc<LongPolls>,
    id: u64,
}

impl LongPolls {
    /// A permit for one long-poll on `entry` waiting `wait_ms` (none is needed for a request
    /// that does not wait), or 503 when `limit` are open.
    pub(crate) fn enter(
        self: &Arc<Self>,
        entry: &PairEntry,
        limit: usize,
        wait_ms: u64,
    ) -> Result<Option<Permit>, ApiError> {
        if wait_ms == 0 {
            return Ok(None);
        }
        let mut open = self.open.lock().unwrap_or_else(|e| e.into_inner());
        let n = open.entry(entry.id).or_insert(0);
        if *n >= limit {
            let n = *n;
            drop(open);
            tracing::warn!(pair = %entry.name, open = n, limit, "refused a long-poll over the pair's bound");
            return Err(ApiError::Unavailable(format!(
                "pair `{}` has {n} long-polls open, its bound ({limit}); retry shortly (a client that polls without waiting for the answers should poll less)",
                entry.name
            )));
        }
        *n += 1;
        Ok(Some(Permit {
            polls: self.clone(),
            id: entry.id,
        }))
    }
}

impl Drop for Permit {
    fn drop(&mut self) {
        let mut open = self.polls.open.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(n) = open.get_mut(&self.id) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                open.remove(&self.id);
            }
        }
    }
}

/// The bound of a pair of `ranks` ranks: the configured one, else [`PER_RANK`] per rank plus
/// [`EXTRA`].
pub(crate) fn bound(configured: Option<usize>, ranks: usize) -> usize {
    configured.unwrap_or_else(|| ranks.saturating_mul(PER_RANK).saturating_add(EXTRA))
}
