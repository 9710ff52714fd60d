//! Exact names, shapes and placements of Megatron parameters for small hand-computed cases.

mod common;

use awex_core::DType;
use awex_core::layout::{Dims, Holder, Placement, RankId, Region, SideLayout, materialize};
use awex_core::model::Catalogue;
use awex_megatron::MegatronLayout;
use common::*;
use std::sync::Arc;

fn p(canonical: &str, offset: &[u64], extent: &[u64], local: &[u64]) -> Placement {
    Placement {
        canonical: Arc::from(canonical),
        region: Region::new(Dims::new(offset), Dims::new(extent)),
        local_offset: Dims::new(local),
        transposed: false,
    }
}

fn shape(v: &[u64]) -> Dims {
    Dims::new(v)
}

const L0: &str = "model.layers.0";

#[test]
fn qkv_whole_groups_split_across_tp_ranks() {
    // qwen3-tiny: 4 heads, 2 KV heads, head_dim 16 => group = [q 32 rows][k 16][v 16] = 64 rows, 128 in all
    let side = layout(&preset("qwen3-tiny"), &[("tp", 2)]).unwrap();
    let name = "decoder.layers.0.self_attention.linear_qkv.weight";
    let r0 = rank(side.as_ref(), 0);
    let t = tensor(&r0, name);
    assert_eq!((t.shape, t.dtype), (shape(&[64, 64]), DType::Bf16));
    assert_eq!(
        t.placements,
        vec![
            p(
                &format!("{L0}.self_attn.q_proj.weight"),
                &[0, 0],
                &[32, 64],
                &[0, 0]
            ),
            p(
                &format!("{L0}.self_attn.k_proj.weight"),
                &[0, 0],
                &[16, 64],
                &[32, 0]
            ),
            p(
                &format!("{L0}.self_attn.v_proj.weight"),
                &[0, 0],
                &[16, 64],
                &[48, 0]
            ),
        ]
    );
    let r1 = rank(side.as_ref(), 1);
    let t = tensor(&r1, name);
    assert_eq!(t.shape, shape(&[64, 64]));
    assert_eq!(
        t.placements,
        vec![
            p(
                &format!("{L0}.self_attn.q_proj.weight"),
                &[32, 0],
                &[32, 64],
                &[0, 0]
            ),
            p(
                &format!("{L0}.self_attn.k_proj.weight"),
                &[16, 0],
                &[16, 64],
                &[32, 0]
            ),
            p(
                &format!("{L0}.self_attn.v_proj.weight"),
                &[16, 0],
                &[16, 64],
                &[48, 0]
            ),
        ]
    );
}

#[test]
fn qkv_tp_above_groups_cuts_inside_groups() {
    // tp=4 over 2 groups of 64 rows: each rank holds 32 contiguous rows of the interleaved tensor
    let side = layout(&preset("qwen3-tiny"), &[("tp", 4)]).unwrap();
    let name = "decoder.layers.0.self_attention.linear_qkv.weight";
    let q = format!("{L0}.self_attn.q_proj.weight");
    let k = format!("{L0}.self_attn.k_proj.weight");
    let v = format!("{L0}.self_attn.v_proj.weight");
    let want = [
        vec![p(&q, &[0, 0], &[32, 64], &[0, 0])],
        vec![
            p(&k, &[0, 0], &[16, 64], &[0, 0]),
            p(&v, &[0, 0], &[16, 64], &[16, 0]),
        ],
        vec![p(&q, &[32, 0], &[32, 64], &[0, 0])],
        vec![
            p(&k, &[16, 0], &[16, 64], &[0, 0]),
            p(&v, &[16, 0], &[16, 64], &[16, 0]),
        ],
    ];
    for (r, w) in want.iter().enumerate() {
        let rl = rank(side.as_ref(), r as u32);
        let t = tensor(&rl, name);
        assert_eq!(t.shape, shape(&[32, 64]), "rank {r}");
        assert_eq!(&t.placements, w, "rank {r}");
    }
}

