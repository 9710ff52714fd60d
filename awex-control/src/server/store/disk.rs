//! The gateway's durable state: an embedded `redb` database under `--state-dir`, written through
//! on every mutation and read back at start.
//!
//! Handlers mutate a pair in memory under its lock and note what changed ([`Op`]); releasing the
//! lock turns the notes into rows ([`Write`]) and hands them to one writer thread, which commits
//! everything queued in one transaction (group commit: one fsync for many requests). A request
//! is answered only once the writes queued before its answer are durable (the router's
//! `durable` layer waits for them), so a rank never acts on state a crash could lose.
//!
//! Tables, each keyed by the pair name first: `pairs` (what connect fixed: the request, ids,
//! secret, sides, engine facts), `pair_state` (state, join error, committed / torn versions,
//! last event seq), `roster` (pair, slot), `kv` (pair, key), `updates` (pair, version: one
//! attempt's header), `reports` (pair, version, slot: one rank's report, so that a report writes
//! one small row), `events` (pair, seq), and `meta` (the next pair id). A report or a join
//! never rewrites the pair.

use awex_core::backend::EngineFacts;
use redb::{ReadableTable, TableDefinition};
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::sync::mpsc;
use tokio::sync::watch;

pub(crate) const PAIRS: TableDefinition<&str, &[u8]> = TableDefinition::new("pairs");
pub(crate) const PAIR_STATE: TableDefinition<&str, &[u8]> = TableDefinition::new("pair_state");
pub(crate) const ROSTER: TableDefinition<(&str, u64), &[u8]> = TableDefinition::new("roster");
pub(crate) const KV: TableDefinition<(&str, &str), &[u8]> = TableDefinition::new("kv");
pub(crate) const UPDATES: TableDefinition<(&str, u64), &[u8]> = TableDefinition::new("updates");
pub(crate) const REPORTS: TableDefinition<(&str, u64, u64), &[u8]> =
    TableDefinition::new("reports");
pub(crate) const EVENTS: TableDefinition<(&str, u64), &[u8]> = TableDefinition::new("events");
pub(crate) const META: TableDefinition<&str, u64> = TableDefinition::new("meta");

/// What a mutation of a pair changed, noted under the pair's lock; turned into rows when the
/// lock is released (reading the pair's state then).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Op {
    /// The pair's state record (state, join error, committed / torn, engine errors).
    State,
    /// One roster slot.
    Roster(usize),
    /// One rendezvous value.
    Kv(String),
    /// One update's header (deleted when the version left the history).
    Update(u64),
    /// Forget every report of a version (a new attempt, or its detail aged out).
    ClearReports(u64),
    /// One rank's report of a version.
    Report(u64, usize),
    /// One event (and the trimming of events older than the kept window).
    Event(u64),
}

/// One row change.
#[derive(Debug)]
pub(crate) enum Write {
    Pair(String, Vec<u8>),
    State(String, Vec<u8>),
    Roster(String, u64, Vec<u8>),
    Kv(String, String, Vec<u8>),
    Update(String, u64, Option<Vec<u8>>),
    ClearReports(String, u64),
    Report(String, u64, u64, Vec<u8>),
    Event(String, u64, Vec<u8>, u64),
    NextId(u64),
    DeletePair(String),
}

/// What connect fixed about a pair.
#[derive(Serialize, Deserialize)]
pub(crate) struct PairRecord {
    pub(crate) request: crate::wire::ConnectRequest,
    pub(crate) id: u64,
    pub(crate) uid: String,
    pub(crate) secret: String,
    pub(crate) slots: [u32; 3],
    pub(crate) created_unix_ms: u64,
    pub(crate) join_deadline_unix_ms: u64,
    pub(crate) training: crate::wire::SideStatus,
    pub(crate) inference: crate::wire::SideStatus,
    #[serde(default)]
    pub(crate) facts: Vec<EngineFacts>,
}

/// The mutable scalars of a pair.
#[derive(Serialize, Deserialize, Default)]
pub(crate) struct StateRecord {
    pub(crate) state: Option<crate::wire::PairState>,
    pub(crate) join_error: Option<String>,
    pub(crate) engine_errors: Vec<String>,
    pub(crate) committed: Option<u64>,
    pub(crate) torn: Option<u64>,
    pub(crate) serving_torn: Option<u64>,
    pub(crate) last_event_seq: u64,
    pub(crate) kv_revision: u64,
    pub(crate) disconnected_unix_ms: Option<u64>,
}

/// One roster slot.
#[derive(Serialize, Deserialize)]
pub(crate) struct RosterRecord {
    pub(crate) info: serde_json::Value,
    pub(crate) unix_ms: u64,
}

/// One rendezvous value (kept as its JSON text).
#[derive(Serialize, Deserialize)]
pub(crate) struct KvRecord {
    pub(crate) value: Box<serde_json::value::RawValue>,
    pub(crate) revision: u64,
}

