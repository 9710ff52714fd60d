//! FP8 inference sides over every registered inference backend: which tensors are FP8, their
//! scale tensors, the refusals, plans that differ from the plain pair's only in where the bf16
//! lands (receiver-encoded), and plans whose senders quantise the blocks they hold whole.

use awex_core::backend::{BackendSpec, inference_backends};
use awex_core::dtype::DType;
use awex_core::encoding::{Encoding, Fp8Block, Fp8Config, InferFp8, Recipe};
use awex_core::layout::RankId;
use awex_core::layout::{ExplicitSide, LocalTensor, RankLayout, Side};
use awex_core::model::{Part, presets};
use awex_core::pair::{PairSpec, ResolvedPair};
use awex_core::plan::{EncodeAt, RankPlan, SCALE_BYTES, Transfer, covers_whole_blocks};
use awex_core::{ModelSpec, Transport};

fn fp8(block: [u32; 2], ignored: &[&str]) -> InferFp8 {
    let config = Fp8Config::from_hf(&serde_json::json!({
        "quant_method": "fp8", "activation_scheme": "dynamic",
        "weight_block_size": block, "ignored_layers": ignored
    }))
    .unwrap();
    InferFp8::new(config, Recipe::Vllm).unwrap()
}

fn pair(model: &ModelSpec, train: &str, infer: &str, f: Option<InferFp8>) -> ResolvedPair {
    try_pair(model, train, infer, f).unwrap()
}

fn try_pair(
    model: &ModelSpec,
    train: &str,
    infer: &str,
    f: Option<InferFp8>,
) -> Result<ResolvedPair, String> {
    awex_tests::link_backends();
    PairSpec {
        model: model.clone(),
        train: train.parse::<BackendSpec>().unwrap(),
        infer: infer.parse::<BackendSpec>().unwrap(),
        // a transport that quantises on the receiver: `plan_pair()` plans every block
        // receiver-encoded (the sender-encoded plans below switch `encode_on_sender` on)
        transport: Transport::CudaIpc,
        infer_fp8: f,
    }
    .resolve()
    .map_err(|e| e.to_string())
}

fn part_of(model: &ModelSpec, canonical: &str) -> awex_core::model::Part {
    model.names().parse(canonical).unwrap().part
}

/// The structure every FP8 rank layout must have: FP8 tensors hold linear weights (and the
/// parts the engine's class quantises too, `extra`) only and each is followed by its scales in
/// block coordinates; everything else is plain.
fn check_rank(model: &ModelSpec, l: &RankLayout, block: [u32; 2], extra: &[Part]) -> usize {
    let fp8_part = |c: &str| {
        let part = part_of(model, c);
        part.fp8_linear() || extra.contains(&part)
    };
    let [bn, bk] = block.map(u64::from);
    let mut fp8 = 0;
    for (i, t) in l.tensors.iter().enumerate() {
        match &t.encoding {
            Encoding::Fp8Block(b) => {
                fp8 += 1;
                assert_eq!(b.block, block);
                assert_eq!(t.dtype, DType::F8E4m3, "{}", t.name);
                for p in &t.placements {
                    assert!(fp8_part(&p.canonical), "{} holds {}", t.name, p.canonical);
                }
                let s: &LocalTensor = &l.tensors[i + 1];
                assert_eq!(*s.name, Fp8Block::scale_name(&t.name));
                assert_eq!(s.dtype, DType::F32);
                assert!(matches!(s.encoding, Encoding::Fp8Scales(_)));
                let (ts, ss) = (t.shape.as_slice(), s.shape.as_slice());
                let n = ts.len();
                assert_eq!(ss[..n - 2], ts[..n - 2]);
                assert_eq!(
                    ss[n - 2..],
                    [ts[n - 2].div_ceil(bn), ts[n - 1].div_ceil(bk)]
                );
                // the scales' placements cover the weight's blocks, part by part
                assert_eq!(s.placements.len(), t.placements.len());
                for (w, sp) in t.placements.iter().zip(&s.placements) {
                    assert_eq!(*sp.canonical, Fp8Block::scale_name(&w.canonical));
                    let (wo, so) = (w.local_offset.as_slice(), sp.local_offset.as_slice());
                    let m = wo.len();
                    assert_eq!(so[m - 2..], [wo[m - 2] / bn, wo[m - 1] / bk]);
                    let we = w.region.extent.as_slice();
                    let se = sp.region.extent.as_slice();
                    let r = we.len();
                    assert_eq!(
                        se[r - 2..],
                        [we[r - 2].div_ceil(bn), we[r - 1].div_ceil(bk)]
                    );
                }
            }
            Encoding::Fp8Scales(_) => {
                assert!(i > 0 && matches!(l.tensors[i - 1].encoding, Encoding::Fp8Block(_)));
            }
            Encoding::Plain(d) => {
                assert_eq!(*d, t.dtype);
                for p in &t.placements {
                    assert!(
                        !fp8_part(&p.canonical),
                        "{} holds linear weight {} but is plain",
                        t.name,
                        p.canonical
                    );
                }
            }
        }
    }
    fp8
}

