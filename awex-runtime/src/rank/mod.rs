//! A rank of a pair: joins through the gateway, then executes its plan for every update version
//! and reports. Training ranks are writers, inference ranks readers; the code is shared.
//!
//! One file per job: `config` (what a rank is configured with), `retry` (the gateway retry
//! policy), `prepare` (layout and plan), `factory` (building the transport), `kv` (verified
//! pair kv reads), `checks` (the pair a rank joins), `join`, `update` (one update: execute,
//! watch, report, apply) and `outcome`; this file holds the rank and its wait for work.

mod checks;
mod config;
mod error;
mod factory;
mod join;
mod kv;
mod outcome;
mod prepare;
mod retry;
mod update;

pub use config::{RankConfig, pair_settings, pair_uid};
pub use error::RankError;
pub use factory::make_transport;
use join::unknown_pair;
pub use kv::read_checked_kv;
pub use outcome::{Failure, Outcome, Work};
pub use prepare::{Prepared, prepare, rendezvous_key};
pub use retry::{DEFAULT_GATEWAY_LOST, gateway_lost_from, retry_gateway, transient};

use crate::transport::{ExecStats, Transport};
use crate::{ConfigMismatch, RuntimeError};
use awex_control::client::{Client, ClientError};
use awex_control::wire::{EventKind, JoinRequest, JoinResponse};
use awex_core::layout::RankId;
use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// A joined rank.
pub struct Rank {
    client: Client,
    cfg: RankConfig,
    /// The join answer: roster, options.
    pub joined: JoinResponse,
    transport: Option<Box<dyn Transport>>,
    peers: HashMap<RankId, serde_json::Value>,
    last_seq: u64,
    /// The newest event seq the update watchers of this rank read (see
    /// [`Rank::skip_read_events`]).
    watched_seq: Arc<AtomicU64>,
    pending: VecDeque<awex_control::wire::Event>,
    /// The stream's `disconnect` was taken.
    disconnected: bool,
    /// Test hook: corrupt one received byte of this version.
    pub corrupt_version: Option<u64>,
    /// How long this rank keeps retrying a lost gateway while it waits for work
    /// ([`RankConfig::gateway_lost`]).
    pub gateway_lost: Duration,
    /// The join request this rank re-attaches with after losing the gateway.
    join_request: JoinRequest,
    /// The last work whose bytes this rank's transport moved, and how long that took.
    last_transfer: Option<(Work, Duration)>,
    /// Deltas on: the version the inference ranks hold, as announced with the last `update`
    /// event taken, and the work it was announced with.
    bases: Option<(Work, crate::delta::PeerBases)>,
    /// Training ranks: engines the last update could not reach (commit policies `quorum:K`,
    /// `available`), reported with it (`Report::unreached`).
    unreached: Vec<u32>,
    /// The engines the gateway left out of the running version (its `left_out` events).
    lost: Arc<crate::transport::LostEngines>,
    /// The engine slots out of the last `update` taken from its start (free, or an added
    /// engine whose ranks have not all joined), and the work it announced.
    out: Option<(Work, Vec<u32>)>,
    /// The gateway's deadline of the work last taken from [`Rank::next_live_work`], as an
    /// instant of this process (from the update's status: its `deadline_ms` less its
    /// `elapsed_ms`, counted from when that status was asked for, so no clock is compared).
    attempt_deadline: Option<(Work, Instant)>,
    /// This rank's engine was removed from the pair (its `engine_removed` event was taken).
    removed: bool,
    /// The event poll this rank's process keeps open while it holds its slot.
    _presence: Presence,
}

/// A presence poll of the rank's process (`events?presence=true` in the `awex-claim` header's
/// name), kept open from its join until the rank is dropped, on a thread and a runtime of its
/// own (so that a busy or blocked rank still holds it): the gateway learns of the process's
/// death, whatever the rank was doing then, from that poll's connection closing, fails a
/// version the rank had not finished at once and lets a restarted rank take the slot. A silent
/// (stopped) process keeps its slot: its poll stays open.
struct Presence(Option<tokio::sync::oneshot::Sender<()>>);

