//! Updates: `POST /v1/pairs/{name}/updates` starts a version, `GET .../updates/{version}` reads
//! (and optionally waits for) its state, `POST .../updates/{version}/report` is how each rank
//! says it finished.
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

use crate::server::engine::{EngineCmd, EngineEvents};
use crate::server::error::ApiError;
use crate::server::extract::{JsonBody, PathParams, QueryParams, wait_ms};
use crate::server::state::{AppState, Pair, PairEntry, unix_ms};
use crate::server::store::disk::Op;
use crate::server::store::roster::{list_ranks, rank_name};
use crate::server::store::updates::RankSlot;
use crate::server::store::updates::{RankDetail, Update};
use crate::wire::{
    ApplyMode, EventKind, PairState, Report, ReportAck, StartUpdate, UpdateState, UpdateStatus,
};
use crate::wire::{MAX_ERROR_BYTES, ms};
use axum::Json;
use axum::extract::State;
use axum::http::StatusCode;
use serde::Deserialize;
use std::sync::Arc;
use std::time::Duration;
use tokio::time::Instant;

/// `POST /v1/pairs/{name}/updates`: starts a version; 202 with its status.
pub(crate) async fn start(
    State(gw): State<AppState>,
    PathParams(name): PathParams<String>,
    JsonBody(req): JsonBody<StartUpdate>,
) -> Result<(StatusCode, Json<UpdateStatus>), ApiError> {
    let entry = gw.pair(&name)?;
    let version = req.version;
    let mut p = entry.lock();
    match p.state {
        PairState::Ready => {}
        PairState::Joining => {
            return Err(ApiError::Conflict(format!(
                "pair `{name}` is still joining: {} of {} ranks joined; start updates once every rank joined",
                p.roster.joined(),
                entry.slots.total()
            )));
        }
        PairState::JoinFailed => {
            return Err(ApiError::Conflict(format!(
                "pair `{name}` failed to join; disconnect it and connect again"
            )));
        }
        PairState::Disconnected => return Err(ApiError::disconnected(&name)),
    }
    let mut attempt = 1;
    if let Some(cur) = p.updates.latest() {
        if !cur.state.is_final() {
            return Err(ApiError::Conflict(format!(
                "version {} of pair `{name}` is {}; wait for it to commit or fail before starting version {version}",
                cur.version,
                cur.state.as_str()
            )));
        }
        if version < cur.version || (version == cur.version && cur.state == UpdateState::Committed)
        {
            return Err(ApiError::Conflict(format!(
                "version {version} is stale: pair `{name}` already ran version {} ({}); versions must increase, and only a failed version may be retried",
                cur.version,
                cur.state.as_str()
            )));
        }
        if version == cur.version {
            attempt = cur.attempt.saturating_add(1);
        }
    }
    let deadline = Duration::from_millis(entry.request.options.update_deadline_ms);
    let pending = entry.engines.is_some();
    tracing::info!(pair = %name, version, attempt, "update started");
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
        ranks: vec![RankSlot::default(); entry.slots.total()],
        succeeded: 0,
        bytes: [0; 2],
        checksums: [0; 2],
        error: None,
        engine_errors: Vec::new(),
        trigger_waiting: false,
        finishing: false,
        applying: false,
        applied: 0,
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
        entry.engine_cmd(EngineCmd::Pause { version, attempt });
    } else {
        bind_claims(&mut p, version);
        entry.publish(
            &mut p,
            EventKind::Update,
            Some(version),
            Some(attempt),
            None,
        );
    }
    entry.update_tx.send_replace(());
    let status = p
        .updates
        .latest()
        .map(|u| entry.update_status(u, RankDetail::None));
    drop(p);
    let weak = Arc::downgrade(&entry);
    tokio::spawn(async move {
        tokio::time::sleep(deadline).await;
        if let Some(e) = weak.upgrade() {
            e.enforce_update_deadline(version, attempt);
        }
    });
    status
        .map(|s| (StatusCode::ACCEPTED, Json(s)))
        .ok_or_else(|| ApiError::NotFound(format!("version {version} vanished")))
}

