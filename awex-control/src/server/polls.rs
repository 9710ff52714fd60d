//! The per-pair bound on long-polls: every request that waits (an event poll, a join waiting
//! for the other ranks, an update status or a kv read with `timeout_ms`) holds a permit of its
//! pair while it runs; beyond the pair's bound the request is refused with 503 at once, so one
//! pair's flood of waiting requests cannot pile up tasks and memory without end. Event polls
//! of a rank's live holder (naming its claim id) count in that rank's own pool instead, so a
//! flood of other requests does not cut the ranks off their work. A permit is
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

/// The long-polls open on every pair, by pair id (one connect) and pool: the pair's shared
/// pool (`None`), or one rank slot's own (`Some(slot)`: event polls of that slot's live holder,
/// which names its claim id), so that a flood of other requests cannot take the event polls
/// that keep a pair's ranks live and hand them their work.
#[derive(Default)]
pub(crate) struct LongPolls {
    open: Mutex<HashMap<(u64, Option<usize>), usize>>,
}

/// One open long-poll; dropping it closes it.
pub(crate) struct Permit {
    polls: Arc<LongPolls>,
    key: (u64, Option<usize>),
}

impl LongPolls {
    /// A permit for one long-poll on `entry` waiting `wait_ms` (none is needed for a request
    /// that does not wait), or 503 when `limit` are open.
    /// `slot`: the request is an event poll of that rank slot's live holder, counted in the
    /// slot's own pool of [`PER_RANK`] instead of the pair's shared one.
    pub(crate) fn enter(
        self: &Arc<Self>,
        entry: &PairEntry,
        limit: usize,
        wait_ms: u64,
        slot: Option<usize>,
    ) -> Result<Option<Permit>, ApiError> {
        if wait_ms == 0 {
            return Ok(None);
        }
        let limit = if slot.is_some() { PER_RANK } else { limit };
        let key = (entry.id, slot);
        let mut open = self.open.lock().unwrap_or_else(|e| e.into_inner());
        let n = open.entry(key).or_insert(0);
        if *n >= limit {
            let n = *n;
            drop(open);
            tracing::warn!(pair = %entry.name, open = n, limit, ?slot, "refused a long-poll over its bound");
            let whose = match slot {
                Some(i) => format!(
                    "a rank of pair `{}` (slot {i}) has {n} event polls open, its own bound ({limit})",
                    entry.name
                ),
                None => format!(
                    "pair `{}` has {n} long-polls open, its bound ({limit})",
                    entry.name
                ),
            };
            return Err(ApiError::Unavailable(format!(
                "{whose}; retry shortly (a client that polls without waiting for the answers should poll less)"
            )));
        }
        *n += 1;
        Ok(Some(Permit {
            polls: self.clone(),
            key,
        }))
    }
}

impl Drop for Permit {
    fn drop(&mut self) {
        let mut open = self.polls.open.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(n) = open.get_mut(&self.key) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                open.remove(&self.key);
            }
        }
    }
}

/// The bound of a pair of `ranks` ranks: the configured one, else [`PER_RANK`] per rank plus
/// [`EXTRA`].
pub(crate) fn bound(configured: Option<usize>, ranks: usize) -> usize {
    configured.unwrap_or_else(|| ranks.saturating_mul(PER_RANK).saturating_add(EXTRA))
}
