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
//! a check value of the derived secret, sides, engine facts), `pair_state` (state, join error,
//! committed / torn versions, last event seq), `roster` (pair, slot), `kv` (pair, key),
//! `updates` (pair, version: one attempt's header), `reports` (pair, version, slot: one rank's
//! report, so that a report writes one small row), `events` (pair, seq), and `meta` (the next
//! pair id, the database's id and its commit number). A report or a join never rewrites the
//! pair.
//!
//! Faults: every commit is two-phase and its number is recorded in `gateway.commit`
//! ([`super::witness`]) before anyone is answered; at start a zero-length, truncated or damaged
//! file (every page's checksum is checked) and a database older than the record are refused
//! with a message naming the file. A failed commit keeps its rows queued; the writer reopens
//! the database and tries again every second, so the gateway recovers when the disk does. The
//! file is compacted once the last pair is gone.

use awex_core::backend::EngineFacts;
use redb::{ReadableTable, ReadableTableMetadata, TableDefinition};
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::sync::mpsc;
use tokio::sync::watch;

use super::witness::{self, Acked, Witness};

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
    DeleteRoster(String, u64),
    Kv(String, String, Vec<u8>),
    DeleteKv(String, String),
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
    /// The data-plane secret, as gateways before derived secrets stored it (empty since: the
    /// secret is derived from the gateway's key, see `server::secret`).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub(crate) secret: String,
    /// A check value of the derived secret (tells a restart whether its key changed).
    #[serde(default)]
    pub(crate) secret_check: String,
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
    /// Where each inference engine stands.
    #[serde(default)]
    pub(crate) engines: Vec<super::engines::EngineRecord>,
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
    /// Engines left out of the attempt (commit policies `quorum:K`, `available`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub(crate) left_out: Vec<crate::wire::EngineLeftOut>,
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
    /// Pairs with deltas on: the report's delta figures.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) delta: Option<crate::wire::ReportDelta>,
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
        "the state directory {0} is in use by another gateway (it holds the directory's lock); stop that gateway or give this one another --state-dir"
    )]
    InUse(PathBuf),
    /// Another user owns the directory or could read it: the state is refused as ssh refuses
    /// a key file others can read.
    #[error("refusing the gateway state directory {path}: {reason}")]
    Unsafe {
        /// the directory
        path: PathBuf,
        /// what is wrong and what would be right
        reason: String,
    },
    /// The database (or its acknowledged-commit record) is damaged: refused, never served.
    #[error("the gateway's database {file} cannot be used: {message}; {hint}")]
    Damaged {
        /// the damaged file
        file: PathBuf,
        /// what is wrong with it
        message: String,
        /// what to do
        hint: &'static str,
    },
    /// The database is older than the last commit the gateway acknowledged.
    #[error(
        "the gateway's database {file} cannot be used: {message}. Restore the newest backup; or, to run on this older state knowingly, remove {witness} and start again"
    )]
    RolledBack {
        /// the database
        file: PathBuf,
        /// what was found
        message: String,
        /// the acknowledged-commit record
        witness: PathBuf,
    },
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
    /// The state directory, opened and locked (`flock`, exclusive) for as long as the store
    /// lives: one gateway per directory. Released after the writer closed the database.
    _lock: std::fs::File,
    dir: PathBuf,
    /// The database, for [`Store::load`] at start (then handed to the writer alone, which
    /// must be its only holder to reopen it after a failure).
    db: Mutex<Option<std::sync::Arc<redb::Database>>>,
    tx: Mutex<Option<mpsc::Sender<Batch>>>,
    writer: Mutex<Option<std::thread::JoinHandle<()>>>,
    /// Tickets handed out so far.
    submitted: std::sync::atomic::AtomicU64,
    /// How far the writer got.
    synced: watch::Receiver<Synced>,
}

