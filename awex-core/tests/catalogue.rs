//! The canonical catalogue against what HuggingFace `transformers` really saves, and the presets.
//!
//! The fixtures in `tests/fixtures/hf/` were written by `tools/hf_fixtures.py` (see the README
//! there): each holds a `config.json` saved by `transformers` and the names, shapes and dtypes of
//! every tensor in the safetensors checkpoint saved beside it. transformers 5.17.0 fuses MoE
//! experts in memory (`mlp.experts.gate_up_proj` [E, 2*I, H], `mlp.experts.down_proj` [E, H, I])
//! but `save_pretrained` writes the per-expert `mlp.experts.{e}.{gate,up,down}_proj.weight`
//! tensors of published Hub checkpoints, which is also what awex's catalogue names; the fixtures
//! are compared as written, with no conversion.

use awex_core::model::{Architecture, Catalogue, ModelSpec, presets};
use serde_json::Value;
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

/// Every fixture this file checks; `every_fixture_file_is_checked` keeps it in step with the folder.
const FIXTURES: &[&str] = &[
    "llama",
    "qwen2",
    "qwen3",
    "qwen3-tied",
    "qwen3-wide-head",
    "qwen3-moe",
    "qwen3-moe-step2",
    "qwen3-attention-bias",
    "llama-attention-bias",
    "mixtral",
    "deepseek-v2",
    "deepseek-v3",
    "deepseek-v3-no-q-lora",
    "glm4-moe",
    "glm4-moe-plain",
    "qwen3-next",
    "qwen3.5",
    "qwen3.5-moe",
    "gpt-oss",
];

/// One tensor as (name, shape, safetensors dtype name), the unit both sides are compared in.
type Entry = (String, Vec<u64>, String);

fn fixture_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/hf")
}

fn load(name: &str) -> Value {
    let path = fixture_dir().join(format!("{name}.json"));
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("cannot read fixture {}: {e}", path.display()));
    serde_json::from_str(&text)
        .unwrap_or_else(|e| panic!("fixture {} is not JSON: {e}", path.display()))
}

fn fixture_entries(doc: &Value) -> Vec<Entry> {
    let tensors = doc["tensors"]
        .as_object()
        .unwrap_or_else(|| panic!("fixture has no `tensors` object"));
    let mut out: Vec<Entry> = tensors
        .iter()
        .map(|(name, t)| {
            let shape = t["shape"]
                .as_array()
                .unwrap_or_else(|| panic!("`{name}` has no shape list"))
                .iter()
                .map(|d| {
                    d.as_u64()
                        .unwrap_or_else(|| panic!("`{name}` has a non-integer dim {d}"))
                })
                .collect();
            let dtype = t["dtype"]
                .as_str()
                .unwrap_or_else(|| panic!("`{name}` has no dtype string"))
                .to_string();
            (name.clone(), shape, dtype)
        })
        .collect();
    out.sort();
    out
}

fn catalogue_entries(cat: &Catalogue) -> Vec<Entry> {
    let mut out: Vec<Entry> = cat
        .tensors()
        .iter()
        .map(|t| {
            (
                t.name.clone(),
                t.shape.as_slice().to_vec(),
                t.dtype.safetensors_name().to_string(),
            )
        })
        .collect();
    out.sort();
    out
}

/// Describes the first place two sorted lists differ, or `None` when they are equal.
fn first_difference(awex: &[Entry], hf: &[Entry]) -> Option<String> {
    for (i, (a, h)) in awex.iter().zip(hf).enumerate() {
        if a != h {
            return Some(format!(
                "at sorted index {i}: awex has {a:?}, transformers saved {h:?}"
            ));
        }
    }
    match awex.len().cmp(&hf.len()) {
        std::cmp::Ordering::Equal => None,
        std::cmp::Ordering::Greater => Some(format!(
            "awex has {} more tensors, first {:?}",
            awex.len() - hf.len(),
            awex[hf.len()]
        )),
        std::cmp::Ordering::Less => Some(format!(
            "transformers saved {} more tensors, first {:?}",
            hf.len() - awex.len(),
            hf[awex.len()]
        )),
    }
}

/// Parses the fixture's config, builds awex's catalogue, and asserts it equals the saved tensors.
fn check_fixture(name: &str) -> ModelSpec {
    let doc = load(name);
    let spec = ModelSpec::from_config_value(&doc["config"])
        .unwrap_or_else(|e| panic!("fixture {name}: config rejected: {e}"));
    let awex = catalogue_entries(&Catalogue::of(&spec));
    let hf = fixture_entries(&doc);
    if let Some(diff) = first_difference(&awex, &hf) {
        panic!(
            "fixture {name} (transformers {}): catalogue differs from the saved checkpoint: {diff}",
            doc["transformers_version"]
        );
    }
    spec
}

fn names(cat: &Catalogue) -> BTreeSet<&str> {
    cat.tensors().iter().map(|t| t.name.as_str()).collect()
}

