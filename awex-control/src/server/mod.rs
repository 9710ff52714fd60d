//! The weight-update gateway: the HTTP control plane that pairs a training job with inference
//! engines, sequences weight updates by version, and commits a version only when every rank of
//! both sides reported success. It never touches tensor bytes.
//!
//! The modules form one chain, each importing only those before it:
//!
//! 1. leaves: `error` (every failure mapped to a 4xx status and a `{"error": ...}` body),
//!    `config`, `validate` (names, bounds, model and catalogue checks), `secret` (pair secrets
//!    derived from the key file and the token, never stored), `listener` (connection limits,
//!    request-head deadlines, the reserve of slots for token holders);
//! 2. `store`: the data a pair's state is made of (`events`, `kv`, `roster`, `updates`,
//!    `metrics`), knowing nothing of handlers, and `disk`, the durable copy of it (an embedded
//!    `redb` database under the state directory, written through before each answer), with
//!    `witness`, the record of the last acknowledged commit;
//! 3. `engine`: the inference engines' calls, as the backend's `EngineControl` describes them,
//!    reporting back through a trait the pair implements;
//! 4. `polls` (the per-pair bound on long-polls), `state`: the gateway and every pair's entry;
//! 5. `lifecycle`: the update state machine on a pair's entry (start, reports, fail, settle,
//!    commit, the deadline, the engines' session), answering typed refusals (`UpdateError`);
//!    `fleet`: engines added to and removed from a running pair, on the same entry;
//! 6. `extract` (JSON, path and query extractors whose rejections become errors), `auth`
//!    (bearer token, constant-time compare);
//! 7. `routes`: one file per resource, thin handlers that parse, authorise, call the state and
//!    map its refusals to status codes:
//!
//! | file | routes |
//! | --- | --- |
//! | `routes/pairs` | `POST /v1/pairs`, `GET /v1/pairs/{name}/status`, `POST .../resume`, `DELETE /v1/pairs/{name}` |
//! | `routes/engines` | `POST /v1/pairs/{name}/engines`, `DELETE /v1/pairs/{name}/engines/{engine}` |
//! | `routes/ranks` | `POST /v1/pairs/{name}/ranks` (join, long-poll) |
//! | `routes/kv` | `PUT`/`GET /v1/pairs/{name}/kv/{key}` (rendezvous values) |
//! | `routes/updates` | `POST /v1/pairs/{name}/updates`, `GET .../updates/{version}`, `POST .../updates/{version}/report` |
//! | `routes/events` | `GET /v1/pairs/{name}/events?after=N` (long-poll) |
//! | `routes/metrics` | `GET /metrics` (Prometheus text) |
//! | `routes/openapi` | `GET /openapi.json` |
//!
//! and this file: the route table, the router and `serve`. The long-form guide is
//! `docs/gateway.md`.

mod auth;
mod config;
mod engine;
mod error;
mod extract;
mod fleet;
mod lifecycle;
mod listener;
mod polls;
mod routes;
mod secret;
mod state;
mod store;
mod trim;
mod validate;

pub use config::{GatewayConfig, ServeError};
pub use error::ApiError;
pub use routes::openapi::DOCUMENT as OPENAPI_DOCUMENT;
pub use store::disk::StoreError;

use routes::{engines, events, kv, metrics, openapi, pairs, ranks, updates};
use state::{AppState, Gateway};

use axum::Router;
use axum::handler::Handler;
use axum::http::Method;
use axum::routing::{MethodFilter, MethodRouter, on};
use std::collections::HashMap;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, RwLock};

pub use crate::wire::{
    DEFAULT_WAIT_MS, EVENTS_KEPT, MAX_ERROR_BYTES, MAX_INFO_BYTES, MAX_KV_KEYS, MAX_KV_VALUE_BYTES,
    MAX_RANKS, MAX_ROSTER_INFO_BYTES, MAX_WAIT_MS, UPDATES_KEPT, ms,
};

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
        route(
            Method::POST,
            "/v1/pairs/{name}/engines",
            Token,
            engines::add,
        ),
        route(
            Method::DELETE,
            "/v1/pairs/{name}/engines/{engine}",
            Token,
            engines::remove,
        ),
        route(Method::POST, "/v1/pairs/{name}/ranks", Token, ranks::join),
        route(
            Method::POST,
            "/v1/pairs/{name}/ranks/release",
            Token,
            ranks::release,
        ),
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

