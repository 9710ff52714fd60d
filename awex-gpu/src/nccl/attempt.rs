//! A pair's communicator across attempts: the one built at join, then a fresh one for every
//! retry, without the pair reconnecting.
//!
//! An aborted NCCL communicator cannot be used again, and NCCL communicators are collective: when
//! one rank aborts, every rank of the pair must build a new one from a new unique id. So the
//! first attempt of every version uses the communicator of the id published at join
//! ([`UID_KEY`]), and a retry (attempt > 1 of a version) always starts a fresh communicator:
//! training rank 0 creates a new id and publishes it under [`attempt_uid_key`]
//! (`nccl.uid.<version>.<attempt>`) before it executes the retry; every other rank reads that key
//! (waiting for it) before its first group of the retry. The key names the version and the
//! attempt, so every rank picks the same id whatever it saw of the failed attempt, and ids of
//! different retries never mix. The old communicator is aborted (its peers may be gone or
//! half-way through the failed attempt), the new one initialised on first use.

use super::library::Library;
use super::uid::{UID_KEY, UniqueId, creates_uid};
use super::{Communicator, NcclError};
use awex_core::layout::{RankId, Side};
use std::sync::Arc;
use std::time::Duration;

/// The kv key of the unique id that attempt `attempt` of `version` builds its communicator
/// from: [`UID_KEY`] (published at join) for first attempts, `nccl.uid.<version>.<attempt>` for
/// retries.
pub fn attempt_uid_key(version: u64, attempt: u32) -> String {
    if attempt <= 1 {
        UID_KEY.to_string()
    } else {
        format!("{UID_KEY}.{version}.{attempt}")
    }
}

/// Whether attempt `attempt` needs a fresh communicator (every retry does).
pub fn needs_fresh_comm(attempt: u32) -> bool {
    attempt > 1
}

/// One rank's communicator of a pair, renewed per retry.
pub struct AttemptComm {
    lib: Arc<Library>,
    nranks: u32,
    rank: u32,
    /// The id the next communicator is built from, and the kv key it came from.
    uid: Option<(String, UniqueId)>,
    /// The live communicator, and the key of the id it was built from.
    comm: Option<(String, Communicator)>,
    /// Why the communicator of the current id failed (it is not rebuilt from the same id).
    failed: Option<String>,
    /// Communicators built so far (for reports and tests).
    built: u32,
}

impl std::fmt::Debug for AttemptComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "AttemptComm(rank {} of {}, id {:?}, built {})",
            self.rank,
            self.nranks,
            self.uid.as_ref().map(|(k, _)| k.as_str()),
            self.built
        )
    }
}

impl AttemptComm {
    /// Rank `rank` of a communicator of `nranks` ranks; no id yet.
    pub fn new(lib: Arc<Library>, nranks: u32, rank: u32) -> AttemptComm {
        AttemptComm {
            lib,
            nranks,
            rank,
            uid: None,
            comm: None,
            failed: None,
            built: 0,
        }
    }

    /// The library.
    pub fn library(&self) -> &Arc<Library> {
        &self.lib
    }

    /// The current id and the key it was published under, once known.
    pub fn uid(&self) -> Option<(&str, UniqueId)> {
        self.uid.as_ref().map(|(k, u)| (k.as_str(), *u))
    }

    /// How many communicators this rank has initialised.
    pub fn built(&self) -> u32 {
        self.built
    }

    /// Whether a communicator is live now.
    pub fn is_live(&self) -> bool {
        self.comm.is_some()
    }

    /// Why the current id's communicator failed, if it did.
    pub fn failed(&self) -> Option<&str> {
        self.failed.as_deref()
    }

