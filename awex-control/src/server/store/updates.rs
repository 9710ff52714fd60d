//! A pair's updates: every recent version's latest attempt, its ranks' reports, and the
//! committed and torn versions.

use crate::server::store::roster::Slots;
use crate::wire::*;
use serde::Deserialize;
use std::collections::BTreeMap;
use std::time::Duration;
use tokio::time::Instant;
/// Versions whose per-rank detail is kept; older ones keep only their totals.
pub(crate) const DETAIL_KEPT: usize = 4;

/// Which ranks `GET .../updates/{version}` lists.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub(crate) enum RankDetail {
    /// Every rank.
    #[default]
    All,
    /// Ranks that did not (yet) succeed.
    Problems,
    /// None.
    None,
}

#[derive(Clone, Debug, Default)]
pub(crate) struct RankSlot {
    pub(crate) state: Option<bool>,
    pub(crate) missing: bool,
    pub(crate) bytes: u64,
    pub(crate) checksum: Option<u64>,
    pub(crate) error: Option<String>,
    pub(crate) after_ms: Option<u64>,
    /// Atomic pairs, inference ranks: the second report (copied staging into live tensors).
    pub(crate) applied: Option<bool>,
    /// The claim id of the slot's holder when the version was announced: only it may report.
    pub(crate) claim: Option<String>,
    /// The delta figures of its successful report (pairs with deltas on).
    pub(crate) delta: Option<crate::wire::ReportDelta>,
}

/// One attempt of one version.
pub(crate) struct Update {
    pub(crate) version: u64,
    pub(crate) attempt: u32,
    pub(crate) state: UpdateState,
    pub(crate) started: Instant,
    pub(crate) started_unix_ms: u64,
    pub(crate) deadline: Duration,
    pub(crate) pause: Option<Duration>,
    pub(crate) finished: Option<Instant>,
    pub(crate) ranks: Vec<RankSlot>,
    /// Pairs with deltas on: the version the inference ranks held as this attempt started.
    pub(crate) base: Option<crate::wire::DeltaBase>,
    /// Pairs with deltas on, until the attempt is announced: the version before it, and per slot
    /// the claim id of the process that applied it and holds it (`None`: the slot holds none).
    pub(crate) held: Option<(u64, Vec<Option<String>>)>,
    pub(crate) succeeded: usize,
    pub(crate) bytes: [u64; 2],
    pub(crate) checksums: [u64; 2],
    pub(crate) error: Option<String>,
    pub(crate) engine_errors: Vec<String>,
    /// Whether the engines' trigger (their loaders receiving) is still to answer.
    pub(crate) trigger_waiting: bool,
    /// Whether the engines' closing calls (ending the update session) are running.
    pub(crate) finishing: bool,
    /// Atomic pairs: the `apply` event went out (every rank received); from here on the
    /// inference ranks write their live tensors.
    pub(crate) applying: bool,
    /// Atomic pairs: inference ranks that reported their live tensors applied.
    pub(crate) applied: usize,
    /// Whether the engines' resume after this attempt (`continue_generation`) is queued or
    /// running: a wait for the attempt's end answers once it is done, so that a committed
    /// version is being served when the wait returns. Not stored: after a restart nothing is
    /// in flight.
    pub(crate) resuming: bool,
    /// Per engine, why it failed this attempt and is left out of it (commit policies
    /// `quorum:K`, `available`; `None`: not failed).
    pub(crate) left_out: Vec<Option<String>>,
    /// Per engine, whether nothing of this attempt was written to its live tensors: it was out
    /// of the attempt when it was announced (a free slot, a joining engine, an engine whose
    /// pause failed), or, in atomic pairs, left out before `apply` went out. Not stored (a
    /// restart fails the attempt as torn everywhere).
    pub(crate) unwritten: Vec<bool>,
    /// Per engine (per-engine commits with engine URLs): its trigger (the engine's loader
    /// receiving) has not answered yet. Not stored.
    pub(crate) trigger_open: Vec<bool>,
}

impl Update {
    /// The version.
    pub(crate) fn version(&self) -> u64 {
        self.version
    }

    /// The attempt.
    pub(crate) fn attempt(&self) -> u32 {
        self.attempt
    }

    /// The state.
    pub(crate) fn state(&self) -> UpdateState {
        self.state
    }

    pub(crate) fn elapsed(&self) -> Duration {
        self.finished.unwrap_or_else(Instant::now) - self.started
    }

    /// The engines left out of this attempt, with why.
    pub(crate) fn left_out(&self) -> Vec<EngineLeftOut> {
        self.left_out
            .iter()
            .enumerate()
            .filter_map(|(e, why)| {
                why.as_ref().map(|w| EngineLeftOut {
                    engine: e as u32,
                    error: w.clone(),
                })
            })
            .collect()
    }

