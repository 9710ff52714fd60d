//! vLLM's tensor-parallel layout: what every rank of every engine holds, in vLLM's own names.
//!
//! A layout is a pure function of `(ModelSpec, tp, ep, engines)`. [`VllmLayout`] answers both
//! directions lazily: [`SideLayout::rank_layout`] builds one rank's tensors, and
//! [`SideLayout::holders`] derives every shard of one canonical tensor from the sharding rules,
//! without building any rank.
//!
//! The rules, each from vLLM 0.33.0's source (paths relative to the `vllm/` package):
//!
//! - `qkv_proj` (`model_executor/layers/linear.py`, `QKVParallelLinear.__init__` and
//!   `weight_loader`): q heads split over tp; when `tp >= num_kv_heads` every rank holds one KV
//!   head, `num_kv_head_replicas = tp / num_kv_heads`, and rank `r` loads KV head
//!   `r // num_kv_head_replicas`; rows are `[q | k | v]`.
//! - `gate_up_proj` (`MergedColumnParallelLinear`): `[gate | up]` rows of rank `r`;
//!   `o_proj` / `down_proj` (`RowParallelLinear`): columns of rank `r`.
//! - `embed_tokens` / `lm_head` (`model_executor/layers/vocab_parallel_embedding.py`):
//!   `pad_vocab_size` rounds the vocabulary up to a multiple of `DEFAULT_VOCAB_PADDING_SIZE = 64`,
//!   then `num_embeddings_per_partition = divide(padded, tp)` (an assertion: vLLM has no
//!   `64 * tp` fallback, unlike SGLang); rank `r` holds rows `[r*per, min((r+1)*per, vocab))` at
//!   local row 0 and zero padding after them.
//! - tied embeddings (`ParallelLMHead.tie_weights` -> `UnquantizedEmbeddingMethod.tie_weights`:
//!   `layer.weight = embed_tokens.weight`): the same `Parameter`, so `named_parameters()` lists
//!   `model.embed_tokens.weight` once, for dense and MoE classes alike (`models/qwen3.py`,
//!   `models/qwen3_moe.py`, `models/llama.py`).
//! - experts (`model_executor/layers/fused_moe/`): `FusedMoEFactory` returns a `MoERunner`
//!   (`runner/moe_runner.py`) whose `routed_experts` submodule holds `w13_weight`
//!   `[local_experts, 2 * inter, hidden]` (`[gate | up]`) and `w2_weight`
//!   `[local_experts, hidden, inter]` (`unquantized_fused_moe_method.py`, `create_weights`).
//!   Without expert parallelism every rank holds every expert, `inter` split over tp; with
//!   `--enable-expert-parallel` `FusedMoEParallelConfig.make` (`config.py`) sets `ep_size = tp`
//!   and the experts' tp to 1, and `determine_expert_map` (`expert_map_manager.py`, the default
//!   `linear` placement) gives rank `r` `num_experts // ep (+1 for r < num_experts % ep)`
//!   consecutive experts.
//! - parameters a class does not build ([`CLASS_DROPS`]): `models/qwen3.py` and
//!   `models/qwen3_moe.py` build `o_proj` as `RowParallelLinear(..., bias=False)` whatever
//!   `attention_bias` says, and `AutoWeightsLoader` (`models/utils.py`) ignores an unexpected
//!   `.bias`, so a Qwen3 checkpoint's `o_proj.bias` is dropped; `models/llama.py` keeps it
//!   (`bias_o_proj = attention_bias`).
//! - multi-head latent attention (`models/deepseek_v2.py`, `DeepseekV2MLAAttention`; DeepSeek-V2,
//!   V3, Kimi-K2): with `q_lora_rank`, `self_attn.fused_qkv_a_proj` is a
//!   `DeepSeekV2FusedQkvAProjLinear` (a `MergedColumnParallelLinear` with `disable_tp=True`:
//!   whole on every rank) of `[q_lora_rank, kv_lora_rank + qk_rope_head_dim]` rows, filled by
//!   `load_weights` from `q_a_proj` (shard 0) and `kv_a_proj_with_mqa` (shard 1); without it,
//!   `q_proj` (`ColumnParallelLinear`) and `kv_a_proj_with_mqa` (`ReplicatedLinear`) apart;
//!   `q_a_layernorm` / `kv_a_layernorm` replicated; `q_b_proj`, `kv_b_proj` column-parallel by
//!   heads, `o_proj` row-parallel. The router `mlp.gate` (`GateLinear`) keeps the model's dtype
//!   (`moe_router_dtype` unset), its `e_score_correction_bias` is fp32 (`topk_method: noaux_tc`).
//! - classes that build their own `lm_head` whatever `tie_word_embeddings` says
//!   ([`OWN_HEAD_WHEN_TIED`]): `DeepseekV2ForCausalLM.__init__` always builds a
//!   `ParallelLMHead` and its `load_weights` never ties it, so a tied checkpoint leaves it
//!   unwritten there; awex writes the tied embedding into it.
//! - block FP8 (`quantization_config` with `weight_block_size`; `awex_core::encoding::Fp8Side`
//!   marks the tensors): `Fp8LinearMethod` / `Fp8MoEMethod.create_weights`
//!   (`model_executor/layers/quantization/fp8.py`) keep every name and shape above, store the
//!   weight as `float8_e4m3fn` and add an fp32 `weight_scale_inv` (`w13_weight_scale_inv`,
//!   `w2_weight_scale_inv` for the expert stacks) of `ceil(rows / block_n) x ceil(cols /
//!   block_k)` blocks per matrix; besides the linear weights, a class may quantise more
//!   ([`CLASS_FP8_PARTS`]: Qwen3-MoE's router).

