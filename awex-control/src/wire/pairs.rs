//! Pairs: connect requests, options, transports and the status document.

use super::options::PairOptions;
use super::ranks::RosterRank;
use super::updates::UpdateStatus;
use awex_core::backend::ParallelConfig;
use awex_core::encoding::InferFp8;
use awex_core::model::{CatalogueSummary, ModelSpec};
use serde::{Deserialize, Serialize};

pub use awex_core::Transport;

/// The training side of a connect request.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TrainingSpec {
    /// Backend name (`megatron`, `fsdp`).
    pub backend: String,
    /// Parallel config (`tp`, `pp`, ...).
    #[serde(default)]
    pub parallel: ParallelConfig,
    /// Number of training ranks (ranks `{0, 0..world_size}`).
    pub world_size: u32,
    /// The model as the training side sees it.
    pub model: ModelSpec,
    /// `Catalogue::of(model).summary()`, as computed by the training side.
    pub catalogue: CatalogueSummary,
}

/// The inference side of a connect request.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct InferenceSpec {
    /// Backend name (`sglang`).
    pub backend: String,
    /// Parallel config of one engine.
    #[serde(default)]
    pub parallel: ParallelConfig,
    /// Number of engine slots (replicas), spare ones included: the ranks of every slot plan
    /// against all of them, so an engine that joins or leaves later changes no other
    /// engine's plan.
    pub engines: u32,
    /// Ranks of all engine slots together (`engines` x ranks per engine).
    pub world_size: u32,
    /// How many of the last engine slots start empty: engines added at run time
    /// (`POST /v1/pairs/{name}/engines`) take them. 0 (the default) to `engines - 1`; needs a
    /// commit policy other than `all`, and transport shm or tcp.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub spare: u32,
    /// One base URL per engine; when given, the gateway pauses generation around each update.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub urls: Vec<String>,
    /// The model as the inference side sees it.
    pub model: ModelSpec,
    /// `Catalogue::of(model).summary()`, as computed by the inference side.
    pub catalogue: CatalogueSummary,
    /// The engines store the linear weights as FP8 blocks (quantization_config and recipe);
    /// absent for engines that store what the trainer holds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fp8: Option<InferFp8>,
}

fn is_zero(n: &u32) -> bool {
    *n == 0
}

/// `POST /v1/pairs` body: a training job and inference engines to pair.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ConnectRequest {
    /// Pair name, `[A-Za-z0-9._-]{1,128}`.
    pub name: String,
    /// The training side.
    pub training: TrainingSpec,
    /// The inference side.
    pub inference: InferenceSpec,
    /// How bytes move.
    pub transport: Transport,
    /// Deadlines, buckets, checksums.
    #[serde(default)]
    pub options: PairOptions,
}

/// Where a pair is in its life.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PairState {
    /// Connected; waiting for every rank to join.
    Joining,
    /// Every rank joined; updates can run.
    Ready,
    /// The join deadline passed with ranks missing; delete the pair and connect again.
    JoinFailed,
    /// Disconnected; kept briefly so ranks see `disconnect` on their event stream.
    Disconnected,
}

impl PairState {
    /// Every state, in a fixed order.
    pub const ALL: [PairState; 4] = [
        PairState::Joining,
        PairState::Ready,
        PairState::JoinFailed,
        PairState::Disconnected,
    ];

    /// The wire name (`join_failed`).
    pub fn as_str(self) -> &'static str {
        match self {
            PairState::Joining => "joining",
            PairState::Ready => "ready",
            PairState::JoinFailed => "join_failed",
            PairState::Disconnected => "disconnected",
        }
    }
}

/// One side of a pair as status reports it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SideStatus {
    /// Backend name.
    pub backend: String,
    /// Parallel config.
    pub parallel: ParallelConfig,
    /// Ranks of the side.
    pub world_size: u32,
    /// Engines (1 on the training side).
    pub engines: u32,
    /// Engine URLs (inference side, when given).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub urls: Vec<String>,
    /// The model's display name.
    pub model: String,
    /// `ModelSpec::fingerprint`, hex.
    pub fingerprint: String,
    /// The canonical catalogue summary.
    pub catalogue: CatalogueSummary,
    /// Canonical tensors this side's engine does not hold (its model class builds no parameter
    /// for them and its load drops them): an update moves nothing into them.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub dropped: Vec<String>,
    /// Ranks of this side that joined.
    pub joined: u32,
    /// The inference side's FP8 encoding (absent when plain, and on the training side); every
    /// rank must be configured with the same.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fp8: Option<InferFp8>,
}

