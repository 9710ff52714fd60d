//! The vocabulary every family and every backend shares: the parts a decoder model can have,
//! how tensor parallelism splits each one (its role), and which parts engines fuse into one
//! tensor (engine-neutral fusion groups).
//!
//! A family file lists its parts with their shapes ([`super::family`]); a backend maps
//! (part, role, fusion) to its own names and shards. Neither spells the other's names.

/// A part of a decoder model, without its layer or expert index.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Part {
    /// The token embedding `[vocab, hidden]`.
    Embed,
    /// The output projection `[vocab, hidden]` (absent when tied to the embedding).
    LmHead,
    /// The norm after the last layer.
    FinalNorm,
    /// The norm before attention.
    InputNorm,
    /// The norm before the MLP.
    PostNorm,
    /// Query projection `[heads * head_dim, hidden]`.
    Q,
    /// Key projection `[kv_heads * head_dim, hidden]`.
    K,
    /// Value projection `[kv_heads * head_dim, hidden]`.
    V,
    /// Query bias.
    QBias,
    /// Key bias.
    KBias,
    /// Value bias.
    VBias,
    /// Attention output projection `[hidden, heads * head_dim]`.
    O,
    /// Attention output bias `[hidden]` (added once, after the row-parallel reduction).
    OBias,
    /// Per-head query norm `[head_dim]`.
    QNorm,
    /// Per-head key norm `[head_dim]`.
    KNorm,
    /// MLA: query down projection `[q_lora_rank, hidden]`.
    QDown,
    /// MLA: norm after the query down projection `[q_lora_rank]`.
    QDownNorm,
    /// MLA: query up projection `[heads * qk_head_dim, q_lora_rank]`.
    QUp,
    /// MLA: key/value down projection with the rope part `[kv_lora_rank + rope_dim, hidden]`.
    KvDown,
    /// MLA: norm after the key/value down projection `[kv_lora_rank]`.
    KvDownNorm,
    /// MLA: key/value up projection `[heads * (nope_dim + v_dim), kv_lora_rank]`.
    KvUp,
    /// Dense MLP gate projection `[intermediate, hidden]`.
    Gate,
    /// Dense MLP up projection `[intermediate, hidden]`.
    Up,
    /// Dense MLP down projection `[hidden, intermediate]`.
    Down,
    /// MoE router `[experts, hidden]`.
    Router,
    /// MoE router score correction bias `[experts]`.
    RouterBias,
    /// One routed expert's gate projection `[moe_intermediate, hidden]`.
    ExpertGate,
    /// One routed expert's up projection `[moe_intermediate, hidden]`.
    ExpertUp,
    /// One routed expert's down projection `[hidden, moe_intermediate]`.
    ExpertDown,
    /// Shared experts' gate projection `[shared_intermediate, hidden]`.
    SharedGate,
    /// Shared experts' up projection `[shared_intermediate, hidden]`.
    SharedUp,
    /// Shared experts' down projection `[hidden, shared_intermediate]`.
    SharedDown,
    /// The sigmoid gate of the shared expert's output `[1, hidden]` (Qwen3-Next, Qwen3.5-MoE:
    /// `mlp.shared_expert_gate`).
    SharedExpertGate,
    /// Gated DeltaNet (linear attention): the fused input projection of Qwen3-Next,
    /// `[2 * key_dim + 2 * value_dim, hidden]`, rows grouped by key head: for each key head
    /// `[q (key_head_dim) | k (key_head_dim) | v | z (value heads per key head * value_head_dim each)]`.
    LinQkvz,
    /// Gated DeltaNet: Qwen3-Next's fused `[b | a]` projection `[2 * value_heads, hidden]`, rows
    /// grouped by key head: for each key head `[b | a]` (value heads per key head each).
    LinBa,
    /// Gated DeltaNet: Qwen3.5's query/key/value projection `[2 * key_dim + value_dim, hidden]`,
    /// rows `[q (all key heads) | k (all key heads) | v (all value heads)]`.
    LinQkv,
    /// Gated DeltaNet: Qwen3.5's output-gate projection `[value_dim, hidden]`.
    LinZ,
    /// Gated DeltaNet: Qwen3.5's beta projection `[value_heads, hidden]`.
    LinB,
    /// Gated DeltaNet: Qwen3.5's alpha projection `[value_heads, hidden]`.
    LinA,
    /// Gated DeltaNet: the depthwise causal convolution `[2 * key_dim + value_dim, 1, kernel]`,
    /// channels `[q | k | v]` (all heads each).
    LinConv,
    /// Gated DeltaNet: per-value-head `A_log` `[value_heads]` (fp32).
    LinALog,
    /// Gated DeltaNet: per-value-head `dt_bias` `[value_heads]`.
    LinDtBias,
    /// Gated DeltaNet: the gated RMS norm of one value head `[value_head_dim]`.
    LinNorm,
    /// Gated DeltaNet: the output projection `[hidden, value_dim]`.
    LinOut,
    /// Per-head attention sink logits `[heads]` (gpt-oss: `self_attn.sinks`, one learned
    /// logit per query head that joins the softmax's denominator).
    Sinks,
    /// All routed experts' gate and up projections of a layer in one tensor, transposed and
    /// interleaved (gpt-oss: `mlp.experts.gate_up_proj` `[experts, hidden, 2 * moe_intermediate]`;
    /// column `2j` is gate row `j`, column `2j + 1` up row `j`).
    ExpertsGateUp,
    /// All routed experts' gate and up biases `[experts, 2 * moe_intermediate]`, interleaved as
    /// [`Part::ExpertsGateUp`]'s last dim (gpt-oss: `mlp.experts.gate_up_proj_bias`).
    ExpertsGateUpBias,
    /// All routed experts' down projections of a layer in one tensor, transposed (gpt-oss:
    /// `mlp.experts.down_proj` `[experts, moe_intermediate, hidden]`).
    ExpertsDown,
    /// All routed experts' down biases `[experts, hidden]` (gpt-oss: `mlp.experts.down_proj_bias`;
    /// added once, after the expert-TP reduction).
    ExpertsDownBias,
}

