//! A pair's roster: which ranks exist (slots) and which joined, with their rendezvous info.

use crate::server::error::ApiError;
use crate::server::store::unix_ms;
use crate::wire::MAX_ROSTER_INFO_BYTES;
use crate::wire::*;
use awex_core::layout::{RankId, Side};
use axum::body::Bytes;
use serde_json::Value;
/// The rank slots of a pair: training ranks first, then each engine's ranks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Slots {
    pub(crate) train: u32,
    pub(crate) engines: u32,
    pub(crate) per_engine: u32,
}

/// How a rank is named in messages (`training rank 3`, `inference rank 1/0`).
pub(crate) fn rank_name(side: Side, rank: RankId) -> String {
    match side {
        Side::Training => format!("training rank {}", rank.rank),
        Side::Inference => format!("inference rank {}/{}", rank.engine, rank.rank),
    }
}

impl Slots {
    /// Slots for `train` training ranks and `engines` engines of `per_engine` ranks.
    pub(crate) fn new(train: u32, engines: u32, per_engine: u32) -> Self {
        Slots {
            train,
            engines,
            per_engine,
        }
    }

    /// Ranks of both sides.
    pub(crate) fn total(&self) -> usize {
        self.train as usize + self.engines as usize * self.per_engine as usize
    }

    /// The slot of a rank, or 422 naming the valid range.
    pub(crate) fn index(&self, side: Side, rank: RankId) -> Result<usize, ApiError> {
        match side {
            Side::Training if rank.engine == 0 && rank.rank < self.train => Ok(rank.rank as usize),
            Side::Training => Err(ApiError::Unprocessable(format!(
                "training rank {{engine: {}, rank: {}}} is not in this pair: training ranks are {{engine: 0, rank: 0..{}}}",
                rank.engine, rank.rank, self.train
            ))),
            Side::Inference if rank.engine < self.engines && rank.rank < self.per_engine => {
                Ok(self.train as usize
                    + rank.engine as usize * self.per_engine as usize
                    + rank.rank as usize)
            }
            Side::Inference => Err(ApiError::Unprocessable(format!(
                "inference rank {{engine: {}, rank: {}}} is not in this pair: engines 0..{}, ranks 0..{} per engine",
                rank.engine, rank.rank, self.engines, self.per_engine
            ))),
        }
    }

    /// The rank in a slot.
    pub(crate) fn rank(&self, i: usize) -> (Side, RankId) {
        let i = i as u32;
        if i < self.train {
            (Side::Training, RankId::train(i))
        } else {
            let j = i - self.train;
            let per = self.per_engine.max(1);
            (Side::Inference, RankId::infer(j / per, j % per))
        }
    }

    /// Whether a slot is on the training side.
    pub(crate) fn is_training(&self, i: usize) -> bool {
        i < self.train as usize
    }
}

/// Lists at most 16 ranks by name, then how many more.
pub(crate) fn list_ranks(slots: &Slots, idx: impl Iterator<Item = usize>) -> String {
    let all: Vec<usize> = idx.collect();
    let mut s: Vec<String> = all
        .iter()
        .take(16)
        .map(|&i| {
            let (side, rank) = slots.rank(i);
            rank_name(side, rank)
        })
        .collect();
    if all.len() > 16 {
        s.push(format!("and {} more", all.len() - 16));
    }
    s.join(", ")
}

/// How long a slot's holder counts as live after it was last seen (joined, re-attached, or
/// polled for events) when it has no poll open.
pub(crate) const HOLDER_LIVENESS: std::time::Duration = std::time::Duration::from_secs(15);

pub(crate) struct Joined {
    pub(crate) info: Value,
    pub(crate) info_bytes: usize,
    pub(crate) unix_ms: u64,
    /// The holder process's claim id (`info.incarnation`), when it sent one.
    pub(crate) incarnation: Option<String>,
    /// The holder's pid (`info.pid`), for messages.
    pub(crate) pid: Option<u64>,
    /// Until when the holder counts as live without an open poll.
    pub(crate) live_until: tokio::time::Instant,
    /// Event polls the holder has open.
    pub(crate) polls: u32,
    /// The holder is known gone: its last open event poll was dropped unanswered (the
    /// connection closed, as when the process dies) and it has not polled or joined since.
    pub(crate) gone: bool,
    /// The operator released the slot (`POST .../ranks/release`): the next claimant takes it.
    pub(crate) released: bool,
}

