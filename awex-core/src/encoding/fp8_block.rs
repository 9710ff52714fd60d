//! The FP8 block encoding and its parsing from an HF `quantization_config`.
//!
//! A block-FP8 checkpoint (DeepSeek-V3, Kimi-K2, Qwen3-FP8) stores each quantised weight as
//! `float8_e4m3fn` plus an fp32 `weight_scale_inv` of shape `[ceil(rows / bn), ceil(cols /
//! bk)]`, one scale per `bn x bk` block (`weight = e4m3 * scale`). The fields and defaults are
//! the engines' own: vLLM 0.33 `vllm/model_executor/layers/quantization/fp8.py`
//! (`Fp8Config.from_config`: `quant_method` must contain `fp8`, `activation_scheme` is required
//! and is `static` or `dynamic`, `weight_block_size` has two entries and needs `dynamic`,
//! `ignored_layers` or else `modules_to_not_convert`), and SGLang 0.5.23
//! `sglang/srt/layers/quantization/fp8.py` (`scale_fmt`, which DeepSeek-V3.1 sets to `ue8m0`
//! for power-of-two scales).

use serde::{Deserialize, Serialize};
use serde_json::Value;

/// The block edge every known FP8 checkpoint uses (`weight_block_size: [128, 128]`).
pub const DEFAULT_BLOCK: [u32; 2] = [128, 128];

/// The largest block edge awex accepts (a bound on per-block work and staging).
pub const MAX_BLOCK_EDGE: u32 = 4096;

/// Most `ignored_layers` patterns a config may list: one per module of the largest model awex
/// plans (a few per layer of 4,096 layers), far above what a real checkpoint lists.
pub const MAX_IGNORED_LAYERS: usize = 16_384;

/// Longest `ignored_layers` pattern, in bytes (a real module name has under 100).
pub const MAX_LAYER_NAME_BYTES: usize = 512;

/// How a block's scale is stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ScaleFormat {
    /// Any fp32 value (`amax / 448`), what most checkpoints hold.
    F32,
    /// A power of two held in fp32 (UE8M0: exponent only), as DeepGEMM wants on Blackwell.
    Ue8m0,
}

/// The FP8 block encoding of one tensor: e4m3fn elements and one fp32 scale per block.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Fp8Block {
    /// `[bn, bk]`: rows and columns of one block.
    pub block: [u32; 2],
    /// How the scales are stored.
    pub scale_format: ScaleFormat,
}

impl Default for Fp8Block {
    fn default() -> Self {
        Fp8Block {
            block: DEFAULT_BLOCK,
            scale_format: ScaleFormat::F32,
        }
    }
}

/// A `quantization_config` awex cannot encode, with the field at fault.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum QuantConfigError {
    /// A required field is absent.
    #[error("quantization_config has no `{field}`; {hint}")]
    Missing {
        /// the field name
        field: &'static str,
        /// what would be right
        hint: &'static str,
    },
    /// A list is longer than awex accepts.
    #[error("quantization_config `{field}` lists {count} entries; awex accepts at most {max}")]
    TooMany {
        /// the field name
        field: &'static str,
        /// how many it lists
        count: usize,
        /// the bound
        max: usize,
    },
    /// A field holds a value awex does not support.
    #[error("quantization_config `{field}` is {got}; {hint}")]
    Unsupported {
        /// the field name
        field: &'static str,
        /// the value found, as JSON
        got: String,
        /// what would be right
        hint: &'static str,
    },
}

/// A parsed FP8 `quantization_config`: the encoding plus the layers it leaves alone. Built
/// from a checkpoint's config by [`Fp8Config::from_hf`] (the CLI, the Python package) or
/// deserialised (the gateway's connect): both are checked by [`Fp8Config::validate`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Fp8Config {
    /// The encoding of every quantised weight.
    pub encoding: Fp8Block,
    /// `activation_scheme` (always `dynamic` for block FP8).
    pub activation_scheme: String,
    /// `ignored_layers` (or `modules_to_not_convert`): module names kept in their dtype.
    pub ignored_layers: Vec<String>,
}

