//! Transports: how planned bytes move between a training rank and an inference rank.
//!
//! Every transport executes the same per-rank plan; they differ in how bytes travel:
//! `shm` (receivers copy straight out of the sender's shared memory: one copy), `tcp`
//! (buckets streamed over sockets, packing overlapped with sending), and the GPU transports
//! (`cuda-ipc`, `nccl`) behind the `cuda` feature. [`config`] holds each transport's typed
//! settings (filled by the caller); `control` the control-segment codec `shm` and `cuda-ipc`
//! share.

pub mod auth;
pub mod config;
mod control;
mod cuda_ipc;
mod encoded;
mod nccl;
mod shm;
mod staged;
mod tcp;

pub use auth::{PairSecret, SealError};
pub use config::{CudaIpcConfig, DriverMin, PeerOrder, SettingError, TcpConfig, TransportConfig};
pub use cuda_ipc::{
    CudaIpcTransport, Fp8Target, FusedFp8, JoinStats, fusable as cuda_ipc_fusable, fused_jobs,
};
pub use encoded::{EncodingTransport, fp8_tensors, refuse_on_gpu, refuse_on_gpu_over};
pub use nccl::{NcclConfig, NcclTransport, open_uid, seal_uid};
pub use shm::ShmTransport;
pub use staged::StagedTransport;
pub use tcp::TcpTransport;

use super::RuntimeError;
use awex_core::layout::RankId;
use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

/// What one execution of an update needs besides the plan and tensors.
pub struct ExecContext<'a> {
    /// The version being executed.
    pub version: u64,
    /// The attempt of that version (1 for the first; a failed version may be retried).
    pub attempt: u32,
    /// When to give up.
    pub deadline: Instant,
    /// Set when the update was aborted elsewhere (a peer failed).
    pub cancel: &'a AtomicBool,
    /// Compute and verify per-bucket checksums.
    pub checksums: bool,
    /// The current rendezvous values of the peers (a restarted peer publishes new ones).
    pub peers: &'a HashMap<RankId, serde_json::Value>,
    /// Test hook: corrupt one received byte before verification.
    pub corrupt: bool,
    /// Delta updates (training ranks): the version each inference rank holds, as the gateway
    /// announced it with this update; `None`: every byte moves.
    pub bases: Option<&'a crate::delta::PeerBases>,
}

impl ExecContext<'_> {
    /// Version and attempt in one word, as published by senders (attempts beyond 65535 wrap).
    pub fn tag(&self) -> u64 {
        (self.version << 16) | (self.attempt as u64 & 0xffff)
    }

    /// Errors out when the update was aborted or its deadline passed.
    pub fn check(&self) -> Result<(), RuntimeError> {
        if self.cancel.load(Ordering::Acquire) {
            return Err(RuntimeError::Aborted(self.version));
        }
        if Instant::now() >= self.deadline {
            return Err(RuntimeError::Deadline(self.version));
        }
        Ok(())
    }

    /// Waits until `ready()` holds, backing off from spinning to short sleeps, within the deadline.
    pub fn wait_until(&self, mut ready: impl FnMut() -> bool) -> Result<(), RuntimeError> {
        let mut pause = Duration::from_micros(2);
        loop {
            if ready() {
                return Ok(());
            }
            self.check()?;
            std::thread::sleep(pause);
            pause = (pause * 2).min(Duration::from_millis(1));
        }
    }
}

/// The engines the gateway left out of the running version (its `left_out` events, and the
/// engine slots its `update` event names as out from the start), shared by the rank that reads
/// the events and the transport that moves the bytes; and the instant from which a sender stops
/// waiting for engines that have not taken its bytes (stopped, or too slow), so that its report
/// names them `unreached` while the attempt can still commit on the others.
#[derive(Debug, Default)]
pub struct LostEngines(std::sync::Mutex<LostState>);

#[derive(Debug, Default)]
struct LostState {
    lost: std::collections::BTreeSet<u32>,
    absent: Vec<u32>,
    cutoff: Option<Instant>,
}

