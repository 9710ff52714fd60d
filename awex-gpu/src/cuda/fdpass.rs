//! Handing file descriptors to another process of the same user over a Unix socket
//! (`SCM_RIGHTS`): how a receiver takes the descriptors of a span of `cuMemMap` chunks when the
//! kernel refuses `pidfd_getfd` (a host with `kernel.yama.ptrace_scope` 1, a container whose
//! seccomp profile blocks it).
//!
//! The exporting process serves its descriptors ([`FdServer`]) on a socket file created mode
//! 0600, and answers only a peer whose uid (`SO_PEERCRED`) is its own. A peer that connects gets
//! every served descriptor, in batches of at most [`BATCH`]: each message carries the batch's
//! size and the exporter's number of each descriptor as data, the descriptors themselves as
//! ancillary data. [`fetch_fds`] reads them into a map from the exporter's numbers to new
//! descriptors of this process.

use super::CudaError;
use std::collections::HashMap;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

/// Descriptors per message (the kernel takes at most 253 in one `SCM_RIGHTS` message).
pub const BATCH: usize = 200;

fn err(what: &str, e: io::Error) -> CudaError {
    CudaError::FdPass {
        what: what.to_string(),
        detail: e.to_string(),
    }
}

/// Serves a process's descriptors to peers of the same user, until dropped.
pub struct FdServer {
    path: PathBuf,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl FdServer {
    /// Serves `fds` (kept open by the caller while the server lives) on a new socket `path`.
    pub fn start(path: &Path, fds: Vec<RawFd>) -> Result<FdServer, CudaError> {
        let _ = std::fs::remove_file(path);
        let listener = UnixListener::bind(path).map_err(|e| err("binding the socket", e))?;
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))
            .map_err(|e| err("making the socket private", e))?;
        let stop = Arc::new(AtomicBool::new(false));
        let s2 = stop.clone();
        let thread = std::thread::Builder::new()
            .name("awex-fds".into())
            .spawn(move || serve(listener, fds, s2))
            .map_err(|e| err("starting the serving thread", e))?;
        Ok(FdServer {
            path: path.to_path_buf(),
            stop,
            thread: Some(thread),
        })
    }

    /// The socket's path.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for FdServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        // wake the blocking accept with a connection of our own; if that cannot be made (the
        // socket file was removed), the thread is left to end with the process
        let woken = UnixStream::connect(&self.path).is_ok();
        if let Some(t) = self.thread.take()
            && woken
        {
            let _ = t.join();
        }
        let _ = std::fs::remove_file(&self.path);
    }
}

fn serve(listener: UnixListener, fds: Vec<RawFd>, stop: Arc<AtomicBool>) {
    loop {
        let accepted = listener.accept();
        if stop.load(Ordering::Acquire) {
            return; // the drop's own wake-up, or a peer too late: nothing more is handed out
        }
        match accepted {
            // one peer at a time: a peer takes milliseconds; errors end only that peer
            Ok((conn, _)) => {
                let _ = answer(&conn, &fds);
            }
            Err(_) => std::thread::sleep(Duration::from_millis(50)),
        }
    }
}

/// The uid of the process at the other end of `s`.
fn peer_uid(s: &UnixStream) -> io::Result<u32> {
    let mut cred = libc::ucred {
        pid: 0,
        uid: 0,
        gid: 0,
    };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: `cred` and `len` are valid for writes of the sizes given.
    let r = unsafe {
        libc::getsockopt(
            s.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut cred as *mut libc::ucred).cast(),
            &mut len,
        )
    };
    if r != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(cred.uid)
}

fn answer(conn: &UnixStream, fds: &[RawFd]) -> io::Result<()> {
    conn.set_nonblocking(false)?;
    conn.set_write_timeout(Some(Duration::from_secs(10)))?;
    // SAFETY: getuid cannot fail.
    if peer_uid(conn)? != unsafe { libc::getuid() } {
        return Err(io::Error::from(io::ErrorKind::PermissionDenied));
    }
    let total = fds.len() as u64;
    if fds.is_empty() {
        return send_batch(conn, total, &[]);
    }
    for batch in fds.chunks(BATCH) {
        send_batch(conn, total, batch)?;
    }
    Ok(())
}

