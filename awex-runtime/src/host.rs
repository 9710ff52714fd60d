//! Rank hosting: where a rank's tensors live and how they are staged, shared by every host of a
//! rank (the CLI worker, the Python binding).
//!
//! - [`shm_data_segment`]: the name of a training rank's shared-memory data segment (the
//!   naming and liveness rules are in [`crate::shm`]);
//! - [`Memory`]: the tensor set the transport works on, with its host staging copy (weights on
//!   a GPU) or its shared-memory mirror (registered host tensors on the `shm` transport).

use crate::fill::{Weights, fill_or_check_parallel_with, fill_or_check_with};
use crate::shm::{gc, segment_name};
use crate::{RuntimeError, TensorError, TensorSet, TensorView};
use awex_core::Transport;
use awex_core::layout::{RankId, RankLayout, Side};
use awex_core::model::Catalogue;
use awex_gpu::cuda::Device;
use std::sync::Arc;

/// Where a rank's shared-memory segments are named: the pair and its connect uid
/// (`PairStatus::uid`; a rank that does not know it uses a random id of its own process).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ShmScope {
    /// The pair.
    pub pair: String,
    /// 32 hex digits.
    pub uid: String,
}

impl ShmScope {
    /// The scope of `pair` connected as `uid` (an empty or malformed uid: this process's own).
    pub fn new(pair: &str, uid: &str) -> Self {
        let ok = uid.len() == 32 && uid.bytes().all(|b| b.is_ascii_hexdigit());
        ShmScope {
            pair: pair.to_string(),
            uid: if ok {
                uid.to_ascii_lowercase()
            } else {
                process_uid().to_string()
            },
        }
    }

    /// The name of `who`'s segment of `kind` (`who`: `t0.1`, `i1.0`; `kind`: `data`, `ctl`).
    pub fn name(&self, who: &str, kind: &str) -> String {
        segment_name(&self.pair, &self.uid, who, kind)
    }
}

/// `{side}{engine}.{rank}.{incarnation}`: a rank's part of its segment names; the
/// incarnation (8 hex digits of [`process_uid`]) changes when the rank restarts, so that its
/// peers see new names and re-open its segments instead of reading the dead ones.
pub fn rank_tag(side: &str, rank: RankId) -> String {
    format!(
        "{side}{}.{}.{}",
        rank.engine,
        rank.rank,
        &process_uid()[..8]
    )
}

/// A random id of this process (32 hex digits), for segments of a rank that does not know its
/// pair's connect uid.
pub fn process_uid() -> &'static str {
    static ID: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    ID.get_or_init(|| {
        crate::transport::auth::random_bytes()[..16]
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect()
    })
}

/// The name of training rank `rank`'s shared-memory data segment. Dead segments on this host
/// (of any pair: their creators' liveness locks are free) are reclaimed first.
pub fn shm_data_segment(scope: &ShmScope, rank: RankId) -> String {
    gc(None);
    scope.name(&rank_tag("t", rank), "data")
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
    /// The inference side's FP8 encoding, for filling and checking FP8 tensors.
    pub fp8: Option<awex_core::encoding::InferFp8>,
}

impl Memory {
    /// Tensors awex allocates itself for `layout` (demos and benchmarks): on GPU `gpu` for the
    /// GPU transports (with a host staging copy), in shared memory for a training rank on
    /// `shm`, on the host otherwise.
    pub fn allocate(
        layout: &RankLayout,
        scope: &ShmScope,
        side: Side,
        transport: Transport,
        gpu: u32,
    ) -> Result<Memory, RuntimeError> {
        let (tensors, staging) = if transport.on_gpu() {
            let dev = Device::open(gpu).map_err(|source| RuntimeError::Cuda {
                what: "opening the GPU for the tensors".into(),
                source,
            })?;
            let tensors = TensorSet::allocate_cuda(layout, &dev)?;
            let staging = tensors.host_mirror()?;
            (tensors, Some(staging))
        } else if side == Side::Training && transport.sends_from_shared_memory() {
            let name = shm_data_segment(scope, layout.rank);
            (TensorSet::allocate_shm(layout, &name)?, None)
        } else {
            (TensorSet::allocate_host(layout)?, None)
        };
        Ok(Memory {
            tensors: Arc::new(tensors),
            staging,
            mirrored: Vec::new(),
            fp8: None,
        })
    }

    /// Tensors an engine registered (its own memory, addressed in place). A training rank on
    /// `shm` sends from a shared-memory mirror instead, refilled by [`Memory::refresh`].
    pub fn registered(
        views: Vec<TensorView>,
        layout: &RankLayout,
        scope: &ShmScope,
        side: Side,
        transport: Transport,
    ) -> Result<Memory, RuntimeError> {
        let set = TensorSet::from_views(views.clone())?;
        set.check_layout(layout)?;
        if side == Side::Training && transport.sends_from_shared_memory() {
            let name = shm_data_segment(scope, layout.rank);
            let mirror = TensorSet::allocate_shm(layout, &name)?;
            return Ok(Memory {
                tensors: Arc::new(mirror),
                staging: None,
                mirrored: views,
                fp8: None,
            });
        }
        Ok(Memory {
            tensors: Arc::new(set),
            staging: None,
            mirrored: Vec::new(),
            fp8: None,
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
                RuntimeError::from(TensorError::NotMirrored {
                    name: v.name.to_string(),
                })
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
        let fp8 = self.fp8.as_ref();
        match &self.staging {
            None => fill_or_check_with(weights, layout, cat, &self.tensors, v, false, fp8),
            Some(host) => fill_or_check_parallel_with(weights, layout, cat, host, v, false, fp8),
        }
        .map_err(|detail| RuntimeError::Weights { version: v, detail })?;
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
        let fp8 = self.fp8.as_ref();
        match &self.staging {
            None => fill_or_check_with(weights, layout, cat, &self.tensors, v, true, fp8),
            Some(host) => {
                self.tensors.download_to(host).map_err(|e| e.to_string())?;
                fill_or_check_parallel_with(weights, layout, cat, host, v, true, fp8)
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
