//! Reports are bound to the claim of the slot's holder, as joins, rendezvous writes and event
//! polls are: a token holder that is not the rank cannot commit (or fail) a version for it, and
//! the claim ids that bind the slots are never handed out (roster, kv, messages).

mod gateway_common;

use awex_control::client::Client;
use awex_control::server::GatewayConfig;
use awex_control::wire::{JoinRequest, Report, UpdateState};
use awex_core::{RankId, Side};
use gateway_common::{connect_request, start};
use serde_json::json;
use std::time::Duration;

const T: (Side, RankId) = (Side::Training, RankId { engine: 0, rank: 0 });
const I: (Side, RankId) = (Side::Inference, RankId { engine: 0, rank: 0 });
const T_CLAIM: &str = "c1a1m0000000000t";
const I_CLAIM: &str = "c1a1m0000000000i";

fn report(side: Side, rank: RankId, ok: bool, claim: Option<&str>) -> Report {
    Report {
        side,
        rank,
        ok,
        bytes: 10,
        checksum: ok.then_some(7),
        error: (!ok).then(|| "forged".to_string()),
        attempt: Some(1),
        incarnation: claim.map(str::to_string),
        delta: None,
        unreached: Vec::new(),
    }
}

/// A ready pair whose two ranks joined with claim ids (as awex's ranks do), version 1 running.
async fn running(c: &Client, name: &str) {
    c.connect(&connect_request(name, 1, 1, 1)).await.unwrap();
    for ((side, _), claim) in [(T, T_CLAIM), (I, I_CLAIM)] {
        let key = format!(
            "rdv.{}.0.0",
            if side == Side::Training {
                "train"
            } else {
                "infer"
            }
        );
        c.put_kv(
            name,
            &key,
            json!({"incarnation": claim, "transport": {"port": 1}}),
        )
        .await
        .unwrap();
    }
    let join = |side, rank, claim: &str| JoinRequest {
        side,
        rank,
        info: json!({"incarnation": claim, "pid": 4242, "transport": {"port": 1}}),
        capabilities: vec![],
    };
    let (jt, ji) = (join(T.0, T.1, T_CLAIM), join(I.0, I.1, I_CLAIM));
    let (a, b) = tokio::join!(c.join(name, &jt), c.join(name, &ji));
    let roster = a.unwrap();
    b.unwrap();
    // nobody learns a claim id from the roster or the rendezvous values
    let text = serde_json::to_string(&roster).unwrap();
    assert!(!text.contains(T_CLAIM) && !text.contains(I_CLAIM), "{text}");
    let kv = c
        .get_kv(name, "rdv.train.0.0", Duration::ZERO)
        .await
        .unwrap();
    assert_eq!(kv.value, json!({"transport": {"port": 1}}));
    c.start_update(name, 1).await.unwrap();
}

#[tokio::test]
async fn a_report_without_the_holders_claim_is_refused_and_changes_nothing() {
    let url = start(GatewayConfig::default()).await;
    let c = Client::new(&url, None).unwrap().with_retries(0);
    running(&c, "cl").await;
    c.report("cl", 1, &report(T.0, T.1, true, Some(T_CLAIM)))
        .await
        .unwrap();
    // a token holder posts `ok` for the inference rank: no claim, then a guessed one
    for claim in [None, Some("0123456789abcdef"), Some(T_CLAIM)] {
        let e = c
            .report("cl", 1, &report(I.0, I.1, true, claim))
            .await
            .unwrap_err();
        assert_eq!(e.status(), Some(409), "{e}");
        let msg = e.to_string();
        assert!(
            msg.contains("inference rank 0/0 is held by the process (pid 4242)"),
            "{msg}"
        );
        assert!(msg.contains("is refused and changed nothing"), "{msg}");
        assert!(
            !msg.contains(I_CLAIM),
            "the holder's claim is never echoed: {msg}"
        );
    }
    // and a forged failure does not fail the version
    let e = c
        .report("cl", 1, &report(I.0, I.1, false, None))
        .await
        .unwrap_err();
    assert_eq!(e.status(), Some(409), "{e}");
    let st = c.update_status("cl", 1).await.unwrap();
    assert_eq!(st.state, UpdateState::Running, "{st:?}");
    assert_eq!(st.succeeded, 1);
    // the rank itself reports, and the version commits
    c.report("cl", 1, &report(I.0, I.1, true, Some(I_CLAIM)))
        .await
        .unwrap();
    let st = c
        .wait_update("cl", 1, Duration::from_secs(30))
        .await
        .unwrap();
    assert_eq!(st.state, UpdateState::Committed, "{st:?}");
}