#[test]
fn first_difference_names_the_first_mismatch_and_any_extra_tensor() {
    let e = |n: &str, s: &[u64]| (n.to_string(), s.to_vec(), "BF16".to_string());
    let hf = vec![e("a", &[2, 3]), e("b", &[4])];
    assert_eq!(first_difference(&hf, &hf), None);
    assert_eq!(
        first_difference(&[e("a", &[3, 2]), e("b", &[4])], &hf),
        Some(
            "at sorted index 0: awex has (\"a\", [3, 2], \"BF16\"), transformers saved \
             (\"a\", [2, 3], \"BF16\")"
                .to_string()
        )
    );
    assert_eq!(
        first_difference(&hf[..1], &hf),
        Some("transformers saved 1 more tensors, first (\"b\", [4], \"BF16\")".to_string())
    );
    assert_eq!(
        first_difference(&hf, &hf[..1]),
        Some("awex has 1 more tensors, first (\"b\", [4], \"BF16\")".to_string())
    );
}

#[test]
fn every_fixture_file_is_checked() {
    let mut on_disk: Vec<String> = std::fs::read_dir(fixture_dir())
        .unwrap_or_else(|e| panic!("cannot list fixtures: {e}"))
        .filter_map(|e| e.ok())
        .filter_map(|e| {
            e.file_name()
                .to_str()
                .and_then(|n| n.strip_suffix(".json"))
                .map(str::to_string)
        })
        .collect();
    on_disk.sort();
    let mut listed: Vec<String> = FIXTURES.iter().map(|s| s.to_string()).collect();
    listed.sort();
    assert_eq!(on_disk, listed);
}

#[test]
fn fixtures_record_the_transformers_and_torch_that_wrote_them() {
    for name in FIXTURES {
        let doc = load(name);
        assert_eq!(doc["transformers_version"], "5.19.0", "{name}");
        assert_eq!(doc["torch_version"], "2.14.1+cu130", "{name}");
        assert_eq!(doc["config"]["dtype"], "bfloat16", "{name}");
    }
}

#[test]
fn llama_catalogue_matches_transformers() {
    let spec = check_fixture("llama");
    assert_eq!(spec.architecture, Architecture::Llama);
    assert!(!spec.attention_bias);
    assert_eq!(Catalogue::of(&spec).len(), 21);
}

#[test]
fn qwen2_catalogue_matches_transformers_with_qkv_biases() {
    let spec = check_fixture("qwen2");
    assert_eq!(spec.architecture, Architecture::Qwen2);
    // The saved Qwen2 config has no `attention_bias`; the biases come from the architecture.
    assert!(load("qwen2")["config"].get("attention_bias").is_none());
    assert!(spec.attention_bias);
    let cat = Catalogue::of(&spec);
    assert_eq!(cat.len(), 27);
    assert_eq!(
        cat.get("model.layers.1.self_attn.k_proj.bias")
            .map(|t| t.shape.as_slice().to_vec()),
        Some(vec![32])
    );
}

#[test]
fn qwen3_catalogue_matches_transformers() {
    let spec = check_fixture("qwen3");
    assert_eq!(spec.architecture, Architecture::Qwen3);
    assert_eq!(Catalogue::of(&spec).len(), 25);
}

#[test]
fn qwen3_tied_catalogue_matches_transformers_without_lm_head() {
    let spec = check_fixture("qwen3-tied");
    assert!(spec.tie_word_embeddings);
    let cat = Catalogue::of(&spec);
    assert_eq!(cat.len(), 24);
    assert!(cat.get("lm_head.weight").is_none());
}

#[test]
fn qwen3_wide_head_catalogue_matches_transformers() {
    let spec = check_fixture("qwen3-wide-head");
    assert_eq!(
        (spec.hidden_size, spec.num_heads, spec.head_dim),
        (64, 4, 32)
    );
    let cat = Catalogue::of(&spec);
    assert_eq!(
        cat.get("model.layers.0.self_attn.q_proj.weight")
            .map(|t| t.shape.as_slice().to_vec()),
        Some(vec![128, 64])
    );
    assert_eq!(
        cat.get("model.layers.0.self_attn.o_proj.weight")
            .map(|t| t.shape.as_slice().to_vec()),
        Some(vec![64, 128])
    );
}

#[test]
fn qwen3_moe_catalogue_matches_transformers_per_expert_names() {
    let spec = check_fixture("qwen3-moe");
    // transformers 5 writes `num_local_experts`, not `num_experts`.
    let cfg = &load("qwen3-moe")["config"];
    assert_eq!(cfg["num_local_experts"], 8);
    assert!(cfg.get("num_experts").is_none());
    assert_eq!(spec.num_experts(), 8);
    let moe_layers: Vec<u64> = (0..spec.num_layers)
        .filter(|&l| spec.is_moe_layer(l))
        .collect();
    assert_eq!(moe_layers, vec![1, 2, 3]);
    let cat = Catalogue::of(&spec);
    assert_eq!(cat.len(), 113);
    assert!(cat.get("model.layers.0.mlp.gate_proj.weight").is_some());
    assert!(cat.get("model.layers.0.mlp.gate.weight").is_none());
    assert_eq!(
        cat.get("model.layers.3.mlp.experts.7.down_proj.weight")
            .map(|t| t.shape.as_slice().to_vec()),
        Some(vec![64, 32])
    );
}

