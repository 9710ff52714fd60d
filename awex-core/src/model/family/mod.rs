//! Model families: one file per HF class, each parsing its config's own fields and listing
//! every layer's parts (from the shared [`super::part`] vocabulary) with their shapes, its
//! presets beside it. The catalogue, its size and every backend's view come from these lists.
//!
//! Adding a family: write `family/<name>.rs` with a `pub const FAMILY: Family` (see
//! `qwen3.rs`), and add it to [`ALL`].

pub(crate) mod deepseek_v2;
pub(crate) mod deepseek_v3;
pub(crate) mod glm4_moe;
pub(crate) mod gpt_oss;
pub(crate) mod llama;
pub(crate) mod mixtral;
pub(crate) mod qwen2;
pub(crate) mod qwen3;
pub(crate) mod qwen3_5;
pub(crate) mod qwen3_5_moe;
pub(crate) mod qwen3_moe;
pub(crate) mod qwen3_next;

use super::names::{Canon, HfNames};
use super::part::Part;
use super::{ModelError, ModelSpec, MoeSpec};
use crate::dims::Dims;
use crate::dtype::DType;
use serde_json::Value;

/// Every family awex knows, in the order `plan --help` lists them.
pub const ALL: &[&Family] = &[
    &llama::FAMILY,
    &qwen2::FAMILY,
    &qwen3::FAMILY,
    &qwen3_moe::FAMILY,
    &mixtral::FAMILY,
    &deepseek_v2::FAMILY,
    &deepseek_v3::FAMILY,
    &glm4_moe::FAMILY,
    &qwen3_next::FAMILY,
    &qwen3_5::FAMILY,
    &qwen3_5_moe::FAMILY,
    &gpt_oss::FAMILY,
];

/// One model family: its HF class, its names, how it reads a config and which parts a layer has.
#[derive(Debug)]
pub struct Family {
    /// Short name (`qwen3`), for help text and docs.
    pub name: &'static str,
    /// The HF class, `architectures[0]` of a config (`Qwen3ForCausalLM`).
    pub hf_class: &'static str,
    /// How the family's checkpoints spell its parts.
    pub names: &'static HfNames,
    /// Reads the family's own config fields into a spec whose common sizes are already read.
    pub parse: fn(&Value, &mut ModelSpec) -> Result<(), ModelError>,
    /// Lists layer `l`'s parts, in checkpoint (catalogue) order.
    pub layer: fn(&ModelSpec, u64, &mut dyn Sink),
    /// Checks the sizes only this family reads (MLA's ranks, ...), beyond the common ones
    /// [`ModelSpec::validate`] checks, so that no tensor of a spec it accepts is empty.
    pub check: fn(&ModelSpec) -> Result<(), ModelError>,
    /// Built-in presets of the family.
    pub presets: &'static [Preset],
}

/// A built-in model.
#[derive(Debug)]
pub struct Preset {
    /// The `--model` name.
    pub name: &'static str,
    /// What it is, for help text.
    pub about: &'static str,
    /// Its spec (named `name`).
    pub spec: fn(&str) -> ModelSpec,
}

/// Receives a family's parts.
pub trait Sink {
    /// One tensor, in the model's dtype.
    fn part(&mut self, c: Canon, shape: Dims);
    /// One tensor that a checkpoint stores in `dtype` whatever the model's dtype (DeepSeek-V3's
    /// fp32 router bias); a sink that needs no dtype treats it as [`Sink::part`].
    fn part_as(&mut self, c: Canon, shape: Dims, dtype: DType) {
        let _ = dtype;
        self.part(c, shape);
    }
    /// `count` routed experts of layer `l`, each with these parts (in this order).
    fn experts(&mut self, l: u64, count: u64, parts: &[(Part, Dims)]);
}

impl Family {
    /// The family of an HF class name.
    pub fn of(hf_class: &str) -> Result<&'static Family, ModelError> {
        ALL.iter()
            .copied()
            .find(|f| f.hf_class == hf_class)
            .ok_or_else(|| ModelError::UnknownArchitecture {
                found: hf_class.to_string(),
                supported: ALL.iter().map(|f| f.hf_class).collect(),
            })
    }
}

