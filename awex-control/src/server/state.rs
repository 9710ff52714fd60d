//! The gateway's state: every pair's entry (its immutable description, its mutable state behind
//! a mutex, the channels waiters watch) and the gateway that holds them. Handlers live in
//! `routes`, the update lifecycle in `lifecycle`; the data structures the state is made of live
//! in `store`.

use crate::server::config::GatewayConfig;
use crate::server::engine::{EngineClient, EngineCmd, EngineLane, Engines};
use crate::server::error::ApiError;
use crate::server::polls::{self, LongPolls, Permit};
use crate::server::store::disk::{self, Op, Store, Write};
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
    /// The durable state (`None`: in memory only).
    pub(crate) store: Option<Arc<Store>>,
    /// What every pair's data-plane secret is derived from (never stored with the state).
    pub(crate) secrets: crate::server::secret::SecretKey,
    /// Gives the memory of forgotten pairs and large requests back to the system.
    pub(crate) trim: Arc<crate::server::trim::Trim>,
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
    /// Where each inference engine stands (the version it serves, behind, torn).
    pub(crate) engines: Vec<crate::server::store::engines::EngineRecord>,
    /// When the pair was disconnected (its tombstone's age after a restart).
    pub(crate) disconnected_unix_ms: Option<u64>,
    /// What changed since the lock was taken, written through when it is released.
    pub(crate) journal: Vec<Op>,
}

impl Pair {
    /// A fresh pair's state for `slots` ranks.
    pub(crate) fn new(slots: &Slots) -> Pair {
        Pair {
            state: PairState::Joining,
            join_error: None,
            roster: Roster::new(slots.total()),
            kv: KvStore::default(),
            updates: Updates::default(),
            events: EventLog::default(),
            engine_errors: Vec::new(),
            engines: vec![Default::default(); slots.engines as usize],
            disconnected_unix_ms: None,
            journal: Vec::new(),
        }
    }

    /// Notes a change for the write-through.
    pub(crate) fn changed(&mut self, op: Op) {
        if self.journal.last() != Some(&op) {
            self.journal.push(op);
        }
    }
}

/// A locked pair: releasing it writes what changed through to the store (under the lock, so
/// that one pair's changes reach the store in the order they happened).
pub(crate) struct PairGuard<'a> {
    entry: &'a PairEntry,
    guard: MutexGuard<'a, Pair>,
}

impl std::ops::Deref for PairGuard<'_> {
    type Target = Pair;
    fn deref(&self) -> &Pair {
        &self.guard
    }
}

impl std::ops::DerefMut for PairGuard<'_> {
    fn deref_mut(&mut self) -> &mut Pair {
        &mut self.guard
    }
}

impl Drop for PairGuard<'_> {
    fn drop(&mut self) {
        if self.guard.journal.is_empty() {
            return;
        }
        let ops = std::mem::take(&mut self.guard.journal);
        if let Some(store) = &self.entry.store {
            let rows = self.entry.rows(&self.guard, ops);
            store.submit(rows);
        }
    }
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
    /// The join deadline as wall-clock time (survives a restart).
    pub(crate) join_deadline_unix_ms: u64,
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
    /// The engines' facts learned at connect (kept for a restart).
    pub(crate) facts: Vec<awex_core::backend::EngineFacts>,
    /// Where changes are written through (`None`: in memory only).
    pub(crate) store: Option<Arc<Store>>,
}

impl crate::server::engine::PairVersions for PairEntry {
    fn committed_version(&self) -> Option<u64> {
        self.lock().updates.committed()
    }

