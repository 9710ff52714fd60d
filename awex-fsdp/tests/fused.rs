//! transformers 5's fused MoE experts under FSDP2 (`fused_experts=1`): per layer one
//! `mlp.experts.gate_up_proj` `[E, 2I, H]` (expert e: gate rows, then up rows) and one
//! `mlp.experts.down_proj` `[E, H, I]`, sharded on the expert dim with `torch.chunk` semantics.

mod common;

use awex_core::backend::{Backend, ParallelConfig};
use awex_core::layout::{Dims, Placement, RankId, Region, SideLayout};
use awex_core::model::Catalogue;
use awex_core::model::presets::preset;
use awex_fsdp::FsdpBackend;
use std::sync::Arc;

fn side(pairs: &[(&str, u64)]) -> Arc<dyn SideLayout> {
    FsdpBackend
        .layout(
            &preset("qwen3-moe-tiny").expect("preset"),
            &ParallelConfig::from_pairs(pairs.iter().copied()),
        )
        .expect("layout")
}

fn p(canonical: &str, extent: &[u64], local: &[u64]) -> Placement {
    Placement {
        canonical: Arc::from(canonical),
        region: Region::new(Dims::zeros(extent.len()), Dims::new(extent)),
        local_offset: Dims::new(local),
        transposed: false,
    }
}

#[test]
fn fused_experts_are_chunked_on_the_expert_dim_over_dp() {
    // 8 experts over dp=3: torch.chunk gives 3, 3, 2
    let s = side(&[("dp", 3), ("fused_experts", 1)]);
    for (r, n, first) in [(0u32, 3u64, 0u64), (1, 3, 3), (2, 2, 6)] {
        let rl = s.rank_layout(RankId::train(r)).expect("rank");
        let gu = rl
            .tensors
            .iter()
            .find(|t| &*t.name == "model.layers.1.mlp.experts.gate_up_proj")
            .expect("gate_up_proj");
        assert_eq!(gu.shape, Dims::new(&[n, 64, 64]));
        assert_eq!(gu.placements.len() as u64, 2 * n);
        assert_eq!(
            gu.placements[2..4],
            [
                p(
                    &format!("model.layers.1.mlp.experts.{}.gate_proj.weight", first + 1),
                    &[32, 64],
                    &[1, 0, 0]
                ),
                p(
                    &format!("model.layers.1.mlp.experts.{}.up_proj.weight", first + 1),
                    &[32, 64],
                    &[1, 32, 0]
                ),
            ]
        );
        let down = rl
            .tensors
            .iter()
            .find(|t| &*t.name == "model.layers.1.mlp.experts.down_proj")
            .expect("down_proj");
        assert_eq!(down.shape, Dims::new(&[n, 64, 32]));
        assert_eq!(
            down.placements[0],
            p(
                &format!("model.layers.1.mlp.experts.{first}.down_proj.weight"),
                &[64, 32],
                &[0, 0, 0]
            )
        );
        // no per-expert names, and experts come before the router as transformers 5 registers them
        let names: Vec<&str> = rl.tensors.iter().map(|t| &*t.name).collect();
        assert!(!names.iter().any(|n| n.contains("experts.0.")));
        let at = |n: &str| names.iter().position(|x| *x == n).expect(n);
        assert_eq!(
            at("model.layers.1.mlp.experts.down_proj") + 1,
            at("model.layers.1.mlp.gate.weight")
        );
        // the dense layer 0 (mlp_only_layers) keeps its plain MLP
        assert!(names.contains(&"model.layers.0.mlp.gate_proj.weight"));
    }
}

#[test]
fn fused_holders_name_the_rank_that_holds_each_expert() {
    let s = side(&[("dp", 3), ("replicate", 2), ("fused_experts", 1)]);
    let h = s.holders("model.layers.2.mlp.experts.7.up_proj.weight");
    assert_eq!(h.len(), 1);
    // expert 7 is local expert 1 of dp rank 2; replicate groups 0 and 1 hold it (ranks 2 and 5)
    assert_eq!(h[0].ranks, vec![RankId::train(2), RankId::train(5)]);
    assert_eq!(&*h[0].tensor, "model.layers.2.mlp.experts.gate_up_proj");
    assert_eq!(h[0].tensor_shape, Dims::new(&[2, 64, 64]));
    assert_eq!(h[0].local_offset, Dims::new(&[1, 32, 0]));
}

