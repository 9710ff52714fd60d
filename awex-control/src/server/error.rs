//! Every way a request can fail, mapped to a status code and a `{"error": "..."}` body.
//!
//! The gateway answers malformed, hostile or out-of-order requests with a client error that says
//! what is wrong and what would be right; its only 5xx is 503 for a request over a bound (too
//! many long-polls on one pair), which clients retry.

use axum::Json;
use axum::http::{HeaderValue, Method, StatusCode, Uri, header};
use axum::response::{IntoResponse, Response};

/// A request the gateway refuses, with the message the caller sees.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ApiError {
    /// 400: malformed path, query, or JSON syntax.
    #[error("{0}")]
    BadRequest(String),
    /// 401: no (or an unreadable) bearer token.
    #[error("{0}")]
    Unauthorized(String),
    /// 403: a bearer token that is not the gateway's.
    #[error("{0}")]
    Forbidden(String),
    /// 404: no such route, pair, key or version.
    #[error("{0}")]
    NotFound(String),
    /// 405: the route exists but not with this method.
    #[error("{0}")]
    MethodNotAllowed(String),
    /// 408: a rank waited for the others to join and the join deadline passed.
    #[error("{0}")]
    JoinTimeout(String),
    /// 408: the request body did not arrive within the gateway's body timeout.
    #[error("{0}")]
    RequestTimeout(String),
    /// 409: the request conflicts with the pair's state (name taken, update running, stale version).
    #[error("{0}")]
    Conflict(String),
    /// 410: the pair was disconnected.
    #[error("{0}")]
    Gone(String),
    /// 413: the body (or a value inside it) is larger than allowed.
    #[error("{0}")]
    TooLarge(String),
    /// 415: the body is not `application/json`.
    #[error("{0}")]
    UnsupportedMediaType(String),
    /// 422: well-formed JSON that describes something invalid (unknown field, mismatched models).
    #[error("{0}")]
    Unprocessable(String),
    /// 503: over a bound (the pair's long-polls); retry shortly.
    #[error("{0}")]
    Unavailable(String),
}

impl ApiError {
    /// The HTTP status code of this error.
    pub fn status(&self) -> StatusCode {
        match self {
            ApiError::BadRequest(_) => StatusCode::BAD_REQUEST,
            ApiError::Unauthorized(_) => StatusCode::UNAUTHORIZED,
            ApiError::Forbidden(_) => StatusCode::FORBIDDEN,
            ApiError::NotFound(_) => StatusCode::NOT_FOUND,
            ApiError::MethodNotAllowed(_) => StatusCode::METHOD_NOT_ALLOWED,
            ApiError::JoinTimeout(_) | ApiError::RequestTimeout(_) => StatusCode::REQUEST_TIMEOUT,
            ApiError::Conflict(_) => StatusCode::CONFLICT,
            ApiError::Gone(_) => StatusCode::GONE,
            ApiError::TooLarge(_) => StatusCode::PAYLOAD_TOO_LARGE,
            ApiError::UnsupportedMediaType(_) => StatusCode::UNSUPPORTED_MEDIA_TYPE,
            ApiError::Unprocessable(_) => StatusCode::UNPROCESSABLE_ENTITY,
            ApiError::Unavailable(_) => StatusCode::SERVICE_UNAVAILABLE,
        }
    }

    /// 404 for a pair name that is not registered.
    pub(crate) fn no_pair(name: &str) -> ApiError {
        ApiError::NotFound(format!(
            "no pair named `{name}`; create it with POST /v1/pairs"
        ))
    }

    /// 410 for a pair that was disconnected.
    pub(crate) fn disconnected(name: &str) -> ApiError {
        ApiError::Gone(format!(
            "pair `{name}` was disconnected; connect it again with POST /v1/pairs"
        ))
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let status = self.status();
        let unauthorized = matches!(self, ApiError::Unauthorized(_));
        let unavailable = matches!(self, ApiError::Unavailable(_));
        let mut response = (
            status,
            Json(serde_json::json!({ "error": self.to_string() })),
        )
            .into_response();
        if unauthorized {
            response.headers_mut().insert(
                header::WWW_AUTHENTICATE,
                HeaderValue::from_static("Bearer realm=\"awex\""),
            );
        }
        if unavailable {
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
        }
        response
    }
}

/// Fallback for paths no route matches.
pub(crate) async fn no_route(method: Method, uri: Uri) -> ApiError {
    ApiError::NotFound(format!(
        "no route for {method} {}; the routes are listed in GET /openapi.json",
        uri.path()
    ))
}

/// Fallback for a known path with a method it does not accept.
pub(crate) async fn method_not_allowed(method: Method, uri: Uri) -> ApiError {
    ApiError::MethodNotAllowed(format!(
        "method {method} is not allowed on {}; the routes are listed in GET /openapi.json",
        uri.path()
    ))
}