impl PartialEq for Family {
    fn eq(&self, other: &Self) -> bool {
        self.hf_class == other.hf_class
    }
}

impl Eq for Family {}

/// The check of a family without multi-head latent attention: a spec (sent as JSON) that
/// carries MLA sizes anyway is refused, not silently ignored.
pub(crate) fn no_mla(spec: &ModelSpec) -> Result<(), ModelError> {
    if spec.mla.is_some() {
        return Err(ModelError::Inconsistent(format!(
            "the model gives multi-head latent attention sizes (`mla`), but {} has no MLA; only DeepseekV2ForCausalLM and DeepseekV3ForCausalLM models have them",
            spec.architecture.hf_name()
        )));
    }
    Ok(())
}

/// The check of a family without linear attention: a spec (sent as JSON) that carries Gated
/// DeltaNet sizes anyway is refused, not silently ignored.
pub(crate) fn no_linear(spec: &ModelSpec) -> Result<(), ModelError> {
    if spec.linear.is_some() {
        return Err(ModelError::Inconsistent(format!(
            "the model gives linear-attention sizes (`linear`), but {} has no linear attention; only Qwen3NextForCausalLM, Qwen3_5ForCausalLM and Qwen3_5MoeForCausalLM models have them",
            spec.architecture.hf_name()
        )));
    }
    Ok(())
}

/// The check of a dense family (an MLP on every layer): a spec that carries MoE sizes anyway
/// is refused, not silently ignored.
pub(crate) fn no_moe(spec: &ModelSpec) -> Result<(), ModelError> {
    if spec.moe.is_some() {
        return Err(ModelError::Inconsistent(format!(
            "the model gives mixture-of-experts sizes (`moe`), but {} is dense (an MLP on every layer); its MoE sibling is another architecture",
            spec.architecture.hf_name()
        )));
    }
    Ok(())
}

/// The check of a mixture-of-experts family: a spec without MoE sizes is refused (it would
/// walk as a dense model under a MoE architecture's name).
pub(crate) fn needs_moe(spec: &ModelSpec) -> Result<(), ModelError> {
    if spec.moe.is_none() {
        return Err(ModelError::Inconsistent(format!(
            "{} is a mixture-of-experts model, but the model gives no MoE sizes (`moe`: num_experts, num_experts_per_tok, moe_intermediate_size, ...)",
            spec.architecture.hf_name()
        )));
    }
    Ok(())
}

/// The check of a dense family with standard attention (Llama, Qwen2, Qwen3).
pub(crate) fn dense_standard(spec: &ModelSpec) -> Result<(), ModelError> {
    no_mla(spec)?;
    no_linear(spec)?;
    no_moe(spec)
}

/// The check of a MoE family with standard attention (Qwen3-MoE, Mixtral, GLM-4.5).
pub(crate) fn moe_standard(spec: &ModelSpec) -> Result<(), ModelError> {
    no_mla(spec)?;
    no_linear(spec)?;
    needs_moe(spec)
}

/// Every part of `spec` in catalogue order: the embedding, each layer's parts, the final norm
/// and (untied) the output projection.
pub fn walk(spec: &ModelSpec, sink: &mut dyn Sink) {
    let (v, h) = (spec.vocab_size, spec.hidden_size);
    sink.part(Canon::global(Part::Embed), Dims::new(&[v, h]));
    let layer = spec.architecture.family().layer;
    for l in 0..spec.num_layers {
        layer(spec, l, sink);
    }
    sink.part(Canon::global(Part::FinalNorm), Dims::new(&[h]));
    if !spec.tie_word_embeddings {
        sink.part(Canon::global(Part::LmHead), Dims::new(&[v, h]));
    }
}

// ---- the building blocks family files compose ----

