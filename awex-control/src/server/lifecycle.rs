//! The update lifecycle of a pair: the state machine the update routes drive.
//!
//! A version goes `pending` (pausing the inference engines, when the pair names their URLs) ->
//! `running` (ranks were told through an `update` event) -> `committed` | `failed`. It commits
//! only when every rank of both sides reported success and, with checksums on, the training
//! ranks' checksums sum to the inference ranks' sum. A failed report, a checksum mismatch, a
//! missed deadline or a disconnect fails it, naming the ranks and reasons; a failed version can
//! be started again with the same number (a new attempt).
//!
//! In atomic pairs (`options.apply = atomic`) the reports of every rank mean "received and
//! verified into staging"; once all are in (and the checksums agree) the gateway publishes an
//! `apply` event, the inference ranks copy staging into their live tensors and report a second
//! time, and only then the version commits. A failure before `apply` wrote nothing live (the
//! version is not torn, the engines resume on the last committed one); a failure after it is
//! torn, as in place.
//!
//! The engines' session (pause, trigger, finish, continue) is driven from here through the
//! pair's engine lane, whose answers come back through [`EngineEvents`]. Everything here works
//! on a [`PairEntry`] and answers with an [`UpdateError`]; `routes/updates` only parses,
//! authorises, calls and maps the error to a status code.

use crate::server::engine::{
    EngineCmd, EngineEvents, EngineFailure, Engines, WARM_UP_AGAIN, messages,
};
use crate::server::error::ApiError;
use crate::server::state::{Pair, PairEntry, unix_ms};
use crate::server::store::disk::Op;
use crate::server::store::roster::{list_ranks, rank_name};
use crate::server::store::updates::{RankDetail, RankSlot, Update};
use crate::wire::{
    ApplyMode, EventKind, MAX_ERROR_BYTES, PairState, Report, ReportAck, UpdateState, UpdateStatus,
    ms,
};
use std::sync::Arc;
use std::time::Duration;
use tokio::time::Instant;

/// Why the lifecycle refused a start, a report or a status read (the route maps each to its
/// status code; the message says what is wrong and what would be right).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum UpdateError {
    /// The pair is still joining: updates start once every rank joined.
    #[error(
        "pair `{pair}` is still joining: {joined} of {total} ranks joined; start updates once every rank joined"
    )]
    Joining {
        pair: String,
        joined: usize,
        total: usize,
    },
    /// The pair's join failed: it must be connected again.
    #[error("pair `{pair}` failed to join; disconnect it and connect again")]
    JoinFailed { pair: String },
    /// The pair was disconnected.
    #[error("pair `{pair}` was disconnected; connect it again with POST /v1/pairs")]
    Disconnected { pair: String },
    /// Another version is still pending or running.
    #[error(
        "version {current} of pair `{pair}` is {}; wait for it to commit or fail before starting version {version}",
        state.as_str()
    )]
    Busy {
        pair: String,
        current: u64,
        state: UpdateState,
        version: u64,
    },
    /// The version is not newer than the latest (or repeats a committed one).
    #[error(
        "version {version} is stale: pair `{pair}` already ran version {latest} ({}); versions must increase, and only a failed version may be retried",
        state.as_str()
    )]
    Stale {
        pair: String,
        version: u64,
        latest: u64,
        state: UpdateState,
    },
    /// No update of that version exists (status read).
    #[error(
        "pair `{pair}` has no update of version {version}{}",
        match latest {
            Some(l) => format!(" (latest: {l})"),
            None => " (none was started)".to_string(),
        }
    )]
    NoSuchVersion {
        pair: String,
        version: u64,
        latest: Option<u64>,
    },
    /// A report for a version that was never announced.
    #[error(
        "pair `{pair}` has no update of version {version}; report only versions announced by an `update` event"
    )]
    NotAnnounced { pair: String, version: u64 },
    /// The version was dropped from the history while it was being answered.
    #[error("version {version} vanished")]
    Vanished { version: u64 },
    /// A report's error is longer than the wire allows.
    #[error("the error {who} reported is longer than {MAX_ERROR_BYTES} bytes")]
    ErrorTooLong { who: String },
    /// A successful report without the checksum the pair asks for.
    #[error("pair `{pair}` has checksums on: the successful report of {who} needs `checksum`")]
    ChecksumMissing { pair: String, who: String },
    /// A report's `unreached` names no engine of the pair, or comes from an inference rank.
    #[error("the report of {who} is refused: {why}")]
    BadUnreached { who: String, why: String },
    /// A report for an attempt that is over.
    #[error("attempt {attempt} of version {version} is over; the current attempt is {current}")]
    AttemptOver {
        version: u64,
        attempt: u32,
        current: u32,
    },
    /// A report while the engines are still being paused.
    #[error(
        "version {version} has not started running (the engines are being paused); wait for its `update` event"
    )]
    NotRunning { version: u64 },
    /// A report after the version committed or failed.
    #[error(
        "version {version} attempt {attempt} already {}; the report of {who} came too late",
        state.as_str()
    )]
    Settled {
        version: u64,
        attempt: u32,
        state: UpdateState,
        who: String,
    },
    /// A second report of the same rank for the same attempt.
    #[error("{who} already reported for version {version} attempt {attempt}")]
    AlreadyReported {
        who: String,
        version: u64,
        attempt: u32,
    },
    /// A training rank's report while the inference ranks apply an atomic version.
    #[error(
        "{who} already reported for version {version} attempt {attempt}; while the inference ranks apply it, only they report"
    )]
    ApplyingOnlyInference {
        who: String,
        version: u64,
        attempt: u32,
    },
    /// A second "applied" report of the same inference rank.
    #[error("{who} already reported applying version {version} attempt {attempt}")]
    AlreadyApplied {
        who: String,
        version: u64,
        attempt: u32,
    },
    /// The version holds no record of the rank (a history trimmed of per-rank detail).
    #[error("version {version} has no per-rank record of {who}")]
    NoRankRecord { who: String, version: u64 },
    /// The roster refused the reporter (a rank outside the pair, or not the slot's holder).
    #[error(transparent)]
    Reporter(ApiError),
}

impl PairEntry {
    /// Starts `version` (a new one, or a new attempt of a failed one): pauses the engines or
    /// announces it to the ranks, and arms its deadline. Answers its status.
    pub(crate) fn start_update(
        self: &Arc<Self>,
        version: u64,
    ) -> Result<UpdateStatus, UpdateError> {
        let name = &self.name;
        let mut p = self.lock();
        match p.state {
            PairState::Ready => {}
            PairState::Joining => {
                return Err(UpdateError::Joining {
                    pair: name.clone(),
                    joined: p.roster.joined(),
                    total: self.slots.total(),
                });
            }
            PairState::JoinFailed => {
                return Err(UpdateError::JoinFailed { pair: name.clone() });
            }
            PairState::Disconnected => {
                return Err(UpdateError::Disconnected { pair: name.clone() });
            }
        }
        let mut attempt = 1;
        if let Some(cur) = p.updates.latest() {
            if !cur.state.is_final() {
                return Err(UpdateError::Busy {
                    pair: name.clone(),
                    current: cur.version,
                    state: cur.state,
                    version,
                });
            }
            if version < cur.version
                || (version == cur.version && cur.state == UpdateState::Committed)
            {
                return Err(UpdateError::Stale {
                    pair: name.clone(),
                    version,
                    latest: cur.version,
                    state: cur.state,
                });
            }
            if version == cur.version {
                attempt = cur.attempt.saturating_add(1);
            }
        }
        let deadline = Duration::from_millis(self.request.options.update_deadline_ms);
        let pending = self.engines.is_some();
        // an added engine whose ranks all joined takes part from this version on
        self.admit_joined_engines(&mut p);
        // what the last attempt left each inference rank holding (before its record is replaced)
        let held = self
            .request
            .options
            .deltas
            .then(|| p.updates.latest().map(|u| self.held_after(u)))
            .flatten();
        tracing::info!(pair = %name, version, attempt, "update started");
        let out = self.out_from_start(&p);
        let taking_part = Engines::of(out.iter().map(Option::is_none).collect());
        let engines = out.len();
        let (gone, trimmed) = p.updates.insert(Update {
            version,
            attempt,
            state: if pending {
                UpdateState::Pending
            } else {
                UpdateState::Running
            },
            started: Instant::now(),
            started_unix_ms: unix_ms(),
            deadline,
            pause: None,
            finished: None,
            ranks: vec![RankSlot::default(); self.slots.total()],
            base: None,
            held,
            succeeded: 0,
            bytes: [0; 2],
            checksums: [0; 2],
            error: None,
            engine_errors: Vec::new(),
            trigger_waiting: false,
            finishing: false,
            applying: false,
            applied: 0,
            resuming: false,
            left_out: out,
            unwritten: vec![false; engines],
            trigger_open: vec![false; engines],
        });
        for v in gone {
            p.changed(Op::Update(v));
        }
        for v in trimmed {
            // its header says it has no per-rank detail any more
            p.changed(Op::ClearReports(v));
            p.changed(Op::Update(v));
        }
        p.changed(Op::ClearReports(version));
        p.changed(Op::Update(version));
        if pending {
            let rewarm = Engines::of(
                (0..self.slots.engines)
                    .map(|e| {
                        // per-engine commits: an engine taking part whose ranks are all gone (a
                        // server that died) is warmed up again: a restarted one's receivers
                        // join with the warm-up calls
                        !self.request.options.commit.is_all()
                            && taking_part.has(e as usize)
                            && self.engine_slots(e).all(|i| {
                                p.roster
                                    .slots
                                    .get(i)
                                    .is_none_or(|j| j.as_ref().is_none_or(|j| j.gone))
                            })
                    })
                    .collect(),
            );
            self.engine_cmd(EngineCmd::Pause {
                version,
                attempt,
                engines: taking_part,
                rewarm,
            });
        } else {
            bind_claims(&mut p, version);
            self.publish_update(&mut p, version, attempt);
        }
        self.update_tx.send_replace(());
        let status = p
            .updates
            .latest()
            .map(|u| self.update_status(u, RankDetail::None));
        drop(p);
        let weak = Arc::downgrade(self);
        tokio::spawn(async move {
            tokio::time::sleep(deadline).await;
            if let Some(e) = weak.upgrade() {
                e.enforce_update_deadline(version, attempt);
            }
        });
        status.ok_or(UpdateError::Vanished { version })
    }

