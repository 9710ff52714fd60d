//! A gateway that keeps its state under a state directory loses nothing when it is killed and
//! started again: pairs, rosters, rendezvous values, the committed version and the event
//! sequence come back; an update in flight at the crash is failed (never committed, torn when
//! the ranks had been told to write) and its retry commits. A second gateway on the same
//! directory is refused. Each gateway runs on a runtime of its own, dropped to kill it.

mod gateway_common;

use awex_control::client::{Client, JoinOutcome};
use awex_control::server::{GatewayConfig, ServeError, bind, open_router, serve};
use awex_control::wire::{EventKind, JoinRequest, PairState, Report, UpdateState};
use awex_core::{RankId, Side};
use gateway_common::connect_request;
use serde_json::json;
use std::path::Path;
use std::time::Duration;

/// A gateway on its own runtime (so that dropping it ends every connection and task, as a
/// kill would).
struct Gw {
    rt: Option<tokio::runtime::Runtime>,
    port: u16,
}

impl Gw {
    /// Starts a gateway on `port` (0: any) keeping its state in `dir` (`None`: in memory).
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
        let l = rt.block_on(async {
            bind(format!("127.0.0.1:{port}").parse().unwrap()).expect("bind the gateway's port")
        });
        let port = l.local_addr().unwrap().port();
        rt.spawn(async move {
            if let Err(e) = serve(l, config).await {
                panic!("gateway failed: {e}");
            }
        });
        Gw { rt: Some(rt), port }
    }

    fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// Kills the gateway: every task and connection is dropped, the database closed.
    fn kill(mut self) -> u16 {
        if let Some(rt) = self.rt.take() {
            rt.shutdown_timeout(Duration::from_secs(5));
        }
        self.port
    }
}

fn jr(side: Side, rank: RankId) -> JoinRequest {
    JoinRequest {
        side,
        rank,
        info: json!({ "transport": { "port": 1000 + rank.rank }, "pid": 42 }),
        capabilities: vec![awex_control::wire::CAP_ATOMIC_APPLY.to_string()],
    }
}

fn report(side: Side, rank: RankId, attempt: u32) -> Report {
    Report {
        side,
        rank,
        ok: true,
        bytes: 10,
        checksum: Some(7),
        error: None,
        attempt: Some(attempt),
        incarnation: None,
        delta: None,
        unreached: Vec::new(),
    }
}

const T: (Side, RankId) = (Side::Training, RankId { engine: 0, rank: 0 });
const I: (Side, RankId) = (Side::Inference, RankId { engine: 0, rank: 0 });

/// Connects `name` (one training rank, one inference rank) and joins both ranks.
async fn ready_pair(c: &Client, name: &str) {
    c.connect(&connect_request(name, 1, 1, 1)).await.unwrap();
    assert!(matches!(
        c.join_once(name, &jr(T.0, T.1), Duration::ZERO)
            .await
            .unwrap(),
        JoinOutcome::Pending(_)
    ));
    let r = c.join(name, &jr(I.0, I.1)).await.unwrap();
    assert_eq!(r.roster.len(), 2);
}

async fn commit(c: &Client, name: &str, version: u64, attempt: u32) {
    let st = c.start_update(name, version).await.unwrap();
    assert_eq!(st.attempt, attempt);
    for (side, rank) in [T, I] {
        c.report(name, version, &report(side, rank, attempt))
            .await
            .unwrap();
    }
    let st = c
        .wait_update(name, version, Duration::from_secs(120))
        .await
        .unwrap();
    assert_eq!(st.state, UpdateState::Committed, "{st:?}");
}

