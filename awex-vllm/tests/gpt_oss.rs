//! gpt-oss on vLLM 0.33 (bf16): awex's layout against what vLLM's own classes load.
//!
//! `engines/tests/gpt_oss_layout.py` writes down, from vLLM's code, every parameter a TP rank
//! holds of a gpt-oss checkpoint, and `engines/tests/vllm/test_gpt_oss_vllm_params.py` checks it
//! against vLLM's real `GptOssForCausalLM.load_weights` at tp 1, 2, 4 and tp 2 / ep 2.
//! `expected` below is the same function (the experts the transpose of a chunk of the
//! checkpoint's fused experts, the down bias on TP rank 0 only, the sinks in the model's dtype,
//! the attention module `attn`, the embedding `model.embedding`): awex's rank layouts, filled
//! from a checkpoint whose every element names itself, must hold exactly those names, shapes,
//! dtypes and elements.

mod common;
#[path = "../../awex-core/tests/shared/labelled.rs"]
mod labelled;

use awex_core::DType;
use awex_core::layout::{RankId, SideLayout, materialize};
use awex_core::model::presets::preset;
use awex_core::model::{CanonicalTensor, Catalogue, ModelSpec};
use awex_vllm::VllmLayout;
use labelled::{Tensor, bf16, cat_rows, checkpoint, checksum, cols, mid, rows, swap};
use std::collections::{BTreeMap, HashMap};

/// `engines/tests/gpt_oss_layout.py` `expected("vllm", ck, config, tp, ep, r)`.
fn expected(
    spec: &ModelSpec,
    ck: &HashMap<String, Tensor>,
    tp: usize,
    ep: usize,
    r: usize,
) -> BTreeMap<String, Tensor> {
    let g = |n: &str| ck.get(n).unwrap_or_else(|| panic!("no `{n}`"));
    let (heads, kv, hd) = (
        spec.num_heads as usize,
        spec.num_kv_heads as usize,
        spec.head_dim as usize,
    );
    let moe = spec.moe.as_ref().unwrap();
    let (experts, inter) = (moe.num_experts as usize, moe.moe_intermediate_size as usize);
    // vLLM's expert parallelism is the whole tp group when enabled
    let moe_tp = if ep > 1 { 1 } else { tp };
    let (moe_r, ep_r) = (r % moe_tp, r / moe_tp);
    let local = experts / (tp / moe_tp);
    let es = (ep_r * local, (ep_r + 1) * local);
    let vocab = |name: &str| {
        let t = g(name);
        let per = t.0[0].div_ceil(64) * 64 / tp;
        rows(t, r * per, (r + 1) * per, true)
    };
    let mut out = BTreeMap::new();
    out.insert(
        "model.embedding.weight".to_string(),
        vocab("model.embed_tokens.weight"),
    );
    out.insert("lm_head.weight".to_string(), vocab("lm_head.weight"));
    out.insert(
        "model.norm.weight".to_string(),
        g("model.norm.weight").clone(),
    );
    let q_per = heads / tp;
    let kv_per = (kv / tp).max(1);
    let kv_first = if tp <= kv { r * kv / tp } else { r / (tp / kv) };
    for l in 0..spec.num_layers as usize {
        let src = format!("model.layers.{l}");
        let sa = format!("{src}.self_attn");
        let attn = format!("{src}.attn");
        let ex = format!("{src}.mlp.experts.routed_experts");
        let (qs, ks) = (
            (r * q_per * hd, (r + 1) * q_per * hd),
            (kv_first * hd, (kv_first + kv_per) * hd),
        );
        for what in ["weight", "bias"] {
            let q = rows(g(&format!("{sa}.q_proj.{what}")), qs.0, qs.1, false);
            let k = rows(g(&format!("{sa}.k_proj.{what}")), ks.0, ks.1, false);
            let v = rows(g(&format!("{sa}.v_proj.{what}")), ks.0, ks.1, false);
            out.insert(format!("{attn}.qkv_proj.{what}"), cat_rows(&[q, k, v]));
        }
        out.insert(
            format!("{attn}.o_proj.weight"),
            cols(g(&format!("{sa}.o_proj.weight")), qs.0, qs.1),
        );
        out.insert(
            format!("{attn}.o_proj.bias"),
            g(&format!("{sa}.o_proj.bias")).clone(),
        );
        let sinks = rows(g(&format!("{sa}.sinks")), r * q_per, (r + 1) * q_per, false);
        out.insert(format!("{attn}.sinks"), sinks);
        for what in ["weight", "bias"] {
            let n = format!("{src}.mlp.router.{what}");
            out.insert(n.clone(), g(&n).clone());
        }
        let gu = rows(
            g(&format!("{src}.mlp.experts.gate_up_proj")),
            es.0,
            es.1,
            false,
        );
        let c = 2 * inter / moe_tp;
        out.insert(
            format!("{ex}.w13_weight"),
            swap(&cols(&gu, moe_r * c, (moe_r + 1) * c)),
        );
        let gub = rows(
            g(&format!("{src}.mlp.experts.gate_up_proj_bias")),
            es.0,
            es.1,
            false,
        );
        out.insert(
            format!("{ex}.w13_bias"),
            cols(&gub, moe_r * c, (moe_r + 1) * c),
        );
        let dn = rows(
            g(&format!("{src}.mlp.experts.down_proj")),
            es.0,
            es.1,
            false,
        );
        let ci = inter / moe_tp;
        out.insert(
            format!("{ex}.w2_weight"),
            swap(&mid(&dn, moe_r * ci, (moe_r + 1) * ci)),
        );
        let b = rows(
            g(&format!("{src}.mlp.experts.down_proj_bias")),
            es.0,
            es.1,
            false,
        );
        let b = if moe_r == 0 {
            b
        } else {
            (b.0.clone(), vec![0.0; b.1.len()])
        };
        out.insert(format!("{ex}.w2_bias"), b);
        for norm in ["input_layernorm", "post_attention_layernorm"] {
            let n = format!("{src}.{norm}.weight");
            out.insert(n.clone(), g(&n).clone());
        }
    }
    out
}

