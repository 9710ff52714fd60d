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
fn binary_registers_all_four_backends() {
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
    assert_eq!(names("inference"), ["sglang", "vllm"]);
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
    // the backend's reason is said once (not once per error in the chain)
    assert_eq!(
        err.matches("needs num_attention_heads divisible by tp")
            .count(),
        1,
        "{err}"
    );
    let (code, _, err) = cli(&["plan", "--infer", "trtllm:tp=2"]);
    assert_eq!(code, 2);
    assert!(
        err.contains("no inference backend named `trtllm`; registered: sglang, vllm"),
        "{err}"
    );
    let (code, _, err) = cli(&["plan", "--model", "nope"]);
    assert_eq!(code, 2);
    assert!(err.contains("neither a built-in preset"), "{err}");
    let (code, _, err) = cli(&["plan", "--rank", "train"]);
    assert_eq!(code, 2);
    assert!(err.contains("expected `train:N` or `infer:E/N`"), "{err}");
}

/// Runs the binary and checks it exits with an error (code 2) within 2 s, returning stderr.
/// Runs the CLI with 1 GiB of address space (`ulimit -v`) and asserts it refused the command
/// (exit 2): a refusal that first built per-rank state for the sizes it refuses, or a layout
/// of a billion ranks, runs out of memory instead (a count of what it may hold, not a time a
/// loaded machine could miss).
fn refused(args: &[&str]) -> String {
    let out = Command::new("/bin/sh")
        .arg("-c")
        .arg("ulimit -v 1048576 && exec \"$0\" \"$@\"")
        .arg(env!("CARGO_BIN_EXE_awex-cli"))
        .args(args)
        .env("PATH", "/nonexistent")
        .output()
        .expect("run awex-cli");
    let (code, out, err) = (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).to_string(),
        String::from_utf8_lossy(&out.stderr).to_string(),
    );
    assert_eq!(code, 2, "{args:?} was not refused: {out}{err}");
    err
}

#[test]
fn parallel_sizes_above_the_limits_are_refused_at_once() {
    for (train, infer, want) in [
        (
            "megatron:dp=1000000000",
            "sglang:tp=2",
            "megatron dp=1000000000 is above awex's limit of 65536 (one side of a pair has at most 65536 ranks)",
        ),
        (
            "fsdp:tp=100000",
            "sglang:tp=2",
            "fsdp tp=100000 is above awex's limit of 1024 (tensor parallelism splits attention heads, of which a model has at most 1024)",
        ),
        (
            "megatron:tp=2",
            "sglang:engines=100000",
            "sglang engines=100000 is above awex's limit of 65536 (one side of a pair has at most 65536 ranks)",
        ),
        (
            "megatron:tp=1024,dp=1024",
            "sglang:tp=2",
            "megatron world size tp*cp*dp*pp=1048576 is above awex's limit of 65536",
        ),
    ] {
        let err = refused(&["plan", "--train", train, "--infer", infer]);
        assert!(err.contains(want), "{train} {infer}: {err}");
    }
}

#[test]
fn fsdp_tp_must_give_every_rank_whole_heads() {
    // qwen3-0.6b: 16 query heads, 8 KV heads
    for tp in ["3", "16"] {
        let train = format!("fsdp:tp={tp}");
        let err = refused(&["plan", "--train", &train]);
        assert!(
            err.contains(&format!(
                "model has 16 attention heads and 8 KV heads; fsdp tp={tp} needs both divisible by tp"
            )),
            "{err}"
        );
    }
    let (code, out, err) = cli(&["plan", "--train", "fsdp:tp=4,dp=2", "--json"]);
    assert_eq!(code, 0, "{err}");
    let j: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(j["exact"], true);
}

/// A model directory holding a Qwen3 config.json with `field` set to `value`.
fn config_dir(field: &str, value: Value) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = serde_json::json!({
        "architectures": ["Qwen3ForCausalLM"],
        "hidden_size": 64,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "intermediate_size": 128,
        "vocab_size": 1000,
        "dtype": "bfloat16"
    });
    cfg[field] = value;
    std::fs::write(dir.path().join("config.json"), cfg.to_string()).unwrap();
    dir
}

#[test]
fn deepseek_configs_with_an_empty_mla_size_are_refused_by_every_tool_not_a_panic() {
    let fixture: Value = serde_json::from_str(include_str!(
        "../../awex-core/tests/fixtures/hf/deepseek-v3.json"
    ))
    .unwrap();
    for (field, want) in [
        (
            "kv_lora_rank",
            "config.json field `kv_lora_rank`: must be at least 1 (DeepSeek-V3 has 512)",
        ),
        (
            "q_lora_rank",
            "config.json field `q_lora_rank`: must be at least 1 (DeepSeek-V3 has 1536), or null for a plain q_proj (DeepSeek-V2-Lite)",
        ),
        (
            "v_head_dim",
            "config.json field `v_head_dim`: must be at least 1 (DeepSeek-V3 has 128)",
        ),
    ] {
        let dir = tempfile::tempdir().unwrap();
        let mut cfg = fixture["config"].clone();
        cfg[field] = serde_json::json!(0);
        std::fs::write(dir.path().join("config.json"), cfg.to_string()).unwrap();
        let model = dir.path().to_str().unwrap();
        for args in [
            vec![
                "plan",
                "--model",
                model,
                "--train",
                "megatron:tp=1",
                "--infer",
                "sglang:tp=1",
            ],
            vec!["demo", "--model", model, "--updates", "1"],
            vec!["simulate", "--model", model],
            vec![
                "pair",
                "--gateway",
                "http://127.0.0.1:9",
                "connect",
                "--name",
                "p",
                "--model",
                model,
                "--train",
                "megatron:tp=1",
                "--infer",
                "sglang:tp=1",
            ],
        ] {
            // exit 2 with the message, never a panic (101)
            let (code, out, err) = cli(&args);
            assert_eq!(code, 2, "{args:?}: {out}{err}");
            assert!(err.contains(want), "{args:?}: {err}");
            assert!(!err.contains("panicked"), "{args:?}: {err}");
        }
    }
}