    /// The status of `version` once it committed or failed, or as it is at `end`; fails it on
    /// the way if its deadline passes while waiting.
    pub(crate) async fn wait_update(
        &self,
        version: u64,
        end: Instant,
        detail: RankDetail,
    ) -> Result<UpdateStatus, UpdateError> {
        let mut rx = self.update_tx.subscribe();
        loop {
            let (v, attempt, done) = {
                let p = self.lock();
                let Some(u) = p.updates.history.get(&version) else {
                    return Err(UpdateError::NoSuchVersion {
                        pair: self.name.clone(),
                        version,
                        latest: p.updates.latest().map(|l| l.version),
                    });
                };
                // a final attempt answers once the engines were resumed after it (a committed
                // version is served when the wait returns)
                if (u.state.is_final() && !u.resuming) || Instant::now() >= end {
                    return Ok(self.update_status(u, detail));
                }
                (u.version, u.attempt, u.elapsed() >= u.deadline)
            };
            if done {
                self.enforce_update_deadline(v, attempt);
                continue;
            }
            let _ = tokio::time::timeout_at(end, rx.changed()).await;
        }
    }

    /// Records a rank's report of `version`: a success settles the version (it commits once
    /// every rank succeeded), a failure fails it with the rank's reason.
    pub(crate) fn report(&self, version: u64, r: Report) -> Result<ReportAck, UpdateError> {
        let name = &self.name;
        let slot = self
            .slots
            .index(r.side, r.rank)
            .map_err(UpdateError::Reporter)?;
        let who = rank_name(r.side, r.rank);
        if r.error.as_ref().is_some_and(|e| e.len() > MAX_ERROR_BYTES) {
            return Err(UpdateError::ErrorTooLong { who });
        }
        if !r.unreached.is_empty() {
            let why = if !self.slots.is_training(slot) {
                Some("`unreached` is for training ranks, which name the engines they could not send to".to_string())
            } else if let Some(e) = r.unreached.iter().find(|&&e| e >= self.slots.engines) {
                Some(format!(
                    "`unreached` names engine {e}, but the pair's engines are 0..{}",
                    self.slots.engines
                ))
            } else if !r.ok {
                Some("`unreached` goes with a successful part (`ok`: true); a failed part fails the version".to_string())
            } else {
                None
            };
            if let Some(why) = why {
                return Err(UpdateError::BadUnreached { who, why });
            }
        }
        if self.request.options.checksums && r.ok && r.checksum.is_none() {
            return Err(UpdateError::ChecksumMissing {
                pair: name.clone(),
                who,
            });
        }
        let mut p = self.lock();
        if p.state == PairState::Disconnected {
            return Err(UpdateError::Disconnected { pair: name.clone() });
        }
        // only the process that held the slot when the version was announced reports for it
        let announced = p
            .updates
            .history
            .get(&version)
            .and_then(|u| u.ranks.get(slot))
            .and_then(|r| r.claim.clone());
        p.roster
            .check_reporter(
                &self.slots,
                slot,
                announced.as_deref(),
                r.incarnation.as_deref(),
            )
            .map_err(UpdateError::Reporter)?;
        let Some(u) = p.updates.history.get_mut(&version) else {
            return Err(UpdateError::NotAnnounced {
                pair: name.clone(),
                version,
            });
        };
        if let Some(a) = r.attempt {
            if a != u.attempt {
                return Err(UpdateError::AttemptOver {
                    version,
                    attempt: a,
                    current: u.attempt,
                });
            }
        }
        match u.state {
            UpdateState::Running => {}
            UpdateState::Pending => return Err(UpdateError::NotRunning { version }),
            UpdateState::Committed | UpdateState::Failed => {
                return Err(UpdateError::Settled {
                    version,
                    attempt: u.attempt,
                    state: u.state,
                    who,
                });
            }
        }
        let after = ms(u.elapsed());
        let attempt = u.attempt;
        if u.applying {
            // atomic pairs, second phase: every rank received; inference ranks say they applied
            if self.slots.is_training(slot) {
                return Err(UpdateError::ApplyingOnlyInference {
                    who,
                    version,
                    attempt,
                });
            }
            let Some(rank) = u.ranks.get_mut(slot) else {
                return Err(UpdateError::NoRankRecord { who, version });
            };
            if rank.applied.is_some() {
                return Err(UpdateError::AlreadyApplied {
                    who,
                    version,
                    attempt,
                });
            }
            rank.applied = Some(r.ok);
            if !r.ok {
                rank.error = Some(
                    r.error
                        .clone()
                        .unwrap_or_else(|| "no reason given".to_string()),
                );
            }
            if r.ok {
                u.applied += 1;
            }
            p.changed(Op::Report(version, slot));
            if r.ok {
                self.settle(&mut p);
            } else {
                let why = r.error.unwrap_or_else(|| "no reason given".to_string());
                // (under `quorum:K` and `available` only its engine is left out: torn there)
                self.rank_failed(
                    &mut p,
                    slot,
                    format!("{who} failed applying the staged version to its live tensors: {why}"),
                );
            }
            return self.ack(&p, version);
        }
        let Some(rank) = u.ranks.get_mut(slot) else {
            return Err(UpdateError::NoRankRecord { who, version });
        };
        if rank.state.is_some() {
            return Err(UpdateError::AlreadyReported {
                who,
                version,
                attempt,
            });
        }
        rank.state = Some(r.ok);
        rank.bytes = r.bytes;
        rank.checksum = r.checksum;
        rank.error = r.error.clone();
        rank.after_ms = Some(after);
        rank.delta = if r.ok { r.delta } else { None };
        p.changed(Op::Report(version, slot));
        let Some(u) = p.updates.history.get_mut(&version) else {
            return Err(UpdateError::Vanished { version });
        };
        let side = usize::from(!self.slots.is_training(slot));
        u.bytes[side] = u.bytes[side].saturating_add(r.bytes);
        u.checksums[side] = u.checksums[side].wrapping_add(r.checksum.unwrap_or(0));
        if r.ok {
            u.succeeded += 1;
            for &e in &r.unreached {
                let detail = r
                    .error
                    .as_deref()
                    .map(|x| format!(": {x}"))
                    .unwrap_or_default();
                let why = format!("{who} could not reach engine {e}{detail}");
                self.engine_failed(&mut p, e, why);
            }
            self.settle(&mut p);
        } else {
            let why = r.error.unwrap_or_else(|| "no reason given".to_string());
            self.rank_failed(&mut p, slot, format!("{who} reported failure: {why}"));
        }
        self.ack(&p, version)
    }

    /// The answer to a report: where `version` stands now.
    fn ack(&self, p: &Pair, version: u64) -> Result<ReportAck, UpdateError> {
        let u = p
            .updates
            .history
            .get(&version)
            .ok_or(UpdateError::Vanished { version })?;
        Ok(ReportAck {
            version,
            attempt: u.attempt,
            state: u.state,
            succeeded: u.succeeded as u32,
            world_size: self.slots.total() as u32,
        })
    }

    /// Marks the current attempt failed, tells ranks that were told to run it (`abort`), resumes
    /// the engines.
    pub(crate) fn fail(&self, p: &mut Pair, reason: String) {
        self.fail_and(p, reason, false);
    }

    /// [`Self::fail`]; with `resume`, the engines are resumed even on torn weights (the pair
    /// is going away).
    fn fail_and(&self, p: &mut Pair, reason: String, resume: bool) {
        let Some(u) = p.updates.latest_mut() else {
            return;
        };
        if u.state.is_final() {
            return;
        }
        let announced = u.state == UpdateState::Running;
        // in atomic pairs the live tensors are written only once `apply` went out
        let wrote = announced && (self.request.options.apply == ApplyMode::InPlace || u.applying);
        u.state = UpdateState::Failed;
        u.finished = Some(Instant::now());
        let error = format!(
            "version {} attempt {} failed: {reason}",
            u.version, u.attempt
        );
        u.error = Some(error.clone());
        let (version, attempt) = (u.version, u.attempt);
        p.changed(Op::Update(version));
        p.changed(Op::State);
        let Some(u) = p.updates.history.get(&version) else {
            return;
        };
        tracing::warn!(
            pair = %self.name,
            version,
            attempt,
            elapsed_ms = ms(u.elapsed()),
            error = %error,
            "update failed"
        );
        self.metrics
            .update_finished(false, u.elapsed().as_secs_f64(), u.bytes);
        let now = unix_ms();
        let left_out = u.left_out.clone();
        let unwritten = u.unwritten.clone();
        for (e, rec) in p.engines.iter_mut().enumerate() {
            if !rec.takes_part() {
                continue;
            }
            let why = left_out
                .get(e)
                .cloned()
                .flatten()
                .unwrap_or_else(|| error.clone());
            // an engine out of the attempt when it was announced took nothing of it
            let wrote = wrote && !unwritten.get(e).copied().unwrap_or(false);
            rec.failed(version, wrote, false, &why, now);
        }
        // ranks waiting for this version learn at once that it failed, even when it never
        // reached them (e.g. pausing the engines failed)
        self.publish(
            p,
            EventKind::Abort,
            Some(version),
            Some(attempt),
            Some(error),
        );
        if wrote {
            // the ranks may have written part of this version: never serve it silently
            p.updates.torn = Some(version);
            p.changed(Op::State);
        }
        if resume
            || (!wrote && p.updates.torn.is_none())
            || self.engines.is_none()
            || !self.request.options.commit.is_all()
        {
            // nothing was written (the live weights are the last committed version's), or the
            // pair is gone: the engines serve again. After an earlier torn attempt they stay
            // paused, even when this attempt wrote nothing. Under per-engine commits each
            // engine that is not torn serves again (its last version whole).
            self.resume_engines(p, version, attempt, resume);
        }
        self.update_tx.send_replace(());
    }

