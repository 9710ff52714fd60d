//! awex-sim: an update's predicted time on a stated cluster, from awex's own plans.

pub mod buckets;
pub mod topology;

/// Why a simulation cannot run.
#[derive(Debug, thiserror::Error)]
pub enum SimError {
    /// The topology is malformed or cannot hold the pair.
    #[error("topology: {0}")]
    Topology(String),
}