fn unsupported(field: &'static str, v: &Value, hint: &'static str) -> QuantConfigError {
    QuantConfigError::Unsupported {
        field,
        got: clipped(&v.to_string()),
        hint,
    }
}

/// At most 120 characters of a value, for messages (a hostile value may be megabytes).
fn clipped(s: &str) -> String {
    if s.chars().count() <= 120 {
        return s.to_string();
    }
    let mut out: String = s.chars().take(120).collect();
    out.push_str(&format!("... ({} bytes)", s.len()));
    out
}

/// A list of module names (`ignored_layers`, `modules_to_not_convert`): absent or null is
/// none; anything but a list of strings is refused, not skipped (skipping quantises every
/// layer the list meant to keep).
fn module_names(q: &Value, field: &'static str) -> Result<Option<Vec<String>>, QuantConfigError> {
    let hint = "it must be a list of module names (strings), e.g. [\"lm_head\"]";
    match q.get(field) {
        None | Some(Value::Null) => Ok(None),
        Some(v @ Value::Array(a)) => {
            if a.len() > MAX_IGNORED_LAYERS {
                return Err(QuantConfigError::TooMany {
                    field,
                    count: a.len(),
                    max: MAX_IGNORED_LAYERS,
                });
            }
            a.iter()
                .map(|e| e.as_str().map(str::to_string).ok_or(()))
                .collect::<Result<Vec<String>, ()>>()
                .map(Some)
                .map_err(|()| unsupported(field, v, hint))
        }
        Some(v) => Err(unsupported(field, v, hint)),
    }
}

impl Fp8Config {
    /// Parses an HF `quantization_config` object (the value, not the whole `config.json`).
    pub fn from_hf(q: &Value) -> Result<Fp8Config, QuantConfigError> {
        if !q.is_object() {
            return Err(unsupported(
                "quantization_config",
                q,
                "it must be a JSON object such as {\"quant_method\": \"fp8\", \"activation_scheme\": \"dynamic\", \"weight_block_size\": [128, 128]}",
            ));
        }
        let method = q.get("quant_method").ok_or(QuantConfigError::Missing {
            field: "quant_method",
            hint: "awex encodes `quant_method: \"fp8\"` checkpoints",
        })?;
        match method.as_str() {
            Some("fp8") => {}
            _ => {
                return Err(unsupported(
                    "quant_method",
                    method,
                    "awex encodes block FP8 only (`\"fp8\"`); mxfp8, fp4, gptq, awq and compressed-tensors are not supported",
                ));
            }
        }
        if let Some(fmt) = q.get("fmt")
            && fmt.as_str() != Some("e4m3")
        {
            return Err(unsupported(
                "fmt",
                fmt,
                "awex writes e4m3 (float8_e4m3fn) elements; e5m2 is not supported",
            ));
        }
        let act = q
            .get("activation_scheme")
            .ok_or(QuantConfigError::Missing {
                field: "activation_scheme",
                hint: "vLLM requires it; block FP8 uses \"dynamic\"",
            })?;
        let activation_scheme = match act.as_str() {
            Some(s @ ("dynamic" | "static")) => s.to_string(),
            _ => {
                return Err(unsupported(
                    "activation_scheme",
                    act,
                    "it must be \"dynamic\" or \"static\" (vLLM's ACTIVATION_SCHEMES)",
                ));
            }
        };
        let bs = match q.get("weight_block_size") {
            None | Some(Value::Null) => {
                return Err(QuantConfigError::Missing {
                    field: "weight_block_size",
                    hint: "without it the checkpoint is per-tensor FP8, which awex does not encode; block FP8 sets e.g. [128, 128]",
                });
            }
            Some(v) => v,
        };
        let edges: Option<Vec<u32>> = bs.as_array().map(|a| {
            a.iter()
                .filter_map(|e| e.as_u64())
                .filter(|&e| (1..=MAX_BLOCK_EDGE as u64).contains(&e))
                .map(|e| e as u32)
                .collect()
        });
        let block = match edges.as_deref() {
            Some(&[bn, bk]) if bs.as_array().map(Vec::len) == Some(2) => [bn, bk],
            _ => {
                return Err(unsupported(
                    "weight_block_size",
                    bs,
                    "it must be two integers [rows, cols] from 1 to 4096, e.g. [128, 128]",
                ));
            }
        };
        if activation_scheme != "dynamic" {
            return Err(unsupported(
                "activation_scheme",
                act,
                "block FP8 (weight_block_size set) needs \"dynamic\" (vLLM refuses the pair too)",
            ));
        }
        let scale_format = match q.get("scale_fmt") {
            None | Some(Value::Null) => ScaleFormat::F32,
            Some(v) if v.as_str() == Some("ue8m0") => ScaleFormat::Ue8m0,
            Some(v) => {
                return Err(unsupported(
                    "scale_fmt",
                    v,
                    "it must be absent (fp32 scales) or \"ue8m0\" (power-of-two scales)",
                ));
            }
        };
        let not_converted = module_names(q, "modules_to_not_convert")?;
        let ignored_layers = module_names(q, "ignored_layers")?
            .filter(|v| !v.is_empty())
            .or(not_converted)
            .unwrap_or_default();
        let config = Fp8Config {
            encoding: Fp8Block {
                block,
                scale_format,
            },
            activation_scheme,
            ignored_layers,
        };
        config.validate()?;
        Ok(config)
    }

