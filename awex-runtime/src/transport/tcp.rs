//! The `tcp` transport: buckets streamed over one connection per peer pair.
//!
//! Inference ranks listen and publish their address; training ranks connect and open with a
//! hello carrying both ranks, the peer plan's fingerprint and the bucket size, which the
//! receiver checks, then both ends prove they hold the pair's secret (an HMAC-SHA256
//! challenge-response over both ends' nonces, see [`super::auth`]): a connection that does not
//! is refused and logged, and so is a second connection for a peer whose stream is live. Per
//! update, each peer pair runs a two-stage pipeline on each end with two bucket buffers:
//! pack (with dtype conversion) overlaps send on the sender, receive overlaps unpack on the
//! receiver. Every frame names its version and bucket; a mismatch fails the update.
//!
//! With deltas on ([`crate::delta`]), a frame to an inference rank that holds the version the
//! sender's copy holds carries the bucket's delta instead of its bytes (flag bit 0, and the
//! base version in the header); the receiver refuses a delta against a version its tensors from
//! that sender do not hold, and applies it in place otherwise.
//!
//! Every blocking call waits in slices of at most [`SLICE`], so that each thread of the
//! transport stops on an I/O error, on abort, at the deadline or on disconnect; when one stage
//! of a pipeline stops, the other sees its channels close and stops too.

use super::auth::{PairSecret, random_bytes};
use super::{ExecContext, ExecStats, Transport};
use crate::bucket::{Bucket, hash_destination, make_buckets, pack, unpack};
use crate::delta::{
    Changes, Encoded, HeldBases, SenderBase, SharedDeltas, apply_bucket, check_base,
    encode_bucket_from, max_len,
};
use crate::tensors::TensorSet;
use crate::{RuntimeError, TransportError};
use awex_core::encoding::Fp8Quantiser;
use awex_core::layout::{RankId, Side};
use awex_core::plan::{PeerPlan, RankPlan};
use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{Receiver, SyncSender, sync_channel};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

const HELLO: u64 = u64::from_le_bytes(*b"AWEXTCP2");
/// Magic, source, destination, fingerprint, tag, bucket bytes, then the sender's nonce.
const HELLO_LEN: usize = 48 + 32;
/// How long a blocking socket call waits before the transport checks abort and deadline again.
pub(crate) const SLICE: Duration = Duration::from_millis(100);
/// How long an accepted connection has to complete its hello.
const HANDSHAKE: Duration = Duration::from_secs(5);
/// Hellos being read at once; connections beyond are refused (a flood cannot starve peers).
const MAX_HANDSHAKES: usize = 64;
const FRAME: u32 = u32::from_le_bytes(*b"AWXB");
/// Magic, flags, version, bucket, length, checksum, base version.
const FRAME_HEADER: usize = 48;
/// Frame flag: the payload is the bucket's delta against the header's base version.
const FLAG_DELTA: u32 = 1;

/// A filled bucket buffer: (bytes used, buffer, checksum of the dense bytes, delta base).
type Filled = (usize, Vec<u8>, u64, Option<u64>);

/// Accepted streams by peer, with the tag (version, attempt) of the retry they were opened for (0: first).
type Streams = Arc<(Mutex<HashMap<RankId, (u64, TcpStream)>>, Condvar)>;

/// TCP transport for one rank.
pub struct TcpTransport {
    side: Side,
    me: RankId,
    plan: Arc<RankPlan>,
    buckets: Vec<Arc<Vec<Bucket>>>,
    tensors: Arc<TensorSet>,
    bucket_bytes: u64,
    addr: Option<String>,
    incoming: Streams,
    outgoing: HashMap<RankId, TcpStream>,
    /// the rendezvous value each outgoing connection was opened with
    connected: HashMap<RankId, serde_json::Value>,
    stop: Arc<AtomicBool>,
    secret: Arc<Mutex<Option<PairSecret>>>,
    refused: Arc<Refusals>,
    /// the quantiser of sender-encoded FP8 transfers (a training rank of an FP8 pair)
    fp8: Option<Fp8Quantiser>,
    /// deltas on: a training rank's copy of what it last sent
    base: Option<SenderBase>,
    /// deltas on: what an inference rank's tensors hold, per sender
    held: Arc<HeldBases>,
    deltas: bool,
    /// Pair option `check_finite` (training ranks): sources read for infinity and NaN first.
    check_finite: bool,
    /// training ranks: a peer that cannot be reached leaves only its engine out
    /// ([`Transport::tolerate_lost_engines`])
    tolerate: bool,
    /// the engines the last send could not reach
    unreached: std::collections::BTreeSet<u32>,
    /// the engines the gateway left out of the running version
    lost: Option<Arc<super::LostEngines>>,
    /// The most threads per peer that encode or apply deltas (`None`: the cores, up to 16).
    delta_threads: Option<usize>,
}

/// What a peer stream's end needs besides its plan, tensors and socket: the bucket size, the
/// FP8 quantiser and its part in deltas.
struct PeerDelta<'a> {
    /// the pair's bucket size
    bb: u64,
    /// the quantiser of sender-encoded FP8 transfers
    fp8: Option<&'a Fp8Quantiser>,
    /// sending: the version the peer holds and the copy holding it, when the peer gets deltas
    /// (the encoders record what they find changed into it)
    base: Option<(u64, &'a SenderBase)>,
    /// sending: the deltas this rank's peers share (each encoded once per update)
    shared: &'a SharedDeltas,
    /// receiving: what this rank's tensors hold per sender
    held: &'a HeldBases,
    /// receiving: whether this rank takes deltas (its pair has them on)
    deltas: bool,
    /// sending, in a pair that may leave engines out: from this instant on, a peer that has
    /// not taken every byte is given up (its engine reported unreached)
    cutoff: Option<Instant>,
    /// the most threads that encode (sending) or apply (receiving) this peer's deltas
    threads: usize,
}

/// Threads per peer that encode or apply deltas when the config does not say: the cores, up
/// to 16 (on 16 cores a qwen3-0.6b delta update took 278 ms with 4, 197 with 8 and 101 with
/// 16: docs/deltas.md).
fn auto_delta_threads() -> usize {
    std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .clamp(1, 16)
}

/// Where a blocking socket call stands: the deadline, the abort flag, whom it waits for.
struct Io<'a> {
    deadline: Instant,
    cancel: &'a AtomicBool,
    version: u64,
    peer: String,
}