#[test]
fn qwen3_moe_sparse_step_catalogue_matches_transformers() {
    let spec = check_fixture("qwen3-moe-step2");
    let moe_layers: Vec<u64> = (0..spec.num_layers)
        .filter(|&l| spec.is_moe_layer(l))
        .collect();
    assert_eq!(moe_layers, vec![1, 3]);
    assert_eq!(Catalogue::of(&spec).len(), 91);
}

#[test]
fn qwen3_moe_tiny_preset_equals_the_transformers_checkpoint() {
    let spec = presets::preset("qwen3-moe-tiny").unwrap_or_else(|| panic!("no qwen3-moe-tiny"));
    let awex = catalogue_entries(&Catalogue::of(&spec));
    let hf = fixture_entries(&load("qwen3-moe"));
    assert_eq!(first_difference(&awex, &hf), None);
}

#[test]
fn every_preset_name_resolves_to_a_spec_of_that_name() {
    for name in presets::names() {
        let spec = ModelSpec::resolve(name).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(spec.name, name);
        assert_eq!(spec.validate(), Ok(()), "{name}");
        let qwen3 = spec.architecture.hf_name().starts_with("Qwen3");
        // GLM-4.5 has q/k norms, GLM-4.5-Air does not (use_qk_norm)
        let glm_qk = spec.architecture == Architecture::Glm4Moe && spec.use_qk_norm;
        assert_eq!(spec.qk_norm(), qwen3 || glm_qk, "{name}");
    }
    assert_eq!(presets::names().len(), 27);
    assert!(presets::preset("qwen3-9b").is_none());
}

/// (hidden, layers, heads, kv heads, head_dim, intermediate, vocab, tied, experts, per token, moe intermediate)
type Sizes = (u64, u64, u64, u64, u64, u64, u64, bool, u64, u64, u64);

fn sizes(name: &str) -> Sizes {
    let s = presets::preset(name).unwrap_or_else(|| panic!("no preset {name}"));
    let (e, k, mi) = s.moe.as_ref().map_or((0, 0, 0), |m| {
        (m.num_experts, m.experts_per_token, m.moe_intermediate_size)
    });
    (
        s.hidden_size,
        s.num_layers,
        s.num_heads,
        s.num_kv_heads,
        s.head_dim,
        s.intermediate_size,
        s.vocab_size,
        s.tie_word_embeddings,
        e,
        k,
        mi,
    )
}

#[test]
fn presets_carry_the_published_sizes() {
    assert_eq!(
        sizes("qwen3-0.6b"),
        (1024, 28, 16, 8, 128, 3072, 151936, true, 0, 0, 0)
    );
    assert_eq!(
        sizes("qwen3-8b"),
        (4096, 36, 32, 8, 128, 12288, 151936, false, 0, 0, 0)
    );
    assert_eq!(
        sizes("qwen3-30b-a3b"),
        (2048, 48, 32, 4, 128, 6144, 151936, false, 128, 8, 768)
    );
    assert_eq!(
        sizes("qwen3-235b-a22b"),
        (4096, 94, 64, 4, 128, 12288, 151936, false, 128, 8, 1536)
    );
    assert_eq!(
        sizes("moe-1t"),
        (7168, 64, 64, 8, 128, 18432, 163840, false, 384, 8, 2048)
    );
    assert_eq!(
        sizes("qwen3-tiny"),
        (64, 4, 4, 2, 16, 128, 1000, false, 0, 0, 0)
    );
    assert_eq!(
        sizes("qwen3-moe-tiny"),
        (64, 4, 4, 2, 16, 128, 1000, false, 8, 2, 32)
    );
}

fn totals(name: &str) -> (usize, u64, u64) {
    let spec = presets::preset(name).unwrap_or_else(|| panic!("no preset {name}"));
    let cat = Catalogue::of(&spec);
    let params: u64 = cat.tensors().iter().map(|t| t.numel()).sum();
    (cat.len(), params, cat.total_bytes())
}

#[test]
fn preset_catalogues_have_the_exact_parameter_counts() {
    // (tensors, parameters, bf16 bytes)
    assert_eq!(totals("qwen3-tiny"), (47, 276_160, 552_320));
    assert_eq!(totals("qwen3-moe-tiny"), (113, 351_424, 702_848));
    assert_eq!(totals("qwen3-0.6b"), (310, 596_049_920, 1_192_099_840));
    // 8.19e9 parameters, 16.38 GB of bf16.
    assert_eq!(totals("qwen3-8b"), (399, 8_190_735_360, 16_381_470_720));
    assert_eq!(
        totals("qwen3-30b-a3b"),
        (18_867, 30_532_122_624, 61_064_245_248)
    );
    assert_eq!(
        totals("qwen3-235b-a22b"),
        (36_945, 235_093_634_560, 470_187_269_120)
    );
    // About 1.09e12 parameters (every layer MoE since 2026-12-02; 73,157 tensors and
    // 1,076,795,563,008 parameters with the dense layer 0 before).
    assert_eq!(
        totals("moe-1t"),
        (74_307, 1_093_313_387_520, 2_186_626_775_040)
    );
}

