//! The `tcp` transport: buckets streamed over one connection per peer pair.
//!
//! Inference ranks listen and publish their address; training ranks connect and open with a
//! hello carrying both ranks and the peer plan's fingerprint, which the receiver checks. Per
//! update, each peer pair runs a two-stage pipeline on each end with two bucket buffers:
//! pack (with dtype conversion) overlaps send on the sender, receive overlaps unpack on the
//! receiver. Every frame names its version and bucket; a mismatch fails the update.

use super::{ExecContext, ExecStats, Transport, TransportKind};
use crate::RuntimeError;
use crate::bucket::{Bucket, make_buckets, pack, unpack};
use crate::tensors::TensorSet;
use awex_core::layout::{RankId, Side};
use awex_core::plan::{PeerPlan, RankPlan};
use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, SyncSender, sync_channel};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

const HELLO: u64 = u64::from_le_bytes(*b"AWEXTCP1");
const FRAME: u32 = u32::from_le_bytes(*b"AWXB");
const FRAME_HEADER: usize = 40;

/// A filled bucket buffer: (bytes used, buffer, checksum).
type Filled = (usize, Vec<u8>, u64);

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
    stop: Arc<AtomicBool>,
}

fn io_err(what: String) -> impl FnOnce(std::io::Error) -> RuntimeError {
    move |e| RuntimeError::Transport(format!("{what}: {e}"))
}

fn remaining(deadline: Instant) -> Result<Duration, RuntimeError> {
    let d = deadline.saturating_duration_since(Instant::now());
    if d.is_zero() {
        return Err(RuntimeError::Transport(
            "deadline passed during network I/O".into(),
        ));
    }
    Ok(d)
}

fn read_hello(s: &mut TcpStream) -> std::io::Result<(RankId, RankId, u64, u64)> {
    let mut b = [0u8; 40];
    s.read_exact(&mut b)?;
    let w = |i: usize| u64::from_le_bytes(b[i * 8..i * 8 + 8].try_into().unwrap_or([0; 8]));
    if w(0) != HELLO {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            "not an awex peer",
        ));
    }
    let r = |x: u64| RankId {
        engine: (x >> 32) as u32,
        rank: x as u32,
    };
    Ok((r(w(1)), r(w(2)), w(3), w(4)))
}

fn key(r: RankId) -> u64 {
    ((r.engine as u64) << 32) | r.rank as u64
}