/// One attempt's header (its reports are rows of their own).
#[derive(Serialize, Deserialize)]
pub(crate) struct UpdateRecord {
    pub(crate) attempt: u32,
    pub(crate) state: crate::wire::UpdateState,
    pub(crate) started_unix_ms: u64,
    pub(crate) deadline_ms: u64,
    pub(crate) pause_ms: Option<u64>,
    pub(crate) elapsed_ms: Option<u64>,
    pub(crate) error: Option<String>,
    pub(crate) engine_errors: Vec<String>,
    /// Whether this attempt reached the ranks (an `update` event went out).
    #[serde(default)]
    pub(crate) detail: bool,
    /// Atomic pairs: the `apply` event went out.
    #[serde(default)]
    pub(crate) applying: bool,
}

/// One rank's report.
#[derive(Serialize, Deserialize)]
pub(crate) struct ReportRecord {
    pub(crate) ok: Option<bool>,
    pub(crate) missing: bool,
    pub(crate) bytes: u64,
    pub(crate) checksum: Option<u64>,
    pub(crate) error: Option<String>,
    pub(crate) after_ms: Option<u64>,
    /// Atomic pairs, inference ranks: the second report (applied to the live tensors).
    #[serde(default)]
    pub(crate) applied: Option<bool>,
}

/// One stored update: its version, header, and the reports by slot.
pub(crate) type LoadedUpdate = (u64, UpdateRecord, Vec<(u64, ReportRecord)>);

/// A batch of row changes and its ticket, on its way to the writer thread.
type Batch = (u64, Vec<Write>);

/// Everything the database holds about one pair.
pub(crate) struct Loaded {
    pub(crate) pair: PairRecord,
    pub(crate) state: StateRecord,
    pub(crate) roster: Vec<(u64, RosterRecord)>,
    pub(crate) kv: Vec<(String, KvRecord)>,
    pub(crate) updates: Vec<LoadedUpdate>,
    pub(crate) events: Vec<crate::wire::Event>,
}

/// Why the state directory could not be used.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// Another gateway holds the database.
    #[error(
        "the state directory {0} is in use by another gateway (its database is locked); stop that gateway or give this one another --state-dir"
    )]
    InUse(PathBuf),
    /// The directory or the database could not be opened, read or written.
    #[error("gateway state in {path}: {message}")]
    Io {
        /// the directory
        path: PathBuf,
        /// the cause
        message: String,
    },
}

/// The database and its writer thread.
pub(crate) struct Store {
    dir: PathBuf,
    db: std::sync::Arc<redb::Database>,
    tx: Mutex<Option<mpsc::Sender<Batch>>>,
    writer: Mutex<Option<std::thread::JoinHandle<()>>>,
    /// Tickets handed out so far.
    submitted: std::sync::atomic::AtomicU64,
    /// (tickets committed, the last commit error).
    synced: watch::Receiver<(u64, Option<String>)>,
}

fn io(dir: &Path, e: impl std::fmt::Display) -> StoreError {
    StoreError::Io {
        path: dir.to_path_buf(),
        message: e.to_string(),
    }
}

impl Store {
    /// Opens (creating) the database `gateway.redb` in `dir` and starts the writer thread.
    pub(crate) fn open(dir: &Path) -> Result<Store, StoreError> {
        std::fs::create_dir_all(dir).map_err(|e| io(dir, format!("cannot create it: {e}")))?;
        let file = dir.join("gateway.redb");
        let db = match redb::Database::create(&file) {
            Ok(db) => db,
            Err(redb::DatabaseError::DatabaseAlreadyOpen) => {
                return Err(StoreError::InUse(dir.to_path_buf()));
            }
            Err(e) => return Err(io(dir, format!("cannot open {}: {e}", file.display()))),
        };
        let db = std::sync::Arc::new(db);
        {
            // every table exists from the start, so that readers never meet a missing one
            let w = db.begin_write().map_err(|e| io(dir, e))?;
            {
                w.open_table(PAIRS).map_err(|e| io(dir, e))?;
                w.open_table(PAIR_STATE).map_err(|e| io(dir, e))?;
                w.open_table(ROSTER).map_err(|e| io(dir, e))?;
                w.open_table(KV).map_err(|e| io(dir, e))?;
                w.open_table(UPDATES).map_err(|e| io(dir, e))?;
                w.open_table(REPORTS).map_err(|e| io(dir, e))?;
                w.open_table(EVENTS).map_err(|e| io(dir, e))?;
                w.open_table(META).map_err(|e| io(dir, e))?;
            }
            w.commit().map_err(|e| io(dir, e))?;
        }
        let (tx, rx) = mpsc::channel::<Batch>();
        let (synced_tx, synced) = watch::channel((0u64, None));
        let wdb = db.clone();
        let handle = std::thread::Builder::new()
            .name("awex-gateway-store".into())
            .spawn(move || writer(&wdb, &rx, &synced_tx))
            .map_err(|e| io(dir, format!("cannot start the writer thread: {e}")))?;
        Ok(Store {
            dir: dir.to_path_buf(),
            db,
            tx: Mutex::new(Some(tx)),
            writer: Mutex::new(Some(handle)),
            submitted: std::sync::atomic::AtomicU64::new(0),
            synced,
        })
    }

