//! awex-core: the engine-independent, dependency-light heart of awex that backend plugins build on.
//!
//! It holds:
//!
//! - [`dtype`] and [`dims`]: element types (with conversion) and inline N-d coordinates;
//! - [`encoding`]: how a side stores a tensor (plain or FP8 block), the FP8 quantisers awex
//!   reproduces byte for byte, and their CPU reference;
//! - [`model`]: the model spec parsed from an HF `config.json` or a preset, the canonical
//!   tensor catalogue, and a safetensors checkpoint reader;
//! - [`layout`]: the placement algebra that describes what every rank of an engine holds as
//!   boxes of canonical tensors, with whole-side checks;
//! - [`plan`]: the planner that turns two layouts into exact, balanced per-rank transfer lists,
//!   and the bucket cut every transport moves;
//! - [`backend`]: the traits engine crates implement, their `inventory` registry, the data-only
//!   [`backend::Probe`], and engine control as data ([`backend::EngineControl`]);
//! - [`limits`]: the largest sizes every entry point accepts, checked before any allocation;
//!   [`file`]: reading a file a user names without blocking on a FIFO or reading without bound;
//! - [`pair`]: a pair's spec (model + both sides + transport + options) resolved into layouts;
//! - [`transport`]: the one enum naming the transports;
//! - [`weights`] and [`synthetic`]: deterministic canonical weights and synthetic layouts for
//!   demos and tests.
//!
//! No async runtime, HTTP, CUDA or dynamic loading is in its dependency tree: the rank runtime
//! (`awex-runtime`), the GPU layer (`awex-gpu`) and the control plane (`awex-control`) are
//! crates of their own.

#![warn(missing_docs)]

pub mod backend;
pub mod dims;
pub mod dtype;
pub mod encoding;
pub mod file;
pub mod layout;
pub mod limits;
pub mod model;
pub mod pair;
pub mod plan;
pub mod synthetic;
pub mod transport;
pub mod weights;

pub use backend::{BackendSpec, InferenceBackend, ParallelConfig, TrainingBackend};
pub use dims::Dims;
pub use dtype::DType;
pub use layout::{
    Alike, AlikeKey, Holder, LocalTensor, Placement, RankId, RankLayout, Region, Side, SideLayout,
};
pub use model::{Catalogue, ModelSpec};
pub use transport::Transport;

// Re-exported so backend crates register without depending on inventory's version directly.
pub use inventory;
