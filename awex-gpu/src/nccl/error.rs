//! Errors of the NCCL transport, written for the person at the terminal.

use super::library::NcclVersion;
use crate::cuda::CudaError;
use awex_core::layout::{RankId, Side};
use std::time::Duration;

/// Why loading NCCL, building a communicator or moving bytes over NCCL failed.
#[derive(Debug, Clone, thiserror::Error, PartialEq, Eq)]
pub enum NcclError {
    /// No candidate library could be opened.
    #[error(
        "no NCCL library found: tried {}; install NCCL 2.19 or newer (e.g. `pip install nvidia-nccl-cu12`) and put it on the library path, or set AWEX_NCCL_LIBRARY to the full path of libnccl.so.2",
        tried.iter().map(|(path, why)| format!("{path} ({why})")).collect::<Vec<_>>().join(", ")
    )]
    NotFound {
        /// Every path or name tried, with the loader's answer.
        tried: Vec<(String, String)>,
    },
    /// The library loaded but lacks an entry point awex calls.
    #[error("the NCCL library at {path} lacks `{symbol}`; awex needs NCCL 2.19 or newer")]
    MissingSymbol {
        /// The library.
        path: String,
        /// The missing entry point.
        symbol: &'static str,
    },
    /// The library is older than the oldest NCCL awex supports.
    #[error("NCCL {found} found at {path}; awex needs 2.19 or newer")]
    TooOld {
        /// The version the library reports.
        found: NcclVersion,
        /// The library.
        path: String,
    },
    /// An NCCL call returned an error.
    #[error("{call} failed: {name} ({code}): {message}")]
    Call {
        /// The NCCL entry point.
        call: &'static str,
        /// The `ncclResult_t` number.
        code: i32,
        /// The `ncclResult_t` name.
        name: &'static str,
        /// NCCL's description (its last error message when it has one).
        message: String,
    },
    /// A communicator did not finish initialising in time; it was aborted.
    #[error(
        "NCCL communicator init (rank {rank} of {nranks}) did not finish within {waited:?}; it was aborted. Every rank of the pair must join, and the ranks must reach each other (NCCL_SOCKET_IFNAME, firewall)"
    )]
    InitTimeout {
        /// This rank in the communicator.
        rank: u32,
        /// Ranks in the communicator.
        nranks: u32,
        /// How long it waited.
        waited: Duration,
    },
    /// Grouped operations did not finish in time; the communicator was aborted.
    #[error(
        "NCCL operations of step {step} did not finish before the deadline ({detail}); the communicator was aborted"
    )]
    OpTimeout {
        /// The schedule step that was running.
        step: usize,
        /// What was waited on.
        detail: String,
    },
    /// A communicator was aborted earlier and cannot be used again.
    #[error(
        "the NCCL communicator was aborted ({0}); reconnect the pair to build a new one with a fresh unique id"
    )]
    Aborted(String),
    /// A unique id that is not 256 hex digits.
    #[error("bad NCCL unique id `{0}`: expected 256 hex digits (128 bytes)")]
    BadUniqueId(String),
    /// A rank outside the communicator's world.
    #[error("{side} rank {rank} is not in the NCCL world ({world})")]
    NoSuchRank {
        /// The side.
        side: Side,
        /// The rank.
        rank: RankId,
        /// The world, described.
        world: String,
    },
    /// A communicator rank beyond the world.
    #[error("communicator rank {rank} is outside the NCCL world of {nranks} ranks")]
    NoSuchCommRank {
        /// The rank asked for.
        rank: u32,
        /// Ranks in the world.
        nranks: u32,
    },
    /// A world whose sizes make no communicator.
    #[error("bad NCCL world: {0}")]
    BadWorld(String),
    /// A peer's rendezvous value lacks what the NCCL transport needs, or disagrees with the plan.
    #[error("{0}")]
    Rendezvous(String),
    /// The plan or the registered tensors do not fit the device path.
    #[error("{0}")]
    Plan(String),
    /// The transport is used in a way it does not support.
    #[error("{0}")]
    Usage(String),
    /// This build has no CUDA support, which the NCCL transport needs.
    #[error("the nccl transport needs awex built with --features cuda")]
    NeedsCuda,
    /// A CUDA call of the data path failed.
    #[error(transparent)]
    Cuda(#[from] CudaError),
    /// The update was aborted elsewhere.
    #[error("update {0} was aborted")]
    Cancelled(u64),
}