#[test]
fn model_sizes_above_the_limits_are_refused_by_plan_and_pair_connect() {
    for (field, value, want) in [
        (
            "num_hidden_layers",
            serde_json::json!(1_000_000_000u64),
            "model num_hidden_layers=1000000000 is above awex's limit of 1024",
        ),
        (
            "vocab_size",
            serde_json::json!(1u64 << 62),
            "model vocab_size=4611686018427387904 is above awex's limit of 4194304",
        ),
        (
            "head_dim",
            serde_json::json!(u64::MAX),
            "model head_dim=18446744073709551615 is above awex's limit of 1024",
        ),
    ] {
        let dir = config_dir(field, value);
        let model = dir.path().to_str().unwrap();
        let err = refused(&["plan", "--model", model, "--infer", "sglang:tp=2"]);
        assert!(err.contains(want), "{field}: {err}");
        assert_eq!(err.matches(want).count(), 1, "said more than once: {err}");
        // refused before any request: nothing listens on the gateway port
        let err = refused(&[
            "pair",
            "--gateway",
            "http://127.0.0.1:9",
            "connect",
            "--name",
            "p",
            "--model",
            model,
            "--train",
            "megatron:tp=1",
            "--infer",
            "sglang:tp=1",
        ]);
        assert!(err.contains(want), "{field}: {err}");
    }
}

#[test]
fn plan_of_a_model_directory_checks_its_weights() {
    let dir = config_dir("vocab_size", serde_json::json!(1000));
    let model = dir.path().to_str().unwrap();
    let args = ["plan", "--model", model, "--infer", "sglang:tp=2"];
    let (code, _, err) = cli(&args);
    assert_eq!(code, 0, "{err}");
    std::fs::write(
        dir.path().join("model.safetensors"),
        b"root:x:0:0:root:/root:/bin/bash\n",
    )
    .unwrap();
    let err = refused(&args);
    assert!(
        err.contains("model.safetensors is not a valid safetensors file: its header length field is above the 100000000 bytes a safetensors header may have"),
        "{err}"
    );
    assert!(!err.contains("root"), "{err}");
}

#[test]
fn detect_says_what_every_backend_looked_for() {
    let (code, out, err) = cli(&["detect"]);
    assert_eq!(code, 0, "{err}");
    for want in [
        "not found: python package `megatron.core`: not checked (no python3 found on PATH)",
        "not found: CUDA_DEVICE_MAX_CONNECTIONS=1 (Megatron's launch setting): unset",
        "not found: a torch distributed checkpoint (`.metadata` and `*.distcp` files): no --checkpoint given",
        "not found: python package `sglang`: not checked (no python3 found on PATH)",
    ] {
        assert!(out.contains(want), "{want}\n{out}");
    }
    let (code, out, _) = cli(&["detect", "--json"]);
    assert_eq!(code, 0);
    let j: Value = serde_json::from_str(&out).unwrap();
    for side in ["training", "inference"] {
        for b in j[side].as_array().unwrap() {
            assert!(
                !b["not_found"].as_array().unwrap().is_empty(),
                "{} lists nothing it looked for",
                b["backend"]
            );
        }
    }
}

#[test]
fn detect_refuses_a_missing_checkpoint_and_a_bad_url() {
    let err = refused(&["detect", "--checkpoint", "/nonexistent/ckpt"]);
    assert!(
        err.contains("--checkpoint /nonexistent/ckpt: no such file or directory"),
        "{err}"
    );
    let err = refused(&["detect", "--sglang-url", "notaurl"]);
    assert!(
        err.contains("--sglang-url `notaurl` is not a valid URL (relative URL without a base); expected e.g. http://10.0.0.5:30000"),
        "{err}"
    );
}

#[test]
fn commit_policies_are_checked_at_parse_time_with_what_is_accepted() {
    let connect = |policy: &'static str| {
        vec![
            "pair",
            "connect",
            "--name",
            "p",
            "--model",
            "qwen3-tiny",
            "--train",
            "megatron",
            "--infer",
            "sglang",
            "--commit",
            policy,
        ]
    };
    for (args, want) in [
        (
            connect("most"),
            "invalid value 'most' for '--commit <COMMIT>': `most` is not a commit policy: use `all`, `available` or `quorum:K` (K engines, at least 1)",
        ),
        (
            connect("quorum:0"),
            "invalid value 'quorum:0' for '--commit <COMMIT>': `quorum:0`: the quorum K in `quorum:K` must be a whole number of engines, at least 1",
        ),
        (
            vec!["demo", "--commit", "quorum:x"],
            "invalid value 'quorum:x' for '--commit <COMMIT>'",
        ),
    ] {
        let err = refused(&args);
        assert!(err.contains(want), "{args:?}: {err}");
    }
}