/// A slot changing hands: who held it, and why it may be taken.
#[derive(Debug)]
pub(crate) struct Takeover {
    /// The replaced holder's claim id (compared, never shown).
    pub(crate) claim: String,
    /// The replaced holder's pid, for messages and logs.
    pub(crate) pid: Option<u64>,
    /// Why the slot is free: the holder's connection closed, or the operator released it.
    pub(crate) why: &'static str,
}

impl Joined {
    /// Whether the holder is live: a poll open, or seen within [`HOLDER_LIVENESS`] (after a
    /// restart: within the pair's join deadline).
    pub(crate) fn live(&self) -> bool {
        self.polls > 0 || tokio::time::Instant::now() < self.live_until
    }
}

/// Whether two claim ids are equal, in time independent of where they differ.
fn same_claim(a: &str, b: &str) -> bool {
    use subtle::ConstantTimeEq;
    a.len() == b.len() && bool::from(a.as_bytes().ct_eq(b.as_bytes()))
}

/// The claim id a rank sends in its info (`incarnation`).
pub(crate) fn incarnation_of(info: &Value) -> Option<&str> {
    info.get("incarnation").and_then(Value::as_str)
}

/// The slot a rendezvous key names (`rdv.{train|infer}.{engine}.{rank}`, as the ranks publish).
pub(crate) fn rendezvous_slot(slots: &Slots, key: &str) -> Option<usize> {
    let mut it = key.strip_prefix("rdv.")?.split('.');
    let side = match it.next()? {
        "train" => Side::Training,
        "infer" => Side::Inference,
        _ => return None,
    };
    let engine = it.next()?.parse().ok()?;
    let rank = it.next()?.parse().ok()?;
    slots.index(side, RankId { engine, rank }).ok()
}

/// Who joined, with their rendezvous info, and the serialised roster once complete.
pub(crate) struct Roster {
    pub(crate) slots: Vec<Option<Joined>>,
    /// Holder claim id -> slot.
    pub(crate) holders: std::collections::HashMap<String, usize>,
    pub(crate) joined: usize,
    pub(crate) info_bytes: usize,
    pub(crate) cached: Option<Bytes>,
}

impl Roster {
    /// An empty roster of `n` slots.
    pub(crate) fn new(n: usize) -> Self {
        Roster {
            slots: (0..n).map(|_| None).collect(),
            holders: std::collections::HashMap::new(),
            joined: 0,
            info_bytes: 0,
            cached: None,
        }
    }

    /// Ranks joined.
    pub(crate) fn joined(&self) -> usize {
        self.joined
    }

    /// Ranks joined per side.
    pub(crate) fn joined_per_side(&self, slots: &Slots) -> (u32, u32) {
        let t = self.slots[..slots.train as usize]
            .iter()
            .filter(|s| s.is_some())
            .count();
        (t as u32, (self.joined - t) as u32)
    }

    /// Forgets the serialised roster (a rank re-joined or a rendezvous value changed).
    pub(crate) fn invalidate(&mut self) {
        self.cached = None;
    }

    /// The missing ranks among the slots `waited` for, for messages.
    pub(crate) fn describe_missing(&self, slots: &Slots, waited: impl Fn(usize) -> bool) -> String {
        list_ranks(
            slots,
            self.slots
                .iter()
                .enumerate()
                .filter(|&(i, s)| s.is_none() && waited(i))
                .map(|(i, _)| i),
        )
    }

    /// Joined ranks, for status.
    pub(crate) fn ranks(&self, slots: &Slots) -> Vec<RosterRank> {
        self.slots
            .iter()
            .enumerate()
            .filter_map(|(i, s)| {
                s.as_ref().map(|j| {
                    let (side, rank) = slots.rank(i);
                    RosterRank {
                        side,
                        rank,
                        joined_unix_ms: j.unix_ms,
                    }
                })
            })
            .collect()
    }

