//! Engines joining and leaving a running pair: `add_engine` fills a free engine slot (a spare
//! one reserved at connect, or one whose engine was removed), `remove_engine` frees one.
//!
//! Every rank plans against every engine slot (the inference side's layout counts them all), so
//! no plan changes when an engine comes or goes: what changes is which engines take part in a
//! version. Each `update` event names the slots out of it from its start (free, or an added
//! engine whose ranks have not all joined); the training ranks send them nothing and wait for
//! none of their ranks. An added engine takes part from the first version that starts after
//! its ranks all joined, with every byte (its ranks hold no version: they are in the delta
//! base's `except`), and is reported serving once that version committed on it. A removed
//! engine is left out of a version under way, its rank slots and rendezvous values are
//! dropped, and its ranks are told (`engine_removed`) to stop.
//!
//! Both need a commit policy other than `all`: an engine whose ranks are still joining applies
//! no version, and under `all` every engine must.

use crate::server::error::ApiError;
use crate::server::state::{Pair, PairEntry, unix_ms};
use crate::server::store::disk::Op;
use crate::server::store::engines::{EngineRecord, Membership};
use crate::server::store::roster::rendezvous_slot;
use crate::wire::{CommitPolicy, EngineChanged, EventKind, PairState};

/// Why a pair over `transport` keeps its engines fixed, if it does: the GPU transports do not
/// leave an engine out of a version (`Transport::tolerate_lost_engines`), so a free slot would
/// fail every version.
pub(crate) fn fixed_engines(transport: crate::wire::Transport) -> Option<String> {
    use crate::wire::Transport;
    match transport {
        Transport::Shm | Transport::Tcp => None,
        t => Some(format!(
            "the {t} transport does not leave an engine out of a version, so an empty engine slot would fail every version; engines join and leave pairs over shm and tcp"
        )),
    }
}

impl PairEntry {
    /// Refuses changing the engines of a pair that cannot take it (disconnected, join failed,
    /// commit policy `all`, a transport that keeps its engines fixed).
    fn check_fleet_change(&self, p: &Pair, what: &str) -> Result<(), ApiError> {
        let name = &self.name;
        match p.state {
            PairState::Disconnected => return Err(ApiError::disconnected(name)),
            PairState::JoinFailed => {
                return Err(ApiError::Conflict(format!(
                    "pair `{name}` failed to join; disconnect it and connect again before you {what}"
                )));
            }
            PairState::Joining | PairState::Ready => {}
        }
        if let Some(why) = fixed_engines(self.request.transport) {
            return Err(ApiError::Conflict(format!(
                "pair `{name}` cannot {what}: {why}"
            )));
        }
        if self.request.options.commit.is_all() {
            return Err(ApiError::Conflict(format!(
                "pair `{name}` has commit policy `all`: every engine must apply every version, and an engine whose ranks are still joining (or leaving) applies none, so no version could commit while one is; engines can join and leave pairs connected with options.commit = quorum:K or available (and inference.spare slots for engines to join)"
            )));
        }
        Ok(())
    }

    /// `POST /v1/pairs/{name}/engines`: puts an engine in slot `want` (or the lowest free
    /// one). It is `joining` until its ranks all joined, then takes part in the next version.
    pub(crate) fn add_engine(&self, want: Option<u32>) -> Result<EngineChanged, ApiError> {
        let name = &self.name;
        let mut p = self.lock();
        self.check_fleet_change(&p, "add an engine")?;
        let slots = self.slots.engines;
        let engine = match want {
            Some(e) if e >= slots => {
                return Err(ApiError::Unprocessable(format!(
                    "engine {e} is not a slot of pair `{name}`: its engine slots are 0..{slots} (inference.engines); connect with more (inference.spare) to add engines beyond them"
                )));
            }
            Some(e) => {
                let r = &p.engines[e as usize];
                if r.member != Membership::Absent {
                    return Err(ApiError::Conflict(format!(
                        "engine slot {e} of pair `{name}` already holds an engine ({}); remove it first, or add to a free slot",
                        r.status(e, false).state.as_str()
                    )));
                }
                e
            }
            None => match p
                .engines
                .iter()
                .position(|r| r.member == Membership::Absent)
            {
                Some(e) => e as u32,
                None => {
                    return Err(ApiError::Conflict(format!(
                        "every one of the {slots} engine slots of pair `{name}` holds an engine; remove one first, or connect with inference.spare to keep slots free for engines added at run time"
                    )));
                }
            },
        };
        // a removed engine's slots were emptied; anything left is from before that
        self.empty_engine_slots(&mut p, engine);
        p.engines[engine as usize] = EngineRecord::joining(unix_ms());
        p.changed(Op::State);
        tracing::info!(pair = %name, engine, "engine added: waiting for its ranks to join");
        Ok(self.engine_changed(&p, engine))
    }