use awex_core::layout::fused_tp::{self, FusedTp, FusedTpLayout, LmHead};
use awex_core::layout::{Alike, Holder, LayoutError, RankId, RankLayout, Side, SideLayout};
use awex_core::model::{ModelSpec, Part};
use std::sync::Arc;

/// The parts of a model that vLLM 0.33's class for its HF class builds no parameter for (facts
/// of vLLM's model files, cited in the module docs): those tensors are dropped by vLLM's load.
pub const CLASS_DROPS: &[(&str, &[Part])] = &[
    ("Qwen3ForCausalLM", &[Part::OBias]),
    ("Qwen3MoeForCausalLM", &[Part::OBias]),
];

/// The parts that vLLM 0.33's class for an HF class stores as block FP8 in an FP8 checkpoint,
/// beyond the linear weights every engine quantises (`Part::fp8_linear`): `models/qwen3_moe.py`
/// builds the router `mlp.gate` as `GateLinear(..., quant_config=quant_config)`, so
/// `Fp8Config.get_quant_method` gives it an `Fp8LinearMethod` (e4m3 `weight` and fp32
/// `weight_scale_inv`) unless `ignored_layers` / `modules_to_not_convert` names it (a checkpoint
/// that keeps its routers unquantised must list them there); the other classes build their router
/// without `quant_config` (`qwen2_moe.py`, `glm4_moe.py`, `deepseek_v2.py`, `mixtral.py`), as
/// SGLang 0.5.23 builds every router.
pub const CLASS_FP8_PARTS: &[(&str, &[Part])] = &[("Qwen3MoeForCausalLM", &[Part::Router])];

/// vLLM 0.33 classes with their own `lm_head.weight` even for a tied config (module docs).
pub const OWN_HEAD_WHEN_TIED: &[&str] = &["DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM"];

/// vLLM's module of MLA's fused query and key/value down projections.
pub const MLA_DOWN: &str = "fused_qkv_a_proj";

/// vLLM pads the vocabulary of `VocabParallelEmbedding` / `ParallelLMHead` to a multiple of this
/// (`DEFAULT_VOCAB_PADDING_SIZE`, `model_executor/layers/vocab_parallel_embedding.py`).
pub const VOCAB_PADDING: u64 = 64;