    /// Empties slot `i` (its engine left the pair); whether it held a rank.
    pub(crate) fn remove(&mut self, i: usize) -> bool {
        let Some(j) = self.slots.get_mut(i).and_then(Option::take) else {
            return false;
        };
        if let Some(c) = &j.incarnation {
            self.holders.remove(c);
        }
        self.joined -= 1;
        self.info_bytes -= j.info_bytes;
        self.cached = None;
        true
    }

    /// Records (or replaces) a rank's entry.
    pub(crate) fn put(&mut self, i: usize, info: Value, info_bytes: usize) -> Result<(), ApiError> {
        let old = self.slots[i].as_ref().map_or(0, |j| j.info_bytes);
        let total = self.info_bytes - old + info_bytes;
        if total > MAX_ROSTER_INFO_BYTES {
            return Err(ApiError::TooLarge(format!(
                "the ranks' info of this pair would total {total} bytes; at most {MAX_ROSTER_INFO_BYTES} are accepted"
            )));
        }
        if self.slots[i].is_none() {
            self.joined += 1;
        }
        self.info_bytes = total;
        let incarnation = incarnation_of(&info).map(str::to_string);
        let pid = info.get("pid").and_then(Value::as_u64);
        let polls = match self.slots[i].take() {
            Some(old) => {
                if let Some(o) = &old.incarnation {
                    self.holders.remove(o);
                }
                // the same holder joining again keeps its open polls
                if old.incarnation == incarnation {
                    old.polls
                } else {
                    0
                }
            }
            None => 0,
        };
        if let Some(c) = &incarnation {
            self.holders.insert(c.clone(), i);
        }
        self.slots[i] = Some(Joined {
            info,
            info_bytes,
            unix_ms: unix_ms(),
            incarnation,
            pid,
            live_until: tokio::time::Instant::now() + HOLDER_LIVENESS,
            polls,
            gone: false,
            released: false,
        });
        self.cached = None;
        Ok(())
    }

    /// Decides whether a claimant of slot `i` (claim id `incarnation`, pid `pid`) may join or
    /// write its rendezvous value: the holder itself (its claim id), anyone for an empty slot or
    /// one whose holder joined without a claim id, and anyone once the holder is known gone
    /// (its event poll's connection closed) or the operator released the slot: then the slot
    /// changes hands ([`Takeover`]). A silent holder is not a gone one: any other claimant is
    /// refused, 409 naming the slot and the holder's pid, never a claim id.
    pub(crate) fn check_claim(
        &self,
        slots: &Slots,
        i: usize,
        incarnation: Option<&str>,
        pid: Option<u64>,
    ) -> Result<Option<Takeover>, ApiError> {
        let Some(h) = self.slots.get(i).and_then(Option::as_ref) else {
            return Ok(None);
        };
        let Some(held) = h.incarnation.as_deref() else {
            return Ok(None);
        };
        if incarnation.is_some_and(|c| same_claim(c, held)) {
            return Ok(None);
        }
        let takeover = |why| {
            Ok(Some(Takeover {
                claim: held.to_string(),
                pid: h.pid,
                why,
            }))
        };
        if h.released {
            return takeover("the operator released the slot");
        }
        if h.gone && h.polls == 0 {
            return takeover("its event poll's connection closed (the process is gone)");
        }
        let (side, rank) = slots.rank(i);
        let pid_of = |p: Option<u64>| p.map_or("unknown".to_string(), |p| p.to_string());
        // no claim id is echoed: the holder's binds the slot to it, and a claimant's is its own
        Err(ApiError::Conflict(format!(
            "{} is held by a live process (pid {}): it has not been seen to go (its connection did not close), and a silent or stopped process keeps its slot; this second claimant (pid {}) is refused and changed nothing. Stop the duplicate; if the holder is really gone, release its slot (`awex-cli pair release`, POST /v1/pairs/{{name}}/ranks/release) and start the rank again",
            rank_name(side, rank),
            pid_of(h.pid),
            pid_of(pid),
        )))
    }

