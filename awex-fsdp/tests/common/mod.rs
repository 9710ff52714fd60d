//! Shared checks for layout tests: validation, holder agreement, coverage, and byte round trips.

#![allow(dead_code)]

use awex_core::layout::{
    RankLayout, Region, SideLayout, coverage, materialize, reconstruct, validate_holders,
    validate_rank,
};
use awex_core::model::Catalogue;
use std::collections::HashMap;

/// Deterministic pseudo-random bytes for every canonical tensor (xorshift seeded by name and index).
pub fn canonical_bytes(cat: &Catalogue) -> HashMap<String, Vec<u8>> {
    cat.tensors()
        .iter()
        .enumerate()
        .map(|(i, t)| {
            let mut s: u64 = 0x9e37_79b9_7f4a_7c15 ^ (i as u64).wrapping_mul(0x2545_f491_4f6c_dd1d);
            for b in t.name.bytes() {
                s = (s ^ u64::from(b)).wrapping_mul(0x1000_0000_01b3);
            }
            let bytes = (0..t.nbytes())
                .map(|_| {
                    s ^= s << 13;
                    s ^= s >> 7;
                    s ^= s << 17;
                    (s >> 24) as u8
                })
                .collect();
            (t.name.clone(), bytes)
        })
        .collect()
}

/// Every shard of each canonical tensor, per local tensor name, is disjoint from the others and
/// together they hold exactly the canonical tensor's elements.
pub fn check_holders_partition(side: &dyn SideLayout, cat: &Catalogue) {
    for c in cat.tensors() {
        let holders = side.holders(&c.name);
        let mut by_tensor: HashMap<&str, Vec<Region>> = HashMap::new();
        for h in &holders {
            by_tensor.entry(&h.tensor).or_default().push(h.region);
        }
        assert!(!by_tensor.is_empty(), "`{}` has no holder", c.name);
        for (tensor, regions) in by_tensor {
            let total: u64 = regions.iter().map(Region::numel).sum();
            assert_eq!(total, c.numel(), "`{}` in `{tensor}`: shard sizes", c.name);
            for (i, a) in regions.iter().enumerate() {
                for b in &regions[i + 1..] {
                    assert_eq!(
                        a.intersect(b),
                        None,
                        "`{}` in `{tensor}`: {a} and {b} overlap",
                        c.name
                    );
                }
            }
        }
    }
}

/// Validates every rank, the holder index, coverage, and that materialize -> reconstruct gives
/// back the canonical bytes for every engine (replica) on its own.
pub fn check_side(side: &dyn SideLayout, cat: &Catalogue) {
    let ranks = side.ranks();
    assert_eq!(ranks.len(), side.world_size());
    let layouts: Vec<RankLayout> = ranks
        .iter()
        .map(|&r| side.rank_layout(r).expect("every listed rank has a layout"))
        .collect();
    for l in &layouts {
        validate_rank(l, cat).unwrap_or_else(|e| panic!("{e}"));
    }
    validate_holders(side, cat).unwrap_or_else(|e| panic!("{e}"));
    let gaps = coverage(side, cat);
    assert!(gaps.is_empty(), "coverage gaps: {:?}", gaps);
    check_holders_partition(side, cat);

    let canon = canonical_bytes(cat);
    let get = |name: &str| canon.get(name).map(Vec::as_slice);
    for engine in 0..side.engines() {
        let mine: Vec<RankLayout> = layouts
            .iter()
            .filter(|l| l.rank.engine == engine)
            .cloned()
            .collect();
        let buffers: Vec<Vec<Vec<u8>>> = mine
            .iter()
            .map(|l| materialize(l, cat, &get).expect("materialize"))
            .collect();
        for (l, bufs) in mine.iter().zip(&buffers) {
            for (t, b) in l.tensors.iter().zip(bufs) {
                assert_eq!(
                    b.len() as u64,
                    t.nbytes(),
                    "{}: buffer of {}",
                    l.rank,
                    t.name
                );
            }
        }
        let back = reconstruct(&mine, &buffers, cat).expect("reconstruct");
        assert_eq!(
            back.len(),
            cat.len(),
            "engine {engine}: reconstructed tensor count"
        );
        for c in cat.tensors() {
            assert!(
                back.get(&c.name) == canon.get(&c.name),
                "engine {engine}: `{}` does not round-trip",
                c.name
            );
        }
    }
}