#[test]
fn a_restart_while_idle_brings_back_pairs_rosters_kv_events_and_the_committed_version() {
    let dir = tempfile::tempdir().unwrap();
    let gw = Gw::start(Some(dir.path()), 0);
    let url = gw.url();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let c = Client::new(&url, None).unwrap().with_retries(0);
    let before = rt.block_on(async {
        ready_pair(&c, "idle").await;
        c.put_kv("idle", "nccl.uid", json!([1, 2, 3, {"a": "b"}]))
            .await
            .unwrap();
        commit(&c, "idle", 1, 1).await;
        c.status("idle").await.unwrap()
    });
    let port = gw.kill();
    // the pair is gone while the gateway is down
    assert!(rt.block_on(c.status("idle")).is_err());
    let gw = Gw::start(Some(dir.path()), port);
    rt.block_on(async {
        let after = c.status("idle").await.unwrap();
        assert_eq!(after.state, PairState::Ready);
        assert_eq!(after.serving_version, Some(1));
        assert_eq!(after.uid, before.uid);
        assert_eq!(after.id, before.id);
        assert_eq!(after.joined, 2);
        assert_eq!(after.last_event_seq, before.last_event_seq);
        assert_eq!(after.torn_version, None);
        let kv = c.get_kv("idle", "nccl.uid", Duration::ZERO).await.unwrap();
        assert_eq!(kv.value, json!([1, 2, 3, {"a": "b"}]));
        // the ranks' cursors stay valid: no 409 for after=last
        let ev = c
            .events("idle", before.last_event_seq, Duration::ZERO)
            .await
            .unwrap();
        assert!(ev.events.is_empty());
        assert_eq!(ev.last_seq, before.last_event_seq);
        // a re-join of a slot answers the current roster at once (the pair is ready)
        let r = c.join("idle", &jr(T.0, T.1)).await.unwrap();
        assert_eq!(r.roster.len(), 2);
        assert_eq!(r.uid, before.uid);
        // version 1 is committed: a retry of it is stale, version 2 commits
        let e = c.start_update("idle", 1).await.unwrap_err();
        assert_eq!(e.status(), Some(409), "{e}");
        commit(&c, "idle", 2, 1).await;
        // a new pair gets a new id, not one of a restored pair
        c.connect(&connect_request("other", 1, 1, 1)).await.unwrap();
        assert!(c.status("other").await.unwrap().id > before.id);
    });
    gw.kill();
}

#[test]
fn a_restart_mid_update_fails_the_attempt_as_torn_and_its_retry_commits() {
    let dir = tempfile::tempdir().unwrap();
    let gw = Gw::start(Some(dir.path()), 0);
    let c = Client::new(&gw.url(), None).unwrap().with_retries(0);
    let rt = tokio::runtime::Runtime::new().unwrap();
    let seq = rt.block_on(async {
        ready_pair(&c, "mid").await;
        commit(&c, "mid", 1, 1).await;
        let st = c.start_update("mid", 2).await.unwrap();
        assert_eq!(st.state, UpdateState::Running);
        // one rank reported before the crash
        c.report("mid", 2, &report(T.0, T.1, 1)).await.unwrap();
        c.status("mid").await.unwrap().last_event_seq
    });
    let port = gw.kill();
    let gw = Gw::start(Some(dir.path()), port);
    rt.block_on(async {
        let u = c.update_status("mid", 2).await.unwrap();
        assert_eq!(u.state, UpdateState::Failed);
        assert_eq!(
            u.error.as_deref(),
            Some("version 2 attempt 1 failed: gateway restarted during update 2")
        );
        assert_eq!(u.succeeded, 1, "the report made before the crash is kept");
        let st = c.status("mid").await.unwrap();
        assert_eq!(st.serving_version, Some(1), "never committed");
        assert_eq!(
            st.torn_version,
            Some(2),
            "the ranks had been told to write: torn"
        );
        // the abort follows the events the ranks already saw
        let ev = c.events("mid", seq, Duration::ZERO).await.unwrap();
        assert_eq!(ev.events.len(), 1, "{ev:?}");
        assert_eq!(ev.events[0].kind, EventKind::Abort);
        assert_eq!(ev.events[0].seq, seq + 1);
        assert_eq!(ev.events[0].version, Some(2));
        // the late report of the old attempt is refused; the retry commits
        let e = c.report("mid", 2, &report(I.0, I.1, 1)).await.unwrap_err();
        assert_eq!(e.status(), Some(409), "{e}");
        commit(&c, "mid", 2, 2).await;
        let st = c.status("mid").await.unwrap();
        assert_eq!((st.serving_version, st.torn_version), (Some(2), None));
    });
    // and that outcome survives the next restart too
    let port = gw.kill();
    let gw = Gw::start(Some(dir.path()), port);
    rt.block_on(async {
        let u = c.update_status("mid", 2).await.unwrap();
        assert_eq!(
            (u.state, u.attempt, u.succeeded),
            (UpdateState::Committed, 2, 2)
        );
    });
    gw.kill();
}