#[test]
fn qkv_slices_clip_query_blocks_and_biases() {
    // 8 heads over 2 groups, head_dim 4: group = [q 16][k 4][v 4] = 24 rows, 48 in all; tp=4 => 12 rows each
    let side = layout(&wide_groups(), &[("tp", 4)]).unwrap();
    let q = format!("{L0}.self_attn.q_proj.weight");
    let k = format!("{L0}.self_attn.k_proj.weight");
    let v = format!("{L0}.self_attn.v_proj.weight");
    let want = [
        vec![p(&q, &[0, 0], &[12, 8], &[0, 0])],
        vec![
            p(&q, &[12, 0], &[4, 8], &[0, 0]),
            p(&k, &[0, 0], &[4, 8], &[4, 0]),
            p(&v, &[0, 0], &[4, 8], &[8, 0]),
        ],
        vec![p(&q, &[16, 0], &[12, 8], &[0, 0])],
        vec![
            p(&q, &[28, 0], &[4, 8], &[0, 0]),
            p(&k, &[4, 0], &[4, 8], &[4, 0]),
            p(&v, &[4, 0], &[4, 8], &[8, 0]),
        ],
    ];
    for (r, w) in want.iter().enumerate() {
        let rl = rank(side.as_ref(), r as u32);
        let t = tensor(&rl, "decoder.layers.0.self_attention.linear_qkv.weight");
        assert_eq!(t.shape, shape(&[12, 8]), "rank {r}");
        assert_eq!(&t.placements, w, "rank {r}");
    }
    let rl = rank(side.as_ref(), 3);
    let b = tensor(&rl, "decoder.layers.0.self_attention.linear_qkv.bias");
    assert_eq!(b.shape, shape(&[12]));
    assert_eq!(
        b.placements,
        vec![
            p(&format!("{L0}.self_attn.q_proj.bias"), &[28], &[4], &[0]),
            p(&format!("{L0}.self_attn.k_proj.bias"), &[4], &[4], &[4]),
            p(&format!("{L0}.self_attn.v_proj.bias"), &[4], &[4], &[8]),
        ]
    );
}

#[test]
fn qkv_bytes_equal_the_interleaved_reference() {
    // independent of the placement code: build [q of g; k g; v g] per group and slice it per rank
    for (model, tp) in [
        (preset("qwen3-tiny"), 1),
        (preset("qwen3-tiny"), 2),
        (preset("qwen3-tiny"), 4),
        (qwen2_tiny(), 2),
        (wide_groups(), 2),
        (wide_groups(), 4),
    ] {
        let side = layout(&model, &[("tp", tp)]).unwrap();
        let cat = Catalogue::of(&model);
        let canon = canonical_bytes(&cat);
        let (hd, ng) = (model.head_dim as usize, model.num_kv_heads as usize);
        let qpg = (model.num_heads / model.num_kv_heads) as usize;
        for (suffix, row_len) in [("weight", model.hidden_size as usize), ("bias", 1)] {
            if suffix == "bias" && !model.attention_bias {
                continue;
            }
            let bytes = |w: &str| &canon[&format!("{L0}.self_attn.{w}_proj.{suffix}")];
            let row = row_len * 2;
            let mut full = Vec::new();
            for g in 0..ng {
                full.extend_from_slice(&bytes("q")[g * qpg * hd * row..(g + 1) * qpg * hd * row]);
                full.extend_from_slice(&bytes("k")[g * hd * row..(g + 1) * hd * row]);
                full.extend_from_slice(&bytes("v")[g * hd * row..(g + 1) * hd * row]);
            }
            let per = full.len() / tp as usize;
            for r in 0..tp as u32 {
                let rl = rank(side.as_ref(), r);
                let get = |n: &str| canon.get(n).map(|v| v.as_slice());
                let bufs = materialize(&rl, &cat, &get).unwrap();
                let name = format!("decoder.layers.0.self_attention.linear_qkv.{suffix}");
                let i = rl.tensors.iter().position(|t| *t.name == *name).unwrap();
                assert!(
                    bufs[i] == full[r as usize * per..(r as usize + 1) * per],
                    "{} tp={tp} rank {r} {suffix}",
                    model.name
                );
            }
        }
    }
}

#[test]
fn qwen2_biases_follow_the_weight_and_qk_norms_are_absent() {
    let side = layout(&qwen2_tiny(), &[("tp", 2)]).unwrap();
    let rl = rank(side.as_ref(), 1);
    let b = tensor(&rl, "decoder.layers.0.self_attention.linear_qkv.bias");
    assert_eq!((b.shape, b.dtype), (shape(&[64]), DType::Bf16));
    assert_eq!(
        b.placements,
        vec![
            p(&format!("{L0}.self_attn.q_proj.bias"), &[32], &[32], &[0]),
            p(&format!("{L0}.self_attn.k_proj.bias"), &[16], &[16], &[32]),
            p(&format!("{L0}.self_attn.v_proj.bias"), &[16], &[16], &[48]),
        ]
    );
    assert!(
        rl.tensor("decoder.layers.0.self_attention.q_layernorm.weight")
            .is_none()
    );
    let qwen3 = layout(&preset("qwen3-tiny"), &[("tp", 2)]).unwrap();
    assert!(
        rank(qwen3.as_ref(), 0)
            .tensor("decoder.layers.0.self_attention.linear_qkv.bias")
            .is_none()
    );
}

