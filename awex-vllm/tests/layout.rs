//! vLLM 0.33.0's sharding rules, each pinned to exact placements and to the source it comes from
//! (paths relative to the `vllm/` package), plus whole-side checks over a matrix of configs.

mod common;

use awex_core::backend::{Backend, ParallelConfig, inference_backends};
use awex_core::layout::{Dims, LocalTensor, Placement, RankId, Region, SideLayout};
use awex_core::model::presets::preset;
use awex_core::model::{Architecture, Catalogue, ModelSpec};
use awex_vllm::{VllmBackend, VllmConfigError, VllmLayout, expert_range, padded_vocab};

fn tiny() -> ModelSpec {
    preset("qwen3-tiny").expect("preset")
}
fn moe_tiny() -> ModelSpec {
    preset("qwen3-moe-tiny").expect("preset")
}
fn tied(spec: ModelSpec) -> ModelSpec {
    ModelSpec {
        tie_word_embeddings: true,
        ..spec
    }
}

fn layout(spec: &ModelSpec, tp: u64, ep: u64, engines: u64) -> VllmLayout {
    VllmLayout::new(spec, tp, ep, engines).expect("valid config")
}

fn tensor(side: &VllmLayout, engine: u32, rank: u32, name: &str) -> LocalTensor {
    side.rank_layout(RankId::infer(engine, rank))
        .expect("rank exists")
        .tensor(name)
        .unwrap_or_else(|| panic!("rank {engine}/{rank} has no `{name}`"))
        .clone()
}

fn names(side: &VllmLayout, rank: u32) -> Vec<String> {
    side.rank_layout(RankId::infer(0, rank))
        .expect("rank")
        .tensors
        .iter()
        .map(|t| t.name.to_string())
        .collect()
}

fn place(canonical: &str, offset: &[u64], extent: &[u64], at: &[u64]) -> Placement {
    Placement {
        canonical: canonical.into(),
        region: Region::new(Dims::new(offset), Dims::new(extent)),
        local_offset: Dims::new(at),
        transposed: false,
    }
}

const L0: &str = "model.layers.0";
const L1: &str = "model.layers.1";

/// `QKVParallelLinear` (`model_executor/layers/linear.py`): `[q | k | v]` rows of the rank's heads.
#[test]
fn qkv_proj_concatenates_the_ranks_q_k_v_heads() {
    let side = layout(&tiny(), 2, 1, 1);
    let t = tensor(&side, 0, 1, &format!("{L0}.self_attn.qkv_proj.weight"));
    assert_eq!(t.shape, Dims::new(&[64, 64]));
    assert_eq!(
        t.placements,
        vec![
            place(
                &format!("{L0}.self_attn.q_proj.weight"),
                &[32, 0],
                &[32, 64],
                &[0, 0]
            ),
            place(
                &format!("{L0}.self_attn.k_proj.weight"),
                &[16, 0],
                &[16, 64],
                &[32, 0]
            ),
            place(
                &format!("{L0}.self_attn.v_proj.weight"),
                &[16, 0],
                &[16, 64],
                &[48, 0]
            ),
        ]
    );
}

/// `tp_size >= total_num_kv_heads`: one KV head per rank, `num_kv_head_replicas = tp / kv`,
/// rank `r` loads head `r // num_kv_head_replicas` (`QKVParallelLinear.weight_loader`).
#[test]
fn kv_heads_are_replicated_when_tp_exceeds_them() {
    let side = layout(&tiny(), 4, 1, 1);
    for r in 0..4u32 {
        let t = tensor(&side, 0, r, &format!("{L0}.self_attn.qkv_proj.weight"));
        let head = u64::from(r / 2);
        assert_eq!(t.shape, Dims::new(&[48, 64]));
        assert_eq!(
            t.placements[1],
            place(
                &format!("{L0}.self_attn.k_proj.weight"),
                &[head * 16, 0],
                &[16, 64],
                &[16, 0]
            )
        );
        assert_eq!(
            t.placements[2],
            place(
                &format!("{L0}.self_attn.v_proj.weight"),
                &[head * 16, 0],
                &[16, 64],
                &[32, 0]
            )
        );
    }
    let holders = side.holders(&format!("{L0}.self_attn.k_proj.weight"));
    assert_eq!(holders.len(), 2, "two distinct KV shards");
    assert_eq!(
        holders[0].ranks,
        vec![RankId::infer(0, 0), RankId::infer(0, 1)]
    );
}