/// The transfers of a rank's plan without their encodings.
fn stripped(ts: &[Transfer]) -> Vec<Transfer> {
    ts.iter()
        .cloned()
        .map(|mut t| {
            t.encode = None;
            t
        })
        .collect()
}

#[test]
fn every_backend_marks_the_linear_weights_and_plans_as_the_plain_pair_but_into_staging() {
    let block = [8, 8];
    let models = [
        "qwen3-tiny",
        "qwen3-moe-tiny",
        "mixtral-tiny",
        "glm-4.5-tiny",
    ];
    let mut checked = 0;
    for name in models {
        let model = presets::preset(name).unwrap();
        // fsdp dp=3: Shard(0) chunks that cut blocks on the training side (the receiver
        // quantises whole blocks all the same)
        for (train, b) in ["megatron:tp=2", "fsdp:dp=3"]
            .into_iter()
            .flat_map(|t| inference_backends().into_iter().map(move |b| (t, b)))
        {
            for infer in [
                format!("{}:tp=1", b.name()),
                format!("{}:tp=2", b.name()),
                format!("{}:tp=2,ep=2", b.name()),
            ] {
                let Ok(p) = try_pair(&model, train, &infer, Some(fp8(block, &[]))) else {
                    continue; // a config the backend itself refuses (no ep for dense models)
                };
                let plain = pair(&model, train, &infer, None);
                let mut fp8_tensors = 0;
                for rank in p.inference.ranks() {
                    let l = p.inference.rank_layout(rank).unwrap();
                    let extra = p.inference.fp8_extra_parts();
                    fp8_tensors += check_rank(&model, &l, block, extra);
                    let a = p.plan_pair().plan_rank(Side::Inference, rank).unwrap();
                    let z = plain.plan_pair().plan_rank(Side::Inference, rank).unwrap();
                    assert_eq!(a.peers.len(), z.peers.len());
                    for (x, y) in a.peers.iter().zip(&z.peers) {
                        // the same boxes, in the same order, delivered in the same dtype
                        assert_eq!(
                            stripped(&x.transfers),
                            y.transfers.to_vec(),
                            "{name} {train} {infer}"
                        );
                        assert_eq!(x.bytes, y.bytes);
                        for t in &x.transfers {
                            let into_fp8 = matches!(
                                l.tensor(&t.dst_tensor).unwrap().encoding,
                                Encoding::Fp8Block(_)
                            );
                            assert_eq!(t.encode.is_some(), into_fp8, "{}", t.dst_tensor);
                            if let Some(e) = &t.encode {
                                assert_eq!(e.at, EncodeAt::Receiver);
                                assert_eq!(t.dst_dtype, DType::Bf16);
                            }
                        }
                        // the fingerprint says whether the plan encodes
                        let encodes = x.transfers.iter().any(|t| t.encode.is_some());
                        assert_eq!(x.fingerprint != y.fingerprint, encodes, "{name} {infer}");
                    }
                }
                assert!(fp8_tensors > 0, "{name} {infer}");
                // both ends agree
                for rank in p.training.ranks() {
                    let t = p.plan_pair().plan_rank(Side::Training, rank).unwrap();
                    for peer in &t.peers {
                        let i = p.plan_pair().plan_rank(Side::Inference, peer.peer).unwrap();
                        assert_eq!(i.peer(rank).unwrap().fingerprint, peer.fingerprint);
                    }
                }
                checked += 1;
            }
        }
    }
    assert!(checked >= 24, "only {checked} configs checked");
}

