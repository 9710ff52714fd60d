//! The connect request of a resolved pair: the one place that turns both sides' layouts into
//! `POST /v1/pairs`'s body.

use crate::wire::{ConnectRequest, InferenceSpec, PairOptions, TrainingSpec};
use awex_core::pair::ResolvedPair;

/// `POST /v1/pairs`'s body for `pair`: both sides' backends, parallel configs and world sizes
/// from the layouts, the model and its catalogue summary, the engines' URLs and the options.
pub fn connect_request(
    name: &str,
    pair: &ResolvedPair,
    urls: Vec<String>,
    options: PairOptions,
) -> ConnectRequest {
    let summary = pair.catalogue.summary();
    ConnectRequest {
        name: name.to_string(),
        training: TrainingSpec {
            backend: pair.spec.train.backend.clone(),
            parallel: pair.spec.train.parallel.clone(),
            world_size: pair.training.world_size() as u32,
            model: pair.spec.model.clone(),
            catalogue: summary.clone(),
        },
        inference: InferenceSpec {
            spare: 0,
            backend: pair.spec.infer.backend.clone(),
            parallel: pair.spec.infer.parallel.clone(),
            engines: pair.inference.engines(),
            world_size: pair.inference.world_size() as u32,
            urls,
            model: pair.spec.model.clone(),
            catalogue: summary,
            fp8: pair.spec.infer_fp8.clone(),
        },
        transport: pair.spec.transport,
        options,
    }
}
