//! Input checks shared by the resources: names, sizes, and the model/catalogue comparison that
//! decides whether two sides describe the same canonical tensors.

use super::error::ApiError;
use awex_core::layout::Side;
use awex_core::model::{Catalogue, CatalogueSummary, ModelSpec};
use serde_json::Value;

/// Checks a pair name or rendezvous key: `[A-Za-z0-9._-]{1,128}`, not `.` or `..` (which no
/// URL can name: clients resolve them as path steps).
pub(crate) fn name(what: &str, s: &str) -> Result<(), ApiError> {
    if s == "." || s == ".." {
        return Err(ApiError::BadRequest(format!(
            "{what} `{s}` is invalid: `.` and `..` cannot be named in a URL; use 1 to 128 characters from A-Z a-z 0-9 . _ - other than these two"
        )));
    }
    let ok = !s.is_empty()
        && s.len() <= 128
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'));
    if ok {
        Ok(())
    } else {
        Err(ApiError::BadRequest(format!(
            "{what} `{}` is invalid: use 1 to 128 characters from A-Z a-z 0-9 . _ -",
            clip(s, 160)
        )))
    }
}

/// At most `n` characters of `s` (for echoing input in messages).
pub(crate) fn clip(s: &str, n: usize) -> String {
    if s.chars().count() <= n {
        s.to_string()
    } else {
        let mut out: String = s.chars().take(n).collect();
        out.push_str("...");
        out
    }
}

