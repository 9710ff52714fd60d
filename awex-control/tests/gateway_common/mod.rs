//! Helpers shared by the gateway tests: request builders, a loopback server, and a checker that
//! an answer conforms to its schema in the checked-in OpenAPI document.

#![allow(dead_code)]

use awex_control::client::{Client, ClientError};
use awex_control::server::{GatewayConfig, OPENAPI_DOCUMENT};
use awex_control::wire::{CAP_ATOMIC_APPLY, EventKind, JoinRequest, Report};
use awex_control::wire::{ConnectRequest, InferenceSpec, PairOptions, TrainingSpec, Transport};
use awex_core::model::presets::preset;
use awex_core::{Catalogue, ModelSpec, ParallelConfig};
use awex_core::{RankId, Side};
use serde_json::{Value, json};
use std::sync::Arc;
use std::time::Duration;

/// The tiny preset model.
pub fn tiny() -> ModelSpec {
    preset("qwen3-tiny").expect("qwen3-tiny preset")
}

/// A valid connect request: `train` training ranks, `engines` engines of `per_engine` ranks.
pub fn connect_request(name: &str, train: u32, engines: u32, per_engine: u32) -> ConnectRequest {
    let model = tiny();
    let summary = Catalogue::of(&model).summary();
    ConnectRequest {
        name: name.to_string(),
        training: TrainingSpec {
            backend: "megatron".into(),
            parallel: ParallelConfig::from_pairs([("tp", u64::from(train))]),
            world_size: train,
            model: model.clone(),
            catalogue: summary.clone(),
        },
        inference: InferenceSpec {
            spare: 0,
            fp8: None,
            backend: "sglang".into(),
            parallel: ParallelConfig::from_pairs([("tp", u64::from(per_engine))]),
            engines,
            world_size: engines * per_engine,
            urls: Vec::new(),
            model,
            catalogue: summary,
        },
        transport: Transport::Shm,
        options: PairOptions::default(),
    }
}

/// Starts a gateway on an ephemeral loopback port; returns its base URL.
pub async fn start(config: GatewayConfig) -> String {
    // engine URLs need the inference backend's engine control: link the sglang backend
    std::hint::black_box(awex_sglang::CRATE);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind loopback");
    let addr = listener.local_addr().expect("local addr");
    tokio::spawn(awex_control::server::serve(listener, config));
    format!("http://{addr}")
}

fn resolve<'a>(doc: &'a Value, schema: &'a Value) -> &'a Value {
    match schema.get("$ref").and_then(Value::as_str) {
        Some(r) => &doc["components"]["schemas"][r.trim_start_matches("#/components/schemas/")],
        None => match schema.get("allOf").and_then(Value::as_array) {
            Some(all) if all.len() == 1 => resolve(doc, &all[0]),
            _ => schema,
        },
    }
}

fn check(doc: &Value, schema: &Value, v: &Value, path: &str) -> Result<(), String> {
    let nullable = schema.get("nullable") == Some(&Value::Bool(true));
    let s = resolve(doc, schema);
    if v.is_null() {
        let allowed =
            nullable || s.get("nullable") == Some(&Value::Bool(true)) || s.get("type").is_none();
        return if allowed {
            Ok(())
        } else {
            Err(format!("{path}: null where the schema does not allow it"))
        };
    }
    if let Some(e) = s.get("enum").and_then(Value::as_array) {
        if !e.contains(v) {
            return Err(format!("{path}: {v} is not one of {e:?}"));
        }
    }
    match s.get("type").and_then(Value::as_str) {
        Some("object") => {
            let Some(obj) = v.as_object() else {
                return Err(format!("{path}: expected an object, found {v}"));
            };
            let props = s.get("properties").and_then(Value::as_object);
            for req in s
                .get("required")
                .and_then(Value::as_array)
                .into_iter()
                .flatten()
            {
                let k = req.as_str().unwrap_or_default();
                if !obj.contains_key(k) {
                    return Err(format!("{path}: required `{k}` is missing"));
                }
            }
            for (k, x) in obj {
                match props.and_then(|p| p.get(k)) {
                    Some(ps) => check(doc, ps, x, &format!("{path}.{k}"))?,
                    None => match s.get("additionalProperties") {
                        Some(Value::Bool(false)) => {
                            return Err(format!("{path}: `{k}` is not in the schema"));
                        }
                        Some(ap @ Value::Object(_)) => check(doc, ap, x, &format!("{path}.{k}"))?,
                        _ => {}
                    },
                }
            }
            Ok(())
        }
        Some("array") => {
            let Some(a) = v.as_array() else {
                return Err(format!("{path}: expected an array"));
            };
            for (i, x) in a.iter().enumerate() {
                check(doc, &s["items"], x, &format!("{path}[{i}]"))?;
            }
            Ok(())
        }
        Some("integer") if !(v.is_u64() || v.is_i64()) => {
            Err(format!("{path}: expected an integer, found {v}"))
        }
        Some("string") if !v.is_string() => Err(format!("{path}: expected a string, found {v}")),
        Some("boolean") if !v.is_boolean() => Err(format!("{path}: expected a boolean, found {v}")),
        _ => Ok(()),
    }
}

