//! A rank's layout and plan, computed before it joins ([`prepare`]), and the name of its
//! rendezvous value.

use super::{RankConfig, RankError};
use crate::RuntimeError;
use awex_core::layout::{RankId, RankLayout, Side};
use awex_core::model::Catalogue;
use awex_core::pair::ResolvedPair;
use awex_core::plan::RankPlan;
use std::sync::Arc;

/// A rank's layout and plan, computed before it joins (so tensors can be checked first).
pub struct Prepared {
    /// The pair's catalogue and both sides' layouts ([`RankConfig::pair_spec`] resolved).
    pub pair: Arc<ResolvedPair>,
    /// The model's catalogue.
    pub catalogue: Catalogue,
    /// This rank's local tensors.
    pub layout: RankLayout,
    /// This rank's plan.
    pub plan: Arc<RankPlan>,
}

/// Computes this rank's layout and plan.
pub fn prepare(cfg: &RankConfig) -> Result<Prepared, RankError> {
    let pair = cfg.pair_spec().resolve()?;
    let mine = pair.side(cfg.side);
    let layout = mine.rank_layout(cfg.rank).ok_or_else(|| {
        RankError::Layout(format!(
            "{} layout {} has no rank {} (world size {})",
            cfg.side,
            pair.backend(cfg.side),
            cfg.rank,
            mine.world_size()
        ))
    })?;
    let plan = Arc::new(
        pair.plan_pair()
            .plan_rank(cfg.side, cfg.rank)
            .map_err(RuntimeError::from)?,
    );
    if cfg.transport == awex_core::Transport::Nccl {
        // FP8: every block quantised by its sender on its GPU, none left to the receiver
        for t in plan.peers.iter().flat_map(|p| &p.transfers) {
            awex_gpu::nccl::check_encoding(t).map_err(|e| RuntimeError::Fp8(e.to_string()))?;
        }
    }
    Ok(Prepared {
        catalogue: pair.catalogue.clone(),
        pair: Arc::new(pair),
        layout,
        plan,
    })
}

/// The kv key under which a rank publishes its rendezvous info.
pub fn rendezvous_key(side: Side, rank: RankId) -> String {
    format!("rdv.{}.{}.{}", side.short(), rank.engine, rank.rank)
}
