//! The controller of pairs, for an RL loop written in Python: connect a training job to
//! inference engines, run updates (start + wait, raising `awex.UpdateFailed` with the gateway's
//! reason), read status, disconnect. It talks to the gateway only; no tensor passes through it.

use crate::endpoint::{runtime, seconds, to_py, wait};
use crate::errors::{Fail, Result};
use crate::spec::ModelArg;
use awex_control::client::Client;
use awex_control::connect::connect_request;
use awex_control::wire::{
    ApplyMode, CommitPolicy, PairOptions, PairState, RankReportState, Transport, UpdateState,
    UpdateStatus,
};
use awex_core::backend::BackendSpec;
use awex_core::layout::Side;
use awex_core::pair::PairSpec;
use pyo3::prelude::*;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// A gateway client bound to one pair at a time (the engine of `awex.Controller`).
#[pyclass(name = "_Controller", module = "awex._awex")]
pub(crate) struct Controller {
    client: Client,
    rt: tokio::runtime::Runtime,
    pair: Mutex<Option<String>>,
}

/// Why an update did not commit, with the ranks that did not succeed.
pub(crate) fn failed(st: &UpdateStatus) -> Fail {
    let ranks = st
        .ranks
        .iter()
        .filter(|r| r.state != RankReportState::Ok)
        .map(|r| match r.side {
            Side::Training => format!("training rank {}", r.rank.rank),
            Side::Inference => format!("inference rank {}/{}", r.rank.engine, r.rank.rank),
        })
        .collect();
    Fail::UpdateFailed {
        version: st.version,
        message: format!(
            "version {} of pair `{}` failed: {}",
            st.version,
            st.pair,
            st.error.as_deref().unwrap_or("no reason given")
        ),
        ranks,
    }
}

impl Controller {
    fn pair_name(&self, pair: Option<String>) -> Result<String> {
        if let Some(p) = pair {
            return Ok(p);
        }
        self.pair
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
            .ok_or_else(|| Fail::Value("no pair: call connect() first or pass pair=<name>".into()))
    }

    /// One call to the gateway about `pair` (this controller's pair when `None`), waited for
    /// up to a minute (`what` names it in a timeout's message); its answer as a Python object.
    fn ask<'py, T, F, Fut>(
        &self,
        py: Python<'py>,
        what: &str,
        pair: Option<String>,
        call: F,
    ) -> PyResult<Bound<'py, PyAny>>
    where
        T: serde::Serialize,
        F: FnOnce(Client, String) -> Fut,
        Fut: std::future::Future<Output = std::result::Result<T, awex_control::client::ClientError>>
            + Send,
        T: Send,
    {
        let pair = self.pair_name(pair)?;
        let r = wait(
            py,
            &self.rt,
            what,
            Some(Duration::from_secs(60)),
            call(self.client.clone(), pair),
        )?
        .map_err(Fail::from)?;
        Ok(to_py(py, &r)?)
    }
}

#[pymethods]
impl Controller {
    /// A controller of the gateway at `gateway` (`http://host:port`).
    #[new]
    #[pyo3(signature = (gateway, token=None, pair=None))]
    fn new(gateway: &str, token: Option<String>, pair: Option<String>) -> PyResult<Self> {
        Ok(Controller {
            client: Client::new(gateway, token).map_err(Fail::from)?,
            rt: runtime("awex-controller")?,
            pair: Mutex::new(pair),
        })
    }

