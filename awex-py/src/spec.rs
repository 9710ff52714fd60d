//! What a rank must know of its pair, resolved from the gateway's description of the pair
//! (`GET /v1/pairs/{name}/status`, and the model a controller stored under `model.{side}`),
//! with explicit arguments taking the place of any part and checked against it.

use crate::errors::{Fail, Result};
use awex_control::client::Client;
use awex_control::wire::{PairStatus, SideStatus};
use awex_core::Transport;
use awex_core::backend::{BackendSpec, ParallelConfig, inference_backend, training_backend};
use awex_core::layout::{RankId, Side};
use awex_core::model::ModelSpec;
use awex_runtime::rank::RankConfig;
use awex_runtime::transport::TransportConfig;
use std::collections::BTreeMap;
use std::time::Duration;

pub(crate) use awex_control::wire::model_key;

/// The model as the caller gave it.
#[derive(Clone, Debug)]
pub(crate) enum ModelArg {
    /// A preset name, a `config.json` path or an HF model directory.
    Resolve(String),
    /// The text of a `config.json`.
    ConfigJson(String),
}

impl ModelArg {
    /// The model spec it names.
    pub(crate) fn spec(&self) -> Result<ModelSpec> {
        Ok(match self {
            ModelArg::Resolve(s) => ModelSpec::resolve(s)?,
            ModelArg::ConfigJson(t) => ModelSpec::from_config_json(t)?,
        })
    }
}

/// One side's layout as the caller gave it: a whole spec, or a backend and/or a parallel config.
#[derive(Clone, Debug, Default)]
pub(crate) struct SideArg {
    /// `backend:k=v,...`.
    pub spec: Option<String>,
    /// The backend name alone.
    pub backend: Option<String>,
    /// The parallel config alone.
    pub parallel: Option<BTreeMap<String, u64>>,
}

/// Everything a Writer or Reader was constructed with.
#[derive(Clone, Debug)]
pub(crate) struct RankArgs {
    pub side: Side,
    pub gateway: String,
    pub pair: String,
    pub rank: RankId,
    pub token: Option<String>,
    pub model: Option<ModelArg>,
    pub train: SideArg,
    pub infer: SideArg,
    pub transport: Option<String>,
    pub bucket_mib: Option<u64>,
    pub host: Option<String>,
}

/// Fills in a backend's default parallel keys, those that follow other keys included, so that
/// `tp=2`, `tp=2,pp=1` and Megatron's `tp=2,etp=2` compare equal.
pub(crate) fn normalised(side: Side, spec: &BackendSpec) -> ParallelConfig {
    let resolved = match side {
        Side::Training => {
            training_backend(&spec.backend).and_then(|b| b.resolved_parallel(&spec.parallel))
        }
        Side::Inference => {
            inference_backend(&spec.backend).and_then(|b| b.resolved_parallel(&spec.parallel))
        }
    };
    resolved.unwrap_or_else(|_| spec.parallel.clone())
}

/// One side's spec: the caller's pieces where given, the pair's otherwise; a caller's spec that
/// disagrees with the pair is refused (every rank must compute the same plan).
fn side_spec(side: Side, arg: &SideArg, theirs: &SideStatus, pair: &str) -> Result<BackendSpec> {
    let pair_spec = BackendSpec {
        backend: theirs.backend.clone(),
        parallel: theirs.parallel.clone(),
    };
    let mine = match (&arg.spec, &arg.backend, &arg.parallel) {
        (Some(s), None, None) => s.parse::<BackendSpec>()?,
        (Some(_), _, _) => {
            return Err(Fail::Value(format!(
                "give the {side} layout either as a spec string or as backend/parallel, not both"
            )));
        }
        (None, b, p) => BackendSpec {
            backend: b.clone().unwrap_or_else(|| pair_spec.backend.clone()),
            parallel: p
                .clone()
                .map(ParallelConfig)
                .unwrap_or_else(|| pair_spec.parallel.clone()),
        },
    };
    if mine.backend != pair_spec.backend || normalised(side, &mine) != normalised(side, &pair_spec)
    {
        return Err(Fail::Layout(format!(
            "this rank was given the {side} layout `{mine}` but pair `{pair}` was connected with `{pair_spec}`; every rank must use the pair's layouts (leave it out to take the pair's)"
        )));
    }
    Ok(mine)
}