impl Presence {
    fn start(cfg: &RankConfig, claim: String) -> Presence {
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let (gateway, token, pair) = (cfg.gateway.clone(), cfg.token.clone(), cfg.pair.clone());
        let held = std::thread::Builder::new()
            .name("awex-presence".into())
            .spawn(move || {
                let Ok(rt) = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                else {
                    return;
                };
                // a client of its own: its connections live on this runtime
                let Ok(client) = Client::new(&gateway, token) else {
                    return;
                };
                rt.block_on(async move {
                    let hold = async {
                        loop {
                            match client
                                .presence(&pair, &claim, Duration::from_secs(60))
                                .await
                            {
                                Ok(_) => {}
                                // the pair is gone: nothing left to hold
                                Err(e) if matches!(e.status(), Some(404 | 410)) => return,
                                // a lost gateway: the rank's own waits say so; try again shortly
                                Err(_) => tokio::time::sleep(Duration::from_secs(1)).await,
                            }
                        }
                    };
                    tokio::select! {
                        _ = stopped => {}
                        () = hold => {}
                    }
                });
            });
        if let Err(e) = held {
            // the rank works without it; its death is then seen only while it polls
            tracing::warn!(error = %e, "awex rank: cannot start the presence thread");
        }
        Presence(Some(stop))
    }
}

impl Drop for Presence {
    fn drop(&mut self) {
        // the rank leaves its slot: the poll is dropped, and the gateway counts its holder gone
        if let Some(stop) = self.0.take() {
            let _ = stop.send(());
        }
    }
}

impl Rank {
    /// How long this rank's transport took to move its bytes of `work`, when that was the last
    /// work it moved and the move succeeded: the data plane alone (from the transport's start to
    /// its end, waiting for peers included), without the gateway's round trips around it. An
    /// atomic pair's apply is not in it.
    pub fn transfer_time(&self, work: Work) -> Option<Duration> {
        self.last_transfer
            .filter(|(w, _)| *w == work)
            .map(|(_, d)| d)
    }

    /// This rank process's claim id on its slot (random per [`Rank`]), sent with its join.
    pub fn incarnation(&self) -> &str {
        self.join_request
            .info
            .get("incarnation")
            .and_then(|v| v.as_str())
            .unwrap_or_default()
    }

    /// After the gateway was lost: joins this rank's slot again with the same info (plan
    /// fingerprint, incarnation); the gateway answers the current roster. A pair connected
    /// again meanwhile (another uid) is an error.
    async fn reattach(&mut self) -> Result<(), RankError> {
        let limit = self.gateway_lost;
        let r = retry_gateway(&self.cfg.gateway, "re-attaching", limit, || {
            self.client.join(&self.cfg.pair, &self.join_request)
        })
        .await
        .map_err(|e| self.classify(e))?;
        if !self.joined.uid.is_empty() && r.uid != self.joined.uid {
            return Err(RuntimeError::from(ConfigMismatch::Reconnected {
                pair: self.cfg.pair.clone(),
                expected: self.joined.uid.clone(),
                got: r.uid.clone(),
            })
            .into());
        }
        tracing::info!(
            "awex rank: {} {} re-attached to pair `{}` (last event {})",
            self.cfg.side,
            self.cfg.rank,
            self.cfg.pair,
            r.last_event_seq
        );
        Ok(())
    }

    /// 404 is the pair unknown to the gateway, 410 its disconnect; others pass through.
    fn classify(&self, e: RankError) -> RankError {
        match e {
            RankError::Gateway(c) if c.status() == Some(410) => RankError::Disconnected,
            e => unknown_pair(e, &self.cfg),
        }
    }

    /// The gateway client.
    pub fn client(&self) -> &Client {
        &self.client
    }

