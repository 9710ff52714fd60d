//! One update on a joined rank ([`Rank::execute`]): the transport moves the bytes on a blocking
//! task while a watcher follows the pair's event stream for an abort; the result is reported,
//! and an atomic pair's staging is applied on the gateway's `apply`.

use super::kv::checked;
use super::{Rank, RankError, Work, read_checked_kv, rendezvous_key, retry_gateway};
use crate::transport::{ExecContext, ExecStats};
use crate::{RuntimeError, TransportError};
use awex_control::client::ClientError;
use awex_control::wire::{EventKind, Report, ReportDelta};
use awex_core::layout::RankId;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

/// The task that watches the pair's event stream for an abort while a transport moves bytes
/// ([`Rank::execute`]); told to stop when dropped, so no way out of an update leaves it
/// polling. It is never aborted mid-poll: the gateway takes a poll whose connection closes
/// unanswered for the rank's process gone, and lets another process take its slot; the poll
/// open when it is stopped (at most 2 s) ends in the background, answered.
struct Watcher(Arc<AtomicBool>);

impl Watcher {
    /// Starts `watch` (a loop that ends once the flag it is given is set).
    fn start<F: std::future::Future<Output = ()> + Send + 'static>(
        watch: impl FnOnce(Arc<AtomicBool>) -> F,
    ) -> Watcher {
        let stop = Arc::new(AtomicBool::new(false));
        tokio::spawn(watch(stop.clone()));
        Watcher(stop)
    }

    /// Stops the task after the poll it has open.
    async fn stop(self) {}
}

impl Drop for Watcher {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Release);
    }
}