impl TcpTransport {
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
            stop: Arc::new(AtomicBool::new(false)),
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
            let (incoming, stop, me) = (t.incoming.clone(), t.stop.clone(), t.me);
            listener
                .set_nonblocking(true)
                .map_err(io_err("listener".into()))?;
            std::thread::Builder::new()
                .name("awex-tcp-accept".into())
                .spawn(move || accept_loop(listener, incoming, stop, me, fingerprints))
                .map_err(io_err("spawn acceptor".into()))?;
        }
        Ok(t)
    }

    fn connect(&mut self, peer: &PeerPlan, ctx: &ExecContext<'_>) -> Result<(), RuntimeError> {
        // a retry always opens fresh connections: the old ones may hold half a failed attempt
        let tag = if ctx.attempt > 1 { ctx.tag() } else { 0 };
        if tag != 0 {
            if let Some(old) = self.outgoing.remove(&peer.peer) {
                let _ = old.shutdown(std::net::Shutdown::Both);
            }
        } else if self.outgoing.contains_key(&peer.peer) {
            return Ok(());
        }
        let addr = ctx
            .peers
            .get(&peer.peer)
            .and_then(|v| v.get("addr"))
            .and_then(|v| v.as_str())
            .ok_or_else(|| {
                RuntimeError::Transport(format!(
                    "inference rank {} published no tcp address",
                    peer.peer
                ))
            })?;
        let sock = addr
            .to_socket_addrs()
            .map_err(io_err(format!("resolve {addr}")))?
            .next()
            .ok_or_else(|| RuntimeError::Transport(format!("{addr} resolves to nothing")))?;
        let mut s = TcpStream::connect_timeout(&sock, remaining(ctx.deadline)?).map_err(io_err(
            format!("connect to inference rank {} at {addr}", peer.peer),
        ))?;
        s.set_nodelay(true).ok();
        let mut hello = Vec::with_capacity(40);
        for w in [HELLO, key(self.me), key(peer.peer), peer.fingerprint, tag] {
            hello.extend_from_slice(&w.to_le_bytes());
        }
        s.set_write_timeout(Some(remaining(ctx.deadline)?)).ok();
        s.write_all(&hello)
            .map_err(io_err(format!("hello to {}", peer.peer)))?;
        self.outgoing.insert(peer.peer, s);
        Ok(())
    }

    fn send(&mut self, ctx: &ExecContext<'_>) -> Result<ExecStats, RuntimeError> {
        let plan = self.plan.clone();
        for peer in &plan.peers {
            self.connect(peer, ctx)?;
        }
        let mut streams: Vec<(usize, TcpStream)> = Vec::new();
        for (i, peer) in plan.peers.iter().enumerate() {
            let s = self.outgoing[&peer.peer]
                .try_clone()
                .map_err(io_err("clone socket".into()))?;
            streams.push((i, s));
        }
        self.run_peers(&plan, streams, ctx, send_peer)
            .map_err(|(peer, e)| {
                self.outgoing.remove(&peer);
                e
            })
    }

    fn receive(&mut self, ctx: &ExecContext<'_>) -> Result<ExecStats, RuntimeError> {
        let plan = self.plan.clone();
        let mut streams = Vec::new();
        {
            let (lock, cv) = &*self.incoming;
            let mut map = lock
                .lock()
                .map_err(|_| RuntimeError::Transport("poisoned".into()))?;
            let want = if ctx.attempt > 1 { ctx.tag() } else { 0 };
            for (i, peer) in plan.peers.iter().enumerate() {
                // on a retry, only a connection opened for this attempt will do
                while !map
                    .get(&peer.peer)
                    .is_some_and(|(t, _)| want == 0 || *t == want)
                {
                    ctx.check().map_err(|e| {
                        RuntimeError::Transport(format!(
                            "training rank {} never connected ({e})",
                            peer.peer
                        ))
                    })?;
                    map = cv
                        .wait_timeout(map, Duration::from_millis(20))
                        .map_err(|_| RuntimeError::Transport("poisoned".into()))?
                        .0;
                }
                let s = map[&peer.peer]
                    .1
                    .try_clone()
                    .map_err(io_err("clone socket".into()))?;
                streams.push((i, s));
            }
        }
        self.run_peers(&plan, streams, ctx, receive_peer)
            .map_err(|(peer, e)| {
                // a broken stream is dropped; the peer reconnects on retry
                if let Ok(mut m) = self.incoming.0.lock() {
                    m.remove(&peer);
                }
                e
            })
    }

    /// Runs one thread per peer stream and sums their stats; the first failure names its peer.
    fn run_peers(
        &self,
        plan: &RankPlan,
        streams: Vec<(usize, TcpStream)>,
        ctx: &ExecContext<'_>,
        per_peer: PeerFn,
    ) -> Result<ExecStats, (RankId, RuntimeError)> {
        let results: Vec<Result<ExecStats, RuntimeError>> = std::thread::scope(|scope| {
            let handles: Vec<_> = streams
                .into_iter()
                .map(|(i, s)| {
                    let (peer, buckets, tensors) =
                        (&plan.peers[i], self.buckets[i].clone(), &self.tensors);
                    let bb = self.bucket_bytes;
                    scope.spawn(move || per_peer(peer, &buckets, tensors, s, ctx, bb))
                })
                .collect();
            handles
                .into_iter()
                .map(|h| {
                    h.join().unwrap_or_else(|_| {
                        Err(RuntimeError::Transport("peer thread panicked".into()))
                    })
                })
                .collect()
        });
        let mut total = ExecStats::default();
        for (peer, r) in plan.peers.iter().zip(results) {
            total.add(&r.map_err(|e| (peer.peer, e))?);
        }
        Ok(total)
    }
}