    /// Fails a pending or running update and resumes the engines (used on disconnect: the
    /// controller ended the pair).
    pub(crate) fn fail_running_update(&self, p: &mut Pair, reason: String) {
        self.fail_and(p, reason, true);
    }

    /// Commits the current attempt if every rank succeeded, or fails it on a checksum mismatch.
    fn settle(&self, p: &mut Pair) {
        if !self.request.options.commit.is_all() {
            self.settle_by_engines(p);
            return;
        }
        let checksums = self.request.options.checksums;
        let Some(u) = p.updates.latest_mut() else {
            return;
        };
        if u.state != UpdateState::Running || u.succeeded < u.ranks.len() {
            return;
        }
        if checksums && u.checksums[0] != u.checksums[1] {
            let reason = format!(
                "checksum mismatch: the training ranks' checksums sum to {:#018x}, the inference ranks' to {:#018x}",
                u.checksums[0], u.checksums[1]
            );
            self.fail(p, reason);
            return;
        }
        // (an engine whose receivers apply inside the trigger keeps it open until they applied:
        // `apply` goes out while it waits, the commit waits for its answer)
        if u.finishing || (u.trigger_waiting && self.request.options.apply == ApplyMode::InPlace) {
            return;
        }
        if self.request.options.apply == ApplyMode::Atomic {
            if !u.applying {
                // every rank received and verified: now, and only now, the live tensors change
                self.publish_apply(p);
                return;
            }
            let inference = (0..u.ranks.len())
                .filter(|&i| !self.slots.is_training(i))
                .count();
            if u.applied < inference || u.trigger_waiting {
                return;
            }
        }
        if self.engines.as_ref().is_some_and(|l| l.finishes) {
            u.finishing = true;
            let (version, attempt) = (u.version, u.attempt);
            let engines = Engines::all(self.slots.engines as usize);
            self.engine_cmd(EngineCmd::Finish {
                version,
                attempt,
                engines,
            });
            return;
        }
        self.commit(p);
    }

    /// Commits the current attempt (every rank and every engine said success).
    fn commit(&self, p: &mut Pair) {
        let Some(u) = p.updates.latest_mut() else {
            return;
        };
        if u.state != UpdateState::Running {
            return;
        }
        u.state = UpdateState::Committed;
        u.finished = Some(Instant::now());
        let (version, attempt) = (u.version, u.attempt);
        tracing::info!(
            pair = %self.name,
            version,
            attempt,
            elapsed_ms = ms(u.elapsed()),
            training_bytes = u.bytes[0],
            inference_bytes = u.bytes[1],
            "update committed"
        );
        self.metrics
            .update_finished(true, u.elapsed().as_secs_f64(), u.bytes);
        let left_out = u.left_out.clone();
        let unwritten = u.unwritten.clone();
        p.updates.committed = Some(version);
        p.updates.torn = None;
        p.updates.serving_torn = None;
        let now = unix_ms();
        // a left-out engine's ranks may have written part of the version, unless it was out
        // before anything was written there (in atomic pairs: before `apply` went out)
        let wrote = true;
        for (e, rec) in p.engines.iter_mut().enumerate() {
            // a free slot, or an added engine still joining, took no part: nothing changes
            if !rec.takes_part() {
                continue;
            }
            match left_out.get(e).cloned().flatten() {
                None => rec.applied(version),
                Some(why) => {
                    tracing::warn!(pair = %self.name, version, engine = e, error = %why, "engine left out of a committed version: behind");
                    let wrote = wrote && !unwritten.get(e).copied().unwrap_or(false);
                    rec.failed(version, wrote, true, &why, now);
                }
            }
        }
        p.changed(Op::Update(version));
        p.changed(Op::State);
        self.resume_engines(p, version, attempt, false);
        self.update_tx.send_replace(());
    }

    /// The engines' loaders answered the trigger of `version`/`attempt`.
    pub(crate) fn engines_triggered(&self, version: u64, attempt: u32, failed: Vec<EngineFailure>) {
        let mut p = self.lock();
        let Some(u) = p.updates.attempt_mut(version, attempt) else {
            return;
        };
        if u.state != UpdateState::Running {
            return;
        }
        u.trigger_waiting = false;
        u.trigger_open.fill(false);
        if failed.is_empty() {
            self.settle(&mut p);
        } else {
            let errors = messages(&failed);
            u.engine_errors.extend(errors.iter().cloned());
            self.fail(
                &mut p,
                format!(
                    "the inference engines' weight loaders failed: {}",
                    errors.join("; ")
                ),
            );
        }
    }

    /// Per-engine commits: engine `engine`'s loader answered the trigger of
    /// `version`/`attempt`; a failure leaves that engine out of the version.
    pub(crate) fn engine_triggered(
        &self,
        version: u64,
        attempt: u32,
        engine: u32,
        error: Option<String>,
    ) {
        let mut p = self.lock();
        let Some(u) = p.updates.attempt_mut(version, attempt) else {
            return;
        };
        if u.state != UpdateState::Running {
            return;
        }
        if let Some(t) = u.trigger_open.get_mut(engine as usize) {
            *t = false;
        }
        u.trigger_waiting = u.trigger_open.iter().any(|t| *t);
        match error {
            None => self.settle(&mut p),
            Some(e) => {
                u.engine_errors.push(e.clone());
                self.engine_failed(
                    &mut p,
                    engine,
                    format!("the inference engine's weight loader failed: {e}"),
                );
            }
        }
    }

    /// The engines closed the update of `version`/`attempt` (or failed to). Under per-engine
    /// commits an engine that failed to close is left out (its ranks wrote: it is torn) and the
    /// version commits on the others if the policy is still met.
    pub(crate) fn engines_finished(&self, version: u64, attempt: u32, failed: Vec<EngineFailure>) {
        let mut p = self.lock();
        let Some(u) = p.updates.attempt_mut(version, attempt) else {
            return;
        };
        if u.state != UpdateState::Running {
            return;
        }
        u.finishing = false;
        if failed.is_empty() {
            self.commit(&mut p);
            return;
        }
        let errors = messages(&failed);
        u.engine_errors.extend(errors.iter().cloned());
        if self.request.options.commit.is_all() {
            self.fail(
                &mut p,
                format!(
                    "closing the inference engines' update failed: {}",
                    errors.join("; ")
                ),
            );
            return;
        }
        for f in &failed {
            if let Some(x) = u.left_out.get_mut(f.engine as usize) {
                x.get_or_insert_with(|| {
                    format!("closing the engine's update failed: {}", f.message)
                });
            }
        }
        p.changed(Op::Update(version));
        if let Some(reason) = self.short_of_policy(&p) {
            self.fail(&mut p, reason);
        } else {
            self.commit(&mut p);
        }
    }

    /// The warm-up calls after connect finished; their errors are kept for the status.
    pub(crate) fn engines_warmed(&self, errors: Vec<String>) {
        if !errors.is_empty() {
            tracing::warn!(pair = %self.name, errors = %errors.join("; "), "engine warm-up failed");
            let mut p = self.lock();
            p.engine_errors.extend(errors);
            p.changed(Op::State);
        }
    }

    /// The engines were paused (or failed to be) for `version`/`attempt`. Under per-engine
    /// commits an engine whose pause failed is left out of the version from its start (its
    /// ranks take none of it, so its weights stay whole), and the version runs on the others
    /// if the policy can still be met.
    pub(crate) fn engines_paused(&self, version: u64, attempt: u32, failed: Vec<EngineFailure>) {
        let mut p = self.lock();
        let Some(u) = p.updates.attempt_mut(version, attempt) else {
            return;
        };
        if u.state != UpdateState::Pending {
            return;
        }
        u.pause = Some(u.elapsed());
        if !failed.is_empty() {
            let errors = messages(&failed);
            u.engine_errors.extend(errors.iter().cloned());
            if self.request.options.commit.is_all() {
                self.fail(
                    &mut p,
                    format!(
                        "pausing the inference engines failed: {}",
                        errors.join("; ")
                    ),
                );
                return;
            }
            for f in &failed {
                if let Some(x) = u.left_out.get_mut(f.engine as usize) {
                    tracing::warn!(pair = %self.name, version, engine = f.engine, error = %f.message, "engine left out of the update: pausing it failed");
                    x.get_or_insert_with(|| {
                        if f.message.starts_with(WARM_UP_AGAIN) {
                            f.message.clone()
                        } else {
                            format!("pausing the engine failed: {}", f.message)
                        }
                    });
                }
            }
            if let Some(reason) = self.short_of_policy(&p) {
                self.fail(&mut p, reason);
                return;
            }
        }
        let Some(u) = p.updates.attempt_mut(version, attempt) else {
            return;
        };
        u.state = UpdateState::Running;
        let taking_part: Vec<bool> = u.left_out.iter().map(Option::is_none).collect();
        p.changed(Op::Update(version));
        let Some(u) = p.updates.attempt_mut(version, attempt) else {
            return;
        };
        if let Some(lane) = &self.engines {
            for (e, t) in u.trigger_open.iter_mut().enumerate() {
                *t = taking_part.get(e).copied().unwrap_or(false)
                    && lane.triggered.get(e).copied().unwrap_or(false);
            }
        }
        u.trigger_waiting = u.trigger_open.iter().any(|t| *t);
        if u.trigger_waiting {
            self.engine_cmd(EngineCmd::Trigger {
                version,
                attempt,
                engines: Engines::of(taking_part),
            });
        }
        bind_claims(&mut p, version);
        self.publish_update(&mut p, version, attempt);
        self.update_tx.send_replace(());
    }

    /// The engines were resumed after `version`/`attempt`; records errors and wakes the waits
    /// for the attempt's end.
    pub(crate) fn engines_resumed(&self, version: u64, attempt: u32, failed: Vec<EngineFailure>) {
        let mut p = self.lock();
        if let Some(u) = p.updates.attempt_mut(version, attempt) {
            u.resuming = false;
            if !failed.is_empty() {
                u.engine_errors.extend(messages(&failed));
                p.changed(Op::Update(version));
            }
        }
        drop(p);
        self.update_tx.send_replace(());
    }

