//! The fused tensor-parallel layout that SGLang and vLLM share: what every rank of every engine
//! holds, in the engines' own (common) parameter names. The backends (`awex-sglang`,
//! `awex-vllm`) check their engine's rules (which ep, which vocabulary padding, how a tied head
//! is held, where the fused experts live) and build a [`FusedTpLayout`] from a [`FusedTp`].
//!
//! A layout is a pure function of `(ModelSpec, FusedTp)`. [`FusedTpLayout`] answers both
//! directions lazily: [`SideLayout::rank_layout`] builds one rank's tensors, and
//! [`SideLayout::holders`] derives every shard of one canonical tensor from the sharding rules,
//! without building any rank.
//!
//! The rules (each engine's backend cites its engine's source for them):
//!
//! - `self_attn.qkv_proj`: q heads split over tp; when `tp >= num_kv_heads` every rank holds
//!   one KV head, `tp / num_kv_heads` ranks sharing it (rank `r` holds KV head
//!   `r / replicas`); rows are `[q | k | v]`; its bias likewise.
//! - `mlp.gate_up_proj`: `[gate | up]` rows of rank `r`; `o_proj` / `down_proj`: columns of
//!   rank `r`.
//! - `embed_tokens` / `lm_head`: `vocab_rows` padded rows per rank; rank `r` holds canonical rows
//!   `[r * vocab_rows, min((r + 1) * vocab_rows, vocab))` at local row 0, zero padding after.
//! - experts: `{experts_module}.w13_weight` `[local_experts, 2 * inter, hidden]` (`[gate | up]`)
//!   and `w2_weight` `[local_experts, hidden, inter]`; `inter` split over moe_tp = tp / ep; EP
//!   rank `r` (TP ranks `r * moe_tp ..`) holds consecutive experts, [`expert_range`].
//! - norms, q/k norms, the router and its score-correction bias: replicated. The bias is fp32
//!   (both engines build it so); the router weight is fp32 where the model routes in fp32
//!   ([`crate::model::MoeSpec::router_fp32`]), the model's dtype otherwise.
//! - shared experts: `mlp.shared_experts.gate_up_proj` (`[gate | up]` rows of rank `r`) and
//!   `mlp.shared_experts.down_proj` (columns of rank `r`), a dense MLP of
//!   `shared_intermediate_size` rows split over tp; or, when the engine fuses them
//!   ([`FusedTp::fused_shared_experts`]), one more expert after the routed ones in
//!   `w13_weight` / `w2_weight`, split over moe_tp like them; at ep > 1 every EP rank holds a
//!   copy as its last local expert (local index `num_experts / ep`).
//! - multi-head latent attention (MLA, DeepSeek-V2/V3): the query down projection and the
//!   key/value down projection (with the shared rotary key) are replicated, concatenated in
//!   that order as one tensor `self_attn.{FusedTp::mla_down}.weight` when the model has a query
//!   down projection (`q_lora_rank`), each under its own name otherwise; their norms
//!   replicated; the query up projection (or the plain `q_proj` without `q_lora_rank`) and
//!   the key/value up projection `kv_b_proj` split by heads over tp (column); `o_proj` split
//!   by heads over tp (row), `v_head_dim` columns per head.

use crate::DType;
use crate::layout::{
    Alike, Dims, Holder, LocalTensor, Placement, RankId, RankLayout, Region, Side, SideLayout,
};
use crate::model::family::Sink;
use crate::model::{Canon, HfNames, ModelSpec, Part, push_index};
use std::sync::Arc;

/// Which `lm_head.weight` an engine's model class holds.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LmHead {
    /// None: tied embeddings with `lm_head.weight` the same parameter as `embed_tokens.weight`,
    /// which `named_parameters()` lists once.
    Absent,
    /// A separate `lm_head.weight` holding the canonical tensor of that name.
    Own(Arc<str>),
    /// A separate `lm_head.weight` parameter holding a copy of the tied canonical tensor named
    /// here (the embedding).
    Tied(Arc<str>),
}

/// Names of one decoder layer, canonical and engine-local, built once per layout.
#[derive(Clone, Debug)]
struct LayerNames {
    input_ln: Arc<str>,
    post_ln: Arc<str>,
    q: Arc<str>,
    k: Arc<str>,
    v: Arc<str>,
    q_bias: Arc<str>,
    k_bias: Arc<str>,
    v_bias: Arc<str>,
    o: Arc<str>,
    o_bias: Arc<str>,
    /// the engine's names of `o_proj`'s bias and the sinks ([`FusedTp::local_names`])
    o_bias_local: Arc<str>,
    sinks_local: Arc<str>,
    q_norm: Arc<str>,
    k_norm: Arc<str>,
    qkv: Arc<str>,
    qkv_bias: Arc<str>,
    gate_proj: Arc<str>,
    up_proj: Arc<str>,
    down_proj: Arc<str>,
    gate_up: Arc<str>,
    router: Arc<str>,
    router_bias: Arc<str>,
    shared_gate: Arc<str>,
    shared_up: Arc<str>,
    shared_down: Arc<str>,
    shared_gate_up: Arc<str>,
    w13: Arc<str>,
    w2: Arc<str>,
    /// gpt-oss: the attention sinks, the experts fused over all experts (canonical) and the
    /// engine's expert biases (`{experts}.{FusedTp::expert_biases}`)
    sinks: Arc<str>,
    experts_gate_up: Arc<str>,
    experts_gate_up_bias: Arc<str>,
    experts_down: Arc<str>,
    experts_down_bias: Arc<str>,
    w13_bias: Arc<str>,
    w2_bias: Arc<str>,
    q_down: Arc<str>,
    q_down_norm: Arc<str>,
    q_up: Arc<str>,
    kv_down: Arc<str>,
    kv_down_norm: Arc<str>,
    kv_up: Arc<str>,
    /// the engine's fused `[q down | kv down]` tensor (MLA with `q_lora_rank`)
    mla_down: Arc<str>,
    /// the layer's attention is MLA
    mla: bool,
    /// the engine's names of a hybrid model's full-attention tensors (`qkv_proj`, `o_proj`,
    /// `q_norm`, `k_norm`; the canonical names' module replaced by [`FusedTp::hybrid_attention`])
    o_local: Arc<str>,
    q_norm_local: Arc<str>,
    k_norm_local: Arc<str>,
    /// Gated DeltaNet canonical names
    lin_qkvz: Arc<str>,
    lin_ba: Arc<str>,
    lin_qkv: Arc<str>,
    lin_z: Arc<str>,
    lin_b: Arc<str>,
    lin_a: Arc<str>,
    lin_conv: Arc<str>,
    lin_dt_bias: Arc<str>,
    lin_a_log: Arc<str>,
    lin_norm: Arc<str>,
    lin_out: Arc<str>,
    /// the engines' fused `linear_attn.in_proj_qkvz` / `linear_attn.in_proj_ba`
    lin_qkvz_local: Arc<str>,
    lin_ba_local: Arc<str>,
    /// the layer is a Gated DeltaNet layer
    linear: bool,
    shared_expert_gate: Arc<str>,
    /// `model.layers.{l}.{experts}.`, the prefix of per-expert canonical names
    experts_prefix: String,
    /// the parts the family lists for this layer ([`mask`])
    parts: u64,
    moe: bool,
}

/// The bit of a part in a layer's part set.
const fn mask(p: Part) -> u64 {
    1 << (p as u64)
}

/// The parts of one layer as a set, from the family's list.
fn layer_parts(spec: &ModelSpec, l: u64) -> u64 {
    /// Collects part bits.
    struct Bits(u64);
    impl Sink for Bits {
        fn part(&mut self, c: Canon, _: Dims) {
            self.0 |= mask(c.part);
        }
        fn experts(&mut self, _: u64, count: u64, parts: &[(Part, Dims)]) {
            if count > 0 {
                self.0 |= parts.iter().fold(0, |m, (p, _)| m | mask(*p));
            }
        }
    }
    let mut b = Bits(0);
    (spec.architecture.family().layer)(spec, l, &mut b);
    b.0
}

impl LayerNames {
    fn new(
        spec: &ModelSpec,
        l: u64,
        routed: &str,
        mla_down: &str,
        hybrid_attn: &str,
        expert_biases: [&str; 2],
        local_names: &[(&str, &str)],
    ) -> Self {
        let names = spec.names();
        let p = format!("model.layers.{l}");
        let local = |name: Arc<str>| rename(local_names, name);
        // a canonical name the family spells (empty for a part it does not have: never placed)
        let c = |part: Part| -> Arc<str> {
            Arc::from(names.name(Canon::at(part, l)).unwrap_or_default())
        };
        // the engine's fused tensor `leaf` in the module of `part`
        let fused = |part: Part, leaf: &str| -> Arc<str> {
            match names.module(part) {
                Some(m) => Arc::from(format!("{p}.{m}.{leaf}")),
                None => Arc::from(""),
            }
        };
        let experts = match routed {
            "" => format!("{p}.{}", names.experts),
            r => format!("{p}.{}.{r}", names.experts),
        };
        let parts = layer_parts(spec, l);
        let hybrid = spec.linear.is_some();
        // a hybrid model's full-attention tensor `leaf` in the engine's attention module
        let attn = |part: Part, leaf: &str| -> Arc<str> {
            match (hybrid, hybrid_attn) {
                (false, _) => c(part),
                (true, "") => Arc::from(format!("{p}.{leaf}")),
                (true, m) => Arc::from(format!("{p}.{m}.{leaf}")),
            }
        };
        let qkv = match (hybrid, hybrid_attn) {
            (false, _) => fused(Part::Q, "qkv_proj.weight"),
            (true, "") => Arc::from(format!("{p}.qkv_proj.weight")),
            (true, m) => Arc::from(format!("{p}.{m}.qkv_proj.weight")),
        };
        LayerNames {
            o_local: local(attn(Part::O, "o_proj.weight")),
            q_norm_local: attn(Part::QNorm, "q_norm.weight"),
            k_norm_local: attn(Part::KNorm, "k_norm.weight"),
            lin_qkvz: c(Part::LinQkvz),
            lin_ba: c(Part::LinBa),
            lin_qkv: c(Part::LinQkv),
            lin_z: c(Part::LinZ),
            lin_b: c(Part::LinB),
            lin_a: c(Part::LinA),
            lin_conv: c(Part::LinConv),
            lin_dt_bias: c(Part::LinDtBias),
            lin_a_log: c(Part::LinALog),
            lin_norm: c(Part::LinNorm),
            lin_out: c(Part::LinOut),
            lin_qkvz_local: Arc::from(format!("{p}.linear_attn.in_proj_qkvz.weight")),
            lin_ba_local: Arc::from(format!("{p}.linear_attn.in_proj_ba.weight")),
            linear: spec.is_linear_layer(l),
            shared_expert_gate: c(Part::SharedExpertGate),
            input_ln: c(Part::InputNorm),
            post_ln: c(Part::PostNorm),
            q: c(Part::Q),
            k: c(Part::K),
            v: c(Part::V),
            q_bias: c(Part::QBias),
            k_bias: c(Part::KBias),
            v_bias: c(Part::VBias),
            o: c(Part::O),
            o_bias: c(Part::OBias),
            o_bias_local: local(c(Part::OBias)),
            sinks_local: local(c(Part::Sinks)),
            q_norm: c(Part::QNorm),
            k_norm: c(Part::KNorm),
            qkv: local(qkv),
            qkv_bias: local(fused(Part::QBias, "qkv_proj.bias")),
            gate_proj: c(Part::Gate),
            up_proj: c(Part::Up),
            down_proj: c(Part::Down),
            gate_up: fused(Part::Gate, "gate_up_proj.weight"),
            router: c(Part::Router),
            router_bias: c(Part::RouterBias),
            shared_gate: c(Part::SharedGate),
            shared_up: c(Part::SharedUp),
            shared_down: c(Part::SharedDown),
            shared_gate_up: fused(Part::SharedGate, "gate_up_proj.weight"),
            w13: Arc::from(format!("{experts}.w13_weight")),
            w2: Arc::from(format!("{experts}.w2_weight")),
            sinks: c(Part::Sinks),
            experts_gate_up: c(Part::ExpertsGateUp),
            experts_gate_up_bias: c(Part::ExpertsGateUpBias),
            experts_down: c(Part::ExpertsDown),
            experts_down_bias: c(Part::ExpertsDownBias),
            w13_bias: Arc::from(format!("{experts}.{}", expert_biases[0])),
            w2_bias: Arc::from(format!("{experts}.{}", expert_biases[1])),
            q_down: c(Part::QDown),
            q_down_norm: c(Part::QDownNorm),
            q_up: c(Part::QUp),
            kv_down: c(Part::KvDown),
            kv_down_norm: c(Part::KvDownNorm),
            kv_up: c(Part::KvUp),
            mla_down: fused(Part::QDown, &format!("{mla_down}.weight")),
            mla: parts & mask(Part::KvDown) != 0,
            experts_prefix: format!("{p}.{}.", names.experts),
            parts,
            moe: spec.is_moe_layer(l),
        }
    }

