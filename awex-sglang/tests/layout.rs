//! Exact SGLang placements for small models: qkv (with KV replication), vocab padding, gate_up,
//! row-parallel columns, FusedMoE w13/w2 under EP x moe_tp, tied lm_head, engine replicas, errors.

use awex_core::backend::Backend;
use awex_core::backend::{ParallelConfig, inference_backends};
use awex_core::layout::{Dims, Holder, LocalTensor, Placement, RankId, Region, SideLayout};
use awex_core::model::presets::preset;
use awex_core::model::{Catalogue, ModelSpec};
use awex_sglang::{SglangBackend, SglangLayout, padded_vocab};

fn tiny() -> ModelSpec {
    preset("qwen3-tiny").expect("preset")
}

/// qwen3-moe-tiny with every layer MoE, as SGLang 0.5.23 builds a Qwen3-MoE model.
fn moe_tiny() -> ModelSpec {
    let mut spec = preset("qwen3-moe-tiny").expect("preset");
    if let Some(m) = &mut spec.moe {
        m.mlp_only_layers.clear();
    }
    spec
}

fn layout(spec: &ModelSpec, tp: u64, ep: u64, engines: u64) -> SglangLayout {
    SglangLayout::new(spec, tp, ep, engines).expect("valid config")
}

fn tensor(side: &SglangLayout, engine: u32, rank: u32, name: &str) -> LocalTensor {
    side.rank_layout(RankId::infer(engine, rank))
        .expect("rank exists")
        .tensor(name)
        .unwrap_or_else(|| panic!("rank {engine}/{rank} has no `{name}`"))
        .clone()
}

fn place(canonical: &str, offset: &[u64], extent: &[u64], at: &[u64]) -> Placement {
    Placement {
        canonical: canonical.into(),
        region: Region::new(Dims::new(offset), Dims::new(extent)),
        local_offset: Dims::new(at),
        transposed: false,
    }
}

fn ranks(pairs: &[(u32, u32)]) -> Vec<RankId> {
    pairs.iter().map(|&(e, r)| RankId::infer(e, r)).collect()
}

const L0: &str = "model.layers.0";