impl LostEngines {
    fn lock(&self) -> std::sync::MutexGuard<'_, LostState> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Engine `e` is left out.
    pub fn insert(&self, e: u32) {
        self.lock().lost.insert(e);
    }

    /// Engine slot `e` is out of the version from its start (free, or an added engine still
    /// joining): left out, and expected to be.
    pub fn insert_absent(&self, e: u32) {
        let mut g = self.lock();
        g.lost.insert(e);
        g.absent.push(e);
    }

    /// Whether engine `e` is left out.
    pub fn contains(&self, e: u32) -> bool {
        self.lock().lost.contains(&e)
    }

    /// Whether engine slot `e` is out of the version from its start.
    pub fn is_absent(&self, e: u32) -> bool {
        self.lock().absent.contains(&e)
    }

    /// From `at` on, a sender leaves out the engines that have not taken its bytes yet.
    pub fn set_cutoff(&self, at: Instant) {
        self.lock().cutoff = Some(at);
    }

    /// The instant from which a sender leaves out the engines still behind, if set.
    pub fn cutoff(&self) -> Option<Instant> {
        self.lock().cutoff
    }

    /// A new version: none is left out yet, and no cut-off is set.
    pub fn clear(&self) {
        *self.lock() = LostState::default();
    }
}

/// How long before its deadline a training rank of a pair that may leave engines out stops
/// waiting for engines that have not taken its bytes (a stopped or stalled engine): a tenth of
/// the time the attempt has, at least 0.5 s and at most 5 s, so that its report (naming those
/// engines unreached) reaches the gateway while the attempt can commit on the others.
pub fn straggler_cutoff(now: Instant, deadline: Instant) -> Instant {
    let left = deadline.saturating_duration_since(now);
    let margin = (left / 10).clamp(Duration::from_millis(500), Duration::from_secs(5));
    // (an attempt with less than the margin left keeps half of it)
    deadline
        .checked_sub(margin.min(left / 2))
        .unwrap_or(deadline)
}

/// What a rank moved in one update.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ExecStats {
    /// Bytes sent (training) or received (inference).
    pub bytes: u64,
    /// Wrapping sum of the per-bucket xxh3 digests (0 without checksums).
    pub checksum: u64,
    /// Buckets moved.
    pub buckets: u64,
    /// Delta figures: the elements covered and changed, the bytes a dense update would have
    /// moved and what moved instead (zero when every bucket moved dense).
    pub delta: awex_core::encoding::DeltaStats,
    /// Sending with deltas: bytes of the new version this rank compared against its base.
    /// A bucket several peers take (engines replicating a layout) is compared once, so this
    /// is at most `delta.dense_bytes`.
    pub compared: u64,
    /// Sending with deltas: bytes written into this rank's copy of the base after the update
    /// (the changed elements when every peer took a delta, else the whole copy).
    pub refreshed: u64,
}

impl ExecStats {
    /// Adds another part's stats (checksums add wrapping, as the gateway compares them).
    pub fn add(&mut self, o: &ExecStats) {
        self.bytes += o.bytes;
        self.buckets += o.buckets;
        self.checksum = self.checksum.wrapping_add(o.checksum);
        self.delta.add(&o.delta);
        self.compared += o.compared;
        self.refreshed += o.refreshed;
    }

    /// Bytes a dense update would have moved: `bytes` with every delta counted at its dense size.
    pub fn dense_bytes(&self) -> u64 {
        self.bytes - self.delta.delta_bytes.min(self.bytes) + self.delta.dense_bytes
    }
}

