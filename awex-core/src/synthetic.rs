//! Synthetic catalogues and layouts for property tests and planner benchmarks.
//!
//! A synthetic side splits every canonical tensor into contiguous chunks along one dim, lays the
//! chunks out in per-rank local tensors (optionally with padding rows, optionally fused into one
//! local tensor per rank), and replicates the whole split over replicas and engines.

use crate::dtype::DType;
use crate::layout::{Dims, ExplicitSide, LocalTensor, Placement, RankId, RankLayout, Region, Side};
use crate::model::{CanonicalTensor, Catalogue};
use std::sync::Arc;

/// How one side splits one canonical tensor.
#[derive(Clone, Debug)]
pub struct TensorSplit {
    /// The dim split (0 or the last).
    pub dim: usize,
    /// Chunk boundaries, strictly inside the dim (sorted, may repeat to make empty chunks).
    pub cuts: Vec<u64>,
    /// Padding rows before the chunk in each local tensor (not fused tensors).
    pub pad: u64,
}

/// A synthetic side description.
#[derive(Clone, Debug)]
pub struct SyntheticSide {
    /// Which side.
    pub side: Side,
    /// Engines (replicas of the whole layout with distinct engine ids); 1 for training.
    pub engines: u32,
    /// Replicas inside each engine (DP-like on training, replication like kv heads on inference).
    pub replicas: u32,
    /// Number of shards per tensor (= cuts.len() + 1 for every split).
    pub shards: u32,
    /// Split per canonical tensor.
    pub splits: Vec<TensorSplit>,
    /// Local dtype.
    pub dtype: DType,
    /// Stack all dim-0 chunks of 2-D tensors with equal columns into one local tensor per rank.
    pub fuse: bool,
}

fn chunk_bounds(len: u64, cuts: &[u64], s: usize) -> (u64, u64) {
    let lo = if s == 0 { 0 } else { cuts[s - 1] };
    let hi = if s == cuts.len() { len } else { cuts[s] };
    (lo, hi)
}

impl SyntheticSide {
    /// Ranks per engine.
    pub fn ranks_per_engine(&self) -> u32 {
        self.shards * self.replicas
    }

    /// The layout of every rank.
    pub fn rank_layouts(&self, cat: &Catalogue) -> Vec<RankLayout> {
        let mut out = Vec::new();
        for e in 0..self.engines {
            for rep in 0..self.replicas {
                for s in 0..self.shards {
                    let rank = RankId {
                        engine: e,
                        rank: rep * self.shards + s,
                    };
                    out.push(RankLayout {
                        rank,
                        tensors: self.tensors_of_shard(cat, s as usize),
                    });
                }
            }
        }
        out
    }

    fn tensors_of_shard(&self, cat: &Catalogue, s: usize) -> Vec<LocalTensor> {
        let mut tensors = Vec::new();
        let mut fused: Vec<Placement> = Vec::new();
        let mut fused_rows = 0u64;
        let mut fused_cols = None;
        for (c, split) in cat.tensors().iter().zip(&self.splits) {
            let (lo, hi) = chunk_bounds(c.shape.get(split.dim), &split.cuts, s);
            let mut region = Region::full(c.shape);
            region.offset.set(split.dim, lo);
            region.extent.set(split.dim, hi - lo);
            let canonical: Arc<str> = Arc::from(c.name.as_str());
            let fusable = self.fuse
                && c.shape.ndim() == 2
                && split.dim == 0
                && fused_cols.is_none_or(|cols| cols == c.shape.get(1));
            if fusable {
                fused_cols = Some(c.shape.get(1));
                if hi > lo {
                    fused.push(Placement {
                        canonical,
                        region,
                        local_offset: Dims::new(&[fused_rows, 0]),
                        transposed: false,
                    });
                }
                fused_rows += hi - lo + split.pad;
                continue;
            }
            let mut shape = c.shape;
            shape.set(split.dim, hi - lo);
            let mut local_offset = Dims::zeros(shape.ndim());
            shape.set(0, shape.get(0) + split.pad);
            local_offset.set(0, split.pad);
            tensors.push(LocalTensor {
                name: Arc::from(format!("local.{}", c.name).as_str()),
                shape,
                dtype: self.dtype,
                encoding: crate::encoding::Encoding::Plain(self.dtype),
                placements: if hi > lo {
                    vec![Placement {
                        canonical,
                        region,
                        local_offset,
                        transposed: false,
                    }]
                } else {
                    vec![]
                },
            });
        }
        if let Some(cols) = fused_cols {
            tensors.push(LocalTensor {
                name: Arc::from("local.fused"),
                shape: Dims::new(&[fused_rows, cols]),
                dtype: self.dtype,
                encoding: crate::encoding::Encoding::Plain(self.dtype),
                placements: fused,
            });
        }
        tensors
    }

    /// The side as an [`ExplicitSide`].
    pub fn build(&self, cat: &Catalogue) -> ExplicitSide {
        ExplicitSide::new(self.side, self.rank_layouts(cat))
    }
}

/// A catalogue of `n` bf16 tensors with the given shapes, named `t{i}`.
pub fn catalogue(shapes: &[Vec<u64>]) -> Catalogue {
    Catalogue::new(
        shapes
            .iter()
            .enumerate()
            .map(|(i, s)| CanonicalTensor {
                name: format!("t{i}"),
                shape: Dims::new(s),
                dtype: DType::Bf16,
            })
            .collect(),
    )
}

/// Deterministic pseudo-random bytes for canonical tensor `name` at `version` (the runtime's
/// synthetic weights, [`crate::weights`]).
pub fn canonical_bytes(name: &str, version: u64, len: usize) -> Vec<u8> {
    let mut out = vec![0u8; len];
    crate::weights::canonical_bytes_at(crate::weights::seed(name, version), 0, &mut out);
    out
}
