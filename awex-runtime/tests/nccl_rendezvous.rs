//! The NCCL unique id's rendezvous through a gateway in process: the id is sealed with the pair
//! secret, so an injector that can write the pair's kv (everything about a pair but the secret
//! is public) cannot get a rank to build a communicator with it. A bare or forged id is
//! refused, the reader waits for the genuine one and takes it; an id replayed from another
//! attempt's key is refused; a reader that only ever sees forgeries fails, saying why. The
//! CPU build has no NCCL transport; this drives the read path every nccl rank uses
//! (`rank::read_checked_kv` with the transport's check, `open_uid`).

use awex_control::client::Client;
use awex_control::connect::connect_request;
use awex_control::server::{GatewayConfig, bind, serve};
use awex_control::wire::{JoinRequest, PairOptions};
use awex_core::Transport;
use awex_core::layout::{RankId, Side};
use awex_core::model::ModelSpec;
use awex_core::pair::PairSpec;
use awex_gpu::nccl::UniqueId;
use awex_runtime::RuntimeError;
use awex_runtime::rank::read_checked_kv;
use awex_runtime::transport::{PairSecret, open_uid, seal_uid};
use std::time::Duration;

// Linked so that their backends register.
const _: [&str; 2] = [awex_megatron::CRATE, awex_sglang::CRATE];

async fn gateway() -> String {
    let l = bind("127.0.0.1:0".parse().unwrap()).unwrap();
    let addr = l.local_addr().unwrap();
    tokio::spawn(serve(l, GatewayConfig::default()));
    format!("http://{addr}")
}

/// A joined nccl pair of one training and one inference rank; the pair secret.
async fn pair(gw: &str) -> (Client, PairSecret) {
    let client = Client::new(gw, None).unwrap();
    let spec = PairSpec {
        infer_fp8: None,
        model: ModelSpec::resolve("qwen3-tiny").unwrap(),
        train: "megatron:tp=1".parse().unwrap(),
        infer: "sglang:tp=1".parse().unwrap(),
        transport: Transport::Nccl,
    };
    let req = connect_request(
        "n",
        &spec.resolve().unwrap(),
        vec![],
        PairOptions::default(),
    );
    client.connect(&req).await.unwrap();
    let join = |side, rank| {
        let c = client.clone();
        async move {
            c.join(
                "n",
                &JoinRequest {
                    side,
                    rank,
                    info: serde_json::json!({}),
                    capabilities: vec![],
                },
            )
            .await
            .unwrap()
        }
    };
    let (a, _) = tokio::join!(
        join(Side::Training, RankId::train(0)),
        join(Side::Inference, RankId::infer(0, 0))
    );
    let secret = PairSecret::from_hex("n", &a.secret.unwrap().0).unwrap();
    (client, secret)
}

fn check(
    secret: &PairSecret,
    key: &str,
) -> impl Fn(&serde_json::Value) -> Result<(), RuntimeError> {
    let (secret, key) = (secret.clone(), key.to_string());
    move |v| {
        open_uid(&secret, &key, v)?;
        Ok(())
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forged_uid_is_refused_and_the_reader_takes_the_genuine_one_written_later() {
    let gw = gateway().await;
    let (client, secret) = pair(&gw).await;
    let genuine = UniqueId([0x42; 128]);
    // the injector was first: a bare id, then one sealed with a secret of its own
    let injected = UniqueId([0x66; 128]);
    client
        .put_kv("n", "nccl.uid", injected.to_kv())
        .await
        .unwrap();
    let reader = {
        let (client, secret) = (client.clone(), secret.clone());
        tokio::spawn(async move {
            read_checked_kv(
                &client,
                "n",
                "nccl.uid",
                Duration::from_secs(20),
                check(&secret, "nccl.uid"),
            )
            .await
        })
    };
    tokio::time::sleep(Duration::from_millis(250)).await;
    let other = PairSecret::random("n");
    client
        .put_kv("n", "nccl.uid", seal_uid(&other, "nccl.uid", &injected))
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(250)).await;
    assert!(!reader.is_finished(), "no forged value was accepted");
    // the legitimate publisher's write replaces it
    let sealed = seal_uid(&secret, "nccl.uid", &genuine);
    assert!(
        !sealed.to_string().contains(&"42".repeat(4)),
        "the kv reveals nothing"
    );
    client.put_kv("n", "nccl.uid", sealed).await.unwrap();
    let v = tokio::time::timeout(Duration::from_secs(20), reader)
        .await
        .expect("the reader finished")
        .unwrap()
        .unwrap();
    assert_eq!(open_uid(&secret, "nccl.uid", &v).unwrap(), genuine);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forged_or_replayed_uid_alone_fails_the_reader_clearly() {
    let gw = gateway().await;
    let (client, secret) = pair(&gw).await;
    // a genuine retry id, replayed under a later attempt's key
    let replay = seal_uid(&secret, "nccl.uid.3.2", &UniqueId([7; 128]));
    client.put_kv("n", "nccl.uid.3.3", replay).await.unwrap();
    let e = read_checked_kv(
        &client,
        "n",
        "nccl.uid.3.3",
        Duration::from_millis(600),
        check(&secret, "nccl.uid.3.3"),
    )
    .await
    .unwrap_err()
    .to_string();
    assert!(
        e.starts_with("transport: refused the NCCL unique id in kv `nccl.uid.3.3` of pair `n`: its authentication tag does not verify with the pair secret"),
        "{e}"
    );
    assert!(e.contains("no communicator is built from it"), "{e}");
    assert!(e.contains("waited 600ms for a value that verifies"), "{e}");
    // a bare id: refused, naming that it is not sealed
    client
        .put_kv("n", "nccl.uid", UniqueId([9; 128]).to_kv())
        .await
        .unwrap();
    let e = read_checked_kv(
        &client,
        "n",
        "nccl.uid",
        Duration::from_millis(300),
        check(&secret, "nccl.uid"),
    )
    .await
    .unwrap_err()
    .to_string();
    assert!(e.contains("it is not sealed with the pair secret"), "{e}");
    // nothing at all: the wait is bounded and says who should have published it
    let e = read_checked_kv(
        &client,
        "n",
        "nccl.uid.9.2",
        Duration::from_millis(200),
        check(&secret, "nccl.uid.9.2"),
    )
    .await
    .unwrap_err()
    .to_string();
    assert!(e.contains("has no kv `nccl.uid.9.2`"), "{e}");
}