    /// Fails `version`/`attempt` if it is still unfinished once its deadline passed.
    fn enforce_update_deadline(&self, version: u64, attempt: u32) {
        let mut p = self.lock();
        // which holders are still there (an event poll open, or seen lately): a rank whose
        // process died (its poll's connection closed) is told from the live ones that waited
        let live: Vec<bool> = p
            .roster
            .slots
            .iter()
            .map(|s| s.as_ref().is_some_and(|j| j.live()))
            .collect();
        let members: Vec<bool> = p.engines.iter().map(|r| r.takes_part()).collect();
        let Some(u) = p.updates.attempt_mut(version, attempt) else {
            return;
        };
        if u.state.is_final() || u.elapsed() < u.deadline {
            return;
        }
        if !self.request.options.commit.is_all()
            && u.state == UpdateState::Running
            && (0..self.slots.train as usize)
                .all(|i| u.ranks.get(i).is_some_and(|r| r.state.is_some()))
        {
            // every training rank reported: the engines that did not are left out, and the
            // version commits on the others if the policy is met
            let deadline = ms(u.deadline);
            let mut touched = Vec::new();
            for e in 0..self.slots.engines {
                // a slot out of the version from its start has no rank that should report
                if !members.get(e as usize).copied().unwrap_or(true) {
                    continue;
                }
                // (atomic, after `apply` went out: its ranks that did not report applying, unless
                // the engine was left out before, when they do not apply)
                let applying =
                    u.applying && u.left_out.get(e as usize).is_some_and(Option::is_none);
                let silent: Vec<usize> = self
                    .engine_slots(e)
                    .filter(|&i| {
                        u.ranks
                            .get(i)
                            .is_some_and(|r| r.state.is_none() || (applying && r.applied.is_none()))
                    })
                    .collect();
                if silent.is_empty() {
                    // its ranks reported, but its loader (the trigger) did not answer
                    if u.trigger_open.get(e as usize).copied().unwrap_or(false)
                        && let Some(x) = u.left_out.get_mut(e as usize)
                    {
                        x.get_or_insert_with(|| {
                            format!("the deadline of {deadline} ms passed; engine {e}'s weight loader did not answer")
                        });
                    }
                    continue;
                }
                for &i in &silent {
                    if let Some(r) = u.ranks.get_mut(i) {
                        r.missing = true;
                    }
                }
                if let Some(x) = u.left_out.get_mut(e as usize) {
                    x.get_or_insert_with(|| {
                        format!(
                            "the deadline of {deadline} ms passed; engine {e}'s {} did not report",
                            list_ranks(&self.slots, silent.iter().copied())
                        )
                    });
                }
                touched.extend(silent);
            }
            for i in touched {
                p.changed(Op::Report(version, i));
            }
            p.changed(Op::Update(version));
            self.settle_by_engines(&mut p);
            if p.updates
                .attempt_mut(version, attempt)
                .is_some_and(|u| !u.state.is_final())
            {
                self.fail(
                    &mut p,
                    format!("the deadline of {deadline} ms passed before the version could settle"),
                );
            }
            return;
        }
        let applying = u.applying;
        let waiting: Vec<usize> = u
            .ranks
            .iter()
            .enumerate()
            .filter(|(i, r)| {
                if applying {
                    !self.slots.is_training(*i) && r.applied.is_none()
                } else {
                    r.state.is_none()
                }
            })
            .map(|(i, _)| i)
            .collect();
        let (gone, stayed): (Vec<usize>, Vec<usize>) = waiting
            .iter()
            .partition(|&&i| !live.get(i).copied().unwrap_or(false));
        // the ranks to blame: the gone ones when some are gone and others stayed
        let blamed = if gone.is_empty() || stayed.is_empty() {
            &waiting
        } else {
            &gone
        };
        for &i in blamed {
            if let Some(r) = u.ranks.get_mut(i) {
                r.missing = true;
            }
        }
        let missing = blamed.clone();
        let (did_not, waited_for) = if gone.is_empty() || stayed.is_empty() {
            ("did not report", String::new())
        } else {
            (
                "are gone without reporting",
                format!(
                    " (no event poll open: the process's connection closed, or it was silent for {} s); {} live that did not report waited for them: {}",
                    crate::server::store::roster::HOLDER_LIVENESS.as_secs(),
                    stayed.len(),
                    list_ranks(&self.slots, stayed.iter().copied())
                ),
            )
        };
        let (is_pending, trigger_waiting, finishing, deadline, n) = (
            u.state == UpdateState::Pending,
            u.trigger_waiting,
            u.finishing,
            u.deadline,
            u.ranks.len(),
        );
        for &i in &missing {
            p.changed(Op::Report(version, i));
        }
        let reason = if is_pending {
            format!(
                "the deadline of {} ms passed while pausing the inference engines",
                ms(deadline)
            )
        } else if missing.is_empty() && (trigger_waiting || finishing) {
            format!(
                "the deadline of {} ms passed while the inference engines {}",
                ms(deadline),
                if trigger_waiting {
                    "were receiving (their weight loaders did not answer)"
                } else {
                    "were closing the update"
                }
            )
        } else if applying {
            format!(
                "the deadline of {} ms passed while the inference ranks applied the version; {} did not report applying: {}{waited_for}",
                ms(deadline),
                missing.len(),
                list_ranks(&self.slots, missing.into_iter())
            )
        } else {
            format!(
                "the deadline of {} ms passed; {} of {} ranks {did_not}: {}{waited_for}",
                ms(deadline),
                missing.len(),
                n,
                list_ranks(&self.slots, missing.into_iter())
            )
        };
        self.fail(&mut p, reason);
    }
}

impl EngineEvents for PairEntry {
    fn engines_warmed(&self, errors: Vec<String>) {
        PairEntry::engines_warmed(self, errors)
    }

    fn engines_paused(&self, version: u64, attempt: u32, failed: Vec<EngineFailure>) {
        PairEntry::engines_paused(self, version, attempt, failed)
    }

    fn engines_triggered(&self, version: u64, attempt: u32, failed: Vec<EngineFailure>) {
        PairEntry::engines_triggered(self, version, attempt, failed)
    }

    fn engine_triggered(&self, version: u64, attempt: u32, engine: u32, error: Option<String>) {
        PairEntry::engine_triggered(self, version, attempt, engine, error)
    }

    fn engines_finished(&self, version: u64, attempt: u32, failed: Vec<EngineFailure>) {
        PairEntry::engines_finished(self, version, attempt, failed)
    }

    fn engines_resumed(&self, version: u64, attempt: u32, failed: Vec<EngineFailure>) {
        PairEntry::engines_resumed(self, version, attempt, failed)
    }
}

impl PairEntry {
    /// The slots of engine `e`'s ranks.
    pub(crate) fn engine_slots(&self, e: u32) -> std::ops::Range<usize> {
        let per = self.slots.per_engine as usize;
        let first = self.slots.train as usize + e as usize * per;
        first..first + per
    }

    /// The engine of an inference slot (`None`: a training slot).
    pub(crate) fn engine_of(&self, slot: usize) -> Option<u32> {
        let (side, rank) = self.slots.rank(slot);
        (side == awex_core::layout::Side::Inference).then_some(rank.engine)
    }

    /// The rank in `slot` failed the running attempt (`why` names it): with commit policy
    /// `all`, or a training rank, the version fails; otherwise its engine is left out of the
    /// version, which commits on the others once they settle and the policy is met.
    pub(crate) fn rank_failed(&self, p: &mut Pair, slot: usize, why: String) {
        match self.engine_of(slot) {
            Some(e) => self.engine_failed(p, e, why),
            None => self.fail(p, why),
        }
    }

    /// Engine `engine` failed the running attempt (`why`): with commit policy `all` the version
    /// fails; otherwise the engine is left out of it, and the version settles if it can.
    pub(crate) fn engine_failed(&self, p: &mut Pair, engine: u32, why: String) {
        if self.request.options.commit.is_all() {
            self.fail(p, why);
            return;
        }
        let Some(u) = p.updates.latest_mut() else {
            return;
        };
        if u.state != UpdateState::Running {
            return;
        }
        let (version, attempt) = (u.version, u.attempt);
        if let Some(x) = u.left_out.get_mut(engine as usize)
            && x.is_none()
        {
            tracing::warn!(pair = %self.name, version, engine, error = %why, "engine left out of the update");
            *x = Some(why.clone());
            // the training ranks stop sending to it and waiting for it
            self.publish(
                p,
                EventKind::LeftOut,
                Some(version),
                Some(attempt),
                Some(why),
            );
            if let Some(ev) = p.events.events.back_mut() {
                ev.engines = vec![engine];
            }
        }
        p.changed(Op::Update(version));
        self.settle_by_engines(p);
        self.update_tx.send_replace(());
    }

    /// Commit policies `quorum:K` and `available`: commits the running attempt once every
    /// training rank succeeded and every engine either applied it (each of its ranks
    /// succeeded, and its loader answered where it is triggered) or was left out, if enough
    /// engines applied it (after the applied engines' closing calls, where the engines have
    /// them); fails it as soon as too few engines can still apply it.
    fn settle_by_engines(&self, p: &mut Pair) {
        if let Some(reason) = self.short_of_policy(p) {
            self.fail(p, reason);
            return;
        }
        let atomic = self.request.options.apply == ApplyMode::Atomic;
        let Some(u) = p.updates.latest_mut() else {
            return;
        };
        if u.state != UpdateState::Running || u.finishing {
            return;
        }
        let ok = |i: usize| u.ranks.get(i).is_some_and(|r| r.state == Some(true));
        let applied_live = |i: usize| u.ranks.get(i).is_some_and(|r| r.applied == Some(true));
        let training_ok = (0..self.slots.train as usize).all(ok);
        let mut applied = vec![false; self.slots.engines as usize];
        let (mut still, mut received, mut open) = (0u32, 0u32, 0u32);
        for e in 0..self.slots.engines {
            if u.left_out.get(e as usize).is_some_and(Option::is_some) {
                continue;
            }
            still += 1;
            let answered = !u.trigger_open.get(e as usize).copied().unwrap_or(false);
            let got = self.engine_slots(e).all(ok);
            // atomic: received into staging, then (after `apply`) copied into the live tensors;
            // an engine whose receivers apply inside the trigger answers it after applying
            let done = got && answered && (!atomic || self.engine_slots(e).all(applied_live));
            if done {
                applied[e as usize] = true;
            } else {
                open += 1;
            }
            if got {
                received += 1;
            }
        }
        if !training_ok {
            return;
        }
        if atomic && !u.applying {
            // every engine still in received and verified: now, and only now, their live
            // tensors change
            if received == still {
                self.publish_apply(p);
            }
            return;
        }
        if open > 0 {
            return;
        }
        if self.engines.as_ref().is_some_and(|l| l.finishes) {
            u.finishing = true;
            let (version, attempt) = (u.version, u.attempt);
            self.engine_cmd(EngineCmd::Finish {
                version,
                attempt,
                engines: Engines::of(applied),
            });
            return;
        }
        self.commit(p);
    }

