//! Ranks outlive their gateway: killed and restarted on its state directory while the ranks
//! wait for work, they retry, re-attach and run the next version; killed mid-update, the
//! version in flight fails ("gateway restarted during update N"), the ranks learn it and its
//! retry commits; a disconnect then ends them cleanly. A gateway restarted *without* its state
//! answers 404 for the pair, which is an error for the ranks, never a clean end. Every
//! gateway runs on a runtime of its own, dropped to kill it.

#[path = "shared/ranks.rs"]
mod ranks;

use awex_control::client::Client;
use awex_control::server::{GatewayConfig, bind, serve};
use awex_control::wire::{PairOptions, UpdateState};
use awex_core::Transport;
use awex_core::layout::{RankId, Side};
use awex_runtime::rank::{Rank, RankConfig, RankError};
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{Notify, Semaphore};

const LIMIT: Duration = Duration::from_secs(90);

/// A gateway on its own runtime, so that dropping it ends every connection and task.
struct Gw {
    rt: Option<tokio::runtime::Runtime>,
    port: u16,
}

impl Gw {
    fn start(dir: Option<&Path>, port: u16) -> Gw {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        // a state directory must be private (tempdir makes it 0755 under the usual umask)
        if let Some(d) = dir {
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(d, std::fs::Permissions::from_mode(0o700)).unwrap();
        }
        let config = GatewayConfig {
            state_dir: dir.map(Path::to_path_buf),
            ..GatewayConfig::default()
        };
        let l = rt.block_on(async { bind(format!("127.0.0.1:{port}").parse().unwrap()).unwrap() });
        let port = l.local_addr().unwrap().port();
        rt.spawn(serve(l, config));
        Gw { rt: Some(rt), port }
    }

    fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    fn kill(mut self) -> u16 {
        if let Some(rt) = self.rt.take() {
            rt.shutdown_timeout(Duration::from_secs(5));
        }
        self.port
    }
}

fn cfg(gw: &str, pair: &str, side: Side, rank: RankId) -> RankConfig {
    ranks::cfg(gw, pair, side, rank, Transport::Tcp, "sglang:tp=1")
}

async fn join(c: RankConfig) -> Rank {
    ranks::join(c).await.unwrap()
}

async fn connect(gw: &str, pair: &str) -> Client {
    let client = Client::new(gw, None).unwrap();
    let options = PairOptions {
        bucket_mib: 1,
        update_deadline_ms: 20_000,
        ..PairOptions::default()
    };
    ranks::connect(&client, pair, Transport::Tcp, "sglang:tp=1", options).await;
    client
}

/// A rank's loop as a worker runs it; once version `hold` is over it says so and waits for a
/// permit before it looks for more work (a rank busy elsewhere). Returns what it did, or its
/// error.
async fn follow(
    mut me: Rank,
    hold: Option<u64>,
    reached: Arc<Notify>,
    gate: Arc<Semaphore>,
) -> Result<Vec<String>, RankError> {
    let mut log = Vec::new();
    while let Some(w) = me.next_live_work().await? {
        // as `awex-cli worker` does: a rank that succeeded waits for the version's outcome
        let r = me.execute(w, true).await;
        let line = match r {
            Ok(_) => {
                let outcome = me.wait_outcome(w.version, LIMIT).await?;
                format!("{}/{} ok {}", w.version, w.attempt, outcome.state.as_str())
            }
            Err(e) => format!("{}/{} err {e}", w.version, w.attempt),
        };
        log.push(line);
        if hold == Some(w.version) {
            reached.notify_one();
            let _ = gate.acquire().await;
        }
    }
    Ok(log)
}

/// Runs a rank's loop on a thread and runtime of its own (a rank future holds its `Rank`
/// across awaits, so it is not `Send`); the answer arrives on a oneshot channel.
fn on_thread(
    me: Rank,
    hold: Option<u64>,
    reached: Arc<Notify>,
    gate: Arc<Semaphore>,
) -> tokio::sync::oneshot::Receiver<Result<Vec<String>, RankError>> {
    let (tx, rx) = tokio::sync::oneshot::channel();
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let _ = tx.send(rt.block_on(follow(me, hold, reached, gate)));
    });
    rx
}

async fn committed(client: &Client, pair: &str, version: u64) -> u32 {
    let u = client.wait_update(pair, version, LIMIT).await.unwrap();
    assert_eq!(u.state, UpdateState::Committed, "{u:?}");
    u.attempt
}

