//! `GET /openapi.json`: the OpenAPI 3.0 document of the gateway, checked in beside this file and
//! tested against the route table (every route documented with its methods, and nothing else).

use axum::http::header;
use axum::response::IntoResponse;

/// The OpenAPI 3.0 document of the gateway's HTTP API.
pub const DOCUMENT: &str = include_str!("openapi.json");

/// `GET /openapi.json`.
pub(crate) async fn document() -> impl IntoResponse {
    ([(header::CONTENT_TYPE, "application/json")], DOCUMENT)
}