    /// Atomic pairs: every rank still in the running attempt received and verified it, so its
    /// live tensors may change now: publishes `apply`, naming the engines left out (their ranks
    /// skip it, so nothing of the attempt is written there).
    fn publish_apply(&self, p: &mut Pair) {
        let Some(u) = p.updates.latest_mut() else {
            return;
        };
        u.applying = true;
        let out: Vec<u32> = (0..u.left_out.len() as u32)
            .filter(|&e| u.left_out[e as usize].is_some())
            .collect();
        for &e in &out {
            if let Some(w) = u.unwritten.get_mut(e as usize) {
                *w = true;
            }
        }
        let (version, attempt) = (u.version, u.attempt);
        tracing::info!(pair = %self.name, version, attempt, left_out = ?out, "every rank still in received; applying");
        p.changed(Op::Update(version));
        self.publish(p, EventKind::Apply, Some(version), Some(attempt), None);
        if let Some(ev) = p.events.events.back_mut() {
            ev.engines = out;
        }
        self.update_tx.send_replace(());
    }

    /// Commit policies `quorum:K` and `available`: why the running attempt can no longer
    /// commit (fewer engines than the policy needs are still in it), or `None`.
    fn short_of_policy(&self, p: &Pair) -> Option<String> {
        let policy = self.request.options.commit;
        if policy.is_all() {
            return None;
        }
        let u = p.updates.latest()?;
        if u.state.is_final() {
            return None;
        }
        let engines = self.slots.engines;
        let need = policy.needs(engines);
        let still = (0..engines)
            .filter(|&e| u.left_out.get(e as usize).is_some_and(Option::is_none))
            .count() as u32;
        if still >= need {
            return None;
        }
        let why: Vec<String> = u
            .left_out()
            .into_iter()
            .map(|l| format!("engine {}: {}", l.engine, l.error))
            .collect();
        Some(format!(
            "only {still} of {engines} engines can still apply it and the commit policy `{policy}` needs {need}; left out: {}",
            why.join("; ")
        ))
    }

    /// Makes every added engine whose ranks all joined a member (as a version starts: an
    /// engine joins the versions that start after it is whole, never one under way).
    fn admit_joined_engines(&self, p: &mut Pair) {
        use crate::server::store::engines::Membership;
        let mut changed = false;
        for e in 0..self.slots.engines {
            let joining = p
                .engines
                .get(e as usize)
                .is_some_and(|r| r.member == Membership::Joining);
            if joining && self.engine_slots(e).all(|i| p.roster.slots[i].is_some()) {
                tracing::info!(pair = %self.name, engine = e, "added engine's ranks joined: it takes part from this version on");
                if let Some(r) = p.engines.get_mut(e as usize) {
                    r.member = Membership::Member;
                }
                changed = true;
            }
        }
        if changed {
            p.changed(Op::State);
        }
    }

    /// Per engine slot, why it is out of a version from its start: a free slot, or an added
    /// engine whose ranks have not all joined (`None`: it takes part).
    fn out_from_start(&self, p: &Pair) -> Vec<Option<String>> {
        use crate::server::store::engines::Membership;
        p.engines
            .iter()
            .map(|r| match r.member {
                Membership::Member => None,
                Membership::Joining => Some(
                    "the engine was added and its ranks have not all joined yet; it takes part in the first update after they did".to_string(),
                ),
                Membership::Absent => Some("the engine slot is free".to_string()),
            })
            .collect()
    }

    /// Announces `version`/`attempt` to the ranks (`update` event), with deltas on naming the
    /// version the inference ranks hold ([`PairEntry::delta_base`]), also kept in its status,
    /// and naming the engine slots out of it from its start.
    fn publish_update(&self, p: &mut Pair, version: u64, attempt: u32) {
        let base = if self.request.options.deltas {
            self.delta_base(p, version)
        } else {
            None
        };
        if let Some(u) = p.updates.attempt_mut(version, attempt) {
            u.base = base.clone();
            // an engine out of the attempt now never takes any of it
            u.unwritten = u.left_out.iter().map(Option::is_some).collect();
        }
        let out: Vec<u32> = p
            .updates
            .attempt_mut(version, attempt)
            .map(|u| {
                (0..u.left_out.len() as u32)
                    .filter(|&e| u.left_out[e as usize].is_some())
                    .collect()
            })
            .unwrap_or_default();
        self.publish(p, EventKind::Update, Some(version), Some(attempt), None);
        if let Some(ev) = p.events.events.back_mut() {
            ev.base = base;
            ev.engines = out;
        }
    }

    /// What `u` (a settled attempt) left each slot holding: its version, and per inference
    /// slot the claim id of the process that reported it applied it whole and keeps its bytes as
    /// received (`ReportDelta::holds`; in atomic pairs: applied to its live tensors), unless its
    /// engine was left out of the attempt.
    fn held_after(&self, u: &crate::server::store::updates::Update) -> (u64, Vec<Option<String>>) {
        let atomic = self.request.options.apply == ApplyMode::Atomic;
        let claims = (0..self.slots.total())
            .map(|i| {
                let r = u.ranks.get(i)?;
                // an engine left out of the attempt holds none of it (a training rank's bytes
                // may not have reached it, though its own ranks reported success)
                let left_out = self
                    .engine_of(i)
                    .and_then(|e| u.left_out.get(e as usize))
                    .is_some_and(Option::is_some);
                let held = !self.slots.is_training(i)
                    && !left_out
                    && r.state == Some(true)
                    && r.delta.is_some_and(|d| d.holds)
                    && (!atomic || r.applied == Some(true));
                if held { r.claim.clone() } else { None }
            })
            .collect();
        (u.version, claims)
    }

    /// The version the inference ranks provably hold as an attempt is announced: what the
    /// attempt before it left them holding ([`PairEntry::held_after`]), for each slot whose
    /// holder is still the same process. Every other inference rank (failed, torn, restarted,
    /// new, or any after a gateway restart: claims are not stored) is in `except`; `None` when
    /// no rank holds it.
    fn delta_base(&self, p: &Pair, version: u64) -> Option<crate::wire::DeltaBase> {
        let u = p.updates.history.get(&version)?;
        let (base, held) = u.held.as_ref()?;
        let claims = p.roster.claims();
        let mut except = Vec::new();
        let mut holders = 0usize;
        for i in 0..self.slots.total() {
            // (a slot out of the version from its start takes nothing: it is not listed)
            if !self.waits_for(p, i) || self.slots.is_training(i) {
                continue;
            }
            let same = held
                .get(i)
                .and_then(|c| c.as_ref())
                .is_some_and(|c| claims.get(i).and_then(|x| x.as_ref()) == Some(c));
            if same {
                holders += 1;
            } else {
                except.push(self.slots.rank(i).1);
            }
        }
        (holders > 0).then_some(crate::wire::DeltaBase {
            version: *base,
            except,
        })
    }
}