/// One message: [total u64][count u32][the exporter's numbers, i32 each], the descriptors as
/// `SCM_RIGHTS`.
fn send_batch(conn: &UnixStream, total: u64, batch: &[RawFd]) -> io::Result<()> {
    let mut data = Vec::with_capacity(12 + 4 * batch.len());
    data.extend_from_slice(&total.to_le_bytes());
    data.extend_from_slice(&(batch.len() as u32).to_le_bytes());
    for fd in batch {
        data.extend_from_slice(&fd.to_le_bytes());
    }
    let fd_bytes = std::mem::size_of_val(batch) as u32;
    let mut control = control_for(batch.len());
    let mut iov = libc::iovec {
        iov_base: data.as_mut_ptr().cast(),
        iov_len: data.len(),
    };
    let mut msg = message(&mut iov, &mut control);
    if batch.is_empty() {
        msg.msg_control = std::ptr::null_mut();
        msg.msg_controllen = 0;
    } else {
        // SAFETY: the control buffer holds CMSG_SPACE(fd_bytes) bytes, room for one header and
        // the descriptors.
        unsafe {
            let c = libc::CMSG_FIRSTHDR(&msg);
            (*c).cmsg_level = libc::SOL_SOCKET;
            (*c).cmsg_type = libc::SCM_RIGHTS;
            (*c).cmsg_len = libc::CMSG_LEN(fd_bytes) as _;
            std::ptr::copy_nonoverlapping(
                batch.as_ptr().cast::<u8>(),
                libc::CMSG_DATA(c),
                fd_bytes as usize,
            );
        }
    }
    // SAFETY: `msg` points at live buffers of the lengths it states.
    let n = unsafe { libc::sendmsg(conn.as_raw_fd(), &msg, libc::MSG_NOSIGNAL) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    if n as usize != data.len() {
        return Err(io::Error::new(io::ErrorKind::WriteZero, "short message"));
    }
    Ok(())
}

/// Connects to the [`FdServer`] at `path` and takes every descriptor it serves, at most `max`
/// (a bound on what a peer can make this process hold): a map from the exporter's numbers to
/// descriptors of this process.
pub fn fetch_fds(path: &Path, max: usize) -> Result<HashMap<RawFd, OwnedFd>, CudaError> {
    let conn = UnixStream::connect(path).map_err(|e| err("connecting to the socket", e))?;
    conn.set_read_timeout(Some(Duration::from_secs(30)))
        .map_err(|e| err("setting up the socket", e))?;
    let bad = |detail: String| CudaError::FdPass {
        what: "reading the descriptors".into(),
        detail,
    };
    let mut got = HashMap::new();
    let (mut offered, mut received) = (None, 0u64);
    loop {
        let (total, batch) = recv_batch(&conn)?;
        if total > max as u64 {
            return Err(bad(format!(
                "the exporter offers {total}, more than the {max} expected"
            )));
        }
        if *offered.get_or_insert(total) != total {
            return Err(bad(format!(
                "the exporter offered {} descriptors, then {total}",
                offered.unwrap_or(total)
            )));
        }
        // counted as sent, not as distinct numbers: a peer repeating itself cannot keep this
        // loop going
        received += batch.len() as u64;
        if received > total {
            return Err(bad(format!("{received} descriptors sent, {total} offered")));
        }
        got.extend(batch);
        if received == total {
            if got.len() as u64 != total {
                return Err(bad(format!(
                    "{total} descriptors sent under {} distinct numbers",
                    got.len()
                )));
            }
            return Ok(got);
        }
    }
}

type Batch = Vec<(RawFd, OwnedFd)>;

/// A control buffer with room for `fds` descriptors.
fn control_for(fds: usize) -> Vec<u8> {
    // SAFETY: CMSG_SPACE is a pure size computation.
    vec![0u8; unsafe { libc::CMSG_SPACE((4 * fds) as u32) } as usize]
}

/// A message header over one data buffer and a control buffer; both must outlive its use.
fn message(iov: &mut libc::iovec, control: &mut [u8]) -> libc::msghdr {
    // SAFETY: a zeroed msghdr is valid; the pointers set are the caller's live buffers.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.as_mut_ptr().cast();
    msg.msg_controllen = control.len() as _;
    msg
}

fn recv_batch(conn: &UnixStream) -> Result<(u64, Batch), CudaError> {
    let bad = |detail: String| CudaError::FdPass {
        what: "reading the descriptors".into(),
        detail,
    };
    let mut data = vec![0u8; 12 + 4 * BATCH];
    let mut control = control_for(BATCH);
    let mut iov = libc::iovec {
        iov_base: data.as_mut_ptr().cast(),
        iov_len: data.len(),
    };
    let mut msg = message(&mut iov, &mut control);
    // SAFETY: `msg` points at live buffers of the lengths it states.
    let n = unsafe { libc::recvmsg(conn.as_raw_fd(), &mut msg, libc::MSG_CMSG_CLOEXEC) };
    if n < 0 {
        return Err(err("reading the descriptors", io::Error::last_os_error()));
    }
    // every descriptor the kernel installed, owned at once so that an error below closes them
    let mut fds: Vec<OwnedFd> = Vec::new();
    // SAFETY: walks the control messages recvmsg wrote into `control`.
    unsafe {
        let mut c = libc::CMSG_FIRSTHDR(&msg);
        while !c.is_null() {
            if (*c).cmsg_level == libc::SOL_SOCKET && (*c).cmsg_type == libc::SCM_RIGHTS {
                let bytes = (*c).cmsg_len as usize - libc::CMSG_LEN(0) as usize;
                let p = libc::CMSG_DATA(c) as *const RawFd;
                for i in 0..bytes / 4 {
                    fds.push(OwnedFd::from_raw_fd(p.add(i).read_unaligned()));
                }
            }
            c = libc::CMSG_NXTHDR(&msg, c);
        }
    }
    if msg.msg_flags & libc::MSG_CTRUNC != 0 {
        return Err(bad("the descriptors were cut short (MSG_CTRUNC)".into()));
    }
    let n = n as usize;
    if n < 12 {
        return Err(bad(format!("a message of {n} bytes")));
    }
    let total = u64::from_le_bytes(data[..8].try_into().unwrap_or_default());
    let count = u32::from_le_bytes(data[8..12].try_into().unwrap_or_default()) as usize;
    if count > BATCH || n != 12 + 4 * count || fds.len() != count {
        return Err(bad(format!(
            "a batch of {count} descriptors in {n} bytes with {} attached",
            fds.len()
        )));
    }
    let numbers = data[12..n]
        .chunks_exact(4)
        .map(|b| i32::from_le_bytes([b[0], b[1], b[2], b[3]]));
    Ok((total, numbers.zip(fds).collect()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Seek, Write};

    fn files(n: usize) -> (tempfile::TempDir, Vec<std::fs::File>) {
        let dir = tempfile::tempdir().unwrap();
        let fs = (0..n)
            .map(|i| {
                let mut f = tempfile::tempfile_in(dir.path()).unwrap();
                write!(f, "file {i}").unwrap();
                f
            })
            .collect();
        (dir, fs)
    }

    #[test]
    fn a_peer_takes_every_descriptor_and_reads_what_each_names() {
        let (dir, fs) = files(450); // three batches
        let raw: Vec<RawFd> = fs.iter().map(|f| f.as_raw_fd()).collect();
        let path = dir.path().join("fds.sock");
        let server = FdServer::start(&path, raw.clone()).unwrap();
        use std::os::unix::fs::PermissionsExt;
        assert_eq!(
            std::fs::metadata(&path).unwrap().permissions().mode() & 0o777,
            0o600
        );
        for _ in 0..2 {
            // a second peer gets them all again
            let got = fetch_fds(&path, 450).unwrap();
            assert_eq!(got.len(), 450);
            for (i, fd) in raw.iter().enumerate() {
                let mine = got.get(fd).expect("every exporter number is in the map");
                assert_ne!(mine.as_raw_fd(), *fd, "a new descriptor of this process");
                let mut f = std::fs::File::from(mine.try_clone().unwrap());
                f.rewind().unwrap();
                let mut s = String::new();
                f.read_to_string(&mut s).unwrap();
                assert_eq!(s, format!("file {i}"));
            }
        }
        drop(server);
        assert!(!path.exists(), "the socket file goes with the server");
        let e = fetch_fds(&path, 450).unwrap_err().to_string();
        assert!(
            e.starts_with("passing file descriptors: connecting to the socket:"),
            "{e}"
        );
    }

    #[test]
    fn more_descriptors_than_expected_are_refused() {
        let (dir, fs) = files(3);
        let path = dir.path().join("many.sock");
        let _server = FdServer::start(&path, fs.iter().map(|f| f.as_raw_fd()).collect()).unwrap();
        assert_eq!(
            fetch_fds(&path, 2).unwrap_err().to_string(),
            "passing file descriptors: reading the descriptors: the exporter offers 3, more than the 2 expected"
        );
        assert_eq!(fetch_fds(&path, 3).unwrap().len(), 3);
    }

    #[test]
    fn a_peer_repeating_one_descriptor_number_is_refused() {
        let (dir, fs) = files(1);
        let path = dir.path().join("same.sock");
        let fd = fs[0].as_raw_fd();
        let _server = FdServer::start(&path, vec![fd, fd, fd]).unwrap();
        assert_eq!(
            fetch_fds(&path, 3).unwrap_err().to_string(),
            "passing file descriptors: reading the descriptors: 3 descriptors sent under 1 distinct numbers"
        );
    }

    #[test]
    fn a_server_with_nothing_to_serve_answers_an_empty_map() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("none.sock");
        let _server = FdServer::start(&path, vec![]).unwrap();
        assert!(fetch_fds(&path, 0).unwrap().is_empty());
    }

    #[test]
    fn a_malformed_answer_is_refused_by_name() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("bad.sock");
        let listener = UnixListener::bind(&path).unwrap();
        let t = std::thread::spawn(move || {
            let (mut c, _) = listener.accept().unwrap();
            // claims 3 descriptors in the batch, sends none
            let mut m = 5u64.to_le_bytes().to_vec();
            m.extend_from_slice(&3u32.to_le_bytes());
            m.extend_from_slice(&[0u8; 12]);
            c.write_all(&m).unwrap();
        });
        let e = fetch_fds(&path, 5).unwrap_err().to_string();
        assert_eq!(
            e,
            "passing file descriptors: reading the descriptors: a batch of 3 descriptors in 24 bytes with 0 attached"
        );
        t.join().unwrap();
    }
}