    /// Whether slot `i`'s holder is known gone (its last open poll's connection closed).
    pub(crate) fn is_gone(&self, i: usize) -> bool {
        self.slots
            .get(i)
            .and_then(Option::as_ref)
            .is_some_and(|j| j.gone && j.polls == 0)
    }

    /// The operator releases slot `i`: its holder (if any) may be replaced by the next
    /// claimant; the holder's pid, when one holds it. `None`: the slot is empty.
    pub(crate) fn release(&mut self, i: usize) -> Option<Option<u64>> {
        let j = self.slots.get_mut(i)?.as_mut()?;
        j.released = true;
        Some(j.pid)
    }

    /// Refuses a report for slot `i` that does not carry `holder`, the claim id of the process
    /// that held the slot when the version was announced (else of the slot's holder now): 409,
    /// and nothing changes. A slot whose holder joined without a claim id accepts any report.
    pub(crate) fn check_reporter(
        &self,
        slots: &Slots,
        i: usize,
        announced: Option<&str>,
        claim: Option<&str>,
    ) -> Result<(), ApiError> {
        let holder = self.slots.get(i).and_then(Option::as_ref);
        let Some(want) = announced.or_else(|| holder.and_then(|h| h.incarnation.as_deref())) else {
            return Ok(());
        };
        if claim.is_some_and(|c| same_claim(c, want)) {
            return Ok(());
        }
        let (side, rank) = slots.rank(i);
        let pid = holder
            .and_then(|h| h.pid)
            .map_or("unknown".to_string(), |p| p.to_string());
        Err(ApiError::Conflict(format!(
            "{} is held by the process (pid {pid}) that joined it before this version was announced; only it may report, with the claim id it joined with (`incarnation`). This report ({}) is refused and changed nothing",
            rank_name(side, rank),
            match claim {
                Some(_) => "another claim id",
                None => "no claim id",
            }
        )))
    }

    /// Every slot's holder claim id (`None`: empty, or joined without one).
    pub(crate) fn claims(&self) -> Vec<Option<String>> {
        self.slots
            .iter()
            .map(|s| s.as_ref().and_then(|j| j.incarnation.clone()))
            .collect()
    }

    /// The slot whose current holder is `incarnation`, if any.
    pub(crate) fn holder_slot(&self, incarnation: &str) -> Option<usize> {
        self.holders.get(incarnation).copied()
    }

    /// The holder `incarnation` polls for events: counted live until the returned guard's
    /// slot is released with [`Roster::end_poll`].
    pub(crate) fn begin_poll(&mut self, incarnation: &str) -> Option<usize> {
        let i = *self.holders.get(incarnation)?;
        let j = self.slots.get_mut(i)?.as_mut()?;
        j.polls += 1;
        j.gone = false;
        Some(i)
    }

