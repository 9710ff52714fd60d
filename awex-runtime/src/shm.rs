//! Named POSIX shared-memory segments (`/dev/shm/awex-*`), mapped read-write, created mode 0600.
//!
//! # Names and lifecycle
//!
//! awex names a pair's segments `awex-{pair}-{uid}-{who}-{kind}` ([`segment_name`]): the pair
//! name, the pair's connect uid (32 hex digits, from the gateway), the rank and its process
//! incarnation (`t0.1.{8 hex}`: a restarted rank publishes new names, so its peers re-open)
//! and the kind (`data`, `ctl`). [`parse_name`] reads a name back from the right, so the pair
//! is matched exactly (pair `s6-job` never matches `s6-job-2`'s segments).
//!
//! The creator of a segment holds a shared `flock` on it for as long as it lives; the kernel
//! drops it when the process dies, however it dies (SIGKILL included). A segment is dead when
//! nobody holds that lock: this works across PID namespaces and containers that share
//! `/dev/shm`, and does not depend on PIDs at all. [`gc`] removes dead segments; every rank
//! runs it when it allocates its segments (the next connect on the host), and `awex-cli gc`
//! can run it by hand.

use super::{RuntimeError, ShmError};
use std::ffi::CString;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, Ordering};

/// A mapped shared-memory segment; the creator unlinks it on drop.
pub struct ShmSegment {
    name: String,
    ptr: NonNull<u8>,
    len: usize,
    owner: AtomicBool,
    /// The creator's descriptor, holding the liveness lock (see the module doc).
    lock: Option<std::os::fd::OwnedFd>,
}

// SAFETY: the mapping is plain shared memory; synchronisation is the users' job (atomics in the header).
unsafe impl Send for ShmSegment {}
// SAFETY: as above.
unsafe impl Sync for ShmSegment {}

/// Prefix of every segment awex creates (so leaks are easy to find in /dev/shm).
pub const SHM_PREFIX: &str = "awex-";

fn os_err(op: &'static str, name: &str) -> RuntimeError {
    ShmError::Os {
        op,
        name: name.to_string(),
        source: std::io::Error::last_os_error(),
    }
    .into()
}

fn bad_name(name: &str) -> RuntimeError {
    ShmError::BadName {
        name: name.to_string(),
        prefix: SHM_PREFIX,
    }
    .into()
}

fn cname(name: &str) -> Result<CString, RuntimeError> {
    if !name.starts_with(SHM_PREFIX)
        || name.len() > 200
        || !name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
    {
        return Err(bad_name(name));
    }
    CString::new(format!("/{name}")).map_err(|_| bad_name(name))
}

impl ShmSegment {
    /// Creates (exclusively, mode 0600) and maps a zero-filled segment of `len` bytes, and
    /// holds its liveness lock until drop.
    pub fn create(name: &str, len: usize) -> Result<Self, RuntimeError> {
        for _ in 0..3 {
            if let Some(seg) = Self::try_create(name, len)? {
                return Ok(seg);
            }
        }
        Err(ShmError::Vanished {
            name: name.to_string(),
        }
        .into())
    }

    /// One attempt; `None` when a sweeper removed the name between create and lock.
    fn try_create(name: &str, len: usize) -> Result<Option<Self>, RuntimeError> {
        use std::os::fd::{FromRawFd, OwnedFd};
        let c = cname(name)?;
        let len = len.max(1);
        // SAFETY: plain libc calls with a valid C string; every result is checked.
        unsafe {
            let fd = libc::shm_open(
                c.as_ptr(),
                libc::O_CREAT | libc::O_EXCL | libc::O_RDWR | libc::O_CLOEXEC,
                0o600,
            );
            if fd < 0 {
                return Err(os_err("cannot create", name));
            }
            let owned = OwnedFd::from_raw_fd(fd);
            // the umask may only have narrowed it; make it exactly owner-only
            libc::fchmod(fd, 0o600);
            if libc::flock(fd, libc::LOCK_SH) != 0 {
                let e = os_err("cannot lock", name);
                libc::shm_unlink(c.as_ptr());
                return Err(e);
            }
            // a sweeper may have unlinked the fresh, not yet locked name: check it is ours
            let (mut a, mut b): (libc::stat, libc::stat) = (std::mem::zeroed(), std::mem::zeroed());
            let path = CString::new(format!("/dev/shm/{name}")).unwrap_or_default();
            if libc::fstat(fd, &mut a) != 0
                || libc::stat(path.as_ptr(), &mut b) != 0
                || a.st_ino != b.st_ino
            {
                return Ok(None);
            }
            if libc::ftruncate(fd, len as libc::off_t) != 0 {
                let e = os_err("cannot size", name);
                libc::shm_unlink(c.as_ptr());
                return Err(e);
            }
            let seg = Self::map(fd, name, len, true, false);
            match seg {
                Ok(mut s) => {
                    s.lock = Some(owned);
                    Ok(Some(s))
                }
                Err(e) => {
                    libc::shm_unlink(c.as_ptr());
                    Err(e)
                }
            }
        }
    }

