//! The typed client of the weight-update gateway, used by the ranks (join, events, report) and by
//! the controller and operator commands (connect, start an update, wait for it, status,
//! disconnect).
//!
//! Retries are safe by construction: a request whose connection could not even be opened is
//! retried whatever its method (nothing reached the gateway); any other failure is retried only
//! for idempotent requests (GETs, `PUT kv`, the join and event long-polls). Starting an update,
//! connecting and reporting are never re-sent after they may have reached the gateway.

use crate::wire::{
    AddEngine, CLAIM_HEADER, ConnectRequest, EngineChanged, EventsResponse, JoinPending,
    JoinRequest, JoinResponse, KvEntry, KvPut, PairStatus, ReleaseSlot, Report, ReportAck,
    SlotReleased, StartUpdate, UpdateStatus,
};
use reqwest::{Method, StatusCode, Url};
use serde::Serialize;
use serde::de::DeserializeOwned;
use std::time::Duration;

/// Why a gateway call failed.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// The gateway answered with an error status and message.
    #[error("gateway answered {status}: {message}")]
    Api {
        /// HTTP status code.
        status: u16,
        /// The gateway's `error` message.
        message: String,
    },
    /// No connection could be opened.
    #[error("cannot reach the gateway at {url}: {message}")]
    Connect {
        /// the URL
        url: String,
        /// the cause
        message: String,
    },
    /// The request was sent but failed (timeout, reset).
    #[error("request to {url} failed: {message}")]
    Transport {
        /// the URL
        url: String,
        /// the cause
        message: String,
    },
    /// The gateway's answer could not be decoded.
    #[error("unexpected answer from {url}: {message}")]
    Decode {
        /// the URL
        url: String,
        /// the cause
        message: String,
    },
    /// The gateway URL is not an `http://host:port` URL.
    #[error("`{0}` is not a gateway URL; expected e.g. http://127.0.0.1:7480")]
    BadUrl(String),
    /// The gateway made the change but could not write it to its state directory (503 with
    /// `"queued": true`): the change is in effect (a started version runs) and is written once
    /// the disk takes writes again. Not a refusal: read the state instead of repeating it.
    #[error("gateway answered 503, and the change was made: {message}")]
    Queued {
        /// The gateway's message.
        message: String,
    },
    /// Waiting for an update ended before it committed or failed.
    #[error("version {version} is still {state} after waiting {waited_ms} ms")]
    StillRunning {
        /// the version
        version: u64,
        /// its last state
        state: String,
        /// how long the client waited
        waited_ms: u64,
    },
}

impl ClientError {
    /// The HTTP status of an error answer from the gateway.
    pub fn status(&self) -> Option<u16> {
        match self {
            ClientError::Api { status, .. } => Some(*status),
            ClientError::Queued { .. } => Some(503),
            _ => None,
        }
    }

    /// Whether the gateway made the change though it answered 503 ([`ClientError::Queued`]).
    pub fn queued(&self) -> bool {
        matches!(self, ClientError::Queued { .. })
    }
}

/// What one join request got: the roster, or "not everyone yet, join again".
#[derive(Clone, Debug, PartialEq)]
pub enum JoinOutcome {
    /// Every rank joined.
    Ready(JoinResponse),
    /// The poll window ended first.
    Pending(JoinPending),
}

/// An async client of one gateway.
#[derive(Clone, Debug)]
pub struct Client {
    base: Url,
    http: reqwest::Client,
    token: Option<String>,
    retries: u32,
    timeout: Duration,
}

/// Whether an error answer says the change was made and queued (`"queued": true`).
fn says_queued(body: &[u8]) -> bool {
    serde_json::from_slice::<serde_json::Value>(body)
        .ok()
        .and_then(|v| v.get("queued").and_then(serde_json::Value::as_bool))
        == Some(true)
}

/// Margin added to a long-poll's server-side wait for the HTTP request timeout.
const POLL_MARGIN: Duration = Duration::from_secs(10);

impl Client {
    /// A client of the gateway at `base` (e.g. `http://127.0.0.1:7480`), with an optional token.
    pub fn new(base: &str, token: Option<String>) -> Result<Client, ClientError> {
        let mut url = Url::parse(base).map_err(|_| ClientError::BadUrl(base.to_string()))?;
        if url.scheme() != "http" || url.host_str().is_none() || url.cannot_be_a_base() {
            return Err(ClientError::BadUrl(base.to_string()));
        }
        if !url.path().ends_with('/') {
            let p = format!("{}/", url.path());
            url.set_path(&p);
        }
        let http = reqwest::Client::builder()
            .pool_max_idle_per_host(usize::MAX)
            .build()
            .map_err(|e| ClientError::BadUrl(format!("{base} ({e})")))?;
        Ok(Client {
            base: url,
            http,
            token,
            retries: 3,
            timeout: Duration::from_secs(30),
        })
    }