    /// Sets the id published under `key`. A key other than the current one retires the
    /// current communicator (aborted: its peers may be gone or half-way through a failed
    /// attempt) and clears the failure, so that the next [`AttemptComm::get`] builds a fresh
    /// communicator from `uid`; the same key again changes nothing.
    pub fn set_uid(&mut self, key: &str, uid: UniqueId) {
        if self.uid.as_ref().is_some_and(|(k, _)| k == key) {
            return;
        }
        if let Some((_, mut c)) = self.comm.take() {
            c.abort(&format!("a fresh communicator replaces it (id `{key}`)"));
        }
        self.failed = None;
        self.uid = Some((key.to_string(), uid));
    }

    /// For a rank that creates ids (training rank 0): the id and kv entry that attempt
    /// `attempt` of `version` publishes before it executes, a fresh id for every retry and none
    /// for first attempts (their id was published at join). Other ranks get `None`.
    pub fn publish_for_attempt(
        &mut self,
        side: Side,
        rank: RankId,
        version: u64,
        attempt: u32,
    ) -> Result<Option<(String, serde_json::Value)>, NcclError> {
        if !needs_fresh_comm(attempt) || !creates_uid(side, rank) {
            return Ok(None);
        }
        let key = attempt_uid_key(version, attempt);
        if let Some((k, u)) = &self.uid
            && *k == key
        {
            return Ok(Some((key, u.to_kv())));
        }
        let uid = self.lib.unique_id()?;
        self.set_uid(&key, uid);
        Ok(Some((key, uid.to_kv())))
    }

    /// The key a rank that does not create ids reads before attempt `attempt` of `version`
    /// (retries only).
    pub fn read_for_attempt(
        side: Side,
        rank: RankId,
        version: u64,
        attempt: u32,
    ) -> Option<String> {
        (needs_fresh_comm(attempt) && !creates_uid(side, rank))
            .then(|| attempt_uid_key(version, attempt))
    }

    /// The live communicator, initialised from the current id on first use (waiting at most
    /// `timeout` for every rank). After a failure of the current id's communicator, says so
    /// until a new id arrives: the other ranks have moved on from that id.
    pub fn get(&mut self, timeout: Duration) -> Result<&mut Communicator, NcclError> {
        if let Some(why) = &self.failed {
            return Err(NcclError::Aborted(why.clone()));
        }
        if self.comm.is_none() {
            let Some((key, uid)) = self.uid.clone() else {
                return Err(NcclError::Usage(format!(
                    "the NCCL unique id of this pair is not known yet: training rank 0 publishes it, sealed with the pair secret, under kv `{UID_KEY}` once it joined (`nccl.uid.<version>.<attempt>` before a retry), and every other rank reads it"
                )));
            };
            match Communicator::init(self.lib.clone(), &uid, self.nranks, self.rank, timeout) {
                Ok(c) => {
                    self.built += 1;
                    self.comm = Some((key, c));
                }
                Err(e) => {
                    // the other ranks may have half-joined this id: it cannot be used again
                    self.failed = Some(e.to_string());
                    return Err(e);
                }
            }
        }
        Ok(&mut self.comm.as_mut().expect("just built").1)
    }

    /// The live communicator, if any (not built on demand).
    pub fn live(&mut self) -> Option<&mut Communicator> {
        self.comm.as_mut().map(|(_, c)| c)
    }

    /// After an error: aborts the live communicator (peers blocked on this rank are released)
    /// and remembers why, until a new id arrives. Without a live communicator (an error before
    /// init) nothing is marked: the same id may still be used.
    pub fn fail(&mut self, why: &str) {
        if let Some((_, mut c)) = self.comm.take() {
            c.abort(why);
            if self.failed.is_none() {
                self.failed = Some(why.to_string());
            }
        }
    }

    /// Tears the live communicator down (flush for at most `timeout`, then destroy; abort when
    /// the flush fails).
    pub fn close(&mut self, timeout: Duration) -> Result<(), NcclError> {
        match self.comm.take() {
            Some((_, c)) => c.destroy(timeout),
            None => Ok(()),
        }
    }
}
