//! A pair's event log: its last events, in order, with their seqs.

use crate::wire::{EVENTS_KEPT, Event, EventKind};
use std::collections::VecDeque;

/// The last [`EVENTS_KEPT`] events of a pair.
#[derive(Default)]
pub(crate) struct EventLog {
    pub(crate) events: VecDeque<Event>,
    pub(crate) last: u64,
}

impl EventLog {
    /// Appends an event; returns its seq.
    pub(crate) fn push(
        &mut self,
        kind: EventKind,
        version: Option<u64>,
        attempt: Option<u32>,
        reason: Option<String>,
    ) -> u64 {
        self.last += 1;
        if self.events.len() == EVENTS_KEPT {
            self.events.pop_front();
        }
        self.events.push_back(Event {
            seq: self.last,
            kind,
            version,
            attempt,
            reason,
            base: None,
            engines: Vec::new(),
        });
        self.last
    }

    /// Seq of the last event (0 before any).
    pub(crate) fn last_seq(&self) -> u64 {
        self.last
    }

    /// Kept events with `seq > after`.
    pub(crate) fn since(&self, after: u64) -> Vec<Event> {
        let skip = self.events.partition_point(|e| e.seq <= after);
        self.events.iter().skip(skip).cloned().collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn log_keeps_the_latest_events_and_answers_after_a_seq() {
        let mut log = EventLog::default();
        for v in 0..(EVENTS_KEPT as u64 + 10) {
            log.push(EventKind::Update, Some(v), Some(1), None);
        }
        assert_eq!(log.last_seq(), EVENTS_KEPT as u64 + 10);
        let tail = log.since(EVENTS_KEPT as u64 + 8);
        assert_eq!(
            tail.iter().map(|e| e.seq).collect::<Vec<_>>(),
            vec![EVENTS_KEPT as u64 + 9, EVENTS_KEPT as u64 + 10]
        );
        assert_eq!(log.since(0).len(), EVENTS_KEPT);
        assert_eq!(log.since(0)[0].seq, 11);
        assert!(log.since(log.last_seq()).is_empty());
    }
}
