//! awex-core: the engine-independent heart of awex.
//!
//! It holds the canonical model catalogue ([`model`]), the placement layouts that describe what
//! every rank of an engine holds ([`layout`]), the planner that turns two layouts into exact,
//! balanced per-rank transfer lists ([`plan`]), and the backend traits that engine crates
//! implement and register ([`backend`]). [`limits`] holds the largest sizes every entry point
//! accepts.

pub mod backend;
pub mod client;
pub mod cuda;
pub mod dtype;
pub mod gateway;
pub mod layout;
pub mod limits;
pub mod model;
pub mod nccl;
pub mod plan;
pub mod runtime;
pub mod synthetic;

pub use backend::{BackendSpec, InferenceBackend, ParallelConfig, TrainingBackend};
pub use dtype::DType;
pub use layout::{
    Dims, Holder, LocalTensor, Placement, RankId, RankLayout, Region, Side, SideLayout,
};
pub use model::{Catalogue, ModelSpec};

// Re-exported so backend crates register without depending on inventory's version directly.
pub use inventory;