impl Rank {
    /// Reads the peers' rendezvous values again. A training rank of a pair whose engines may
    /// join and leave also reads those of every inference rank of the engines that take part
    /// in `work` (an engine added since this rank joined), and forgets the ranks of engines
    /// out of it (a removed engine's values are gone).
    async fn refresh_peers(&mut self, work: Work) -> Result<(), ClientError> {
        let other = self.cfg.side.other();
        let mut ranks: Vec<RankId> = self.peers.keys().copied().collect();
        let out = self
            .out
            .as_ref()
            .filter(|(w, _)| *w == work)
            .map(|(_, o)| o.clone())
            .unwrap_or_default();
        let elastic = self.cfg.side == awex_core::layout::Side::Training
            && !self.joined.options.commit.is_all();
        if elastic {
            let engines = self.joined.engines.max(1);
            let per = self.joined.inference_world_size / engines;
            ranks = (0..engines)
                .filter(|e| !out.contains(e))
                .flat_map(|e| (0..per).map(move |r| RankId::infer(e, r)))
                .collect();
            self.peers.retain(|r, _| !out.contains(&r.engine));
        }
        for r in ranks {
            let got = self
                .client
                .get_kv(&self.cfg.pair, &rendezvous_key(other, r), Duration::ZERO)
                .await;
            match got {
                Ok(e) => {
                    self.peers
                        .insert(r, e.value.get("transport").cloned().unwrap_or_default());
                }
                // a rank of an engine that takes part but has not published (it left since
                // the version started): its engine cannot be reached and is left out
                Err(e) if elastic && e.status() == Some(404) => {
                    self.peers.remove(&r);
                }
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    /// Before a retry: publishes what the transport publishes for it, reads what it reads
    /// (waiting at most the update deadline) and hands that to the transport.
    async fn attempt_kv(&mut self, work: Work) -> Result<(), RuntimeError> {
        let t = self
            .transport
            .as_mut()
            .ok_or(TransportError::Closed("transport"))?;
        let gw = |source: ClientError| RuntimeError::Gateway {
            what: "pair kv",
            source,
        };
        if let Some((key, value)) = t.kv_before_attempt(work.version, work.attempt)? {
            self.client
                .put_kv(&self.cfg.pair, &key, value)
                .await
                .map_err(gw)?;
        }
        if let Some(key) = t.kv_for_attempt(work.version, work.attempt) {
            let wait = Duration::from_millis(self.joined.options.update_deadline_ms);
            let t = std::sync::Mutex::new(
                self.transport
                    .take()
                    .ok_or(TransportError::Closed("transport"))?,
            );
            let value = read_checked_kv(&self.client, &self.cfg.pair, &key, wait, |v| {
                checked(&t, &key, v)
            })
            .await;
            self.transport = Some(t.into_inner().unwrap_or_else(|e| e.into_inner()));
            let value = value?;
            let t = self
                .transport
                .as_mut()
                .ok_or(TransportError::Closed("transport"))?;
            t.begin_attempt(&key, &value)?;
        }
        Ok(())
    }

    /// Executes one piece of work and reports it; returns what moved, or the error reported.
    pub async fn execute(
        &mut self,
        work: Work,
        checksums: bool,
    ) -> Result<ExecStats, RuntimeError> {
        let tolerant = !self.joined.options.commit.is_all();
        if work.attempt > 1 || tolerant {
            // a restarted peer publishes new rendezvous values (a retry; or, where engines may
            // be left out of a version, before every update: an engine left out may have been
            // restarted since, and a sender whose bytes it took before it died never knew)
            if let Err(e) = self.refresh_peers(work).await {
                return self
                    .report(
                        work,
                        Err(RuntimeError::Gateway {
                            what: "reading the peers' rendezvous values",
                            source: e,
                        }),
                    )
                    .await;
            }
        }
        if work.attempt > 1 {
            // nccl: a fresh communicator per retry, its id shared through the kv
            if let Err(e) = self.attempt_kv(work).await {
                return self.report(work, Err(e)).await;
            }
        }
        // bounded by the attempt's deadline as the gateway set it, not counted from when this
        // rank got to it: a rank resumed after a stop past that deadline fails at once
        let deadline = match self.work_deadline(work).await {
            Ok(d) => d,
            Err(e) => return self.report(work, Err(e)).await,
        };
        if deadline <= Instant::now() {
            return self
                .report(work, Err(RuntimeError::Deadline(work.version)))
                .await;
        }
        let cancel = Arc::new(AtomicBool::new(false));
        // a transport lost to a panic of an earlier update: this one fails, and says so
        let Some(mut transport) = self.transport.take() else {
            return self.report(work, Err(TransportError::Lost.into())).await;
        };
        // a failed engine is left out of the version instead of failing it, where the pair's
        // commit policy allows and the transport can
        self.lost.clear();
        // the engine slots out of this version from its start (free, or still joining)
        if let Some((w, out)) = &self.out
            && *w == work
        {
            for &e in out {
                self.lost.insert_absent(e);
            }
        }
        // engines left out in events read together with this work's `update` (the watcher
        // below reads only what comes after them)
        for ev in &self.pending {
            if ev.kind == EventKind::LeftOut
                && ev.version == Some(work.version)
                && ev.attempt.unwrap_or(1) == work.attempt
            {
                for &e in &ev.engines {
                    self.lost.insert(e);
                }
            }
        }
        if tolerant {
            self.lost
                .set_cutoff(crate::transport::straggler_cutoff(Instant::now(), deadline));
        }
        transport.tolerate_lost_engines(tolerant.then(|| self.lost.clone()));
        let peers = self.peers.clone();
        let bases = self
            .bases
            .as_ref()
            .filter(|(w, _)| *w == work)
            .map(|(_, b)| b.clone());
        let corrupt = self.corrupt_version == Some(work.version);
        let c2 = cancel.clone();
        let t_moved = Instant::now();
        let job = tokio::task::spawn_blocking(move || {
            let ctx = ExecContext {
                version: work.version,
                attempt: work.attempt,
                deadline,
                cancel: &c2,
                checksums,
                peers: &peers,
                corrupt,
                bases: bases.as_ref(),
            };
            let r = transport.execute(&ctx);
            (transport, r)
        });
        // watch the event stream for an abort of this version while the bytes move; the events
        // stay on the gateway, so `next_work` still sees them afterwards
        let watcher = Watcher::start({
            let client = self.client.clone();
            let pair = self.cfg.pair.clone();
            let cancel = cancel.clone();
            let mut after = self.last_seq;
            let me = self.incarnation().to_string();
            let watched = self.watched_seq.clone();
            let lost = self.lost.clone();
            let (side, me_rank) = (self.cfg.side, self.cfg.rank);
            move |stop: Arc<AtomicBool>| async move {
                while !stop.load(Ordering::Acquire) {
                    let polled = client
                        .events_as(&pair, after, Duration::from_secs(2), Some(&me))
                        .await;
                    match polled {
                        Ok(r) => {
                            after = r.last_seq.max(after);
                            watched.fetch_max(after, Ordering::AcqRel);
                            for ev in &r.events {
                                // an engine left out: stop sending to it and waiting for it
                                if ev.kind == EventKind::LeftOut
                                    && ev.version == Some(work.version)
                                    && ev.attempt.unwrap_or(1) == work.attempt
                                {
                                    for &e in &ev.engines {
                                        lost.insert(e);
                                    }
                                }
                            }
                            let aborted = r.events.iter().any(|ev| match ev.kind {
                                // (an earlier attempt's abort stays in the stream: a rank
                                // told its attempt directly starts watching before it)
                                EventKind::Abort => {
                                    ev.version == Some(work.version)
                                        && ev.attempt.unwrap_or(1) >= work.attempt
                                }
                                EventKind::Disconnect => true,
                                // this rank's engine left the pair: stop at once
                                EventKind::EngineRemoved => {
                                    side == awex_core::layout::Side::Inference
                                        && ev.engines.contains(&me_rank.engine)
                                }
                                // a later attempt or version started: this attempt is over
                                // (a rank that took it late, its abort already behind it)
                                EventKind::Update => {
                                    ev.version > Some(work.version)
                                        || (ev.version == Some(work.version)
                                            && ev.attempt.unwrap_or(1) > work.attempt)
                                }
                                EventKind::Apply | EventKind::LeftOut => false,
                            });
                            if aborted {
                                cancel.store(true, Ordering::Release);
                            }
                        }
                        Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
                    }
                }
            }
        });
        let joined = job.await;
        watcher.stop().await;
        // a transport that panicked is gone (its task unwound); the failure is reported all the
        // same, so the version fails now instead of at its deadline
        let (transport, result) = match joined {
            Ok(done) => done,
            Err(e) => return self.report(work, Err(TransportError::Task(e).into())).await,
        };
        if result.is_ok() {
            self.last_transfer = Some((work, t_moved.elapsed()));
        }
        let stages = transport.stages();
        self.unreached = transport.unreached();
        self.transport = Some(transport);
        let received = self.report(work, result).await?;
        if !stages {
            return Ok(received);
        }
        // atomic: received and verified into staging; the live tensors change only on `apply`
        self.wait_apply(work, deadline).await?;
        let mut transport = self
            .transport
            .take()
            .ok_or(TransportError::Closed("transport"))?;
        let job = tokio::task::spawn_blocking(move || {
            let r = transport.apply();
            (transport, r)
        });
        let applied = match job.await {
            Ok((transport, applied)) => {
                self.transport = Some(transport);
                applied
            }
            Err(e) => Err(TransportError::Task(e).into()),
        };
        let applied = applied.map(|_| received).map_err(|e| RuntimeError::Apply {
            version: work.version,
            cause: Box::new(e),
        });
        self.report(work, applied).await
    }

    /// Atomic pairs, inference ranks: waits for the gateway's `apply` event of `work` (every
    /// rank of both sides received). Its abort, a later attempt, a disconnect, the deadline, or
    /// this rank's engine left out of the attempt (named by a `left_out` event or by `apply`
    /// itself) end the wait with an error: the live tensors were not touched.
    async fn wait_apply(&mut self, work: Work, deadline: Instant) -> Result<(), RuntimeError> {
        let mut after = self.last_seq;
        let v = Some(work.version);
        let me = self.incarnation().to_string();
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(RuntimeError::Deadline(work.version));
            }
            let polled = self
                .client
                .events_as(
                    &self.cfg.pair,
                    after,
                    left.min(Duration::from_secs(30)),
                    Some(&me),
                )
                .await;
            match polled {
                Ok(r) => {
                    after = r.last_seq.max(after);
                    self.watched_seq.fetch_max(after, Ordering::AcqRel);
                    for ev in r.events {
                        let attempt = ev.attempt.unwrap_or(1);
                        match ev.kind {
                            // per-engine commits: `apply` names the engines left out, whose
                            // ranks leave their live tensors as they are
                            EventKind::Apply if ev.version == v && attempt == work.attempt => {
                                if ev.engines.contains(&self.cfg.rank.engine) {
                                    return Err(RuntimeError::Aborted(work.version));
                                }
                                return Ok(());
                            }
                            EventKind::LeftOut
                                if ev.version == v
                                    && attempt == work.attempt
                                    && ev.engines.contains(&self.cfg.rank.engine) =>
                            {
                                return Err(RuntimeError::Aborted(work.version));
                            }
                            EventKind::Abort if ev.version == v && attempt >= work.attempt => {
                                return Err(RuntimeError::Aborted(work.version));
                            }
                            EventKind::Update
                                if ev.version > v
                                    || (ev.version == v && attempt > work.attempt) =>
                            {
                                return Err(RuntimeError::Aborted(work.version));
                            }
                            EventKind::Disconnect => {
                                return Err(RuntimeError::Aborted(work.version));
                            }
                            _ => {}
                        }
                    }
                }
                Err(e) if matches!(e.status(), Some(404) | Some(410)) => {
                    return Err(RuntimeError::Aborted(work.version));
                }
                Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
            }
        }
    }

    async fn report(
        &mut self,
        work: Work,
        result: Result<ExecStats, RuntimeError>,
    ) -> Result<ExecStats, RuntimeError> {
        let deltas_on = self.joined.options.deltas;
        let holds = self.transport.as_ref().is_some_and(|t| t.holds_base());
        let delta = |s: &ExecStats| {
            deltas_on.then_some(ReportDelta {
                dense_bytes: s.dense_bytes(),
                elements: s.delta.elements,
                changed: s.delta.changed,
                holds,
            })
        };
        let report = match &result {
            Ok(s) => Report {
                side: self.cfg.side,
                rank: self.cfg.rank,
                ok: true,
                bytes: s.bytes,
                checksum: Some(s.checksum),
                error: None,
                attempt: Some(work.attempt),
                incarnation: Some(self.incarnation().to_string()),
                delta: delta(s),
                unreached: self.unreached.clone(),
            },
            Err(e) => Report {
                side: self.cfg.side,
                rank: self.cfg.rank,
                ok: false,
                bytes: 0,
                checksum: None,
                error: Some(e.to_string()),
                attempt: Some(work.attempt),
                incarnation: Some(self.incarnation().to_string()),
                delta: None,
                unreached: Vec::new(),
            },
        };
        // a report that may have arrived is re-sent only after a transient failure: the gateway
        // refuses a duplicate with 409, which is what a version that failed meanwhile answers
        let sent = retry_gateway(&self.cfg.gateway, "reporting", self.update_limit(), || {
            self.client.report(&self.cfg.pair, work.version, &report)
        })
        .await;
        if let Err(e) = sent {
            let refused = matches!(&e, RankError::Gateway(c) if c.status() == Some(409));
            if result.is_ok() && refused {
                // refused because the attempt is over (failed, or a later one started while
                // this rank ran it late): its part does not count, and the caller must not
                // wait for the version's outcome as if it did. Refused as a repeat of a report
                // that did arrive: the attempt still runs or committed, and the part counts.
                let st = self
                    .client
                    .update_status(&self.cfg.pair, work.version)
                    .await;
                let engine = self.cfg.rank.engine;
                let inference = self.cfg.side == awex_core::layout::Side::Inference;
                let over = match &st {
                    Ok(st)
                        if st.attempt != work.attempt
                            || st.state == awex_control::wire::UpdateState::Failed =>
                    {
                        Some(super::over_why(st))
                    }
                    // settled without this rank's engine: it does not hold the version
                    Ok(st) if inference && st.left_out.iter().any(|l| l.engine == engine) => {
                        Some(format!("engine {engine} was left out of it"))
                    }
                    _ => None,
                };
                if let Some(why) = over {
                    return Err(RuntimeError::AttemptOver {
                        version: work.version,
                        attempt: work.attempt,
                        why,
                    });
                }
            }
            // a report refused because the version already failed is not this rank's error
            if result.is_ok() && !refused {
                return Err(match e {
                    RankError::Gateway(source) => RuntimeError::Gateway {
                        what: "report to the gateway failed",
                        source,
                    },
                    RankError::Runtime(r) => r,
                    other => RuntimeError::GatewayLost {
                        what: "report to the gateway failed",
                        reason: other.to_string(),
                    },
                });
            }
        }
        result
    }
}
