//! `GET /metrics`: pairs, updates by outcome, update durations and bytes, in the Prometheus text
//! exposition format (version 0.0.4).

use crate::wire::PairState;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};

/// Upper bounds (seconds) of the update-duration histogram buckets.
pub(crate) const BUCKETS: [f64; 14] = [
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0, 60.0, 300.0,
];

/// Counters of the gateway, updated lock-free by the handlers and background tasks.
#[derive(Default)]
pub(crate) struct Metrics {
    pub(crate) committed: AtomicU64,
    pub(crate) failed: AtomicU64,
    pub(crate) bytes_training: AtomicU64,
    pub(crate) bytes_inference: AtomicU64,
    pub(crate) joins: AtomicU64,
    pub(crate) buckets: [AtomicU64; BUCKETS.len()],
    pub(crate) duration_count: AtomicU64,
    pub(crate) duration_sum_us: AtomicU64,
    /// connect requests being validated now (a gauge)
    pub(crate) validating: AtomicU64,
}

/// Counts one connect validation as running until it is dropped.
pub(crate) struct Validating(std::sync::Arc<Metrics>);

impl Drop for Validating {
    fn drop(&mut self) {
        self.0.validating.fetch_sub(1, Ordering::Relaxed);
    }
}

impl Metrics {
    /// Records a finished update: its outcome, duration and bytes per side.
    pub(crate) fn update_finished(&self, committed: bool, seconds: f64, bytes: [u64; 2]) {
        if committed {
            self.committed.fetch_add(1, Ordering::Relaxed);
        } else {
            self.failed.fetch_add(1, Ordering::Relaxed);
        }
        for (i, le) in BUCKETS.iter().enumerate() {
            if seconds <= *le {
                self.buckets[i].fetch_add(1, Ordering::Relaxed);
            }
        }
        self.duration_count.fetch_add(1, Ordering::Relaxed);
        self.duration_sum_us
            .fetch_add((seconds * 1e6) as u64, Ordering::Relaxed);
        self.bytes_training.fetch_add(bytes[0], Ordering::Relaxed);
        self.bytes_inference.fetch_add(bytes[1], Ordering::Relaxed);
    }

    /// Counts a connect validation as running; it stops counting when the guard drops (moved
    /// into the blocking task, so that it counts what runs, also after the request is gone).
    pub(crate) fn validating(self: &std::sync::Arc<Self>) -> Validating {
        self.validating.fetch_add(1, Ordering::Relaxed);
        Validating(self.clone())
    }

    /// Records a rank joining (or re-joining) a pair.
    pub(crate) fn rank_joined(&self) {
        self.joins.fetch_add(1, Ordering::Relaxed);
    }

    /// The exposition text, given the number of pairs in each state.
    pub(crate) fn text(&self, pairs: &[(PairState, usize)]) -> String {
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let mut s = String::new();
        let _ = writeln!(
            s,
            "# HELP awex_gateway_pairs Pairs known to the gateway, by state."
        );
        let _ = writeln!(s, "# TYPE awex_gateway_pairs gauge");
        for (state, n) in pairs {
            let _ = writeln!(s, "awex_gateway_pairs{{state=\"{}\"}} {n}", state.as_str());
        }
        let _ = writeln!(
            s,
            "# HELP awex_gateway_updates_total Finished weight updates, by outcome."
        );
        let _ = writeln!(s, "# TYPE awex_gateway_updates_total counter");
        let _ = writeln!(
            s,
            "awex_gateway_updates_total{{outcome=\"committed\"}} {}",
            get(&self.committed)
        );
        let _ = writeln!(
            s,
            "awex_gateway_updates_total{{outcome=\"failed\"}} {}",
            get(&self.failed)
        );
        let _ = writeln!(
            s,
            "# HELP awex_gateway_update_duration_seconds Time from starting an update to its commit or failure."
        );
        let _ = writeln!(s, "# TYPE awex_gateway_update_duration_seconds histogram");
        for (i, le) in BUCKETS.iter().enumerate() {
            let _ = writeln!(
                s,
                "awex_gateway_update_duration_seconds_bucket{{le=\"{le}\"}} {}",
                get(&self.buckets[i])
            );
        }
        let count = get(&self.duration_count);
        let _ = writeln!(
            s,
            "awex_gateway_update_duration_seconds_bucket{{le=\"+Inf\"}} {count}"
        );
        let _ = writeln!(
            s,
            "awex_gateway_update_duration_seconds_sum {}",
            get(&self.duration_sum_us) as f64 / 1e6
        );
        let _ = writeln!(s, "awex_gateway_update_duration_seconds_count {count}");
        let _ = writeln!(
            s,
            "# HELP awex_gateway_update_bytes_total Bytes ranks reported moving in finished updates, by side."
        );
        let _ = writeln!(s, "# TYPE awex_gateway_update_bytes_total counter");
        let _ = writeln!(
            s,
            "awex_gateway_update_bytes_total{{side=\"training\"}} {}",
            get(&self.bytes_training)
        );
        let _ = writeln!(
            s,
            "awex_gateway_update_bytes_total{{side=\"inference\"}} {}",
            get(&self.bytes_inference)
        );
        let _ = writeln!(
            s,
            "# HELP awex_gateway_rank_joins_total Rank joins (re-joins included)."
        );
        let _ = writeln!(s, "# TYPE awex_gateway_rank_joins_total counter");
        let _ = writeln!(s, "awex_gateway_rank_joins_total {}", get(&self.joins));
        let _ = writeln!(
            s,
            "# HELP awex_gateway_connect_validations Connect requests being validated now (catalogues and layouts, on the blocking pool)."
        );
        let _ = writeln!(s, "# TYPE awex_gateway_connect_validations gauge");
        let _ = writeln!(
            s,
            "awex_gateway_connect_validations {}",
            get(&self.validating)
        );
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_is_cumulative_and_counts_outcomes_and_bytes() {
        let m = std::sync::Arc::new(Metrics::default());
        let running = m.validating();
        m.update_finished(true, 0.003, [100, 200]);
        m.update_finished(false, 0.2, [5, 0]);
        let text = m.text(&[(PairState::Ready, 2)]);
        for line in [
            "awex_gateway_pairs{state=\"ready\"} 2",
            "awex_gateway_updates_total{outcome=\"committed\"} 1",
            "awex_gateway_updates_total{outcome=\"failed\"} 1",
            "awex_gateway_update_duration_seconds_bucket{le=\"0.0025\"} 0",
            "awex_gateway_update_duration_seconds_bucket{le=\"0.005\"} 1",
            "awex_gateway_update_duration_seconds_bucket{le=\"0.25\"} 2",
            "awex_gateway_update_duration_seconds_bucket{le=\"+Inf\"} 2",
            "awex_gateway_update_duration_seconds_count 2",
            "awex_gateway_update_bytes_total{side=\"training\"} 105",
            "awex_gateway_update_bytes_total{side=\"inference\"} 200",
            "awex_gateway_connect_validations 1",
        ] {
            assert!(
                text.lines().any(|l| l == line),
                "missing `{line}` in\n{text}"
            );
        }
        drop(running);
        assert!(
            m.text(&[])
                .contains("\nawex_gateway_connect_validations 0\n")
        );
    }
}
