//! Engines joining and leaving a running pair over HTTP: an added engine is `joining` until its
//! ranks joined, sits out every version that started before, takes part in the next one whole
//! and is `serving` once it committed; a removed engine is left out of the version under way
//! (which commits on the others), its slots and rendezvous values are dropped and its ranks are
//! told; both are refused under commit policy `all`, and a removal that would leave too few
//! engines for the policy is refused.

mod gateway_common;

use awex_control::client::{Client, ClientError};
use awex_control::server::GatewayConfig;
use awex_control::wire::{
    CommitPolicy, ConnectRequest, EngineState, Event, EventKind, JoinRequest, PairState, Report,
    UpdateState,
};
use awex_core::{RankId, Side};
use gateway_common::{conforms, connect_request, start};
use serde_json::json;
use std::time::Duration;

fn jr(side: Side, rank: RankId) -> JoinRequest {
    JoinRequest {
        side,
        rank,
        info: json!({ "transport": { "port": 2000 + 10 * rank.engine + rank.rank }, "pid": 42 }),
        capabilities: Vec::new(),
    }
}

fn ok(side: Side, rank: RankId, attempt: u32) -> Report {
    Report {
        side,
        rank,
        ok: true,
        bytes: 10,
        checksum: None,
        error: None,
        attempt: Some(attempt),
        incarnation: None,
        delta: None,
        unreached: Vec::new(),
    }
}

const T0: RankId = RankId { engine: 0, rank: 0 };

/// One training rank and `slots` engine slots of one rank, the last `spare` empty.
fn fleet(name: &str, slots: u32, spare: u32, commit: CommitPolicy) -> ConnectRequest {
    let mut req = connect_request(name, 1, slots, 1);
    req.inference.spare = spare;
    req.options.commit = commit;
    req
}

/// The `update` event of `version`.
async fn update_event(c: &Client, name: &str, version: u64) -> Event {
    let r = c.events(name, 0, Duration::ZERO).await.unwrap();
    r.events
        .into_iter()
        .rev()
        .find(|e| e.kind == EventKind::Update && e.version == Some(version))
        .expect("the version's update event")
}

/// Starts `version`, reports success from the training rank and `engines`, waits for the end.
async fn run(c: &Client, name: &str, version: u64, engines: &[u32]) -> UpdateState {
    c.start_update(name, version).await.unwrap();
    c.report(name, version, &ok(Side::Training, T0, 1))
        .await
        .unwrap();
    for &e in engines {
        c.report(name, version, &ok(Side::Inference, RankId::infer(e, 0), 1))
            .await
            .unwrap();
    }
    c.wait_update(name, version, Duration::from_secs(120))
        .await
        .unwrap()
        .state
}

fn states(st: &awex_control::wire::PairStatus) -> Vec<(EngineState, Option<u64>)> {
    st.engines
        .iter()
        .map(|e| (e.state, e.serving_version))
        .collect()
}

