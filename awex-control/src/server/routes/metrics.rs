//! `GET /metrics`: the Prometheus text of the gateway's counters.

use crate::server::state::AppState;
use crate::wire::PairState;
use axum::extract::State;
use axum::http::header;
use axum::response::IntoResponse;
/// `GET /metrics`.
pub(crate) async fn render(State(gateway): State<AppState>) -> impl IntoResponse {
    let mut counts: Vec<(PairState, usize)> = PairState::ALL.iter().map(|s| (*s, 0)).collect();
    {
        let pairs = gateway.pairs.read().unwrap_or_else(|e| e.into_inner());
        for entry in pairs.values() {
            let state = entry.state();
            if let Some(c) = counts.iter_mut().find(|(s, _)| *s == state) {
                c.1 += 1;
            }
        }
    }
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        gateway.metrics.text(&counts),
    )
}