    fn serving_versions(&self) -> Vec<Option<u64>> {
        let p = self.lock();
        if self.request.options.commit.is_all() {
            vec![p.updates.committed(); p.engines.len()]
        } else {
            p.engines.iter().map(|r| r.serving).collect()
        }
    }
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
    pub(crate) fn lock(&self) -> PairGuard<'_> {
        PairGuard {
            entry: self,
            guard: self.inner.lock().unwrap_or_else(|e| e.into_inner()),
        }
    }

    /// What connect fixed about this pair, as stored.
    pub(crate) fn record(&self) -> disk::PairRecord {
        disk::PairRecord {
            request: self.request.clone(),
            id: self.id,
            uid: self.uid.clone(),
            secret: String::new(),
            secret_check: crate::server::secret::check_value(&self.secret),
            slots: [self.slots.train, self.slots.engines, self.slots.per_engine],
            created_unix_ms: self.created_unix_ms,
            join_deadline_unix_ms: self.join_deadline_unix_ms,
            training: self.training.clone(),
            inference: self.inference.clone(),
            facts: self.facts.clone(),
        }
    }

    /// The rows for the changes `ops`, read from the pair's state `p`.
    fn rows(&self, p: &Pair, ops: Vec<Op>) -> Vec<Write> {
        let n = || self.name.clone();
        let json = |v: &dyn erased::Ser| v.to_json();
        let mut out = Vec::with_capacity(ops.len());
        for op in ops {
            match op {
                Op::State => out.push(Write::State(
                    n(),
                    json(&disk::StateRecord {
                        state: Some(p.state),
                        join_error: p.join_error.clone(),
                        engine_errors: p.engine_errors.clone(),
                        committed: p.updates.committed,
                        torn: p.updates.torn,
                        serving_torn: p.updates.serving_torn,
                        last_event_seq: p.events.last_seq(),
                        kv_revision: p.kv.revision,
                        disconnected_unix_ms: p.disconnected_unix_ms,
                        engines: p.engines.clone(),
                    }),
                )),
                Op::Roster(slot) => {
                    if let Some(None) = p.roster.slots.get(slot) {
                        // emptied: its engine left the pair
                        out.push(Write::DeleteRoster(n(), slot as u64));
                    }
                    if let Some(Some(j)) = p.roster.slots.get(slot) {
                        out.push(Write::Roster(
                            n(),
                            slot as u64,
                            json(&disk::RosterRecord {
                                info: j.info.clone(),
                                unix_ms: j.unix_ms,
                            }),
                        ));
                    }
                }
                Op::Kv(key) => {
                    if !p.kv.values.contains_key(&key) {
                        out.push(Write::DeleteKv(n(), key.clone()));
                    }
                    if let Some((v, rev)) = p.kv.values.get(&key) {
                        out.push(Write::Kv(
                            n(),
                            key,
                            json(&disk::KvRecord {
                                value: v.clone(),
                                revision: *rev,
                            }),
                        ));
                    }
                }
                Op::Update(v) => out.push(Write::Update(
                    n(),
                    v,
                    p.updates.history.get(&v).map(|u| {
                        json(&disk::UpdateRecord {
                            attempt: u.attempt,
                            state: u.state,
                            started_unix_ms: u.started_unix_ms,
                            deadline_ms: crate::wire::ms(u.deadline),
                            pause_ms: u.pause.map(crate::wire::ms),
                            elapsed_ms: u.finished.map(|_| crate::wire::ms(u.elapsed())),
                            error: u.error.clone(),
                            engine_errors: u.engine_errors.clone(),
                            detail: !u.ranks.is_empty(),
                            applying: u.applying,
                            left_out: u.left_out(),
                        })
                    }),
                )),
                Op::ClearReports(v) => out.push(Write::ClearReports(n(), v)),
                Op::Report(v, slot) => {
                    if let Some(r) = p.updates.history.get(&v).and_then(|u| u.ranks.get(slot)) {
                        out.push(Write::Report(
                            n(),
                            v,
                            slot as u64,
                            json(&disk::ReportRecord {
                                ok: r.state,
                                missing: r.missing,
                                bytes: r.bytes,
                                checksum: r.checksum,
                                error: r.error.clone(),
                                after_ms: r.after_ms,
                                applied: r.applied,
                                delta: r.delta,
                            }),
                        ));
                    }
                }
                Op::Event(seq) => {
                    if let Some(ev) = p.events.events.iter().rev().find(|e| e.seq == seq) {
                        let kept = crate::wire::EVENTS_KEPT as u64;
                        let keep_from = seq.saturating_sub(kept) + 1;
                        out.push(Write::Event(
                            n(),
                            seq,
                            json(ev),
                            if seq > kept { keep_from } else { 0 },
                        ));
                    }
                }
            }
        }
        out
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
        p.changed(Op::Event(seq));
        p.changed(Op::State);
        self.events_tx.send_replace(seq);
    }

    /// Queues a call to every engine (no-op without engine URLs).
    pub(crate) fn engine_cmd(&self, cmd: EngineCmd) {
        if let Some(lane) = &self.engines {
            lane.send(cmd);
        }
    }

    /// Queues the engines' resume after `version`/`attempt` and marks the attempt `resuming`
    /// until the lane answers ([`Self::engines_resumed`]), so that a wait for the attempt's
    /// outcome answers only after the resume. Under commit policy `all` every engine is
    /// resumed; under `quorum:K` and `available` only the engines of the pair that may serve
    /// (not torn: a torn engine stays paused until it catches up or the controller accepts its
    /// weights), or with `every` (the pair is going away) all of them.
    pub(crate) fn resume_engines(&self, p: &mut Pair, version: u64, attempt: u32, every: bool) {
        let Some(lane) = &self.engines else {
            return;
        };
        let engines = if every || self.request.options.commit.is_all() {
            Engines::all(p.engines.len())
        } else {
            Engines::of(
                p.engines
                    .iter()
                    .map(|r| r.takes_part() && r.torn.is_none())
                    .collect(),
            )
        };
        if engines.is_empty() {
            return;
        }
        if let Some(u) = p.updates.attempt_mut(version, attempt) {
            u.resuming = true;
        }
        lane.send(EngineCmd::Continue {
            version,
            attempt,
            engines,
        });
    }

    /// Fails the join if its deadline passed while ranks were missing.
    pub(crate) fn enforce_join_deadline(&self) {
        let mut p = self.lock();
        if p.state != PairState::Joining || Instant::now() < self.join_deadline {
            return;
        }
        // (free engine slots, and added engines still joining, are not waited for)
        let missing = p
            .roster
            .describe_missing(&self.slots, |i| self.waits_for(&p, i));
        tracing::warn!(pair = %self.name, missing = %missing, "join deadline passed; pair join_failed");
        p.state = PairState::JoinFailed;
        p.join_error = Some(format!(
            "join deadline of {} ms passed with {} of {} ranks joined; missing: {missing}",
            self.request.options.join_deadline_ms,
            p.roster.joined(),
            self.slots.total()
        ));
        p.changed(Op::State);
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
        p.disconnected_unix_ms = Some(unix_ms());
        // what only a live pair answers (rendezvous reads of a disconnected pair are 410): its
        // bulk goes now, not when the tombstone is forgotten
        p.kv.values = Default::default();
        p.roster.cached = None;
        p.changed(Op::State);
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
                // held once, in the request (a config may list thousands of ignored layers)
                fp8: self.request.inference.fp8.clone(),
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
            engines: engine_statuses(&p),
        }
    }

    /// The pair's state and its engines' (for `/metrics`: no copy of the rest of the status).
    pub(crate) fn engines(&self) -> (PairState, Vec<crate::wire::EngineStatus>) {
        let p = self.lock();
        (p.state, engine_statuses(&p))
    }
}

