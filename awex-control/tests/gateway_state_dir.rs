//! The state directory under attack and fault: another user can read nothing of it (and a
//! directory another user owns or can read is refused), no pair's data-plane secret is stored
//! in it, and a damaged, truncated, empty or rolled-back database is refused at start with a
//! message naming the file, never served and never a panic.

mod gateway_common;

use awex_control::client::{Client, JoinOutcome};
use awex_control::server::{GatewayConfig, ServeError, bind, open_router, serve};
use awex_control::wire::{JoinRequest, Report, UpdateState};
use awex_core::{RankId, Side};
use gateway_common::connect_request;
use serde_json::json;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::time::Duration;

/// A gateway on its own runtime, dropped to stop it.
struct Gw {
    rt: Option<tokio::runtime::Runtime>,
    port: u16,
}

impl Gw {
    fn start(dir: &Path, token: Option<&str>) -> Gw {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        private(dir);
        let config = GatewayConfig {
            state_dir: Some(dir.to_path_buf()),
            token: token.map(str::to_string),
            ..GatewayConfig::default()
        };
        let l = rt.block_on(async { bind("127.0.0.1:0".parse().unwrap()).unwrap() });
        let port = l.local_addr().unwrap().port();
        rt.spawn(async move {
            if let Err(e) = serve(l, config).await {
                panic!("gateway failed: {e}");
            }
        });
        Gw { rt: Some(rt), port }
    }

    fn client(&self, token: Option<&str>) -> Client {
        Client::new(
            &format!("http://127.0.0.1:{}", self.port),
            token.map(str::to_string),
        )
        .unwrap()
        .with_retries(0)
    }

    fn stop(mut self) {
        if let Some(rt) = self.rt.take() {
            rt.shutdown_timeout(Duration::from_secs(5));
        }
    }
}

/// Makes an existing `dir` private (tempdir makes it 0755 under the usual umask).
fn private(dir: &Path) {
    if dir.exists() {
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700)).unwrap();
    }
}

/// Opens the state in `dir` as `serve` would (on a runtime of its own), returning the error.
fn open(dir: &Path) -> Result<(), ServeError> {
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        open_router(GatewayConfig {
            state_dir: Some(dir.to_path_buf()),
            ..GatewayConfig::default()
        })
        .map(drop)
    })
}

const T: (Side, RankId) = (Side::Training, RankId { engine: 0, rank: 0 });
const I: (Side, RankId) = (Side::Inference, RankId { engine: 0, rank: 0 });

fn jr(side: Side, rank: RankId) -> JoinRequest {
    JoinRequest {
        side,
        rank,
        info: json!({ "pid": 42 }),
        capabilities: vec![],
    }
}

/// Connects `name` (1 + 1 ranks), joins both, commits `versions`; returns the join answer's
/// secret.
async fn pair_with_commits(
    c: &Client,
    name: &str,
    versions: std::ops::RangeInclusive<u64>,
) -> String {
    c.connect(&connect_request(name, 1, 1, 1)).await.unwrap();
    assert!(matches!(
        c.join_once(name, &jr(T.0, T.1), Duration::ZERO)
            .await
            .unwrap(),
        JoinOutcome::Pending(_)
    ));
    let joined = c.join(name, &jr(I.0, I.1)).await.unwrap();
    for v in versions {
        c.start_update(name, v).await.unwrap();
        for (side, rank) in [T, I] {
            let r = Report {
                side,
                rank,
                ok: true,
                bytes: 10,
                checksum: Some(7),
                error: None,
                attempt: Some(1),
                incarnation: None,
                delta: None,
                unreached: Vec::new(),
            };
            c.report(name, v, &r).await.unwrap();
        }
        let st = c
            .wait_update(name, v, Duration::from_secs(30))
            .await
            .unwrap();
        assert_eq!(st.state, UpdateState::Committed);
    }
    joined.secret.map(|s| s.0).unwrap_or_default()
}

fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() == 0 }
}

/// Runs `cmd` as uid/gid 65534 (nobody); `None` when setpriv is not there.
fn as_nobody(cmd: &[&str]) -> Option<std::process::Output> {
    std::process::Command::new("setpriv")
        .args(["--reuid=65534", "--regid=65534", "--clear-groups", "--"])
        .args(cmd)
        .output()
        .ok()
}