    /// Waits for the next piece of work; `None` when the pair was disconnected by its
    /// controller (a `disconnect` event, or 410 Gone), at once on every later call (the
    /// `disconnect` event is the stream's last). A gateway that cannot be reached (or answers
    /// 5xx) is retried with backoff for [`Rank::gateway_lost`], then the rank re-attaches; a
    /// gateway that does not know the pair (404) is [`RankError::UnknownPair`].
    pub async fn next_work(&mut self) -> Result<Option<Work>, RankError> {
        if self.disconnected {
            return Ok(None);
        }
        loop {
            while let Some(ev) = self.pending.pop_front() {
                match ev.kind {
                    EventKind::Disconnect => {
                        self.disconnected = true;
                        return Ok(None);
                    }
                    EventKind::EngineRemoved if self.removed_by(&ev) => {
                        // this rank's engine left the pair: its slot is free, nothing more
                        // comes to it
                        tracing::info!(
                            pair = %self.cfg.pair,
                            rank = %self.cfg.rank,
                            "awex rank: this rank's engine was removed from the pair"
                        );
                        self.disconnected = true;
                        self.removed = true;
                        return Ok(None);
                    }
                    EventKind::EngineRemoved => {}
                    EventKind::Update if self.out_of(&ev) => {
                        // this rank's engine is out of the version from its start (an engine
                        // added while its ranks were still joining): nothing comes to it
                    }
                    EventKind::Update => {
                        if let Some(version) = ev.version {
                            let work = Work {
                                version,
                                attempt: ev.attempt.unwrap_or(1),
                            };
                            self.out = Some((work, ev.engines.clone()));
                            self.bases = ev.base.map(|b| {
                                (
                                    work,
                                    crate::delta::PeerBases {
                                        version: b.version,
                                        except: b.except.into_iter().collect(),
                                    },
                                )
                            });
                            return Ok(Some(work));
                        }
                    }
                    EventKind::Abort | EventKind::Apply | EventKind::LeftOut => {}
                }
            }
            let me = self.incarnation().to_string();
            let r = self
                .client
                .events_as(
                    &self.cfg.pair,
                    self.last_seq,
                    Duration::from_secs(30),
                    Some(&me),
                )
                .await;
            match r {
                Ok(r) => {
                    self.last_seq = r.last_seq.max(self.last_seq);
                    self.pending.extend(r.events);
                }
                Err(e) if e.status() == Some(410) => return Ok(None),
                Err(e) if transient(&e) => {
                    // the gateway is restarting (or overloaded): wait for it, then re-attach
                    let (pair, after) = (self.cfg.pair.clone(), self.last_seq);
                    let me = me.clone();
                    let client = self.client.clone();
                    let first = std::sync::Mutex::new(Some(e));
                    let r = retry_gateway(
                        &self.cfg.gateway,
                        "waiting for work",
                        self.gateway_lost,
                        || {
                            let first = first.lock().ok().and_then(|mut f| f.take());
                            let client = client.clone();
                            let pair = pair.clone();
                            let me = me.clone();
                            async move {
                                match first {
                                    Some(e) => Err(e),
                                    None => {
                                        client
                                            .events_as(&pair, after, Duration::ZERO, Some(&me))
                                            .await
                                    }
                                }
                            }
                        },
                    )
                    .await;
                    match r.map_err(|e| self.classify(e)) {
                        Ok(_) => self.reattach().await?,
                        Err(RankError::Disconnected) => return Ok(None),
                        Err(e) => return Err(e),
                    }
                }
                Err(e) => return Err(self.classify(e.into())),
            }
        }
    }

