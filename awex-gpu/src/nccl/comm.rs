//! One rank's NCCL communicator: non-blocking init with a deadline, grouped point-to-point
//! operations, and teardown that never hangs.
//!
//! The communicator is created non-blocking (`ncclConfig_t.blocking = 0`), so init and
//! `ncclGroupEnd` return at once and their progress is polled with `ncclCommGetAsyncError`,
//! between checks of a deadline and of a stop condition. Any failure or timeout aborts the
//! communicator (`ncclCommAbort`), so that no rank waits forever on a peer that is gone;
//! later calls say it was aborted and why. A communicator is used by one thread at a time.

use super::NcclError;
use super::ffi::{self, NcclResult, RawComm, RawStream};
use super::library::Library;
use super::schedule::OpKind;
use super::uid::UniqueId;
use std::ffi::{c_int, c_void};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// One point-to-point operation of a group.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct P2p {
    /// Send or receive.
    pub kind: OpKind,
    /// Device address of the bytes.
    pub addr: u64,
    /// Byte count.
    pub bytes: u64,
    /// The peer's communicator rank.
    pub peer: u32,
}

/// An initialised communicator of one rank.
pub struct Communicator {
    lib: Arc<Library>,
    raw: RawComm,
    rank: u32,
    nranks: u32,
    aborted: Option<String>,
}

// SAFETY: the handle is only used through `&mut self` or by one thread at a time (NCCL allows a
// communicator to move between threads); the library is immutable.
unsafe impl Send for Communicator {}

impl std::fmt::Debug for Communicator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Communicator(rank {} of {})", self.rank, self.nranks)
    }
}

/// Sleeps a little longer each time, from microseconds up to a millisecond.
struct Backoff(Duration);

impl Backoff {
    fn new() -> Self {
        Backoff(Duration::from_micros(2))
    }

    fn pause(&mut self) {
        std::thread::sleep(self.0);
        self.0 = (self.0 * 2).min(Duration::from_millis(1));
    }
}

impl Communicator {
    /// Joins the communicator `uid` of `nranks` ranks as `rank`, on the CUDA device current on
    /// this thread, waiting at most `timeout` for every rank; aborts it on failure or timeout.
    pub fn init(
        lib: Arc<Library>,
        uid: &UniqueId,
        nranks: u32,
        rank: u32,
        timeout: Duration,
    ) -> Result<Communicator, NcclError> {
        if rank >= nranks || nranks > i32::MAX as u32 {
            return Err(NcclError::NoSuchCommRank { rank, nranks });
        }
        let deadline = Instant::now() + timeout;
        let mut raw: RawComm = std::ptr::null_mut();
        let mut config = ffi::RawConfig::new(false);
        // SAFETY: every argument is valid for the call; `config` outlives it (NCCL copies it).
        let r = unsafe {
            (lib.api().comm_init_rank_config)(
                &mut raw,
                nranks as c_int,
                uid.to_raw(),
                rank as c_int,
                &mut config,
            )
        };
        let mut comm = Communicator {
            lib,
            raw,
            rank,
            nranks,
            aborted: None,
        };
        if r != ffi::SUCCESS && r != ffi::IN_PROGRESS {
            let e = comm.error("ncclCommInitRankConfig", r);
            comm.abort(&e.to_string());
            return Err(e);
        }
        if comm.raw.is_null() {
            return Err(comm.error("ncclCommInitRankConfig", ffi::SUCCESS));
        }
        comm.wait("ncclCommInitRankConfig", &mut || {
            (Instant::now() >= deadline).then_some(NcclError::InitTimeout {
                rank,
                nranks,
                waited: timeout,
            })
        })?;
        Ok(comm)
    }

    /// This rank in the communicator.
    pub fn rank(&self) -> u32 {
        self.rank
    }

    /// Ranks in the communicator.
    pub fn nranks(&self) -> u32 {
        self.nranks
    }

    /// Why the communicator was aborted, if it was.
    pub fn aborted(&self) -> Option<&str> {
        self.aborted.as_deref()
    }

    fn error(&self, call: &'static str, code: NcclResult) -> NcclError {
        NcclError::Call {
            call,
            code,
            name: ffi::result_name(code),
            message: if code == ffi::SUCCESS {
                "returned no communicator".to_string()
            } else {
                self.lib.describe(code, self.raw)
            },
        }
    }

    fn alive(&self) -> Result<RawComm, NcclError> {
        match &self.aborted {
            Some(why) => Err(NcclError::Aborted(why.clone())),
            None if self.raw.is_null() => {
                Err(NcclError::Aborted("it was already destroyed".to_string()))
            }
            None => Ok(self.raw),
        }
    }

    /// The communicator's state: `ncclSuccess`, `ncclInProgress`, or the error it hit.
    pub fn state(&self) -> Result<NcclResult, NcclError> {
        let raw = self.alive()?;
        let mut state: NcclResult = ffi::SUCCESS;
        // SAFETY: a live communicator; NCCL writes one result.
        let r = unsafe { (self.lib.api().comm_get_async_error)(raw, &mut state) };
        if r != ffi::SUCCESS {
            return Err(self.error("ncclCommGetAsyncError", r));
        }
        Ok(state)
    }