impl Io<'_> {
    fn for_update<'a>(ctx: &'a ExecContext<'_>, peer: String) -> Io<'a> {
        Io {
            deadline: ctx.deadline,
            cancel: ctx.cancel,
            version: ctx.version,
            peer,
        }
    }

    /// Runs `op` in slices until it made progress, checking abort and deadline in between.
    fn wait<T>(
        &self,
        s: &TcpStream,
        what: &str,
        started: Instant,
        write: bool,
        mut op: impl FnMut() -> std::io::Result<T>,
    ) -> Result<T, RuntimeError> {
        loop {
            if self.cancel.load(Ordering::Acquire) {
                return Err(RuntimeError::Aborted(self.version));
            }
            let left = self.deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(TransportError::PeerTimedOut {
                    what: what.to_string(),
                    peer: self.peer.clone(),
                    after: started.elapsed(),
                }
                .into());
            }
            let t = Some(left.min(SLICE).max(Duration::from_millis(1)));
            if write {
                s.set_write_timeout(t).ok();
            } else {
                s.set_read_timeout(t).ok();
            }
            match op() {
                Ok(v) => return Ok(v),
                Err(e)
                    if matches!(
                        e.kind(),
                        std::io::ErrorKind::WouldBlock
                            | std::io::ErrorKind::TimedOut
                            | std::io::ErrorKind::Interrupted
                    ) => {}
                Err(e) => {
                    return Err(TransportError::PeerFailed {
                        what: what.to_string(),
                        peer: self.peer.clone(),
                        source: e,
                    }
                    .into());
                }
            }
        }
    }

    /// Reads exactly `buf.len()` bytes.
    fn read(&self, s: &mut TcpStream, buf: &mut [u8], what: &str) -> Result<(), RuntimeError> {
        let started = Instant::now();
        let mut off = 0;
        while off < buf.len() {
            let r = &mut *s;
            let n = self.wait(&*r, what, started, false, || (&*r).read(&mut buf[off..]))?;
            if n == 0 {
                return Err(TransportError::PeerClosed {
                    what: what.to_string(),
                    peer: self.peer.clone(),
                }
                .into());
            }
            off += n;
        }
        Ok(())
    }

    /// Writes all of `buf`.
    fn write(&self, s: &mut TcpStream, buf: &[u8], what: &str) -> Result<(), RuntimeError> {
        let started = Instant::now();
        let mut off = 0;
        while off < buf.len() {
            let r = &mut *s;
            let n = self.wait(&*r, what, started, true, || (&*r).write(&buf[off..]))?;
            if n == 0 {
                return Err(TransportError::PeerClosed {
                    what: what.to_string(),
                    peer: self.peer.clone(),
                }
                .into());
            }
            off += n;
        }
        Ok(())
    }
}

fn io_err(what: String) -> impl FnOnce(std::io::Error) -> RuntimeError {
    move |source| TransportError::Io { what, source }.into()
}

fn remaining(deadline: Instant) -> Result<Duration, RuntimeError> {
    let d = deadline.saturating_duration_since(Instant::now());
    if d.is_zero() {
        return Err(TransportError::DeadlinePassed.into());
    }
    Ok(d)
}

fn rank_of(x: u64) -> RankId {
    RankId {
        engine: (x >> 32) as u32,
        rank: x as u32,
    }
}

/// The hello a training rank opens with (without its nonce).
fn hello_words(src: RankId, dst: RankId, fp: u64, tag: u64, bucket_bytes: u64) -> [u64; 6] {
    [HELLO, key(src), key(dst), fp, tag, bucket_bytes]
}

/// Whether the other end of a stream is still there (no EOF, no error), without reading.
fn alive(s: &TcpStream) -> bool {
    use std::os::fd::AsRawFd;
    let mut b = [0u8; 1];
    // SAFETY: a valid socket and a 1-byte buffer; MSG_PEEK leaves the data in place.
    let n = unsafe {
        libc::recv(
            s.as_raw_fd(),
            b.as_mut_ptr() as *mut libc::c_void,
            1,
            libc::MSG_PEEK | libc::MSG_DONTWAIT,
        )
    };
    if n > 0 {
        return true;
    }
    if n == 0 {
        return false;
    }
    let e = std::io::Error::last_os_error();
    matches!(
        e.kind(),
        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::Interrupted
    )
}

fn key(r: RankId) -> u64 {
    ((r.engine as u64) << 32) | r.rank as u64
}

impl TcpTransport {
    /// Quantises the plan's sender-encoded FP8 transfers with `q` (the pair's recipe) as it
    /// packs them: set on a training rank of a pair with an FP8 inference side.
    pub fn set_fp8(&mut self, q: Option<Fp8Quantiser>) {
        self.fp8 = q;
    }

    /// The most threads that encode (training) or apply (inference) one peer's deltas
    /// ([`super::TcpConfig::delta_threads`]); `None`: the cores, up to 16.
    pub fn set_delta_threads(&mut self, n: Option<usize>) {
        self.delta_threads = n.filter(|&n| n > 0);
    }

    /// A transport for one rank; inference ranks listen on `bind` (e.g. `127.0.0.1:0`) and
    /// advertise `advertise_host` with the bound port.
    pub fn new(
        plan: Arc<RankPlan>,
        tensors: Arc<TensorSet>,
        bucket_bytes: u64,
        bind: &str,
        advertise_host: &str,
    ) -> Result<Self, RuntimeError> {
        tensors.require_host("the tcp transport")?;
        let buckets = plan
            .peers
            .iter()
            .map(|p| Arc::new(make_buckets(&p.transfers, bucket_bytes)))
            .collect();
        let mut t = TcpTransport {
            side: plan.side,
            me: plan.rank,
            plan,
            buckets,
            tensors,
            bucket_bytes: bucket_bytes.max(1),
            addr: None,
            incoming: Arc::new((Mutex::new(HashMap::new()), Condvar::new())),
            outgoing: HashMap::new(),
            connected: HashMap::new(),
            stop: Arc::new(AtomicBool::new(false)),
            secret: Arc::new(Mutex::new(None)),
            refused: Arc::new(Refusals::default()),
            fp8: None,
            base: None,
            held: Arc::new(HeldBases::default()),
            deltas: false,
            check_finite: false,
            tolerate: false,
            unreached: Default::default(),
            lost: None,
            delta_threads: None,
        };
        if t.side == Side::Inference {
            let listener =
                TcpListener::bind(bind).map_err(io_err(format!("cannot listen on {bind}")))?;
            let port = listener
                .local_addr()
                .map_err(io_err("listener address".into()))?
                .port();
            t.addr = Some(format!("{advertise_host}:{port}"));
            let fingerprints: HashMap<RankId, u64> = t
                .plan
                .peers
                .iter()
                .map(|p| (p.peer, p.fingerprint))
                .collect();
            listener
                .set_nonblocking(true)
                .map_err(io_err("listener".into()))?;
            let acceptor = Acceptor {
                incoming: t.incoming.clone(),
                stop: t.stop.clone(),
                me: t.me,
                fingerprints,
                bucket_bytes: t.bucket_bytes,
                secret: t.secret.clone(),
                refused: t.refused.clone(),
                handshakes: Arc::new(AtomicUsize::new(0)),
            };
            std::thread::Builder::new()
                .name("awex-tcp-accept".into())
                .spawn(move || acceptor.run(listener))
                .map_err(io_err("spawn acceptor".into()))?;
        }
        Ok(t)
    }