/// Whether the q/k/v (and o) projections carry biases.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Biases {
    /// No bias.
    None,
    /// q, k and v biases (Qwen2).
    Qkv,
    /// q, k, v and o biases (Llama, Qwen3 with `attention_bias`).
    QkvO,
}

/// Grouped-query attention with optional biases and per-head q/k norms, between the input norm
/// and the post-attention norm (the Llama layout of a layer's first half).
pub(crate) fn gqa_attention(
    spec: &ModelSpec,
    l: u64,
    biases: Biases,
    qk_norm: bool,
    sink: &mut dyn Sink,
) {
    let h = spec.hidden_size;
    let (q, kv) = (spec.q_size(), spec.kv_size());
    let mut part = |p: Part, shape: &[u64]| sink.part(Canon::at(p, l), Dims::new(shape));
    part(Part::InputNorm, &[h]);
    part(Part::Q, &[q, h]);
    part(Part::K, &[kv, h]);
    part(Part::V, &[kv, h]);
    if biases != Biases::None {
        part(Part::QBias, &[q]);
        part(Part::KBias, &[kv]);
        part(Part::VBias, &[kv]);
    }
    part(Part::O, &[h, q]);
    if biases == Biases::QkvO {
        part(Part::OBias, &[h]);
    }
    if qk_norm {
        part(Part::QNorm, &[spec.head_dim]);
        part(Part::KNorm, &[spec.head_dim]);
    }
    part(Part::PostNorm, &[h]);
}

/// The gated dense MLP (gate, up, down) of `intermediate` rows.
pub(crate) fn dense_mlp(spec: &ModelSpec, l: u64, sink: &mut dyn Sink) {
    let (h, i) = (spec.hidden_size, spec.intermediate_size);
    sink.part(Canon::at(Part::Gate, l), Dims::new(&[i, h]));
    sink.part(Canon::at(Part::Up, l), Dims::new(&[i, h]));
    sink.part(Canon::at(Part::Down, l), Dims::new(&[h, i]));
}

/// A router and routed experts, each a gated MLP whose parts come in `order`.
pub(crate) fn routed_experts(spec: &ModelSpec, l: u64, order: [Part; 3], sink: &mut dyn Sink) {
    let Some(m) = &spec.moe else { return };
    let (h, i) = (spec.hidden_size, m.moe_intermediate_size);
    sink.part(Canon::at(Part::Router, l), Dims::new(&[m.num_experts, h]));
    let parts = order.map(|p| {
        let shape = if p == Part::ExpertDown {
            [h, i]
        } else {
            [i, h]
        };
        (p, Dims::new(&shape))
    });
    sink.experts(l, m.num_experts, &parts);
}

/// A DeepSeek-style MoE block (DeepSeek-V3, GLM-4.5): the router `[experts, hidden]`, its
/// score-correction bias (fp32 in the checkpoint whatever the model's dtype) when the model has
/// one, the routed experts (gate, up, down) and the shared experts' gated MLP of
/// `shared_intermediate_size` rows when it is not 0.
pub(crate) fn shared_moe(spec: &ModelSpec, l: u64, sink: &mut dyn Sink) {
    let Some(m) = &spec.moe else { return };
    let (h, e, i) = (spec.hidden_size, m.num_experts, m.moe_intermediate_size);
    sink.part(Canon::at(Part::Router, l), Dims::new(&[e, h]));
    if m.router_bias {
        sink.part_as(Canon::at(Part::RouterBias, l), Dims::new(&[e]), DType::F32);
    }
    sink.experts(
        l,
        e,
        &[
            (Part::ExpertGate, Dims::new(&[i, h])),
            (Part::ExpertUp, Dims::new(&[i, h])),
            (Part::ExpertDown, Dims::new(&[h, i])),
        ],
    );
    let s = m.shared_intermediate_size;
    if s > 0 {
        sink.part(Canon::at(Part::SharedGate, l), Dims::new(&[s, h]));
        sink.part(Canon::at(Part::SharedUp, l), Dims::new(&[s, h]));
        sink.part(Canon::at(Part::SharedDown, l), Dims::new(&[h, s]));
    }
}

