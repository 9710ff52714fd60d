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
#[path = "../../awex-core/tests/shared/gpt_oss_expected.rs"]
mod reference;

use awex_core::model::Catalogue;
use awex_core::model::presets::preset;
use awex_vllm::VllmLayout;
use labelled::{bf16, checkpoint, checksum};
use reference::{VLLM, awex_rank, expected};

#[test]
fn gpt_oss_tiny_ranks_hold_what_vllm_loads_at_tp_1_2_4_and_tp2_ep2() {
    let spec = preset("gpt-oss-tiny").expect("preset");
    let cat = Catalogue::of(&spec);
    let ck = checkpoint(&cat);
    for (tp, ep) in [(1u64, 1u64), (2, 1), (4, 1), (2, 2)] {
        let layout = VllmLayout::new(&spec, tp, ep, 1).unwrap();
        for r in 0..tp as usize {
            let want = expected(&VLLM, &spec, &ck, tp as usize, ep as usize, r);
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