#[tokio::test]
async fn an_engine_added_mid_run_sits_out_until_its_ranks_joined_then_catches_up_whole() {
    let c = Client::new(&start(GatewayConfig::default()).await, None).unwrap();
    let name = "grow";
    c.connect(&fleet(name, 3, 1, CommitPolicy::Available))
        .await
        .unwrap();
    // the pair is ready without the spare slot's rank
    c.join_once(name, &jr(Side::Training, T0), Duration::ZERO)
        .await
        .unwrap();
    c.join_once(
        name,
        &jr(Side::Inference, RankId::infer(0, 0)),
        Duration::ZERO,
    )
    .await
    .unwrap();
    let r = c
        .join(name, &jr(Side::Inference, RankId::infer(1, 0)))
        .await
        .unwrap();
    assert_eq!(r.roster.len(), 3);
    assert_eq!(r.engines, 3, "every rank plans against every slot");
    let st = c.status(name).await.unwrap();
    assert_eq!(st.state, PairState::Ready);
    assert_eq!(st.engines[2].state, EngineState::Absent);
    // a rank of a free slot is refused, saying how to add its engine
    let e = c
        .join(name, &jr(Side::Inference, RankId::infer(2, 0)))
        .await
        .unwrap_err();
    assert_eq!(e.status(), Some(409), "{e}");
    assert!(e.to_string().contains("add the engine first"), "{e}");
    assert_eq!(run(&c, name, 1, &[0, 1]).await, UpdateState::Committed);
    assert_eq!(update_event(&c, name, 1).await.engines, vec![2]);
    let m = c.metrics().await.unwrap();
    for line in [
        "awex_gateway_engines{state=\"serving\"} 2",
        "awex_gateway_engines{state=\"absent\"} 1",
    ] {
        assert!(m.lines().any(|l| l == line), "{line} not in\n{m}");
    }

    // added: joining; a version that starts before its ranks joined goes on without it
    let added = c.add_engine(name, None).await.unwrap();
    conforms("EngineChanged", &serde_json::to_value(&added).unwrap()).unwrap();
    assert_eq!((added.engine, added.ranks), (2, 1));
    assert_eq!(added.status.state, EngineState::Joining);
    assert!(added.status.behind_since_unix_ms.is_some());
    assert_eq!(run(&c, name, 2, &[0, 1]).await, UpdateState::Committed);
    assert_eq!(update_event(&c, name, 2).await.engines, vec![2]);
    let st = c.status(name).await.unwrap();
    assert_eq!(
        states(&st),
        vec![
            (EngineState::Serving, Some(2)),
            (EngineState::Serving, Some(2)),
            (EngineState::Joining, None)
        ]
    );
    // its rank joins the ready pair at once, with every rank's info
    let r = c
        .join(name, &jr(Side::Inference, RankId::infer(2, 0)))
        .await
        .unwrap();
    assert_eq!(r.roster.len(), 4);
    // the next version takes it in: catching up while it runs, serving once committed
    c.start_update(name, 3).await.unwrap();
    assert!(update_event(&c, name, 3).await.engines.is_empty());
    let st = c.status(name).await.unwrap();
    assert_eq!(st.engines[2].state, EngineState::CatchingUp);
    for (side, rank) in [
        (Side::Training, T0),
        (Side::Inference, RankId::infer(0, 0)),
        (Side::Inference, RankId::infer(1, 0)),
    ] {
        c.report(name, 3, &ok(side, rank, 1)).await.unwrap();
    }
    // it is a member now: the version waits for it
    let st = c.update_status(name, 3).await.unwrap();
    assert_eq!(st.state, UpdateState::Running);
    c.report(name, 3, &ok(Side::Inference, RankId::infer(2, 0), 1))
        .await
        .unwrap();
    let st = c
        .wait_update(name, 3, Duration::from_secs(120))
        .await
        .unwrap();
    assert_eq!(st.state, UpdateState::Committed);
    assert!(st.left_out.is_empty(), "{:?}", st.left_out);
    let st = c.status(name).await.unwrap();
    assert_eq!(
        states(&st),
        vec![(EngineState::Serving, Some(3)); 3],
        "{:?}",
        st.engines
    );
    assert_eq!(st.engines[2].behind_since_unix_ms, None);
    // no slot is free now
    let e = c.add_engine(name, None).await.unwrap_err();
    assert_eq!(e.status(), Some(409), "{e}");
    assert!(e.to_string().contains("inference.spare"), "{e}");
    let e = c.add_engine(name, Some(7)).await.unwrap_err();
    assert_eq!(e.status(), Some(422), "{e}");
}

