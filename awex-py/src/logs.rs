//! Logs: the ranks and the in-process gateway emit `tracing` events. A library must not take
//! over its host's logging, so the module installs no subscriber of its own unless `AWEX_LOG`
//! asks for one: then the events go to stderr, filtered by `AWEX_LOG` (a level such as `info`,
//! or directives such as `awex_runtime=debug,warn`), as text or, with `AWEX_LOG_FORMAT=json`,
//! as one JSON object per line. A subscriber the host installed first is kept.

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use tracing_subscriber::EnvFilter;

/// Installs the stderr subscriber `AWEX_LOG` / `AWEX_LOG_FORMAT` ask for (nothing when
/// `AWEX_LOG` is unset or empty).
pub(crate) fn init_from_env() -> PyResult<()> {
    let Some(directives) = std::env::var("AWEX_LOG")
        .ok()
        .filter(|s| !s.trim().is_empty())
    else {
        return Ok(());
    };
    let filter = EnvFilter::try_new(&directives).map_err(|e| {
        PyValueError::new_err(format!(
            "AWEX_LOG `{directives}` is not a log filter ({e}); use a level (error, warn, info, debug, trace) or directives like `awex_runtime=debug,warn`"
        ))
    })?;
    let json = match std::env::var("AWEX_LOG_FORMAT").as_deref() {
        Err(_) | Ok("") | Ok("text") => false,
        Ok("json") => true,
        Ok(other) => {
            return Err(PyValueError::new_err(format!(
                "AWEX_LOG_FORMAT `{other}` is not a log format; use text or json"
            )));
        }
    };
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_target(true);
    // a subscriber installed first (by the host, or an earlier import) is kept
    let _ = if json {
        builder.json().try_init()
    } else {
        builder.try_init()
    };
    Ok(())
}