    /// Connects a pair: both sides' layouts are computed here (world sizes, engines, catalogue)
    /// and the model is stored on the gateway so that ranks need not be told it.
    #[pyo3(signature = (pair, train, infer, *, model=None, model_json=None, transport="shm",
        urls=None, checksums=false, bucket_mib=64, join_deadline_s=60.0, update_deadline_s=120.0,
        atomic=false, commit="all", infer_quant=None, infer_config_json=None, infer_config_what=None,
        fp8_block=None, fp8_recipe=None, deltas=false, check_finite=false, spare=0))]
    #[allow(clippy::too_many_arguments)]
    fn connect<'py>(
        &self,
        py: Python<'py>,
        pair: String,
        train: &str,
        infer: &str,
        model: Option<String>,
        model_json: Option<String>,
        transport: &str,
        urls: Option<Vec<String>>,
        checksums: bool,
        bucket_mib: u64,
        join_deadline_s: f64,
        update_deadline_s: f64,
        atomic: bool,
        commit: &str,
        infer_quant: Option<String>,
        infer_config_json: Option<String>,
        infer_config_what: Option<String>,
        fp8_block: Option<[u32; 2]>,
        fp8_recipe: Option<String>,
        deltas: bool,
        check_finite: bool,
        spare: u32,
    ) -> PyResult<Bound<'py, PyAny>> {
        let model = match (model, model_json) {
            (Some(m), None) => ModelArg::Resolve(m),
            (None, Some(j)) => ModelArg::ConfigJson(j),
            _ => {
                return Err(Fail::Value(
                    "connect needs the model: give model or model_json".into(),
                )
                .into());
            }
        };
        let spec = model.spec()?;
        if infer_quant.is_none() && infer_config_json.is_none() {
            model.refuse_fp8_as_plain()?;
        }
        let train_spec: BackendSpec = train.parse().map_err(Fail::from)?;
        let infer_spec: BackendSpec = infer.parse().map_err(Fail::from)?;
        let transport: Transport = transport.parse().map_err(Fail::Value)?;
        let infer_fp8 = crate::spec::infer_fp8(
            &spec,
            infer_quant.as_deref(),
            infer_config_json.as_deref(),
            infer_config_what.as_deref().unwrap_or("(a config dict)"),
            fp8_block,
            fp8_recipe.as_deref(),
        )?;
        let resolved = PairSpec {
            infer_fp8,
            model: spec.clone(),
            train: train_spec,
            infer: infer_spec,
            transport,
        }
        .resolve()
        .map_err(Fail::from)?;
        let ms = |what: &str, s: f64| -> Result<u64> {
            seconds(Some(s))?
                .map(|d| d.as_millis() as u64)
                .ok_or_else(|| Fail::Value(format!("{what} must be given")))
        };
        let options = PairOptions {
            join_deadline_ms: ms("join_deadline_s", join_deadline_s)?,
            update_deadline_ms: ms("update_deadline_s", update_deadline_s)?,
            bucket_mib,
            checksums,
            apply: if atomic {
                ApplyMode::Atomic
            } else {
                ApplyMode::InPlace
            },
            deltas,
            check_finite,
            commit: CommitPolicy::parse(commit).map_err(|e| Fail::Value(format!("commit: {e}")))?,
            ..PairOptions::default()
        };
        let mut req = connect_request(&pair, &resolved, urls.unwrap_or_default(), options);
        req.inference.spare = spare;
        // the gateway stores both sides' models from the request (under `model_key`) before
        // it answers, so ranks need not be told the model
        let client = self.client.clone();
        let status = wait(
            py,
            &self.rt,
            "connecting the pair",
            Some(Duration::from_secs(60)),
            async move { client.connect(&req).await },
        )?
        .map_err(Fail::from)?;
        *self.pair.lock().unwrap_or_else(|e| e.into_inner()) = Some(pair);
        Ok(to_py(py, &status)?)
    }

    /// Adds an engine to the running pair (`POST /v1/pairs/{name}/engines`), in slot `engine`
    /// or the lowest free one; the answer names the slot its ranks join as.
    #[pyo3(signature = (engine=None, pair=None))]
    fn add_engine<'py>(
        &self,
        py: Python<'py>,
        engine: Option<u32>,
        pair: Option<String>,
    ) -> PyResult<Bound<'py, PyAny>> {
        self.ask(
            py,
            "adding an engine",
            pair,
            move |client, pair| async move { client.add_engine(&pair, engine).await },
        )
    }

    /// Removes engine `engine` from the pair (`DELETE /v1/pairs/{name}/engines/{engine}`).
    #[pyo3(signature = (engine, pair=None))]
    fn remove_engine<'py>(
        &self,
        py: Python<'py>,
        engine: u32,
        pair: Option<String>,
    ) -> PyResult<Bound<'py, PyAny>> {
        self.ask(
            py,
            "removing an engine",
            pair,
            move |client, pair| async move { client.remove_engine(&pair, engine).await },
        )
    }

    /// The pair's status document (`GET /v1/pairs/{name}/status`).
    #[pyo3(signature = (pair=None))]
    fn status<'py>(&self, py: Python<'py>, pair: Option<String>) -> PyResult<Bound<'py, PyAny>> {
        self.ask(
            py,
            "reading the pair's status",
            pair,
            move |client, pair| async move { client.status(&pair).await },
        )
    }

    /// Waits until every rank of both sides joined; raises if the join deadline passed.
    #[pyo3(signature = (timeout=60.0, pair=None))]
    fn wait_ready<'py>(
        &self,
        py: Python<'py>,
        timeout: f64,
        pair: Option<String>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let pair = self.pair_name(pair)?;
        let limit = seconds(Some(timeout))?;
        let client = self.client.clone();
        let st = wait(
            py,
            &self.rt,
            &format!("waiting for every rank of pair `{pair}` to join"),
            limit,
            async move {
                loop {
                    let st = client.status(&pair).await.map_err(Fail::from)?;
                    match st.state {
                        PairState::Ready => return Ok(st),
                        PairState::Joining => {}
                        PairState::JoinFailed => {
                            return Err(Fail::Awex(format!(
                                "pair `{pair}` failed to join: {}",
                                st.join_error.as_deref().unwrap_or("join deadline passed")
                            )));
                        }
                        PairState::Disconnected => {
                            return Err(Fail::Disconnected(format!(
                                "pair `{pair}` was disconnected"
                            )));
                        }
                    }
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            },
        )??;
        Ok(to_py(py, &st)?)
    }

    /// Starts `version` and returns at once with its status.
    #[pyo3(signature = (version, pair=None))]
    fn start_update<'py>(
        &self,
        py: Python<'py>,
        version: u64,
        pair: Option<String>,
    ) -> PyResult<Bound<'py, PyAny>> {
        self.ask(
            py,
            "starting the update",
            pair,
            move |client, pair| async move { client.start_update(&pair, version).await },
        )
    }

    /// Waits until `version` committed (returns its status) or failed (raises `awex.UpdateFailed`).
    #[pyo3(signature = (version, timeout=600.0, pair=None))]
    fn wait_update<'py>(
        &self,
        py: Python<'py>,
        version: u64,
        timeout: f64,
        pair: Option<String>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let pair = self.pair_name(pair)?;
        let limit = seconds(Some(timeout))?.unwrap_or_default();
        let client = self.client.clone();
        let what = format!("waiting for version {version} of pair `{pair}`");
        let st = wait(py, &self.rt, &what, None, async move {
            client.wait_update(&pair, version, limit).await
        })?;
        let st = match st {
            Ok(st) => st,
            Err(awex_control::client::ClientError::StillRunning {
                state, waited_ms, ..
            }) => {
                return Err(Fail::Timeout(format!(
                    "version {version} is still {state} after {:.1} s",
                    waited_ms as f64 / 1000.0
                ))
                .into());
            }
            Err(e) => return Err(Fail::from(e).into()),
        };
        if st.state != UpdateState::Committed {
            return Err(failed(&st).into());
        }
        Ok(to_py(py, &st)?)
    }

    /// Starts `version` and waits until it committed (returns its status) or failed (raises
    /// `awex.UpdateFailed` with the gateway's reason).
    #[pyo3(signature = (version, timeout=600.0, pair=None))]
    fn update<'py>(
        &self,
        py: Python<'py>,
        version: u64,
        timeout: f64,
        pair: Option<String>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let t0 = Instant::now();
        self.start_update(py, version, pair.clone())?;
        let left = (timeout - t0.elapsed().as_secs_f64()).max(0.0);
        self.wait_update(py, version, left, pair)
    }

    /// Lets the pair's engines serve again outside an update; `accept_torn` also when the last
    /// failed version left their weights partially written.
    #[pyo3(signature = (accept_torn=false, pair=None))]
    fn resume<'py>(
        &self,
        py: Python<'py>,
        accept_torn: bool,
        pair: Option<String>,
    ) -> PyResult<Bound<'py, PyAny>> {
        self.ask(
            py,
            "resuming the engines",
            pair,
            move |client, pair| async move { client.resume(&pair, accept_torn).await },
        )
    }

    /// Disconnects the pair: its ranks see `disconnect`, tear down and their `update` raises
    /// `awex.Disconnected`.
    #[pyo3(signature = (pair=None))]
    fn disconnect<'py>(
        &self,
        py: Python<'py>,
        pair: Option<String>,
    ) -> PyResult<Bound<'py, PyAny>> {
        self.ask(py, "disconnecting", pair, move |client, pair| async move {
            client.disconnect(&pair).await
        })
    }

    /// The pair this controller acts on by default (set by `connect`).
    #[getter]
    fn pair(&self) -> Option<String> {
        self.pair.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// The gateway's base URL.
    #[getter]
    fn gateway(&self) -> String {
        self.client.base().to_string()
    }
}