    /// Sets how often a retryable request is re-sent (default 3).
    pub fn with_retries(mut self, retries: u32) -> Client {
        self.retries = retries;
        self
    }

    /// Sets the timeout of requests that do not long-poll (default 30 s).
    pub fn with_timeout(mut self, timeout: Duration) -> Client {
        self.timeout = timeout;
        self
    }

    /// The gateway's base URL.
    pub fn base(&self) -> &Url {
        &self.base
    }

    fn url(&self, segments: &[&str], query: &[(&str, String)]) -> Result<Url, ClientError> {
        let mut url = self.base.clone();
        {
            let mut path = url
                .path_segments_mut()
                .map_err(|_| ClientError::BadUrl(self.base.to_string()))?;
            path.pop_if_empty();
            path.extend(segments);
        }
        if !query.is_empty() {
            let mut q = url.query_pairs_mut();
            for (k, v) in query {
                q.append_pair(k, v);
            }
        }
        Ok(url)
    }

    /// Sends a request, retrying as the module docs say; returns the status and body of a 2xx.
    async fn send(
        &self,
        method: Method,
        url: Url,
        body: Option<Vec<u8>>,
        idempotent: bool,
        timeout: Duration,
    ) -> Result<(StatusCode, Vec<u8>), ClientError> {
        self.send_as(method, url, body, idempotent, timeout, None)
            .await
    }

    /// [`Client::send`] by the rank whose claim id is `claim`, sent in the [`CLAIM_HEADER`]
    /// header (never in the URL, which error messages and logs print).
    async fn send_as(
        &self,
        method: Method,
        url: Url,
        body: Option<Vec<u8>>,
        idempotent: bool,
        timeout: Duration,
        claim: Option<&str>,
    ) -> Result<(StatusCode, Vec<u8>), ClientError> {
        let mut attempt = 0;
        loop {
            let mut req = self
                .http
                .request(method.clone(), url.clone())
                .timeout(timeout);
            if let Some(t) = &self.token {
                req = req.bearer_auth(t);
            }
            if let Some(c) = claim {
                req = req.header(CLAIM_HEADER, c);
            }
            if let Some(b) = &body {
                req = req
                    .header(reqwest::header::CONTENT_TYPE, "application/json")
                    .body(b.clone());
            }
            let result = match req.send().await {
                Ok(resp) => {
                    let status = resp.status();
                    match crate::body::read_capped(resp, crate::body::MAX_GATEWAY_ANSWER_BYTES)
                        .await
                    {
                        Ok(bytes) => Ok((status, bytes)),
                        // not what a gateway answers, and no better the next time
                        Err(e @ crate::body::BodyError::TooLarge { .. }) => {
                            Err(ClientError::Decode {
                                url: url.to_string(),
                                message: e.to_string(),
                            })
                        }
                        Err(e) => Err(ClientError::Transport {
                            url: url.to_string(),
                            message: e.to_string(),
                        }),
                    }
                }
                Err(e) if e.is_connect() => Err(ClientError::Connect {
                    url: url.to_string(),
                    message: e.to_string(),
                }),
                Err(e) => Err(ClientError::Transport {
                    url: url.to_string(),
                    message: e.to_string(),
                }),
            };
            let retryable = match &result {
                Err(ClientError::Connect { .. }) => true,
                Err(ClientError::Decode { .. }) => false,
                Err(_) => idempotent,
                // a change the gateway made and queued is never re-sent (not even an
                // idempotent one: its answer says what happened)
                Ok((s, b)) => idempotent && matches!(s.as_u16(), 502..=504) && !says_queued(b),
            };
            if retryable && attempt < self.retries {
                attempt += 1;
                let backoff = Duration::from_millis(100u64 << attempt.min(4));
                tokio::time::sleep(backoff).await;
                continue;
            }
            let (status, bytes) = result?;
            if status.is_success() {
                return Ok((status, bytes));
            }
            let answer = serde_json::from_slice::<serde_json::Value>(&bytes).ok();
            let message = answer
                .as_ref()
                .and_then(|v| v.get("error").and_then(|m| m.as_str()).map(str::to_string))
                .unwrap_or_else(|| String::from_utf8_lossy(&bytes).into_owned());
            if status == StatusCode::SERVICE_UNAVAILABLE && says_queued(&bytes) {
                return Err(ClientError::Queued { message });
            }
            return Err(ClientError::Api {
                status: status.as_u16(),
                message,
            });
        }
    }