/// The common sizes every family's config carries.
pub(crate) fn common(
    cfg: &Value,
    name: &str,
    family: &'static Family,
) -> Result<ModelSpec, ModelError> {
    use super::spec::{opt_bool, opt_uint, uint};
    let hidden_size = uint(cfg, "hidden_size")?;
    let num_layers = uint(cfg, "num_hidden_layers")?;
    let num_heads = uint(cfg, "num_attention_heads")?;
    let num_kv_heads = opt_uint(cfg, "num_key_value_heads")?.unwrap_or(num_heads);
    let head_dim = match opt_uint(cfg, "head_dim")? {
        Some(h) => h,
        None => {
            if num_heads == 0 || hidden_size % num_heads != 0 {
                return Err(ModelError::Inconsistent(format!(
                    "config has no `head_dim` and num_attention_heads={num_heads} does not divide hidden_size={hidden_size}; set `head_dim` explicitly"
                )));
            }
            hidden_size / num_heads
        }
    };
    // Qwen3_5MoeTextConfig has no dense intermediate size (every layer is MoE); a family whose
    // layers may be dense needs it (`ModelSpec::validate` refuses 0 then)
    let intermediate_size = match opt_uint(cfg, "intermediate_size")? {
        Some(i) => i,
        None if family.hf_class == "Qwen3_5MoeForCausalLM" => 0,
        None => return Err(ModelError::MissingField("intermediate_size")),
    };
    let vocab_size = uint(cfg, "vocab_size")?;
    let tie_word_embeddings = opt_bool(cfg, "tie_word_embeddings", false)?;
    let dtype = match cfg.get("torch_dtype").or_else(|| cfg.get("dtype")) {
        Some(Value::String(s)) => {
            s.parse()
                .map_err(|e: crate::dtype::DTypeError| ModelError::BadField {
                    field: "torch_dtype",
                    message: e.to_string(),
                })?
        }
        _ => DType::Bf16,
    };
    Ok(ModelSpec {
        name: name.to_string(),
        architecture: super::Architecture(family),
        hidden_size,
        num_layers,
        num_heads,
        num_kv_heads,
        head_dim,
        intermediate_size,
        vocab_size,
        tie_word_embeddings,
        attention_bias: false,
        use_qk_norm: false,
        dtype,
        moe: None,
        mla: None,
        mtp_layers: 0,
        linear: None,
    })
}

/// A list of layer indices (`mlp_only_layers`).
pub(crate) fn layer_list(cfg: &Value, field: &'static str) -> Result<Vec<u64>, ModelError> {
    match cfg.get(field) {
        None | Some(Value::Null) => Ok(Vec::new()),
        Some(Value::Array(a)) => a
            .iter()
            .map(|v| {
                v.as_u64().ok_or_else(|| ModelError::BadField {
                    field,
                    message: format!("expected layer indices, found {v}"),
                })
            })
            .collect(),
        Some(v) => Err(ModelError::BadField {
            field,
            message: format!("expected a list of layer indices, found {v}"),
        }),
    }
}

/// A Llama-shaped dense spec for presets.
#[allow(clippy::too_many_arguments)]
pub(crate) fn dense(
    family: &'static Family,
    name: &str,
    hidden: u64,
    layers: u64,
    heads: u64,
    kv: u64,
    head_dim: u64,
    inter: u64,
    vocab: u64,
    tied: bool,
) -> ModelSpec {
    ModelSpec {
        name: name.to_string(),
        architecture: super::Architecture(family),
        hidden_size: hidden,
        num_layers: layers,
        num_heads: heads,
        num_kv_heads: kv,
        head_dim,
        intermediate_size: inter,
        vocab_size: vocab,
        tie_word_embeddings: tied,
        attention_bias: false,
        use_qk_norm: false,
        dtype: DType::Bf16,
        moe: None,
        mla: None,
        mtp_layers: 0,
        linear: None,
    }
}

