//! The weight-update gateway: the HTTP control plane that pairs a training job with inference
//! engines, sequences weight updates by version, and commits a version only when every rank of
//! both sides reported success. It never touches tensor bytes.
//!
//! One file per resource, as the routes are laid out:
//!
//! | file | routes |
//! | --- | --- |
//! | [`pairs`] | `POST /v1/pairs`, `GET /v1/pairs/{name}/status`, `DELETE /v1/pairs/{name}` |
//! | [`ranks`] | `POST /v1/pairs/{name}/ranks` (join, long-poll) |
//! | [`kv`] | `PUT`/`GET /v1/pairs/{name}/kv/{key}` (rendezvous values) |
//! | [`updates`] | `POST /v1/pairs/{name}/updates`, `GET .../updates/{version}`, `POST .../updates/{version}/report` |
//! | [`events`] | `GET /v1/pairs/{name}/events?after=N` (long-poll) |
//! | `metrics` | `GET /metrics` (Prometheus text) |
//! | `openapi` | `GET /openapi.json` |
//!
//! Cross-cutting concerns have their own files: `auth` (bearer token, constant-time compare),
//! `error` (every failure mapped to a 4xx status and a `{"error": ...}` body), `extract`
//! (JSON, path and query extractors whose rejections become those errors), `validate` (names,
//! bounds, model and catalogue checks) and `engine` (SGLang `pause_generation` /
//! `continue_generation` calls around an update). The long-form guide is `docs/gateway.md`.

mod auth;
mod engine;
mod error;
pub mod events;
mod extract;
pub mod kv;
mod metrics;
mod openapi;
pub mod pairs;
pub mod ranks;
pub mod updates;
mod validate;

pub use error::ApiError;
pub use openapi::DOCUMENT as OPENAPI_DOCUMENT;

use axum::Router;
use axum::handler::Handler;
use axum::http::Method;
use axum::routing::{MethodFilter, MethodRouter, on};
use std::collections::HashMap;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, RwLock};
use std::time::Duration;

pub use crate::wire::{
    DEFAULT_WAIT_MS, EVENTS_KEPT, MAX_ERROR_BYTES, MAX_INFO_BYTES, MAX_KV_KEYS, MAX_KV_VALUE_BYTES,
    MAX_RANKS, MAX_ROSTER_INFO_BYTES, MAX_WAIT_MS, UPDATES_KEPT, ms,
};

/// How the gateway runs: its token, limits and timeouts.
#[derive(Clone, Debug)]
pub struct GatewayConfig {
    /// Bearer token every `/v1` and `/metrics` request must carry; `None` serves without auth
    /// (allowed only on a loopback address).
    pub token: Option<String>,
    /// Largest request body in bytes; bigger bodies get 413.
    pub body_limit: usize,
    /// Most live (not disconnected) pairs.
    pub max_pairs: usize,
    /// Timeout of one call to an inference engine (`pause_generation` / `continue_generation`).
    pub engine_timeout: Duration,
    /// How long a disconnected pair stays visible (its event stream ends with `disconnect`).
    pub tombstone: Duration,
}

impl Default for GatewayConfig {
    fn default() -> Self {
        GatewayConfig {
            token: None,
            body_limit: 8 * 1024 * 1024,
            max_pairs: 1024,
            engine_timeout: Duration::from_secs(10),
            tombstone: Duration::from_secs(60),
        }
    }
}

/// Why the gateway could not start or stopped.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    /// A non-loopback address without a token would expose an unauthenticated control plane.
    #[error(
        "refusing to serve on {addr} without a token: a non-loopback address needs --token-file or AWEX_TOKEN (or bind 127.0.0.1)"
    )]
    NoTokenOnPublicAddress {
        /// the address
        addr: SocketAddr,
    },
    /// The token is empty or contains characters that cannot appear in an HTTP header.
    #[error("the gateway token must be 1 to 4096 visible ASCII characters without spaces")]
    BadToken,
    /// The listener or the server failed.
    #[error("gateway I/O error: {0}")]
    Io(#[from] std::io::Error),
}