    /// Waits for the next piece of work whose attempt is still live: an `update` event that
    /// this rank took late (after a stall, or catching up on queued events) may be for an
    /// attempt that is already over, with its `abort` or its retry queued right behind it;
    /// such work is skipped, never executed (executing it would publish readiness for a dead
    /// attempt and hold up the retry). `None` when the pair was disconnected.
    pub async fn next_live_work(&mut self) -> Result<Option<Work>, RankError> {
        loop {
            let Some(w) = self.next_work().await? else {
                return Ok(None);
            };
            if self.queued_behind(w) {
                continue;
            }
            // when the answer was asked for (the last try's, after a lost gateway)
            let asked = std::sync::Mutex::new(Instant::now());
            let st = retry_gateway(
                &self.cfg.gateway,
                "reading the update's state",
                self.update_limit(),
                || {
                    if let Ok(mut a) = asked.lock() {
                        *a = Instant::now();
                    }
                    self.client.update_status(&self.cfg.pair, w.version)
                },
            )
            .await
            .map_err(|e| self.classify(e));
            match st {
                Ok(st) if attempt_over(&st, w) => continue,
                Ok(st) => {
                    // the attempt's own deadline as the gateway counts it: a rank that takes
                    // its work late (a stopped process, resumed) never runs past it
                    let asked = asked.into_inner().unwrap_or_else(|e| e.into_inner());
                    let left = st.deadline_ms.saturating_sub(st.elapsed_ms);
                    self.attempt_deadline = Some((w, asked + Duration::from_millis(left)));
                    return Ok(Some(w));
                }
                Err(RankError::Disconnected) => return Ok(None),
                Err(e) => return Err(e),
            }
        }
    }

    /// For a rank that is told each attempt it runs (an engine's trigger names it) and never
    /// waits for work on the event stream: forgets the events its last update's watchers read,
    /// so that the next update's watchers do not read the whole history again. A rank that
    /// takes its work from [`Rank::next_work`] must not call it (it would skip those events).
    pub fn skip_read_events(&mut self) {
        self.last_seq = self.last_seq.max(self.watched_seq.load(Ordering::Acquire));
        self.pending.clear();
    }

    /// The instant this rank's part of `work` must end by: the update deadline from now, and
    /// no later than the attempt's deadline as the gateway set it (known for work taken from
    /// [`Rank::next_live_work`]; otherwise asked for here, once, and an attempt the gateway
    /// says is over is [`RuntimeError::AttemptOver`]).
    async fn work_deadline(&mut self, work: Work) -> Result<Instant, RuntimeError> {
        let local = Instant::now() + Duration::from_millis(self.joined.options.update_deadline_ms);
        if let Some((w, d)) = self.attempt_deadline
            && w == work
        {
            return Ok(local.min(d));
        }
        let asked = Instant::now();
        match self
            .client
            .update_status(&self.cfg.pair, work.version)
            .await
        {
            Ok(st) if attempt_over(&st, work) => Err(RuntimeError::AttemptOver {
                version: work.version,
                attempt: work.attempt,
                why: over_why(&st),
            }),
            Ok(st) => {
                let left = st.deadline_ms.saturating_sub(st.elapsed_ms);
                let d = asked + Duration::from_millis(left);
                self.attempt_deadline = Some((work, d));
                Ok(local.min(d))
            }
            // the gateway's answer is not needed to run the attempt: the local bound holds
            Err(_) => Ok(local),
        }
    }

    /// Whether an event already fetched ends `w` (its abort, a later attempt, or a disconnect).
    fn queued_behind(&self, w: Work) -> bool {
        self.pending.iter().any(|ev| match ev.kind {
            EventKind::Abort => {
                ev.version == Some(w.version) && ev.attempt.unwrap_or(1) >= w.attempt
            }
            EventKind::Update => {
                ev.version == Some(w.version) && ev.attempt.unwrap_or(1) > w.attempt
            }
            EventKind::Disconnect => true,
            EventKind::EngineRemoved => self.removed_by(ev),
            EventKind::Apply | EventKind::LeftOut => false,
        })
    }

    /// Whether this rank's work ended because its engine was removed from the pair (then
    /// [`Rank::next_work`] answers `None`, as after a disconnect).
    pub fn engine_removed(&self) -> bool {
        self.removed
    }

    /// Whether `ev` (an `engine_removed` event) removes this rank's engine.
    fn removed_by(&self, ev: &awex_control::wire::Event) -> bool {
        ev.kind == EventKind::EngineRemoved
            && self.cfg.side == awex_core::layout::Side::Inference
            && ev.engines.contains(&self.cfg.rank.engine)
    }