#[test]
fn another_uid_can_read_nothing_of_the_state_and_no_pair_secret_is_stored() {
    // a world-readable parent, as /var/lib or a home directory would be
    let parent = tempfile::tempdir().unwrap();
    std::fs::set_permissions(parent.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let dir = parent.path().join("state");
    let gw = Gw::start(&dir, Some("tok"));
    let c = gw.client(Some("tok"));
    let rt = tokio::runtime::Runtime::new().unwrap();
    let secret = rt.block_on(pair_with_commits(&c, "sec", 1..=1));
    assert_eq!(secret.len(), 64, "the join answer carries the secret");
    gw.stop();
    let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode(&dir), 0o700, "the state directory");
    for entry in std::fs::read_dir(&dir).unwrap() {
        let p = entry.unwrap().path();
        assert_eq!(mode(&p), 0o600, "{}", p.display());
    }
    // the secret (nor its bytes in any case) is nowhere in the state directory
    for entry in std::fs::read_dir(&dir).unwrap() {
        let p = entry.unwrap().path();
        let bytes = std::fs::read(&p).unwrap();
        let text = String::from_utf8_lossy(&bytes).to_lowercase();
        assert!(
            !text.contains(&secret),
            "{} holds the pair secret",
            p.display()
        );
    }
    // the key file alone does not give the secret: it is combined with the token
    assert!(dir.join("pair-secret.key").exists());
    if !is_root() {
        eprintln!("skipped the second-uid check: it needs root to switch to uid 65534");
        return;
    }
    let db = dir.join("gateway.redb");
    let Some(out) = as_nobody(&["cat", db.to_str().unwrap()]) else {
        eprintln!("skipped the second-uid check: setpriv is not installed");
        return;
    };
    assert!(
        !out.status.success() && out.stdout.is_empty(),
        "uid 65534 read {} bytes of {}",
        out.stdout.len(),
        db.display()
    );
    let out = as_nobody(&["ls", dir.to_str().unwrap()]).unwrap();
    assert!(
        !out.status.success(),
        "uid 65534 listed the state directory"
    );
}

#[test]
fn a_state_directory_another_uid_owns_or_others_can_read_is_refused() {
    let parent = tempfile::tempdir().unwrap();
    let open_dir = parent.path().join("open");
    std::fs::create_dir(&open_dir).unwrap();
    std::fs::set_permissions(&open_dir, std::fs::Permissions::from_mode(0o755)).unwrap();
    let e = open(&open_dir).unwrap_err().to_string();
    assert!(
        e.contains("its mode is 0755: other users can read or enter it; run `chmod 700"),
        "{e}"
    );
    assert!(
        !open_dir.join("gateway.redb").exists(),
        "refused before anything is written"
    );
    if !is_root() {
        eprintln!("skipped the other-owner check: it needs root to chown");
        return;
    }
    let theirs = parent.path().join("theirs");
    std::fs::create_dir(&theirs).unwrap();
    std::fs::set_permissions(&theirs, std::fs::Permissions::from_mode(0o700)).unwrap();
    std::os::unix::fs::chown(&theirs, Some(65534), Some(65534)).unwrap();
    let e = open(&theirs).unwrap_err().to_string();
    assert!(
        e.contains("it is owned by uid 65534, and this gateway runs as uid 0"),
        "{e}"
    );
}

#[test]
fn two_gateways_started_at_once_on_a_fresh_directory_one_serves_the_other_is_refused() {
    use std::sync::Barrier;
    for round in 0..20 {
        let parent = tempfile::tempdir().unwrap();
        private(parent.path());
        let dir = parent.path().join("state");
        let (start, answered) = (Barrier::new(2), Barrier::new(2));
        let outcomes: Vec<Result<(), String>> = std::thread::scope(|s| {
            let starts: Vec<_> = (0..2)
                .map(|_| {
                    s.spawn(|| {
                        let rt = tokio::runtime::Builder::new_current_thread()
                            .enable_all()
                            .build()
                            .unwrap();
                        start.wait();
                        let r = rt.block_on(async {
                            open_router(GatewayConfig {
                                state_dir: Some(dir.clone()),
                                ..GatewayConfig::default()
                            })
                        });
                        // the winner holds the directory until both have their answer
                        answered.wait();
                        r.map(drop).map_err(|e| e.to_string())
                    })
                })
                .collect();
            starts.into_iter().map(|h| h.join().unwrap()).collect()
        });
        let served = outcomes.iter().filter(|r| r.is_ok()).count();
        let refused: Vec<&String> = outcomes.iter().filter_map(|r| r.as_ref().err()).collect();
        assert_eq!(served, 1, "round {round}: {outcomes:?}");
        assert_eq!(
            refused,
            [&format!(
                "the state directory {} is in use by another gateway (it holds the directory's lock); stop that gateway or give this one another --state-dir",
                dir.display()
            )],
            "round {round}"
        );
        // the directory is usable afterwards: the loser wrote nothing in it
        assert_eq!(
            open(&dir).map_err(|e| e.to_string()),
            Ok(()),
            "round {round}"
        );
    }
}

