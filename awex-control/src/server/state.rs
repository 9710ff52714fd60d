//! The gateway's state: every pair's entry (its immutable description, its mutable state behind
//! a mutex, the channels waiters watch) and the gateway that holds them. Handlers live in
//! `routes`; the data structures the state is made of live in `store`.

use crate::server::config::GatewayConfig;
use crate::server::engine::{EngineClient, EngineCmd, EngineLane};
use crate::server::error::ApiError;
use crate::server::polls::{self, LongPolls, Permit};
use crate::server::store::events::EventLog;
use crate::server::store::kv::KvStore;
use crate::server::store::metrics::Metrics;
use crate::server::store::roster::{Roster, Slots};
pub(crate) use crate::server::store::unix_ms;
use crate::server::store::updates::{RankDetail, Update, Updates};
use crate::server::validate;
use crate::wire::{ConnectRequest, EventKind, PairState, PairStatus, SideStatus, UpdateStatus};
use std::collections::HashMap;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex, MutexGuard, RwLock};
use tokio::sync::watch;
use tokio::time::Instant;

/// The shared state behind every handler.
pub(crate) struct Gateway {
    pub(crate) config: GatewayConfig,
    pub(crate) pairs: RwLock<HashMap<String, Arc<PairEntry>>>,
    pub(crate) metrics: Arc<Metrics>,
    pub(crate) engines: EngineClient,
    pub(crate) next_id: AtomicU64,
    /// Every pair's open long-polls.
    pub(crate) long_polls: Arc<LongPolls>,
    /// Connect validations running at once (CPU-bound, on the blocking pool): one core fewer
    /// than the machine has, so the async workers always find a core for `/healthz` and the
    /// long-polls.
    pub(crate) validations: tokio::sync::Semaphore,
}

/// How many connect validations may run at once: one fewer than the cores, at least one.
pub(crate) fn validation_slots() -> usize {
    std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .saturating_sub(1)
        .max(1)
}

/// State type of the router.
pub(crate) type AppState = Arc<Gateway>;

/// The mutable state of a pair, behind the entry's mutex.
pub(crate) struct Pair {
    pub(crate) state: PairState,
    pub(crate) join_error: Option<String>,
    pub(crate) roster: Roster,
    pub(crate) kv: KvStore,
    pub(crate) updates: Updates,
    pub(crate) events: EventLog,
    /// Engine errors outside an update (warm-up), kept for the status.
    pub(crate) engine_errors: Vec<String>,
}

/// A registered pair: its immutable description, its state, and the channels waiters watch.
pub(crate) struct PairEntry {
    pub(crate) name: String,
    pub(crate) id: u64,
    /// Unique id of this connect (random hex), in status and the join answer.
    pub(crate) uid: String,
    /// The data-plane secret (random hex): only in the join answer (behind the bearer token).
    pub(crate) secret: String,
    pub(crate) request: ConnectRequest,
    pub(crate) slots: Slots,
    pub(crate) created_unix_ms: u64,
    pub(crate) join_deadline: Instant,
    pub(crate) training: SideStatus,
    pub(crate) inference: SideStatus,
    pub(crate) inner: Mutex<Pair>,
    /// Fires when the pair leaves `joining` (ready, join failed, disconnected).
    pub(crate) roster_tx: watch::Sender<()>,
    /// Carries the last event seq; fires on every event.
    pub(crate) events_tx: watch::Sender<u64>,
    /// Fires on every rendezvous value written.
    pub(crate) kv_tx: watch::Sender<()>,
    /// Fires when an update starts or finishes.
    pub(crate) update_tx: watch::Sender<()>,
    pub(crate) metrics: Arc<Metrics>,
    pub(crate) engines: Option<EngineLane>,
}

impl PairEntry {
    /// The status document of one of this pair's updates.
    pub(crate) fn update_status(&self, u: &Update, detail: RankDetail) -> UpdateStatus {
        u.status(
            &self.name,
            &self.slots,
            self.request.options.checksums,
            detail,
        )
    }