    /// Whether `ev` (an `update` event) leaves this rank's engine out from its start.
    fn out_of(&self, ev: &awex_control::wire::Event) -> bool {
        self.cfg.side == awex_core::layout::Side::Inference
            && ev.engines.contains(&self.cfg.rank.engine)
    }

    /// The longest a rank waits for a lost gateway during an update: the pair's update
    /// deadline plus 30 s.
    pub fn update_limit(&self) -> Duration {
        Duration::from_millis(self.joined.options.update_deadline_ms) + Duration::from_secs(30)
    }

    /// Waits until `version` is over (committed or failed), at most `limit`; returns its status.
    /// A lost gateway is retried within `limit`.
    pub async fn wait_outcome(
        &self,
        version: u64,
        limit: Duration,
    ) -> Result<awex_control::wire::UpdateStatus, RankError> {
        let start = Instant::now();
        retry_gateway(
            &self.cfg.gateway,
            "waiting for the update's outcome",
            limit,
            || {
                let left = limit.saturating_sub(start.elapsed());
                self.client.wait_update(&self.cfg.pair, version, left)
            },
        )
        .await
        .map_err(|e| self.classify(e))
    }

    /// One update, start to end: waits for the next live work (until `deadline`, or without
    /// limit), hands it to `before` (a training rank fills its tensors, a mirror is refreshed),
    /// executes and reports this rank's part, and with `commit_wait` waits that long for the
    /// version's outcome ([`Rank::run`]). An error of `before` ends the step with that error.
    pub async fn step(
        &mut self,
        deadline: Option<Instant>,
        checksums: bool,
        commit_wait: Option<Duration>,
        before: impl FnOnce(Work) -> Result<(), RankError>,
    ) -> Result<Outcome, RankError> {
        let next = match deadline {
            None => self.next_live_work().await?,
            Some(d) => match tokio::time::timeout_at(d.into(), self.next_live_work()).await {
                Ok(next) => next?,
                Err(_) => return Ok(Outcome::TimedOut { work: None }),
            },
        };
        let Some(work) = next else {
            return Ok(Outcome::Disconnected);
        };
        before(work)?;
        Ok(self.run(work, checksums, commit_wait).await)
    }

    /// Executes and reports this rank's part of `work` and, with `commit_wait`, waits that
    /// long for the version's outcome (without, a part that succeeded is
    /// [`Outcome::Executed`]).
    pub async fn run(
        &mut self,
        work: Work,
        checksums: bool,
        commit_wait: Option<Duration>,
    ) -> Outcome {
        let (pair, side, rank) = (&self.cfg.pair, self.cfg.side, self.cfg.rank);
        let (version, attempt) = (work.version, work.attempt);
        tracing::info!(%pair, %side, %rank, version, attempt, "update started");
        let t0 = Instant::now();
        let stats = match self.execute(work, checksums).await {
            Ok(s) => {
                tracing::info!(
                    pair = %self.cfg.pair,
                    side = %self.cfg.side,
                    rank = %self.cfg.rank,
                    version,
                    attempt,
                    bytes = s.bytes,
                    buckets = s.buckets,
                    ms = t0.elapsed().as_millis() as u64,
                    "update part done"
                );
                s
            }
            Err(e) => {
                tracing::warn!(
                    pair = %self.cfg.pair,
                    side = %self.cfg.side,
                    rank = %self.cfg.rank,
                    version,
                    attempt,
                    ms = t0.elapsed().as_millis() as u64,
                    reason = %e,
                    "update failed on this rank"
                );
                return Outcome::Failed {
                    work,
                    stats: None,
                    reason: Failure::Rank(e),
                };
            }
        };
        let Some(limit) = commit_wait else {
            return Outcome::Executed { work, stats };
        };
        let outcome = self.outcome(work, stats, limit).await;
        let (pair, side, rank) = (&self.cfg.pair, self.cfg.side, self.cfg.rank);
        let ms = t0.elapsed().as_millis() as u64;
        match &outcome {
            Outcome::Committed { .. } => {
                tracing::info!(%pair, %side, %rank, version, attempt, ms, "update committed")
            }
            Outcome::Failed { reason, .. } => tracing::warn!(
                %pair, %side, %rank, version, attempt, ms, %reason, "update did not commit"
            ),
            Outcome::TimedOut { .. } => tracing::warn!(
                %pair, %side, %rank, version, attempt, ms, waited_ms = limit.as_millis() as u64,
                "no outcome of the update in time"
            ),
            Outcome::Disconnected => {
                tracing::info!(%pair, %side, %rank, version, attempt, "pair disconnected")
            }
            Outcome::Executed { .. } => {}
        }
        outcome
    }