#[test]
fn reported_fp8_layouts_round_trip_through_json_and_plan_the_same() {
    // every layer MoE, as SGLang builds a Qwen3-MoE model
    let mut model = presets::preset("qwen3-moe-tiny").unwrap();
    if let Some(m) = &mut model.moe {
        m.mlp_only_layers.clear();
    }
    let p = pair(
        &model,
        "megatron:tp=2,dp=2,ep=2",
        "sglang:tp=2,ep=2",
        Some(fp8([16, 16], &[])),
    );
    let layouts: Vec<RankLayout> = p
        .inference
        .ranks()
        .into_iter()
        .map(|r| {
            let l = p.inference.rank_layout(r).unwrap();
            let json = serde_json::to_string(&l).unwrap();
            let back: RankLayout = serde_json::from_str(&json).unwrap();
            assert_eq!(back, l);
            back
        })
        .collect();
    // a plain layout writes no encoding at all (its JSON is what it was before encodings)
    let plain = pair(&model, "megatron:tp=2,dp=2,ep=2", "sglang:tp=2,ep=2", None);
    let l0 = plain
        .inference
        .rank_layout(plain.inference.ranks()[0])
        .unwrap();
    assert!(!serde_json::to_string(&l0).unwrap().contains("encoding"));
    let explicit = ExplicitSide::new(Side::Inference, layouts);
    let again = awex_core::plan::Pair {
        catalogue: &p.catalogue,
        training: &*p.training,
        inference: &explicit,
        encode_on_sender: false,
    };
    for rank in p.inference.ranks() {
        assert_eq!(
            again.plan_rank(Side::Inference, rank).unwrap(),
            p.plan_pair().plan_rank(Side::Inference, rank).unwrap()
        );
    }
}

#[test]
fn ignored_layers_stay_plain_and_a_half_ignored_fused_tensor_is_refused() {
    let model = presets::preset("qwen3-tiny").unwrap();
    let p = pair(
        &model,
        "megatron:tp=1",
        "sglang:tp=1",
        Some(fp8(
            [16, 16],
            &["model.layers.0.self_attn", "mlp.down_proj"],
        )),
    );
    let l = p.inference.rank_layout(p.inference.ranks()[0]).unwrap();
    let enc = |name: &str| l.tensor(name).unwrap().encoding.clone();
    assert!(matches!(
        enc("model.layers.0.self_attn.qkv_proj.weight"),
        Encoding::Plain(DType::Bf16)
    ));
    assert!(matches!(
        enc("model.layers.1.self_attn.qkv_proj.weight"),
        Encoding::Fp8Block(_)
    ));
    assert!(matches!(
        enc("model.layers.2.mlp.down_proj.weight"),
        Encoding::Plain(_)
    ));
    assert!(matches!(
        enc("model.layers.2.mlp.gate_up_proj.weight"),
        Encoding::Fp8Block(_)
    ));
    for plain in [
        "model.embed_tokens.weight",
        "lm_head.weight",
        "model.norm.weight",
        "model.layers.1.input_layernorm.weight",
        "model.layers.1.self_attn.q_norm.weight",
    ] {
        assert!(matches!(enc(plain), Encoding::Plain(_)), "{plain}");
    }
    assert!(
        l.tensor("model.layers.0.self_attn.qkv_proj.weight_scale_inv")
            .is_none()
    );
    let e = try_pair(
        &model,
        "megatron:tp=1",
        "vllm:tp=1",
        Some(fp8([16, 16], &["model.layers.1.self_attn.k_proj"])),
    )
    .err()
    .unwrap();
    assert!(
        e.contains("`model.layers.1.self_attn.qkv_proj.weight` holds FP8 parts and parts the quantization_config keeps unquantised (model.layers.1.self_attn.k_proj.weight)"),
        "{e}"
    );
}