#[test]
fn vocab_is_padded_to_128_tp_and_split_over_tp() {
    // 1000 rows, tp=2: padded to 1024, 512 per rank; rank 1 holds rows 512..1000 at local 0..488
    let side = layout(&preset("qwen3-tiny"), &[("tp", 2)]).unwrap();
    for (name, canonical) in [
        (
            "embedding.word_embeddings.weight",
            "model.embed_tokens.weight",
        ),
        ("output_layer.weight", "lm_head.weight"),
    ] {
        let r0 = rank(side.as_ref(), 0);
        let t = tensor(&r0, name);
        assert_eq!(t.shape, shape(&[512, 64]));
        assert_eq!(
            t.placements,
            vec![p(canonical, &[0, 0], &[512, 64], &[0, 0])]
        );
        let r1 = rank(side.as_ref(), 1);
        let t = tensor(&r1, name);
        assert_eq!(t.shape, shape(&[512, 64]));
        assert_eq!(
            t.placements,
            vec![p(canonical, &[512, 0], &[488, 64], &[0, 0])]
        );
    }
    // the padding rows stay zero
    let model = preset("qwen3-tiny");
    let cat = Catalogue::of(&model);
    let canon = canonical_bytes(&cat);
    let r1 = rank(side.as_ref(), 1);
    let get = |n: &str| canon.get(n).map(|v| v.as_slice());
    let bufs = materialize(&r1, &cat, &get).unwrap();
    let emb = &bufs[0];
    assert_eq!(&*r1.tensors[0].name, "embedding.word_embeddings.weight");
    assert_eq!(emb.len(), 512 * 64 * 2);
    assert!(emb[488 * 64 * 2..].iter().all(|&b| b == 0));
    assert_eq!(
        &emb[..488 * 64 * 2],
        &canon["model.embed_tokens.weight"][512 * 64 * 2..]
    );
    // tp=1: padded to 1024 as well, one placement of all 1000 rows
    let one = layout(&preset("qwen3-tiny"), &[]).unwrap();
    let t = rank(one.as_ref(), 0);
    let t = tensor(&t, "embedding.word_embeddings.weight");
    assert_eq!(t.shape, shape(&[1024, 64]));
    assert_eq!(
        t.placements,
        vec![p(
            "model.embed_tokens.weight",
            &[0, 0],
            &[1000, 64],
            &[0, 0]
        )]
    );
}

#[test]
fn fc1_stacks_gate_then_up_rows_of_the_tp_rank() {
    let side = layout(&preset("qwen3-tiny"), &[("tp", 2)]).unwrap();
    let rl = rank(side.as_ref(), 1);
    let t = tensor(&rl, "decoder.layers.0.mlp.linear_fc1.weight");
    assert_eq!(t.shape, shape(&[128, 64]));
    assert_eq!(
        t.placements,
        vec![
            p(
                &format!("{L0}.mlp.gate_proj.weight"),
                &[64, 0],
                &[64, 64],
                &[0, 0]
            ),
            p(
                &format!("{L0}.mlp.up_proj.weight"),
                &[64, 0],
                &[64, 64],
                &[64, 0]
            ),
        ]
    );
}

#[test]
fn proj_and_fc2_split_columns() {
    let side = layout(&preset("qwen3-tiny"), &[("tp", 2)]).unwrap();
    let rl = rank(side.as_ref(), 1);
    let t = tensor(&rl, "decoder.layers.0.self_attention.linear_proj.weight");
    assert_eq!(t.shape, shape(&[64, 32]));
    assert_eq!(
        t.placements,
        vec![p(
            &format!("{L0}.self_attn.o_proj.weight"),
            &[0, 32],
            &[64, 32],
            &[0, 0]
        )]
    );
    let t = tensor(&rl, "decoder.layers.0.mlp.linear_fc2.weight");
    assert_eq!(t.shape, shape(&[64, 64]));
    assert_eq!(
        t.placements,
        vec![p(
            &format!("{L0}.mlp.down_proj.weight"),
            &[0, 64],
            &[64, 64],
            &[0, 0]
        )]
    );
}

