//! Every failure of the extension as one enum, raised in Python as the matching `awex.errors`
//! class (or a built-in exception) carrying the Rust message.

use awex_control::client::ClientError;
use awex_core::backend::{SideError, SpecError};
use awex_core::model::ModelError;
use awex_core::pair::PairError;
use awex_runtime::RuntimeError;
use awex_runtime::rank::RankError;
use pyo3::exceptions::{PyRuntimeError, PyTimeoutError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyList;

/// A failure on its way to Python.
#[derive(Debug)]
pub(crate) enum Fail {
    /// Registered tensors disagree with the rank's layout (`awex.LayoutError`).
    Layout(String),
    /// An argument of the wrong kind (`TypeError`).
    Type(String),
    /// A bad argument value (`ValueError`).
    Value(String),
    /// The gateway refused a request or could not be reached (`awex.GatewayError`).
    Gateway {
        /// HTTP status of the refusal, when the gateway answered.
        status: Option<u16>,
        /// The message.
        message: String,
        /// The gateway made the change though it could not write it yet (503 `queued`).
        queued: bool,
    },
    /// An update did not commit (`awex.UpdateFailed`).
    UpdateFailed {
        /// The version.
        version: u64,
        /// Why.
        message: String,
        /// The ranks that did not succeed, as the gateway names them.
        ranks: Vec<String>,
    },
    /// The pair was disconnected (`awex.Disconnected`).
    Disconnected(String),
    /// A wait ran out (`TimeoutError`).
    Timeout(String),
    /// Anything else awex reports (`awex.AwexError`).
    Awex(String),
    /// An exception raised by Python itself (e.g. `KeyboardInterrupt`).
    Py(PyErr),
}

impl From<PyErr> for Fail {
    fn from(e: PyErr) -> Self {
        Fail::Py(e)
    }
}

impl From<ClientError> for Fail {
    fn from(e: ClientError) -> Self {
        Fail::Gateway {
            status: e.status(),
            message: e.to_string(),
            queued: e.queued(),
        }
    }
}

impl From<RuntimeError> for Fail {
    fn from(e: RuntimeError) -> Self {
        match e {
            RuntimeError::Layout(l) => Fail::Layout(l.to_string()),
            RuntimeError::Tensor(t) => Fail::Layout(t.to_string()),
            RuntimeError::Weights { detail, .. } => Fail::Layout(detail),
            RuntimeError::Gateway { ref source, .. } => Fail::Gateway {
                status: source.status(),
                queued: source.queued(),
                message: e.to_string(),
            },
            other => Fail::Awex(other.to_string()),
        }
    }
}

impl From<RankError> for Fail {
    fn from(e: RankError) -> Self {
        match e {
            RankError::Gateway(c) => c.into(),
            RankError::Runtime(r) => r.into(),
            RankError::Layout(m) => Fail::Layout(m),
            RankError::Pair(p) => p.into(),
            RankError::Disconnected => Fail::Disconnected("the pair was disconnected".into()),
            e @ RankError::UnknownPair { .. } => Fail::Gateway {
                status: Some(404),
                message: e.to_string(),
                queued: false,
            },
            e @ RankError::GatewayLost { .. } => Fail::Gateway {
                status: None,
                message: e.to_string(),
                queued: false,
            },
        }
    }
}

impl From<PairError> for Fail {
    fn from(e: PairError) -> Self {
        Fail::Layout(e.to_string())
    }
}

impl From<ModelError> for Fail {
    fn from(e: ModelError) -> Self {
        Fail::Value(e.to_string())
    }
}

impl From<SpecError> for Fail {
    fn from(e: SpecError) -> Self {
        Fail::Value(e.to_string())
    }
}

impl From<SideError> for Fail {
    fn from(e: SideError) -> Self {
        Fail::Layout(e.to_string())
    }
}

/// Instantiates `awex.errors.<class>(message)` and sets extra attributes on it.
fn awex_error(py: Python<'_>, class: &str, message: &str, attrs: &[(&str, Py<PyAny>)]) -> PyErr {
    let made = (|| -> PyResult<PyErr> {
        let cls = py.import("awex.errors")?.getattr(class)?;
        let exc = cls.call1((message,))?;
        for (k, v) in attrs {
            exc.setattr(*k, v.bind(py))?;
        }
        Ok(PyErr::from_value(exc))
    })();
    // without the Python half of the package (a broken install), still raise the message
    made.unwrap_or_else(|_| PyRuntimeError::new_err(message.to_string()))
}

impl From<Fail> for PyErr {
    fn from(f: Fail) -> PyErr {
        Python::attach(|py| match f {
            Fail::Layout(m) => awex_error(py, "LayoutError", &m, &[]),
            Fail::Type(m) => PyTypeError::new_err(m),
            Fail::Value(m) => PyValueError::new_err(m),
            Fail::Gateway {
                status,
                message,
                queued,
            } => {
                let status = match status {
                    Some(s) => s.into_pyobject(py).map(|s| s.into_any().unbind()),
                    None => Ok(py.None()),
                };
                let queued = queued
                    .into_pyobject(py)
                    .map(|q| q.to_owned().into_any().unbind());
                let Ok(status) = status;
                let Ok(queued) = queued;
                awex_error(
                    py,
                    "GatewayError",
                    &message,
                    &[("status", status), ("queued", queued)],
                )
            }
            Fail::UpdateFailed {
                version,
                message,
                ranks,
            } => {
                let Ok(v) = version.into_pyobject(py);
                let mut attrs = vec![("version", v.into_any().unbind())];
                if let Ok(r) = PyList::new(py, &ranks) {
                    attrs.push(("ranks", r.into_any().unbind()));
                }
                awex_error(py, "UpdateFailed", &message, &attrs)
            }
            Fail::Disconnected(m) => awex_error(py, "Disconnected", &m, &[]),
            Fail::Timeout(m) => PyTimeoutError::new_err(m),
            Fail::Awex(m) => awex_error(py, "AwexError", &m, &[]),
            Fail::Py(e) => e,
        })
    }
}

/// The result type of the extension's internals.
pub(crate) type Result<T, E = Fail> = std::result::Result<T, E>;
