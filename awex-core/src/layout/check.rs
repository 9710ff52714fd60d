//! Whole-side checks any backend's layout must pass (used by backend tests and the conformance suite).
//!
//! They build every rank's layout, so they are for test-sized worlds.

use super::copy::CopyError;
use super::{
    CoverageGap, LayoutError, RankId, RankLayout, Region, SideLayout, coverage, materialize,
    reconstruct, validate_holders, validate_rank,
};
use crate::model::Catalogue;
use std::collections::HashMap;

/// Why a side's layout failed a whole-side check.
#[derive(Debug, thiserror::Error)]
pub enum CheckError {
    /// The side lists a different number of ranks than its world size.
    #[error("{listed} ranks listed, world size {world}")]
    RankCount {
        /// ranks listed
        listed: usize,
        /// the world size
        world: usize,
    },
    /// A listed rank has no layout.
    #[error("listed rank {0} has no layout")]
    NoLayout(RankId),
    /// One rank's layout is malformed.
    #[error(transparent)]
    Rank(#[from] LayoutError),
    /// The holder index disagrees with the ranks' layouts.
    #[error("{0}")]
    Holders(String),
    /// Some canonical bytes are held by no rank of an engine.
    #[error("coverage gap: {0}")]
    Gap(CoverageGap),
    /// A canonical tensor has no holder at all.
    #[error("`{0}` has no holder")]
    NoHolder(String),
    /// The shards of a canonical tensor in one local tensor name do not add up to it.
    #[error("`{canonical}` in `{tensor}`: shards hold {held} elements, the tensor has {numel}")]
    ShardTotal {
        /// canonical tensor
        canonical: String,
        /// local tensor name
        tensor: String,
        /// elements the shards hold
        held: u64,
        /// elements of the canonical tensor
        numel: u64,
    },
    /// Two shards of one local tensor name overlap.
    #[error("`{canonical}` in `{tensor}`: {a} and {b} overlap")]
    Overlap {
        /// canonical tensor
        canonical: String,
        /// local tensor name
        tensor: String,
        /// one shard (`[r0..r1, c0..c1]`)
        a: String,
        /// the other
        b: String,
    },
    /// Materialising or reconstructing the bytes failed.
    #[error(transparent)]
    Copy(#[from] CopyError),
    /// An engine does not reconstruct every canonical tensor.
    #[error("engine {engine}: {got} of {want} canonical tensors reconstructed")]
    Reconstructed {
        /// the engine
        engine: u32,
        /// tensors reconstructed
        got: usize,
        /// tensors in the catalogue
        want: usize,
    },
    /// An engine's bytes do not round-trip for a canonical tensor.
    #[error("engine {engine}: `{canonical}` does not round-trip")]
    RoundTrip {
        /// the engine
        engine: u32,
        /// canonical tensor
        canonical: String,
    },
}

/// Every shard of each canonical tensor, per local tensor name, is disjoint from the others and
/// together they hold exactly the canonical tensor's elements.
pub fn holders_partition(side: &dyn SideLayout, cat: &Catalogue) -> Result<(), CheckError> {
    let dropped = side.dropped();
    // what the planner does: each tensor's holders written over the previous tensor's list
    let mut reused = Vec::new();
    for c in cat.tensors() {
        let holders = side.holders(&c.name);
        side.holders_into(&c.name, &mut reused);
        if reused != holders {
            let at = reused
                .iter()
                .zip(&holders)
                .take_while(|(a, b)| a == b)
                .count();
            return Err(CheckError::Holders(format!(
                "`{}`: holders_into over the previous tensor's holders gives {} holders where holders() gives {}, the first difference at holder {at}: {:?} against {:?}",
                c.name,
                reused.len(),
                holders.len(),
                reused.get(at),
                holders.get(at)
            )));
        }
        if holders.is_empty() && dropped.contains(&c.name) {
            // the engine's class holds no such parameter ([`SideLayout::dropped`])
            continue;
        }
        let mut by_tensor: HashMap<&str, Vec<Region>> = HashMap::new();
        for h in &holders {
            by_tensor.entry(&h.tensor).or_default().push(h.region);
        }
        if by_tensor.is_empty() {
            return Err(CheckError::NoHolder(c.name.clone()));
        }
        for (tensor, regions) in by_tensor {
            let total: u64 = regions.iter().map(Region::numel).sum();
            if total != c.numel() {
                return Err(CheckError::ShardTotal {
                    canonical: c.name.clone(),
                    tensor: tensor.to_string(),
                    held: total,
                    numel: c.numel(),
                });
            }
            for (i, a) in regions.iter().enumerate() {
                if let Some(b) = regions[i + 1..].iter().find(|b| a.intersect(b).is_some()) {
                    return Err(CheckError::Overlap {
                        canonical: c.name.clone(),
                        tensor: tensor.to_string(),
                        a: a.to_string(),
                        b: b.to_string(),
                    });
                }
            }
        }
    }
    Ok(())
}

/// Validates every rank, the holder index, coverage, the holders' partition, and that
/// materialize -> reconstruct gives back the canonical bytes for every engine (replica) alone.
pub fn side(side: &dyn SideLayout, cat: &Catalogue) -> Result<(), CheckError> {
    let ranks = side.ranks();
    if ranks.len() != side.world_size() {
        return Err(CheckError::RankCount {
            listed: ranks.len(),
            world: side.world_size(),
        });
    }
    let mut layouts: Vec<RankLayout> = Vec::with_capacity(ranks.len());
    for &r in &ranks {
        let l = side.rank_layout(r).ok_or(CheckError::NoLayout(r))?;
        validate_rank(&l, cat)?;
        layouts.push(l);
    }
    validate_holders(side, cat).map_err(CheckError::Holders)?;
    if let Some(g) = coverage(side, cat)?.into_iter().next() {
        return Err(CheckError::Gap(g));
    }
    holders_partition(side, cat)?;
    let canon: HashMap<&str, Vec<u8>> = cat
        .tensors()
        .iter()
        .filter_map(|c| {
            Some((
                c.name.as_str(),
                crate::weights::canonical_tensor(cat, &c.name, 11)?,
            ))
        })
        .collect();
    let get = |name: &str| canon.get(name).map(Vec::as_slice);
    // tensors the engine's class does not hold are in no rank ([`SideLayout::dropped`])
    let dropped = side.dropped();
    for engine in 0..side.engines() {
        let mine: Vec<RankLayout> = layouts
            .iter()
            .filter(|l| l.rank.engine == engine)
            .cloned()
            .collect();
        let buffers: Vec<Vec<Vec<u8>>> = mine
            .iter()
            .map(|l| materialize(l, cat, &get))
            .collect::<Result<_, _>>()?;
        let back = reconstruct(&mine, &buffers, cat)?;
        if back.len() + dropped.len() != cat.len() {
            return Err(CheckError::Reconstructed {
                engine,
                got: back.len(),
                want: cat.len() - dropped.len(),
            });
        }
        if let Some(c) = cat.tensors().iter().find(|c| {
            !dropped.contains(&c.name) && back.get(&c.name).map(Vec::as_slice) != get(&c.name)
        }) {
            return Err(CheckError::RoundTrip {
                engine,
                canonical: c.name.clone(),
            });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dtype::DType;
    use crate::layout::{ExplicitSide, Side};
    use crate::synthetic::{SyntheticSide, TensorSplit, catalogue};

    fn two_shards() -> (Catalogue, SyntheticSide) {
        let cat = catalogue(&[vec![8, 2]]);
        let s = SyntheticSide {
            side: Side::Inference,
            engines: 2,
            replicas: 1,
            shards: 2,
            splits: vec![TensorSplit {
                dim: 0,
                cuts: vec![3],
                pad: 1,
            }],
            dtype: DType::Bf16,
            fuse: false,
        };
        (cat, s)
    }

    #[test]
    fn a_good_side_passes_and_a_missing_shard_is_named() {
        let (cat, s) = two_shards();
        assert!(side(&s.build(&cat), &cat).is_ok());
        let layouts: Vec<_> = s
            .rank_layouts(&cat)
            .into_iter()
            .filter(|l| l.rank != crate::layout::RankId::infer(1, 1))
            .collect();
        let broken = ExplicitSide::new(Side::Inference, layouts);
        assert_eq!(
            side(&broken, &cat).unwrap_err().to_string(),
            "coverage gap: engine 1: [3..8, 0..2] of `t0` is held by no rank"
        );
    }

    #[test]
    fn an_empty_canonical_tensor_is_an_error_not_an_index_panic() {
        // a catalogue built from an unvalidated spec: `t1` has a zero dimension
        let cat = catalogue(&[vec![8, 2], vec![4, 0]]);
        let side = ExplicitSide::new(
            Side::Inference,
            vec![RankLayout {
                rank: crate::layout::RankId::infer(0, 0),
                tensors: Vec::new(),
            }],
        );
        let e = crate::layout::ops::coverage(&side, &cat).unwrap_err();
        assert_eq!(
            e.to_string(),
            "canonical tensor `t1` has shape [4, 0], with no elements (dimension 1 is 0); every tensor of a model needs at least one element along each dimension"
        );
        let mut cells = 0;
        let r = crate::layout::ops::grid_cells(&Region::new([0, 0], [0, 3]), &[], |_| cells += 1);
        assert_eq!(
            (r, cells),
            (Err(crate::layout::ops::EmptyExtent { dim: 0 }), 0)
        );
    }

    #[test]
    fn overlapping_shards_of_one_local_tensor_name_are_refused() {
        let (cat, mut s) = two_shards();
        s.engines = 1;
        let mut layouts = s.rank_layouts(&cat);
        // rank 1 claims rows 2..8 instead of 3..8 (one row held twice)
        let p = &mut layouts[1].tensors[0].placements[0];
        p.region = Region::new([2, 0], [6, 2]);
        layouts[1].tensors[0].shape = crate::layout::Dims::new(&[7, 2]);
        let e = holders_partition(&ExplicitSide::new(Side::Inference, layouts), &cat).unwrap_err();
        assert_eq!(
            e.to_string(),
            "`t0` in `local.t0`: shards hold 18 elements, the tensor has 16"
        );
    }
}

/// One run of consecutive canonical elements in a local tensor: `(local flat start, canonical
/// tensor, canonical flat start, length)`.
pub type ElementRun = (u64, String, u64, u64);

/// What one local tensor of a rank holds, element by element: its name, shape, dtype and the
/// maximal runs of canonical elements in it (ascending local start; what is not in a run is
/// padding). Engine tests record the same from the engines' own loads of a checkpoint whose
/// every element names itself, and compare.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LocalRuns {
    /// the local tensor
    pub name: String,
    /// its shape
    pub shape: Vec<u64>,
    /// its dtype
    pub dtype: crate::DType,
    /// its runs of canonical elements
    pub runs: Vec<ElementRun>,
}

/// [`LocalRuns`] of every local tensor of `l`, in the layout's order. A placement whose region
/// has fewer dims than its local tensor sits at the local offset's leading indices (one expert
/// of a stacked expert tensor).
pub fn element_runs(l: &RankLayout, cat: &Catalogue) -> Result<Vec<LocalRuns>, CheckError> {
    let strides = |shape: &[u64]| {
        let mut s = vec![1u64; shape.len()];
        for d in (0..shape.len().saturating_sub(1)).rev() {
            s[d] = s[d + 1] * shape[d + 1];
        }
        s
    };
    let mut out = Vec::new();
    for t in &l.tensors {
        let local = t.shape.as_slice().to_vec();
        let ls = strides(&local);
        let mut runs: Vec<ElementRun> = Vec::new();
        for p in &t.placements {
            let c = cat
                .get(&p.canonical)
                .ok_or_else(|| LayoutError::UnknownCanonical {
                    rank: l.rank,
                    tensor: t.name.to_string(),
                    canonical: p.canonical.to_string(),
                })?;
            let cs = strides(c.shape.as_slice());
            let (o, x, lo) = (
                p.region.offset.as_slice(),
                p.region.extent.as_slice(),
                p.local_offset.as_slice(),
            );
            let n = x.len();
            if n == 0 || lo.len() < n {
                continue;
            }
            let k = lo.len() - n;
            let base: u64 = (0..k).map(|d| lo[d] * ls[d]).sum();
            let rows: u64 = x[..n - 1].iter().product();
            for row in 0..rows {
                // the row's index over the leading dims
                let (mut rem, mut lf, mut cf) = (row, base + lo[k + n - 1], o[n - 1]);
                for d in (0..n - 1).rev() {
                    let i = rem % x[d];
                    rem /= x[d];
                    lf += (lo[k + d] + i) * ls[k + d];
                    cf += (o[d] + i) * cs[d];
                }
                runs.push((lf, p.canonical.to_string(), cf, x[n - 1]));
            }
        }
        runs.sort();
        let mut merged: Vec<ElementRun> = Vec::new();
        for r in runs {
            match merged.last_mut() {
                Some(m) if m.0 + m.3 == r.0 && m.1 == r.1 && m.2 + m.3 == r.2 => m.3 += r.3,
                _ => merged.push(r),
            }
        }
        out.push(LocalRuns {
            name: t.name.to_string(),
            shape: local,
            dtype: t.dtype,
            runs: merged,
        });
    }
    Ok(out)
}
