//! SGLang 0.5.23's own hybrid linear-attention models (Qwen3-Next, Qwen3.5, Qwen3.5-MoE) against
//! awex's SGLang layout, element by element.
//!
//! `tests/fixtures/hybrid_sglang_params.json` is written by
//! `engines/tests/test_hybrid_sglang_params.py`: SGLang's real model classes load, one process
//! per TP rank, a checkpoint whose every element names itself, and every parameter of every rank
//! is recorded as runs `[local start, canonical tensor (index into the case's sorted
//! `tensors`), canonical start, length]` of the canonical elements it holds (zeros, which no checkpoint element is, are padding). Here awex's
//! layout of the same model places, on every rank, exactly the same parameters (names, shapes,
//! dtypes) and exactly the same runs.
//!
//! Cases with `"platform": "cuda"` were built with SGLang's MoE block deciding as on an NVIDIA
//! GPU (`engines/sglang_cpu.py` `qwen2_moe_block_as_on_cuda`) and record SGLang's own decision
//! as `fused_shared_experts`: Qwen3-Next's shared expert fused into the routed experts (one more
//! expert in `mlp.experts.w13_weight` / `w2_weight`; under expert parallelism one copy as every
//! EP rank's last local expert, its MoE-TP share at tp 4 / ep 2), Qwen3.5-MoE's apart. awex's
//! layout is told the same (`sglang:...,fused_shared_experts=N`), and its holders (what the
//! planner reads) must agree with its rank layouts.

use awex_core::DType;
use awex_core::layout::{RankId, RankLayout, SideLayout};
use awex_core::model::{Catalogue, ModelSpec};
use awex_sglang::SglangLayout;
use serde_json::Value;

/// One run of consecutive canonical elements in a local tensor.
type Run = awex_core::layout::check::ElementRun;

/// The maximal runs of canonical elements every local tensor of `l` holds, by tensor name
/// ([`awex_core::layout::check::element_runs`]).
fn layout_runs(l: &RankLayout, cat: &Catalogue) -> Vec<(String, Vec<u64>, DType, Vec<Run>)> {
    let mut out: Vec<(String, Vec<u64>, DType, Vec<Run>)> =
        awex_core::layout::check::element_runs(l, cat)
            .unwrap()
            .into_iter()
            .map(|t| (t.name, t.shape, t.dtype, t.runs))
            .collect();
    out.sort_by(|a, b| a.0.cmp(&b.0));
    out
}

fn dtype(d: &str) -> DType {
    match d {
        "float32" => DType::F32,
        "bfloat16" => DType::Bf16,
        other => panic!("dtype {other}"),
    }
}

#[test]
fn the_sglang_layout_of_hybrid_models_places_exactly_sglang_s_own_elements() {
    let fixture: Value =
        serde_json::from_str(include_str!("fixtures/hybrid_sglang_params.json")).unwrap();
    let mut ranks_checked = 0;
    let mut runs_checked = 0;
    let mut fused_cases = 0;
    for case in fixture["cases"].as_array().unwrap() {
        let spec = ModelSpec::from_config_value(&case["config"]).unwrap();
        let (tp, ep) = (case["tp"].as_u64().unwrap(), case["ep"].as_u64().unwrap());
        let what = format!("{} tp={tp} ep={ep}", case["arch"]);
        // SGLang on CPU keeps the shared expert apart (`Qwen2MoeSparseMoeBlock` fuses it only
        // on CUDA / AITER); a case built as on an NVIDIA GPU records SGLang's own decision,
        // which the deployment tells awex (`sglang:...,fused_shared_experts=N`)
        let fused = match case.get("fused_shared_experts") {
            Some(n) => {
                assert_eq!(case["platform"], "cuda", "{what}");
                // `models/qwen3_next.py` builds the block with
                // `enable_cuda_shared_expert_fusion=True`; `models/qwen3_5.py` without it
                let want = match case["arch"].as_str().unwrap() {
                    "Qwen3NextForCausalLM" => 1,
                    "Qwen3_5MoeForCausalLM" => 0,
                    a => panic!("{what}: no expected fusion for {a}"),
                };
                assert_eq!(n.as_u64(), Some(want), "{what}: SGLang's fusion on CUDA");
                fused_cases += 1;
                Some(want == 1)
            }
            None => spec.moe.as_ref().map(|_| false),
        };
        let layout = SglangLayout::with_shared_experts(&spec, tp, ep, 1, fused)
            .unwrap_or_else(|e| panic!("{what}: {e}"));
        let cat = Catalogue::of(&spec);
        // the holders the planner reads agree with the rank layouts compared below, and every
        // canonical tensor round-trips through them
        awex_core::layout::check::side(&layout, &cat).unwrap_or_else(|e| panic!("{what}: {e}"));
        let tensors: Vec<&str> = case["tensors"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t.as_str().unwrap())
            .collect();
        for (r, params) in case["ranks"].as_array().unwrap().iter().enumerate() {
            let l = layout.rank_layout(RankId::infer(0, r as u32)).unwrap();
            let ours = layout_runs(&l, &cat);
            let mut theirs: Vec<(String, Vec<u64>, DType, Vec<Run>)> = params
                .as_array()
                .unwrap()
                .iter()
                .map(|p| {
                    let runs = p[3]
                        .as_array()
                        .unwrap()
                        .iter()
                        .map(|x| {
                            (
                                x[0].as_u64().unwrap(),
                                tensors[x[1].as_u64().unwrap() as usize].to_string(),
                                x[2].as_u64().unwrap(),
                                x[3].as_u64().unwrap(),
                            )
                        })
                        .collect();
                    let shape = p[1].as_array().unwrap().iter().map(|d| d.as_u64().unwrap());
                    (
                        p[0].as_str().unwrap().to_string(),
                        shape.collect(),
                        dtype(p[2].as_str().unwrap()),
                        runs,
                    )
                })
                .collect();
            theirs.sort_by(|a, b| a.0.cmp(&b.0));
            let names = |v: &[(String, Vec<u64>, DType, Vec<Run>)]| -> Vec<String> {
                v.iter().map(|t| t.0.clone()).collect()
            };
            assert_eq!(names(&ours), names(&theirs), "{what} rank {r}: parameters");
            for (a, b) in ours.iter().zip(&theirs) {
                assert_eq!(a, b, "{what} rank {r}: {}", a.0);
                runs_checked += a.3.len();
            }
            ranks_checked += 1;
        }
    }
    assert_eq!(
        ranks_checked,
        1 + 1 + 2 + 4 + 2 + 2 + 4 + 2 + (1 + 2 + 1 + 2) + (2 + 4)
    );
    assert_eq!(fused_cases, 6);
    assert!(runs_checked > 7000, "{runs_checked}");
}

