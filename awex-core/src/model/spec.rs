//! `ModelSpec`: the architecture and sizes of a model, parsed from an HF `config.json`.

use super::ModelError;
use super::family::{self, Family, Sink};
use super::names::Canon;
use super::part::Part;
use crate::dims::Dims;
use crate::dtype::DType;
use crate::limits::LimitError;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use std::path::Path;

/// The model family of a spec: its HF class (`architectures[0]`), serialised as that name.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Architecture(pub(crate) &'static Family);

#[allow(non_upper_case_globals)]
impl Architecture {
    /// `LlamaForCausalLM`
    pub const Llama: Architecture = Architecture(&family::llama::FAMILY);
    /// `Qwen2ForCausalLM` (q/k/v biases)
    pub const Qwen2: Architecture = Architecture(&family::qwen2::FAMILY);
    /// `Qwen3ForCausalLM` (q_norm / k_norm)
    pub const Qwen3: Architecture = Architecture(&family::qwen3::FAMILY);
    /// `Qwen3MoeForCausalLM` (router + per-expert MLPs)
    pub const Qwen3Moe: Architecture = Architecture(&family::qwen3_moe::FAMILY);
    /// `MixtralForCausalLM` (every layer MoE, `block_sparse_moe`)
    pub const Mixtral: Architecture = Architecture(&family::mixtral::FAMILY);
    /// `DeepseekV2ForCausalLM` (DeepSeek-V3's layer, V2's defaults, no router bias but for
    /// `topk_method: noaux_tc`)
    pub const DeepseekV2: Architecture = Architecture(&family::deepseek_v2::FAMILY);
    /// `DeepseekV3ForCausalLM` (MLA, shared experts, router bias; Kimi-K2 too)
    pub const DeepseekV3: Architecture = Architecture(&family::deepseek_v3::FAMILY);
    /// `Glm4MoeForCausalLM` (GLM-4.5: q/k/v biases, optional q/k norms, shared experts, router
    /// bias, dense first layers)
    pub const Glm4Moe: Architecture = Architecture(&family::glm4_moe::FAMILY);
    /// `Qwen3NextForCausalLM` (Gated DeltaNet + gated full attention, MoE with a gated shared
    /// expert)
    pub const Qwen3Next: Architecture = Architecture(&family::qwen3_next::FAMILY);
    /// `Qwen3_5ForCausalLM` (Qwen3.5 dense: Gated DeltaNet + gated full attention)
    pub const Qwen3_5: Architecture = Architecture(&family::qwen3_5::FAMILY);
    /// `Qwen3_5MoeForCausalLM` (Qwen3.5-MoE)
    pub const Qwen3_5Moe: Architecture = Architecture(&family::qwen3_5_moe::FAMILY);
    /// `GptOssForCausalLM` (gpt-oss: q/k/v/o biases, attention sinks, every layer MoE with a
    /// router bias and fused, transposed experts with biases)
    pub const GptOss: Architecture = Architecture(&family::gpt_oss::FAMILY);

    /// The HF class name.
    pub const fn hf_name(self) -> &'static str {
        self.0.hf_class
    }

    /// The family: its names, its parts, its presets.
    pub const fn family(self) -> &'static Family {
        self.0
    }

    /// Parses an HF class name.
    pub fn from_hf_name(name: &str) -> Result<Self, ModelError> {
        Family::of(name).map(Architecture)
    }
}

impl std::hash::Hash for Architecture {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.0.hf_class.hash(state)
    }
}

impl Serialize for Architecture {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.0.hf_class)
    }
}

impl<'de> Deserialize<'de> for Architecture {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let name = String::deserialize(d)?;
        Architecture::from_hf_name(&name).map_err(serde::de::Error::custom)
    }
}

/// Mixture-of-experts sizes (Qwen3-MoE).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct MoeSpec {
    /// Number of routed experts per MoE layer.
    pub num_experts: u64,
    /// Experts each token is routed to.
    pub experts_per_token: u64,
    /// Intermediate size of one expert's MLP.
    pub moe_intermediate_size: u64,
    /// Every `decoder_sparse_step`-th layer is MoE (HF: `(i + 1) % step == 0`).
    pub decoder_sparse_step: u64,
    /// Layers that stay dense whatever the step says.
    pub mlp_only_layers: Vec<u64>,
    /// Rows of the shared experts' MLP every token also goes through (0: none).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub shared_intermediate_size: u64,
    /// The router has a score-correction bias (`e_score_correction_bias`, fp32).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub router_bias: bool,
    /// The model computes its router in fp32 (GLM-4.5: transformers' `Glm4MoeTopkRouter` casts
    /// the weight to fp32): the checkpoint stores it in the model's dtype, and an engine class
    /// that follows the model holds it in fp32 (its backend says which do).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub router_fp32: bool,
}

/// Multi-head latent attention sizes (DeepSeek-V2/V3, Kimi-K2).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct MlaSpec {
    /// Rank of the query down projection; `None`: a plain `q_proj`.
    pub q_lora_rank: Option<u64>,
    /// Rank of the key/value down projection.
    pub kv_lora_rank: u64,
    /// Per-head query/key size without rotary embedding.
    pub qk_nope_head_dim: u64,
    /// Per-head query/key size with rotary embedding (shared by all heads for the key).
    pub qk_rope_head_dim: u64,
    /// Per-head value size.
    pub v_head_dim: u64,
}