    /// The state directory.
    pub(crate) fn dir(&self) -> &Path {
        &self.dir
    }

    /// Queues row changes; returns their ticket.
    pub(crate) fn submit(&self, writes: Vec<Write>) -> u64 {
        let tx = self.tx.lock().unwrap_or_else(|e| e.into_inner());
        let ticket = self
            .submitted
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst)
            + 1;
        // the writer lives as long as the store
        if let Some(tx) = tx.as_ref() {
            let _ = tx.send((ticket, writes));
        }
        ticket
    }

    /// Waits until every change queued so far is durable; `Err` is the writer's last failure.
    pub(crate) async fn sync(&self) -> Result<(), String> {
        let want = self.submitted.load(std::sync::atomic::Ordering::SeqCst);
        let mut rx = self.synced.clone();
        loop {
            {
                let (done, err) = &*rx.borrow_and_update();
                if *done >= want {
                    return match err {
                        Some(e) => Err(e.clone()),
                        None => Ok(()),
                    };
                }
            }
            if rx.changed().await.is_err() {
                return Err("the gateway's state writer stopped".into());
            }
        }
    }

    /// Reads every pair and the next pair id.
    pub(crate) fn load(&self) -> Result<(Vec<Loaded>, u64), StoreError> {
        let dir = &self.dir;
        let r = self.db.begin_read().map_err(|e| io(dir, e))?;
        let e = |e: redb::Error| io(dir, e);
        let pairs = r.open_table(PAIRS).map_err(|x| e(x.into()))?;
        let states = r.open_table(PAIR_STATE).map_err(|x| e(x.into()))?;
        let roster = r.open_table(ROSTER).map_err(|x| e(x.into()))?;
        let kv = r.open_table(KV).map_err(|x| e(x.into()))?;
        let updates = r.open_table(UPDATES).map_err(|x| e(x.into()))?;
        let reports = r.open_table(REPORTS).map_err(|x| e(x.into()))?;
        let events = r.open_table(EVENTS).map_err(|x| e(x.into()))?;
        let meta = r.open_table(META).map_err(|x| e(x.into()))?;
        let next_id = meta
            .get("next_id")
            .map_err(|x| e(x.into()))?
            .map_or(1, |v| v.value());
        let bad = |what: &str, name: &str, x: serde_json::Error| {
            io(
                dir,
                format!("a damaged {what} record of pair `{name}`: {x}"),
            )
        };
        let mut out = Vec::new();
        for row in pairs.iter().map_err(|x| e(x.into()))? {
            let (k, v) = row.map_err(|x| e(x.into()))?;
            let name = k.value().to_string();
            let pair: PairRecord =
                serde_json::from_slice(v.value()).map_err(|x| bad("pair", &name, x))?;
            let state: StateRecord = match states.get(name.as_str()).map_err(|x| e(x.into()))? {
                Some(v) => serde_json::from_slice(v.value()).map_err(|x| bad("state", &name, x))?,
                None => StateRecord::default(),
            };
            let n = name.as_str();
            let mut ros = Vec::new();
            for row in roster
                .range((n, 0)..=(n, u64::MAX))
                .map_err(|x| e(x.into()))?
            {
                let (k, v) = row.map_err(|x| e(x.into()))?;
                let rec = serde_json::from_slice(v.value()).map_err(|x| bad("roster", n, x))?;
                ros.push((k.value().1, rec));
            }
            let mut kvs = Vec::new();
            for row in kv.range((n, "")..).map_err(|x| e(x.into()))? {
                let (k, v) = row.map_err(|x| e(x.into()))?;
                let (p, key) = k.value();
                if p != n {
                    break;
                }
                let rec = serde_json::from_slice(v.value()).map_err(|x| bad("kv", n, x))?;
                kvs.push((key.to_string(), rec));
            }
            let mut ups = Vec::new();
            for row in updates
                .range((n, 0)..=(n, u64::MAX))
                .map_err(|x| e(x.into()))?
            {
                let (k, v) = row.map_err(|x| e(x.into()))?;
                let version = k.value().1;
                let rec: UpdateRecord =
                    serde_json::from_slice(v.value()).map_err(|x| bad("update", n, x))?;
                let mut reps = Vec::new();
                for row in reports
                    .range((n, version, 0)..=(n, version, u64::MAX))
                    .map_err(|x| e(x.into()))?
                {
                    let (k, v) = row.map_err(|x| e(x.into()))?;
                    let rec = serde_json::from_slice(v.value()).map_err(|x| bad("report", n, x))?;
                    reps.push((k.value().2, rec));
                }
                ups.push((version, rec, reps));
            }
            let mut evs = Vec::new();
            for row in events
                .range((n, 0)..=(n, u64::MAX))
                .map_err(|x| e(x.into()))?
            {
                let (_, v) = row.map_err(|x| e(x.into()))?;
                evs.push(serde_json::from_slice(v.value()).map_err(|x| bad("event", n, x))?);
            }
            out.push(Loaded {
                pair,
                state,
                roster: ros,
                kv: kvs,
                updates: ups,
                events: evs,
            });
        }
        Ok((out, next_id))
    }
}