/// SGLang 0.5.23 never fuses Qwen3.5-MoE's shared expert on NVIDIA (`models/qwen3_5.py` builds
/// its `Qwen2MoeSparseMoeBlock` without `enable_cuda_shared_expert_fusion`; the fixture's cases
/// built as on CUDA hold `mlp.shared_expert.*` apart): `fused_shared_experts=1` is refused
/// naming why, and leaving the key out lays it out apart, as `fused_shared_experts=0` does.
/// Qwen3-Next, whose block SGLang builds with that flag, takes either.
#[test]
fn qwen3_5_moe_refuses_a_fused_shared_expert_sglang_never_builds() {
    let moe = awex_core::model::presets::preset("qwen3.5-moe-tiny").unwrap();
    let cat = Catalogue::of(&moe);
    for tp in [1, 2] {
        let e = SglangLayout::with_shared_experts(&moe, tp, 1, 1, Some(true)).unwrap_err();
        assert!(
            e.to_string()
                .contains("Qwen3_5MoeForCausalLM's shared expert apart on NVIDIA GPUs")
                && e.to_string().contains("enable_cuda_shared_expert_fusion"),
            "{e}"
        );
        let unsaid = SglangLayout::with_shared_experts(&moe, tp, 1, 1, None).unwrap();
        let apart = SglangLayout::with_shared_experts(&moe, tp, 1, 1, Some(false)).unwrap();
        for r in 0..tp as u32 {
            let rank = RankId::infer(0, r);
            let runs = layout_runs(&unsaid.rank_layout(rank).unwrap(), &cat);
            assert!(
                runs.iter()
                    .any(|t| t.0 == "model.layers.0.mlp.shared_expert.gate_up_proj.weight"),
                "tp={tp} rank {r}"
            );
            assert_eq!(
                runs,
                layout_runs(&apart.rank_layout(rank).unwrap(), &cat),
                "tp={tp} rank {r}"
            );
        }
    }
    let next = awex_core::model::presets::preset("qwen3-next-tiny").unwrap();
    assert!(SglangLayout::with_shared_experts(&next, 2, 1, 1, Some(true)).is_ok());
    assert!(SglangLayout::with_shared_experts(&next, 2, 1, 1, None).is_err());
}

