//! What a rank is configured with ([`RankConfig`]), and the pair settings it reads from the
//! gateway before it joins.

use super::RankError;
use crate::transport::TransportConfig;
use awex_control::client::Client;
use awex_control::wire::ApplyMode;
use awex_core::backend::BackendSpec;
use awex_core::encoding::InferFp8;
use awex_core::layout::{RankId, Side};
use awex_core::model::ModelSpec;
use awex_core::pair::PairSpec;
use std::time::Duration;

/// Everything a rank needs to know to take part in a pair.
#[derive(Clone, Debug)]
pub struct RankConfig {
    /// Gateway base URL.
    pub gateway: String,
    /// Bearer token.
    pub token: Option<String>,
    /// Pair name.
    pub pair: String,
    /// This rank's side.
    pub side: Side,
    /// This rank.
    pub rank: RankId,
    /// The model.
    pub model: ModelSpec,
    /// Training layout spec.
    pub train: BackendSpec,
    /// Inference layout spec.
    pub infer: BackendSpec,
    /// How bytes move.
    pub transport: awex_core::Transport,
    /// The transports' settings (the caller reads them, e.g. from the `AWEX_*` variables).
    pub transports: TransportConfig,
    /// How long an idle rank keeps retrying a gateway it lost ([`Rank::gateway_lost`](super::Rank::gateway_lost)).
    pub gateway_lost: Duration,
    /// Staging bucket size in bytes.
    pub bucket_bytes: u64,
    /// Host this rank advertises to peers (tcp).
    pub host: String,
    /// The pair's connect uid (`PairStatus::uid`), which names its shared-memory segments;
    /// empty when not known yet ([`pair_uid`] asks the gateway).
    pub uid: String,
    /// How the pair applies updates (`PairOptions::apply`, from its status); an inference
    /// rank of an `atomic` pair receives into staging ([`make_transport`](super::make_transport)).
    pub apply: ApplyMode,
    /// The inference side's FP8 encoding (its `quantization_config` and recipe), when it
    /// stores the linear weights as FP8 blocks; every rank of the pair must be given the same.
    pub infer_fp8: Option<InferFp8>,
    /// Whether this process takes part in delta updates when its pair has them on
    /// (`PairOptions::deltas`): a training rank keeps a host copy of its tensors as last sent;
    /// an inference rank applies deltas to its tensors, which must hold exactly what it received
    /// between updates (an engine whose loader rewrites its weights after loading says false
    /// and gets every byte).
    pub deltas: bool,
}

impl RankConfig {
    /// The pair this rank belongs to, as a [`PairSpec`] (model, both sides, transport).
    pub fn pair_spec(&self) -> PairSpec {
        PairSpec {
            infer_fp8: self.infer_fp8.clone(),
            model: self.model.clone(),
            train: self.train.clone(),
            infer: self.infer.clone(),
            transport: self.transport,
        }
    }

    /// Where this rank's shared-memory segments are named.
    pub fn shm_scope(&self) -> crate::host::ShmScope {
        crate::host::ShmScope::new(&self.pair, &self.uid)
    }
}

/// The connect uid of the pair a rank is configured for (asks the gateway's status).
pub async fn pair_uid(cfg: &RankConfig) -> Result<String, RankError> {
    Ok(pair_settings(cfg).await?.0)
}

/// The connect uid and the apply mode of the pair a rank is configured for (asks the
/// gateway's status), for [`RankConfig::uid`] and [`RankConfig::apply`].
pub async fn pair_settings(cfg: &RankConfig) -> Result<(String, ApplyMode), RankError> {
    let client = Client::new(&cfg.gateway, cfg.token.clone())?;
    let st = client.status(&cfg.pair).await?;
    Ok((st.uid, st.options.apply))
}