#[test]
fn qwen3_0_6b_is_tied_and_has_no_lm_head() {
    let spec = presets::preset("qwen3-0.6b").unwrap_or_else(|| panic!("no qwen3-0.6b"));
    let cat = Catalogue::of(&spec);
    assert!(cat.get("lm_head.weight").is_none());
    assert_eq!(
        cat.get("model.embed_tokens.weight")
            .map(|t| t.shape.as_slice().to_vec()),
        Some(vec![151936, 1024])
    );
    assert_eq!(
        cat.tensors().last().map(|t| t.name.as_str()),
        Some("model.norm.weight")
    );
}

#[test]
fn qwen3_8b_ends_with_an_untied_lm_head() {
    let spec = presets::preset("qwen3-8b").unwrap_or_else(|| panic!("no qwen3-8b"));
    let cat = Catalogue::of(&spec);
    let last = cat
        .tensors()
        .last()
        .map(|t| (t.name.as_str(), t.shape.as_slice().to_vec()));
    assert_eq!(last, Some(("lm_head.weight", vec![151936, 4096])));
}

#[test]
fn moe_1t_has_384_experts_in_every_layer_and_no_dense_mlp() {
    let spec = presets::preset("moe-1t").unwrap_or_else(|| panic!("no moe-1t"));
    let cat = Catalogue::of(&spec);
    let all = names(&cat);
    let shape = |n: &str| cat.get(n).map(|t| t.shape.as_slice().to_vec());

    // as SGLang builds a Qwen3-MoE model: layer 0 MoE too, no dense MLP anywhere
    assert!(spec.is_moe_layer(0));
    assert!(!all.iter().any(|n| n.ends_with("mlp.gate_proj.weight")));
    assert_eq!(
        all.iter()
            .filter(|n| n.starts_with("model.layers.0.mlp.experts."))
            .count(),
        384 * 3
    );
    assert!(spec.is_moe_layer(1));
    assert_eq!(
        shape("model.layers.1.mlp.gate.weight"),
        Some(vec![384, 7168])
    );
    let experts: BTreeSet<&str> = all
        .iter()
        .filter_map(|n| n.strip_prefix("model.layers.1.mlp.experts."))
        .filter_map(|rest| rest.split('.').next())
        .collect();
    assert_eq!(experts.len(), 384);
    assert_eq!(
        shape("model.layers.1.mlp.experts.383.gate_proj.weight"),
        Some(vec![2048, 7168])
    );
    assert_eq!(
        shape("model.layers.1.mlp.experts.383.down_proj.weight"),
        Some(vec![7168, 2048])
    );
    assert!(
        cat.get("model.layers.1.mlp.experts.384.gate_proj.weight")
            .is_none()
    );
    assert!(cat.get("model.layers.1.mlp.gate_proj.weight").is_none());
    assert_eq!((0..64).filter(|&l| spec.is_moe_layer(l)).count(), 64);
}

#[test]
fn qwen3_attention_bias_catalogue_holds_the_o_proj_bias_too() {
    let spec = check_fixture("qwen3-attention-bias");
    assert!(spec.attention_bias);
    let cat = Catalogue::of(&spec);
    assert_eq!(cat.len(), 33);
    assert_eq!(
        cat.get("model.layers.1.self_attn.o_proj.bias")
            .map(|t| t.shape.as_slice().to_vec()),
        Some(vec![64])
    );
}

#[test]
fn llama_attention_bias_catalogue_holds_q_k_v_and_o_biases() {
    let spec = check_fixture("llama-attention-bias");
    let cat = Catalogue::of(&spec);
    assert_eq!(cat.len(), 29);
    assert!(cat.get("model.layers.0.self_attn.o_proj.bias").is_some());
}

#[test]
fn mixtral_catalogue_matches_transformers_block_sparse_moe_names() {
    let spec = check_fixture("mixtral");
    assert_eq!(spec.architecture, Architecture::Mixtral);
    assert_eq!(spec.num_experts(), 4);
    assert!((0..spec.num_layers).all(|l| spec.is_moe_layer(l)));
    let cat = Catalogue::of(&spec);
    assert_eq!(cat.len(), 41);
    for (name, shape) in [
        ("model.layers.1.block_sparse_moe.gate.weight", vec![4, 64]),
        (
            "model.layers.1.block_sparse_moe.experts.3.w1.weight",
            vec![32, 64],
        ),
        (
            "model.layers.1.block_sparse_moe.experts.3.w2.weight",
            vec![64, 32],
        ),
        (
            "model.layers.1.block_sparse_moe.experts.3.w3.weight",
            vec![32, 64],
        ),
    ] {
        assert_eq!(
            cat.get(name).map(|t| t.shape.as_slice().to_vec()),
            Some(shape),
            "{name}"
        );
    }
}

#[test]
fn every_family_preset_is_of_its_family_and_every_part_has_an_hf_name() {
    for (family, preset) in presets::all() {
        let spec = (preset.spec)(preset.name);
        assert_eq!(spec.architecture.family(), family, "{}", preset.name);
        // the catalogue drops a part its family does not spell: every part must be spelled
        assert_eq!(
            Catalogue::of(&spec).len() as u128,
            spec_size(&spec),
            "{}",
            preset.name
        );
    }
}

