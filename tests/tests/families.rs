//! A family added through its family file alone (Mixtral) gets every backend's own names: each
//! backend maps the family's parts, roles and fusions, and spells nothing of Mixtral itself.

use awex_core::backend::side_layout;
use awex_core::layout::{RankId, Side, SideLayout};
use awex_core::model::presets;
use awex_core::{BackendSpec, DType, ModelSpec};
use std::collections::BTreeMap;
use std::sync::Arc;

fn layout(side: Side, spec: &str, model: &ModelSpec) -> Arc<dyn SideLayout> {
    std::hint::black_box(awex_tests::link_backends());
    let s: BackendSpec = spec.parse().unwrap();
    side_layout(side, &s, model).unwrap_or_else(|e| panic!("{spec}: {e}"))
}

/// Rank `rank`'s local tensors: local name -> the canonical names placed in it.
fn tensors(l: &dyn SideLayout, rank: RankId) -> BTreeMap<String, Vec<String>> {
    let mut out = BTreeMap::new();
    for t in l.rank_layout(rank).unwrap().tensors {
        let mut c: Vec<String> = t
            .placements
            .iter()
            .map(|p| p.canonical.to_string())
            .collect();
        c.dedup();
        out.insert(t.name.to_string(), c);
    }
    out
}

fn mixtral() -> ModelSpec {
    presets::preset("mixtral-tiny").unwrap()
}

#[test]
fn sglang_holds_mixtral_experts_fused_under_block_sparse_moe() {
    let l = layout(Side::Inference, "sglang:tp=2,ep=2", &mixtral());
    let t = tensors(&*l, RankId::infer(0, 1));
    let p = "model.layers.3";
    // sglang/srt/models/mixtral.py: `block_sparse_moe.experts` is a FusedMoE, the gate a
    // ReplicatedLinear, the attention a QKVParallelLinear
    assert_eq!(
        t[&format!("{p}.block_sparse_moe.experts.w13_weight")],
        (4..8)
            .flat_map(
                |e| ["w1", "w3"].map(|w| format!("{p}.block_sparse_moe.experts.{e}.{w}.weight"))
            )
            .collect::<Vec<_>>()
    );
    assert_eq!(
        t[&format!("{p}.block_sparse_moe.experts.w2_weight")],
        (4..8)
            .map(|e| format!("{p}.block_sparse_moe.experts.{e}.w2.weight"))
            .collect::<Vec<_>>()
    );
    assert_eq!(
        t[&format!("{p}.block_sparse_moe.gate.weight")],
        vec![format!("{p}.block_sparse_moe.gate.weight")]
    );
    assert_eq!(t[&format!("{p}.self_attn.qkv_proj.weight")].len(), 3);
    assert!(!t.keys().any(|n| n.contains(".mlp.")), "{t:?}");
}

#[test]
fn vllm_holds_mixtral_experts_below_routed_experts() {
    let l = layout(Side::Inference, "vllm:tp=2,ep=2", &mixtral());
    let t = tensors(&*l, RankId::infer(0, 0));
    // vllm/model_executor/models/mixtral.py: `block_sparse_moe.experts` is a FusedMoE whose
    // runner holds the weights in `routed_experts`
    assert!(t.contains_key("model.layers.0.block_sparse_moe.experts.routed_experts.w13_weight"));
    assert!(t.contains_key("model.layers.0.block_sparse_moe.experts.routed_experts.w2_weight"));
    assert!(t.contains_key("model.layers.0.block_sparse_moe.gate.weight"));
}

#[test]
fn megatron_holds_mixtral_experts_in_its_own_names() {
    let l = layout(Side::Training, "megatron:tp=2,ep=2,etp=1", &mixtral());
    let t = tensors(&*l, RankId::train(1));
    assert_eq!(
        t["decoder.layers.0.mlp.router.weight"],
        vec!["model.layers.0.block_sparse_moe.gate.weight".to_string()]
    );
    // global experts 4..8 on EP rank 1, gate then up rows in linear_fc1
    assert_eq!(
        t["decoder.layers.0.mlp.experts.linear_fc1.weight0"],
        vec![
            "model.layers.0.block_sparse_moe.experts.4.w1.weight".to_string(),
            "model.layers.0.block_sparse_moe.experts.4.w3.weight".to_string()
        ]
    );
}

#[test]
fn fsdp_holds_mixtral_in_checkpoint_names_or_transformers_5_fused_experts() {
    let l = layout(Side::Training, "fsdp:dp=2", &mixtral());
    let t = tensors(&*l, RankId::train(0));
    let names: Vec<&String> = t.keys().collect();
    assert!(
        t.contains_key("model.layers.0.block_sparse_moe.experts.3.w2.weight"),
        "{names:?}"
    );
    // transformers 5 renames `block_sparse_moe` to `mlp` in memory (conversion_mapping.py) and
    // fuses the experts: `mlp.gate.weight`, `mlp.experts.gate_up_proj`, `mlp.experts.down_proj`
    let l = layout(Side::Training, "fsdp:dp=2,fused_experts=1", &mixtral());
    let t = tensors(&*l, RankId::train(1));
    assert_eq!(
        t["model.layers.0.mlp.gate.weight"],
        vec!["model.layers.0.block_sparse_moe.gate.weight".to_string()]
    );
    assert_eq!(
        t["model.layers.0.mlp.experts.gate_up_proj"],
        (4..8)
            .flat_map(|e| ["w1", "w3"]
                .map(|w| format!("model.layers.0.block_sparse_moe.experts.{e}.{w}.weight")))
            .collect::<Vec<_>>()
    );
    assert!(!t.keys().any(|n| n.contains("block_sparse_moe")), "{t:?}");
}

