//! The floors measured in the same run: memcpy, one device copy, one loopback TCP stream.

use std::time::Instant;

/// Best-of-5 bandwidth of one 1 GiB device-to-device copy on GPU `gpu` (bytes copied per second).
pub fn device_copy_gbps(gpu: u32) -> anyhow::Result<f64> {
    crate::cmd::bench::floors::device_copy_gbps(gpu)
}

/// Best-of-5 single-thread memcpy bandwidth over 256 MiB buffers (bytes copied per second).
pub fn memcpy_gbps() -> f64 {
    let n = 256usize << 20;
    let src = vec![1u8; n];
    let mut dst = vec![0u8; n];
    dst.copy_from_slice(&src);
    let mut best = f64::MAX;
    for _ in 0..5 {
        let t = Instant::now();
        dst.copy_from_slice(std::hint::black_box(&src));
        std::hint::black_box(&mut dst);
        best = best.min(t.elapsed().as_secs_f64());
    }
    n as f64 / best / 1e9
}

/// Best-of-3 bandwidth of one loopback TCP stream carrying 512 MiB in 64 MiB writes (bytes per second).
pub fn tcp_loopback_gbps() -> anyhow::Result<f64> {
    use std::io::{Read, Write};
    let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
    let addr = listener.local_addr()?;
    let total = 512usize << 20;
    let reader = std::thread::spawn(move || -> std::io::Result<()> {
        let (mut s, _) = listener.accept()?;
        let mut buf = vec![0u8; 64 << 20];
        for _ in 0..3 {
            let mut got = 0;
            while got < total {
                let n = s.read(&mut buf)?;
                if n == 0 {
                    return Ok(());
                }
                got += n;
            }
            s.write_all(&[1])?;
        }
        Ok(())
    });
    let mut s = std::net::TcpStream::connect(addr)?;
    s.set_nodelay(true).ok();
    let chunk = vec![7u8; 64 << 20];
    let mut best = f64::MAX;
    for _ in 0..3 {
        let t = Instant::now();
        for _ in 0..total / chunk.len() {
            s.write_all(&chunk)?;
        }
        let mut ack = [0u8; 1];
        s.read_exact(&mut ack)?;
        best = best.min(t.elapsed().as_secs_f64());
    }
    drop(s);
    reader
        .join()
        .map_err(|_| anyhow::anyhow!("loopback reader panicked"))??;
    Ok(total as f64 / best / 1e9)
}