#[test]
fn an_unfinished_new_database_never_held_data_and_is_not_damage() {
    let dir = tempfile::tempdir().unwrap();
    private(dir.path());
    // what a gateway killed while building its database leaves
    let tmp = dir.path().join("gateway.redb.new");
    std::fs::write(&tmp, vec![0xA5u8; 100_000]).unwrap();
    assert_eq!(open(dir.path()).map_err(|e| e.to_string()), Ok(()));
    assert!(!tmp.exists());
    assert!(dir.path().join("gateway.redb").exists());
}

#[test]
fn a_fifo_or_a_device_in_place_of_the_database_is_refused_for_what_it_is() {
    let dir = tempfile::tempdir().unwrap();
    private(dir.path());
    let file = dir.path().join("gateway.redb");
    let c = std::ffi::CString::new(file.to_str().unwrap()).unwrap();
    // SAFETY: mkfifo reads a NUL-terminated path that lives for the call.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
    let e = open(dir.path()).unwrap_err().to_string();
    assert!(
        e.contains("gateway.redb cannot be used: it is not a regular file but a FIFO"),
        "{e}"
    );
    std::fs::remove_file(&file).unwrap();
    std::os::unix::fs::symlink("/dev/zero", &file).unwrap();
    let e = open(dir.path()).unwrap_err().to_string();
    assert!(
        e.contains("gateway.redb cannot be used: it is not a regular file but a character device"),
        "{e}"
    );
}

#[test]
fn an_empty_commit_record_is_damage_beside_a_database_with_commits_and_not_beside_a_new_one() {
    let dir = tempfile::tempdir().unwrap();
    private(dir.path());
    // a gateway that started and never changed anything: its record is written at start
    assert_eq!(open(dir.path()).map_err(|e| e.to_string()), Ok(()));
    let record = dir.path().join("gateway.commit");
    // one slot: commit 0 of this database
    assert_eq!(std::fs::metadata(&record).unwrap().len(), 32);
    // a leftover record that never held data, beside a database without commits: fine
    std::fs::write(&record, b"").unwrap();
    assert_eq!(open(dir.path()).map_err(|e| e.to_string()), Ok(()));
    // a database with commits
    let gw = Gw::start(dir.path(), None);
    let c = gw.client(None);
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async { c.connect(&connect_request("p", 1, 1, 1)).await.unwrap() });
    gw.stop();
    std::fs::write(&record, b"").unwrap();
    let e = open(dir.path()).unwrap_err().to_string();
    assert!(
        e.contains(
            "gateway.commit cannot be used: it is empty (0 bytes), but the database holds commit"
        ),
        "{e}"
    );
}

#[test]
fn a_zero_length_database_is_refused_not_taken_as_new() {
    let dir = tempfile::tempdir().unwrap();
    private(dir.path());
    std::fs::write(dir.path().join("gateway.redb"), b"").unwrap();
    let e = open(dir.path()).unwrap_err().to_string();
    assert!(
        e.contains("gateway.redb cannot be used: it is empty (0 bytes)"),
        "{e}"
    );
    assert!(e.contains("restore gateway.redb"), "{e}");
}

#[test]
fn a_truncated_database_is_refused_with_a_message_not_a_panic() {
    let dir = tempfile::tempdir().unwrap();
    let gw = Gw::start(dir.path(), None);
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(pair_with_commits(&gw.client(None), "tr", 1..=2));
    gw.stop();
    let db = dir.path().join("gateway.redb");
    let whole = std::fs::read(&db).unwrap();
    let len = whole.len();
    for cut in [len / 2, len - 1, 4096, 100, 20, 5] {
        std::fs::write(&db, &whole[..cut]).unwrap();
        let e = open(dir.path()).unwrap_err().to_string();
        assert!(
            e.contains("gateway.redb cannot be used: "),
            "cut at {cut}: {e}"
        );
        if cut >= 32 {
            assert!(
                e.contains(&format!(
                    "it is truncated: {cut} bytes, where its header describes"
                )),
                "cut at {cut}: {e}"
            );
        }
    }
}

/// Replaces every copy of `from` in `file` by `to` (same length); returns how many.
fn patch(file: &Path, from: &[u8], to: &[u8]) -> usize {
    let mut b = std::fs::read(file).unwrap();
    let mut n = 0;
    let mut i = 0;
    while let Some(at) = b[i..].windows(from.len()).position(|w| w == from) {
        b[i + at..i + at + to.len()].copy_from_slice(to);
        i += at + from.len();
        n += 1;
    }
    std::fs::write(file, b).unwrap();
    n
}