/// qwen3-tiny with attention_bias: q/k/v and o_proj biases (transformers' Qwen3).
fn qwen3_biased() -> ModelSpec {
    ModelSpec {
        attention_bias: true,
        ..presets::preset("qwen3-tiny").unwrap()
    }
}

#[test]
fn qwen3_o_proj_bias_is_whole_on_every_rank_of_megatron_fsdp_and_sglang() {
    let m = qwen3_biased();
    let o_bias = "model.layers.2.self_attn.o_proj.bias".to_string();
    // Megatron-Core: RowParallelLinear's bias is not split (added after the reduction)
    let l = layout(Side::Training, "megatron:tp=2", &m);
    for r in 0..2 {
        let t = tensors(&*l, RankId::train(r));
        assert_eq!(
            t["decoder.layers.2.self_attention.linear_proj.bias"],
            vec![o_bias.clone()]
        );
    }
    // FSDP + TP: transformers' rowwise plan replicates the bias over TP
    let l = layout(Side::Training, "fsdp:tp=2", &m);
    let h = l.holders(&o_bias);
    assert_eq!(h.len(), 1);
    assert_eq!(h[0].ranks.len(), 2);
    // SGLang 0.5.23 (models/qwen3.py): o_proj = RowParallelLinear(bias=attention_bias)
    let l = layout(Side::Inference, "sglang:tp=2", &m);
    for r in 0..2 {
        let t = tensors(&*l, RankId::infer(0, r));
        assert_eq!(t[&o_bias], vec![o_bias.clone()]);
    }
    assert!(l.dropped().is_empty());
}

#[test]
fn vllm_holds_no_qwen3_o_proj_bias_and_says_it_drops_it() {
    let m = qwen3_biased();
    let l = layout(Side::Inference, "vllm:tp=2", &m);
    let t = tensors(&*l, RankId::infer(0, 0));
    assert!(!t.keys().any(|n| n.contains("o_proj.bias")), "{t:?}");
    assert!(t.contains_key("model.layers.0.self_attn.qkv_proj.bias"));
    assert!(l.holders("model.layers.0.self_attn.o_proj.bias").is_empty());
    assert_eq!(
        l.dropped(),
        (0..4)
            .map(|i| format!("model.layers.{i}.self_attn.o_proj.bias"))
            .collect::<Vec<_>>()
    );
    // vLLM's Llama keeps the o_proj bias (models/llama.py: bias_o_proj = attention_bias)
    let llama = ModelSpec {
        architecture: awex_core::model::Architecture::Llama,
        ..m
    };
    let l = layout(Side::Inference, "vllm:tp=2", &llama);
    assert!(l.dropped().is_empty());
    assert_eq!(l.holders("model.layers.0.self_attn.o_proj.bias").len(), 1);
}

#[test]
fn a_plan_into_vllm_moves_everything_but_the_dropped_tensors() {
    let m = qwen3_biased();
    let cat = awex_core::Catalogue::of(&m);
    let t = layout(Side::Training, "megatron:tp=2", &m);
    let i = layout(Side::Inference, "vllm:tp=2", &m);
    let pair = awex_core::plan::Pair {
        catalogue: &cat,
        training: &*t,
        inference: &*i,
        encode_on_sender: false,
    };
    let mut moved = 0;
    for r in i.ranks() {
        let plan = pair.plan_rank(Side::Inference, r).unwrap();
        for peer in &plan.peers {
            for tr in &peer.transfers {
                assert!(!tr.dst_tensor.contains("o_proj.bias"), "{}", tr.dst_tensor);
            }
        }
        moved += plan.bytes();
    }
    assert!(moved > 0);
}

fn glm() -> ModelSpec {
    presets::preset("glm-4.5-tiny").unwrap()
}

/// Rank `rank`'s local tensors: local name -> (shape, dtype, canonical names placed in it).
fn shaped(l: &dyn SideLayout, rank: RankId) -> BTreeMap<String, (Vec<u64>, DType, Vec<String>)> {
    let mut out = BTreeMap::new();
    for t in l.rank_layout(rank).unwrap().tensors {
        let mut c: Vec<String> = t
            .placements
            .iter()
            .map(|p| p.canonical.to_string())
            .collect();
        c.dedup();
        out.insert(
            t.name.to_string(),
            (t.shape.as_slice().to_vec(), t.dtype, c),
        );
    }
    out
}

fn strings(v: &[&str]) -> Vec<String> {
    v.iter().map(|s| s.to_string()).collect()
}

