//! The planner's output, pinned: digests of chosen ranks of the 1T-parameter MoE pair and a
//! digest over every rank of smaller pairs. A faster planner must plan exactly the same
//! transfers; these values were taken before the planner's speed work.
//!
//! The pins are digests of the transfers themselves ([`content`]: every transfer made, in
//! order, hashed as the plans' fingerprints hashed them until 2026-12-06), not the plans' own
//! fingerprints, whose bytes may change without the plan changing. Those are pinned apart
//! ([`plans_own_fingerprints_are_pinned`]), and every whole-pair digest checks that both ends
//! of each peer pair carry the same fingerprint.

use awex_core::backend::side_layout;
use awex_core::layout::{RankId, Side};
use awex_core::plan::{EncodeAt, Pair, RankPlan};
use awex_core::{BackendSpec, Catalogue, ModelSpec};

/// The digest of a rank's plan from its transfers: per peer, xxh3 over every transfer's bytes
/// (ranks; each end's name, NUL, shape and offset, dtype; the extent; the transpose and
/// encoding), then xxh3 over the peers' digests in order.
fn content(plan: &RankPlan) -> u64 {
    let mut all = xxhash_rust::xxh3::Xxh3::new();
    let mut h: Vec<u8> = Vec::new();
    for p in &plan.peers {
        h.clear();
        for t in p.transfers.iter() {
            for r in [t.src_rank, t.dst_rank] {
                h.extend_from_slice(&r.engine.to_le_bytes());
                h.extend_from_slice(&r.rank.to_le_bytes());
            }
            for (name, shape, off, dt) in [
                (&t.src_tensor, &t.src_shape, &t.src_offset, t.src_dtype),
                (&t.dst_tensor, &t.dst_shape, &t.dst_offset, t.dst_dtype),
            ] {
                h.extend_from_slice(name.as_bytes());
                h.push(0);
                for d in shape.as_slice().iter().chain(off.as_slice()) {
                    h.extend_from_slice(&d.to_le_bytes());
                }
                h.extend_from_slice(dt.as_str().as_bytes());
            }
            for d in t.extent.as_slice() {
                h.extend_from_slice(&d.to_le_bytes());
            }
            if t.transposed {
                h.extend_from_slice(b"transposed");
            }
            if let Some(e) = &t.encode {
                h.extend_from_slice(b"fp8");
                for b in e.encoding.block {
                    h.extend_from_slice(&b.to_le_bytes());
                }
                h.push(match e.encoding.scale_format {
                    awex_core::encoding::ScaleFormat::F32 => 0,
                    awex_core::encoding::ScaleFormat::Ue8m0 => 1,
                });
                h.push(match e.at {
                    EncodeAt::Receiver => 0,
                    EncodeAt::Sender => 1,
                });
            }
        }
        all.update(&xxhash_rust::xxh3::xxh3_64(&h).to_le_bytes());
    }
    all.digest()
}

struct Resolved {
    cat: Catalogue,
    training: std::sync::Arc<dyn awex_core::SideLayout>,
    inference: std::sync::Arc<dyn awex_core::SideLayout>,
}

fn resolve(model: &str, train: &str, infer: &str) -> Resolved {
    std::hint::black_box((awex_megatron::CRATE, awex_sglang::CRATE, awex_fsdp::CRATE));
    let model = ModelSpec::resolve(model).unwrap();
    let ts: BackendSpec = train.parse().unwrap();
    let is: BackendSpec = infer.parse().unwrap();
    Resolved {
        cat: Catalogue::of(&model),
        training: side_layout(Side::Training, &ts, &model).unwrap(),
        inference: side_layout(Side::Inference, &is, &model).unwrap(),
    }
}

impl Resolved {
    fn pair(&self) -> Pair<'_> {
        Pair {
            catalogue: &self.cat,
            training: &*self.training,
            inference: &*self.inference,
            encode_on_sender: false,
        }
    }

    /// xxh3 over every rank's [`content`], training ranks then inference ranks; on the way,
    /// checks that the plans' fingerprints agree ([`check_fingerprints`]).
    fn digest(&self) -> u64 {
        let pair = self.pair();
        let mut h = xxhash_rust::xxh3::Xxh3::new();
        let mut plans = Vec::new();
        for (side, l) in [
            (Side::Training, &self.training),
            (Side::Inference, &self.inference),
        ] {
            for r in l.ranks() {
                let plan = pair.plan_rank(side, r).unwrap();
                h.update(&content(&plan).to_le_bytes());
                plans.push(plan);
            }
        }
        check_fingerprints(&plans);
        h.digest()
    }
}