/// `MergedColumnParallelLinear` `[gate | up]`, `RowParallelLinear` columns for o/down_proj.
#[test]
fn gate_up_is_column_parallel_and_o_down_are_row_parallel() {
    let side = layout(&tiny(), 2, 1, 1);
    let gu = tensor(&side, 0, 1, &format!("{L0}.mlp.gate_up_proj.weight"));
    assert_eq!(gu.shape, Dims::new(&[128, 64]));
    assert_eq!(
        gu.placements,
        vec![
            place(
                &format!("{L0}.mlp.gate_proj.weight"),
                &[64, 0],
                &[64, 64],
                &[0, 0]
            ),
            place(
                &format!("{L0}.mlp.up_proj.weight"),
                &[64, 0],
                &[64, 64],
                &[64, 0]
            ),
        ]
    );
    let down = tensor(&side, 0, 1, &format!("{L0}.mlp.down_proj.weight"));
    assert_eq!(
        down.placements,
        vec![place(
            &format!("{L0}.mlp.down_proj.weight"),
            &[0, 64],
            &[64, 64],
            &[0, 0]
        )]
    );
    let o = tensor(&side, 0, 1, &format!("{L0}.self_attn.o_proj.weight"));
    assert_eq!(
        o.placements,
        vec![place(
            &format!("{L0}.self_attn.o_proj.weight"),
            &[0, 32],
            &[64, 32],
            &[0, 0]
        )]
    );
}

/// `pad_vocab_size` (multiple of 64) then `divide(num_embeddings_padded, tp)`
/// (`model_executor/layers/vocab_parallel_embedding.py`): 1000 -> 1024 rows, 512 per rank at tp=2,
/// the last rank's 488 real rows at local row 0 and padding after them.
#[test]
fn vocab_is_padded_to_64_then_split_over_tp() {
    assert_eq!(padded_vocab(1000), 1024);
    assert_eq!(padded_vocab(151936), 151936);
    assert_eq!(padded_vocab(64), 64);
    let side = layout(&tiny(), 2, 1, 1);
    assert_eq!(side.vocab_rows_per_rank(), 512);
    for name in ["model.embed_tokens.weight", "lm_head.weight"] {
        let t = tensor(&side, 0, 1, name);
        assert_eq!(t.shape, Dims::new(&[512, 64]));
        assert_eq!(
            t.placements,
            vec![place(name, &[512, 0], &[488, 64], &[0, 0])]
        );
    }
}

/// No `64 * tp` fallback as in SGLang: a padded vocabulary that does not divide by tp is refused
/// (vLLM's `divide` asserts).
#[test]
fn a_padded_vocab_that_does_not_split_over_tp_is_refused() {
    let spec = ModelSpec {
        num_heads: 6,
        num_kv_heads: 3,
        intermediate_size: 192,
        ..tiny()
    };
    assert_eq!(
        VllmLayout::new(&spec, 6, 1, 1).unwrap_err(),
        VllmConfigError::Vocab {
            vocab: 1000,
            padded: 1024,
            tp: 6
        }
    );
    let spec = ModelSpec {
        vocab_size: 1152,
        ..spec
    };
    common::check_side(&layout(&spec, 6, 1, 2), &Catalogue::of(&spec));
}

/// `ParallelLMHead.tie_weights` assigns `embed_tokens.weight` itself: `named_parameters()` lists
/// it once, for the dense (`models/qwen3.py`) and the MoE class (`models/qwen3_moe.py`) alike.
#[test]
fn tied_embeddings_appear_once_dense_and_moe() {
    for spec in [tied(tiny()), tied(moe_tiny())] {
        let side = layout(&spec, 2, 1, 1);
        let n = names(&side, 0);
        assert!(!n.iter().any(|x| x == "lm_head.weight"), "{}", spec.name);
        assert_eq!(side.holders("model.embed_tokens.weight").len(), 2);
        assert!(side.holders("lm_head.weight").is_empty());
    }
    assert!(
        names(&layout(&moe_tiny(), 2, 1, 1), 0)
            .iter()
            .any(|x| x == "lm_head.weight")
    );
}

/// Without expert parallelism every rank holds every expert, the intermediate split over tp
/// (`FusedMoEParallelConfig.make`, `model_executor/layers/fused_moe/config.py`; shapes from
/// `UnquantizedFusedMoEMethod.create_weights`).
#[test]
fn experts_split_over_tp_without_ep() {
    let side = layout(&moe_tiny(), 2, 1, 1);
    let w13 = tensor(
        &side,
        0,
        1,
        &format!("{L1}.mlp.experts.routed_experts.w13_weight"),
    );
    assert_eq!(w13.shape, Dims::new(&[8, 32, 64]));
    assert_eq!(
        w13.placements[0],
        place(
            &format!("{L1}.mlp.experts.0.gate_proj.weight"),
            &[16, 0],
            &[16, 64],
            &[0, 0, 0]
        )
    );
    assert_eq!(
        w13.placements[1],
        place(
            &format!("{L1}.mlp.experts.0.up_proj.weight"),
            &[16, 0],
            &[16, 64],
            &[0, 16, 0]
        )
    );
    let w2 = tensor(
        &side,
        0,
        1,
        &format!("{L1}.mlp.experts.routed_experts.w2_weight"),
    );
    assert_eq!(w2.shape, Dims::new(&[8, 64, 16]));
    assert_eq!(
        w2.placements[7],
        place(
            &format!("{L1}.mlp.experts.7.down_proj.weight"),
            &[0, 16],
            &[64, 16],
            &[7, 0, 0]
        )
    );
    // the router is replicated, layer 0 (mlp_only_layers) stays dense
    assert_eq!(
        tensor(&side, 0, 0, &format!("{L1}.mlp.gate.weight")).shape,
        Dims::new(&[8, 64])
    );
    assert!(
        names(&side, 0)
            .iter()
            .any(|x| x == &format!("{L0}.mlp.gate_up_proj.weight"))
    );
}

