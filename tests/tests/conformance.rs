//! Conformance of every registered backend, discovered through inventory (no hand-written list).
//!
//! Parallel configs are generated from each backend's own `parallel_keys()`; a new backend crate
//! linked into this test crate gets every check below by registering.

use awex_core::backend::{ParallelConfig, ParallelKey, inference_backends, training_backends};
use awex_core::layout::{ExplicitSide, RankId, Side, SideLayout, check, materialize};
use awex_core::model::{Architecture, presets};
use awex_core::plan::{Pair, RankBuffers, simulate};
use awex_core::weights::canonical_tensor;
use awex_core::{Catalogue, ModelSpec};
use std::collections::{HashMap, HashSet};
use std::sync::Arc;

fn models() -> Vec<ModelSpec> {
    let tiny = presets::preset("qwen3-tiny").unwrap();
    let moe = presets::preset("qwen3-moe-tiny").unwrap();
    let qwen2 = ModelSpec {
        name: "qwen2-tiny".into(),
        architecture: Architecture::Qwen2,
        attention_bias: true,
        ..tiny.clone()
    };
    let tied = ModelSpec {
        name: "qwen3-tiny-tied".into(),
        tie_word_embeddings: true,
        num_layers: 2,
        ..tiny.clone()
    };
    let llama = ModelSpec {
        name: "llama-tiny".into(),
        architecture: Architecture::Llama,
        num_heads: 8,
        num_kv_heads: 4,
        head_dim: 8,
        num_layers: 2,
        ..tiny.clone()
    };
    // Qwen3 with attention_bias: q/k/v and o_proj biases
    let biased = ModelSpec {
        name: "qwen3-tiny-biased".into(),
        attention_bias: true,
        num_layers: 2,
        ..tiny.clone()
    };
    let mixtral = presets::preset("mixtral-tiny").unwrap();
    // q/k/v biases, q/k norms, a dense first layer, shared experts, the fp32 router bias (and
    // an fp32 router on the engines)
    let glm = presets::preset("glm-4.5-tiny").unwrap();
    // hybrid linear attention: Gated DeltaNet layers, a gated full-attention layer, a gated
    // shared expert (Megatron refuses them, FSDP2 maps them at tp 1); in fp32, where the
    // trainer's `A_log` has the catalogue's dtype (in bf16 transformers holds it bf16, and the
    // transfer widens it, which a byte round trip cannot compare)
    let f32 = |name: &str| ModelSpec {
        dtype: awex_core::DType::F32,
        ..presets::preset(name).unwrap()
    };
    let next = f32("qwen3-next-tiny");
    let qwen35 = f32("qwen3.5-tiny");
    let qwen35_moe = f32("qwen3.5-moe-tiny");
    vec![
        tiny, moe, qwen2, tied, llama, biased, mixtral, glm, next, qwen35, qwen35_moe,
    ]
}

/// Configs from the keys: all defaults, each defaulted key at 2 and 4, and every pair of keys at 2.
fn configs(keys: &[ParallelKey]) -> Vec<ParallelConfig> {
    let tunable: Vec<&str> = keys
        .iter()
        .filter(|k| k.default.is_some_and(|d| d >= 1))
        .map(|k| k.name)
        .collect();
    let mut out = vec![ParallelConfig::default()];
    for k in &tunable {
        for v in [2, 4] {
            out.push(ParallelConfig::from_pairs([(*k, v)]));
        }
    }
    for (i, a) in tunable.iter().enumerate() {
        for b in &tunable[i + 1..] {
            out.push(ParallelConfig::from_pairs([(*a, 2), (*b, 2)]));
        }
    }
    out
}

/// [`configs`], and for a backend that asks whether shared experts are fused (SGLang), each
/// of them with either answer.
fn configs_with_switches(keys: &[ParallelKey]) -> Vec<ParallelConfig> {
    let base = configs(keys);
    if !keys.iter().any(|k| k.name == "fused_shared_experts") {
        return base;
    }
    let mut out = base.clone();
    for v in [0, 1] {
        for p in &base {
            let mut p = p.clone();
            p.0.insert("fused_shared_experts".into(), v);
            out.push(p);
        }
    }
    out
}

