//! Names on both ends: canonical (HF) tensors as compact identifiers, and Megatron's local
//! parameter names (`decoder.layers.{i}.self_attention.linear_qkv.weight`, ...).

use crate::config::ExpertLayout;
use awex_core::model::push_index;
use std::sync::Arc;

pub use awex_core::model::Canon;

/// The local spec's input norm, a module of its own (`get_gpt_layer_local_spec`,
/// `megatron/core/models/gpt/gpt_layer_specs.py`); its presence marks the local spec.
const LOCAL_QKV_NORM: &str = "input_layernorm.weight";
/// The input norm with Transformer Engine, fused into `linear_qkv` (`TELayerNormColumnParallelLinear`).
const TE_QKV_NORM: &str = "self_attention.linear_qkv.layer_norm_weight";
/// The pre-MLP norm as a module: the local spec's, and every spec's in a MoE layer.
const PRE_MLP_NORM: &str = "pre_mlp_layernorm.weight";
/// The pre-MLP norm with Transformer Engine in a dense layer, fused into `linear_fc1`.
const TE_FC1_NORM: &str = "mlp.linear_fc1.layer_norm_weight";
/// The start of every `SequentialMLP` expert parameter (`mlp.experts.local_experts.{j}.`).
const SEQUENTIAL_EXPERTS: &str = "mlp.experts.local_experts.";
/// The start of every `TEGroupedMLP` expert parameter (`mlp.experts.linear_fc1.weight{j}`).
const GROUPED_FC: &str = "mlp.experts.linear_";
/// `TEGroupedMLP`'s stacked fc1 with `moe_single_grouped_weight`; with a suffix `{j}`, expert j's fc1.
const STACKED_FC1: &str = "mlp.experts.linear_fc1.weight";
/// `TEGroupedMLP`'s stacked fc2 with `moe_single_grouped_weight`.
const STACKED_FC2: &str = "mlp.experts.linear_fc2.weight";
/// MLA's key/value up projection (`MLASelfAttention`, megatron/core/transformer/multi_latent_attention.py);
/// its presence marks multi-latent attention, whose input norm is a module under every spec.
const MLA_KV_UP: &str = "self_attention.linear_kv_up_proj.weight";
/// MLA's norm after the key/value down projection as a module of its own: the local spec's
/// (`get_gpt_layer_local_submodules`: `kv_layernorm=qk_norm`); Transformer Engine fuses it into
/// `linear_kv_up_proj` as `layer_norm_weight`.
const LOCAL_MLA_KV_NORM: &str = "self_attention.kv_layernorm.weight";