/// Gated DeltaNet (linear attention) sizes of a hybrid model (Qwen3-Next, Qwen3.5): which
/// layers keep full attention, and the linear-attention heads of the others.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LinearAttnSpec {
    /// Key (and query) heads of a linear-attention layer (`linear_num_key_heads`).
    pub num_key_heads: u64,
    /// Value heads (`linear_num_value_heads`), a multiple of the key heads.
    pub num_value_heads: u64,
    /// Size of one key head (`linear_key_head_dim`).
    pub key_head_dim: u64,
    /// Size of one value head (`linear_value_head_dim`).
    pub value_head_dim: u64,
    /// Kernel of the depthwise causal convolution (`linear_conv_kernel_dim`).
    pub conv_kernel: u64,
    /// The layers with full (softmax) attention (`layer_types[l] == "full_attention"`); every
    /// other layer is a linear-attention layer.
    pub full_attention_layers: Vec<u64>,
    /// The full-attention layers' `q_proj` holds a per-head output gate after each head's
    /// query rows (`attn_output_gate`, `[heads * 2 * head_dim, hidden]`).
    pub attn_output_gate: bool,
}

impl LinearAttnSpec {
    /// `key_head_dim * num_key_heads`.
    pub fn key_dim(&self) -> u64 {
        self.key_head_dim * self.num_key_heads
    }

    /// `value_head_dim * num_value_heads`.
    pub fn value_dim(&self) -> u64 {
        self.value_head_dim * self.num_value_heads
    }

    /// Channels of the convolution, `2 * key_dim + value_dim`.
    pub fn conv_dim(&self) -> u64 {
        2 * self.key_dim() + self.value_dim()
    }
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

/// The architecture and sizes of a model: everything needed to name and shape its tensors.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ModelSpec {
    /// A display name (preset name or the config's `_name_or_path`).
    pub name: String,
    /// Model family.
    pub architecture: Architecture,
    /// Hidden size.
    pub hidden_size: u64,
    /// Number of decoder layers.
    pub num_layers: u64,
    /// Attention (query) heads.
    pub num_heads: u64,
    /// Key/value heads (GQA groups).
    pub num_kv_heads: u64,
    /// Size of one head.
    pub head_dim: u64,
    /// Intermediate size of the dense MLP.
    pub intermediate_size: u64,
    /// Vocabulary size (unpadded).
    pub vocab_size: u64,
    /// `lm_head` shares the embedding.
    pub tie_word_embeddings: bool,
    /// q/k/v projections carry biases.
    pub attention_bias: bool,
    /// Per-head q/k norms, where the family makes them optional (GLM-4.5's `use_qk_norm`);
    /// families that always have them (Qwen3) or never do ignore it.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub use_qk_norm: bool,
    /// Parameter dtype of the checkpoint.
    pub dtype: DType,
    /// MoE sizes, when the model has experts.
    pub moe: Option<MoeSpec>,
    /// Multi-head latent attention sizes, when the attention is MLA.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mla: Option<MlaSpec>,
    /// Multi-token-prediction layers a checkpoint holds after the decoder layers
    /// (`num_nextn_predict_layers`: `model.layers.{num_hidden_layers + i}.*`). They are not part
    /// of the catalogue and not moved ([`ModelSpec::not_moved`]).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub mtp_layers: u64,
    /// Gated DeltaNet sizes, when some layers are linear attention (Qwen3-Next, Qwen3.5).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub linear: Option<LinearAttnSpec>,
}

/// Tensors a checkpoint may hold that awex knows of and does not move, by a rule that names
/// them ([`ModelSpec::not_moved`]): a checkpoint's tensors under it are skipped when it is
/// opened, and `plan` and `demo` list the rule.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NotMoved {
    /// The first excluded layer index (`model.layers.{first_layer}.*`).
    pub first_layer: u64,
    /// How many layers from `first_layer` on.
    pub layers: u64,
}

impl NotMoved {
    /// Whether the checkpoint tensor `name` is under this rule (`model.layers.{l}.` with `l` in
    /// the excluded range, the index written as Python writes it).
    pub fn covers(&self, name: &str) -> bool {
        let Some(rest) = name.strip_prefix("model.layers.") else {
            return false;
        };
        let Some((index, _)) = rest.split_once('.') else {
            return false;
        };
        if index.is_empty() || (index.len() > 1 && index.starts_with('0')) {
            return false;
        }
        match index.parse::<u64>() {
            Ok(l) => l >= self.first_layer && l - self.first_layer < self.layers,
            Err(_) => false,
        }
    }

    /// The rule in words, for `plan`, `demo` and error messages.
    pub fn describe(&self) -> String {
        let layers = if self.layers == 1 {
            format!("model.layers.{}.*", self.first_layer)
        } else {
            format!(
                "model.layers.{{{}..={}}}.*",
                self.first_layer,
                self.first_layer + self.layers - 1
            )
        };
        format!(
            "{layers}: the multi-token-prediction layer{} (num_nextn_predict_layers = {}), which \
             no backend of awex holds; a checkpoint's tensors there are skipped",
            if self.layers == 1 { "" } else { "s" },
            self.layers
        )
    }
}

pub(crate) fn field<'a>(cfg: &'a Value, name: &'static str) -> Result<&'a Value, ModelError> {
    match cfg.get(name) {
        Some(v) if !v.is_null() => Ok(v),
        _ => Err(ModelError::MissingField(name)),
    }
}

pub(crate) fn uint(cfg: &Value, name: &'static str) -> Result<u64, ModelError> {
    let v = field(cfg, name)?;
    v.as_u64().ok_or_else(|| ModelError::BadField {
        field: name,
        message: format!("expected a non-negative integer, found {v}"),
    })
}

pub(crate) fn opt_uint(cfg: &Value, name: &'static str) -> Result<Option<u64>, ModelError> {
    match cfg.get(name) {
        None | Some(Value::Null) => Ok(None),
        Some(_) => uint(cfg, name).map(Some),
    }
}

pub(crate) fn opt_bool(cfg: &Value, name: &'static str, default: bool) -> Result<bool, ModelError> {
    match cfg.get(name) {
        None | Some(Value::Null) => Ok(default),
        Some(Value::Bool(b)) => Ok(*b),
        Some(v) => Err(ModelError::BadField {
            field: name,
            message: format!("expected true or false, found {v}"),
        }),
    }
}

