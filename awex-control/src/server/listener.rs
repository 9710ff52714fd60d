//! The gateway's listener: a bounded number of open connections, and connections that say
//! nothing for too long, or take too long to say what they want, are closed, so that a flood of
//! idle or trickling sockets cannot starve the API.
//!
//! - At most `max_connections` are open at once; a connection beyond it is answered at once
//!   with `503 Service Unavailable` and closed (the accept loop never blocks on it).
//! - On a gateway with a token, connections that have not yet presented it (*unproven*) may
//!   hold at most `max_connections - reserve` of them; past that, a new connection closes the
//!   oldest unproven one instead of being refused. So a flood without the token holds no slot
//!   for long, and the controller and the ranks, which present the token in their first
//!   request, always get one (`/healthz` too: a new connection is never the one closed).
//! - Each request head (request line and headers) must arrive whole within `header_timeout` of
//!   its first byte (of the connection's start, for the first request), however its bytes
//!   trickle in; bodies are read under `body_timeout` (the JSON extractor). Afterwards a
//!   connection on which nothing is read or written for `idle_timeout` (longer than the
//!   longest long-poll) is closed.
//! - Accept errors (e.g. out of file descriptors) are logged and retried after a pause.

use axum::serve::Listener;
use std::collections::VecDeque;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::task::{Context, Poll, Waker};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::time::{Instant, Sleep};

/// Limits of the listener.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Limits {
    /// Most connections open at once.
    pub(crate) max_connections: usize,
    /// Time a request head has to arrive whole (from its first byte; for a new connection,
    /// from its start).
    pub(crate) header_timeout: Duration,
    /// Time a connection may stay silent in both directions once it spoke.
    pub(crate) idle_timeout: Duration,
    /// Whether connections must prove themselves (present the token) to keep their slot:
    /// `false` serves every connection alike.
    pub(crate) token_required: bool,
}

impl Limits {
    /// Slots only connections that presented the token may hold: a quarter.
    fn reserve(&self) -> usize {
        if self.token_required {
            (self.max_connections / 4).max(1)
        } else {
            0
        }
    }
}

/// How many evicted connections may still be closing while new ones are admitted past the
/// limit (each closes at its next wake-up).
const EVICTING_SLACK: usize = 64;

/// The connections open now.
#[derive(Default)]
struct Pool {
    open: AtomicUsize,
    /// The most connections open since memory was last given back.
    peak: AtomicUsize,
    unproven: AtomicUsize,
    /// Unproven connections, oldest first (proven and closed ones are skipped lazily).
    queue: Mutex<VecDeque<Weak<ConnState>>>,
}

/// One connection's standing, shared by its I/O and the requests served on it.
pub(crate) struct ConnState {
    pool: Arc<Pool>,
    proven: AtomicBool,
    evicted: AtomicBool,
    waker: Mutex<Option<Waker>>,
}

impl ConnState {
    /// The connection presented the gateway's token: it keeps its slot like any proven one.
    pub(crate) fn prove(&self) {
        if !self.proven.swap(true, Ordering::AcqRel) {
            self.pool.unproven.fetch_sub(1, Ordering::AcqRel);
        }
    }

    fn evict(&self) {
        self.evicted.store(true, Ordering::Release);
        if let Some(w) = self.waker.lock().unwrap_or_else(|e| e.into_inner()).take() {
            w.wake();
        }
    }
}

/// The connection a request came on (axum's connect info): the token check proves it.
#[derive(Clone)]
pub(crate) struct Conn(pub(crate) Arc<ConnState>);

impl axum::extract::connect_info::Connected<axum::serve::IncomingStream<'_, Bounded>> for Conn {
    fn connect_info(stream: axum::serve::IncomingStream<'_, Bounded>) -> Conn {
        Conn(stream.io().state.clone())
    }
}

/// A TCP listener with [`Limits`].
pub(crate) struct Bounded {
    inner: TcpListener,
    pool: Arc<Pool>,
    limits: Limits,
}

impl Bounded {
    /// Wraps `inner`.
    pub(crate) fn new(inner: TcpListener, limits: Limits) -> Self {
        Bounded {
            inner,
            pool: Arc::default(),
            limits: Limits {
                max_connections: limits.max_connections.max(1),
                ..limits
            },
        }
    }

    /// Closes the oldest unproven connection still open; whether there was one.
    fn evict_oldest(&self) -> bool {
        let mut q = self.pool.queue.lock().unwrap_or_else(|e| e.into_inner());
        while let Some(w) = q.pop_front() {
            if let Some(c) = w.upgrade() {
                if !c.proven.load(Ordering::Acquire) && !c.evicted.load(Ordering::Acquire) {
                    c.evict();
                    return true;
                }
            }
        }
        false
    }

