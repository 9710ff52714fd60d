//! SGLang's tensor-parallel layout: what every rank of every engine holds, in SGLang's own names.
//!
//! It is the fused-TP layout SGLang and vLLM share ([`FusedTpLayout`]), with SGLang's
//! vocabulary padding, tied head and expert module. A layout is a pure function of
//! `(ModelSpec, tp, ep, engines)`. [`SglangLayout`] answers both
//! directions lazily: [`SideLayout::rank_layout`] builds one rank's tensors, and
//! [`SideLayout::holders`] derives every shard of one canonical tensor from the sharding rules,
//! without building any rank.
//!
//! Multi-head latent attention (DeepSeek-V2/V3, Kimi-K2), from SGLang 0.5.23's
//! `models/deepseek_v2.py` (`DeepseekV2AttentionMLA.__init__`) and
//! `models/deepseek_common/deepseek_weight_loader.py` (`do_load_weights`): with `q_lora_rank`,
//! `self_attn.fused_qkv_a_proj_with_mqa` is a `ReplicatedLinear` of
//! `q_lora_rank + kv_lora_rank + qk_rope_head_dim` rows, which the loader fills with
//! `torch.cat([q_a_proj, kv_a_proj_with_mqa])`; `q_a_layernorm` and `kv_a_layernorm` are
//! replicated; `q_b_proj` and `kv_b_proj` are `ColumnParallelLinear` (heads over attention tp,
//! which is tp without attention data parallelism); `o_proj` a `RowParallelLinear`. Without
//! `q_lora_rank`, `q_proj` (column) and `kv_a_proj_with_mqa` (replicated) stay apart.
//! `post_load_weights` derives `w_kc` / `w_vc` from `kv_b_proj.weight`, which stays a
//! parameter: awex writes `kv_b_proj` and `awex.sglang.receive` runs `post_load_weights`.

use awex_core::DType;
use awex_core::layout::fused_tp::{self, FusedTp, FusedTpLayout, LmHead};
use awex_core::layout::{Alike, Holder, LayoutError, RankId, RankLayout, Side, SideLayout};
use awex_core::model::{ModelSpec, Part};
use std::sync::Arc;

/// SGLang classes whose `lm_head` is the embedding module itself when the config ties them
/// (`named_parameters()` lists the embedding once): `DeepseekV2ForCausalLM.__init__`
/// (`self.lm_head = self.model.embed_tokens` at pp 1), and `models/qwen3_5_text.py`
/// `Qwen3_5ForCausalLM.__init__` (Qwen3.5 and Qwen3.5-MoE, the same at pp 1). Other MoE
/// classes (Qwen3-MoE, Qwen3-Next, GLM-4.5, Mixtral) keep their own `lm_head` whatever the
/// config says.
pub const TIED_HEAD_IS_EMBEDDING: &[&str] = &[
    "DeepseekV2ForCausalLM",
    "DeepseekV3ForCausalLM",
    "Qwen3_5ForCausalLM",
    "Qwen3_5MoeForCausalLM",
];

/// SGLang's module of MLA's fused query and key/value down projections
/// (`DeepseekV2AttentionMLA.fused_qkv_a_proj_with_mqa`).
pub const MLA_DOWN: &str = "fused_qkv_a_proj_with_mqa";

/// Where SGLang 0.5.23 holds a hybrid model's full-attention `qkv_proj`, `o_proj`, `q_norm`
/// and `k_norm`: in the decoder layer itself (`models/qwen3_next.py`
/// `Qwen3HybridAttentionDecoderLayer.__init__`, `models/qwen3_5.py`
/// `Qwen3_5AttentionDecoderLayer.__init__`; their `load_weights` drop `.self_attn` from the
/// checkpoint's names).
pub const HYBRID_ATTENTION: &str = "";

/// SGLang pads the vocabulary of `VocabParallelEmbedding` / `ParallelLMHead` to a multiple of this.
pub const VOCAB_PADDING: u64 = 64;