/// Every plan's fingerprint is xxh3 over its peers' fingerprints, and each peer pair's two
/// plans (every rank of both sides is in `plans`) carry the same fingerprint and bytes.
fn check_fingerprints(plans: &[RankPlan]) {
    let by_end: std::collections::HashMap<(Side, RankId, RankId), (u64, u64)> = plans
        .iter()
        .flat_map(|pl| {
            pl.peers
                .iter()
                .map(move |p| ((pl.side, pl.rank, p.peer), (p.fingerprint, p.bytes)))
        })
        .collect();
    for pl in plans {
        check_fingerprints_compose(pl);
        for p in &pl.peers {
            assert_eq!(
                by_end.get(&(pl.side.other(), p.peer, pl.rank)),
                Some(&(p.fingerprint, p.bytes)),
                "{}:{} and its peer {} disagree",
                pl.side.short(),
                pl.rank,
                p.peer
            );
        }
    }
}

/// moe-1t has had every layer MoE since 2026-12-02 (SGLang builds every Qwen3-MoE layer MoE, so
/// its dense layer 0 was a pair SGLang cannot load); these pins were taken then.
#[test]
fn moe_1t_fingerprints_are_pinned() {
    let r = resolve(
        "moe-1t",
        "megatron:tp=8,pp=8,dp=16,ep=32,etp=1",
        "sglang:tp=16,ep=16,engines=8",
    );
    let pair = r.pair();
    let got: Vec<(String, u64)> = [
        (Side::Inference, RankId::infer(0, 0)),
        (Side::Inference, RankId::infer(4, 8)),
        (Side::Inference, RankId::infer(7, 15)),
        (Side::Training, RankId::train(0)),
        (Side::Training, RankId::train(1023)),
    ]
    .into_iter()
    .map(|(s, rank)| {
        (
            format!("{}:{rank}", s.short()),
            content(&pair.plan_rank(s, rank).unwrap()),
        )
    })
    .collect();
    let want: Vec<(String, u64)> = vec![
        ("infer:0/0".to_string(), 0x9d73ebe5b53ddc15),
        ("infer:4/8".to_string(), 0x165a4e85c68b1d83),
        ("infer:7/15".to_string(), 0x42652f9de11f63dd),
        ("train:0/0".to_string(), 0x3a0ff84e42a99299),
        ("train:0/1023".to_string(), 0x56cd2fcc19458746),
    ];
    assert_eq!(got, want);
}

#[test]
fn whole_pair_digests_are_pinned() {
    let got: Vec<u64> = [
        ("qwen3-0.6b", "megatron:tp=2,pp=2", "sglang:tp=2,engines=2"),
        (
            "qwen3-30b-a3b",
            "megatron:tp=2,pp=2,dp=2,ep=4,etp=1",
            "sglang:tp=4,ep=4,engines=2",
        ),
        ("qwen3-8b", "fsdp:dp=4", "sglang:tp=2,engines=3"),
    ]
    .into_iter()
    .map(|(m, t, i)| resolve(m, t, i).digest())
    .collect();
    let want: Vec<u64> = vec![0x56b479a33c8f0bd0, 0xcf6a4a2796395988, 0x0e8eca48717b760f];
    assert_eq!(got, want);
}

/// A model from the text of its `config.json` (not a preset: the family's own parser reads it).
fn from_config(config: &str, train: &str, infer: &str) -> Resolved {
    std::hint::black_box(awex_vllm::CRATE);
    let model = ModelSpec::from_config_json(config).unwrap();
    let ts: BackendSpec = train.parse().unwrap();
    let is: BackendSpec = infer.parse().unwrap();
    Resolved {
        cat: Catalogue::of(&model),
        training: side_layout(Side::Training, &ts, &model).unwrap(),
        inference: side_layout(Side::Inference, &is, &model).unwrap(),
    }
}

/// A tiny config of `class` (GQA 8 heads over 2 KV heads) with the given extra fields.
fn tiny_config(class: &str, extra: &str) -> String {
    format!(
        r#"{{"architectures": ["{class}"], "hidden_size": 64, "num_hidden_layers": 3,
            "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 16,
            "intermediate_size": 128, "vocab_size": 1000{extra}}}"#
    )
}