#[test]
fn norms_are_replicated_over_tp_under_their_megatron_names() {
    let side = layout(&preset("qwen3-tiny"), &[("tp", 2)]).unwrap();
    for r in 0..2 {
        let rl = rank(side.as_ref(), r);
        for (local, canonical, n) in [
            (
                "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight",
                format!("{L0}.input_layernorm.weight"),
                64,
            ),
            (
                "decoder.layers.0.self_attention.q_layernorm.weight",
                format!("{L0}.self_attn.q_norm.weight"),
                16,
            ),
            (
                "decoder.layers.0.self_attention.k_layernorm.weight",
                format!("{L0}.self_attn.k_norm.weight"),
                16,
            ),
            (
                "decoder.layers.0.mlp.linear_fc1.layer_norm_weight",
                format!("{L0}.post_attention_layernorm.weight"),
                64,
            ),
            (
                "decoder.final_layernorm.weight",
                "model.norm.weight".to_string(),
                64,
            ),
        ] {
            let t = tensor(&rl, local);
            assert_eq!(t.shape, shape(&[n]), "{local}");
            assert_eq!(
                t.placements,
                vec![p(&canonical, &[0], &[n], &[0])],
                "{local}"
            );
        }
    }
    let h = side.holders(&format!("{L0}.input_layernorm.weight"));
    assert_eq!(h.len(), 1);
    assert_eq!(h[0].ranks, vec![RankId::train(0), RankId::train(1)]);
}

#[test]
fn one_layer_names_in_named_parameters_order() {
    let side = layout(&preset("qwen3-tiny"), &[]).unwrap();
    let rl = rank(side.as_ref(), 0);
    let names: Vec<&str> = rl.tensors.iter().map(|t| &*t.name).collect();
    assert_eq!(names.len(), 1 + 4 * 8 + 2);
    assert_eq!(
        &names[..10],
        &[
            "embedding.word_embeddings.weight",
            "decoder.layers.0.self_attention.linear_proj.weight",
            "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight",
            "decoder.layers.0.self_attention.linear_qkv.weight",
            "decoder.layers.0.self_attention.q_layernorm.weight",
            "decoder.layers.0.self_attention.k_layernorm.weight",
            "decoder.layers.0.mlp.linear_fc1.layer_norm_weight",
            "decoder.layers.0.mlp.linear_fc1.weight",
            "decoder.layers.0.mlp.linear_fc2.weight",
            "decoder.layers.1.self_attention.linear_proj.weight",
        ]
    );
    assert_eq!(
        &names[names.len() - 2..],
        &["decoder.final_layernorm.weight", "output_layer.weight"]
    );
}

fn layer_names(rl: &awex_core::layout::RankLayout) -> Vec<String> {
    rl.tensors.iter().map(|t| t.name.to_string()).collect()
}

#[test]
fn pipeline_stages_use_local_layer_indices() {
    // 4 layers over pp=2: stage 0 has layers 0, 1 and the embedding; stage 1 has 2, 3 as local 0, 1
    let side = layout(&preset("qwen3-tiny"), &[("pp", 2)]).unwrap();
    let s0 = rank(side.as_ref(), 0);
    let s1 = rank(side.as_ref(), 1);
    let n0 = layer_names(&s0);
    let n1 = layer_names(&s1);
    assert_eq!(n0[0], "embedding.word_embeddings.weight");
    assert_eq!(n0.len(), 1 + 2 * 8);
    assert!(
        !n0.iter()
            .any(|n| n.contains("final_layernorm") || n.contains("output_layer"))
    );
    assert_eq!(n1.len(), 2 * 8 + 2);
    assert!(!n1.iter().any(|n| n.contains("embedding")));
    assert_eq!(
        n1[n1.len() - 2..],
        ["decoder.final_layernorm.weight", "output_layer.weight"]
    );
    assert!(
        !n1.iter()
            .any(|n| n.contains("layers.2") || n.contains("layers.3"))
    );
    let t = tensor(&s1, "decoder.layers.1.self_attention.linear_proj.weight");
    assert_eq!(
        t.placements,
        vec![p(
            "model.layers.3.self_attn.o_proj.weight",
            &[0, 0],
            &[64, 64],
            &[0, 0]
        )]
    );
    // and the inverse: layer 3 lives on stage 1 under local index 1
    let h = side.holders("model.layers.3.self_attn.o_proj.weight");
    assert_eq!(h.len(), 1);
    assert_eq!(
        &*h[0].tensor,
        "decoder.layers.1.self_attention.linear_proj.weight"
    );
    assert_eq!(h[0].ranks, vec![RankId::train(1)]);
    let h = side.holders("model.norm.weight");
    assert_eq!(h[0].ranks, vec![RankId::train(1)]);
    let h = side.holders("model.embed_tokens.weight");
    assert_eq!(h[0].ranks, vec![RankId::train(0)]);
}