    /// Whether the family lists `part` in this layer.
    fn has(&self, part: Part) -> bool {
        self.parts & mask(part) != 0
    }
}

/// The parts a fused-TP layout places; a family with any other part is refused by name.
pub const MAPPED: [Part; 49] = [
    Part::Embed,
    Part::LmHead,
    Part::FinalNorm,
    Part::InputNorm,
    Part::PostNorm,
    Part::Q,
    Part::K,
    Part::V,
    Part::QBias,
    Part::KBias,
    Part::VBias,
    Part::O,
    Part::OBias,
    Part::QNorm,
    Part::KNorm,
    Part::Gate,
    Part::Up,
    Part::Down,
    Part::Router,
    Part::RouterBias,
    Part::ExpertGate,
    Part::ExpertUp,
    Part::ExpertDown,
    Part::SharedGate,
    Part::SharedUp,
    Part::SharedDown,
    Part::QDown,
    Part::QDownNorm,
    Part::QUp,
    Part::KvDown,
    Part::KvDownNorm,
    Part::KvUp,
    Part::SharedExpertGate,
    Part::LinQkvz,
    Part::LinBa,
    Part::LinQkv,
    Part::LinZ,
    Part::LinB,
    Part::LinA,
    Part::LinConv,
    Part::LinALog,
    Part::LinDtBias,
    Part::LinNorm,
    Part::LinOut,
    Part::Sinks,
    Part::ExpertsGateUp,
    Part::ExpertsGateUpBias,
    Part::ExpertsDown,
    Part::ExpertsDownBias,
];

/// The three per-expert canonical tensors an engine fuses into `w13_weight` / `w2_weight`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum ExpertPart {
    Gate,
    Up,
    Down,
}

/// The sizes every rule needs, checked once.
#[derive(Clone, Debug)]
struct Dimensions {
    hidden: u64,
    head_dim: u64,
    /// query heads per TP rank
    q_heads: u64,
    /// KV heads per TP rank (1 when replicated)
    kv_heads: u64,
    /// ranks sharing one KV head (1 when tp <= KV heads)
    kv_replicas: u64,
    /// dense intermediate rows per TP rank (0 if the model has no dense layer)
    inter: u64,
    experts: u64,
    /// expert-parallel size
    ep: u64,
    /// expert intermediate rows per MoE-TP rank
    moe_inter: u64,
    moe_tp: u64,
    /// shared-expert intermediate rows per TP rank (0: no shared experts)
    shared_inter: u64,
    /// the shared experts are one more expert in `w13_weight` / `w2_weight` (after the routed)
    fused_shared: bool,
    /// the router weight's dtype
    router_dtype: DType,
    /// the router bias's dtype: fp32 (DeepSeek's score correction, which both engines build
    /// in fp32), the model's for gpt-oss (a linear layer's bias: SGLang 0.5.23 and vLLM 0.33
    /// `GptOssMoE`/`MLPBlock` build the router as `ReplicatedLinear(..., bias=True)`)
    router_bias_dtype: DType,
    /// the attention sinks' dtype (gpt-oss)
    sinks_dtype: DType,
    vocab: u64,
    /// padded vocab rows per TP rank
    vocab_rows: u64,
    /// `o_proj` input columns per TP rank
    o_cols: u64,
    /// MLA's sizes (a model with multi-head latent attention)
    mla: Option<MlaDims>,
    /// 2 when `q_proj` holds a per-head output gate after each head's query rows (hybrid
    /// Qwen models), 1 otherwise
    q_gate: u64,
    /// Gated DeltaNet sizes per TP rank (a hybrid model)
    lin: Option<LinDims>,
}

/// The sizes of Gated DeltaNet linear attention, per TP rank.
#[derive(Clone, Copy, Debug)]
struct LinDims {
    /// query (= key) rows, `key_dim / tp`
    key: u64,
    /// value (= z) rows, `value_dim / tp`
    value: u64,
    /// value heads, `value_heads / tp`
    heads: u64,
    /// canonical `key_dim` and `value_dim`
    key_full: u64,
    value_full: u64,
    /// size of one value head (the gated norm)
    head_v: u64,
    kernel: u64,
}

/// One engine tensor of a rank: its name, shape, dtype and where its pieces come from.
type Piece = (Arc<str>, Dims, DType, Vec<Placement>);

/// The sizes of multi-head latent attention.
#[derive(Clone, Copy, Debug)]
struct MlaDims {
    /// query down rank (`q_lora_rank`; `None`: a plain column-parallel `q_proj`)
    q_lora: Option<u64>,
    /// key/value down rank plus the rotary key (rows of the key/value down projection)
    kv_down: u64,
    /// key/value down rank (`kv_lora_rank`, the norm and the up projection's columns)
    kv_lora: u64,
    /// query rows per head (`qk_nope_head_dim + qk_rope_head_dim`)
    qk_head: u64,
    /// key/value up rows per head (`qk_nope_head_dim + v_head_dim`)
    kv_up_head: u64,
}

