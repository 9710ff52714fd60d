//! Whole-side checks any backend's layout must pass (used by backend tests and the conformance suite).
//!
//! They build every rank's layout, so they are for test-sized worlds.

use super::{
    RankLayout, Region, SideLayout, coverage, materialize, reconstruct, validate_holders,
    validate_rank,
};
use crate::model::Catalogue;
use std::collections::HashMap;

/// Every shard of each canonical tensor, per local tensor name, is disjoint from the others and
/// together they hold exactly the canonical tensor's elements.
pub fn holders_partition(side: &dyn SideLayout, cat: &Catalogue) -> Result<(), String> {
    for c in cat.tensors() {
        let holders = side.holders(&c.name);
        let mut by_tensor: HashMap<&str, Vec<Region>> = HashMap::new();
        for h in &holders {
            by_tensor.entry(&h.tensor).or_default().push(h.region);
        }
        if by_tensor.is_empty() {
            return Err(format!("`{}` has no holder", c.name));
        }
        for (tensor, regions) in by_tensor {
            let total: u64 = regions.iter().map(Region::numel).sum();
            if total != c.numel() {
                return Err(format!(
                    "`{}` in `{tensor}`: shards hold {total} elements, the tensor has {}",
                    c.name,
                    c.numel()
                ));
            }
            for (i, a) in regions.iter().enumerate() {
                if let Some(b) = regions[i + 1..].iter().find(|b| a.intersect(b).is_some()) {
                    return Err(format!("`{}` in `{tensor}`: {a} and {b} overlap", c.name));
                }
            }
        }
    }
    Ok(())
}

/// Validates every rank, the holder index, coverage, the holders' partition, and that
/// materialize -> reconstruct gives back the canonical bytes for every engine (replica) alone.
pub fn side(side: &dyn SideLayout, cat: &Catalogue) -> Result<(), String> {
    let ranks = side.ranks();
    if ranks.len() != side.world_size() {
        return Err(format!(
            "{} ranks listed, world size {}",
            ranks.len(),
            side.world_size()
        ));
    }
    let mut layouts: Vec<RankLayout> = Vec::with_capacity(ranks.len());
    for &r in &ranks {
        let l = side
            .rank_layout(r)
            .ok_or_else(|| format!("listed rank {r} has no layout"))?;
        validate_rank(&l, cat).map_err(|e| e.to_string())?;
        layouts.push(l);
    }
    validate_holders(side, cat)?;
    if let Some(g) = coverage(side, cat).first() {
        return Err(format!("coverage gap: {g}"));
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
    for engine in 0..side.engines() {
        let mine: Vec<RankLayout> = layouts
            .iter()
            .filter(|l| l.rank.engine == engine)
            .cloned()
            .collect();
        let buffers: Vec<Vec<Vec<u8>>> = mine
            .iter()
            .map(|l| materialize(l, cat, &get).map_err(|e| e.to_string()))
            .collect::<Result<_, _>>()?;
        let back = reconstruct(&mine, &buffers, cat).map_err(|e| e.to_string())?;
        if back.len() != cat.len() {
            return Err(format!(
                "engine {engine}: {} of {} canonical tensors reconstructed",
                back.len(),
                cat.len()
            ));
        }
        if let Some(c) = cat
            .tensors()
            .iter()
            .find(|c| back.get(&c.name).map(Vec::as_slice) != get(&c.name))
        {
            return Err(format!("engine {engine}: `{}` does not round-trip", c.name));
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
        assert_eq!(side(&s.build(&cat), &cat), Ok(()));
        let layouts: Vec<_> = s
            .rank_layouts(&cat)
            .into_iter()
            .filter(|l| l.rank != crate::layout::RankId::infer(1, 1))
            .collect();
        let broken = ExplicitSide::new(Side::Inference, layouts);
        assert_eq!(
            side(&broken, &cat),
            Err("coverage gap: engine 1: [3..8, 0..2] of `t0` is held by no rank".into())
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
            e,
            "`t0` in `local.t0`: shards hold 18 elements, the tensor has 16"
        );
    }
}