/// How far the writer got: every ticket up to `durable` is on disk; tickets up to `failed` were
/// tried and failed with `error` (they stay queued and are tried again).
#[derive(Clone, Debug, Default)]
pub(crate) struct Synced {
    pub(crate) durable: u64,
    pub(crate) failed: u64,
    pub(crate) error: Option<String>,
    /// When the writes began failing (Unix ms).
    pub(crate) failing_since_unix_ms: Option<u64>,
}

fn io(dir: &Path, e: impl std::fmt::Display) -> StoreError {
    StoreError::Io {
        path: dir.to_path_buf(),
        message: e.to_string(),
    }
}

/// The database file's name in the state directory.
pub(crate) const DB_FILE: &str = "gateway.redb";

/// What to do about a damaged database, for messages.
const DAMAGED_HINT: &str = "restore gateway.redb (and gateway.commit) from a backup taken while the gateway was stopped, or move the directory away to start with no pairs (every pair then connects again)";

thread_local! {
    /// Set while [`no_panic`] runs on this thread: a panic there is an answer, not a bug.
    static QUIET: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Installs (once) a panic hook that stays silent for panics [`no_panic`] catches on its own
/// thread and hands every other panic to the hook that was there before.
fn quiet_panics_in_no_panic() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            if !QUIET.with(std::cell::Cell::get) {
                previous(info);
            }
        }));
    });
}

/// Runs `f`, turning a panic inside the database library (it asserts on some damaged files)
/// into an error, without printing the panic and its backtrace (the error says it all).
fn no_panic<T>(f: impl FnOnce() -> Result<T, String>) -> Result<T, String> {
    quiet_panics_in_no_panic();
    let was = QUIET.with(|q| q.replace(true));
    let caught = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f));
    QUIET.with(|q| q.set(was));
    match caught {
        Ok(r) => r,
        Err(p) => {
            let what = p
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| p.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "an internal check failed".to_string());
            Err(format!(
                "the database library could not read it ({what}): it is truncated or damaged"
            ))
        }
    }
}

/// The database's builder: a bounded cache (the gateway's state is small; redb's default cache
/// would keep up to 1 GiB of pages alive).
fn builder() -> redb::Builder {
    let mut b = redb::Builder::new();
    b.set_cache_size(16 << 20);
    b
}

/// The ancestors of `dir` that every user may write and that are not sticky: another user
/// could rename or replace the state directory inside them (`/tmp` is sticky, so fine).
pub(crate) fn loose_parents(dir: &Path) -> Vec<PathBuf> {
    use std::os::unix::fs::MetadataExt;
    let abs = std::fs::canonicalize(dir).unwrap_or_else(|_| dir.to_path_buf());
    abs.ancestors()
        .skip(1)
        .filter(|p| {
            std::fs::metadata(p).is_ok_and(|m| m.mode() & 0o002 != 0 && m.mode() & 0o1000 == 0)
        })
        .map(Path::to_path_buf)
        .collect()
}

/// The temporary name a new database is built under.
const TMP_DB_FILE: &str = "gateway.redb.new";

/// Opens the state directory and takes its lock (`flock`, exclusive, not waiting); the lock
/// lasts as long as the returned file. Another gateway holding it is [`StoreError::InUse`].
fn lock_dir(dir: &Path) -> Result<std::fs::File, StoreError> {
    use std::os::fd::AsRawFd;
    // opened close-on-exec (as std opens every file): a child process never inherits the lock
    let f = std::fs::File::open(dir).map_err(|e| io(dir, format!("cannot open it: {e}")))?;
    // SAFETY: flock on a descriptor owned by `f`, alive for the call; no memory is passed.
    let r = unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
    if r != 0 {
        let e = std::io::Error::last_os_error();
        if e.raw_os_error() == Some(libc::EWOULDBLOCK) {
            return Err(StoreError::InUse(dir.to_path_buf()));
        }
        return Err(io(dir, format!("cannot lock it: {e}")));
    }
    Ok(f)
}