/// What awex's layout puts on TP rank `r`: every tensor filled from the labelled checkpoint,
/// in f32 (each element converted to the tensor's dtype and back), with its dtype.
fn awex_rank(
    layout: &VllmLayout,
    cat: &Catalogue,
    ck: &HashMap<String, Tensor>,
    r: u32,
) -> BTreeMap<String, (Tensor, DType)> {
    let rl = layout.rank_layout(RankId::infer(0, r)).expect("rank");
    awex_core::layout::validate_rank(&rl, cat).unwrap();
    // the same layout with every tensor in f32, from an f32 checkpoint: exact labels
    let f32cat = Catalogue::new(
        cat.tensors()
            .iter()
            .map(|c| CanonicalTensor {
                dtype: DType::F32,
                ..c.clone()
            })
            .collect(),
    );
    let mut wide = rl.clone();
    for t in &mut wide.tensors {
        t.dtype = DType::F32;
        t.encoding = awex_core::encoding::Encoding::Plain(DType::F32);
    }
    let bytes: HashMap<&str, Vec<u8>> = ck
        .iter()
        .map(|(n, (_, v))| (n.as_str(), v.iter().flat_map(|x| x.to_le_bytes()).collect()))
        .collect();
    let get = |n: &str| bytes.get(n).map(|v| v.as_slice());
    let bufs = materialize(&wide, &f32cat, &get).expect("materialize");
    rl.tensors
        .iter()
        .zip(bufs)
        .map(|(t, b)| {
            let v: Vec<f32> = b
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
                .collect();
            let v = if t.dtype == DType::Bf16 {
                bf16(&(vec![], v)).1
            } else {
                v
            };
            let shape = t.shape.as_slice().iter().map(|&d| d as usize).collect();
            (t.name.to_string(), ((shape, v), t.dtype))
        })
        .collect()
}