/// `GET /v1/pairs/{name}/updates/{version}?timeout_ms=T&ranks=all|problems|none`.
pub(crate) async fn status(
    State(gw): State<AppState>,
    PathParams((name, version)): PathParams<(String, u64)>,
    QueryParams(q): QueryParams<StatusQuery>,
) -> Result<Json<UpdateStatus>, ApiError> {
    let wait = match q.timeout_ms {
        None => 0,
        t => wait_ms(t)?,
    };
    let entry = gw.pair(&name)?;
    let _permit = gw.long_poll(&entry, wait)?;
    let mut rx = entry.update_tx.subscribe();
    let end = Instant::now() + Duration::from_millis(wait);
    loop {
        let (v, attempt, done) = {
            let p = entry.lock();
            let Some(u) = p.updates.history.get(&version) else {
                return Err(ApiError::NotFound(format!(
                    "pair `{name}` has no update of version {version}{}",
                    match p.updates.latest() {
                        Some(l) => format!(" (latest: {})", l.version),
                        None => " (none was started)".to_string(),
                    }
                )));
            };
            if u.state.is_final() || Instant::now() >= end {
                return Ok(Json(entry.update_status(u, q.ranks)));
            }
            (u.version, u.attempt, u.elapsed() >= u.deadline)
        };
        if done {
            entry.enforce_update_deadline(v, attempt);
            continue;
        }
        let _ = tokio::time::timeout_at(end, rx.changed()).await;
    }
}

