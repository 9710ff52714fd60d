//! The C types of the NCCL API that awex calls, as `nccl.h` (2.19 and later) defines them.
//!
//! Only what awex needs: the unique id, the opaque communicator, result codes, the byte data
//! type, the communicator configuration (for non-blocking init), and the entry points' types.

use std::ffi::{c_char, c_int, c_uint, c_void};

/// `NCCL_UNIQUE_ID_BYTES`: size of `ncclUniqueId`.
pub const UNIQUE_ID_BYTES: usize = 128;

/// `ncclUniqueId`: 128 opaque bytes (the bootstrap root's address), passed by value.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct RawUniqueId {
    /// The bytes.
    pub internal: [c_char; UNIQUE_ID_BYTES],
}

/// `ncclComm_t`: a pointer to NCCL's opaque communicator.
pub type RawComm = *mut c_void;

/// `cudaStream_t` (the same handle as the driver's `CUstream`).
pub type RawStream = *mut c_void;

/// `ncclResult_t`.
pub type NcclResult = c_int;

/// `ncclSuccess`.
pub const SUCCESS: NcclResult = 0;
/// `ncclInProgress`: a non-blocking call is still running.
pub const IN_PROGRESS: NcclResult = 7;

/// The name of a `ncclResult_t`.
pub fn result_name(code: NcclResult) -> &'static str {
    match code {
        0 => "ncclSuccess",
        1 => "ncclUnhandledCudaError",
        2 => "ncclSystemError",
        3 => "ncclInternalError",
        4 => "ncclInvalidArgument",
        5 => "ncclInvalidUsage",
        6 => "ncclRemoteError",
        7 => "ncclInProgress",
        8 => "ncclTimeout",
        _ => "unknown ncclResult_t",
    }
}

/// `ncclDataType_t`.
pub type DataType = c_int;

/// `ncclUint8`: awex moves bytes, whatever the tensors' element type.
pub const UINT8: DataType = 1;

/// `NCCL_API_MAGIC`, which `NCCL_CONFIG_INITIALIZER` puts in `magic`.
pub const API_MAGIC: c_uint = 0xcafe_beef;

/// `NCCL_CONFIG_UNDEF_INT`: "let NCCL choose".
pub const CONFIG_UNDEF_INT: c_int = c_int::MIN;

/// The NCCL version whose `ncclConfig_t` layout [`RawConfig`] reproduces.
pub const CONFIG_VERSION: c_uint = 21900;

/// `ncclConfig_t` as NCCL 2.19 defines it, the oldest layout awex loads.
///
/// The struct is append-only and versioned: NCCL reads `size` first, copies at most that many
/// bytes over its own defaults, and ignores fields newer than `version`. So this 2.19 prefix is
/// read correctly by every later NCCL, and fields added since keep their defaults.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct RawConfig {
    /// `sizeof` this struct.
    pub size: usize,
    /// [`API_MAGIC`].
    pub magic: c_uint,
    /// [`CONFIG_VERSION`].
    pub version: c_uint,
    /// 0: non-blocking communicator (init and group calls may return `ncclInProgress`).
    pub blocking: c_int,
    /// CGA cluster size.
    pub cga_cluster_size: c_int,
    /// Minimum CTAs.
    pub min_ctas: c_int,
    /// Maximum CTAs.
    pub max_ctas: c_int,
    /// Network name.
    pub net_name: *const c_char,
    /// Share resources with split communicators.
    pub split_share: c_int,
}

impl RawConfig {
    /// `NCCL_CONFIG_INITIALIZER` with `blocking` set.
    pub fn new(blocking: bool) -> Self {
        RawConfig {
            size: std::mem::size_of::<RawConfig>(),
            magic: API_MAGIC,
            version: CONFIG_VERSION,
            blocking: c_int::from(blocking),
            cga_cluster_size: CONFIG_UNDEF_INT,
            min_ctas: CONFIG_UNDEF_INT,
            max_ctas: CONFIG_UNDEF_INT,
            net_name: std::ptr::null(),
            split_share: CONFIG_UNDEF_INT,
        }
    }
}

/// `ncclGetVersion(int*)`.
pub type GetVersion = unsafe extern "C" fn(*mut c_int) -> NcclResult;
/// `ncclGetUniqueId(ncclUniqueId*)`.
pub type GetUniqueId = unsafe extern "C" fn(*mut RawUniqueId) -> NcclResult;
/// `ncclCommInitRankConfig(ncclComm_t*, int nranks, ncclUniqueId, int rank, ncclConfig_t*)`.
pub type CommInitRankConfig =
    unsafe extern "C" fn(*mut RawComm, c_int, RawUniqueId, c_int, *mut RawConfig) -> NcclResult;
/// `ncclCommGetAsyncError(ncclComm_t, ncclResult_t*)`.
pub type CommGetAsyncError = unsafe extern "C" fn(RawComm, *mut NcclResult) -> NcclResult;
/// `ncclCommAbort`, `ncclCommDestroy`, `ncclCommFinalize`.
pub type CommOp = unsafe extern "C" fn(RawComm) -> NcclResult;
/// `ncclSend(const void*, size_t, ncclDataType_t, int peer, ncclComm_t, cudaStream_t)`.
pub type Send =
    unsafe extern "C" fn(*const c_void, usize, DataType, c_int, RawComm, RawStream) -> NcclResult;
/// `ncclRecv(void*, size_t, ncclDataType_t, int peer, ncclComm_t, cudaStream_t)`.
pub type Recv =
    unsafe extern "C" fn(*mut c_void, usize, DataType, c_int, RawComm, RawStream) -> NcclResult;
/// `ncclGroupStart()`, `ncclGroupEnd()`.
pub type Group = unsafe extern "C" fn() -> NcclResult;
/// `ncclGetErrorString(ncclResult_t)`.
pub type GetErrorString = unsafe extern "C" fn(NcclResult) -> *const c_char;
/// `ncclGetLastError(ncclComm_t)`.
pub type GetLastError = unsafe extern "C" fn(RawComm) -> *const c_char;

#[cfg(test)]
mod tests {
    use super::*;
    use std::mem::{offset_of, size_of};

    #[test]
    fn config_matches_the_nccl_2_19_layout() {
        // size_t size; unsigned magic, version; int blocking, cgaClusterSize, minCTAs, maxCTAs;
        // const char* netName; int splitShare; (padded to 8)
        assert_eq!(offset_of!(RawConfig, magic), 8);
        assert_eq!(offset_of!(RawConfig, version), 12);
        assert_eq!(offset_of!(RawConfig, blocking), 16);
        assert_eq!(offset_of!(RawConfig, max_ctas), 28);
        assert_eq!(offset_of!(RawConfig, net_name), 32);
        assert_eq!(offset_of!(RawConfig, split_share), 40);
        assert_eq!(size_of::<RawConfig>(), 48);
        let c = RawConfig::new(false);
        assert_eq!(
            (c.size, c.magic, c.version, c.blocking),
            (48, 0xcafebeef, 21900, 0)
        );
        assert_eq!(c.min_ctas, i32::MIN);
        assert_eq!(size_of::<RawUniqueId>(), 128);
    }

    #[test]
    fn result_codes_have_their_header_names() {
        assert_eq!(result_name(SUCCESS), "ncclSuccess");
        assert_eq!(result_name(IN_PROGRESS), "ncclInProgress");
        assert_eq!(result_name(6), "ncclRemoteError");
        assert_eq!(result_name(42), "unknown ncclResult_t");
    }
}
