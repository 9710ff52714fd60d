//! gpt-oss's reference layouts on SGLang and vLLM, shared by `awex-sglang/tests/gpt_oss.rs` and
//! `awex-vllm/tests/gpt_oss.rs` (each includes this file with `#[path]`, beside `labelled.rs` as
//! `labelled`): [`expected`] is `engines/tests/gpt_oss_layout.py`'s `expected(engine, ...)`, the
//! function the engine tests pin against each engine's own load, and [`awex_rank`] what awex's
//! layout puts on a rank.

use super::labelled::{Tensor, bf16, cat_rows, cols, mid, rows, swap};
use awex_core::DType;
use awex_core::layout::{RankId, SideLayout, materialize};
use awex_core::model::{CanonicalTensor, Catalogue, ModelSpec};
use std::collections::{BTreeMap, HashMap};

/// What differs between the engines (`gpt_oss_layout.py`'s `NAMES` and its ep rule).
pub struct Engine {
    /// The embedding's name.
    pub embed: &'static str,
    /// The attention module under `model.layers.{l}`.
    pub attn: &'static str,
    /// The experts module under `model.layers.{l}`.
    pub experts: &'static str,
    /// The gate/up and down biases' names in the experts module.
    pub w13_bias: &'static str,
    pub w2_bias: &'static str,
    /// The sinks are held in bf16 (SGLang) rather than the model's dtype (vLLM's is bf16 too).
    pub sinks_bf16: bool,
    /// Expert parallelism takes the whole tp group (vLLM) rather than tp / ep ranks (SGLang).
    pub ep_whole_group: bool,
}

/// SGLang 0.5.23's names (`models/gpt_oss.py`).
#[allow(dead_code)]
pub const SGLANG: Engine = Engine {
    embed: "model.embed_tokens.weight",
    attn: "self_attn",
    experts: "mlp.experts",
    w13_bias: "w13_weight_bias",
    w2_bias: "w2_weight_bias",
    sinks_bf16: true,
    ep_whole_group: false,
};

/// vLLM 0.33's names (`model_executor/models/gpt_oss.py`).
#[allow(dead_code)]
pub const VLLM: Engine = Engine {
    embed: "model.embedding.weight",
    attn: "attn",
    experts: "mlp.experts.routed_experts",
    w13_bias: "w13_bias",
    w2_bias: "w2_bias",
    sinks_bf16: false,
    ep_whole_group: true,
};

/// Every parameter TP rank `r` of `engine` holds at tp `tp`, ep `ep`, in f32.
pub fn expected(
    engine: &Engine,
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
    let moe_tp = if engine.ep_whole_group {
        if ep > 1 { 1 } else { tp }
    } else {
        tp / ep
    };
    let (moe_r, ep_r) = (r % moe_tp, r / moe_tp);
    let local = experts / (tp / moe_tp);
    let es = (ep_r * local, (ep_r + 1) * local);
    let vocab = |name: &str| {
        let t = g(name);
        let per = t.0[0].div_ceil(64) * 64 / tp;
        rows(t, r * per, (r + 1) * per, true)
    };
    let mut out = BTreeMap::new();
    out.insert(engine.embed.to_string(), vocab("model.embed_tokens.weight"));
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
        let attn = format!("{src}.{}", engine.attn);
        let ex = format!("{src}.{}", engine.experts);
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
        out.insert(
            format!("{attn}.sinks"),
            if engine.sinks_bf16 {
                bf16(&sinks)
            } else {
                sinks
            },
        );
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
            format!("{ex}.{}", engine.w13_bias),
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
        out.insert(format!("{ex}.{}", engine.w2_bias), b);
        for norm in ["input_layernorm", "post_attention_layernorm"] {
            let n = format!("{src}.{norm}.weight");
            out.insert(n.clone(), g(&n).clone());
        }
    }
    out
}

/// What awex's layout puts on TP rank `r`: every tensor filled from the labelled checkpoint,
/// in f32 (each element converted to the tensor's dtype and back), with its dtype.
pub fn awex_rank(
    layout: &dyn SideLayout,
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