/// vLLM 0.33's Qwen3-MoE builds its router with the checkpoint's quantisation
/// (`models/qwen3_moe.py`: `GateLinear(..., quant_config=quant_config)`), SGLang's without:
/// the vLLM side holds `mlp.gate.weight` as e4m3 with its scales unless `ignored_layers` names
/// the router; no other vLLM class quantises its router.
#[test]
fn vllm_quantises_the_qwen3_moe_router_unless_ignored_and_sglang_never_does() {
    // every layer MoE (SGLang refuses qwen3-moe-tiny's dense layer 0)
    let mut model = presets::preset("qwen3-moe-tiny").unwrap();
    model.moe.as_mut().unwrap().mlp_only_layers.clear();
    let router = "model.layers.1.mlp.gate.weight";
    let enc = |infer: &str, ignored: &[&str]| {
        let p = pair(&model, "megatron:tp=2", infer, Some(fp8([16, 16], ignored)));
        let l = p.inference.rank_layout(p.inference.ranks()[1]).unwrap();
        let scales = l
            .tensor(&format!("{router}_scale_inv"))
            .map(|t| t.shape.as_slice().to_vec());
        (
            l.tensor(router).unwrap().encoding.clone(),
            l.tensor(router).unwrap().dtype,
            scales,
        )
    };
    let (e, d, s) = enc("vllm:tp=2", &[]);
    assert!(matches!(e, Encoding::Fp8Block(_)), "{e:?}");
    assert_eq!(d, DType::F8E4m3);
    // 8 experts x hidden 64 in 16 x 16 blocks, whole on every rank
    assert_eq!(s, Some(vec![1, 4]));
    let (e, d, s) = enc("vllm:tp=2,ep=2", &[]);
    assert!(matches!(e, Encoding::Fp8Block(_)) && d == DType::F8E4m3 && s.is_some());
    for (infer, ignored) in [
        ("vllm:tp=2", &["model.layers.1.mlp.gate"][..]),
        ("vllm:tp=2", &["mlp.gate"][..]),
        ("sglang:tp=2", &[][..]),
    ] {
        let (e, d, s) = enc(infer, ignored);
        assert!(
            matches!(e, Encoding::Plain(DType::Bf16)),
            "{infer} {ignored:?}: {e:?}"
        );
        assert_eq!((d, s), (DType::Bf16, None), "{infer} {ignored:?}");
    }
    // the other MoE families keep their router's dtype on vLLM
    for name in ["mixtral-tiny", "glm-4.5-tiny"] {
        let model = presets::preset(name).unwrap();
        let p = pair(&model, "megatron:tp=1", "vllm:tp=1", Some(fp8([8, 8], &[])));
        assert!(p.inference.fp8_extra_parts().is_empty(), "{name}");
        let l = p.inference.rank_layout(p.inference.ranks()[0]).unwrap();
        let routers: Vec<_> = l
            .tensors
            .iter()
            .filter(|t| t.name.ends_with(".gate.weight"))
            .collect();
        assert!(!routers.is_empty(), "{name}");
        for t in routers {
            assert!(
                matches!(t.encoding, Encoding::Plain(_)),
                "{name} {}",
                t.name
            );
        }
    }
}

#[test]
fn shards_that_cut_a_block_are_refused_by_name_rows_and_columns() {
    let model = presets::preset("qwen3-tiny").unwrap();
    // column: 64 query rows over tp 2 in 64-row blocks
    let e = try_pair(
        &model,
        "megatron:tp=1",
        "vllm:tp=2",
        Some(fp8([64, 16], &[])),
    )
    .err()
    .unwrap();
    assert!(
        e.contains(
            "output_partition_size = 32 is not divisible by weight quantization block_n = 64"
        ),
        "{e}"
    );
    // row: o_proj's 64 input columns over tp 2 in 64-column blocks
    let e = try_pair(
        &model,
        "megatron:tp=1",
        "sglang:tp=2",
        Some(fp8([16, 64], &[])),
    )
    .err()
    .unwrap();
    assert!(
        e.contains(
            "input_size_per_partition = 32 is not divisible by weight quantization block_k = 64"
        ),
        "{e}"
    );
    // tp 1: an edge block may be partial (64 rows in 48-row blocks: 48 + 16 of q)... but a fused
    // part boundary inside a block is not (k starts at row 64, inside the second 48-row block)
    let e = try_pair(
        &model,
        "megatron:tp=1",
        "sglang:tp=1",
        Some(fp8([48, 16], &[])),
    )
    .err()
    .unwrap();
    assert!(
        e.contains("not divisible by weight quantization block_n = 48"),
        "{e}"
    );
    // tp 1 with blocks that only cut the canonical edges: accepted (partial edge blocks)
    let m = ModelSpec {
        hidden_size: 72,
        ..model.clone()
    };
    let p = pair(&m, "megatron:tp=1", "sglang:tp=1", Some(fp8([16, 16], &[])));
    let l = p.inference.rank_layout(p.inference.ranks()[0]).unwrap();
    // o_proj [72, 64]: 5 row blocks, the last 8 high
    assert_eq!(
        l.tensor("model.layers.0.self_attn.o_proj.weight_scale_inv")
            .unwrap()
            .shape
            .as_slice(),
        [5, 4]
    );
    // qkv_proj [64 + 32 + 32, 72]: 8 row blocks, 5 column blocks
    assert_eq!(
        l.tensor("model.layers.0.self_attn.qkv_proj.weight_scale_inv")
            .unwrap()
            .shape
            .as_slice(),
        [8, 5]
    );
}

