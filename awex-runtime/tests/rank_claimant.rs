//! A second live claimant of a rank slot, started with the right configuration (so it passes
//! every check a mis-started one fails), is refused by the gateway without touching the
//! holder: its join gets 409 naming the slot and the holder's pid, the holder's rendezvous value
//! and roster entry stay as they were, and the next update commits. A claimant whose holder is
//! known gone (its poll's connection closed) or whose slot the operator released takes the
//! slot over (`store::roster` unit tests, `awex-control/tests/gateway_claims.rs`).

#[path = "shared/ranks.rs"]
mod ranks;

use awex_control::client::Client;
use awex_control::server::{GatewayConfig, bind, serve};
use awex_control::wire::{PairOptions, UpdateState};
use awex_core::Transport;
use awex_core::layout::{RankId, Side};
use awex_runtime::rank::{RankConfig, rendezvous_key};
use ranks::join;
use std::time::Duration;

fn cfg(gw: &str, side: Side, rank: RankId) -> RankConfig {
    ranks::cfg(gw, "claim", side, rank, Transport::Tcp, "sglang:tp=1")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_second_live_claimant_is_refused_without_touching_the_holder() {
    let l = bind("127.0.0.1:0".parse().unwrap()).unwrap();
    let gw = format!("http://{}", l.local_addr().unwrap());
    tokio::spawn(serve(l, GatewayConfig::default()));
    let client = Client::new(&gw, None).unwrap();
    let options = PairOptions {
        bucket_mib: 1,
        update_deadline_ms: 20_000,
        ..PairOptions::default()
    };
    ranks::connect(&client, "claim", Transport::Tcp, "sglang:tp=1", options).await;
    let (t, i) = (RankId::train(0), RankId::infer(0, 0));
    let (a, b) = tokio::join!(
        join(cfg(&gw, Side::Training, t)),
        join(cfg(&gw, Side::Inference, i)),
    );
    let (mut trainer, mut reader) = (a.unwrap(), b.unwrap());
    let key = rendezvous_key(Side::Training, t);
    let kv_before = client.get_kv("claim", &key, Duration::ZERO).await.unwrap();
    let roster_before = client.status("claim").await.unwrap().roster;

    // the holder waits for work as an idle rank does: an event poll open with its claim id
    let idle = {
        let (c, me) = (client.clone(), trainer.incarnation().to_string());
        tokio::spawn(async move {
            loop {
                let _ = c
                    .events_as("claim", 0, Duration::from_secs(30), Some(&me))
                    .await;
            }
        })
    };
    // a duplicate of the live training rank, configured exactly like it: it retries for 20 s
    // and is refused
    let e = join(cfg(&gw, Side::Training, t)).await.err().unwrap();
    let pid = std::process::id();
    assert!(
        e.contains(&format!(
            "gateway answered 409: training rank 0 is held by a live process (pid {pid})"
        )),
        "{e}"
    );
    assert!(
        !e.contains(trainer.incarnation()),
        "the holder's claim id is never echoed: {e}"
    );
    assert!(e.contains("this second claimant"), "{e}");
    let kv_after = client.get_kv("claim", &key, Duration::ZERO).await.unwrap();
    assert_eq!(
        kv_after, kv_before,
        "the holder's rendezvous value is untouched"
    );
    assert_eq!(
        client.status("claim").await.unwrap().roster,
        roster_before,
        "the holder's roster entry is untouched"
    );
    // a put of the holder's rendezvous key by another process is refused too
    let mut forged = kv_before.value.clone();
    forged["incarnation"] = "0123456789abcdef".into();
    let e = client.put_kv("claim", &key, forged).await.unwrap_err();
    assert_eq!(e.status(), Some(409), "{e}");
    assert_eq!(
        client.get_kv("claim", &key, Duration::ZERO).await.unwrap(),
        kv_before
    );

    idle.abort();
    // and the next update commits, the holder and its peer untouched
    client.start_update("claim", 1).await.unwrap();
    let (x, y) = tokio::join!(
        async {
            let w = trainer.next_live_work().await.unwrap().unwrap();
            trainer.execute(w, true).await
        },
        async {
            let w = reader.next_live_work().await.unwrap().unwrap();
            reader.execute(w, true).await
        },
    );
    x.unwrap();
    y.unwrap();
    let u = client
        .wait_update("claim", 1, Duration::from_secs(20))
        .await
        .unwrap();
    assert_eq!(u.state, UpdateState::Committed, "{u:?}");
}
