//! Exact FSDP2 placements: torch.chunk row shards (uneven and empty), HSDP replicas, FSDP + TP
//! colwise / rowwise splits, tied embeddings, HF names, and refused configs.

use awex_core::DType;
use awex_core::backend::Backend;
use awex_core::backend::{ParallelConfig, training_backends};
use awex_core::layout::{Dims, Holder, LocalTensor, Placement, RankId, Region, SideLayout};
use awex_core::model::presets::preset;
use awex_core::model::{Architecture, Catalogue, ModelSpec};
use awex_fsdp::{FsdpBackend, FsdpLayout, chunk};

fn tiny() -> ModelSpec {
    preset("qwen3-tiny").expect("preset")
}

fn layout(spec: &ModelSpec, dp: u64, replicate: u64, tp: u64) -> FsdpLayout {
    FsdpLayout::new(spec, dp, replicate, tp).expect("valid config")
}

fn tensor(side: &FsdpLayout, rank: u32, name: &str) -> LocalTensor {
    side.rank_layout(RankId::train(rank))
        .expect("rank exists")
        .tensor(name)
        .unwrap_or_else(|| panic!("rank {rank} has no `{name}`"))
        .clone()
}

fn place(canonical: &str, offset: &[u64], extent: &[u64]) -> Vec<Placement> {
    vec![Placement {
        canonical: canonical.into(),
        region: Region::new(Dims::new(offset), Dims::new(extent)),
        local_offset: Dims::zeros(offset.len()),
        transposed: false,
    }]
}

fn train(ranks: &[u32]) -> Vec<RankId> {
    ranks.iter().map(|&r| RankId::train(r)).collect()
}

const EMBED: &str = "model.embed_tokens.weight";

#[test]
fn chunk_follows_torch_chunk() {
    assert_eq!(
        (0..3).map(|i| chunk(1000, 3, i)).collect::<Vec<_>>(),
        vec![(0, 334), (334, 334), (668, 332)]
    );
    assert_eq!(
        (0..4).map(|i| chunk(2, 4, i)).collect::<Vec<_>>(),
        vec![(0, 1), (1, 1), (2, 0), (2, 0)]
    );
    // torch.chunk(5 rows, 4) gives 3 chunks of 2, 2, 1: the fourth rank holds nothing
    assert_eq!(
        (0..4).map(|i| chunk(5, 4, i)).collect::<Vec<_>>(),
        vec![(0, 2), (2, 2), (4, 1), (5, 0)]
    );
    assert_eq!(chunk(0, 3, 1), (0, 0));
}

#[test]
fn uneven_rows_split_334_334_332_over_dp3() {
    let side = layout(&tiny(), 3, 1, 1);
    let got: Vec<(Dims, Vec<Placement>)> = (0..3)
        .map(|r| {
            let t = tensor(&side, r, EMBED);
            (t.shape, t.placements)
        })
        .collect();
    assert_eq!(
        got,
        vec![
            (Dims::new(&[334, 64]), place(EMBED, &[0, 0], &[334, 64])),
            (Dims::new(&[334, 64]), place(EMBED, &[334, 0], &[334, 64])),
            (Dims::new(&[332, 64]), place(EMBED, &[668, 0], &[332, 64])),
        ]
    );
    // 1-D norms shard too: 64 = 22 + 22 + 20
    let n = tensor(&side, 2, "model.norm.weight");
    assert_eq!(
        (n.shape, n.placements),
        (Dims::new(&[20]), place("model.norm.weight", &[44], &[20]))
    );
}