/// The number of canonical tensors the family lists (experts expanded).
fn spec_size(spec: &ModelSpec) -> u128 {
    use awex_core::layout::Dims;
    use awex_core::model::family::{Sink, walk};
    use awex_core::model::{Canon, Part};
    struct Count(u128);
    impl Sink for Count {
        fn part(&mut self, _: Canon, _: Dims) {
            self.0 += 1;
        }
        fn experts(&mut self, _: u64, count: u64, parts: &[(Part, Dims)]) {
            self.0 += u128::from(count) * parts.len() as u128;
        }
    }
    let mut c = Count(0);
    walk(spec, &mut c);
    c.0
}

#[test]
fn deepseek_v3_catalogue_matches_transformers_mla_shared_experts_and_fp32_router_bias() {
    let spec = check_fixture("deepseek-v3");
    assert_eq!(spec.architecture, Architecture::DeepseekV3);
    let moe_layers: Vec<u64> = (0..spec.num_layers)
        .filter(|&l| spec.is_moe_layer(l))
        .collect();
    assert_eq!(moe_layers, vec![1, 2]);
    let cat = Catalogue::of(&spec);
    assert_eq!(cat.len(), 91);
    let bias = cat
        .get("model.layers.1.mlp.gate.e_score_correction_bias")
        .map(|t| (t.shape.as_slice().to_vec(), t.dtype.as_str()));
    assert_eq!(bias, Some((vec![8], "f32")));
    assert!(
        cat.get("model.layers.0.mlp.gate.e_score_correction_bias")
            .is_none()
    );
    assert!(
        cat.get("model.layers.2.mlp.shared_experts.down_proj.weight")
            .is_some()
    );
}

#[test]
fn deepseek_v3_without_q_lora_rank_has_a_plain_q_proj() {
    let spec = check_fixture("deepseek-v3-no-q-lora");
    let cat = Catalogue::of(&spec);
    assert_eq!(cat.len(), 85);
    assert_eq!(
        cat.get("model.layers.0.self_attn.q_proj.weight")
            .map(|t| t.shape.as_slice().to_vec()),
        Some(vec![4 * 24, 64])
    );
    assert!(
        cat.get("model.layers.0.self_attn.q_a_proj.weight")
            .is_none()
    );
}

#[test]
fn deepseek_v3_refuses_a_moe_layer_freq_other_than_one_by_name() {
    let mut cfg = load("deepseek-v3")["config"].clone();
    cfg["moe_layer_freq"] = serde_json::json!(2);
    let e = ModelSpec::from_config_value(&cfg)
        .map(|s| s.name)
        .map_err(|e| e.to_string());
    assert_eq!(
        e,
        Err("config.json field `moe_layer_freq`: awex supports moe_layer_freq 1 (every layer from first_k_dense_replace on is MoE), found 2".to_string())
    );
}

#[test]
fn deepseek_v2_is_deepseek_v3_s_layer_with_v2_s_defaults_and_no_router_bias() {
    let spec = check_fixture("deepseek-v2");
    assert_eq!(spec.architecture, Architecture::DeepseekV2);
    let m = spec.moe.as_ref().unwrap();
    assert!(!m.router_bias);
    assert_eq!(m.shared_intermediate_size, 2 * m.moe_intermediate_size);
    let cat = Catalogue::of(&spec);
    assert!(
        cat.get("model.layers.1.mlp.gate.e_score_correction_bias")
            .is_none()
    );
    assert!(cat.get("model.layers.1.self_attn.q_proj.weight").is_some());
    // the same tensors as the V3 class of the same sizes, but for the router bias
    let v3 = check_fixture("deepseek-v3-no-q-lora");
    let v3_names: Vec<String> = Catalogue::of(&v3)
        .tensors()
        .iter()
        .map(|t| t.name.clone())
        .filter(|n| !n.ends_with("e_score_correction_bias") && !n.contains("shared_experts"))
        .collect();
    let v2_names: Vec<String> = cat
        .tensors()
        .iter()
        .map(|t| t.name.clone())
        .filter(|n| !n.contains("shared_experts"))
        .collect();
    assert_eq!(v2_names, v3_names);

    // transformers' DeepseekV2Config defaults: first_k_dense_replace 0, n_shared_experts 2;
    // topk_method noaux_tc gives the router its bias (SGLang's and vLLM's MoEGate)
    let mut cfg = load("deepseek-v2")["config"].clone();
    let o = cfg.as_object_mut().unwrap();
    o.remove("first_k_dense_replace");
    o.remove("n_shared_experts");
    o.insert("topk_method".into(), serde_json::json!("noaux_tc"));
    let s = ModelSpec::from_config_value(&cfg).unwrap_or_else(|e| panic!("{e}"));
    let m = s.moe.as_ref().unwrap();
    assert!(m.mlp_only_layers.is_empty() && m.router_bias);
    assert_eq!(m.shared_intermediate_size, 2 * m.moe_intermediate_size);
    assert!(
        Catalogue::of(&s)
            .get("model.layers.0.mlp.gate.e_score_correction_bias")
            .is_some()
    );
    // what transformers' V2 class would add and awex does not describe is refused by name
    let mut bias = load("deepseek-v2")["config"].clone();
    bias["mlp_bias"] = serde_json::json!(true);
    let e = ModelSpec::from_config_value(&bias).unwrap_err().to_string();
    assert!(e.contains("mlp_bias"), "{e}");
}