/// Creates a new database at `file` without ever leaving a partial one under that name: it
/// is built under a temporary name (mode 0600), synced, then renamed (under the directory's
/// lock, so no other gateway writes the same temporary file).
fn create_db(dir: &Path, file: &Path) -> Result<(), StoreError> {
    use std::os::unix::fs::OpenOptionsExt;
    let tmp = dir.join(TMP_DB_FILE);
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(&tmp)
        .map_err(|e| io(dir, format!("cannot create {}: {e}", tmp.display())))?;
    let db = builder()
        .create_file(f)
        .map_err(|e| io(dir, format!("cannot create {}: {e}", tmp.display())))?;
    drop(db);
    std::fs::File::open(&tmp)
        .and_then(|f| f.sync_all())
        .and_then(|()| std::fs::rename(&tmp, file))
        .and_then(|()| std::fs::File::open(dir))
        .and_then(|d| d.sync_all())
        .map_err(|e| io(dir, format!("cannot create {}: {e}", file.display())))
}

/// A database file shorter than its own header says it is (a truncated copy), as a message;
/// `None` when it is not, or when the header is not one this check reads (then the database
/// library's own checks speak). The header layout is redb 2's (`tree_store/page_store/
/// header.rs` and `layout.rs`): the magic number, then at byte 12 the page size, the pages of a
/// region's header, the data pages of a full region, the number of full regions and the data
/// pages of the trailing partial region (u32, little-endian); the file is one page of header,
/// then the regions. Checked first, because redb asserts (panics) on such a file.
fn truncated(file: &Path) -> Option<String> {
    use std::io::Read;
    const MAGIC: [u8; 9] = [b'r', b'e', b'd', b'b', 0x1A, 0x0A, 0xA9, 0x0D, 0x0A];
    let mut f = std::fs::File::open(file).ok()?;
    let len = f.metadata().ok()?.len();
    let mut h = [0u8; 32];
    f.read_exact(&mut h).ok()?;
    if h[..9] != MAGIC {
        return None;
    }
    let word = |at: usize| {
        let mut w = [0u8; 4];
        w.copy_from_slice(&h[at..at + 4]);
        u64::from(u32::from_le_bytes(w))
    };
    let (page, header_pages, region_pages, full, trailing) =
        (word(12), word(16), word(20), word(24), word(28));
    if !page.is_power_of_two() || !(512..=1 << 20).contains(&page) {
        return None;
    }
    let region = (header_pages + region_pages).checked_mul(page)?;
    let tail = if trailing > 0 {
        (header_pages + trailing).checked_mul(page)?
    } else {
        0
    };
    let want = full
        .checked_mul(region)?
        .checked_add(tail)?
        .checked_add(page)?;
    (len < want).then(|| format!("it is truncated: {len} bytes, where its header describes {want}"))
}

/// Opens the existing database `file`: a file redb cannot read, one whose newest commit fails
/// its checksums (never silently replaced by the commit before it: every commit is two-phase),
/// is refused naming the file.
fn open_db(dir: &Path, file: &Path) -> Result<redb::Database, StoreError> {
    let damaged = |message: String| StoreError::Damaged {
        file: file.to_path_buf(),
        message,
        hint: DAMAGED_HINT,
    };
    if let Some(message) = truncated(file) {
        return Err(damaged(message));
    }
    let opened = no_panic(|| match builder().create(file) {
        Ok(db) => Ok(Ok(db)),
        Err(redb::DatabaseError::DatabaseAlreadyOpen) => Ok(Err(())),
        Err(e) => Err(e.to_string()),
    })
    .map_err(damaged)?;
    let Ok(mut db) = opened else {
        return Err(StoreError::InUse(dir.to_path_buf()));
    };
    // every page's checksum, every time: a changed byte anywhere is found now, not served
    no_panic(|| db.check_integrity().map_err(|e| e.to_string())).map_err(damaged)?;
    Ok(db)
}