#[test]
fn zero_deadlines_and_buckets_are_refused_at_parse_time_with_the_range() {
    for (args, want) in [
        (
            &["demo", "--deadline-s", "0"][..],
            "invalid value '0' for '--deadline-s <DEADLINE_S>': 0 is not in 1..=86400",
        ),
        (
            &["demo", "--bucket-mib", "0"],
            "invalid value '0' for '--bucket-mib <BUCKET_MIB>': 0 is not in 1..=65536",
        ),
        (
            &[
                "pair",
                "connect",
                "--name",
                "p",
                "--model",
                "qwen3-tiny",
                "--train",
                "megatron",
                "--infer",
                "sglang",
                "--update-deadline-s",
                "0",
            ],
            "invalid value '0' for '--update-deadline-s <UPDATE_DEADLINE_S>': 0 is not in 1..=86400",
        ),
        (
            &[
                "pair",
                "connect",
                "--name",
                "p",
                "--model",
                "qwen3-tiny",
                "--train",
                "megatron",
                "--infer",
                "sglang",
                "--join-deadline-s",
                "0",
            ],
            "invalid value '0' for '--join-deadline-s <JOIN_DEADLINE_S>': 0 is not in 1..=3600",
        ),
        (
            &[
                "pair",
                "connect",
                "--name",
                "p",
                "--model",
                "qwen3-tiny",
                "--train",
                "megatron",
                "--infer",
                "sglang",
                "--bucket-mib",
                "0",
            ],
            "invalid value '0' for '--bucket-mib <BUCKET_MIB>': 0 is not in 1..=65536",
        ),
    ] {
        let err = refused(args);
        assert!(err.contains(want), "{args:?}: {err}");
    }
}

#[test]
fn checksums_and_deadlines_are_spelled_one_way() {
    for (cmd, flags) in [
        (
            &["demo", "--help"][..],
            &["--checksums", "--deadline-s"][..],
        ),
        (
            &["pair", "connect", "--help"],
            &["--checksums", "--join-deadline-s", "--update-deadline-s"],
        ),
    ] {
        let (code, out, err) = cli(cmd);
        assert_eq!(code, 0, "{err}");
        for f in flags {
            assert!(out.contains(f), "{cmd:?} lacks {f}");
        }
        for old in ["--checksum ", "deadline-ms"] {
            assert!(!out.contains(old), "{cmd:?} still shows {old}");
        }
    }
}

#[test]
fn a_backend_alone_means_its_defaults_and_says_so() {
    let (code, out, err) = cli(&[
        "plan",
        "--model",
        "qwen3-tiny",
        "--train",
        "megatron",
        "--infer",
        "sglang",
        "--json",
    ]);
    assert_eq!(code, 0, "{err}");
    assert!(
        err.contains(
            "note: `--train megatron` names no settings, so megatron's defaults apply: tp=1, pp=1"
        ),
        "{err}"
    );
    assert!(
        err.contains("note: `--infer sglang` names no settings, so sglang's defaults apply: tp=1"),
        "{err}"
    );
    let j: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(j["training_ranks"], 1);
    // with a colon the user chose: no note
    let (_, _, err) = cli(&[
        "plan",
        "--model",
        "qwen3-tiny",
        "--train",
        "megatron:",
        "--infer",
        "sglang:tp=1",
    ]);
    assert!(!err.contains("note:"), "{err}");
}

#[test]
fn plan_of_a_rank_outside_the_layout_states_the_world_size() {
    let err = refused(&["plan", "--rank", "train:99"]);
    assert!(
        err.contains(
            "there is no training rank 99: `megatron:pp=2,tp=2` has world size 4 (ranks 0..=3)"
        ),
        "{err}"
    );
    let err = refused(&["plan", "--rank", "infer:2/0"]);
    assert!(
        err.contains("there is no inference rank 2/0: `sglang:engines=2,tp=2` has world size 4 (2 engines of 2 ranks, ranks 0/0..=1/1)"),
        "{err}"
    );
}

#[test]
fn counts_of_one_are_singular() {
    let (code, out, err) = cli(&[
        "plan",
        "--model",
        "qwen3-tiny",
        "--train",
        "megatron:tp=1",
        "--infer",
        "sglang:tp=1",
    ]);
    assert_eq!(code, 0, "{err}");
    assert!(
        out.contains("training     megatron:tp=1 (1 rank)\n"),
        "{out}"
    );
    assert!(out.contains("inference    sglang:tp=1 (1 rank)\n"), "{out}");
    let (code, out, err) = cli(&[
        "plan",
        "--model",
        "qwen3-tiny",
        "--train",
        "megatron:tp=1",
        "--infer",
        "sglang:tp=1",
        "--rank",
        "infer:0",
    ]);
    assert_eq!(code, 0, "{err}");
    assert!(out.starts_with("inference rank 0/0: 1 peer, "), "{out}");
}

#[test]
fn top_level_help_lists_every_command() {
    let (code, out, err) = cli(&["--help"]);
    assert_eq!(code, 0, "{err}");
    for c in [
        "detect", "plan", "serve", "pair", "bench", "demo", "gc", "simulate",
    ] {
        assert!(
            out.lines()
                .any(|l| l.trim_start().starts_with(&format!("{c} "))),
            "{c} missing from\n{out}"
        );
    }
}