/// A Megatron local parameter, by kind; layer tensors carry their global layer index.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Local {
    /// `embedding.word_embeddings.weight`
    Embedding,
    /// `decoder.final_layernorm.weight`
    FinalNorm,
    /// `output_layer.weight`
    OutputLayer,
    /// `self_attention.linear_qkv.layer_norm_weight` (`input_layernorm.weight` with the local spec)
    QkvNorm(u64),
    /// `self_attention.linear_qkv.weight`
    Qkv(u64),
    /// `self_attention.linear_qkv.bias`
    QkvBias(u64),
    /// `self_attention.q_layernorm.weight`
    QLayerNorm(u64),
    /// `self_attention.k_layernorm.weight`
    KLayerNorm(u64),
    /// `self_attention.linear_proj.weight`
    Proj(u64),
    /// `self_attention.linear_proj.bias` (full on every TP rank: added after the reduction)
    ProjBias(u64),
    /// `mlp.linear_fc1.layer_norm_weight` (`pre_mlp_layernorm.weight` with the local spec)
    Fc1Norm(u64),
    /// `mlp.linear_fc1.weight`
    Fc1(u64),
    /// `mlp.linear_fc2.weight`
    Fc2(u64),
    /// `pre_mlp_layernorm.weight`
    PreMlpNorm(u64),
    /// `mlp.router.weight`
    Router(u64),
    /// `mlp.router.expert_bias`: the router's score-correction bias, an fp32 buffer
    /// (`TopKRouter.__init__`, megatron/core/transformer/moe/router.py, with
    /// `moe_router_enable_expert_bias`)
    ExpertBias(u64),
    /// `mlp.shared_experts.linear_fc1.weight`: the shared experts' `[gate | up]` rows of one TP rank
    SharedFc1(u64),
    /// `mlp.shared_experts.linear_fc2.weight`: the shared experts' down columns of one TP rank
    SharedFc2(u64),
    /// `mlp.experts.linear_fc1.weight{j}` or `mlp.experts.local_experts.{j}.linear_fc1.weight` (layer, local expert j)
    ExpertFc1(u64, u64),
    /// `mlp.experts.linear_fc2.weight{j}` or `mlp.experts.local_experts.{j}.linear_fc2.weight` (layer, local expert j)
    ExpertFc2(u64, u64),
    /// `mlp.experts.linear_fc1.weight`: every local expert's fc1 stacked (`moe_single_grouped_weight`)
    StackedFc1(u64),
    /// `mlp.experts.linear_fc2.weight`: every local expert's fc2 stacked (`moe_single_grouped_weight`)
    StackedFc2(u64),
    /// `input_layernorm.weight`: MLA's input norm, a module of its own under every spec
    /// (`get_gpt_layer_with_transformer_engine_submodules` builds `input_layernorm=TENorm` for MLA)
    InputNorm(u64),
    /// MLA `self_attention.linear_q_down_proj.weight`: column-parallel with the local spec
    /// (`ColumnParallelLinear`, its output gathered), whole with Transformer Engine (`TELinear`,
    /// `parallel_mode='duplicated'`)
    QDown(u64),
    /// MLA `self_attention.q_layernorm.weight` (local spec) or
    /// `self_attention.linear_q_up_proj.layer_norm_weight` (Transformer Engine)
    QDownNorm(u64),
    /// MLA `self_attention.linear_q_up_proj.weight`: column-parallel
    QUp(u64),
    /// MLA `self_attention.linear_kv_down_proj.weight`: split as [`Local::QDown`]
    KvDown(u64),
    /// MLA `self_attention.kv_layernorm.weight` (local spec) or
    /// `self_attention.linear_kv_up_proj.layer_norm_weight` (Transformer Engine)
    KvDownNorm(u64),
    /// MLA `self_attention.linear_kv_up_proj.weight`: column-parallel
    KvUp(u64),
}

/// How a local parameter is replicated and split across the ranks of its stage.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Split {
    /// The same on every rank of the stage.
    Replicated,
    /// Split over TP ranks, replicated over DP and CP.
    Tp,
    /// Split over EP (experts) and ETP ranks, replicated over EDP.
    Expert,
}

impl Local {
    /// How this parameter is split; `local_spec`: the model uses the local layer spec, whose
    /// MLA down projections are column-parallel (whole on every rank with Transformer Engine).
    pub fn split(&self, local_spec: bool) -> Split {
        match self {
            Local::QDown(_) | Local::KvDown(_) if local_spec => Split::Tp,
            Local::QDown(_) | Local::KvDown(_) => Split::Replicated,
            Local::FinalNorm
            | Local::InputNorm(_)
            | Local::QDownNorm(_)
            | Local::KvDownNorm(_)
            | Local::QkvNorm(_)
            | Local::QLayerNorm(_)
            | Local::KLayerNorm(_)
            | Local::Fc1Norm(_)
            | Local::PreMlpNorm(_)
            | Local::ProjBias(_)
            | Local::Router(_)
            | Local::ExpertBias(_) => Split::Replicated,
            Local::Embedding
            | Local::OutputLayer
            | Local::Qkv(_)
            | Local::QkvBias(_)
            | Local::Proj(_)
            | Local::Fc1(_)
            | Local::Fc2(_)
            | Local::SharedFc1(_)
            | Local::SharedFc2(_)
            | Local::QUp(_)
            | Local::KvUp(_) => Split::Tp,
            Local::ExpertFc1(..)
            | Local::ExpertFc2(..)
            | Local::StackedFc1(_)
            | Local::StackedFc2(_) => Split::Expert,
        }
    }
}