    /// Connections this (inference) rank refused: a failed hello, a missing or wrong proof of
    /// the pair secret, or a second connection for a live peer.
    pub fn refused(&self) -> u64 {
        self.refused.count.load(Ordering::Acquire)
    }

    /// The address inference ranks listen on (`None` on training ranks).
    pub fn addr(&self) -> Option<&str> {
        self.addr.as_deref()
    }

    fn connect(&mut self, peer: &PeerPlan, ctx: &ExecContext<'_>) -> Result<(), RuntimeError> {
        // a retry always opens fresh connections: the old ones may hold half a failed attempt.
        // Every connection names the attempt it was opened for, so that the receiver lets it
        // replace an older stream that still looks live (one that holds the unread half of a
        // part it gave up on, as a stopped and resumed receiver's does)
        let tag = ctx.tag();
        if ctx.attempt > 1 {
            if let Some(old) = self.outgoing.remove(&peer.peer) {
                let _ = old.shutdown(std::net::Shutdown::Both);
            }
        } else if self.outgoing.contains_key(&peer.peer) {
            if self.connected.get(&peer.peer) == ctx.peers.get(&peer.peer) {
                return Ok(());
            }
            // the peer published new rendezvous values since (a restarted process): the old
            // connection leads to the process it replaced
            if let Some(old) = self.outgoing.remove(&peer.peer) {
                let _ = old.shutdown(std::net::Shutdown::Both);
            }
        }
        let addr = ctx
            .peers
            .get(&peer.peer)
            .and_then(|v| v.get("addr"))
            .and_then(|v| v.as_str())
            .ok_or_else(|| RuntimeError::from(TransportError::NoAddress { peer: peer.peer }))?;
        let sock = addr
            .to_socket_addrs()
            .map_err(io_err(format!("resolve {addr}")))?
            .next()
            .ok_or_else(|| TransportError::Unresolvable {
                addr: addr.to_string(),
            })?;
        let secret = self
            .secret
            .lock()
            .ok()
            .and_then(|g| g.clone())
            .ok_or_else(|| RuntimeError::from(TransportError::NoSecret))?;
        let wait = remaining(ctx.deadline)?.min(Duration::from_secs(10));
        let mut s = TcpStream::connect_timeout(&sock, wait).map_err(io_err(format!(
            "connect to inference rank {} at {addr}",
            peer.peer
        )))?;
        s.set_nodelay(true).ok();
        let mut io = Io::for_update(ctx, format!("inference rank {} at {addr}", peer.peer));
        // (a stopped peer's hello is given up at the cut-off, as its bytes would be)
        if let Some(c) = self.lost.as_ref().and_then(|l| l.cutoff()) {
            io.deadline = io.deadline.min(c);
        }
        let mut hello = Vec::with_capacity(HELLO_LEN);
        for w in hello_words(self.me, peer.peer, peer.fingerprint, tag, self.bucket_bytes) {
            hello.extend_from_slice(&w.to_le_bytes());
        }
        hello.extend_from_slice(&random_bytes());
        io.write(&mut s, &hello, "hello")?;
        let mut nonce = [0u8; 32];
        io.read(&mut s, &mut nonce, "hello (its challenge; a refusal means plans, bucket sizes or pair secrets disagree, see its log)")?;
        let mut transcript = hello[8..].to_vec();
        transcript.extend_from_slice(&nonce);
        io.write(&mut s, &secret.prove(b"S", &transcript), "hello (proof)")?;
        let mut theirs = [0u8; 32];
        io.read(
            &mut s,
            &mut theirs,
            "hello (its proof; a refusal means it does not accept this connection, see its log)",
        )?;
        if !secret.verify(b"R", &transcript, &theirs) {
            return Err(TransportError::NotAuthenticated {
                addr: addr.to_string(),
                pair: secret.pair().to_string(),
                peer: peer.peer,
            }
            .into());
        }
        self.outgoing.insert(peer.peer, s);
        if let Some(v) = ctx.peers.get(&peer.peer) {
            self.connected.insert(peer.peer, v.clone());
        }
        Ok(())
    }

    fn send(&mut self, ctx: &ExecContext<'_>) -> Result<ExecStats, RuntimeError> {
        let plan = self.plan.clone();
        self.unreached.clear();
        if self.check_finite {
            let sources = plan.peers.iter().flat_map(|p| &p.transfers);
            crate::finite::check_sources(&self.tensors, sources.map(|t| &*t.src_tensor))?;
        }
        let mut streams: Vec<(usize, TcpStream)> = Vec::new();
        for (i, peer) in plan.peers.iter().enumerate() {
            let lost = self
                .lost
                .as_ref()
                .is_some_and(|l| l.contains(peer.peer.engine));
            if lost {
                self.unreached.insert(peer.peer.engine);
            }
            if self.unreached.contains(&peer.peer.engine) {
                // its engine is out of this version: close the stream, so that the engine's
                // other ranks stop waiting for it now (a fresh one opens next time)
                if let Some(s) = self.outgoing.remove(&peer.peer) {
                    let _ = s.shutdown(std::net::Shutdown::Both);
                }
                continue;
            }
            if let Err(e) = self.connect(peer, ctx) {
                self.lose(peer.peer, e, ctx)?;
                continue;
            }
            let s = self.outgoing[&peer.peer]
                .try_clone()
                .map_err(io_err("clone socket".into()))?;
            streams.push((i, s));
        }
        if let Some(b) = self.base.as_mut() {
            // the last update's changes may still be landing in the copy (off that update's
            // path); a copy they could not be written into holds no version: every byte then
            if let Err(e) = b.settle() {
                tracing::warn!(version = ctx.version, "{e}");
            }
            b.forget_changes();
        }
        // the copy may be refreshed from the encoders' changes only when every peer of the
        // plan took a delta against it (every box this rank sends was compared) and got it
        let mut all_deltas = streams.len() == plan.peers.len()
            && self.base.as_ref().is_some_and(|b| {
                plan.peers
                    .iter()
                    .all(|p| b.base_for(ctx.bases, p.peer).is_some())
            });
        let mut sent = Ok(ExecStats::default());
        let started = Instant::now();
        for (peer, r) in self.run_peers(&plan, streams, ctx, send_peer) {
            all_deltas &= r.is_ok();
            match r {
                Ok(s) => {
                    if let Ok(total) = sent.as_mut() {
                        total.add(&s);
                    }
                }
                Err(e) => {
                    self.outgoing.remove(&peer);
                    if sent.is_ok()
                        && let Err(e) = self.lose(peer, e, ctx)
                    {
                        sent = Err(e);
                    }
                }
            }
        }
        if let Some(b) = self.base.as_mut() {
            match &mut sent {
                // what every peer now holds, unless a peer failed after all (then the gateway
                // names it in `except` and it gets every byte)
                Ok(st) => {
                    let (sending, t) = (started.elapsed(), Instant::now());
                    let bytes = if all_deltas {
                        b.refresh_changed(&self.tensors, ctx.version)?
                    } else {
                        b.refresh(&self.tensors, ctx.version)?
                    };
                    tracing::debug!(
                        rank = self.me.rank,
                        version = ctx.version,
                        sending_ms = sending.as_secs_f64() * 1e3,
                        refresh_ms = t.elapsed().as_secs_f64() * 1e3,
                        refresh_bytes = bytes,
                        partial = all_deltas,
                        "sent; refreshed the copy of what was sent"
                    );
                    st.refreshed = bytes;
                }
                Err(_) => b.invalidate(),
            }
        }
        sent
    }