#[test]
fn a_disconnected_pair_stays_disconnected_after_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let gw = Gw::start(Some(dir.path()), 0);
    let c = Client::new(&gw.url(), None).unwrap().with_retries(0);
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        ready_pair(&c, "gone").await;
        c.disconnect("gone").await.unwrap();
    });
    let port = gw.kill();
    let gw = Gw::start(Some(dir.path()), port);
    rt.block_on(async {
        // the tombstone: 410 for the ranks, a disconnect event at the end of the stream
        let e = c.join("gone", &jr(T.0, T.1)).await.unwrap_err();
        assert_eq!(e.status(), Some(410), "{e}");
        let ev = c.events("gone", 0, Duration::ZERO).await.unwrap();
        assert_eq!(
            ev.events.last().map(|e| e.kind),
            Some(EventKind::Disconnect)
        );
    });
    gw.kill();
}

#[tokio::test]
async fn a_second_gateway_on_the_same_state_directory_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let config = GatewayConfig {
        state_dir: Some(dir.path().join("state")),
        ..GatewayConfig::default()
    };
    let first = open_router(config.clone()).unwrap();
    let e = open_router(config.clone()).unwrap_err();
    assert!(matches!(e, ServeError::State(_)), "{e:?}");
    assert_eq!(
        e.to_string(),
        format!(
            "the state directory {} is in use by another gateway (it holds the directory's lock); stop that gateway or give this one another --state-dir",
            dir.path().join("state").display()
        )
    );
    drop(first);
    // once the first is gone the directory can be used again
    assert!(open_router(config).is_ok());
}

#[test]
fn a_pair_still_joining_keeps_its_joined_ranks_and_completes_after_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let gw = Gw::start(Some(dir.path()), 0);
    let c = Client::new(&gw.url(), None).unwrap().with_retries(0);
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        c.connect(&connect_request("joining", 1, 1, 1))
            .await
            .unwrap();
        let first = c
            .join_once("joining", &jr(T.0, T.1), Duration::ZERO)
            .await
            .unwrap();
        assert!(matches!(first, JoinOutcome::Pending(p) if p.joined == 1));
    });
    let port = gw.kill();
    let gw = Gw::start(Some(dir.path()), port);
    rt.block_on(async {
        let st = c.status("joining").await.unwrap();
        assert_eq!((st.state, st.joined), (PairState::Joining, 1));
        // the second rank completes the pair; the roster has both, the first one's info kept
        let r = c.join("joining", &jr(I.0, I.1)).await.unwrap();
        assert_eq!(r.roster.len(), 2);
        assert_eq!(r.roster[0].info, jr(T.0, T.1).info);
        commit(&c, "joining", 1, 1).await;
    });
    gw.kill();
}