#[test]
fn ranks_past_the_last_chunk_keep_an_empty_tensor() {
    // k_proj of 2 rows over dp=4: 1, 1, 0, 0
    let spec = ModelSpec {
        hidden_size: 8,
        num_heads: 2,
        num_kv_heads: 2,
        head_dim: 1,
        ..tiny()
    };
    let side = layout(&spec, 4, 1, 1);
    let name = "model.layers.0.self_attn.k_proj.weight";
    let got: Vec<(Dims, Vec<Placement>)> = (0..4)
        .map(|r| {
            let t = tensor(&side, r, name);
            (t.shape, t.placements)
        })
        .collect();
    assert_eq!(
        got,
        vec![
            (Dims::new(&[1, 8]), place(name, &[0, 0], &[1, 8])),
            (Dims::new(&[1, 8]), place(name, &[1, 0], &[1, 8])),
            (Dims::new(&[0, 8]), vec![]),
            (Dims::new(&[0, 8]), vec![]),
        ]
    );
    // names line up with named_parameters() on every rank, empty or not
    let names = |r: u32| -> Vec<String> {
        side.rank_layout(RankId::train(r))
            .expect("rank")
            .tensors
            .iter()
            .map(|t| t.name.to_string())
            .collect()
    };
    assert_eq!(names(0), names(3));
    assert_eq!(side.holders(name).len(), 2);
}

#[test]
fn hsdp_replicate_groups_hold_identical_shards() {
    let side = layout(&tiny(), 2, 2, 1);
    assert_eq!(side.world_size(), 4);
    // rank = rep * dp + dp_rank
    assert_eq!(tensor(&side, 1, EMBED), tensor(&side, 3, EMBED));
    assert_eq!(
        side.holders(EMBED),
        vec![
            Holder {
                ranks: train(&[0, 2]),
                tensor: EMBED.into(),
                tensor_shape: Dims::new(&[500, 64]),
                dtype: DType::Bf16,
                region: Region::new([0, 0], [500, 64]),
                local_offset: Dims::zeros(2),
                transposed: false,
            },
            Holder {
                ranks: train(&[1, 3]),
                tensor: EMBED.into(),
                tensor_shape: Dims::new(&[500, 64]),
                dtype: DType::Bf16,
                region: Region::new([500, 0], [500, 64]),
                local_offset: Dims::zeros(2),
                transposed: false,
            },
        ]
    );
}

#[test]
fn tp_splits_colwise_rows_before_fsdp_shards_them() {
    // mesh (dp=2, tp=2): rank = dp_rank * 2 + tp_rank
    let side = layout(&tiny(), 2, 1, 2);
    assert_eq!(side.coords(3), (0, 1, 1));
    let q = "model.layers.0.self_attn.q_proj.weight"; // [64, 64]: tp halves of 32 rows, dp halves of 16
    let got: Vec<Vec<Placement>> = (0..4).map(|r| tensor(&side, r, q).placements).collect();
    assert_eq!(
        got,
        vec![
            place(q, &[0, 0], &[16, 64]),
            place(q, &[32, 0], &[16, 64]),
            place(q, &[16, 0], &[16, 64]),
            place(q, &[48, 0], &[16, 64]),
        ]
    );
    let up = tensor(&side, 2, "model.layers.1.mlp.up_proj.weight"); // [128, 64]
    assert_eq!(up.shape, Dims::new(&[32, 64]));
    assert_eq!(
        up.placements,
        place("model.layers.1.mlp.up_proj.weight", &[32, 0], &[32, 64])
    );
    // vocab-parallel embedding and lm_head split rows too
    let e = tensor(&side, 3, EMBED);
    assert_eq!(
        (e.shape, e.placements),
        (Dims::new(&[250, 64]), place(EMBED, &[750, 0], &[250, 64]))
    );
    let h = tensor(&side, 1, "lm_head.weight");
    assert_eq!(h.placements, place("lm_head.weight", &[500, 0], &[250, 64]));
}

#[test]
fn tp_splits_rowwise_columns_and_fsdp_shards_rows() {
    let side = layout(&tiny(), 2, 1, 2);
    let o = "model.layers.0.self_attn.o_proj.weight"; // [64, 64]
    let t = tensor(&side, 3, o);
    assert_eq!(
        (t.shape, t.placements),
        (Dims::new(&[32, 32]), place(o, &[32, 32], &[32, 32]))
    );
    let d = "model.layers.2.mlp.down_proj.weight"; // [64, 128]
    let t = tensor(&side, 1, d);
    assert_eq!(
        (t.shape, t.placements),
        (Dims::new(&[32, 64]), place(d, &[0, 64], &[32, 64]))
    );
}