    /// Opens and maps an existing segment created by another process, its pages faulted in
    /// at once (`MAP_POPULATE`: a data segment the receiver reads whole).
    pub fn open(name: &str) -> Result<Self, RuntimeError> {
        Self::open_with(name, true)
    }

    /// Opens and maps an existing segment, faulting in a page only when it is read: for a
    /// segment sized for the worst case and written only in part (the delta segment), whose
    /// unwritten pages populating would commit (tmpfs allocates and clears them).
    pub fn open_lazy(name: &str) -> Result<Self, RuntimeError> {
        Self::open_with(name, false)
    }

    fn open_with(name: &str, populate: bool) -> Result<Self, RuntimeError> {
        let c = cname(name)?;
        // SAFETY: as in `create`.
        unsafe {
            let fd = libc::shm_open(c.as_ptr(), libc::O_RDWR | libc::O_CLOEXEC, 0);
            if fd < 0 {
                return Err(os_err("cannot open", name));
            }
            let mut st: libc::stat = std::mem::zeroed();
            if libc::fstat(fd, &mut st) != 0 {
                let e = os_err("cannot stat", name);
                libc::close(fd);
                return Err(e);
            }
            let r = Self::map(fd, name, st.st_size as usize, false, populate);
            libc::close(fd);
            r
        }
    }

    /// # Safety
    /// `fd` must be an open shared-memory descriptor of at least `len` bytes; the caller closes it.
    unsafe fn map(
        fd: i32,
        name: &str,
        len: usize,
        owner: bool,
        populate: bool,
    ) -> Result<Self, RuntimeError> {
        // SAFETY: guaranteed by the caller; the result is checked.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                if populate {
                    libc::MAP_SHARED | libc::MAP_POPULATE
                } else {
                    libc::MAP_SHARED
                },
                fd,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(os_err("cannot map", name));
        }
        Ok(ShmSegment {
            name: name.to_string(),
            ptr: NonNull::new(p as *mut u8).ok_or_else(|| os_err("null map of", name))?,
            len,
            owner: AtomicBool::new(owner),
            lock: None,
        })
    }

    /// The segment's name (without the leading slash).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Base address of the mapping.
    pub fn ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the segment is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Removes the name now (the mapping stays valid until drop).
    pub fn unlink(&self) {
        if self.owner.swap(false, Ordering::AcqRel)
            && let Ok(c) = cname(&self.name)
        {
            // SAFETY: valid C string.
            unsafe { libc::shm_unlink(c.as_ptr()) };
        }
    }
}

impl Drop for ShmSegment {
    fn drop(&mut self) {
        self.unlink();
        // SAFETY: ptr/len come from a successful mmap.
        unsafe { libc::munmap(self.ptr.as_ptr() as *mut libc::c_void, self.len) };
    }
}

/// A segment name awex made, read back by [`parse_name`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SegmentName {
    /// The pair.
    pub pair: String,
    /// The pair's connect uid (or, for a rank that did not know it, its own random id).
    pub uid: String,
    /// The rank (`t0.1`, `i1.0`).
    pub who: String,
    /// `data`, `ctl` or `delta`.
    pub kind: String,
}

