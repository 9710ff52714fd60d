//! Where each inference engine of a pair stands: the version it serves whole, since when it is
//! behind, a version that tore its weights, and why it last failed. Engines are the unit of
//! commit (docs/gateway.md, "Engines and commit policies"); this record is stored with the
//! pair's state, so it survives a gateway restart.

use crate::wire::{EngineState, EngineStatus};
use serde::{Deserialize, Serialize};

/// One engine's standing (stored as part of the pair's state record).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub(crate) struct EngineRecord {
    /// The last committed version it applied whole.
    pub(crate) serving: Option<u64>,
    /// When it first missed a committed version (ms since the Unix epoch).
    pub(crate) behind_since_unix_ms: Option<u64>,
    /// A failed version that may have written part of its weights.
    pub(crate) torn: Option<u64>,
    /// A torn version the controller chose to serve on it.
    pub(crate) serving_torn: Option<u64>,
    /// Why it last failed an update.
    pub(crate) last_error: Option<String>,
    /// Whether the slot holds an engine of the pair (absent from old records: a member).
    pub(crate) member: Membership,
}

/// Whether an engine slot holds an engine of the pair.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub(crate) enum Membership {
    /// An engine of the pair: it takes part in every version (unless left out of one).
    #[default]
    Member,
    /// Added at run time; waits for every one of its ranks to join, then becomes a member.
    Joining,
    /// A free slot: a spare one, or its engine was removed.
    Absent,
}

impl EngineRecord {
    /// It applied committed `version` whole: it serves it, current.
    pub(crate) fn applied(&mut self, version: u64) {
        self.serving = Some(version);
        self.behind_since_unix_ms = None;
        self.torn = None;
        self.serving_torn = None;
    }

    /// It failed `version` (`wrote`: its ranks may have written part of it) for `why`;
    /// `committed`: the version committed on other engines, so this one is now behind.
    pub(crate) fn failed(
        &mut self,
        version: u64,
        wrote: bool,
        committed: bool,
        why: &str,
        now: u64,
    ) {
        if wrote {
            self.torn = Some(version);
            self.serving_torn = None;
        }
        if committed {
            self.behind_since_unix_ms.get_or_insert(now);
        }
        self.last_error = Some(why.to_string());
    }

    /// A free slot (a spare one, or its engine removed): it serves nothing.
    pub(crate) fn absent() -> EngineRecord {
        EngineRecord {
            member: Membership::Absent,
            ..EngineRecord::default()
        }
    }

    /// An engine added to the slot at `now`: it holds no version and is behind until its
    /// first update, which moves every byte to it.
    pub(crate) fn joining(now: u64) -> EngineRecord {
        EngineRecord {
            member: Membership::Joining,
            behind_since_unix_ms: Some(now),
            ..EngineRecord::default()
        }
    }

    /// Whether the slot holds an engine that takes part in the next version (a member).
    pub(crate) fn takes_part(&self) -> bool {
        self.member == Membership::Member
    }

    /// The controller resumed the engines on their torn weights.
    pub(crate) fn accept_torn(&mut self) {
        if let Some(t) = self.torn.take() {
            self.serving_torn = Some(t);
        }
    }

    /// The status of engine `engine`; `running`: an update is pending or running now (a behind
    /// or torn engine takes part in it: it is catching up).
    pub(crate) fn status(&self, engine: u32, running: bool) -> EngineStatus {
        let lagging = self.behind_since_unix_ms.is_some() || self.torn.is_some();
        let catching_up = lagging && running && self.takes_part();
        let state = if self.member == Membership::Absent {
            EngineState::Absent
        } else if self.member == Membership::Joining {
            EngineState::Joining
        } else if catching_up {
            EngineState::CatchingUp
        } else if self.torn.is_some() {
            EngineState::Torn
        } else if self.behind_since_unix_ms.is_some() {
            EngineState::Behind
        } else {
            EngineState::Serving
        };
        EngineStatus {
            engine,
            state,
            serving_version: self.serving,
            behind_since_unix_ms: self.behind_since_unix_ms,
            torn_version: self.torn,
            serving_torn_version: self.serving_torn,
            catching_up,
            last_error: self.last_error.clone(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_joining_engine_is_behind_with_no_version_and_an_absent_one_serves_nothing() {
        let j = EngineRecord::joining(5_000);
        let s = j.status(3, true);
        assert_eq!(
            (
                s.state,
                s.serving_version,
                s.behind_since_unix_ms,
                s.catching_up
            ),
            (EngineState::Joining, None, Some(5_000), false)
        );
        assert!(!j.takes_part());
        let a = EngineRecord::absent().status(4, true);
        assert_eq!(
            (a.state, a.serving_version, a.catching_up),
            (EngineState::Absent, None, false)
        );
        // records written before membership existed read as members
        let old: EngineRecord = serde_json::from_str(r#"{"serving": 2}"#).expect("old record");
        assert!(old.takes_part());
        // a member that was joining and is now in: catching up while an update runs
        let mut m = j.clone();
        m.member = Membership::Member;
        assert_eq!(m.status(3, true).state, EngineState::CatchingUp);
        assert_eq!(m.status(3, false).state, EngineState::Behind);
    }

    #[test]
    fn a_failed_engine_is_never_reported_serving_what_it_holds_only_partly() {
        let mut e = EngineRecord::default();
        e.applied(3);
        e.failed(4, true, true, "rank 1 died", 1_000);
        let s = e.status(2, false);
        assert_eq!(
            (s.state, s.serving_version, s.torn_version),
            (EngineState::Torn, Some(3), Some(4))
        );
        assert_eq!(s.behind_since_unix_ms, Some(1_000));
        // it stays behind since the first version it missed
        e.failed(5, false, true, "still gone", 2_000);
        assert_eq!(e.status(2, false).behind_since_unix_ms, Some(1_000));
        assert_eq!(e.status(2, true).state, EngineState::CatchingUp);
        e.applied(6);
        let s = e.status(2, false);
        assert_eq!(
            (
                s.state,
                s.serving_version,
                s.torn_version,
                s.behind_since_unix_ms
            ),
            (EngineState::Serving, Some(6), None, None)
        );
        assert_eq!(s.last_error.as_deref(), Some("still gone"));
    }
}