#[test]
fn an_atomic_update_in_flight_at_a_restart_is_torn_only_once_apply_went_out() {
    let dir = tempfile::tempdir().unwrap();
    let gw = Gw::start(Some(dir.path()), 0);
    let c = Client::new(&gw.url(), None).unwrap().with_retries(0);
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let mut req = connect_request("at", 1, 1, 1);
        req.options.apply = awex_control::wire::ApplyMode::Atomic;
        c.connect(&req).await.unwrap();
        let _ = c
            .join_once("at", &jr(T.0, T.1), Duration::ZERO)
            .await
            .unwrap();
        c.join("at", &jr(I.0, I.1)).await.unwrap();
        // version 1: both received, the inference rank applied
        c.start_update("at", 1).await.unwrap();
        for (side, rank) in [T, I, I] {
            c.report("at", 1, &report(side, rank, 1)).await.unwrap();
        }
        assert_eq!(
            c.update_status("at", 1).await.unwrap().state,
            UpdateState::Committed
        );
        // version 2: the training rank reported, nothing applied yet
        c.start_update("at", 2).await.unwrap();
        c.report("at", 2, &report(T.0, T.1, 1)).await.unwrap();
    });
    let port = gw.kill();
    let gw = Gw::start(Some(dir.path()), port);
    rt.block_on(async {
        let st = c.status("at").await.unwrap();
        assert_eq!(st.options.apply, awex_control::wire::ApplyMode::Atomic);
        assert_eq!((st.serving_version, st.torn_version), (Some(1), None));
        // attempt 2: every rank received, `apply` went out, then the gateway dies
        c.start_update("at", 2).await.unwrap();
        for (side, rank) in [T, I] {
            c.report("at", 2, &report(side, rank, 2)).await.unwrap();
        }
        assert!(c.update_status("at", 2).await.unwrap().applying);
    });
    let port = gw.kill();
    let gw = Gw::start(Some(dir.path()), port);
    rt.block_on(async {
        let u = c.update_status("at", 2).await.unwrap();
        assert_eq!(u.state, UpdateState::Failed);
        assert!(u.applying, "the apply phase is remembered");
        let st = c.status("at").await.unwrap();
        assert_eq!((st.serving_version, st.torn_version), (Some(1), Some(2)));
    });
    gw.kill();
}

/// Connects `name` with commit policy `available` over `engines` engines of one rank and one
/// training rank, and joins every rank.
async fn ready_fleet(c: &Client, name: &str, engines: u32) {
    let mut req = connect_request(name, 1, engines, 1);
    req.options.commit = awex_control::wire::CommitPolicy::Available;
    c.connect(&req).await.unwrap();
    for e in 0..engines {
        let _ = c
            .join_once(
                name,
                &jr(Side::Inference, RankId::infer(e, 0)),
                Duration::ZERO,
            )
            .await
            .unwrap();
    }
    let r = c.join(name, &jr(T.0, T.1)).await.unwrap();
    assert_eq!(r.roster.len(), engines as usize + 1);
}

fn engine_report(engine: u32, ok: bool, attempt: u32) -> Report {
    Report {
        ok,
        error: (!ok).then(|| "connection reset by peer".to_string()),
        checksum: None,
        ..report(Side::Inference, RankId::infer(engine, 0), attempt)
    }
}

