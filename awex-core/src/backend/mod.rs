//! Backend traits and their registry: each engine (Megatron-Core, FSDP2, SGLang, ...) is a crate
//! implementing [`TrainingBackend`] or [`InferenceBackend`] and registering itself with
//! `inventory::submit!`; awex discovers them at run time. Both traits share [`Backend`]; an
//! inference backend may add [`EngineControl`], the engine's control calls as data that the
//! gateway executes.

mod engine;
mod parallel;
mod probe;

pub use engine::{
    EngineCall, EngineControl, EngineExpect, EngineFacts, HttpMethod, TriggerPhase, TriggerWork,
};
pub use parallel::{BackendSpec, ParallelConfig, ParallelKey, SpecError};
pub use probe::{Detection, Probe};

use crate::layout::{LayoutError, Side, SideLayout};
use crate::model::ModelSpec;
use std::sync::Arc;

/// What every backend provides, whichever side it serves.
pub trait Backend: Send + Sync + 'static {
    /// Short name used on the command line (`megatron`).
    fn name(&self) -> &'static str;

    /// One line describing the engine and the layout conventions it follows.
    fn description(&self) -> &'static str;

    /// The parallel-config keys this backend accepts, with defaults and help.
    fn parallel_keys(&self) -> &'static [ParallelKey];

    /// `parallel` with every default filled in, those that follow from other keys included
    /// (Megatron's `etp` is `tp` unless given): two configs that lay out the same ranks resolve
    /// equal. Unknown keys and values past their limits are refused.
    fn resolved_parallel(&self, parallel: &ParallelConfig) -> Result<ParallelConfig, SpecError> {
        parallel.checked(self.parallel_keys(), self.name())
    }

    /// Python packages whose presence is evidence for this engine (probed with `python3`).
    fn python_packages(&self) -> &'static [&'static str] {
        &[]
    }

    /// Paths of a live server to `GET` for detection, tried in order (the answers land in
    /// [`Probe::server_answers`]).
    fn server_info_paths(&self) -> &'static [&'static str] {
        &[]
    }

    /// The layout of every rank of this side for this model and parallel config.
    fn layout(
        &self,
        model: &ModelSpec,
        parallel: &ParallelConfig,
    ) -> Result<Arc<dyn SideLayout>, LayoutError>;

    /// How strongly the (already gathered) probe suggests this engine runs here.
    fn detect(&self, probe: &Probe) -> Detection;
}

/// A training engine awex can read weights from.
pub trait TrainingBackend: Backend {
    /// The parallel keys that a live rank's own parameter names decide (Megatron's layer spec
    /// and expert module, FSDP's fused experts), in the order of [`Backend::parallel_keys`]:
    /// `Writer.attach` reads them from the model instead of asking. A key is left out when the
    /// names say nothing about it (no expert parameter, say); the default says nothing at all.
    fn options_from_names(&self, names: &[&str]) -> Vec<(&'static str, u64)> {
        let _ = names;
        Vec::new()
    }

    /// The parallel keys that a live rank's parameters decide by their names and dtypes (FSDP's
    /// `transformers` release, from the dtype its model classes keep routers in), in the order
    /// of [`Backend::parallel_keys`]; by default what the names decide.
    fn options_from_tensors(&self, tensors: &[(&str, crate::DType)]) -> Vec<(&'static str, u64)> {
        let names: Vec<&str> = tensors.iter().map(|t| t.0).collect();
        self.options_from_names(&names)
    }
}

/// An inference engine awex can write weights into.
pub trait InferenceBackend: Backend {
    /// How the gateway drives the engine's servers around an update, if it can (SGLang's
    /// pause / update session / resume). `None`: the ranks receive on their own.
    fn engine_control(&self) -> Option<&'static dyn EngineControl> {
        None
    }
}

/// A training backend's registration, collected with `inventory`.
pub struct TrainingRegistration(pub &'static dyn TrainingBackend);

/// An inference backend's registration, collected with `inventory`.
pub struct InferenceRegistration(pub &'static dyn InferenceBackend);

inventory::collect!(TrainingRegistration);
inventory::collect!(InferenceRegistration);

/// Every registered training backend, sorted by name.
pub fn training_backends() -> Vec<&'static dyn TrainingBackend> {
    let mut v: Vec<_> = inventory::iter::<TrainingRegistration>
        .into_iter()
        .map(|r| r.0)
        .collect();
    v.sort_by_key(|b| b.name());
    v
}

/// Every registered inference backend, sorted by name.
pub fn inference_backends() -> Vec<&'static dyn InferenceBackend> {
    let mut v: Vec<_> = inventory::iter::<InferenceRegistration>
        .into_iter()
        .map(|r| r.0)
        .collect();
    v.sort_by_key(|b| b.name());
    v
}

/// The names of the registered backends of one side.
pub fn backend_names(side: Side) -> Vec<&'static str> {
    match side {
        Side::Training => training_backends().iter().map(|b| b.name()).collect(),
        Side::Inference => inference_backends().iter().map(|b| b.name()).collect(),
    }
}

/// A registered training backend by name.
pub fn training_backend(name: &str) -> Result<&'static dyn TrainingBackend, SpecError> {
    training_backends()
        .into_iter()
        .find(|b| b.name() == name)
        .ok_or_else(|| SpecError::UnknownBackend {
            side: Side::Training,
            name: name.to_string(),
            known: backend_names(Side::Training),
        })
}

/// A registered inference backend by name.
pub fn inference_backend(name: &str) -> Result<&'static dyn InferenceBackend, SpecError> {
    inference_backends()
        .into_iter()
        .find(|b| b.name() == name)
        .ok_or_else(|| SpecError::UnknownBackend {
            side: Side::Inference,
            name: name.to_string(),
            known: backend_names(Side::Inference),
        })
}

/// Builds the layout of one side from a `backend:k=v,...` spec.
pub fn side_layout(
    side: Side,
    spec: &BackendSpec,
    model: &ModelSpec,
) -> Result<Arc<dyn SideLayout>, SideError> {
    let layout = match side {
        Side::Training => {
            let b = training_backend(&spec.backend)?;
            let p = spec.parallel.checked(b.parallel_keys(), &spec.backend)?;
            b.layout(model, &p)?
        }
        Side::Inference => {
            let b = inference_backend(&spec.backend)?;
            let p = spec.parallel.checked(b.parallel_keys(), &spec.backend)?;
            b.layout(model, &p)?
        }
    };
    Ok(layout)
}

/// Why a side's layout could not be built.
#[derive(Debug, thiserror::Error)]
pub enum SideError {
    /// The spec is malformed or names an unknown backend or key.
    #[error(transparent)]
    Spec(#[from] SpecError),
    /// The backend refused the parallel config.
    #[error(transparent)]
    Layout(#[from] LayoutError),
}
