//! `SideLayout::for_each_canonical`: a layout that names a rank's canonical tensors without
//! building the rank names exactly those its `rank_layout` places.

use awex_core::backend::side_layout;
use awex_core::encoding::Encoding;
use awex_core::layout::{RankId, Side, SideLayout};
use awex_core::{BackendSpec, ModelSpec};
use std::collections::BTreeSet;

mod common;

/// What the trait's default names: the canonical tensor of every placement of the rank's
/// tensors (FP8 scales, placed by no canonical tensor of their own, left out).
fn placed(l: &dyn SideLayout, r: RankId) -> BTreeSet<String> {
    let rank = l.rank_layout(r).expect("a rank of the layout");
    rank.tensors
        .iter()
        .filter(|t| !matches!(t.encoding, Encoding::Fp8Scales(_)))
        .flat_map(|t| t.placements.iter().map(|p| p.canonical.to_string()))
        .collect()
}

#[test]
fn an_fsdp_rank_names_the_canonical_tensors_its_layout_places() {
    std::hint::black_box(awex_fsdp::CRATE);
    let specs = [
        "fsdp:dp=4",
        "fsdp:dp=3,replicate=2",
        "fsdp:dp=2,tp=2",
        "fsdp:dp=5,fused_experts=1",
        "fsdp:dp=64,fused_experts=1",
        "fsdp:dp=4,replicate=2,fused_experts=1",
    ];
    let mut checked = 0;
    for name in common::TINY_FAMILIES {
        let model = ModelSpec::resolve(name).unwrap();
        for spec in specs {
            let bs: BackendSpec = spec.parse().unwrap();
            // (a layout a family refuses is not one to check)
            let Ok(l) = side_layout(Side::Training, &bs, &model) else {
                continue;
            };
            for r in l.ranks() {
                let mut named = BTreeSet::new();
                assert!(l.for_each_canonical(r, &mut |c| {
                    named.insert(c.to_string());
                }));
                assert_eq!(named, placed(&*l, r), "{name} {spec} rank {r}");
                checked += 1;
            }
            assert!(!l.for_each_canonical(RankId::train(l.ranks().len() as u32), &mut |_| {}));
        }
    }
    assert!(checked > 300, "{checked} ranks checked");
}
