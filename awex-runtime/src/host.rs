//! Rank hosting: where a rank's tensors live and how they are staged, shared by every host of a
//! rank (the CLI worker, the Python binding).
//!
//! - [`shm_data_segment`]: the name of a training rank's shared-memory data segment;
//! - [`Memory`]: the tensor set the transport works on, with its host staging copy (weights on
//!   a GPU) or its shared-memory mirror (registered host tensors on the `shm` transport).

use crate::fill::{Weights, fill_or_check_from, fill_or_check_parallel};
use crate::shm::sweep_dead;
use crate::{RuntimeError, TensorSet, TensorView};
use awex_core::Transport;
use awex_core::layout::{RankId, RankLayout, Side};
use awex_core::model::Catalogue;
use awex_gpu::cuda::Device;
use std::sync::Arc;

/// The prefix of every shared-memory segment of `pair`.
pub fn shm_prefix(pair: &str) -> String {
    format!("awex-{pair}-")
}

/// The name of training rank `rank`'s shared-memory data segment (the segments of dead
/// processes of the pair are swept first).
pub fn shm_data_segment(pair: &str, rank: RankId) -> String {
    let prefix = shm_prefix(pair);
    // a rank killed earlier may have left its segments behind
    sweep_dead(&prefix);
    format!("{prefix}train0.{}-{}-data", rank.rank, std::process::id())
}

/// Whether a transport moves device memory.
pub fn on_gpu(transport: Transport) -> bool {
    matches!(transport, Transport::CudaIpc | Transport::Nccl)
}

/// A rank's tensors as the transport sees them, and how they are kept in step with the
/// engine's own memory.
pub struct Memory {
    /// What the transport reads (training) or writes (inference).
    pub tensors: Arc<TensorSet>,
    /// Host copy of device tensors (awex-allocated GPU weights), for filling and checking.
    staging: Option<TensorSet>,
    /// Registered host tensors copied into `tensors` (a shared-memory mirror) before each
    /// update; empty unless the mirror is in use.
    mirrored: Vec<TensorView>,
}

impl Memory {
    /// Tensors awex allocates itself for `layout` (demos and benchmarks): on GPU `gpu` for the
    /// GPU transports (with a host staging copy), in shared memory for a training rank on
    /// `shm`, on the host otherwise.
    pub fn allocate(
        layout: &RankLayout,
        pair: &str,
        side: Side,
        transport: Transport,
        gpu: u32,
    ) -> Result<Memory, RuntimeError> {
        let (tensors, staging) = if on_gpu(transport) {
            let dev = Device::open(gpu).map_err(|e| RuntimeError::Tensor(e.to_string()))?;
            let tensors = TensorSet::allocate_cuda(layout, &dev)?;
            let staging = tensors.host_mirror()?;
            (tensors, Some(staging))
        } else if side == Side::Training && transport == Transport::Shm {
            let name = shm_data_segment(pair, layout.rank);
            (TensorSet::allocate_shm(layout, &name)?, None)
        } else {
            (TensorSet::allocate_host(layout)?, None)
        };
        Ok(Memory {
            tensors: Arc::new(tensors),
            staging,
            mirrored: Vec::new(),
        })
    }

    /// Tensors an engine registered (its own memory, addressed in place). A training rank on
    /// `shm` sends from a shared-memory mirror instead, refilled by [`Memory::refresh`].
    pub fn registered(
        views: Vec<TensorView>,
        layout: &RankLayout,
        pair: &str,
        side: Side,
        transport: Transport,
    ) -> Result<Memory, RuntimeError> {
        let set = TensorSet::from_views(views.clone())?;
        set.check_layout(layout)?;
        if side == Side::Training && transport == Transport::Shm {
            let name = shm_data_segment(pair, layout.rank);
            let mirror = TensorSet::allocate_shm(layout, &name)?;
            return Ok(Memory {
                tensors: Arc::new(mirror),
                staging: None,
                mirrored: views,
            });
        }
        Ok(Memory {
            tensors: Arc::new(set),
            staging: None,
            mirrored: Vec::new(),
        })
    }

    /// Whether updates copy the registered tensors into a shared-memory mirror first.
    pub fn uses_mirror(&self) -> bool {
        !self.mirrored.is_empty()
    }

    /// Brings the transport's tensors up to date with the engine's before an update (the
    /// mirror copy; nothing otherwise). Must not run while an update moves these tensors.
    pub fn refresh(&self) -> Result<(), RuntimeError> {
        for v in &self.mirrored {
            let dst = self.tensors.get(&v.name).ok_or_else(|| {
                RuntimeError::Tensor(format!("`{}` has no place in the mirror", v.name))
            })?;
            // SAFETY: no update runs on the mirror between updates (this is its only writer);
            // the lengths agree, both coming from the checked layout.
            let out = unsafe { dst.try_bytes_mut() }?;
            out.copy_from_slice(v.try_bytes()?);
        }
        Ok(())
    }

    /// Writes version `v` of `weights` into the tensors (on the host, then one upload for
    /// device tensors).
    pub fn fill(
        &self,
        weights: &Weights,
        layout: &RankLayout,
        cat: &Catalogue,
        v: u64,
    ) -> Result<(), RuntimeError> {
        match &self.staging {
            None => fill_or_check_from(weights, layout, cat, &self.tensors, v, false),
            Some(host) => fill_or_check_parallel(weights, layout, cat, host, v, false),
        }
        .map_err(RuntimeError::Tensor)?;
        if let Some(host) = &self.staging {
            self.tensors.upload_from(host)?;
        }
        Ok(())
    }

    /// Checks that the tensors hold version `v` (device tensors are downloaded first); the
    /// first mismatch, described.
    pub fn check(
        &self,
        weights: &Weights,
        layout: &RankLayout,
        cat: &Catalogue,
        v: u64,
    ) -> Result<(), String> {
        match &self.staging {
            None => fill_or_check_from(weights, layout, cat, &self.tensors, v, true),
            Some(host) => {
                self.tensors.download_to(host).map_err(|e| e.to_string())?;
                fill_or_check_parallel(weights, layout, cat, host, v, true)
            }
        }
    }

    /// The tensors as host memory (device tensors downloaded), e.g. for dumps.
    pub fn host_view(&self) -> Result<&TensorSet, RuntimeError> {
        match &self.staging {
            None => Ok(&self.tensors),
            Some(host) => {
                self.tensors.download_to(host)?;
                Ok(host)
            }
        }
    }
}