    fn decode<T: DeserializeOwned>(url: &str, bytes: &[u8]) -> Result<T, ClientError> {
        serde_json::from_slice(bytes).map_err(|e| ClientError::Decode {
            url: url.to_string(),
            message: e.to_string(),
        })
    }

    fn encode(body: &impl Serialize) -> Result<Vec<u8>, ClientError> {
        serde_json::to_vec(body).map_err(|e| ClientError::Decode {
            url: String::new(),
            message: format!("cannot encode the request: {e}"),
        })
    }

    async fn call<T: DeserializeOwned>(
        &self,
        method: Method,
        segments: &[&str],
        query: &[(&str, String)],
        body: Option<Vec<u8>>,
        idempotent: bool,
        timeout: Duration,
    ) -> Result<T, ClientError> {
        let url = self.url(segments, query)?;
        let text = url.to_string();
        let (_, bytes) = self.send(method, url, body, idempotent, timeout).await?;
        Self::decode(&text, &bytes)
    }

    /// `GET /healthz`.
    pub async fn healthz(&self) -> Result<(), ClientError> {
        self.call::<serde_json::Value>(Method::GET, &["healthz"], &[], None, true, self.timeout)
            .await
            .map(|_| ())
    }

    /// `GET /metrics`, the Prometheus text.
    pub async fn metrics(&self) -> Result<String, ClientError> {
        let url = self.url(&["metrics"], &[])?;
        let (_, bytes) = self
            .send(Method::GET, url, None, true, self.timeout)
            .await?;
        Ok(String::from_utf8_lossy(&bytes).into_owned())
    }

    /// `GET /openapi.json`.
    pub async fn openapi(&self) -> Result<serde_json::Value, ClientError> {
        self.call(
            Method::GET,
            &["openapi.json"],
            &[],
            None,
            true,
            self.timeout,
        )
        .await
    }

    /// `POST /v1/pairs`: connects a pair (never re-sent once it may have arrived).
    pub async fn connect(&self, req: &ConnectRequest) -> Result<PairStatus, ClientError> {
        let body = Self::encode(req)?;
        self.call(
            Method::POST,
            &["v1", "pairs"],
            &[],
            Some(body),
            false,
            self.timeout,
        )
        .await
    }

    /// `GET /v1/pairs/{name}/status`.
    pub async fn status(&self, name: &str) -> Result<PairStatus, ClientError> {
        self.call(
            Method::GET,
            &["v1", "pairs", name, "status"],
            &[],
            None,
            true,
            self.timeout,
        )
        .await
    }

    /// `POST /v1/pairs/{name}/resume`: lets the engines serve again outside an update (with
    /// `accept_torn`, on partially written weights too).
    pub async fn resume(&self, name: &str, accept_torn: bool) -> Result<PairStatus, ClientError> {
        let body = Self::encode(&crate::wire::Resume { accept_torn })?;
        self.call(
            Method::POST,
            &["v1", "pairs", name, "resume"],
            &[],
            Some(body),
            true,
            self.timeout,
        )
        .await
    }

    /// `DELETE /v1/pairs/{name}`: disconnects; ranks see `disconnect` and tear down.
    pub async fn disconnect(&self, name: &str) -> Result<PairStatus, ClientError> {
        self.call(
            Method::DELETE,
            &["v1", "pairs", name],
            &[],
            None,
            false,
            self.timeout,
        )
        .await
    }

    /// `POST /v1/pairs/{name}/engines`: adds an engine to a running pair, in slot `engine` or
    /// the lowest free one; start its ranks as `{engine, rank: 0..ranks}` of the answer.
    pub async fn add_engine(
        &self,
        name: &str,
        engine: Option<u32>,
    ) -> Result<EngineChanged, ClientError> {
        let body = Self::encode(&AddEngine { engine })?;
        self.call(
            Method::POST,
            &["v1", "pairs", name, "engines"],
            &[],
            Some(body),
            false,
            self.timeout,
        )
        .await
    }

    /// `DELETE /v1/pairs/{name}/engines/{engine}`: removes an engine from the pair.
    pub async fn remove_engine(
        &self,
        name: &str,
        engine: u32,
    ) -> Result<EngineChanged, ClientError> {
        let e = engine.to_string();
        self.call(
            Method::DELETE,
            &["v1", "pairs", name, "engines", &e],
            &[],
            None,
            false,
            self.timeout,
        )
        .await
    }

