//! What became of a rank's step ([`Outcome`]), why an update did not commit ([`Failure`]), and
//! the work a rank was asked to do ([`Work`]).

use crate::RuntimeError;
use crate::transport::ExecStats;
use awex_control::client::ClientError;

/// What became of one step of a rank ([`Rank::step`](super::Rank::step), [`Rank::run`](super::Rank::run)).
#[derive(Debug)]
pub enum Outcome {
    /// This rank did its part and the version committed.
    Committed {
        /// the work
        work: Work,
        /// what this rank moved
        stats: ExecStats,
    },
    /// This rank did its part; the outcome was not waited for.
    Executed {
        /// the work
        work: Work,
        /// what this rank moved
        stats: ExecStats,
    },
    /// The update did not commit.
    Failed {
        /// the work
        work: Work,
        /// what this rank moved, when its own part succeeded
        stats: Option<ExecStats>,
        /// why
        reason: Failure,
    },
    /// The wait ran out: for work (`work` is `None`) or for the outcome of `work`.
    TimedOut {
        /// the work whose outcome did not arrive in time
        work: Option<Work>,
    },
    /// The pair was disconnected.
    Disconnected,
}

impl Outcome {
    /// The work the step was about (`None` when there was none: disconnected, timed out).
    pub fn work(&self) -> Option<Work> {
        match self {
            Outcome::Committed { work, .. }
            | Outcome::Executed { work, .. }
            | Outcome::Failed { work, .. } => Some(*work),
            Outcome::TimedOut { work } => *work,
            Outcome::Disconnected => None,
        }
    }

    /// Whether this rank's own part succeeded (whatever became of the version).
    pub fn part_done(&self) -> bool {
        match self {
            Outcome::Committed { .. } | Outcome::Executed { .. } => true,
            Outcome::Failed { stats, .. } => stats.is_some(),
            Outcome::TimedOut { work } => work.is_some(),
            Outcome::Disconnected => false,
        }
    }
}

/// Why an update did not commit, as one rank learns it.
#[derive(Debug, thiserror::Error)]
pub enum Failure {
    /// This rank's own part failed (the error it reported).
    #[error(transparent)]
    Rank(RuntimeError),
    /// The version failed elsewhere (aborted, another rank, the engines): its status.
    #[error("version {} did not commit: {}", .0.version, .0.error.as_deref().unwrap_or("failed"))]
    Version(Box<awex_control::wire::UpdateStatus>),
    /// The outcome could not be read from the gateway.
    #[error("reading the outcome: {0}")]
    Gateway(ClientError),
}

/// One update a rank was asked to do.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Work {
    /// Version.
    pub version: u64,
    /// Attempt.
    pub attempt: u32,
}