#[test]
fn norms_replicate_over_tp_and_shard_over_dp() {
    let side = layout(&tiny(), 2, 1, 2);
    let n = "model.layers.0.input_layernorm.weight";
    let h = side.holders(n);
    assert_eq!(
        h.iter()
            .map(|h| (h.ranks.clone(), h.region))
            .collect::<Vec<_>>(),
        vec![
            (train(&[0, 1]), Region::new([0], [32])),
            (train(&[2, 3]), Region::new([32], [32]))
        ]
    );
}

#[test]
fn uneven_tp_chunks_then_dp_chunks() {
    // vocab 1000 over tp=3: 334, 334, 332; then dp=2 halves each (6 heads over 3 KV heads split over tp=3)
    let six_heads = ModelSpec {
        num_heads: 6,
        num_kv_heads: 3,
        ..tiny()
    };
    let side = layout(&six_heads, 2, 1, 3);
    let rows: Vec<(u64, u64)> = (0..6)
        .map(|r| {
            let t = tensor(&side, r, EMBED);
            let p = &t.placements[0];
            (p.region.offset.get(0), p.region.extent.get(0))
        })
        .collect();
    // rank = dp_rank * 3 + tp_rank
    assert_eq!(
        rows,
        vec![
            (0, 167),
            (334, 167),
            (668, 166),
            (167, 167),
            (501, 167),
            (834, 166)
        ]
    );
}

#[test]
fn moe_experts_split_like_dense_mlps() {
    let side = layout(&preset("qwen3-moe-tiny").expect("preset"), 2, 1, 2);
    let g = "model.layers.1.mlp.experts.3.gate_proj.weight"; // [32, 64]
    assert_eq!(tensor(&side, 3, g).placements, place(g, &[24, 0], &[8, 64]));
    let d = "model.layers.1.mlp.experts.3.down_proj.weight"; // [64, 32]
    assert_eq!(
        tensor(&side, 3, d).placements,
        place(d, &[32, 16], &[32, 16])
    );
    let router = "model.layers.1.mlp.gate.weight"; // [8, 64], replicated over tp
    assert_eq!(
        side.holders(router)
            .iter()
            .map(|h| h.ranks.clone())
            .collect::<Vec<_>>(),
        vec![train(&[0, 1]), train(&[2, 3])]
    );
}

#[test]
fn local_names_are_hf_names_in_module_order() {
    let spec = ModelSpec {
        architecture: Architecture::Qwen2,
        attention_bias: true,
        tie_word_embeddings: true,
        ..tiny()
    };
    let side = layout(&spec, 1, 1, 1);
    let names: Vec<String> = side
        .rank_layout(RankId::train(0))
        .expect("rank")
        .tensors
        .iter()
        .map(|t| t.name.to_string())
        .collect();
    let layer0 = [
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.self_attn.q_proj.bias",
        "model.layers.0.self_attn.k_proj.weight",
        "model.layers.0.self_attn.k_proj.bias",
        "model.layers.0.self_attn.v_proj.weight",
        "model.layers.0.self_attn.v_proj.bias",
        "model.layers.0.self_attn.o_proj.weight",
        "model.layers.0.mlp.gate_proj.weight",
        "model.layers.0.mlp.up_proj.weight",
        "model.layers.0.mlp.down_proj.weight",
        "model.layers.0.input_layernorm.weight",
        "model.layers.0.post_attention_layernorm.weight",
    ];
    assert_eq!(names[0], EMBED);
    assert_eq!(&names[1..13], &layer0);
    // tied: the embedding appears once, no lm_head
    assert_eq!(names.last().map(String::as_str), Some("model.norm.weight"));
    assert!(side.holders("lm_head.weight").is_empty());
    // every catalogue tensor appears exactly once, under its own name
    let cat = Catalogue::of(&spec);
    let mut sorted = names.clone();
    sorted.sort();
    let mut want: Vec<String> = cat.tensors().iter().map(|t| t.name.clone()).collect();
    want.sort();
    assert_eq!(sorted, want);
}

