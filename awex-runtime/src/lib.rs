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
//! - [`finite`]: the check of a training rank's sources for infinity and NaN;
//! - [`shm`]: POSIX shared-memory segments;
//! - [`RuntimeError`]: every failure, typed (tensor, placement, setting, CUDA, NCCL, segment,
//!   peer, gateway), with the failing layer's error as its source.

#![warn(missing_docs)]

pub mod bucket;
pub mod delta;
mod error;
pub mod fill;
pub mod finite;
pub mod host;
pub mod rank;
pub mod shm;
mod tensors;
pub mod transport;

pub use error::{
    ConfigMismatch, LayoutMismatch, PlacementError, RuntimeError, ShmError, TensorError,
    TransportError,
};
pub use tensors::{Location, TensorSet, TensorView};