/// `GET /healthz`: the process is up (`ok`), or up while its state cannot be written
/// (`degraded`, with the store's error: changes are refused until the disk takes writes again).
/// Always 200: restarting the gateway would not help a full disk.
async fn health(
    axum::extract::State(gw): axum::extract::State<AppState>,
) -> axum::Json<serde_json::Value> {
    let failing = gw.store.as_ref().and_then(|s| s.failing().map(|f| (s, f)));
    axum::Json(match failing {
        None => serde_json::json!({ "status": "ok" }),
        Some((s, f)) => serde_json::json!({
            "status": "degraded",
            "store": {
                "dir": s.dir().display().to_string(),
                "error": f.error,
                "failing_since_unix_ms": f.failing_since_unix_ms,
            }
        }),
    })
}

/// The router of an in-memory gateway (for tests and for embedding in another server):
/// `config.state_dir` is not used; [`open_router`] keeps the state on disk.
pub fn router(config: GatewayConfig) -> Router {
    let config = GatewayConfig {
        state_dir: None,
        ..config
    };
    // (no random source: a fixed key still gives each connect, by its random uid, its own secret)
    let base = secret::SecretKey::random().unwrap_or_else(|_| secret::SecretKey::fixed());
    let secrets = match &config.token {
        Some(t) => base.with_token(t),
        None => base,
    };
    routes_of(gateway_of(config, None, secrets))
}

/// The router of a gateway whose state lives under `config.state_dir` (when set): opens the
/// database (refusing a directory another gateway holds) and brings back every pair it holds.
/// Must be called within a Tokio runtime.
pub fn open_router(config: GatewayConfig) -> Result<Router, ServeError> {
    let store = match &config.state_dir {
        Some(dir) => Some(Arc::new(store::disk::Store::open(dir)?)),
        None => None,
    };
    let loaded = match &store {
        Some(s) => Some(s.load()?),
        None => None,
    };
    // the pair secrets' key: the state directory's key file combined with the token
    let base = match &store {
        Some(s) => secret::SecretKey::from_file(s.dir()).map_err(|message| {
            store::disk::StoreError::Io {
                path: s.dir().to_path_buf(),
                message,
            }
        })?,
        None => secret::SecretKey::random()?,
    };
    let secrets = match &config.token {
        Some(t) => base.with_token(t),
        None => base,
    };
    let gw = gateway_of(config, store, secrets);
    if let Some((pairs, next_id)) = loaded {
        gw.next_id
            .fetch_max(next_id, std::sync::atomic::Ordering::Relaxed);
        let n = routes::pairs::restore(&gw, pairs);
        if let Some(s) = &gw.store {
            tracing::info!(pairs = n, dir = %s.dir().display(), "gateway state loaded");
        }
    }
    Ok(routes_of(gw))
}

fn gateway_of(
    config: GatewayConfig,
    store: Option<Arc<store::disk::Store>>,
    secrets: secret::SecretKey,
) -> AppState {
    Arc::new(Gateway {
        secrets,
        engines: engine::EngineClient::new(config.engine_timeout),
        config,
        pairs: RwLock::new(HashMap::new()),
        metrics: Arc::new(store::metrics::Metrics::default()),
        next_id: AtomicU64::new(1),
        long_polls: Arc::default(),
        validations: tokio::sync::Semaphore::new(state::validation_slots()),
        store,
        trim: Arc::default(),
    })
}

