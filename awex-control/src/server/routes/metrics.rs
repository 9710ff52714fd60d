//! `GET /metrics`: the Prometheus text of the gateway's counters.

use crate::server::state::AppState;
use crate::wire::{EngineState, PairState};
use axum::extract::State;
use axum::http::header;
use axum::response::IntoResponse;
use std::fmt::Write as _;
/// `GET /metrics`.
pub(crate) async fn render(State(gateway): State<AppState>) -> impl IntoResponse {
    let mut counts: Vec<(PairState, usize)> = PairState::ALL.iter().map(|s| (*s, 0)).collect();
    let mut engines: Vec<(EngineState, usize)> = EngineState::ALL.iter().map(|s| (*s, 0)).collect();
    // (pair, engine, serving version, behind since) of every ready pair's engines
    let mut serving = Vec::new();
    {
        let pairs = gateway.pairs.read().unwrap_or_else(|e| e.into_inner());
        for (name, entry) in pairs.iter() {
            let (state, statuses) = entry.engines();
            if let Some(c) = counts.iter_mut().find(|(s, _)| *s == state) {
                c.1 += 1;
            }
            if state != PairState::Ready {
                continue;
            }
            for e in statuses {
                if let Some(c) = engines.iter_mut().find(|(s, _)| *s == e.state) {
                    c.1 += 1;
                }
                serving.push((
                    name.clone(),
                    e.engine,
                    e.serving_version,
                    e.behind_since_unix_ms,
                ));
            }
        }
    }
    serving.sort();
    let mut text = gateway.metrics.text(&counts);
    let _ = writeln!(
        text,
        "# HELP awex_gateway_memory_trims_total Times the gateway gave freed memory back to the system (after pairs were disconnected or forgotten, or a large connect was handled)."
    );
    let _ = writeln!(text, "# TYPE awex_gateway_memory_trims_total counter");
    let _ = writeln!(
        text,
        "awex_gateway_memory_trims_total {}",
        gateway.trim.done.load(std::sync::atomic::Ordering::Relaxed)
    );
    let _ = writeln!(
        text,
        "# HELP awex_gateway_engines Inference engine slots of ready pairs, by state (serving, behind, torn, catching_up, joining, absent)."
    );
    let _ = writeln!(text, "# TYPE awex_gateway_engines gauge");
    for (state, n) in &engines {
        let _ = writeln!(
            text,
            "awex_gateway_engines{{state=\"{}\"}} {n}",
            state.as_str()
        );
    }
    let _ = writeln!(
        text,
        "# HELP awex_gateway_engine_serving_version The last committed version each engine of a ready pair applied whole (absent before the first)."
    );
    let _ = writeln!(text, "# TYPE awex_gateway_engine_serving_version gauge");
    for (pair, engine, version, _) in &serving {
        if let Some(v) = version {
            let _ = writeln!(
                text,
                "awex_gateway_engine_serving_version{{pair=\"{pair}\",engine=\"{engine}\"}} {v}"
            );
        }
    }
    let _ = writeln!(
        text,
        "# HELP awex_gateway_engine_behind_since_seconds When the engine first missed a committed version (Unix time; absent when current)."
    );
    let _ = writeln!(
        text,
        "# TYPE awex_gateway_engine_behind_since_seconds gauge"
    );
    for (pair, engine, _, since) in &serving {
        if let Some(t) = since {
            let _ = writeln!(
                text,
                "awex_gateway_engine_behind_since_seconds{{pair=\"{pair}\",engine=\"{engine}\"}} {}",
                *t as f64 / 1e3
            );
        }
    }
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        text,
    )
}
