//! A pair's spec (the model, both sides' backend specs, the transport) and its resolution into
//! the catalogue and both sides' layouts: the one place where "build both layouts" happens.

use crate::backend::{BackendSpec, SideError, side_layout};
use crate::encoding::{Fp8Side, InferFp8};
use crate::layout::{Side, SideLayout};
use crate::model::{Catalogue, ModelSpec};
use crate::plan;
use crate::transport::Transport;
use std::sync::Arc;

/// What a pair is made of, before any layout is built.
#[derive(Clone, Debug)]
pub struct PairSpec {
    /// The model both sides hold.
    pub model: ModelSpec,
    /// The training side (`megatron:tp=2,pp=2`).
    pub train: BackendSpec,
    /// The inference side (`sglang:tp=2,engines=2`).
    pub infer: BackendSpec,
    /// How the bytes move.
    pub transport: Transport,
    /// The inference side stores the linear weights as FP8 blocks (from its
    /// `quantization_config`); `None`: it stores what the training side holds.
    pub infer_fp8: Option<InferFp8>,
}

/// A pair spec with its catalogue and both sides' layouts built.
#[derive(Clone)]
pub struct ResolvedPair {
    /// The spec it was built from.
    pub spec: PairSpec,
    /// The model's canonical tensors.
    pub catalogue: Catalogue,
    /// Every training rank's layout.
    pub training: Arc<dyn SideLayout>,
    /// Every inference rank's layout, all engines.
    pub inference: Arc<dyn SideLayout>,
}

/// Why a pair spec could not be resolved: which side, its spec, and the backend's reason.
#[derive(Debug, thiserror::Error)]
// the reason is part of the message and not the error's `source`, so that a report of the
// whole chain (`{:#}`) says it once
#[error("{side} layout `{spec}`: {reason}")]
pub struct PairError {
    /// The side whose layout failed.
    pub side: Side,
    /// That side's spec.
    pub spec: Box<BackendSpec>,
    /// Why.
    pub reason: Box<SideError>,
}

impl PairSpec {
    /// Builds the catalogue and both sides' layouts through the registered backends.
    pub fn resolve(&self) -> Result<ResolvedPair, PairError> {
        let layout = |side: Side, spec: &BackendSpec| {
            side_layout(side, spec, &self.model).map_err(|reason| PairError {
                side,
                spec: Box::new(spec.clone()),
                reason: Box::new(reason),
            })
        };
        let training = layout(Side::Training, &self.train)?;
        let mut inference = layout(Side::Inference, &self.infer)?;
        let catalogue = Catalogue::of(&self.model);
        if let Some(fp8) = &self.infer_fp8 {
            inference = Arc::new(
                Fp8Side::new(inference, &self.model, &catalogue, fp8.clone()).map_err(|e| {
                    PairError {
                        side: Side::Inference,
                        spec: Box::new(self.infer.clone()),
                        reason: Box::new(SideError::Layout(e)),
                    }
                })?,
            );
        }
        Ok(ResolvedPair {
            catalogue,
            spec: self.clone(),
            training,
            inference,
        })
    }
}

impl ResolvedPair {
    /// The layout of one side.
    pub fn side(&self, side: Side) -> &dyn SideLayout {
        match side {
            Side::Training => &*self.training,
            Side::Inference => &*self.inference,
        }
    }

    /// The backend spec of one side.
    pub fn backend(&self, side: Side) -> &BackendSpec {
        match side {
            Side::Training => &self.spec.train,
            Side::Inference => &self.spec.infer,
        }
    }

    /// The planner's view of the pair.
    pub fn plan_pair(&self) -> plan::Pair<'_> {
        plan::Pair {
            catalogue: &self.catalogue,
            training: &*self.training,
            inference: &*self.inference,
            encode_on_sender: self.spec.transport.encodes_fp8_on_sender(),
        }
    }
}