    /// Polls until the last call has finished; aborts on its failure or when `stop` says so.
    fn wait(
        &mut self,
        call: &'static str,
        stop: &mut dyn FnMut() -> Option<NcclError>,
    ) -> Result<(), NcclError> {
        let mut backoff = Backoff::new();
        loop {
            let e = match self.state() {
                Ok(ffi::SUCCESS) => return Ok(()),
                Ok(ffi::IN_PROGRESS) => match stop() {
                    None => {
                        backoff.pause();
                        continue;
                    }
                    Some(e) => e,
                },
                Ok(code) => self.error(call, code),
                Err(e) => e,
            };
            self.abort(&e.to_string());
            return Err(e);
        }
    }

    /// Checks, without waiting, that no operation has failed; aborts if one has.
    pub fn check(&mut self) -> Result<(), NcclError> {
        match self.state() {
            Ok(ffi::SUCCESS | ffi::IN_PROGRESS) => Ok(()),
            Ok(code) => {
                let e = self.error("ncclCommGetAsyncError", code);
                self.abort(&e.to_string());
                Err(e)
            }
            Err(e) => {
                self.abort(&e.to_string());
                Err(e)
            }
        }
    }

    /// Issues `ops` as one `ncclGroupStart..End` group on `stream` and waits until NCCL has
    /// taken them (not until they complete on the device); aborts on failure or when `stop`
    /// says so.
    ///
    /// # Safety
    /// `stream` must be a CUDA stream of the communicator's device, and every op's
    /// `[addr, addr + bytes)` device memory on that device that stays allocated, unread
    /// (receives) or unwritten (sends) by anyone else until the stream has run the group.
    pub unsafe fn group(
        &mut self,
        ops: &[P2p],
        stream: RawStream,
        stop: &mut dyn FnMut() -> Option<NcclError>,
    ) -> Result<(), NcclError> {
        let raw = self.alive()?;
        let api = *self.lib.api();
        // SAFETY: plain call.
        let r = unsafe { (api.group_start)() };
        if r != ffi::SUCCESS {
            let e = self.error("ncclGroupStart", r);
            self.abort(&e.to_string());
            return Err(e);
        }
        let mut first: Option<NcclError> = None;
        for op in ops {
            let count = usize::try_from(op.bytes).unwrap_or(usize::MAX);
            let peer = op.peer as c_int;
            // SAFETY: the caller guarantees the addresses and the stream (see `# Safety`).
            let r = unsafe {
                match op.kind {
                    OpKind::Send => (api.send)(
                        op.addr as *const c_void,
                        count,
                        ffi::UINT8,
                        peer,
                        raw,
                        stream,
                    ),
                    OpKind::Recv => {
                        (api.recv)(op.addr as *mut c_void, count, ffi::UINT8, peer, raw, stream)
                    }
                }
            };
            if r != ffi::SUCCESS && r != ffi::IN_PROGRESS && first.is_none() {
                let call = match op.kind {
                    OpKind::Send => "ncclSend",
                    OpKind::Recv => "ncclRecv",
                };
                first = Some(self.error(call, r));
            }
        }
        // the group is always closed, even after a failed op
        // SAFETY: plain call.
        let r = unsafe { (api.group_end)() };
        if first.is_none() && r != ffi::SUCCESS && r != ffi::IN_PROGRESS {
            first = Some(self.error("ncclGroupEnd", r));
        }
        if let Some(e) = first {
            self.abort(&e.to_string());
            return Err(e);
        }
        self.wait("ncclGroupEnd", stop)
    }

    /// Aborts the communicator: in-flight operations end, resources are freed, and later calls
    /// fail with `why`. Does nothing if it is already gone.
    pub fn abort(&mut self, why: &str) {
        if self.aborted.is_none() {
            self.aborted = Some(why.to_string());
        }
        if self.raw.is_null() {
            return;
        }
        // SAFETY: a communicator not yet destroyed; abort is valid in any state.
        let _ = unsafe { (self.lib.api().comm_abort)(self.raw) };
        self.raw = std::ptr::null_mut();
    }

    /// Tears the communicator down: flushes (`ncclCommFinalize`, when the library has it) for at
    /// most `timeout`, then destroys; aborts instead when the flush fails or times out. A
    /// communicator aborted earlier has nothing left to free.
    pub fn destroy(mut self, timeout: Duration) -> Result<(), NcclError> {
        let raw = self.raw;
        if raw.is_null() {
            return Ok(());
        }
        let api = *self.lib.api();
        if let Some(finalize) = api.comm_finalize {
            // SAFETY: a live communicator.
            let r = unsafe { finalize(raw) };
            if r != ffi::SUCCESS && r != ffi::IN_PROGRESS {
                let e = self.error("ncclCommFinalize", r);
                self.abort(&e.to_string());
                return Err(e);
            }
            let deadline = Instant::now() + timeout;
            self.wait("ncclCommFinalize", &mut || {
                (Instant::now() >= deadline).then(|| {
                    NcclError::Aborted(format!(
                        "ncclCommFinalize did not finish within {timeout:?}"
                    ))
                })
            })?;
        }
        // SAFETY: a live communicator, destroyed once; the handle is cleared right after.
        let r = unsafe { (api.comm_destroy)(raw) };
        if r != ffi::SUCCESS && r != ffi::IN_PROGRESS {
            let e = self.error("ncclCommDestroy", r);
            self.abort(&e.to_string());
            return Err(e);
        }
        self.raw = std::ptr::null_mut();
        Ok(())
    }
}

impl Drop for Communicator {
    fn drop(&mut self) {
        // a communicator dropped without `destroy` (an error path) is aborted: never a hang
        self.abort("it was dropped");
    }
}