/// Where each of the pair's engines stands (catching up while an update is pending or running).
fn engine_statuses(p: &Pair) -> Vec<crate::wire::EngineStatus> {
    let running = p.updates.latest().is_some_and(|u| !u.state.is_final());
    p.engines
        .iter()
        .enumerate()
        .map(|(i, e)| e.status(i as u32, running))
        .collect()
}

impl Gateway {
    /// A permit for one long-poll on `entry` waiting `wait_ms`, or 503 over the pair's bound.
    pub(crate) fn long_poll(
        &self,
        entry: &PairEntry,
        wait_ms: u64,
    ) -> Result<Option<Permit>, ApiError> {
        let limit = polls::bound(self.config.max_long_polls_per_pair, entry.slots.total());
        self.long_polls.enter(entry, limit, wait_ms, None)
    }

    /// [`Gateway::long_poll`] for an event poll of rank slot `slot`'s live holder: counted in
    /// the slot's own pool.
    pub(crate) fn rank_event_poll(
        &self,
        entry: &PairEntry,
        wait_ms: u64,
        slot: usize,
    ) -> Result<Option<Permit>, ApiError> {
        self.long_polls.enter(entry, 0, wait_ms, Some(slot))
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

/// JSON encoding of the records (they hold only strings, numbers and JSON values, so encoding
/// cannot fail; an empty row would be refused at load).
mod erased {
    pub(crate) trait Ser {
        fn to_json(&self) -> Vec<u8>;
    }
    impl<T: serde::Serialize> Ser for T {
        fn to_json(&self) -> Vec<u8> {
            serde_json::to_vec(self).unwrap_or_default()
        }
    }
}