/// How tensor parallelism splits a part (engines agree on these; their padding and fusions
/// differ).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Role {
    /// Vocabulary-parallel: rows split over TP (padded by each engine).
    Vocab,
    /// Column-parallel: output rows (dim 0; a bias's only dim) split over TP.
    Column,
    /// Row-parallel: input columns (dim 1) split over TP.
    Row,
    /// The same on every TP rank (norms, routers, biases added after a reduction).
    Replicated,
    /// One routed expert's matrix: experts split over EP, then column- or row-parallel over
    /// expert TP.
    Expert(Split),
    /// All routed experts of a layer in one tensor, experts along dim 0 (gpt-oss): experts
    /// split over EP, then dim `tp_dim` (the expert intermediate size, or the interleaved
    /// gate/up pairs of it) in contiguous chunks over expert TP; `None`: the same on every
    /// expert-TP rank (a bias added once after the reduction).
    StackedExperts {
        /// The dim split over expert TP, `None` when none is.
        tp_dim: Option<u8>,
    },
}

/// The TP direction of an expert matrix.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Split {
    /// Output rows split.
    Column,
    /// Input columns split.
    Row,
}

/// An engine-neutral fusion group: parts that engines hold as one tensor, concatenated in the
/// group's slot order along dim 0 (per TP rank).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Fusion {
    /// q, k, v projections.
    Qkv,
    /// q, k, v biases.
    QkvBias,
    /// Dense gate and up projections.
    GateUp,
    /// A routed expert's gate and up projections.
    ExpertGateUp,
    /// Shared experts' gate and up projections.
    SharedGateUp,
    /// MLA's query down and key/value down projections (both replicated).
    MlaDown,
}

impl Part {
    /// How tensor parallelism splits this part.
    pub const fn role(self) -> Role {
        use Part::*;
        match self {
            Embed | LmHead => Role::Vocab,
            Q | K | V | QBias | KBias | VBias | QUp | KvUp | Gate | Up | SharedGate | SharedUp
            | LinQkvz | LinBa | LinQkv | LinZ | LinB | LinA | LinConv | LinALog | LinDtBias
            | Sinks => Role::Column,
            O | Down | SharedDown | LinOut => Role::Row,
            FinalNorm | InputNorm | PostNorm | OBias | QNorm | KNorm | QDown | QDownNorm
            | KvDown | KvDownNorm | Router | RouterBias | SharedExpertGate | LinNorm => {
                Role::Replicated
            }
            ExpertGate | ExpertUp => Role::Expert(Split::Column),
            ExpertDown => Role::Expert(Split::Row),
            // [experts, hidden, 2I]: the interleaved (gate, up) pairs split by contiguous
            // chunks of the last dim, as SGLang 0.5.23 narrows its transposed copy
            // (`FusedMoE._load_w13`, `shard_dim` 1 of `[experts, 2I, hidden]`)
            ExpertsGateUp => Role::StackedExperts { tp_dim: Some(2) },
            ExpertsGateUpBias => Role::StackedExperts { tp_dim: Some(1) },
            // [experts, I, hidden]: the intermediate rows
            ExpertsDown => Role::StackedExperts { tp_dim: Some(1) },
            ExpertsDownBias => Role::StackedExperts { tp_dim: None },
        }
    }

    /// The fusion group this part belongs to and its slot in it.
    pub const fn fusion(self) -> Option<(Fusion, u8)> {
        use Part::*;
        Some(match self {
            Q => (Fusion::Qkv, 0),
            K => (Fusion::Qkv, 1),
            V => (Fusion::Qkv, 2),
            QBias => (Fusion::QkvBias, 0),
            KBias => (Fusion::QkvBias, 1),
            VBias => (Fusion::QkvBias, 2),
            Gate => (Fusion::GateUp, 0),
            Up => (Fusion::GateUp, 1),
            ExpertGate => (Fusion::ExpertGateUp, 0),
            ExpertUp => (Fusion::ExpertGateUp, 1),
            SharedGate => (Fusion::SharedGateUp, 0),
            SharedUp => (Fusion::SharedGateUp, 1),
            QDown => (Fusion::MlaDown, 0),
            KvDown => (Fusion::MlaDown, 1),
            _ => return None,
        })
    }

