//! Delta bases at the gateway (`options.deltas`): each `update` event names the version the
//! inference ranks provably hold (those that reported the version before it applied whole and
//! kept as received, as the process that holds the slot now) and lists every other inference
//! rank in `except`; a pair without deltas announces no base.

mod gateway_common;

use awex_control::client::Client;
use awex_control::server::GatewayConfig;
use awex_control::wire::{DeltaBase, EventKind, JoinRequest, Report, ReportDelta, UpdateState};
use awex_core::{RankId, Side};
use gateway_common::{connect_request, start};
use serde_json::json;
use std::time::Duration;

const T: RankId = RankId::train(0);
const I: [RankId; 3] = [
    RankId::infer(0, 0),
    RankId::infer(1, 0),
    RankId::infer(2, 0),
];

fn claim(side: Side, rank: RankId) -> String {
    format!(
        "{:016x}",
        (side == Side::Training) as u64 * 1000 + rank.engine as u64 * 10 + 7
    )
}

fn report(side: Side, rank: RankId, ok: bool, holds: bool) -> Report {
    Report {
        side,
        rank,
        ok,
        bytes: 8,
        checksum: None,
        error: (!ok).then(|| "peer reset".to_string()),
        attempt: None,
        incarnation: Some(claim(side, rank)),
        delta: ok.then_some(ReportDelta {
            dense_bytes: 16,
            elements: 8,
            changed: 1,
            holds,
        }),
        unreached: Vec::new(),
    }
}

async fn join_all(client: &Client, pair: &str) {
    let mut all = vec![(Side::Training, T)];
    all.extend(I.iter().map(|r| (Side::Inference, *r)));
    // a join answers once every rank joined: all at once
    let joins: Vec<_> = all
        .into_iter()
        .map(|(side, rank)| {
            let (c, pair) = (client.clone(), pair.to_string());
            tokio::spawn(async move {
                c.join(
                    &pair,
                    &JoinRequest {
                        side,
                        rank,
                        info: json!({"incarnation": claim(side, rank)}),
                        capabilities: vec![],
                    },
                )
                .await
                .unwrap()
            })
        })
        .collect();
    for j in joins {
        j.await.unwrap();
    }
}

/// The base announced with the `update` event of version `v`.
async fn announced(client: &Client, pair: &str, v: u64) -> Option<DeltaBase> {
    let evs = client.events(pair, 0, Duration::ZERO).await.unwrap().events;
    let ev = evs
        .iter()
        .rev()
        .find(|e| e.kind == EventKind::Update && e.version == Some(v))
        .expect("the update event");
    ev.base.clone()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn update_events_name_the_base_every_inference_rank_provably_holds() {
    let base = start(GatewayConfig::default()).await;
    let client = Client::new(&base, None).unwrap();
    let mut req = connect_request("d", 1, 3, 1);
    req.options.deltas = true;
    let st = client.connect(&req).await.unwrap();
    assert!(st.options.deltas);
    join_all(&client, "d").await;

    // version 1: nothing held yet
    client.start_update("d", 1).await.unwrap();
    assert_eq!(announced(&client, "d", 1).await, None);
    client
        .report("d", 1, &report(Side::Training, T, true, false))
        .await
        .unwrap();
    client
        .report("d", 1, &report(Side::Inference, I[0], true, true))
        .await
        .unwrap();
    client
        .report("d", 1, &report(Side::Inference, I[1], true, true))
        .await
        .unwrap();
    // an engine whose loader rewrites its weights keeps nothing a delta could apply to
    client
        .report("d", 1, &report(Side::Inference, I[2], true, false))
        .await
        .unwrap();
    let u = client.update_status("d", 1).await.unwrap();
    assert_eq!(u.state, UpdateState::Committed);
    let t = u.delta.expect("the ranks' delta figures");
    assert_eq!(
        (
            t.dense_bytes.inference,
            t.elements.inference,
            t.changed.inference
        ),
        (48, 24, 3)
    );

    // version 2: deltas against 1 for the two that hold it; one of them fails
    client.start_update("d", 2).await.unwrap();
    let want = DeltaBase {
        version: 1,
        except: vec![I[2]],
    };
    assert_eq!(announced(&client, "d", 2).await, Some(want.clone()));
    assert_eq!(client.update_status("d", 2).await.unwrap().base, Some(want));
    client
        .report("d", 2, &report(Side::Inference, I[0], true, true))
        .await
        .unwrap();
    client
        .report("d", 2, &report(Side::Inference, I[1], false, false))
        .await
        .unwrap();
    assert_eq!(
        client.update_status("d", 2).await.unwrap().state,
        UpdateState::Failed
    );

    // version 3: rank 0/0 applied 2 whole before it failed elsewhere; the failed rank may be
    // torn and the rewriting engine holds nothing: both get every byte
    client.start_update("d", 3).await.unwrap();
    assert_eq!(
        announced(&client, "d", 3).await,
        Some(DeltaBase {
            version: 2,
            except: vec![I[1], I[2]],
        })
    );

    // a pair without deltas announces no base
    let req = connect_request("n", 1, 3, 1);
    client.connect(&req).await.unwrap();
    join_all(&client, "n").await;
    client.start_update("n", 1).await.unwrap();
    for r in std::iter::once((Side::Training, T)).chain(I.iter().map(|r| (Side::Inference, *r))) {
        let mut rep = report(r.0, r.1, true, true);
        rep.delta = None;
        client.report("n", 1, &rep).await.unwrap();
    }
    client.start_update("n", 2).await.unwrap();
    assert_eq!(announced(&client, "n", 2).await, None);
}
