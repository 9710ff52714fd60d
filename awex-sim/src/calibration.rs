//! Measured runs and the simulation's predictions of them (`data/calibration.toml`).
//!
//! Layouts come from the registered backends: the caller links the backend crates.

use crate::exec::Options;
use crate::topology::{Placement, Topology};
use crate::{Names, SimError, simulate};
use awex_core::Transport;
use awex_core::backend::side_layout;
use awex_core::layout::Side;
use awex_core::plan::Pair;
use awex_core::{BackendSpec, Catalogue, ModelSpec};
use serde::{Deserialize, Serialize};

/// The calibration file shipped with the crate.
pub const DATA: &str = include_str!("../data/calibration.toml");

/// One measured run.
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Run {
    /// What ran.
    pub name: String,
    /// When (UTC date).
    pub date: String,
    /// On what.
    pub machine: String,
    /// The command that measured it.
    pub command: String,
    /// Model.
    pub model: String,
    /// Training spec.
    pub train: String,
    /// Inference spec.
    pub infer: String,
    /// Topology preset or file.
    pub topology: String,
    /// Placement, when not the topology's.
    pub placement: Option<Placement>,
    /// Transport.
    pub transport: String,
    /// Bucket size, MiB.
    pub bucket_mib: u64,
    /// Control plane share, when not the topology's (ms).
    pub control_ms: Option<f64>,
    /// GPU copy bandwidth measured in the same run, GB/s.
    pub copy_gbps: Option<f64>,
    /// Host copy bandwidth measured in the same run, GB/s.
    pub host_copy_gbps: Option<f64>,
    /// One process's copy bandwidth measured in the same run, GB/s.
    pub thread_copy_gbps: Option<f64>,
    /// The measured update time, ms.
    pub measured_ms: f64,
    /// Anything else.
    #[serde(default)]
    pub note: String,
}

/// The file's runs.
#[derive(Clone, Debug, Deserialize, Serialize)]
pub struct Calibration {
    /// The runs.
    pub run: Vec<Run>,
}

impl Calibration {
    /// Parses a calibration file.
    pub fn parse(text: &str) -> Result<Self, SimError> {
        toml::from_str(text).map_err(|e| SimError::Usage(format!("calibration file: {e}")))
    }
}

impl Run {
    /// The run's topology: the preset with the run's own figures.
    pub fn topology(&self) -> Result<Topology, SimError> {
        let mut t = Topology::resolve(&self.topology)?;
        if let Some(p) = self.placement {
            t.placement = p;
        }
        if let Some(v) = self.control_ms {
            t.control_ms = v;
        }
        if let Some(v) = self.copy_gbps {
            t.copy_gbps = v;
        }
        if let Some(v) = self.host_copy_gbps {
            t.host_copy_gbps = v;
        }
        if let Some(v) = self.thread_copy_gbps {
            t.thread_copy_gbps = v;
        }
        t.check()?;
        Ok(t)
    }

    /// The predicted update time, ms.
    pub fn predict_ms(&self) -> Result<f64, SimError> {
        let bad = |e: String| SimError::Usage(format!("calibration run `{}`: {e}", self.name));
        let model = ModelSpec::resolve(&self.model).map_err(|e| bad(e.to_string()))?;
        let cat = Catalogue::of(&model);
        let ts: BackendSpec = self
            .train
            .parse()
            .map_err(|e: awex_core::backend::SpecError| bad(e.to_string()))?;
        let is: BackendSpec = self
            .infer
            .parse()
            .map_err(|e: awex_core::backend::SpecError| bad(e.to_string()))?;
        let training = side_layout(Side::Training, &ts, &model).map_err(|e| bad(e.to_string()))?;
        let inference =
            side_layout(Side::Inference, &is, &model).map_err(|e| bad(e.to_string()))?;
        let pair = Pair {
            catalogue: &cat,
            training: &*training,
            inference: &*inference,
            encode_on_sender: false,
        };
        let opts = Options {
            transport: Some(
                self.transport
                    .parse::<Transport>()
                    .map_err(SimError::Usage)?,
            ),
            bucket_bytes: self.bucket_mib << 20,
            ..Options::default()
        };
        let names = Names {
            model: self.model.clone(),
            training: self.train.clone(),
            inference: self.infer.clone(),
        };
        let r = simulate(&pair, &names, &self.topology()?, &opts)?;
        Ok(r.predicted_s * 1e3)
    }
}