    /// Checks a config however it was made (parsed here, or deserialised from a connect
    /// request): block FP8 with dynamic activations, block edges 1 to [`MAX_BLOCK_EDGE`], at
    /// most [`MAX_IGNORED_LAYERS`] module names of 1 to [`MAX_LAYER_NAME_BYTES`] bytes each.
    /// The CLI, the Python package and the gateway all run this one check.
    pub fn validate(&self) -> Result<(), QuantConfigError> {
        if self.activation_scheme != "dynamic" {
            return Err(unsupported(
                "activation_scheme",
                &Value::String(self.activation_scheme.clone()),
                "block FP8 (weight_block_size set) needs \"dynamic\" (vLLM refuses the pair too)",
            ));
        }
        if !self
            .encoding
            .block
            .iter()
            .all(|e| (1..=MAX_BLOCK_EDGE).contains(e))
        {
            return Err(unsupported(
                "weight_block_size",
                &serde_json::json!(self.encoding.block),
                "it must be two integers [rows, cols] from 1 to 4096, e.g. [128, 128]",
            ));
        }
        if self.ignored_layers.len() > MAX_IGNORED_LAYERS {
            return Err(QuantConfigError::TooMany {
                field: "ignored_layers",
                count: self.ignored_layers.len(),
                max: MAX_IGNORED_LAYERS,
            });
        }
        if let Some(bad) = self
            .ignored_layers
            .iter()
            .find(|n| n.is_empty() || n.len() > MAX_LAYER_NAME_BYTES)
        {
            return Err(unsupported(
                "ignored_layers",
                &Value::String(bad.clone()),
                "every entry must be a module name of 1 to 512 bytes, e.g. \"lm_head\"",
            ));
        }
        Ok(())
    }

    /// Whether a whole HF `config.json` says its linear weights are FP8
    /// (`quantization_config.quant_method: "fp8"`), however well formed the rest of it is.
    pub fn declared_by(config: &Value) -> bool {
        config
            .get("quantization_config")
            .and_then(|q| q.get("quant_method"))
            .and_then(Value::as_str)
            == Some("fp8")
    }

    /// Parses the `quantization_config` of a whole HF `config.json`; `None` when it has none.
    pub fn from_hf_model_config(config: &Value) -> Result<Option<Fp8Config>, QuantConfigError> {
        match config.get("quantization_config") {
            None | Some(Value::Null) => Ok(None),
            Some(q) => Fp8Config::from_hf(q).map(Some),
        }
    }
}