#[test]
fn every_help_lists_every_spec_key_with_its_default() {
    for cmd in [
        &["plan", "--help"][..],
        &["demo", "--help"],
        &["pair", "connect", "--help"],
    ] {
        let (code, out, err) = cli(cmd);
        assert_eq!(code, 0, "{err}");
        for key in [
            "tp=1",
            "pp=1",
            "dp=1",
            "cp=1",
            "ep=1",
            "etp",
            "vpp",
            "first_stage_layers",
            "last_stage_layers",
            "fp32=0",
            "local_spec=0",
            "replicate=1",
            "engines=1",
        ] {
            assert!(out.contains(key), "{cmd:?} lacks `{key}`:\n{out}");
        }
    }
}

#[test]
fn plan_names_the_trained_tensors_the_inference_engine_drops() {
    // Qwen3 with attention_bias has o_proj biases; vLLM 0.33's Qwen3 class holds none
    let dir = config_dir("attention_bias", serde_json::json!(true));
    let model = dir.path().to_str().unwrap();
    let (code, out, err) = cli(&["plan", "--model", model, "--infer", "vllm:tp=2", "--json"]);
    assert_eq!(code, 0, "{err}");
    let j: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(j["exact"], true);
    assert_eq!(j["dropped_by_inference"].as_array().map(Vec::len), Some(4));
    assert_eq!(
        j["dropped_by_inference"][0],
        "model.layers.0.self_attn.o_proj.bias"
    );
    let (code, out, err) = cli(&["plan", "--model", model, "--infer", "vllm:tp=2"]);
    assert_eq!(code, 0, "{err}");
    assert!(
        out.contains(
            "dropped      4 trained tensors the inference engine does not hold (its load drops them; not moved): model.layers.0.self_attn.o_proj.bias, ..."
        ),
        "{out}"
    );
    // SGLang 0.5.23 holds them
    let (code, out, err) = cli(&["plan", "--model", model, "--infer", "sglang:tp=2", "--json"]);
    assert_eq!(code, 0, "{err}");
    let j: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(j["dropped_by_inference"], serde_json::json!([]));
}

#[test]
fn plan_help_lists_every_family_and_its_presets() {
    let (code, out, err) = cli(&["plan", "--help"]);
    assert_eq!(code, 0, "{err}");
    for family in [
        "llama (LlamaForCausalLM)",
        "qwen2 (Qwen2ForCausalLM)",
        "qwen3 (Qwen3ForCausalLM)",
        "qwen3-moe (Qwen3MoeForCausalLM)",
        "mixtral (MixtralForCausalLM)",
        "deepseek-v2 (DeepseekV2ForCausalLM)",
        "deepseek-v3 (DeepseekV3ForCausalLM)",
        "glm4-moe (Glm4MoeForCausalLM)",
        "qwen3-next (Qwen3NextForCausalLM)",
        "qwen3.5 (Qwen3_5ForCausalLM)",
        "qwen3.5-moe (Qwen3_5MoeForCausalLM)",
    ] {
        assert!(out.contains(family), "{family}: {out}");
    }
    for preset in awex_core::model::presets::names() {
        assert!(out.contains(&format!("    {preset} ")), "{preset}: {out}");
    }
}

/// Writes `tensors` (name, shape, dtype; zeros) as one safetensors file.
fn write_zero_checkpoint(path: &std::path::Path, tensors: &[(String, Vec<u64>, awex_core::DType)]) {
    let mut header = serde_json::Map::new();
    let mut at = 0u64;
    for (name, shape, dtype) in tensors {
        let len = shape.iter().product::<u64>() * dtype.size() as u64;
        header.insert(
            name.clone(),
            serde_json::json!({
                "dtype": dtype.safetensors_name(),
                "shape": shape,
                "data_offsets": [at, at + len]
            }),
        );
        at += len;
    }
    let text = Value::Object(header).to_string();
    let mut out = (text.len() as u64).to_le_bytes().to_vec();
    out.extend(text.as_bytes());
    out.resize(out.len() + at as usize, 0);
    std::fs::write(path, out).unwrap();
}

#[test]
fn plan_says_the_mtp_layer_is_not_moved_and_skips_its_checkpoint_tensors() {
    let fixture: Value = serde_json::from_str(include_str!(
        "../../awex-core/tests/fixtures/hf/glm4-moe.json"
    ))
    .unwrap();
    let mut cfg = fixture["config"].clone();
    let spec = awex_core::model::ModelSpec::from_config_value(&cfg).unwrap();
    let layers = spec.num_layers;
    let mut tensors: Vec<_> = awex_core::Catalogue::of(&spec)
        .tensors()
        .iter()
        .map(|t| (t.name.clone(), t.shape.as_slice().to_vec(), t.dtype))
        .collect();
    // the MTP layer a GLM-4.5 checkpoint holds after its decoder layers
    for leaf in ["enorm.weight", "hnorm.weight", "eh_proj.weight"] {
        tensors.push((
            format!("model.layers.{layers}.{leaf}"),
            vec![64],
            awex_core::DType::Bf16,
        ));
    }
    let dir = tempfile::tempdir().unwrap();
    write_zero_checkpoint(&dir.path().join("model.safetensors"), &tensors);
    let model = dir.path().to_str().unwrap();
    let plan = [
        "plan",
        "--model",
        model,
        "--train",
        "megatron:tp=2",
        "--infer",
        "sglang:tp=1,fused_shared_experts=0",
    ];

    // undeclared: refused, naming the tensor and the field
    std::fs::write(dir.path().join("config.json"), cfg.to_string()).unwrap();
    let err = refused(&plan);
    assert!(
        err.contains(&format!(
            "`model.layers.{layers}.eh_proj.weight` is not a tensor of the model in config.json \
             (past the model's {layers} decoder layers"
        )) && err.contains("num_nextn_predict_layers"),
        "{err}"
    );

    // declared: planned, the rule and the skipped tensors said, in text and JSON
    cfg["num_nextn_predict_layers"] = serde_json::json!(1);
    std::fs::write(dir.path().join("config.json"), cfg.to_string()).unwrap();
    let (code, out, err) = cli(&plan);
    assert_eq!(code, 0, "{err}");
    assert!(
        out.contains(&format!(
            "not moved    model.layers.{layers}.*: the multi-token-prediction layer \
             (num_nextn_predict_layers = 1)"
        )) && out.contains("skipped      3 tensors of the checkpoint under that rule"),
        "{out}"
    );
    let json: Vec<&str> = plan.iter().copied().chain(["--json"]).collect();
    let (code, out, err) = cli(&json);
    assert_eq!(code, 0, "{err}");
    let j: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(j["exact"], true);
    assert_eq!(j["not_moved"].as_array().map(Vec::len), Some(1));
    assert_eq!(j["skipped_checkpoint_tensors"], 3);
    // a model without MTP layers says nothing of them
    let (_, out, _) = cli(&["plan", "--json"]);
    let j: Value = serde_json::from_str(&out).unwrap();
    assert!(j.get("not_moved").is_none() && j.get("skipped_checkpoint_tensors").is_none());
}