/// The fused-TP layout of inference engines (replicas) for one model and `tp`/`ep`/`engines`.
#[derive(Clone, Debug)]
pub struct FusedTpLayout {
    tp: u32,
    engines: u32,
    dtype: DType,
    num_layers: u64,
    names: &'static HfNames,
    d: Dimensions,
    /// the per-expert parts' names below `{experts}.{e}.`: gate, up, down
    expert_leaves: [&'static str; 3],
    /// the parts of the model the engine's class does not hold ([`mask`])
    dropped: u64,
    embed: Arc<str>,
    /// the engine's name of the embedding ([`FusedTp::local_names`])
    embed_local: Arc<str>,
    final_norm: Arc<str>,
    lm_head: LmHead,
    lm_head_local: Arc<str>,
    layers: Vec<LayerNames>,
}

/// Experts of EP rank `r` when `experts` are placed in consecutive blocks over `ep` ranks, the
/// first `experts % ep` ranks taking one more: `(first, count)`. With `experts % ep == 0` every
/// rank holds `experts / ep`.
pub fn expert_range(experts: u64, ep: u64, r: u64) -> (u64, u64) {
    let (base, rem) = (experts / ep, experts % ep);
    (r * base + r.min(rem), base + u64::from(r < rem))
}

/// The engine-specific inputs of a [`FusedTpLayout`], checked by the engine's backend.
#[derive(Clone, Debug)]
pub struct FusedTp {
    /// Tensor-parallel size of each engine.
    pub tp: u64,
    /// Expert-parallel size; it divides `tp` (moe_tp = tp / ep).
    pub ep: u64,
    /// Engines (replicas).
    pub engines: u64,
    /// Padded vocabulary rows each TP rank holds of `embed_tokens` / `lm_head`.
    pub vocab_rows: u64,
    /// Which `lm_head.weight` the model class holds.
    pub lm_head: LmHead,
    /// The submodule of the family's experts module (`mlp.experts`) whose parameters are
    /// `w13_weight` and `w2_weight`: empty for SGLang, `routed_experts` for vLLM.
    pub routed_experts: &'static str,
    /// Parts of the model the engine's class builds no parameter for (its loader skips them):
    /// they are not placed, and [`FusedTpLayout::dropped`] names them.
    pub drops: &'static [Part],
    /// The engine holds the shared experts as one more routed expert (index `num_experts`) of
    /// `w13_weight` / `w2_weight` instead of a `shared_experts` MLP; needs shared experts of
    /// `moe_intermediate_size` rows and the routed experts split evenly over ep. At ep > 1 every
    /// EP rank holds the whole shared expert (its MoE-TP share) as one more local expert after
    /// its `num_experts / ep` routed ones.
    pub fused_shared_experts: bool,
    /// The module below `self_attn` whose `weight` holds MLA's query and key/value down
    /// projections concatenated (`fused_qkv_a_proj_with_mqa` for SGLang, `fused_qkv_a_proj`
    /// for vLLM); unused by a model without MLA.
    pub mla_down: &'static str,
    /// The module below `model.layers.{l}` that holds a hybrid model's (Qwen3-Next, Qwen3.5)
    /// full-attention `qkv_proj`, `o_proj`, `q_norm` and `k_norm`: empty for SGLang (the
    /// decoder layer itself), `self_attn` for vLLM; unused by other models.
    pub hybrid_attention: &'static str,
    /// The names below the experts module of the biases of `w13_weight` and `w2_weight` in a
    /// model whose experts have biases (gpt-oss): `w13_weight_bias` / `w2_weight_bias` for
    /// SGLang, `w13_bias` / `w2_bias` for vLLM; unused by other models.
    pub expert_biases: [&'static str; 2],
    /// The dtype of the attention sinks (gpt-oss) when the engine does not hold them in the
    /// model's dtype (SGLang 0.5.23: bf16); `None`: the model's dtype.
    pub sinks_dtype: Option<DType>,
    /// Fragments of the engine's local names that differ from the canonical ones, replaced in
    /// the names of the embedding and the attention tensors (`qkv_proj`, `o_proj` and its bias,
    /// the sinks): vLLM 0.33's gpt-oss class names its attention module `attn` and its
    /// embedding `model.embedding` (`models/gpt_oss.py`). Empty for every other model.
    pub local_names: &'static [(&'static str, &'static str)],
}

/// `name` with every `(from, to)` fragment of `names` replaced (the first occurrence each).
fn rename(names: &[(&str, &str)], name: Arc<str>) -> Arc<str> {
    if name.is_empty() || !names.iter().any(|(f, _)| name.contains(f)) {
        return name;
    }
    let mut s = name.to_string();
    for (from, to) in names {
        s = s.replacen(from, to, 1);
    }
    Arc::from(s)
}

/// Why a [`FusedTp`] does not fit the model (the backends check first, with their own words).
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("fused-TP layout: {0}")]
pub struct FusedTpError(String);

impl FusedTpLayout {
    /// The layout of `spec` under `cfg`; builds no rank. `cfg` must split the model evenly: query
    /// heads, KV heads (or their replicas), the dense and expert intermediate sizes over tp and
    /// tp / ep, at least one expert per EP rank.
    pub fn new(spec: &ModelSpec, cfg: FusedTp) -> Result<Self, FusedTpError> {
        let FusedTp {
            tp,
            ep,
            engines,
            vocab_rows,
            lm_head,
            routed_experts,
            drops,
            fused_shared_experts,
            mla_down,
            hybrid_attention,
            expert_biases,
            sinks_dtype,
            local_names,
        } = cfg;
        let bad = |what: String| Err(FusedTpError(what));
        if tp == 0 || ep == 0 || engines == 0 || tp % ep != 0 {
            return bad(format!(
                "tp={tp}, ep={ep}, engines={engines}: sizes must be >= 1 and ep must divide tp"
            ));
        }
        if tp > u64::from(u32::MAX) || engines > u64::from(u32::MAX) {
            return bad(format!("tp={tp} or engines={engines} above u32"));
        }
        check_mapped(spec)?;
        if spec.num_heads % tp != 0 {
            return bad(format!("{} attention heads over tp={tp}", spec.num_heads));
        }
        let kv = spec.num_kv_heads;
        let (kv_heads, kv_replicas) = if spec.mla.is_some() {
            // MLA has no per-head keys and values: one latent shared by every head
            (0, 1)
        } else if tp <= kv && kv % tp == 0 {
            (kv / tp, 1)
        } else if tp > kv && kv > 0 && tp % kv == 0 {
            (1, tp / kv)
        } else {
            return bad(format!("{kv} KV heads over tp={tp}"));
        };
        let has_dense = (0..spec.num_layers).any(|l| !spec.is_moe_layer(l));
        if has_dense && spec.intermediate_size % tp != 0 {
            return bad(format!(
                "intermediate_size={} over tp={tp}",
                spec.intermediate_size
            ));
        }
        let moe_tp = tp / ep;
        let (experts, moe_inter_full) = match &spec.moe {
            Some(m) if (0..spec.num_layers).any(|l| spec.is_moe_layer(l)) => {
                if m.num_experts < ep || m.moe_intermediate_size % moe_tp != 0 {
                    return bad(format!(
                        "{} experts of moe_intermediate_size={} over ep={ep}, moe_tp={moe_tp}",
                        m.num_experts, m.moe_intermediate_size
                    ));
                }
                (m.num_experts, m.moe_intermediate_size)
            }
            _ => (0, 0),
        };
        let shared_full = spec.moe.as_ref().map_or(0, |m| m.shared_intermediate_size);
        let has_shared = spec.has(Part::SharedGate);
        let fused_shared = fused_shared_experts && has_shared;
        if fused_shared && (experts % ep != 0 || shared_full != moe_inter_full) {
            return bad(format!(
                "shared experts of {shared_full} rows fused into {experts} routed experts with ep={ep}: \
                 the fusion needs the routed experts split evenly over ep and shared experts of \
                 moe_intermediate_size={moe_inter_full} rows"
            ));
        }
        if has_shared && !fused_shared && shared_full % tp != 0 {
            return bad(format!(
                "shared experts' intermediate size {shared_full} over tp={tp}"
            ));
        }
        let lin = match &spec.linear {
            Some(a) => {
                // both engines split the linear-attention heads by key-head group over tp
                // (SGLang 0.5.23 `Qwen3GatedDeltaNet.fix_query_key_value_ordering`, vLLM 0.33
                // `QwenGatedDeltaNetAttention.fix_query_key_value_ordering`: num_k_heads // tp)
                if a.num_key_heads % tp != 0 {
                    return bad(format!(
                        "{} linear-attention key heads over tp={tp}",
                        a.num_key_heads
                    ));
                }
                Some(LinDims {
                    key: a.key_dim() / tp,
                    value: a.value_dim() / tp,
                    heads: a.num_value_heads / tp,
                    key_full: a.key_dim(),
                    value_full: a.value_dim(),
                    head_v: a.value_head_dim,
                    kernel: a.conv_kernel,
                })
            }
            None => None,
        };
        let router_dtype = match &spec.moe {
            Some(m) if m.router_fp32 => DType::F32,
            _ => spec.dtype,
        };
        if vocab_rows * tp < spec.vocab_size {
            return bad(format!(
                "{vocab_rows} vocab rows per rank over tp={tp} hold fewer than vocab_size={}",
                spec.vocab_size
            ));
        }
        Ok(FusedTpLayout {
            tp: tp as u32,
            engines: engines as u32,
            dtype: spec.dtype,
            num_layers: spec.num_layers,
            names: spec.names(),
            expert_leaves: [Part::ExpertGate, Part::ExpertUp, Part::ExpertDown].map(|p| {
                let names = spec.names();
                names
                    .expert
                    .iter()
                    .find(|(q, _)| *q == p)
                    .map_or("", |(_, n)| *n)
            }),
            dropped: drops.iter().fold(0, |m, p| m | mask(*p)),
            d: Dimensions {
                hidden: spec.hidden_size,
                head_dim: spec.head_dim,
                q_heads: spec.num_heads / tp,
                kv_heads,
                kv_replicas,
                inter: if has_dense {
                    spec.intermediate_size / tp
                } else {
                    0
                },
                experts,
                ep,
                moe_inter: moe_inter_full / moe_tp,
                moe_tp,
                shared_inter: if has_shared && !fused_shared {
                    shared_full / tp
                } else {
                    0
                },
                fused_shared,
                router_dtype,
                router_bias_dtype: if spec.has(Part::ExpertsGateUp) {
                    spec.dtype
                } else {
                    DType::F32
                },
                sinks_dtype: sinks_dtype.unwrap_or(spec.dtype),
                vocab: spec.vocab_size,
                vocab_rows,
                o_cols: match &spec.mla {
                    Some(a) => spec.num_heads / tp * a.v_head_dim,
                    None => spec.num_heads / tp * spec.head_dim,
                },
                mla: spec.mla.as_ref().map(|a| MlaDims {
                    q_lora: a.q_lora_rank,
                    kv_down: a.kv_lora_rank + a.qk_rope_head_dim,
                    kv_lora: a.kv_lora_rank,
                    qk_head: a.qk_nope_head_dim + a.qk_rope_head_dim,
                    kv_up_head: a.qk_nope_head_dim + a.v_head_dim,
                }),
                q_gate: if spec.gated_q() { 2 } else { 1 },
                lin,
            },
            embed: Arc::from("model.embed_tokens.weight"),
            embed_local: rename(local_names, Arc::from("model.embed_tokens.weight")),
            final_norm: Arc::from("model.norm.weight"),
            lm_head,
            lm_head_local: Arc::from("lm_head.weight"),
            layers: (0..spec.num_layers)
                .map(|l| {
                    LayerNames::new(
                        spec,
                        l,
                        routed_experts,
                        mla_down,
                        hybrid_attention,
                        expert_biases,
                        local_names,
                    )
                })
                .collect(),
        })
    }

    /// The canonical tensors of the model that the engine's class holds no parameter for, in
    /// catalogue order (an update moves nothing into them: the engine drops them).
    pub fn dropped(&self) -> Vec<String> {
        let mut out = Vec::new();
        for n in &self.layers {
            for (part, name) in [(Part::OBias, &n.o_bias)] {
                if n.has(part) && self.dropped & mask(part) != 0 {
                    out.push(name.to_string());
                }
            }
        }
        out
    }

    /// Tensor-parallel size of each engine.
    pub fn tp(&self) -> u32 {
        self.tp
    }

    /// Padded vocabulary rows held by each TP rank.
    pub fn vocab_rows_per_rank(&self) -> u64 {
        self.d.vocab_rows
    }

    // ---- the sharding rules, shared by both directions ----

    /// Canonical vocab rows `[start, start + len)` held by TP rank `r` (at local row 0).
    fn vocab_rows(&self, r: u64) -> (u64, u64) {
        let start = r * self.d.vocab_rows;
        let end = ((r + 1) * self.d.vocab_rows).min(self.d.vocab);
        (start, end.saturating_sub(start))
    }

    /// First KV head held by TP rank `r`.
    fn kv_head_start(&self, r: u64) -> u64 {
        if self.d.kv_replicas > 1 {
            r / self.d.kv_replicas
        } else {
            r * self.d.kv_heads
        }
    }

    /// Rows of `qkv_proj` on one rank.
    fn qkv_rows(&self) -> u64 {
        (self.d.q_gate * self.d.q_heads + 2 * self.d.kv_heads) * self.d.head_dim
    }

    /// For one of q/k/v on TP rank `r`: (canonical row start, rows, local row offset).
    fn qkv_part(&self, part: usize, r: u64) -> (u64, u64, u64) {
        let hd = self.d.head_dim;
        let q_rows = self.d.q_gate * self.d.q_heads * hd;
        let kv_rows = self.d.kv_heads * hd;
        match part {
            0 => (r * q_rows, q_rows, 0),
            1 => (self.kv_head_start(r) * hd, kv_rows, q_rows),
            _ => (self.kv_head_start(r) * hd, kv_rows, q_rows + kv_rows),
        }
    }

    fn dims2(a: u64, b: u64) -> Dims {
        Dims::new(&[a, b])
    }

    fn engine_ranks(&self, tp_rank: u64) -> Vec<RankId> {
        (0..self.engines)
            .map(|e| RankId::infer(e, tp_rank as u32))
            .collect()
    }

    fn all_ranks(&self) -> Vec<RankId> {
        let mut v = Vec::with_capacity(self.engines as usize * self.tp as usize);
        for e in 0..self.engines {
            v.extend((0..self.tp).map(|r| RankId::infer(e, r)));
        }
        v
    }

    /// Ranks (all engines) that hold the same KV head as TP rank `r`.
    fn kv_group_ranks(&self, r: u64) -> Vec<RankId> {
        let n = self.d.kv_replicas;
        let first = r / n * n;
        let mut v = Vec::with_capacity(self.engines as usize * n as usize);
        for e in 0..self.engines {
            v.extend((first..first + n).map(|t| RankId::infer(e, t as u32)));
        }
        v
    }

    // ---- rank view ----

    fn embed_tensor(&self, name: &Arc<str>, canonical: &Arc<str>, r: u64) -> LocalTensor {
        let shape = Self::dims2(self.d.vocab_rows, self.d.hidden);
        let (start, len) = self.vocab_rows(r);
        let placements = if len > 0 {
            vec![Placement {
                canonical: canonical.clone(),
                region: Region::new([start, 0], [len, self.d.hidden]),
                local_offset: Dims::zeros(2),
                transposed: false,
            }]
        } else {
            Vec::new()
        };
        self.local(name, shape, placements)
    }

    fn local(&self, name: &Arc<str>, shape: Dims, placements: Vec<Placement>) -> LocalTensor {
        LocalTensor {
            name: name.clone(),
            shape,
            dtype: self.dtype,
            encoding: crate::encoding::Encoding::Plain(self.dtype),
            placements,
        }
    }

    fn replicated(&self, name: &Arc<str>, shape: Dims) -> LocalTensor {
        self.replicated_as(name, shape, self.dtype)
    }

    /// A replicated tensor the engine names `local` holding canonical `canonical` whole.
    fn replicated_named(&self, local: &Arc<str>, canonical: &Arc<str>, shape: Dims) -> LocalTensor {
        let placements = vec![Placement {
            canonical: canonical.clone(),
            region: Region::full(shape),
            local_offset: Dims::zeros(shape.ndim()),
            transposed: false,
        }];
        self.local(local, shape, placements)
    }