#[test]
fn sglang_holds_glm_shared_experts_apart_or_fused_as_one_more_expert_as_told() {
    let m = glm();
    let p = "model.layers.1";
    // sglang/srt/models/glm4_moe.py: Glm4MoeGate holds weight and e_score_correction_bias in
    // fp32; Glm4MoeAttention's qkv_proj has the biases, o_proj none; the shared experts are a
    // Glm4MoeMLP (gate_up_proj, down_proj) unless fused
    let l = layout(Side::Inference, "sglang:tp=2,fused_shared_experts=0", &m);
    let t = shaped(&*l, RankId::infer(0, 1));
    assert_eq!(
        t[&format!("{p}.mlp.gate.weight")],
        (
            vec![8, 64],
            DType::F32,
            strings(&[&format!("{p}.mlp.gate.weight")])
        )
    );
    assert_eq!(
        t[&format!("{p}.mlp.gate.e_score_correction_bias")],
        (
            vec![8],
            DType::F32,
            strings(&[&format!("{p}.mlp.gate.e_score_correction_bias")])
        )
    );
    assert_eq!(
        t[&format!("{p}.mlp.shared_experts.gate_up_proj.weight")],
        (
            vec![32, 64],
            DType::Bf16,
            strings(&[
                &format!("{p}.mlp.shared_experts.gate_proj.weight"),
                &format!("{p}.mlp.shared_experts.up_proj.weight")
            ])
        )
    );
    assert_eq!(
        t[&format!("{p}.mlp.shared_experts.down_proj.weight")].0,
        vec![64, 16]
    );
    assert_eq!(t[&format!("{p}.mlp.experts.w13_weight")].0, vec![8, 32, 64]);
    assert_eq!(t[&format!("{p}.mlp.experts.w2_weight")].0, vec![8, 64, 16]);
    // 2 of 4 query heads and 1 of 2 KV heads, head_dim 16
    assert_eq!(t[&format!("{p}.self_attn.qkv_proj.bias")].0, vec![64]);
    assert_eq!(t["model.layers.0.self_attn.q_norm.weight"].0, vec![16]);
    // layer 0 is dense (first_k_dense_replace)
    assert_eq!(t["model.layers.0.mlp.gate_up_proj.weight"].0, vec![128, 64]);
    assert!(!t.keys().any(|n| n.contains("o_proj.bias")), "{t:?}");
    assert!(!t.contains_key("model.layers.0.mlp.gate.weight"));
    // the second half of the shared experts' rows on TP rank 1
    let h = l.holders(&format!("{p}.mlp.shared_experts.up_proj.weight"));
    assert_eq!(h.len(), 2);
    assert_eq!(h[1].region.offset.as_slice(), &[16, 0]);
    assert_eq!(h[1].local_offset.as_slice(), &[16, 0]);

    // fused (SGLang's default at ep=1 on NVIDIA sm80+): expert 8 of w13/w2 is the shared one
    let l = layout(Side::Inference, "sglang:tp=2,fused_shared_experts=1", &m);
    let t = shaped(&*l, RankId::infer(0, 0));
    let (shape, _, names) = &t[&format!("{p}.mlp.experts.w13_weight")];
    assert_eq!(shape, &vec![9, 32, 64]);
    assert_eq!(
        names[16..],
        strings(&[
            &format!("{p}.mlp.shared_experts.gate_proj.weight"),
            &format!("{p}.mlp.shared_experts.up_proj.weight")
        ])
    );
    assert_eq!(t[&format!("{p}.mlp.experts.w2_weight")].0, vec![9, 64, 16]);
    assert!(!t.keys().any(|n| n.contains("shared_experts")), "{t:?}");
    let h = l.holders(&format!("{p}.mlp.shared_experts.down_proj.weight"));
    assert_eq!(h.len(), 2);
    assert_eq!(&*h[1].tensor, &format!("{p}.mlp.experts.w2_weight"));
    assert_eq!(h[1].local_offset.as_slice(), &[8, 0, 0]);
    assert_eq!(h[1].region.offset.as_slice(), &[0, 16]);
}

#[test]
fn sglang_refuses_glm_at_ep_1_until_told_whether_shared_experts_are_fused() {
    let m = glm();
    let err = |spec: &str| {
        let s: BackendSpec = spec.parse().unwrap();
        match side_layout(Side::Inference, &s, &m) {
            Ok(_) => panic!("{spec} accepted"),
            Err(e) => e.to_string(),
        }
    };
    let e = err("sglang:tp=2");
    assert!(
        e.contains("Glm4MoeForCausalLM has shared experts")
            && e.contains("fused_shared_experts=1 or fused_shared_experts=0"),
        "{e}"
    );
    let e = err("sglang:tp=2,ep=2,fused_shared_experts=1");
    assert!(
        e.contains("fused_shared_experts=1 with Glm4MoeForCausalLM at ep=2")
            && e.contains("at ep=1 only on NVIDIA"),
        "{e}"
    );
    let e = err("sglang:tp=2,fused_shared_experts=2");
    assert!(e.contains("use 1"), "{e}");
    // with expert parallelism SGLang keeps them apart on NVIDIA: no need to say
    let l = layout(Side::Inference, "sglang:tp=2,ep=2", &m);
    let t = tensors(&*l, RankId::infer(0, 1));
    assert_eq!(
        t["model.layers.2.mlp.experts.w2_weight"],
        (4..8)
            .map(|e| format!("model.layers.2.mlp.experts.{e}.down_proj.weight"))
            .collect::<Vec<_>>()
    );
    assert!(t.contains_key("model.layers.2.mlp.shared_experts.gate_up_proj.weight"));
    // a model without shared experts needs no word about them
    layout(
        Side::Inference,
        "sglang:tp=2",
        &presets::preset("mixtral-tiny").unwrap(),
    );
}