#[test]
fn explicit_first_and_last_stage_sizes() {
    // 4 layers, pp=3, first=1, last=1: middle stage gets 2
    let side = layout(
        &preset("qwen3-tiny"),
        &[
            ("pp", 3),
            ("first_stage_layers", 1),
            ("last_stage_layers", 1),
        ],
    )
    .unwrap();
    let q = |r: u32, local: u64| -> String {
        let rl = rank(side.as_ref(), r);
        tensor(
            &rl,
            &format!("decoder.layers.{local}.self_attention.linear_proj.weight"),
        )
        .placements[0]
            .canonical
            .to_string()
    };
    assert_eq!(q(0, 0), "model.layers.0.self_attn.o_proj.weight");
    assert_eq!(q(1, 0), "model.layers.1.self_attn.o_proj.weight");
    assert_eq!(q(1, 1), "model.layers.2.self_attn.o_proj.weight");
    assert_eq!(q(2, 0), "model.layers.3.self_attn.o_proj.weight");
    assert!(
        rank(side.as_ref(), 0)
            .tensor("decoder.layers.1.self_attention.linear_proj.weight")
            .is_none()
    );
    // only the last stage size given: the rest split evenly over the first two stages
    let side = layout(
        &preset("qwen3-tiny"),
        &[("pp", 3), ("last_stage_layers", 2)],
    )
    .unwrap();
    let h = side.holders("model.layers.1.input_layernorm.weight");
    assert_eq!(
        &*h[0].tensor,
        "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight"
    );
    assert_eq!(h[0].ranks, vec![RankId::train(1)]);
    let h = side.holders("model.layers.3.input_layernorm.weight");
    assert_eq!(
        &*h[0].tensor,
        "decoder.layers.1.self_attention.linear_qkv.layer_norm_weight"
    );
    assert_eq!(h[0].ranks, vec![RankId::train(2)]);
}

#[test]
fn tied_embeddings_with_pp_put_a_copy_in_output_layer() {
    let side = layout(&tied_tiny(), &[("tp", 2), ("pp", 2)]).unwrap();
    // rank 3 = tp 1 of stage 1
    let rl = rank(side.as_ref(), 3);
    let t = tensor(&rl, "output_layer.weight");
    assert_eq!(t.shape, shape(&[512, 64]));
    assert_eq!(
        t.placements,
        vec![p(
            "model.embed_tokens.weight",
            &[512, 0],
            &[488, 64],
            &[0, 0]
        )]
    );
    let mut h = side.holders("model.embed_tokens.weight");
    h.sort_by_key(|h| h.ranks[0]);
    let summary: Vec<(String, Vec<RankId>, Region)> = h
        .iter()
        .map(|h| (h.tensor.to_string(), h.ranks.clone(), h.region))
        .collect();
    let rows = |s: u64, n: u64| Region::new([s, 0], [n, 64]);
    assert_eq!(
        summary,
        vec![
            (
                "embedding.word_embeddings.weight".into(),
                vec![RankId::train(0)],
                rows(0, 512)
            ),
            (
                "embedding.word_embeddings.weight".into(),
                vec![RankId::train(1)],
                rows(512, 488)
            ),
            (
                "output_layer.weight".into(),
                vec![RankId::train(2)],
                rows(0, 512)
            ),
            (
                "output_layer.weight".into(),
                vec![RankId::train(3)],
                rows(512, 488)
            ),
        ]
    );
    assert!(side.holders("lm_head.weight").is_empty());
}

#[test]
fn tied_embeddings_without_pp_have_no_output_layer() {
    let side = layout(&tied_tiny(), &[("tp", 2)]).unwrap();
    for r in 0..2 {
        let rl = rank(side.as_ref(), r);
        assert!(rl.tensor("output_layer.weight").is_none());
        assert_eq!(
            rl.tensors.last().map(|t| &*t.name),
            Some("decoder.final_layernorm.weight")
        );
    }
    let h = side.holders("model.embed_tokens.weight");
    assert_eq!(h.len(), 2);
    assert!(
        h.iter()
            .all(|h| &*h.tensor == "embedding.word_embeddings.weight")
    );
}