/// `--enable-expert-parallel`: `ep_size = tp`, experts' tp 1, `linear` placement of
/// `determine_expert_map` (`model_executor/layers/fused_moe/expert_map_manager.py`).
#[test]
fn expert_parallel_gives_each_rank_whole_consecutive_experts() {
    let side = layout(&moe_tiny(), 4, 4, 1);
    let w13 = tensor(
        &side,
        0,
        2,
        &format!("{L1}.mlp.experts.routed_experts.w13_weight"),
    );
    assert_eq!(w13.shape, Dims::new(&[2, 64, 64]));
    assert_eq!(
        w13.placements[0],
        place(
            &format!("{L1}.mlp.experts.4.gate_proj.weight"),
            &[0, 0],
            &[32, 64],
            &[0, 0, 0]
        )
    );
    assert_eq!(
        w13.placements[3],
        place(
            &format!("{L1}.mlp.experts.5.up_proj.weight"),
            &[0, 0],
            &[32, 64],
            &[1, 32, 0]
        )
    );
    // uneven: 8 experts over 3 ranks -> 3, 3, 2 (remainder to the first ranks)
    assert_eq!(
        (0..3).map(|r| expert_range(8, 3, r)).collect::<Vec<_>>(),
        vec![(0, 3), (3, 3), (6, 2)]
    );
    assert_eq!(expert_range(8, 1, 0), (0, 8));
}

#[test]
fn uneven_expert_parallel_round_trips() {
    let spec = ModelSpec {
        num_heads: 6,
        num_kv_heads: 3,
        intermediate_size: 192,
        vocab_size: 1152,
        ..moe_tiny()
    };
    let side = layout(&spec, 3, 3, 2);
    assert_eq!(
        tensor(
            &side,
            1,
            2,
            &format!("{L1}.mlp.experts.routed_experts.w2_weight")
        )
        .shape,
        Dims::new(&[2, 64, 32])
    );
    common::check_side(&side, &Catalogue::of(&spec));
}

/// vLLM's expert parallelism is the whole TP group (`ep_size = tp_size`) or nothing.
#[test]
fn ep_must_be_one_or_tp() {
    assert_eq!(
        VllmLayout::new(&moe_tiny(), 4, 2, 1).unwrap_err(),
        VllmConfigError::EpNotTp { tp: 4, ep: 2 }
    );
    let few = ModelSpec {
        moe: moe_tiny().moe.map(|m| awex_core::model::MoeSpec {
            num_experts: 2,
            ..m
        }),
        ..moe_tiny()
    };
    assert_eq!(
        VllmLayout::new(&few, 4, 4, 1).unwrap_err(),
        VllmConfigError::Experts { experts: 2, ep: 4 }
    );
}

#[test]
fn every_model_and_config_round_trips() {
    let bias = ModelSpec {
        name: "qwen2-bias-tiny".into(),
        architecture: Architecture::Qwen2,
        attention_bias: true,
        ..tiny()
    };
    let dense = [tiny(), tied(tiny()), bias];
    let moe = [moe_tiny(), tied(moe_tiny())];
    for spec in &dense {
        for (tp, engines) in [(1, 1), (2, 1), (4, 1), (2, 2), (4, 2)] {
            common::check_side(&layout(spec, tp, 1, engines), &Catalogue::of(spec));
        }
    }
    for spec in &moe {
        for (tp, ep, engines) in [(1, 1, 1), (2, 1, 1), (2, 2, 2), (4, 1, 1), (4, 4, 2)] {
            common::check_side(&layout(spec, tp, ep, engines), &Catalogue::of(spec));
        }
    }
}

#[test]
fn the_backend_is_registered_and_lays_out_through_the_trait() {
    let _ = awex_vllm::CRATE;
    assert!(inference_backends().iter().any(|b| b.name() == "vllm"));
    let side = VllmBackend
        .layout(
            &tiny(),
            &ParallelConfig::from_pairs([("tp", 2), ("engines", 2)]),
        )
        .expect("layout");
    assert_eq!(side.world_size(), 4);
    assert!(
        VllmBackend
            .layout(&tiny(), &ParallelConfig::from_pairs([("dp", 2)]))
            .is_err()
    );
}