/// Every accepted (config, layout) of one side for a model.
fn layouts(side: Side, model: &ModelSpec) -> Vec<(String, ParallelConfig, Arc<dyn SideLayout>)> {
    let mut out = Vec::new();
    match side {
        Side::Training => {
            for b in training_backends() {
                for p in configs(b.parallel_keys()) {
                    if let Ok(l) = b.layout(model, &p)
                        && l.world_size() <= 32
                    {
                        out.push((b.name().to_string(), p, l));
                    }
                }
            }
        }
        Side::Inference => {
            for b in inference_backends() {
                for p in configs_with_switches(b.parallel_keys()) {
                    if let Ok(l) = b.layout(model, &p)
                        && l.world_size() <= 32
                    {
                        out.push((b.name().to_string(), p, l));
                    }
                }
            }
        }
    }
    out
}

fn canonical(cat: &Catalogue) -> HashMap<String, Vec<u8>> {
    cat.tensors()
        .iter()
        .map(|c| (c.name.clone(), canonical_tensor(cat, &c.name, 3).unwrap()))
        .collect()
}

fn buffers(side: &ExplicitSide, cat: &Catalogue, canon: &HashMap<String, Vec<u8>>) -> RankBuffers {
    let get = |n: &str| canon.get(n).map(|v| v.as_slice());
    side.rank_layouts()
        .iter()
        .map(|l| {
            let b = materialize(l, cat, &get).unwrap();
            (
                l.rank,
                l.tensors.iter().map(|t| t.name.clone()).zip(b).collect(),
            )
        })
        .collect()
}

#[test]
fn four_backends_are_registered_through_inventory() {
    awex_tests::link_backends();
    let t: Vec<_> = training_backends().iter().map(|b| b.name()).collect();
    let i: Vec<_> = inference_backends().iter().map(|b| b.name()).collect();
    assert_eq!(t, ["fsdp", "megatron"]);
    assert_eq!(i, ["sglang", "vllm"]);
}

#[test]
fn options_read_from_a_training_rank_names_rebuild_the_same_names() {
    awex_tests::link_backends();
    let mut decided = 0;
    for model in models() {
        for b in training_backends() {
            for p in configs(b.parallel_keys()) {
                let Ok(l) = b.layout(&model, &p) else {
                    continue;
                };
                let names_of = |l: &dyn SideLayout| -> Vec<String> {
                    let rl = l.rank_layout(RankId::train(0)).unwrap();
                    rl.tensors.iter().map(|t| t.name.to_string()).collect()
                };
                let names = names_of(l.as_ref());
                let refs: Vec<&str> = names.iter().map(String::as_str).collect();
                let found = b.options_from_names(&refs);
                let order: Vec<usize> = found
                    .iter()
                    .map(|(k, _)| {
                        b.parallel_keys()
                            .iter()
                            .position(|pk| pk.name == *k)
                            .unwrap_or_else(|| panic!("{} decides unknown key {k}", b.name()))
                    })
                    .collect();
                assert!(
                    order.is_sorted(),
                    "{} keys out of order: {found:?}",
                    b.name()
                );
                // what the names decide, over the config, describes the same names
                let mut with = p.clone();
                for (k, v) in &found {
                    with.0.insert(k.to_string(), *v);
                }
                let again = b
                    .layout(&model, &with)
                    .unwrap_or_else(|e| panic!("{} {p} + {found:?}: {e}", b.name()));
                assert_eq!(
                    names_of(again.as_ref()),
                    names,
                    "{} {p} + {found:?}",
                    b.name()
                );
                decided += found.len();
            }
        }
    }
    assert!(decided > 0);
}

#[test]
fn every_backend_layout_is_valid_covering_and_round_trips() {
    awex_tests::link_backends();
    let mut checked = 0;
    for model in models() {
        let cat = Catalogue::of(&model);
        for side in [Side::Training, Side::Inference] {
            let ls = layouts(side, &model);
            assert!(
                !ls.is_empty(),
                "no {side} layout accepted for {}",
                model.name
            );
            for (backend, p, l) in ls {
                let what = format!("{backend}:{p} on {}", model.name);
                let ranks = l.ranks();
                assert_eq!(ranks.len(), l.world_size(), "{what}: rank count");
                assert_eq!(
                    ranks.iter().collect::<HashSet<_>>().len(),
                    ranks.len(),
                    "{what}: distinct ranks"
                );
                // every rank valid, holders agree, coverage, partition, per-engine round trip
                check::side(&*l, &cat).unwrap_or_else(|e| panic!("{what}: {e}"));
                checked += 1;
            }
        }
    }
    assert!(checked > 40, "only {checked} layouts checked");
}