#[test]
fn every_family_s_dense_pair_digest_is_pinned() {
    let cases = [
        // Llama, tied embeddings
        (
            tiny_config("LlamaForCausalLM", r#", "tie_word_embeddings": true"#),
            "megatron:tp=2,pp=3",
            "sglang:tp=4,engines=2",
        ),
        (
            tiny_config("LlamaForCausalLM", ""),
            "fsdp:dp=2,tp=2",
            "vllm:tp=2,engines=2",
        ),
        // Qwen2: q/k/v biases
        (
            tiny_config("Qwen2ForCausalLM", ""),
            "megatron:tp=2,dp=2",
            "sglang:tp=8",
        ),
        (
            tiny_config("Qwen2ForCausalLM", r#", "tie_word_embeddings": true"#),
            "fsdp:dp=3",
            "vllm:tp=4",
        ),
        // Qwen3: q/k norms
        (
            tiny_config("Qwen3ForCausalLM", ""),
            "megatron:tp=2,pp=3",
            "vllm:tp=2,engines=3",
        ),
        (
            tiny_config("Qwen3ForCausalLM", r#", "tie_word_embeddings": true"#),
            "fsdp:dp=2,replicate=2",
            "sglang:tp=2,engines=2",
        ),
        // Qwen3-MoE: a dense layer, experts
        (
            tiny_config(
                "Qwen3MoeForCausalLM",
                r#", "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "mlp_only_layers": [0]"#,
            ),
            "megatron:tp=2,ep=2,etp=1,dp=2",
            "vllm:tp=2,ep=2,engines=2",
        ),
        (
            tiny_config(
                "Qwen3MoeForCausalLM",
                r#", "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32"#,
            ),
            "fsdp:dp=4",
            "sglang:tp=4,ep=2",
        ),
    ];
    let got: Vec<String> = cases
        .iter()
        .map(|(cfg, t, i)| format!("{t} -> {i}: {:#018x}", from_config(cfg, t, i).digest()))
        .collect();
    let want = [
        "megatron:tp=2,pp=3 -> sglang:tp=4,engines=2: 0xd678c108d9dda379",
        "fsdp:dp=2,tp=2 -> vllm:tp=2,engines=2: 0x8a36917b6b8f61e0",
        "megatron:tp=2,dp=2 -> sglang:tp=8: 0x76b680f872a90c02",
        "fsdp:dp=3 -> vllm:tp=4: 0x51e5556e1b3f5b79",
        "megatron:tp=2,pp=3 -> vllm:tp=2,engines=3: 0xeb929042ccd65a49",
        "fsdp:dp=2,replicate=2 -> sglang:tp=2,engines=2: 0x7d5a5a7fece96daa",
        "megatron:tp=2,ep=2,etp=1,dp=2 -> vllm:tp=2,ep=2,engines=2: 0xbd0c79eeb4f9d7d3",
        "fsdp:dp=4 -> sglang:tp=4,ep=2: 0xd18f66485f7a26b7",
    ];
    assert_eq!(got, want);
}

/// The hybrid and gpt-oss families from FSDP2 (the training side they support), pinned before
/// the planner's work on FSDP's many shards (2026-12-05): tiny presets whole, and chosen ranks
/// of a mid-size Qwen3.5-MoE at dp=64 (every parameter in 64 dim-0 shards).
#[test]
fn fsdp_pairs_of_the_new_families_are_pinned() {
    std::hint::black_box(awex_vllm::CRATE);
    let got: Vec<String> = [
        (
            "qwen3.5-moe-tiny",
            "fsdp:dp=4,fused_experts=1",
            "sglang:tp=4,ep=2,engines=2",
        ),
        (
            "qwen3.5-moe-tiny",
            "fsdp:dp=3,replicate=2",
            "vllm:tp=2,engines=2",
        ),
        (
            "qwen3-next-tiny",
            "fsdp:dp=5,fused_experts=1",
            "vllm:tp=4,ep=4",
        ),
        ("qwen3.5-tiny", "fsdp:dp=8", "sglang:tp=4,engines=2"),
        ("gpt-oss-tiny", "fsdp:dp=4", "vllm:tp=4,ep=4,engines=2"),
        (
            "gpt-oss-tiny",
            "fsdp:dp=3,replicate=2",
            "sglang:tp=2,engines=2",
        ),
    ]
    .into_iter()
    .map(|(m, t, i)| format!("{m} {t} -> {i}: {:#018x}", resolve(m, t, i).digest()))
    .collect();
    let want = [
        "qwen3.5-moe-tiny fsdp:dp=4,fused_experts=1 -> sglang:tp=4,ep=2,engines=2: 0x531dde9fd3f69db9",
        "qwen3.5-moe-tiny fsdp:dp=3,replicate=2 -> vllm:tp=2,engines=2: 0xde491ba72353bd43",
        "qwen3-next-tiny fsdp:dp=5,fused_experts=1 -> vllm:tp=4,ep=4: 0x665e0313f68f7e5e",
        "qwen3.5-tiny fsdp:dp=8 -> sglang:tp=4,engines=2: 0xb71f9435948ba166",
        "gpt-oss-tiny fsdp:dp=4 -> vllm:tp=4,ep=4,engines=2: 0x34fc29bac9beae88",
        "gpt-oss-tiny fsdp:dp=3,replicate=2 -> sglang:tp=2,engines=2: 0x4ec4ed17dff1453d",
    ];
    let r = resolve(
        "qwen3.5-35b-a3b",
        "fsdp:dp=64,fused_experts=1",
        "sglang:tp=8,ep=8,engines=2",
    );
    let pair = r.pair();
    let ranks: Vec<String> = [
        (Side::Inference, RankId::infer(0, 0)),
        (Side::Inference, RankId::infer(1, 7)),
        (Side::Training, RankId::train(0)),
        (Side::Training, RankId::train(63)),
    ]
    .into_iter()
    .map(|(s, rank)| {
        format!(
            "{}:{rank}: {:#018x}",
            s.short(),
            content(&pair.plan_rank(s, rank).unwrap())
        )
    })
    .collect();
    let want_ranks = [
        "infer:0/0: 0x547176d89d737118",
        "infer:1/7: 0xe24be102b15b35f3",
        "train:0/0: 0xb0576ea9df98662d",
        "train:0/63: 0x5905e1b46c674676",
    ];
    assert_eq!(got, want);
    assert_eq!(ranks, want_ranks);
}

/// The plans' own fingerprints, which peers compare before an update: a change to the bytes they
/// hash is a change of the wire's agreement (peers of two versions would refuse each other), so
/// it must be deliberate. Pinned on 2026-12-06, equal to what `awex-cli plan` printed at e7c640c,
/// before fingerprints were made where peers are coalesced.
#[test]
fn plans_own_fingerprints_are_pinned() {
    let mut got = Vec::new();
    for (model, train, infer, ranks) in [
        (
            "moe-1t",
            "megatron:tp=8,pp=8,dp=16,ep=32,etp=1",
            "sglang:tp=16,ep=16,engines=8",
            [
                (Side::Inference, RankId::infer(0, 0)),
                (Side::Inference, RankId::infer(7, 15)),
                (Side::Training, RankId::train(1023)),
            ],
        ),
        (
            "qwen3.5-35b-a3b",
            "fsdp:dp=64,fused_experts=1",
            "sglang:tp=8,ep=8,engines=2",
            [
                (Side::Inference, RankId::infer(0, 0)),
                (Side::Inference, RankId::infer(1, 7)),
                (Side::Training, RankId::train(63)),
            ],
        ),
    ] {
        let r = resolve(model, train, infer);
        let pair = r.pair();
        for (s, rank) in ranks {
            let plan = pair.plan_rank(s, rank).unwrap();
            check_fingerprints_compose(&plan);
            got.push(format!(
                "{model} {}:{rank}: {:016x}",
                s.short(),
                plan.fingerprint
            ));
        }
    }
    let want = [
        "moe-1t infer:0/0: c15cf8b312cb75c5",
        "moe-1t infer:7/15: 763fe8621cca8f39",
        "moe-1t train:0/1023: e25f859aa5fdbfec",
        "qwen3.5-35b-a3b infer:0/0: fdbd47e5106b624c",
        "qwen3.5-35b-a3b infer:1/7: 770af2c74b35d516",
        "qwen3.5-35b-a3b train:0/63: cbf14dba147e0206",
    ];
    assert_eq!(got, want);
}

/// A plan's fingerprint is xxh3 over its peers' fingerprints, in order.
fn check_fingerprints_compose(plan: &RankPlan) {
    let mut h = xxhash_rust::xxh3::Xxh3::new();
    for p in &plan.peers {
        h.update(&p.fingerprint.to_le_bytes());
    }
    assert_eq!(
        plan.fingerprint,
        h.digest(),
        "{}:{}",
        plan.side.short(),
        plan.rank
    );
}

/// A plan large enough to be made on several threads (its peers coalesced and fingerprinted in
/// groups) is the plan of one thread: the same peers, transfers, bytes and fingerprints.
#[test]
fn a_plan_made_on_several_threads_is_the_plan_of_one() {
    let r = resolve(
        "qwen3.5-35b-a3b",
        "fsdp:dp=64,fused_experts=1",
        "sglang:tp=8,ep=8",
    );
    let pair = r.pair();
    let rank = RankId::infer(0, 0);
    let one = pair.plan_rank_on(Side::Inference, rank, 1).unwrap();
    assert!(
        one.transfers() > awex_core::plan::THREADED_TRANSFERS,
        "{} transfers: not a plan that threads",
        one.transfers()
    );
    for threads in [2, 3, 7] {
        let many = pair.plan_rank_on(Side::Inference, rank, threads).unwrap();
        assert_eq!(many.fingerprint, one.fingerprint, "{threads} threads");
        assert_eq!(many.peers.len(), one.peers.len());
        for (a, b) in many.peers.iter().zip(&one.peers) {
            assert_eq!(
                (a.peer, a.bytes, a.fingerprint),
                (b.peer, b.bytes, b.fingerprint)
            );
            assert_eq!(
                &a.transfers[..],
                &b.transfers[..],
                "{threads} threads: {}",
                a.peer
            );
        }
    }
    assert_eq!(
        pair.plan_rank(Side::Inference, rank).unwrap().fingerprint,
        one.fingerprint
    );
}