    fn receive(&mut self, ctx: &ExecContext<'_>) -> Result<ExecStats, RuntimeError> {
        let plan = self.plan.clone();
        let mut total = ExecStats::default();
        // the peers still to receive from; a peer whose stream ended before this version's
        // first frame (given up by its sender) is waited for again once, on its fresh stream
        let mut todo: Vec<usize> = (0..plan.peers.len()).collect();
        let mut again_once = std::collections::HashSet::new();
        while !todo.is_empty() {
            let (streams, used) = self.take_streams(&plan, &todo, ctx)?;
            let mut again = Vec::new();
            for ((peer, r), &i) in self
                .run_peers(&plan, streams, ctx, receive_peer)
                .into_iter()
                .zip(&todo)
            {
                // a broken stream is dropped (the peer reconnects), but only the one this
                // attempt used: the peer may already have opened its fresh connection, which
                // replaced it in the map meanwhile
                let broken = |me: &Self| {
                    if let Ok(mut m) = me.incoming.0.lock()
                        && m.get(&peer).map(|(t, _)| *t) == used.get(&peer).copied()
                    {
                        m.remove(&peer);
                    }
                };
                match r {
                    Ok(s) => total.add(&s),
                    Err(RuntimeError::Transport(TransportError::GivenUpStream { .. }))
                        if again_once.insert(peer) =>
                    {
                        broken(self);
                        again.push(i);
                    }
                    Err(e) => {
                        broken(self);
                        return Err(e);
                    }
                }
            }
            todo = again;
        }
        Ok(total)
    }

    /// The stream of each peer in `todo` (indices into the plan's peers), waiting for each;
    /// and the tag each was opened with.
    #[allow(clippy::type_complexity)]
    fn take_streams(
        &self,
        plan: &RankPlan,
        todo: &[usize],
        ctx: &ExecContext<'_>,
    ) -> Result<(Vec<(usize, TcpStream)>, HashMap<RankId, u64>), RuntimeError> {
        let mut streams = Vec::new();
        // the tag of the stream taken from each peer
        let mut used: HashMap<RankId, u64> = HashMap::new();
        // an attempt aborted or past its deadline before it started (a rank that took it late)
        // takes no stream: the streams may be a later attempt's already
        ctx.check()?;
        let (lock, cv) = &*self.incoming;
        let mut map = lock
            .lock()
            .map_err(|_| RuntimeError::from(TransportError::Poisoned))?;
        let want = if ctx.attempt > 1 { ctx.tag() } else { 0 };
        for &i in todo {
            let peer = &plan.peers[i];
            loop {
                match map.get(&peer.peer) {
                    // a connection opened for a later attempt (a retry of this version, or of
                    // a later one): this attempt is over, and that stream is the later
                    // attempt's (left in place for it)
                    Some((t, _)) if *t != 0 && *t > ctx.tag() => {
                        return Err(RuntimeError::AttemptOver {
                            version: ctx.version,
                            attempt: ctx.attempt,
                            why: format!(
                                "training rank {} already connected for attempt {} of version {}",
                                peer.peer,
                                t & 0xffff,
                                t >> 16
                            ),
                        });
                    }
                    // on a retry, only a connection opened for this attempt will do
                    Some((t, _)) if want == 0 || *t == want => break,
                    _ => {}
                }
                ctx.check().map_err(|e| {
                    RuntimeError::from(TransportError::NeverConnected {
                        peer: peer.peer,
                        cause: Box::new(e),
                        refusals: self.refused.said(),
                    })
                })?;
                map = cv
                    .wait_timeout(map, Duration::from_millis(20))
                    .map_err(|_| RuntimeError::from(TransportError::Poisoned))?
                    .0;
            }
            let (tag, s) = &map[&peer.peer];
            used.insert(peer.peer, *tag);
            let s = s.try_clone().map_err(io_err("clone socket".into()))?;
            streams.push((i, s));
        }
        Ok((streams, used))
    }

    /// A training rank could not reach `peer` (`e`): with lost engines tolerated, and unless
    /// the update was aborted or its deadline passed, its engine is left out of this part and
    /// the other peers' transfers go on; otherwise the part fails with `e`.
    fn lose(
        &mut self,
        peer: RankId,
        e: RuntimeError,
        ctx: &ExecContext<'_>,
    ) -> Result<(), RuntimeError> {
        if !self.tolerate || ctx.check().is_err() {
            return Err(e);
        }
        tracing::warn!(
            rank = self.me.rank,
            peer = %peer,
            engine = peer.engine,
            version = ctx.version,
            error = %e,
            "could not reach an inference rank: its engine is left out of this version"
        );
        self.outgoing.remove(&peer);
        self.unreached.insert(peer.engine);
        Ok(())
    }