/// Every case of a fixture written by an engine's own FP8 classes (`fixtures/fp8_<engine>_params.json`:
/// every parameter's name, shape and dtype per TP rank, from the engine's load of the
/// reference-quantised checkpoint) against awex's FP8 layout of the same pair on `backend`;
/// returns how many FP8 parameters the fixture holds.
fn check_engine_fixture(fixture: &str, backend: &str) -> FixtureCounts {
    let fixture: serde_json::Value = serde_json::from_str(fixture).unwrap();
    let dtype = |d: &str| match d {
        "float8_e4m3fn" => DType::F8E4m3,
        "float32" => DType::F32,
        "bfloat16" => DType::Bf16,
        other => panic!("dtype {other}"),
    };
    let mut fp8_params = 0;
    let mut deepseek_ranks = 0;
    let mut skipped = 0;
    for case in fixture["cases"].as_array().unwrap() {
        let config = &case["config"];
        let model = ModelSpec::from_config_value(config).unwrap();
        let f = Fp8Config::from_hf_model_config(config).unwrap().unwrap();
        let (tp, ep) = (case["tp"].as_u64().unwrap(), case["ep"].as_u64().unwrap());
        // the spec the engine test ran (DeepSeek-V3 says its shared experts stay apart)
        let infer = case["infer"]
            .as_str()
            .map_or_else(|| format!("{backend}:tp={tp},ep={ep}"), str::to_string);
        // the inference layout does not depend on the training side (FSDP maps every case,
        // MLA without q_lora_rank included)
        let p = pair(
            &model,
            "fsdp:dp=1",
            &infer,
            Some(InferFp8::new(f, Recipe::Vllm).unwrap()),
        );
        let ranks = case["ranks"].as_array().unwrap();
        assert_eq!(ranks.len(), p.inference.ranks().len(), "{infer}");
        for (r, params) in ranks.iter().enumerate() {
            let rank = p.inference.ranks()[r];
            let l = p.inference.rank_layout(rank).unwrap();
            // SGLang's parameters but those it marks `_skip_weight_check` (DeepSeek's FP8
            // KV-cache k_scale / v_scale), which are no weights and which awex.sglang does not
            // register
            // (vLLM's fixture lists the parameters alone)
            let skip: Vec<&str> = params["skip_weight_check"]
                .as_array()
                .map_or(&[][..], |v| &v[..])
                .iter()
                .map(|n| n.as_str().unwrap())
                .collect();
            skipped += skip.len();
            let list = params.get("params").unwrap_or(params);
            let mut theirs: Vec<(String, Vec<u64>, DType)> = list
                .as_array()
                .unwrap()
                .iter()
                .filter(|x| !skip.contains(&x[0].as_str().unwrap()))
                .map(|x| {
                    let shape = x[1]
                        .as_array()
                        .unwrap()
                        .iter()
                        .map(|d| d.as_u64().unwrap())
                        .collect();
                    (
                        x[0].as_str().unwrap().to_string(),
                        shape,
                        dtype(x[2].as_str().unwrap()),
                    )
                })
                .collect();
            let mut ours: Vec<(String, Vec<u64>, DType)> = l
                .tensors
                .iter()
                .map(|t| (t.name.to_string(), t.shape.as_slice().to_vec(), t.dtype))
                .collect();
            fp8_params += theirs.iter().filter(|t| t.2 == DType::F8E4m3).count();
            theirs.sort();
            ours.sort();
            assert_eq!(ours, theirs, "{} {infer} rank {r}", case["arch"]);
            if case["arch"] == "DeepseekV3ForCausalLM" {
                // DeepSeek-V3's MLA projections are FP8 (the fused q/kv down projection too, as
                // in its FP8 checkpoint), the router and its bias are not
                let dtype_of = |n: &str| ours.iter().find(|t| t.0 == n).map(|t| t.2);
                for proj in [
                    "fused_qkv_a_proj_with_mqa",
                    "q_b_proj",
                    "kv_b_proj",
                    "o_proj",
                ] {
                    let n = format!("model.layers.0.self_attn.{proj}.weight");
                    assert_eq!(dtype_of(&n), Some(DType::F8E4m3), "{n}");
                    assert_eq!(dtype_of(&format!("{n}_scale_inv")), Some(DType::F32), "{n}");
                }
                assert_eq!(
                    dtype_of("model.layers.1.mlp.gate.weight"),
                    Some(DType::Bf16)
                );
                assert_eq!(
                    dtype_of("model.layers.1.mlp.gate.e_score_correction_bias"),
                    Some(DType::F32)
                );
                deepseek_ranks += 1;
            }
        }
    }
    FixtureCounts {
        fp8_params,
        deepseek_ranks,
        skipped,
    }
}