    /// `DELETE /v1/pairs/{name}/engines/{engine}`: takes engine `engine` out of the pair. A
    /// version under way goes on without it; its ranks are told to stop and their slots are
    /// freed.
    pub(crate) fn remove_engine(&self, engine: u32) -> Result<EngineChanged, ApiError> {
        let name = &self.name;
        let mut p = self.lock();
        self.check_fleet_change(&p, "remove an engine")?;
        let slots = self.slots.engines;
        let Some(rec) = p.engines.get(engine as usize) else {
            return Err(ApiError::NotFound(format!(
                "engine {engine} is not a slot of pair `{name}`: its engine slots are 0..{slots}"
            )));
        };
        if rec.member == Membership::Absent {
            return Err(ApiError::Conflict(format!(
                "engine slot {engine} of pair `{name}` is free already: no engine to remove"
            )));
        }
        // the engines left must still be able to commit a version
        let left = p
            .engines
            .iter()
            .enumerate()
            .filter(|&(e, r)| e != engine as usize && r.member != Membership::Absent)
            .count() as u32;
        let need = match self.request.options.commit {
            CommitPolicy::Quorum(k) => k,
            _ => 1,
        };
        if left < need {
            return Err(ApiError::Conflict(format!(
                "removing engine {engine} would leave pair `{name}` {left} engine(s), and its commit policy `{}` needs {need} to commit a version; add an engine first, or disconnect the pair",
                self.request.options.commit
            )));
        }
        // a version under way goes on without it (the training ranks stop sending to it)
        let running = p
            .updates
            .latest()
            .is_some_and(|u| u.state == crate::wire::UpdateState::Running);
        if running {
            self.engine_failed(
                &mut p,
                engine,
                format!("engine {engine} was removed from the pair"),
            );
        }
        self.empty_engine_slots(&mut p, engine);
        p.engines[engine as usize] = EngineRecord::absent();
        p.changed(Op::State);
        self.publish(
            &mut p,
            EventKind::EngineRemoved,
            None,
            None,
            Some(format!("engine {engine} was removed from the pair")),
        );
        if let Some(ev) = p.events.events.back_mut() {
            ev.engines = vec![engine];
        }
        tracing::info!(pair = %name, engine, "engine removed");
        let answer = self.engine_changed(&p, engine);
        // a pair still joining may now have every rank it waits for
        let ready = p.state == PairState::Joining && self.members_joined(&p);
        if ready {
            p.state = PairState::Ready;
            p.changed(Op::State);
        }
        drop(p);
        if ready {
            self.roster_tx.send_replace(());
        }
        self.update_tx.send_replace(());
        Ok(answer)
    }

    /// Drops engine `engine`'s ranks from the roster and their rendezvous values: the slots are
    /// free for the next engine's processes.
    fn empty_engine_slots(&self, p: &mut Pair, engine: u32) {
        let range = self.engine_slots(engine);
        for i in range.clone() {
            if p.roster.remove(i) {
                p.changed(Op::Roster(i));
            }
        }
        let keys: Vec<String> =
            p.kv.values
                .keys()
                .filter(|k| rendezvous_slot(&self.slots, k).is_some_and(|i| range.contains(&i)))
                .cloned()
                .collect();
        for k in keys {
            p.kv.values.remove(&k);
            p.changed(Op::Kv(k));
        }
        p.roster.invalidate();
    }

    /// The answer of an add or remove.
    fn engine_changed(&self, p: &Pair, engine: u32) -> EngineChanged {
        let running = p.updates.latest().is_some_and(|u| !u.state.is_final());
        EngineChanged {
            pair: self.name.clone(),
            engine,
            ranks: self.slots.per_engine,
            status: p.engines[engine as usize].status(engine, running),
        }
    }

    /// Whether every rank the pair waits for joined: every training rank and every rank of
    /// the engines that are members (free slots, and added engines still joining, are not
    /// waited for).
    pub(crate) fn members_joined(&self, p: &Pair) -> bool {
        (0..self.slots.total()).all(|i| !self.waits_for(p, i) || p.roster.slots[i].is_some())
    }

    /// Whether the pair waits for slot `i` to join before it is ready.
    pub(crate) fn waits_for(&self, p: &Pair, i: usize) -> bool {
        match self.engine_of(i) {
            None => true,
            Some(e) => p.engines.get(e as usize).is_some_and(|r| r.takes_part()),
        }
    }

    /// Refuses a rank of a free engine slot: 409 saying how to add the engine.
    pub(crate) fn check_slot_taken(&self, p: &Pair, i: usize) -> Result<(), ApiError> {
        let Some(e) = self.engine_of(i) else {
            return Ok(());
        };
        if p.engines
            .get(e as usize)
            .is_some_and(|r| r.member == Membership::Absent)
        {
            return Err(ApiError::Conflict(format!(
                "engine slot {e} of pair `{}` is free: no engine of the pair runs in it (a spare slot, or its engine was removed); add the engine first (POST /v1/pairs/{}/engines, `awex-cli pair add-engine`), then start its ranks",
                self.name, self.name
            )));
        }
        Ok(())
    }
}