#[test]
fn deepseek_v3_config_defaults_follow_transformers() {
    // transformers' DeepseekV3Config: first_k_dense_replace 3 and n_shared_experts 1 when a
    // config leaves them out (awex read 0 and 0 before: every layer MoE, no shared experts)
    let mut cfg = load("deepseek-v3")["config"].clone();
    let o = cfg.as_object_mut().unwrap();
    o.remove("n_shared_experts");
    o.insert("first_k_dense_replace".into(), serde_json::json!(3));
    let want = ModelSpec::from_config_value(&cfg).unwrap_or_else(|e| panic!("{e}"));
    cfg.as_object_mut().unwrap().remove("first_k_dense_replace");
    let spec = ModelSpec::from_config_value(&cfg).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(spec, want);
    let m = spec.moe.as_ref().unwrap();
    assert_eq!(m.mlp_only_layers, vec![0, 1, 2]);
    assert_eq!(m.shared_intermediate_size, m.moe_intermediate_size);
}

#[test]
fn glm4_moe_catalogue_matches_transformers_biases_qk_norms_shared_experts_and_fp32_router_bias() {
    let spec = check_fixture("glm4-moe");
    assert_eq!(spec.architecture, Architecture::Glm4Moe);
    assert!(spec.attention_bias && spec.use_qk_norm && spec.qk_norm());
    let moe_layers: Vec<u64> = (0..spec.num_layers)
        .filter(|&l| spec.is_moe_layer(l))
        .collect();
    assert_eq!(moe_layers, vec![1, 2]);
    let m = spec.moe.as_ref().unwrap();
    assert_eq!(
        (m.shared_intermediate_size, m.router_bias, m.router_fp32),
        (32, true, true)
    );
    let cat = Catalogue::of(&spec);
    assert_eq!(cat.len(), 97);
    let bias = cat
        .get("model.layers.2.mlp.gate.e_score_correction_bias")
        .map(|t| (t.shape.as_slice().to_vec(), t.dtype.as_str()));
    assert_eq!(bias, Some((vec![8], "f32")));
    // GLM's o_proj has no bias whatever attention_bias says
    assert!(cat.get("model.layers.0.self_attn.o_proj.bias").is_none());
    assert!(cat.get("model.layers.0.self_attn.v_proj.bias").is_some());
    assert!(cat.get("model.layers.0.mlp.gate.weight").is_none());
    let plain = check_fixture("glm4-moe-plain");
    assert!(!plain.attention_bias && !plain.qk_norm());
    assert_eq!(Catalogue::of(&plain).len(), 97 - 3 * 5);
}

#[test]
fn glm4_moe_config_defaults_follow_transformers_and_mtp_layers_are_recorded_not_catalogued() {
    let mut cfg = load("glm4-moe")["config"].clone();
    let o = cfg.as_object_mut().unwrap();
    // transformers' Glm4MoeConfig: first_k_dense_replace 1 and n_shared_experts 1 by default;
    // `num_local_experts` is its alias of `n_routed_experts`
    o.remove("first_k_dense_replace");
    o.remove("n_shared_experts");
    let n = o.remove("n_routed_experts").unwrap();
    o.insert("num_local_experts".into(), n);
    // an MTP layer changes nothing: the catalogue holds the num_hidden_layers decoder layers
    o.insert("num_nextn_predict_layers".into(), serde_json::json!(1));
    o.insert("partial_rotary_factor".into(), serde_json::json!(0.5));
    let spec = ModelSpec::from_config_value(&cfg).unwrap_or_else(|e| panic!("{e}"));
    // ... but the spec records it, and the catalogue names the rule that skips it
    assert_eq!(spec.mtp_layers, 1);
    assert_eq!(
        spec,
        ModelSpec {
            mtp_layers: 1,
            ..check_fixture("glm4-moe")
        }
    );
    let cat = Catalogue::of(&spec);
    assert!(cat.get("model.layers.3.input_layernorm.weight").is_none());
    assert_eq!(cat.len(), Catalogue::of(&check_fixture("glm4-moe")).len());
    assert!(cat.not_moved()[0].covers("model.layers.3.eh_proj.weight"));
    assert!(
        Catalogue::of(&check_fixture("glm4-moe"))
            .not_moved()
            .is_empty()
    );
    // the count is bounded like the layers
    let mut huge = cfg.clone();
    huge["num_nextn_predict_layers"] = serde_json::json!(1u64 << 40);
    let e = ModelSpec::from_config_value(&huge).unwrap_err().to_string();
    assert!(e.contains("num_nextn_predict_layers"), "{e}");
    o_missing(&cfg, "moe_intermediate_size");
}

fn o_missing(cfg: &Value, field: &str) {
    let mut cfg = cfg.clone();
    cfg.as_object_mut().unwrap().remove(field);
    let e = ModelSpec::from_config_value(&cfg)
        .map(|s| s.name)
        .map_err(|e| e.to_string());
    assert_eq!(e, Err(format!("config.json has no `{field}`")));
}