/// What [`check_engine_fixture`] saw.
struct FixtureCounts {
    fp8_params: usize,
    deepseek_ranks: usize,
    skipped: usize,
}

/// `tests/tests/fixtures/fp8_sglang_params.json`: every parameter (name, shape, dtype) of
/// SGLang 0.5.23's own block-FP8 models on CPU, per TP rank, written by
/// `engines/tests/test_fp8_sglang_params.py` (which loads the reference-quantised checkpoint
/// with SGLang's real classes and checks the file still holds what they create), Qwen3,
/// Qwen3-MoE and DeepSeek-V3 (with and without `q_lora_rank`).
#[test]
fn the_sglang_fp8_layout_holds_exactly_sglang_s_own_fp8_parameters() {
    let c = check_engine_fixture(include_str!("fixtures/fp8_sglang_params.json"), "sglang");
    assert!(c.fp8_params >= 40, "{}", c.fp8_params);
    assert!(c.deepseek_ranks >= 5, "{}", c.deepseek_ranks);
    // 2 MLA attention modules x k/v scale x 2 layers, on every DeepSeek rank
    assert_eq!(c.skipped, 8 * (c.deepseek_ranks + 2), "{}", c.skipped);
}

/// `tests/tests/fixtures/fp8_vllm_params.json`: every parameter (name, shape, dtype) of vLLM
/// 0.33's own block-FP8 models on CPU (`Fp8LinearMethod` / `Fp8MoEMethod.create_weights`), per
/// TP rank, written by `engines/tests/vllm/test_fp8_vllm_params.py` (which builds them with
/// vLLM's `initialize_model` from the reference-quantised checkpoint, loads it with the
/// class's `load_weights`, and checks the file still holds what they create).
#[test]
fn the_vllm_fp8_layout_holds_exactly_vllm_s_own_fp8_parameters() {
    let c = check_engine_fixture(include_str!("fixtures/fp8_vllm_params.json"), "vllm");
    assert!(c.fp8_params >= 40, "{}", c.fp8_params);
}

/// One inference rank's plan with sender encoding on (as a transport that encodes on the
/// sender plans it).
fn sender_plan(p: &ResolvedPair, side: Side, rank: RankId) -> RankPlan {
    let mut pp = p.plan_pair();
    pp.encode_on_sender = true;
    pp.plan_rank(side, rank).unwrap()
}

