//! The separated-GPU data path: training GPUs send planned buckets to inference GPUs over NCCL
//! point-to-point (NVLink within a node, InfiniBand/RoCE across nodes).
//!
//! - [`Library`]: libnccl loaded at run time (`$AWEX_NCCL_LIBRARY`, `libnccl.so.2`,
//!   `libnccl.so`), version 2.19 or newer, every entry point resolved up front; all errors are
//!   values, never panics.
//! - [`UniqueId`], [`UID_KEY`]: training rank 0 creates the communicator's id and shares it
//!   through the gateway's kv as hex.
//! - [`CommWorld`]: one communicator per pair; training ranks first, then inference ranks
//!   engine-major.
//! - [`AttemptComm`]: the pair's communicator across attempts: a fresh one (new id under
//!   `nccl.uid.<version>.<attempt>`) for every retry, without reconnecting the pair.
//! - [`Communicator`]: non-blocking init with a deadline, grouped send/recv, abort on any
//!   failure or timeout, finalize + destroy on disconnect.
//! - [`schedule()`]: which buckets go in which NCCL group, ordered so that both ends of every
//!   peer pair issue the pair's operations in the same order (deadlock-free by construction;
//!   proved by simulation in the tests).
//! - [`Program`]: the schedule laid out on device tensors, with the 2-D copies that pack and
//!   unpack non-contiguous boxes, double-buffered over two staging slots, and the FP8 kernel
//!   jobs that quantise an FP8 pair's blocks into the training rank's slots
//!   ([`check_encoding`]: what of an FP8 plan it moves).
//! - [`BucketHeader`], [`FrameLayout`]: delta updates, a header per bucket before its bytes
//!   and each bucket's delta frame encoded and decoded on the GPUs.
//!
//! The transport that runs all of it for a rank is `awex_runtime::transport::NcclTransport`.

mod attempt;
mod comm;
mod delta;
mod error;
pub mod ffi;
mod library;
mod program;
mod ranks;
mod schedule;
mod uid;

pub use attempt::{AttemptComm, attempt_uid_key, needs_fresh_comm};
pub use comm::{Communicator, P2p};
pub use delta::{BucketHeader, FrameLayout, HEADER_BYTES, frameable, max_frame_len, wire_table};
pub use error::NcclError;
pub use library::{FALLBACK_NAMES, LIBRARY_ENV, Library, NcclVersion, candidates};
pub use program::{
    DeviceTensor, DeviceTensors, OpIo, OpSeg, Program, SLOT_ALIGN, StepIo, Wire, check_encoding,
};
pub use ranks::CommWorld;
pub use schedule::{
    Op, OpKind, PAIR_BUCKET_FLOOR, Step, pair_bucket_bytes, peer_buckets, schedule,
};
pub use uid::{UID_CREATOR, UID_KEY, UniqueId, creates_uid};