#[test]
fn virtual_pipeline_chunks_are_prefixed_and_interleaved() {
    // 4 layers, pp=2, vpp=2: chunk c = layer c, on stage c % 2 as virtual chunk c / 2
    let side = layout(&preset("qwen3-tiny"), &[("pp", 2), ("vpp", 2)]).unwrap();
    let s0 = rank(side.as_ref(), 0);
    let n0 = layer_names(&s0);
    assert_eq!(n0[0], "model0.embedding.word_embeddings.weight");
    assert_eq!(
        n0[1],
        "model0.decoder.layers.0.self_attention.linear_proj.weight"
    );
    assert_eq!(
        n0[9],
        "model1.decoder.layers.0.self_attention.linear_proj.weight"
    );
    assert_eq!(n0.len(), 1 + 2 * 8);
    let proj = |rl: &awex_core::layout::RankLayout, name: &str| {
        tensor(rl, name).placements[0].canonical.to_string()
    };
    assert_eq!(
        proj(
            &s0,
            "model1.decoder.layers.0.self_attention.linear_proj.weight"
        ),
        "model.layers.2.self_attn.o_proj.weight"
    );
    let s1 = rank(side.as_ref(), 1);
    let n1 = layer_names(&s1);
    assert_eq!(
        n1[n1.len() - 2..],
        [
            "model1.decoder.final_layernorm.weight",
            "model1.output_layer.weight"
        ]
    );
    assert_eq!(
        proj(
            &s1,
            "model0.decoder.layers.0.self_attention.linear_proj.weight"
        ),
        "model.layers.1.self_attn.o_proj.weight"
    );
    assert_eq!(
        proj(
            &s1,
            "model1.decoder.layers.0.self_attention.linear_proj.weight"
        ),
        "model.layers.3.self_attn.o_proj.weight"
    );
    let h = side.holders("model.layers.2.mlp.down_proj.weight");
    assert_eq!(
        &*h[0].tensor,
        "model1.decoder.layers.0.mlp.linear_fc2.weight"
    );
    assert_eq!(h[0].ranks, vec![RankId::train(0)]);
}

#[test]
fn global_rank_order_is_tp_cp_dp_pp() {
    let model = preset("qwen3-tiny");
    let pairs = [("tp", 2), ("cp", 2), ("dp", 2), ("pp", 2)];
    let lay = MegatronLayout::new(&model, &pc(&pairs)).unwrap();
    assert_eq!(lay.world_size(), 16);
    let c = lay.coord(RankId::train(13)).unwrap();
    assert_eq!((c.tp, c.cp, c.dp, c.pp), (1, 0, 1, 1));
    let c = lay.coord(RankId::train(6)).unwrap();
    assert_eq!((c.tp, c.cp, c.dp, c.pp), (0, 1, 1, 0));
    assert!(lay.coord(RankId::train(16)).is_none());
    assert!(lay.coord(RankId::infer(1, 0)).is_none());
    // tp rank 1 of stage 1 (layer 3): replicas over cp and dp are 9, 11, 13, 15
    let mut h = lay.holders("model.layers.3.self_attn.o_proj.weight");
    h.sort_by_key(|h| h.ranks[0]);
    let t = |v: &[u32]| v.iter().map(|&r| RankId::train(r)).collect::<Vec<_>>();
    assert_eq!(h.len(), 2);
    assert_eq!(h[0].ranks, t(&[8, 10, 12, 14]));
    assert_eq!(h[1].ranks, t(&[9, 11, 13, 15]));
    assert_eq!(h[1].region, Region::new([0, 32], [64, 32]));
    // rank 13 holds the same shard as rank 9
    assert_eq!(
        rank(&lay, 13).tensors,
        rank(&lay, 9).tensors,
        "DP/CP replicas hold identical tensors"
    );
    assert!(lay.rank_layout(RankId::train(16)).is_none());
}