/// The local names of one layer's parameters, built once and shared by every rank and holder.
#[derive(Debug)]
pub struct LayerNames {
    /// `linear_qkv.layer_norm_weight` (Transformer Engine) or `input_layernorm.weight` (local spec)
    pub qkv_norm: Arc<str>,
    /// `linear_qkv.weight`
    pub qkv: Arc<str>,
    /// `linear_qkv.bias`
    pub qkv_bias: Arc<str>,
    /// `q_layernorm.weight`
    pub q_layernorm: Arc<str>,
    /// `k_layernorm.weight`
    pub k_layernorm: Arc<str>,
    /// `linear_proj.weight`
    pub proj: Arc<str>,
    /// `linear_proj.bias`
    pub proj_bias: Arc<str>,
    /// `mlp.linear_fc1.layer_norm_weight` (Transformer Engine) or `pre_mlp_layernorm.weight` (local spec)
    pub fc1_norm: Arc<str>,
    /// `mlp.linear_fc1.weight`
    pub fc1: Arc<str>,
    /// `mlp.linear_fc2.weight`
    pub fc2: Arc<str>,
    /// `pre_mlp_layernorm.weight`
    pub pre_mlp_norm: Arc<str>,
    /// `mlp.router.weight`
    pub router: Arc<str>,
    /// `mlp.router.expert_bias`
    pub expert_bias: Arc<str>,
    /// `mlp.shared_experts.linear_fc1.weight`
    pub shared_fc1: Arc<str>,
    /// `mlp.shared_experts.linear_fc2.weight`
    pub shared_fc2: Arc<str>,
    /// fc1 of every local expert j (see [`expert_name`])
    pub expert_fc1: Vec<Arc<str>>,
    /// fc2 of every local expert j (see [`expert_name`])
    pub expert_fc2: Vec<Arc<str>>,
    /// `mlp.experts.linear_fc1.weight` (the stacked parameter of `moe_single_grouped_weight`)
    pub stacked_fc1: Arc<str>,
    /// `mlp.experts.linear_fc2.weight` (the stacked parameter of `moe_single_grouped_weight`)
    pub stacked_fc2: Arc<str>,
    /// `input_layernorm.weight` (MLA, every spec)
    pub input_norm: Arc<str>,
    /// `self_attention.linear_q_down_proj.weight`
    pub q_down: Arc<str>,
    /// `self_attention.q_layernorm.weight` (local spec) or `linear_q_up_proj.layer_norm_weight`
    pub q_down_norm: Arc<str>,
    /// `self_attention.linear_q_up_proj.weight`
    pub q_up: Arc<str>,
    /// `self_attention.linear_kv_down_proj.weight`
    pub kv_down: Arc<str>,
    /// `self_attention.kv_layernorm.weight` (local spec) or `linear_kv_up_proj.layer_norm_weight`
    pub kv_down_norm: Arc<str>,
    /// `self_attention.linear_kv_up_proj.weight`
    pub kv_up: Arc<str>,
}

/// The pieces of the suffix (after `decoder.layers.{i}.`) of local expert `j`'s `linear_{fc}`
/// weight (`fc` is `fc1` or `fc2`; `j` is the index as written), to be joined in order.
///
/// - `TEGroupedMLP` (`megatron/core/transformer/moe/experts.py`) holds `linear_fc1` /
///   `linear_fc2` as Transformer Engine `GroupedLinear`s, which register one parameter per GEMM,
///   `weight{j}` (`megatron/core/extensions/transformer_engine.py`, `TEGroupedLinear`):
///   `mlp.experts.linear_fc1.weight{j}`.
/// - `SequentialMLP` (same file) holds `local_experts = ModuleList([MLP, ...])`, each `MLP` with
///   its own `linear_fc1` / `linear_fc2` (`ColumnParallelLinear` / `RowParallelLinear` with the
///   local spec, `megatron/core/models/backends.py` `LocalSpecProvider.grouped_mlp_modules`):
///   `mlp.experts.local_experts.{j}.linear_fc1.weight`.
/// - With `moe_single_grouped_weight` the grouped layer has no per-expert parameter at all (see
///   [`Local::StackedFc1`]); `None` then.
fn expert_name<'a>(layout: ExpertLayout, j: &'a str, fc: &'a str) -> Option<[&'a str; 5]> {
    match layout {
        ExpertLayout::Grouped => Some([GROUPED_FC, fc, ".weight", j, ""]),
        ExpertLayout::Sequential => Some([SEQUENTIAL_EXPERTS, j, ".linear_", fc, ".weight"]),
        ExpertLayout::SingleGrouped => None,
    }
}

