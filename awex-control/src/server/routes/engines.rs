//! Engines of a running pair: `POST /v1/pairs/{name}/engines` adds one in a free engine slot,
//! `DELETE /v1/pairs/{name}/engines/{engine}` removes one (`server::fleet` says what each does).

use crate::server::error::ApiError;
use crate::server::extract::{JsonBody, PathParams};
use crate::server::state::AppState;
use crate::wire::{AddEngine, EngineChanged};
use axum::Json;
use axum::extract::State;

/// `POST /v1/pairs/{name}/engines`: the engine's slot, `joining` until its ranks joined.
pub(crate) async fn add(
    State(gw): State<AppState>,
    PathParams(name): PathParams<String>,
    JsonBody(req): JsonBody<AddEngine>,
) -> Result<Json<EngineChanged>, ApiError> {
    let entry = gw.pair(&name)?;
    Ok(Json(entry.add_engine(req.engine)?))
}

/// `DELETE /v1/pairs/{name}/engines/{engine}`: the slot, now `absent`.
pub(crate) async fn remove(
    State(gw): State<AppState>,
    PathParams((name, engine)): PathParams<(String, String)>,
) -> Result<Json<EngineChanged>, ApiError> {
    let entry = gw.pair(&name)?;
    let engine: u32 = engine.parse().map_err(|_| {
        ApiError::BadRequest(format!(
            "`{}` is not an engine index: use the engine slot's number (0, 1, ...), as pair status lists them",
            crate::server::validate::clip(&engine, 40)
        ))
    })?;
    Ok(Json(entry.remove_engine(engine)?))
}
