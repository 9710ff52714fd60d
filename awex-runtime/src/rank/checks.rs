//! The checks a rank makes of the pair it joins (model, layouts, FP8 encoding, transport,
//! bucket size, apply mode, connect uid) before it publishes anything.

use super::{RankConfig, RankError};
use crate::{ConfigMismatch, RuntimeError};
use awex_core::backend::BackendSpec;
use awex_core::layout::Side;

pub(super) fn normalised(side: Side, spec: &BackendSpec) -> awex_core::backend::ParallelConfig {
    let keys = match side {
        Side::Training => {
            awex_core::backend::training_backend(&spec.backend).map(|b| b.parallel_keys())
        }
        Side::Inference => {
            awex_core::backend::inference_backend(&spec.backend).map(|b| b.parallel_keys())
        }
    };
    match keys {
        Ok(k) => spec
            .parallel
            .checked(k, &spec.backend)
            .unwrap_or_else(|_| spec.parallel.clone()),
        Err(_) => spec.parallel.clone(),
    }
}

pub(super) fn transport_mismatch(
    pair: &str,
    theirs: &str,
    ours: awex_core::Transport,
) -> RuntimeError {
    ConfigMismatch::Pair {
        pair: pair.to_string(),
        field: "uses transport",
        expected: theirs.to_string(),
        got: ours.to_string(),
        hint: "",
    }
    .into()
}

/// Refuses to join a pair whose description disagrees with this rank's (model, layouts,
/// transport, bucket geometry, connect): everything a rank could get wrong is checked here,
/// before it publishes anything.
pub(super) fn check_pair(
    st: &awex_control::wire::PairStatus,
    cfg: &RankConfig,
) -> Result<(), RankError> {
    if st.transport.as_str() != cfg.transport.as_str() {
        return Err(transport_mismatch(&cfg.pair, st.transport.as_str(), cfg.transport).into());
    }
    let pair_bucket = st.options.bucket_mib.saturating_mul(1 << 20);
    if pair_bucket != cfg.bucket_bytes {
        return Err(RuntimeError::from(ConfigMismatch::Pair {
            pair: cfg.pair.clone(),
            field: "moves buckets of",
            expected: format!("{} MiB", st.options.bucket_mib),
            got: format!(
                "{} bytes ({} MiB)",
                cfg.bucket_bytes,
                cfg.bucket_bytes as f64 / (1u64 << 20) as f64
            ),
            hint: "; every rank must use the pair's bucket_mib (the bucket geometry is part of the plan every peer checks)",
        })
        .into());
    }
    if !cfg.uid.is_empty() && !st.uid.is_empty() && cfg.uid != st.uid {
        return Err(RuntimeError::from(ConfigMismatch::Reconnected {
            pair: cfg.pair.clone(),
            expected: cfg.uid.clone(),
            got: st.uid.clone(),
        })
        .into());
    }
    if st.options.apply != cfg.apply {
        return Err(RuntimeError::from(ConfigMismatch::Pair {
            pair: cfg.pair.clone(),
            field: "applies updates",
            expected: st.options.apply.to_string(),
            got: cfg.apply.to_string(),
            hint: "; take the apply mode from the pair's status (rank::pair_settings)",
        })
        .into());
    }
    if st.inference.fp8 != cfg.infer_fp8 {
        let say = |f: &Option<awex_core::encoding::InferFp8>| match f {
            Some(f) => f.describe(),
            None => "plain (no FP8)".to_string(),
        };
        return Err(RuntimeError::from(ConfigMismatch::Pair {
            pair: cfg.pair.clone(),
            field: "stores its inference weights as",
            expected: say(&st.inference.fp8),
            got: say(&cfg.infer_fp8),
            hint: "; every rank must be given the inference side's FP8 config the pair was connected with (the plan and the receivers' tensors follow from it)",
        })
        .into());
    }
    let fp = format!("{:016x}", cfg.model.fingerprint());
    for (side, spec, theirs) in [
        (Side::Training, &cfg.train, &st.training),
        (Side::Inference, &cfg.infer, &st.inference),
    ] {
        let pair_spec = BackendSpec {
            backend: theirs.backend.clone(),
            parallel: theirs.parallel.clone(),
        };
        if theirs.backend != spec.backend || normalised(side, spec) != normalised(side, &pair_spec)
        {
            return Err(RankError::Layout(format!(
                "this rank was started with {side} layout `{spec}` but pair `{}` was connected with `{pair_spec}`; every rank must use the pair's layouts",
                cfg.pair
            )));
        }
        if theirs.fingerprint != fp {
            return Err(RankError::Layout(format!(
                "this rank's model `{}` (fingerprint {fp}) differs from the {side} model of pair `{}` (`{}`, fingerprint {})",
                cfg.model.name, cfg.pair, theirs.model, theirs.fingerprint
            )));
        }
    }
    Ok(())
}