/// The name of a segment of `pair` (connect `uid`) for rank `who`, of `kind`.
pub fn segment_name(pair: &str, uid: &str, who: &str, kind: &str) -> String {
    format!("{SHM_PREFIX}{pair}-{uid}-{who}-{kind}")
}

/// Reads a name made by [`segment_name`] back, from the right (pair names may hold `-`);
/// `None` for anything else.
pub fn parse_name(name: &str) -> Option<SegmentName> {
    let rest = name.strip_prefix(SHM_PREFIX)?;
    let mut parts = rest.rsplitn(4, '-');
    let kind = parts.next()?;
    let who = parts.next()?;
    let uid = parts.next()?;
    let pair = parts.next()?;
    let hex = |s: &str| s.len() == 32 && s.bytes().all(|b| b.is_ascii_hexdigit());
    // `t0.1` or `t0.1.{incarnation}` (8 hex digits: a restarted rank gets new names)
    let rank = |s: &str| {
        let (side, r) = s.split_at(1.min(s.len()));
        let p: Vec<&str> = r.split('.').collect();
        matches!(side, "t" | "i")
            && (p.len() == 2 || p.len() == 3)
            && p[0].parse::<u32>().is_ok()
            && p[1].parse::<u32>().is_ok()
            && p.get(2)
                .is_none_or(|x| x.len() == 8 && x.bytes().all(|b| b.is_ascii_hexdigit()))
    };
    if pair.is_empty() || !hex(uid) || !rank(who) || !matches!(kind, "data" | "ctl" | "delta") {
        return None;
    }
    Some(SegmentName {
        pair: pair.into(),
        uid: uid.into(),
        who: who.into(),
        kind: kind.into(),
    })
}

/// Whether some process holds segment `name`'s liveness lock (its creator is alive); `None`
/// when it cannot be told (the segment is gone, or not readable by this user).
pub fn is_live(name: &str) -> Option<bool> {
    let c = cname(name).ok()?;
    // SAFETY: plain libc calls on a descriptor opened here and closed before returning.
    unsafe {
        let fd = libc::shm_open(c.as_ptr(), libc::O_RDONLY | libc::O_CLOEXEC, 0);
        if fd < 0 {
            return None;
        }
        let free = libc::flock(fd, libc::LOCK_EX | libc::LOCK_NB) == 0;
        libc::close(fd);
        Some(!free)
    }
}

/// Removes the dead segments awex made ([`parse_name`]): those no process holds the liveness
/// lock of. With `pair`, only that pair's (matched exactly). Returns the names removed.
pub fn gc(pair: Option<&str>) -> Vec<String> {
    gc_where(|_, n| pair.is_none_or(|p| p == n.pair))
}

fn gc_where(keep: impl Fn(&str, &SegmentName) -> bool) -> Vec<String> {
    let mut removed = Vec::new();
    for name in list_segments(SHM_PREFIX) {
        let Some(n) = parse_name(&name) else { continue };
        if !keep(&name, &n) {
            continue;
        }
        let Ok(c) = cname(&name) else { continue };
        // SAFETY: plain libc calls; the exclusive lock is held while the name is removed, so a
        // creator cannot lock it in between (it re-checks the name's inode after locking)
        unsafe {
            let fd = libc::shm_open(c.as_ptr(), libc::O_RDONLY | libc::O_CLOEXEC, 0);
            if fd < 0 {
                continue;
            }
            if libc::flock(fd, libc::LOCK_EX | libc::LOCK_NB) == 0
                && libc::shm_unlink(c.as_ptr()) == 0
            {
                removed.push(name);
            }
            libc::close(fd);
        }
    }
    removed
}

/// The Unix socket on which a cuda-ipc training rank whose control segment is `ctl_name`
/// serves the descriptors of its `cuMemMap` spans (in the temp directory).
pub fn fd_socket_path(ctl_name: &str) -> std::path::PathBuf {
    std::env::temp_dir().join(format!("{ctl_name}.fds"))
}

/// Removes the descriptor sockets ([`fd_socket_path`]) of `pair` (all pairs with `None`) that
/// nobody serves any more (their rank died without removing them: connecting is refused);
/// returns their paths. A live rank's socket stays.
pub fn gc_fd_sockets(pair: Option<&str>) -> Vec<String> {
    gc_fd_sockets_in(&std::env::temp_dir(), pair)
}