/// The submodule of a `MoERunner` that holds the expert weights (`FusedMoEFactory`,
/// `model_executor/layers/fused_moe/layer.py`; `routed_experts_prefix` there).
pub const ROUTED_EXPERTS: &str = "routed_experts";

/// Where vLLM 0.33 holds a hybrid model's full-attention `qkv_proj`, `o_proj`, `q_norm` and
/// `k_norm`: `self_attn` (`models/qwen3_next.py` `Qwen3NextDecoderLayer.__init__`:
/// `self.self_attn = Qwen3NextAttention(...)`, whose `qkv_proj` is a `QKVParallelLinear` of
/// `num_attention_heads * (1 + attn_output_gate)` query heads).
pub const HYBRID_ATTENTION: &str = "self_attn";

/// The classes whose MoE block is vLLM 0.33's `Qwen3NextSparseMoeBlock` (`models/qwen3_next.py`;
/// `models/qwen3_5.py` builds it for Qwen3.5-MoE), which refuses `tp > num_experts`.
/// What vLLM 0.33's gpt-oss class names differently from the checkpoint (`models/gpt_oss.py`:
/// the decoder layer's attention is `self.attn`, its sinks `attn.sinks`, the embedding
/// `self.embedding`; `load_weights` maps `.self_attn.` to `.attn.`).
const GPT_OSS_NAMES: &[(&str, &str)] = &[
    (".self_attn.", ".attn."),
    ("model.embed_tokens.", "model.embedding."),
];

const QWEN3_NEXT_MOE_BLOCK: &[&str] = &["Qwen3NextForCausalLM", "Qwen3_5MoeForCausalLM"];

/// A parallel configuration vLLM cannot run for this model.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum VllmConfigError {
    /// A size that must be at least 1 is 0.
    #[error("vllm {key}=0 is not a valid size; {key} must be at least 1")]
    Zero {
        /// the parallel key
        key: &'static str,
    },
    /// vLLM's expert parallelism is all of the TP group or nothing.
    #[error(
        "vllm ep={ep} with tp={tp}: vLLM's --enable-expert-parallel spreads the experts over the whole TP group (ep_size = tp_size), so ep must be 1 or {tp}"
    )]
    EpNotTp {
        /// tensor-parallel size
        tp: u64,
        /// expert-parallel size
        ep: u64,
    },
    /// Query heads must split evenly over TP.
    #[error(
        "model has {heads} attention heads; vllm tp={tp} needs num_attention_heads divisible by tp"
    )]
    Heads {
        /// query heads
        heads: u64,
        /// tensor-parallel size
        tp: u64,
    },
    /// KV heads must split evenly (tp <= kv) or be replicated evenly (tp > kv).
    #[error(
        "model has {kv_heads} KV heads; vllm tp={tp} needs num_key_value_heads divisible by tp (when tp <= KV heads) or tp divisible by num_key_value_heads (when tp > KV heads)"
    )]
    KvHeads {
        /// KV heads
        kv_heads: u64,
        /// tensor-parallel size
        tp: u64,
    },
    /// The dense MLP must split evenly over TP.
    #[error("model has intermediate_size={size}; vllm tp={tp} needs it divisible by tp")]
    Intermediate {
        /// dense intermediate size
        size: u64,
        /// tensor-parallel size
        tp: u64,
    },
    /// Every EP rank must hold at least one expert.
    #[error(
        "model has {experts} experts per MoE layer; vllm ep={ep} would leave an EP rank without experts (needs num_experts >= ep)"
    )]
    Experts {
        /// routed experts
        experts: u64,
        /// expert-parallel size
        ep: u64,
    },
    /// Each expert's MLP must split evenly over the MoE TP group.
    #[error(
        "model has moe_intermediate_size={size}; vllm moe_tp = tp/ep = {moe_tp} (tp={tp}, ep={ep}) needs it divisible by moe_tp"
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
    /// The padded vocabulary must split evenly over TP (`divide` in `vocab_parallel_embedding.py`).
    #[error(
        "model has vocab_size={vocab}, padded by vLLM to {padded} (a multiple of 64); vllm tp={tp} needs the padded vocabulary divisible by tp"
    )]
    Vocab {
        /// vocabulary
        vocab: u64,
        /// padded vocabulary
        padded: u64,
        /// tensor-parallel size
        tp: u64,
    },
    /// Gated DeltaNet key heads that do not split evenly over TP.
    #[error(
        "model has {key_heads} linear-attention key heads (linear_num_key_heads); vllm tp={tp} needs them divisible by tp: vLLM 0.33's QwenGatedDeltaNetAttention (model_executor/layers/mamba/gdn/qwen_gdn_linear_attn.py) splits the linear-attention heads by key-head group, num_k_heads // tp_size per rank, with no replication of key heads for tp above them"
    )]
    LinearKeyHeads {
        /// linear-attention key heads
        key_heads: u64,
        /// tensor-parallel size
        tp: u64,
    },
    /// A tensor-parallel size above the routed experts, which vLLM's Qwen3-Next MoE block refuses.
    #[error(
        "model has {experts} routed experts per MoE layer, fewer than vllm tp={tp}: vLLM 0.33's Qwen3NextSparseMoeBlock.__init__ (models/qwen3_next.py, Qwen3.5-MoE's block too) raises \"Tensor parallel size {tp} is greater than the number of experts {experts}.\"; use tp <= {experts}"
    )]
    TpAboveExperts {
        /// routed experts
        experts: u64,
        /// tensor-parallel size
        tp: u64,
    },
    /// A size or the world is above awex's limits.
    #[error(transparent)]
    Limit(#[from] awex_core::limits::LimitError),
    /// The shared fused-TP layout refused the checked sizes (not expected after the checks above).
    #[error("vllm: {0}")]
    Layout(String),
}