    /// Whether an FP8 block checkpoint stores this part quantised: the linear weights of
    /// attention (MLA's included), the dense MLP, the routed and the shared experts. The
    /// embedding, `lm_head`, norms, biases, the router and its bias keep their dtype (as in
    /// DeepSeek-V3's and Qwen3's FP8 checkpoints, and as SGLang's and vLLM's FP8 methods create
    /// them: only `LinearBase` and `FusedMoE` layers get FP8 weights).
    pub const fn fp8_linear(self) -> bool {
        use Part::*;
        matches!(
            self,
            Q | K
                | V
                | O
                | QDown
                | QUp
                | KvDown
                | KvUp
                | Gate
                | Up
                | Down
                | ExpertGate
                | ExpertUp
                | ExpertDown
                | SharedGate
                | SharedUp
                | SharedDown
        )
    }

    /// Whether the part belongs to one decoder layer.
    pub const fn per_layer(self) -> bool {
        !matches!(self, Part::Embed | Part::LmHead | Part::FinalNorm)
    }

    /// Whether the part belongs to one routed expert of a layer.
    pub const fn per_expert(self) -> bool {
        matches!(self, Part::ExpertGate | Part::ExpertUp | Part::ExpertDown)
    }

    /// A short lowercase name for messages (`q_bias`, `expert_gate`).
    pub const fn label(self) -> &'static str {
        use Part::*;
        match self {
            Embed => "embed",
            LmHead => "lm_head",
            FinalNorm => "final_norm",
            InputNorm => "input_norm",
            PostNorm => "post_norm",
            Q => "q",
            K => "k",
            V => "v",
            QBias => "q_bias",
            KBias => "k_bias",
            VBias => "v_bias",
            O => "o",
            OBias => "o_bias",
            QNorm => "q_norm",
            KNorm => "k_norm",
            QDown => "q_down",
            QDownNorm => "q_down_norm",
            QUp => "q_up",
            KvDown => "kv_down",
            KvDownNorm => "kv_down_norm",
            KvUp => "kv_up",
            Gate => "gate",
            Up => "up",
            Down => "down",
            Router => "router",
            RouterBias => "router_bias",
            ExpertGate => "expert_gate",
            ExpertUp => "expert_up",
            ExpertDown => "expert_down",
            SharedGate => "shared_gate",
            SharedUp => "shared_up",
            SharedDown => "shared_down",
            SharedExpertGate => "shared_expert_gate",
            LinQkvz => "linear_qkvz",
            LinBa => "linear_ba",
            LinQkv => "linear_qkv",
            LinZ => "linear_z",
            LinB => "linear_b",
            LinA => "linear_a",
            LinConv => "linear_conv1d",
            LinALog => "linear_a_log",
            LinDtBias => "linear_dt_bias",
            LinNorm => "linear_norm",
            LinOut => "linear_out",
            Sinks => "sinks",
            ExpertsGateUp => "experts_gate_up",
            ExpertsGateUpBias => "experts_gate_up_bias",
            ExpertsDown => "experts_down",
            ExpertsDownBias => "experts_down_bias",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_fusion_group_holds_parts_of_one_role_in_consecutive_slots() {
        use Part::*;
        let all = [
            Embed,
            LmHead,
            FinalNorm,
            InputNorm,
            PostNorm,
            Q,
            K,
            V,
            QBias,
            KBias,
            VBias,
            O,
            OBias,
            QNorm,
            KNorm,
            QDown,
            QDownNorm,
            QUp,
            KvDown,
            KvDownNorm,
            KvUp,
            Gate,
            Up,
            Down,
            Router,
            RouterBias,
            ExpertGate,
            ExpertUp,
            ExpertDown,
            SharedGate,
            SharedUp,
            SharedDown,
            SharedExpertGate,
            LinQkvz,
            LinBa,
            LinQkv,
            LinZ,
            LinB,
            LinA,
            LinConv,
            LinALog,
            LinDtBias,
            LinNorm,
            LinOut,
            Sinks,
            ExpertsGateUp,
            ExpertsGateUpBias,
            ExpertsDown,
            ExpertsDownBias,
        ];
        let mut groups: std::collections::HashMap<Fusion, Vec<(u8, Role)>> = Default::default();
        for p in all {
            if let Some((f, slot)) = p.fusion() {
                groups.entry(f).or_default().push((slot, p.role()));
            }
        }
        assert_eq!(groups.len(), 6);
        for (f, mut members) in groups {
            members.sort_by_key(|m| m.0);
            let slots: Vec<u8> = members.iter().map(|m| m.0).collect();
            assert_eq!(slots, (0..members.len() as u8).collect::<Vec<_>>(), "{f:?}");
            assert!(members.iter().all(|m| m.1 == members[0].1), "{f:?}");
        }
    }
}