/// The shared state behind every handler.
pub(crate) struct Gateway {
    pub(crate) config: GatewayConfig,
    pub(crate) pairs: RwLock<HashMap<String, Arc<pairs::PairEntry>>>,
    pub(crate) metrics: Arc<metrics::Metrics>,
    pub(crate) engines: engine::EngineClient,
    pub(crate) next_id: AtomicU64,
}

/// State type of the router.
pub(crate) type AppState = Arc<Gateway>;

/// Whether a route needs the bearer token.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Access {
    /// Open to anyone (`/healthz`, `/openapi.json`).
    Public,
    /// Needs `Authorization: Bearer <token>` when the gateway has a token.
    Token,
}

/// One row of the route table: the router and the OpenAPI test both read it.
#[derive(Clone, Debug)]
pub(crate) struct RouteSpec {
    /// Read by the OpenAPI test; the router gets the method through the handler's filter.
    #[cfg_attr(not(test), allow(dead_code))]
    pub(crate) method: Method,
    pub(crate) path: &'static str,
    pub(crate) access: Access,
}

fn route<H, T>(
    method: Method,
    path: &'static str,
    access: Access,
    handler: H,
) -> (RouteSpec, MethodRouter<AppState>)
where
    H: Handler<T, AppState>,
    T: 'static,
{
    let filter = match method {
        Method::GET => MethodFilter::GET,
        Method::POST => MethodFilter::POST,
        Method::PUT => MethodFilter::PUT,
        _ => MethodFilter::DELETE,
    };
    (
        RouteSpec {
            method,
            path,
            access,
        },
        on(filter, handler),
    )
}

/// The route table: every route of the gateway, its method, access and handler.
pub(crate) fn route_table() -> Vec<(RouteSpec, MethodRouter<AppState>)> {
    use Access::{Public, Token};
    vec![
        route(Method::GET, "/healthz", Public, health),
        route(Method::GET, "/openapi.json", Public, openapi::document),
        route(Method::GET, "/metrics", Token, metrics::render),
        route(Method::POST, "/v1/pairs", Token, pairs::connect),
        route(Method::GET, "/v1/pairs/{name}/status", Token, pairs::status),
        route(Method::DELETE, "/v1/pairs/{name}", Token, pairs::disconnect),
        route(
            Method::POST,
            "/v1/pairs/{name}/resume",
            Token,
            pairs::resume,
        ),
        route(Method::POST, "/v1/pairs/{name}/ranks", Token, ranks::join),
        route(Method::PUT, "/v1/pairs/{name}/kv/{key}", Token, kv::put),
        route(Method::GET, "/v1/pairs/{name}/kv/{key}", Token, kv::get),
        route(
            Method::POST,
            "/v1/pairs/{name}/updates",
            Token,
            updates::start,
        ),
        route(
            Method::GET,
            "/v1/pairs/{name}/updates/{version}",
            Token,
            updates::status,
        ),
        route(
            Method::POST,
            "/v1/pairs/{name}/updates/{version}/report",
            Token,
            updates::report,
        ),
        route(Method::GET, "/v1/pairs/{name}/events", Token, events::poll),
    ]
}

/// `GET /healthz`: the process is up.
async fn health() -> axum::Json<serde_json::Value> {
    axum::Json(serde_json::json!({ "status": "ok" }))
}

/// The gateway's router (for tests and for embedding in another server).
pub fn router(config: GatewayConfig) -> Router {
    let body_limit = config.body_limit;
    let gateway = Arc::new(Gateway {
        engines: engine::EngineClient::new(config.engine_timeout),
        config,
        pairs: RwLock::new(HashMap::new()),
        metrics: Arc::new(metrics::Metrics::default()),
        next_id: AtomicU64::new(1),
    });
    let mut router: Router<AppState> = Router::new();
    for (spec, method_router) in route_table() {
        // Without a token (loopback only) there is nothing to check: skip the layer.
        let needs_token = spec.access == Access::Token && gateway.config.token.is_some();
        let method_router = if needs_token {
            method_router.route_layer(axum::middleware::from_fn_with_state(
                gateway.clone(),
                auth::require_token,
            ))
        } else {
            method_router
        };
        router = router.route(spec.path, method_router);
    }
    router
        .fallback(error::no_route)
        .method_not_allowed_fallback(error::method_not_allowed)
        .layer(axum::extract::DefaultBodyLimit::max(body_limit))
        .with_state(gateway)
}

