//! Atomic apply on an inference rank: a transport that receives into staging tensors (one copy
//! of the rank's shard, in the same kind of memory as its live tensors) and copies them into
//! the live tensors only when told to ([`Transport::apply`]), once the gateway saw every rank
//! of both sides receive and verify (its `apply` event). A failure before that leaves the live
//! tensors exactly as the last committed version wrote them.

use crate::transport::{ExecContext, ExecStats, PairSecret, Transport};
use crate::{RuntimeError, TensorSet};
use awex_core::layout::RankId;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

/// A transport over staging tensors, and the live tensors it applies them to.
pub struct StagedTransport {
    inner: Box<dyn Transport>,
    staging: Arc<TensorSet>,
    live: Arc<TensorSet>,
}

impl StagedTransport {
    /// `inner` moves bytes into `staging`; [`Transport::apply`] copies `staging` into `live`
    /// (same tensors, same kind of memory: [`TensorSet::staging_like`]).
    pub fn new(inner: Box<dyn Transport>, staging: Arc<TensorSet>, live: Arc<TensorSet>) -> Self {
        StagedTransport {
            inner,
            staging,
            live,
        }
    }

    /// The staging tensors (what the last update received).
    pub fn staging(&self) -> &Arc<TensorSet> {
        &self.staging
    }
}

impl Transport for StagedTransport {
    fn kind(&self) -> awex_core::Transport {
        self.inner.kind()
    }

    fn rendezvous(&self) -> serde_json::Value {
        self.inner.rendezvous()
    }

    fn kv_at_join(&self) -> Result<Option<(String, serde_json::Value)>, RuntimeError> {
        self.inner.kv_at_join()
    }

    fn kv_after_join(&self) -> Option<String> {
        self.inner.kv_after_join()
    }

    fn check_kv(&self, key: &str, value: &serde_json::Value) -> Result<(), RuntimeError> {
        self.inner.check_kv(key, value)
    }

    fn joined(
        &mut self,
        value: Option<&serde_json::Value>,
        join_deadline: Duration,
    ) -> Result<(), RuntimeError> {
        self.inner.joined(value, join_deadline)
    }

    fn authenticate(&mut self, secret: &PairSecret) {
        self.inner.authenticate(secret)
    }

    fn connect(&mut self, peers: &HashMap<RankId, serde_json::Value>) -> Result<(), RuntimeError> {
        self.inner.connect(peers)
    }

    fn execute(&mut self, ctx: &ExecContext<'_>) -> Result<ExecStats, RuntimeError> {
        self.inner.execute(ctx)
    }

    fn kv_before_attempt(
        &mut self,
        version: u64,
        attempt: u32,
    ) -> Result<Option<(String, serde_json::Value)>, RuntimeError> {
        self.inner.kv_before_attempt(version, attempt)
    }

    fn kv_for_attempt(&self, version: u64, attempt: u32) -> Option<String> {
        self.inner.kv_for_attempt(version, attempt)
    }

    fn begin_attempt(&mut self, key: &str, value: &serde_json::Value) -> Result<(), RuntimeError> {
        self.inner.begin_attempt(key, value)
    }

    fn stages(&self) -> bool {
        true
    }

    fn enable_deltas(&mut self) -> Result<bool, RuntimeError> {
        self.inner.enable_deltas()
    }

    fn holds_base(&self) -> bool {
        self.inner.holds_base()
    }

    fn check_finite_sources(&mut self) -> Result<(), RuntimeError> {
        self.inner.check_finite_sources()
    }

    fn tolerate_lost_engines(&mut self, lost: Option<Arc<super::LostEngines>>) -> bool {
        self.inner.tolerate_lost_engines(lost)
    }

    fn unreached(&self) -> Vec<u32> {
        self.inner.unreached()
    }

    fn apply(&mut self) -> Result<u64, RuntimeError> {
        self.live.copy_from(&self.staging)
    }

    fn close(&mut self) {
        self.inner.close()
    }
}