/// Checks the sender-encoding contract over one inference rank's transfers and counts, over
/// its FP8 tensors, the blocks quantised by a sender and by the receiver. Every block of every
/// FP8 tensor is covered by exactly one of: one sender-encoded transfer (its scale box names
/// it once), or receiver-encoded transfers only.
fn check_blocks(l: &RankLayout, ts: &[&Transfer]) -> (u64, u64) {
    let (mut sent, mut received) = (0, 0);
    for t in &l.tensors {
        let Encoding::Fp8Block(enc) = &t.encoding else {
            continue;
        };
        let [bn, bk] = enc.block.map(u64::from);
        let n = t.shape.ndim();
        let scales = l.tensor(&Fp8Block::scale_name(&t.name)).unwrap();
        let (rows, cols) = (scales.shape.get(n - 2), scales.shape.get(n - 1));
        let lead: u64 = t.shape.as_slice()[..n - 2].iter().product();
        let idx = |lead_i: u64, r: u64, c: u64| ((lead_i * rows + r) * cols + c) as usize;
        let mut by_sender = vec![0u32; (lead * rows * cols) as usize];
        let mut by_receiver = vec![false; by_sender.len()];
        for x in ts.iter().filter(|x| *x.dst_tensor == *t.name) {
            let e = x.encode.as_ref().expect("a transfer into FP8 is encoded");
            assert_eq!(e.encoding, *enc);
            let k = x.extent.ndim();
            // the leading (stack) indices the box covers
            let mut leads = vec![0u64];
            for j in 0..n - 2 {
                let len = if j >= n - k {
                    x.extent.get(j - (n - k))
                } else {
                    1
                };
                let o = x.dst_offset.get(j);
                leads = leads
                    .iter()
                    .flat_map(|&l0| (o..o + len).map(move |i| l0 * t.shape.get(j) + i))
                    .collect();
            }
            let (r0, c0) = (x.dst_offset.get(n - 2), x.dst_offset.get(n - 1));
            let (re, ce) = (x.extent.get(k - 2), x.extent.get(k - 1));
            match e.at {
                EncodeAt::Sender => {
                    assert!(covers_whole_blocks(
                        enc.block,
                        &x.dst_shape,
                        &x.dst_offset,
                        &x.extent
                    ));
                    assert_eq!(x.dst_dtype, DType::F8E4m3);
                    let sb = x.scale_box().unwrap();
                    assert_eq!(sb.tensor, *scales.name);
                    assert_eq!(sb.shape, scales.shape);
                    assert_eq!(sb.extent.get(k - 2), re.div_ceil(bn));
                    assert_eq!(sb.extent.get(k - 1), ce.div_ceil(bk));
                    assert_eq!(sb.offset.get(n - 2), r0 / bn);
                    assert_eq!(sb.offset.get(n - 1), c0 / bk);
                    assert_eq!(
                        x.bytes(),
                        x.numel() + sb.extent.numel() * SCALE_BYTES,
                        "e4m3 bytes + fp32 scales"
                    );
                    for &li in &leads {
                        for r in r0 / bn..(r0 + re).div_ceil(bn) {
                            for c in c0 / bk..(c0 + ce).div_ceil(bk) {
                                by_sender[idx(li, r, c)] += 1;
                            }
                        }
                    }
                }
                EncodeAt::Receiver => {
                    assert_eq!(x.dst_dtype, DType::Bf16);
                    assert!(x.scale_box().is_none());
                    assert_eq!(x.bytes(), x.numel() * 2);
                    for &li in &leads {
                        for r in r0 / bn..(r0 + re).div_ceil(bn) {
                            for c in c0 / bk..(c0 + ce).div_ceil(bk) {
                                by_receiver[idx(li, r, c)] = true;
                            }
                        }
                    }
                }
            }
        }
        for (i, (&s, &r)) in by_sender.iter().zip(&by_receiver).enumerate() {
            assert!(s <= 1, "`{}` block {i} sender-encoded {s} times", t.name);
            assert!(
                (s == 1) != r,
                "`{}` block {i}: sender {s}, receiver {r}",
                t.name
            );
            if s == 1 {
                sent += 1;
            } else {
                received += 1;
            }
        }
    }
    (sent, received)
}

/// (sender-encoded blocks, receiver-encoded blocks) over every inference rank of `p`, checking
/// the contract, both ends' agreement and the boxes against the receiver-encoded plan.
fn check_sender_pair(p: &ResolvedPair) -> (u64, u64) {
    let (mut sent, mut received) = (0, 0);
    for rank in p.inference.ranks() {
        let l = p.inference.rank_layout(rank).unwrap();
        let a = sender_plan(p, Side::Inference, rank);
        let z = p.plan_pair().plan_rank(Side::Inference, rank).unwrap();
        let ts: Vec<&Transfer> = a.peers.iter().flat_map(|x| &x.transfers).collect();
        let (s, r) = check_blocks(&l, &ts);
        sent += s;
        received += r;
        // the same elements land, per destination tensor
        let count = |ts: &mut dyn Iterator<Item = &Transfer>| {
            let mut m = std::collections::BTreeMap::<String, u64>::new();
            for t in ts {
                *m.entry(t.dst_tensor.to_string()).or_default() += t.numel();
            }
            m
        };
        assert_eq!(
            count(&mut ts.iter().copied()),
            count(&mut z.peers.iter().flat_map(|x| &x.transfers))
        );
        // bytes: each peer's total is its transfers'; FP8 data moves as e4m3 + scales
        for x in &a.peers {
            assert_eq!(
                x.bytes,
                x.transfers.iter().map(Transfer::bytes).sum::<u64>()
            );
        }
        if s > 0 {
            assert!(a.bytes() < z.bytes(), "{} >= {}", a.bytes(), z.bytes());
            assert_ne!(a.fingerprint, z.fingerprint);
        } else {
            assert_eq!(a, z);
        }
    }
    // both ends agree
    for rank in p.training.ranks() {
        let t = sender_plan(p, Side::Training, rank);
        for peer in &t.peers {
            let i = sender_plan(p, Side::Inference, peer.peer);
            let mine = i.peer(rank).unwrap();
            assert_eq!(mine.fingerprint, peer.fingerprint);
            assert_eq!(mine.transfers, peer.transfers);
        }
    }
    (sent, received)
}

