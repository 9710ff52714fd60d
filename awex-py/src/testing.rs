//! For tests only: a gateway served inside this process on a loopback port, so that a test can
//! run a whole pair (controller, writers, readers) in one interpreter. Production gateways are
//! `awex-cli serve`.

use crate::errors::Fail;
use awex_control::server::{GatewayConfig, serve};
use pyo3::prelude::*;
use std::sync::OnceLock;

/// The runtime every test gateway of this process runs on (it lives until the process exits).
static GATEWAYS: OnceLock<tokio::runtime::Runtime> = OnceLock::new();

/// Starts a gateway on `127.0.0.1:0` in this process and returns its URL (tests only).
#[pyfunction]
#[pyo3(signature = (token=None))]
pub(crate) fn start_gateway(py: Python<'_>, token: Option<String>) -> PyResult<String> {
    let rt = match GATEWAYS.get() {
        Some(rt) => rt,
        None => {
            let rt = crate::endpoint::runtime("awex-test-gateway")?;
            GATEWAYS.get_or_init(|| rt)
        }
    };
    let url = py.detach(|| {
        rt.block_on(async {
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
                .await
                .map_err(|e| Fail::Awex(format!("cannot bind a loopback port: {e}")))?;
            let addr = listener
                .local_addr()
                .map_err(|e| Fail::Awex(format!("cannot read the bound address: {e}")))?;
            let config = GatewayConfig {
                token,
                ..GatewayConfig::default()
            };
            tokio::spawn(serve(listener, config));
            Ok::<_, Fail>(format!("http://{addr}"))
        })
    })?;
    Ok(url)
}