impl LayerNames {
    /// The names of layer `local` of a chunk whose names start with `prefix` (`""` or `model{v}.`);
    /// `local_spec` selects the local layer spec's norm names over Transformer Engine's fused ones.
    /// `experts` picks the expert parameters' names.
    pub fn new(
        prefix: &str,
        local: u64,
        experts_local: u64,
        local_spec: bool,
        experts: ExpertLayout,
    ) -> LayerNames {
        // built by appending, not `format!`: a layer has a few dozen names, built on first use
        let mut base = String::with_capacity(prefix.len() + 96);
        base.push_str(prefix);
        base.push_str("decoder.layers.");
        push_index(&mut base, local);
        base.push('.');
        let mut j_buf = String::new();
        let mut expert = |base: &mut String, j: u64, fc: &str| -> Option<Arc<str>> {
            j_buf.clear();
            push_index(&mut j_buf, j);
            expert_name(experts, &j_buf, fc).map(|parts| joined(base, &parts))
        };
        let expert_fc1: Vec<Arc<str>> = (0..experts_local)
            .filter_map(|j| expert(&mut base, j, "fc1"))
            .collect();
        let expert_fc2: Vec<Arc<str>> = (0..experts_local)
            .filter_map(|j| expert(&mut base, j, "fc2"))
            .collect();
        let mut n = |suffix: &str| joined(&mut base, &[suffix]);
        let (qkv_norm, fc1_norm) = if local_spec {
            (LOCAL_QKV_NORM, PRE_MLP_NORM)
        } else {
            (TE_QKV_NORM, TE_FC1_NORM)
        };
        // MLA's latent norms: modules of the local spec (`q_layernorm` / `kv_layernorm`), fused
        // into the up projections by Transformer Engine (`TELayerNormColumnParallelLinear`)
        let (q_down_norm, kv_down_norm) = if local_spec {
            ("self_attention.q_layernorm.weight", LOCAL_MLA_KV_NORM)
        } else {
            (
                "self_attention.linear_q_up_proj.layer_norm_weight",
                "self_attention.linear_kv_up_proj.layer_norm_weight",
            )
        };
        LayerNames {
            qkv_norm: n(qkv_norm),
            qkv: n("self_attention.linear_qkv.weight"),
            qkv_bias: n("self_attention.linear_qkv.bias"),
            q_layernorm: n("self_attention.q_layernorm.weight"),
            k_layernorm: n("self_attention.k_layernorm.weight"),
            proj: n("self_attention.linear_proj.weight"),
            proj_bias: n("self_attention.linear_proj.bias"),
            fc1_norm: n(fc1_norm),
            fc1: n("mlp.linear_fc1.weight"),
            fc2: n("mlp.linear_fc2.weight"),
            pre_mlp_norm: n(PRE_MLP_NORM),
            router: n("mlp.router.weight"),
            expert_bias: n("mlp.router.expert_bias"),
            shared_fc1: n("mlp.shared_experts.linear_fc1.weight"),
            shared_fc2: n("mlp.shared_experts.linear_fc2.weight"),
            expert_fc1,
            expert_fc2,
            stacked_fc1: n(STACKED_FC1),
            stacked_fc2: n(STACKED_FC2),
            input_norm: n(LOCAL_QKV_NORM),
            q_down: n("self_attention.linear_q_down_proj.weight"),
            q_down_norm: n(q_down_norm),
            q_up: n("self_attention.linear_q_up_proj.weight"),
            kv_down: n("self_attention.linear_kv_down_proj.weight"),
            kv_down_norm: n(kv_down_norm),
            kv_up: n(MLA_KV_UP),
        }
    }
}