#[test]
fn engines_left_out_stay_behind_across_a_restart_and_an_update_in_flight_commits_nothing() {
    use awex_control::wire::EngineState;
    let dir = tempfile::tempdir().unwrap();
    let gw = Gw::start(Some(dir.path()), 0);
    let c = Client::new(&gw.url(), None).unwrap().with_retries(0);
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        ready_fleet(&c, "fleet", 3).await;
        c.start_update("fleet", 1).await.unwrap();
        c.report("fleet", 1, &engine_report(1, false, 1))
            .await
            .unwrap();
        for r in [
            report(T.0, T.1, 1),
            engine_report(0, true, 1),
            engine_report(2, true, 1),
        ] {
            c.report("fleet", 1, &r).await.unwrap();
        }
        let u = c
            .wait_update("fleet", 1, Duration::from_secs(120))
            .await
            .unwrap();
        assert_eq!(u.state, UpdateState::Committed, "{u:?}");
        assert_eq!(u.left_out.len(), 1);
        // version 2 starts; engine 0 applies it, then the gateway dies
        c.start_update("fleet", 2).await.unwrap();
        c.report("fleet", 2, &engine_report(0, true, 1))
            .await
            .unwrap();
    });
    let port = gw.kill();
    let gw = Gw::start(Some(dir.path()), port);
    rt.block_on(async {
        let st = c.status("fleet").await.unwrap();
        assert_eq!(
            st.options.commit,
            awex_control::wire::CommitPolicy::Available
        );
        // nothing committed that was not applied: version 2 failed, every engine serves what
        // it applied whole before, and none is reported serving version 2
        assert_eq!(st.serving_version, Some(1));
        assert_eq!(
            c.update_status("fleet", 2).await.unwrap().state,
            UpdateState::Failed
        );
        let e = &st.engines;
        assert_eq!(e.len(), 3);
        assert_eq!(
            (e[0].serving_version, e[2].serving_version),
            (Some(1), Some(1))
        );
        assert_eq!(e[1].serving_version, None, "{:?}", e[1]);
        assert!(e[1].behind_since_unix_ms.is_some(), "{:?}", e[1]);
        assert!(
            e[1].last_error
                .as_deref()
                .unwrap_or("")
                .contains("gateway restarted during update 2"),
            "{:?}",
            e[1]
        );
        // why engine 1 was left out of version 1 is kept with the version
        let u1 = c.update_status("fleet", 1).await.unwrap();
        assert_eq!(u1.left_out.len(), 1, "{u1:?}");
        assert_eq!(u1.left_out[0].engine, 1);
        assert!(
            u1.left_out[0].error.contains("connection reset by peer"),
            "{u1:?}"
        );
        // version 2 may have written part of every engine's weights: all are torn, so resume
        // refuses without accept_torn
        for x in e {
            assert_eq!(
                (x.state, x.torn_version),
                (EngineState::Torn, Some(2)),
                "{x:?}"
            );
        }
        let refused = c.resume("fleet", false).await.unwrap_err();
        assert_eq!(refused.status(), Some(409), "{refused}");
        // the ranks re-attach and the retry commits everywhere: engine 1 caught up
        for e in 0..3 {
            c.join("fleet", &jr(Side::Inference, RankId::infer(e, 0)))
                .await
                .unwrap();
        }
        c.join("fleet", &jr(T.0, T.1)).await.unwrap();
        let st = c.start_update("fleet", 2).await.unwrap();
        assert_eq!(st.attempt, 2);
        c.report("fleet", 2, &report(T.0, T.1, 2)).await.unwrap();
        for e in 0..3 {
            c.report("fleet", 2, &engine_report(e, true, 2))
                .await
                .unwrap();
        }
        let u = c
            .wait_update("fleet", 2, Duration::from_secs(120))
            .await
            .unwrap();
        assert_eq!(u.state, UpdateState::Committed, "{u:?}");
        for x in c.status("fleet").await.unwrap().engines {
            assert_eq!(
                (x.state, x.serving_version, x.behind_since_unix_ms),
                (EngineState::Serving, Some(2), None),
                "{x:?}"
            );
        }
        let m = c.metrics().await.unwrap();
        assert!(
            m.contains("awex_gateway_engines{state=\"serving\"} 3"),
            "{m}"
        );
        assert!(
            m.contains("awex_gateway_engine_serving_version{pair=\"fleet\",engine=\"1\"} 2"),
            "{m}"
        );
    });
    gw.kill();
}

/// Reports success of `version` (attempt `attempt`) from the training rank and the inference
/// ranks of `engines` (one rank each) and waits for it to settle.
async fn settle_on(
    c: &Client,
    name: &str,
    version: u64,
    attempt: u32,
    engines: &[u32],
) -> UpdateState {
    c.report(name, version, &report(T.0, T.1, attempt))
        .await
        .unwrap();
    for &e in engines {
        c.report(
            name,
            version,
            &report(Side::Inference, RankId::infer(e, 0), attempt),
        )
        .await
        .unwrap();
    }
    c.wait_update(name, version, Duration::from_secs(120))
        .await
        .unwrap()
        .state
}

