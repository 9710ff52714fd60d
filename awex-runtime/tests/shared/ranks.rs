//! Ranks against a gateway in this process, shared by the `rank_*` tests (each includes this
//! file with `#[path]`): a gateway on a free port, a qwen3-tiny pair's connect and its ranks'
//! configuration, and a rank's
//! join with awex-allocated tensors (in shared memory for a training rank on shm). Every wait is
//! bounded by [`LIMIT`].

#![allow(dead_code)]

use awex_control::client::Client;
use awex_control::connect::connect_request;
use awex_control::server::{GatewayConfig, bind, serve};
use awex_control::wire::{PairOptions, PairStatus};
use awex_core::Transport;
use awex_core::layout::{RankId, Side};
use awex_core::model::ModelSpec;
use awex_runtime::host::Memory;
use awex_runtime::rank::{Rank, RankConfig, Work, make_transport, prepare};
use std::time::Duration;

// Linked so that their backends register.
const _: [&str; 2] = [awex_megatron::CRATE, awex_sglang::CRATE];

/// The bound on every wait of these tests: far above what a loaded machine needs.
pub const LIMIT: Duration = Duration::from_secs(60);

/// A gateway with the default configuration on a free local port; its URL.
pub async fn gateway() -> String {
    gateway_with(GatewayConfig::default()).await
}

/// A gateway with configuration `config` on a free local port; its URL.
pub async fn gateway_with(config: GatewayConfig) -> String {
    let l = bind("127.0.0.1:0".parse().unwrap()).unwrap();
    let addr = l.local_addr().unwrap();
    tokio::spawn(serve(l, config));
    format!("http://{addr}")
}

/// Connects pair `pair` (the pair [`cfg`] configures its ranks for: qwen3-tiny from Megatron
/// `tp=1` into SGLang `infer` over `transport`) with `options`; the gateway's answer.
pub async fn connect(
    client: &Client,
    pair: &str,
    transport: Transport,
    infer: &str,
    options: PairOptions,
) -> PairStatus {
    let spec = awex_core::pair::PairSpec {
        infer_fp8: None,
        model: ModelSpec::resolve("qwen3-tiny").unwrap(),
        train: "megatron:tp=1".parse().unwrap(),
        infer: infer.parse().unwrap(),
        transport,
    };
    let req = connect_request(pair, &spec.resolve().unwrap(), vec![], options);
    client.connect(&req).await.unwrap()
}

/// Rank `rank` of `side` of pair `pair`: qwen3-tiny from Megatron `tp=1` into SGLang `infer`
/// over `transport`, buckets of 1 MiB, deltas on.
pub fn cfg(
    gw: &str,
    pair: &str,
    side: Side,
    rank: RankId,
    transport: Transport,
    infer: &str,
) -> RankConfig {
    RankConfig {
        infer_fp8: None,
        gateway: gw.into(),
        token: None,
        pair: pair.into(),
        side,
        rank,
        model: ModelSpec::resolve("qwen3-tiny").unwrap(),
        train: "megatron:tp=1".parse().unwrap(),
        infer: infer.parse().unwrap(),
        transport,
        bucket_bytes: 1 << 20,
        host: "127.0.0.1".into(),
        uid: String::new(),
        apply: Default::default(),
        transports: Default::default(),
        gateway_lost: awex_runtime::rank::DEFAULT_GATEWAY_LOST,
        deltas: true,
    }
}

/// Joins rank `c` with tensors awex allocates (named by `c.uid` where they are shared).
pub async fn join(c: RankConfig) -> Result<Rank, String> {
    let prepared = prepare(&c).map_err(|e| e.to_string())?;
    let mem = Memory::allocate(&prepared.layout, &c.shm_scope(), c.side, c.transport, 0)
        .map_err(|e| e.to_string())?;
    let t = make_transport(&c, &prepared, mem.tensors.clone()).map_err(|e| e.to_string())?;
    tokio::time::timeout(LIMIT, Rank::join(c, &prepared, &mem.tensors, t))
        .await
        .map_err(|_| "join hung".to_string())?
        .map_err(|e| e.to_string())
}

/// The next live work of `rank`: there must be some within [`LIMIT`].
pub async fn next(rank: &mut Rank) -> Work {
    tokio::time::timeout(LIMIT, rank.next_live_work())
        .await
        .expect("no work in time")
        .expect("waiting for work failed")
        .expect("the pair was disconnected")
}
