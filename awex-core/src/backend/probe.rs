//! Detection: what a backend can look at (`Probe`) and what it concludes (`Detection`).

use super::ParallelConfig;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

/// What a backend concludes from a probe.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Detection {
    /// 0 (no sign of this engine) to 1 (certain).
    pub score: f64,
    /// Human-readable reasons, one per fact seen.
    pub evidence: Vec<String>,
    /// The parallel config, when the probe reveals it.
    pub parallel: Option<ParallelConfig>,
}

impl Detection {
    /// Adds `weight` to the score (capped at 1) with a reason.
    pub fn add(&mut self, weight: f64, reason: impl Into<String>) {
        self.score = (self.score + weight).min(1.0);
        self.evidence.push(reason.into());
    }
}

/// The facts backends inspect to decide whether their engine is in use.
#[derive(Clone, Debug, Default)]
pub struct Probe {
    /// Environment variables.
    pub env: BTreeMap<String, String>,
    /// Python packages checked with `python3` (name -> importable); empty without a python3.
    pub python_packages: BTreeMap<String, bool>,
    /// A checkpoint directory to inspect.
    pub checkpoint: Option<PathBuf>,
    /// An inference server's base URL.
    pub server_url: Option<String>,
    /// Timeout for each HTTP request to the server.
    pub http_timeout: Duration,
}

impl Probe {
    /// A probe of this process: its environment, importable packages among `packages`, and the given checkpoint / server.
    pub async fn gather(
        packages: &[&str],
        checkpoint: Option<PathBuf>,
        server_url: Option<String>,
    ) -> Probe {
        Probe {
            env: std::env::vars().collect(),
            python_packages: python_importable(packages).await,
            checkpoint,
            server_url,
            http_timeout: Duration::from_secs(5),
        }
    }

    /// An environment variable.
    pub fn env(&self, key: &str) -> Option<&str> {
        self.env.get(key).map(String::as_str)
    }

    /// Whether a Python package is importable (false when unknown).
    pub fn has_package(&self, name: &str) -> bool {
        self.python_packages.get(name).copied().unwrap_or(false)
    }

    /// GETs `path` on the server and parses JSON; `Err` says why not.
    pub async fn get_json(&self, path: &str) -> Result<serde_json::Value, String> {
        let base = self.server_url.as_deref().ok_or("no server URL given")?;
        let url = format!(
            "{}/{}",
            base.trim_end_matches('/'),
            path.trim_start_matches('/')
        );
        let client = reqwest::Client::builder()
            .timeout(self.http_timeout)
            .build()
            .map_err(|e| e.to_string())?;
        let resp = client
            .get(&url)
            .send()
            .await
            .map_err(|e| format!("GET {url}: {e}"))?;
        if !resp.status().is_success() {
            return Err(format!("GET {url}: HTTP {}", resp.status()));
        }
        resp.json()
            .await
            .map_err(|e| format!("GET {url}: not JSON: {e}"))
    }
}

/// Asks `python3` which of `packages` are importable; empty when there is no python3 or it fails.
async fn python_importable(packages: &[&str]) -> BTreeMap<String, bool> {
    if packages.is_empty() {
        return BTreeMap::new();
    }
    let names = serde_json::to_string(packages).unwrap_or_else(|_| "[]".into());
    let script = format!(
        "import importlib.util, json\nout = {{}}\nfor n in {names}:\n    try:\n        out[n] = importlib.util.find_spec(n) is not None\n    except Exception:\n        out[n] = False\nprint(json.dumps(out))\n"
    );
    let run = tokio::process::Command::new("python3")
        .arg("-c")
        .arg(script)
        .kill_on_drop(true)
        .output();
    match tokio::time::timeout(Duration::from_secs(20), run).await {
        Ok(Ok(out)) if out.status.success() => {
            serde_json::from_slice(&out.stdout).unwrap_or_default()
        }
        _ => BTreeMap::new(),
    }
}