    /// Runs one thread per peer stream; each peer's stats or failure.
    fn run_peers(
        &self,
        plan: &RankPlan,
        streams: Vec<(usize, TcpStream)>,
        ctx: &ExecContext<'_>,
        per_peer: PeerFn,
    ) -> Vec<(RankId, Result<ExecStats, RuntimeError>)> {
        let base_of = |peer: RankId| {
            self.base
                .as_ref()
                .and_then(|b| Some((b.base_for(ctx.bases, peer)?, b)))
        };
        // the buckets more than one delta-taking peer shares (engines replicating a layout)
        let shared = SharedDeltas::new(
            plan.peers
                .iter()
                .zip(&self.buckets)
                .filter(|(p, _)| base_of(p.peer).is_some())
                .map(|(p, b)| (b.as_slice(), p.transfers.as_slice())),
        );
        let shared = &shared;
        let peers: Vec<RankId> = streams.iter().map(|(i, _)| plan.peers[*i].peer).collect();
        let results: Vec<Result<ExecStats, RuntimeError>> = std::thread::scope(|scope| {
            let handles: Vec<_> = streams
                .into_iter()
                .map(|(i, s)| {
                    let (peer, buckets, tensors) =
                        (&plan.peers[i], self.buckets[i].clone(), &self.tensors);
                    let delta = PeerDelta {
                        bb: self.bucket_bytes,
                        fp8: self.fp8.as_ref(),
                        base: base_of(peer.peer),
                        shared,
                        held: &self.held,
                        deltas: self.deltas,
                        cutoff: self.lost.as_ref().and_then(|l| l.cutoff()),
                        threads: self.delta_threads.unwrap_or_else(auto_delta_threads),
                    };
                    scope.spawn(move || per_peer(peer, &buckets, tensors, s, ctx, &delta))
                })
                .collect();
            handles
                .into_iter()
                .map(|h| {
                    h.join()
                        .unwrap_or_else(|_| Err(TransportError::Panicked("peer thread").into()))
                })
                .collect()
        });
        peers.into_iter().zip(results).collect()
    }
}

/// Moves one peer's buckets over its stream (the sending or the receiving end).
type PeerFn = fn(
    &PeerPlan,
    &[Bucket],
    &TensorSet,
    TcpStream,
    &ExecContext<'_>,
    &PeerDelta<'_>,
) -> Result<ExecStats, RuntimeError>;

/// The connections an inference rank refused: how many, and the last one's peer and reason,
/// said when a training rank then never connects (the refusal is otherwise only a warning in
/// this rank's log, which a job may not keep).
#[derive(Default)]
struct Refusals {
    count: AtomicU64,
    last: Mutex<Option<String>>,
}

impl Refusals {
    fn add(&self, from: std::net::SocketAddr, why: &str) {
        self.count.fetch_add(1, Ordering::AcqRel);
        if let Ok(mut last) = self.last.lock() {
            *last = Some(format!("{from}: {why}"));
        }
    }

    /// `""`, or `"; this rank has refused N connection(s), the last from ADDR: WHY"`.
    fn said(&self) -> String {
        let n = self.count.load(Ordering::Acquire);
        let last = self.last.lock().ok().and_then(|l| l.clone());
        match (n, last) {
            (0, _) | (_, None) => String::new(),
            (1, Some(l)) => format!("; this rank has refused 1 connection, from {l}"),
            (n, Some(l)) => format!("; this rank has refused {n} connections, the last from {l}"),
        }
    }
}

/// The listening end: accepts connections and runs each hello on its own thread.
struct Acceptor {
    incoming: Streams,
    stop: Arc<AtomicBool>,
    me: RankId,
    fingerprints: HashMap<RankId, u64>,
    bucket_bytes: u64,
    secret: Arc<Mutex<Option<PairSecret>>>,
    refused: Arc<Refusals>,
    handshakes: Arc<AtomicUsize>,
}

impl Acceptor {
    fn run(self, listener: TcpListener) {
        let me = Arc::new(self);
        let mut last_error = None;
        while !me.stop.load(Ordering::Acquire) {
            match listener.accept() {
                Ok((s, from)) => {
                    if me.handshakes.fetch_add(1, Ordering::AcqRel) >= MAX_HANDSHAKES {
                        me.handshakes.fetch_sub(1, Ordering::AcqRel);
                        me.refuse(&s, from, "too many hellos in progress");
                        continue;
                    }
                    let a = me.clone();
                    let spawned = std::thread::Builder::new()
                        .name("awex-tcp-hello".into())
                        .spawn(move || {
                            if let Err(why) = a.hello(s, from) {
                                a.refused.add(from, &why);
                                tracing::warn!(
                                    rank = %a.me,
                                    %from,
                                    reason = %why,
                                    "refused a tcp connection"
                                );
                            }
                            a.handshakes.fetch_sub(1, Ordering::AcqRel);
                        });
                    if spawned.is_err() {
                        me.handshakes.fetch_sub(1, Ordering::AcqRel);
                    }
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    std::thread::sleep(Duration::from_millis(5));
                }
                Err(e) => {
                    // out of descriptors and the like: said at most once a second
                    if last_error.is_none_or(|t: Instant| t.elapsed() >= Duration::from_secs(1)) {
                        tracing::warn!(rank = %me.me, error = %e, "accepting a tcp connection failed");
                        last_error = Some(Instant::now());
                    }
                    std::thread::sleep(Duration::from_millis(20))
                }
            }
        }
    }

    fn refuse(&self, s: &TcpStream, from: std::net::SocketAddr, why: &str) {
        self.refused.add(from, why);
        tracing::warn!(rank = %self.me, %from, reason = %why, "refused a tcp connection");
        let _ = s.shutdown(std::net::Shutdown::Both);
    }

    /// Runs one hello; the stream is registered only once the peer proved the pair secret.
    fn hello(&self, mut s: TcpStream, from: std::net::SocketAddr) -> Result<(), String> {
        let fail = |s: &TcpStream, why: String| {
            let _ = s.shutdown(std::net::Shutdown::Both);
            why
        };
        s.set_nonblocking(false).ok();
        s.set_nodelay(true).ok();
        let io = Io {
            deadline: Instant::now() + HANDSHAKE,
            cancel: &self.stop,
            version: 0,
            peer: format!("{from}"),
        };
        let mut h = [0u8; HELLO_LEN];
        io.read(&mut s, &mut h, "hello")
            .map_err(|e| fail(&s, e.to_string()))?;
        let w = |i: usize| u64::from_le_bytes(h[i * 8..i * 8 + 8].try_into().unwrap_or([0; 8]));
        let (src, dst, fp, tag, bb) = (rank_of(w(1)), rank_of(w(2)), w(3), w(4), w(5));
        if w(0) != HELLO {
            return Err(fail(&s, "not an awex peer (or an older version)".into()));
        }
        if dst != self.me {
            return Err(fail(&s, format!("the hello is for inference rank {dst}")));
        }
        match self.fingerprints.get(&src) {
            None => {
                return Err(fail(
                    &s,
                    format!("training rank {src} has no transfers with this rank"),
                ));
            }
            Some(&mine) if mine != fp => {
                return Err(fail(
                    &s,
                    format!(
                        "training rank {src}'s plan fingerprint {fp:016x} differs from this rank's {mine:016x} (the ranks plan different layouts)"
                    ),
                ));
            }
            Some(_) => {}
        }
        if bb != self.bucket_bytes {
            return Err(fail(
                &s,
                format!(
                    "training rank {src} uses buckets of {bb} bytes, this rank {} (every rank must use the pair's bucket_mib)",
                    self.bucket_bytes
                ),
            ));
        }
        // the secret arrives with the join answer, which may be a moment behind the peer's
        let secret = loop {
            if let Some(k) = self.secret.lock().ok().and_then(|g| g.clone()) {
                break k;
            }
            if Instant::now() >= io.deadline || self.stop.load(Ordering::Acquire) {
                return Err(fail(&s, "this rank has no pair secret yet".into()));
            }
            std::thread::sleep(Duration::from_millis(10));
        };
        let nonce = random_bytes();
        io.write(&mut s, &nonce, "hello (challenge)")
            .map_err(|e| fail(&s, e.to_string()))?;
        let mut proof = [0u8; 32];
        io.read(&mut s, &mut proof, "hello (proof)")
            .map_err(|e| fail(&s, e.to_string()))?;
        let mut transcript = h[8..].to_vec();
        transcript.extend_from_slice(&nonce);
        if !secret.verify(b"S", &transcript, &proof) {
            return Err(fail(
                &s,
                format!(
                    "it claims to be training rank {src} but does not hold pair `{}`'s secret",
                    secret.pair()
                ),
            ));
        }
        let (lock, cv) = &*self.incoming;
        let mut m = lock.lock().map_err(|_| fail(&s, "poisoned".into()))?;
        if let Some((old_tag, old)) = m.get(&src) {
            // a later attempt or version (a later tag) or a peer whose old stream is gone
            // replaces it; anything
            // else is a second connection for a live peer
            if alive(old) && !(tag != 0 && tag > *old_tag) {
                return Err(fail(
                    &s,
                    format!(
                        "second connection for training rank {src} while its stream is live; kept the live stream"
                    ),
                ));
            }
        }
        io.write(&mut s, &secret.prove(b"R", &transcript), "hello (proof)")
            .map_err(|e| fail(&s, e.to_string()))?;
        if let Some((_, old)) = m.insert(src, (tag, s)) {
            let _ = old.shutdown(std::net::Shutdown::Both);
        }
        cv.notify_all();
        Ok(())
    }
}

