//! Atomic apply against a gateway in process, with real ranks over shared memory (two training ranks,
//! megatron tp=2, into one inference rank): a failed update (a corrupted bucket caught by its
//! checksum; one of the two senders stopped before it sent, so that the other one's half of
//! the version arrives) leaves every live inference tensor byte-identical to the last committed version,
//! the pair not torn, and the retry commits; the same faults in place tear the pair (the live
//! tensors hold half of the failed version).

use awex_control::client::Client;
use awex_control::connect::connect_request;
use awex_control::server::{GatewayConfig, bind, serve};
use awex_control::wire::{ApplyMode, PairOptions, UpdateState};
use awex_core::Transport;
use awex_core::layout::{RankId, Side};
use awex_core::model::ModelSpec;
use awex_core::pair::PairSpec;
use awex_runtime::TensorSet;
use awex_runtime::fill::{Weights, fill_or_check_from};
use awex_runtime::host::shm_data_segment;
use awex_runtime::rank::{Prepared, Rank, RankConfig, make_transport, prepare};
use std::sync::Arc;
use std::time::Duration;

// Linked so that their backends register.
const _: [&str; 2] = [awex_megatron::CRATE, awex_sglang::CRATE];

const LIMIT: Duration = Duration::from_secs(60);

async fn gateway() -> String {
    let l = bind("127.0.0.1:0".parse().unwrap()).unwrap();
    let addr = l.local_addr().unwrap();
    tokio::spawn(serve(l, GatewayConfig::default()));
    format!("http://{addr}")
}

fn cfg(gw: &str, pair: &str, side: Side, rank: u32, apply: ApplyMode) -> RankConfig {
    RankConfig {
        infer_fp8: None,
        gateway: gw.into(),
        token: None,
        pair: pair.into(),
        side,
        rank: match side {
            Side::Training => RankId::train(rank),
            Side::Inference => RankId::infer(0, rank),
        },
        model: ModelSpec::resolve("qwen3-tiny").unwrap(),
        train: "megatron:tp=2".parse().unwrap(),
        infer: "sglang:tp=1".parse().unwrap(),
        transport: Transport::Shm,
        bucket_bytes: 1 << 20,
        host: "127.0.0.1".into(),
        uid: String::new(),
        apply,
        transports: Default::default(),
        gateway_lost: awex_runtime::rank::DEFAULT_GATEWAY_LOST,
        deltas: true,
    }
}

struct Joined {
    rank: Rank,
    prepared: Prepared,
    /// The live tensors (what the engine serves).
    live: Arc<TensorSet>,
}

async fn join(c: RankConfig) -> Joined {
    let prepared = prepare(&c).unwrap();
    // a training rank on shm sends from a shared-memory segment
    let live = Arc::new(match c.side {
        Side::Training => {
            TensorSet::allocate_shm(&prepared.layout, &shm_data_segment(&c.shm_scope(), c.rank))
                .unwrap()
        }
        Side::Inference => TensorSet::allocate_host(&prepared.layout).unwrap(),
    });
    let t = make_transport(&c, &prepared, live.clone()).unwrap();
    let rank = tokio::time::timeout(LIMIT, Rank::join(c, &prepared, &live, t))
        .await
        .expect("join hung")
        .unwrap();
    Joined {
        rank,
        prepared,
        live,
    }
}

impl Joined {
    fn fill(&self, v: u64) {
        let p = &self.prepared;
        fill_or_check_from(
            &Weights::Synthetic,
            &p.layout,
            &p.catalogue,
            &self.live,
            v,
            false,
        )
        .unwrap();
    }

    /// Whether the live tensors hold exactly version `v`.
    fn holds(&self, v: u64) -> Result<(), String> {
        let p = &self.prepared;
        fill_or_check_from(
            &Weights::Synthetic,
            &p.layout,
            &p.catalogue,
            &self.live,
            v,
            true,
        )
    }

    /// A digest of every live byte.
    fn digest(&self) -> u64 {
        let all: Vec<u8> = self.live.iter().flat_map(|v| v.bytes().to_vec()).collect();
        xxhash_rust::xxh3::xxh3_64(&all)
    }

    async fn run(&mut self) -> Result<(), String> {
        let w = tokio::time::timeout(LIMIT, self.rank.next_live_work())
            .await
            .expect("no work came")
            .unwrap()
            .expect("work");
        tokio::time::timeout(LIMIT, self.rank.execute(w, true))
            .await
            .expect("execute hung")
            .map(drop)
            .map_err(|e| e.to_string())
    }

    /// [`Joined::run`] for a rank whose attempt may end before it takes it: a failure
    /// elsewhere (the receiver's checksum, a deadline) can fail the attempt first, and a rank
    /// then skips the dead attempt and waits for live work, which this phase never starts
    /// (`Rank::next_live_work`). Gives up after `wait` with an error instead of panicking.
    async fn run_unless_over(&mut self, wait: Duration) -> Result<(), String> {
        let w = match tokio::time::timeout(wait, self.rank.next_live_work()).await {
            Err(_) => return Err("the attempt was over before this rank took it".into()),
            Ok(w) => w.map_err(|e| e.to_string())?.ok_or("disconnected")?,
        };
        tokio::time::timeout(LIMIT, self.rank.execute(w, true))
            .await
            .expect("execute hung")
            .map(drop)
            .map_err(|e| e.to_string())
    }
}