/// `POST /v1/pairs/{name}/updates/{version}/report`.
pub(crate) async fn report(
    State(gw): State<AppState>,
    PathParams((name, version)): PathParams<(String, u64)>,
    JsonBody(r): JsonBody<Report>,
) -> Result<Json<ReportAck>, ApiError> {
    let entry = gw.pair(&name)?;
    let slot = entry.slots.index(r.side, r.rank)?;
    let who = rank_name(r.side, r.rank);
    if r.error.as_ref().is_some_and(|e| e.len() > MAX_ERROR_BYTES) {
        return Err(ApiError::TooLarge(format!(
            "the error {who} reported is longer than {MAX_ERROR_BYTES} bytes"
        )));
    }
    if entry.request.options.checksums && r.ok && r.checksum.is_none() {
        return Err(ApiError::Unprocessable(format!(
            "pair `{name}` has checksums on: the successful report of {who} needs `checksum`"
        )));
    }
    let mut p = entry.lock();
    if p.state == PairState::Disconnected {
        return Err(ApiError::disconnected(&name));
    }
    // only the process that held the slot when the version was announced reports for it
    let announced = p
        .updates
        .history
        .get(&version)
        .and_then(|u| u.ranks.get(slot))
        .and_then(|r| r.claim.clone());
    p.roster.check_reporter(
        &entry.slots,
        slot,
        announced.as_deref(),
        r.incarnation.as_deref(),
    )?;
    let Some(u) = p.updates.history.get_mut(&version) else {
        return Err(ApiError::Conflict(format!(
            "pair `{name}` has no update of version {version}; report only versions announced by an `update` event"
        )));
    };
    if let Some(a) = r.attempt {
        if a != u.attempt {
            return Err(ApiError::Conflict(format!(
                "attempt {a} of version {version} is over; the current attempt is {}",
                u.attempt
            )));
        }
    }
    match u.state {
        UpdateState::Running => {}
        UpdateState::Pending => {
            return Err(ApiError::Conflict(format!(
                "version {version} has not started running (the engines are being paused); wait for its `update` event"
            )));
        }
        UpdateState::Committed | UpdateState::Failed => {
            return Err(ApiError::Conflict(format!(
                "version {version} attempt {} already {}; the report of {who} came too late",
                u.attempt,
                u.state.as_str()
            )));
        }
    }
    let after = ms(u.elapsed());
    if u.applying {
        // atomic pairs, second phase: every rank received; inference ranks say they applied
        let attempt = u.attempt;
        if entry.slots.is_training(slot) {
            return Err(ApiError::Conflict(format!(
                "{who} already reported for version {version} attempt {attempt}; while the inference ranks apply it, only they report"
            )));
        }
        let Some(rank) = u.ranks.get_mut(slot) else {
            return Err(ApiError::Conflict(format!(
                "version {version} has no per-rank record of {who}"
            )));
        };
        if rank.applied.is_some() {
            return Err(ApiError::Conflict(format!(
                "{who} already reported applying version {version} attempt {attempt}"
            )));
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
        p_changed_report(&mut p, version, slot);
        if r.ok {
            entry.settle(&mut p);
        } else {
            let why = r.error.unwrap_or_else(|| "no reason given".to_string());
            entry.fail(
                &mut p,
                format!("{who} failed applying the staged version to its live tensors: {why}"),
            );
        }
        return ack(&entry, &p, version);
    }
    let Some(rank) = u.ranks.get_mut(slot) else {
        return Err(ApiError::Conflict(format!(
            "version {version} has no per-rank record of {who}"
        )));
    };
    if rank.state.is_some() {
        return Err(ApiError::Conflict(format!(
            "{who} already reported for version {version} attempt {}",
            u.attempt
        )));
    }
    rank.state = Some(r.ok);
    rank.bytes = r.bytes;
    rank.checksum = r.checksum;
    rank.error = r.error.clone();
    rank.after_ms = Some(after);
    p_changed_report(&mut p, version, slot);
    let Some(u) = p.updates.history.get_mut(&version) else {
        return Err(ApiError::NotFound(format!("version {version} vanished")));
    };
    let side = usize::from(!entry.slots.is_training(slot));
    u.bytes[side] = u.bytes[side].saturating_add(r.bytes);
    u.checksums[side] = u.checksums[side].wrapping_add(r.checksum.unwrap_or(0));
    if r.ok {
        u.succeeded += 1;
        entry.settle(&mut p);
    } else {
        let why = r.error.unwrap_or_else(|| "no reason given".to_string());
        entry.fail(&mut p, format!("{who} reported failure: {why}"));
    }
    ack(&entry, &p, version)
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

fn ack(entry: &PairEntry, p: &Pair, version: u64) -> Result<Json<ReportAck>, ApiError> {
    let u = p
        .updates
        .history
        .get(&version)
        .ok_or_else(|| ApiError::NotFound(format!("version {version} vanished")))?;
    Ok(Json(ReportAck {
        version,
        attempt: u.attempt,
        state: u.state,
        succeeded: u.succeeded as u32,
        world_size: entry.slots.total() as u32,
    }))
}

fn p_changed_update(p: &mut Pair, version: u64) {
    p.changed(Op::Update(version));
}

fn p_changed_report(p: &mut Pair, version: u64, slot: usize) {
    p.changed(Op::Report(version, slot));
}

/// Query of `GET .../updates/{version}`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct StatusQuery {
    /// Wait up to this long for the update to commit or fail (0 or absent: answer at once).
    timeout_ms: Option<u64>,
    #[serde(default)]
    ranks: RankDetail,
}

impl PairEntry {
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
        if resume || (!wrote && p.updates.torn.is_none()) || self.engines.is_none() {
            // nothing was written (the live weights are the last committed version's), or the
            // pair is gone: the engines serve again. After an earlier torn attempt they stay
            // paused, even when this attempt wrote nothing.
            self.engine_cmd(EngineCmd::Continue { version, attempt });
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
                u.applying = true;
                let (version, attempt) = (u.version, u.attempt);
                tracing::info!(pair = %self.name, version, attempt, "every rank received; applying");
                p.changed(Op::Update(version));
                self.publish(p, EventKind::Apply, Some(version), Some(attempt), None);
                self.update_tx.send_replace(());
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
            self.engine_cmd(EngineCmd::Finish { version, attempt });
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
        p.updates.committed = Some(version);
        p.updates.torn = None;
        p.updates.serving_torn = None;
        p.changed(Op::Update(version));
        p.changed(Op::State);
        self.engine_cmd(EngineCmd::Continue { version, attempt });
        self.update_tx.send_replace(());
    }

    /// The engines' loaders answered the trigger of `version`/`attempt`.
    pub(crate) fn engines_triggered(&self, version: u64, attempt: u32, errors: Vec<String>) {
        let mut p = self.lock();
        let Some(u) = p.updates.attempt_mut(version, attempt) else {
            return;
        };
        if u.state != UpdateState::Running {
            return;
        }
        u.trigger_waiting = false;
        if errors.is_empty() {
            self.settle(&mut p);
        } else {
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

    /// The engines closed the update of `version`/`attempt` (or failed to).
    pub(crate) fn engines_finished(&self, version: u64, attempt: u32, errors: Vec<String>) {
        let mut p = self.lock();
        let Some(u) = p.updates.attempt_mut(version, attempt) else {
            return;
        };
        if u.state != UpdateState::Running {
            return;
        }
        u.finishing = false;
        if errors.is_empty() {
            self.commit(&mut p);
        } else {
            u.engine_errors.extend(errors.iter().cloned());
            self.fail(
                &mut p,
                format!(
                    "closing the inference engines' update failed: {}",
                    errors.join("; ")
                ),
            );
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

    /// The engines were paused (or failed to be) for `version`/`attempt`.
    pub(crate) fn engines_paused(&self, version: u64, attempt: u32, errors: Vec<String>) {
        let mut p = self.lock();
        let Some(u) = p.updates.attempt_mut(version, attempt) else {
            return;
        };
        if u.state != UpdateState::Pending {
            return;
        }
        u.pause = Some(u.elapsed());
        if errors.is_empty() {
            u.state = UpdateState::Running;
            p_changed_update(&mut p, version);
            let Some(u) = p.updates.attempt_mut(version, attempt) else {
                return;
            };
            let triggers = self.engines.as_ref().is_some_and(|l| l.triggers);
            u.trigger_waiting = triggers;
            if triggers {
                self.engine_cmd(EngineCmd::Trigger { version, attempt });
            }
            bind_claims(&mut p, version);
            self.publish(
                &mut p,
                EventKind::Update,
                Some(version),
                Some(attempt),
                None,
            );
            self.update_tx.send_replace(());
        } else {
            u.engine_errors.extend(errors.iter().cloned());
            self.fail(
                &mut p,
                format!(
                    "pausing the inference engines failed: {}",
                    errors.join("; ")
                ),
            );
        }
    }

    /// The engines were resumed after `version`/`attempt`; records errors.
    pub(crate) fn engines_resumed(&self, version: u64, attempt: u32, errors: Vec<String>) {
        if errors.is_empty() {
            return;
        }
        let mut p = self.lock();
        if let Some(u) = p.updates.attempt_mut(version, attempt) {
            u.engine_errors.extend(errors);
            p.changed(Op::Update(version));
        }
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
        let Some(u) = p.updates.attempt_mut(version, attempt) else {
            return;
        };
        if u.state.is_final() || u.elapsed() < u.deadline {
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

    fn engines_paused(&self, version: u64, attempt: u32, errors: Vec<String>) {
        PairEntry::engines_paused(self, version, attempt, errors)
    }

    fn engines_triggered(&self, version: u64, attempt: u32, errors: Vec<String>) {
        PairEntry::engines_triggered(self, version, attempt, errors)
    }

    fn engines_finished(&self, version: u64, attempt: u32, errors: Vec<String>) {
        PairEntry::engines_finished(self, version, attempt, errors)
    }

    fn engines_resumed(&self, version: u64, attempt: u32, errors: Vec<String>) {
        PairEntry::engines_resumed(self, version, attempt, errors)
    }
}
