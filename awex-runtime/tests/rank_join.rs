//! Ranks against a gateway in process: a mis-started duplicate of a live rank (the wrong
//! transport, the wrong bucket size) refuses itself before it publishes anything, so the live
//! pair keeps updating; the pair secret reaches ranks in the join answer only. Every wait is
//! bounded.

#[path = "shared/ranks.rs"]
mod ranks;

use awex_control::client::Client;
use awex_control::wire::PairOptions;
use awex_core::Transport;
use awex_core::layout::{RankId, Side};
use awex_runtime::rank::{RankConfig, rendezvous_key};
use ranks::{gateway, join};
use std::time::Duration;

fn cfg(gw: &str, side: Side, rank: RankId, transport: Transport, bucket_mib: u64) -> RankConfig {
    let mut c = ranks::cfg(gw, "dup", side, rank, transport, "sglang:tp=1");
    c.bucket_bytes = bucket_mib << 20;
    c
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_mis_started_duplicate_refuses_itself_without_touching_the_live_rank() {
    let gw = gateway().await;
    let client = Client::new(&gw, None).unwrap();
    let options = PairOptions {
        bucket_mib: 1,
        update_deadline_ms: 20_000,
        ..PairOptions::default()
    };
    let st = ranks::connect(&client, "dup", Transport::Tcp, "sglang:tp=1", options).await;
    assert_eq!(st.uid.len(), 32, "a connect uid");
    let (t, i) = (RankId::train(0), RankId::infer(0, 0));
    let (a, b) = tokio::join!(
        join(cfg(&gw, Side::Training, t, Transport::Tcp, 1)),
        join(cfg(&gw, Side::Inference, i, Transport::Tcp, 1)),
    );
    let (mut trainer, mut reader) = (a.unwrap(), b.unwrap());
    let secret = trainer
        .joined
        .secret
        .clone()
        .expect("the join answer carries the secret");
    assert_eq!(secret.0.len(), 64);
    assert!(
        !format!("{:?}", trainer.joined).contains(&secret.0),
        "Debug redacts it"
    );
    let status = serde_json::to_string(&client.status("dup").await.unwrap()).unwrap();
    assert!(!status.contains(&secret.0), "never in status");

    let key = rendezvous_key(Side::Inference, i);
    let before = client
        .get_kv("dup", &key, Duration::ZERO)
        .await
        .unwrap()
        .value;
    // duplicates of the live inference rank: the wrong transport, the wrong bucket size
    let e = join(cfg(&gw, Side::Inference, i, Transport::Shm, 1))
        .await
        .err()
        .unwrap();
    assert!(
        e.contains("uses transport tcp but this rank was started with shm"),
        "{e}"
    );
    let e = join(cfg(&gw, Side::Inference, i, Transport::Tcp, 2))
        .await
        .err()
        .unwrap();
    assert!(e.contains("bucket_mib"), "{e}");
    // ... and one given an FP8 inference side the pair was not connected with
    let mut fp8 = cfg(&gw, Side::Inference, i, Transport::Tcp, 1);
    fp8.infer_fp8 = Some(
        awex_core::encoding::InferFp8::new(
            awex_core::encoding::Fp8Config::from_hf(&serde_json::json!({
                "quant_method": "fp8", "activation_scheme": "dynamic",
                "weight_block_size": [16, 16]
            }))
            .unwrap(),
            awex_core::encoding::Recipe::Vllm,
        )
        .unwrap(),
    );
    let e = join(fp8).await.err().unwrap();
    assert!(
        e.contains("pair `dup` stores its inference weights as plain (no FP8) but this rank was started with fp8 e4m3, 16x16 blocks, fp32 scales, recipe vllm"),
        "{e}"
    );
    let after = client
        .get_kv("dup", &key, Duration::ZERO)
        .await
        .unwrap()
        .value;
    assert_eq!(
        before, after,
        "the live rank's rendezvous value is untouched"
    );

    // and the live pair still updates, over authenticated tcp
    for version in 1..=2u64 {
        client.start_update("dup", version).await.unwrap();
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
            .wait_update("dup", version, Duration::from_secs(20))
            .await
            .unwrap();
        assert!(u.state.is_final(), "{u:?}");
        assert_eq!(
            client.status("dup").await.unwrap().serving_version,
            Some(version)
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_step_answers_committed_timed_out_or_disconnected() {
    use awex_runtime::rank::Outcome;
    use std::time::Instant;
    let gw = gateway().await;
    let client = Client::new(&gw, None).unwrap();
    let options = PairOptions {
        bucket_mib: 1,
        update_deadline_ms: 20_000,
        ..PairOptions::default()
    };
    ranks::connect(&client, "steps", Transport::Tcp, "sglang:tp=1", options).await;
    let named = |side, rank| {
        let mut c = cfg(&gw, side, rank, Transport::Tcp, 1);
        c.pair = "steps".into();
        c
    };
    let (a, b) = tokio::join!(
        join(named(Side::Training, RankId::train(0))),
        join(named(Side::Inference, RankId::infer(0, 0))),
    );
    let (mut trainer, mut reader) = (a.unwrap(), b.unwrap());
    // no update started: the wait for work ends at the deadline
    let soon = Some(Instant::now() + Duration::from_millis(300));
    let o = trainer.step(soon, false, None, |_| Ok(())).await.unwrap();
    assert!(matches!(o, Outcome::TimedOut { work: None }), "{o:?}");
    // an update: both ranks see it commit, the hook sees the work first
    client.start_update("steps", 1).await.unwrap();
    let wait = Some(Duration::from_secs(20));
    let mut seen = None;
    let (x, y) = tokio::join!(
        trainer.step(None, true, wait, |w| {
            seen = Some(w);
            Ok(())
        }),
        reader.step(None, true, wait, |_| Ok(())),
    );
    for o in [x.unwrap(), y.unwrap()] {
        match o {
            Outcome::Committed { work, stats } => {
                assert_eq!((work.version, work.attempt), (1, 1));
                assert!(stats.bytes > 0, "{stats:?}");
            }
            o => panic!("{o:?}"),
        }
    }
    assert_eq!(seen.map(|w| w.version), Some(1));
    // a hook's error ends the step with it, before anything executes
    client.start_update("steps", 2).await.unwrap();
    let e = trainer
        .step(None, true, wait, |_| {
            Err(awex_runtime::rank::RankError::Layout(
                "refused by the hook".into(),
            ))
        })
        .await
        .unwrap_err();
    assert_eq!(e.to_string(), "layout: refused by the hook");
    // the pair goes away
    client.disconnect("steps").await.unwrap();
    let o = reader.step(None, true, wait, |_| Ok(())).await.unwrap();
    // (update 2 is skipped: the disconnect is queued behind it)
    assert!(matches!(o, Outcome::Disconnected), "{o:?}");
    // and says so on every later step, even one that would wait an hour for work (it does not
    // wait on a gone pair's stream); the bound only says it did not wait
    let hour = Some(Duration::from_secs(3600));
    let o = tokio::time::timeout(
        Duration::from_secs(120),
        reader.step(None, true, hour, |_| Ok(())),
    )
    .await
    .expect("a step of a disconnected rank does not wait")
    .unwrap();
    assert!(matches!(o, Outcome::Disconnected), "{o:?}");
}
