//! What a rank must know of its pair, resolved from the gateway's description of the pair
//! (`GET /v1/pairs/{name}/status`, and the model a controller stored under `model.{side}`),
//! with explicit arguments taking the place of any part and checked against it.

use crate::errors::{Fail, Result};
use awex_control::client::Client;
use awex_control::wire::{PairStatus, SideStatus};
use awex_core::Transport;
use awex_core::backend::{BackendSpec, ParallelConfig, inference_backend, training_backend};
use awex_core::encoding::fp8_block::{DEFAULT_BLOCK, MAX_BLOCK_EDGE};
use awex_core::encoding::{Fp8Block, Fp8Config, InferFp8, Recipe, ScaleFormat};
use awex_core::layout::{RankId, Side};
use awex_core::model::{Catalogue, ModelSpec};
use awex_runtime::rank::RankConfig;
use awex_runtime::transport::TransportConfig;
use std::collections::BTreeMap;
use std::time::Duration;

pub(crate) use awex_control::wire::model_key;

/// The model as the caller gave it.
#[derive(Clone, Debug)]
pub(crate) enum ModelArg {
    /// A preset name, a `config.json` path or an HF model directory.
    Resolve(String),
    /// The text of a `config.json`.
    ConfigJson(String),
}

impl ModelArg {
    /// The model spec it names.
    pub(crate) fn spec(&self) -> Result<ModelSpec> {
        Ok(match self {
            ModelArg::Resolve(s) => ModelSpec::resolve(s)?,
            ModelArg::ConfigJson(t) => ModelSpec::from_config_json(t)?,
        })
    }

    /// Refuses a model whose own config quantises to FP8 (`quantization_config.quant_method:
    /// fp8`) for a connect without `infer_quant` or `infer_config`: it would be planned as a
    /// bf16 inference side, not what an engine serving that checkpoint holds (as
    /// `awex-cli`'s `--model`, `awex-cli/src/cmd/quant.rs`). A preset passes.
    pub(crate) fn refuse_fp8_as_plain(&self) -> Result<()> {
        // (a preset, or a config the model's own reader refuses with its own message)
        let value = match self {
            ModelArg::ConfigJson(t) => serde_json::from_str(t).ok(),
            ModelArg::Resolve(s) => ModelSpec::config_value_of(s).ok().flatten(),
        };
        let Some(value) = value else {
            return Ok(());
        };
        if Fp8Config::declared_by(&value) {
            return Err(Fail::Value(
                "the model's config quantises the linear weights to FP8 (quantization_config quant_method \"fp8\"), which an engine serving it holds as e4m3 and scales; pass the same config as infer_config (the encoding from it), or give the bf16 model's config for a bf16 inference side".into(),
            ));
        }
        Ok(())
    }
}

/// `awex._awex.read_config(path)`: the text of the `config.json` a path names (the file, or the
/// one in an HF model directory), read as every `--model` and `--infer-config` path is read
/// ([`ModelSpec::read_config`]): a FIFO or a device is refused, not waited on, and a file past
/// the JSON limit is refused before it is read.
#[pyo3::pyfunction]
pub(crate) fn read_config(path: std::path::PathBuf) -> pyo3::PyResult<String> {
    Ok(ModelSpec::read_config(&path).map_err(Fail::from)?)
}

/// One side's layout as the caller gave it: a whole spec, or a backend and/or a parallel config.
#[derive(Clone, Debug, Default)]
pub(crate) struct SideArg {
    /// `backend:k=v,...`.
    pub spec: Option<String>,
    /// The backend name alone.
    pub backend: Option<String>,
    /// The parallel config alone.
    pub parallel: Option<BTreeMap<String, u64>>,
}

/// Everything a Writer or Reader was constructed with.
#[derive(Clone, Debug)]
pub(crate) struct RankArgs {
    pub side: Side,
    pub gateway: String,
    pub pair: String,
    pub rank: RankId,
    pub token: Option<String>,
    pub model: Option<ModelArg>,
    pub train: SideArg,
    pub infer: SideArg,
    pub transport: Option<String>,
    pub bucket_mib: Option<u64>,
    pub host: Option<String>,
    /// Whether this rank takes part in delta updates (a pair with deltas on): `None` for the
    /// default, a Writer yes (it keeps a host copy of what it sent), a Reader no.
    pub deltas: Option<bool>,
}