#[tokio::test]
async fn an_engine_removed_mid_update_is_left_out_and_its_slots_are_freed() {
    let c = Client::new(&start(GatewayConfig::default()).await, None).unwrap();
    let name = "shrink";
    c.connect(&fleet(name, 3, 0, CommitPolicy::Quorum(2)))
        .await
        .unwrap();
    c.join_once(name, &jr(Side::Training, T0), Duration::ZERO)
        .await
        .unwrap();
    for e in 0..2 {
        c.join_once(
            name,
            &jr(Side::Inference, RankId::infer(e, 0)),
            Duration::ZERO,
        )
        .await
        .unwrap();
    }
    c.join(name, &jr(Side::Inference, RankId::infer(2, 0)))
        .await
        .unwrap();
    c.put_kv(name, "rdv.infer.1.0", json!({"transport": {"port": 2010}}))
        .await
        .unwrap();
    assert_eq!(run(&c, name, 1, &[0, 1, 2]).await, UpdateState::Committed);

    // removed while version 2 runs: left out of it, which commits on the other two
    c.start_update(name, 2).await.unwrap();
    let after = c.status(name).await.unwrap().last_event_seq;
    let removed = c.remove_engine(name, 1).await.unwrap();
    assert_eq!(removed.status.state, EngineState::Absent);
    let evs = c.events(name, after, Duration::ZERO).await.unwrap().events;
    let kinds: Vec<(EventKind, Vec<u32>)> =
        evs.iter().map(|e| (e.kind, e.engines.clone())).collect();
    assert_eq!(
        kinds,
        vec![
            (EventKind::LeftOut, vec![1]),
            (EventKind::EngineRemoved, vec![1])
        ]
    );
    for (side, rank) in [
        (Side::Training, T0),
        (Side::Inference, RankId::infer(0, 0)),
        (Side::Inference, RankId::infer(2, 0)),
    ] {
        c.report(name, 2, &ok(side, rank, 1)).await.unwrap();
    }
    let st = c
        .wait_update(name, 2, Duration::from_secs(120))
        .await
        .unwrap();
    assert_eq!(st.state, UpdateState::Committed);
    // its slot is free: roster entry and rendezvous value gone, its rank refused
    let st = c.status(name).await.unwrap();
    assert_eq!(
        states(&st),
        vec![
            (EngineState::Serving, Some(2)),
            (EngineState::Absent, None),
            (EngineState::Serving, Some(2))
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
    let e = c
        .put_kv(name, "rdv.infer.1.0", json!({"transport": {}}))
        .await
        .unwrap_err();
    assert_eq!(e.status(), Some(409), "{e}");
    // the next version runs without it from its start
    assert_eq!(run(&c, name, 3, &[0, 2]).await, UpdateState::Committed);
    assert_eq!(update_event(&c, name, 3).await.engines, vec![1]);
    // quorum:2 with two engines left: removing one more is refused, and changes nothing
    let e = c.remove_engine(name, 2).await.unwrap_err();
    assert_eq!(e.status(), Some(409), "{e}");
    assert!(e.to_string().contains("needs 2"), "{e}");
    let e = c.remove_engine(name, 1).await.unwrap_err();
    assert_eq!(e.status(), Some(409), "{e}");
    let e = c.remove_engine(name, 9).await.unwrap_err();
    assert_eq!(e.status(), Some(404), "{e}");
    // added again in its old slot: a fresh engine that joins behind
    let added = c.add_engine(name, Some(1)).await.unwrap();
    assert_eq!(added.status.state, EngineState::Joining);
    assert_eq!(added.status.serving_version, None);
}

#[tokio::test]
async fn commit_policy_all_refuses_engines_joining_or_leaving_and_spare_slots() {
    let c = Client::new(&start(GatewayConfig::default()).await, None).unwrap();
    let e = c
        .connect(&fleet("spare-all", 2, 1, CommitPolicy::All))
        .await
        .unwrap_err();
    assert_eq!(e.status(), Some(422), "{e}");
    assert!(
        e.to_string()
            .contains("needs a commit policy other than `all`"),
        "{e}"
    );
    let e = c
        .connect(&fleet("spare-q", 3, 2, CommitPolicy::Quorum(2)))
        .await
        .unwrap_err();
    assert_eq!(e.status(), Some(422), "{e}");
    let e = c
        .connect(&fleet("spare-many", 2, 2, CommitPolicy::Available))
        .await
        .unwrap_err();
    assert_eq!(e.status(), Some(422), "{e}");
    c.connect(&fleet("all", 2, 0, CommitPolicy::All))
        .await
        .unwrap();
    for e in [
        c.add_engine("all", None).await.unwrap_err(),
        c.remove_engine("all", 1).await.unwrap_err(),
    ] {
        assert_eq!(e.status(), Some(409), "{e}");
        assert!(e.to_string().contains("commit policy `all`"), "{e}");
    }
    let st = c.status("all").await.unwrap();
    assert!(st.engines.iter().all(|e| e.state == EngineState::Serving));
    // the GPU transports leave no engine out of a version: no spare slot, no join or leave
    let mut req = fleet("spare-nccl", 2, 1, CommitPolicy::Available);
    req.transport = awex_control::wire::Transport::Nccl;
    let e = c.connect(&req).await.unwrap_err();
    assert_eq!(e.status(), Some(422), "{e}");
    assert!(
        e.to_string()
            .contains("engines join and leave pairs over shm and tcp"),
        "{e}"
    );
    req.inference.spare = 0;
    c.connect(&req).await.unwrap();
    let e = c.remove_engine("spare-nccl", 1).await.unwrap_err();
    assert_eq!(e.status(), Some(409), "{e}");
    assert!(e.to_string().contains("over shm and tcp"), "{e}");
    let e: ClientError = c.remove_engine("nope", 0).await.unwrap_err();
    assert_eq!(e.status(), Some(404), "{e}");
}

#[tokio::test]
async fn a_delta_base_lists_only_engines_taking_part_and_an_added_one_gets_every_byte() {
    use awex_control::wire::{DeltaBase, ReportDelta};
    let c = Client::new(&start(GatewayConfig::default()).await, None).unwrap();
    let name = "grow-deltas";
    let mut req = fleet(name, 3, 1, CommitPolicy::Available);
    req.options.deltas = true;
    c.connect(&req).await.unwrap();
    let claim = |e: u32| format!("{:016x}", 100 + e);
    let join = |side: Side, rank: RankId, claim: String| JoinRequest {
        side,
        rank,
        info: json!({ "incarnation": claim }),
        capabilities: Vec::new(),
    };
    c.join_once(name, &join(Side::Training, T0, claim(99)), Duration::ZERO)
        .await
        .unwrap();
    c.join_once(
        name,
        &join(Side::Inference, RankId::infer(0, 0), claim(0)),
        Duration::ZERO,
    )
    .await
    .unwrap();
    c.join(name, &join(Side::Inference, RankId::infer(1, 0), claim(1)))
        .await
        .unwrap();
    let held = |side: Side, rank: RankId, who: String| Report {
        incarnation: Some(who),
        delta: Some(ReportDelta {
            dense_bytes: 16,
            elements: 8,
            changed: 1,
            holds: true,
        }),
        ..ok(side, rank, 1)
    };
    let run = |v: u64, engines: Vec<u32>| {
        let c = c.clone();
        async move {
            c.start_update(name, v).await.unwrap();
            c.report(name, v, &held(Side::Training, T0, claim(99)))
                .await
                .unwrap();
            for e in engines {
                c.report(
                    name,
                    v,
                    &held(Side::Inference, RankId::infer(e, 0), claim(e)),
                )
                .await
                .unwrap();
            }
            c.wait_update(name, v, Duration::from_secs(120))
                .await
                .unwrap()
                .state
        }
    };
    assert_eq!(run(1, vec![0, 1]).await, UpdateState::Committed);
    assert_eq!(run(2, vec![0, 1]).await, UpdateState::Committed);
    // the spare slot takes no part: every rank that does holds version 1
    assert_eq!(
        update_event(&c, name, 2).await.base,
        Some(DeltaBase {
            version: 1,
            except: vec![]
        })
    );
    c.add_engine(name, None).await.unwrap();
    c.join(name, &join(Side::Inference, RankId::infer(2, 0), claim(2)))
        .await
        .unwrap();
    assert_eq!(run(3, vec![0, 1, 2]).await, UpdateState::Committed);
    // the added engine's rank holds nothing: it gets every byte, the others a delta
    assert_eq!(
        update_event(&c, name, 3).await.base,
        Some(DeltaBase {
            version: 2,
            except: vec![RankId::infer(2, 0)]
        })
    );
}