/// Moves one peer's buckets over its stream (the sending or the receiving end).
type PeerFn = fn(
    &PeerPlan,
    &[Bucket],
    &TensorSet,
    TcpStream,
    &ExecContext<'_>,
    u64,
) -> Result<ExecStats, RuntimeError>;

fn accept_loop(
    listener: TcpListener,
    incoming: Streams,
    stop: Arc<AtomicBool>,
    me: RankId,
    fingerprints: HashMap<RankId, u64>,
) {
    while !stop.load(Ordering::Acquire) {
        match listener.accept() {
            Ok((mut s, _)) => {
                s.set_nonblocking(false).ok();
                s.set_nodelay(true).ok();
                s.set_read_timeout(Some(Duration::from_secs(10))).ok();
                match read_hello(&mut s) {
                    Ok((src, dst, fp, tag)) if dst == me && fingerprints.get(&src) == Some(&fp) => {
                        if let Ok(mut m) = incoming.0.lock() {
                            if let Some((_, old)) = m.insert(src, (tag, s)) {
                                let _ = old.shutdown(std::net::Shutdown::Both);
                            }
                            incoming.1.notify_all();
                        }
                    }
                    _ => {
                        // wrong peer or a plan that disagrees: refuse the connection
                        let _ = s.shutdown(std::net::Shutdown::Both);
                    }
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                std::thread::sleep(Duration::from_millis(5));
            }
            Err(_) => std::thread::sleep(Duration::from_millis(20)),
        }
    }
}

fn frame_header(version: u64, bucket: u64, len: u64, checksum: u64) -> [u8; FRAME_HEADER] {
    let mut h = [0u8; FRAME_HEADER];
    h[0..4].copy_from_slice(&FRAME.to_le_bytes());
    h[8..16].copy_from_slice(&version.to_le_bytes());
    h[16..24].copy_from_slice(&bucket.to_le_bytes());
    h[24..32].copy_from_slice(&len.to_le_bytes());
    h[32..40].copy_from_slice(&checksum.to_le_bytes());
    h
}

fn max_bucket(buckets: &[Bucket], bb: u64) -> usize {
    buckets
        .iter()
        .map(|b| b.bytes)
        .max()
        .unwrap_or(0)
        .max(bb.min(1 << 20)) as usize
}

fn send_peer(
    peer: &PeerPlan,
    buckets: &[Bucket],
    tensors: &TensorSet,
    mut s: TcpStream,
    ctx: &ExecContext<'_>,
    bb: u64,
) -> Result<ExecStats, RuntimeError> {
    let cap = max_bucket(buckets, bb);
    let (full_tx, full_rx): (SyncSender<Filled>, Receiver<Filled>) = sync_channel(1);
    let (free_tx, free_rx) = sync_channel::<Vec<u8>>(2);
    for _ in 0..2 {
        let _ = free_tx.send(vec![0u8; cap]);
    }
    std::thread::scope(|scope| {
        let packer = scope.spawn(move || -> Result<ExecStats, RuntimeError> {
            let mut st = ExecStats::default();
            for (i, b) in buckets.iter().enumerate() {
                ctx.check()?;
                let mut buf = free_rx
                    .recv()
                    .map_err(|_| RuntimeError::Transport("sender stopped".into()))?;
                let n = pack(b, &peer.transfers, tensors, &mut buf)?;
                let h = if ctx.checksums {
                    xxhash_rust::xxh3::xxh3_64(&buf[..n])
                } else {
                    0
                };
                st.checksum = st.checksum.wrapping_add(h);
                st.bytes += n as u64;
                st.buckets += 1;
                if full_tx.send((n, buf, h)).is_err() {
                    return Err(RuntimeError::Transport(format!(
                        "connection to {} broke",
                        peer.peer
                    )));
                }
                let _ = i;
            }
            Ok(st)
        });
        let mut write_err = None;
        for (i, (n, buf, h)) in full_rx.iter().enumerate() {
            let r = (|| -> Result<(), RuntimeError> {
                s.set_write_timeout(Some(remaining(ctx.deadline)?)).ok();
                let what = format!("send to inference rank {}", peer.peer);
                s.write_all(&frame_header(ctx.version, i as u64, n as u64, h))
                    .map_err(io_err(what.clone()))?;
                s.write_all(&buf[..n]).map_err(io_err(what))?;
                Ok(())
            })();
            if let Err(e) = r {
                write_err = Some(e);
                break;
            }
            let _ = free_tx.send(buf);
        }
        drop(full_rx);
        let packed = packer
            .join()
            .unwrap_or_else(|_| Err(RuntimeError::Transport("packer panicked".into())));
        match write_err {
            Some(e) => Err(e),
            None => packed,
        }
    })
}

fn receive_peer(
    peer: &PeerPlan,
    buckets: &[Bucket],
    tensors: &TensorSet,
    mut s: TcpStream,
    ctx: &ExecContext<'_>,
    bb: u64,
) -> Result<ExecStats, RuntimeError> {
    let cap = max_bucket(buckets, bb);
    let (full_tx, full_rx) = sync_channel::<(usize, Vec<u8>, u64)>(1);
    let (free_tx, free_rx) = sync_channel::<Vec<u8>>(2);
    for _ in 0..2 {
        let _ = free_tx.send(vec![0u8; cap]);
    }
    std::thread::scope(|scope| {
        let unpacker = scope.spawn(move || -> Result<ExecStats, RuntimeError> {
            let mut st = ExecStats::default();
            for (i, (n, mut buf, h)) in full_rx.iter().enumerate() {
                let b = &buckets[i];
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
                let _ = free_tx.send(buf);
            }
            Ok(st)
        });
        let mut read_err = None;
        for (i, b) in buckets.iter().enumerate() {
            let r = (|| -> Result<(usize, Vec<u8>, u64), RuntimeError> {
                ctx.check()?;
                let mut buf = free_rx
                    .recv()
                    .map_err(|_| RuntimeError::Transport("receiver stopped".into()))?;
                let what = format!("receive from training rank {}", peer.peer);
                s.set_read_timeout(Some(remaining(ctx.deadline)?)).ok();
                let mut hdr = [0u8; FRAME_HEADER];
                s.read_exact(&mut hdr).map_err(io_err(what.clone()))?;
                let w = |a: usize| u64::from_le_bytes(hdr[a..a + 8].try_into().unwrap_or([0; 8]));
                let (version, bucket, len, h) = (w(8), w(16), w(24), w(32));
                if hdr[0..4] != FRAME.to_le_bytes()
                    || version != ctx.version
                    || bucket != i as u64
                    || len != b.bytes
                {
                    return Err(RuntimeError::Transport(format!(
                        "{what}: expected bucket {i} of version {} ({} bytes), got bucket {bucket} of version {version} ({len} bytes)",
                        ctx.version, b.bytes
                    )));
                }
                s.read_exact(&mut buf[..len as usize])
                    .map_err(io_err(what))?;
                Ok((len as usize, buf, h))
            })();
            match r {
                Ok(item) => {
                    if full_tx.send(item).is_err() {
                        break;
                    }
                }
                Err(e) => {
                    read_err = Some(e);
                    break;
                }
            }
        }
        drop(full_tx);
        let unpacked = unpacker
            .join()
            .unwrap_or_else(|_| Err(RuntimeError::Transport("unpacker panicked".into())));
        match (unpacked, read_err) {
            (Err(e), _) => Err(e),
            (Ok(_), Some(e)) => Err(e),
            (Ok(st), None) => Ok(st),
        }
    })
}

impl Transport for TcpTransport {
    fn kind(&self) -> TransportKind {
        TransportKind::Tcp
    }

    fn rendezvous(&self) -> serde_json::Value {
        match &self.addr {
            Some(a) => serde_json::json!({ "addr": a }),
            None => serde_json::json!({}),
        }
    }

    fn execute(&mut self, ctx: &ExecContext<'_>) -> Result<ExecStats, RuntimeError> {
        match self.side {
            Side::Training => self.send(ctx),
            Side::Inference => self.receive(ctx),
        }
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