#[test]
fn fp8_plan_reports_bytes_per_encoding_and_plain_plans_say_nothing_of_it() {
    let plain = [
        "plan",
        "--model",
        "qwen3-tiny",
        "--infer",
        "sglang:tp=2",
        "--json",
    ];
    let (code, out, err) = cli(&plain);
    assert_eq!(code, 0, "{err}");
    let j: Value = serde_json::from_str(&out).unwrap();
    assert!(j.get("fp8").is_none(), "{j}");
    let plain_moved = j["moved_bytes"].as_u64().unwrap();

    let mut fp8 = plain.to_vec();
    fp8.extend([
        "--infer-quant",
        "fp8",
        "--fp8-block",
        "16x16",
        "--fp8-encode-at",
        "receiver",
    ]);
    let (code, out, err) = cli(&fp8);
    assert_eq!(code, 0, "{err}");
    let j: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(j["exact"], true);
    assert_eq!(j["fingerprints_agree"], true);
    let f = &j["fp8"];
    assert_eq!(
        f["encoding"],
        "fp8 e4m3, 16x16 blocks, fp32 scales, recipe vllm"
    );
    assert_eq!(f["encoded_at"], "receiver");
    // receiver-encoded: bf16 on the wire (2 bytes per element), e4m3 lands (1 byte)
    let (wire, e4m3) = (
        f["wire_bytes"].as_u64().unwrap(),
        f["e4m3_bytes"].as_u64().unwrap(),
    );
    assert!(e4m3 > 0 && wire == 2 * e4m3, "{f}");
    // qwen3-tiny's linear weights per engine: 4 layers x (qkv, o, gate_up, down) per rank x 2
    assert_eq!(f["fp8_tensors"], 16);
    // one fp32 scale per 16x16 block
    assert_eq!(f["scale_bytes"].as_u64().unwrap(), e4m3 / 256 * 4);
    // what moves is what a plain pair moves: the plan differs only in where bf16 lands
    assert_eq!(j["moved_bytes"].as_u64().unwrap(), plain_moved);
    assert_eq!(
        f["plain_bytes"].as_u64().unwrap() + wire,
        plain_moved,
        "{f}"
    );

    let (code, out, err) = cli(&[
        "plan",
        "--model",
        "qwen3-tiny",
        "--infer",
        "sglang:tp=2",
        "--infer-quant",
        "fp8",
        "--fp8-block",
        "16x16",
    ]);
    assert_eq!(code, 0, "{err}");
    assert!(
        out.contains("encoding     fp8 e4m3, 16x16 blocks, fp32 scales, recipe vllm")
            && out.contains("land in the engines"),
        "{out}"
    );
}

