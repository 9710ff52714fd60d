//! Detection: what a backend can look at (`Probe`) and what it concludes (`Detection`).

use super::ParallelConfig;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::PathBuf;

/// What a backend concludes from a probe.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Detection {
    /// 0 (no sign of this engine) to 1 (certain).
    pub score: f64,
    /// Human-readable reasons, one per fact seen.
    pub evidence: Vec<String>,
    /// The parallel config, when the probe reveals it.
    pub parallel: Option<ParallelConfig>,
    /// What the backend looked for and did not find, one line each (`detect` prints them
    /// after the evidence so that a score of 0 explains itself).
    #[serde(default)]
    pub not_found: Vec<String>,
}

impl Detection {
    /// Adds `weight` to the score (capped at 1) with a reason.
    pub fn add(&mut self, weight: f64, reason: impl Into<String>) {
        self.score = (self.score + weight).min(1.0);
        self.evidence.push(reason.into());
    }

    /// Records a sign the backend looked for and did not find.
    pub fn absent(&mut self, what: impl Into<String>) {
        self.not_found.push(what.into());
    }

    /// Records a Python package that is not importable, or that no `python3` could check.
    pub fn absent_package(&mut self, probe: &Probe, package: &str) {
        if probe.python_packages.is_empty() {
            self.absent(format!(
                "python package `{package}`: not checked (no python3 found on PATH)"
            ));
        } else {
            self.absent(format!("python package `{package}`: not importable"));
        }
    }
}

/// The facts backends inspect to decide whether their engine is in use: data only, gathered
/// beforehand by the caller (`awex_control::probe::gather` runs `python3` and the HTTP GETs).
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
    /// The server's answers to the backends' [`super::Backend::server_info_paths`]: path ->
    /// parsed JSON, or why there is none (unreachable, HTTP error, not JSON).
    pub server_answers: BTreeMap<String, Result<serde_json::Value, String>>,
}

impl Probe {
    /// An environment variable.
    pub fn env(&self, key: &str) -> Option<&str> {
        self.env.get(key).map(String::as_str)
    }

    /// Whether a Python package is importable (false when unknown).
    pub fn has_package(&self, name: &str) -> bool {
        self.python_packages.get(name).copied().unwrap_or(false)
    }

    /// The server's answer to `GET path`; `Err` says why there is none.
    pub fn server_answer(&self, path: &str) -> Result<&serde_json::Value, String> {
        if self.server_url.is_none() {
            return Err("no server URL given".into());
        }
        match self.server_answers.get(path) {
            Some(Ok(v)) => Ok(v),
            Some(Err(e)) => Err(e.clone()),
            None => Err(format!("GET {path} was not asked")),
        }
    }
}