fn gc_fd_sockets_in(dir: &std::path::Path, pair: Option<&str>) -> Vec<String> {
    use std::os::unix::fs::FileTypeExt;
    let mut removed = Vec::new();
    let Ok(entries) = std::fs::read_dir(dir) else {
        return removed;
    };
    for e in entries.filter_map(|e| e.ok()) {
        let name = e.file_name().to_string_lossy().into_owned();
        let Some(n) = name.strip_suffix(".fds").and_then(parse_name) else {
            continue;
        };
        if pair.is_some_and(|p| p != n.pair) || !e.file_type().is_ok_and(|t| t.is_socket()) {
            continue;
        }
        let path = e.path();
        let refused = std::os::unix::net::UnixStream::connect(&path)
            .is_err_and(|err| err.kind() == std::io::ErrorKind::ConnectionRefused);
        if refused && std::fs::remove_file(&path).is_ok() {
            removed.push(path.to_string_lossy().into_owned());
        }
    }
    removed
}

/// Removes the dead awex segments whose names start with `prefix` (see [`gc`]; liveness by
/// lock, never by PID).
pub fn sweep_dead(prefix: &str) -> Vec<String> {
    gc_where(|name, _| name.starts_with(prefix))
}

/// Names of awex segments currently in /dev/shm that start with `prefix` (for leak checks).
pub fn list_segments(prefix: &str) -> Vec<String> {
    std::fs::read_dir("/dev/shm")
        .map(|d| {
            d.filter_map(|e| e.ok())
                .filter_map(|e| e.file_name().into_string().ok())
                .filter(|n| n.starts_with(prefix))
                .collect()
        })
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn segment_is_shared_and_unlinked_on_drop() {
        let name = format!("awex-test-{}-seg", std::process::id());
        let a = ShmSegment::create(&name, 4096).unwrap();
        // SAFETY: both mappings are 4096 bytes.
        unsafe { *a.ptr().add(100) = 42 };
        let b = ShmSegment::open(&name).unwrap();
        assert_eq!(b.len(), 4096);
        // SAFETY: in bounds.
        assert_eq!(unsafe { *b.ptr().add(100) }, 42);
        assert!(ShmSegment::create(&name, 10).is_err(), "exclusive create");
        drop(a);
        assert!(list_segments(&name).is_empty());
        assert!(ShmSegment::open(&name).is_err());
        assert!(matches!(
            ShmSegment::create("../etc", 1),
            Err(RuntimeError::Shm(_))
        ));
    }

    #[test]
    fn gc_removes_the_descriptor_sockets_nobody_serves_and_keeps_live_ones() {
        let dir = tempfile::tempdir().unwrap();
        let uid = "0123456789abcdef0123456789abcdef";
        let name = |pair: &str, r: u32| {
            format!("{}.fds", segment_name(pair, uid, &format!("t0.{r}"), "ctl"))
        };
        // dead: bound, then the listener dropped (the file stays, nobody accepts)
        let dead = dir.path().join(name("p1", 0));
        drop(std::os::unix::net::UnixListener::bind(&dead).unwrap());
        let other = dir.path().join(name("p2", 0));
        drop(std::os::unix::net::UnixListener::bind(&other).unwrap());
        // live: still listening
        let live = dir.path().join(name("p1", 1));
        let _listener = std::os::unix::net::UnixListener::bind(&live).unwrap();
        // not a socket, and not an awex name
        let plain = dir.path().join(name("p1", 2));
        std::fs::write(&plain, b"x").unwrap();
        let stray = dir.path().join("someone-else.fds");
        drop(std::os::unix::net::UnixListener::bind(&stray).unwrap());
        assert_eq!(
            gc_fd_sockets_in(dir.path(), Some("p1")),
            vec![dead.to_string_lossy().into_owned()]
        );
        assert!(live.exists() && plain.exists() && other.exists() && stray.exists());
        assert_eq!(
            gc_fd_sockets_in(dir.path(), None),
            vec![other.to_string_lossy().into_owned()]
        );
        assert!(live.exists() && stray.exists());
    }
}