#[test]
fn vllm_holds_glm_shared_experts_apart_and_the_router_in_fp32() {
    // vllm/model_executor/models/glm4_moe.py: GateLinear(params_dtype=torch.float32), an fp32
    // e_score_correction_bias, shared experts a Glm4MoeMLP unless ROCm AITER fuses them
    let l = layout(Side::Inference, "vllm:tp=2,ep=2", &glm());
    let t = shaped(&*l, RankId::infer(0, 0));
    let p = "model.layers.2.mlp";
    assert_eq!(t[&format!("{p}.gate.weight")].1, DType::F32);
    assert_eq!(
        t[&format!("{p}.gate.e_score_correction_bias")].1,
        DType::F32
    );
    assert_eq!(
        t[&format!("{p}.experts.routed_experts.w13_weight")].0,
        vec![4, 64, 64]
    );
    assert_eq!(
        t[&format!("{p}.shared_experts.gate_up_proj.weight")].0,
        vec![32, 64]
    );
    assert!(l.dropped().is_empty());
}

#[test]
fn megatron_holds_glm_shared_experts_expert_bias_and_dense_first_layer_in_its_names() {
    let l = layout(Side::Training, "megatron:tp=2,ep=2,etp=1", &glm());
    let t = shaped(&*l, RankId::train(1));
    let p = "decoder.layers.1.mlp";
    // megatron/core/transformer/moe: TopKRouter's fp32 `expert_bias` buffer, SharedExpertMLP's
    // linear_fc1 ([gate | up] rows of the TP rank) and linear_fc2
    assert_eq!(
        t[&format!("{p}.router.expert_bias")],
        (
            vec![8],
            DType::F32,
            strings(&["model.layers.1.mlp.gate.e_score_correction_bias"])
        )
    );
    assert_eq!(t[&format!("{p}.router.weight")].1, DType::Bf16);
    assert_eq!(
        t[&format!("{p}.shared_experts.linear_fc1.weight")],
        (
            vec![32, 64],
            DType::Bf16,
            strings(&[
                "model.layers.1.mlp.shared_experts.gate_proj.weight",
                "model.layers.1.mlp.shared_experts.up_proj.weight"
            ])
        )
    );
    assert_eq!(
        t[&format!("{p}.shared_experts.linear_fc2.weight")].0,
        vec![64, 16]
    );
    let h = l.holders("model.layers.1.mlp.shared_experts.up_proj.weight");
    assert_eq!(h.len(), 2);
    assert_eq!(h[1].region.offset.as_slice(), &[16, 0]);
    // layer 0 dense (moe_layer_freq [0, 1, 1]): Transformer Engine's fused norm in linear_fc1
    assert_eq!(t["decoder.layers.0.mlp.linear_fc1.weight"].0, vec![128, 64]);
    assert!(t.contains_key("decoder.layers.0.mlp.linear_fc1.layer_norm_weight"));
    assert!(t.contains_key("decoder.layers.0.self_attention.linear_qkv.bias"));
    assert!(t.contains_key("decoder.layers.0.self_attention.q_layernorm.weight"));
    assert!(!t.contains_key("decoder.layers.0.self_attention.linear_proj.bias"));
    assert_eq!(
        t["decoder.layers.2.mlp.experts.linear_fc1.weight0"].2,
        strings(&[
            "model.layers.2.mlp.experts.4.gate_proj.weight",
            "model.layers.2.mlp.experts.4.up_proj.weight"
        ])
    );
}

#[test]
fn fsdp_holds_glm_in_checkpoint_names_with_the_fp32_router_bias_buffer() {
    let l = layout(Side::Training, "fsdp:tp=2", &glm());
    let t = shaped(&*l, RankId::train(1));
    let p = "model.layers.1.mlp";
    assert_eq!(t[&format!("{p}.gate.e_score_correction_bias")].0, vec![8]);
    assert_eq!(
        t[&format!("{p}.gate.e_score_correction_bias")].1,
        DType::F32
    );
    // transformers' TP plan: shared_experts gate/up colwise, down rowwise
    assert_eq!(
        t[&format!("{p}.shared_experts.gate_proj.weight")].0,
        vec![16, 64]
    );
    assert_eq!(
        t[&format!("{p}.shared_experts.down_proj.weight")].0,
        vec![64, 16]
    );
    let l = layout(Side::Training, "fsdp:dp=2,fused_experts=1", &glm());
    let t = shaped(&*l, RankId::train(1));
    assert_eq!(t[&format!("{p}.experts.gate_up_proj")].0, vec![4, 64, 64]);
    // a buffer: fully_shard leaves it whole on every rank (the router's weight is sharded)
    assert_eq!(t[&format!("{p}.gate.e_score_correction_bias")].0, vec![8]);
    assert_eq!(t[&format!("{p}.gate.weight")].0, vec![4, 64]);
    let h = l.holders(&format!("{p}.gate.e_score_correction_bias"));
    assert_eq!(h.len(), 1);
    assert_eq!(h[0].ranks.len(), 2);
    assert!(t.contains_key("model.layers.0.mlp.gate_proj.weight"));
}

// ---- DeepSeek-V3 on the training side (MLA in Megatron-Core's and FSDP's names) ----