#[test]
fn qkv_concatenates_q_k_v_heads_of_each_rank_at_tp2() {
    let side = layout(&tiny(), 2, 1, 1);
    let t = tensor(&side, 0, 1, "model.layers.0.self_attn.qkv_proj.weight");
    // 2 q heads + 1 k head + 1 v head of 16 rows each
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

#[test]
fn kv_heads_replicate_when_tp_exceeds_kv_heads() {
    let side = layout(&tiny(), 4, 1, 1);
    for r in 0..4u64 {
        let t = tensor(
            &side,
            0,
            r as u32,
            "model.layers.2.self_attn.qkv_proj.weight",
        );
        let kv_head = r / 2;
        assert_eq!(t.shape, Dims::new(&[48, 64]));
        assert_eq!(
            t.placements,
            vec![
                place(
                    "model.layers.2.self_attn.q_proj.weight",
                    &[16 * r, 0],
                    &[16, 64],
                    &[0, 0]
                ),
                place(
                    "model.layers.2.self_attn.k_proj.weight",
                    &[16 * kv_head, 0],
                    &[16, 64],
                    &[16, 0]
                ),
                place(
                    "model.layers.2.self_attn.v_proj.weight",
                    &[16 * kv_head, 0],
                    &[16, 64],
                    &[32, 0]
                ),
            ],
            "rank {r}"
        );
    }
    // holders: one shard per kv head, held by the pair of ranks that share it
    let h = side.holders("model.layers.2.self_attn.k_proj.weight");
    let qkv = "model.layers.2.self_attn.qkv_proj.weight";
    assert_eq!(
        h,
        vec![
            Holder {
                ranks: ranks(&[(0, 0), (0, 1)]),
                tensor: qkv.into(),
                tensor_shape: Dims::new(&[48, 64]),
                dtype: awex_core::DType::Bf16,
                region: Region::new([0, 0], [16, 64]),
                local_offset: Dims::new(&[16, 0]),
                transposed: false,
            },
            Holder {
                ranks: ranks(&[(0, 2), (0, 3)]),
                tensor: qkv.into(),
                tensor_shape: Dims::new(&[48, 64]),
                dtype: awex_core::DType::Bf16,
                region: Region::new([16, 0], [16, 64]),
                local_offset: Dims::new(&[16, 0]),
                transposed: false,
            },
        ]
    );
    // q heads are never replicated
    let q = side.holders("model.layers.2.self_attn.q_proj.weight");
    assert_eq!(q.len(), 4);
    assert!(q.iter().all(|h| h.ranks.len() == 1));
}

#[test]
fn vocab_pads_to_64_and_splits_evenly_at_tp2() {
    assert_eq!(padded_vocab(1000, 2), 1024);
    let side = layout(&tiny(), 2, 1, 1);
    let e0 = tensor(&side, 0, 0, "model.embed_tokens.weight");
    let e1 = tensor(&side, 0, 1, "model.embed_tokens.weight");
    assert_eq!(e0.shape, Dims::new(&[512, 64]));
    assert_eq!(e1.shape, Dims::new(&[512, 64]));
    assert_eq!(
        e0.placements,
        vec![place(
            "model.embed_tokens.weight",
            &[0, 0],
            &[512, 64],
            &[0, 0]
        )]
    );
    // rows 512..1000 at local 0..488; local rows 488..512 are padding
    assert_eq!(
        e1.placements,
        vec![place(
            "model.embed_tokens.weight",
            &[512, 0],
            &[488, 64],
            &[0, 0]
        )]
    );
    let head = tensor(&side, 0, 1, "lm_head.weight");
    assert_eq!(head.shape, Dims::new(&[512, 64]));
    assert_eq!(
        head.placements,
        vec![place("lm_head.weight", &[512, 0], &[488, 64], &[0, 0])]
    );
}

#[test]
fn vocab_pads_to_64_times_tp_when_64_padding_does_not_split() {
    // 1024 is not divisible by 3: pad to a multiple of 192 instead
    assert_eq!(padded_vocab(1000, 3), 1152);
    assert_eq!(padded_vocab(1000, 4), 1024);
    assert_eq!(padded_vocab(151936, 16), 151936);
    let mut spec = tiny();
    spec.num_heads = 6;
    spec.num_kv_heads = 3;
    spec.intermediate_size = 96;
    let side = layout(&spec, 3, 1, 1);
    assert_eq!(side.vocab_rows_per_rank(), 384);
    let rows: Vec<Vec<Placement>> = (0..3)
        .map(|r| tensor(&side, 0, r, "model.embed_tokens.weight").placements)
        .collect();
    assert_eq!(
        rows,
        vec![
            vec![place(
                "model.embed_tokens.weight",
                &[0, 0],
                &[384, 64],
                &[0, 0]
            )],
            vec![place(
                "model.embed_tokens.weight",
                &[384, 0],
                &[384, 64],
                &[0, 0]
            )],
            vec![place(
                "model.embed_tokens.weight",
                &[768, 0],
                &[232, 64],
                &[0, 0]
            )],
        ]
    );
}

#[test]
fn rank_holding_only_vocab_padding_has_no_placement() {
    // vocab 70 pads to 128 = 4 x 32 rows: rank 2 holds rows 64..70, rank 3 padding only
    let mut spec = tiny();
    spec.vocab_size = 70;
    let side = layout(&spec, 4, 1, 1);
    assert_eq!(side.vocab_rows_per_rank(), 32);
    let t = tensor(&side, 0, 2, "model.embed_tokens.weight");
    assert_eq!(
        t.placements,
        vec![place(
            "model.embed_tokens.weight",
            &[64, 0],
            &[6, 64],
            &[0, 0]
        )]
    );
    let t = tensor(&side, 0, 3, "model.embed_tokens.weight");
    assert_eq!(t.shape, Dims::new(&[32, 64]));
    assert!(t.placements.is_empty());
    let h = side.holders("model.embed_tokens.weight");
    assert_eq!(
        h.iter().map(|h| h.ranks.clone()).collect::<Vec<_>>(),
        vec![ranks(&[(0, 0)]), ranks(&[(0, 1)]), ranks(&[(0, 2)])]
    );
}

#[test]
fn gate_up_stacks_gate_then_up_rows_of_each_rank() {
    let side = layout(&tiny(), 2, 1, 1);
    let t = tensor(&side, 0, 1, "model.layers.1.mlp.gate_up_proj.weight");
    assert_eq!(t.shape, Dims::new(&[128, 64]));
    assert_eq!(
        t.placements,
        vec![
            place(
                "model.layers.1.mlp.gate_proj.weight",
                &[64, 0],
                &[64, 64],
                &[0, 0]
            ),
            place(
                "model.layers.1.mlp.up_proj.weight",
                &[64, 0],
                &[64, 64],
                &[64, 0]
            ),
        ]
    );
}

#[test]
fn o_proj_and_down_proj_split_columns() {
    let side = layout(&tiny(), 2, 1, 1);
    let o = tensor(&side, 0, 1, "model.layers.0.self_attn.o_proj.weight");
    assert_eq!(o.shape, Dims::new(&[64, 32]));
    assert_eq!(
        o.placements,
        vec![place(
            "model.layers.0.self_attn.o_proj.weight",
            &[0, 32],
            &[64, 32],
            &[0, 0]
        )]
    );
    let d = tensor(&side, 0, 1, "model.layers.0.mlp.down_proj.weight");
    assert_eq!(d.shape, Dims::new(&[64, 64]));
    assert_eq!(
        d.placements,
        vec![place(
            "model.layers.0.mlp.down_proj.weight",
            &[0, 64],
            &[64, 64],
            &[0, 0]
        )]
    );
}

#[test]
fn norms_are_replicated_on_every_rank_of_every_engine() {
    let side = layout(&tiny(), 2, 1, 2);
    let h = side.holders("model.layers.3.self_attn.k_norm.weight");
    assert_eq!(h.len(), 1);
    assert_eq!(h[0].ranks, ranks(&[(0, 0), (0, 1), (1, 0), (1, 1)]));
    assert_eq!(h[0].region, Region::new([0], [16]));
    let t = tensor(&side, 1, 1, "model.norm.weight");
    assert_eq!(
        t.placements,
        vec![place("model.norm.weight", &[0], &[64], &[0])]
    );
}

#[test]
fn rank_tensors_follow_sglang_named_parameters() {
    let side = layout(&tiny(), 2, 1, 1);
    let names: Vec<String> = side
        .rank_layout(RankId::infer(0, 0))
        .expect("rank")
        .tensors
        .iter()
        .map(|t| t.name.to_string())
        .collect();
    let layer0 = [
        "model.layers.0.self_attn.q_norm.weight",
        "model.layers.0.self_attn.k_norm.weight",
        "model.layers.0.self_attn.qkv_proj.weight",
        "model.layers.0.self_attn.o_proj.weight",
        "model.layers.0.mlp.gate_up_proj.weight",
        "model.layers.0.mlp.down_proj.weight",
        "model.layers.0.input_layernorm.weight",
        "model.layers.0.post_attention_layernorm.weight",
    ];
    assert_eq!(names.len(), 1 + 4 * 8 + 2);
    assert_eq!(names[0], "model.embed_tokens.weight");
    assert_eq!(&names[1..9], &layer0);
    assert_eq!(
        &names[names.len() - 2..],
        &["model.norm.weight", "lm_head.weight"]
    );
}

#[test]
fn moe_experts_fuse_into_w13_and_w2_under_ep_and_moe_tp() {
    // tp=4, ep=2: moe_tp=2, 4 local experts, 16 intermediate rows per moe_tp rank
    let side = layout(&moe_tiny(), 4, 2, 1);
    let w13 = tensor(&side, 0, 3, "model.layers.1.mlp.experts.w13_weight");
    assert_eq!(w13.shape, Dims::new(&[4, 32, 64]));
    let mut want = Vec::new();
    for j in 0..4u64 {
        let e = 4 + j; // ep_rank 1
        want.push(place(
            &format!("model.layers.1.mlp.experts.{e}.gate_proj.weight"),
            &[16, 0],
            &[16, 64],
            &[j, 0, 0],
        ));
        want.push(place(
            &format!("model.layers.1.mlp.experts.{e}.up_proj.weight"),
            &[16, 0],
            &[16, 64],
            &[j, 16, 0],
        ));
    }
    assert_eq!(w13.placements, want);
    let w2 = tensor(&side, 0, 2, "model.layers.1.mlp.experts.w2_weight");
    assert_eq!(w2.shape, Dims::new(&[4, 64, 16]));
    let want: Vec<Placement> = (0..4u64)
        .map(|j| {
            place(
                &format!("model.layers.1.mlp.experts.{}.down_proj.weight", 4 + j),
                &[0, 0],
                &[64, 16],
                &[j, 0, 0],
            )
        })
        .collect();
    assert_eq!(w2.placements, want);
    // the router is replicated
    let g = tensor(&side, 0, 1, "model.layers.1.mlp.gate.weight");
    assert_eq!(
        g.placements,
        vec![place(
            "model.layers.1.mlp.gate.weight",
            &[0, 0],
            &[8, 64],
            &[0, 0]
        )]
    );
    // expert 5 lives on ep rank 1 (tp ranks 2, 3) as local expert 1
    let h = side.holders("model.layers.1.mlp.experts.5.up_proj.weight");
    assert_eq!(
        h.iter()
            .map(|h| (h.ranks.clone(), h.region, h.local_offset))
            .collect::<Vec<_>>(),
        vec![
            (
                ranks(&[(0, 2)]),
                Region::new([0, 0], [16, 64]),
                Dims::new(&[1, 16, 0])
            ),
            (
                ranks(&[(0, 3)]),
                Region::new([16, 0], [16, 64]),
                Dims::new(&[1, 16, 0])
            ),
        ]
    );
}

#[test]
fn moe_model_dense_layer_uses_dense_names() {
    // GLM-4.5's first layer is dense (first_k_dense_replace), in SGLang too
    let glm = preset("glm-4.5-tiny").expect("preset");
    let side = layout(&glm, 2, 2, 1);
    let rank = side.rank_layout(RankId::infer(0, 0)).expect("rank");
    assert!(
        rank.tensor("model.layers.0.mlp.gate_up_proj.weight")
            .is_some()
    );
    assert!(
        rank.tensor("model.layers.0.mlp.experts.w13_weight")
            .is_none()
    );
    assert!(
        rank.tensor("model.layers.1.mlp.gate_up_proj.weight")
            .is_none()
    );
    // ep=2 = tp: moe_tp=1, each rank holds 4 whole experts
    let w13 = rank
        .tensor("model.layers.1.mlp.experts.w13_weight")
        .expect("w13");
    assert_eq!(w13.shape, Dims::new(&[4, 64, 64]));
    assert_eq!(
        w13.placements[1],
        place(
            "model.layers.1.mlp.experts.0.up_proj.weight",
            &[0, 0],
            &[32, 64],
            &[0, 32, 0]
        )
    );
}

#[test]
fn a_qwen3_moe_dense_layer_is_refused_naming_the_field_sglang_ignores() {
    // qwen3-moe-tiny's layer 0 is dense through mlp_only_layers; SGLang 0.5.23 builds it as MoE
    let e = SglangLayout::new(&preset("qwen3-moe-tiny").expect("preset"), 2, 1, 1)
        .unwrap_err()
        .to_string();
    assert!(
        e.starts_with("Qwen3MoeForCausalLM in SGLang 0.5.23 builds every layer as MoE")
            && e.contains("this config's `mlp_only_layers` makes layer 0 dense")
            && e.contains("Serve it with vLLM"),
        "{e}"
    );
    let mut step = moe_tiny();
    if let Some(m) = &mut step.moe {
        m.decoder_sparse_step = 2;
    }
    let e = SglangLayout::new(&step, 2, 1, 1).unwrap_err().to_string();
    assert!(
        e.contains("this config's `decoder_sparse_step` makes layer 0 dense"),
        "{e}"
    );
    // every layer MoE: accepted
    assert!(SglangLayout::new(&moe_tiny(), 2, 1, 1).is_ok());
}

#[test]
fn tied_dense_model_has_no_lm_head() {
    let mut spec = tiny();
    spec.tie_word_embeddings = true;
    let side = layout(&spec, 2, 1, 1);
    let rank = side.rank_layout(RankId::infer(0, 1)).expect("rank");
    assert!(rank.tensor("lm_head.weight").is_none());
    assert_eq!(
        rank.tensors.last().map(|t| &*t.name),
        Some("model.norm.weight")
    );
    assert_eq!(side.holders("model.embed_tokens.weight").len(), 2);
    assert!(side.holders("lm_head.weight").is_empty());
}

#[test]
fn tied_moe_model_keeps_lm_head_holding_the_embedding() {
    let mut spec = moe_tiny();
    spec.tie_word_embeddings = true;
    let side = layout(&spec, 2, 1, 1);
    let head = tensor(&side, 0, 1, "lm_head.weight");
    assert_eq!(head.shape, Dims::new(&[512, 64]));
    assert_eq!(
        head.placements,
        vec![place(
            "model.embed_tokens.weight",
            &[512, 0],
            &[488, 64],
            &[0, 0]
        )]
    );
    let h = side.holders("model.embed_tokens.weight");
    let tensors: Vec<&str> = h.iter().map(|h| &*h.tensor).collect();
    assert_eq!(
        tensors,
        vec![
            "model.embed_tokens.weight",
            "model.embed_tokens.weight",
            "lm_head.weight",
            "lm_head.weight"
        ]
    );
    assert!(side.holders("lm_head.weight").is_empty());
}

#[test]
fn engines_are_replicas_of_one_layout() {
    let side = layout(&tiny(), 2, 1, 3);
    assert_eq!(side.engines(), 3);
    assert_eq!(side.world_size(), 6);
    assert_eq!(
        side.ranks(),
        ranks(&[(0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1)])
    );
    let a = side.rank_layout(RankId::infer(0, 1)).expect("rank");
    let b = side.rank_layout(RankId::infer(2, 1)).expect("rank");
    assert_eq!(a.tensors, b.tensors);
    assert_eq!(b.rank, RankId::infer(2, 1));
    let h = side.holders("model.layers.0.self_attn.q_proj.weight");
    assert_eq!(h[1].ranks, ranks(&[(0, 1), (1, 1), (2, 1)]));
    assert!(side.rank_layout(RankId::infer(3, 0)).is_none());
    assert!(side.rank_layout(RankId::infer(0, 2)).is_none());
}

#[test]
fn qwen2_biases_follow_qkv_rows() {
    let mut spec = tiny();
    spec.architecture = awex_core::model::Architecture::Qwen2;
    spec.attention_bias = true;
    let side = layout(&spec, 4, 1, 1);
    let t = tensor(&side, 0, 3, "model.layers.0.self_attn.qkv_proj.bias");
    assert_eq!(t.shape, Dims::new(&[48]));
    assert_eq!(
        t.placements,
        vec![
            place("model.layers.0.self_attn.q_proj.bias", &[48], &[16], &[0]),
            place("model.layers.0.self_attn.k_proj.bias", &[16], &[16], &[16]),
            place("model.layers.0.self_attn.v_proj.bias", &[16], &[16], &[32]),
        ]
    );
    let rank = side.rank_layout(RankId::infer(0, 0)).expect("rank");
    assert!(
        rank.tensor("model.layers.0.self_attn.q_norm.weight")
            .is_none()
    );
}

#[test]
fn holders_of_unknown_or_absent_names_are_empty() {
    let side = layout(&moe_tiny(), 2, 1, 1);
    for name in [
        "model.layers.4.input_layernorm.weight",
        "model.layers.01.input_layernorm.weight",
        "model.layers.+1.input_layernorm.weight",
        "model.layers.1.mlp.gate_proj.weight",
        "model.layers.0.mlp.gate_proj.weight",
        "model.layers.1.mlp.experts.8.gate_proj.weight",
        "model.layers.1.mlp.experts.1.bias",
        "model.layers.0.self_attn.q_proj.bias",
        "nonsense",
    ] {
        assert!(side.holders(name).is_empty(), "{name}");
    }
}

#[test]
fn one_trillion_parameter_layout_answers_per_rank_and_per_tensor() {
    let spec = preset("moe-1t").expect("preset");
    let side = layout(&spec, 16, 16, 8);
    assert_eq!(side.world_size(), 128);
    let rank = side.rank_layout(RankId::infer(7, 15)).expect("rank");
    let w13 = rank
        .tensor("model.layers.1.mlp.experts.w13_weight")
        .expect("w13");
    // 384 experts / 16 = 24 local, moe_tp = 1: whole experts
    assert_eq!(w13.shape, Dims::new(&[24, 4096, 7168]));
    assert_eq!(
        w13.placements[0].canonical.as_ref(),
        "model.layers.1.mlp.experts.360.gate_proj.weight"
    );
    let h = side.holders("model.layers.63.mlp.experts.383.down_proj.weight");
    assert_eq!(h.len(), 1);
    assert_eq!(
        h[0].ranks,
        (0..8).map(|e| RankId::infer(e, 15)).collect::<Vec<_>>()
    );
    assert_eq!(h[0].local_offset, Dims::new(&[23, 0, 0]));
    // 8 KV heads over tp=16: pairs of ranks share a head
    let k = side.holders("model.layers.5.self_attn.k_proj.weight");
    assert_eq!(k.len(), 8);
    assert_eq!(k[3].ranks.len(), 16);
    let cat = Catalogue::of(&spec);
    assert!(
        cat.tensors()
            .iter()
            .all(|c| !side.holders(&c.name).is_empty())
    );
}

fn err(spec: &ModelSpec, pairs: &[(&str, u64)]) -> String {
    match SglangBackend.layout(spec, &ParallelConfig::from_pairs(pairs.iter().copied())) {
        Ok(_) => panic!("{pairs:?} should be refused"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn invalid_configs_are_refused_with_clear_messages() {
    let tiny = tiny();
    assert_eq!(
        err(&tiny, &[("tp", 0)]),
        "sglang tp=0 is not a valid size; tp must be at least 1"
    );
    assert_eq!(
        err(&tiny, &[("engines", 0)]),
        "sglang engines=0 is not a valid size; engines must be at least 1"
    );
    assert_eq!(
        err(&tiny, &[("tp", 3)]),
        "model has 4 attention heads; sglang tp=3 needs num_attention_heads divisible by tp"
    );
    assert_eq!(
        err(&tiny, &[("tp", 4), ("ep", 3)]),
        "sglang ep=3 must divide tp=4: expert parallelism splits the tensor-parallel group (moe_tp = tp / ep)"
    );
    assert_eq!(
        err(&tiny, &[("pp", 2)]),
        "backend `sglang` has no parallel key `pp`; keys: tp, ep, engines, fused_shared_experts"
    );
    let mut kv = tiny.clone();
    kv.num_heads = 12;
    kv.num_kv_heads = 6;
    kv.intermediate_size = 96;
    let msg = "model has 6 KV heads; sglang tp=4 needs num_key_value_heads divisible by tp (when tp <= KV heads) or tp divisible by num_key_value_heads (when tp > KV heads)";
    assert_eq!(err(&kv, &[("tp", 4)]), msg);
    kv.num_kv_heads = 4;
    assert_eq!(
        err(&kv, &[("tp", 6)]),
        "model has 4 KV heads; sglang tp=6 needs num_key_value_heads divisible by tp (when tp <= KV heads) or tp divisible by num_key_value_heads (when tp > KV heads)"
    );
    let mut inter = tiny.clone();
    inter.intermediate_size = 101;
    assert_eq!(
        err(&inter, &[("tp", 2)]),
        "model has intermediate_size=101; sglang tp=2 needs it divisible by tp"
    );
    let mut experts = moe_tiny();
    if let Some(m) = experts.moe.as_mut() {
        m.num_experts = 6;
    }
    assert_eq!(
        err(&experts, &[("tp", 4), ("ep", 4)]),
        "model has 6 experts per MoE layer; sglang ep=4 needs num_experts divisible by ep"
    );
    let mut moe_inter = moe_tiny();
    if let Some(m) = moe_inter.moe.as_mut() {
        m.moe_intermediate_size = 30;
    }
    assert_eq!(
        err(&moe_inter, &[("tp", 4)]),
        "model has moe_intermediate_size=30; sglang moe_tp = tp/ep = 4 (tp=4, ep=1) needs it divisible by moe_tp"
    );
    // the dense intermediate size only matters when a layer is dense
    let mut all_moe = moe_tiny();
    all_moe.intermediate_size = 7;
    if let Some(m) = all_moe.moe.as_mut() {
        m.mlp_only_layers.clear();
    }
    assert!(SglangLayout::new(&all_moe, 2, 1, 1).is_ok());
}

#[test]
fn backend_is_registered_as_sglang() {
    let names: Vec<&str> = inference_backends().iter().map(|b| b.name()).collect();
    assert!(names.contains(&"sglang"), "{names:?}");
    let b = awex_core::backend::inference_backend("sglang").expect("registered");
    let keys: Vec<(&str, Option<u64>)> = b
        .parallel_keys()
        .iter()
        .map(|k| (k.name, k.default))
        .collect();
    assert_eq!(
        keys,
        vec![
            ("tp", Some(1)),
            ("ep", Some(1)),
            ("engines", Some(1)),
            ("fused_shared_experts", None)
        ]
    );
    assert_eq!(b.python_packages(), &["sglang"]);
    assert_eq!(awex_sglang::CRATE, "awex-sglang");
    let side = b
        .layout(
            &tiny(),
            &ParallelConfig::from_pairs([("tp", 2), ("engines", 2)]),
        )
        .expect("layout");
    assert_eq!((side.world_size(), side.engines()), (4, 2));
}

/// SGLang 0.5.23's MoE blocks refuse a tensor-parallel size above the routed experts when the
/// server builds the model (`models/deepseek_v2.py`, `DeepseekV2MoE.__init__`: "Tensor parallel
/// size {tp} is greater than the number of experts {n}."; GLM-4.5 and Qwen3-MoE likewise):
/// awex refuses the same layout by name, before any rank starts.
#[test]
fn tp_above_the_routed_experts_is_refused_as_sglang_refuses_it() {
    // DeepSeek-V3 (8 routed experts): tp 16, even with expert parallelism (SGLang compares the
    // whole tp)
    let ds = preset("deepseek-v3-tiny").expect("preset");
    let mut ds = ds.clone();
    ds.num_heads = 16;
    let msg = |tp: u64, ep: u64| {
        format!(
            "model has 8 routed experts per MoE layer (`n_routed_experts`), fewer than sglang tp = {tp} (tp={tp}, ep={ep}): SGLang 0.5.23's DeepseekV3ForCausalLM refuses that when it builds its first MoE layer (`DeepseekV2MoE.__init__` raises \"Tensor parallel size {tp} is greater than the number of experts 8.\"), so the server never starts; use tp <= 8"
        )
    };
    assert_eq!(
        err(&ds, &[("tp", 16), ("fused_shared_experts", 0)]),
        msg(16, 1)
    );
    assert_eq!(err(&ds, &[("tp", 16), ("ep", 8)]), msg(16, 8));
    // tp equal to the experts is what SGLang builds
    assert!(
        SglangLayout::with_shared_experts(&ds, 8, 1, 1, Some(false)).is_ok(),
        "tp 8 over 8 experts"
    );
    // GLM-4.5 compares the whole tp as well
    let mut glm = preset("glm-4.5-tiny").expect("preset");
    let experts = glm.moe.as_ref().expect("moe").num_experts;
    glm.num_heads = experts * 2;
    glm.num_kv_heads = experts * 2;
    let tp = experts * 2;
    let e = err(&glm, &[("tp", tp), ("fused_shared_experts", 0)]);
    assert!(
        e.starts_with(&format!(
            "model has {experts} routed experts per MoE layer (`n_routed_experts`), fewer than sglang tp = {tp}"
        )) && e.contains("Glm4MoeSparseMoeBlock.__init__"),
        "{e}"
    );
    // Qwen3-MoE compares moe_tp = tp / ep: tp 16 over 8 experts is refused at ep 1, built at ep 2
    let mut qwen = moe_tiny();
    qwen.num_heads = 16;
    qwen.num_kv_heads = 16;
    assert_eq!(
        err(&qwen, &[("tp", 16)]),
        "model has 8 routed experts per MoE layer (`num_experts`), fewer than sglang moe_tp = tp/ep = 16 (tp=16, ep=1): SGLang 0.5.23's Qwen3MoeForCausalLM refuses that when it builds its first MoE layer (`Qwen3MoeSparseMoeBlock.__init__` raises \"Tensor parallel size 16 is greater than the number of experts 8.\"), so the server never starts; use moe_tp = tp/ep <= 8"
    );
    assert!(
        SglangLayout::new(&qwen, 16, 2, 1).is_ok(),
        "moe_tp 8 over 8 experts"
    );
    // Mixtral's block has no such check
    let mut mixtral = preset("mixtral-tiny").expect("preset");
    let experts = mixtral.moe.as_ref().expect("moe").num_experts;
    mixtral.num_heads = experts * 2;
    mixtral.num_kv_heads = experts * 2;
    assert!(
        SglangLayout::new(&mixtral, experts * 2, 1, 1).is_ok(),
        "mixtral at tp {}",
        experts * 2
    );
}