#[test]
fn plans_against_every_backend_of_the_other_side_are_exact_and_agreed() {
    awex_tests::link_backends();
    let mut pairs = 0;
    for model in models() {
        let cat = Catalogue::of(&model);
        let canon = canonical(&cat);
        let train = layouts(Side::Training, &model);
        let infer = layouts(Side::Inference, &model);
        // every training layout against one inference layout and vice versa (round robin)
        let n = train.len().max(infer.len());
        for k in 0..n {
            let (tb, tp, tl) = &train[k % train.len()];
            let (ib, ip, il) = &infer[k % infer.len()];
            let what = format!("{tb}:{tp} -> {ib}:{ip} on {}", model.name);
            let pair = Pair {
                catalogue: &cat,
                training: &**tl,
                inference: &**il,
                encode_on_sender: false,
            };
            let tplans: Vec<_> = tl
                .ranks()
                .into_iter()
                .map(|r| {
                    pair.plan_rank(Side::Training, r)
                        .unwrap_or_else(|e| panic!("{what}: {e}"))
                })
                .collect();
            let mut fps: HashMap<(RankId, RankId), u64> = HashMap::new();
            for p in &tplans {
                for peer in &p.peers {
                    fps.insert((p.rank, peer.peer), peer.fingerprint);
                }
            }
            for r in il.ranks() {
                let p = pair.plan_rank(Side::Inference, r).unwrap();
                for peer in &p.peers {
                    assert_eq!(
                        fps.remove(&(peer.peer, r)),
                        Some(peer.fingerprint),
                        "{what}: fingerprints"
                    );
                }
            }
            assert!(fps.is_empty(), "{what}: one-sided peer plans");
            let src_side = ExplicitSide::from_side(&**tl);
            let dst_side = ExplicitSide::from_side(&**il);
            let src = buffers(&src_side, &cat, &canon);
            let want = buffers(&dst_side, &cat, &canon);
            let mut got: RankBuffers = want
                .iter()
                .map(|(r, m)| {
                    (
                        *r,
                        m.iter()
                            .map(|(n, b)| (n.clone(), vec![0u8; b.len()]))
                            .collect(),
                    )
                })
                .collect();
            simulate(&tplans, &src, &mut got).unwrap();
            assert!(
                got == want,
                "{what}: executed plans differ from the materialized destination"
            );
            pairs += 1;
        }
    }
    assert!(pairs > 20, "only {pairs} pairs checked");
}

/// GLM-4.5 from each training backend into SGLang with the shared experts fused into the
/// routed experts and apart, and into vLLM: every plan moves exactly the destination's bytes,
/// the router converted to the engines' fp32 on the way.
#[test]
fn glm_plans_into_fused_and_separate_shared_experts_are_exact() {
    awex_tests::link_backends();
    let model = presets::preset("glm-4.5-tiny").unwrap();
    let cat = Catalogue::of(&model);
    let canon = canonical(&cat);
    let side = |side: Side, spec: &str| -> Arc<dyn SideLayout> {
        let s: awex_core::BackendSpec = spec.parse().unwrap();
        awex_core::backend::side_layout(side, &s, &model).unwrap_or_else(|e| panic!("{spec}: {e}"))
    };
    let mut converted = 0;
    for (train, infer) in [
        ("megatron:tp=2", "sglang:tp=2,fused_shared_experts=1"),
        (
            "megatron:tp=1,dp=2,ep=2",
            "sglang:tp=2,fused_shared_experts=0",
        ),
        ("fsdp:dp=2", "sglang:tp=2,ep=2"),
        ("fsdp:tp=2", "vllm:tp=2"),
        ("megatron:tp=2,ep=2,etp=1", "vllm:tp=2,ep=2"),
    ] {
        let (tl, il) = (side(Side::Training, train), side(Side::Inference, infer));
        let pair = Pair {
            catalogue: &cat,
            training: &*tl,
            inference: &*il,
            encode_on_sender: false,
        };
        let plans: Vec<_> = tl
            .ranks()
            .into_iter()
            .map(|r| pair.plan_rank(Side::Training, r).unwrap())
            .collect();
        converted += plans
            .iter()
            .flat_map(|p| &p.peers)
            .flat_map(|peer| &peer.transfers)
            .filter(|t| t.converts())
            .count();
        let src = buffers(&ExplicitSide::from_side(&*tl), &cat, &canon);
        let want = buffers(&ExplicitSide::from_side(&*il), &cat, &canon);
        let mut got: RankBuffers = want
            .iter()
            .map(|(r, m)| {
                let zero = m.iter().map(|(n, b)| (n.clone(), vec![0u8; b.len()]));
                (*r, zero.collect())
            })
            .collect();
        simulate(&plans, &src, &mut got).unwrap();
        assert!(got == want, "{train} -> {infer}: executed plans differ");
    }
    // every router (2 MoE layers) goes bf16 -> fp32 into each engine
    assert!(converted >= 5 * 2, "{converted}");
}