#[test]
fn fp8_plan_reports_sender_encoded_bytes_on_the_wire() {
    let base = [
        "plan",
        "--model",
        "qwen3-tiny",
        "--infer",
        "sglang:tp=2",
        "--infer-quant",
        "fp8",
        "--fp8-block",
        "16x16",
        "--json",
    ];
    let run = |extra: &[&str]| {
        let mut a = base.to_vec();
        a.extend(extra);
        let (code, out, err) = cli(&a);
        assert_eq!(code, 0, "{err}");
        serde_json::from_str::<Value>(&out).unwrap()
    };
    let recv = run(&["--fp8-encode-at", "receiver"]);
    // megatron tp 2 -> sglang tp 2: every block held whole by one sender
    let j = run(&["--fp8-encode-at", "sender"]);
    // `plan` plans as shm, which quantises on the sender
    assert_eq!(run(&[])["fp8"], j["fp8"]);
    assert_eq!(j["exact"], true, "{j}");
    assert_eq!(j["fingerprints_agree"], true);
    let (f, fr) = (&j["fp8"], &recv["fp8"]);
    let n = |v: &Value, k: &str| v[k].as_u64().unwrap();
    assert_eq!(f["encoded_at"], "sender");
    assert_eq!(n(f, "receiver_blocks"), 0);
    assert_eq!(n(f, "receiver_wire_bytes"), 0);
    assert_eq!(n(f, "sender_e4m3_bytes"), n(f, "e4m3_bytes"));
    assert_eq!(n(f, "sender_scale_bytes"), n(f, "scale_bytes"));
    assert_eq!(n(f, "sender_blocks") * 4, n(f, "scale_bytes"));
    assert_eq!(
        n(f, "wire_bytes"),
        n(f, "e4m3_bytes") + n(f, "scale_bytes"),
        "{f}"
    );
    // half the bf16 plus the scales
    assert_eq!(
        n(fr, "wire_bytes"),
        2 * n(f, "wire_bytes") - 2 * n(f, "scale_bytes")
    );
    assert_eq!(
        n(&j, "moved_bytes"),
        n(f, "plain_bytes") + n(f, "wire_bytes")
    );
    assert_eq!(n(f, "plain_bytes"), n(fr, "plain_bytes"));
    assert_eq!(n(&j, "required_bytes"), n(&recv, "required_bytes"));
    // fsdp dp 3: its row chunks cut blocks, which the receiver quantises
    let mut fsdp = base.to_vec();
    fsdp.extend(["--train", "fsdp:dp=3", "--fp8-encode-at", "sender"]);
    let (code, out, err) = cli(&fsdp);
    assert_eq!(code, 0, "{err}");
    let j: Value = serde_json::from_str(&out).unwrap();
    let f = &j["fp8"];
    assert_eq!(j["exact"], true, "{j}");
    assert_eq!(f["encoded_at"], "sender+receiver");
    assert!(n(f, "receiver_blocks") > 0 && n(f, "sender_blocks") > n(f, "receiver_blocks"));
    assert_eq!(
        n(f, "sender_blocks") + n(f, "receiver_blocks"),
        n(f, "scale_bytes") / 4
    );
    assert!(n(f, "receiver_wire_bytes") > 0);
    assert_eq!(
        n(f, "wire_bytes"),
        n(f, "sender_e4m3_bytes") + n(f, "sender_scale_bytes") + n(f, "receiver_wire_bytes")
    );
    // the table says both
    let table: Vec<&str> = fsdp.iter().copied().filter(|a| *a != "--json").collect();
    let (code, out, err) = cli(&table);
    assert_eq!(code, 0, "{err}");
    assert!(
        out.contains("quantised by their sender")
            && out.contains("cut between senders by the receiver")
            && out.contains("sender-encoded")
            && out.contains("receiver-encoded"),
        "{out}"
    );
    // a rank's transfers say where their scales land
    let mut rank = table.clone();
    rank.extend(["--rank", "infer:0/0"]);
    let (code, out, err) = cli(&rank);
    assert_eq!(code, 0, "{err}");
    assert!(
        out.contains("fp8 by the sender") && out.contains("weight_scale_inv"),
        "{out}"
    );
    assert!(out.contains("fp8 by the receiver"), "{out}");
}

#[test]
fn fp8_flags_are_refused_clearly() {
    let refused_with = |args: &[&str], want: &str| {
        let (code, _, err) = cli(args);
        assert_ne!(code, 0);
        assert!(err.contains(want), "{args:?}: {err}");
    };
    let base = ["plan", "--model", "qwen3-tiny", "--infer", "sglang:tp=2"];
    fn with<'a>(base: &[&'a str], extra: &[&'a str]) -> Vec<&'a str> {
        let mut v: Vec<&str> = base.to_vec();
        v.extend(extra);
        v
    }
    // 64 query rows over tp 2 cut 128-row blocks, as SGLang refuses them
    refused_with(
        &with(&base, &["--infer-quant", "fp8"]),
        "output_partition_size = 32 is not divisible by weight quantization block_n = 128",
    );
    refused_with(
        &with(&base, &["--fp8-recipe", "vllm"]),
        "need --infer-quant fp8",
    );
    refused_with(
        &with(&base, &["--infer-quant", "fp8", "--fp8-recipe", "nope"]),
        "nope",
    );
    refused_with(
        &with(&base, &["--infer-quant", "fp8", "--fp8-block", "16"]),
        "expected ROWSxCOLS",
    );
    // an inference config whose model is not --model's
    let other = config_dir("num_hidden_layers", serde_json::json!(2));
    let mut cfg: Value =
        serde_json::from_str(&std::fs::read_to_string(other.path().join("config.json")).unwrap())
            .unwrap();
    cfg["quantization_config"] = serde_json::json!({
        "quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [16, 16]
    });
    std::fs::write(other.path().join("config.json"), cfg.to_string()).unwrap();
    refused_with(
        &with(&base, &["--infer-config", other.path().to_str().unwrap()]),
        "differs from --model `qwen3-tiny` in more than the quantisation",
    );
    // a config without quantization_config
    let plain = config_dir("num_hidden_layers", serde_json::json!(4));
    refused_with(
        &with(&base, &["--infer-config", plain.path().to_str().unwrap()]),
        "has no quantization_config",
    );
}

