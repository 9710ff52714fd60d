//! Named POSIX shared-memory segments (`/dev/shm/awex-*`), mapped read-write.

use super::RuntimeError;
use std::ffi::CString;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, Ordering};

/// A mapped shared-memory segment; the creator unlinks it on drop.
pub struct ShmSegment {
    name: String,
    ptr: NonNull<u8>,
    len: usize,
    owner: AtomicBool,
}

// SAFETY: the mapping is plain shared memory; synchronisation is the users' job (atomics in the header).
unsafe impl Send for ShmSegment {}
// SAFETY: as above.
unsafe impl Sync for ShmSegment {}

/// Prefix of every segment awex creates (so leaks are easy to find in /dev/shm).
pub const SHM_PREFIX: &str = "awex-";

fn os_err(what: &str, name: &str) -> RuntimeError {
    RuntimeError::Shm(format!(
        "{what} `/dev/shm/{name}`: {}",
        std::io::Error::last_os_error()
    ))
}

fn cname(name: &str) -> Result<CString, RuntimeError> {
    if !name.starts_with(SHM_PREFIX)
        || name.len() > 200
        || !name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
    {
        return Err(RuntimeError::Shm(format!(
            "bad shared-memory name `{name}`: must start with `{SHM_PREFIX}` and use [A-Za-z0-9._-]"
        )));
    }
    CString::new(format!("/{name}")).map_err(|_| RuntimeError::Shm(format!("bad name `{name}`")))
}

impl ShmSegment {
    /// Creates (exclusively) and maps a zero-filled segment of `len` bytes.
    pub fn create(name: &str, len: usize) -> Result<Self, RuntimeError> {
        let c = cname(name)?;
        let len = len.max(1);
        // SAFETY: plain libc calls with a valid C string; every result is checked.
        unsafe {
            let fd = libc::shm_open(
                c.as_ptr(),
                libc::O_CREAT | libc::O_EXCL | libc::O_RDWR,
                0o600,
            );
            if fd < 0 {
                return Err(os_err("cannot create", name));
            }
            if libc::ftruncate(fd, len as libc::off_t) != 0 {
                let e = os_err("cannot size", name);
                libc::close(fd);
                libc::shm_unlink(c.as_ptr());
                return Err(e);
            }
            let seg = Self::map(fd, name, len, true);
            if seg.is_err() {
                libc::shm_unlink(c.as_ptr());
            }
            seg
        }
    }

    /// Opens and maps an existing segment created by another process.
    pub fn open(name: &str) -> Result<Self, RuntimeError> {
        let c = cname(name)?;
        // SAFETY: as in `create`.
        unsafe {
            let fd = libc::shm_open(c.as_ptr(), libc::O_RDWR, 0);
            if fd < 0 {
                return Err(os_err("cannot open", name));
            }
            let mut st: libc::stat = std::mem::zeroed();
            if libc::fstat(fd, &mut st) != 0 {
                let e = os_err("cannot stat", name);
                libc::close(fd);
                return Err(e);
            }
            Self::map(fd, name, st.st_size as usize, false)
        }
    }

    /// # Safety
    /// `fd` must be an open shared-memory descriptor of at least `len` bytes; it is closed here.
    unsafe fn map(fd: i32, name: &str, len: usize, owner: bool) -> Result<Self, RuntimeError> {
        // SAFETY: guaranteed by the caller; the result is checked.
        let p = unsafe {
            let p = libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                if owner {
                    libc::MAP_SHARED
                } else {
                    libc::MAP_SHARED | libc::MAP_POPULATE
                },
                fd,
                0,
            );
            libc::close(fd);
            p
        };
        if p == libc::MAP_FAILED {
            return Err(os_err("cannot map", name));
        }
        Ok(ShmSegment {
            name: name.to_string(),
            ptr: NonNull::new(p as *mut u8).ok_or_else(|| os_err("null map of", name))?,
            len,
            owner: AtomicBool::new(owner),
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

/// Removes segments starting with `prefix` whose creating process (the pid before the last `-`) is gone.
///
/// awex names segments `...-{pid}-{kind}`; a rank killed before it could unlink leaves them behind.
pub fn sweep_dead(prefix: &str) -> Vec<String> {
    let mut removed = Vec::new();
    for name in list_segments(prefix) {
        let mut parts = name.rsplit('-');
        let _kind = parts.next();
        let Some(pid) = parts.next().and_then(|p| p.parse::<u32>().ok()) else {
            continue;
        };
        if std::path::Path::new(&format!("/proc/{pid}")).exists() {
            continue;
        }
        if let Ok(c) = cname(&name) {
            // SAFETY: valid C string.
            if unsafe { libc::shm_unlink(c.as_ptr()) } == 0 {
                removed.push(name);
            }
        }
    }
    removed
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
}