#[test]
fn megatron_holds_deepseek_mla_in_its_names_with_down_projections_by_spec() {
    let m = presets::preset("deepseek-v3-tiny").unwrap();
    // megatron/core/transformer/multi_latent_attention.py, MLASelfAttention: with Transformer
    // Engine the down projections are TELinear(parallel_mode='duplicated') and the latent norms
    // are fused into the up projections; the up projections are column-parallel over heads
    let l = layout(Side::Training, "megatron:tp=2,ep=2,etp=1", &m);
    let t = shaped(&*l, RankId::train(1));
    let p = "decoder.layers.1.self_attention";
    assert_eq!(
        t[&format!("{p}.linear_q_down_proj.weight")],
        (
            vec![32, 64],
            DType::Bf16,
            strings(&["model.layers.1.self_attn.q_a_proj.weight"])
        )
    );
    assert_eq!(
        t[&format!("{p}.linear_q_up_proj.layer_norm_weight")].2,
        strings(&["model.layers.1.self_attn.q_a_layernorm.weight"])
    );
    assert_eq!(t[&format!("{p}.linear_q_up_proj.weight")].0, vec![48, 32]);
    assert_eq!(
        t[&format!("{p}.linear_kv_down_proj.weight")].0,
        vec![24, 64]
    );
    assert_eq!(
        t[&format!("{p}.linear_kv_up_proj.layer_norm_weight")].2,
        strings(&["model.layers.1.self_attn.kv_a_layernorm.weight"])
    );
    assert_eq!(t[&format!("{p}.linear_kv_up_proj.weight")].0, vec![64, 16]);
    assert_eq!(t[&format!("{p}.linear_proj.weight")].0, vec![64, 32]);
    assert_eq!(
        t["decoder.layers.1.input_layernorm.weight"].2,
        strings(&["model.layers.1.input_layernorm.weight"])
    );
    assert_eq!(
        t["decoder.layers.1.mlp.router.expert_bias"],
        (
            vec![8],
            DType::F32,
            strings(&["model.layers.1.mlp.gate.e_score_correction_bias"])
        )
    );
    assert!(t.contains_key("decoder.layers.0.mlp.linear_fc1.layer_norm_weight"));
    // the local spec: ColumnParallelLinear down projections, q_layernorm / kv_layernorm modules
    let l = layout(Side::Training, "megatron:tp=2,local_spec=1", &m);
    let t = shaped(&*l, RankId::train(1));
    assert_eq!(t[&format!("{p}.linear_q_down_proj.weight")].0, vec![16, 64]);
    assert_eq!(
        t[&format!("{p}.linear_kv_down_proj.weight")].0,
        vec![12, 64]
    );
    assert_eq!(
        t[&format!("{p}.kv_layernorm.weight")].2,
        strings(&["model.layers.1.self_attn.kv_a_layernorm.weight"])
    );
    assert_eq!(
        t[&format!("{p}.q_layernorm.weight")].2,
        strings(&["model.layers.1.self_attn.q_a_layernorm.weight"])
    );
}

#[test]
fn fsdp_holds_deepseek_in_checkpoint_names_and_refuses_tp() {
    let m = presets::preset("deepseek-v3-tiny").unwrap();
    let l = layout(Side::Training, "fsdp:dp=2,fused_experts=1", &m);
    let t = shaped(&*l, RankId::train(0));
    assert_eq!(
        t["model.layers.1.self_attn.kv_b_proj.weight"].0,
        vec![64, 16]
    );
    assert_eq!(
        t["model.layers.1.mlp.gate.e_score_correction_bias"],
        (
            vec![8],
            DType::F32,
            strings(&["model.layers.1.mlp.gate.e_score_correction_bias"])
        )
    );
    let s: BackendSpec = "fsdp:tp=2".parse().unwrap();
    let e = side_layout(Side::Training, &s, &m)
        .err()
        .unwrap()
        .to_string();
    assert!(
        e.contains("fsdp tp=2 with DeepseekV3ForCausalLM's multi-latent attention"),
        "{e}"
    );
}

// ---- DeepSeek-V3 (MLA) on the inference engines ----

fn deepseek() -> ModelSpec {
    presets::preset("deepseek-v3-tiny").unwrap()
}

fn deepseek_without_q_lora() -> ModelSpec {
    let mut m = deepseek();
    m.mla.as_mut().unwrap().q_lora_rank = None;
    m
}

