//! The retry-time NCCL unique-id handoff through the rank loop, against a gateway in process
//! and the stub libnccl: attempt 1 of a version fails in its first NCCL group (the stub's
//! `ncclRemoteError`) and is aborted; the same version started again (attempt 2) runs on a fresh
//! communicator on both ranks, built from a new unique id that training rank 0 publishes under
//! kv `nccl.uid.<version>.<attempt>` and the inference rank reads, through
//! `Rank::execute`'s `attempt_kv`, without the pair reconnecting; every byte arrives. Every id
//! travels sealed with the pair secret (the kv holds nothing of it in clear), and a forged id
//! written over the retry's key before the genuine one is refused by the reader.
//!
//! The `nccl` transport itself needs CUDA (device tensors, streams), so the transport here is a
//! stand-in of its communicator side: the kv hooks make exactly the calls `NcclTransport` makes
//! (`uid_at_join`/`uid_after_join` with `seal_uid`/`open_uid`, `AttemptComm::publish_for_attempt`,
//! `AttemptComm::read_for_attempt`, `AttemptComm::set_uid`; `src/transport/nccl.rs`), each
//! attempt's group runs on the stub's communicator, and the bytes move over the tcp transport.

#[path = "../../awex-gpu/tests/stub_nccl/mod.rs"]
mod stub_nccl;

use awex_control::client::Client;
use awex_control::connect::connect_request;
use awex_control::server::{GatewayConfig, bind, serve};
use awex_control::wire::{PairOptions, UpdateState};
use awex_core::layout::{RankId, Side};
use awex_core::model::{Catalogue, ModelSpec};
use awex_core::pair::PairSpec;
use awex_gpu::nccl::{AttemptComm, Library, OpKind, P2p, UID_KEY, UniqueId, creates_uid};
use awex_runtime::fill::fill_or_check;
use awex_runtime::rank::{Rank, RankConfig, make_transport, prepare};
use awex_runtime::transport::{ExecContext, ExecStats, PairSecret, Transport, open_uid, seal_uid};
use awex_runtime::{RuntimeError, TensorSet};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use stub_nccl::{load, stub, stub_log};

// Linked so that their backends register.
const _: [&str; 2] = [awex_megatron::CRATE, awex_sglang::CRATE];

const LIMIT: Duration = Duration::from_secs(60);
const PAIR: &str = "retry";

/// What one attempt ran on: the attempt, the kv key of the communicator's id, and how many
/// communicators the rank had built by then.
type Used = Arc<Mutex<Vec<(u32, String, u32)>>>;

/// The `nccl` transport's communicator side over the stub library, bytes over `inner` (tcp).
struct StubNccl {
    inner: Box<dyn Transport>,
    comms: AttemptComm,
    side: Side,
    rank: RankId,
    /// The id training rank 0 creates before it joins (`nccl_transport` in `src/rank/factory.rs`).
    join_uid: Option<UniqueId>,
    used: Used,
    /// The pair secret (from the join answer), which seals the ids.
    secret: Option<PairSecret>,
    /// Set by the inference rank when it starts executing; the training rank waits for it
    /// before its first group, so that both ranks are inside attempt 1 when it fails (as with
    /// a real communicator, whose group waits for the peer). Without it the inference rank may
    /// take the update only after attempt 1 failed and rightly skip it.
    inside: Arc<AtomicBool>,
}

impl StubNccl {
    fn peer(&self) -> P2p {
        // a 1 x 1 pair: communicator rank 0 is the training rank, 1 the inference rank
        let (kind, peer) = match self.side {
            Side::Training => (OpKind::Send, 1),
            Side::Inference => (OpKind::Recv, 0),
        };
        P2p {
            kind,
            addr: 0x1000,
            bytes: 64,
            peer,
        }
    }
}

impl Transport for StubNccl {
    fn kind(&self) -> awex_core::Transport {
        awex_core::Transport::Nccl
    }

    fn rendezvous(&self) -> serde_json::Value {
        self.inner.rendezvous()
    }

    fn kv_at_join(&self) -> Result<Option<(String, serde_json::Value)>, RuntimeError> {
        // `uid_at_join`: the creator publishes its id, sealed, under `nccl.uid`
        let secret = self.secret.as_ref().expect("the join answer's secret");
        Ok(creates_uid(self.side, self.rank)
            .then_some(self.join_uid)
            .flatten()
            .map(|u| (UID_KEY.to_string(), seal_uid(secret, UID_KEY, &u))))
    }

