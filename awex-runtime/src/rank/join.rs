//! Joining a pair: the claim on the rank's slot, publishing its rendezvous value, and the
//! join itself ([`Rank::join`]), retried while the gateway is lost.

use super::checks::{check_pair, transport_mismatch};
use super::kv::checked;
use super::{
    Prepared, Rank, RankConfig, RankError, read_checked_kv, rendezvous_key, retry_gateway,
};
use crate::tensors::TensorSet;
use crate::transport::{PairSecret, Transport};
use crate::{ConfigMismatch, RuntimeError};
use awex_control::client::{Client, ClientError};
use awex_control::wire::{ApplyMode, CAP_ATOMIC_APPLY, JoinRequest, JoinResponse};
use awex_core::layout::Side;
use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::time::{Duration, Instant};

/// A random id of one rank process's claim on its slot (16 hex digits).
pub(super) fn incarnation_id() -> String {
    use std::io::Read;
    let mut b = [0u8; 8];
    let read = std::fs::File::open("/dev/urandom").and_then(|mut f| f.read_exact(&mut b));
    if read.is_err() {
        // no kernel random source: the pid and the clock still tell two processes apart
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(0);
        b = (t ^ (u64::from(std::process::id()) << 32)).to_le_bytes();
    }
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// A 404 from the gateway is the pair unknown to it (a restart without state); other errors
/// pass through.
pub(super) fn unknown_pair(e: RankError, cfg: &RankConfig) -> RankError {
    match e {
        RankError::Gateway(c) if c.status() == Some(404) => RankError::UnknownPair {
            gateway: cfg.gateway.clone(),
            pair: cfg.pair.clone(),
        },
        e => e,
    }
}

/// How long a rank whose slot is held by another process keeps trying to join: a little more
/// than the gateway's liveness window (15 s), so that a restarted rank gets the slot of its
/// dead predecessor, and a duplicate of a live rank is refused.
pub(super) const CLAIM_WAIT: Duration = Duration::from_secs(20);

/// Whether the gateway refused a join because another live process holds the slot.
pub(super) fn held_by_another(e: &ClientError) -> bool {
    e.status() == Some(409) && e.to_string().contains("is held by a live process")
}

/// Joins (or re-attaches to) this rank's slot, retrying a lost gateway until `limit`, and
/// publishes the rank's rendezvous value once the gateway accepted it as the slot's holder.
pub(super) async fn join_retrying(
    client: &Client,
    cfg: &RankConfig,
    req: &JoinRequest,
    limit: Duration,
    key: &str,
    info: &serde_json::Value,
) -> Result<JoinResponse, RankError> {
    let gw = &cfg.gateway;
    let start = Instant::now();
    let mut published = false;
    loop {
        let left = limit
            .saturating_sub(start.elapsed())
            .max(Duration::from_secs(1));
        // the rendezvous value first, then one join: the join answer's event cursor is then
        // the one of the moment the pair became ready, so no update started after it is missed
        let step = if published {
            retry_gateway(gw, "joining", left, || client.join(&cfg.pair, req))
                .await
                .map(Some)
        } else {
            retry_gateway(gw, "publishing rendezvous", left, || {
                client.put_kv(&cfg.pair, key, info.clone())
            })
            .await
            .map(|_| None)
        };
        match step.map_err(|e| unknown_pair(e, cfg)) {
            Ok(Some(r)) => return Ok(r),
            Ok(None) => published = true,
            // the slot is held: by this rank's predecessor (killed moments ago, its liveness
            // running out) or by a live duplicate (then this rank gives up after the wait);
            // the gateway refuses both the rendezvous value and the join without touching it
            Err(RankError::Gateway(c)) if held_by_another(&c) && start.elapsed() < CLAIM_WAIT => {
                tracing::warn!(
                    "awex rank: {} {} of pair `{}`: {c}; retrying for up to {} s",
                    cfg.side,
                    cfg.rank,
                    cfg.pair,
                    CLAIM_WAIT.saturating_sub(start.elapsed()).as_secs()
                );
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
            Err(e) => return Err(e),
        }
    }
}

impl Rank {
    /// Joins the pair (publishing the transport's rendezvous) and waits for every rank.
    pub async fn join(
        cfg: RankConfig,
        prepared: &Prepared,
        tensors: &TensorSet,
        transport: Box<dyn Transport>,
    ) -> Result<Rank, RankError> {
        let t0 = Instant::now();
        // everything is validated before anything is published (kv, roster): a mis-started
        // rank refuses itself without touching the pair
        tensors.check_layout(&prepared.layout)?;
        if transport.kind() != cfg.transport {
            return Err(RuntimeError::from(ConfigMismatch::BuiltTransport {
                configured: cfg.transport,
                built: transport.kind(),
            })
            .into());
        }
        let client = Client::new(&cfg.gateway, cfg.token.clone())?;
        let lost = cfg.gateway_lost;
        let gw = cfg.gateway.clone();
        let st = retry_gateway(&gw, "checking the pair", lost, || client.status(&cfg.pair))
            .await
            .map_err(|e| unknown_pair(e, &cfg))?;
        check_pair(&st, &cfg)?;
        let join_limit = Duration::from_millis(st.options.join_deadline_ms);
        let mut transport = transport;
        let incarnation = incarnation_id();
        let info = serde_json::json!({
            "transport": transport.rendezvous(),
            "plan_fingerprint": format!("{:016x}", prepared.plan.fingerprint),
            "bucket_bytes": cfg.bucket_bytes,
            "pid": std::process::id(),
            "incarnation": incarnation,
        });
        let key = rendezvous_key(cfg.side, cfg.rank);
        let req = JoinRequest {
            side: cfg.side,
            rank: cfg.rank,
            info: info.clone(),
            // only atomic pairs need it: gateways that predate the field accept the rest
            capabilities: match cfg.apply {
                ApplyMode::Atomic => vec![CAP_ATOMIC_APPLY.to_string()],
                ApplyMode::InPlace => Vec::new(),
            },
        };
        // a second live claimant of the slot gets 409 for both, and changes nothing
        let joined = join_retrying(&client, &cfg, &req, join_limit, &key, &info).await?;
        tracing::info!(
            pair = %cfg.pair,
            side = %cfg.side,
            rank = %cfg.rank,
            transport = %cfg.transport,
            ranks = joined.roster.len(),
            ms = t0.elapsed().as_millis() as u64,
            "rank joined"
        );
        if joined.transport.as_str() != cfg.transport.as_str() {
            // checked before publishing; only a pair connected again meanwhile gets here
            return Err(
                transport_mismatch(&cfg.pair, joined.transport.as_str(), cfg.transport).into(),
            );
        }
        let staged = if transport.stages() {
            ApplyMode::Atomic
        } else {
            ApplyMode::InPlace
        };
        if joined.options.apply != cfg.apply || (cfg.side == Side::Inference && staged != cfg.apply)
        {
            return Err(RuntimeError::from(ConfigMismatch::Pair {
                pair: cfg.pair.clone(),
                field: "applies updates",
                expected: joined.options.apply.to_string(),
                got: format!("a transport built for {staged}"),
                hint: "; build the transport with make_transport and the pair's apply mode",
            })
            .into());
        }
        match joined
            .secret
            .as_ref()
            .and_then(|k| PairSecret::from_hex(&cfg.pair, &k.0))
        {
            Some(k) => transport.authenticate(&k),
            None if cfg.transport.needs_pair_secret() => {
                return Err(RuntimeError::from(ConfigMismatch::NoSecret {
                    pair: cfg.pair.clone(),
                    transport: cfg.transport,
                })
                .into());
            }
            None => {}
        }
        if let Some((key, value)) = transport.kv_at_join()? {
            retry_gateway(&gw, "publishing rendezvous", join_limit, || {
                client.put_kv(&cfg.pair, &key, value.clone())
            })
            .await
            .map_err(|e| unknown_pair(e, &cfg))?;
        }
        let other = cfg.side.other();
        let peers = joined
            .roster
            .iter()
            .filter(|e| e.side == other)
            .map(|e| (e.rank, e.info.get("transport").cloned().unwrap_or_default()))
            .collect();
        let join_deadline = Duration::from_millis(joined.options.join_deadline_ms);
        let shared = match transport.kv_after_join() {
            Some(key) => {
                let t = std::sync::Mutex::new(transport);
                let v = read_checked_kv(&client, &cfg.pair, &key, join_deadline, |v| {
                    checked(&t, &key, v)
                })
                .await;
                transport = t.into_inner().unwrap_or_else(|e| e.into_inner());
                Some(v?)
            }
            None => None,
        };
        transport.joined(shared.as_ref(), join_deadline)?;
        if joined.options.check_finite && cfg.side == Side::Training {
            transport.check_finite_sources()?;
        }
        if joined.options.deltas && cfg.deltas {
            let on = transport.enable_deltas()?;
            tracing::info!(
                pair = %cfg.pair,
                side = %cfg.side,
                rank = %cfg.rank,
                "{}",
                if on && cfg.transport == awex_core::Transport::CudaIpc {
                    "delta updates on (cuda-ipc transport): the receiver's diff kernel reads both versions, so on one GPU a delta update costs about what a dense copy does, and more once over about 0.1 % of the elements change; they pay where the bytes cross a slower link (docs/deltas.md)".to_string()
                } else if on {
                    format!("delta updates on ({} transport)", cfg.transport)
                } else {
                    format!(
                        "the pair has delta updates on, but this rank's {} transport moves every byte (deltas run over shm, tcp, cuda-ipc and nccl; a rank started with deltas off takes no part)",
                        cfg.transport
                    )
                }
            );
        }
        transport.connect(&peers)?;
        tracing::info!(
            pair = %cfg.pair,
            side = %cfg.side,
            rank = %cfg.rank,
            ms = t0.elapsed().as_millis() as u64,
            "rank ready"
        );
        let presence = super::Presence::start(&cfg, incarnation);
        Ok(Rank {
            _presence: presence,
            client,
            last_seq: joined.last_event_seq,
            watched_seq: Arc::new(AtomicU64::new(joined.last_event_seq)),
            joined,
            cfg,
            transport: Some(transport),
            peers,
            pending: VecDeque::new(),
            disconnected: false,
            corrupt_version: None,
            gateway_lost: lost,
            join_request: req,
            last_transfer: None,
            bases: None,
            unreached: Vec::new(),
            lost: Default::default(),
            out: None,
            attempt_deadline: None,
            removed: false,
        })
    }
}
