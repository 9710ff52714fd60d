//! The gateway's listener: a bounded number of open connections, and connections that say
//! nothing for too long are closed, so that a flood of idle sockets cannot starve the API.
//!
//! - At most `max_connections` are open at once; a connection beyond it is answered at once
//!   with `503 Service Unavailable` and closed (the accept loop never blocks on it).
//! - A new connection must send its first bytes within `header_timeout`; afterwards a
//!   connection on which nothing is read or written for `idle_timeout` (longer than the
//!   longest long-poll) is closed.
//! - Accept errors (e.g. out of file descriptors) are logged and retried after a pause.

use axum::serve::Listener;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::{Instant, Sleep};

/// Limits of the listener.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Limits {
    /// Most connections open at once.
    pub(crate) max_connections: usize,
    /// Time a new connection has to send its first bytes.
    pub(crate) header_timeout: Duration,
    /// Time a connection may stay silent in both directions once it spoke.
    pub(crate) idle_timeout: Duration,
}

/// A TCP listener with [`Limits`].
pub(crate) struct Bounded {
    inner: TcpListener,
    permits: Arc<Semaphore>,
    limits: Limits,
}

impl Bounded {
    /// Wraps `inner`.
    pub(crate) fn new(inner: TcpListener, limits: Limits) -> Self {
        Bounded {
            inner,
            permits: Arc::new(Semaphore::new(limits.max_connections.max(1))),
            limits,
        }
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
            match self.permits.clone().try_acquire_owned() {
                Ok(permit) => return (Guarded::new(tcp, permit, self.limits), addr),
                Err(_) => {
                    tracing::warn!(
                        peer = %addr,
                        limit = self.limits.max_connections,
                        "refused a connection: the gateway holds its maximum of open connections"
                    );
                    tokio::spawn(refuse(tcp, self.limits.max_connections));
                }
            }
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

/// An accepted connection holding its permit, closed when silent too long.
pub(crate) struct Guarded {
    tcp: TcpStream,
    _permit: OwnedSemaphorePermit,
    limits: Limits,
    spoke: bool,
    timer: Pin<Box<Sleep>>,
}

impl Guarded {
    fn new(tcp: TcpStream, permit: OwnedSemaphorePermit, limits: Limits) -> Self {
        Guarded {
            tcp,
            _permit: permit,
            limits,
            spoke: false,
            timer: Box::pin(tokio::time::sleep(limits.header_timeout)),
        }
    }

    fn activity(&mut self) {
        self.spoke = true;
        let next = Instant::now() + self.limits.idle_timeout;
        self.timer.as_mut().reset(next);
    }

    /// Whether the silence limit passed (registering the timer's wake-up otherwise).
    fn expired(&mut self, cx: &mut Context<'_>) -> bool {
        self.timer.as_mut().poll(cx).is_ready()
    }
}

impl AsyncRead for Guarded {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        match Pin::new(&mut self.tcp).poll_read(cx, buf) {
            Poll::Ready(Ok(())) => {
                if buf.filled().len() > before {
                    self.activity();
                }
                Poll::Ready(Ok(()))
            }
            Poll::Ready(Err(e)) => Poll::Ready(Err(e)),
            Poll::Pending => {
                if self.expired(cx) {
                    let what = if self.spoke { "idle" } else { "header" };
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
        let r = Pin::new(&mut self.tcp).poll_write(cx, data);
        if matches!(r, Poll::Ready(Ok(n)) if n > 0) {
            self.activity();
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