    fn check_kv(&self, key: &str, value: &serde_json::Value) -> Result<(), RuntimeError> {
        open_uid(self.secret.as_ref().expect("secret"), key, value)?;
        Ok(())
    }

    fn kv_after_join(&self) -> Option<String> {
        // `uid_after_join`: every other rank reads it
        (!creates_uid(self.side, self.rank)).then(|| UID_KEY.to_string())
    }

    fn joined(
        &mut self,
        value: Option<&serde_json::Value>,
        _join_deadline: Duration,
    ) -> Result<(), RuntimeError> {
        match value {
            Some(v) => self.comms.set_uid(
                UID_KEY,
                open_uid(self.secret.as_ref().expect("secret"), UID_KEY, v)?,
            ),
            None => {
                let uid = self.join_uid.ok_or_else(|| RuntimeError::MissingKv {
                    pair: "stub".into(),
                    key: UID_KEY.into(),
                    waited: Duration::ZERO,
                })?;
                self.comms.set_uid(UID_KEY, uid);
            }
        }
        Ok(())
    }

    fn authenticate(&mut self, secret: &PairSecret) {
        self.secret = Some(secret.clone());
        self.inner.authenticate(secret);
    }

    fn connect(&mut self, peers: &HashMap<RankId, serde_json::Value>) -> Result<(), RuntimeError> {
        self.inner.connect(peers)
    }

    fn execute(&mut self, ctx: &ExecContext<'_>) -> Result<ExecStats, RuntimeError> {
        let op = self.peer();
        match self.side {
            Side::Inference => self.inside.store(true, Ordering::Release),
            Side::Training => {
                let until = Instant::now() + Duration::from_secs(30);
                while !self.inside.load(Ordering::Acquire) && Instant::now() < until {
                    std::thread::sleep(Duration::from_millis(5));
                }
            }
        }
        let comm = self.comms.get(Duration::from_secs(5))?;
        // SAFETY: the stub never touches the addresses or the stream.
        let r = unsafe { comm.group(&[op], std::ptr::null_mut(), &mut || None) };
        if let Err(e) = r {
            self.comms.fail(&e.to_string());
            return Err(e.into());
        }
        let key = self
            .comms
            .uid()
            .map(|(k, _)| k.to_string())
            .unwrap_or_default();
        self.used
            .lock()
            .unwrap()
            .push((ctx.attempt, key, self.comms.built()));
        self.inner.execute(ctx)
    }

    fn kv_before_attempt(
        &mut self,
        version: u64,
        attempt: u32,
    ) -> Result<Option<(String, serde_json::Value)>, RuntimeError> {
        let secret = self.secret.clone().expect("secret");
        Ok(self
            .comms
            .publish_for_attempt(self.side, self.rank, version, attempt)?
            .map(|(key, v)| {
                let uid = UniqueId::from_kv(&v).expect("the id just created");
                let sealed = seal_uid(&secret, &key, &uid);
                (key, sealed)
            }))
    }

    fn kv_for_attempt(&self, version: u64, attempt: u32) -> Option<String> {
        AttemptComm::read_for_attempt(self.side, self.rank, version, attempt)
    }

    fn begin_attempt(&mut self, key: &str, value: &serde_json::Value) -> Result<(), RuntimeError> {
        let uid = open_uid(self.secret.as_ref().expect("secret"), key, value)?;
        self.comms.set_uid(key, uid);
        Ok(())
    }

    fn close(&mut self) {
        let _ = self.comms.close(Duration::from_secs(5));
        self.inner.close();
    }
}

fn cfg(gw: &str, side: Side, rank: RankId) -> RankConfig {
    RankConfig {
        infer_fp8: None,
        gateway: gw.into(),
        token: None,
        pair: PAIR.into(),
        side,
        rank,
        model: ModelSpec::resolve("qwen3-tiny").unwrap(),
        train: "megatron:tp=1".parse().unwrap(),
        infer: "sglang:tp=1".parse().unwrap(),
        transport: awex_core::Transport::Nccl,
        bucket_bytes: 1 << 20,
        host: "127.0.0.1".into(),
        uid: String::new(),
        apply: Default::default(),
        transports: Default::default(),
        gateway_lost: awex_runtime::rank::DEFAULT_GATEWAY_LOST,
        deltas: true,
    }
}

