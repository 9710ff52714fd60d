//! Detecting SGLang: its Python package, and a live server's parallel config through its HTTP API.
//!
//! SGLang's server-info endpoint (`GET /server_info`, `GET /get_server_info` before it was
//! renamed) answers one flat JSON object: every `ServerArgs` field (`model_path`, `tp_size`,
//! `dp_size`, `ep_size`, ...), the scheduler's info, per-DP `internal_states`, and `version`.

use awex_core::backend::{Detection, ParallelConfig, Probe};
use serde_json::Value;

/// Server-info paths, newest first.
pub const SERVER_INFO_PATHS: [&str; 2] = ["/server_info", "/get_server_info"];

/// Weight of an importable `sglang` package.
const PACKAGE_WEIGHT: f64 = 0.3;
/// Weight of a server that answers SGLang's server-info format.
const SERVER_WEIGHT: f64 = 0.7;
/// Weight of a server that answers, but not in SGLang's format.
const FOREIGN_SERVER_WEIGHT: f64 = 0.05;

/// What awex reads from SGLang's server-info response.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServerInfo {
    /// Tensor-parallel size of each replica.
    pub tp_size: u64,
    /// Data-parallel replicas inside the server (1 when absent).
    pub dp_size: u64,
    /// Expert-parallel size (1 when absent: servers older than expert parallelism).
    pub ep_size: u64,
    /// The model the server loaded, when reported.
    pub model_path: Option<String>,
    /// SGLang version, when reported.
    pub version: Option<String>,
    /// Whether attention runs data-parallel inside the TP group.
    pub enable_dp_attention: bool,
    /// Attention data-parallel groups inside the TP group (`attn_dp_size`, SGLang >= 0.5.23;
    /// 1 when absent).
    pub attn_dp_size: u64,
    /// The tensor-parallel size of the dense MLP layers of an MoE model (`moe_dense_tp_size`;
    /// `None`: tp).
    pub moe_dense_tp_size: Option<u64>,
}

impl ServerInfo {
    /// Reads a server-info JSON object; `Err` says which field is missing or malformed.
    pub fn from_json(v: &Value) -> Result<Self, String> {
        let obj = v
            .as_object()
            .ok_or_else(|| format!("expected a JSON object, found {}", kind(v)))?;
        let size = |key: &str, default: Option<u64>| -> Result<u64, String> {
            match obj.get(key) {
                None | Some(Value::Null) => {
                    default.ok_or_else(|| format!("the response has no `{key}`"))
                }
                Some(x) => match x.as_u64() {
                    Some(n) if n >= 1 => Ok(n),
                    _ => Err(format!("`{key}` must be a positive integer, found {x}")),
                },
            }
        };
        let text = |key: &str| obj.get(key).and_then(Value::as_str).map(str::to_string);
        Ok(ServerInfo {
            tp_size: size("tp_size", None)?,
            dp_size: size("dp_size", Some(1))?,
            ep_size: size("ep_size", Some(1))?,
            model_path: text("model_path"),
            version: text("version"),
            enable_dp_attention: obj
                .get("enable_dp_attention")
                .and_then(Value::as_bool)
                .unwrap_or(false),
            attn_dp_size: size("attn_dp_size", Some(1))?,
            moe_dense_tp_size: match obj.get("moe_dense_tp_size") {
                None | Some(Value::Null) => None,
                Some(_) => Some(size("moe_dense_tp_size", None)?),
            },
        })
    }

    /// The awex parallel config of one engine: `tp`, `ep`, `engines=1`.
    pub fn parallel(&self) -> ParallelConfig {
        ParallelConfig::from_pairs([("tp", self.tp_size), ("ep", self.ep_size), ("engines", 1)])
    }
}

fn kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// The server's info, newest path first; `Err` lists why each path failed.
fn fetch_server_info(probe: &Probe) -> Result<(&'static str, &Value), Vec<String>> {
    let mut errors = Vec::new();
    for path in SERVER_INFO_PATHS {
        match probe.server_answer(path) {
            Ok(v) => return Ok((path, v)),
            Err(e) => errors.push(e),
        }
    }
    Err(errors)
}

/// Looks for SGLang: the `sglang` package and a server's info at `probe.server_url`.
pub fn detect(probe: &Probe) -> Detection {
    let mut d = Detection::default();
    if probe.has_package("sglang") {
        d.add(PACKAGE_WEIGHT, "python package `sglang` is importable");
    } else {
        d.absent_package(probe, "sglang");
    }
    let Some(url) = probe.server_url.as_deref() else {
        d.evidence.push(
            "no server URL given: pass the SGLang server's URL to read its tp/ep/dp sizes".into(),
        );
        return d;
    };
    let (path, json) = match fetch_server_info(probe) {
        Ok(found) => found,
        Err(errors) => {
            d.evidence.push(format!(
                "no SGLang server answered at {url}: {}",
                errors.join("; ")
            ));
            return d;
        }
    };
    let info = match ServerInfo::from_json(json) {
        Ok(info) => info,
        Err(why) => {
            d.add(
                FOREIGN_SERVER_WEIGHT,
                format!(
                    "a server at {url} answered GET {path}, but not in SGLang's server-info format: {why}"
                ),
            );
            return d;
        }
    };
    let version = info.version.as_deref().map_or_else(
        || "SGLang (version not reported)".to_string(),
        |v| format!("SGLang {v}"),
    );
    let model = info
        .model_path
        .as_deref()
        .map_or_else(String::new, |m| format!("model_path={m}, "));
    d.add(
        SERVER_WEIGHT,
        format!(
            "{version} server at {url} (GET {path}): {model}tp_size={}, ep_size={}",
            info.tp_size, info.ep_size
        ),
    );
    d.evidence.push(format!(
        "dp_size={}: the server runs {} data-parallel {} of tp_size={}; awex lays out one engine of tp={} ranks (engines=1)",
        info.dp_size,
        info.dp_size,
        if info.dp_size == 1 { "replica" } else { "replicas" },
        info.tp_size,
        info.tp_size
    ));
    d.evidence.push(loader_evidence(json));
    if info.enable_dp_attention {
        d.evidence.push(
            "enable_dp_attention=true: attention is split over attn_tp = tp/dp, which awex does not lay out yet; the layout assumes attention split over tp".into(),
        );
    }
    d.parallel = Some(info.parallel());
    d
}

/// Whether the server allows awex's custom weight loader, as its info shows it: SGLang lists
/// `--custom-weight-loader` as `custom_weight_loader` among the resolved server arguments
/// (0.5.23 resolves an unset flag to `[]`, `arg_groups/model_path_hook.py`); servers that do not
/// report the field say nothing either way.
pub fn loader_evidence(info: &Value) -> String {
    let loader = crate::control::LOADER;
    match info.get("custom_weight_loader") {
        None => format!(
            "custom weight loader: unknown (the server's info has no `custom_weight_loader`; awex needs `--custom-weight-loader {loader}`)"
        ),
        Some(Value::Array(list)) if list.iter().any(|x| x.as_str() == Some(loader)) => {
            format!(
                "custom weight loader: {loader} is allowed (custom_weight_loader={})",
                Value::Array(list.clone())
            )
        }
        Some(other) => {
            let shown = match other {
                Value::Null => "[]".to_string(),
                v => v.to_string(),
            };
            format!(
                "custom weight loader: {loader} is not allowed (custom_weight_loader={shown}); launch the server with `--custom-weight-loader {loader}`"
            )
        }
    }
}