    /// Whether a new connection may be admitted now (closing an unproven one to make room).
    fn admit(&self) -> bool {
        let max = self.limits.max_connections;
        let open = self.pool.open.load(Ordering::Acquire);
        let unproven = self.pool.unproven.load(Ordering::Acquire);
        let unproven_cap = max - self.limits.reserve().min(max - 1);
        if self.limits.token_required && (unproven >= unproven_cap || open >= max) {
            // the newcomer may be the controller: the oldest stranger makes room
            if self.evict_oldest() {
                return open < max + EVICTING_SLACK;
            }
        }
        open < max
    }

    fn guard(&self, tcp: TcpStream) -> Guarded {
        let state = Arc::new(ConnState {
            pool: self.pool.clone(),
            proven: AtomicBool::new(!self.limits.token_required),
            evicted: AtomicBool::new(false),
            waker: Mutex::new(None),
        });
        let open = self.pool.open.fetch_add(1, Ordering::AcqRel) + 1;
        self.pool.peak.fetch_max(open, Ordering::AcqRel);
        if self.limits.token_required {
            self.pool.unproven.fetch_add(1, Ordering::AcqRel);
            let mut q = self.pool.queue.lock().unwrap_or_else(|e| e.into_inner());
            // drop entries of connections that proved themselves or closed
            if q.len() >= 2 * self.limits.max_connections {
                q.retain(|w| {
                    w.upgrade()
                        .is_some_and(|c| !c.proven.load(Ordering::Acquire))
                });
            }
            q.push_back(Arc::downgrade(&state));
        }
        Guarded::new(tcp, state, self.limits)
    }
}

impl Listener for Bounded {
    type Io = Guarded;
    type Addr = std::net::SocketAddr;

    async fn accept(&mut self) -> (Guarded, std::net::SocketAddr) {
        loop {
            let (tcp, addr) = match self.inner.accept().await {
                Ok(x) => x,
                Err(e) => {
                    tracing::warn!(error = %e, "accepting a connection failed; retrying in 100 ms");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            };
            let _ = tcp.set_nodelay(true);
            if self.admit() {
                return (self.guard(tcp), addr);
            }
            tracing::warn!(
                peer = %addr,
                limit = self.limits.max_connections,
                "refused a connection: the gateway holds its maximum of open connections"
            );
            tokio::spawn(refuse(tcp, self.limits.max_connections));
        }
    }

    fn local_addr(&self) -> io::Result<Self::Addr> {
        self.inner.local_addr()
    }
}

/// Answers 503 on a connection over the limit and closes it.
async fn refuse(mut tcp: TcpStream, limit: usize) {
    let body = format!(
        "{{\"error\":\"the gateway holds its maximum of {limit} open connections; retry later\"}}"
    );
    let resp = format!(
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\nretry-after: 1\r\n\r\n{body}",
        body.len()
    );
    let _ = tokio::time::timeout(Duration::from_secs(1), tcp.write_all(resp.as_bytes())).await;
    let _ = tcp.shutdown().await;
}

/// Where a connection is in its current request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
    /// Between requests (or before the first): the next byte read starts a request head.
    Idle,
    /// Reading a request head; `tail` holds its last bytes (to find the blank line ending it).
    Head { tail: [u8; 3] },
    /// The head arrived; the body and the answer follow.
    Served,
}

/// An accepted connection holding its slot, closed when silent too long, when a request head
/// takes too long, or when it is evicted.
pub(crate) struct Guarded {
    tcp: TcpStream,
    state: Arc<ConnState>,
    limits: Limits,
    spoke: bool,
    phase: Phase,
    timer: Pin<Box<Sleep>>,
}

impl Drop for Guarded {
    fn drop(&mut self) {
        let pool = &self.state.pool;
        let open = pool.open.fetch_sub(1, Ordering::AcqRel).saturating_sub(1);
        if !self.state.proven.swap(true, Ordering::AcqRel) {
            pool.unproven.fetch_sub(1, Ordering::AcqRel);
        }
        // a flood went away: give its connections' buffers back to the system (glibc keeps
        // freed memory otherwise), once per flood
        let peak = pool.peak.load(Ordering::Acquire);
        if peak >= 256
            && open * 4 < peak
            && pool
                .peak
                .compare_exchange(peak, open, Ordering::AcqRel, Ordering::Acquire)
                .is_ok()
        {
            #[cfg(all(target_os = "linux", target_env = "gnu"))]
            // SAFETY: malloc_trim only releases free memory of the process's own heap.
            unsafe {
                libc::malloc_trim(0);
            }
        }
    }
}