/// The model classes SGLang 0.5.23 builds with every decoder layer MoE, whatever the config's
/// `mlp_only_layers` and `decoder_sparse_step` say (`sglang/srt/models/qwen3_moe.py`,
/// `stage_facts`: "Qwen3MoE all layers are sparse"; Mixtral has no dense layer to begin with).
/// `models/qwen3_next.py` builds every layer of `Qwen3NextForCausalLM` with a
/// `Qwen2MoeSparseMoeBlock` too (`Qwen3HybridLinearDecoderLayer.__init__` and
/// `Qwen3HybridAttentionDecoderLayer.__init__`: "Qwen3Next all layers are sparse").
const EVERY_LAYER_MOE: &[&str] = &["Qwen3MoeForCausalLM", "Qwen3NextForCausalLM"];

/// The model classes whose SGLang 0.5.23 MoE block refuses a tensor-parallel size above the
/// routed experts: the class, that block, the config field counting the experts, and the size
/// compared. `models/deepseek_v2.py` (`DeepseekV2MoE.__init__`, which DeepSeek-V3 and Kimi-K2
/// build too) and `models/glm4_moe.py` (`Glm4MoeSparseMoeBlock.__init__`) compare the whole
/// `get_parallel().tp_size`, whatever the expert parallelism; `models/qwen3_moe.py`
/// (`Qwen3MoeSparseMoeBlock.__init__`) compares `get_parallel().moe_tp_size` (tp / ep). Each
/// raises `ValueError("Tensor parallel size {size} is greater than the number of experts {n}.")`.
/// Mixtral's block has no such check.
const TP_AT_MOST_EXPERTS: &[(&str, &str, &str, Compared)] = &[
    (
        "DeepseekV2ForCausalLM",
        "DeepseekV2MoE",
        "n_routed_experts",
        Compared::Tp,
    ),
    (
        "DeepseekV3ForCausalLM",
        "DeepseekV2MoE",
        "n_routed_experts",
        Compared::Tp,
    ),
    (
        "Glm4MoeForCausalLM",
        "Glm4MoeSparseMoeBlock",
        "n_routed_experts",
        Compared::Tp,
    ),
    (
        "Qwen3MoeForCausalLM",
        "Qwen3MoeSparseMoeBlock",
        "num_experts",
        Compared::MoeTp,
    ),
    // `models/qwen2_moe.py` `Qwen2MoeSparseMoeBlock.__init__` compares `get_parallel().tp_size`
    // (Qwen3-Next's and Qwen3.5-MoE's block)
    (
        "Qwen3NextForCausalLM",
        "Qwen2MoeSparseMoeBlock",
        "num_experts",
        Compared::Tp,
    ),
    (
        "Qwen3_5MoeForCausalLM",
        "Qwen2MoeSparseMoeBlock",
        "num_experts",
        Compared::Tp,
    ),
];

/// The model classes with a shared expert that SGLang 0.5.23 never fuses into the routed
/// experts on NVIDIA GPUs, with the reason. `models/qwen3_5.py` builds Qwen3.5-MoE's
/// `Qwen2MoeSparseMoeBlock` (`Qwen3_5LinearDecoderLayer.__init__`,
/// `Qwen3_5AttentionDecoderLayer.__init__`) without `enable_cuda_shared_expert_fusion`, and
/// `models/qwen2_moe.py` `Qwen2MoeSparseMoeBlock.__init__` fuses only when `_use_aiter or
/// (_is_cuda and enable_cuda_shared_expert_fusion)`: on ROCm with AITER alone, where
/// `Qwen3_5MoeForCausalLM.load_weights` maps `mlp.shared_expert.*` onto the extra expert
/// (`_use_aiter and not _disable_shared_experts_fusion()` in its `__init__`). Qwen3-Next's
/// layers (`models/qwen3_next.py`) pass `enable_cuda_shared_expert_fusion=True`, so it fuses on
/// CUDA at ep=1 (`can_fuse_shared_expert`: one shared expert of `moe_intermediate_size` rows, no
/// `--disable-shared-experts-fusion`, no DeepEP / MoRI).
const SHARED_EXPERT_APART_ON_NVIDIA: &[(&str, &str)] = &[(
    "Qwen3_5MoeForCausalLM",
    "models/qwen3_5.py builds its Qwen2MoeSparseMoeBlock without enable_cuda_shared_expert_fusion, so Qwen2MoeSparseMoeBlock.__init__ (models/qwen2_moe.py) fuses it only with ROCm AITER (SGLANG_USE_AITER=1 on HIP, which awex does not describe)",
)];