/// `GET /v1/pairs/{name}/status`: everything about a pair.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PairStatus {
    /// Pair name.
    pub name: String,
    /// Incarnation id: a pair connected again under the same name gets a new id.
    pub id: u64,
    /// Unique id of this connect (random, 32 hex digits): unlike `id`, unique across gateways
    /// and gateway restarts; names the pair's shared-memory segments.
    #[serde(default)]
    pub uid: String,
    /// Where the pair is in its life.
    pub state: PairState,
    /// The last committed version: what the inference engines serve (null before the first commit).
    pub serving_version: Option<u64>,
    /// The latest update (any state), without per-rank detail (see `GET .../updates/{version}`).
    pub current_update: Option<UpdateStatus>,
    /// The training side.
    pub training: SideStatus,
    /// The inference side.
    pub inference: SideStatus,
    /// Transport.
    pub transport: Transport,
    /// Options in force.
    pub options: PairOptions,
    /// Ranks joined, both sides.
    pub joined: u32,
    /// Ranks of the pair, both sides.
    pub world_size: u32,
    /// Joined ranks.
    pub roster: Vec<RosterRank>,
    /// Why the join failed (state `join_failed`).
    pub join_error: Option<String>,
    /// Connect time, ms since the Unix epoch.
    pub created_unix_ms: u64,
    /// Seq of the last event (`GET .../events?after=` this to wait for the next one).
    pub last_event_seq: u64,
    /// A version whose failed attempt may have written part of the inference ranks' weights:
    /// the engines are held paused on it until a retry commits or the controller resumes them
    /// with `accept_torn` (`POST /v1/pairs/{name}/resume`).
    #[serde(default)]
    pub torn_version: Option<u64>,
    /// A torn version the controller chose to serve (resumed with `accept_torn`); cleared by
    /// the next commit.
    #[serde(default)]
    pub serving_torn_version: Option<u64>,
    /// What the engines' servers answered to calls outside an update (warm-up after connect).
    #[serde(default)]
    pub engine_errors: Vec<String>,
    /// Per engine: the version it serves, whether it is behind, torn or catching up, and why
    /// it last failed (docs/gateway.md, "Engines and commit policies").
    #[serde(default)]
    pub engines: Vec<EngineStatus>,
}

/// Where one inference engine stands ([`PairStatus::engines`]).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct EngineStatus {
    /// The engine index (its ranks are `{engine, rank: 0..}`).
    pub engine: u32,
    /// `serving`, `behind`, `torn`, `catching_up`, `joining` or `absent`.
    pub state: EngineState,
    /// The last committed version this engine applied whole: what it serves (null before the
    /// first commit). Never a version it holds only partly.
    pub serving_version: Option<u64>,
    /// When it first missed a committed version (ms since the Unix epoch); null when current.
    #[serde(default)]
    pub behind_since_unix_ms: Option<u64>,
    /// A version that failed on it after its ranks may have written: its weights are partly
    /// written; it is not served until it catches up or the controller accepts it.
    #[serde(default)]
    pub torn_version: Option<u64>,
    /// A torn version the controller chose to serve on it (`resume` with `accept_torn`).
    #[serde(default)]
    pub serving_torn_version: Option<u64>,
    /// It is behind and takes part in the running update, which brings it to that version.
    #[serde(default)]
    pub catching_up: bool,
    /// Why it last failed an update.
    #[serde(default)]
    pub last_error: Option<String>,
}

/// Where an engine stands, in one word ([`EngineStatus::state`]): route requests only to
/// `serving` engines.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum EngineState {
    /// It serves `serving_version`, the pair's latest committed version (or none was yet).
    Serving,
    /// It missed a committed version and serves an older one, whole.
    Behind,
    /// Its weights are partly written by a failed version: it must not serve.
    Torn,
    /// It is behind and the running update brings it to the new version.
    CatchingUp,
    /// It was added at run time and waits for its ranks to join; it takes part in the first
    /// update that starts once they all joined (a full one: it holds no version).
    Joining,
    /// Its slot is free (a spare slot, or the engine was removed): no version goes to it.
    Absent,
}

impl EngineState {
    /// Every state, in the order `/metrics` lists them.
    pub const ALL: [EngineState; 6] = [
        EngineState::Serving,
        EngineState::Behind,
        EngineState::Torn,
        EngineState::CatchingUp,
        EngineState::Joining,
        EngineState::Absent,
    ];

    /// The wire name (`catching_up`).
    pub fn as_str(self) -> &'static str {
        match self {
            EngineState::Serving => "serving",
            EngineState::Behind => "behind",
            EngineState::Torn => "torn",
            EngineState::CatchingUp => "catching_up",
            EngineState::Joining => "joining",
            EngineState::Absent => "absent",
        }
    }
}

/// `POST /v1/pairs/{name}/resume` body: let the engines serve again outside an update.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Resume {
    /// Resume even though the last failed version left the weights partially written.
    pub accept_torn: bool,
}

/// `POST /v1/pairs/{name}/engines` body: add an engine to a running pair, in a free engine slot.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AddEngine {
    /// The slot to fill; absent: the lowest free one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub engine: Option<u32>,
}

/// Answer of `POST /v1/pairs/{name}/engines` and `DELETE /v1/pairs/{name}/engines/{engine}`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct EngineChanged {
    /// Pair name.
    pub pair: String,
    /// The engine's slot: start its ranks as `{engine, rank: 0..ranks}` (after an add).
    pub engine: u32,
    /// Ranks per engine.
    pub ranks: u32,
    /// Where the engine stands now (`joining` after an add, `absent` after a remove).
    pub status: EngineStatus,
}