#[tokio::test]
async fn a_rendezvous_write_by_another_claim_is_refused_without_echoing_the_holders_claim() {
    let url = start(GatewayConfig::default()).await;
    let c = Client::new(&url, None).unwrap().with_retries(0);
    running(&c, "kv").await;
    let e = c
        .put_kv(
            "kv",
            "rdv.infer.0.0",
            json!({"incarnation": "ffffffffffffffff", "transport": {"port": 9}}),
        )
        .await
        .unwrap_err();
    assert_eq!(e.status(), Some(409), "{e}");
    assert!(!e.to_string().contains(I_CLAIM), "{e}");
    let kv = c
        .get_kv("kv", "rdv.infer.0.0", Duration::ZERO)
        .await
        .unwrap();
    assert_eq!(kv.value, json!({"transport": {"port": 1}}));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rank_whose_process_died_is_listed_missing_not_the_live_rank_that_waited_for_it() {
    use awex_control::wire::RankReportState;
    let url = start(GatewayConfig::default()).await;
    let c = Client::new(&url, None).unwrap().with_retries(0);
    let mut req = connect_request("gone", 1, 1, 1);
    req.options.update_deadline_ms = 2_000;
    c.connect(&req).await.unwrap();
    let join = |side, rank, claim: &str| JoinRequest {
        side,
        rank,
        info: json!({"incarnation": claim, "pid": 4242}),
        capabilities: vec![],
    };
    let (jt, ji) = (join(T.0, T.1, T_CLAIM), join(I.0, I.1, I_CLAIM));
    let (a, b) = tokio::join!(c.join("gone", &jt), c.join("gone", &ji));
    let after = a.unwrap().last_event_seq;
    b.unwrap();
    // the training rank waits for work with its poll open, as a live rank does
    let live = {
        let c = Client::new(&url, None).unwrap().with_retries(0);
        tokio::spawn(async move {
            let mut after = after;
            loop {
                match c
                    .events_as("gone", after, Duration::from_secs(30), Some(T_CLAIM))
                    .await
                {
                    Ok(r) => after = r.last_seq,
                    Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
                }
            }
        })
    };
    // the inference rank's process dies while its poll is open: the connection closes
    let dying = {
        let c = Client::new(&url, None).unwrap().with_retries(0);
        tokio::spawn(async move {
            let _ = c
                .events_as("gone", after, Duration::from_secs(30), Some(I_CLAIM))
                .await;
        })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    dying.abort();
    let _ = dying.await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    c.start_update("gone", 1).await.unwrap();
    let st = c
        .wait_update("gone", 1, Duration::from_secs(120))
        .await
        .unwrap();
    live.abort();
    assert_eq!(st.state, UpdateState::Failed, "{st:?}");
    let error = st.error.unwrap_or_default();
    assert!(
        error.contains("1 of 2 ranks are gone without reporting: inference rank 0/0"),
        "{error}"
    );
    assert!(
        error.contains("1 live that did not report waited for them: training rank 0"),
        "{error}"
    );
    let missing: Vec<_> = st
        .ranks
        .iter()
        .filter(|r| r.state == RankReportState::Missing)
        .map(|r| r.side)
        .collect();
    assert_eq!(missing, vec![Side::Inference], "{:?}", st.ranks);
}

/// Joins `slot` of `name` as a process that is not its holder: a made-up claim id, its `info`
/// otherwise the holder's (as a token holder copies it from the rendezvous value).
fn intruder(side: Side, rank: RankId) -> JoinRequest {
    JoinRequest {
        side,
        rank,
        info: json!({"incarnation": "1ntruder00000000", "pid": 999, "transport": {"port": 1}}),
        capabilities: vec![],
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_holder_keeps_its_slot_a_gone_one_changes_hands_and_its_version_fails() {
    let url = start(GatewayConfig::default()).await;
    let c = Client::new(&url, None).unwrap().with_retries(0);
    running(&c, "silent").await;
    // the inference rank polled once (answered), then went silent, as a SIGSTOPped process:
    // far past the 15 s a holder used to count as live without a poll
    let polled = c
        .events_as("silent", 0, Duration::ZERO, Some(I_CLAIM))
        .await
        .unwrap();
    assert!(!polled.events.is_empty());
    tokio::time::sleep(Duration::from_secs(16)).await;
    let e = c.join("silent", &intruder(I.0, I.1)).await.unwrap_err();
    assert_eq!(e.status(), Some(409), "{e}");
    let msg = e.to_string();
    assert!(
        msg.contains("inference rank 0/0 is held by a live process (pid 4242)"),
        "{msg}"
    );
    assert!(!msg.contains(I_CLAIM) && !msg.contains("1ntruder"), "{msg}");
    let st = c.update_status("silent", 1).await.unwrap();
    assert_eq!(st.state, UpdateState::Running, "{st:?}");

    // the holder's process dies with its poll open: its connection closes unanswered. (The
    // poll must have reached the gateway before it dies: each round waits longer for that.)
    let last = c
        .events("silent", 0, Duration::ZERO)
        .await
        .unwrap()
        .last_seq;
    let mut joined = None;
    for round in 1..=20u64 {
        let dying = {
            let c = Client::new(&url, None).unwrap().with_retries(0);
            tokio::spawn(async move {
                let _ = c
                    .events_as("silent", last, Duration::from_secs(30), Some(I_CLAIM))
                    .await;
            })
        };
        tokio::time::sleep(Duration::from_millis(100 * round)).await;
        // while the holder's poll is open, the slot is held
        let e = c.join("silent", &intruder(I.0, I.1)).await.unwrap_err();
        assert_eq!(e.status(), Some(409), "{e}");
        dying.abort();
        let _ = dying.await;
        tokio::time::sleep(Duration::from_millis(100 * round)).await;
        match c.join("silent", &intruder(I.0, I.1)).await {
            Ok(r) => {
                joined = Some(r);
                break;
            }
            Err(e) if e.status() == Some(409) => {}
            Err(e) => panic!("{e}"),
        }
    }
    assert!(joined.is_some(), "the gone holder's slot was never free");
    // the version announced to the dead holder failed as it died (before the takeover)
    let st = c.update_status("silent", 1).await.unwrap();
    assert_eq!(st.state, UpdateState::Failed, "{st:?}");
    assert_eq!(
        st.error.as_deref(),
        Some(
            "version 1 attempt 1 failed: inference rank 0/0 is gone without reporting: its event poll's connection closed (the process, pid 4242, died or was cut off), so this version cannot commit; start the rank again and retry the version"
        )
    );
    // the replaced holder's report changes nothing
    let e = c
        .report("silent", 1, &report(I.0, I.1, true, Some(I_CLAIM)))
        .await
        .unwrap_err();
    assert_eq!(e.status(), Some(409), "{e}");
}

#[tokio::test]
async fn the_operator_releases_a_silent_holders_slot_and_only_then_it_changes_hands() {
    use awex_control::wire::ReleaseSlot;
    let url = start(GatewayConfig::default()).await;
    let c = Client::new(&url, None).unwrap().with_retries(0);
    running(&c, "rel").await;
    let e = c.join("rel", &intruder(T.0, T.1)).await.unwrap_err();
    assert_eq!(e.status(), Some(409), "{e}");
    let r = c
        .release_slot(
            "rel",
            &ReleaseSlot {
                side: T.0,
                rank: T.1,
            },
        )
        .await
        .unwrap();
    assert_eq!(r.holder_pid, Some(4242));
    c.join("rel", &intruder(T.0, T.1)).await.unwrap();
    let st = c.update_status("rel", 1).await.unwrap();
    assert_eq!(st.state, UpdateState::Failed, "{st:?}");
    assert!(
        st.error
            .as_deref()
            .unwrap_or_default()
            .contains("training rank 0 changed hands while it ran: the process it was announced to (pid 4242) was replaced by pid 999 (the operator released the slot)"),
        "{st:?}"
    );
    // a rank outside the pair, and a pair without the slot's holder
    let e = c
        .release_slot(
            "rel",
            &ReleaseSlot {
                side: Side::Training,
                rank: RankId::train(5),
            },
        )
        .await
        .unwrap_err();
    assert_eq!(e.status(), Some(422), "{e}");
    c.connect(&connect_request("empty", 1, 1, 1)).await.unwrap();
    let e = c
        .release_slot(
            "empty",
            &ReleaseSlot {
                side: T.0,
                rank: T.1,
            },
        )
        .await
        .unwrap_err();
    assert_eq!(
        (e.status(), e.to_string()),
        (
            Some(409),
            "gateway answered 409: training rank 0 of pair `empty` has not joined: there is no holder to release; start the rank".to_string()
        )
    );
}

#[tokio::test]
async fn a_claim_id_never_travels_in_a_url() {
    let url = start(GatewayConfig::default()).await;
    let c = Client::new(&url, None).unwrap().with_retries(0);
    running(&c, "url").await;
    // the gateway refuses one in the query, naming the header
    let http = reqwest::Client::new();
    let resp = http
        .get(format!(
            "{url}/v1/pairs/url/events?after=0&timeout_ms=0&incarnation={I_CLAIM}"
        ))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status().as_u16(), 400);
    let body: serde_json::Value = serde_json::from_slice(&resp.bytes().await.unwrap()).unwrap();
    assert_eq!(
        body["error"],
        "`incarnation` does not belong in the URL, where it would be logged: send the rank's claim id in the `awex-claim` header"
    );
    // the typed client sends it as a header: an error naming the URL names no claim id
    let closed = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap()
    };
    let gone = Client::new(&format!("http://{closed}"), None)
        .unwrap()
        .with_retries(0);
    let e = gone
        .events_as("url", 0, Duration::ZERO, Some(I_CLAIM))
        .await
        .unwrap_err();
    assert!(
        e.to_string().contains("/v1/pairs/url/events?after=0"),
        "{e}"
    );
    assert!(!e.to_string().contains(I_CLAIM), "{e}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rank_that_dies_during_an_update_fails_it_at_once_not_at_its_deadline() {
    let url = start(GatewayConfig::default()).await;
    let c = Client::new(&url, None).unwrap().with_retries(0);
    let mut req = connect_request("dies", 1, 1, 1);
    // far beyond the test's own wait: only the death can end the version in time
    req.options.update_deadline_ms = 3_600_000;
    c.connect(&req).await.unwrap();
    let join = |side, rank, claim: &str| JoinRequest {
        side,
        rank,
        info: json!({"incarnation": claim, "pid": 4242}),
        capabilities: vec![],
    };
    let (jt, ji) = (join(T.0, T.1, T_CLAIM), join(I.0, I.1, I_CLAIM));
    let (a, b) = tokio::join!(c.join("dies", &jt), c.join("dies", &ji));
    a.unwrap();
    b.unwrap();
    c.start_update("dies", 1).await.unwrap();
    let last = c.events("dies", 0, Duration::ZERO).await.unwrap().last_seq;
    // the inference rank moves its bytes with its watcher's poll open, and dies
    for round in 1..=20u64 {
        let dying = {
            let c = Client::new(&url, None).unwrap().with_retries(0);
            tokio::spawn(async move {
                let _ = c
                    .events_as("dies", last, Duration::from_secs(30), Some(I_CLAIM))
                    .await;
            })
        };
        tokio::time::sleep(Duration::from_millis(100 * round)).await;
        dying.abort();
        let _ = dying.await;
        let st = c
            .wait_update("dies", 1, Duration::from_millis(100 * round))
            .await;
        if let Ok(st) = st
            && st.state == UpdateState::Failed
        {
            assert_eq!(
                st.error.as_deref(),
                Some(
                    "version 1 attempt 1 failed: inference rank 0/0 is gone without reporting: its event poll's connection closed (the process, pid 4242, died or was cut off), so this version cannot commit; start the rank again and retry the version"
                )
            );
            return;
        }
    }
    panic!("the version did not fail when its rank's process died");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_presence_poll_is_held_through_events_and_ends_with_the_disconnect() {
    let url = start(GatewayConfig::default()).await;
    let c = Client::new(&url, None).unwrap().with_retries(0);
    running(&c, "pres").await;
    let held = {
        let c = Client::new(&url, None).unwrap().with_retries(0);
        tokio::spawn(async move { c.presence("pres", I_CLAIM, Duration::from_secs(60)).await })
    };
    // events come (a failed attempt, its abort, a retry): the presence poll stays open
    c.report("pres", 1, &report(T.0, T.1, false, Some(T_CLAIM)))
        .await
        .unwrap();
    c.start_update("pres", 1).await.unwrap();
    let seen = c.events("pres", 0, Duration::ZERO).await.unwrap();
    assert!(seen.events.len() >= 3, "{seen:?}");
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(!held.is_finished(), "a presence poll answered an event");
    c.disconnect("pres").await.unwrap();
    let e = held.await.unwrap().unwrap_err();
    assert_eq!(e.status(), Some(410), "{e}");
}

/// The process that reported the running version received, in place, takes its own slot over
/// (as `awex.sglang.receive` does when it recreates its Reader for storage the engine rebound):
/// the version stands and commits. The same takeover before its report, or by another process
/// after it, fails the version.
#[tokio::test]
async fn a_process_taking_its_own_slot_over_after_its_report_keeps_the_version_others_fail_it() {
    use awex_control::wire::ReleaseSlot;
    let url = start(GatewayConfig::default()).await;
    let c = Client::new(&url, None).unwrap().with_retries(0);
    let rejoin = |pid: u64| JoinRequest {
        side: I.0,
        rank: I.1,
        info: json!({"incarnation": "c1a1m000000000n2", "pid": pid, "transport": {"port": 2}}),
        capabilities: vec![],
    };
    let release = ReleaseSlot {
        side: I.0,
        rank: I.1,
    };
    // (name, reported before the takeover, the new holder's pid) -> the version's state
    for (name, reported, pid, want) in [
        ("own", true, 4242, UpdateState::Committed),
        ("early", false, 4242, UpdateState::Failed),
        ("other", true, 777, UpdateState::Failed),
    ] {
        running(&c, name).await;
        if reported {
            c.report(name, 1, &report(I.0, I.1, true, Some(I_CLAIM)))
                .await
                .unwrap();
        }
        c.release_slot(name, &release).await.unwrap();
        c.join(name, &rejoin(pid)).await.unwrap();
        if want == UpdateState::Committed {
            c.report(name, 1, &report(T.0, T.1, true, Some(T_CLAIM)))
                .await
                .unwrap();
        }
        let st = c.update_status(name, 1).await.unwrap();
        assert_eq!(st.state, want, "{name}: {st:?}");
        if want == UpdateState::Failed {
            assert!(
                st.error
                    .as_deref()
                    .unwrap_or_default()
                    .contains("inference rank 0/0 changed hands while it ran"),
                "{name}: {st:?}"
            );
        }
    }
}
