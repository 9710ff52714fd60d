//! Updates: `POST /v1/pairs/{name}/updates` starts a version, `GET .../updates/{version}` reads
//! (and optionally waits for) its state, `POST .../updates/{version}/report` is how each rank
//! says it finished.
//!
//! The handlers parse the request, find the pair, take a long-poll permit where they wait, and
//! call the pair's update lifecycle (`server/lifecycle`, which holds the state machine); its
//! refusals become status codes here.

use crate::server::error::ApiError;
use crate::server::extract::{JsonBody, PathParams, QueryParams, wait_ms};
use crate::server::lifecycle::UpdateError;
use crate::server::state::AppState;
use crate::server::store::updates::RankDetail;
use crate::wire::{Report, ReportAck, StartUpdate, UpdateStatus};
use axum::Json;
use axum::extract::State;
use axum::http::StatusCode;
use serde::Deserialize;
use std::time::Duration;
use tokio::time::Instant;

/// `POST /v1/pairs/{name}/updates`: starts a version; 202 with its status.
pub(crate) async fn start(
    State(gw): State<AppState>,
    PathParams(name): PathParams<String>,
    JsonBody(req): JsonBody<StartUpdate>,
) -> Result<(StatusCode, Json<UpdateStatus>), ApiError> {
    let entry = gw.pair(&name)?;
    let status = entry.start_update(req.version)?;
    Ok((StatusCode::ACCEPTED, Json(status)))
}

/// `GET /v1/pairs/{name}/updates/{version}?timeout_ms=T&ranks=all|problems|none`.
pub(crate) async fn status(
    State(gw): State<AppState>,
    PathParams((name, version)): PathParams<(String, u64)>,
    QueryParams(q): QueryParams<StatusQuery>,
) -> Result<Json<UpdateStatus>, ApiError> {
    let wait = match q.timeout_ms {
        None => 0,
        t => wait_ms(t)?,
    };
    let entry = gw.pair(&name)?;
    let _permit = gw.long_poll(&entry, wait)?;
    let end = Instant::now() + Duration::from_millis(wait);
    Ok(Json(entry.wait_update(version, end, q.ranks).await?))
}

/// `POST /v1/pairs/{name}/updates/{version}/report`.
pub(crate) async fn report(
    State(gw): State<AppState>,
    PathParams((name, version)): PathParams<(String, u64)>,
    JsonBody(r): JsonBody<Report>,
) -> Result<Json<ReportAck>, ApiError> {
    let entry = gw.pair(&name)?;
    Ok(Json(entry.report(version, r)?))
}

/// Query of `GET .../updates/{version}`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct StatusQuery {
    /// Wait up to this long for the update to commit or fail (0 or absent: answer at once).
    timeout_ms: Option<u64>,
    #[serde(default)]
    ranks: RankDetail,
}

impl From<UpdateError> for ApiError {
    /// The status code of each refusal of the update lifecycle.
    fn from(e: UpdateError) -> ApiError {
        use UpdateError as E;
        let message = e.to_string();
        match e {
            E::Joining { .. }
            | E::JoinFailed { .. }
            | E::Busy { .. }
            | E::Stale { .. }
            | E::NotAnnounced { .. }
            | E::AttemptOver { .. }
            | E::NotRunning { .. }
            | E::Settled { .. }
            | E::AlreadyReported { .. }
            | E::ApplyingOnlyInference { .. }
            | E::AlreadyApplied { .. }
            | E::NoRankRecord { .. } => ApiError::Conflict(message),
            E::Disconnected { .. } => ApiError::Gone(message),
            E::NoSuchVersion { .. } | E::Vanished { .. } => ApiError::NotFound(message),
            E::ErrorTooLong { .. } => ApiError::TooLarge(message),
            E::ChecksumMissing { .. } => ApiError::Unprocessable(message),
            E::BadUnreached { .. } => ApiError::Unprocessable(message),
            E::Reporter(api) => api,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::UpdateState;

    #[test]
    fn lifecycle_refusals_map_to_their_status_codes_with_their_message() {
        let settled = UpdateError::Settled {
            version: 3,
            attempt: 1,
            state: UpdateState::Committed,
            who: "training rank 0".into(),
        };
        let cases = [
            (settled, StatusCode::CONFLICT),
            (
                UpdateError::Disconnected { pair: "p".into() },
                StatusCode::GONE,
            ),
            (
                UpdateError::NoSuchVersion {
                    pair: "p".into(),
                    version: 9,
                    latest: Some(8),
                },
                StatusCode::NOT_FOUND,
            ),
            (
                UpdateError::ErrorTooLong { who: "x".into() },
                StatusCode::PAYLOAD_TOO_LARGE,
            ),
            (
                UpdateError::ChecksumMissing {
                    pair: "p".into(),
                    who: "x".into(),
                },
                StatusCode::UNPROCESSABLE_ENTITY,
            ),
            (
                UpdateError::Reporter(ApiError::Unprocessable("rank 7 is outside".into())),
                StatusCode::UNPROCESSABLE_ENTITY,
            ),
        ];
        for (e, code) in cases {
            let message = e.to_string();
            let api = ApiError::from(e);
            assert_eq!((api.status(), api.to_string()), (code, message));
        }
        let e = UpdateError::NoSuchVersion {
            pair: "p".into(),
            version: 9,
            latest: None,
        };
        assert_eq!(
            e.to_string(),
            "pair `p` has no update of version 9 (none was started)"
        );
    }
}