/// Fills in a backend's default parallel keys, those that follow other keys included, so that
/// `tp=2`, `tp=2,pp=1` and Megatron's `tp=2,etp=2` compare equal.
pub(crate) fn normalised(side: Side, spec: &BackendSpec) -> ParallelConfig {
    let resolved = match side {
        Side::Training => {
            training_backend(&spec.backend).and_then(|b| b.resolved_parallel(&spec.parallel))
        }
        Side::Inference => {
            inference_backend(&spec.backend).and_then(|b| b.resolved_parallel(&spec.parallel))
        }
    };
    resolved.unwrap_or_else(|_| spec.parallel.clone())
}

/// The inference parallel key that counts a pair's engines.
const ENGINES: &str = "engines";

/// One side's spec: the caller's pieces where given, the pair's otherwise (an inference rank's
/// parallel config without `engines` takes the pair's); a caller's spec that disagrees with the
/// pair is refused (every rank must compute the same plan).
fn side_spec(side: Side, arg: &SideArg, theirs: &SideStatus, pair: &str) -> Result<BackendSpec> {
    let pair_spec = BackendSpec {
        backend: theirs.backend.clone(),
        parallel: theirs.parallel.clone(),
    };
    checked_side_spec(side, arg, pair_spec, pair)
}

/// [`side_spec`] against the pair's spec of the side, `pair_spec`.
fn checked_side_spec(
    side: Side,
    arg: &SideArg,
    pair_spec: BackendSpec,
    pair: &str,
) -> Result<BackendSpec> {
    let mut mine = match (&arg.spec, &arg.backend, &arg.parallel) {
        (Some(s), None, None) => s.parse::<BackendSpec>()?,
        (Some(_), _, _) => {
            return Err(Fail::Value(format!(
                "give the {side} layout either as a spec string or as backend/parallel, not both"
            )));
        }
        (None, b, p) => BackendSpec {
            backend: b.clone().unwrap_or_else(|| pair_spec.backend.clone()),
            parallel: p
                .clone()
                .map(ParallelConfig)
                .unwrap_or_else(|| pair_spec.parallel.clone()),
        },
    };
    // How many engines the pair has is the pair's: an engine's own parallel config (what an
    // engine's receiver reads from its server, e.g. vLLM's tp and ep) cannot know it.
    if side == Side::Inference
        && !mine.parallel.0.contains_key(ENGINES)
        && let Some(&n) = pair_spec.parallel.0.get(ENGINES)
    {
        mine.parallel.0.insert(ENGINES.to_string(), n);
    }
    if mine.backend != pair_spec.backend || normalised(side, &mine) != normalised(side, &pair_spec)
    {
        return Err(Fail::Layout(format!(
            "this rank was given the {side} layout `{mine}` but pair `{pair}` was connected with `{pair_spec}`; every rank must use the pair's layouts (leave it out to take the pair's)"
        )));
    }
    Ok(mine)
}

/// The model: the caller's, else the one the controller stored on the gateway, else the
/// preset the pair names; checked against the pair's fingerprint for this rank's side.
async fn model(args: &RankArgs, client: &Client, st: &PairStatus) -> Result<ModelSpec> {
    let theirs = match args.side {
        Side::Training => &st.training,
        Side::Inference => &st.inference,
    };
    let spec = match &args.model {
        Some(m) => m.spec()?,
        None => {
            let stored = client
                .get_kv(&args.pair, &model_key(args.side), Duration::ZERO)
                .await;
            match stored {
                Ok(e) => serde_json::from_value::<ModelSpec>(e.value)
                    .map_err(|e| e.to_string())
                    .and_then(|s| s.validate().map(|()| s).map_err(|e| e.to_string()))
                    .map_err(|e| {
                        Fail::Awex(format!(
                            "the model stored on pair `{}` under `{}` is not a model description: {e}",
                            args.pair,
                            model_key(args.side)
                        ))
                    })?,
                Err(e) if e.status() == Some(404) => {
                    ModelSpec::resolve(&theirs.model).map_err(|_| {
                        Fail::Value(format!(
                            "pair `{}` was connected with model `{}`, which is not a built-in preset, and no controller stored it on the gateway; pass model=<preset, config.json or HF model directory>",
                            args.pair, theirs.model
                        ))
                    })?
                }
                Err(e) => return Err(e.into()),
            }
        }
    };
    let fp = format!("{:016x}", spec.fingerprint());
    if fp != theirs.fingerprint {
        return Err(Fail::Layout(format!(
            "model `{}` (fingerprint {fp}) differs from the {} model of pair `{}` (`{}`, fingerprint {}); pass the model the pair was connected with",
            spec.name, args.side, args.pair, theirs.model, theirs.fingerprint
        )));
    }
    Ok(spec)
}