/// Refuses a plan that writes a box transposed ([`awex_core::plan::Transfer::transposed`])
/// where `what` (delta updates over shm or tcp) does not move transposed boxes yet: the CPU
/// copies of shm and tcp transpose, and the transpose kernel of cuda-ipc and nccl.
pub fn refuse_transposed(plan: &awex_core::plan::RankPlan, what: &str) -> Result<(), RuntimeError> {
    match plan.first_transposed() {
        None => Ok(()),
        Some(t) => Err(crate::TransportError::Unsupported(format!(
            "{what}: transposed boxes are not moved there yet, and this plan writes `{}` of rank {} transposed into `{}` of rank {} (the engine stores it with its last two dims swapped); the cuda-ipc and nccl transports move such boxes (with or without delta updates), shm and tcp without delta updates",
            t.src_tensor, t.src_rank, t.dst_tensor, t.dst_rank
        ))
        .into()),
    }
}

/// Moves one rank's planned bytes for each update.
pub trait Transport: Send {
    /// Which transport this is.
    fn kind(&self) -> awex_core::Transport;

    /// The cuda-ipc transport this one is or wraps (an FP8 rank's encoding around it), for
    /// its join figures and mappings; `None` for the others.
    fn cuda_ipc(&self) -> Option<&CudaIpcTransport> {
        None
    }

    /// The cuda-ipc transport this one is, to be configured before it connects (the FP8
    /// encoding hands it the tensors it quantises straight out of the senders' memory);
    /// `None` for the others.
    fn cuda_ipc_mut(&mut self) -> Option<&mut CudaIpcTransport> {
        None
    }

    /// Values this rank publishes when it joins (addresses, segment names).
    fn rendezvous(&self) -> serde_json::Value;

    /// A pair kv entry `(key, value)` this rank publishes right after it joined, once it holds
    /// the pair secret ([`Transport::authenticate`]), for the other ranks to read (the NCCL
    /// unique id of training rank 0, sealed with the secret); `None` for transports that need
    /// none.
    fn kv_at_join(&self) -> Result<Option<(String, serde_json::Value)>, RuntimeError> {
        Ok(None)
    }

    /// A pair kv key this rank reads once every rank has joined, before it connects (published
    /// by another rank's [`Transport::kv_at_join`]); `None` for transports that need none.
    fn kv_after_join(&self) -> Option<String> {
        None
    }

    /// Checks a value read from the pair kv under `key` ([`Transport::kv_after_join`],
    /// [`Transport::kv_for_attempt`]) before it is used: a sealed value that does not open
    /// with the pair secret is refused (the reader waits for a genuine one until its deadline,
    /// then fails with this error). Accepts everything by default.
    fn check_kv(&self, _key: &str, _value: &serde_json::Value) -> Result<(), RuntimeError> {
        Ok(())
    }

    /// Called once every rank has joined, before [`Transport::connect`]: the value read under
    /// [`Transport::kv_after_join`], and the pair's join deadline (how long connecting may wait
    /// for the other ranks).
    fn joined(
        &mut self,
        _value: Option<&serde_json::Value>,
        _join_deadline: Duration,
    ) -> Result<(), RuntimeError> {
        Ok(())
    }

    /// Hands the transport the pair's data-plane secret (from the join answer), before
    /// [`Transport::connect`]; transports that authenticate their peers with it (tcp) refuse
    /// every peer connection until they have it.
    fn authenticate(&mut self, _secret: &PairSecret) {}

    /// Prepares connections to the peers once the roster is known (optional; `execute` connects
    /// lazily otherwise), so that the first update does not pay for it.
    fn connect(&mut self, _peers: &HashMap<RankId, serde_json::Value>) -> Result<(), RuntimeError> {
        Ok(())
    }