impl ModelSpec {
    /// Parses the text of an HF `config.json`.
    pub fn from_config_json(text: &str) -> Result<Self, ModelError> {
        let cfg: Value = serde_json::from_str(text).map_err(|e| ModelError::Json(e.to_string()))?;
        Self::from_config_value(&cfg)
    }

    /// Parses an HF config already read as JSON.
    pub fn from_config_value(cfg: &Value) -> Result<Self, ModelError> {
        if !cfg.is_object() {
            return Err(ModelError::Json(
                "config.json must hold a JSON object".into(),
            ));
        }
        let arch_name = field(cfg, "architectures")?
            .as_array()
            .and_then(|a| a.first())
            .and_then(|v| v.as_str())
            .ok_or(ModelError::BadField {
                field: "architectures",
                message: "expected a list with one class name, e.g. [\"Qwen3ForCausalLM\"]".into(),
            })?;
        let family = Family::of(arch_name)?;
        let name = cfg
            .get("_name_or_path")
            .and_then(|v| v.as_str())
            .filter(|s| !s.is_empty())
            .unwrap_or(arch_name);
        let mut spec = family::common(cfg, name, family)?;
        (family.parse)(cfg, &mut spec)?;
        spec.validate()?;
        Ok(spec)
    }

    /// Reads a `config.json` file, or the `config.json` inside an HF model directory.
    pub fn from_path(path: &Path) -> Result<Self, ModelError> {
        Self::from_config_json(&Self::read_config(path)?)
    }

    /// The text of the `config.json` that `path` names: the file itself, or the `config.json`
    /// inside an HF model directory. Only a regular file of at most
    /// [`crate::limits::MAX_JSON_BYTES`] is read: a FIFO, a device or a huge file is refused,
    /// not waited on. Every reader of a `--model` or `--infer-config` path reads through here.
    pub fn read_config(path: &Path) -> Result<String, ModelError> {
        let file = if path.is_dir() {
            path.join("config.json")
        } else {
            path.to_path_buf()
        };
        let io = |message| ModelError::Io {
            path: file.display().to_string(),
            message,
        };
        crate::file::read_regular_text(&file, crate::limits::MAX_JSON_BYTES).map_err(io)
    }

    /// Resolves a `--model` argument: a built-in preset name, a `config.json`, or an HF directory.
    pub fn resolve(arg: &str) -> Result<Self, ModelError> {
        if let Some(spec) = super::presets::preset(arg) {
            return Ok(spec);
        }
        Self::from_config_json(&Self::config_text_of(arg)?)
    }

    /// The HF config of a `--model` argument as JSON, for what the spec does not keep (its
    /// `quantization_config`): `None` for a built-in preset. Read as [`ModelSpec::resolve`]
    /// reads it, with the same errors.
    pub fn config_value_of(arg: &str) -> Result<Option<Value>, ModelError> {
        if super::presets::preset(arg).is_some() {
            return Ok(None);
        }
        serde_json::from_str(&Self::config_text_of(arg)?)
            .map(Some)
            .map_err(|e| ModelError::Json(e.to_string()))
    }

    /// The `config.json` text of a `--model` argument that is not a preset.
    fn config_text_of(arg: &str) -> Result<String, ModelError> {
        let path = Path::new(arg);
        if path.exists() {
            return Self::read_config(path);
        }
        Err(ModelError::UnknownModel {
            arg: arg.to_string(),
            presets: super::presets::names(),
        })
    }

    /// What a checkpoint of this model may hold that awex does not move: the
    /// multi-token-prediction layers after the decoder layers.
    pub fn not_moved(&self) -> Vec<NotMoved> {
        if self.mtp_layers == 0 {
            return Vec::new();
        }
        vec![NotMoved {
            first_layer: self.num_layers,
            layers: self.mtp_layers,
        }]
    }

    /// Checks every size against [`crate::limits`] (before anything walks or allocates by them),
    /// then that the sizes agree with each other.
    pub fn validate(&self) -> Result<(), ModelError> {
        self.check_limits()?;
        // the family's own sizes first: DeepSeek's head_dim is its qk_rope_head_dim
        (self.architecture.family().check)(self)?;
        let positive = [
            ("hidden_size", self.hidden_size),
            ("num_hidden_layers", self.num_layers),
            ("num_attention_heads", self.num_heads),
            ("num_key_value_heads", self.num_kv_heads),
            ("head_dim", self.head_dim),
            ("vocab_size", self.vocab_size),
        ];
        for (name, v) in positive {
            if v == 0 {
                return Err(ModelError::BadField {
                    field: name,
                    message: "must be at least 1".into(),
                });
            }
        }
        if self.num_heads % self.num_kv_heads != 0 {
            return Err(ModelError::Inconsistent(format!(
                "num_key_value_heads={} must divide num_attention_heads={}",
                self.num_kv_heads, self.num_heads
            )));
        }
        if let Some(moe) = &self.moe {
            if moe.num_experts == 0 || moe.moe_intermediate_size == 0 {
                return Err(ModelError::Inconsistent(
                    "num_experts and moe_intermediate_size must be at least 1".into(),
                ));
            }
            if moe.decoder_sparse_step == 0 {
                return Err(ModelError::BadField {
                    field: "decoder_sparse_step",
                    message: "must be at least 1".into(),
                });
            }
            if moe.experts_per_token == 0 || moe.experts_per_token > moe.num_experts {
                return Err(ModelError::Inconsistent(format!(
                    "num_experts_per_tok={} must be between 1 and num_experts={}",
                    moe.experts_per_token, moe.num_experts
                )));
            }
            if let Some(&l) = moe.mlp_only_layers.iter().find(|&&l| l >= self.num_layers) {
                return Err(ModelError::Inconsistent(format!(
                    "mlp_only_layers names layer {l} but the model has {} layers",
                    self.num_layers
                )));
            }
        }
        let dense_layers = (0..self.num_layers).any(|l| !self.is_moe_layer(l));
        if dense_layers && self.intermediate_size == 0 {
            return Err(ModelError::BadField {
                field: "intermediate_size",
                message: "must be at least 1 for dense MLP layers".into(),
            });
        }
        // what no check above names: no tensor may be empty (a zero dimension would reach the
        // layout and the planner as a box with no elements)
        if let Some((name, shape)) = self.first_empty_tensor() {
            return Err(ModelError::Inconsistent(format!(
                "tensor `{name}` would have shape {shape}, with no elements; every size it is made of must be at least 1"
            )));
        }
        Ok(())
    }