    /// A poll of slot `i`'s holder `incarnation` ended: answered, the holder was seen now;
    /// dropped unanswered (its connection closed), it vouches for nothing more.
    pub(crate) fn end_poll(&mut self, i: usize, incarnation: &str, answered: bool) {
        if let Some(Some(j)) = self.slots.get_mut(i) {
            if j.incarnation.as_deref() == Some(incarnation) {
                j.polls = j.polls.saturating_sub(1);
                let now = tokio::time::Instant::now();
                j.live_until = if answered {
                    now + HOLDER_LIVENESS
                } else {
                    j.live_until.min(now)
                };
                // the last open poll's connection closed before its answer: the process is
                // gone (awex's ranks never drop a poll they opened while they live)
                if !answered && j.polls == 0 {
                    j.gone = true;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_number_training_then_engines_and_reject_outsiders() {
        let s = Slots::new(2, 2, 3);
        assert_eq!(s.total(), 8);
        assert_eq!(s.index(Side::Training, RankId::train(1)).unwrap(), 1);
        assert_eq!(s.index(Side::Inference, RankId::infer(1, 2)).unwrap(), 7);
        assert_eq!(s.rank(7), (Side::Inference, RankId::infer(1, 2)));
        assert_eq!(s.rank(1), (Side::Training, RankId::train(1)));
        assert_eq!(
            s.index(Side::Training, RankId::infer(1, 0))
                .unwrap_err()
                .to_string(),
            "training rank {engine: 1, rank: 0} is not in this pair: training ranks are {engine: 0, rank: 0..2}"
        );
        assert_eq!(
            s.index(Side::Inference, RankId::infer(2, 0))
                .unwrap_err()
                .to_string(),
            "inference rank {engine: 2, rank: 0} is not in this pair: engines 0..2, ranks 0..3 per engine"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_silent_holder_keeps_its_slot_and_only_a_gone_or_released_one_changes_hands() {
        let s = Slots::new(1, 1, 1);
        let mut r = Roster::new(s.total());
        let info = serde_json::json!({"incarnation": "aaaa", "pid": 7});
        r.put(0, info.clone(), 10).unwrap();
        let e = r.check_claim(&s, 0, Some("bbbb"), Some(8)).unwrap_err();
        assert_eq!(
            e.to_string(),
            "training rank 0 is held by a live process (pid 7): it has not been seen to go (its connection did not close), and a silent or stopped process keeps its slot; this second claimant (pid 8) is refused and changed nothing. Stop the duplicate; if the holder is really gone, release its slot (`awex-cli pair release`, POST /v1/pairs/{name}/ranks/release) and start the rank again"
        );
        assert!(!e.to_string().contains("bbbb") && !e.to_string().contains("aaaa"));
        assert!(
            matches!(r.check_claim(&s, 0, Some("aaaa"), Some(7)), Ok(None)),
            "the holder itself"
        );
        assert!(
            matches!(r.check_claim(&s, 1, Some("bbbb"), None), Ok(None)),
            "an empty slot"
        );
        // an open poll, then silence far past the liveness window (SIGSTOP): still held
        let slot = r.begin_poll("aaaa").unwrap();
        tokio::time::advance(HOLDER_LIVENESS * 4).await;
        assert!(r.check_claim(&s, 0, Some("bbbb"), None).is_err());
        r.end_poll(slot, "aaaa", true);
        tokio::time::advance(HOLDER_LIVENESS * 100).await;
        assert!(r.check_claim(&s, 0, Some("bbbb"), None).is_err());
        // a poll dropped unanswered while another is open: not gone
        let (a, b) = (r.begin_poll("aaaa").unwrap(), r.begin_poll("aaaa").unwrap());
        r.end_poll(a, "aaaa", false);
        assert!(r.check_claim(&s, 0, Some("bbbb"), None).is_err());
        // the last open poll's connection closed: gone, the slot changes hands
        r.end_poll(b, "aaaa", false);
        let t = r
            .check_claim(&s, 0, Some("bbbb"), Some(8))
            .unwrap()
            .unwrap();
        assert_eq!((t.claim.as_str(), t.pid), ("aaaa", Some(7)));
        assert_eq!(
            t.why,
            "its event poll's connection closed (the process is gone)"
        );
        // ... unless it polls again first
        r.begin_poll("aaaa").unwrap();
        assert!(r.check_claim(&s, 0, Some("bbbb"), None).is_err());
        r.put(0, serde_json::json!({"incarnation": "bbbb"}), 10)
            .unwrap();
        assert_eq!(r.holders.get("bbbb"), Some(&0));
        assert!(!r.holders.contains_key("aaaa"));
        assert_eq!(r.joined(), 1);
        // the operator releases a silent holder's slot
        assert_eq!(r.release(1), None, "an empty slot");
        assert_eq!(r.release(0), Some(None));
        let t = r.check_claim(&s, 0, Some("cccc"), None).unwrap().unwrap();
        assert_eq!(t.why, "the operator released the slot");
        // the holder re-joining with its own claim keeps it, and the release is spent
        r.put(0, serde_json::json!({"incarnation": "bbbb"}), 10)
            .unwrap();
        assert!(r.check_claim(&s, 0, Some("cccc"), None).is_err());
    }

    #[test]
    fn missing_ranks_are_listed_up_to_sixteen() {
        let s = Slots::new(20, 1, 1);
        let r = Roster::new(s.total());
        let text = r.describe_missing(&s, |_| true);
        assert!(text.starts_with("training rank 0, training rank 1, "));
        assert!(text.ends_with("training rank 15, and 5 more"));
    }
}