    /// Executes the rank's plan for one version.
    fn execute(&mut self, ctx: &ExecContext<'_>) -> Result<ExecStats, RuntimeError>;

    /// Before a retry (attempt > 1) executes: a pair kv entry this rank publishes for it (nccl:
    /// training rank 0's fresh communicator id). None by default.
    fn kv_before_attempt(
        &mut self,
        _version: u64,
        _attempt: u32,
    ) -> Result<Option<(String, serde_json::Value)>, RuntimeError> {
        Ok(None)
    }

    /// Before a retry executes: the pair kv key this rank reads (waiting for it) and hands to
    /// [`Transport::begin_attempt`] (nccl: every other rank reads the fresh id). None by default.
    fn kv_for_attempt(&self, _version: u64, _attempt: u32) -> Option<String> {
        None
    }

    /// The value read under [`Transport::kv_for_attempt`]'s key, before the retry executes.
    fn begin_attempt(
        &mut self,
        _key: &str,
        _value: &serde_json::Value,
    ) -> Result<(), RuntimeError> {
        Ok(())
    }

    /// Whether this transport receives into staging tensors that [`Transport::apply`] copies
    /// into the live ones (atomic apply: [`StagedTransport`]).
    fn stages(&self) -> bool {
        false
    }

    /// Atomic apply: copies what the last update received into staging into the live tensors;
    /// the bytes copied. Transports that write the live tensors directly refuse.
    fn apply(&mut self) -> Result<u64, RuntimeError> {
        Err(crate::ConfigMismatch::NothingStaged {
            transport: self.kind(),
        }
        .into())
    }

    /// Turns delta updates on ([`crate::delta`]): a training rank keeps a host copy of its
    /// tensors as it last sent them and moves only the changed elements to inference ranks that
    /// hold that version; an inference rank applies them in place. Answers whether this
    /// transport does deltas; one that does not yet (the default) keeps moving every byte.
    fn enable_deltas(&mut self) -> Result<bool, RuntimeError> {
        Ok(false)
    }

    /// Training ranks of pairs with `check_finite`: before each update moves anything, the
    /// sources this rank sends are read for infinity and NaN ([`crate::finite`]), and the first
    /// one fails the update naming the tensor and element. Transports whose sources live in host
    /// memory (shm, tcp) do it; the default refuses, naming the transports that can.
    fn check_finite_sources(&mut self) -> Result<(), RuntimeError> {
        Err(crate::TransportError::Unsupported(format!(
            "check_finite reads the training ranks' sources on the host: the {} transport keeps them in GPU memory, where awex has no such check yet; use shm or tcp, or connect without check_finite",
            self.kind()
        ))
        .into())
    }

    /// Inference ranks: whether the tensors this transport writes hold exactly the bytes of the
    /// last update it completed, so that a delta against that version applies (deltas on).
    fn holds_base(&self) -> bool {
        false
    }

    /// Training ranks of pairs whose commit policy leaves failed engines out (`quorum:K`,
    /// `available`): with `lost` (the engines the gateway left out of the running version, filled
    /// as its `left_out` events come), a peer this rank cannot reach (its connection refused or
    /// broken, not an abort or the deadline), or whose engine is left out before it took its
    /// bytes, no longer fails the whole part; the others' transfers go on and
    /// [`Transport::unreached`] names its engine. Answers whether this transport does so; one
    /// that does not (the default) keeps failing the part on any peer's failure.
    fn tolerate_lost_engines(&mut self, _lost: Option<Arc<LostEngines>>) -> bool {
        false
    }

    /// The engines the last [`Transport::execute`] could not reach (see
    /// [`Transport::tolerate_lost_engines`]), ascending; empty by default.
    fn unreached(&self) -> Vec<u32> {
        Vec::new()
    }

    /// Releases every resource (sockets, segments, handles).
    fn close(&mut self);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_straggler_cutoff_leaves_a_tenth_of_the_time_within_half_a_second_and_five() {
        let now = Instant::now();
        let at = |s: f64| straggler_cutoff(now, now + Duration::from_secs_f64(s));
        // 60 s: 6 s would be a tenth, 5 s is the most
        assert_eq!(at(60.0), now + Duration::from_secs(55));
        // 20 s: a tenth
        assert_eq!(at(20.0), now + Duration::from_secs(18));
        // 3 s: 0.3 s would be a tenth, 0.5 s is the least
        assert_eq!(at(3.0), now + Duration::from_millis(2500));
        // 0.6 s: half of what is left
        assert_eq!(at(0.6), now + Duration::from_millis(300));
        // past the deadline: the deadline
        assert_eq!(straggler_cutoff(now + Duration::from_secs(1), now), now);
    }
}