/// Resolves a rank's full configuration from its arguments and the pair's description.
pub(crate) async fn resolve(args: &RankArgs) -> Result<RankConfig> {
    let client = Client::new(&args.gateway, args.token.clone())?;
    let st = client.status(&args.pair).await?;
    let train = side_spec(Side::Training, &args.train, &st.training, &args.pair)?;
    let infer = side_spec(Side::Inference, &args.infer, &st.inference, &args.pair)?;
    let model = model(args, &client, &st).await?;
    let pair_transport: Transport = st.transport;
    let transport = match &args.transport {
        None => pair_transport,
        Some(t) => {
            let t: Transport = t.parse().map_err(Fail::Value)?;
            if t != pair_transport {
                return Err(Fail::Value(format!(
                    "pair `{}` uses transport {pair_transport} but this rank was given {t}",
                    args.pair
                )));
            }
            t
        }
    };
    let bucket_mib = args.bucket_mib.unwrap_or(st.options.bucket_mib).max(1);
    Ok(RankConfig {
        // every rank takes the inference side's FP8 encoding the pair was connected with: the
        // plan (which transfers are receiver-encoded) and the receivers' tensors follow from it
        infer_fp8: st.inference.fp8.clone(),
        gateway: args.gateway.clone(),
        token: args.token.clone(),
        pair: args.pair.clone(),
        side: args.side,
        rank: args.rank,
        model,
        train,
        infer,
        transport,
        bucket_bytes: bucket_mib << 20,
        host: args
            .host
            .clone()
            .or_else(|| std::env::var("AWEX_HOST").ok())
            .unwrap_or_else(|| "127.0.0.1".into()),
        uid: st.uid.clone(),
        apply: st.options.apply,
        transports: TransportConfig::from_vars(|k| std::env::var(k).ok())
            .map_err(|e| Fail::Value(e.to_string()))?,
        gateway_lost: awex_runtime::rank::gateway_lost_from(
            std::env::var("AWEX_GATEWAY_LOST_S").ok().as_deref(),
        )
        .map_err(|e| Fail::Value(e.to_string()))?,
        // a training rank keeps a copy of what it sent; a Reader takes deltas only when its
        // owner says that nothing but awex writes its registered tensors between updates (an
        // engine whose loader rewrites weights after loading must not: its tensors do not
        // provably hold what they received)
        deltas: args
            .deltas
            .unwrap_or(args.side == awex_core::layout::Side::Training),
    })
}

