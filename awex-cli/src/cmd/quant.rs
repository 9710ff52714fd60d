//! The inference side's FP8 flags, shared by `plan`, `demo` and the demo's workers.

use anyhow::{Context, bail};
use awex_core::ModelSpec;
use awex_core::encoding::fp8_block::DEFAULT_BLOCK;
use awex_core::encoding::{Fp8Block, Fp8Config, InferFp8, Recipe, ScaleFormat};
use awex_core::model::Catalogue;
use std::path::{Path, PathBuf};

/// How the inference side stores the weights (FP8 rollouts).
#[derive(clap::Args, Debug, Clone, Default)]
pub struct QuantArgs {
    /// Store the inference side's linear weights (attention, MLP, experts) as block FP8:
    /// e4m3 elements plus an fp32 `weight_scale_inv` per block, quantised by awex from the
    /// training side's bf16 (on the receiving rank: on the CPU over shm and tcp, on the GPU
    /// over cuda-ipc, 128x128 blocks). Embeddings,
    /// norms, `lm_head` and the router keep their dtype. `fp8` is the only value.
    #[arg(long, value_name = "fp8", value_parser = ["fp8"])]
    pub infer_quant: Option<String>,
    /// The inference model's `config.json` or HF directory, whose `quantization_config`
    /// (`quant_method: fp8`, `weight_block_size`, `scale_fmt`, `ignored_layers` /
    /// `modules_to_not_convert`) gives the encoding; implies `--infer-quant fp8`. Its model must
    /// be `--model`'s in everything but the quantisation.
    #[arg(long, value_name = "PATH")]
    pub infer_config: Option<PathBuf>,
    /// Block shape `ROWSxCOLS` with `--infer-quant fp8` (default 128x128, every known FP8
    /// checkpoint's).
    #[arg(long, value_name = "BNxBK")]
    pub fp8_block: Option<String>,
    /// The quantiser whose bytes awex reproduces: vllm (default: what vLLM does when it
    /// quantises online; deepgemm is the same), vllm-ue8m0, deepgemm-ue8m0, deepgemm-legacy,
    /// awex-python, awex-python-ue8m0, slime, slime-pow2, sglang-ue8m0. A `-ue8m0`/`-pow2`
    /// recipe writes power-of-two scales (`scale_fmt: ue8m0`).
    #[arg(long, value_name = "RECIPE")]
    pub fp8_recipe: Option<String>,
}

impl QuantArgs {
    /// The inference side's FP8 settings, `None` for a plain side. `model` is the training
    /// side's model: an `--infer-config` whose model differs from it is refused by name.
    pub fn resolve(&self, model: &ModelSpec) -> anyhow::Result<Option<InferFp8>> {
        let recipe = match &self.fp8_recipe {
            Some(r) => Some(r.parse::<Recipe>().map_err(anyhow::Error::msg)?),
            None => None,
        };
        let config = match (&self.infer_config, &self.infer_quant) {
            (Some(path), _) => {
                if self.fp8_block.is_some() {
                    bail!(
                        "--fp8-block is given by the quantization_config of --infer-config (`weight_block_size`); drop one of them"
                    );
                }
                config_of(path, model)?
            }
            (None, Some(_)) => {
                let block = match &self.fp8_block {
                    Some(b) => parse_block(b)?,
                    None => DEFAULT_BLOCK,
                };
                Fp8Config {
                    encoding: Fp8Block {
                        block,
                        scale_format: recipe.map_or(ScaleFormat::F32, Recipe::scale_format),
                    },
                    activation_scheme: "dynamic".into(),
                    ignored_layers: vec![],
                }
            }
            (None, None) => {
                if self.fp8_block.is_some() || self.fp8_recipe.is_some() {
                    bail!("--fp8-block and --fp8-recipe need --infer-quant fp8 or --infer-config");
                }
                return Ok(None);
            }
        };
        // the default recipe: vLLM's, with power-of-two scales where the config stores them
        let recipe = recipe.unwrap_or(match config.encoding.scale_format {
            ScaleFormat::F32 => Recipe::Vllm,
            ScaleFormat::Ue8m0 => Recipe::VllmUe8m0,
        });
        Ok(Some(InferFp8::new(config, recipe).map_err(|e| {
            anyhow::anyhow!("--fp8-recipe {}: {e}", recipe.name())
        })?))
    }

