//! awex-gpu: the GPU layer of awex, loaded at run time so that no build needs CUDA.
//!
//! - [`cuda`]: the CUDA driver layer (devices, streams, events, IPC handles of allocations,
//!   2-D/3-D copy descriptors and the copy engine), behind the `cuda` feature; built without it
//!   the same API returns [`cuda::CudaError::NotBuilt`] from every call.
//! - [`nccl`]: libnccl loaded with `libloading` (version-gated), communicators with deadlines
//!   and abort, the deadlock-free per-bucket group schedule, and the device program that packs
//!   and unpacks planned boxes.
//!
//! It depends on `awex-core` for the geometry (layouts, plans, buckets) and on nothing async.

#![warn(missing_docs)]

pub mod cuda;
pub mod nccl;
