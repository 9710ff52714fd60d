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
        let catching_up = lagging && running;
        let state = if catching_up {
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