    /// [`QuantArgs::resolve`] for `model`, resolved from `arg` (`--model` as given): without an
    /// FP8 flag, a `--model` whose own config quantises to FP8 is refused (planning it bf16 would
    /// not be what the engine serving that checkpoint holds).
    pub fn resolve_for(&self, arg: &str, model: &ModelSpec) -> anyhow::Result<Option<InferFp8>> {
        if self.infer_quant.is_none() && self.infer_config.is_none() {
            refuse_fp8_model_arg(arg)?;
        }
        self.resolve(model)
    }

    /// [`QuantArgs::resolve`] against `--model` as given (a preset, config or HF directory).
    pub fn resolve_model(&self, model: &str) -> anyhow::Result<Option<InferFp8>> {
        if self.infer_quant.is_none()
            && self.infer_config.is_none()
            && self.fp8_block.is_none()
            && self.fp8_recipe.is_none()
        {
            refuse_fp8_model_arg(model)?;
            return Ok(None);
        }
        self.resolve(&ModelSpec::resolve(model)?)
    }

    /// The same flags for another process (the demo's workers).
    pub fn to_args(&self) -> Vec<String> {
        let mut v = Vec::new();
        if let Some(q) = &self.infer_quant {
            v.extend(["--infer-quant".to_string(), q.clone()]);
        }
        if let Some(p) = &self.infer_config {
            v.extend(["--infer-config".to_string(), p.display().to_string()]);
        }
        if let Some(b) = &self.fp8_block {
            v.extend(["--fp8-block".to_string(), b.clone()]);
        }
        if let Some(r) = &self.fp8_recipe {
            v.extend(["--fp8-recipe".to_string(), r.clone()]);
        }
        v
    }
}

/// Refuses a `--model` path (a `config.json` or HF directory) whose `quantization_config` says
/// FP8, given without an FP8 flag: the inference side would be planned bf16 while the engine
/// serving that checkpoint holds e4m3 weights and scales. A preset, or a path without such a
/// config, passes.
fn refuse_fp8_model_arg(arg: &str) -> anyhow::Result<()> {
    // (a preset, or a path the model's own reader refuses with its own message)
    let Ok(Some(value)) = ModelSpec::config_value_of(arg) else {
        return Ok(());
    };
    if Fp8Config::declared_by(&value) {
        bail!(
            "--model {arg}: its config.json quantises the linear weights to FP8 (quantization_config quant_method \"fp8\"), which an engine serving it holds as e4m3 and scales; say so with `--infer-config {arg}` (the encoding from that config), or give the bf16 model's config as --model for a bf16 inference side"
        );
    }
    Ok(())
}

/// `128x128` (or `128,128`) as `[bn, bk]`.
fn parse_block(s: &str) -> anyhow::Result<[u32; 2]> {
    let bad = || {
        anyhow::anyhow!(
            "--fp8-block `{s}`: expected ROWSxCOLS with edges from 1 to {}, e.g. 128x128",
            awex_core::encoding::fp8_block::MAX_BLOCK_EDGE
        )
    };
    let (a, b) = s.split_once(['x', 'X', ',']).ok_or_else(bad)?;
    let edge = |e: &str| -> anyhow::Result<u32> {
        let n: u32 = e.trim().parse().map_err(|_| bad())?;
        if n == 0 || n > awex_core::encoding::fp8_block::MAX_BLOCK_EDGE {
            return Err(bad());
        }
        Ok(n)
    };
    Ok([edge(a)?, edge(b)?])
}