/// Checks that `v` conforms to schema `name` of the OpenAPI document (property names, required
/// fields, types, enums), recursively.
pub fn conforms(name: &str, v: &Value) -> Result<(), String> {
    let doc: Value = serde_json::from_str(OPENAPI_DOCUMENT).map_err(|e| e.to_string())?;
    let schema = serde_json::json!({ "$ref": format!("#/components/schemas/{name}") });
    check(&doc, &schema, v, name)
}

// ---- simulated ranks: tokio tasks that join and follow the event stream ----

/// What a simulated rank does when told to run an update.
#[derive(Clone, Debug)]
pub enum Act {
    Ok {
        bytes: u64,
        checksum: u64,
    },
    Fail(&'static str),
    Silent,
    /// Atomic pairs: receives (reports ok), then fails applying with this reason.
    FailApply(&'static str),
}

pub type Behaviour = Arc<dyn Fn(u64, u32) -> Act + Send + Sync>;

pub fn always_ok(bytes: u64, checksum: u64) -> Behaviour {
    Arc::new(move |_, _| Act::Ok { bytes, checksum })
}

/// A rank: joins, then follows the event stream until `disconnect`; returns what it saw.
pub async fn rank(
    client: Client,
    pair: String,
    side: Side,
    rank: RankId,
    act: Behaviour,
) -> Result<Vec<String>, ClientError> {
    rank_as(client, pair, side, rank, act, None).await
}

/// [`rank`] as awex's ranks run: it joins with claim id `claim`, polls its events under it, and
/// keeps a presence poll open while it lives (in the same task: aborting the task closes both,
/// as a process's death does), so the gateway knows when it is gone.
pub async fn present_rank(
    client: Client,
    pair: String,
    side: Side,
    id: RankId,
    act: Behaviour,
    claim: String,
) -> Result<Vec<String>, ClientError> {
    let presence = async {
        loop {
            if let Err(e) = client
                .presence(&pair, &claim, Duration::from_secs(30))
                .await
            {
                if e.status() == Some(410) {
                    // the pair was disconnected: nothing to hold any more
                    std::future::pending::<()>().await;
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    };
    tokio::select! {
        r = rank_as(client.clone(), pair.clone(), side, id, act, Some(claim.clone())) => r,
        _ = presence => unreachable!("the presence loop never ends"),
    }
}

async fn rank_as(
    client: Client,
    pair: String,
    side: Side,
    rank: RankId,
    act: Behaviour,
    claim: Option<String>,
) -> Result<Vec<String>, ClientError> {
    let mut info =
        json!({ "host": "127.0.0.1", "port": 20000 + rank.engine * 100 + rank.rank, "side": side });
    if let Some(c) = &claim {
        info["incarnation"] = json!(c);
    }
    let roster = client
        .join(
            &pair,
            &JoinRequest {
                side,
                rank,
                info,
                capabilities: vec![CAP_ATOMIC_APPLY.to_string()],
            },
        )
        .await?;
    let mut log = vec![format!("joined {}", roster.roster.len())];
    let mut after = roster.last_event_seq;
    loop {
        let batch = client
            .events_as(&pair, after, Duration::from_secs(5), claim.as_deref())
            .await?;
        for e in batch.events {
            after = e.seq;
            let (v, a) = (e.version.unwrap_or(0), e.attempt.unwrap_or(0));
            match e.kind {
                EventKind::Update => {
                    log.push(format!("update {v}/{a}"));
                    let report = match act(v, a) {
                        Act::FailApply(_) => Some(Report {
                            side,
                            rank,
                            ok: true,
                            bytes: 1,
                            checksum: Some(0),
                            error: None,
                            attempt: Some(a),
                            incarnation: claim.clone(),
                            delta: None,
                            unreached: Vec::new(),
                        }),
                        Act::Ok { bytes, checksum } => Some(Report {
                            side,
                            rank,
                            ok: true,
                            bytes,
                            checksum: Some(checksum),
                            error: None,
                            attempt: Some(a),
                            incarnation: claim.clone(),
                            delta: None,
                            unreached: Vec::new(),
                        }),
                        Act::Fail(why) => Some(Report {
                            side,
                            rank,
                            ok: false,
                            bytes: 0,
                            checksum: None,
                            error: Some(why.into()),
                            attempt: Some(a),
                            incarnation: claim.clone(),
                            delta: None,
                            unreached: Vec::new(),
                        }),
                        Act::Silent => None,
                    };
                    if let Some(r) = report {
                        match client.report(&pair, v, &r).await {
                            // The attempt already failed (another rank was faster): its abort follows.
                            Err(e) if e.status() == Some(409) => {}
                            other => {
                                other?;
                            }
                        }
                    }
                }
                EventKind::Apply => {
                    log.push(format!("apply {v}/{a}"));
                    if side == Side::Inference {
                        let (ok, error) = match act(v, a) {
                            Act::FailApply(why) => (false, Some(why.to_string())),
                            _ => (true, None),
                        };
                        let r = Report {
                            side,
                            rank,
                            ok,
                            bytes: 1,
                            checksum: Some(0),
                            error,
                            attempt: Some(a),
                            incarnation: claim.clone(),
                            delta: None,
                            unreached: Vec::new(),
                        };
                        match client.report(&pair, v, &r).await {
                            Err(e) if e.status() == Some(409) => {}
                            other => {
                                other?;
                            }
                        }
                    }
                }
                EventKind::Abort => log.push(format!("abort {v}/{a}")),
                EventKind::LeftOut => log.push(format!("left_out {v}/{a} {:?}", e.engines)),
                EventKind::EngineRemoved => log.push(format!("engine_removed {:?}", e.engines)),
                EventKind::Disconnect => {
                    log.push("disconnect".into());
                    return Ok(log);
                }
            }
        }
    }
}

pub type Ranks = Vec<tokio::task::JoinHandle<Result<Vec<String>, ClientError>>>;

/// Spawns every rank of a pair with `train` training ranks and `engines` x `per` inference ranks.
pub fn spawn_ranks(
    client: &Client,
    pair: &str,
    train: u32,
    engines: u32,
    per: u32,
    act: impl Fn(Side, RankId) -> Behaviour,
) -> Ranks {
    let mut handles = Vec::new();
    for r in 0..train {
        let id = RankId::train(r);
        handles.push(tokio::spawn(rank(
            client.clone(),
            pair.into(),
            Side::Training,
            id,
            act(Side::Training, id),
        )));
    }
    for e in 0..engines {
        for r in 0..per {
            let id = RankId::infer(e, r);
            handles.push(tokio::spawn(rank(
                client.clone(),
                pair.into(),
                Side::Inference,
                id,
                act(Side::Inference, id),
            )));
        }
    }
    handles
}

pub async fn logs(handles: Ranks) -> Vec<Vec<String>> {
    let mut out = Vec::new();
    for h in handles {
        out.push(h.await.expect("rank task").expect("rank ran"));
    }
    out
}