struct Joined {
    rank: Rank,
    tensors: Arc<TensorSet>,
    layout: awex_core::layout::RankLayout,
    used: Used,
}

async fn join(c: RankConfig, lib: Arc<Library>, inside: Arc<AtomicBool>) -> Joined {
    let prepared = prepare(&c).unwrap();
    let tensors = Arc::new(TensorSet::allocate_host(&prepared.layout).unwrap());
    let mut tcp = c.clone();
    tcp.transport = awex_core::Transport::Tcp;
    let inner = make_transport(&tcp, &prepared, tensors.clone()).unwrap();
    let nranks_rank = match c.side {
        Side::Training => 0,
        Side::Inference => 1,
    };
    let join_uid = creates_uid(c.side, c.rank).then(|| lib.unique_id().unwrap());
    let used = Used::default();
    let t = Box::new(StubNccl {
        inner,
        comms: AttemptComm::new(lib, 2, nranks_rank),
        side: c.side,
        rank: c.rank,
        join_uid,
        used: used.clone(),
        secret: None,
        inside,
    });
    let rank = tokio::time::timeout(LIMIT, Rank::join(c, &prepared, &tensors, t))
        .await
        .expect("join hung")
        .unwrap();
    Joined {
        rank,
        tensors,
        layout: prepared.layout.clone(),
        used,
    }
}

async fn attempt(r: &mut Rank) -> Result<ExecStats, RuntimeError> {
    let w = tokio::time::timeout(LIMIT, r.next_live_work())
        .await
        .expect("no work")
        .unwrap()
        .expect("the pair is connected");
    tokio::time::timeout(LIMIT, r.execute(w, true))
        .await
        .expect("execute hung")
}