/// The FP8 config of an inference `config.json` (or HF directory), after checking its model
/// is `model` (the catalogues equal: same tensors, shapes and dtypes).
fn config_of(path: &Path, model: &ModelSpec) -> anyhow::Result<Fp8Config> {
    let text = ModelSpec::read_config(path).context("--infer-config")?;
    let file = path.display();
    let value: serde_json::Value = serde_json::from_str(&text)
        .with_context(|| format!("--infer-config {file} is not JSON"))?;
    let config = Fp8Config::from_hf_model_config(&value)
        .with_context(|| format!("--infer-config {file}"))?
        .ok_or_else(|| {
            anyhow::anyhow!(
                "--infer-config {file} has no quantization_config; give an FP8 checkpoint's config (quant_method fp8) or use --infer-quant fp8"
            )
        })?;
    let theirs =
        ModelSpec::from_config_json(&text).with_context(|| format!("--infer-config {file}"))?;
    if let Some(d) = Catalogue::of(&theirs).first_difference(&Catalogue::of(model)) {
        bail!(
            "the inference model of --infer-config {file} differs from --model `{}` in more than the quantisation: {d}",
            model.name
        );
    }
    Ok(config)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_fp8_model_without_an_fp8_flag_is_refused_naming_infer_config() {
        let dir = tempfile::tempdir().unwrap();
        let mut cfg: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(concat!(
                env!("CARGO_MANIFEST_DIR"),
                "/../awex-core/tests/fixtures/hf/qwen3.json"
            ))
            .unwrap(),
        )
        .unwrap();
        let cfg = cfg["config"].take();
        std::fs::write(dir.path().join("config.json"), cfg.to_string()).unwrap();
        let bf16 = dir.path().to_str().unwrap().to_string();
        let model = ModelSpec::resolve(&bf16).unwrap();
        assert_eq!(
            QuantArgs::default().resolve_for(&bf16, &model).unwrap(),
            None
        );
        let mut fp8 = cfg.clone();
        fp8["quantization_config"] = serde_json::json!({
            "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
            "weight_block_size": [16, 16]
        });
        let file = dir.path().join("fp8.json");
        std::fs::write(&file, fp8.to_string()).unwrap();
        let arg = file.to_str().unwrap();
        let e = QuantArgs::default()
            .resolve_for(arg, &model)
            .unwrap_err()
            .to_string();
        assert!(e.contains("quantises the linear weights to FP8"), "{e}");
        assert!(e.contains(&format!("--infer-config {arg}")), "{e}");
        let e = QuantArgs::default()
            .resolve_model(arg)
            .unwrap_err()
            .to_string();
        assert!(e.contains("quantises the linear weights to FP8"), "{e}");
        // with the flag it names, the same config is the FP8 encoding
        let told = QuantArgs {
            infer_config: Some(file.clone()),
            ..Default::default()
        };
        let f = told.resolve_for(arg, &model).unwrap().unwrap();
        assert_eq!(f.config.encoding.block, [16, 16]);
    }

    #[test]
    fn blocks_parse_and_bad_ones_say_the_syntax() {
        assert_eq!(parse_block("128x128").unwrap(), [128, 128]);
        assert_eq!(parse_block("64,32").unwrap(), [64, 32]);
        for bad in ["128", "0x128", "ax1", "128x99999"] {
            assert!(
                parse_block(bad)
                    .unwrap_err()
                    .to_string()
                    .contains("expected ROWSxCOLS"),
                "{bad}"
            );
        }
    }

    #[test]
    fn defaults_are_vllm_128_blocks_and_a_mismatched_recipe_is_refused() {
        let model = ModelSpec::resolve("qwen3-tiny").unwrap();
        let a = QuantArgs {
            infer_quant: Some("fp8".into()),
            ..Default::default()
        };
        let f = a.resolve(&model).unwrap().unwrap();
        assert_eq!(f.recipe, Recipe::Vllm);
        assert_eq!(f.config.encoding.block, [128, 128]);
        assert_eq!(QuantArgs::default().resolve(&model).unwrap(), None);
        let ue = QuantArgs {
            infer_quant: Some("fp8".into()),
            fp8_recipe: Some("deepgemm-ue8m0".into()),
            ..Default::default()
        };
        assert_eq!(
            ue.resolve(&model)
                .unwrap()
                .unwrap()
                .config
                .encoding
                .scale_format,
            ScaleFormat::Ue8m0
        );
        let sg = QuantArgs {
            infer_quant: Some("fp8".into()),
            fp8_recipe: Some("sglang-ue8m0".into()),
            fp8_block: Some("64x64".into()),
            ..Default::default()
        };
        let e = sg.resolve(&model).unwrap_err().to_string();
        assert!(
            e.contains("sglang-ue8m0") && e.contains("[128, 128]"),
            "{e}"
        );
        let orphan = QuantArgs {
            fp8_recipe: Some("vllm".into()),
            ..Default::default()
        };
        assert!(
            orphan
                .resolve(&model)
                .unwrap_err()
                .to_string()
                .contains("need --infer-quant")
        );
    }
}
