//! gpt-oss under FSDP2 at tp 1: transformers 5.19 holds exactly the checkpoint's tensors
//! (experts fused and transposed per layer, sinks, the router's bias a parameter), each
//! sharded on dim 0 over dp; every whole-side check; real FSDP2's shards element by element
//! (`tests/fixtures/gpt_oss_fsdp.json`); TP refused by name.

mod common;

use awex_core::DType;
use awex_core::backend::{Backend, ParallelConfig};
use awex_core::layout::{Dims, RankId, RankLayout, Region, SideLayout};
use awex_core::model::presets::preset;
use awex_core::model::{Catalogue, ModelSpec};
use awex_fsdp::FsdpBackend;
use serde_json::Value;
use std::sync::Arc;

fn side(pairs: &[(&str, u64)]) -> Arc<dyn SideLayout> {
    FsdpBackend
        .layout(
            &preset("gpt-oss-tiny").expect("preset"),
            &ParallelConfig::from_pairs(pairs.iter().copied()),
        )
        .unwrap_or_else(|e| panic!("{pairs:?}: {e}"))
}

#[test]
fn gpt_oss_round_trips_on_every_tp1_mesh() {
    let cat = Catalogue::of(&preset("gpt-oss-tiny").expect("preset"));
    for pairs in [
        &[("dp", 1)][..],
        &[("dp", 3)],
        &[("dp", 2), ("replicate", 2)],
        // the names are transformers' either way: the key changes nothing for gpt-oss
        &[("dp", 3), ("fused_experts", 1)],
    ] {
        common::check_side(side(pairs).as_ref(), &cat);
    }
    assert_eq!(
        side(&[("dp", 3), ("fused_experts", 1)])
            .rank_layout(RankId::train(1))
            .expect("rank"),
        side(&[("dp", 3)])
            .rank_layout(RankId::train(1))
            .expect("rank")
    );
}

/// The order and shapes `GptOssForCausalLM.named_parameters()` gives on one rank of dp 1
/// (transformers 5.19.0, the tiny config: `sinks` first, the module's own parameter), and
/// the expert tensors chunked by experts over dp 3 (8 experts: 3, 3, 2).
#[test]
fn parameters_come_in_transformers_order_and_experts_shard_over_dp() {
    let rl = side(&[("dp", 1)])
        .rank_layout(RankId::train(0))
        .expect("rank");
    let layer1: Vec<(&str, Vec<u64>)> = rl
        .tensors
        .iter()
        .filter(|t| t.name.starts_with("model.layers.1."))
        .map(|t| (&*t.name, t.shape.as_slice().to_vec()))
        .collect();
    let want: Vec<(&str, Vec<u64>)> = vec![
        ("model.layers.1.self_attn.sinks", vec![4]),
        ("model.layers.1.self_attn.q_proj.weight", vec![64, 64]),
        ("model.layers.1.self_attn.q_proj.bias", vec![64]),
        ("model.layers.1.self_attn.k_proj.weight", vec![32, 64]),
        ("model.layers.1.self_attn.k_proj.bias", vec![32]),
        ("model.layers.1.self_attn.v_proj.weight", vec![32, 64]),
        ("model.layers.1.self_attn.v_proj.bias", vec![32]),
        ("model.layers.1.self_attn.o_proj.weight", vec![64, 64]),
        ("model.layers.1.self_attn.o_proj.bias", vec![64]),
        ("model.layers.1.mlp.router.weight", vec![8, 64]),
        ("model.layers.1.mlp.router.bias", vec![8]),
        ("model.layers.1.mlp.experts.gate_up_proj", vec![8, 64, 96]),
        ("model.layers.1.mlp.experts.gate_up_proj_bias", vec![8, 96]),
        ("model.layers.1.mlp.experts.down_proj", vec![8, 48, 64]),
        ("model.layers.1.mlp.experts.down_proj_bias", vec![8, 64]),
        ("model.layers.1.input_layernorm.weight", vec![64]),
        ("model.layers.1.post_attention_layernorm.weight", vec![64]),
    ];
    assert_eq!(layer1, want);
    let s = side(&[("dp", 3)]);
    for (rank, e0, n) in [(0u32, 0u64, 3u64), (1, 3, 3), (2, 6, 2)] {
        let rl = s.rank_layout(RankId::train(rank)).expect("rank");
        let t = rl
            .tensor("model.layers.0.mlp.experts.gate_up_proj")
            .expect("gate_up_proj");
        assert_eq!(t.shape, Dims::new(&[n, 64, 96]), "rank {rank}");
        assert_eq!(t.placements.len(), 1);
        assert_eq!(
            t.placements[0].region,
            Region::new([e0, 0, 0], [n, 64, 96]),
            "rank {rank}"
        );
        // the router's bias is a parameter (sharded), not a buffer held whole
        let b = rl.tensor("model.layers.0.mlp.router.bias").expect("bias");
        assert_eq!(b.shape, Dims::new(&[n]), "rank {rank}");
    }
}