/// The inference side's FP8 settings of a connect, as `awex-cli`'s `--infer-quant`,
/// `--infer-config`, `--fp8-block` and `--fp8-recipe` take them (`awex-cli/src/cmd/quant.rs`):
/// `None` for a plain side. `config_json` is the text of the inference model's `config.json`
/// (`config_what` names it in messages); its `quantization_config` gives the encoding and its
/// model must be `model` in everything but the quantisation.
pub(crate) fn infer_fp8(
    model: &ModelSpec,
    infer_quant: Option<&str>,
    config_json: Option<&str>,
    config_what: &str,
    block: Option<[u32; 2]>,
    recipe: Option<&str>,
) -> Result<Option<InferFp8>> {
    let recipe = match recipe {
        Some(r) => Some(
            r.parse::<Recipe>()
                .map_err(|e| Fail::Value(format!("fp8_recipe: {e}")))?,
        ),
        None => None,
    };
    if let Some(q) = infer_quant
        && q != "fp8"
    {
        return Err(Fail::Value(format!(
            "infer_quant must be \"fp8\" (or None for a plain inference side), not {q:?}"
        )));
    }
    if let Some(b) = block
        && b.iter().any(|&e| e == 0 || e > MAX_BLOCK_EDGE)
    {
        return Err(Fail::Value(format!(
            "fp8_block {b:?}: block edges go from 1 to {MAX_BLOCK_EDGE}, e.g. (128, 128)"
        )));
    }
    let config = match (config_json, infer_quant) {
        (Some(text), _) => {
            if block.is_some() {
                return Err(Fail::Value(format!(
                    "fp8_block is given by the quantization_config of infer_config {config_what} (`weight_block_size`); drop one of them"
                )));
            }
            let value: serde_json::Value = serde_json::from_str(text)
                .map_err(|e| Fail::Value(format!("infer_config {config_what} is not JSON: {e}")))?;
            let config = Fp8Config::from_hf_model_config(&value)
                .map_err(|e| Fail::Value(format!("infer_config {config_what}: {e}")))?
                .ok_or_else(|| {
                    Fail::Value(format!(
                        "infer_config {config_what} has no quantization_config; give an FP8 checkpoint's config (quant_method fp8) or infer_quant=\"fp8\""
                    ))
                })?;
            let theirs = ModelSpec::from_config_json(text)
                .map_err(|e| Fail::Value(format!("infer_config {config_what}: {e}")))?;
            if let Some(d) = Catalogue::of(&theirs).first_difference(&Catalogue::of(model)) {
                return Err(Fail::Value(format!(
                    "the inference model of infer_config {config_what} differs from the pair's model `{}` in more than the quantisation: {d}",
                    model.name
                )));
            }
            config
        }
        (None, Some(_)) => Fp8Config {
            encoding: Fp8Block {
                block: block.unwrap_or(DEFAULT_BLOCK),
                scale_format: recipe.map_or(ScaleFormat::F32, Recipe::scale_format),
            },
            activation_scheme: "dynamic".into(),
            ignored_layers: vec![],
        },
        (None, None) => {
            if block.is_some() || recipe.is_some() {
                return Err(Fail::Value(
                    "fp8_block and fp8_recipe need infer_quant=\"fp8\" or infer_config".into(),
                ));
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
        Fail::Value(format!("fp8_recipe {}: {e}", recipe.name()))
    })?))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A Qwen3 `config.json` (the qwen3-tiny sizes).
    fn qwen3() -> serde_json::Value {
        serde_json::json!({
            "architectures": ["Qwen3ForCausalLM"], "hidden_size": 64, "num_hidden_layers": 4,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
            "intermediate_size": 128, "vocab_size": 1000, "tie_word_embeddings": false,
            "dtype": "bfloat16"
        })
    }

    #[test]
    fn an_fp8_model_for_a_plain_side_is_refused_naming_infer_config() {
        let mut cfg = qwen3();
        assert!(
            ModelArg::ConfigJson(cfg.to_string())
                .refuse_fp8_as_plain()
                .is_ok()
        );
        assert!(
            ModelArg::Resolve("qwen3-tiny".into())
                .refuse_fp8_as_plain()
                .is_ok()
        );
        cfg["quantization_config"] = serde_json::json!({
            "quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [32, 64]
        });
        let e = ModelArg::ConfigJson(cfg.to_string())
            .refuse_fp8_as_plain()
            .unwrap_err();
        assert!(
            format!("{e:?}").contains("pass the same config as infer_config"),
            "{e:?}"
        );
        let dir = std::env::temp_dir().join(format!("awex-py-fp8-model-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("config.json"), cfg.to_string()).unwrap();
        let r = ModelArg::Resolve(dir.to_string_lossy().into_owned()).refuse_fp8_as_plain();
        std::fs::remove_dir_all(&dir).unwrap();
        assert!(r.is_err(), "an HF directory whose config is FP8 was taken");
    }

    #[test]
    fn fp8_settings_follow_the_cli_and_bad_ones_say_what_to_change() {
        let model = ModelSpec::from_config_value(&qwen3()).unwrap();
        let f = infer_fp8(&model, Some("fp8"), None, "", None, None)
            .unwrap()
            .unwrap();
        assert_eq!(f.recipe, Recipe::Vllm);
        assert_eq!(f.config.encoding.block, [128, 128]);
        assert_eq!(infer_fp8(&model, None, None, "", None, None).unwrap(), None);
        let e = infer_fp8(&model, Some("int4"), None, "", None, None).unwrap_err();
        assert!(format!("{e:?}").contains("infer_quant must be"), "{e:?}");
        let e = infer_fp8(&model, None, None, "", Some([16, 16]), None).unwrap_err();
        assert!(format!("{e:?}").contains("need infer_quant"), "{e:?}");
        let e = infer_fp8(&model, Some("fp8"), None, "", Some([0, 16]), None).unwrap_err();
        assert!(format!("{e:?}").contains("block edges"), "{e:?}");
        let ue = infer_fp8(&model, Some("fp8"), None, "", None, Some("deepgemm-ue8m0"))
            .unwrap()
            .unwrap();
        assert_eq!(ue.config.encoding.scale_format, ScaleFormat::Ue8m0);
        let e = infer_fp8(&model, Some("fp8"), None, "", None, Some("nope")).unwrap_err();
        assert!(format!("{e:?}").contains("fp8_recipe"), "{e:?}");
        // a checkpoint's config: its block; a config without quantization_config is refused
        let mut cfg = qwen3();
        let e = infer_fp8(&model, None, Some(&cfg.to_string()), "c.json", None, None).unwrap_err();
        assert!(format!("{e:?}").contains("no quantization_config"), "{e:?}");
        cfg["quantization_config"] = serde_json::json!({
            "quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [32, 64]
        });
        let f = infer_fp8(&model, None, Some(&cfg.to_string()), "c.json", None, None)
            .unwrap()
            .unwrap();
        assert_eq!(f.config.encoding.block, [32, 64]);
        let e = infer_fp8(
            &model,
            None,
            Some(&cfg.to_string()),
            "c.json",
            Some([16, 16]),
            None,
        )
        .unwrap_err();
        assert!(format!("{e:?}").contains("drop one of them"), "{e:?}");
    }

    #[test]
    fn an_engine_rank_without_engines_takes_the_pairs_and_one_that_names_others_is_refused() {
        // vLLM's receiver gives its server's tp and ep (awex.vllm.parallel_of): the number of
        // engines is the pair's
        let pair: BackendSpec = "vllm:tp=1,engines=2".parse().unwrap();
        let arg = SideArg {
            spec: None,
            backend: Some("vllm".into()),
            parallel: Some([("tp".to_string(), 1), ("ep".to_string(), 1)].into()),
        };
        let got = checked_side_spec(Side::Inference, &arg, pair.clone(), "p").unwrap();
        assert_eq!(got.parallel.0.get("engines"), Some(&2));
        let arg = SideArg {
            spec: Some("vllm:tp=1,engines=3".into()),
            backend: None,
            parallel: None,
        };
        let e = checked_side_spec(Side::Inference, &arg, pair.clone(), "p").unwrap_err();
        assert!(
            format!("{e:?}").contains("every rank must use the pair's layouts"),
            "{e:?}"
        );
        let arg = SideArg {
            spec: Some("vllm:tp=2".into()),
            backend: None,
            parallel: None,
        };
        assert!(checked_side_spec(Side::Inference, &arg, pair.clone(), "p").is_err());
    }

    fn norm(side: Side, s: &str) -> ParallelConfig {
        normalised(side, &s.parse().unwrap())
    }

    #[test]
    fn a_rank_spec_that_spells_out_a_derived_default_equals_the_pairs() {
        // Megatron's etp is tp unless given, grouped_gemm is the opposite of local_spec
        assert_eq!(
            norm(Side::Training, "megatron:tp=2"),
            norm(Side::Training, "megatron:tp=2,etp=2,pp=1")
        );
        assert_eq!(
            norm(Side::Training, "megatron:tp=2,local_spec=1"),
            norm(Side::Training, "megatron:tp=2,local_spec=1,grouped_gemm=0")
        );
        assert_ne!(
            norm(Side::Training, "megatron:tp=2"),
            norm(Side::Training, "megatron:tp=2,etp=1")
        );
        assert_eq!(
            norm(Side::Inference, "sglang:tp=2"),
            norm(Side::Inference, "sglang:tp=2,ep=1,engines=1")
        );
    }
}