#[test]
fn gpt_oss_tiny_ranks_hold_what_vllm_loads_at_tp_1_2_4_and_tp2_ep2() {
    let spec = preset("gpt-oss-tiny").expect("preset");
    let cat = Catalogue::of(&spec);
    let ck = checkpoint(&cat);
    for (tp, ep) in [(1u64, 1u64), (2, 1), (4, 1), (2, 2)] {
        let layout = VllmLayout::new(&spec, tp, ep, 1).unwrap();
        for r in 0..tp as usize {
            let want = expected(&spec, &ck, tp as usize, ep as usize, r);
            let got = awex_rank(&layout, &cat, &ck, r as u32);
            let (wn, gn): (Vec<_>, Vec<_>) = (want.keys().collect(), got.keys().collect());
            assert_eq!(gn, wn, "tp={tp} ep={ep} rank {r}: names");
            for (name, w) in &want {
                let ((shape, v), dtype) = &got[name];
                assert_eq!(shape, &w.0, "tp={tp} ep={ep} rank {r} `{name}`: shape");
                assert_eq!(
                    *dtype, spec.dtype,
                    "tp={tp} ep={ep} rank {r} `{name}`: dtype"
                );
                // the model is bf16: compare what bf16 holds of the labels
                let w = bf16(w).1;
                if let Some(i) = (0..w.len()).find(|&i| v[i] != w[i]) {
                    panic!(
                        "tp={tp} ep={ep} rank {r} `{name}` element {i}: {} != {}",
                        v[i], w[i]
                    );
                }
            }
        }
    }
}

#[test]
fn gpt_oss_layouts_are_valid_and_round_trip() {
    let spec = preset("gpt-oss-tiny").expect("preset");
    let cat = Catalogue::of(&spec);
    for (tp, ep, engines) in [(1, 1, 1), (2, 1, 1), (4, 1, 1), (2, 2, 1), (4, 4, 2)] {
        let layout = VllmLayout::new(&spec, tp, ep, engines).unwrap();
        common::check_side(&layout, &cat);
    }
}

/// Every rank of awex's layout holds the names, shapes and elements (by checksum) that
/// `gpt_oss_layout.expected` (the function the engine tests pin against the engine's own load)
/// gives, read from the fixture that `engines/tests/write_gpt_oss_expected.py` wrote with it.
#[test]
fn gpt_oss_tiny_ranks_match_the_engine_tests_written_down_layout() {
    let spec = preset("gpt-oss-tiny").expect("preset");
    let cat = Catalogue::of(&spec);
    let ck = checkpoint(&cat);
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/gpt_oss_expected.json"
    );
    let fixture: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(path).expect("fixture")).expect("json");
    let cases = fixture["cases"].as_array().expect("cases");
    assert!(!cases.is_empty());
    for case in cases {
        let (tp, ep, r) = (
            case["tp"].as_u64().unwrap(),
            case["ep"].as_u64().unwrap(),
            case["rank"].as_u64().unwrap(),
        );
        let layout = VllmLayout::new(&spec, tp, ep, 1).unwrap();
        let got = awex_rank(&layout, &cat, &ck, r as u32);
        let want = case["tensors"].as_object().expect("tensors");
        let names: Vec<&String> = want.keys().collect();
        assert_eq!(
            got.keys().collect::<Vec<_>>(),
            names,
            "tp={tp} ep={ep} rank {r}: names"
        );
        for (name, w) in want {
            let ((shape, v), _) = &got[name];
            let ws: Vec<usize> = w[0]
                .as_array()
                .unwrap()
                .iter()
                .map(|d| d.as_u64().unwrap() as usize)
                .collect();
            assert_eq!(shape, &ws, "tp={tp} ep={ep} rank {r} `{name}`: shape");
            // bf16 of the labels (the sinks of SGLang are bf16 already)
            let v = bf16(&(vec![], v.clone())).1;
            assert_eq!(
                checksum(&v),
                w[1].as_u64().unwrap(),
                "tp={tp} ep={ep} rank {r} `{name}`: elements"
            );
        }
    }
}