/// How long a training rank of a failing phase may take to find its work.
const OVER: Duration = Duration::from_secs(10);

async fn outcome(client: &Client, pair: &str, v: u64) -> UpdateState {
    client
        .wait_update(pair, v, Duration::from_secs(30))
        .await
        .unwrap()
        .state
}

/// Runs the drill on a pair applying `apply`; returns the torn version after each fault.
async fn drill(apply: ApplyMode) -> (Option<u64>, Option<u64>) {
    let gw = gateway().await;
    let pair = format!("drill-{}", apply.as_str());
    let client = Client::new(&gw, None).unwrap();
    let spec = PairSpec {
        infer_fp8: None,
        model: ModelSpec::resolve("qwen3-tiny").unwrap(),
        train: "megatron:tp=2".parse().unwrap(),
        infer: "sglang:tp=1".parse().unwrap(),
        transport: Transport::Shm,
    };
    let options = PairOptions {
        bucket_mib: 1,
        update_deadline_ms: 3_000,
        checksums: true,
        apply,
        ..PairOptions::default()
    };
    let req = connect_request(&pair, &spec.resolve().unwrap(), vec![], options);
    client.connect(&req).await.unwrap();
    let (mut t0, mut t1, mut reader) = tokio::join!(
        join(cfg(&gw, &pair, Side::Training, 0, apply)),
        join(cfg(&gw, &pair, Side::Training, 1, apply)),
        join(cfg(&gw, &pair, Side::Inference, 0, apply))
    );
    // version 1 commits
    t0.fill(1);
    t1.fill(1);
    client.start_update(&pair, 1).await.unwrap();
    let (a, b, c) = tokio::join!(t0.run(), t1.run(), reader.run());
    a.unwrap();
    b.unwrap();
    c.unwrap();
    assert_eq!(outcome(&client, &pair, 1).await, UpdateState::Committed);
    reader.holds(1).unwrap();
    let v1 = reader.digest();

    // fault 1: a bucket of version 2 arrives corrupted; the receiver's checksum catches it
    t0.fill(2);
    t1.fill(2);
    reader.rank.corrupt_version = Some(2);
    client.start_update(&pair, 2).await.unwrap();
    let (_, _, c) = tokio::join!(
        t0.run_unless_over(OVER),
        t1.run_unless_over(OVER),
        reader.run()
    );
    let e = c.unwrap_err();
    assert!(e.contains("failed its checksum"), "{e}");
    assert_eq!(outcome(&client, &pair, 2).await, UpdateState::Failed);
    reader.rank.corrupt_version = None;
    let st = client.status(&pair).await.unwrap();
    assert_eq!(st.serving_version, Some(1));
    let torn_1 = st.torn_version;
    if apply == ApplyMode::Atomic {
        assert_eq!(
            reader.digest(),
            v1,
            "the live tensors are version 1's, byte for byte"
        );
    }

    // fault 2: training rank 1 stops (as if killed: it never sends attempt 2) while rank 0
    // sends its half of version 2
    client.start_update(&pair, 2).await.unwrap();
    // (rank 0 waits for the receiver to be done with its segment, which it never is)
    let (_, c) = tokio::join!(t0.run_unless_over(OVER), reader.run());
    assert!(c.is_err(), "the receiver misses training rank 1's half");
    assert_eq!(outcome(&client, &pair, 2).await, UpdateState::Failed);
    let st = client.status(&pair).await.unwrap();
    assert_eq!(st.serving_version, Some(1));
    let torn_2 = st.torn_version;
    match apply {
        ApplyMode::Atomic => {
            assert_eq!(reader.digest(), v1, "still version 1's, byte for byte");
            reader.holds(1).unwrap();
        }
        ApplyMode::InPlace => {
            // half of version 2 landed in the live tensors: neither version
            assert_ne!(reader.digest(), v1);
            assert!(reader.holds(1).is_err() && reader.holds(2).is_err());
        }
    }

    // training rank 1 comes back (it skips the attempt that is over); the retry commits
    client.start_update(&pair, 2).await.unwrap();
    let (a, b, c) = tokio::join!(t0.run(), t1.run(), reader.run());
    a.unwrap();
    b.unwrap();
    c.unwrap();
    assert_eq!(outcome(&client, &pair, 2).await, UpdateState::Committed);
    let st = client.status(&pair).await.unwrap();
    assert_eq!((st.serving_version, st.torn_version), (Some(2), None));
    reader.holds(2).unwrap();
    client.disconnect(&pair).await.unwrap();
    (torn_1, torn_2)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn atomic_failures_leave_the_live_tensors_at_the_last_version_and_are_not_torn() {
    assert_eq!(drill(ApplyMode::Atomic).await, (None, None));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn in_place_failures_tear_the_pair() {
    assert_eq!(drill(ApplyMode::InPlace).await, (Some(2), Some(2)));
}