/// The model: the caller's, else the one the controller stored on the gateway, else the
/// preset the pair names; checked against the pair's fingerprint for this rank's side.
async fn model(args: &RankArgs, client: &Client, st: &PairStatus) -> Result<ModelSpec> {
    let theirs = match args.side {
        Side::Training => &st.training,
        Side::Inference => &st.inference,
    };
    let spec = match &args.model {
        Some(m) => m.spec()?,
        None => {
            let stored = client
                .get_kv(&args.pair, &model_key(args.side), Duration::ZERO)
                .await;
            match stored {
                Ok(e) => serde_json::from_value::<ModelSpec>(e.value)
                    .map_err(|e| e.to_string())
                    .and_then(|s| s.validate().map(|()| s).map_err(|e| e.to_string()))
                    .map_err(|e| {
                        Fail::Awex(format!(
                            "the model stored on pair `{}` under `{}` is not a model description: {e}",
                            args.pair,
                            model_key(args.side)
                        ))
                    })?,
                Err(e) if e.status() == Some(404) => {
                    ModelSpec::resolve(&theirs.model).map_err(|_| {
                        Fail::Value(format!(
                            "pair `{}` was connected with model `{}`, which is not a built-in preset, and no controller stored it on the gateway; pass model=<preset, config.json or HF model directory>",
                            args.pair, theirs.model
                        ))
                    })?
                }
                Err(e) => return Err(e.into()),
            }
        }
    };
    let fp = format!("{:016x}", spec.fingerprint());
    if fp != theirs.fingerprint {
        return Err(Fail::Layout(format!(
            "model `{}` (fingerprint {fp}) differs from the {} model of pair `{}` (`{}`, fingerprint {}); pass the model the pair was connected with",
            spec.name, args.side, args.pair, theirs.model, theirs.fingerprint
        )));
    }
    Ok(spec)
}

/// Resolves a rank's full configuration from its arguments and the pair's description.
pub(crate) async fn resolve(args: &RankArgs) -> Result<RankConfig> {
    let client = Client::new(&args.gateway, args.token.clone())?;
    let st = client.status(&args.pair).await?;
    let train = side_spec(Side::Training, &args.train, &st.training, &args.pair)?;
    let infer = side_spec(Side::Inference, &args.infer, &st.inference, &args.pair)?;
    let model = model(args, &client, &st).await?;
    let pair_transport: Transport = st.transport;
    let transport = match &args.transport {
        None => pair_transport,
        Some(t) => {
            let t: Transport = t.parse().map_err(Fail::Value)?;
            if t != pair_transport {
                return Err(Fail::Value(format!(
                    "pair `{}` uses transport {pair_transport} but this rank was given {t}",
                    args.pair
                )));
            }
            t
        }
    };
    let bucket_mib = args.bucket_mib.unwrap_or(st.options.bucket_mib).max(1);
    Ok(RankConfig {
        infer_fp8: None,
        gateway: args.gateway.clone(),
        token: args.token.clone(),
        pair: args.pair.clone(),
        side: args.side,
        rank: args.rank,
        model,
        train,
        infer,
        transport,
        bucket_bytes: bucket_mib << 20,
        host: args
            .host
            .clone()
            .or_else(|| std::env::var("AWEX_HOST").ok())
            .unwrap_or_else(|| "127.0.0.1".into()),
        uid: st.uid.clone(),
        apply: st.options.apply,
        transports: TransportConfig::from_vars(|k| std::env::var(k).ok())
            .map_err(|e| Fail::Value(e.to_string()))?,
        gateway_lost: awex_runtime::rank::gateway_lost_from(
            std::env::var("AWEX_GATEWAY_LOST_S").ok().as_deref(),
        )
        .map_err(|e| Fail::Value(e.to_string()))?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn norm(side: Side, s: &str) -> ParallelConfig {
        normalised(side, &s.parse().unwrap())
    }

    #[test]
    fn a_rank_spec_that_spells_out_a_derived_default_equals_the_pairs() {
        // Megatron's etp is tp unless given, grouped_gemm is the opposite of local_spec
        assert_eq!(
            norm(Side::Training, "megatron:tp=2"),
            norm(Side::Training, "megatron:tp=2,etp=2,pp=1")
        );
        assert_eq!(
            norm(Side::Training, "megatron:tp=2,local_spec=1"),
            norm(Side::Training, "megatron:tp=2,local_spec=1,grouped_gemm=0")
        );
        assert_ne!(
            norm(Side::Training, "megatron:tp=2"),
            norm(Side::Training, "megatron:tp=2,etp=1")
        );
        assert_eq!(
            norm(Side::Inference, "sglang:tp=2"),
            norm(Side::Inference, "sglang:tp=2,ep=1,engines=1")
        );
    }
}