#[test]
fn glm_presets_have_the_published_sizes() {
    let s = presets::preset("glm-4.5").unwrap();
    assert_eq!(s.architecture, Architecture::Glm4Moe);
    assert_eq!(
        (
            s.hidden_size,
            s.num_layers,
            s.num_heads,
            s.num_kv_heads,
            s.head_dim
        ),
        (5120, 92, 96, 8, 128)
    );
    let m = s.moe.as_ref().unwrap();
    assert_eq!(
        (
            m.num_experts,
            m.moe_intermediate_size,
            m.shared_intermediate_size
        ),
        (160, 1536, 1536)
    );
    assert_eq!((0..92).filter(|&l| !s.is_moe_layer(l)).count(), 3);
    // about 355B parameters
    let params = Catalogue::of(&s).total_bytes() / 2;
    assert!((350e9..360e9).contains(&(params as f64)), "{params}");
    let air = presets::preset("glm-4.5-air").unwrap();
    let params = Catalogue::of(&air).total_bytes() / 2;
    assert!((105e9..108e9).contains(&(params as f64)), "{params}");
    assert!(!air.qk_norm());
}

/// The hybrid Qwen fixtures (transformers 5.19.0): Gated DeltaNet layers 0..2, a gated full
/// attention layer 3; the tiny presets are these models.
#[test]
fn hybrid_qwen_catalogues_match_transformers_and_their_tiny_presets() {
    for (fixture, preset, arch) in [
        ("qwen3-next", "qwen3-next-tiny", Architecture::Qwen3Next),
        ("qwen3.5", "qwen3.5-tiny", Architecture::Qwen3_5),
        ("qwen3.5-moe", "qwen3.5-moe-tiny", Architecture::Qwen3_5Moe),
    ] {
        let spec = check_fixture(fixture);
        assert_eq!(spec.architecture, arch);
        let a = spec
            .linear
            .as_ref()
            .unwrap_or_else(|| panic!("{fixture}: no linear sizes"));
        assert_eq!(a.full_attention_layers, vec![3], "{fixture}");
        assert!((0..3).all(|l| spec.is_linear_layer(l)) && !spec.is_linear_layer(3));
        let cat = Catalogue::of(&spec);
        // A_log in fp32 (the engines' dtype), dt_bias in the model's
        let a_log = cat.get("model.layers.0.linear_attn.A_log").expect("A_log");
        assert_eq!(a_log.dtype, awex_core::DType::F32);
        let dt = cat
            .get("model.layers.0.linear_attn.dt_bias")
            .expect("dt_bias");
        assert_eq!(dt.dtype, awex_core::DType::Bf16);
        // the gated q_proj: [query | gate] per head
        let q = cat
            .get("model.layers.3.self_attn.q_proj.weight")
            .expect("q_proj");
        assert_eq!(q.shape.as_slice(), &[2 * 4 * 16, 64]);
        let tiny = presets::preset(preset).unwrap_or_else(|| panic!("no {preset}"));
        assert_eq!(
            ModelSpec {
                name: spec.name.clone(),
                ..tiny
            },
            spec,
            "{preset} is the {fixture} fixture's model"
        );
    }
}

/// The gpt-oss fixture (transformers 5.19.0): what `save_pretrained` writes is what the model
/// holds in memory (fused, transposed experts with biases, sinks), and the tiny preset is it.
#[test]
fn gpt_oss_catalogue_matches_transformers_and_its_tiny_preset() {
    let spec = check_fixture("gpt-oss");
    assert_eq!(spec.architecture, Architecture::GptOss);
    let cat = Catalogue::of(&spec);
    let shape = |n: &str| {
        cat.get(n)
            .unwrap_or_else(|| panic!("no {n}"))
            .shape
            .as_slice()
            .to_vec()
    };
    // [experts, hidden, 2 * intermediate]: transposed against a linear layer's [out, in]
    assert_eq!(
        shape("model.layers.1.mlp.experts.gate_up_proj"),
        [8, 64, 96]
    );
    assert_eq!(shape("model.layers.1.mlp.experts.down_proj"), [8, 48, 64]);
    assert_eq!(shape("model.layers.0.self_attn.sinks"), [4]);
    assert_eq!(shape("model.layers.0.mlp.router.bias"), [8]);
    assert!(
        cat.tensors()
            .iter()
            .all(|t| t.dtype == awex_core::DType::Bf16)
    );
    let tiny = presets::preset("gpt-oss-tiny").unwrap_or_else(|| panic!("no gpt-oss-tiny"));
    assert_eq!(
        ModelSpec {
            name: spec.name.clone(),
            ..tiny
        },
        spec
    );
}

#[test]
fn gpt_oss_presets_have_the_published_parameter_counts() {
    // (tensors, parameters): openai/gpt-oss-20b and -120b in bf16 (the model card: 20.91B and
    // 116.83B in total); 17 tensors a layer plus the embedding, final norm and lm_head
    assert_eq!(totals("gpt-oss-20b").0, 24 * 17 + 3);
    assert_eq!(totals("gpt-oss-20b").1, 20_914_757_184);
    assert_eq!(totals("gpt-oss-120b").0, 36 * 17 + 3);
    assert_eq!(totals("gpt-oss-120b").1, 116_829_156_672);
}

