//! Loading libnccl at run time: which file, which version, which entry points.
//!
//! awex never links NCCL. It opens the first of `$AWEX_NCCL_LIBRARY`, `libnccl.so.2` (the
//! only name PyTorch's `nvidia-nccl` wheels ship; found through the library path, or already
//! loaded in the process by torch) and `libnccl.so`, asks the library for its version, refuses
//! anything older than 2.19, and resolves every entry point it calls up front, so that a
//! missing one is an error at load time, never a crash mid-update.

use super::NcclError;
use super::ffi::{self, NcclResult, RawComm};
use super::uid::UniqueId;
use std::ffi::{CStr, OsStr, OsString, c_int, c_void};
use std::fmt;

/// The environment variable naming the NCCL library to load first.
pub const LIBRARY_ENV: &str = "AWEX_NCCL_LIBRARY";

/// Library names tried after `$AWEX_NCCL_LIBRARY`, in order.
pub const FALLBACK_NAMES: [&str; 2] = ["libnccl.so.2", "libnccl.so"];

/// An NCCL release.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct NcclVersion {
    /// Major version.
    pub major: u32,
    /// Minor version.
    pub minor: u32,
    /// Patch level.
    pub patch: u32,
}

impl NcclVersion {
    /// The oldest NCCL awex loads (stable non-blocking init, abort and finalize).
    pub const MIN: NcclVersion = NcclVersion {
        major: 2,
        minor: 19,
        patch: 0,
    };

    /// Decodes `ncclGetVersion`'s integer: `major*10000 + minor*100 + patch` from 2.9 on,
    /// `major*1000 + minor*100 + patch` before.
    pub fn from_code(code: i32) -> NcclVersion {
        let c = code.max(0) as u32;
        if c >= 10000 {
            NcclVersion {
                major: c / 10000,
                minor: (c % 10000) / 100,
                patch: c % 100,
            }
        } else {
            NcclVersion {
                major: c / 1000,
                minor: (c % 1000) / 100,
                patch: c % 100,
            }
        }
    }
}

impl fmt::Display for NcclVersion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}.{}", self.major, self.minor, self.patch)
    }
}

/// The libraries [`Library::load`] tries, in order: `env` (the value of `$AWEX_NCCL_LIBRARY`)
/// when set and not empty, then [`FALLBACK_NAMES`].
pub fn candidates(env: Option<OsString>) -> Vec<OsString> {
    let mut out: Vec<OsString> = env.filter(|v| !v.is_empty()).into_iter().collect();
    out.extend(FALLBACK_NAMES.iter().map(OsString::from));
    out
}

/// The entry points awex calls, resolved once.
#[derive(Clone, Copy)]
pub(crate) struct Api {
    pub(crate) get_unique_id: ffi::GetUniqueId,
    pub(crate) comm_init_rank_config: ffi::CommInitRankConfig,
    pub(crate) comm_get_async_error: ffi::CommGetAsyncError,
    pub(crate) comm_abort: ffi::CommOp,
    pub(crate) comm_destroy: ffi::CommOp,
    pub(crate) comm_finalize: Option<ffi::CommOp>,
    pub(crate) send: ffi::Send,
    pub(crate) recv: ffi::Recv,
    pub(crate) group_start: ffi::Group,
    pub(crate) group_end: ffi::Group,
    pub(crate) get_error_string: ffi::GetErrorString,
    pub(crate) get_last_error: Option<ffi::GetLastError>,
}

/// A loaded NCCL library of version 2.19 or newer, with every entry point awex calls.
pub struct Library {
    api: Api,
    path: String,
    version: NcclVersion,
    // last: the entry points above point into it
    _lib: libloading::Library,
}

impl fmt::Debug for Library {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Library(NCCL {} at {})", self.version, self.path)
    }
}

fn display(p: &OsStr) -> String {
    p.to_string_lossy().into_owned()
}

/// The loader's reason, without the path it repeats.
fn open_reason(path: &str, e: &libloading::Error) -> String {
    let s = e.to_string();
    s.strip_prefix(path)
        .and_then(|r| r.strip_prefix(": "))
        .map(str::to_string)
        .unwrap_or(s)
}