    /// One join request waiting at most `wait`: the roster, or pending.
    pub async fn join_once(
        &self,
        name: &str,
        req: &JoinRequest,
        wait: Duration,
    ) -> Result<JoinOutcome, ClientError> {
        let wait_ms = wait.as_millis().min(u128::from(crate::wire::MAX_WAIT_MS)) as u64;
        let url = self.url(
            &["v1", "pairs", name, "ranks"],
            &[("timeout_ms", wait_ms.to_string())],
        )?;
        let text = url.to_string();
        let body = Self::encode(req)?;
        let timeout = Duration::from_millis(wait_ms) + POLL_MARGIN;
        let (status, bytes) = self
            .send(Method::POST, url, Some(body), true, timeout)
            .await?;
        if status == StatusCode::ACCEPTED {
            Ok(JoinOutcome::Pending(Self::decode(&text, &bytes)?))
        } else {
            Ok(JoinOutcome::Ready(Self::decode(&text, &bytes)?))
        }
    }

    /// Joins a pair and waits until every rank joined (or the join deadline fails it: 408).
    pub async fn join(&self, name: &str, req: &JoinRequest) -> Result<JoinResponse, ClientError> {
        let wait = Duration::from_millis(crate::wire::DEFAULT_WAIT_MS);
        loop {
            if let JoinOutcome::Ready(r) = self.join_once(name, req, wait).await? {
                return Ok(r);
            }
        }
    }

    /// `PUT /v1/pairs/{name}/kv/{key}`: sets a rendezvous value.
    pub async fn put_kv(
        &self,
        name: &str,
        key: &str,
        value: serde_json::Value,
    ) -> Result<KvEntry, ClientError> {
        let body = Self::encode(&KvPut { value })?;
        self.call(
            Method::PUT,
            &["v1", "pairs", name, "kv", key],
            &[],
            Some(body),
            true,
            self.timeout,
        )
        .await
    }

    /// `GET /v1/pairs/{name}/kv/{key}`, waiting up to `wait` for it to be set (404 after that).
    pub async fn get_kv(
        &self,
        name: &str,
        key: &str,
        wait: Duration,
    ) -> Result<KvEntry, ClientError> {
        let wait_ms = wait.as_millis().min(u128::from(crate::wire::MAX_WAIT_MS)) as u64;
        self.call(
            Method::GET,
            &["v1", "pairs", name, "kv", key],
            &[("timeout_ms", wait_ms.to_string())],
            None,
            true,
            Duration::from_millis(wait_ms) + POLL_MARGIN,
        )
        .await
    }

    /// `GET /v1/pairs/{name}/events?after=N`: events after `after`, waiting up to `wait` for one.
    pub async fn events(
        &self,
        name: &str,
        after: u64,
        wait: Duration,
    ) -> Result<EventsResponse, ClientError> {
        self.events_as(name, after, wait, None).await
    }

    /// [`Client::events`] by the rank whose claim id is `incarnation` (what it joined with as
    /// `info.incarnation`), sent in the `awex-claim` header: the gateway counts the slot as held
    /// while the poll is open, and a poll whose connection closes unanswered as the process
    /// gone. A rank that lives never drops a poll it opened.
    pub async fn events_as(
        &self,
        name: &str,
        after: u64,
        wait: Duration,
        incarnation: Option<&str>,
    ) -> Result<EventsResponse, ClientError> {
        let wait_ms = wait.as_millis().min(u128::from(crate::wire::MAX_WAIT_MS)) as u64;
        let query = [
            ("after", after.to_string()),
            ("timeout_ms", wait_ms.to_string()),
        ];
        let url = self.url(&["v1", "pairs", name, "events"], &query)?;
        let text = url.to_string();
        let (_, bytes) = self
            .send_as(
                Method::GET,
                url,
                None,
                true,
                Duration::from_millis(wait_ms) + POLL_MARGIN,
                incarnation,
            )
            .await?;
        Self::decode(&text, &bytes)
    }