#[test]
fn experts_are_numbered_by_ep_rank_and_split_by_etp() {
    // qwen3-moe-tiny: 8 experts of moe_intermediate 32; tp=2, dp=2 => 4 ranks per stage; ep=2, etp=2
    let side = layout(
        &preset("qwen3-moe-tiny"),
        &[("tp", 2), ("dp", 2), ("ep", 2), ("etp", 2)],
    )
    .unwrap();
    // rank 2: stage-local 2 = etp 0 + 2 * (ep 1): experts 4..8, etp half 0
    let rl = rank(side.as_ref(), 2);
    let l1 = "model.layers.1.mlp.experts";
    let t = tensor(&rl, "decoder.layers.1.mlp.experts.linear_fc1.weight3");
    assert_eq!(t.shape, shape(&[32, 64]));
    assert_eq!(
        t.placements,
        vec![
            p(
                &format!("{l1}.7.gate_proj.weight"),
                &[0, 0],
                &[16, 64],
                &[0, 0]
            ),
            p(
                &format!("{l1}.7.up_proj.weight"),
                &[0, 0],
                &[16, 64],
                &[16, 0]
            ),
        ]
    );
    let t = tensor(&rl, "decoder.layers.1.mlp.experts.linear_fc2.weight0");
    assert_eq!(t.shape, shape(&[64, 16]));
    assert_eq!(
        t.placements,
        vec![p(
            &format!("{l1}.4.down_proj.weight"),
            &[0, 0],
            &[64, 16],
            &[0, 0]
        )]
    );
    assert!(
        rl.tensor("decoder.layers.1.mlp.experts.linear_fc1.weight4")
            .is_none()
    );
    // rank 3: etp 1 of ep 1
    let rl = rank(side.as_ref(), 3);
    let t = tensor(&rl, "decoder.layers.1.mlp.experts.linear_fc1.weight3");
    assert_eq!(
        t.placements,
        vec![
            p(
                &format!("{l1}.7.gate_proj.weight"),
                &[16, 0],
                &[16, 64],
                &[0, 0]
            ),
            p(
                &format!("{l1}.7.up_proj.weight"),
                &[16, 0],
                &[16, 64],
                &[16, 0]
            ),
        ]
    );

    // etp=1, ep=2 over 4 ranks: edp=2; expert 5 = ep 1, local 1, held by stage-local 1 and 3
    let side = layout(
        &preset("qwen3-moe-tiny"),
        &[("tp", 2), ("dp", 2), ("ep", 2), ("etp", 1)],
    )
    .unwrap();
    let h = side.holders(&format!("{l1}.5.up_proj.weight"));
    assert_eq!(
        h,
        vec![Holder {
            ranks: vec![RankId::train(1), RankId::train(3)],
            tensor: Arc::from("decoder.layers.1.mlp.experts.linear_fc1.weight1"),
            tensor_shape: shape(&[64, 64]),
            dtype: DType::Bf16,
            region: Region::new([0, 0], [32, 64]),
            local_offset: Dims::new(&[32, 0]),
            transposed: false,
        }]
    );
    let rl = rank(side.as_ref(), 1);
    let t = tensor(&rl, "decoder.layers.1.mlp.experts.linear_fc1.weight1");
    assert_eq!(
        t.placements,
        vec![
            p(
                &format!("{l1}.5.gate_proj.weight"),
                &[0, 0],
                &[32, 64],
                &[0, 0]
            ),
            p(
                &format!("{l1}.5.up_proj.weight"),
                &[0, 0],
                &[32, 64],
                &[32, 0]
            ),
        ]
    );
}

#[test]
fn router_is_replicated_on_every_rank_of_its_stage() {
    let side = layout(
        &preset("qwen3-moe-tiny"),
        &[("tp", 2), ("dp", 2), ("ep", 2), ("pp", 2)],
    )
    .unwrap();
    // layer 3 is on stage 1 (ranks 4..8) as local layer 1
    let h = side.holders("model.layers.3.mlp.gate.weight");
    assert_eq!(
        h,
        vec![Holder {
            ranks: (4..8).map(RankId::train).collect(),
            tensor: Arc::from("decoder.layers.1.mlp.router.weight"),
            tensor_shape: shape(&[8, 64]),
            dtype: DType::Bf16,
            region: Region::new([0, 0], [8, 64]),
            local_offset: Dims::new(&[0, 0]),
            transposed: false,
        }]
    );
    for r in 4..8 {
        let rl = rank(side.as_ref(), r);
        let t = tensor(&rl, "decoder.layers.1.mlp.router.weight");
        assert_eq!(
            t.placements,
            vec![p(
                "model.layers.3.mlp.gate.weight",
                &[0, 0],
                &[8, 64],
                &[0, 0]
            )]
        );
        let t = tensor(&rl, "decoder.layers.1.pre_mlp_layernorm.weight");
        assert_eq!(
            t.placements,
            vec![p(
                "model.layers.3.post_attention_layernorm.weight",
                &[0],
                &[64],
                &[0]
            )]
        );
    }
}