/// The parallel keys a live rank's parameter names decide, in [`crate::KEYS`] order:
/// `local_spec` (always: 1 when some name ends in the local spec's `input_layernorm.weight`;
/// with multi-latent attention, whose input norm is a module under every spec, when some name
/// ends in the local spec's `self_attention.kv_layernorm.weight`),
/// then, when the names hold MoE experts, `grouped_gemm` (0 for `SequentialMLP`'s
/// `mlp.experts.local_experts.{j}.`, 1 for `TEGroupedMLP`'s `mlp.experts.linear_fc1.weight{j}`)
/// and `single_grouped_weight=1` for a stacked `mlp.experts.linear_fc1.weight`. Names may carry
/// any prefix (`model{v}.`, `decoder.layers.{i}.`); the markers are the names [`LayerNames`] spells.
pub fn options_from_names(names: &[&str]) -> Vec<(&'static str, u64)> {
    // where `part` starts a module path in `name` (after a `.`), and what follows it
    let after = |name: &'_ str, part: &str| -> Vec<usize> {
        name.match_indices(part)
            .filter(|(at, _)| name[..*at].ends_with('.'))
            .map(|(at, _)| at + part.len())
            .collect()
    };
    let ends_with_part = |name: &str, part: &str| after(name, part).contains(&name.len());
    let mla = names.iter().any(|n| ends_with_part(n, MLA_KV_UP));
    let marker = if mla {
        LOCAL_MLA_KV_NORM
    } else {
        LOCAL_QKV_NORM
    };
    let local = names.iter().any(|n| ends_with_part(n, marker));
    let mut out = vec![("local_spec", u64::from(local))];
    // `mlp.experts.linear_fc1.weight{j}`: the stacked name followed by an expert index
    let grouped_expert = |name: &str| {
        after(name, STACKED_FC1).into_iter().any(|end| {
            let j = &name[end..];
            !j.is_empty() && j.bytes().all(|b| b.is_ascii_digit())
        })
    };
    if names
        .iter()
        .any(|n| !after(n, SEQUENTIAL_EXPERTS).is_empty())
    {
        out.push(("grouped_gemm", 0));
    } else if names.iter().any(|n| ends_with_part(n, STACKED_FC1)) {
        out.push(("grouped_gemm", 1));
        out.push(("single_grouped_weight", 1));
    } else if names.iter().any(|n| grouped_expert(n)) {
        out.push(("grouped_gemm", 1));
    }
    out
}

/// `base` followed by `parts`, as one allocation (`base` is left as it was).
fn joined(base: &mut String, parts: &[&str]) -> Arc<str> {
    let len = base.len();
    for p in parts {
        base.push_str(p);
    }
    let name = Arc::from(base.as_str());
    base.truncate(len);
    name
}

