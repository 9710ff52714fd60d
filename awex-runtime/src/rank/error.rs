//! Why a rank failed outside an update ([`RankError`]).

use crate::RuntimeError;
use awex_control::client::ClientError;
use awex_core::pair::PairError;

/// Why a rank failed outside an update.
#[derive(Debug, thiserror::Error)]
pub enum RankError {
    /// Talking to the gateway failed.
    #[error(transparent)]
    Gateway(#[from] ClientError),
    /// The runtime failed.
    #[error(transparent)]
    Runtime(#[from] RuntimeError),
    /// The layout could not be built, or disagrees with the pair's.
    #[error("layout: {0}")]
    Layout(String),
    /// A side's layout could not be built from the rank's specs.
    #[error("layout: {0}")]
    Pair(#[from] PairError),
    /// The pair was disconnected.
    #[error("pair disconnected")]
    Disconnected,
    /// The gateway does not know the pair (404): it restarted without its state, or the pair's
    /// record expired. The rank cannot learn the outcome of its updates.
    #[error(
        "the gateway at {gateway} has no pair `{pair}` (404 unknown pair): it was restarted without its state (--state-dir none) or forgot the pair; this rank cannot learn the outcome of its updates and stops"
    )]
    UnknownPair {
        /// The gateway URL.
        gateway: String,
        /// The pair.
        pair: String,
    },
    /// The gateway stayed unreachable (or answered 5xx) longer than the rank waits for it.
    #[error(
        "the gateway at {gateway} has been unreachable for {waited_s} s while this rank was {doing} (it waits at most {limit_s} s): {last}"
    )]
    GatewayLost {
        /// The gateway URL.
        gateway: String,
        /// What the rank was waiting for.
        doing: String,
        /// Seconds it retried.
        waited_s: u64,
        /// Its limit, seconds.
        limit_s: u64,
        /// The last error.
        last: String,
    },
}