fn frame_header(
    version: u64,
    bucket: u64,
    len: u64,
    checksum: u64,
    base: Option<u64>,
) -> [u8; FRAME_HEADER] {
    let mut h = [0u8; FRAME_HEADER];
    h[0..4].copy_from_slice(&FRAME.to_le_bytes());
    if let Some(b) = base {
        h[4..8].copy_from_slice(&FLAG_DELTA.to_le_bytes());
        h[40..48].copy_from_slice(&b.to_le_bytes());
    }
    h[8..16].copy_from_slice(&version.to_le_bytes());
    h[16..24].copy_from_slice(&bucket.to_le_bytes());
    h[24..32].copy_from_slice(&len.to_le_bytes());
    h[32..40].copy_from_slice(&checksum.to_le_bytes());
    h
}

fn hash_if(on: bool, bytes: &[u8]) -> u64 {
    if on {
        xxhash_rust::xxh3::xxh3_64(bytes)
    } else {
        0
    }
}

fn max_bucket(buckets: &[Bucket], bb: u64) -> usize {
    buckets
        .iter()
        .map(|b| b.bytes)
        .max()
        .unwrap_or(0)
        .max(bb.min(1 << 20)) as usize
}

/// The largest frame payload of these buckets when deltas may arrive.
fn max_frame(buckets: &[Bucket], bb: u64) -> usize {
    buckets
        .iter()
        .map(max_len)
        .max()
        .unwrap_or(0)
        .max(max_bucket(buckets, bb))
}

fn send_peer(
    peer: &PeerPlan,
    buckets: &[Bucket],
    tensors: &TensorSet,
    mut s: TcpStream,
    ctx: &ExecContext<'_>,
    delta: &PeerDelta<'_>,
) -> Result<ExecStats, RuntimeError> {
    let (bb, fp8) = (delta.bb, delta.fp8);
    let cap = max_bucket(buckets, bb);
    let base = delta.base;
    // packers: one for dense buckets (packing runs at memory speed, the socket is the limit);
    // with deltas, comparing against the copy is the work, so several encode side by side
    // (`delta.threads`: the config's, else the cores up to 16), packer `k` taking buckets k,
    // k + K, ... and the writer taking them back in order
    let packers = match base {
        None => 1,
        Some(_) => delta.threads.max(1).min(buckets.len().max(1)),
    };
    let mut fulls = Vec::with_capacity(packers);
    let mut frees = Vec::with_capacity(packers);
    let mut ends = Vec::with_capacity(packers);
    for _ in 0..packers {
        let (full_tx, full_rx): (SyncSender<Filled>, Receiver<Filled>) = sync_channel(1);
        let (free_tx, free_rx) = sync_channel::<Vec<u8>>(2);
        for _ in 0..2 {
            // a delta's bytes are copied in (a few per cent of the bucket): grown as needed
            let _ = free_tx.send(match base {
                None => vec![0u8; cap],
                Some(_) => Vec::new(),
            });
        }
        fulls.push(full_rx);
        frees.push(free_tx);
        ends.push((full_tx, free_rx));
    }
    let mut io = Io::for_update(ctx, format!("inference rank {}", peer.peer));
    if let Some(c) = delta.cutoff {
        io.deadline = io.deadline.min(c);
    }
    std::thread::scope(|scope| {
        // a packer stops when the writer stops: its channels close (no wait without an end)
        let handles: Vec<_> = ends
            .into_iter()
            .enumerate()
            .map(|(k, (full_tx, free_rx))| {
                scope.spawn(move || -> Result<ExecStats, RuntimeError> {
                    let mut st = ExecStats::default();
                    // deltas: scratch for pieces compared packed; the dense bytes for checksums
                    let mut scratch = (Vec::new(), Vec::new(), Vec::new());
                    let mut new = Vec::new();
                    let mut busy = Duration::ZERO;
                    for b in buckets.iter().skip(k).step_by(packers) {
                        ctx.check()?;
                        let mut buf = free_rx.recv().map_err(|_| TransportError::SenderStopped)?;
                        let t = Instant::now();
                        let (n, h, sent_base) = match base {
                            None => {
                                let n = pack(b, &peer.transfers, tensors, &mut buf, fp8)?;
                                (n, hash_if(ctx.checksums, &buf[..n]), None)
                            }
                            Some((v, sb)) => {
                                let mut compared = 0;
                                let enc = delta.shared.get(b, &peer.transfers, || {
                                    let mut bytes = Vec::new();
                                    let mut changes = Changes::default();
                                    let stats = encode_bucket_from(
                                        b,
                                        &peer.transfers,
                                        tensors,
                                        sb.copy()?,
                                        fp8,
                                        &mut bytes,
                                        &mut scratch,
                                        Some(&mut changes),
                                    )?;
                                    // written into the copy once every encoder of the update
                                    // is done (`TcpTransport::send`)
                                    sb.record(changes)?;
                                    // checksums cover the bytes the receiver ends with: the
                                    // dense bucket
                                    let checksum = if ctx.checksums {
                                        new.resize(cap, 0);
                                        let n = pack(b, &peer.transfers, tensors, &mut new, fp8)?;
                                        hash_if(true, &new[..n])
                                    } else {
                                        0
                                    };
                                    compared = stats.dense_bytes;
                                    Ok(Encoded {
                                        bytes,
                                        stats,
                                        checksum,
                                    })
                                })?;
                                st.compared += compared;
                                st.delta.add(&enc.stats);
                                buf.clear();
                                buf.extend_from_slice(&enc.bytes);
                                (buf.len(), enc.checksum, Some(v))
                            }
                        };
                        st.checksum = st.checksum.wrapping_add(h);
                        st.bytes += n as u64;
                        st.buckets += 1;
                        busy += t.elapsed();
                        if full_tx.send((n, buf, h, sent_base)).is_err() {
                            return Err(TransportError::Broken { peer: peer.peer }.into());
                        }
                    }
                    tracing::debug!(
                        peer = %peer.peer,
                        version = ctx.version,
                        packer = k,
                        delta = base.is_some(),
                        pack_ms = busy.as_secs_f64() * 1e3,
                        "packed or encoded a peer's buckets"
                    );
                    Ok(st)
                })
            })
            .collect();
        // the writer owns the other ends of every channel: returning drops them
        let written = (move || -> Result<(), RuntimeError> {
            let what = format!("send to inference rank {}", peer.peer);
            for i in 0..buckets.len() {
                let k = i % packers;
                // a packer that stopped closed its channel: its error is the one to report
                let Ok((n, buf, h, b)) = fulls[k].recv() else {
                    return Ok(());
                };
                io.write(
                    &mut s,
                    &frame_header(ctx.version, i as u64, n as u64, h, b),
                    &what,
                )?;
                io.write(&mut s, &buf[..n], &what)?;
                let _ = frees[k].send(buf);
            }
            Ok(())
        })();
        let mut packed = Ok(ExecStats::default());
        for h in handles {
            let r = h
                .join()
                .unwrap_or_else(|_| Err(TransportError::Panicked("packer").into()));
            packed = match (packed, r) {
                (Ok(mut a), Ok(b)) => {
                    a.add(&b);
                    Ok(a)
                }
                (Err(e), _) | (_, Err(e)) => Err(e),
            };
        }
        written.and(packed)
    })
}