/// The model classes whose shared expert SGLang 0.5.23 fuses on NVIDIA under expert
/// parallelism too. `models/qwen2_moe.py` `Qwen2MoeSparseMoeBlock.__init__` turns the fusion
/// off at `moe_ep_size > 1` only for backends with per-rank shared slots
/// (`uses_per_rank_fused_shared_slots`, `layers/moe/utils.py`: DeepEP-class and MegaMoE), which
/// `can_fuse_shared_expert` rules out already or awex does not describe. With the default
/// all-to-all backend `FusedMoE.__init__` (`layers/moe/fused_moe_triton/layer.py`) then holds
/// `num_experts / ep` routed experts plus the shared expert on every EP rank
/// (`num_local_experts = _num_local_routed + num_fused_shared_experts`), and
/// `_map_global_expert_id_to_local_expert_id` sends the shared expert (global id
/// `num_experts`) to local slot `num_experts / ep` of every rank, split over the MoE-TP group
/// like the routed experts (`_load_w13` / `_load_w2`: `moe_tp_rank`'s share).
const SHARED_EXPERT_FUSED_UNDER_EP: &[&str] = &["Qwen3NextForCausalLM"];

/// Which tensor-parallel size an SGLang MoE block compares with its routed experts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Compared {
    /// the whole tensor-parallel size, `tp`
    Tp,
    /// the MoE tensor-parallel size, `moe_tp = tp / ep`
    MoeTp,
}

impl std::fmt::Display for Compared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Compared::Tp => "tp",
            Compared::MoeTp => "moe_tp = tp/ep",
        })
    }
}