/// Whether `bytes`, following `tail`, complete the blank line that ends a request head; the new
/// tail otherwise.
fn head_end(tail: [u8; 3], bytes: &[u8]) -> Result<(), [u8; 3]> {
    let mut w = tail;
    for &b in bytes {
        if w == *b"\r\n\r" && b == b'\n' {
            return Ok(());
        }
        w = [w[1], w[2], b];
    }
    Err(w)
}

impl Guarded {
    fn new(tcp: TcpStream, state: Arc<ConnState>, limits: Limits) -> Self {
        Guarded {
            tcp,
            state,
            limits,
            spoke: false,
            phase: Phase::Idle,
            // the first request's head must be whole within the header timeout of the accept
            timer: Box::pin(tokio::time::sleep(limits.header_timeout)),
        }
    }

    fn read_bytes(&mut self, bytes: &[u8]) {
        let first = !self.spoke;
        self.spoke = true;
        let tail = match self.phase {
            Phase::Served => {
                self.idle_from_now();
                return;
            }
            Phase::Idle => {
                if !first {
                    // a new request: its head has the header timeout from now, however it trickles
                    let next = Instant::now() + self.limits.header_timeout;
                    self.timer.as_mut().reset(next);
                }
                [0; 3]
            }
            Phase::Head { tail } => tail,
        };
        self.phase = match head_end(tail, bytes) {
            Ok(()) => {
                self.idle_from_now();
                Phase::Served
            }
            Err(tail) => Phase::Head { tail },
        };
    }

    fn idle_from_now(&mut self) {
        let next = Instant::now() + self.limits.idle_timeout;
        self.timer.as_mut().reset(next);
    }

    /// Whether the current limit passed (registering the timer's wake-up otherwise).
    fn expired(&mut self, cx: &mut Context<'_>) -> bool {
        self.timer.as_mut().poll(cx).is_ready()
    }

    /// The error that closes an evicted connection, if it was evicted (registering the waker
    /// that eviction wakes otherwise).
    fn evicted(&self, cx: &mut Context<'_>) -> Option<io::Error> {
        if self.state.proven.load(Ordering::Acquire) {
            return None;
        }
        *self.state.waker.lock().unwrap_or_else(|e| e.into_inner()) = Some(cx.waker().clone());
        self.state.evicted.load(Ordering::Acquire).then(|| {
            io::Error::new(
                io::ErrorKind::ConnectionAborted,
                "connection closed by the gateway: its slot went to a newer connection (connections without the token hold at most three quarters of them)",
            )
        })
    }
}

impl AsyncRead for Guarded {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        if let Some(e) = self.evicted(cx) {
            return Poll::Ready(Err(e));
        }
        let before = buf.filled().len();
        match Pin::new(&mut self.tcp).poll_read(cx, buf) {
            Poll::Ready(Ok(())) => {
                if buf.filled().len() > before {
                    let this = &mut *self;
                    this.read_bytes(&buf.filled()[before..]);
                }
                Poll::Ready(Ok(()))
            }
            Poll::Ready(Err(e)) => Poll::Ready(Err(e)),
            Poll::Pending => {
                if self.expired(cx) {
                    let what = if !self.spoke || matches!(self.phase, Phase::Head { .. }) {
                        "header"
                    } else {
                        "idle"
                    };
                    Poll::Ready(Err(io::Error::new(
                        io::ErrorKind::TimedOut,
                        format!("connection closed by the gateway's {what} timeout"),
                    )))
                } else {
                    Poll::Pending
                }
            }
        }
    }
}

impl AsyncWrite for Guarded {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        data: &[u8],
    ) -> Poll<io::Result<usize>> {
        if let Some(e) = self.evicted(cx) {
            return Poll::Ready(Err(e));
        }
        let r = Pin::new(&mut self.tcp).poll_write(cx, data);
        if matches!(r, Poll::Ready(Ok(n)) if n > 0) {
            // an answer: the next byte read starts a new request
            self.phase = Phase::Idle;
            self.spoke = true;
            self.idle_from_now();
        }
        r
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.tcp).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.tcp).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_head_ends_at_its_blank_line_even_split_across_reads() {
        assert!(head_end([0; 3], b"GET / HTTP/1.1\r\nHost: x\r\n\r\n").is_ok());
        let t = head_end([0; 3], b"GET / HTTP/1.1\r\nHost: x\r\n\r").unwrap_err();
        assert!(head_end(t, b"\n").is_ok());
        let t = head_end([0; 3], b"GET / HTTP/1.1\r\n").unwrap_err();
        assert!(head_end(t, b"Host: x\r\n").is_err());
    }
}