fn receive_peer(
    peer: &PeerPlan,
    buckets: &[Bucket],
    tensors: &TensorSet,
    mut s: TcpStream,
    ctx: &ExecContext<'_>,
    delta: &PeerDelta<'_>,
) -> Result<ExecStats, RuntimeError> {
    let cap = max_frame(buckets, delta.bb);
    // from here on this sender's boxes may be torn until every bucket landed
    let held = delta.held.begin(peer.peer);
    // appliers: one unpacks dense frames (a copy at memory speed: the socket is the limit);
    // where this rank takes deltas and holds a base from the peer, its frames may be deltas, whose apply
    // (decode, then a write per changed element, into lines spread over the whole
    // destination) is the work, so several apply side by side (`delta.threads`), applier `k` taking delta
    // frames k, k + K, ... (the buckets of one peer write disjoint boxes) and applier 0 any
    // dense frame; their buffers start empty and grow to the frames they carry (a delta is a
    // few per cent of its bucket)
    let appliers = match held {
        Some(_) if delta.deltas => delta.threads.max(1).min(buckets.len().max(1)),
        _ => 1,
    };
    // buffers: one being read and one waiting for the single unpacker; with several
    // appliers, one each being applied and two read ahead (a bucket-sized frame at most each)
    let pool = if appliers == 1 { 2 } else { appliers + 2 };
    let (free_tx, free_rx) = sync_channel::<Vec<u8>>(pool);
    for _ in 0..pool {
        let _ = free_tx.send(if appliers == 1 {
            vec![0u8; cap]
        } else {
            Vec::new()
        });
    }
    let mut fulls = Vec::with_capacity(appliers);
    let mut ends = Vec::with_capacity(appliers);
    for _ in 0..appliers {
        let (full_tx, full_rx) = sync_channel::<(usize, Filled)>(1);
        fulls.push(full_tx);
        ends.push((full_rx, free_tx.clone()));
    }
    // the appliers hold the only senders of free buffers: when they all stopped, the reader's
    // wait for one ends
    drop(free_tx);
    let io = Io::for_update(ctx, format!("training rank {}", peer.peer));
    std::thread::scope(|scope| {
        let handles: Vec<_> = ends
            .into_iter()
            .map(|(full_rx, free_tx)| {
                scope.spawn(move || -> Result<ExecStats, RuntimeError> {
                    let mut st = ExecStats::default();
                    let mut busy = Duration::ZERO;
                    for (i, (n, mut buf, h, base)) in full_rx.iter() {
                        let t = Instant::now();
                        let b = buckets.get(i).ok_or_else(|| {
                            RuntimeError::from(TransportError::TooManyBuckets { peer: peer.peer })
                        })?;
                        if base.is_some() {
                            // a delta lands in place; the checksum covers the bytes it leaves there
                            let d = apply_bucket(b, &peer.transfers, tensors, &buf[..n])?;
                            if ctx.corrupt && i == 0 {
                                super::shm::corrupt_first_byte(b, &peer.transfers, tensors);
                            }
                            if ctx.checksums {
                                let got = hash_destination(b, &peer.transfers, tensors)?;
                                if got != h {
                                    return Err(RuntimeError::Checksum {
                                        peer: peer.peer,
                                        bucket: i as u64,
                                    });
                                }
                                st.checksum = st.checksum.wrapping_add(got);
                            }
                            st.delta.add(&d);
                            st.bytes += n as u64;
                            st.buckets += 1;
                            busy += t.elapsed();
                            let _ = free_tx.send(buf);
                            continue;
                        }
                        if ctx.corrupt && i == 0 && n > 0 {
                            buf[0] ^= 0x5a;
                        }
                        if ctx.checksums {
                            let got = xxhash_rust::xxh3::xxh3_64(&buf[..n]);
                            if got != h {
                                return Err(RuntimeError::Checksum {
                                    peer: peer.peer,
                                    bucket: i as u64,
                                });
                            }
                            st.checksum = st.checksum.wrapping_add(got);
                        }
                        unpack(b, &peer.transfers, tensors, &buf[..n])?;
                        st.bytes += n as u64;
                        st.buckets += 1;
                        busy += t.elapsed();
                        let _ = free_tx.send(buf);
                    }
                    tracing::debug!(
                        peer = %peer.peer,
                        version = ctx.version,
                        apply_ms = busy.as_secs_f64() * 1e3,
                        appliers,
                        "unpacked or applied a peer's buckets"
                    );
                    Ok(st)
                })
            })
            .collect();
        // the reader owns the other ends of both channels: returning drops them
        let read = (move || -> Result<(), RuntimeError> {
            let what = format!("receive from training rank {}", peer.peer);
            for (i, b) in buckets.iter().enumerate() {
                ctx.check()?;
                let Ok(mut buf) = free_rx.recv() else {
                    return Ok(()); // the unpacker stopped; its error is the one to report
                };
                // a stream that ends before the first frame of this version held nothing of it:
                // its sender gave it up (and opens a fresh one for this version)
                let first = |e: RuntimeError| {
                    let ended = match &e {
                        RuntimeError::Transport(TransportError::PeerClosed { .. }) => true,
                        RuntimeError::Transport(TransportError::PeerFailed { source, .. }) => {
                            matches!(
                                source.kind(),
                                std::io::ErrorKind::ConnectionReset
                                    | std::io::ErrorKind::ConnectionAborted
                            )
                        }
                        _ => false,
                    };
                    if ended && i == 0 {
                        TransportError::GivenUpStream {
                            peer: peer.peer,
                            version: ctx.version,
                        }
                        .into()
                    } else {
                        e
                    }
                };
                let mut hdr = [0u8; FRAME_HEADER];
                io.read(&mut s, &mut hdr, &what).map_err(first)?;
                // frames of an earlier version left in this stream (its sender pushed them
                // into the socket while this rank was stopped or had given that version up,
                // leaving it unread): skipped, every one of them, bounded by the buffer
                while hdr[0..4] == FRAME.to_le_bytes()
                    && u32::from_le_bytes(hdr[4..8].try_into().unwrap_or([0; 4])) & !FLAG_DELTA == 0
                    && u64::from_le_bytes(hdr[8..16].try_into().unwrap_or([0; 8])) < ctx.version
                {
                    let len = u64::from_le_bytes(hdr[24..32].try_into().unwrap_or([0; 8]));
                    if len > cap as u64 {
                        break; // not a frame this plan sends: refused below
                    }
                    if buf.len() < len as usize {
                        buf.resize(len as usize, 0);
                    }
                    io.read(&mut s, &mut buf[..len as usize], &what)
                        .map_err(first)?;
                    io.read(&mut s, &mut hdr, &what).map_err(first)?;
                }
                let w = |a: usize| u64::from_le_bytes(hdr[a..a + 8].try_into().unwrap_or([0; 8]));
                let (version, bucket, len, h) = (w(8), w(16), w(24), w(32));
                let flags = u32::from_le_bytes(hdr[4..8].try_into().unwrap_or([0; 4]));
                let base = (flags & FLAG_DELTA != 0).then(|| w(40));
                if let Some(v) = base {
                    check_base(peer.peer, v, held)?;
                }
                let fits = match base {
                    None => len == b.bytes,
                    Some(_) => len <= max_len(b) as u64,
                };
                if hdr[0..4] != FRAME.to_le_bytes()
                    || flags & !FLAG_DELTA != 0
                    || version != ctx.version
                    || bucket != i as u64
                    || !fits
                    || len > cap as u64
                {
                    return Err(TransportError::UnexpectedBucket {
                        what,
                        index: i,
                        version: ctx.version,
                        bytes: b.bytes,
                        got_bucket: bucket,
                        got_version: version,
                        got_bytes: len,
                    }
                    .into());
                }
                if buf.len() < len as usize {
                    buf.resize(len as usize, 0);
                }
                io.read(&mut s, &mut buf[..len as usize], &what)?;
                // a dense frame is a copy bound by the socket: one unpacker takes them all,
                // in order, as without a base
                let k = if base.is_some() { i % appliers } else { 0 };
                if fulls[k].send((i, (len as usize, buf, h, base))).is_err() {
                    return Ok(());
                }
            }
            Ok(())
        })();
        // every applier ends once its channel closes (the reader's ends dropped with it)
        let mut unpacked: Result<ExecStats, RuntimeError> = Ok(ExecStats::default());
        for h in handles {
            let r = h
                .join()
                .unwrap_or_else(|_| Err(TransportError::Panicked("unpacker").into()));
            match (&mut unpacked, r) {
                (Ok(total), Ok(st)) => total.add(&st),
                (Ok(_), Err(e)) => unpacked = Err(e),
                (Err(_), _) => {}
            }
        }
        match (unpacked, read) {
            (Err(e), _) => Err(e),
            (Ok(_), Err(e)) => Err(e),
            (Ok(st), Ok(())) => {
                delta.held.finish(peer.peer, ctx.version);
                Ok(st)
            }
        }
    })
}

