//! awex-runtime: the rank runtime of awex.
//!
//! A training rank (writer) and an inference rank (reader) execute their plans for every
//! update version, over a [`transport::Transport`], on memory they do not own:
//!
//! - [`TensorView`] / [`TensorSet`]: host, shared-memory and device views of a rank's tensors;
//! - [`bucket`]: packing and unpacking buckets with dtype conversion and xxh3 checksums;
//! - [`transport`]: `shm`, `tcp`, `cuda-ipc` and `nccl`, one module each, behind one trait;
//! - [`rank`]: the rank loop over the gateway (join, events, execute, report);
//! - [`host`]: rank hosting (where tensors live, staging, shm mirrors, segment names), shared
//!   by the CLI worker and the Python binding;
//! - [`fill`]: filling and checking tensors against deterministic canonical weights;
//! - [`shm`]: POSIX shared-memory segments.

#![warn(missing_docs)]

pub mod bucket;
pub mod fill;
pub mod host;
pub mod rank;
pub mod shm;
mod tensors;
pub mod transport;

pub use tensors::{Location, TensorSet, TensorView};

use awex_core::layout::RankId;

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
    Copy(#[from] awex_core::layout::copy::CopyError),
    /// Planning failed.
    #[error(transparent)]
    Plan(#[from] awex_core::plan::PlanError),
}