    /// The first tensor of the catalogue with a zero dimension, named, with its shape.
    fn first_empty_tensor(&self) -> Option<(String, Dims)> {
        /// Remembers the first empty tensor.
        struct Empty<'a>(&'a ModelSpec, Option<(String, Dims)>);
        impl Sink for Empty<'_> {
            fn part(&mut self, c: Canon, shape: Dims) {
                if self.1.is_none() && shape.as_slice().contains(&0) {
                    let name = self.0.canonical_name(c).unwrap_or_else(|| format!("{c:?}"));
                    self.1 = Some((name, shape));
                }
            }
            fn experts(&mut self, l: u64, count: u64, parts: &[(Part, Dims)]) {
                if count == 0 {
                    return;
                }
                for (p, shape) in parts {
                    self.part(Canon::expert_at(*p, l, 0), *shape);
                }
            }
        }
        let mut e = Empty(self, None);
        family::walk(self, &mut e);
        e.1
    }

    /// Checks each size and the derived tensor count and bytes against [`crate::limits`].
    pub fn check_limits(&self) -> Result<(), LimitError> {
        use crate::limits as l;
        let name_bytes = self.name.len() as u128;
        l::MODEL_NAME_BYTES.check("name (`_name_or_path`) bytes", name_bytes)?;
        let mut sizes = vec![
            ("hidden_size", self.hidden_size, l::HIDDEN),
            ("num_hidden_layers", self.num_layers, l::LAYERS),
            ("num_attention_heads", self.num_heads, l::HEADS),
            ("num_key_value_heads", self.num_kv_heads, l::HEADS),
            ("head_dim", self.head_dim, l::HEAD_DIM),
            ("intermediate_size", self.intermediate_size, l::INTERMEDIATE),
            ("vocab_size", self.vocab_size, l::VOCAB),
            ("num_nextn_predict_layers", self.mtp_layers, l::LAYERS),
        ];
        if let Some(a) = &self.mla {
            sizes.extend([
                ("q_lora_rank", a.q_lora_rank.unwrap_or(0), l::HIDDEN),
                ("kv_lora_rank", a.kv_lora_rank, l::HIDDEN),
                ("qk_nope_head_dim", a.qk_nope_head_dim, l::HIDDEN),
                ("qk_rope_head_dim", a.qk_rope_head_dim, l::HIDDEN),
                ("v_head_dim", a.v_head_dim, l::HIDDEN),
            ]);
        }
        if let Some(a) = &self.linear {
            let full = a.full_attention_layers.len() as u64;
            sizes.extend([
                ("linear_num_key_heads", a.num_key_heads, l::HEADS),
                ("linear_num_value_heads", a.num_value_heads, l::HEADS),
                ("linear_key_head_dim", a.key_head_dim, l::HEAD_DIM),
                ("linear_value_head_dim", a.value_head_dim, l::HEAD_DIM),
                ("linear_conv_kernel_dim", a.conv_kernel, l::CONV_KERNEL),
                (
                    "full-attention layers (`layer_types`)",
                    full,
                    l::PER_LAYER_LIST,
                ),
            ]);
        }
        if let Some(m) = &self.moe {
            let shared = m.shared_intermediate_size;
            sizes.extend([
                ("shared experts' intermediate size", shared, l::INTERMEDIATE),
                ("num_experts", m.num_experts, l::EXPERTS),
                ("num_experts_per_tok", m.experts_per_token, l::EXPERTS),
                (
                    "moe_intermediate_size",
                    m.moe_intermediate_size,
                    l::INTERMEDIATE,
                ),
                (
                    "mlp_only_layers",
                    m.mlp_only_layers.len() as u64,
                    l::PER_LAYER_LIST,
                ),
            ]);
        }
        for (field, v, limit) in sizes {
            limit.check(field, u128::from(v))?;
        }
        let (tensors, elements) = self.catalogue_size();
        l::TENSORS.check("canonical tensors", tensors)?;
        l::MODEL_BYTES.check("total bytes", elements * self.dtype.size() as u128)?;
        Ok(())
    }

    /// The number of canonical tensors and their elements, exactly as [`super::Catalogue::of`]
    /// builds them (counted from the family's parts, each expert's parts once times the expert
    /// count), in 128-bit arithmetic (every size is below 2^32 after the per-field checks).
    pub(crate) fn catalogue_size(&self) -> (u128, u128) {
        /// Counts what a family lists.
        struct Count(u128, u128);
        impl Sink for Count {
            fn part(&mut self, _: Canon, shape: Dims) {
                self.0 += 1;
                self.1 += u128::from(shape.numel());
            }
            fn experts(&mut self, _: u64, count: u64, parts: &[(Part, Dims)]) {
                let n = u128::from(count);
                self.0 += n * parts.len() as u128;
                self.1 += n * parts
                    .iter()
                    .map(|(_, s)| u128::from(s.numel()))
                    .sum::<u128>();
            }
        }
        let mut c = Count(0, 0);
        family::walk(self, &mut c);
        (c.0, c.1)
    }

    /// Whether the model has `part` in some layer (or, for the embedding, final norm and output
    /// projection, at all).
    pub fn has(&self, part: Part) -> bool {
        /// Looks for one part.
        struct Find(Part, bool);
        impl Sink for Find {
            fn part(&mut self, c: Canon, _: Dims) {
                self.1 |= c.part == self.0;
            }
            fn experts(&mut self, _: u64, count: u64, parts: &[(Part, Dims)]) {
                self.1 |= count > 0 && parts.iter().any(|(p, _)| *p == self.0);
            }
        }
        let mut f = Find(part, false);
        family::walk(self, &mut f);
        f.1
    }

    /// Every part the model has, each once, in first-seen order.
    pub fn parts(&self) -> Vec<Part> {
        /// Collects distinct parts.
        struct Distinct(Vec<Part>);
        impl Sink for Distinct {
            fn part(&mut self, c: Canon, _: Dims) {
                if !self.0.contains(&c.part) {
                    self.0.push(c.part);
                }
            }
            fn experts(&mut self, _: u64, count: u64, parts: &[(Part, Dims)]) {
                for (p, _) in parts.iter().filter(|_| count > 0) {
                    if !self.0.contains(p) {
                        self.0.push(*p);
                    }
                }
            }
        }
        let mut d = Distinct(Vec::new());
        family::walk(self, &mut d);
        d.0
    }

    /// The HF name of a canonical tensor of this model's family (`None` when the family has no
    /// such part).
    pub fn canonical_name(&self, c: Canon) -> Option<String> {
        self.architecture.family().names.name(c)
    }

    /// How this model's checkpoints spell its parts.
    pub fn names(&self) -> &'static super::names::HfNames {
        self.architecture.family().names
    }

    /// Whether layer `l` has a mixture-of-experts MLP (HF Qwen3-MoE rule).
    pub fn is_moe_layer(&self, l: u64) -> bool {
        match &self.moe {
            None => false,
            Some(m) => {
                m.decoder_sparse_step > 0
                    && !m.mlp_only_layers.contains(&l)
                    && (l + 1) % m.decoder_sparse_step == 0
            }
        }
    }

    /// Whether layer `l` is a Gated DeltaNet (linear-attention) layer of a hybrid model.
    pub fn is_linear_layer(&self, l: u64) -> bool {
        self.linear
            .as_ref()
            .is_some_and(|a| !a.full_attention_layers.contains(&l))
    }

    /// Rows of `q_proj` (`num_heads * head_dim`).
    pub fn q_size(&self) -> u64 {
        self.num_heads * self.head_dim
    }

    /// Whether the full-attention layers' `q_proj` holds a per-head output gate
    /// ([`LinearAttnSpec::attn_output_gate`]): `2 * q_size()` rows, `[query | gate]` per head.
    pub fn gated_q(&self) -> bool {
        self.linear.as_ref().is_some_and(|a| a.attn_output_gate)
    }

    /// Rows of `k_proj` / `v_proj` (`num_kv_heads * head_dim`).
    pub fn kv_size(&self) -> u64 {
        self.num_kv_heads * self.head_dim
    }

    /// Whether the attention has q_norm / k_norm.
    pub fn qk_norm(&self) -> bool {
        self.has(Part::QNorm)
    }

    /// The number of experts, zero for a dense model.
    pub fn num_experts(&self) -> u64 {
        self.moe.as_ref().map_or(0, |m| m.num_experts)
    }

    /// A stable 64-bit fingerprint of the sizes and names that define the canonical tensors.
    pub fn fingerprint(&self) -> u64 {
        let mut s = self.clone();
        s.name = String::new();
        let text = serde_json::to_string(&s).unwrap_or_default();
        xxhash_rust::xxh3::xxh3_64(text.as_bytes())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// A valid Qwen3 config (the qwen3-tiny sizes) to break one field at a time.
    fn qwen3() -> Value {
        json!({
            "architectures": ["Qwen3ForCausalLM"],
            "hidden_size": 64,
            "num_hidden_layers": 4,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "intermediate_size": 128,
            "vocab_size": 1000,
            "tie_word_embeddings": false,
            "dtype": "bfloat16"
        })
    }

    /// A valid Qwen3-MoE config (the qwen3-moe-tiny sizes).
    fn qwen3_moe() -> Value {
        let mut cfg = qwen3();
        cfg["architectures"] = json!(["Qwen3MoeForCausalLM"]);
        cfg["num_experts"] = json!(8);
        cfg["num_experts_per_tok"] = json!(2);
        cfg["moe_intermediate_size"] = json!(32);
        cfg["mlp_only_layers"] = json!([0]);
        cfg
    }

    /// A valid DeepSeek-V3 config (the tiny fixture's).
    fn deepseek_v3() -> Value {
        let fixture: Value =
            serde_json::from_str(include_str!("../../tests/fixtures/hf/deepseek-v3.json"))
                .unwrap_or_else(|e| panic!("fixture: {e}"));
        fixture["config"].clone()
    }

    fn err(cfg: &Value) -> String {
        match ModelSpec::from_config_value(cfg) {
            Ok(spec) => panic!("config was accepted: {spec:?}"),
            Err(e) => e.to_string(),
        }
    }

    #[test]
    fn parses_a_qwen3_config_into_its_sizes() {
        let spec = ModelSpec::from_config_value(&qwen3()).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(
            spec,
            ModelSpec {
                name: "Qwen3ForCausalLM".into(),
                architecture: Architecture::Qwen3,
                hidden_size: 64,
                num_layers: 4,
                num_heads: 4,
                num_kv_heads: 2,
                head_dim: 16,
                intermediate_size: 128,
                vocab_size: 1000,
                tie_word_embeddings: false,
                attention_bias: false,
                use_qk_norm: false,
                dtype: DType::Bf16,
                moe: None,
                mla: None,
                mtp_layers: 0,
                linear: None,
            }
        );
        assert_eq!(
            Some(spec),
            crate::model::presets::preset("qwen3-tiny").map(|p| ModelSpec {
                name: "Qwen3ForCausalLM".into(),
                ..p
            })
        );
    }

    #[test]
    fn unknown_architecture_lists_the_supported_ones() {
        let mut cfg = qwen3();
        cfg["architectures"] = json!(["MistralForCausalLM"]);
        assert_eq!(
            err(&cfg),
            "unsupported architecture `MistralForCausalLM`; supported: LlamaForCausalLM, \
             Qwen2ForCausalLM, Qwen3ForCausalLM, Qwen3MoeForCausalLM, MixtralForCausalLM, \
             DeepseekV2ForCausalLM, DeepseekV3ForCausalLM, Glm4MoeForCausalLM, \
             Qwen3NextForCausalLM, Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM, GptOssForCausalLM"
        );
    }

    #[test]
    fn architectures_that_is_not_a_list_of_names_is_rejected() {
        let mut cfg = qwen3();
        cfg["architectures"] = json!("Qwen3ForCausalLM");
        assert_eq!(
            err(&cfg),
            "config.json field `architectures`: expected a list with one class name, e.g. \
             [\"Qwen3ForCausalLM\"]"
        );
    }

    #[test]
    fn missing_hidden_size_is_named() {
        let mut cfg = qwen3();
        cfg.as_object_mut().map(|o| o.remove("hidden_size"));
        assert_eq!(err(&cfg), "config.json has no `hidden_size`");
        cfg["hidden_size"] = Value::Null;
        assert_eq!(err(&cfg), "config.json has no `hidden_size`");
    }

    #[test]
    fn missing_architectures_is_named() {
        let mut cfg = qwen3();
        cfg.as_object_mut().map(|o| o.remove("architectures"));
        assert_eq!(err(&cfg), "config.json has no `architectures`");
    }

    #[test]
    fn kv_heads_that_do_not_divide_heads_are_rejected() {
        let mut cfg = qwen3();
        cfg["num_key_value_heads"] = json!(3);
        assert_eq!(
            err(&cfg),
            "inconsistent model sizes: num_key_value_heads=3 must divide num_attention_heads=4"
        );
    }

    #[test]
    fn missing_kv_heads_default_to_the_query_heads() {
        let mut cfg = qwen3();
        cfg.as_object_mut().map(|o| o.remove("num_key_value_heads"));
        let spec = ModelSpec::from_config_value(&cfg).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!((spec.num_heads, spec.num_kv_heads), (4, 4));
    }

    #[test]
    fn no_head_dim_with_heads_not_dividing_hidden_is_rejected() {
        let mut cfg = qwen3();
        cfg.as_object_mut().map(|o| o.remove("head_dim"));
        cfg["num_attention_heads"] = json!(6);
        cfg["num_key_value_heads"] = json!(2);
        assert_eq!(
            err(&cfg),
            "inconsistent model sizes: config has no `head_dim` and num_attention_heads=6 does \
             not divide hidden_size=64; set `head_dim` explicitly"
        );
    }

    #[test]
    fn no_head_dim_derives_it_from_hidden_over_heads() {
        let mut cfg = qwen3();
        cfg.as_object_mut().map(|o| o.remove("head_dim"));
        cfg["num_attention_heads"] = json!(8);
        let spec = ModelSpec::from_config_value(&cfg).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(spec.head_dim, 8);
    }

    #[test]
    fn explicit_head_dim_may_differ_from_hidden_over_heads() {
        let mut cfg = qwen3();
        cfg["head_dim"] = json!(32);
        let spec = ModelSpec::from_config_value(&cfg).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(
            (spec.hidden_size, spec.num_heads, spec.head_dim),
            (64, 4, 32)
        );
        assert_eq!((spec.q_size(), spec.kv_size()), (128, 64));
    }

    #[test]
    fn a_string_where_an_integer_goes_is_rejected() {
        let mut cfg = qwen3();
        cfg["hidden_size"] = json!("64");
        assert_eq!(
            err(&cfg),
            "config.json field `hidden_size`: expected a non-negative integer, found \"64\""
        );
        let mut cfg = qwen3();
        cfg["vocab_size"] = json!(-1);
        assert_eq!(
            err(&cfg),
            "config.json field `vocab_size`: expected a non-negative integer, found -1"
        );
        let mut cfg = qwen3();
        cfg["head_dim"] = json!(16.5);
        assert_eq!(
            err(&cfg),
            "config.json field `head_dim`: expected a non-negative integer, found 16.5"
        );
    }

    #[test]
    fn a_non_boolean_tie_word_embeddings_is_rejected() {
        let mut cfg = qwen3();
        cfg["tie_word_embeddings"] = json!("yes");
        assert_eq!(
            err(&cfg),
            "config.json field `tie_word_embeddings`: expected true or false, found \"yes\""
        );
    }

    #[test]
    fn an_unknown_dtype_is_rejected() {
        let mut cfg = qwen3();
        cfg["dtype"] = json!("float8");
        assert_eq!(
            err(&cfg),
            "config.json field `torch_dtype`: unknown dtype `float8`; supported: bf16, f16, f32, \
             f64, u8, i8, i32, i64 (also torch/HF spellings such as bfloat16, float32)"
        );
    }

    #[test]
    fn zero_layers_are_rejected() {
        let mut cfg = qwen3();
        cfg["num_hidden_layers"] = json!(0);
        assert_eq!(
            err(&cfg),
            "config.json field `num_hidden_layers`: must be at least 1"
        );
    }

    #[test]
    fn mlp_only_layers_out_of_range_is_rejected() {
        let mut cfg = qwen3_moe();
        cfg["mlp_only_layers"] = json!([0, 4]);
        assert_eq!(
            err(&cfg),
            "inconsistent model sizes: mlp_only_layers names layer 4 but the model has 4 layers"
        );
    }

    #[test]
    fn mlp_only_layers_that_are_not_indices_are_rejected() {
        let mut cfg = qwen3_moe();
        cfg["mlp_only_layers"] = json!(["0"]);
        assert_eq!(
            err(&cfg),
            "config.json field `mlp_only_layers`: expected layer indices, found \"0\""
        );
        cfg["mlp_only_layers"] = json!(0);
        assert_eq!(
            err(&cfg),
            "config.json field `mlp_only_layers`: expected a list of layer indices, found 0"
        );
    }

    #[test]
    fn experts_per_token_above_the_expert_count_is_rejected() {
        let mut cfg = qwen3_moe();
        cfg["num_experts_per_tok"] = json!(9);
        assert_eq!(
            err(&cfg),
            "inconsistent model sizes: num_experts_per_tok=9 must be between 1 and num_experts=8"
        );
    }

    #[test]
    fn moe_expert_count_is_read_from_num_experts_or_num_local_experts() {
        let spec = ModelSpec::from_config_value(&qwen3_moe()).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(
            spec.moe,
            Some(MoeSpec {
                num_experts: 8,
                experts_per_token: 2,
                moe_intermediate_size: 32,
                decoder_sparse_step: 1,
                mlp_only_layers: vec![0],
                shared_intermediate_size: 0,
                router_bias: false,
                router_fp32: false,
            })
        );
        // transformers 5 saves Qwen3-MoE configs with `num_local_experts`.
        let mut cfg = qwen3_moe();
        cfg.as_object_mut().map(|o| o.remove("num_experts"));
        cfg["num_local_experts"] = json!(8);
        let local = ModelSpec::from_config_value(&cfg).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(local, spec);
        // `num_experts` wins when both are present.
        cfg["num_experts"] = json!(16);
        let both = ModelSpec::from_config_value(&cfg).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(both.num_experts(), 16);
        cfg.as_object_mut().map(|o| o.remove("num_experts"));
        cfg.as_object_mut().map(|o| o.remove("num_local_experts"));
        assert_eq!(err(&cfg), "config.json has no `num_experts`");
    }

    #[test]
    fn a_model_name_longer_than_a_path_is_refused() {
        let mut cfg = qwen3();
        cfg["_name_or_path"] = json!("m".repeat(1024));
        assert!(ModelSpec::from_config_value(&cfg).is_ok());
        cfg["_name_or_path"] = json!("m".repeat(3_000_000));
        assert_eq!(
            err(&cfg),
            "model name (`_name_or_path`) bytes=3000000 is above awex's limit of 1024 (an HF model id has at most 96 characters, a local path rarely 256)"
        );
    }

    #[test]
    fn zero_mla_sizes_are_refused_naming_the_field() {
        assert!(ModelSpec::from_config_value(&deepseek_v3()).is_ok());
        let cases = [
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
            (
                "qk_nope_head_dim",
                "config.json field `qk_nope_head_dim`: must be at least 1 (DeepSeek-V3 has 128)",
            ),
            (
                "qk_rope_head_dim",
                "config.json field `qk_rope_head_dim`: must be at least 1 (DeepSeek-V3 has 64)",
            ),
        ];
        for arch in ["DeepseekV3ForCausalLM", "DeepseekV2ForCausalLM"] {
            for (field, want) in cases {
                let mut cfg = deepseek_v3();
                cfg["architectures"] = json!([arch]);
                cfg[field] = json!(0);
                assert_eq!(err(&cfg), want, "{arch} {field}");
            }
        }
    }

    #[test]
    fn a_spec_sent_as_json_without_or_with_foreign_mla_sizes_is_refused() {
        let spec = ModelSpec::from_config_value(&deepseek_v3()).unwrap_or_else(|e| panic!("{e}"));
        let e = ModelSpec {
            mla: None,
            ..spec.clone()
        }
        .validate()
        .map_err(|e| e.to_string());
        assert_eq!(
            e,
            Err("inconsistent model sizes: DeepseekV3ForCausalLM has multi-head latent attention, but the model gives no MLA sizes (`mla`: kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim, q_lora_rank)".to_string())
        );
        let e = ModelSpec {
            head_dim: 16,
            ..spec.clone()
        }
        .validate()
        .map_err(|e| e.to_string());
        assert_eq!(
            e,
            Err("inconsistent model sizes: head_dim=16 must equal qk_rope_head_dim=8 in a model with multi-head latent attention".to_string())
        );
        let qwen = ModelSpec::from_config_value(&qwen3()).unwrap_or_else(|e| panic!("{e}"));
        let e = ModelSpec {
            mla: spec.mla.clone(),
            ..qwen
        }
        .validate()
        .map_err(|e| e.to_string());
        assert_eq!(
            e,
            Err("inconsistent model sizes: the model gives multi-head latent attention sizes (`mla`), but Qwen3ForCausalLM has no MLA; only DeepseekV2ForCausalLM and DeepseekV3ForCausalLM models have them".to_string())
        );
    }

    #[test]
    fn no_accepted_spec_has_an_empty_tensor() {
        // GLM-4.5 with every layer MoE reads no intermediate_size; the shared experts' rows
        // come from n_shared_experts: a spec sent as JSON can still say 0 for a size that
        // shapes a tensor
        let glm =
            crate::model::presets::preset("glm-4.5-tiny").unwrap_or_else(|| panic!("glm-4.5-tiny"));
        assert!(glm.validate().is_ok());
        let mut hostile = glm.clone();
        if let Some(m) = &mut hostile.moe {
            m.num_experts = 0;
        }
        assert!(hostile.validate().is_err());
        let e = ModelSpec {
            intermediate_size: 0,
            ..glm
        }
        .validate()
        .map_err(|e| e.to_string());
        assert_eq!(
            e,
            Err(
                "config.json field `intermediate_size`: must be at least 1 for dense MLP layers"
                    .to_string()
            )
        );
        for name in crate::model::presets::names() {
            let spec = crate::model::presets::preset(name).unwrap_or_else(|| panic!("{name}"));
            assert_eq!(spec.first_empty_tensor(), None, "{name}");
            assert!(spec.validate().is_ok(), "{name}");
        }
    }

    #[test]
    fn invalid_json_is_reported_with_its_position() {
        let e = ModelSpec::from_config_json("{\"hidden_size\": 64,")
            .map(|s| s.name)
            .map_err(|e| e.to_string());
        assert_eq!(
            e,
            Err(
                "config.json is not valid JSON: EOF while parsing a value at line 1 column 19"
                    .to_string()
            )
        );
        let e = ModelSpec::from_config_json("[1, 2]").map_err(|e| e.to_string());
        assert_eq!(
            e.map(|s| s.name),
            Err("config.json is not valid JSON: config.json must hold a JSON object".to_string())
        );
    }

    #[test]
    fn resolve_of_an_unknown_name_lists_the_presets() {
        let e = ModelSpec::resolve("qwen3-9b-does-not-exist").map_err(|e| e.to_string());
        assert_eq!(
            e.map(|s| s.name),
            Err(
                "`qwen3-9b-does-not-exist` is neither a built-in preset nor an existing \
                 config.json or HF directory; presets: qwen3-tiny, qwen3-0.6b, qwen3-8b, \
                 qwen3-moe-tiny, qwen3-30b-a3b, qwen3-235b-a22b, moe-1t, mixtral-tiny, mixtral-8x7b, \
                 deepseek-v2-lite, deepseek-v3-tiny, deepseek-v3, mla-moe-30b, kimi-k2, glm-4.5-tiny, glm-4.5, glm-4.5-air, \
                 qwen3-next-tiny, qwen3-next-80b-a3b, qwen3.5-tiny, qwen3.5-9b, qwen3.5-moe-tiny, \
                 qwen3.5-35b-a3b, qwen3.5-397b-a17b, gpt-oss-tiny, gpt-oss-20b, gpt-oss-120b"
                    .to_string()
            )
        );
    }

    #[test]
    fn resolve_reads_config_json_from_a_directory_and_a_file() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("tempdir: {e}"));
        let mut cfg = qwen3();
        cfg["_name_or_path"] = json!("org/tiny-qwen3");
        let file = dir.path().join("config.json");
        std::fs::write(&file, cfg.to_string()).unwrap_or_else(|e| panic!("write: {e}"));
        let arg = dir
            .path()
            .to_str()
            .unwrap_or_else(|| panic!("non-UTF-8 temp path"));
        let from_dir = ModelSpec::resolve(arg).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(from_dir.name, "org/tiny-qwen3");
        assert_eq!(from_dir.architecture, Architecture::Qwen3);
        assert_eq!(from_dir.hidden_size, 64);
        let file_arg = file
            .to_str()
            .unwrap_or_else(|| panic!("non-UTF-8 temp path"));
        let from_file = ModelSpec::resolve(file_arg).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(from_file, from_dir);
    }

    #[test]
    fn resolve_of_a_directory_without_config_json_names_the_missing_file() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("tempdir: {e}"));
        let arg = dir
            .path()
            .to_str()
            .unwrap_or_else(|| panic!("non-UTF-8 temp path"));
        let e = ModelSpec::resolve(arg).map_err(|e| e.to_string());
        assert_eq!(
            e.map(|s| s.name),
            Err(format!(
                "cannot read {}: No such file or directory (os error 2)",
                dir.path().join("config.json").display()
            ))
        );
    }

    #[test]
    fn qwen2_always_has_attention_biases() {
        let mut cfg = qwen3();
        cfg["architectures"] = json!(["Qwen2ForCausalLM"]);
        cfg["attention_bias"] = json!(false);
        let spec = ModelSpec::from_config_value(&cfg).unwrap_or_else(|e| panic!("{e}"));
        assert!(spec.attention_bias);
        assert!(!spec.qk_norm());
    }

    #[test]
    fn the_bounded_catalogue_size_is_exactly_the_catalogue() {
        let mut specs: Vec<ModelSpec> = crate::model::presets::names()
            .into_iter()
            .filter_map(crate::model::presets::preset)
            .collect();
        let base = specs[0].clone();
        specs.push(ModelSpec {
            attention_bias: true,
            architecture: Architecture::Qwen2,
            tie_word_embeddings: true,
            ..base
        });
        for spec in specs {
            let cat = crate::model::Catalogue::of(&spec);
            let elements: u64 = cat.tensors().iter().map(|t| t.numel()).sum();
            assert_eq!(
                spec.catalogue_size(),
                (cat.len() as u128, u128::from(elements)),
                "{}",
                spec.name
            );
        }
    }

    #[test]
    fn legacy_torch_dtype_is_read() {
        let mut cfg = qwen3();
        cfg.as_object_mut().map(|o| o.remove("dtype"));
        cfg["torch_dtype"] = json!("float32");
        let spec = ModelSpec::from_config_value(&cfg).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(spec.dtype, DType::F32);
    }

    #[test]
    fn the_mtp_rule_covers_exactly_its_layers_as_python_writes_them() {
        let r = NotMoved {
            first_layer: 61,
            layers: 2,
        };
        for n in [
            "model.layers.61.enorm.weight",
            "model.layers.62.mlp.gate.weight",
        ] {
            assert!(r.covers(n), "{n}");
        }
        for n in [
            "model.layers.60.enorm.weight",
            "model.layers.63.enorm.weight",
            "model.layers.061.enorm.weight",
            "model.layers.61",
            "model.layers..x",
            "lm_head.weight",
            "model.layers.99999999999999999999999.x",
        ] {
            assert!(!r.covers(n), "{n}");
        }
        assert!(
            r.describe()
                .starts_with("model.layers.{61..=62}.*: the multi-token-prediction layers")
        );
        let one = NotMoved {
            first_layer: 61,
            layers: 1,
        };
        assert!(
            one.describe()
                .starts_with("model.layers.61.*: the multi-token-prediction layer (")
        );
    }
}