    /// `GET /v1/pairs/{name}/events?presence=true` by the rank whose claim id is `claim`: held
    /// open for `wait` whatever events come (the disconnect ends it, 410), answering none. A
    /// rank keeps one open while it holds its slot, so that its death closes it.
    pub async fn presence(
        &self,
        name: &str,
        claim: &str,
        wait: Duration,
    ) -> Result<EventsResponse, ClientError> {
        let wait_ms = wait.as_millis().min(u128::from(crate::wire::MAX_WAIT_MS)) as u64;
        let query = [
            ("presence", "true".to_string()),
            ("timeout_ms", wait_ms.to_string()),
        ];
        let url = self.url(&["v1", "pairs", name, "events"], &query)?;
        let text = url.to_string();
        let (_, bytes) = self
            .send_as(
                Method::GET,
                url,
                None,
                false,
                Duration::from_millis(wait_ms) + POLL_MARGIN,
                Some(claim),
            )
            .await?;
        Self::decode(&text, &bytes)
    }

    /// `POST /v1/pairs/{name}/ranks/release`: the operator says the holder of a rank slot is
    /// gone; the next process that joins the slot takes it over.
    pub async fn release_slot(
        &self,
        name: &str,
        req: &ReleaseSlot,
    ) -> Result<SlotReleased, ClientError> {
        let body = Self::encode(req)?;
        self.call(
            Method::POST,
            &["v1", "pairs", name, "ranks", "release"],
            &[],
            Some(body),
            false,
            self.timeout,
        )
        .await
    }

    /// `POST /v1/pairs/{name}/updates`: starts `version` (never re-sent once it may have arrived).
    pub async fn start_update(
        &self,
        name: &str,
        version: u64,
    ) -> Result<UpdateStatus, ClientError> {
        let body = Self::encode(&StartUpdate { version })?;
        self.call(
            Method::POST,
            &["v1", "pairs", name, "updates"],
            &[],
            Some(body),
            false,
            self.timeout,
        )
        .await
    }

    /// `GET /v1/pairs/{name}/updates/{version}` with every rank's state.
    pub async fn update_status(
        &self,
        name: &str,
        version: u64,
    ) -> Result<UpdateStatus, ClientError> {
        let v = version.to_string();
        self.call(
            Method::GET,
            &["v1", "pairs", name, "updates", &v],
            &[],
            None,
            true,
            self.timeout,
        )
        .await
    }

    /// Waits until `version` commits or fails (at most `timeout`); lists the ranks that did not
    /// succeed. A failed update is `Ok` with state `failed`: read its `error` and `ranks`.
    pub async fn wait_update(
        &self,
        name: &str,
        version: u64,
        timeout: Duration,
    ) -> Result<UpdateStatus, ClientError> {
        let v = version.to_string();
        let start = tokio::time::Instant::now();
        loop {
            let left = timeout.saturating_sub(start.elapsed());
            let wait_ms = left.as_millis().min(u128::from(crate::wire::MAX_WAIT_MS)) as u64;
            let s: UpdateStatus = self
                .call(
                    Method::GET,
                    &["v1", "pairs", name, "updates", &v],
                    &[
                        ("timeout_ms", wait_ms.to_string()),
                        ("ranks", "problems".to_string()),
                    ],
                    None,
                    true,
                    Duration::from_millis(wait_ms) + POLL_MARGIN,
                )
                .await?;
            if s.state.is_final() {
                return Ok(s);
            }
            if start.elapsed() >= timeout {
                return Err(ClientError::StillRunning {
                    version,
                    state: format!("{:?}", s.state).to_lowercase(),
                    waited_ms: crate::wire::ms(start.elapsed()),
                });
            }
        }
    }

    /// `POST /v1/pairs/{name}/updates/{version}/report` (never re-sent once it may have arrived).
    pub async fn report(
        &self,
        name: &str,
        version: u64,
        report: &Report,
    ) -> Result<ReportAck, ClientError> {
        let v = version.to_string();
        let body = Self::encode(report)?;
        self.call(
            Method::POST,
            &["v1", "pairs", name, "updates", &v, "report"],
            &[],
            Some(body),
            false,
            self.timeout,
        )
        .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_encode_segments_and_keep_a_base_path() {
        let c = Client::new("http://127.0.0.1:7480", None).unwrap();
        assert_eq!(
            c.url(&["v1", "pairs", "a b", "events"], &[("after", "3".into())])
                .unwrap()
                .as_str(),
            "http://127.0.0.1:7480/v1/pairs/a%20b/events?after=3"
        );
        let c = Client::new("http://gw.local:80/awex", None).unwrap();
        assert_eq!(
            c.url(&["healthz"], &[]).unwrap().as_str(),
            "http://gw.local/awex/healthz"
        );
        assert_eq!(
            Client::new("https://x", None).unwrap_err().to_string(),
            "`https://x` is not a gateway URL; expected e.g. http://127.0.0.1:7480"
        );
        assert!(Client::new("not a url", None).is_err());
    }
}