/// The file a symbol of a loaded library comes from.
fn file_of(addr: *const c_void) -> Option<String> {
    // SAFETY: dladdr only reads the loader's tables; `info` is plain data it fills in.
    let mut info: libc::Dl_info = unsafe { std::mem::zeroed() };
    // SAFETY: as above; a non-zero return means `dli_fname` points to a valid C string.
    if unsafe { libc::dladdr(addr, &mut info) } == 0 || info.dli_fname.is_null() {
        return None;
    }
    // SAFETY: checked non-null; owned by the loader for the library's lifetime.
    let name = unsafe { CStr::from_ptr(info.dli_fname) };
    Some(name.to_string_lossy().into_owned())
}

impl Library {
    /// Loads the first NCCL of `preferred` (the caller's choice, `$AWEX_NCCL_LIBRARY` for the
    /// binary and the Python package), `libnccl.so.2`, `libnccl.so`.
    pub fn load(preferred: Option<&OsStr>) -> Result<Library, NcclError> {
        Self::load_first(&candidates(preferred.map(OsStr::to_os_string)))
    }

    /// Loads NCCL from one path (or library name).
    pub fn load_from(path: impl AsRef<OsStr>) -> Result<Library, NcclError> {
        Self::load_first(&[path.as_ref().to_os_string()])
    }

    /// Loads the first of `candidates` that opens. A library that opens but is too old or
    /// incomplete is an error at once: it is what the machine has, and the message says so.
    pub fn load_first(candidates: &[OsString]) -> Result<Library, NcclError> {
        let mut tried = Vec::new();
        for c in candidates {
            let label = display(c);
            // SAFETY: opening runs the library's initialisers; NCCL's only set up its own state.
            match unsafe { libloading::Library::new(c) } {
                Ok(lib) => return Self::resolve(lib, label),
                Err(e) => {
                    let why = open_reason(&label, &e);
                    tried.push((label, why));
                }
            }
        }
        Err(NcclError::NotFound { tried })
    }

    fn resolve(lib: libloading::Library, label: String) -> Result<Library, NcclError> {
        // SAFETY: the symbol is looked up with the type nccl.h declares for it.
        let get_version: ffi::GetVersion = match unsafe { lib.get(b"ncclGetVersion\0") } {
            Ok(s) => *s,
            Err(_) => {
                return Err(NcclError::MissingSymbol {
                    path: label,
                    symbol: "ncclGetVersion",
                });
            }
        };
        let path = file_of(get_version as *const c_void).unwrap_or(label);
        let mut code: c_int = 0;
        // SAFETY: ncclGetVersion writes one int.
        let r = unsafe { get_version(&mut code) };
        if r != ffi::SUCCESS {
            return Err(NcclError::Call {
                call: "ncclGetVersion",
                code: r,
                name: ffi::result_name(r),
                message: format!("the library at {path} could not report its version"),
            });
        }
        let version = NcclVersion::from_code(code);
        if version < NcclVersion::MIN {
            return Err(NcclError::TooOld {
                found: version,
                path,
            });
        }
        macro_rules! required {
            ($name:literal) => {
                // SAFETY: looked up with the type nccl.h declares; kept alive with `lib`.
                match unsafe { lib.get(concat!($name, "\0").as_bytes()) } {
                    Ok(s) => *s,
                    Err(_) => {
                        return Err(NcclError::MissingSymbol {
                            path,
                            symbol: $name,
                        });
                    }
                }
            };
        }
        macro_rules! optional {
            ($name:literal) => {
                // SAFETY: as above.
                unsafe { lib.get(concat!($name, "\0").as_bytes()) }
                    .ok()
                    .map(|s| *s)
            };
        }
        let api = Api {
            get_unique_id: required!("ncclGetUniqueId"),
            comm_init_rank_config: required!("ncclCommInitRankConfig"),
            comm_get_async_error: required!("ncclCommGetAsyncError"),
            comm_abort: required!("ncclCommAbort"),
            comm_destroy: required!("ncclCommDestroy"),
            comm_finalize: optional!("ncclCommFinalize"),
            send: required!("ncclSend"),
            recv: required!("ncclRecv"),
            group_start: required!("ncclGroupStart"),
            group_end: required!("ncclGroupEnd"),
            get_error_string: required!("ncclGetErrorString"),
            get_last_error: optional!("ncclGetLastError"),
        };
        Ok(Library {
            api,
            path,
            version,
            _lib: lib,
        })
    }