/// The prefix of a model chunk's parameter names: `model{v}.` with virtual pipeline chunks, empty without.
pub fn chunk_prefix(vpp: u64, chunk: u64) -> String {
    if vpp > 1 {
        format!("model{chunk}.")
    } else {
        String::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layer_names_spell_megatron_parameter_names() {
        let n = LayerNames::new("model1.", 10, 12, false, ExpertLayout::Grouped);
        for j in [0usize, 7, 11] {
            let p = "model1.decoder.layers.10.mlp.experts";
            assert_eq!(&*n.expert_fc1[j], format!("{p}.linear_fc1.weight{j}"));
            assert_eq!(&*n.expert_fc2[j], format!("{p}.linear_fc2.weight{j}"));
        }
        assert_eq!(
            &*n.qkv,
            "model1.decoder.layers.10.self_attention.linear_qkv.weight"
        );
        let n = LayerNames::new("", 3, 12, false, ExpertLayout::Sequential);
        assert_eq!(
            &*n.expert_fc2[11],
            "decoder.layers.3.mlp.experts.local_experts.11.linear_fc2.weight"
        );
        let n = LayerNames::new("", 0, 12, true, ExpertLayout::SingleGrouped);
        assert!(n.expert_fc1.is_empty() && n.expert_fc2.is_empty());
        assert_eq!(&*n.qkv_norm, "decoder.layers.0.input_layernorm.weight");
    }

    /// The names one rank's layer holds under a spec and expert layout, as Megatron lists them.
    fn layer(prefix: &str, local_spec: bool, experts: Option<ExpertLayout>) -> Vec<String> {
        let n = LayerNames::new(
            prefix,
            3,
            2,
            local_spec,
            experts.unwrap_or(ExpertLayout::Grouped),
        );
        let mut out: Vec<Arc<str>> = vec![n.qkv_norm.clone(), n.qkv.clone(), n.proj.clone()];
        match experts {
            None => out.extend([n.fc1_norm.clone(), n.fc1.clone(), n.fc2.clone()]),
            Some(ExpertLayout::SingleGrouped) => out.extend([
                n.pre_mlp_norm.clone(),
                n.router.clone(),
                n.stacked_fc1.clone(),
                n.stacked_fc2.clone(),
            ]),
            Some(_) => {
                out.extend([n.pre_mlp_norm.clone(), n.router.clone()]);
                out.extend(n.expert_fc1.iter().chain(&n.expert_fc2).cloned());
            }
        }
        out.iter().map(|s| s.to_string()).collect()
    }

    fn options(names: &[String]) -> Vec<(&'static str, u64)> {
        options_from_names(&names.iter().map(String::as_str).collect::<Vec<_>>())
    }

    /// A spec (local or not), an expert module (none: dense), and the options its names decide.
    type Case = (bool, Option<ExpertLayout>, &'static [(&'static str, u64)]);

    #[test]
    fn options_from_names_read_the_layer_spec_and_expert_module_megatron_names_spell() {
        use ExpertLayout::*;
        let cases: [Case; 6] = [
            (true, None, &[("local_spec", 1)]),
            (false, None, &[("local_spec", 0)]),
            (
                true,
                Some(Sequential),
                &[("local_spec", 1), ("grouped_gemm", 0)],
            ),
            (
                false,
                Some(Sequential),
                &[("local_spec", 0), ("grouped_gemm", 0)],
            ),
            (
                false,
                Some(Grouped),
                &[("local_spec", 0), ("grouped_gemm", 1)],
            ),
            (
                false,
                Some(SingleGrouped),
                &[
                    ("local_spec", 0),
                    ("grouped_gemm", 1),
                    ("single_grouped_weight", 1),
                ],
            ),
        ];
        for prefix in ["", "model1."] {
            for (local_spec, experts, want) in cases {
                let names = layer(prefix, local_spec, experts);
                assert_eq!(options(&names), want, "{names:?}");
            }
        }
        // a dense layer beside a MoE layer (`moe_layer_freq`) still says grouped experts
        let mut mixed = layer("", false, None);
        mixed.extend(layer("", false, Some(Grouped)));
        assert_eq!(options(&mixed), [("local_spec", 0), ("grouped_gemm", 1)]);
        // every key is a megatron parallel key
        for (key, _) in options(&layer("", false, Some(SingleGrouped))) {
            assert!(crate::KEYS.iter().any(|k| k.name == key), "{key}");
        }
    }

    #[test]
    fn options_from_names_need_a_whole_module_name_not_a_substring() {
        // no `.` before the marker, a marker in the middle, or a non-index after `weight`
        let names = [
            "decoder.layers.0.my_input_layernorm.weight",
            "input_layernorm.weight",
            "decoder.layers.0.input_layernorm.weight_scale",
            "decoder.layers.0.mlp.experts.linear_fc1.weight_scale",
            "decoder.layers.0.moe_mlp.experts.local_experts.0.linear_fc1.weight",
        ];
        assert_eq!(options_from_names(&names), [("local_spec", 0)]);
        assert_eq!(options_from_names(&[]), [("local_spec", 0)]);
    }
}