impl From<VllmConfigError> for LayoutError {
    fn from(e: VllmConfigError) -> Self {
        LayoutError::Config(e.to_string())
    }
}

/// The layout of vLLM engines (replicas) for one model and `tp`/`ep`/`engines`: the fused-TP
/// layout ([`FusedTpLayout`]) with vLLM's vocabulary padding, its tied head (absent) and its
/// expert module.
#[derive(Clone, Debug)]
pub struct VllmLayout(FusedTpLayout, &'static [Part]);

/// vLLM's padded vocabulary (`pad_vocab_size`): a multiple of 64, whatever `tp` is.
pub fn padded_vocab(vocab: u64) -> u64 {
    vocab.div_ceil(VOCAB_PADDING) * VOCAB_PADDING
}

/// Experts of EP rank `r` under vLLM's `linear` placement: `(first, count)`
/// (`determine_expert_map`, `model_executor/layers/fused_moe/expert_map_manager.py`).
pub fn expert_range(experts: u64, ep: u64, r: u64) -> (u64, u64) {
    fused_tp::expert_range(experts, ep, r)
}

impl VllmLayout {
    /// Checks the config against the model and prepares the names; builds no rank.
    pub fn new(spec: &ModelSpec, tp: u64, ep: u64, engines: u64) -> Result<Self, VllmConfigError> {
        for (key, v) in [("tp", tp), ("ep", ep), ("engines", engines)] {
            if v == 0 {
                return Err(VllmConfigError::Zero { key });
            }
        }
        awex_core::limits::check_parallel("vllm", [("tp", tp), ("ep", ep), ("engines", engines)])?;
        awex_core::limits::check_world("vllm", &[("engines", engines), ("tp", tp)])?;
        if ep != 1 && ep != tp {
            return Err(VllmConfigError::EpNotTp { tp, ep });
        }
        if spec.num_heads % tp != 0 {
            return Err(VllmConfigError::Heads {
                heads: spec.num_heads,
                tp,
            });
        }
        let kv = spec.num_kv_heads;
        let kv_split = tp <= kv && kv % tp == 0;
        let kv_replicated = tp > kv && kv > 0 && tp % kv == 0;
        // MLA: one latent key/value for every head, replicated (no KV heads to split)
        if spec.mla.is_none() && !kv_split && !kv_replicated {
            return Err(VllmConfigError::KvHeads { kv_heads: kv, tp });
        }
        if let Some(a) = &spec.linear
            && a.num_key_heads % tp != 0
        {
            return Err(VllmConfigError::LinearKeyHeads {
                key_heads: a.num_key_heads,
                tp,
            });
        }
        let has_dense = (0..spec.num_layers).any(|l| !spec.is_moe_layer(l));
        if has_dense && spec.intermediate_size % tp != 0 {
            return Err(VllmConfigError::Intermediate {
                size: spec.intermediate_size,
                tp,
            });
        }
        let moe_tp = tp / ep;
        match &spec.moe {
            Some(m) if (0..spec.num_layers).any(|l| spec.is_moe_layer(l)) => {
                if m.num_experts < ep {
                    return Err(VllmConfigError::Experts {
                        experts: m.num_experts,
                        ep,
                    });
                }
                if QWEN3_NEXT_MOE_BLOCK.contains(&spec.architecture.hf_name()) && tp > m.num_experts
                {
                    return Err(VllmConfigError::TpAboveExperts {
                        experts: m.num_experts,
                        tp,
                    });
                }
                if m.moe_intermediate_size % moe_tp != 0 {
                    return Err(VllmConfigError::MoeIntermediate {
                        size: m.moe_intermediate_size,
                        moe_tp,
                        tp,
                        ep,
                    });
                }
            }
            _ => {}
        }
        let padded = padded_vocab(spec.vocab_size);
        if padded % tp != 0 {
            return Err(VllmConfigError::Vocab {
                vocab: spec.vocab_size,
                padded,
                tp,
            });
        }
        let vocab_rows = padded / tp;
        let lm_head = if spec.tie_word_embeddings
            && OWN_HEAD_WHEN_TIED.contains(&spec.architecture.hf_name())
        {
            LmHead::Tied(Arc::from("model.embed_tokens.weight"))
        } else if spec.tie_word_embeddings {
            LmHead::Absent
        } else {
            LmHead::Own(Arc::from("lm_head.weight"))
        };
        let inner = FusedTpLayout::new(
            spec,
            FusedTp {
                tp,
                ep,
                engines,
                vocab_rows,
                lm_head,
                routed_experts: ROUTED_EXPERTS,
                drops: CLASS_DROPS
                    .iter()
                    .find(|(class, _)| *class == spec.architecture.hf_name())
                    .map_or(&[], |(_, parts)| parts),
                // `resolve_layer_fused_shared_expert` (fused_moe/utils.py) fuses shared experts
                // only with ROCm AITER; on NVIDIA and CPU they stay a `shared_experts` MLP
                fused_shared_experts: false,
                mla_down: MLA_DOWN,
                hybrid_attention: HYBRID_ATTENTION,
                // `GptOssRoutedExperts`: `w13_bias` / `w2_bias`; sinks in the model's dtype
                // (`make_attention_sink`)
                expert_biases: ["w13_bias", "w2_bias"],
                sinks_dtype: None,
                local_names: if spec.has(Part::ExpertsGateUp) {
                    GPT_OSS_NAMES
                } else {
                    &[]
                },
            },
        )
        .map_err(|e| VllmConfigError::Layout(e.to_string()))?;
        let fp8_parts = CLASS_FP8_PARTS
            .iter()
            .find(|(class, _)| *class == spec.architecture.hf_name())
            .map_or(&[][..], |(_, parts)| parts);
        Ok(VllmLayout(inner, fp8_parts))
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

impl SideLayout for VllmLayout {
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

    fn dropped(&self) -> Vec<String> {
        self.0.dropped()
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

    fn fp8_extra_parts(&self) -> &[Part] {
        self.1
    }
}