/// Answers a request only once the state changes queued before its answer are durable; a
/// failed write is a 503 naming the state directory. A change the handler already made (a
/// successful `POST`, `PUT` or `DELETE`) stays made and queued, so its 503 says so
/// (`"queued": true`): the request was not refused, and must not be repeated as if it were.
async fn durable(
    axum::extract::State(gw): axum::extract::State<AppState>,
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> axum::response::Response {
    use axum::response::IntoResponse;
    // while the disk refuses writes, a change is refused before it is made (reads still answer)
    if req.method() != axum::http::Method::GET {
        if let Some(f) = gw.store.as_ref().and_then(|s| s.failing()) {
            let body = serde_json::json!({
                "error": format!(
                    "the gateway cannot write its state in {} ({}); changes are refused until it can again (GET /healthz says when): retry later",
                    gw.store.as_ref().map(|s| s.dir().display().to_string()).unwrap_or_default(),
                    f.error.unwrap_or_default()
                )
            });
            return (
                axum::http::StatusCode::SERVICE_UNAVAILABLE,
                [(axum::http::header::RETRY_AFTER, "1")],
                axum::Json(body),
            )
                .into_response();
        }
    }
    let changes = req.method() != axum::http::Method::GET;
    let resp = next.run(req).await;
    if let Some(store) = &gw.store {
        if let Err(e) = store.sync().await {
            // the handler's change is in memory and queued for the disk: it takes effect (the
            // ranks may already act on it), so the answer must not read as a refusal
            let made = changes && resp.status().is_success();
            let body = if made {
                serde_json::json!({
                    "error": format!(
                        "the gateway could not persist its state in {}: {e}; the change WAS MADE and is queued: it is in effect now and is written once the disk takes writes again (lost only if the gateway stops first). Do not repeat the request as if it were refused: read the state (status, update status) to follow it",
                        store.dir().display()
                    ),
                    "queued": true,
                })
            } else {
                serde_json::json!({
                    "error": format!(
                        "the gateway could not persist its state in {}: {e}",
                        store.dir().display()
                    )
                })
            };
            return (
                axum::http::StatusCode::SERVICE_UNAVAILABLE,
                axum::Json(body),
            )
                .into_response();
        }
    }
    resp
}

fn routes_of(gateway: AppState) -> Router {
    let body_limit = gateway.config.body_limit;
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
        // the API's answers wait for their changes to be durable (health and docs need not)
        let method_router = if gateway.store.is_some() && spec.path.starts_with("/v1/") {
            method_router.route_layer(axum::middleware::from_fn_with_state(
                gateway.clone(),
                durable,
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

/// Refuses a config the gateway cannot serve on `addr`: a malformed token, or no token on a
/// non-loopback address. `serve` checks it too; callers check it before opening the state.
pub fn check_token_and_bind(addr: SocketAddr, config: &GatewayConfig) -> Result<(), ServeError> {
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
/// Opens the state directory first ([`open_router`]).
pub async fn serve_with_shutdown(
    listener: tokio::net::TcpListener,
    config: GatewayConfig,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), ServeError> {
    check_token_and_bind(listener.local_addr()?, &config)?;
    let app = open_router(config.clone())?;
    serve_router(listener, &config, app, shutdown).await
}

/// Serves `app` (from [`open_router`] with `config`) on `listener` until `shutdown` completes,
/// with `config`'s connection limits.
pub async fn serve_router(
    listener: tokio::net::TcpListener,
    config: &GatewayConfig,
    app: Router,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), ServeError> {
    check_token_and_bind(listener.local_addr()?, config)?;
    // bounded connections, silent ones closed, no Nagle delay on small exchanges
    let listener = listener::Bounded::new(
        listener,
        listener::Limits {
            max_connections: config.max_connections,
            header_timeout: config.header_timeout,
            idle_timeout: config.idle_timeout,
            token_required: config.token.is_some(),
        },
    );
    // each request knows its connection: presenting the token proves it (see `listener`)
    axum::serve(
        listener,
        app.into_make_service_with_connect_info::<listener::Conn>(),
    )
    .with_graceful_shutdown(shutdown)
    .await?;
    Ok(())
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