#[test]
fn fused_layouts_validate_and_round_trip() {
    let model = preset("qwen3-moe-tiny").expect("preset");
    let cat = Catalogue::of(&model);
    for (dp, rep) in [(1, 1), (2, 1), (3, 1), (5, 1), (9, 1), (2, 2)] {
        let s = side(&[("dp", dp), ("replicate", rep), ("fused_experts", 1)]);
        common::check_side(s.as_ref(), &cat);
    }
}

#[test]
fn fused_experts_refuse_tp_and_bad_values() {
    let model = preset("qwen3-moe-tiny").expect("preset");
    let err = |pairs: &[(&str, u64)]| match FsdpBackend
        .layout(&model, &ParallelConfig::from_pairs(pairs.iter().copied()))
    {
        Ok(_) => panic!("{pairs:?} accepted"),
        Err(e) => e.to_string(),
    };
    assert!(
        err(&[("tp", 2), ("fused_experts", 1)]).contains(
            "fsdp fused_experts=1 with tp=2: awex describes transformers' fused expert tensors sharded over dp only"
        )
    );
    assert!(err(&[("fused_experts", 2)]).contains("fsdp fused_experts=2; use fused_experts=1"));
}

/// The names rank 0 of an `fsdp:` config holds.
fn names_of(model: &str, pairs: &[(&str, u64)]) -> Vec<String> {
    let s = FsdpBackend
        .layout(
            &preset(model).expect("preset"),
            &ParallelConfig::from_pairs(pairs.iter().copied()),
        )
        .expect("layout");
    let rl = s.rank_layout(RankId::train(0)).expect("rank");
    rl.tensors.iter().map(|t| t.name.to_string()).collect()
}

#[test]
fn options_from_names_find_fused_experts_in_the_names_the_layout_gives() {
    use awex_core::backend::TrainingBackend;
    let options = |names: &[String]| {
        FsdpBackend.options_from_names(&names.iter().map(String::as_str).collect::<Vec<_>>())
    };
    let fused = names_of("qwen3-moe-tiny", &[("dp", 2), ("fused_experts", 1)]);
    assert_eq!(options(&fused), [("fused_experts", 1)]);
    // transformers 4's per-expert names and a dense model say nothing
    assert!(options(&names_of("qwen3-moe-tiny", &[("dp", 2)])).is_empty());
    assert!(options(&names_of("qwen3-tiny", &[("dp", 2)])).is_empty());
    // the wrappers torch.compile and FSDP1 put in front of the layer do not hide it
    let wrapped: Vec<String> = fused.iter().map(|n| format!("_orig_mod.{n}")).collect();
    assert_eq!(options(&wrapped), [("fused_experts", 1)]);
    // a name that only ends like it is not it
    let near = ["model.layers.0.moe_mlp.experts.gate_up_proj".to_string()];
    assert!(options(&near).is_empty());
}

#[test]
fn holders_written_over_a_used_list_are_the_holders() {
    // the planner hands each tensor's holder list to the next tensor: holders of other counts,
    // names, shapes and rank lists (replicas, TP groups, buffers, fused experts) are written over
    for (model, pairs) in [
        (
            "qwen3-moe-tiny",
            &[("dp", 3), ("replicate", 2), ("fused_experts", 1)][..],
        ),
        (
            "qwen3-moe-tiny",
            &[("dp", 2), ("replicate", 2), ("tp", 2)][..],
        ),
        ("qwen3-tiny", &[("dp", 5), ("tp", 2)][..]),
        // (the router's score-correction bias: a buffer every rank holds whole)
        ("glm-4.5-tiny", &[("dp", 3), ("fused_experts", 1)][..]),
        ("gpt-oss-tiny", &[("dp", 3), ("replicate", 2)][..]),
        ("qwen3.5-moe-tiny", &[("dp", 4), ("fused_experts", 1)][..]),
    ] {
        let spec = preset(model).expect("preset");
        let s = FsdpBackend
            .layout(&spec, &ParallelConfig::from_pairs(pairs.iter().copied()))
            .expect("layout");
        let cat = Catalogue::of(&spec);
        let names: Vec<&str> = cat.tensors().iter().map(|c| c.name.as_str()).collect();
        let mut list = Vec::new();
        let mut seen = 0;
        for name in names
            .iter()
            .chain(names.iter().rev())
            .chain(["no.such.tensor"].iter())
        {
            s.holders_into(name, &mut list);
            assert_eq!(list, s.holders(name), "{model} {pairs:?}: `{name}`");
            seen += list.len();
        }
        assert!(seen > 2 * names.len(), "{model} {pairs:?}: {seen} holders");
    }
}