#[test]
fn moe_model_dense_layer_uses_dense_names() {
    let side = layout(&preset("qwen3-moe-tiny"), &[("ep", 1)]).unwrap();
    let rl = rank(side.as_ref(), 0);
    let names = layer_names(&rl);
    let layer = |i: u64| -> Vec<&str> {
        let prefix = format!("decoder.layers.{i}.");
        names
            .iter()
            .filter_map(|n| n.strip_prefix(&prefix))
            .collect()
    };
    assert_eq!(
        layer(0),
        vec![
            "self_attention.linear_proj.weight",
            "self_attention.linear_qkv.layer_norm_weight",
            "self_attention.linear_qkv.weight",
            "self_attention.q_layernorm.weight",
            "self_attention.k_layernorm.weight",
            "mlp.linear_fc1.layer_norm_weight",
            "mlp.linear_fc1.weight",
            "mlp.linear_fc2.weight",
        ]
    );
    let mut want1 = vec![
        "self_attention.linear_proj.weight",
        "self_attention.linear_qkv.layer_norm_weight",
        "self_attention.linear_qkv.weight",
        "self_attention.q_layernorm.weight",
        "self_attention.k_layernorm.weight",
        "pre_mlp_layernorm.weight",
        "mlp.router.weight",
    ];
    let fc: Vec<String> = (0..8)
        .map(|j| format!("mlp.experts.linear_fc1.weight{j}"))
        .chain((0..8).map(|j| format!("mlp.experts.linear_fc2.weight{j}")))
        .collect();
    want1.extend(fc.iter().map(String::as_str));
    assert_eq!(layer(1), want1);
    let t = tensor(&rl, "decoder.layers.0.mlp.linear_fc1.weight");
    assert_eq!(t.shape, shape(&[256, 64]));
    assert!(side.holders("model.layers.0.mlp.gate.weight").is_empty());
    assert!(
        side.holders("model.layers.1.mlp.gate_proj.weight")
            .is_empty()
    );
}

#[test]
fn fp32_key_makes_local_tensors_f32() {
    let side = layout(&preset("qwen3-tiny"), &[("fp32", 1)]).unwrap();
    let rl = rank(side.as_ref(), 0);
    assert!(rl.tensors.iter().all(|t| t.dtype == DType::F32));
    assert_eq!(
        tensor(&rl, "decoder.final_layernorm.weight").nbytes(),
        64 * 4
    );
    assert!(
        side.holders("model.norm.weight")
            .iter()
            .all(|h| h.dtype == DType::F32)
    );
}

#[test]
fn unknown_canonical_names_have_no_holders() {
    let side = layout(&preset("qwen3-tiny"), &[("tp", 2)]).unwrap();
    for name in [
        "model.layers.4.input_layernorm.weight",
        "model.layers.0.self_attn.q_proj.bias",
        "model.layers.0.mlp.experts.0.up_proj.weight",
        "model.layers.00.input_layernorm.weight",
        "something.else",
    ] {
        assert!(side.holders(name).is_empty(), "{name}");
    }
}

#[test]
fn backend_is_registered_as_megatron() {
    let b = awex_core::backend::training_backend("megatron").unwrap();
    assert_eq!(b.name(), "megatron");
    assert_eq!(b.python_packages(), &["megatron.core", "megatron"]);
    let keys: Vec<&str> = b.parallel_keys().iter().map(|k| k.name).collect();
    assert_eq!(
        keys,
        [
            "tp",
            "pp",
            "dp",
            "cp",
            "ep",
            "etp",
            "vpp",
            "first_stage_layers",
            "last_stage_layers",
            "fp32",
            "local_spec",
            "grouped_gemm",
            "single_grouped_weight"
        ]
    );
    let side = b
        .layout(&preset("qwen3-tiny"), &pc(&[("tp", 2), ("dp", 3)]))
        .unwrap();
    assert_eq!(side.world_size(), 6);
    assert_eq!(side.engines(), 1);
    assert_eq!(side.side(), awex_core::layout::Side::Training);
    assert_eq!(side.ranks(), (0..6).map(RankId::train).collect::<Vec<_>>());
    assert_eq!(awex_megatron::CRATE, "awex-megatron");
}