impl Transport for TcpTransport {
    fn kind(&self) -> awex_core::Transport {
        awex_core::Transport::Tcp
    }

    fn rendezvous(&self) -> serde_json::Value {
        match &self.addr {
            Some(a) => serde_json::json!({ "addr": a }),
            None => serde_json::json!({}),
        }
    }

    fn authenticate(&mut self, secret: &PairSecret) {
        if let Ok(mut g) = self.secret.lock() {
            *g = Some(secret.clone());
        }
    }

    fn execute(&mut self, ctx: &ExecContext<'_>) -> Result<ExecStats, RuntimeError> {
        match self.side {
            Side::Training => self.send(ctx),
            Side::Inference => self.receive(ctx),
        }
    }

    fn check_finite_sources(&mut self) -> Result<(), RuntimeError> {
        self.check_finite = true;
        Ok(())
    }

    fn enable_deltas(&mut self) -> Result<bool, RuntimeError> {
        super::refuse_transposed(&self.plan, "delta updates")?;
        if self.side == Side::Training && self.base.is_none() {
            self.base = Some(SenderBase::new(&self.tensors)?);
        }
        self.deltas = true;
        Ok(true)
    }

    fn holds_base(&self) -> bool {
        self.deltas && self.side == Side::Inference
    }

    fn tolerate_lost_engines(&mut self, lost: Option<Arc<super::LostEngines>>) -> bool {
        self.tolerate = lost.is_some() && self.side == Side::Training;
        self.lost = lost.filter(|_| self.tolerate);
        self.tolerate
    }

    fn unreached(&self) -> Vec<u32> {
        self.unreached.iter().copied().collect()
    }

    fn close(&mut self) {
        self.stop.store(true, Ordering::Release);
        for (_, s) in self.outgoing.drain() {
            let _ = s.shutdown(std::net::Shutdown::Both);
        }
        if let Ok(mut m) = self.incoming.0.lock() {
            for (_, (_, s)) in m.drain() {
                let _ = s.shutdown(std::net::Shutdown::Both);
            }
        }
    }
}

impl Drop for TcpTransport {
    fn drop(&mut self) {
        self.close();
    }
}