    /// The delta figures the ranks reported, summed per side (`None` when none reported any).
    fn delta_totals(&self, slots: &Slots) -> Option<crate::wire::DeltaTotals> {
        let mut t = crate::wire::DeltaTotals::default();
        let mut any = false;
        for (i, r) in self.ranks.iter().enumerate() {
            let Some(d) = r.delta else { continue };
            any = true;
            let add = |s: &mut SideTotals, x: u64| {
                if slots.is_training(i) {
                    s.training = s.training.saturating_add(x);
                } else {
                    s.inference = s.inference.saturating_add(x);
                }
            };
            add(&mut t.dense_bytes, d.dense_bytes);
            add(&mut t.elements, d.elements);
            add(&mut t.changed, d.changed);
        }
        any.then_some(t)
    }

    /// The status document, listing ranks per `detail`.
    /// The status document of this update of pair `pair` (whose ranks are `slots`), listing
    /// ranks per `detail`; with `checksums`, the two sides' checksum sums.
    pub(crate) fn status(
        &self,
        pair: &str,
        slots: &Slots,
        checksums: bool,
        detail: RankDetail,
    ) -> UpdateStatus {
        let ranks = match detail {
            RankDetail::None => Vec::new(),
            _ => self
                .ranks
                .iter()
                .enumerate()
                .filter(|(_, r)| detail == RankDetail::All || r.state != Some(true))
                .map(|(i, r)| {
                    let (side, rank) = slots.rank(i);
                    RankUpdate {
                        side,
                        rank,
                        state: match (r.state, r.missing) {
                            (Some(true), _) => RankReportState::Ok,
                            (Some(false), _) => RankReportState::Failed,
                            (None, true) => RankReportState::Missing,
                            (None, false) => RankReportState::Waiting,
                        },
                        bytes: r.bytes,
                        checksum: r.checksum,
                        error: r.error.clone(),
                        reported_after_ms: r.after_ms,
                        applied: r.applied,
                    }
                })
                .collect(),
        };
        UpdateStatus {
            pair: pair.to_string(),
            version: self.version,
            attempt: self.attempt,
            state: self.state,
            started_unix_ms: self.started_unix_ms,
            pause_ms: self.pause.map(ms),
            elapsed_ms: ms(self.elapsed()),
            deadline_ms: ms(self.deadline),
            world_size: slots.total() as u32,
            succeeded: self.succeeded as u32,
            bytes: SideTotals {
                training: self.bytes[0],
                inference: self.bytes[1],
            },
            delta: self.delta_totals(slots),
            base: self.base.clone(),
            checksums: checksums.then_some(SideTotals {
                training: self.checksums[0],
                inference: self.checksums[1],
            }),
            ranks,
            error: self.error.clone(),
            engine_errors: self.engine_errors.clone(),
            applying: self.applying,
            applied: self.applied as u32,
            resuming: self.resuming,
            left_out: self.left_out(),
        }
    }
}

/// The updates of a pair: the latest attempt of each recent version, and the committed one.
#[derive(Default)]
pub(crate) struct Updates {
    pub(crate) history: BTreeMap<u64, Update>,
    pub(crate) committed: Option<u64>,
    /// A version whose failed attempt may have written some of the inference ranks' bytes:
    /// the engines stay paused until a retry commits or the controller accepts it.
    pub(crate) torn: Option<u64>,
    /// A torn version the controller resumed the engines on (`resume` with `accept_torn`).
    pub(crate) serving_torn: Option<u64>,
}

impl Updates {
    /// The committed version (what inference serves).
    pub(crate) fn committed(&self) -> Option<u64> {
        self.committed
    }

    /// The partially written version the engines are held paused on, if any.
    pub(crate) fn torn(&self) -> Option<u64> {
        self.torn
    }

    /// The controller accepts serving the torn version.
    pub(crate) fn accept_torn(&mut self) {
        self.serving_torn = self.torn.take();
    }

    /// The torn version the controller chose to serve, if any.
    pub(crate) fn serving_torn(&self) -> Option<u64> {
        self.serving_torn
    }

    /// The most recently started version.
    pub(crate) fn latest(&self) -> Option<&Update> {
        self.history.values().next_back()
    }

    pub(crate) fn latest_mut(&mut self) -> Option<&mut Update> {
        self.history.values_mut().next_back()
    }

    pub(crate) fn attempt_mut(&mut self, version: u64, attempt: u32) -> Option<&mut Update> {
        self.history
            .get_mut(&version)
            .filter(|u| u.attempt == attempt)
    }

    /// Records an attempt; returns the versions that left the history and those whose per-rank
    /// detail was dropped (for the write-through).
    pub(crate) fn insert(&mut self, u: Update) -> (Vec<u64>, Vec<u64>) {
        self.history.insert(u.version, u);
        let mut gone = Vec::new();
        while self.history.len() > UPDATES_KEPT {
            if let Some((v, _)) = self.history.pop_first() {
                gone.push(v);
            }
        }
        let n = self.history.len();
        let mut trimmed = Vec::new();
        for old in self
            .history
            .values_mut()
            .take(n.saturating_sub(DETAIL_KEPT))
        {
            if !old.ranks.is_empty() {
                old.ranks = Vec::new();
                trimmed.push(old.version);
            }
        }
        (gone, trimmed)
    }
}