    /// TP rank `r`'s Gated DeltaNet tensors of one linear-attention layer (both engines build
    /// the same ones):
    ///
    /// - `linear_attn.in_proj_qkvz` `[(2 * key_dim + 2 * value_dim) / tp, hidden]`. Qwen3-Next's
    ///   checkpoint tensor is grouped by key head, and both engines load it with one contiguous
    ///   row slice per rank (SGLang 0.5.23 `models/qwen3_next.py`,
    ///   `Qwen3GatedDeltaNet._make_packed_weight_loader`: "Do contiguous TP slice like
    ///   ColumnParallelLinear"; vLLM 0.33 `layers/mamba/gdn/qwen_gdn_linear_attn.py`,
    ///   `create_qkvz_proj`: one output size "to preserve the interleaving across TP ranks").
    ///   Qwen3.5's `in_proj_qkv` and `in_proj_z` load into the four output sizes
    ///   `[key_dim, key_dim, value_dim, value_dim]` of the same `MergedColumnParallelLinear`
    ///   (SGLang `models/qwen3_5.py` `load_weights`: `in_proj_qkv` shard `(0, 1, 2)`,
    ///   `in_proj_z` shard 3; vLLM `create_qkvz_proj` with `gqa_interleaved_layout=False`):
    ///   rank `r` holds `[q_r | k_r | v_r | z_r]`, each the `r`-th tp-th of its part.
    /// - `linear_attn.in_proj_ba` `[2 * value_heads / tp, hidden]`: Qwen3-Next's grouped tensor
    ///   sliced contiguously (output sizes `[2 * value_heads]`), Qwen3.5's `in_proj_b` and
    ///   `in_proj_a` as `[b_r | a_r]` (output sizes `[value_heads, value_heads]`).
    /// - `linear_attn.conv1d.weight` `[conv_dim / tp, 1, kernel]`: `[q_r | k_r | v_r]`, each the
    ///   `r`-th tp-th of its channels (`mamba_v2_sharded_weight_loader` with shard specs
    ///   `(key_dim, key_dim, value_dim)`, no duplicated groups, in both engines).
    /// - `dt_bias` and `A_log` (fp32) `[value_heads / tp]`: `sharded_weight_loader(0)`, the
    ///   `r`-th tp-th of the value heads.
    /// - `linear_attn.norm.weight` `[value_head_dim]`: replicated.
    /// - `linear_attn.out_proj.weight` `[hidden, value_dim / tp]`: `RowParallelLinear`.
    ///
    /// Only the pieces holding a canonical tensor that `keep` accepts are made (the holders of
    /// one canonical tensor need one piece of each rank; the rank view keeps all).
    fn linear_pieces(
        &self,
        n: &LayerNames,
        r: u64,
        keep: &dyn Fn(&Arc<str>) -> bool,
    ) -> Vec<Piece> {
        let Some(d) = self.d.lin else {
            return Vec::new();
        };
        let h = self.d.hidden;
        let dt = self.dtype;
        let pl = |c: &Arc<str>, region: Region, at: Dims| Placement {
            canonical: c.clone(),
            region,
            local_offset: at,
            transposed: false,
        };
        let rows = |c: &Arc<str>, start: u64, len: u64, at: u64| {
            pl(c, Region::new([start, 0], [len, h]), Dims::new(&[at, 0]))
        };
        let (k, v, nv, kf) = (d.key, d.value, d.heads, d.key_full);
        let mut out: Vec<Piece> = Vec::with_capacity(7);
        if n.has(Part::LinQkvz) {
            let qkvz = 2 * k + 2 * v;
            if keep(&n.lin_qkvz) {
                out.push((
                    n.lin_qkvz_local.clone(),
                    Self::dims2(qkvz, h),
                    dt,
                    vec![rows(&n.lin_qkvz, r * qkvz, qkvz, 0)],
                ));
            }
            if keep(&n.lin_ba) {
                out.push((
                    n.lin_ba_local.clone(),
                    Self::dims2(2 * nv, h),
                    dt,
                    vec![rows(&n.lin_ba, r * 2 * nv, 2 * nv, 0)],
                ));
            }
        } else {
            if keep(&n.lin_qkv) || keep(&n.lin_z) {
                out.push((
                    n.lin_qkvz_local.clone(),
                    Self::dims2(2 * k + 2 * v, h),
                    dt,
                    vec![
                        rows(&n.lin_qkv, r * k, k, 0),
                        rows(&n.lin_qkv, kf + r * k, k, k),
                        rows(&n.lin_qkv, 2 * kf + r * v, v, 2 * k),
                        rows(&n.lin_z, r * v, v, 2 * k + v),
                    ],
                ));
            }
            if keep(&n.lin_b) || keep(&n.lin_a) {
                out.push((
                    n.lin_ba_local.clone(),
                    Self::dims2(2 * nv, h),
                    dt,
                    vec![
                        rows(&n.lin_b, r * nv, nv, 0),
                        rows(&n.lin_a, r * nv, nv, nv),
                    ],
                ));
            }
        }
        let kernel = d.kernel;
        let conv = |start: u64, len: u64, at: u64| {
            pl(
                &n.lin_conv,
                Region::new([start, 0, 0], [len, 1, kernel]),
                Dims::new(&[at, 0, 0]),
            )
        };
        if keep(&n.lin_conv) {
            out.push((
                n.lin_conv.clone(),
                Dims::new(&[2 * k + v, 1, kernel]),
                dt,
                vec![
                    conv(r * k, k, 0),
                    conv(kf + r * k, k, k),
                    conv(2 * kf + r * v, v, 2 * k),
                ],
            ));
        }
        let heads = |c: &Arc<str>| pl(c, Region::new([r * nv], [nv]), Dims::zeros(1));
        if keep(&n.lin_dt_bias) {
            out.push((
                n.lin_dt_bias.clone(),
                Dims::new(&[nv]),
                dt,
                vec![heads(&n.lin_dt_bias)],
            ));
        }
        if keep(&n.lin_a_log) {
            out.push((
                n.lin_a_log.clone(),
                Dims::new(&[nv]),
                DType::F32,
                vec![heads(&n.lin_a_log)],
            ));
        }
        let norm = Dims::new(&[d.head_v]);
        if keep(&n.lin_norm) {
            out.push((
                n.lin_norm.clone(),
                norm,
                dt,
                vec![pl(&n.lin_norm, Region::full(norm), Dims::zeros(1))],
            ));
        }
        if keep(&n.lin_out) {
            out.push((
                n.lin_out.clone(),
                Self::dims2(h, v),
                dt,
                vec![pl(
                    &n.lin_out,
                    Region::new([0, r * v], [h, v]),
                    Dims::zeros(2),
                )],
            ));
        }
        let _ = d.value_full;
        out
    }

    /// Holders of a Gated DeltaNet part of layer `l`: every rank's pieces taken from it.
    fn linear_holders(&self, l: u64, canonical: &str) -> Vec<Holder> {
        let n = &self.layers[l as usize];
        let mut out = Vec::new();
        for r in 0..u64::from(self.tp) {
            let keep = |c: &Arc<str>| &**c == canonical;
            for (name, shape, dtype, placements) in self.linear_pieces(n, r, &keep) {
                for p in placements
                    .into_iter()
                    .filter(|p| &*p.canonical == canonical)
                {
                    out.push(Holder {
                        dtype,
                        ..self.holder(self.engine_ranks(r), &name, shape, p.region, p.local_offset)
                    });
                }
            }
        }
        out
    }

    fn replicated_as(&self, name: &Arc<str>, shape: Dims, dtype: DType) -> LocalTensor {
        let placements = vec![Placement {
            canonical: name.clone(),
            region: Region::full(shape),
            local_offset: Dims::zeros(shape.ndim()),
            transposed: false,
        }];
        LocalTensor {
            dtype,
            encoding: crate::encoding::Encoding::Plain(dtype),
            ..self.local(name, shape, placements)
        }
    }

    /// A `[gate | up]` tensor of `i` rows each per rank and the down projection of `i` columns
    /// per rank: TP rank `r`'s dense MLP (or shared experts).
    fn push_mlp(
        &self,
        out: &mut Vec<LocalTensor>,
        [gate_up, gate, up, down]: [&Arc<str>; 4],
        i: u64,
        r: u64,
    ) {
        let h = self.d.hidden;
        out.push(self.local(
            gate_up,
            Self::dims2(2 * i, h),
            vec![
                Placement {
                    canonical: gate.clone(),
                    region: Region::new([r * i, 0], [i, h]),
                    local_offset: Dims::zeros(2),
                    transposed: false,
                },
                Placement {
                    canonical: up.clone(),
                    region: Region::new([r * i, 0], [i, h]),
                    local_offset: Dims::new(&[i, 0]),
                    transposed: false,
                },
            ],
        ));
        out.push(self.local(
            down,
            Self::dims2(h, i),
            vec![Placement {
                canonical: down.clone(),
                region: Region::new([0, r * i], [h, i]),
                local_offset: Dims::zeros(2),
                transposed: false,
            }],
        ));
    }

    /// Where TP rank `r`'s fused qkv tensor takes its q, k and v rows from: `cols` hidden
    /// columns for the weight, `None` for the bias.
    fn qkv_placements(&self, parts: [&Arc<str>; 3], r: u64, cols: Option<u64>) -> Vec<Placement> {
        parts
            .iter()
            .enumerate()
            .map(|(i, c)| {
                let (start, len, at) = self.qkv_part(i, r);
                let (region, local_offset) = match cols {
                    Some(h) => (Region::new([start, 0], [len, h]), Dims::new(&[at, 0])),
                    None => (Region::new([start], [len]), Dims::new(&[at])),
                };
                Placement {
                    canonical: (*c).clone(),
                    region,
                    local_offset,
                    transposed: false,
                }
            })
            .collect()
    }

    /// TP rank `r`'s MLA tensors of one layer (without `o_proj`).
    fn push_mla(&self, out: &mut Vec<LocalTensor>, n: &LayerNames, a: MlaDims, r: u64) {
        let h = self.d.hidden;
        let heads = self.d.q_heads;
        // a tensor split by heads over tp: `rows` rows per rank of `cols` columns
        let column = |name: &Arc<str>, rows: u64, cols: u64| {
            self.local(
                name,
                Self::dims2(rows, cols),
                vec![Placement {
                    canonical: name.clone(),
                    region: Region::new([r * rows, 0], [rows, cols]),
                    local_offset: Dims::zeros(2),
                    transposed: false,
                }],
            )
        };
        match a.q_lora {
            Some(q_lora) => {
                out.push(self.local(
                    &n.mla_down,
                    Self::dims2(q_lora + a.kv_down, h),
                    vec![
                        Placement {
                            canonical: n.q_down.clone(),
                            region: Region::new([0, 0], [q_lora, h]),
                            local_offset: Dims::zeros(2),
                            transposed: false,
                        },
                        Placement {
                            canonical: n.kv_down.clone(),
                            region: Region::new([0, 0], [a.kv_down, h]),
                            local_offset: Dims::new(&[q_lora, 0]),
                            transposed: false,
                        },
                    ],
                ));
                out.push(self.replicated(&n.q_down_norm, Dims::new(&[q_lora])));
                out.push(column(&n.q_up, heads * a.qk_head, q_lora));
            }
            None => {
                out.push(column(&n.q, heads * a.qk_head, h));
                out.push(self.replicated(&n.kv_down, Self::dims2(a.kv_down, h)));
            }
        }
        out.push(self.replicated(&n.kv_down_norm, Dims::new(&[a.kv_lora])));
        out.push(column(&n.kv_up, heads * a.kv_up_head, a.kv_lora));
    }