    /// Waits at most `limit` for the outcome of `work`, whose part this rank did (`stats`).
    /// The future owns what it needs (a Python binding polls it in slices, between signal
    /// checks, and may drop it).
    pub fn outcome(
        &self,
        work: Work,
        stats: ExecStats,
        limit: Duration,
    ) -> impl std::future::Future<Output = Outcome> + Send + 'static {
        let client = self.client.clone();
        let pair = self.cfg.pair.clone();
        // an inference rank's engine left out of the running attempt (failed elsewhere, or
        // removed from the pair): the attempt's outcome is not this rank's to wait for
        let engine =
            (self.cfg.side == awex_core::layout::Side::Inference).then_some(self.cfg.rank.engine);
        let left_out = move |st: &awex_control::wire::UpdateStatus| {
            engine.and_then(|e| st.left_out.iter().find(|l| l.engine == e).cloned())
        };
        async move {
            // a later attempt already running (this rank ran its attempt late): waiting for
            // the version would wait for that attempt, which this rank would then miss
            // (nor can the wait's own answer say so in time: a retry started as this attempt
            // failed leaves the version running, so the wait goes on in slices, each followed
            // by a look at the attempt)
            let start = Instant::now();
            let answer = loop {
                match client.update_status(&pair, work.version).await {
                    Ok(st) if st.attempt != work.attempt => break Ok(st),
                    Ok(st) if !st.state.is_final() && left_out(&st).is_some() => break Ok(st),
                    _ => {}
                }
                let left = limit.saturating_sub(start.elapsed());
                let slice = left.min(OUTCOME_SLICE);
                match client.wait_update(&pair, work.version, slice).await {
                    Err(ClientError::StillRunning { .. }) if left > slice => {}
                    other => break other,
                }
            };
            match answer {
                Ok(st) if !st.state.is_final() && st.attempt == work.attempt => {
                    let l = left_out(&st);
                    Outcome::Failed {
                        work,
                        stats: Some(stats),
                        reason: Failure::Rank(RuntimeError::AttemptOver {
                            version: work.version,
                            attempt: work.attempt,
                            why: match l {
                                Some(l) => format!(
                                    "this rank's engine {} was left out of it ({})",
                                    l.engine, l.error
                                ),
                                None => over_why(&st),
                            },
                        }),
                    }
                }
                Ok(st) if st.attempt != work.attempt => Outcome::Failed {
                    work,
                    stats: Some(stats),
                    reason: Failure::Rank(RuntimeError::AttemptOver {
                        version: work.version,
                        attempt: work.attempt,
                        why: over_why(&st),
                    }),
                },
                Ok(st) if st.state == awex_control::wire::UpdateState::Committed => {
                    Outcome::Committed { work, stats }
                }
                Ok(st) => Outcome::Failed {
                    work,
                    stats: Some(stats),
                    reason: Failure::Version(Box::new(st)),
                },
                Err(ClientError::StillRunning { .. }) => Outcome::TimedOut { work: Some(work) },
                Err(e) if matches!(e.status(), Some(404) | Some(410)) => Outcome::Disconnected,
                Err(e) => Outcome::Failed {
                    work,
                    stats: Some(stats),
                    reason: Failure::Gateway(e),
                },
            }
        }
    }

    /// Tears the transport down.
    pub fn close(&mut self) {
        if let Some(mut t) = self.transport.take() {
            t.close();
        }
    }
}