#[test]
fn plan_predicts_a_delta_update_from_a_density_and_refuses_one_outside_zero_to_one() {
    // the default pair moves bf16 only: at 3.03 % of its elements changed the format's gaps
    // take 0.83 bytes per change beside the 2 of its value: 4.28 % of the dense bytes
    // (awex_core::encoding::delta::expected_fraction; the sparse form alone: 4.74 %)
    let (code, out, err) = cli(&["plan", "--json", "--delta-density", "0.0303"]);
    assert_eq!(code, 0, "{err}");
    let j: Value = serde_json::from_str(&out).unwrap();
    let f = j["delta"]["fraction_of_dense"].as_f64().unwrap();
    assert!((0.0415..0.044).contains(&f), "{f}");
    let moved = j["moved_bytes"].as_f64().unwrap();
    let expected = j["delta"]["expected_bytes"].as_f64().unwrap();
    assert!((expected / moved - f).abs() < 1e-9);
    // nothing changed: a tag byte per segment, nothing per element
    let (_, out, _) = cli(&["plan", "--json", "--delta-density", "0"]);
    let j: Value = serde_json::from_str(&out).unwrap();
    let f0 = j["delta"]["fraction_of_dense"].as_f64().unwrap();
    assert_eq!(f0, 0.0, "{f0}");
    // the table says it too
    let (code, out, _) = cli(&["plan", "--delta-density", "0.03"]);
    assert_eq!(code, 0);
    assert!(
        out.contains("delta ") && out.contains("of the dense bytes"),
        "{out}"
    );
    let (code, _, err) = cli(&["plan", "--delta-density", "1.5"]);
    assert_ne!(code, 0);
    assert!(
        err.contains("--delta-density 1.5 is outside [0, 1]"),
        "{err}"
    );
    // without it, no prediction
    let (_, out, _) = cli(&["plan", "--json"]);
    let j: Value = serde_json::from_str(&out).unwrap();
    assert!(j.get("delta").is_none());
}

#[test]
fn simulate_with_a_joining_engine_predicts_its_full_catch_up_beside_the_others_deltas() {
    let run = |args: &[&str]| -> Value {
        let mut all = vec![
            "simulate",
            "--model",
            "qwen3-0.6b",
            "--train",
            "megatron:tp=2",
            "--topology",
            "h200x8",
            "--infer",
            "sglang:tp=1,engines=8",
            "--json",
        ];
        all.extend_from_slice(args);
        let (code, out, err) = cli(&all);
        assert_eq!(code, 0, "{all:?}: {err}");
        serde_json::from_str(&out).expect("simulate --json prints JSON")
    };
    let dense = run(&[]);
    let deltas = run(&["--delta-density", "0.03"]);
    let joining = run(&["--delta-density", "0.03", "--joining-engines", "7"]);
    assert_eq!(joining["joining_engines"], serde_json::json!([7]));
    let s = |v: &Value| v["predicted_s"].as_f64().unwrap();
    // the joining engine takes every byte while the seven others take deltas: slower than
    // deltas to all, never slower than every engine taking every byte
    assert!(
        s(&joining) > s(&deltas),
        "{} vs {}",
        s(&joining),
        s(&deltas)
    );
    assert!(s(&joining) <= s(&dense), "{} vs {}", s(&joining), s(&dense));
    // without deltas every rank takes every byte anyway: a joining engine changes nothing
    let dense_joining = run(&["--joining-engines", "7"]);
    assert_eq!(s(&dense_joining), s(&dense));
    let err = refused(&[
        "simulate",
        "--model",
        "qwen3-0.6b",
        "--infer",
        "sglang:tp=1,engines=8",
        "--failed-engines",
        "3",
        "--joining-engines",
        "3",
    ]);
    assert!(
        err.contains("engine 3 is in both --failed-engines and --joining-engines"),
        "{err}"
    );
}

#[test]
fn simulate_with_a_failed_engine_predicts_the_others_as_a_smaller_fleet() {
    let run = |args: &[&str]| -> Value {
        let mut all = vec![
            "simulate",
            "--model",
            "qwen3-0.6b",
            "--train",
            "megatron:tp=2",
            "--topology",
            "h200x8",
            "--json",
        ];
        all.extend_from_slice(args);
        let (code, out, err) = cli(&all);
        assert_eq!(code, 0, "{all:?}: {err}");
        serde_json::from_str(&out).expect("simulate --json prints JSON")
    };
    let eight_one_failed = run(&["--infer", "sglang:tp=1,engines=8", "--failed-engines", "7"]);
    let seven = run(&["--infer", "sglang:tp=1,engines=7"]);
    assert_eq!(eight_one_failed["failed_engines"], serde_json::json!([7]));
    // the failed engine's ranks get nothing: the others move what seven engines move
    assert_eq!(eight_one_failed["moved_bytes"], seven["moved_bytes"]);
    let (a, b) = (
        eight_one_failed["predicted_s"].as_f64().unwrap(),
        seven["predicted_s"].as_f64().unwrap(),
    );
    assert!(
        a <= 1.10 * b,
        "{a} s with one of 8 engines failed vs {b} s for 7"
    );
    let err = refused(&[
        "simulate",
        "--model",
        "qwen3-0.6b",
        "--infer",
        "sglang:tp=1,engines=8",
        "--failed-engines",
        "8",
    ]);
    assert!(
        err.contains(
            "--failed-engines names engine 8, but `sglang:tp=1,engines=8` has engines 0..8"
        ),
        "{err}"
    );
}