    fn push_layer(&self, out: &mut Vec<LocalTensor>, n: &LayerNames, r: u64) {
        let h = self.d.hidden;
        if n.linear {
            for (name, shape, dtype, placements) in self.linear_pieces(n, r, &|_| true) {
                out.push(LocalTensor {
                    dtype,
                    encoding: crate::encoding::Encoding::Plain(dtype),
                    ..self.local(&name, shape, placements)
                });
            }
            self.push_mlp_of_layer(out, n, r);
            out.push(self.replicated(&n.input_ln, Dims::new(&[h])));
            out.push(self.replicated(&n.post_ln, Dims::new(&[h])));
            return;
        }
        match self.d.mla {
            Some(a) if n.mla => self.push_mla(out, n, a, r),
            _ => self.push_gqa(out, n, r),
        }
        let o_cols = self.d.o_cols;
        out.push(self.local(
            &n.o_local,
            Self::dims2(h, o_cols),
            vec![Placement {
                canonical: n.o.clone(),
                region: Region::new([0, r * o_cols], [h, o_cols]),
                local_offset: Dims::zeros(2),
                transposed: false,
            }],
        ));
        if self.holds(n, Part::OBias) {
            out.push(self.replicated_named(&n.o_bias_local, &n.o_bias, Dims::new(&[h])));
        }
        if self.holds(n, Part::Sinks) {
            let q = self.d.q_heads;
            out.push(LocalTensor {
                dtype: self.d.sinks_dtype,
                encoding: crate::encoding::Encoding::Plain(self.d.sinks_dtype),
                ..self.local(
                    &n.sinks_local,
                    Dims::new(&[q]),
                    vec![Placement::new(
                        n.sinks.clone(),
                        Region::new([r * q], [q]),
                        Dims::zeros(1),
                    )],
                )
            });
        }
        self.push_mlp_of_layer(out, n, r);
        out.push(self.replicated(&n.input_ln, Dims::new(&[h])));
        out.push(self.replicated(&n.post_ln, Dims::new(&[h])));
    }

    /// TP rank `r`'s grouped-query attention tensors of one layer (without `o_proj`).
    fn push_gqa(&self, out: &mut Vec<LocalTensor>, n: &LayerNames, r: u64) {
        let h = self.d.hidden;
        let hd = self.d.head_dim;
        if n.has(Part::QNorm) {
            out.push(self.replicated_named(&n.q_norm_local, &n.q_norm, Dims::new(&[hd])));
            out.push(self.replicated_named(&n.k_norm_local, &n.k_norm, Dims::new(&[hd])));
        }
        let qkv_rows = self.qkv_rows();
        let placements = self.qkv_placements([&n.q, &n.k, &n.v], r, Some(h));
        out.push(self.local(&n.qkv, Self::dims2(qkv_rows, h), placements));
        if n.has(Part::QBias) {
            let placements = self.qkv_placements([&n.q_bias, &n.k_bias, &n.v_bias], r, None);
            out.push(self.local(&n.qkv_bias, Dims::new(&[qkv_rows]), placements));
        }
    }

    /// TP rank `r`'s MLP tensors of one layer: the dense MLP or the MoE block.
    fn push_mlp_of_layer(&self, out: &mut Vec<LocalTensor>, n: &LayerNames, r: u64) {
        let h = self.d.hidden;
        if n.has(Part::ExpertsGateUp) {
            self.push_stacked_experts(out, n, r);
            return;
        }
        if n.moe {
            let mi = self.d.moe_inter;
            let (ep_rank, m) = (r / self.d.moe_tp, r % self.d.moe_tp);
            let (first, ne) = expert_range(self.d.experts, self.d.ep, ep_rank);
            let mut w13 = Vec::with_capacity(2 * ne as usize);
            let mut w2 = Vec::with_capacity(ne as usize);
            for j in 0..ne {
                let e = first + j;
                // `{prefix}{e}.{part}.weight`, appended (this runs for every expert of a rank)
                let mut at = String::with_capacity(n.experts_prefix.len() + 24);
                at.push_str(&n.experts_prefix);
                push_index(&mut at, e);
                at.push('.');
                let stem = at.len();
                let [gate, up, down] = self.expert_leaves;
                let mut name = |leaf: &str| -> Arc<str> {
                    at.push_str(leaf);
                    let name = Arc::from(at.as_str());
                    at.truncate(stem);
                    name
                };
                w13.push(Placement {
                    canonical: name(gate),
                    region: Region::new([m * mi, 0], [mi, h]),
                    local_offset: Dims::new(&[j, 0, 0]),
                    transposed: false,
                });
                w13.push(Placement {
                    canonical: name(up),
                    region: Region::new([m * mi, 0], [mi, h]),
                    local_offset: Dims::new(&[j, mi, 0]),
                    transposed: false,
                });
                w2.push(Placement {
                    canonical: name(down),
                    region: Region::new([0, m * mi], [h, mi]),
                    local_offset: Dims::new(&[j, 0, 0]),
                    transposed: false,
                });
            }
            let shared = self.d.fused_shared && n.has(Part::SharedGate);
            if shared {
                // the shared expert is local expert `ne`, after this EP rank's routed experts,
                // on every EP rank
                for (canonical, at) in [(&n.shared_gate, 0), (&n.shared_up, mi)] {
                    w13.push(Placement {
                        canonical: canonical.clone(),
                        region: Region::new([m * mi, 0], [mi, h]),
                        local_offset: Dims::new(&[ne, at, 0]),
                        transposed: false,
                    });
                }
                w2.push(Placement {
                    canonical: n.shared_down.clone(),
                    region: Region::new([0, m * mi], [h, mi]),
                    local_offset: Dims::new(&[ne, 0, 0]),
                    transposed: false,
                });
            }
            let slots = ne + u64::from(shared);
            out.push(self.local(&n.w13, Dims::new(&[slots, 2 * mi, h]), w13));
            out.push(self.local(&n.w2, Dims::new(&[slots, h, mi]), w2));
            let router_shape = Self::dims2(self.d.experts, h);
            out.push(self.replicated_as(&n.router, router_shape, self.d.router_dtype));
            if n.has(Part::RouterBias) {
                let shape = Dims::new(&[self.d.experts]);
                out.push(self.replicated_as(&n.router_bias, shape, DType::F32));
            }
            if n.has(Part::SharedExpertGate) {
                out.push(self.replicated(&n.shared_expert_gate, Self::dims2(1, h)));
            }
            if n.has(Part::SharedGate) && !shared {
                let names = [
                    &n.shared_gate_up,
                    &n.shared_gate,
                    &n.shared_up,
                    &n.shared_down,
                ];
                self.push_mlp(out, names, self.d.shared_inter, r);
            }
        } else {
            let names = [&n.gate_up, &n.gate_proj, &n.up_proj, &n.down_proj];
            self.push_mlp(out, names, self.d.inter, r);
        }
    }

    /// The boxes of gpt-oss's fused experts that TP rank `r` holds: `(local experts (first,
    /// count), MoE-TP rank)`. Both engines hold `w13_weight` `[local experts, 2 * inter /
    /// moe_tp, hidden]`, the transpose of `gate_up_proj[experts, :, chunk]` (the gate/up
    /// interleave kept), and `w2_weight` `[local experts, hidden, inter / moe_tp]`, the
    /// transpose of `down_proj[experts, chunk, :]`: SGLang 0.5.23 `models/gpt_oss.py`
    /// `_load_normal_weights` (`loaded_weight.transpose(-2, -1)`, then
    /// `FusedMoE.weight_loader_fused` narrows the `moe_tp_rank`-th chunk); vLLM 0.33
    /// `GptOssRoutedExperts._load_unquantized_expert` (narrow, then `.t()`). The biases:
    /// `gate_up_proj_bias[experts, chunk]`, and `down_proj_bias[experts]` on MoE-TP rank 0
    /// only (both engines zero it on the others: it is added once, after the reduction; awex
    /// places nothing there, so those zeros stay). `engines/tests/gpt_oss_layout.py` writes
    /// the same down from the engines' code.
    fn stacked_boxes(&self, r: u64) -> ((u64, u64), u64) {
        let (ep_rank, m) = (r / self.d.moe_tp, r % self.d.moe_tp);
        (expert_range(self.d.experts, self.d.ep, ep_rank), m)
    }

    /// TP rank `r`'s experts and router of one gpt-oss layer ([`Self::stacked_boxes`]).
    fn push_stacked_experts(&self, out: &mut Vec<LocalTensor>, n: &LayerNames, r: u64) {
        let h = self.d.hidden;
        let mi = self.d.moe_inter;
        let ((first, ne), m) = self.stacked_boxes(r);
        let c = 2 * mi;
        let router_shape = Self::dims2(self.d.experts, h);
        out.push(self.replicated_as(&n.router, router_shape, self.d.router_dtype));
        let shape = Dims::new(&[self.d.experts]);
        out.push(self.replicated_as(&n.router_bias, shape, self.d.router_bias_dtype));
        let transposed = |canonical: &Arc<str>, region: Region| Placement {
            transposed: true,
            ..Placement::new(canonical.clone(), region, Dims::zeros(3))
        };
        out.push(self.local(
            &n.w13,
            Dims::new(&[ne, c, h]),
            vec![transposed(
                &n.experts_gate_up,
                Region::new([first, 0, m * c], [ne, h, c]),
            )],
        ));
        out.push(self.local(
            &n.w13_bias,
            Self::dims2(ne, c),
            vec![Placement::new(
                n.experts_gate_up_bias.clone(),
                Region::new([first, m * c], [ne, c]),
                Dims::zeros(2),
            )],
        ));
        out.push(self.local(
            &n.w2,
            Dims::new(&[ne, h, mi]),
            vec![transposed(
                &n.experts_down,
                Region::new([first, m * mi, 0], [ne, mi, h]),
            )],
        ));
        let w2_bias = if m == 0 {
            vec![Placement::new(
                n.experts_down_bias.clone(),
                Region::new([first, 0], [ne, h]),
                Dims::zeros(2),
            )]
        } else {
            Vec::new()
        };
        out.push(self.local(&n.w2_bias, Self::dims2(ne, h), w2_bias));
    }

    /// Every holder of one of gpt-oss's fused expert tensors of layer `l`.
    fn stacked_holders(&self, l: u64, part: Part) -> Vec<Holder> {
        let n = &self.layers[l as usize];
        let (h, mi) = (self.d.hidden, self.d.moe_inter);
        let c = 2 * mi;
        let mut out = Vec::with_capacity(self.tp as usize);
        for r in 0..u64::from(self.tp) {
            let ((first, ne), m) = self.stacked_boxes(r);
            let ranks = self.engine_ranks(r);
            let holder = match part {
                Part::ExpertsGateUp => Holder {
                    transposed: true,
                    ..self.holder(
                        ranks,
                        &n.w13,
                        Dims::new(&[ne, c, h]),
                        Region::new([first, 0, m * c], [ne, h, c]),
                        Dims::zeros(3),
                    )
                },
                Part::ExpertsGateUpBias => self.holder(
                    ranks,
                    &n.w13_bias,
                    Self::dims2(ne, c),
                    Region::new([first, m * c], [ne, c]),
                    Dims::zeros(2),
                ),
                Part::ExpertsDown => Holder {
                    transposed: true,
                    ..self.holder(
                        ranks,
                        &n.w2,
                        Dims::new(&[ne, h, mi]),
                        Region::new([first, m * mi, 0], [ne, mi, h]),
                        Dims::zeros(3),
                    )
                },
                Part::ExpertsDownBias if m == 0 => self.holder(
                    ranks,
                    &n.w2_bias,
                    Self::dims2(ne, h),
                    Region::new([first, 0], [ne, h]),
                    Dims::zeros(2),
                ),
                _ => continue,
            };
            out.push(holder);
        }
        out
    }

    // ---- canonical view ----

    /// Whether the engine holds `part` of layer `n` (the family lists it, the class keeps it).
    fn holds(&self, n: &LayerNames, part: Part) -> bool {
        n.has(part) && self.dropped & mask(part) == 0
    }

    /// The canonical tensor `name` denotes when this model has it and the engine holds it,
    /// parsed without the catalogue.
    fn parse(&self, name: &str) -> Option<Canon> {
        let c = self.names.parse(name)?;
        let has = match (c.layer(), c.expert()) {
            (None, _) => true,
            (Some(l), _) if l >= self.num_layers => false,
            (Some(l), None) => self.holds(&self.layers[l as usize], c.part),
            (Some(l), Some(e)) => {
                self.holds(&self.layers[l as usize], c.part) && e < self.d.experts
            }
        };
        has.then_some(c)
    }