impl Store {
    /// Opens (creating) the database `gateway.redb` in `dir` and starts the writer thread.
    ///
    /// Refuses a directory another user owns or can read, a zero-length, truncated or damaged
    /// database, and one older than the last commit the gateway acknowledged (`gateway.commit`).
    pub(crate) fn open(dir: &Path) -> Result<Store, StoreError> {
        private_dir(dir)?;
        // the directory's lock before any file in it is created, read or removed: a second
        // gateway started at the same instant is refused here, and never writes a file the
        // first one uses
        let lock = lock_dir(dir)?;
        // a database whose creation never finished (the gateway died building it) never held
        // data: it is not damage, and it goes
        let tmp = dir.join(TMP_DB_FILE);
        match std::fs::remove_file(&tmp) {
            Ok(()) => {
                tracing::info!(file = %tmp.display(), "removed an unfinished new database (it never held data)")
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(io(dir, format!("cannot remove {}: {e}", tmp.display()))),
        }
        let file = dir.join(DB_FILE);
        match std::fs::metadata(&file) {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => create_db(dir, &file)?,
            Err(e) => return Err(io(dir, format!("cannot read {}: {e}", file.display()))),
            Ok(m) if !m.is_file() => {
                return Err(StoreError::Damaged {
                    file,
                    message: format!(
                        "it is not a regular file but {}; a gateway database always is",
                        awex_core::file::kind(&m)
                    ),
                    hint: DAMAGED_HINT,
                });
            }
            Ok(m) if m.len() == 0 => {
                return Err(StoreError::Damaged {
                    file,
                    message: "it is empty (0 bytes); a gateway database never is, so its content was lost".into(),
                    hint: DAMAGED_HINT,
                });
            }
            Ok(_) => {}
        }
        private_file(dir, &file)?;
        // the database first: its lock says no other gateway writes the record read next
        let db = open_db(dir, &file)?;
        let witness_file = dir.join(witness::FILE);
        match std::fs::metadata(&witness_file) {
            Ok(m) if !m.is_file() => {
                return Err(StoreError::Damaged {
                    file: witness_file,
                    message: format!(
                        "it is not a regular file but {}; the acknowledged-commit record always is",
                        awex_core::file::kind(&m)
                    ),
                    hint: DAMAGED_HINT,
                });
            }
            _ => {}
        }
        let empty_witness = std::fs::metadata(&witness_file).is_ok_and(|m| m.len() == 0);
        let acked = Witness::read(dir).map_err(|message| StoreError::Damaged {
            file: witness_file.clone(),
            message,
            hint: DAMAGED_HINT,
        })?;
        let (db_id, seq) = {
            // every table exists from the start, so that readers never meet a missing one
            let w = db.begin_write().map_err(|e| io(dir, e))?;
            let ids = {
                w.open_table(PAIRS).map_err(|e| io(dir, e))?;
                w.open_table(PAIR_STATE).map_err(|e| io(dir, e))?;
                w.open_table(ROSTER).map_err(|e| io(dir, e))?;
                w.open_table(KV).map_err(|e| io(dir, e))?;
                w.open_table(UPDATES).map_err(|e| io(dir, e))?;
                w.open_table(REPORTS).map_err(|e| io(dir, e))?;
                w.open_table(EVENTS).map_err(|e| io(dir, e))?;
                let mut meta = w.open_table(META).map_err(|e| io(dir, e))?;
                let get = |k: &str| -> Result<Option<u64>, StoreError> {
                    Ok(meta.get(k).map_err(|e| io(dir, e))?.map(|v| v.value()))
                };
                let (id, seq) = (get(META_DB_ID)?, get(META_SEQ)?.unwrap_or(0));
                let id = match id {
                    Some(id) => id,
                    None => {
                        let id = random_u64().map_err(|e| io(dir, e))?;
                        meta.insert(META_DB_ID, id).map_err(|e| io(dir, e))?;
                        id
                    }
                };
                (id, seq)
            };
            if empty_witness && ids.1 > 0 {
                // created empty and never written: only a gateway that never acknowledged a
                // commit leaves it so; this database holds commits, so the record was lost
                return Err(StoreError::Damaged {
                    file: witness_file,
                    message: format!(
                        "it is empty (0 bytes), but the database holds commit {}: the record of the last commit the gateway acknowledged was lost, so a database that went back in time could not be told. If gateway.redb is intact, remove {} and start again (the check is then skipped once)",
                        ids.1,
                        dir.join(witness::FILE).display()
                    ),
                    hint: DAMAGED_HINT,
                });
            }
            check_acked(dir, &file, acked, ids.0, ids.1)?;
            w.commit().map_err(|e| io(dir, e))?;
            ids
        };
        let witness = Witness::open(dir).map_err(|e| {
            io(
                dir,
                format!("cannot open {}: {e}", dir.join(witness::FILE).display()),
            )
        })?;
        private_file(dir, witness.path())?;
        // the record holds what this start found, so that it is never left empty by a
        // gateway that serves
        witness.record(Acked { db_id, seq }).map_err(|e| {
            io(
                dir,
                format!("cannot write {}: {e}", witness.path().display()),
            )
        })?;
        let db = std::sync::Arc::new(db);
        let (tx, rx) = mpsc::channel::<Batch>();
        let (synced_tx, synced) = watch::channel(Synced::default());
        let mut w = Writer {
            file,
            db: Some(db.clone()),
            witness,
            db_id,
            seq,
            pending: Vec::new(),
            pending_rows: 0,
            last_ticket: 0,
            synced: synced_tx,
            lost: 0,
        };
        let handle = std::thread::Builder::new()
            .name("awex-gateway-store".into())
            .spawn(move || w.run(&rx))
            .map_err(|e| io(dir, format!("cannot start the writer thread: {e}")))?;
        Ok(Store {
            _lock: lock,
            dir: dir.to_path_buf(),
            db: Mutex::new(Some(db)),
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

    /// Waits until every change queued so far is durable; `Err` is the writer's failure while
    /// some of them are not (they stay queued: once the disk takes writes again, they land).
    pub(crate) async fn sync(&self) -> Result<(), String> {
        let want = self.submitted.load(std::sync::atomic::Ordering::SeqCst);
        let mut rx = self.synced.clone();
        loop {
            {
                let s = &*rx.borrow_and_update();
                if s.durable >= want {
                    return Ok(());
                }
                if s.failed >= want {
                    return Err(s.error.clone().unwrap_or_default());
                }
            }
            if rx.changed().await.is_err() {
                return Err("the gateway's state writer stopped".into());
            }
        }
    }

    /// How the writes go: `None` when the last one succeeded, else the failure.
    pub(crate) fn failing(&self) -> Option<Synced> {
        let s = self.synced.borrow();
        s.error.is_some().then(|| s.clone())
    }

    /// Reads every pair and the next pair id.
    pub(crate) fn load(&self) -> Result<(Vec<Loaded>, u64), StoreError> {
        let dir = &self.dir;
        // read once, at start; the writer is then the database's only holder
        let db = self
            .db
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
            .ok_or_else(|| io(dir, "the state was already loaded"))?;
        let r = db.begin_read().map_err(|e| io(dir, e))?;
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

/// Meta keys: the database's random id (tells it from another file), and the sequence number of
/// its last commit (compared with `gateway.commit`).
const META_DB_ID: &str = "db_id";
const META_SEQ: &str = "commit_seq";

fn random_u64() -> std::io::Result<u64> {
    use std::io::Read;
    let mut b = [0u8; 8];
    std::fs::File::open("/dev/urandom")?.read_exact(&mut b)?;
    Ok(u64::from_le_bytes(b))
}

/// Refuses a database older than the last commit the gateway acknowledged, or another database
/// than the one acknowledged.
fn check_acked(
    dir: &Path,
    file: &Path,
    acked: Option<Acked>,
    db_id: u64,
    seq: u64,
) -> Result<(), StoreError> {
    let Some(a) = acked else {
        if seq > 0 {
            tracing::warn!(
                dir = %dir.display(),
                "no {} beside {}: cannot check that the database holds the last acknowledged commit; it is written from now on",
                witness::FILE,
                file.display()
            );
        }
        return Ok(());
    };
    let went_back = |message: String| StoreError::RolledBack {
        file: file.to_path_buf(),
        message,
        witness: dir.join(witness::FILE),
    };
    if a.db_id != db_id {
        return Err(went_back(format!(
            "it is another database than the one the gateway last wrote (id {db_id:016x}, expected {:016x}): it was replaced",
            a.db_id
        )));
    }
    if seq < a.seq {
        return Err(went_back(format!(
            "it holds commit {seq}, but the gateway acknowledged commit {}: the database went back in time (a restored backup, a repair, or a disk that lost writes), so acknowledged state such as committed versions may be missing",
            a.seq
        )));
    }
    Ok(())
}

impl Drop for Store {
    /// Lets the writer commit what is queued and waits for it, so that the database is closed
    /// (and its lock released) when the store is gone.
    fn drop(&mut self) {
        self.db.lock().unwrap_or_else(|e| e.into_inner()).take();
        self.tx.lock().unwrap_or_else(|e| e.into_inner()).take();
        let handle = self.writer.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(h) = handle {
            let _ = h.join();
        }
    }
}

/// Creates `dir` (mode 0700, parents too) when absent, and refuses one that another user owns
/// or that others can read, write or enter: it holds the pairs' rosters and rendezvous values
/// (and, without a token, the key of every pair secret).
pub(crate) fn private_dir(dir: &Path) -> Result<(), StoreError> {
    use std::os::unix::fs::{DirBuilderExt, MetadataExt};
    if !dir.exists() {
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)
            .map_err(|e| io(dir, format!("cannot create it: {e}")))?;
    }
    let unsafe_dir = |reason: String| StoreError::Unsafe {
        path: dir.to_path_buf(),
        reason,
    };
    let meta = std::fs::metadata(dir).map_err(|e| io(dir, format!("cannot read it: {e}")))?;
    if !meta.is_dir() {
        return Err(unsafe_dir(
            "it is not a directory; give --state-dir a directory".into(),
        ));
    }
    // SAFETY: geteuid has no preconditions and cannot fail.
    let me = unsafe { libc::geteuid() };
    if meta.uid() != me {
        return Err(unsafe_dir(format!(
            "it is owned by uid {}, and this gateway runs as uid {me}: that user could read or replace the gateway's state; give --state-dir a directory owned by uid {me} (mode 0700)",
            meta.uid()
        )));
    }
    for p in loose_parents(dir) {
        tracing::warn!(
            dir = %dir.display(),
            parent = %p.display(),
            "a parent of the gateway's state directory is writable by every user and not sticky: another user could rename or replace the state directory; make it writable by its owner only (or sticky, as /tmp is)"
        );
    }
    let mode = meta.mode() & 0o777;
    if mode & 0o077 != 0 {
        return Err(unsafe_dir(format!(
            "its mode is {mode:04o}: other users can read or enter it; run `chmod 700 {}` (the gateway creates its directory 0700), or give another --state-dir",
            dir.display()
        )));
    }
    Ok(())
}

/// Makes `file` private (mode 0600) if it exists: the directory already keeps others out, this
/// keeps a copied or moved file private too.
fn private_file(dir: &Path, file: &Path) -> Result<(), StoreError> {
    use std::os::unix::fs::PermissionsExt;
    match std::fs::metadata(file) {
        Ok(m) if m.permissions().mode() & 0o077 != 0 => {
            std::fs::set_permissions(file, std::fs::Permissions::from_mode(0o600))
                .map_err(|e| io(dir, format!("cannot chmod 600 {}: {e}", file.display())))
        }
        _ => Ok(()),
    }
}

/// Most row changes kept queued while the disk refuses writes (mutating requests are refused
/// meanwhile, so only timers add to them); beyond it, further changes are dropped and counted.
const MAX_PENDING_ROWS: usize = 1 << 20;

/// The writer thread's state: the database (reopened after a failure), the acknowledged-commit
/// record, and the changes not yet durable.
struct Writer {
    file: PathBuf,
    db: Option<std::sync::Arc<redb::Database>>,
    witness: Witness,
    db_id: u64,
    seq: u64,
    pending: Vec<Write>,
    pending_rows: usize,
    last_ticket: u64,
    synced: watch::Sender<Synced>,
    /// Changes dropped because too many were queued while failing.
    lost: u64,
}

impl Writer {
    /// Commits every queued batch in one transaction, then says how far it got; after a failure
    /// keeps the batches and tries again every second (reopening the database), so that the
    /// gateway recovers once the disk takes writes again.
    fn run(&mut self, rx: &mpsc::Receiver<Batch>) {
        loop {
            let first = if self.pending.is_empty() {
                match rx.recv() {
                    Ok(b) => Some(b),
                    Err(_) => return,
                }
            } else {
                match rx.recv_timeout(std::time::Duration::from_secs(1)) {
                    Ok(b) => Some(b),
                    Err(mpsc::RecvTimeoutError::Timeout) => None,
                    // shutting down: one last try for what is queued
                    Err(mpsc::RecvTimeoutError::Disconnected) => {
                        let _ = self.flush();
                        return;
                    }
                }
            };
            if let Some(b) = first {
                self.queue(b);
            }
            while let Ok(more) = rx.try_recv() {
                self.queue(more);
            }
            let _ = self.flush();
        }
    }

    fn queue(&mut self, (ticket, writes): Batch) {
        self.last_ticket = ticket;
        if self.pending_rows + writes.len() > MAX_PENDING_ROWS {
            self.lost += writes.len() as u64;
            return;
        }
        self.pending_rows += writes.len();
        self.pending.extend(writes);
    }

    /// Tries to make everything queued durable.
    fn flush(&mut self) -> Result<(), ()> {
        let result = self.try_commit();
        let mut s = self.synced.borrow().clone();
        match result {
            Ok(()) if self.lost == 0 => {
                if s.error.is_some() {
                    tracing::warn!(file = %self.file.display(), "the gateway's state is written again");
                }
                s = Synced {
                    durable: self.last_ticket,
                    failed: s.failed,
                    error: None,
                    failing_since_unix_ms: None,
                };
                self.synced.send_replace(s);
                Ok(())
            }
            Ok(()) => {
                s.failed = self.last_ticket;
                s.error = Some(format!(
                    "{} changes were dropped while writes failed; the state on disk misses them: restart the gateway",
                    self.lost
                ));
                s.failing_since_unix_ms.get_or_insert_with(super::unix_ms);
                self.synced.send_replace(s);
                Err(())
            }
            Err(e) => {
                // a database that met an I/O error refuses every later write: reopen it next time
                self.db = None;
                if s.error.is_none() {
                    tracing::error!(error = %e, file = %self.file.display(), "the gateway could not persist its state; retrying every second");
                }
                s.failed = self.last_ticket;
                s.error = Some(e);
                s.failing_since_unix_ms.get_or_insert_with(super::unix_ms);
                self.synced.send_replace(s);
                Err(())
            }
        }
    }

    fn try_commit(&mut self) -> Result<(), String> {
        if self.pending.is_empty() {
            return Ok(());
        }
        let db = match &self.db {
            Some(db) => db.clone(),
            None => {
                let db = no_panic(|| builder().create(&self.file).map_err(|e| e.to_string()))?;
                let db = std::sync::Arc::new(db);
                self.db = Some(db.clone());
                db
            }
        };
        let seq = self.seq + 1;
        let deleted = self
            .pending
            .iter()
            .any(|w| matches!(w, Write::DeletePair(_)));
        commit(&db, self.pending.iter(), seq).map_err(|e| e.to_string())?;
        drop(db);
        self.seq = seq;
        self.pending.clear();
        self.pending.shrink_to(1024);
        self.pending_rows = 0;
        self.witness
            .record(Acked {
                db_id: self.db_id,
                seq,
            })
            .map_err(|e| format!("cannot write {}: {e}", self.witness.path().display()))?;
        if deleted {
            self.compact_if_empty();
        }
        Ok(())
    }

    /// Once the last pair is gone, gives the file's free pages back (redb keeps the file at its
    /// high-water mark otherwise). Best effort: a failure is logged and changes nothing.
    fn compact_if_empty(&mut self) {
        let Some(db) = self.db.as_mut().and_then(std::sync::Arc::get_mut) else {
            return;
        };
        let empty = db
            .begin_read()
            .ok()
            .and_then(|r| r.open_table(PAIRS).ok()?.len().ok())
            == Some(0);
        if !empty {
            return;
        }
        if let Err(e) = db.compact() {
            tracing::warn!(error = %e, file = %self.file.display(), "compacting the gateway's database failed");
        }
    }
}

// redb's error is large, but it is made once per failed commit (a disk failure), not per row
#[allow(clippy::result_large_err)]
fn commit<'a>(
    db: &redb::Database,
    writes: impl Iterator<Item = &'a Write>,
    seq: u64,
) -> Result<(), redb::Error> {
    let mut w = db.begin_write()?;
    // the new commit is published only once its pages are on disk: a damaged newest commit is
    // found at start instead of silently replaced by the one before
    w.set_two_phase_commit(true);
    {
        let mut pairs = w.open_table(PAIRS)?;
        let mut states = w.open_table(PAIR_STATE)?;
        let mut roster = w.open_table(ROSTER)?;
        let mut kv = w.open_table(KV)?;
        let mut updates = w.open_table(UPDATES)?;
        let mut reports = w.open_table(REPORTS)?;
        let mut events = w.open_table(EVENTS)?;
        let mut meta = w.open_table(META)?;
        meta.insert(META_SEQ, seq)?;
        for op in writes {
            match op {
                Write::Pair(n, b) => {
                    pairs.insert(n.as_str(), b.as_slice())?;
                }
                Write::State(n, b) => {
                    states.insert(n.as_str(), b.as_slice())?;
                }
                Write::Roster(n, s, b) => {
                    roster.insert((n.as_str(), *s), b.as_slice())?;
                }
                Write::Kv(n, k, b) => {
                    kv.insert((n.as_str(), k.as_str()), b.as_slice())?;
                }
                Write::DeleteRoster(n, s) => {
                    roster.remove((n.as_str(), *s))?;
                }
                Write::DeleteKv(n, k) => {
                    kv.remove((n.as_str(), k.as_str()))?;
                }
                Write::Update(n, v, Some(b)) => {
                    updates.insert((n.as_str(), *v), b.as_slice())?;
                }
                Write::Update(n, v, None) => {
                    let (n, v) = (n.as_str(), *v);
                    updates.remove((n, v))?;
                    reports.retain_in((n, v, 0)..=(n, v, u64::MAX), |_, _| false)?;
                }
                Write::ClearReports(n, v) => {
                    let (n, v) = (n.as_str(), *v);
                    reports.retain_in((n, v, 0)..=(n, v, u64::MAX), |_, _| false)?;
                }
                Write::Report(n, v, s, b) => {
                    reports.insert((n.as_str(), *v, *s), b.as_slice())?;
                }
                Write::Event(n, seq, b, keep_from) => {
                    let n = n.as_str();
                    events.insert((n, *seq), b.as_slice())?;
                    if *keep_from > 0 {
                        events.retain_in((n, 0)..(n, *keep_from), |_, _| false)?;
                    }
                }
                Write::NextId(id) => {
                    meta.insert("next_id", *id)?;
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn a_parent_every_user_may_write_is_loose_unless_it_is_sticky() {
        let root = tempfile::tempdir().unwrap();
        let open = root.path().join("open");
        std::fs::create_dir(&open).unwrap();
        let state = open.join("state");
        std::fs::create_dir(&state).unwrap();
        std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o777)).unwrap();
        let canon = std::fs::canonicalize(&open).unwrap();
        assert!(loose_parents(&state).contains(&canon));
        std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o1777)).unwrap();
        assert!(!loose_parents(&state).contains(&canon));
        std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o755)).unwrap();
        assert!(!loose_parents(&state).contains(&canon));
    }
}