#[test]
fn hybrid_qwen_presets_have_the_published_parameter_counts() {
    // (tensors, parameters, bytes): the text models of the published checkpoints (the
    // Qwen3.5 counts leave out the vision tower of Qwen3_5ForConditionalGeneration)
    assert_eq!(
        totals("qwen3-next-80b-a3b").1,
        79_674_391_296,
        "Qwen3-Next-80B-A3B"
    );
    assert_eq!(totals("qwen3.5-9b").1, 8_953_803_264, "Qwen3.5-9B");
    assert_eq!(
        totals("qwen3.5-35b-a3b").1,
        34_660_610_688,
        "Qwen3.5-35B-A3B"
    );
    assert_eq!(
        totals("qwen3.5-397b-a17b").1,
        396_346_350_336,
        "Qwen3.5-397B-A17B"
    );
    assert_eq!(totals("qwen3-next-80b-a3b").0, 74_391);
    assert_eq!(totals("qwen3.5-397b-a17b").0, 93_078);
}

#[test]
fn hybrid_qwen_configs_that_cannot_load_are_refused_by_field() {
    let doc = load("qwen3-next");
    let refused = |edit: &dyn Fn(&mut Value), want: &str| {
        let mut cfg = doc["config"].clone();
        edit(&mut cfg);
        let e = ModelSpec::from_config_value(&cfg)
            .and_then(|s| s.validate().map(|()| s))
            .expect_err(want);
        assert!(e.to_string().contains(want), "{e}");
    };
    refused(
        &|c| c["attention_bias"] = Value::Bool(true),
        "attention_bias",
    );
    refused(
        &|c| c["attn_output_gate"] = Value::Bool(false),
        "attn_output_gate",
    );
    refused(
        &|c| c["linear_num_value_heads"] = 6.into(),
        "multiple of linear_num_key_heads=4",
    );
    refused(
        &|c| c["shared_expert_intermediate_size"] = 0.into(),
        "shared_expert_intermediate_size",
    );
    refused(
        &|c| {
            c["layer_types"] = serde_json::json!([
                "linear_attention",
                "sliding_attention",
                "full_attention",
                "full_attention"
            ])
        },
        "layer 1 is \"sliding_attention\"",
    );
    refused(
        &|c| c["layer_types"] = serde_json::json!(["full_attention"]),
        "layer_types lists 1 layers",
    );
    refused(
        &|c| c["linear_conv_kernel_dim"] = 0.into(),
        "linear_conv_kernel_dim",
    );
    // without layer_types, full_attention_interval decides
    let mut cfg = doc["config"].clone();
    cfg.as_object_mut().map(|o| o.remove("layer_types"));
    cfg["full_attention_interval"] = 2.into();
    let spec = ModelSpec::from_config_value(&cfg).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        spec.linear.map(|a| a.full_attention_layers),
        Some(vec![1, 3])
    );
}

/// A spec's attention and MLP kinds are its architecture's: a spec (sent as JSON to the gateway,
/// which validates it) that adds MLA, linear attention or experts to a family without them, or
/// drops the experts of a MoE family, is refused by `validate`, never taken with the field
/// silently ignored. The property: whatever validates after such a change has another
/// catalogue than before it.
#[test]
fn a_spec_field_its_family_does_not_have_is_refused_not_ignored() {
    let donor = |name: &str| presets::preset(name).expect(name);
    let (mla, linear, moe) = (
        donor("deepseek-v3-tiny").mla,
        donor("qwen3-next-tiny").linear,
        donor("qwen3-moe-tiny").moe,
    );
    let mut seen = BTreeSet::new();
    let mut refused = 0;
    // the presets, and the fixtures of the families without one
    let specs = presets::names().into_iter().map(donor).chain(
        ["llama", "qwen2"]
            .into_iter()
            .map(|f| ModelSpec::from_config_value(&load(f)["config"]).expect(f)),
    );
    for spec in specs {
        let name = spec.name.clone();
        if !seen.insert(spec.architecture.hf_name()) {
            continue;
        }
        let before = Catalogue::of(&spec);
        // each kind the family lacks, added; each it has, dropped
        for what in ["MLA sizes", "linear-attention sizes", "MoE sizes"] {
            let mut s = spec.clone();
            match what {
                "MLA sizes" => s.mla = s.mla.take().xor(mla.clone()),
                "linear-attention sizes" => s.linear = s.linear.take().xor(linear.clone()),
                _ => s.moe = s.moe.take().xor(moe.clone()),
            }
            match s.validate() {
                Err(_) => refused += 1,
                Ok(()) => assert_ne!(
                    Catalogue::of(&s).first_difference(&before),
                    None,
                    "{name}: {what} changed and validated, but the catalogue ignored them"
                ),
            }
        }
    }
    // every family was tried, and every such change is refused
    assert_eq!(seen.len(), 12, "{seen:?}");
    assert_eq!(refused, 3 * seen.len(), "every change is refused");
}
