//! The rank runtime: a training rank (writer) and an inference rank (reader) executing their
//! plans for every update version, over a [`transport::Transport`], on memory they do not own.

pub mod bucket;
pub mod fill;
pub mod rank;
pub mod shm;
mod tensors;
pub mod transport;

pub use tensors::{Location, TensorSet, TensorView};

use crate::layout::RankId;

/// Why a rank could not execute an update.
#[derive(Debug, thiserror::Error)]
pub enum RuntimeError {
    /// Registered tensors disagree with the rank's layout.
    #[error("layout mismatch: {0}")]
    Layout(String),
    /// A tensor view is malformed or missing.
    #[error("tensor: {0}")]
    Tensor(String),
    /// A bad setting.
    #[error("{0}")]
    Config(String),
    /// Shared memory failed.
    #[error("shared memory: {0}")]
    Shm(String),
    /// The transport failed.
    #[error("transport: {0}")]
    Transport(String),
    /// A bucket's checksum did not match the sender's.
    #[error("bucket {bucket} from training rank {peer} failed its checksum (corrupted in transit)")]
    Checksum {
        /// the sender
        peer: RankId,
        /// bucket index
        bucket: u64,
    },
    /// The update was aborted elsewhere.
    #[error("update {0} was aborted")]
    Aborted(u64),
    /// The update's deadline passed.
    #[error("update {0} missed its deadline")]
    Deadline(u64),
    /// A box copy failed.
    #[error(transparent)]
    Copy(#[from] crate::layout::copy::CopyError),
    /// Planning failed.
    #[error(transparent)]
    Plan(#[from] crate::plan::PlanError),
}