// ---- DeepSeek-V3 on the training side ----

/// DeepSeek-V3 (MLA with and without `q_lora_rank`, a dense first layer, shared experts, the
/// fp32 router bias) in every accepted config of every training backend (Megatron only with
/// `q_lora_rank`): each layout valid and
/// covering, and a plan from each into a whole-checkpoint side (`fsdp:dp=1`, the checkpoint's
/// names and shapes) moves exactly the canonical bytes. (The inference backends map MLA on
/// their own; this checks the training side alone.)
#[test]
fn deepseek_training_layouts_are_valid_and_plan_exactly_into_the_checkpoint() {
    awex_tests::link_backends();
    let with = presets::preset("deepseek-v3-tiny").unwrap();
    let mut without = with.clone();
    without.name = "deepseek-v3-tiny-no-q-lora".into();
    if let Some(a) = &mut without.mla {
        a.q_lora_rank = None;
    }
    let v2 = deepseek_v2_tiny();
    let mut checked = 0;
    for model in [with, without, v2] {
        let cat = Catalogue::of(&model);
        let canon = canonical(&cat);
        let whole: awex_core::BackendSpec = "fsdp:dp=1".parse().unwrap();
        let dst = awex_core::backend::side_layout(Side::Training, &whole, &model).unwrap();
        let dst_side = ExplicitSide::from_side(&*dst);
        let want = buffers(&dst_side, &cat, &canon);
        let train = layouts(Side::Training, &model);
        // Megatron-Core 0.19 builds MLA with q_lora_rank only (awex-megatron refuses the other)
        let backends: &[&str] = if model.mla.is_some_and(|a| a.q_lora_rank.is_some()) {
            &["fsdp", "megatron"]
        } else {
            &["fsdp"]
        };
        for want in backends {
            assert!(
                train.iter().any(|(b, ..)| b == want),
                "{}: {want} accepts no config",
                model.name
            );
        }
        for (backend, p, tl) in train {
            let what = format!("{backend}:{p} on {}", model.name);
            check::side(&*tl, &cat).unwrap_or_else(|e| panic!("{what}: {e}"));
            let pair = Pair {
                catalogue: &cat,
                training: &*tl,
                inference: &*dst,
                encode_on_sender: false,
            };
            let plans: Vec<_> = tl
                .ranks()
                .into_iter()
                .map(|r| {
                    pair.plan_rank(Side::Training, r)
                        .unwrap_or_else(|e| panic!("{what}: {e}"))
                })
                .collect();
            let src = buffers(&ExplicitSide::from_side(&*tl), &cat, &canon);
            let mut got: RankBuffers = want
                .iter()
                .map(|(r, m)| {
                    let zero = m.iter().map(|(n, b)| (n.clone(), vec![0u8; b.len()]));
                    (*r, zero.collect())
                })
                .collect();
            simulate(&plans, &src, &mut got).unwrap_or_else(|e| panic!("{what}: {e}"));
            assert!(
                got == want,
                "{what}: executed plans differ from the checkpoint"
            );
            checked += 1;
        }
    }
    assert!(checked > 20, "only {checked} layouts checked");
}

