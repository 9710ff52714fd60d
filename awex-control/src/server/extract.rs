//! Extractors for JSON bodies, path segments and query strings whose rejections are
//! [`ApiError`]s, so that every malformed request gets a 4xx with a `{"error": ...}` body.

use super::AppState;
use super::error::ApiError;
use axum::body::Bytes;
use axum::extract::{FromRequest, FromRequestParts, Path, Query, Request};
use axum::http::{StatusCode, header, request::Parts};
use serde::de::DeserializeOwned;

/// A JSON request body: `Content-Type: application/json`, within the body limit, unknown fields
/// rejected by the target type.
pub(crate) struct JsonBody<T>(pub T);

impl<T: DeserializeOwned> FromRequest<AppState> for JsonBody<T> {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &AppState) -> Result<Self, Self::Rejection> {
        let json = req
            .headers()
            .get(header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.split(';').next())
            .map(|v| v.trim().eq_ignore_ascii_case("application/json"))
            .unwrap_or(false);
        if !json {
            return Err(ApiError::UnsupportedMediaType(
                "the request body must be JSON with `Content-Type: application/json`".into(),
            ));
        }
        let limit = state.config.body_limit;
        // the whole body within the body timeout, however its bytes trickle in
        let within = state.config.body_timeout;
        let read = tokio::time::timeout(within, Bytes::from_request(req, state))
            .await
            .map_err(|_| {
                ApiError::RequestTimeout(format!(
                    "the request body did not arrive within {} s; send it whole",
                    within.as_secs_f64()
                ))
            })?;
        let bytes = read.map_err(|e| {
            if e.status() == StatusCode::PAYLOAD_TOO_LARGE {
                ApiError::TooLarge(format!(
                    "the request body exceeds the gateway's limit of {limit} bytes"
                ))
            } else {
                ApiError::BadRequest(format!("cannot read the request body: {}", e.body_text()))
            }
        })?;
        parse_json(&bytes).map(JsonBody)
    }
}

/// Parses JSON bytes: syntax errors are 400, well-formed JSON of the wrong shape is 422.
pub(crate) fn parse_json<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, ApiError> {
    serde_json::from_slice(bytes).map_err(|e| json_error(&e))
}

/// The API error for a serde_json error.
pub(crate) fn json_error(e: &serde_json::Error) -> ApiError {
    use serde_json::error::Category;
    match e.classify() {
        Category::Syntax | Category::Eof | Category::Io => {
            ApiError::BadRequest(format!("the request body is not valid JSON: {e}"))
        }
        Category::Data => ApiError::Unprocessable(format!("invalid request body: {e}")),
    }
}

/// Path parameters; a segment that does not decode is 400.
pub(crate) struct PathParams<T>(pub T);

impl<T: DeserializeOwned + Send> FromRequestParts<AppState> for PathParams<T> {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &AppState) -> Result<Self, ApiError> {
        Path::<T>::from_request_parts(parts, state)
            .await
            .map(|Path(v)| PathParams(v))
            .map_err(|e| ApiError::BadRequest(format!("bad path: {}", e.body_text())))
    }
}

/// Query parameters; unknown or malformed parameters are 400.
pub(crate) struct QueryParams<T>(pub T);

impl<T: DeserializeOwned + Send> FromRequestParts<AppState> for QueryParams<T> {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &AppState) -> Result<Self, ApiError> {
        Query::<T>::from_request_parts(parts, state)
            .await
            .map(|Query(v)| QueryParams(v))
            .map_err(|e| ApiError::BadRequest(format!("bad query string: {}", e.body_text())))
    }
}

/// The `timeout_ms` of a long-poll: default [`super::DEFAULT_WAIT_MS`], at most [`super::MAX_WAIT_MS`].
pub(crate) fn wait_ms(requested: Option<u64>) -> Result<u64, ApiError> {
    match requested {
        None => Ok(super::DEFAULT_WAIT_MS),
        Some(t) if t <= super::MAX_WAIT_MS => Ok(t),
        Some(t) => Err(ApiError::BadRequest(format!(
            "timeout_ms={t} exceeds the maximum of {} ms",
            super::MAX_WAIT_MS
        ))),
    }
}