fn check_token_and_bind(addr: SocketAddr, config: &GatewayConfig) -> Result<(), ServeError> {
    match &config.token {
        Some(t) if t.is_empty() || t.len() > 4096 || !t.bytes().all(|b| b.is_ascii_graphic()) => {
            return Err(ServeError::BadToken);
        }
        Some(_) => {}
        None if !addr.ip().is_loopback() => {
            return Err(ServeError::NoTokenOnPublicAddress { addr });
        }
        None => {}
    }
    Ok(())
}

/// Binds a listener for the gateway with a deep accept queue: thousands of ranks connect at
/// once when a pair starts, and an overflowing queue costs each dropped one a 1 s SYN retry.
pub fn bind(addr: SocketAddr) -> std::io::Result<tokio::net::TcpListener> {
    let socket = if addr.is_ipv4() {
        tokio::net::TcpSocket::new_v4()?
    } else {
        tokio::net::TcpSocket::new_v6()?
    };
    socket.set_reuseaddr(true)?;
    socket.bind(addr)?;
    socket.listen(8192)
}

/// Serves the gateway on `listener` until the process ends.
///
/// Refuses a non-loopback listener when the config has no token.
pub async fn serve(
    listener: tokio::net::TcpListener,
    config: GatewayConfig,
) -> Result<(), ServeError> {
    serve_with_shutdown(listener, config, std::future::pending()).await
}

/// Serves the gateway on `listener` until `shutdown` completes, then drains open requests.
pub async fn serve_with_shutdown(
    listener: tokio::net::TcpListener,
    config: GatewayConfig,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), ServeError> {
    use axum::serve::ListenerExt;
    check_token_and_bind(listener.local_addr()?, &config)?;
    // Small request/response exchanges: do not let Nagle's algorithm hold them back.
    let listener = listener.tap_io(|tcp| {
        let _ = tcp.set_nodelay(true);
    });
    axum::serve(listener, router(config))
        .with_graceful_shutdown(shutdown)
        .await?;
    Ok(())
}

/// Milliseconds since the Unix epoch (for status timestamps).
pub(crate) fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn public_address_without_token_is_refused_and_loopback_is_allowed() {
        let cfg = GatewayConfig::default();
        let public: SocketAddr = "0.0.0.0:7480".parse().unwrap_or_else(|_| unreachable!());
        let err = check_token_and_bind(public, &cfg).unwrap_err();
        assert_eq!(
            err.to_string(),
            "refusing to serve on 0.0.0.0:7480 without a token: a non-loopback address needs --token-file or AWEX_TOKEN (or bind 127.0.0.1)"
        );
        let lo: SocketAddr = "127.0.0.1:7480".parse().unwrap_or_else(|_| unreachable!());
        assert!(check_token_and_bind(lo, &cfg).is_ok());
        let lo6: SocketAddr = "[::1]:7480".parse().unwrap_or_else(|_| unreachable!());
        assert!(check_token_and_bind(lo6, &cfg).is_ok());
        let with_token = GatewayConfig {
            token: Some("s3cret".into()),
            ..GatewayConfig::default()
        };
        assert!(check_token_and_bind(public, &with_token).is_ok());
        let bad = GatewayConfig {
            token: Some("has space".into()),
            ..GatewayConfig::default()
        };
        assert!(matches!(
            check_token_and_bind(lo, &bad),
            Err(ServeError::BadToken)
        ));
    }
}
