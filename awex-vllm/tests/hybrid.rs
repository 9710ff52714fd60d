//! vLLM 0.33's own hybrid linear-attention models (Qwen3-Next, Qwen3.5, Qwen3.5-MoE) against
//! awex's vLLM layout, element by element.
//!
//! `tests/fixtures/hybrid_vllm_params.json` is written by
//! `engines/tests/vllm/test_hybrid_vllm_params.py`: vLLM's real model classes load, one process
//! per TP rank, a checkpoint whose every element names itself, and every parameter of every rank
//! is recorded as runs `[local start, canonical tensor (index into the case's sorted
//! `tensors`), canonical start, length]` of the canonical elements it holds (zeros, which no checkpoint element is, are padding). Here awex's
//! layout of the same model places, on every rank, exactly the same parameters (names, shapes,
//! dtypes) and exactly the same runs.

use awex_core::DType;
use awex_core::layout::{RankId, RankLayout, SideLayout};
use awex_core::model::{Catalogue, ModelSpec};
use awex_vllm::VllmLayout;
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
fn the_vllm_layout_of_hybrid_models_places_exactly_vllm_s_own_elements() {
    let fixture: Value =
        serde_json::from_str(include_str!("fixtures/hybrid_vllm_params.json")).unwrap();
    let mut ranks_checked = 0;
    let mut runs_checked = 0;
    for case in fixture["cases"].as_array().unwrap() {
        let spec = ModelSpec::from_config_value(&case["config"]).unwrap();
        let (tp, ep) = (case["tp"].as_u64().unwrap(), case["ep"].as_u64().unwrap());
        let what = format!("{} tp={tp} ep={ep}", case["arch"]);
        let layout = VllmLayout::new(&spec, tp, ep, 1).unwrap_or_else(|e| panic!("{what}: {e}"));
        let cat = Catalogue::of(&spec);
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
    assert_eq!(ranks_checked, 1 + 2 + 4 + 2 + 2 + 4 + 2);
    assert!(runs_checked > 7000, "{runs_checked}");
}

/// What vLLM 0.33 cannot run of a hybrid model is refused naming the reason: more ranks than
/// linear-attention key heads, more ranks than experts.
#[test]
fn hybrid_configs_vllm_cannot_run_are_refused_by_name() {
    let next = awex_core::model::presets::preset("qwen3-next-tiny").unwrap();
    let wide = ModelSpec {
        num_heads: 8,
        ..next.clone()
    };
    let e = VllmLayout::new(&wide, 8, 1, 1).unwrap_err();
    assert!(
        e.to_string()
            .contains("4 linear-attention key heads (linear_num_key_heads); vllm tp=8"),
        "{e}"
    );
    let few = ModelSpec {
        moe: next.moe.clone().map(|m| awex_core::model::MoeSpec {
            num_experts: 2,
            experts_per_token: 2,
            ..m
        }),
        ..next.clone()
    };
    let e = VllmLayout::new(&few, 4, 1, 1).unwrap_err();
    assert!(e.to_string().contains("Qwen3NextSparseMoeBlock"), "{e}");
    // vLLM honours mlp_only_layers and any layer_types
    let mut dense = next.clone();
    if let Some(m) = &mut dense.moe {
        m.mlp_only_layers = vec![1];
    }
    if let Some(a) = &mut dense.linear {
        a.full_attention_layers = vec![0, 3];
    }
    assert!(VllmLayout::new(&dense, 2, 1, 1).is_ok());
}