/// `spec` with routed experts.
pub(crate) fn with_experts(
    spec: ModelSpec,
    experts: u64,
    per_token: u64,
    moe_inter: u64,
    dense_layers: Vec<u64>,
) -> ModelSpec {
    ModelSpec {
        moe: Some(MoeSpec {
            num_experts: experts,
            experts_per_token: per_token,
            moe_intermediate_size: moe_inter,
            decoder_sparse_step: 1,
            mlp_only_layers: dense_layers,
            shared_intermediate_size: 0,
            router_bias: false,
            router_fp32: false,
        }),
        ..spec
    }
}

/// The routed experts of a DeepSeek-style MoE preset: `(experts, per token, moe_intermediate,
/// shared experts, dense first layers)`.
pub(crate) type SharedMoeSizes = (u64, u64, u64, u64, u64);

/// [`with_experts`] for a DeepSeek-style MoE (DeepSeek-V3, GLM-4.5): `shared` shared experts of
/// `moe_intermediate` rows each, the first `first_dense` layers dense, a router bias, the
/// router in fp32 when `router_fp32`.
pub(crate) fn with_shared_experts(
    spec: ModelSpec,
    (experts, per_token, moe_inter, shared, first_dense): SharedMoeSizes,
    router_fp32: bool,
) -> ModelSpec {
    let mut spec = with_experts(
        spec,
        experts,
        per_token,
        moe_inter,
        (0..first_dense).collect(),
    );
    if let Some(m) = &mut spec.moe {
        m.shared_intermediate_size = shared * moe_inter;
        m.router_bias = true;
        m.router_fp32 = router_fp32;
    }
    spec
}

/// What a DeepSeek-style MoE family's config leaves out, per family (transformers' config
/// class defaults).
pub(crate) struct SharedMoeDefaults {
    /// `first_k_dense_replace` when absent.
    pub first_dense: u64,
    /// `n_shared_experts` when absent.
    pub shared: u64,
    /// Whether the model computes its router in fp32 ([`MoeSpec::router_fp32`]).
    pub router_fp32: bool,
}

/// Parses a DeepSeek-style MoE config (DeepSeek-V3, GLM-4.5) into `spec`: `n_routed_experts`
/// (or transformers' alias `num_local_experts`), `num_experts_per_tok`,
/// `moe_intermediate_size`, `n_shared_experts`, the dense first `first_k_dense_replace` layers
/// (layer `l` is MoE when `l >= first_k_dense_replace`), a router with its fp32
/// `e_score_correction_bias`, and the multi-token-prediction layers after the decoder layers
/// (`num_nextn_predict_layers`, recorded, not catalogued).
pub(crate) fn parse_shared_moe(
    cfg: &Value,
    spec: &mut ModelSpec,
    d: SharedMoeDefaults,
) -> Result<(), ModelError> {
    use super::spec::{opt_uint, uint};
    spec.mtp_layers = opt_uint(cfg, "num_nextn_predict_layers")?.unwrap_or(0);
    let first_dense = opt_uint(cfg, "first_k_dense_replace")?.unwrap_or(d.first_dense);
    let moe_inter = uint(cfg, "moe_intermediate_size")?;
    // `num_local_experts` is transformers' alias of `n_routed_experts` (attribute_map)
    let experts = match opt_uint(cfg, "n_routed_experts")? {
        Some(n) => n,
        None => opt_uint(cfg, "num_local_experts")?
            .ok_or(ModelError::MissingField("n_routed_experts"))?,
    };
    let shared = opt_uint(cfg, "n_shared_experts")?.unwrap_or(d.shared);
    spec.moe = Some(MoeSpec {
        num_experts: experts,
        experts_per_token: uint(cfg, "num_experts_per_tok")?,
        moe_intermediate_size: moe_inter,
        decoder_sparse_step: 1,
        mlp_only_layers: (0..first_dense.min(spec.num_layers)).collect(),
        shared_intermediate_size: shared.saturating_mul(moe_inter),
        router_bias: true,
        router_fp32: d.router_fp32,
    });
    Ok(())
}