    /// Locks the pair's state (a poisoned lock still holds consistent data: no handler panics).
    pub(crate) fn lock(&self) -> MutexGuard<'_, Pair> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The pair's state.
    pub(crate) fn state(&self) -> PairState {
        self.lock().state
    }

    /// Appends an event and wakes the event long-polls.
    pub(crate) fn publish(
        &self,
        p: &mut Pair,
        kind: EventKind,
        version: Option<u64>,
        attempt: Option<u32>,
        reason: Option<String>,
    ) {
        let seq = p.events.push(kind, version, attempt, reason);
        self.events_tx.send_replace(seq);
    }

    /// Queues a call to every engine (no-op without engine URLs).
    pub(crate) fn engine_cmd(&self, cmd: EngineCmd) {
        if let Some(lane) = &self.engines {
            lane.send(cmd);
        }
    }

    /// Fails the join if its deadline passed while ranks were missing.
    pub(crate) fn enforce_join_deadline(&self) {
        let mut p = self.lock();
        if p.state != PairState::Joining || Instant::now() < self.join_deadline {
            return;
        }
        let missing = p.roster.describe_missing(&self.slots);
        tracing::warn!(pair = %self.name, missing = %missing, "join deadline passed; pair join_failed");
        p.state = PairState::JoinFailed;
        p.join_error = Some(format!(
            "join deadline of {} ms passed with {} of {} ranks joined; missing: {missing}",
            self.request.options.join_deadline_ms,
            p.roster.joined(),
            self.slots.total()
        ));
        drop(p);
        self.roster_tx.send_replace(());
    }

    /// Disconnects: fails a running update, publishes `disconnect`, wakes every waiter.
    pub(crate) fn disconnect(&self) {
        let mut p = self.lock();
        if p.state == PairState::Disconnected {
            return;
        }
        self.fail_running_update(&mut p, "the pair was disconnected".to_string());
        p.state = PairState::Disconnected;
        tracing::info!(pair = %self.name, id = self.id, "pair disconnected");
        self.publish(&mut p, EventKind::Disconnect, None, None, None);
        drop(p);
        self.roster_tx.send_replace(());
        self.kv_tx.send_replace(());
        self.update_tx.send_replace(());
    }

    /// The status document.
    pub(crate) fn status(&self) -> PairStatus {
        let p = self.lock();
        let (joined_t, joined_i) = p.roster.joined_per_side(&self.slots);
        PairStatus {
            name: self.name.clone(),
            id: self.id,
            uid: self.uid.clone(),
            state: p.state,
            serving_version: p.updates.committed(),
            current_update: p
                .updates
                .latest()
                .map(|u| self.update_status(u, RankDetail::None)),
            training: SideStatus {
                joined: joined_t,
                ..self.training.clone()
            },
            inference: SideStatus {
                joined: joined_i,
                ..self.inference.clone()
            },
            transport: self.request.transport,
            options: self.request.options.clone(),
            joined: p.roster.joined() as u32,
            world_size: self.slots.total() as u32,
            roster: p.roster.ranks(&self.slots),
            join_error: p.join_error.clone(),
            created_unix_ms: self.created_unix_ms,
            last_event_seq: p.events.last_seq(),
            torn_version: p.updates.torn(),
            serving_torn_version: p.updates.serving_torn(),
            engine_errors: p.engine_errors.clone(),
        }
    }
}

impl Gateway {
    /// A permit for one long-poll on `entry` waiting `wait_ms`, or 503 over the pair's bound.
    pub(crate) fn long_poll(
        &self,
        entry: &PairEntry,
        wait_ms: u64,
    ) -> Result<Option<Permit>, ApiError> {
        let limit = polls::bound(self.config.max_long_polls_per_pair, entry.slots.total());
        self.long_polls.enter(entry, limit, wait_ms)
    }

    /// The pair of that name (live or recently disconnected), or 400/404.
    pub(crate) fn pair(&self, name: &str) -> Result<Arc<PairEntry>, ApiError> {
        validate::name("pair name", name)?;
        self.pairs
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .get(name)
            .cloned()
            .ok_or_else(|| ApiError::no_pair(name))
    }
}