/// How long one wait for an outcome ([`Rank::outcome`]) lasts before the rank looks at which
/// attempt runs.
const OUTCOME_SLICE: Duration = Duration::from_secs(1);

/// Whether the update status `st` says that `w` is over: a later attempt (or a later version's
/// status read for it) started, or the same attempt committed or failed.
fn attempt_over(st: &awex_control::wire::UpdateStatus, w: Work) -> bool {
    st.version > w.version
        || st.attempt > w.attempt
        || (st.attempt == w.attempt && st.state.is_final())
}

/// Why an attempt is over, from the status that says so ([`attempt_over`]).
fn over_why(st: &awex_control::wire::UpdateStatus) -> String {
    format!(
        "the gateway has version {} at attempt {}, {}",
        st.version,
        st.attempt,
        st.state.as_str()
    )
}

impl Drop for Rank {
    fn drop(&mut self) {
        self.close();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::TensorSet;
    use crate::transport::{ExecContext, ExecStats, PairSecret, TransportConfig};
    use awex_control::wire::ApplyMode;
    use awex_core::layout::{RankId, Side};
    use awex_core::model::ModelSpec;
    // the backends register themselves (inventory) only when linked
    use awex_megatron as _;
    use awex_sglang as _;

    #[cfg(not(feature = "cuda"))]
    #[test]
    fn nccl_without_the_cuda_feature_says_the_build_lacks_cuda() {
        use awex_core::layout::RankLayout;
        use awex_core::model::Catalogue;
        use awex_core::plan::RankPlan;
        let model = awex_core::model::ModelSpec::resolve("qwen3-tiny").unwrap();
        let catalogue = Catalogue::of(&model);
        let cfg = RankConfig {
            infer_fp8: None,
            gateway: "http://127.0.0.1:1".into(),
            token: None,
            pair: "p".into(),
            side: Side::Training,
            rank: RankId::train(0),
            model,
            train: "megatron:tp=1".parse().unwrap(),
            infer: "sglang:tp=1".parse().unwrap(),
            transport: awex_core::Transport::Nccl,
            bucket_bytes: 1 << 20,
            host: "127.0.0.1".into(),
            uid: String::new(),
            apply: ApplyMode::InPlace,
            transports: TransportConfig::default(),
            gateway_lost: DEFAULT_GATEWAY_LOST,
            deltas: true,
        };
        let prepared = Prepared {
            pair: Arc::new(cfg.pair_spec().resolve().unwrap()),
            catalogue,
            layout: RankLayout {
                rank: RankId::train(0),
                tensors: vec![],
            },
            plan: Arc::new(RankPlan {
                side: Side::Training,
                rank: RankId::train(0),
                peers: vec![],
                fingerprint: 0,
            }),
        };
        let tensors = Arc::new(TensorSet::allocate_host(&prepared.layout).unwrap());
        let e = make_transport(&cfg, &prepared, tensors).err().unwrap();
        assert_eq!(
            e.to_string(),
            "the nccl transport needs awex built with --features cuda"
        );
    }

    /// A tcp transport whose update panics (everything else is the real transport's).
    struct PanicsOnExecute(Box<dyn Transport>);

    impl Transport for PanicsOnExecute {
        fn kind(&self) -> awex_core::Transport {
            self.0.kind()
        }
        fn rendezvous(&self) -> serde_json::Value {
            self.0.rendezvous()
        }
        fn authenticate(&mut self, secret: &PairSecret) {
            self.0.authenticate(secret)
        }
        fn connect(
            &mut self,
            peers: &HashMap<RankId, serde_json::Value>,
        ) -> Result<(), RuntimeError> {
            self.0.connect(peers)
        }
        fn execute(&mut self, _ctx: &ExecContext<'_>) -> Result<ExecStats, RuntimeError> {
            panic!("the transport broke on purpose")
        }
        fn close(&mut self) {
            self.0.close()
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn a_transport_that_panics_is_reported_as_failed_and_its_watcher_stopped() {
        use awex_control::server::{GatewayConfig, bind, serve};
        use awex_control::wire::{PairOptions, UpdateState};
        const LIMIT: Duration = Duration::from_secs(60);
        let listener = bind("127.0.0.1:0".parse().unwrap()).unwrap();
        let gw = format!("http://{}", listener.local_addr().unwrap());
        tokio::spawn(serve(listener, GatewayConfig::default()));
        let client = Client::new(&gw, None).unwrap();
        let cfg = |side, rank| RankConfig {
            infer_fp8: None,
            gateway: gw.clone(),
            token: None,
            pair: "panics".into(),
            side,
            rank,
            model: ModelSpec::resolve("qwen3-tiny").unwrap(),
            train: "megatron:tp=1".parse().unwrap(),
            infer: "sglang:tp=1".parse().unwrap(),
            transport: awex_core::Transport::Tcp,
            bucket_bytes: 1 << 20,
            host: "127.0.0.1".into(),
            uid: String::new(),
            apply: ApplyMode::InPlace,
            transports: TransportConfig::default(),
            gateway_lost: DEFAULT_GATEWAY_LOST,
            deltas: true,
        };
        // the deadline is far beyond the test's waits: only the report can fail the version
        let options = PairOptions {
            bucket_mib: 1,
            update_deadline_ms: 600_000,
            ..PairOptions::default()
        };
        let pair = cfg(Side::Training, RankId::train(0))
            .pair_spec()
            .resolve()
            .unwrap();
        let req = awex_control::connect::connect_request("panics", &pair, vec![], options);
        client.connect(&req).await.unwrap();
        let join = |c: RankConfig, panics: bool| async move {
            let prepared = prepare(&c).unwrap();
            let tensors = Arc::new(TensorSet::allocate_host(&prepared.layout).unwrap());
            let mut t = make_transport(&c, &prepared, tensors.clone()).unwrap();
            if panics {
                t = Box::new(PanicsOnExecute(t));
            }
            tokio::time::timeout(LIMIT, Rank::join(c, &prepared, &tensors, t))
                .await
                .expect("join in time")
                .unwrap()
        };
        let (mut trainer, _reader) = tokio::join!(
            join(cfg(Side::Training, RankId::train(0)), true),
            join(cfg(Side::Inference, RankId::infer(0, 0)), false),
        );
        client.start_update("panics", 1).await.unwrap();
        let work = tokio::time::timeout(LIMIT, trainer.next_live_work())
            .await
            .expect("work in time")
            .unwrap()
            .unwrap();
        let e = tokio::time::timeout(LIMIT, trainer.execute(work, true))
            .await
            .expect("execute in time")
            .unwrap_err();
        assert!(e.to_string().contains("panicked"), "{e}");
        // the abort watcher (which holds the other count) ends after the poll it has open
        // (never cut mid-poll: the gateway would take that for the process gone)
        let watcher_gone = async {
            while Arc::strong_count(&trainer.watched_seq) > 1 {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        };
        tokio::time::timeout(LIMIT, watcher_gone)
            .await
            .expect("the abort watcher stops");
        // the report failed the version long before its deadline
        let st = client.wait_update("panics", 1, LIMIT).await.unwrap();
        assert_eq!(st.state, UpdateState::Failed, "{st:?}");
        let why = st.error.unwrap_or_default();
        assert!(why.contains("the transport broke on purpose"), "{why}");
        // the next update fails at once and is reported with why
        client.start_update("panics", 2).await.unwrap();
        let work = tokio::time::timeout(LIMIT, trainer.next_live_work())
            .await
            .expect("work in time")
            .unwrap()
            .unwrap();
        let e = trainer.execute(work, true).await.unwrap_err();
        assert!(
            e.to_string()
                .contains("lost when an earlier update panicked"),
            "{e}"
        );
        let st = client.wait_update("panics", 2, LIMIT).await.unwrap();
        assert_eq!(st.state, UpdateState::Failed, "{st:?}");
        let why = st.error.unwrap_or_default();
        assert!(why.contains("restart the rank"), "{why}");
    }
}