#[test]
fn sglang_holds_deepseek_mla_fused_down_projection_and_head_split_up_projections() {
    let m = deepseek();
    // sglang/srt/models/deepseek_v2.py, DeepseekV2AttentionMLA: fused_qkv_a_proj_with_mqa a
    // ReplicatedLinear of q_lora_rank + kv_lora_rank + qk_rope_head_dim rows (32 + 16 + 8),
    // filled by the loader with cat([q_a_proj, kv_a_proj_with_mqa]); q_b_proj and kv_b_proj
    // ColumnParallelLinear (2 of 4 heads per rank: 2 * (16 + 8) and 2 * (16 + 16) rows);
    // o_proj RowParallelLinear (2 heads of v_head_dim 16)
    let l = layout(Side::Inference, "sglang:tp=2,fused_shared_experts=0", &m);
    for r in 0..2 {
        let t = shaped(&*l, RankId::infer(0, r));
        let a = "model.layers.1.self_attn";
        assert_eq!(
            t[&format!("{a}.fused_qkv_a_proj_with_mqa.weight")],
            (
                vec![56, 64],
                DType::Bf16,
                strings(&[
                    &format!("{a}.q_a_proj.weight"),
                    &format!("{a}.kv_a_proj_with_mqa.weight")
                ])
            )
        );
        assert_eq!(t[&format!("{a}.q_a_layernorm.weight")].0, vec![32]);
        assert_eq!(t[&format!("{a}.q_b_proj.weight")].0, vec![48, 32]);
        assert_eq!(t[&format!("{a}.kv_a_layernorm.weight")].0, vec![16]);
        assert_eq!(t[&format!("{a}.kv_b_proj.weight")].0, vec![64, 16]);
        assert_eq!(t[&format!("{a}.o_proj.weight")].0, vec![64, 32]);
        assert!(!t.keys().any(|n| n.contains("qkv_proj")), "{t:?}");
        // DeepseekV2MoE: MoEGate's weight in the model's dtype (router_fp32 unset), its
        // e_score_correction_bias fp32 (topk_method noaux_tc); layer 0 dense
        let p = "model.layers.1.mlp";
        assert_eq!(t[&format!("{p}.gate.weight")].1, DType::Bf16);
        assert_eq!(
            t[&format!("{p}.gate.e_score_correction_bias")],
            (
                vec![8],
                DType::F32,
                strings(&[&format!("{p}.gate.e_score_correction_bias")])
            )
        );
        assert_eq!(t[&format!("{p}.experts.w13_weight")].0, vec![8, 32, 64]);
        assert_eq!(
            t[&format!("{p}.shared_experts.gate_up_proj.weight")].0,
            vec![32, 64]
        );
        assert_eq!(t["model.layers.0.mlp.gate_up_proj.weight"].0, vec![128, 64]);
        // untied: SGLang's own ParallelLMHead
        assert_eq!(t["lm_head.weight"].0, vec![512, 64]);
    }
    // the query down projection is rows 0..32 of the fused tensor on every rank, the key/value
    // down projection (with the rotary key) rows 32..56
    let a = "model.layers.2.self_attn";
    let h = l.holders(&format!("{a}.kv_a_proj_with_mqa.weight"));
    assert_eq!(h.len(), 1);
    assert_eq!(h[0].ranks.len(), 2);
    assert_eq!(
        &*h[0].tensor,
        &format!("{a}.fused_qkv_a_proj_with_mqa.weight")
    );
    assert_eq!(h[0].local_offset.as_slice(), &[32, 0]);
    assert_eq!(h[0].region.extent.as_slice(), &[24, 64]);
    // heads 2 and 3 of kv_b_proj on rank 1: rows 64..128
    let h = l.holders(&format!("{a}.kv_b_proj.weight"));
    assert_eq!(h.len(), 2);
    assert_eq!(h[1].region.offset.as_slice(), &[64, 0]);
    assert_eq!(h[1].region.extent.as_slice(), &[64, 16]);
    // o_proj: rank 1 holds the value columns of heads 2 and 3
    let h = l.holders(&format!("{a}.o_proj.weight"));
    assert_eq!(h[1].region.offset.as_slice(), &[0, 32]);
}

#[test]
fn sglang_holds_deepseek_without_q_lora_rank_as_plain_q_proj_and_kv_a_proj() {
    let m = deepseek_without_q_lora();
    // DeepseekV2AttentionMLA without q_lora_rank: q_proj a ColumnParallelLinear,
    // kv_a_proj_with_mqa a ReplicatedLinear, nothing fused (the loader fuses only with
    // q_lora_rank)
    let l = layout(Side::Inference, "sglang:tp=2,ep=2", &m);
    let t = shaped(&*l, RankId::infer(0, 1));
    let a = "model.layers.0.self_attn";
    assert_eq!(
        t[&format!("{a}.q_proj.weight")],
        (
            vec![48, 64],
            DType::Bf16,
            strings(&[&format!("{a}.q_proj.weight")])
        )
    );
    assert_eq!(t[&format!("{a}.kv_a_proj_with_mqa.weight")].0, vec![24, 64]);
    assert!(!t.keys().any(|n| n.contains("fused_qkv_a_proj")), "{t:?}");
    assert!(!t.keys().any(|n| n.contains("q_a_")), "{t:?}");
    let h = l.holders(&format!("{a}.q_proj.weight"));
    assert_eq!(h.len(), 2);
    assert_eq!(h[1].region.offset.as_slice(), &[48, 0]);
    // ep=2: 4 of 8 experts per rank, the shared experts apart (fusion is off under EP)
    assert_eq!(
        t["model.layers.1.mlp.experts.w13_weight"].0,
        vec![4, 64, 64]
    );
}

#[test]
fn sglang_fuses_deepseek_shared_experts_only_when_told_and_ties_the_head_to_the_embedding() {
    let m = deepseek();
    let e = match side_layout(
        Side::Inference,
        &"sglang:tp=2".parse::<BackendSpec>().unwrap(),
        &m,
    ) {
        Ok(_) => panic!("accepted"),
        Err(e) => e.to_string(),
    };
    assert!(
        e.contains("fused_shared_experts=1 or fused_shared_experts=0"),
        "{e}"
    );
    let l = layout(Side::Inference, "sglang:tp=2,fused_shared_experts=1", &m);
    let t = shaped(&*l, RankId::infer(0, 0));
    let p = "model.layers.2.mlp";
    assert_eq!(t[&format!("{p}.experts.w13_weight")].0, vec![9, 32, 64]);
    assert!(!t.keys().any(|n| n.contains("shared_experts")), "{t:?}");
    // tied: DeepseekV2ForCausalLM makes lm_head the embedding module itself (listed once)
    let tied = ModelSpec {
        tie_word_embeddings: true,
        ..m
    };
    let l = layout(Side::Inference, "sglang:tp=2,fused_shared_experts=0", &tied);
    let t = shaped(&*l, RankId::infer(0, 0));
    assert!(!t.contains_key("lm_head.weight"), "{t:?}");
    assert_eq!(l.holders("model.embed_tokens.weight").len(), 2);
}