#[test]
fn one_changed_byte_in_the_newest_state_record_is_refused_not_served() {
    let dir = tempfile::tempdir().unwrap();
    let gw = Gw::start(dir.path(), None);
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(pair_with_commits(&gw.client(None), "byte", 1..=1));
    gw.stop();
    // `"committed":1` -> `"committed":7`: valid JSON, a silently wrong serving version if read
    let n = patch(
        &dir.path().join("gateway.redb"),
        b"\"committed\":1",
        b"\"committed\":7",
    );
    assert!(n > 0, "the state record is in the file");
    let e = open(dir.path()).unwrap_err().to_string();
    assert!(e.contains("gateway.redb cannot be used"), "{e}");
}

#[test]
fn a_database_older_than_the_last_acknowledged_commit_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("gateway.redb");
    let gw = Gw::start(dir.path(), None);
    let rt = tokio::runtime::Runtime::new().unwrap();
    let c = gw.client(None);
    rt.block_on(pair_with_commits(&c, "old", 1..=1));
    gw.stop();
    let backup = std::fs::read(&db).unwrap();
    let gw = Gw::start(dir.path(), None);
    rt.block_on(async {
        let c = gw.client(None);
        c.start_update("old", 2).await.unwrap();
    });
    gw.stop();
    // the database goes back to before version 2 started (a restored backup, a lost write)
    std::fs::write(&db, &backup).unwrap();
    let e = open(dir.path()).unwrap_err().to_string();
    assert!(e.contains("the database went back in time"), "{e}");
    assert!(e.contains("remove"), "{e}");
    assert!(e.contains("gateway.commit"), "{e}");
    // the operator accepts the older state knowingly: the pair comes back at version 1
    std::fs::remove_file(dir.path().join("gateway.commit")).unwrap();
    open(dir.path()).unwrap();
}

#[test]
fn a_pair_restored_under_another_token_is_join_failed_not_served_with_another_secret() {
    let dir = tempfile::tempdir().unwrap();
    let gw = Gw::start(dir.path(), Some("token-one"));
    let rt = tokio::runtime::Runtime::new().unwrap();
    let first = rt.block_on(pair_with_commits(
        &gw.client(Some("token-one")),
        "tok",
        1..=1,
    ));
    gw.stop();
    // the same token: the same secret
    let gw = Gw::start(dir.path(), Some("token-one"));
    let again = rt.block_on(async {
        let c = gw.client(Some("token-one"));
        let st = c.status("tok").await.unwrap();
        assert_eq!(st.state, awex_control::wire::PairState::Ready);
        c.join("tok", &jr(T.0, T.1))
            .await
            .unwrap()
            .secret
            .unwrap()
            .0
    });
    assert_eq!(again, first);
    gw.stop();
    let gw = Gw::start(dir.path(), Some("token-two"));
    rt.block_on(async {
        let st = gw.client(Some("token-two")).status("tok").await.unwrap();
        assert_eq!(st.state, awex_control::wire::PairState::JoinFailed);
        let why = st.join_error.unwrap_or_default();
        assert!(
            why.starts_with("the gateway's token changed since this pair was connected"),
            "{why}"
        );
    });
    gw.stop();
}

#[test]
fn the_database_file_shrinks_once_every_pair_is_gone() {
    let dir = tempfile::tempdir().unwrap();
    private(dir.path());
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let db = dir.path().join("gateway.redb");
    let config = GatewayConfig {
        state_dir: Some(dir.path().to_path_buf()),
        tombstone: Duration::from_millis(200),
        ..GatewayConfig::default()
    };
    let peak = rt.block_on(async {
        let l = bind("127.0.0.1:0".parse().unwrap()).unwrap();
        let url = format!("http://{}", l.local_addr().unwrap());
        tokio::spawn(serve(l, config));
        let c = Client::new(&url, None).unwrap().with_retries(0);
        let value = json!("v".repeat(48 * 1024));
        for i in 0..60 {
            let name = format!("p{i}");
            c.connect(&connect_request(&name, 1, 1, 1)).await.unwrap();
            for k in 0..2 {
                c.put_kv(&name, &format!("k{k}"), value.clone())
                    .await
                    .unwrap();
            }
        }
        let peak = std::fs::metadata(&db).unwrap().len();
        for i in 0..60 {
            c.disconnect(&format!("p{i}")).await.unwrap();
        }
        peak
    });
    assert!(peak > 4 << 20, "the pairs took {peak} bytes");
    let mut now = peak;
    for _ in 0..240 {
        now = std::fs::metadata(&db).unwrap().len();
        if now < peak / 4 {
            break;
        }
        std::thread::sleep(Duration::from_millis(250));
    }
    assert!(
        now < peak / 4,
        "{peak} bytes with 60 pairs, still {now} once they are gone"
    );
    rt.shutdown_timeout(Duration::from_secs(5));
}