    fn holder(
        &self,
        ranks: Vec<RankId>,
        tensor: &Arc<str>,
        tensor_shape: Dims,
        region: Region,
        local_offset: Dims,
    ) -> Holder {
        Holder {
            ranks,
            tensor: tensor.clone(),
            tensor_shape,
            dtype: self.dtype,
            region,
            local_offset,
            transposed: false,
        }
    }

    fn replicated_holder(&self, name: &Arc<str>, shape: Dims) -> Vec<Holder> {
        self.replicated_holder_as(name, shape, self.dtype)
    }

    fn replicated_holder_as(&self, name: &Arc<str>, shape: Dims, dtype: DType) -> Vec<Holder> {
        vec![Holder {
            dtype,
            ..self.holder(
                self.all_ranks(),
                name,
                shape,
                Region::full(shape),
                Dims::zeros(shape.ndim()),
            )
        }]
    }

    fn vocab_holders(&self, local: &Arc<str>, out: &mut Vec<Holder>) {
        let shape = Self::dims2(self.d.vocab_rows, self.d.hidden);
        for r in 0..u64::from(self.tp) {
            let (start, len) = self.vocab_rows(r);
            if len == 0 {
                continue;
            }
            out.push(self.holder(
                self.engine_ranks(r),
                local,
                shape,
                Region::new([start, 0], [len, self.d.hidden]),
                Dims::zeros(2),
            ));
        }
    }

    fn qkv_holders(&self, l: u64, part: usize, bias: bool) -> Vec<Holder> {
        let n = &self.layers[l as usize];
        let h = self.d.hidden;
        let rows = self.qkv_rows();
        let (tensor, shape) = if bias {
            (&n.qkv_bias, Dims::new(&[rows]))
        } else {
            (&n.qkv, Self::dims2(rows, h))
        };
        let replicated_kv = part > 0 && self.d.kv_replicas > 1;
        let step = if replicated_kv { self.d.kv_replicas } else { 1 };
        (0..u64::from(self.tp))
            .step_by(step as usize)
            .map(|r| {
                let (start, len, at) = self.qkv_part(part, r);
                let ranks = if replicated_kv {
                    self.kv_group_ranks(r)
                } else {
                    self.engine_ranks(r)
                };
                let (region, offset) = if bias {
                    (Region::new([start], [len]), Dims::new(&[at]))
                } else {
                    (Region::new([start, 0], [len, h]), Dims::new(&[at, 0]))
                };
                self.holder(ranks, tensor, shape, region, offset)
            })
            .collect()
    }

    /// Holders of a tensor split on `dim` over TP into `per`-sized blocks, all at local offset 0 (o_proj, down_proj).
    fn split_holders(&self, tensor: &Arc<str>, shape: Dims, dim: usize, per: u64) -> Vec<Holder> {
        (0..u64::from(self.tp))
            .map(|r| {
                let region = Region::slice(
                    shape_full(shape, dim, per * u64::from(self.tp)),
                    dim,
                    r * per,
                    per,
                );
                self.holder(
                    self.engine_ranks(r),
                    tensor,
                    shape,
                    region,
                    Dims::zeros(shape.ndim()),
                )
            })
            .collect()
    }

    /// Holders of the gate (or up) projection in a `[gate | up]` tensor of `i` rows each per
    /// rank (the dense MLP's or the shared experts').
    fn gate_up_holders(&self, gate_up: &Arc<str>, i: u64, up: bool) -> Vec<Holder> {
        let h = self.d.hidden;
        let shape = Self::dims2(2 * i, h);
        let at = if up { i } else { 0 };
        (0..u64::from(self.tp))
            .map(|r| {
                self.holder(
                    self.engine_ranks(r),
                    gate_up,
                    shape,
                    Region::new([r * i, 0], [i, h]),
                    Dims::new(&[at, 0]),
                )
            })
            .collect()
    }

    /// Holders of one of MLA's parts of layer `l` (the query projection of a layer without
    /// `q_lora_rank` included).
    fn mla_holders(&self, l: u64, part: Part) -> Vec<Holder> {
        let n = &self.layers[l as usize];
        let Some(a) = self.d.mla else {
            return Vec::new();
        };
        let h = self.d.hidden;
        let heads = self.d.q_heads;
        // the fused down projection, whole on every rank: the query part at row 0, the
        // key/value part after it
        let fused_down = |q_lora: u64, rows: u64, at: u64| {
            vec![self.holder(
                self.all_ranks(),
                &n.mla_down,
                Self::dims2(q_lora + a.kv_down, h),
                Region::new([0, 0], [rows, h]),
                Dims::new(&[at, 0]),
            )]
        };
        match (part, a.q_lora) {
            (Part::QDown, Some(q_lora)) => fused_down(q_lora, q_lora, 0),
            (Part::KvDown, Some(q_lora)) => fused_down(q_lora, a.kv_down, q_lora),
            (Part::KvDown, None) => self.replicated_holder(&n.kv_down, Self::dims2(a.kv_down, h)),
            (Part::QDownNorm, Some(q_lora)) => {
                self.replicated_holder(&n.q_down_norm, Dims::new(&[q_lora]))
            }
            (Part::KvDownNorm, _) => {
                self.replicated_holder(&n.kv_down_norm, Dims::new(&[a.kv_lora]))
            }
            (Part::QUp, Some(q_lora)) => {
                let rows = heads * a.qk_head;
                self.split_holders(&n.q_up, Self::dims2(rows, q_lora), 0, rows)
            }
            (Part::Q, None) => {
                let rows = heads * a.qk_head;
                self.split_holders(&n.q, Self::dims2(rows, h), 0, rows)
            }
            (Part::KvUp, _) => {
                let rows = heads * a.kv_up_head;
                self.split_holders(&n.kv_up, Self::dims2(rows, a.kv_lora), 0, rows)
            }
            _ => Vec::new(),
        }
    }

    /// Holders of a shared expert's part fused as local expert `experts / ep` (after the EP
    /// rank's routed experts) of every TP rank: MoE-TP share `m` on TP ranks `ep_rank * moe_tp +
    /// m` of every EP rank and engine (the experts split evenly over ep, checked in `new`).
    fn fused_shared_holders(&self, l: u64, part: ExpertPart) -> Vec<Holder> {
        let n = &self.layers[l as usize];
        let j = self.d.experts / self.d.ep;
        let (mi, h, slots) = (self.d.moe_inter, self.d.hidden, j + 1);
        let ranks = |m: u64| -> Vec<RankId> {
            let mut v = Vec::with_capacity((u64::from(self.engines) * self.d.ep) as usize);
            for e in 0..self.engines {
                v.extend((0..self.d.ep).map(|p| RankId::infer(e, (p * self.d.moe_tp + m) as u32)));
            }
            v
        };
        (0..self.d.moe_tp)
            .map(|m| match part {
                ExpertPart::Gate | ExpertPart::Up => self.holder(
                    ranks(m),
                    &n.w13,
                    Dims::new(&[slots, 2 * mi, h]),
                    Region::new([m * mi, 0], [mi, h]),
                    Dims::new(&[j, if part == ExpertPart::Up { mi } else { 0 }, 0]),
                ),
                ExpertPart::Down => self.holder(
                    ranks(m),
                    &n.w2,
                    Dims::new(&[slots, h, mi]),
                    Region::new([0, m * mi], [h, mi]),
                    Dims::new(&[j, 0, 0]),
                ),
            })
            .collect()
    }

    fn expert_holders(&self, l: u64, e: u64, part: ExpertPart) -> Vec<Holder> {
        let n = &self.layers[l as usize];
        let (mi, h) = (self.d.moe_inter, self.d.hidden);
        let (base, rem) = (self.d.experts / self.d.ep, self.d.experts % self.d.ep);
        let big = (base + 1) * rem;
        let ep_rank = if e < big {
            e / (base + 1)
        } else {
            rem + (e - big) / base
        };
        let (first, ne) = expert_range(self.d.experts, self.d.ep, ep_rank);
        let j = e - first;
        // the fused shared expert after the routed ones
        let ne = ne + u64::from(self.d.fused_shared && n.has(Part::SharedGate));
        (0..self.d.moe_tp)
            .map(|m| {
                let tp_rank = ep_rank * self.d.moe_tp + m;
                let ranks = self.engine_ranks(tp_rank);
                match part {
                    ExpertPart::Gate | ExpertPart::Up => self.holder(
                        ranks,
                        &n.w13,
                        Dims::new(&[ne, 2 * mi, h]),
                        Region::new([m * mi, 0], [mi, h]),
                        Dims::new(&[j, if part == ExpertPart::Up { mi } else { 0 }, 0]),
                    ),
                    ExpertPart::Down => self.holder(
                        ranks,
                        &n.w2,
                        Dims::new(&[ne, h, mi]),
                        Region::new([0, m * mi], [h, mi]),
                        Dims::new(&[j, 0, 0]),
                    ),
                }
            })
            .collect()
    }
}

/// `shape` with dimension `dim` replaced by `full` (the canonical extent of a TP-split dim).
fn shape_full(shape: Dims, dim: usize, full: u64) -> Dims {
    let mut s = shape;
    s.set(dim, full);
    s
}

impl SideLayout for FusedTpLayout {
    fn side(&self) -> Side {
        Side::Inference
    }

    fn ranks(&self) -> Vec<RankId> {
        self.all_ranks()
    }

    fn world_size(&self) -> usize {
        self.engines as usize * self.tp as usize
    }

    fn engines(&self) -> u32 {
        self.engines
    }

    fn rank_layout(&self, rank: RankId) -> Option<RankLayout> {
        if rank.engine >= self.engines || rank.rank >= self.tp {
            return None;
        }
        let r = u64::from(rank.rank);
        let per_layer = 10;
        let mut tensors = Vec::with_capacity(3 + self.layers.len() * per_layer);
        tensors.push(self.embed_tensor(&self.embed_local, &self.embed, r));
        for n in &self.layers {
            self.push_layer(&mut tensors, n, r);
        }
        tensors.push(self.replicated(&self.final_norm, Dims::new(&[self.d.hidden])));
        match &self.lm_head {
            LmHead::Absent => {}
            LmHead::Own(c) | LmHead::Tied(c) => {
                tensors.push(self.embed_tensor(&self.lm_head_local, c, r))
            }
        }
        Some(RankLayout { rank, tensors })
    }

