//! Executing plans on CPU memory in one process: the reference the transports are checked against.

use super::RankPlan;
use crate::layout::RankId;
use crate::layout::copy::{CopyError, copy_box_transposed};
use std::collections::HashMap;
use std::sync::Arc;

/// Local tensors of many ranks: rank -> tensor name -> bytes.
pub type RankBuffers = HashMap<RankId, HashMap<Arc<str>, Vec<u8>>>;

/// Why a simulated execution failed.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum SimulationError {
    /// A transfer names a tensor the rank has no buffer for.
    #[error("rank {rank} has no buffer for `{tensor}`")]
    MissingTensor {
        /// the rank
        rank: RankId,
        /// the tensor
        tensor: String,
    },
    /// A copy failed.
    #[error(transparent)]
    Copy(#[from] CopyError),
}

/// Executes the training side's plans: copies every transfer from `src` into `dst`.
pub fn simulate(
    training_plans: &[RankPlan],
    src: &RankBuffers,
    dst: &mut RankBuffers,
) -> Result<(), SimulationError> {
    for plan in training_plans {
        for peer in &plan.peers {
            for t in &peer.transfers {
                let s = src
                    .get(&t.src_rank)
                    .and_then(|m| m.get(&t.src_tensor))
                    .ok_or_else(|| SimulationError::MissingTensor {
                        rank: t.src_rank,
                        tensor: t.src_tensor.to_string(),
                    })?;
                let d = dst
                    .get_mut(&t.dst_rank)
                    .and_then(|m| m.get_mut(&t.dst_tensor))
                    .ok_or_else(|| SimulationError::MissingTensor {
                        rank: t.dst_rank,
                        tensor: t.dst_tensor.to_string(),
                    })?;
                copy_box_transposed(
                    s,
                    &t.src_shape,
                    &t.src_offset,
                    t.src_dtype,
                    d,
                    &t.dst_shape,
                    &t.dst_offset,
                    t.dst_dtype,
                    &t.extent,
                    t.transpose(),
                )?;
            }
        }
    }
    Ok(())
}