#[test]
fn engines_added_and_removed_keep_their_standing_across_restarts_in_the_middle_of_each() {
    use awex_control::wire::{CommitPolicy, EngineState};
    let dir = tempfile::tempdir().unwrap();
    let gw = Gw::start(Some(dir.path()), 0);
    let c = Client::new(&gw.url(), None).unwrap().with_retries(0);
    let rt = tokio::runtime::Runtime::new().unwrap();
    let name = "fleet";
    let engine_states = |st: &awex_control::wire::PairStatus| -> Vec<(EngineState, Option<u64>)> {
        st.engines
            .iter()
            .map(|e| (e.state, e.serving_version))
            .collect()
    };
    rt.block_on(async {
        let mut req = connect_request(name, 1, 3, 1);
        req.inference.spare = 1;
        req.options.commit = CommitPolicy::Available;
        c.connect(&req).await.unwrap();
        c.join_once(name, &jr(T.0, T.1), Duration::ZERO)
            .await
            .unwrap();
        c.join_once(
            name,
            &jr(Side::Inference, RankId::infer(0, 0)),
            Duration::ZERO,
        )
        .await
        .unwrap();
        c.join(name, &jr(Side::Inference, RankId::infer(1, 0)))
            .await
            .unwrap();
        c.start_update(name, 1).await.unwrap();
        assert_eq!(
            settle_on(&c, name, 1, 1, &[0, 1]).await,
            UpdateState::Committed
        );
        // added, and the gateway dies before its ranks joined
        assert_eq!(c.add_engine(name, None).await.unwrap().engine, 2);
    });
    let port = gw.kill();
    let gw = Gw::start(Some(dir.path()), port);
    rt.block_on(async {
        let st = c.status(name).await.unwrap();
        assert_eq!(
            engine_states(&st),
            vec![
                (EngineState::Serving, Some(1)),
                (EngineState::Serving, Some(1)),
                (EngineState::Joining, None)
            ]
        );
        let r = c
            .join(name, &jr(Side::Inference, RankId::infer(2, 0)))
            .await
            .unwrap();
        assert_eq!(r.roster.len(), 4);
        c.put_kv(name, "rdv.infer.1.0", json!({"transport": {"port": 1}}))
            .await
            .unwrap();
        // its first version catches it up; then engine 1 is removed while version 3 runs, and
        // the gateway dies before that version settled
        c.start_update(name, 2).await.unwrap();
        assert_eq!(
            settle_on(&c, name, 2, 1, &[0, 1, 2]).await,
            UpdateState::Committed
        );
        c.start_update(name, 3).await.unwrap();
        c.report(name, 3, &report(T.0, T.1, 1)).await.unwrap();
        let removed = c.remove_engine(name, 1).await.unwrap();
        assert_eq!(removed.status.state, EngineState::Absent);
    });
    let port = gw.kill();
    let gw = Gw::start(Some(dir.path()), port);
    rt.block_on(async {
        // the version in flight failed (never committed), the removal holds: slot, roster
        // entry and rendezvous value gone
        let u = c.update_status(name, 3).await.unwrap();
        assert_eq!(u.state, UpdateState::Failed);
        let st = c.status(name).await.unwrap();
        assert_eq!(st.serving_version, Some(2));
        assert_eq!(
            engine_states(&st),
            vec![
                (EngineState::Torn, Some(2)),
                (EngineState::Absent, None),
                (EngineState::Torn, Some(2))
            ]
        );
        assert!(
            !st.roster
                .iter()
                .any(|r| r.side == Side::Inference && r.rank.engine == 1)
        );
        let e = c
            .get_kv(name, "rdv.infer.1.0", Duration::ZERO)
            .await
            .unwrap_err();
        assert_eq!(e.status(), Some(404), "{e}");
        // the retry goes to the two engines left, and commits on them
        c.start_update(name, 3).await.unwrap();
        let ev = c.events(name, 0, Duration::ZERO).await.unwrap().events;
        let last = ev
            .iter()
            .rev()
            .find(|e| e.kind == EventKind::Update)
            .unwrap();
        assert_eq!((last.version, last.attempt), (Some(3), Some(2)));
        assert_eq!(last.engines, vec![1]);
        assert_eq!(
            settle_on(&c, name, 3, 2, &[0, 2]).await,
            UpdateState::Committed
        );
        let st = c.status(name).await.unwrap();
        assert_eq!(
            engine_states(&st),
            vec![
                (EngineState::Serving, Some(3)),
                (EngineState::Absent, None),
                (EngineState::Serving, Some(3))
            ]
        );
    });
    gw.kill();
}
