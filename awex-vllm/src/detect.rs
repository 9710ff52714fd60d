//! Detecting vLLM: its Python package, and a live server's parallel config through its HTTP API.
//!
//! vLLM's dev-mode server-info route (`GET /server_info?config_format=json`, registered by
//! `register_vllm_dev_api_routers` when `VLLM_SERVER_DEV_MODE=1`;
//! `vllm/entrypoints/serve/dev/server_info/api_router.py`) answers
//! `{"vllm_config": <VllmConfig as JSON>, "vllm_env", "system_env"}`; awex reads
//! `vllm_config.parallel_config` (`tensor_parallel_size`, `data_parallel_size`,
//! `pipeline_parallel_size`, `enable_expert_parallel`), `vllm_config.model_config.model` and
//! `vllm_config.weight_transfer_config.backend`.

use awex_core::backend::{Detection, ParallelConfig, Probe};
use serde_json::Value;

/// Server-info paths, in order.
pub const SERVER_INFO_PATHS: [&str; 1] = ["/server_info?config_format=json"];

const PACKAGE_WEIGHT: f64 = 0.3;
const SERVER_WEIGHT: f64 = 0.7;
const FOREIGN_SERVER_WEIGHT: f64 = 0.05;

/// What awex reads from vLLM's server-info response.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServerInfo {
    /// `parallel_config.tensor_parallel_size`.
    pub tp_size: u64,
    /// `parallel_config.data_parallel_size` (1 when absent).
    pub dp_size: u64,
    /// `parallel_config.pipeline_parallel_size` (1 when absent).
    pub pp_size: u64,
    /// `parallel_config.enable_expert_parallel`: experts spread over the TP group.
    pub expert_parallel: bool,
    /// `model_config.model`, when reported.
    pub model: Option<String>,
    /// `weight_transfer_config.backend`, when the server was started with one.
    pub weight_transfer_backend: Option<String>,
}

impl ServerInfo {
    /// Reads a server-info JSON object; `Err` says which field is missing or malformed.
    pub fn from_json(v: &Value) -> Result<Self, String> {
        let cfg = v
            .get("vllm_config")
            .ok_or("the response has no `vllm_config` (start vLLM with VLLM_SERVER_DEV_MODE=1)")?;
        let cfg = match cfg {
            Value::Object(_) => cfg,
            Value::String(_) => {
                return Err("`vllm_config` is text: ask with ?config_format=json".into());
            }
            _ => return Err("`vllm_config` must be an object".into()),
        };
        let par = cfg
            .get("parallel_config")
            .and_then(Value::as_object)
            .ok_or("the response has no `vllm_config.parallel_config`")?;
        let size = |key: &str, default: Option<u64>| -> Result<u64, String> {
            match par.get(key) {
                None | Some(Value::Null) => {
                    default.ok_or_else(|| format!("the response has no `parallel_config.{key}`"))
                }
                Some(x) => match x.as_u64() {
                    Some(n) if n >= 1 => Ok(n),
                    _ => Err(format!(
                        "`parallel_config.{key}` must be a positive integer, found {x}"
                    )),
                },
            }
        };
        let text = |a: &str, b: &str| {
            cfg.get(a)
                .and_then(|x| x.get(b))
                .and_then(Value::as_str)
                .map(str::to_string)
        };
        Ok(ServerInfo {
            tp_size: size("tensor_parallel_size", None)?,
            dp_size: size("data_parallel_size", Some(1))?,
            pp_size: size("pipeline_parallel_size", Some(1))?,
            expert_parallel: par
                .get("enable_expert_parallel")
                .and_then(Value::as_bool)
                .unwrap_or(false),
            model: text("model_config", "model"),
            weight_transfer_backend: text("weight_transfer_config", "backend"),
        })
    }

    /// `ep` as awex's vLLM layout names it: `tp` with expert parallelism, else 1.
    pub fn ep(&self) -> u64 {
        if self.expert_parallel {
            self.tp_size
        } else {
            1
        }
    }

    /// The awex parallel config of one engine: `tp`, `ep`, `engines=1`.
    pub fn parallel(&self) -> ParallelConfig {
        ParallelConfig::from_pairs([("tp", self.tp_size), ("ep", self.ep()), ("engines", 1)])
    }
}

/// Looks for vLLM: the `vllm` package and a server's info at `probe.server_url`.
pub fn detect(probe: &Probe) -> Detection {
    let mut d = Detection::default();
    if probe.has_package("vllm") {
        d.add(PACKAGE_WEIGHT, "python package `vllm` is importable");
    } else {
        d.absent_package(probe, "vllm");
    }
    let Some(url) = probe.server_url.as_deref() else {
        d.evidence.push(
            "no server URL given: pass the vLLM server's URL (VLLM_SERVER_DEV_MODE=1) to read its tp/ep sizes".into(),
        );
        return d;
    };
    let path = SERVER_INFO_PATHS[0];
    let json = match probe.server_answer(path) {
        Ok(v) => v,
        Err(e) => {
            d.evidence
                .push(format!("no vLLM server answered at {url}: {e}"));
            return d;
        }
    };
    let info = match ServerInfo::from_json(json) {
        Ok(info) => info,
        Err(why) => {
            d.add(
                FOREIGN_SERVER_WEIGHT,
                format!("a server at {url} answered GET {path}, but not in vLLM's format: {why}"),
            );
            return d;
        }
    };
    d.add(
        SERVER_WEIGHT,
        format!(
            "vLLM server at {url} (GET {path}): model={}, tensor_parallel_size={}, enable_expert_parallel={}, weight_transfer backend={}",
            info.model.as_deref().unwrap_or("?"),
            info.tp_size,
            info.expert_parallel,
            info.weight_transfer_backend.as_deref().unwrap_or("none")
        ),
    );
    d.parallel = Some(info.parallel());
    d
}