impl Drop for Store {
    /// Lets the writer commit what is queued and waits for it, so that the database is closed
    /// (and its lock released) when the store is gone.
    fn drop(&mut self) {
        self.tx.lock().unwrap_or_else(|e| e.into_inner()).take();
        let handle = self.writer.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(h) = handle {
            let _ = h.join();
        }
    }
}

/// The writer thread: commits every queued batch in one transaction, then says how far it got.
fn writer(
    db: &redb::Database,
    rx: &mpsc::Receiver<Batch>,
    synced: &watch::Sender<(u64, Option<String>)>,
) {
    while let Ok(first) = rx.recv() {
        let mut batch = vec![first];
        while let Ok(more) = rx.try_recv() {
            batch.push(more);
        }
        let last = batch.last().map_or(0, |b| b.0);
        let result = commit(db, batch.into_iter().flat_map(|(_, w)| w));
        let err = match result {
            Ok(()) => None,
            Err(e) => {
                tracing::error!(error = %e, "the gateway could not persist its state");
                Some(e.to_string())
            }
        };
        synced.send_replace((last, err));
    }
}

// redb's error is large, but it is made once per failed commit (a disk failure), not per row
#[allow(clippy::result_large_err)]
fn commit(db: &redb::Database, writes: impl Iterator<Item = Write>) -> Result<(), redb::Error> {
    let w = db.begin_write()?;
    {
        let mut pairs = w.open_table(PAIRS)?;
        let mut states = w.open_table(PAIR_STATE)?;
        let mut roster = w.open_table(ROSTER)?;
        let mut kv = w.open_table(KV)?;
        let mut updates = w.open_table(UPDATES)?;
        let mut reports = w.open_table(REPORTS)?;
        let mut events = w.open_table(EVENTS)?;
        let mut meta = w.open_table(META)?;
        for op in writes {
            match op {
                Write::Pair(n, b) => {
                    pairs.insert(n.as_str(), b.as_slice())?;
                }
                Write::State(n, b) => {
                    states.insert(n.as_str(), b.as_slice())?;
                }
                Write::Roster(n, s, b) => {
                    roster.insert((n.as_str(), s), b.as_slice())?;
                }
                Write::Kv(n, k, b) => {
                    kv.insert((n.as_str(), k.as_str()), b.as_slice())?;
                }
                Write::Update(n, v, Some(b)) => {
                    updates.insert((n.as_str(), v), b.as_slice())?;
                }
                Write::Update(n, v, None) => {
                    updates.remove((n.as_str(), v))?;
                    let n = n.as_str();
                    reports.retain_in((n, v, 0)..=(n, v, u64::MAX), |_, _| false)?;
                }
                Write::ClearReports(n, v) => {
                    let n = n.as_str();
                    reports.retain_in((n, v, 0)..=(n, v, u64::MAX), |_, _| false)?;
                }
                Write::Report(n, v, s, b) => {
                    reports.insert((n.as_str(), v, s), b.as_slice())?;
                }
                Write::Event(n, seq, b, keep_from) => {
                    let n = n.as_str();
                    events.insert((n, seq), b.as_slice())?;
                    if keep_from > 0 {
                        events.retain_in((n, 0)..(n, keep_from), |_, _| false)?;
                    }
                }
                Write::NextId(id) => {
                    meta.insert("next_id", id)?;
                }
                Write::DeletePair(n) => {
                    let n = n.as_str();
                    pairs.remove(n)?;
                    states.remove(n)?;
                    roster.retain_in((n, 0)..=(n, u64::MAX), |_, _| false)?;
                    kv.retain(|k, _| k.0 != n)?;
                    updates.retain_in((n, 0)..=(n, u64::MAX), |_, _| false)?;
                    reports.retain(|k, _| k.0 != n)?;
                    events.retain_in((n, 0)..=(n, u64::MAX), |_, _| false)?;
                }
            }
        }
    }
    w.commit()?;
    Ok(())
}
