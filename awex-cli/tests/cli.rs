//! The built binary: backends registered, `plan` figures, clear errors.

use serde_json::Value;
use std::process::Command;

fn cli(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_awex-cli"))
        .args(args)
        .env("PATH", "/nonexistent") // no python3: detection must not need it
        .output()
        .expect("run awex-cli");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).to_string(),
        String::from_utf8_lossy(&out.stderr).to_string(),
    )
}

#[test]
fn binary_registers_all_three_backends() {
    let (code, out, err) = cli(&["detect", "--json"]);
    assert_eq!(code, 0, "{err}");
    let j: Value = serde_json::from_str(&out).unwrap();
    let names = |side: &str| -> Vec<String> {
        let mut v: Vec<String> = j[side]
            .as_array()
            .unwrap()
            .iter()
            .map(|b| b["backend"].as_str().unwrap().to_string())
            .collect();
        v.sort();
        v
    };
    assert_eq!(names("training"), ["fsdp", "megatron"]);
    assert_eq!(names("inference"), ["sglang"]);
    for b in j["training"].as_array().unwrap() {
        assert!(b["score"].as_f64().is_some() && b["evidence"].is_array());
    }
}

#[test]
fn default_plan_is_exact_balanced_and_agreed() {
    let (code, out, err) = cli(&["plan", "--json"]);
    assert_eq!(code, 0, "{err}");
    let j: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(j["model"], "qwen3-0.6b");
    assert_eq!(j["required_bytes"], j["moved_bytes"]);
    assert_eq!(j["exact"], true);
    assert_eq!(j["fingerprints_agree"], true);
    assert_eq!(
        (j["training_ranks"].as_u64(), j["inference_ranks"].as_u64()),
        (Some(4), Some(4))
    );
    // two engines of the whole model (tied embedding once, vocab padding excluded); each engine's
    // two TP ranks both hold every norm (28 layers x (1024 + 1024 + 128 + 128) + 1024 elements)
    let model_bytes = 596_049_920u64 * 2;
    let norms_bytes = (28 * (1024 + 1024 + 128 + 128) + 1024) * 2;
    assert_eq!(
        j["required_bytes"].as_u64(),
        Some(2 * (model_bytes + norms_bytes))
    );
    assert!(j["plan_ms_max"].as_f64().unwrap() > 0.0);
}

#[test]
fn one_rank_plan_lists_its_transfers() {
    let (code, out, err) = cli(&[
        "plan",
        "--model",
        "qwen3-tiny",
        "--train",
        "megatron:tp=2",
        "--infer",
        "sglang:tp=4",
        "--rank",
        "infer:0/3",
        "--json",
    ]);
    assert_eq!(code, 0, "{err}");
    let j: Value = serde_json::from_str(&out).unwrap();
    let peers = j["plan"]["peers"].as_array().unwrap();
    let qkv = peers
        .iter()
        .flat_map(|p| p["transfers"].as_array().unwrap())
        .find(|t| t["dst_tensor"] == "model.layers.0.self_attn.qkv_proj.weight")
        .unwrap();
    // q head 3, k head 1, v head 1: contiguous on both sides, one transfer of 48 rows
    assert_eq!(
        qkv["src_tensor"],
        "decoder.layers.0.self_attention.linear_qkv.weight"
    );
    assert_eq!(qkv["src_offset"], serde_json::json!([16, 0]));
    assert_eq!(qkv["dst_offset"], serde_json::json!([0, 0]));
    assert_eq!(qkv["extent"], serde_json::json!([48, 64]));
}

#[test]
fn bad_specs_are_clear_errors() {
    let (code, _, err) = cli(&["plan", "--train", "megatron:tp=3"]);
    assert_eq!(code, 2);
    assert!(err.contains("training layout `megatron:tp=3`"), "{err}");
    let (code, _, err) = cli(&["plan", "--infer", "vllm:tp=2"]);
    assert_eq!(code, 2);
    assert!(
        err.contains("no inference backend named `vllm`; registered: sglang"),
        "{err}"
    );
    let (code, _, err) = cli(&["plan", "--model", "nope"]);
    assert_eq!(code, 2);
    assert!(err.contains("neither a built-in preset"), "{err}");
    let (code, _, err) = cli(&["plan", "--rank", "train"]);
    assert_eq!(code, 2);
    assert!(err.contains("expected `train:N` or `infer:E/N`"), "{err}");
}