    /// The version the library reports.
    pub fn version(&self) -> NcclVersion {
        self.version
    }

    /// The file the library was loaded from.
    pub fn path(&self) -> &str {
        &self.path
    }

    /// Whether the library has `ncclCommFinalize` (teardown flushes before destroying).
    pub fn has_finalize(&self) -> bool {
        self.api.comm_finalize.is_some()
    }

    pub(crate) fn api(&self) -> &Api {
        &self.api
    }

    /// A fresh unique id for a new communicator (made by one rank, shared with the others).
    pub fn unique_id(&self) -> Result<UniqueId, NcclError> {
        let mut raw = ffi::RawUniqueId {
            internal: [0; ffi::UNIQUE_ID_BYTES],
        };
        // SAFETY: ncclGetUniqueId fills the 128-byte struct.
        let r = unsafe { (self.api.get_unique_id)(&mut raw) };
        self.check("ncclGetUniqueId", r, std::ptr::null_mut())?;
        Ok(UniqueId::from_raw(&raw))
    }

    /// NCCL's description of a result code, with the communicator's last error when known.
    pub(crate) fn describe(&self, code: NcclResult, comm: RawComm) -> String {
        // SAFETY: ncclGetErrorString returns a static string (or null) for any code.
        let p = unsafe { (self.api.get_error_string)(code) };
        let mut msg = if p.is_null() {
            String::new()
        } else {
            // SAFETY: non-null, a static C string owned by NCCL.
            unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
        };
        if let Some(last) = self.api.get_last_error {
            // SAFETY: ncclGetLastError accepts any communicator, null included.
            let p = unsafe { last(comm) };
            if !p.is_null() {
                // SAFETY: non-null, a C string owned by NCCL.
                let s = unsafe { CStr::from_ptr(p) }.to_string_lossy();
                let s = s.trim();
                if !s.is_empty() && s != msg {
                    msg = if msg.is_empty() {
                        s.to_string()
                    } else {
                        format!("{msg}; {s}")
                    };
                }
            }
        }
        msg
    }

    /// `Ok` for `ncclSuccess`, else the call's error with NCCL's description.
    pub(crate) fn check(
        &self,
        call: &'static str,
        code: NcclResult,
        comm: RawComm,
    ) -> Result<(), NcclError> {
        if code == ffi::SUCCESS {
            return Ok(());
        }
        Err(NcclError::Call {
            call,
            code,
            name: ffi::result_name(code),
            message: self.describe(code, comm),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_decode_both_encodings() {
        let v = |a, b, c| NcclVersion {
            major: a,
            minor: b,
            patch: c,
        };
        assert_eq!(NcclVersion::from_code(21903), v(2, 19, 3));
        assert_eq!(NcclVersion::from_code(21803), v(2, 18, 3));
        assert_eq!(NcclVersion::from_code(22703), v(2, 27, 3));
        assert_eq!(NcclVersion::from_code(2804), v(2, 8, 4));
        assert_eq!(NcclVersion::from_code(30001), v(3, 0, 1));
        assert_eq!(NcclVersion::from_code(21903).to_string(), "2.19.3");
        assert!(v(2, 18, 99) < NcclVersion::MIN);
        assert!(v(2, 19, 0) >= NcclVersion::MIN);
        assert!(v(2, 8, 4) < NcclVersion::MIN);
    }

    #[test]
    fn candidates_put_the_environment_first() {
        assert_eq!(
            candidates(Some("/opt/nccl/libnccl.so.2".into())),
            vec![
                OsString::from("/opt/nccl/libnccl.so.2"),
                "libnccl.so.2".into(),
                "libnccl.so".into()
            ]
        );
        assert_eq!(
            candidates(None),
            vec![OsString::from("libnccl.so.2"), "libnccl.so".into()]
        );
        assert_eq!(candidates(Some("".into())).len(), 2);
    }
}