fn init_line(rank: u32, id0: u8, id127: u8) -> String {
    format!(
        "init nranks=2 rank={rank} id[0]={id0} id[127]={id127} size=48 magic=cafebeef version=21900 blocking=0 min_ctas=-2147483648;"
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_aborted_attempt_retries_on_a_fresh_communicator_from_the_attempts_kv_id() {
    // training rank 0's first group ends with ncclRemoteError; the inference rank's never fails
    let Some((_dt, train_path)) = stub(&["FAIL_GROUPS=1"]) else {
        return;
    };
    let Some((_di, infer_path)) = stub(&[]) else {
        return;
    };
    let (train_lib, infer_lib) = (load(&train_path), load(&infer_path));

    let l = bind("127.0.0.1:0".parse().unwrap()).unwrap();
    let gw = format!("http://{}", l.local_addr().unwrap());
    tokio::spawn(serve(l, GatewayConfig::default()));
    let client = Client::new(&gw, None).unwrap();
    let spec = PairSpec {
        infer_fp8: None,
        model: ModelSpec::resolve("qwen3-tiny").unwrap(),
        train: "megatron:tp=1".parse().unwrap(),
        infer: "sglang:tp=1".parse().unwrap(),
        transport: awex_core::Transport::Nccl,
    };
    let options = PairOptions {
        bucket_mib: 1,
        update_deadline_ms: 20_000,
        ..PairOptions::default()
    };
    let req = connect_request(PAIR, &spec.resolve().unwrap(), vec![], options);
    client.connect(&req).await.unwrap();
    let inside = Arc::new(AtomicBool::new(false));
    let (mut t, mut i) = tokio::join!(
        join(
            cfg(&gw, Side::Training, RankId::train(0)),
            train_lib.clone(),
            inside.clone()
        ),
        join(
            cfg(&gw, Side::Inference, RankId::infer(0, 0)),
            infer_lib.clone(),
            inside
        ),
    );
    let secret = PairSecret::from_hex(PAIR, &t.rank.joined.secret.clone().unwrap().0).unwrap();
    let stored = client
        .get_kv(PAIR, UID_KEY, Duration::ZERO)
        .await
        .unwrap()
        .value;
    let joined_uid = open_uid(&secret, UID_KEY, &stored).unwrap();
    assert!(
        !stored.to_string().contains(&joined_uid.to_hex()[..32]),
        "the kv holds nothing of the id in clear: {stored}"
    );
    // an injector writes a forged id over the retry's key before the retry starts; training
    // rank 0's genuine write replaces it, and the reader refused it meanwhile
    client
        .put_kv(PAIR, "nccl.uid.1.2", UniqueId([0x66; 128]).to_kv())
        .await
        .unwrap();
    let cat = Catalogue::of(&ModelSpec::resolve("qwen3-tiny").unwrap());
    fill_or_check(&t.layout, &cat, &t.tensors, 1, false).unwrap();

    // attempt 1: the training rank's group fails, the version fails, the inference rank (its
    // group taken, waiting for bytes) is released by the abort
    client.start_update(PAIR, 1).await.unwrap();
    let (a, b) = tokio::join!(attempt(&mut t.rank), attempt(&mut i.rank));
    let e = a.unwrap_err().to_string();
    assert!(
        e.contains("ncclGroupEnd") && e.contains("remote process exited"),
        "{e}"
    );
    assert!(
        b.is_err(),
        "the inference rank's attempt 1 was aborted: {b:?}"
    );
    let u = client
        .wait_update(PAIR, 1, Duration::from_secs(20))
        .await
        .unwrap();
    assert_eq!((u.state, u.attempt), (UpdateState::Failed, 1), "{u:?}");
    assert!(
        open_uid(
            &secret,
            "nccl.uid.1.2",
            &client
                .get_kv(PAIR, "nccl.uid.1.2", Duration::ZERO)
                .await
                .unwrap()
                .value
        )
        .is_err(),
        "no genuine retry id before the retry (only the forgery)"
    );
    fill_or_check(&i.layout, &cat, &i.tensors, 1, true).expect_err("attempt 1 delivered nothing");

    // attempt 2 of the same version, on the same joined ranks
    client.start_update(PAIR, 1).await.unwrap();
    let (a, b) = tokio::join!(attempt(&mut t.rank), attempt(&mut i.rank));
    let (a, b) = (a.unwrap(), b.unwrap());
    assert_eq!(a.bytes, b.bytes);
    assert!(a.bytes > 0);
    let u = client
        .wait_update(PAIR, 1, Duration::from_secs(20))
        .await
        .unwrap();
    assert_eq!((u.state, u.attempt), (UpdateState::Committed, 2), "{u:?}");
    fill_or_check(&i.layout, &cat, &i.tensors, 1, true)
        .unwrap_or_else(|e| panic!("the retry's bytes: {e}"));

    // the retry's id: published by training rank 0 under the attempt's key, fresh
    let fresh = open_uid(
        &secret,
        "nccl.uid.1.2",
        &client
            .get_kv(PAIR, "nccl.uid.1.2", Duration::ZERO)
            .await
            .unwrap()
            .value,
    )
    .unwrap();
    assert_ne!(fresh, joined_uid);
    assert_eq!(
        (joined_uid.0[0], fresh.0[0]),
        (1, 17),
        "the stub's first and second ids"
    );
    // attempt 1 ran on the join's communicator on both ranks (the training rank's group failed
    // before it recorded), attempt 2 on a second one built from the retry's id
    assert_eq!(
        *i.used.lock().unwrap(),
        vec![
            (1, UID_KEY.to_string(), 1),
            (2, "nccl.uid.1.2".to_string(), 2)
        ]
    );
    assert_eq!(
        *t.used.lock().unwrap(),
        vec![(2, "nccl.uid.1.2".to_string(), 2)]
    );
    // the libraries' own logs: one init per attempt from the ids above, the old communicator
    // aborted (the training rank's at its failure, the inference rank's when the retry's id
    // replaced it)
    let id127 = |u: &UniqueId| u.0[127];
    assert_eq!(
        stub_log(&train_path),
        format!(
            "{}start;send 0x1000 64 dtype=1 peer=1;end;abort;{}start;send 0x1000 64 dtype=1 peer=1;end;",
            init_line(0, 1, id127(&joined_uid)),
            init_line(0, 17, id127(&fresh))
        )
    );
    assert_eq!(
        stub_log(&infer_path),
        format!(
            "{}start;recv 0x1000 64 dtype=1 peer=0;end;abort;{}start;recv 0x1000 64 dtype=1 peer=0;end;",
            init_line(1, 1, id127(&joined_uid)),
            init_line(1, 17, id127(&fresh))
        )
    );
    t.rank.close();
    i.rank.close();
    assert!(stub_log(&train_path).ends_with(";end;finalize;destroy;"));
    assert!(stub_log(&infer_path).ends_with(";end;finalize;destroy;"));
}