    fn for_each_canonical(&self, rank: RankId, f: &mut dyn FnMut(&str)) -> bool {
        if rank.engine >= self.engines || rank.rank >= self.tp {
            return false;
        }
        // the names `rank_layout` places, in catalogue order, without building the tensors
        let r = u64::from(rank.rank);
        let has_vocab = self.vocab_rows(r).1 > 0;
        if has_vocab {
            f(&self.embed);
        }
        let mut name = String::new();
        for n in &self.layers {
            f(&n.input_ln);
            if n.linear {
                for (_, _, _, placements) in self.linear_pieces(n, r, &|_| true) {
                    for p in placements {
                        f(&p.canonical);
                    }
                }
            } else if n.mla {
                if n.has(Part::QDown) {
                    f(&n.q_down);
                    f(&n.q_down_norm);
                    f(&n.q_up);
                } else {
                    f(&n.q);
                }
                f(&n.kv_down);
                f(&n.kv_down_norm);
                f(&n.kv_up);
            } else {
                f(&n.q);
                f(&n.k);
                f(&n.v);
            }
            if n.has(Part::QBias) {
                f(&n.q_bias);
                f(&n.k_bias);
                f(&n.v_bias);
            }
            if !n.linear {
                f(&n.o);
            }
            if self.holds(n, Part::OBias) {
                f(&n.o_bias);
            }
            if self.holds(n, Part::Sinks) {
                f(&n.sinks);
            }
            if n.has(Part::QNorm) && !n.linear {
                f(&n.q_norm);
                f(&n.k_norm);
            }
            f(&n.post_ln);
            if n.moe {
                f(&n.router);
                if n.has(Part::RouterBias) {
                    f(&n.router_bias);
                }
                if n.has(Part::ExpertsGateUp) {
                    f(&n.experts_gate_up);
                    f(&n.experts_gate_up_bias);
                    f(&n.experts_down);
                    if self.stacked_boxes(r).1 == 0 {
                        f(&n.experts_down_bias);
                    }
                }
                if n.has(Part::SharedGate) {
                    f(&n.shared_gate);
                    f(&n.shared_up);
                    f(&n.shared_down);
                }
                if n.has(Part::SharedExpertGate) {
                    f(&n.shared_expert_gate);
                }
                let (first, ne) = expert_range(self.d.experts, self.d.ep, r / self.d.moe_tp);
                for e in first..first + ne {
                    name.clear();
                    name.push_str(&n.experts_prefix);
                    push_index(&mut name, e);
                    name.push('.');
                    let stem = name.len();
                    for (_, leaf) in self.names.expert {
                        name.truncate(stem);
                        name.push_str(leaf);
                        f(&name);
                    }
                }
            } else {
                f(&n.gate_proj);
                f(&n.up_proj);
                f(&n.down_proj);
            }
        }
        f(&self.final_norm);
        match &self.lm_head {
            LmHead::Own(c) | LmHead::Tied(c) if has_vocab => f(c),
            _ => {}
        }
        true
    }

    /// A layer's tensor of one local tensor (norms, attention and MLP projections, router,
    /// experts, Gated DeltaNet): its part, expert and the layer's kind (its part set and flags),
    /// which is what [`Self::holders`] reads of a layer besides its names. The tensors outside
    /// the layers (single ones), MLA's and the experts fused over all experts (gpt-oss) answer
    /// `None`.
    fn alike(&self, canonical: &str) -> Option<Alike> {
        let c = self.parse(canonical)?;
        let l = c.layer()?;
        let n = self.layers.get(l as usize)?;
        let tensor = match c.part {
            Part::InputNorm => &n.input_ln,
            Part::PostNorm => &n.post_ln,
            Part::QNorm => &n.q_norm_local,
            Part::KNorm => &n.k_norm_local,
            Part::SharedExpertGate => &n.shared_expert_gate,
            Part::LinNorm if self.d.lin.is_some() => &n.lin_norm,
            Part::LinQkvz | Part::LinQkv | Part::LinZ if self.d.lin.is_some() => &n.lin_qkvz_local,
            Part::LinBa | Part::LinB | Part::LinA if self.d.lin.is_some() => &n.lin_ba_local,
            Part::LinConv if self.d.lin.is_some() => &n.lin_conv,
            Part::LinDtBias if self.d.lin.is_some() => &n.lin_dt_bias,
            Part::LinALog if self.d.lin.is_some() => &n.lin_a_log,
            Part::LinOut if self.d.lin.is_some() => &n.lin_out,
            Part::OBias => &n.o_bias_local,
            Part::Sinks => &n.sinks_local,
            Part::Router => &n.router,
            Part::RouterBias => &n.router_bias,
            Part::Q | Part::K | Part::V if !n.mla => &n.qkv,
            Part::QBias | Part::KBias | Part::VBias => &n.qkv_bias,
            Part::O => &n.o_local,
            Part::Gate | Part::Up => &n.gate_up,
            Part::SharedGate | Part::SharedUp if !self.d.fused_shared => &n.shared_gate_up,
            Part::SharedDown if !self.d.fused_shared => &n.shared_down,
            Part::SharedGate | Part::SharedUp => &n.w13,
            Part::SharedDown => &n.w2,
            Part::Down => &n.down_proj,
            Part::ExpertGate | Part::ExpertUp => &n.w13,
            Part::ExpertDown => &n.w2,
            _ => return None,
        };
        let flags = u64::from(n.mla) | u64::from(n.linear) << 1 | u64::from(n.moe) << 2;
        let e = c.expert().unwrap_or(0);
        Some(Alike {
            key: [c.part as u64, e, n.parts, flags, 0, 0, 0, 0],
            tensor: tensor.clone(),
        })
    }