// ---- DeepSeek-V3 (MLA) on the inference engines ----

/// A one-rank training side holding every canonical tensor whole, in its canonical name: the
/// source of a checkpoint load, for an inference layout checked without a training backend.
fn canonical_side(cat: &Catalogue) -> ExplicitSide {
    use awex_core::layout::{Dims, LocalTensor, Placement, RankLayout, Region};
    let tensors = cat
        .tensors()
        .iter()
        .map(|c| LocalTensor {
            name: Arc::from(c.name.as_str()),
            shape: c.shape,
            dtype: c.dtype,
            encoding: awex_core::encoding::Encoding::Plain(c.dtype),
            placements: vec![Placement {
                canonical: Arc::from(c.name.as_str()),
                region: Region::full(c.shape),
                local_offset: Dims::zeros(c.shape.ndim()),
                transposed: false,
            }],
        })
        .collect();
    ExplicitSide::new(
        Side::Training,
        vec![RankLayout {
            rank: RankId::train(0),
            tensors,
        }],
    )
}

/// DeepSeek-V3's MLA (with and without `q_lora_rank`), dense first layer, shared experts (fused
/// and apart) and fp32 router bias: every accepted SGLang and vLLM layout is valid, covering and
/// round-trips, and a plan from the whole checkpoint moves exactly its bytes.
#[test]
fn deepseek_v3_inference_layouts_are_valid_and_plans_from_the_checkpoint_are_exact() {
    awex_tests::link_backends();
    let mut no_q_lora = presets::preset("deepseek-v3-tiny").unwrap();
    no_q_lora.mla.as_mut().unwrap().q_lora_rank = None;
    let mut checked = 0;
    for model in [
        presets::preset("deepseek-v3-tiny").unwrap(),
        no_q_lora,
        deepseek_v2_tiny(),
    ] {
        let cat = Catalogue::of(&model);
        let canon = canonical(&cat);
        let src_side = canonical_side(&cat);
        let src = buffers(&src_side, &cat, &canon);
        let infer = layouts(Side::Inference, &model);
        let backends: HashSet<&str> = infer.iter().map(|(b, _, _)| b.as_str()).collect();
        assert_eq!(backends.len(), 2, "{backends:?}");
        for (backend, p, l) in infer {
            let what = format!("{backend}:{p} on {}", model.name);
            check::side(&*l, &cat).unwrap_or_else(|e| panic!("{what}: {e}"));
            let pair = Pair {
                catalogue: &cat,
                training: &src_side,
                inference: &*l,
                encode_on_sender: false,
            };
            let plan = pair
                .plan_rank(Side::Training, RankId::train(0))
                .unwrap_or_else(|e| panic!("{what}: {e}"));
            let want = buffers(&ExplicitSide::from_side(&*l), &cat, &canon);
            let mut got: RankBuffers = want
                .iter()
                .map(|(r, m)| {
                    let zero = m.iter().map(|(n, b)| (n.clone(), vec![0u8; b.len()]));
                    (*r, zero.collect())
                })
                .collect();
            simulate(&[plan], &src, &mut got).unwrap();
            assert!(got == want, "{what}: executed plan differs");
            checked += 1;
        }
    }
    assert!(checked > 20, "only {checked} layouts checked");
}

/// deepseek-v3-tiny as a DeepSeek-V2 config (`DeepseekV2ForCausalLM`, V2-Lite's shape): no
/// `q_lora_rank`, two shared experts, a router without a score-correction bias.
fn deepseek_v2_tiny() -> awex_core::ModelSpec {
    let mut m = presets::preset("deepseek-v3-tiny").unwrap();
    m.name = "deepseek-v2-tiny".into();
    m.architecture = awex_core::model::Architecture::DeepseekV2;
    if let Some(a) = &mut m.mla {
        a.q_lora_rank = None;
    }
    if let Some(moe) = &mut m.moe {
        moe.router_bias = false;
        moe.shared_intermediate_size = 2 * moe.moe_intermediate_size;
    }
    m
}