/// A parallel configuration SGLang cannot run for this model.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum SglangConfigError {
    /// A size that must be at least 1 is 0.
    #[error("sglang {key}=0 is not a valid size; {key} must be at least 1")]
    Zero {
        /// the parallel key
        key: &'static str,
    },
    /// Expert parallelism must split the TP group evenly.
    #[error(
        "sglang ep={ep} must divide tp={tp}: expert parallelism splits the tensor-parallel group (moe_tp = tp / ep)"
    )]
    EpNotDividingTp {
        /// tensor-parallel size
        tp: u64,
        /// expert-parallel size
        ep: u64,
    },
    /// Query heads must split evenly over TP.
    #[error(
        "model has {heads} attention heads; sglang tp={tp} needs num_attention_heads divisible by tp"
    )]
    Heads {
        /// query heads
        heads: u64,
        /// tensor-parallel size
        tp: u64,
    },
    /// KV heads must split evenly (tp <= kv) or be replicated evenly (tp > kv).
    #[error(
        "model has {kv_heads} KV heads; sglang tp={tp} needs num_key_value_heads divisible by tp (when tp <= KV heads) or tp divisible by num_key_value_heads (when tp > KV heads)"
    )]
    KvHeads {
        /// KV heads
        kv_heads: u64,
        /// tensor-parallel size
        tp: u64,
    },
    /// The dense MLP must split evenly over TP.
    #[error("model has intermediate_size={size}; sglang tp={tp} needs it divisible by tp")]
    Intermediate {
        /// dense intermediate size
        size: u64,
        /// tensor-parallel size
        tp: u64,
    },
    /// Experts must split evenly over EP.
    #[error(
        "model has {experts} experts per MoE layer; sglang ep={ep} needs num_experts divisible by ep"
    )]
    Experts {
        /// routed experts
        experts: u64,
        /// expert-parallel size
        ep: u64,
    },
    /// A tensor-parallel size above the routed experts, which SGLang's MoE block refuses.
    #[error(
        "model has {experts} routed experts per MoE layer (`{field}`), fewer than sglang {compared} = {size} (tp={tp}, ep={ep}): SGLang 0.5.23's {class} refuses that when it builds its first MoE layer (`{module}.__init__` raises \"Tensor parallel size {size} is greater than the number of experts {experts}.\"), so the server never starts; use {compared} <= {experts}"
    )]
    TpAboveExperts {
        /// the HF class
        class: &'static str,
        /// the SGLang module that refuses it
        module: &'static str,
        /// the config field that counts the routed experts
        field: &'static str,
        /// which size the module compares
        compared: Compared,
        /// that size
        size: u64,
        /// routed experts
        experts: u64,
        /// tensor-parallel size
        tp: u64,
        /// expert-parallel size
        ep: u64,
    },
    /// Each expert's MLP must split evenly over the MoE TP group.
    #[error(
        "model has moe_intermediate_size={size}; sglang moe_tp = tp/ep = {moe_tp} (tp={tp}, ep={ep}) needs it divisible by moe_tp"
    )]
    MoeIntermediate {
        /// expert intermediate size
        size: u64,
        /// tp / ep
        moe_tp: u64,
        /// tensor-parallel size
        tp: u64,
        /// expert-parallel size
        ep: u64,
    },
    /// A model with shared experts at ep 1 (Qwen3-Next: at any ep), where SGLang may hold them
    /// fused into the routed experts or apart, and the deployment does not say which.
    #[error(
        "{class} has shared experts, which SGLang 0.5.23 at ep=1 may fuse into the routed experts (one more expert in `mlp.experts.w13_weight` / `w2_weight`): on NVIDIA GPUs of compute capability >= 8.0 and AMD MI300, unless the server runs with --disable-shared-experts-fusion, and for DeepSeek-V3 only with 256 routed experts and 1 shared expert (not Kimi-K2's 384 in bf16) unless it runs with --enforce-shared-experts-fusion; otherwise it keeps them apart (`mlp.shared_experts.gate_up_proj`; CPU, older GPUs): say which with sglang:...,fused_shared_experts=1 or fused_shared_experts=0"
    )]
    SharedExpertsFusionUnset {
        /// the HF class
        class: &'static str,
    },
    /// Qwen3-Next under expert parallelism, where SGLang may hold its shared expert fused into
    /// every EP rank's experts or apart, and the deployment does not say which.
    #[error(
        "{class} at ep={ep}: SGLang 0.5.23 on NVIDIA GPUs fuses its shared expert under expert parallelism too (with the default all-to-all backend `Qwen2MoeSparseMoeBlock.__init__` in models/qwen2_moe.py keeps the fusion, and `FusedMoE.__init__` holds one copy of the shared expert as every EP rank's last local expert in `mlp.experts.w13_weight` / `w2_weight`), unless the server runs with --disable-shared-experts-fusion or a DeepEP, MoRI or MegaMoE all-to-all (`can_fuse_shared_expert`, `uses_per_rank_fused_shared_slots`); on CPU it keeps it apart (`mlp.shared_expert.gate_up_proj`): say which with sglang:...,fused_shared_experts=1 or fused_shared_experts=0"
    )]
    SharedExpertsFusionUnsetUnderEp {
        /// the HF class
        class: &'static str,
        /// expert-parallel size
        ep: u64,
    },
    /// Fused shared experts for a class whose shared expert SGLang keeps apart on NVIDIA
    /// (`SHARED_EXPERT_APART_ON_NVIDIA`).
    #[error(
        "sglang fused_shared_experts=1 with {class}: SGLang 0.5.23 keeps {class}'s shared expert apart on NVIDIA GPUs (`mlp.shared_expert.gate_up_proj` / `down_proj`): {why}; use fused_shared_experts=0, or leave it out"
    )]
    SharedExpertApart {
        /// the HF class
        class: &'static str,
        /// why SGLang keeps it apart
        why: &'static str,
    },
    /// Fused shared experts where SGLang does not fuse them, or cannot.
    #[error(
        "sglang fused_shared_experts=1 with {why}: SGLang 0.5.23 fuses one shared expert of moe_intermediate_size rows, for DeepSeek-V3 / GLM-4.5 / Kimi-K2 at ep=1 only on NVIDIA (`shared_experts_fusion_disable_reason` in models/glm4_moe.py turns it off at ep > 1 off AMD, which awex does not describe), for Qwen3-Next at any ep with the experts split evenly over ep; use fused_shared_experts=0"
    )]
    SharedExpertsFusion {
        /// what rules the fusion out
        why: String,
    },
    /// A dense layer in a class SGLang builds with every layer MoE.
    #[error(
        "{class} in SGLang 0.5.23 builds every layer as MoE (its model file, sglang/srt/models/qwen3_moe.py or qwen3_next.py, ignores mlp_only_layers and decoder_sparse_step), but this config's `{field}` makes layer {layer} dense: SGLang cannot load such a checkpoint. Serve it with vLLM (which honours `{field}`), or train a config without dense layers"
    )]
    DenseLayerEveryLayerMoe {
        /// the HF class
        class: &'static str,
        /// the config field that makes the layer dense
        field: &'static str,
        /// the first dense layer
        layer: u64,
    },
    /// Gated DeltaNet key heads that do not split evenly over TP.
    #[error(
        "model has {key_heads} linear-attention key heads (linear_num_key_heads); sglang tp={tp} needs them divisible by tp: SGLang 0.5.23's Gated DeltaNet (models/qwen3_next.py Qwen3GatedDeltaNet, models/qwen3_5.py Qwen3_5GatedDeltaNet) splits the linear-attention heads by key-head group, num_k_heads // attn_tp_size per rank, with no replication of key heads for tp above them"
    )]
    LinearKeyHeads {
        /// linear-attention key heads
        key_heads: u64,
        /// tensor-parallel size
        tp: u64,
    },
    /// Full-attention layers SGLang cannot place: not every `k`-th layer.
    #[error(
        "{class} has full attention at layers {layers:?}; SGLang 0.5.23 places a hybrid model's full-attention layers by `full_attention_interval` alone (sglang/srt/configs/qwen3_next.py `layers_block_type`: layer l is full when (l + 1) % full_attention_interval == 0, whatever `layer_types` says), so it would build other layers than the checkpoint holds; serve a model whose full-attention layers are every k-th layer (with `full_attention_interval: k` in its config.json)"
    )]
    HybridLayers {
        /// the HF class
        class: &'static str,
        /// the full-attention layers
        layers: Vec<u64>,
    },
    /// A size or the world is above awex's limits.
    #[error(transparent)]
    Limit(#[from] awex_core::limits::LimitError),
    /// The shared fused-TP layout refused the checked sizes (not expected after the checks above).
    #[error("sglang: {0}")]
    Layout(String),
}