#[test]
fn ranks_retry_a_restarting_gateway_re_attach_and_a_version_in_flight_fails_then_commits() {
    let dir = tempfile::tempdir().unwrap();
    let gw = Gw::start(Some(dir.path()), 0);
    let url = gw.url();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(4)
        .enable_all()
        .build()
        .unwrap();
    let (t, i) = (RankId::train(0), RankId::infer(0, 0));
    let reached = Arc::new(Notify::new());
    let gate = Arc::new(Semaphore::new(0));
    let (client, ranks) = rt.block_on(async {
        let client = connect(&url, "rs").await;
        let (a, b) = tokio::join!(
            join(cfg(&url, "rs", Side::Training, t)),
            join(cfg(&url, "rs", Side::Inference, i)),
        );
        let ta = on_thread(a, Some(2), reached.clone(), gate.clone());
        let tb = on_thread(b, None, reached.clone(), gate.clone());
        client.start_update("rs", 1).await.unwrap();
        assert_eq!(committed(&client, "rs", 1).await, 1);
        (client, [ta, tb])
    });

    // killed while the ranks wait for work: they retry, and re-attach once it is back
    let port = gw.kill();
    std::thread::sleep(Duration::from_millis(1500));
    let gw = Gw::start(Some(dir.path()), port);
    rt.block_on(async {
        client.start_update("rs", 2).await.unwrap();
        assert_eq!(committed(&client, "rs", 2).await, 1);
        // version 3: the training rank is held after version 2, the inference rank waits for
        // its bytes, and the gateway dies meanwhile
        tokio::time::timeout(LIMIT, reached.notified())
            .await
            .expect("the training rank finished version 2");
        client.start_update("rs", 3).await.unwrap();
        tokio::time::sleep(Duration::from_millis(300)).await;
    });
    let port = gw.kill();
    let gw = Gw::start(Some(dir.path()), port);
    rt.block_on(async {
        let u = client.update_status("rs", 3).await.unwrap();
        assert_eq!(u.state, UpdateState::Failed);
        assert_eq!(
            u.error.as_deref(),
            Some("version 3 attempt 1 failed: gateway restarted during update 3")
        );
        assert_eq!(client.status("rs").await.unwrap().serving_version, Some(2));
        gate.add_permits(1);
        // the retry commits, with both ranks still alive
        client.start_update("rs", 3).await.unwrap();
        assert_eq!(committed(&client, "rs", 3).await, 2);
        client.disconnect("rs").await.unwrap();
        for (k, task) in ranks.into_iter().enumerate() {
            let log = tokio::time::timeout(LIMIT, task)
                .await
                .expect("the rank ended after the disconnect")
                .unwrap()
                .unwrap_or_else(|e| panic!("rank {k} failed: {e}"));
            assert!(log.len() >= 3, "rank {k}: {log:?}");
            assert_eq!(log[0], "1/1 ok committed", "rank {k}: {log:?}");
            assert_eq!(log[1], "2/1 ok committed", "rank {k}: {log:?}");
            assert_eq!(
                log.last().map(String::as_str),
                Some("3/2 ok committed"),
                "rank {k}: {log:?}"
            );
            // the training rank skipped version 3 attempt 1 (over when it looked); the
            // inference rank ran it and learned that it failed
            // (aborted, or its peer gone: whichever it noticed first)
            let mut log = log;
            if k == 1 {
                assert!(log[2].starts_with("3/1 err "), "rank {k}: {log:?}");
                log.remove(2);
            }
            assert_eq!(
                log,
                ["1/1 ok committed", "2/1 ok committed", "3/2 ok committed"],
                "rank {k}"
            );
        }
    });
    gw.kill();
}

#[test]
fn a_gateway_restarted_without_its_state_is_an_error_for_the_ranks_not_a_clean_end() {
    let gw = Gw::start(None, 0);
    let url = gw.url();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(4)
        .enable_all()
        .build()
        .unwrap();
    let (t, i) = (RankId::train(0), RankId::infer(0, 0));
    let (mut a, _b) = rt.block_on(async {
        connect(&url, "nostate").await;
        tokio::join!(
            join(cfg(&url, "nostate", Side::Training, t)),
            join(cfg(&url, "nostate", Side::Inference, i)),
        )
    });
    let port = gw.kill();
    let gw = Gw::start(None, port);
    let e = rt
        .block_on(async { tokio::time::timeout(LIMIT, a.next_live_work()).await })
        .expect("the rank learned the pair is unknown")
        .unwrap_err();
    assert!(matches!(e, RankError::UnknownPair { .. }), "{e:?}");
    assert_eq!(
        e.to_string(),
        format!(
            "the gateway at {url} has no pair `nostate` (404 unknown pair): it was restarted without its state (--state-dir none) or forgot the pair; this rank cannot learn the outcome of its updates and stops"
        )
    );
    gw.kill();
}