    fn holders(&self, canonical: &str) -> Vec<Holder> {
        let Some(c) = self.parse(canonical) else {
            return Vec::new();
        };
        let h = self.d.hidden;
        let hd = self.d.head_dim;
        let layer = |l: u64| &self.layers[l as usize];
        let (l, e) = (c.layer().unwrap_or(0), c.expert().unwrap_or(0));
        match c.part {
            Part::Embed => {
                let mut out = Vec::with_capacity(2 * self.tp as usize);
                self.vocab_holders(&self.embed_local, &mut out);
                if let LmHead::Tied(_) = self.lm_head {
                    self.vocab_holders(&self.lm_head_local, &mut out);
                }
                out
            }
            Part::LmHead => {
                let mut out = Vec::with_capacity(self.tp as usize);
                if let LmHead::Own(_) = self.lm_head {
                    self.vocab_holders(&self.lm_head_local, &mut out);
                }
                out
            }
            Part::FinalNorm => self.replicated_holder(&self.final_norm, Dims::new(&[h])),
            Part::InputNorm => self.replicated_holder(&layer(l).input_ln, Dims::new(&[h])),
            Part::PostNorm => self.replicated_holder(&layer(l).post_ln, Dims::new(&[h])),
            Part::QNorm => self.replicated_holder(&layer(l).q_norm_local, Dims::new(&[hd])),
            Part::KNorm => self.replicated_holder(&layer(l).k_norm_local, Dims::new(&[hd])),
            Part::SharedExpertGate => {
                self.replicated_holder(&layer(l).shared_expert_gate, Self::dims2(1, h))
            }
            Part::LinNorm => match self.d.lin {
                Some(d) => self.replicated_holder(&layer(l).lin_norm, Dims::new(&[d.head_v])),
                None => Vec::new(),
            },
            Part::LinQkvz
            | Part::LinBa
            | Part::LinQkv
            | Part::LinZ
            | Part::LinB
            | Part::LinA
            | Part::LinConv
            | Part::LinALog
            | Part::LinDtBias
            | Part::LinOut => self.linear_holders(l, canonical),
            Part::OBias => self.replicated_holder(&layer(l).o_bias_local, Dims::new(&[h])),
            Part::Sinks => {
                let q = self.d.q_heads;
                (0..u64::from(self.tp))
                    .map(|r| Holder {
                        dtype: self.d.sinks_dtype,
                        ..self.holder(
                            self.engine_ranks(r),
                            &layer(l).sinks_local,
                            Dims::new(&[q]),
                            Region::new([r * q], [q]),
                            Dims::zeros(1),
                        )
                    })
                    .collect()
            }
            Part::ExpertsGateUp
            | Part::ExpertsGateUpBias
            | Part::ExpertsDown
            | Part::ExpertsDownBias => self.stacked_holders(l, c.part),
            Part::Router => {
                let shape = Self::dims2(self.d.experts, h);
                self.replicated_holder_as(&layer(l).router, shape, self.d.router_dtype)
            }
            Part::RouterBias => {
                let shape = Dims::new(&[self.d.experts]);
                self.replicated_holder_as(&layer(l).router_bias, shape, self.d.router_bias_dtype)
            }
            Part::Q if layer(l).mla => self.mla_holders(l, c.part),
            Part::QDown
            | Part::QDownNorm
            | Part::QUp
            | Part::KvDown
            | Part::KvDownNorm
            | Part::KvUp => self.mla_holders(l, c.part),
            Part::Q => self.qkv_holders(l, 0, false),
            Part::K => self.qkv_holders(l, 1, false),
            Part::V => self.qkv_holders(l, 2, false),
            Part::QBias => self.qkv_holders(l, 0, true),
            Part::KBias => self.qkv_holders(l, 1, true),
            Part::VBias => self.qkv_holders(l, 2, true),
            Part::O => {
                let o_cols = self.d.o_cols;
                self.split_holders(&layer(l).o_local, Self::dims2(h, o_cols), 1, o_cols)
            }
            Part::Gate => self.gate_up_holders(&layer(l).gate_up, self.d.inter, false),
            Part::Up => self.gate_up_holders(&layer(l).gate_up, self.d.inter, true),
            Part::SharedGate | Part::SharedUp | Part::SharedDown if self.d.fused_shared => {
                let part = match c.part {
                    Part::SharedGate => ExpertPart::Gate,
                    Part::SharedUp => ExpertPart::Up,
                    _ => ExpertPart::Down,
                };
                self.fused_shared_holders(l, part)
            }
            Part::SharedGate => {
                self.gate_up_holders(&layer(l).shared_gate_up, self.d.shared_inter, false)
            }
            Part::SharedUp => {
                self.gate_up_holders(&layer(l).shared_gate_up, self.d.shared_inter, true)
            }
            Part::SharedDown => {
                let i = self.d.shared_inter;
                self.split_holders(&layer(l).shared_down, Self::dims2(h, i), 1, i)
            }
            Part::Down => {
                let i = self.d.inter;
                self.split_holders(&layer(l).down_proj, Self::dims2(h, i), 1, i)
            }
            Part::ExpertGate => self.expert_holders(l, e, ExpertPart::Gate),
            Part::ExpertUp => self.expert_holders(l, e, ExpertPart::Up),
            Part::ExpertDown => self.expert_holders(l, e, ExpertPart::Down),
        }
    }
}

/// Refuses a model with a part the fused-TP layout does not place ([`MAPPED`]), naming it.
pub fn check_mapped(spec: &ModelSpec) -> Result<(), FusedTpError> {
    match spec.parts().into_iter().find(|p| !MAPPED.contains(p)) {
        Some(p) => Err(FusedTpError(unmapped(spec, p))),
        None => Ok(()),
    }
}

/// Why an engine whose layout of a model with experts fused over all experts (gpt-oss) awex
/// does not build yet refuses it (`None` for any other model): `engine` names the engine and
/// `missing` what its layout would still need.
pub fn stacked_experts_refusal(spec: &ModelSpec, engine: &str, missing: &str) -> Option<String> {
    if !spec.has(Part::ExpertsGateUp) {
        return None;
    }
    let family = spec.architecture.family();
    Some(format!(
        "{} ({}) on {engine}: {missing} (docs/models.md, gpt-oss)",
        family.hf_class, family.name
    ))
}

/// Why a family with `part` has no fused-TP layout yet.
fn unmapped(spec: &ModelSpec, part: Part) -> String {
    let family = spec.architecture.family();
    let example = (0..spec.num_layers)
        .find_map(|l| family.names.name(Canon::at(part, l)))
        .unwrap_or_else(|| part.label().to_string());
    format!(
        "{} ({}) has `{example}` ({}), which awex does not map to the engine's tensors yet",
        family.hf_class,
        family.name,
        part.label()
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(tp: u64, ep: u64, vocab_rows: u64) -> FusedTp {
        FusedTp {
            tp,
            ep,
            engines: 1,
            vocab_rows,
            lm_head: LmHead::Absent,
            routed_experts: "",
            drops: &[],
            fused_shared_experts: false,
            mla_down: "fused_qkv_a_proj_with_mqa",
            hybrid_attention: "",
            expert_biases: ["w13_weight_bias", "w2_weight_bias"],
            sinks_dtype: None,
            local_names: &[],
        }
    }

    #[test]
    fn for_each_canonical_names_what_rank_layout_places() {
        let mut specs = Vec::new();
        for name in [
            "qwen3-tiny",
            "moe-1t",
            "deepseek-v3-tiny",
            "qwen3-next-tiny",
            "qwen3.5-tiny",
            "qwen3.5-moe-tiny",
        ] {
            specs.push(ModelSpec::resolve(name).unwrap());
        }
        let mut biased = ModelSpec::resolve("qwen3-tiny").unwrap();
        biased.attention_bias = true;
        specs.push(biased);
        // MLA without q_lora_rank: a plain column-parallel q_proj, kv_a_proj_with_mqa apart
        let mut no_q_lora = ModelSpec::resolve("deepseek-v3-tiny").unwrap();
        no_q_lora.mla.as_mut().unwrap().q_lora_rank = None;
        specs.push(no_q_lora);
        let mut checked = 0;
        for spec in &specs {
            for (tp, ep, lm_head) in [
                (2u64, 1u64, LmHead::Absent),
                (4, 2, LmHead::Own(Arc::from("lm_head.weight"))),
                (16, 16, LmHead::Tied(Arc::from("model.embed_tokens.weight"))),
            ] {
                let kv = spec.num_kv_heads;
                if spec.num_heads % tp != 0 || !(kv % tp == 0 || tp % kv == 0) {
                    continue;
                }
                let rows = spec.vocab_size.div_ceil(tp).div_ceil(64) * 64;
                let c = FusedTp {
                    engines: 2,
                    lm_head,
                    ..cfg(tp, ep, rows)
                };
                let Ok(layout) = FusedTpLayout::new(spec, c) else {
                    continue;
                };
                for rank in layout.ranks() {
                    let mut want: Vec<String> = Vec::new();
                    for t in layout.rank_layout(rank).unwrap().tensors {
                        want.extend(t.placements.iter().map(|p| p.canonical.to_string()));
                    }
                    let mut got: Vec<String> = Vec::new();
                    assert!(layout.for_each_canonical(rank, &mut |n| got.push(n.to_string())));
                    want.sort();
                    got.sort();
                    assert_eq!(got, want, "{} tp={tp} ep={ep} rank {rank}", spec.name);
                }
                assert!(!layout.for_each_canonical(RankId::infer(2, 0), &mut |_| {}));
                checked += 1;
            }
        }
        assert!(checked >= 6, "only {checked} layouts checked");
    }

    #[test]
    fn experts_go_in_consecutive_blocks_the_first_ranks_taking_one_more() {
        assert_eq!(
            (0..3).map(|r| expert_range(8, 3, r)).collect::<Vec<_>>(),
            vec![(0, 3), (3, 3), (6, 2)]
        );
        assert_eq!(
            (0..4).map(|r| expert_range(8, 4, r)).collect::<Vec<_>>(),
            vec![(0, 2), (2, 2), (4, 2), (6, 2)]
        );
    }

    #[test]
    fn sizes_that_do_not_split_the_model_are_refused_by_name() {
        let spec = ModelSpec::resolve("qwen3-tiny").unwrap();
        let rows = spec.vocab_size.div_ceil(2);
        assert!(FusedTpLayout::new(&spec, cfg(2, 1, rows)).is_ok());
        let e = FusedTpLayout::new(&spec, cfg(2, 3, rows)).unwrap_err();
        assert_eq!(
            e.to_string(),
            "fused-TP layout: tp=2, ep=3, engines=1: sizes must be >= 1 and ep must divide tp"
        );
        let e = FusedTpLayout::new(&spec, cfg(2, 1, rows - 1)).unwrap_err();
        assert!(e.to_string().contains("hold fewer than vocab_size"), "{e}");
        let e = FusedTpLayout::new(&spec, cfg(spec.num_heads * 2, 1, spec.vocab_size)).unwrap_err();
        assert!(e.to_string().contains("attention heads over tp="), "{e}");
    }

    #[test]
    fn a_tied_head_is_a_second_holder_of_the_embedding() {
        let spec = ModelSpec::resolve("qwen3-tiny").unwrap();
        let rows = spec.vocab_size.div_ceil(2);
        let mut c = cfg(2, 1, rows);
        let absent = FusedTpLayout::new(&spec, c.clone()).unwrap();
        c.lm_head = LmHead::Tied(Arc::from("model.embed_tokens.weight"));
        let tied = FusedTpLayout::new(&spec, c).unwrap();
        let embed = "model.embed_tokens.weight";
        assert_eq!(absent.holders(embed).len(), 2);
        let h = tied.holders(embed);
        assert_eq!(h.len(), 4);
        assert_eq!(&*h[2].tensor, "lm_head.weight");
        assert_eq!(h[2].region, h[0].region);
        let r0 = tied.rank_layout(RankId::infer(0, 0)).unwrap();
        assert_eq!(&*r0.tensors.last().unwrap().name, "lm_head.weight");
    }

    /// A hybrid model's rank `r` at `tp`: every whole-side check (holders agree with the rank
    /// view, full coverage per engine, materialize -> reconstruct gives back every canonical
    /// byte) for the tiny hybrid presets at tp 1, 2, 4 (one key-head group per rank at 4) and
    /// ep 2, with SGLang's and vLLM's attention modules.
    #[test]
    fn hybrid_models_pass_every_whole_side_check() {
        let mut checked = 0;
        for name in ["qwen3-next-tiny", "qwen3.5-tiny", "qwen3.5-moe-tiny"] {
            let spec = ModelSpec::resolve(name).unwrap();
            let cat = crate::model::Catalogue::of(&spec);
            for (tp, ep) in [(1u64, 1u64), (2, 1), (4, 1), (2, 2), (4, 2)] {
                if ep > 1 && spec.moe.is_none() {
                    continue;
                }
                for attn in ["", "self_attn"] {
                    let rows = spec.vocab_size.div_ceil(tp).div_ceil(64) * 64;
                    let c = FusedTp {
                        engines: 2,
                        hybrid_attention: attn,
                        expert_biases: ["w13_weight_bias", "w2_weight_bias"],
                        sinks_dtype: None,
                        local_names: &[],
                        lm_head: LmHead::Own(Arc::from("lm_head.weight")),
                        ..cfg(tp, ep, rows)
                    };
                    let layout = FusedTpLayout::new(&spec, c).unwrap();
                    crate::layout::check::side(&layout, &cat)
                        .unwrap_or_else(|e| panic!("{name} tp={tp} ep={ep} `{attn}`: {e}"));
                    checked += 1;
                }
            }
        }
        assert_eq!(checked, 2 * (3 + 5 + 5));
    }

    /// The pieces of rank 1 of 2 of a Qwen3-Next and a Qwen3.5 linear-attention layer, and of
    /// the gated `qkv_proj`, spelled out (4 key heads of 16, 8 value heads of 16: key_dim 64,
    /// value_dim 128).
    #[test]
    fn linear_attention_pieces_follow_the_engines_splits() {
        let find = |l: &RankLayout, name: &str| -> LocalTensor {
            l.tensors
                .iter()
                .find(|t| &*t.name == name)
                .unwrap_or_else(|| panic!("no {name}"))
                .clone()
        };
        let spans = |t: &LocalTensor| -> Vec<(String, u64, u64, u64)> {
            t.placements
                .iter()
                .map(|p| {
                    (
                        p.canonical.to_string(),
                        p.region.offset.get(0),
                        p.region.extent.get(0),
                        p.local_offset.get(0),
                    )
                })
                .collect()
        };
        let l0 = "model.layers.0.linear_attn";
        // Qwen3-Next: one contiguous slice of the grouped in_proj_qkvz / in_proj_ba
        let next = ModelSpec::resolve("qwen3-next-tiny").unwrap();
        let layout = FusedTpLayout::new(&next, cfg(2, 1, 512)).unwrap();
        let r1 = layout.rank_layout(RankId::infer(0, 1)).unwrap();
        let qkvz = find(&r1, &format!("{l0}.in_proj_qkvz.weight"));
        assert_eq!(qkvz.shape, Dims::new(&[192, 64]));
        assert_eq!(
            spans(&qkvz),
            vec![(format!("{l0}.in_proj_qkvz.weight"), 192, 192, 0)]
        );
        let ba = find(&r1, &format!("{l0}.in_proj_ba.weight"));
        assert_eq!(
            spans(&ba),
            vec![(format!("{l0}.in_proj_ba.weight"), 8, 8, 0)]
        );
        // conv1d: [q_r | k_r | v_r]
        let conv = find(&r1, &format!("{l0}.conv1d.weight"));
        assert_eq!(conv.shape, Dims::new(&[128, 1, 4]));
        let c = format!("{l0}.conv1d.weight");
        assert_eq!(
            spans(&conv),
            vec![
                (c.clone(), 32, 32, 0),
                (c.clone(), 96, 32, 32),
                (c.clone(), 192, 64, 64)
            ]
        );
        let a_log = find(&r1, &format!("{l0}.A_log"));
        assert_eq!(a_log.dtype, DType::F32);
        assert_eq!(spans(&a_log), vec![(format!("{l0}.A_log"), 4, 4, 0)]);
        let out = find(&r1, &format!("{l0}.out_proj.weight"));
        assert_eq!(
            (out.placements[0].region.offset.get(1), out.shape),
            (64, Dims::new(&[64, 64]))
        );
        // the gated q_proj: 2 heads of [query | gate] per rank, then the rank's KV head
        let qkv = find(&r1, "model.layers.3.qkv_proj.weight");
        assert_eq!(qkv.shape, Dims::new(&[(2 * 2 * 16) + 2 * 16, 64]));
        assert_eq!(
            spans(&qkv),
            vec![
                ("model.layers.3.self_attn.q_proj.weight".into(), 64, 64, 0),
                ("model.layers.3.self_attn.k_proj.weight".into(), 16, 16, 64),
                ("model.layers.3.self_attn.v_proj.weight".into(), 16, 16, 80),
            ]
        );
        assert!(
            r1.tensors
                .iter()
                .any(|t| &*t.name == "model.layers.3.o_proj.weight")
        );
        // Qwen3.5: in_proj_qkv and in_proj_z each split, [q_r | k_r | v_r | z_r]; [b_r | a_r]
        let q35 = ModelSpec::resolve("qwen3.5-tiny").unwrap();
        let c = FusedTp {
            hybrid_attention: "self_attn",
            expert_biases: ["w13_weight_bias", "w2_weight_bias"],
            sinks_dtype: None,
            local_names: &[],
            ..cfg(2, 1, 512)
        };
        let layout = FusedTpLayout::new(&q35, c).unwrap();
        let r1 = layout.rank_layout(RankId::infer(0, 1)).unwrap();
        let qkvz = find(&r1, &format!("{l0}.in_proj_qkvz.weight"));
        let (qkv, z) = (
            format!("{l0}.in_proj_qkv.weight"),
            format!("{l0}.in_proj_z.weight"),
        );
        assert_eq!(
            spans(&qkvz),
            vec![
                (qkv.clone(), 32, 32, 0),
                (qkv.clone(), 96, 32, 32),
                (qkv.clone(), 192, 64, 64),
                (z, 64, 64, 128)
            ]
        );
        let ba = find(&r1, &format!("{l0}.in_proj_ba.weight"));
        assert_eq!(
            spans(&ba),
            vec![
                (format!("{l0}.in_proj_b.weight"), 4, 4, 0),
                (format!("{l0}.in_proj_a.weight"), 4, 4, 4)
            ]
        );
        assert!(
            r1.tensors
                .iter()
                .any(|t| &*t.name == "model.layers.3.self_attn.qkv_proj.weight")
        );
        // more ranks than key heads: refused by name
        let wide = ModelSpec {
            num_heads: 8,
            ..next
        };
        let e = FusedTpLayout::new(&wide, cfg(8, 1, 128)).unwrap_err();
        assert!(
            e.to_string()
                .contains("4 linear-attention key heads over tp=8"),
            "{e}"
        );
    }
}