#[test]
fn vllm_holds_deepseek_mla_as_fused_qkv_a_proj_and_experts_below_routed_experts() {
    // vllm/model_executor/models/deepseek_v2.py, DeepseekV2MLAAttention: fused_qkv_a_proj a
    // DeepSeekV2FusedQkvAProjLinear (MergedColumnParallelLinear, disable_tp) of
    // [q_lora_rank, kv_lora_rank + qk_rope_head_dim] rows; q_b_proj / kv_b_proj column, o_proj
    // row; DeepseekV2MoE: GateLinear in the model's dtype, the fp32 e_score_correction_bias, the
    // shared experts a DeepseekV2MLP, the routed ones in the MoERunner's routed_experts
    let m = deepseek();
    let l = layout(Side::Inference, "vllm:tp=2", &m);
    let t = shaped(&*l, RankId::infer(0, 1));
    let a = "model.layers.1.self_attn";
    assert_eq!(
        t[&format!("{a}.fused_qkv_a_proj.weight")],
        (
            vec![56, 64],
            DType::Bf16,
            strings(&[
                &format!("{a}.q_a_proj.weight"),
                &format!("{a}.kv_a_proj_with_mqa.weight")
            ])
        )
    );
    assert_eq!(t[&format!("{a}.q_b_proj.weight")].0, vec![48, 32]);
    assert_eq!(t[&format!("{a}.kv_b_proj.weight")].0, vec![64, 16]);
    assert_eq!(t[&format!("{a}.o_proj.weight")].0, vec![64, 32]);
    let p = "model.layers.1.mlp";
    assert_eq!(t[&format!("{p}.gate.weight")].1, DType::Bf16);
    assert_eq!(
        t[&format!("{p}.gate.e_score_correction_bias")].1,
        DType::F32
    );
    assert_eq!(
        t[&format!("{p}.experts.routed_experts.w13_weight")].0,
        vec![8, 32, 64]
    );
    assert_eq!(
        t[&format!("{p}.shared_experts.gate_up_proj.weight")].0,
        vec![32, 64]
    );
    // without q_lora_rank: q_proj and kv_a_proj_with_mqa apart
    let l = layout(
        Side::Inference,
        "vllm:tp=2,ep=2",
        &deepseek_without_q_lora(),
    );
    let t = shaped(&*l, RankId::infer(0, 0));
    assert_eq!(t[&format!("{a}.q_proj.weight")].0, vec![48, 64]);
    assert_eq!(t[&format!("{a}.kv_a_proj_with_mqa.weight")].0, vec![24, 64]);
    assert!(!t.keys().any(|n| n.contains("fused_qkv_a_proj")), "{t:?}");
    assert_eq!(
        t[&format!("{p}.experts.routed_experts.w13_weight")].0,
        vec![4, 64, 64]
    );
    // DeepseekV2ForCausalLM always builds its own ParallelLMHead (never tied): a tied config's
    // head is a copy of the embedding
    let tied = ModelSpec {
        tie_word_embeddings: true,
        ..deepseek()
    };
    let l = layout(Side::Inference, "vllm:tp=2", &tied);
    let t = shaped(&*l, RankId::infer(0, 0));
    assert_eq!(
        t["lm_head.weight"].2,
        strings(&["model.embed_tokens.weight"])
    );
}

#[test]
fn sglang_and_vllm_lay_out_kimi_k2_at_tp16_ep16() {
    // Kimi-K2 (1T): 64 heads, 384 routed experts + 1 shared, q_lora_rank 1536, kv_lora_rank 512
    let m = presets::preset("kimi-k2").unwrap();
    for spec in ["sglang:tp=16,ep=16", "vllm:tp=16,ep=16"] {
        let l = layout(Side::Inference, spec, &m);
        let t = shaped(&*l, RankId::infer(0, 15));
        let a = "model.layers.60.self_attn";
        let down = if spec.starts_with("sglang") {
            "fused_qkv_a_proj_with_mqa"
        } else {
            "fused_qkv_a_proj"
        };
        // 1536 + 512 + 64 rows, whole on every rank
        assert_eq!(
            t[&format!("{a}.{down}.weight")].0,
            vec![2112, 7168],
            "{spec}"
        );
        // 4 of 64 heads: 4 * (128 + 64) query rows, 4 * (128 + 128) key/value rows
        assert_eq!(
            t[&format!("{a}.q_b_proj.weight")].0,
            vec![768, 1536],
            "{spec}"
        );
        assert_eq!(
            t[&format!("{a}.kv_b_proj.weight")].0,
            vec![1024, 512],
            "{spec}"
        );
        assert_eq!(
            t[&format!("{a}.o_proj.weight")].0,
            vec![7168, 512],
            "{spec}"
        );
        // experts 360..384 on the last rank
        let w13 = t
            .iter()
            .find(|(n, _)| {
                n.starts_with("model.layers.60.mlp.experts") && n.ends_with("w13_weight")
            })
            .unwrap();
        assert_eq!(w13.1.0, vec![24, 4096, 7168], "{spec}");
        assert!(w13.1.2[0].contains(".360."), "{spec}: {:?}", &w13.1.2[..2]);
    }
}

// ---- transformers' dtype rules on the FSDP side, converted where an engine holds another ----