#[test]
fn tensor_parallel_gpt_oss_is_refused_by_name() {
    let e = FsdpBackend
        .layout(
            &preset("gpt-oss-tiny").expect("preset"),
            &ParallelConfig::from_pairs([("dp", 1), ("tp", 2)]),
        )
        .err()
        .expect("tp=2 accepted");
    let e = e.to_string();
    assert!(
        e.contains("fsdp tp=2: GptOssForCausalLM holds each layer's experts in one tensor"),
        "{e}"
    );
}

/// One run of consecutive canonical elements in a local tensor: (local start, canonical
/// tensor, canonical start, length).
type Run = awex_core::layout::check::ElementRun;

/// One parameter: name, shape, dtype and its runs.
type Param = (String, Vec<u64>, DType, Vec<Run>);

/// The maximal runs of canonical elements every local tensor of `l` holds
/// ([`awex_core::layout::check::element_runs`]).
fn layout_runs(l: &RankLayout, cat: &Catalogue) -> Vec<Param> {
    awex_core::layout::check::element_runs(l, cat)
        .unwrap()
        .into_iter()
        .map(|t| (t.name, t.shape, t.dtype, t.runs))
        .collect()
}

/// Real torch FSDP2 (`engines/tests/train/test_fsdp_gpt_oss.py`: transformers' own
/// `GptOssForCausalLM` from a checkpoint whose every element names itself, `fully_shard` per
/// layer and at the root, over gloo) at dp 2, dp 3 (an empty shard) and HSDP 2 x 2: awex's
/// layout holds on every rank the same parameters, in the same order, with the same shapes,
/// dtypes and canonical elements.
#[test]
fn awex_places_exactly_the_elements_real_fsdp2_holds() {
    let fixture: Value =
        serde_json::from_str(include_str!("fixtures/gpt_oss_fsdp.json")).expect("fixture");
    let mut runs_checked = 0;
    for case in fixture["cases"].as_array().expect("cases") {
        let spec = ModelSpec::from_config_value(&case["config"]).expect("config");
        let pairs: Vec<(String, u64)> = case["parallel"]
            .as_object()
            .expect("parallel")
            .iter()
            .map(|(k, v)| (k.clone(), v.as_u64().expect("size")))
            .collect();
        let side = FsdpBackend
            .layout(
                &spec,
                &ParallelConfig::from_pairs(pairs.iter().map(|(k, v)| (k.as_str(), *v))),
            )
            .expect("layout");
        let cat = Catalogue::of(&spec);
        let tensors: Vec<&str> = case["tensors"]
            .as_array()
            .expect("tensors")
            .iter()
            .map(|t| t.as_str().expect("name"))
            .collect();
        for (r, params) in case["ranks"].as_array().expect("ranks").iter().enumerate() {
            let ours = layout_runs(
                &side.rank_layout(RankId::train(r as u32)).expect("rank"),
                &cat,
            );
            let theirs: Vec<Param> = params
                .as_array()
                .expect("params")
                .iter()
                .map(|p| {
                    let runs = p[3]
                        .as_array()
                        .expect("runs")
                        .iter()
                        .map(|x| {
                            let n = |i: usize| x[i].as_u64().expect("int");
                            (n(0), tensors[n(1) as usize].to_string(), n(2), n(3))
                        })
                        .collect();
                    let shape = p[1].as_array().expect("shape").iter();
                    let dtype = match p[2].as_str() {
                        Some("float32") => DType::F32,
                        other => panic!("dtype {other:?}"),
                    };
                    (
                        p[0].as_str().expect("name").to_string(),
                        shape.map(|d| d.as_u64().expect("dim")).collect(),
                        dtype,
                        runs,
                    )
                })
                .collect();
            assert_eq!(ours.len(), theirs.len(), "{pairs:?} rank {r}");
            for (a, b) in ours.iter().zip(&theirs) {
                assert_eq!(a, b, "{pairs:?} rank {r}");
                runs_checked += a.3.len();
            }
        }
    }
    assert!(runs_checked > 300, "{runs_checked}");
}

/// A live gpt-oss model's names read as `fused_experts=1` (its experts are transformers' fused
/// `mlp.experts.gate_up_proj`): `Writer.attach` then asks for a pair connected with that key,
/// whose layout is the same as without it.
#[test]
fn live_names_read_as_fused_experts_which_lays_out_the_same() {
    use awex_core::backend::TrainingBackend;
    let rl = side(&[("dp", 2)])
        .rank_layout(RankId::train(0))
        .expect("rank");
    let names: Vec<&str> = rl.tensors.iter().map(|t| &*t.name).collect();
    assert_eq!(
        FsdpBackend.options_from_names(&names),
        [("fused_experts", 1)]
    );
    assert_eq!(
        side(&[("dp", 2), ("fused_experts", 1)])
            .rank_layout(RankId::train(0))
            .expect("rank"),
        rl
    );
}
