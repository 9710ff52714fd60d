//! Which dtype transformers gives each parameter of a model it loads in bf16 or fp16: the model's
//! dtype, except the tensors its model classes keep in fp32. The rules moved between releases,
//! so an FSDP2 layout names the release (the `transformers` key, [`Rules`]).
//!
//! - Every release awex supports keeps the router's score-correction bias
//!   (`mlp.gate.e_score_correction_bias`, DeepSeek-V3 / Kimi-K2 and GLM-4.5) in fp32
//!   (`_keep_in_fp32_modules_strict = ["e_score_correction_bias"]`); the family says so
//!   ([`awex_core::model::family::Sink::part_as`]).
//! - From transformers 5.24, `DeepseekV2PreTrainedModel` (`["gate.weight"]`),
//!   `DeepseekV3PreTrainedModel` and `Glm4MoePreTrainedModel`
//!   (`["e_score_correction_bias", "gate.weight"]`) keep the router weight `mlp.gate.weight` in
//!   fp32 too, and their `TopkRouter`s create it as `torch.float32` (`models/deepseek_v2/`,
//!   `models/deepseek_v3/`, `models/glm4_moe/modeling_*.py`). Before 5.24 it is in the model's
//!   dtype. The rule's pattern `gate.weight` is a regular expression searched in each name
//!   (`core_model_loading.py`, `build_glob_alternation`): it matches the router
//!   `mlp.gate.weight`, not `gate_proj.weight`.

use awex_core::DType;
use awex_core::model::{ModelSpec, Part};

/// The release whose rules a layout follows when the spec names none: the one awex's
/// real-engine tests pin (`engines/requirements.lock`), as `major * 100 + minor`.
pub const PINNED: u64 = 519;

/// The first release that keeps DeepSeek-V2/V3 and GLM-4.5 router weights in fp32.
pub const FP32_ROUTERS: u64 = 524;

/// The oldest release the key accepts (transformers 4.0).
const OLDEST: u64 = 400;

/// The HF classes whose router weight transformers keeps in fp32 from [`FP32_ROUTERS`] on
/// (Kimi-K2 is a `DeepseekV3ForCausalLM`).
const FP32_ROUTER_CLASSES: [&str; 3] = [
    "DeepseekV2ForCausalLM",
    "DeepseekV3ForCausalLM",
    "Glm4MoeForCausalLM",
];

/// transformers' dtype rules, by release.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Rules {
    /// transformers 4.0 to 5.23: every parameter in the model's dtype (the router's
    /// score-correction bias buffer in fp32).
    #[default]
    ModelDtypeRouters,
    /// transformers 5.24 and later: DeepSeek-V2/V3, Kimi-K2 and GLM-4.5 also keep their router
    /// weights (`mlp.gate.weight`) in fp32.
    Fp32Routers,
}

/// A `transformers` value that names no release awex knows.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error(
    "fsdp transformers={0}: write the transformers release the trainer runs as major * 100 + minor (519 for 5.19, {FP32_ROUTERS} for 5.24), at least {OLDEST} (4.0)"
)]
pub struct RulesError(pub u64);

impl Rules {
    /// The rules of release `version` (`major * 100 + minor`).
    pub fn of_release(version: u64) -> Result<Self, RulesError> {
        match version {
            v if v < OLDEST => Err(RulesError(v)),
            v if v < FP32_ROUTERS => Ok(Rules::ModelDtypeRouters),
            _ => Ok(Rules::Fp32Routers),
        }
    }

    /// The release that stands for these rules: [`PINNED`] or [`FP32_ROUTERS`] (releases with
    /// the same rules lay out the same ranks, so a spec resolves to this one).
    pub fn release(self) -> u64 {
        match self {
            Rules::ModelDtypeRouters => PINNED,
            Rules::Fp32Routers => FP32_ROUTERS,
        }
    }

    /// The dtype transformers holds `part` in, for a part the family gives `dtype`.
    pub fn dtype(self, spec: &ModelSpec, part: Part, dtype: DType) -> DType {
        let class = spec.architecture.family().hf_class;
        match (self, part) {
            (Rules::Fp32Routers, Part::Router) if FP32_ROUTER_CLASSES.contains(&class) => {
                DType::F32
            }
            // the Gated DeltaNet `A_log`: fp32 in the checkpoints and the engines, but
            // transformers (5.19: `Qwen3NextGatedDeltaNet`, `Qwen3_5GatedDeltaNet`, no
            // `_keep_in_fp32_modules`) holds it in the model's dtype
            (_, Part::LinALog) => spec.dtype,
            _ => dtype,
        }
    }
}

/// The `transformers` key a live rank's tensors decide: [`FP32_ROUTERS`] when a router weight
/// (`...mlp.gate.weight`) is fp32 while the model's other parameters are bf16 or fp16 (names may
/// carry any prefix); nothing otherwise (routers in the model's dtype are what [`PINNED`] and
/// every release before 5.24 give, and a model without routers says nothing).
pub fn options_from_tensors(tensors: &[(&str, DType)]) -> Vec<(&'static str, u64)> {
    let is_router = |n: &str| n.ends_with(".mlp.gate.weight") || n == "mlp.gate.weight";
    let fp32_router = tensors
        .iter()
        .any(|(n, d)| *d == DType::F32 && is_router(n));
    let half = tensors
        .iter()
        .any(|(n, d)| matches!(d, DType::Bf16 | DType::F16) && !is_router(n));
    if fp32_router && half {
        vec![("transformers", FP32_ROUTERS)]
    } else {
        Vec::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn releases_before_5_24_keep_routers_in_the_model_dtype() {
        assert_eq!(Rules::of_release(457), Ok(Rules::ModelDtypeRouters));
        assert_eq!(Rules::of_release(PINNED), Ok(Rules::ModelDtypeRouters));
        assert_eq!(Rules::of_release(523), Ok(Rules::ModelDtypeRouters));
        assert_eq!(Rules::of_release(524), Ok(Rules::Fp32Routers));
        assert_eq!(Rules::of_release(525), Ok(Rules::Fp32Routers));
        assert_eq!(
            Rules::of_release(5).unwrap_err().to_string(),
            "fsdp transformers=5: write the transformers release the trainer runs as major * 100 + minor (519 for 5.19, 524 for 5.24), at least 400 (4.0)"
        );
    }

    #[test]
    fn an_fp32_router_among_bf16_parameters_names_5_24() {
        let t = |router: DType| {
            vec![
                ("model.embed_tokens.weight", DType::Bf16),
                ("model.layers.1.mlp.gate.weight", router),
                (
                    "model.layers.1.mlp.gate.e_score_correction_bias",
                    DType::F32,
                ),
                (
                    "model.layers.1.mlp.shared_experts.gate_proj.weight",
                    DType::Bf16,
                ),
            ]
        };
        assert_eq!(
            options_from_tensors(&t(DType::F32)),
            [("transformers", FP32_ROUTERS)]
        );
        assert!(options_from_tensors(&t(DType::Bf16)).is_empty());
        // an fp32 model says nothing; nor does an fp32 `gate_proj`
        let all32: Vec<_> = t(DType::F32)
            .into_iter()
            .map(|(n, _)| (n, DType::F32))
            .collect();
        assert!(options_from_tensors(&all32).is_empty());
        assert!(
            options_from_tensors(&[
                ("model.embed_tokens.weight", DType::Bf16),
                ("model.layers.0.mlp.gate_proj.weight", DType::F32),
            ])
            .is_empty()
        );
    }
}