impl Fp8Block {
    /// The name of the scale tensor of an FP8 tensor named `weight`, as SGLang 0.5.23 and vLLM
    /// 0.33 register it next to the weight (`Fp8LinearMethod.create_weights`:
    /// `weight_scale_inv`; `Fp8MoEMethod.create_weights`: `w13_weight_scale_inv`,
    /// `w2_weight_scale_inv`): the weight's name with `_scale_inv` appended. The canonical
    /// (HF FP8 checkpoint) name of a canonical tensor's scales follows the same rule
    /// (`model.layers.0.self_attn.q_proj.weight_scale_inv`).
    pub fn scale_name(weight: &str) -> String {
        format!("{weight}_scale_inv")
    }

    /// The scale tensor's shape for a `[rows, cols]` weight: `[ceil(rows / bn), ceil(cols / bk)]`.
    pub fn scale_shape(&self, rows: u64, cols: u64) -> [u64; 2] {
        [
            rows.div_ceil(self.block[0] as u64),
            cols.div_ceil(self.block[1] as u64),
        ]
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn parses_a_deepseek_v3_style_config() {
        let c = Fp8Config::from_hf(&json!({
            "activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
            "weight_block_size": [128, 128]
        }))
        .unwrap();
        assert_eq!(c.encoding, Fp8Block::default());
        assert_eq!(c.activation_scheme, "dynamic");
        assert!(c.ignored_layers.is_empty());
    }

    #[test]
    fn reads_ue8m0_scales_odd_blocks_and_ignored_layers() {
        let c = Fp8Config::from_hf(&json!({
            "activation_scheme": "dynamic", "quant_method": "fp8", "scale_fmt": "ue8m0",
            "weight_block_size": [64, 32], "modules_to_not_convert": ["lm_head"]
        }))
        .unwrap();
        assert_eq!(c.encoding.block, [64, 32]);
        assert_eq!(c.encoding.scale_format, ScaleFormat::Ue8m0);
        assert_eq!(c.ignored_layers, vec!["lm_head".to_string()]);
        assert_eq!(c.encoding.scale_shape(100, 65), [2, 3]);
    }

    #[test]
    fn refuses_what_awex_cannot_encode_naming_the_field() {
        let base = json!({"activation_scheme": "dynamic", "quant_method": "fp8", "weight_block_size": [128, 128]});
        let with = |k: &str, v: Value| {
            let mut q = base.clone();
            q[k] = v;
            Fp8Config::from_hf(&q).unwrap_err().to_string()
        };
        let without = |k: &str| {
            let mut q = base.clone();
            q.as_object_mut().unwrap().remove(k);
            Fp8Config::from_hf(&q).unwrap_err().to_string()
        };
        assert!(
            with("quant_method", json!("awq"))
                .starts_with("quantization_config `quant_method` is \"awq\"")
        );
        assert!(with("quant_method", json!("mxfp8")).contains("block FP8 only"));
        assert!(with("fmt", json!("e5m2")).contains("`fmt` is \"e5m2\"; awex writes e4m3"));
        assert!(without("weight_block_size").contains("per-tensor FP8"));
        assert!(with("weight_block_size", json!([128])).contains("`weight_block_size` is [128]"));
        assert!(with("weight_block_size", json!([0, 128])).contains("from 1 to 4096"));
        assert!(with("weight_block_size", json!([128, 128, 1])).contains("two integers"));
        assert!(with("activation_scheme", json!("static")).contains("needs \"dynamic\""));
        assert!(with("activation_scheme", json!("weird")).contains("\"dynamic\" or \"static\""));
        assert!(without("activation_scheme").contains("no `activation_scheme`"));
        assert!(without("quant_method").contains("no `quant_method`"));
        assert!(with("scale_fmt", json!("e8m0x")).contains("`scale_fmt`"));
        assert!(
            Fp8Config::from_hf(&json!([1]))
                .unwrap_err()
                .to_string()
                .contains("JSON object")
        );
    }

    #[test]
    fn ignored_layers_must_be_a_bounded_list_of_names() {
        let base = json!({"activation_scheme": "dynamic", "quant_method": "fp8", "weight_block_size": [128, 128]});
        let with = |k: &str, v: Value| {
            let mut q = base.clone();
            q[k] = v;
            Fp8Config::from_hf(&q).map_err(|e| e.to_string())
        };
        let names = "it must be a list of module names (strings), e.g. [\"lm_head\"]";
        assert_eq!(
            with("ignored_layers", json!([123, null])),
            Err(format!(
                "quantization_config `ignored_layers` is [123,null]; {names}"
            ))
        );
        assert_eq!(
            with("ignored_layers", json!("lm_head")),
            Err(format!(
                "quantization_config `ignored_layers` is \"lm_head\"; {names}"
            ))
        );
        assert_eq!(
            with("modules_to_not_convert", json!({"lm_head": true})),
            Err(format!(
                "quantization_config `modules_to_not_convert` is {{\"lm_head\":true}}; {names}"
            ))
        );
        let many: Vec<String> = (0..=MAX_IGNORED_LAYERS).map(|i| format!("m{i}")).collect();
        assert_eq!(
            with("ignored_layers", json!(many)),
            Err("quantization_config `ignored_layers` lists 16385 entries; awex accepts at most 16384".into())
        );
        let e = with("ignored_layers", json!(["x".repeat(100_000)])).unwrap_err();
        assert!(
            e.contains("every entry must be a module name of 1 to 512 bytes"),
            "{e}"
        );
        assert!(
            e.len() < 400,
            "a hostile value is not echoed whole: {} bytes",
            e.len()
        );
        assert_eq!(
            with("ignored_layers", json!(["lm_head"])).map(|c| c.ignored_layers),
            Ok(vec!["lm_head".to_string()])
        );
    }

    #[test]
    fn a_deserialised_config_is_checked_as_a_parsed_one() {
        let ok: Fp8Config = serde_json::from_value(json!({
            "encoding": {"block": [128, 128], "scale_format": "f32"},
            "activation_scheme": "dynamic", "ignored_layers": []
        }))
        .unwrap();
        assert_eq!(ok.validate(), Ok(()));
        let e = Fp8Config {
            activation_scheme: "static".into(),
            ..ok.clone()
        }
        .validate()
        .unwrap_err()
        .to_string();
        assert_eq!(
            e,
            "quantization_config `activation_scheme` is \"static\"; block FP8 (weight_block_size set) needs \"dynamic\" (vLLM refuses the pair too)"
        );
        let e = Fp8Config {
            activation_scheme: "d".repeat(100_000),
            ..ok.clone()
        }
        .validate()
        .unwrap_err()
        .to_string();
        assert!(e.len() < 400, "{} bytes", e.len());
        let unknown = serde_json::from_value::<Fp8Config>(json!({
            "encoding": {"block": [128, 128], "scale_format": "f32"},
            "activation_scheme": "dynamic", "ignored_layers": [], "colour": "blue"
        }));
        assert!(unknown.is_err());
        let unknown = serde_json::from_value::<Fp8Config>(json!({
            "encoding": {"block": [128, 128], "scale_format": "f32", "x": 1},
            "activation_scheme": "dynamic", "ignored_layers": []
        }));
        assert!(unknown.is_err());
    }

    #[test]
    fn a_model_config_without_quantization_is_plain() {
        assert_eq!(
            Fp8Config::from_hf_model_config(&json!({"hidden_size": 8})),
            Ok(None)
        );
        let c = Fp8Config::from_hf_model_config(&json!({"quantization_config": {
            "activation_scheme": "dynamic", "quant_method": "fp8", "weight_block_size": [128, 128]}}))
        .unwrap();
        assert!(c.is_some());
    }
}