/// Size of a JSON value once serialised, in bytes.
pub(crate) fn json_size(v: &Value) -> usize {
    struct Count(usize);
    impl std::io::Write for Count {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0 += buf.len();
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let mut c = Count(0);
    match serde_json::to_writer(&mut c, v) {
        Ok(()) => c.0,
        Err(_) => usize::MAX,
    }
}

/// Parses a side's `model` strictly: unknown fields rejected, sizes within
/// [`crate::limits`] and consistent, so that building its catalogue is cheap and cannot overflow.
pub(crate) fn model(side: Side, raw: &Value) -> Result<ModelSpec, ApiError> {
    let spec: ModelSpec = serde_json::from_value(raw.clone())
        .map_err(|e| ApiError::Unprocessable(format!("invalid request body: {side}.model: {e}")))?;
    let known = serde_json::to_value(&spec).unwrap_or(Value::Null);
    if let Some(field) = unknown_field(raw, &known, &format!("{side}.model")) {
        return Err(ApiError::Unprocessable(format!(
            "invalid request body: unknown field `{field}`"
        )));
    }
    // Bounds first (awex_core::limits): `validate` walks every layer.
    spec.check_limits()
        .map_err(|m| ApiError::Unprocessable(format!("{side} model is too large: {m}")))?;
    spec.validate()
        .map_err(|e| ApiError::Unprocessable(format!("{side} model is invalid: {e}")))?;
    Ok(spec)
}

/// The first key of `raw` (an object, recursively) that `known` (the re-serialised spec) lacks.
fn unknown_field(raw: &Value, known: &Value, path: &str) -> Option<String> {
    let (Value::Object(r), Value::Object(k)) = (raw, known) else {
        return None;
    };
    for (key, value) in r {
        let here = format!("{path}.{key}");
        match k.get(key) {
            None => return Some(here),
            Some(kv) => {
                if let Some(f) = unknown_field(value, kv, &here) {
                    return Some(f);
                }
            }
        }
    }
    None
}

/// Rebuilds a side's catalogue and checks that its summary matches the one sent.
pub(crate) fn catalogue(
    side: Side,
    spec: &ModelSpec,
    sent: &CatalogueSummary,
) -> Result<Catalogue, ApiError> {
    let cat = Catalogue::of(spec);
    let own = cat.summary();
    if &own != sent {
        // the summary that would pass is not handed out: a client that sends one computes it
        // from the same model, as awex's own clients do
        return Err(ApiError::Unprocessable(format!(
            "the {side} catalogue summary does not match its model `{}`: the request says {} tensors, {} bytes, digest {}, which is not what this model yields; send the summary awex computes from the model itself (`Catalogue::of(model).summary()`, as `awex-cli pair connect` and the Python package do), and check that both were built from the same config",
            clip(&spec.name, 128),
            sent.tensors,
            sent.bytes,
            clip(&sent.digest, 64)
        )));
    }
    Ok(cat)
}

/// The first canonical tensor on which training and inference disagree, described for a person;
/// dtypes may differ where the sender can convert (`DType::converts_to`).
pub(crate) fn first_difference(training: &Catalogue, inference: &Catalogue) -> Option<String> {
    for t in training.tensors() {
        let Some(i) = inference.get(&t.name) else {
            return Some(format!(
                "tensor `{}` ({} {}) exists on the training side but not on the inference side",
                t.name, t.shape, t.dtype
            ));
        };
        if i.shape != t.shape {
            return Some(format!(
                "tensor `{}` has shape {} ({}) on the training side and {} ({}) on the inference side",
                t.name, t.shape, t.dtype, i.shape, i.dtype
            ));
        }
        if !t.dtype.converts_to(i.dtype) {
            return Some(format!(
                "tensor `{}` is {} {} on the training side and {} {} on the inference side; awex cannot convert {} to {}",
                t.name, t.dtype, t.shape, i.dtype, i.shape, t.dtype, i.dtype
            ));
        }
    }
    inference
        .tensors()
        .iter()
        .find(|i| training.get(&i.name).is_none())
        .map(|i| {
            format!(
                "tensor `{}` ({} {}) exists on the inference side but not on the training side",
                i.name, i.shape, i.dtype
            )
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dot_and_dot_dot_are_not_names_but_names_with_dots_are() {
        for bad in [".", ".."] {
            let e = name("pair name", bad).unwrap_err().to_string();
            assert!(e.contains("cannot be named in a URL"), "{e}");
        }
        for good in ["a.b", "...", ".x", "x.."] {
            assert!(name("pair name", good).is_ok(), "{good}");
        }
    }
    use awex_core::DType;
    use awex_core::model::presets::preset;

    fn tiny() -> ModelSpec {
        preset("qwen3-tiny").unwrap()
    }

    #[test]
    fn names_accept_the_documented_alphabet_only() {
        assert!(name("pair name", "run-1.a_B").is_ok());
        assert!(name("pair name", &"x".repeat(128)).is_ok());
        let long = name("pair name", &"x".repeat(129)).unwrap_err();
        assert_eq!(long.status().as_u16(), 400);
        assert_eq!(
            name("pair name", "a/b").unwrap_err().to_string(),
            "pair name `a/b` is invalid: use 1 to 128 characters from A-Z a-z 0-9 . _ -"
        );
        assert!(name("key", "").is_err());
        assert!(name("key", "é").is_err());
    }

    #[test]
    fn dtype_difference_is_allowed_where_conversion_exists() {
        let t = Catalogue::of(&ModelSpec {
            dtype: DType::F32,
            ..tiny()
        });
        let i = Catalogue::of(&tiny());
        assert_eq!(first_difference(&t, &i), None);
        let ints = Catalogue::of(&ModelSpec {
            dtype: DType::I32,
            ..tiny()
        });
        assert_eq!(
            first_difference(&ints, &i).unwrap(),
            "tensor `model.embed_tokens.weight` is i32 [1000, 64] on the training side and bf16 [1000, 64] on the inference side; awex cannot convert i32 to bf16"
        );
    }

    #[test]
    fn first_difference_names_tensor_and_both_shapes() {
        let t = Catalogue::of(&tiny());
        let i = Catalogue::of(&ModelSpec {
            intermediate_size: 256,
            ..tiny()
        });
        assert_eq!(
            first_difference(&t, &i).unwrap(),
            "tensor `model.layers.0.mlp.gate_proj.weight` has shape [128, 64] (bf16) on the training side and [256, 64] (bf16) on the inference side"
        );
        let fewer = Catalogue::of(&ModelSpec {
            num_layers: 3,
            ..tiny()
        });
        assert_eq!(
            first_difference(&t, &fewer).unwrap(),
            "tensor `model.layers.3.input_layernorm.weight` ([64] bf16) exists on the training side but not on the inference side"
        );
        assert_eq!(
            first_difference(&fewer, &t).unwrap(),
            "tensor `model.layers.3.input_layernorm.weight` ([64] bf16) exists on the inference side but not on the training side"
        );
    }

    #[test]
    fn hostile_model_sizes_are_refused_before_building_a_catalogue() {
        let mut raw = serde_json::to_value(tiny()).unwrap();
        raw["num_layers"] = serde_json::json!(1u64 << 40);
        let e = model(Side::Training, &raw).unwrap_err();
        assert_eq!(
            e.to_string(),
            "training model is too large: num_hidden_layers=1099511627776 is above awex's limit of 1024 (8x the most layers of a real model, 126)"
        );
        let mut raw = serde_json::to_value(tiny()).unwrap();
        raw["hidden_size"] = serde_json::json!(u64::MAX);
        raw["vocab_size"] = serde_json::json!(u64::MAX);
        let e = model(Side::Inference, &raw).unwrap_err();
        assert_eq!(
            e.to_string(),
            "inference model is too large: hidden_size=18446744073709551615 is above awex's limit of 65536 (2.5x the largest real hidden size, 25600)"
        );
        // a kind the architecture does not have: refused, not ignored
        let mut raw = serde_json::to_value(tiny()).unwrap();
        raw["linear"] = serde_json::json!({
            "num_key_heads": 4, "num_value_heads": 8, "key_head_dim": 16, "value_head_dim": 16,
            "conv_kernel": 4, "full_attention_layers": [3], "attn_output_gate": true
        });
        assert_eq!(
            model(Side::Training, &raw).unwrap_err().to_string(),
            "training model is invalid: inconsistent model sizes: the model gives linear-attention sizes (`linear`), but Qwen3ForCausalLM has no linear attention; only Qwen3NextForCausalLM, Qwen3_5ForCausalLM and Qwen3_5MoeForCausalLM models have them"
        );
        let mut raw = serde_json::to_value(tiny()).unwrap();
        raw["colour"] = serde_json::json!("blue");
        assert_eq!(
            model(Side::Training, &raw).unwrap_err().to_string(),
            "invalid request body: unknown field `training.model.colour`"
        );
    }
}