/// SGLang 0.5.23 on a GPU fuses Qwen3-Next's shared expert under expert parallelism too
/// (`models/qwen2_moe.py` `Qwen2MoeSparseMoeBlock.__init__` turns the fusion off at ep > 1 only
/// for DeepEP-class / MegaMoE backends; `FusedMoE.__init__` then holds it as every EP rank's
/// last local expert) and keeps it apart on CPU: at ep > 1 the deployment must say which, as at
/// ep=1, and the refusal names both and the key. DeepSeek-V3, whose fusion SGLang turns off at
/// ep > 1 on NVIDIA (`shared_experts_fusion_disable_reason`), still refuses `=1` there and takes
/// the key left out.
#[test]
fn qwen3_next_under_expert_parallelism_needs_the_fusion_said() {
    let next = awex_core::model::presets::preset("qwen3-next-tiny").unwrap();
    for (tp, ep) in [(2, 2), (4, 2), (4, 4)] {
        let e = SglangLayout::with_shared_experts(&next, tp, ep, 1, None)
            .unwrap_err()
            .to_string();
        assert!(
            e.starts_with(&format!("Qwen3NextForCausalLM at ep={ep}: SGLang 0.5.23 on NVIDIA GPUs fuses its shared expert under expert parallelism too"))
                && e.contains("every EP rank's last local expert")
                && e.contains("--disable-shared-experts-fusion")
                && e.contains("fused_shared_experts=1 or fused_shared_experts=0"),
            "{e}"
        );
        for fused in [true, false] {
            let l = SglangLayout::with_shared_experts(&next, tp, ep, 1, Some(fused))
                .unwrap_or_else(|e| panic!("tp={tp} ep={ep} fused={fused}: {e}"));
            let w13 = l
                .rank_layout(RankId::infer(0, 0))
                .unwrap()
                .tensors
                .into_iter()
                .find(|t| t.name.as_ref() == "model.layers.0.mlp.experts.w13_weight")
                .unwrap();
            // 8 routed experts over ep, plus the shared one when fused
            assert_eq!(w13.shape.as_slice()[0], 8 / ep + u64::from(fused));
        }
    }
    let ds = awex_core::model::presets::preset("deepseek-v3-tiny").unwrap();
    let e = SglangLayout::with_shared_experts(&ds, 2, 2, 1, Some(true))
        .unwrap_err()
        .to_string();
    assert!(
        e.starts_with("sglang fused_shared_experts=1 with DeepseekV3ForCausalLM at ep=2: ")
            && e.contains("at ep=1 only on NVIDIA")
            && e.contains("use fused_shared_experts=0"),
        "{e}"
    );
    assert!(SglangLayout::with_shared_experts(&ds, 2, 2, 1, None).is_ok());
}

/// What SGLang 0.5.23 cannot run of a hybrid model is refused naming the reason: more ranks
/// than linear-attention key heads, full-attention layers that are not every k-th layer, a
/// Qwen3-Next layer made dense, more ranks than experts.
#[test]
fn hybrid_configs_sglang_cannot_run_are_refused_by_name() {
    let next = awex_core::model::presets::preset("qwen3-next-tiny").unwrap();
    let wide = ModelSpec {
        num_heads: 8,
        ..next.clone()
    };
    let e = SglangLayout::with_shared_experts(&wide, 8, 1, 1, Some(false)).unwrap_err();
    assert!(
        e.to_string()
            .contains("4 linear-attention key heads (linear_num_key_heads); sglang tp=8"),
        "{e}"
    );
    let mut odd = next.clone();
    if let Some(a) = &mut odd.linear {
        a.full_attention_layers = vec![1, 3];
    }
    assert!(SglangLayout::with_shared_experts(&odd, 2, 1, 1, Some(false)).is_ok());
    if let Some(a) = &mut odd.linear {
        a.full_attention_layers = vec![0, 3];
    }
    let e = SglangLayout::with_shared_experts(&odd, 2, 1, 1, Some(false)).unwrap_err();
    assert!(
        e.to_string().contains("`full_attention_interval` alone"),
        "{e}"
    );
    let mut dense = next.clone();
    if let Some(m) = &mut dense.moe {
        m.mlp_only_layers = vec![1];
    }
    let e = SglangLayout::with_shared_experts(&dense, 2, 1, 1, Some(false)).unwrap_err();
    assert!(e.to_string().contains("builds every layer as MoE"), "{e}");
    let few = ModelSpec {
        moe: next.moe.clone().map(|m| awex_core::model::MoeSpec {
            num_experts: 2,
            experts_per_token: 2,
            ..m
        }),
        ..next.clone()
    };
    let e = SglangLayout::with_shared_experts(&few, 4, 1, 1, Some(false)).unwrap_err();
    assert!(e.to_string().contains("Qwen2MoeSparseMoeBlock"), "{e}");
    // the shared expert at ep 1 needs the deployment to say whether SGLang fuses it
    assert!(SglangLayout::with_shared_experts(&next, 2, 1, 1, None).is_err());
    assert!(SglangLayout::with_shared_experts(&next, 2, 1, 1, Some(true)).is_ok());
}