#[test]
fn bench_delta_moves_a_few_per_cent_on_optimiser_made_versions_and_verifies_every_byte() {
    for transport in ["tcp", "shm"] {
        let (code, out, err) = cli(&[
            "bench",
            "delta",
            "--model",
            "qwen3-tiny",
            "--transport",
            transport,
            "--updates",
            "3",
            "--json",
        ]);
        assert_eq!(code, 0, "{transport}: {err}");
        let j: Value = serde_json::from_str(&out).unwrap();
        assert_eq!(j["verified"], true, "{transport}: {j}");
        let modes = j["modes"].as_array().unwrap();
        let dense = j["dense_bytes"].as_u64().unwrap();
        // the dense mode moves every byte each time; the delta mode a few per cent of them,
        // at the density of an Adam-like step at lr 1e-6 (about 1 % of the elements)
        for b in modes[0]["received_bytes"].as_array().unwrap() {
            assert_eq!(b.as_u64(), Some(dense), "{transport}: {j}");
        }
        for b in modes[1]["received_bytes"].as_array().unwrap() {
            let b = b.as_u64().unwrap();
            assert!(b > 0 && b * 10 < dense, "{transport}: {j}");
        }
        for d in modes[1]["density"].as_array().unwrap() {
            let d = d.as_f64().unwrap();
            assert!((0.003..0.06).contains(&d), "{transport}: {j}");
        }
        assert_eq!(modes[1]["update_ms"].as_array().unwrap().len(), 2);
        // dense: no copy to refresh; deltas: every peer took one, so the training ranks wrote
        // only the changed elements into their copies, not their whole shards
        for b in modes[0]["refreshed_bytes"].as_array().unwrap() {
            assert_eq!(b.as_u64(), Some(0), "{transport}: {j}");
        }
        for b in modes[1]["refreshed_bytes"].as_array().unwrap() {
            let b = b.as_u64().unwrap();
            assert!(b > 0 && b * 10 < dense, "{transport}: {j}");
        }
    }
    // bad input is named
    let (code, _, err) = cli(&["bench", "delta", "--transport", "nccl"]);
    assert_ne!(code, 0);
    assert!(err.contains("shm or tcp"), "{err}");
    let (code, _, err) = cli(&["bench", "delta", "--lr", "0"]);
    assert_ne!(code, 0);
    assert!(err.contains("--lr 0 is not a learning rate"), "{err}");
}

/// Runs awex-cli with `args`, killed if it has not finished within `deadline` (a hang, not a
/// slow machine: every command here finishes in well under a second).
fn cli_within(args: &[&str], deadline: std::time::Duration) -> Option<(i32, String)> {
    let mut child = Command::new(env!("CARGO_BIN_EXE_awex-cli"))
        .args(args)
        .env("PATH", "/nonexistent")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("run awex-cli");
    let start = std::time::Instant::now();
    loop {
        if let Some(status) = child.try_wait().expect("wait") {
            let mut err = String::new();
            std::io::Read::read_to_string(&mut child.stderr.take().expect("stderr"), &mut err)
                .expect("stderr");
            return Some((status.code().unwrap_or(-1), err));
        }
        if start.elapsed() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            return None;
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
}

#[test]
fn a_fifo_named_as_any_input_file_is_refused_not_waited_on() {
    let dir = tempfile::tempdir().unwrap();
    let fifo = |name: &str| {
        let p = dir.path().join(name);
        let c = std::ffi::CString::new(p.to_str().unwrap()).unwrap();
        // SAFETY: mkfifo reads a NUL-terminated path that lives for the call.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        p.to_str().unwrap().to_string()
    };
    // a model directory whose config.json is a FIFO, a FIFO token file, a FIFO topology, and a
    // checkpoint directory whose tracker file and metadata.json are FIFOs
    std::fs::create_dir(dir.path().join("model")).unwrap();
    let config = fifo("model/config.json");
    let model_dir = dir.path().join("model").to_str().unwrap().to_string();
    let token = fifo("token");
    let topology = fifo("topology.toml");
    std::fs::create_dir(dir.path().join("ckpt")).unwrap();
    fifo("ckpt/latest_checkpointed_iteration.txt");
    fifo("ckpt/metadata.json");
    let ckpt = dir.path().join("ckpt").to_str().unwrap().to_string();
    let side = ["--train", "megatron:tp=1", "--infer", "sglang:tp=1"];
    let with = |head: &[&str]| -> Vec<String> {
        head.iter().chain(&side).map(|s| s.to_string()).collect()
    };
    let refusals = [
        with(&["plan", "--model", &config]),
        with(&["plan", "--model", &model_dir]),
        with(&["simulate", "--model", &model_dir]),
        with(&["demo", "--model", &model_dir]),
        with(&[
            "plan",
            "--model",
            "qwen3-tiny",
            "--infer-config",
            &model_dir,
        ]),
        with(&[
            "simulate",
            "--model",
            "qwen3-tiny",
            "--infer-config",
            &config,
        ]),
        with(&["simulate", "--model", "qwen3-tiny", "--topology", &topology]),
        vec![
            "serve".into(),
            "--token-file".into(),
            token.clone(),
            "--bind".into(),
            "127.0.0.1:0".into(),
        ],
    ];
    let deadline = std::time::Duration::from_secs(120);
    for args in &refusals {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let (code, err) = cli_within(&args, deadline)
            .unwrap_or_else(|| panic!("{args:?} waited on a FIFO instead of refusing it"));
        assert_eq!(code, 2, "{args:?}: {err}");
        assert!(
            err.contains("it is a FIFO, not a regular file"),
            "{args:?}: {err}"
        );
    }
    // detect passes over a checkpoint file it cannot read, and still reports
    let (code, err) = cli_within(&["detect", "--checkpoint", &ckpt], deadline)
        .expect("detect waited on a FIFO in the checkpoint directory");
    assert_eq!(code, 0, "{err}");
}