/// Binds each rank's part of `version` to the claim id of the slot's holder now, as the version
/// is announced: only that process may report it.
fn bind_claims(p: &mut Pair, version: u64) {
    let claims = p.roster.claims();
    if let Some(u) = p.updates.history.get_mut(&version) {
        for (r, c) in u.ranks.iter_mut().zip(claims) {
            r.claim = c;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::server::store::metrics::Metrics;
    use crate::server::store::roster::Slots;
    use crate::wire::{
        ConnectRequest, InferenceSpec, PairOptions, SideStatus, TrainingSpec, Transport,
    };
    use awex_core::layout::{RankId, Side};
    use awex_core::model::presets::preset;
    use awex_core::{Catalogue, ParallelConfig};
    use std::sync::Mutex;
    use tokio::sync::watch;

    /// A ready pair of 2 training ranks and one engine of 2 ranks, no engine URLs, no store.
    fn ready_pair(options: PairOptions) -> Arc<PairEntry> {
        pair_of(options, 1, 2)
    }

    /// A ready pair of 2 training ranks and `engines` engines of `per` ranks each.
    fn pair_of(options: PairOptions, engines: u32, per: u32) -> Arc<PairEntry> {
        let model = preset("qwen3-tiny").expect("the qwen3-tiny preset exists");
        let summary = Catalogue::of(&model).summary();
        let side = |backend: &str, world_size| SideStatus {
            fp8: None,
            backend: backend.into(),
            parallel: ParallelConfig::default(),
            world_size,
            engines,
            urls: Vec::new(),
            model: "tiny".into(),
            fingerprint: String::new(),
            catalogue: summary.clone(),
            dropped: Vec::new(),
            joined: world_size,
        };
        let request = ConnectRequest {
            name: "p".into(),
            training: TrainingSpec {
                backend: "megatron".into(),
                parallel: ParallelConfig::default(),
                world_size: 2,
                model: model.clone(),
                catalogue: summary.clone(),
            },
            inference: InferenceSpec {
                spare: 0,
                fp8: None,
                backend: "sglang".into(),
                parallel: ParallelConfig::default(),
                engines,
                world_size: engines * per,
                urls: Vec::new(),
                model,
                catalogue: summary.clone(),
            },
            transport: Transport::Shm,
            options,
        };
        let slots = Slots::new(2, engines, per);
        let mut pair = Pair::new(&slots);
        pair.state = PairState::Ready;
        Arc::new(PairEntry {
            name: "p".into(),
            id: 1,
            uid: "0".repeat(32),
            secret: String::new(),
            request,
            slots,
            created_unix_ms: 0,
            join_deadline: Instant::now(),
            join_deadline_unix_ms: 0,
            training: side("megatron", 2),
            inference: side("sglang", engines * per),
            inner: Mutex::new(pair),
            roster_tx: watch::Sender::new(()),
            events_tx: watch::Sender::new(0),
            kv_tx: watch::Sender::new(()),
            update_tx: watch::Sender::new(()),
            metrics: Arc::new(Metrics::default()),
            engines: None,
            facts: Vec::new(),
            store: None,
        })
    }

    /// The four ranks of [`ready_pair`], training first.
    const RANKS: [(Side, RankId); 4] = [
        (Side::Training, RankId::train(0)),
        (Side::Training, RankId::train(1)),
        (Side::Inference, RankId { engine: 0, rank: 0 }),
        (Side::Inference, RankId { engine: 0, rank: 1 }),
    ];

    fn ok(rank: usize, checksum: Option<u64>) -> Report {
        let (side, rank) = RANKS[rank];
        Report {
            side,
            rank,
            ok: true,
            bytes: 10,
            checksum,
            error: None,
            attempt: Some(1),
            incarnation: None,
            delta: None,
            unreached: Vec::new(),
        }
    }

    fn failed(rank: usize, why: &str) -> Report {
        Report {
            ok: false,
            error: Some(why.to_string()),
            ..ok(rank, None)
        }
    }

    fn kinds(entry: &PairEntry) -> Vec<EventKind> {
        entry
            .lock()
            .events
            .since(0)
            .iter()
            .map(|e| e.kind)
            .collect()
    }

    fn state(entry: &PairEntry, version: u64) -> UpdateState {
        entry.lock().updates.history[&version].state
    }

    #[tokio::test]
    async fn commits_only_once_every_rank_of_both_sides_reported_ok() {
        let entry = ready_pair(PairOptions::default());
        let started = entry
            .start_update(1)
            .expect("a ready pair starts version 1");
        assert_eq!(started.state, UpdateState::Running);
        for (i, succeeded) in [(0, 1), (3, 2), (1, 3)] {
            let ack = entry.report(1, ok(i, None)).expect("report accepted");
            assert_eq!(
                (ack.state, ack.succeeded),
                (UpdateState::Running, succeeded)
            );
            assert_eq!(entry.lock().updates.committed(), None);
        }
        let ack = entry.report(1, ok(2, None)).expect("the last report");
        assert_eq!(
            (ack.state, ack.succeeded, ack.world_size),
            (UpdateState::Committed, 4, 4)
        );
        let p = entry.lock();
        assert_eq!(p.updates.committed(), Some(1));
        assert_eq!(p.updates.history[&1].bytes, [20, 20]);
        drop(p);
        assert_eq!(kinds(&entry), [EventKind::Update]);
    }

    #[tokio::test]
    async fn a_failed_report_fails_the_version_with_the_rank_and_its_reason() {
        let entry = ready_pair(PairOptions::default());
        entry.start_update(1).expect("started");
        entry.report(1, ok(0, None)).expect("accepted");
        let ack = entry
            .report(1, failed(2, "NCCL watchdog timeout"))
            .expect("a failure report is accepted");
        assert_eq!(ack.state, UpdateState::Failed);
        let p = entry.lock();
        let u = &p.updates.history[&1];
        let error = u.error.clone().unwrap_or_default();
        assert_eq!(
            error,
            "version 1 attempt 1 failed: inference rank 0/0 reported failure: NCCL watchdog timeout"
        );
        // in place: the ranks may have written part of it
        assert_eq!(p.updates.torn(), Some(1));
        assert_eq!(p.updates.committed(), None);
        let abort = p.events.since(0).pop().expect("an event was published");
        assert_eq!((abort.kind, abort.version), (EventKind::Abort, Some(1)));
        assert_eq!(abort.reason, Some(error));
    }

    #[tokio::test]
    async fn a_settled_version_refuses_later_reports_and_stays_settled() {
        let entry = ready_pair(PairOptions::default());
        entry.start_update(1).expect("started");
        for i in 0..4 {
            entry.report(1, ok(i, None)).expect("accepted");
        }
        let late = entry.report(1, ok(0, None));
        assert!(
            matches!(
                late,
                Err(UpdateError::Settled {
                    version: 1,
                    attempt: 1,
                    state: UpdateState::Committed,
                    ..
                })
            ),
            "{late:?}"
        );
        entry
            .start_update(2)
            .expect("version 2 starts after 1 committed");
        entry
            .report(2, failed(1, "out of memory"))
            .expect("accepted");
        let late = entry.report(2, ok(0, None));
        assert!(
            matches!(
                late,
                Err(UpdateError::Settled {
                    version: 2,
                    state: UpdateState::Failed,
                    ..
                })
            ),
            "{late:?}"
        );
        let late = late.err().map(|e| e.to_string()).unwrap_or_default();
        assert!(late.contains("training rank 0 came too late"), "{late}");
        assert_eq!(state(&entry, 1), UpdateState::Committed);
        assert_eq!(state(&entry, 2), UpdateState::Failed);
        assert_eq!(entry.lock().updates.history[&2].succeeded, 0);
    }

    #[tokio::test]
    async fn a_second_report_of_one_rank_is_refused_and_not_counted() {
        let entry = ready_pair(PairOptions::default());
        entry.start_update(1).expect("started");
        entry.report(1, ok(1, None)).expect("accepted");
        let again = entry.report(1, ok(1, None));
        assert!(
            matches!(
                again,
                Err(UpdateError::AlreadyReported {
                    version: 1,
                    attempt: 1,
                    ..
                })
            ),
            "{again:?}"
        );
        assert_eq!(entry.lock().updates.history[&1].succeeded, 1);
    }

    #[tokio::test]
    async fn checksums_that_disagree_fail_the_version_instead_of_committing_it() {
        let entry = ready_pair(PairOptions {
            checksums: true,
            ..PairOptions::default()
        });
        entry.start_update(1).expect("started");
        let missing = entry.report(1, ok(0, None));
        assert!(
            matches!(missing, Err(UpdateError::ChecksumMissing { .. })),
            "{missing:?}"
        );
        for (i, sum) in [(0, 1), (1, 2), (2, 1), (3, 3)] {
            entry.report(1, ok(i, Some(sum))).expect("accepted");
        }
        assert_eq!(state(&entry, 1), UpdateState::Failed);
        let error = entry.lock().updates.history[&1]
            .error
            .clone()
            .unwrap_or_default();
        assert!(error.contains("checksum mismatch"), "{error}");
    }

    #[tokio::test]
    async fn atomic_commits_only_after_every_inference_rank_applied() {
        let entry = ready_pair(PairOptions {
            apply: ApplyMode::Atomic,
            ..PairOptions::default()
        });
        entry.start_update(1).expect("started");
        for i in 0..4 {
            entry.report(1, ok(i, None)).expect("accepted");
        }
        assert_eq!(state(&entry, 1), UpdateState::Running);
        assert_eq!(kinds(&entry), [EventKind::Update, EventKind::Apply]);
        let training = entry.report(1, ok(0, None));
        assert!(
            matches!(training, Err(UpdateError::ApplyingOnlyInference { .. })),
            "{training:?}"
        );
        entry.report(1, ok(2, None)).expect("applied");
        assert_eq!(state(&entry, 1), UpdateState::Running);
        let ack = entry.report(1, ok(3, None)).expect("applied");
        assert_eq!(ack.state, UpdateState::Committed);
    }

    #[tokio::test]
    async fn an_atomic_failure_before_apply_is_not_torn() {
        let entry = ready_pair(PairOptions {
            apply: ApplyMode::Atomic,
            ..PairOptions::default()
        });
        entry.start_update(1).expect("started");
        entry.report(1, failed(3, "bad digest")).expect("accepted");
        assert_eq!(state(&entry, 1), UpdateState::Failed);
        assert_eq!(entry.lock().updates.torn(), None);
    }

    #[tokio::test]
    async fn start_refuses_a_busy_pair_and_stale_versions_and_retries_a_failed_one() {
        let entry = ready_pair(PairOptions::default());
        entry.start_update(5).expect("started");
        let busy = entry.start_update(6);
        assert!(
            matches!(
                busy,
                Err(UpdateError::Busy {
                    current: 5,
                    version: 6,
                    ..
                })
            ),
            "{busy:?}"
        );
        entry.report(5, failed(0, "x")).expect("accepted");
        let stale = entry.start_update(4);
        assert!(
            matches!(
                stale,
                Err(UpdateError::Stale {
                    version: 4,
                    latest: 5,
                    ..
                })
            ),
            "{stale:?}"
        );
        let retry = entry
            .start_update(5)
            .expect("a failed version may be retried");
        assert_eq!((retry.version, retry.attempt), (5, 2));
        let old = entry.report(5, ok(0, None));
        assert!(
            matches!(
                old,
                Err(UpdateError::AttemptOver {
                    attempt: 1,
                    current: 2,
                    ..
                })
            ),
            "{old:?}"
        );
    }

    #[tokio::test]
    async fn disconnect_fails_the_running_version_and_refuses_reports() {
        let entry = ready_pair(PairOptions::default());
        entry.start_update(1).expect("started");
        entry.disconnect();
        assert_eq!(state(&entry, 1), UpdateState::Failed);
        let late = entry.report(1, ok(0, None));
        assert!(
            matches!(late, Err(UpdateError::Disconnected { .. })),
            "{late:?}"
        );
        let start = entry.start_update(2);
        assert!(
            matches!(start, Err(UpdateError::Disconnected { .. })),
            "{start:?}"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_missed_deadline_fails_the_version_naming_the_ranks_that_did_not_report() {
        let entry = ready_pair(PairOptions {
            update_deadline_ms: 1_000,
            ..PairOptions::default()
        });
        entry.start_update(1).expect("started");
        for i in 0..3 {
            entry.report(1, ok(i, None)).expect("accepted");
        }
        // the paused clock jumps to the deadline once every task waits: no wall-clock bound
        let end = Instant::now() + Duration::from_secs(60);
        let status = entry.wait_update(1, end, RankDetail::None).await;
        let status = status.expect("version 1 exists");
        assert_eq!(status.state, UpdateState::Failed);
        let error = entry.lock().updates.history[&1]
            .error
            .clone()
            .unwrap_or_default();
        assert!(error.contains("1 of 4 ranks did not report"), "{error}");
        assert!(error.contains("inference rank 0/1"), "{error}");
        assert!(entry.lock().updates.history[&1].ranks[3].missing);
        let unknown = entry.wait_update(2, end, RankDetail::None).await;
        assert!(
            matches!(
                unknown,
                Err(UpdateError::NoSuchVersion {
                    version: 2,
                    latest: Some(1),
                    ..
                })
            ),
            "{unknown:?}"
        );
    }

    /// A report of inference rank `{engine, 0}` (engines of one rank), or of training rank `t`.
    fn engine_report(engine: u32, ok: bool) -> Report {
        Report {
            side: Side::Inference,
            rank: RankId { engine, rank: 0 },
            ok,
            bytes: 10,
            checksum: None,
            error: (!ok).then(|| "peer reset".to_string()),
            attempt: None,
            incarnation: None,
            delta: None,
            unreached: Vec::new(),
        }
    }

    fn training_report(t: u32) -> Report {
        Report {
            side: Side::Training,
            rank: RankId::train(t),
            ..engine_report(0, true)
        }
    }

    fn policy(commit: crate::wire::CommitPolicy, deadline_ms: u64) -> PairOptions {
        PairOptions {
            commit,
            update_deadline_ms: deadline_ms,
            ..PairOptions::default()
        }
    }

    fn engine_states(entry: &PairEntry) -> Vec<crate::wire::EngineStatus> {
        entry.engines().1
    }

    #[tokio::test]
    async fn atomic_available_applies_on_the_engines_still_in_and_tears_only_an_engine_that_failed_applying()
     {
        use crate::wire::{CommitPolicy, EngineState};
        let entry = pair_of(
            PairOptions {
                apply: ApplyMode::Atomic,
                ..policy(CommitPolicy::Available, 60_000)
            },
            3,
            1,
        );
        entry.start_update(1).expect("started");
        entry.report(1, training_report(0)).expect("accepted");
        entry.report(1, training_report(1)).expect("accepted");
        // engine 1 fails receiving: left out before anything reached its live tensors
        entry.report(1, engine_report(1, false)).expect("accepted");
        entry.report(1, engine_report(0, true)).expect("accepted");
        assert_eq!(state(&entry, 1), UpdateState::Running);
        entry.report(1, engine_report(2, true)).expect("accepted");
        // every engine still in received: `apply` goes out naming engine 1, whose ranks skip it
        let apply = {
            let p = entry.lock();
            p.events.events.back().cloned().expect("an event")
        };
        assert_eq!(apply.kind, EventKind::Apply);
        assert_eq!(apply.engines, vec![1]);
        assert_eq!(state(&entry, 1), UpdateState::Running);
        // engine 2 fails applying (its live tensors partly written), engine 0 applies
        entry.report(1, engine_report(2, false)).expect("accepted");
        assert_eq!(state(&entry, 1), UpdateState::Running);
        let ack = entry.report(1, engine_report(0, true)).expect("applied");
        assert_eq!(ack.state, UpdateState::Committed);
        let engines = engine_states(&entry);
        assert_eq!(
            engines.iter().map(|e| e.state).collect::<Vec<_>>(),
            vec![EngineState::Serving, EngineState::Behind, EngineState::Torn]
        );
        assert_eq!(engines[1].torn_version, None);
        assert_eq!(engines[2].torn_version, Some(1));
        assert!(
            engines[2]
                .last_error
                .as_deref()
                .is_some_and(|e| e.contains("failed applying the staged version")),
            "{engines:?}"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn atomic_available_leaves_out_at_the_deadline_an_engine_silent_after_apply() {
        use crate::wire::{CommitPolicy, EngineState};
        let entry = pair_of(
            PairOptions {
                apply: ApplyMode::Atomic,
                ..policy(CommitPolicy::Available, 1_000)
            },
            3,
            1,
        );
        entry.start_update(1).expect("started");
        for r in [training_report(0), training_report(1)] {
            entry.report(1, r).expect("accepted");
        }
        for e in 0..3 {
            entry.report(1, engine_report(e, true)).expect("received");
        }
        // `apply` went out to all three; engines 0 and 1 apply, engine 2 falls silent
        entry.report(1, engine_report(0, true)).expect("applied");
        entry.report(1, engine_report(1, true)).expect("applied");
        let end = Instant::now() + Duration::from_secs(600);
        let status = entry
            .wait_update(1, end, RankDetail::All)
            .await
            .expect("version 1 exists");
        assert_eq!(status.state, UpdateState::Committed, "{:?}", status.error);
        assert_eq!(
            status.left_out.iter().map(|l| l.engine).collect::<Vec<_>>(),
            vec![2]
        );
        let engines = engine_states(&entry);
        // its live tensors may hold part of the version: torn, not serving it
        assert_eq!(engines[2].state, EngineState::Torn);
        assert_eq!(engines[2].serving_version, None);
        assert_eq!(engines[0].serving_version, Some(1));
    }

    #[tokio::test]
    async fn available_commits_on_the_engines_that_applied_and_reports_the_failed_one_behind() {
        use crate::wire::{CommitPolicy, EngineState};
        let entry = pair_of(policy(CommitPolicy::Available, 60_000), 3, 1);
        entry.start_update(1).expect("started");
        entry.report(1, training_report(0)).expect("accepted");
        let ack = entry
            .report(1, engine_report(1, false))
            .expect("a failure is accepted");
        // engine 1 is left out; the version goes on for the others
        assert_eq!(ack.state, UpdateState::Running);
        entry.report(1, engine_report(0, true)).expect("accepted");
        entry.report(1, training_report(1)).expect("accepted");
        assert_eq!(state(&entry, 1), UpdateState::Running);
        let ack = entry.report(1, engine_report(2, true)).expect("accepted");
        assert_eq!(ack.state, UpdateState::Committed);
        assert_eq!(entry.lock().updates.committed(), Some(1));
        // the version's status names the engine left out and why
        let status = entry.update_status(&entry.lock().updates.history[&1], RankDetail::None);
        assert_eq!(status.left_out.len(), 1);
        assert_eq!(status.left_out[0].engine, 1);
        assert!(
            status.left_out[0]
                .error
                .contains("inference rank 1/0 reported failure: peer reset"),
            "{:?}",
            status.left_out
        );
        let engines = engine_states(&entry);
        let by = |e: usize| (engines[e].state, engines[e].serving_version);
        assert_eq!(by(0), (EngineState::Serving, Some(1)));
        assert_eq!(by(2), (EngineState::Serving, Some(1)));
        // never reported serving what it holds only partly: torn, serving nothing whole
        assert_eq!(by(1), (EngineState::Torn, None));
        assert_eq!(engines[1].torn_version, Some(1));
        assert!(engines[1].behind_since_unix_ms.is_some());
        assert!(
            engines[1]
                .last_error
                .as_deref()
                .unwrap_or("")
                .contains("peer reset")
        );
        // the pair itself is not torn: the committed engines serve
        assert_eq!(entry.lock().updates.torn(), None);

        // catch-up: the behind engine takes part in the next update and serves it once applied
        entry
            .start_update(2)
            .expect("the next update starts at once");
        let engines = engine_states(&entry);
        assert_eq!(engines[1].state, EngineState::CatchingUp);
        assert_eq!(engines[0].state, EngineState::Serving);
        for r in [training_report(0), training_report(1)] {
            entry.report(2, r).expect("accepted");
        }
        for e in 0..3 {
            entry.report(2, engine_report(e, true)).expect("accepted");
        }
        assert_eq!(state(&entry, 2), UpdateState::Committed);
        for e in engine_states(&entry) {
            assert_eq!(
                (
                    e.state,
                    e.serving_version,
                    e.torn_version,
                    e.behind_since_unix_ms
                ),
                (EngineState::Serving, Some(2), None, None),
                "{e:?}"
            );
        }
    }

    #[tokio::test]
    async fn quorum_commits_with_k_engines_and_fails_at_once_when_k_cannot_be_reached() {
        use crate::wire::{CommitPolicy, EngineState};
        let entry = pair_of(policy(CommitPolicy::Quorum(2), 60_000), 3, 1);
        entry.start_update(1).expect("started");
        entry.report(1, engine_report(2, false)).expect("accepted");
        for r in [training_report(0), training_report(1)] {
            entry.report(1, r).expect("accepted");
        }
        entry.report(1, engine_report(0, true)).expect("accepted");
        assert_eq!(state(&entry, 1), UpdateState::Running);
        entry.report(1, engine_report(1, true)).expect("accepted");
        assert_eq!(state(&entry, 1), UpdateState::Committed);

        // two of three fail: quorum 2 is out of reach, the version fails without waiting
        entry.start_update(2).expect("started");
        entry.report(2, engine_report(0, false)).expect("accepted");
        assert_eq!(state(&entry, 2), UpdateState::Running);
        entry.report(2, engine_report(1, false)).expect("accepted");
        assert_eq!(state(&entry, 2), UpdateState::Failed);
        let error = entry.lock().updates.history[&2]
            .error
            .clone()
            .unwrap_or_default();
        assert!(
            error.contains(
                "only 1 of 3 engines can still apply it and the commit policy `quorum:2` needs 2"
            ),
            "{error}"
        );
        assert_eq!(entry.lock().updates.committed(), Some(1));
        // nothing is reported serving version 2; every engine that may have written it is torn
        for e in engine_states(&entry) {
            assert_ne!(e.serving_version, Some(2), "{e:?}");
            assert_eq!(e.state, EngineState::Torn, "{e:?}");
        }
    }

    #[tokio::test]
    async fn a_training_rank_failure_fails_the_version_under_every_policy() {
        use crate::wire::CommitPolicy;
        for commit in [CommitPolicy::Available, CommitPolicy::Quorum(1)] {
            let entry = pair_of(policy(commit, 60_000), 3, 1);
            entry.start_update(1).expect("started");
            for e in 0..3 {
                entry.report(1, engine_report(e, true)).expect("accepted");
            }
            let failed = Report {
                ok: false,
                error: Some("out of memory".into()),
                ..training_report(1)
            };
            entry.report(1, failed).expect("accepted");
            assert_eq!(state(&entry, 1), UpdateState::Failed, "{commit}");
            assert_eq!(entry.lock().updates.committed(), None);
        }
    }

    #[tokio::test]
    async fn a_gone_inference_rank_leaves_only_its_engine_out() {
        use crate::wire::CommitPolicy;
        let entry = pair_of(policy(CommitPolicy::Available, 60_000), 2, 2);
        entry.start_update(1).expect("started");
        {
            let mut p = entry.lock();
            // slot 2 + 2 = engine 1, rank 0
            entry.rank_failed(&mut p, 4, "inference rank 1/0 is gone".into());
        }
        assert_eq!(state(&entry, 1), UpdateState::Running);
        for r in [training_report(0), training_report(1)] {
            entry.report(1, r).expect("accepted");
        }
        for rank in 0..2 {
            let r = Report {
                rank: RankId { engine: 0, rank },
                ..engine_report(0, true)
            };
            entry.report(1, r).expect("accepted");
        }
        // engine 1's other rank never reported: the engine is out anyway, the version commits
        assert_eq!(state(&entry, 1), UpdateState::Committed);
        let engines = engine_states(&entry);
        assert_eq!(engines[0].serving_version, Some(1));
        assert_eq!(engines[1].serving_version, None);
        // with `all`, the same loss fails the version (unchanged behaviour)
        let entry = pair_of(PairOptions::default(), 2, 2);
        entry.start_update(1).expect("started");
        {
            let mut p = entry.lock();
            entry.rank_failed(&mut p, 4, "inference rank 1/0 is gone".into());
        }
        assert_eq!(state(&entry, 1), UpdateState::Failed);
    }

    #[tokio::test(start_paused = true)]
    async fn at_the_deadline_available_commits_on_the_healthy_engines_and_the_next_starts_at_once()
    {
        use crate::wire::{CommitPolicy, EngineState};
        let entry = pair_of(policy(CommitPolicy::Available, 1_000), 3, 1);
        let started = Instant::now();
        entry.start_update(1).expect("started");
        for r in [training_report(0), training_report(1)] {
            entry.report(1, r).expect("accepted");
        }
        entry.report(1, engine_report(0, true)).expect("accepted");
        entry.report(1, engine_report(1, true)).expect("accepted");
        // engine 2 is silent (a stopped or hung process): the trainer waits for the deadline,
        // no longer (the paused clock jumps to it: no wall-clock bound)
        let end = Instant::now() + Duration::from_secs(600);
        let status = entry
            .wait_update(1, end, RankDetail::All)
            .await
            .expect("version 1 exists");
        assert_eq!(status.state, UpdateState::Committed);
        assert!(
            started.elapsed() < Duration::from_millis(1_500),
            "{:?}",
            started.elapsed()
        );
        assert_eq!(status.left_out.len(), 1);
        assert!(
            status.left_out[0]
                .error
                .contains("engine 2's inference rank 2/0 did not report"),
            "{:?}",
            status.left_out
        );
        assert!(
            status
                .ranks
                .iter()
                .any(|r| r.rank == RankId { engine: 2, rank: 0 }
                    && r.state == crate::wire::RankReportState::Missing)
        );
        let engines = engine_states(&entry);
        assert_eq!(engines[2].state, EngineState::Torn);
        assert_eq!(engines[0].serving_version, Some(1));
        // the next update starts on time for the healthy engines
        entry
            .start_update(2)
            .expect("version 2 starts once 1 settled");

        // a silent training rank still fails the version at its deadline
        for e in 0..3 {
            entry.report(2, engine_report(e, true)).expect("accepted");
        }
        entry.report(2, training_report(0)).expect("accepted");
        let status = entry
            .wait_update(
                2,
                Instant::now() + Duration::from_secs(600),
                RankDetail::None,
            )
            .await
            .expect("version 2 exists");
        assert_eq!(status.state, UpdateState::Failed);
        assert!(
            status
                .error
                .as_deref()
                .unwrap_or("")
                .contains("training rank 1"),
            "{:?}",
            status.error
        );
    }

    #[tokio::test(start_paused = true)]
    async fn quorum_fails_at_the_deadline_when_too_few_engines_applied() {
        use crate::wire::CommitPolicy;
        let entry = pair_of(policy(CommitPolicy::Quorum(2), 1_000), 3, 1);
        entry.start_update(1).expect("started");
        for r in [training_report(0), training_report(1)] {
            entry.report(1, r).expect("accepted");
        }
        entry.report(1, engine_report(0, true)).expect("accepted");
        // engines 1 and 2 are stopped
        let status = entry
            .wait_update(
                1,
                Instant::now() + Duration::from_secs(600),
                RankDetail::None,
            )
            .await
            .expect("version 1 exists");
        assert_eq!(status.state, UpdateState::Failed);
        assert_eq!(entry.lock().updates.committed(), None);
        let error = status.error.unwrap_or_default();
        assert!(error.contains("needs 2"), "{error}");
        // nothing is reported serving version 1
        for e in engine_states(&entry) {
            assert_eq!(e.serving_version, None, "{e:?}");
        }
        // resumed, the next update commits everywhere
        entry.start_update(2).expect("started");
        for r in [training_report(0), training_report(1)] {
            entry.report(2, r).expect("accepted");
        }
        for e in 0..3 {
            entry.report(2, engine_report(e, true)).expect("accepted");
        }
        assert_eq!(state(&entry, 2), UpdateState::Committed);
        for e in engine_states(&entry) {
            assert_eq!(
                (e.state, e.serving_version),
                (crate::wire::EngineState::Serving, Some(2))
            );
        }
    }

    #[tokio::test]
    async fn a_training_rank_that_could_not_reach_an_engine_leaves_only_that_engine_out() {
        use crate::wire::{CommitPolicy, EngineState};
        let entry = pair_of(policy(CommitPolicy::Available, 60_000), 3, 1);
        entry.start_update(1).expect("started");
        let partial = Report {
            unreached: vec![1],
            error: Some("engine 1: connection reset by peer".into()),
            ..training_report(0)
        };
        entry
            .report(1, partial)
            .expect("a partial success is accepted");
        entry.report(1, training_report(1)).expect("accepted");
        for e in 0..3 {
            entry.report(1, engine_report(e, true)).expect("accepted");
        }
        // engine 1's own rank said it received, but a training rank's bytes never reached it
        assert_eq!(state(&entry, 1), UpdateState::Committed);
        let engines = engine_states(&entry);
        assert_eq!(engines[1].state, EngineState::Torn);
        assert_eq!(engines[1].serving_version, None);
        assert!(
            engines[1]
                .last_error
                .as_deref()
                .unwrap_or("")
                .contains("training rank 0 could not reach engine 1: engine 1: connection reset"),
            "{:?}",
            engines[1]
        );
        assert_eq!(engines[0].serving_version, Some(1));

        // refused: from an inference rank, with a failure, or naming no engine of the pair
        entry.start_update(2).expect("started");
        for (bad, want) in [
            (
                Report {
                    unreached: vec![0],
                    ..engine_report(2, true)
                },
                "is for training ranks",
            ),
            (
                Report {
                    unreached: vec![3],
                    ..training_report(0)
                },
                "names engine 3, but the pair's engines are 0..3",
            ),
            (
                Report {
                    unreached: vec![0],
                    ok: false,
                    ..training_report(0)
                },
                "goes with a successful part",
            ),
        ] {
            let e = entry.report(2, bad).expect_err("refused");
            assert!(matches!(e, UpdateError::BadUnreached { .. }), "{e:?}");
            assert!(e.to_string().contains(want), "{e}");
        }
        assert_eq!(entry.lock().updates.history[&2].succeeded, 0);

        // with `all`, an unreached engine fails the version
        let entry = pair_of(PairOptions::default(), 3, 1);
        entry.start_update(1).expect("started");
        let partial = Report {
            unreached: vec![2],
            ..training_report(0)
        };
        entry.report(1, partial).expect("accepted");
        assert_eq!(state(&entry, 1), UpdateState::Failed);
    }

    #[tokio::test]
    async fn an_engine_left_out_holds_no_delta_base_and_gets_every_byte_next() {
        use crate::wire::{CommitPolicy, ReportDelta};
        let entry = pair_of(
            PairOptions {
                deltas: true,
                ..policy(CommitPolicy::Available, 60_000)
            },
            2,
            1,
        );
        let holds = ReportDelta {
            dense_bytes: 10,
            elements: 5,
            changed: 5,
            holds: true,
        };
        entry.start_update(1).expect("started");
        {
            // as if each slot's holder had joined with a claim id
            let mut p = entry.lock();
            let u = p.updates.history.get_mut(&1).expect("version 1");
            for (i, r) in u.ranks.iter_mut().enumerate() {
                r.claim = Some(format!("claim-{i}"));
            }
        }
        for e in 0..2 {
            // engine 1's rank says it holds version 1, but training rank 0 never reached it
            let r = Report {
                delta: Some(holds),
                incarnation: Some(format!("claim-{}", 2 + e)),
                ..engine_report(e, true)
            };
            entry.report(1, r).expect("accepted");
        }
        let partial = Report {
            unreached: vec![1],
            incarnation: Some("claim-0".into()),
            ..training_report(0)
        };
        entry.report(1, partial).expect("accepted");
        let last = Report {
            incarnation: Some("claim-1".into()),
            ..training_report(1)
        };
        entry.report(1, last).expect("accepted");
        assert_eq!(state(&entry, 1), UpdateState::Committed);
        // engine 0's rank (slot 2) holds version 1; engine 1's (slot 3) holds none, so it is in
        // the next update's `except` and gets every byte
        let held = entry.held_after(&entry.lock().updates.history[&1]);
        assert_eq!(
            held,
            (1, vec![None, None, Some("claim-2".to_string()), None])
        );
    }
}
