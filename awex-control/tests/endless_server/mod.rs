//! A server whose every answer is `200 OK` with a body of up to `limit` bytes, sent in 64 KiB
//! pieces until the client stops reading: a wrong URL or a broken engine as a reader of answers
//! meets it. It counts the bytes it got out, so a test bounds what a reader took by work done,
//! not by time.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

/// The server's base URL and the bytes of body it has written so far.
pub struct Endless {
    pub url: String,
    pub sent: Arc<AtomicU64>,
}

/// Serves on 127.0.0.1; `declared`: the `Content-Length` to claim (none: the body ends when
/// the connection closes).
pub async fn endless(limit: u64, declared: Option<u64>) -> Endless {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let url = format!("http://{}", listener.local_addr().expect("addr"));
    let sent = Arc::new(AtomicU64::new(0));
    let count = sent.clone();
    tokio::spawn(async move {
        while let Ok((mut sock, _)) = listener.accept().await {
            let count = count.clone();
            tokio::spawn(async move {
                let mut buf = Vec::new();
                let mut piece = [0u8; 1024];
                while !buf.windows(4).any(|w| w == b"\r\n\r\n") {
                    match sock.read(&mut piece).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => buf.extend_from_slice(&piece[..n]),
                    }
                }
                let length = declared.map_or(String::new(), |n| format!("content-length: {n}\r\n"));
                let head = format!(
                    "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n{length}connection: close\r\n\r\n"
                );
                if sock.write_all(head.as_bytes()).await.is_err() {
                    return;
                }
                // a JSON array that never closes: `[` then spaces
                let mut body = vec![b' '; 64 << 10];
                body[0] = b'[';
                let mut written = 0u64;
                while written < limit {
                    if sock.write_all(&body).await.is_err() {
                        return;
                    }
                    body[0] = b' ';
                    written += body.len() as u64;
                    count.fetch_add(body.len() as u64, Ordering::SeqCst);
                }
            });
        }
    });
    Endless { url, sent }
}
