//! Communicator rank numbering: one communicator spans every rank of a pair.
//!
//! Training ranks come first (global rank `r` is communicator rank `r`), then the inference
//! ranks engine-major (engine `e`, rank `r` is `T + e*R + r`, with `T` training ranks and `R`
//! ranks per engine). Every rank computes every number from the pair's layouts alone.

use super::NcclError;
use awex_core::layout::{RankId, Side, SideLayout};
use serde::{Deserialize, Serialize};
use std::fmt;

/// The ranks of one pair's communicator.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct CommWorld {
    /// Training ranks (`T`).
    pub training: u32,
    /// Inference engines (`E`).
    pub engines: u32,
    /// Ranks per inference engine (`R`).
    pub ranks_per_engine: u32,
}

impl fmt::Display for CommWorld {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} training ranks + {} engine(s) x {} inference ranks",
            self.training, self.engines, self.ranks_per_engine
        )
    }
}

impl CommWorld {
    /// A world of `training` ranks and `engines` engines of `ranks_per_engine` ranks each.
    pub fn new(training: u32, engines: u32, ranks_per_engine: u32) -> Result<Self, NcclError> {
        let w = CommWorld {
            training,
            engines,
            ranks_per_engine,
        };
        if training == 0 || engines == 0 || ranks_per_engine == 0 {
            return Err(NcclError::BadWorld(format!(
                "{w}: every count must be at least 1"
            )));
        }
        let n = u64::from(engines) * u64::from(ranks_per_engine) + u64::from(training);
        if n > i32::MAX as u64 {
            return Err(NcclError::BadWorld(format!(
                "{w}: {n} ranks exceed what NCCL can number ({})",
                i32::MAX
            )));
        }
        Ok(w)
    }

    /// The world of a pair's two sides.
    pub fn of(training: &dyn SideLayout, inference: &dyn SideLayout) -> Result<Self, NcclError> {
        let t = training.world_size();
        let e = inference.engines().max(1) as usize;
        let i = inference.world_size();
        if i % e != 0 {
            return Err(NcclError::BadWorld(format!(
                "{i} inference ranks do not split evenly over {e} engines"
            )));
        }
        let conv = |x: usize| {
            u32::try_from(x)
                .map_err(|_| NcclError::BadWorld(format!("{x} ranks exceed what NCCL can number")))
        };
        Self::new(conv(t)?, conv(e)?, conv(i / e)?)
    }

    /// Ranks in the communicator: `T + E*R`.
    pub fn nranks(&self) -> u32 {
        self.training + self.engines * self.ranks_per_engine
    }

    /// The communicator rank of a rank of either side.
    pub fn comm_rank(&self, side: Side, rank: RankId) -> Result<u32, NcclError> {
        let ok = match side {
            Side::Training => rank.engine == 0 && rank.rank < self.training,
            Side::Inference => rank.engine < self.engines && rank.rank < self.ranks_per_engine,
        };
        if !ok {
            return Err(NcclError::NoSuchRank {
                side,
                rank,
                world: self.to_string(),
            });
        }
        Ok(match side {
            Side::Training => rank.rank,
            Side::Inference => self.training + rank.engine * self.ranks_per_engine + rank.rank,
        })
    }

    /// The side and rank holding communicator rank `c` (the inverse of [`CommWorld::comm_rank`]).
    pub fn rank_of(&self, c: u32) -> Result<(Side, RankId), NcclError> {
        if c >= self.nranks() {
            return Err(NcclError::NoSuchCommRank {
                rank: c,
                nranks: self.nranks(),
            });
        }
        if c < self.training {
            return Ok((Side::Training, RankId::train(c)));
        }
        let i = c - self.training;
        Ok((
            Side::Inference,
            RankId::infer(i / self.ranks_per_engine, i % self.ranks_per_engine),
        ))
    }
}