impl From<SglangConfigError> for LayoutError {
    fn from(e: SglangConfigError) -> Self {
        LayoutError::Config(e.to_string())
    }
}

/// The layout of SGLang engines (replicas) for one model and `tp`/`ep`/`engines`.
#[derive(Clone, Debug)]
pub struct SglangLayout(FusedTpLayout);

/// SGLang's padded vocabulary for `tp` ranks: a multiple of 64, or of 64 * tp when that does not split evenly.
pub fn padded_vocab(vocab: u64, tp: u64) -> u64 {
    let padded = vocab.div_ceil(VOCAB_PADDING) * VOCAB_PADDING;
    if padded % tp == 0 {
        padded
    } else {
        let unit = VOCAB_PADDING * tp;
        vocab.div_ceil(unit) * unit
    }
}

impl SglangLayout {
    /// Checks the config against the model and prepares the names; builds no rank. A model
    /// with shared experts needs [`SglangLayout::with_shared_experts`] at ep 1.
    pub fn new(
        spec: &ModelSpec,
        tp: u64,
        ep: u64,
        engines: u64,
    ) -> Result<Self, SglangConfigError> {
        Self::with_shared_experts(spec, tp, ep, engines, None)
    }

    /// [`SglangLayout::new`], saying whether the engine fuses shared experts into the routed
    /// experts (`None`: not said; refused for a model with shared experts at ep 1, and for
    /// Qwen3-Next at any ep).
    ///
    /// SGLang 0.5.23 decides before it builds the model (`resolve_shared_experts_config`,
    /// `layers/moe/utils.py`): fused unless `--disable-shared-experts-fusion` or the class's
    /// `shared_experts_fusion_disable_reason` (`models/glm4_moe.py`: neither CUDA of
    /// capability 8.0 or above nor HIP gfx942+, ep > 1 off HIP, DeepEP/MoRI, W4AFP8;
    /// `models/deepseek_v2.py` also: a `DeepseekV3ForCausalLM` config of 256 routed experts
    /// (384 only Quark-quantised) and one shared expert, unless
    /// `--enforce-shared-experts-fusion`). Qwen3-Next's `Qwen2MoeSparseMoeBlock`
    /// (`models/qwen2_moe.py`) decides in its `__init__` instead: fused on CUDA
    /// (`enable_cuda_shared_expert_fusion`) unless `can_fuse_shared_expert` says no; Qwen3.5-MoE's
    /// never on NVIDIA, so `Some(true)` is refused for it and `None` means apart
    /// (`SHARED_EXPERT_APART_ON_NVIDIA`). Qwen3-Next's fuses under expert parallelism too, one
    /// copy as every EP rank's last local expert (`SHARED_EXPERT_FUSED_UNDER_EP`). Fused, the
    /// loader renames
    /// `mlp.shared_experts.*` to expert `n_routed_experts` (`load_weights`,
    /// `iter_weights_with_fused_shared_experts`) and `FusedMoE` holds `n_routed_experts + 1`
    /// experts.
    pub fn with_shared_experts(
        spec: &ModelSpec,
        tp: u64,
        ep: u64,
        engines: u64,
        fused_shared_experts: Option<bool>,
    ) -> Result<Self, SglangConfigError> {
        for (key, v) in [("tp", tp), ("ep", ep), ("engines", engines)] {
            if v == 0 {
                return Err(SglangConfigError::Zero { key });
            }
        }
        awex_core::limits::check_parallel(
            "sglang",
            [("tp", tp), ("ep", ep), ("engines", engines)],
        )?;
        awex_core::limits::check_world("sglang", &[("engines", engines), ("tp", tp)])?;
        if tp % ep != 0 {
            return Err(SglangConfigError::EpNotDividingTp { tp, ep });
        }
        if spec.num_heads % tp != 0 {
            return Err(SglangConfigError::Heads {
                heads: spec.num_heads,
                tp,
            });
        }
        let kv = spec.num_kv_heads;
        let kv_split = tp <= kv && kv % tp == 0;
        let kv_replicated = tp > kv && kv > 0 && tp % kv == 0;
        // MLA: one latent key/value for every head, replicated (no KV heads to split)
        if spec.mla.is_none() && !kv_split && !kv_replicated {
            return Err(SglangConfigError::KvHeads { kv_heads: kv, tp });
        }
        if let Some(a) = &spec.linear {
            if a.num_key_heads % tp != 0 {
                return Err(SglangConfigError::LinearKeyHeads {
                    key_heads: a.num_key_heads,
                    tp,
                });
            }
            // every k-th layer, k the first full-attention layer + 1
            let full = &a.full_attention_layers;
            let every_kth = full.first().is_some_and(|&f| {
                let k = f + 1;
                *full
                    == (0..spec.num_layers)
                        .filter(|l| (l + 1) % k == 0)
                        .collect::<Vec<_>>()
            });
            if !every_kth {
                return Err(SglangConfigError::HybridLayers {
                    class: spec.architecture.hf_name(),
                    layers: full.clone(),
                });
            }
        }
        let has_dense = (0..spec.num_layers).any(|l| !spec.is_moe_layer(l));
        let class = spec.architecture.hf_name();
        if let (Some(m), true) = (&spec.moe, EVERY_LAYER_MOE.contains(&class)) {
            if let Some(layer) = (0..spec.num_layers).find(|&l| !spec.is_moe_layer(l)) {
                return Err(SglangConfigError::DenseLayerEveryLayerMoe {
                    class,
                    field: if m.mlp_only_layers.contains(&layer) {
                        "mlp_only_layers"
                    } else {
                        "decoder_sparse_step"
                    },
                    layer,
                });
            }
        }
        if has_dense && spec.intermediate_size % tp != 0 {
            return Err(SglangConfigError::Intermediate {
                size: spec.intermediate_size,
                tp,
            });
        }
        let moe_tp = tp / ep;
        match &spec.moe {
            Some(m) if (0..spec.num_layers).any(|l| spec.is_moe_layer(l)) => {
                if m.num_experts % ep != 0 {
                    return Err(SglangConfigError::Experts {
                        experts: m.num_experts,
                        ep,
                    });
                }
                if let Some(&(class, module, field, compared)) =
                    TP_AT_MOST_EXPERTS.iter().find(|c| c.0 == class)
                {
                    let size = match compared {
                        Compared::Tp => tp,
                        Compared::MoeTp => moe_tp,
                    };
                    if size > m.num_experts {
                        return Err(SglangConfigError::TpAboveExperts {
                            class,
                            module,
                            field,
                            compared,
                            size,
                            experts: m.num_experts,
                            tp,
                            ep,
                        });
                    }
                }
                if m.moe_intermediate_size % moe_tp != 0 {
                    return Err(SglangConfigError::MoeIntermediate {
                        size: m.moe_intermediate_size,
                        moe_tp,
                        tp,
                        ep,
                    });
                }
            }
            _ => {}
        }
        fused_tp::check_mapped(spec).map_err(|e| SglangConfigError::Layout(e.to_string()))?;
        if ep > 1
            && let Some(why) = fused_tp::stacked_experts_refusal(
                spec,
                "SGLang 0.5.23",
                &format!(
                    "ep={ep} cannot be loaded: `FusedMoE.weight_loader_fused` copies every expert of the fused bf16 `gate_up_proj` / `down_proj` into the rank's `num_experts / ep` experts and fails (\"The size of tensor a ... must match the size of tensor b\"); use ep=1 (the experts' intermediate size split over tp)"
                ),
            )
        {
            return Err(SglangConfigError::Layout(why));
        }
        let shared = spec.moe.as_ref().map_or(0, |m| m.shared_intermediate_size);
        let apart_on_nvidia = SHARED_EXPERT_APART_ON_NVIDIA.iter().find(|c| c.0 == class);
        let fused_shared = if spec.has(Part::SharedGate) {
            let fused_under_ep = SHARED_EXPERT_FUSED_UNDER_EP.contains(&class);
            match fused_shared_experts {
                None if ep == 1 && apart_on_nvidia.is_none() => {
                    return Err(SglangConfigError::SharedExpertsFusionUnset {
                        class: spec.architecture.hf_name(),
                    });
                }
                None if fused_under_ep => {
                    return Err(SglangConfigError::SharedExpertsFusionUnsetUnderEp { class, ep });
                }
                None | Some(false) => false,
                Some(true) if apart_on_nvidia.is_some() => {
                    return Err(SglangConfigError::SharedExpertApart {
                        class,
                        why: apart_on_nvidia.map_or("", |c| c.1),
                    });
                }
                Some(true) => {
                    let m = spec.moe.as_ref().map_or(0, |m| m.moe_intermediate_size);
                    if ep != 1 && !fused_under_ep {
                        return Err(SglangConfigError::SharedExpertsFusion {
                            why: format!("{class} at ep={ep}"),
                        });
                    }
                    if shared != m {
                        return Err(SglangConfigError::SharedExpertsFusion {
                            why: format!(
                                "shared experts of {shared} rows (moe_intermediate_size={m})"
                            ),
                        });
                    }
                    true
                }
            }
        } else {
            false
        };
        if !fused_shared && shared % tp != 0 {
            return Err(SglangConfigError::Layout(format!(
                "model has shared experts of intermediate size {shared}; sglang tp={tp} needs it divisible by tp"
            )));
        }
        let vocab_rows = padded_vocab(spec.vocab_size, tp) / tp;
        // tied dense classes: `lm_head` is the embedding module, listed once; the Qwen3-MoE class
        // keeps a separate `lm_head.weight` holding the tied embedding
        let lm_head = if !spec.tie_word_embeddings {
            LmHead::Own(Arc::from("lm_head.weight"))
        } else if TIED_HEAD_IS_EMBEDDING.contains(&spec.architecture.hf_name()) {
            LmHead::Absent
        } else if spec.moe.is_some() {
            LmHead::Tied(Arc::from("model.embed_tokens.weight"))
        } else {
            LmHead::Absent
        };
        let inner = FusedTpLayout::new(
            spec,
            FusedTp {
                tp,
                ep,
                engines,
                vocab_rows,
                lm_head,
                routed_experts: "",
                drops: &[],
                fused_shared_experts: fused_shared,
                mla_down: MLA_DOWN,
                hybrid_attention: HYBRID_ATTENTION,
                // gpt-oss (`FusedMoE` with biases, `models/gpt_oss.py`): `w13_weight_bias` /
                // `w2_weight_bias`; `GptOssAttention.__init__` builds the sinks in bf16
                // whatever the model's dtype (fp32 only for the `trtllm_mha` backend)
                expert_biases: ["w13_weight_bias", "w2_weight_bias"],
                sinks_dtype: Some(DType::Bf16),
                local_names: &[],
            },
        )
        .map_err(|e| SglangConfigError::Layout(e.to_string()))?;
        Ok(SglangLayout(inner))
    }

    /// Tensor-parallel size of each engine.
    pub fn tp(&self) -> u32 {
        self.0.tp()
    }

    /// Padded vocabulary rows held by each TP rank.
    pub fn vocab_rows_per_rank(&self) -> u64 {
        self.0.vocab_rows_per_rank()
    }
}

impl SideLayout for SglangLayout {
    fn side(&self) -> Side {
        self.0.side()
    }

    fn ranks(&self) -> Vec<RankId> {
        self.0.ranks()
    }

    fn world_size(&self) -> usize {
        self.0.world_size()
    }

    fn engines(&self) -> u32 {
        self.0.engines()
    }

    fn rank_layout(&self, rank: RankId) -> Option<RankLayout> {
        self.0.rank_layout(rank)
    }

    fn holders(&self, canonical: &str) -> Vec<Holder> {
        self.0.holders(canonical)
    }

    fn alike(&self, canonical: &str) -> Option<Alike> {
        self.0.alike(canonical)
    }

    fn for_each_canonical(&self, rank: RankId, f: &mut dyn FnMut(&str)) -> bool {
        self.0.for_each_canonical(rank, f)
    }
}