#[test]
fn megatron_tp2_into_sglang_tp2_is_sender_encoded_throughout() {
    for name in ["qwen3-tiny", "qwen3-moe-tiny"] {
        let mut model = presets::preset(name).unwrap();
        // every layer MoE, as SGLang builds a Qwen3-MoE model
        if let Some(m) = &mut model.moe {
            m.mlp_only_layers.clear();
        }
        let p = pair(
            &model,
            "megatron:tp=2",
            "sglang:tp=2",
            Some(fp8([16, 16], &[])),
        );
        let (sent, received) = check_sender_pair(&p);
        assert!(sent > 0, "{name}");
        assert_eq!(
            received, 0,
            "{name}: every block is held whole by one sender"
        );
        // every transfer into an FP8 tensor is sender-encoded, into the engine's own tensor
        for rank in p.inference.ranks() {
            let a = sender_plan(&p, Side::Inference, rank);
            for t in a.peers.iter().flat_map(|x| &x.transfers) {
                if let Some(e) = &t.encode {
                    assert_eq!(e.at, EncodeAt::Sender, "{}", t.dst_tensor);
                }
            }
        }
        // a transport that does not encode on the sender plans every block receiver-encoded
        let r = p
            .plan_pair()
            .plan_rank(Side::Inference, p.inference.ranks()[0])
            .unwrap();
        assert!(
            r.peers
                .iter()
                .flat_map(|x| &x.transfers)
                .all(|t| !t.sender_encoded())
        );
    }
}

#[test]
fn fsdp_chunks_that_cut_blocks_leave_the_cut_blocks_to_the_receiver() {
    let model = presets::preset("qwen3-tiny").unwrap();
    for infer in ["sglang:tp=2", "vllm:tp=1"] {
        let p = pair(&model, "fsdp:dp=3", infer, Some(fp8([8, 8], &[])));
        let (sent, received) = check_sender_pair(&p);
        // dp 3's row chunks end inside blocks: those blocks (a row of blocks per cut) are the
        // receiver's, the rest the senders'
        assert!(received > 0, "{infer}");
        assert!(
            sent > 2 * received,
            "{infer}: {sent} sent, {received} received"
        );
    }
}

#[test]
fn sender_encoded_plans_round_trip_through_json_and_plain_pairs_ignore_the_switch() {
    let mut model = presets::preset("qwen3-moe-tiny").unwrap();
    if let Some(m) = &mut model.moe {
        m.mlp_only_layers.clear();
    }
    let p = pair(&model, "fsdp:dp=3", "sglang:tp=2", Some(fp8([8, 8], &[])));
    let r = sender_plan(&p, Side::Inference, p.inference.ranks()[0]);
    let json = serde_json::to_string(&r).unwrap();
    assert!(json.contains(r#""at":"sender""#), "{json}");
    assert!(json.contains(r#""at":"receiver""#));
    let back: RankPlan = serde_json::from_str(&json).unwrap();
    assert_eq!(back, r);
    // a plain pair plans byte-identically whatever the transport does with FP8
    let plain = pair(&model, "fsdp:dp=3", "sglang:tp=2", None);
    for rank in plain.inference.ranks() {
        assert_eq!(
            sender_plan(&plain, Side::Inference, rank),
            plain.plan_pair().plan_rank(Side::Inference, rank).unwrap()
        );
    }
}