#[test]
fn holders_of_unknown_names_are_empty() {
    let side = layout(&preset("qwen3-moe-tiny").expect("preset"), 2, 1, 1);
    for name in [
        "model.layers.4.input_layernorm.weight",
        "model.layers.00.input_layernorm.weight",
        "model.layers.+1.input_layernorm.weight",
        "model.layers.1.mlp.gate_proj.weight",
        "model.layers.0.mlp.gate.weight",
        "model.layers.1.mlp.experts.8.up_proj.weight",
        "model.layers.0.self_attn.q_proj.bias",
        "model.layers.1.self_attn.qkv_proj.weight",
        "",
    ] {
        assert!(side.holders(name).is_empty(), "{name}");
    }
    assert!(side.rank_layout(RankId::train(2)).is_none());
    assert!(side.rank_layout(RankId::infer(1, 0)).is_none());
}

fn err(pairs: &[(&str, u64)]) -> String {
    match FsdpBackend.layout(&tiny(), &ParallelConfig::from_pairs(pairs.iter().copied())) {
        Ok(_) => panic!("{pairs:?} should be refused"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn invalid_configs_are_refused_with_clear_messages() {
    assert_eq!(
        err(&[("dp", 0)]),
        "fsdp dp=0 is not a valid mesh size; dp must be at least 1"
    );
    assert_eq!(
        err(&[("replicate", 0)]),
        "fsdp replicate=0 is not a valid mesh size; replicate must be at least 1"
    );
    assert_eq!(
        err(&[("tp", 0)]),
        "fsdp tp=0 is not a valid mesh size; tp must be at least 1"
    );
    assert_eq!(
        err(&[("dp", 1 << 20), ("replicate", 1 << 13)]),
        "fsdp dp=1048576 is above awex's limit of 65536 (one side of a pair has at most 65536 ranks)"
    );
    assert_eq!(
        err(&[("dp", 256), ("replicate", 512)]),
        "fsdp world size replicate*dp*tp=131072 is above awex's limit of 65536 (one side of a pair has at most 65536 ranks)"
    );
    assert_eq!(
        err(&[("tp", 100_000)]),
        "fsdp tp=100000 is above awex's limit of 1024 (tensor parallelism splits attention heads, of which a model has at most 1024)"
    );
    assert_eq!(
        err(&[("pp", 2)]),
        "backend `fsdp` has no parallel key `pp`; keys: dp, replicate, tp, fused_experts, transformers"
    );
}

#[test]
fn backend_is_registered_as_fsdp() {
    let names: Vec<&str> = training_backends().iter().map(|b| b.name()).collect();
    assert!(names.contains(&"fsdp"), "{names:?}");
    let b = awex_core::backend::training_backend("fsdp").expect("registered");
    let keys: Vec<(&str, Option<u64>)> = b
        .parallel_keys()
        .iter()
        .map(|k| (k.name, k.default))
        .collect();
    assert_eq!(
        keys,
        vec![
            ("dp", Some(1)),
            ("replicate", Some(1)),
            ("tp", Some(1)),
            ("fused_experts", Some(0)),
            ("transformers", Some(519))
        ]
    );
    assert_eq!(b.python_packages(), &["torch"]);
    assert_eq!(awex_fsdp::CRATE, "awex-fsdp");
    let side = b
        .layout(
            &tiny(),
            &ParallelConfig::from_pairs([("dp", 3), ("replicate", 2), ("tp", 2)]),
        )
        .expect("layout");
    assert_eq!((side.world_size(), side.engines()), (12, 1));
}

#[test]
fn tp_must_split_query_and_kv_heads_evenly() {
    // qwen3-tiny: 4 query heads over 2 KV heads; a colwise k_proj shard must hold whole KV heads
    assert_eq!(
        err(&[("tp", 3)]),
        "model has 4 attention heads and 2 KV heads; fsdp tp=3 needs both divisible by tp (a colwise q/k/v_proj shard must hold whole heads, in the model's query-to-KV ratio)"
    );
    assert!(err(&[("tp", 4)]).starts_with("model has 4 attention heads and 2 KV heads; fsdp tp=4"));
    assert!(FsdpLayout::new(&tiny(), 1, 1, 2).is_ok());
}