/// A DeepSeek-V2-Lite-shaped model (no q_lora_rank, no router bias), bf16.
fn deepseek_v2_tiny() -> ModelSpec {
    ModelSpec::from_config_value(&serde_json::json!({
        "architectures": ["DeepseekV2ForCausalLM"],
        "hidden_size": 64, "num_hidden_layers": 3, "num_attention_heads": 4,
        "num_key_value_heads": 4, "intermediate_size": 128, "vocab_size": 1000,
        "moe_intermediate_size": 32, "n_routed_experts": 8, "num_experts_per_tok": 2,
        "n_shared_experts": 2, "first_k_dense_replace": 1, "q_lora_rank": null,
        "kv_lora_rank": 16, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16,
        "tie_word_embeddings": false, "torch_dtype": "bfloat16"
    }))
    .unwrap()
}

#[test]
fn fsdp_routers_follow_the_transformers_release_and_plans_convert_to_each_engines_dtype() {
    // transformers 5.24 keeps DeepSeek-V2/V3 (Kimi-K2) and GLM-4.5 routers in fp32
    // (`_keep_in_fp32_modules_strict`), 5.19 in the model's dtype; SGLang's and vLLM's gates
    // are bf16 for DeepSeek (MoEGate / GateLinear in the model's dtype) and fp32 for GLM-4.5
    // (router_fp32): the sender narrows or widens exactly there and nowhere else
    let router = "model.layers.1.mlp.gate.weight";
    let bias = "model.layers.1.mlp.gate.e_score_correction_bias";
    for (m, engine_router) in [
        (deepseek(), DType::Bf16),
        (deepseek_without_q_lora(), DType::Bf16),
        (deepseek_v2_tiny(), DType::Bf16),
        (glm(), DType::F32),
    ] {
        assert_eq!(m.dtype, DType::Bf16, "{}", m.name);
        let cat = awex_core::Catalogue::of(&m);
        for (release, train_router) in [
            ("", DType::Bf16),
            (",transformers=519", DType::Bf16),
            (",transformers=523", DType::Bf16),
            (",transformers=524", DType::F32),
            (",transformers=525", DType::F32),
        ] {
            let what = format!("{} fsdp{release}", m.name);
            let t = layout(
                Side::Training,
                &format!("fsdp:dp=2,fused_experts=1{release}"),
                &m,
            );
            for r in 0..2 {
                let held = shaped(&*t, RankId::train(r));
                assert_eq!(held[router].1, train_router, "{what}");
                assert_eq!(held[router].0, vec![4, 64], "{what}");
                if m.moe.as_ref().is_some_and(|x| x.router_bias) {
                    assert_eq!(held[bias].1, DType::F32, "{what}");
                }
                // every layer's router likewise, and nothing else leaves the model's dtype
                for (n, (_, d, _)) in &held {
                    let want = if n.ends_with(".mlp.gate.weight") {
                        train_router
                    } else if n.ends_with(".mlp.gate.e_score_correction_bias") {
                        DType::F32
                    } else {
                        DType::Bf16
                    };
                    assert_eq!(*d, want, "{what}: {n}");
                }
            }
            assert!(t.holders(router).iter().all(|h| h.dtype == train_router));
            for infer in ["sglang:tp=2,fused_shared_experts=0", "vllm:tp=2"] {
                let i = layout(Side::Inference, infer, &m);
                let pair = awex_core::plan::Pair {
                    catalogue: &cat,
                    training: &*t,
                    inference: &*i,
                    encode_on_sender: false,
                };
                let mut routers = 0;
                for r in i.ranks() {
                    let plan = pair.plan_rank(Side::Inference, r).unwrap();
                    for tr in plan.peers.iter().flat_map(|p| &p.transfers) {
                        let want = if tr.dst_tensor.ends_with("mlp.gate.weight") {
                            routers += 1;
                            (train_router, engine_router)
                        } else if tr.dst_tensor.ends_with("e_score_correction_bias") {
                            (DType::F32, DType::F32)
                        } else {
                            (DType::Bf16, DType::Bf16)
                        };
                        assert_eq!(
                            (tr.src_dtype, tr.dst_dtype),
                            want,
                            "{what} -> {infer}: {}",
                            tr.dst_tensor
                        );
                    }
                }
                // every layer's router on every rank of the engine
                assert!(routers >= 2 * 2, "{what} -> {infer}: {routers}");
            }
        }
    }
}

#[test]
fn fsdp_refuses_a_transformers_value_that_names_no_release() {
    std::hint::black_box(awex_tests::link_backends());
    let s: BackendSpec = "fsdp:dp=2,transformers=24".parse().unwrap();
    let e = side_layout(Side::Training, &s, &deepseek())
        .err()
        .unwrap()
        .to_string();
    assert!(
        e.contains(
            "fsdp transformers=24: write the transformers release the trainer runs as major * 100 + minor (519 for 5.19, 524 for 5.24)"
        ),
        "{e}"
    );
}

#[test]
fn qwen3_moe_routers_stay_in_the_model_dtype_under_every_release() {
    let m = presets::preset("qwen3-moe-tiny").unwrap();
    for release in ["", ",transformers=524"] {
        let t = layout(Side::Training, &format!("fsdp:dp=2{release}"), &m);
        let held = shaped(&*t, RankId::train(0));
        assert!(
            held.values().all(|(_, d, _)| *d == m.dtype),
            "qwen3-moe fsdp{release}"
        );
    }
}
