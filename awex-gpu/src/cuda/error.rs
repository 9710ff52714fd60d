//! Errors of the CUDA data path, written for the person at the terminal.

use awex_core::dtype::DType;
use awex_core::layout::copy::CopyError;

/// Why a CUDA operation of awex failed.
#[derive(Debug, Clone, thiserror::Error, PartialEq, Eq)]
pub enum CudaError {
    /// This build of awex has no CUDA support compiled in.
    #[error("awex was built without CUDA; rebuild with `--features cuda`")]
    NotBuilt,
    /// libcuda could not be loaded (no NVIDIA driver on this machine).
    #[error(
        "no CUDA driver found: libcuda could not be loaded ({detail}); install the NVIDIA driver or run on a machine with a GPU"
    )]
    NoDriver {
        /// what was tried
        detail: String,
    },
    /// The driver is there but too old for the CUDA 13.0 entry points awex uses.
    #[error(
        "the CUDA driver lacks `{symbol}`; install a newer NVIDIA driver (awex uses the CUDA 13.0 driver API)"
    )]
    OldDriver {
        /// the missing entry point
        symbol: &'static str,
    },
    /// The driver loaded but sees no GPU.
    #[error("no GPU: the CUDA driver loaded but reports no device ({detail})")]
    NoGpu {
        /// what the driver said
        detail: String,
    },
    /// A device ordinal beyond the devices the driver reports.
    #[error("no GPU {ordinal}: this machine has {count} GPU(s), ordinals 0..{count}")]
    NoSuchDevice {
        /// the ordinal asked for
        ordinal: u32,
        /// devices present
        count: u32,
    },
    /// A driver call returned an error.
    #[error("{call} failed: {name} ({code}): {message}")]
    Driver {
        /// the driver entry point
        call: &'static str,
        /// the CUresult number
        code: u32,
        /// the CUresult name
        name: String,
        /// the driver's description
        message: String,
    },
    /// The transfer converts dtypes in a way the device path does not.
    #[error(
        "`{tensor}`: this transfer converts {src} to {dst}, which the GPU transports do not (they convert bf16 and f16 to and from f32); keep both sides in the same dtype, or use a CPU transport (shm, tcp)"
    )]
    Conversion {
        /// destination tensor
        tensor: String,
        /// source dtype
        src: DType,
        /// destination dtype
        dst: DType,
    },
    /// The transfer's box does not fit its tensors.
    #[error("`{tensor}`: {detail}")]
    Box {
        /// destination tensor
        tensor: String,
        /// the geometry error
        detail: String,
    },
    /// A pointer that no exported allocation contains.
    #[error("device pointer {ptr:#x} lies in no exported allocation")]
    UnknownPointer {
        /// the pointer
        ptr: u64,
    },
    /// A planned tensor that the process holding it does not have.
    #[error("{holder} has no tensor `{tensor}` (the plan and the memory disagree)")]
    MissingTensor {
        /// who should hold it
        holder: String,
        /// the tensor
        tensor: String,
    },
    /// An allocation index that the import does not have.
    #[error("IPC import has {count} allocation(s); allocation {index} does not exist")]
    NoSuchAllocation {
        /// the index asked for
        index: usize,
        /// allocations present
        count: usize,
    },
    /// A range that runs past the end of its allocation or buffer.
    #[error("range of {len} bytes at offset {offset} runs past the end of {what} ({size} bytes)")]
    OutOfRange {
        /// what was addressed
        what: &'static str,
        /// offset in bytes
        offset: u64,
        /// length in bytes
        len: u64,
        /// size of the allocation or buffer
        size: u64,
    },
    /// An IPC handle that is not 64 bytes of hex.
    #[error("bad IPC handle `{0}`: expected 128 hex digits (64 bytes)")]
    BadHandle(String),
    /// The driver refused one copy descriptor.
    #[error("copy {desc} failed: {detail}")]
    Copy {
        /// the descriptor, as `CopyDesc { .. }`
        desc: String,
        /// the driver's error
        detail: String,
    },
    /// The driver would not give an IPC handle for an allocation behind a training tensor, and
    /// the memory is not mapped with `cuMemMap` either.
    #[error(
        "the allocation at {base:#x} ({size} bytes) behind a training tensor cannot be shared through CUDA IPC: {detail}. \
         awex shares memory from cuMemAlloc (PyTorch's default caching allocator) through legacy IPC handles and memory \
         mapped with cuMemMap (PyTorch's expandable segments, PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True) through \
         file descriptors; this is neither: allocate the training tensors with one of those, or use the nccl transport"
    )]
    Export {
        /// the allocation's first address
        base: u64,
        /// its size
        size: u64,
        /// the driver's error
        detail: String,
    },
    /// A physical allocation behind a training tensor (memory mapped with `cuMemMap`) cannot be
    /// exported as a POSIX file descriptor.
    #[error(
        "the cuMemCreate allocation at {base:#x} ({size} bytes) behind a training tensor cannot be exported as a POSIX \
         file descriptor: {detail}. awex shares such memory (PyTorch's expandable segments) through file descriptors, so \
         it must be created with CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR among its handle types (PyTorch takes fabric \
         handles instead where the system supports them): turn expandable segments off in the training process, or use \
         the nccl transport"
    )]
    ExportFd {
        /// the mapping's first address
        base: u64,
        /// its size
        size: u64,
        /// the driver's error
        detail: String,
    },
    /// A training tensor lies over `cuMemMap` mappings with a hole between them.
    #[error(
        "the training tensor at {ptr:#x} ({len} bytes) lies over cuMemMap mappings that are not contiguous (a hole at {hole:#x})"
    )]
    NotContiguous {
        /// the tensor's first address
        ptr: u64,
        /// its length
        len: u64,
        /// the first address no mapping covers
        hole: u64,
    },
    /// A file descriptor of the training process could not be taken.
    #[error(
        "could not take file descriptor {fd} of training process {pid} (pidfd_getfd): {detail}. Sharing memory mapped with \
         cuMemMap (PyTorch's expandable segments) needs this process to be allowed to trace the training process: the \
         same user, and kernel.yama.ptrace_scope 0 or CAP_SYS_PTRACE; otherwise turn expandable segments off in the \
         training process, or use the nccl transport"
    )]
    FetchFd {
        /// the training process
        pid: u32,
        /// its file descriptor
        fd: i32,
        /// what the kernel answered
        detail: String,
    },
    /// Handing file descriptors over a Unix socket failed.
    #[error("passing file descriptors: {what}: {detail}")]
    FdPass {
        /// the step
        what: String,
        /// what went wrong
        detail: String,
    },
    /// A published list of shared mappings that does not fit its allocation.
    #[error("bad shared mapping list for an allocation of {size} bytes: {why}")]
    BadChunks {
        /// the allocation's size
        size: u64,
        /// what is wrong
        why: String,
    },
    /// A copy engine asked to run with no streams.
    #[error("a copy engine needs at least one stream; {0} given")]
    Streams(usize),
    /// A block-FP8 quantisation the GPU kernel cannot run as asked.
    #[error("FP8 block quantisation on the GPU: {0}")]
    Fp8(String),
    /// Blocks of a GPU quantisation held infinity or NaN (they were left unwritten).
    #[error(
        "FP8 block quantisation on the GPU: {blocks} block(s) hold infinity or NaN; awex quantises finite weights only"
    )]
    Fp8NonFinite {
        /// how many blocks
        blocks: u32,
    },
    /// A delta frame the GPU wire kernels cannot encode or decode as asked, or a malformed one.
    #[error("delta frame on the GPU: {0}")]
    DeltaWire(String),
}

impl CudaError {
    /// The error of a transfer whose box does not fit its tensors.
    pub(crate) fn geometry(tensor: &str, source: CopyError) -> Self {
        CudaError::Box {
            tensor: tensor.to_string(),
            detail: source.to_string(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_refused_export_names_the_allocation_the_driver_and_the_way_out() {
        let e = CudaError::Export {
            base: 0x7f00_0000_0000,
            size: 2 << 20,
            detail: "cuIpcGetMemHandle failed: CUDA_ERROR_INVALID_VALUE (1): invalid argument"
                .into(),
        };
        let m = e.to_string();
        assert!(
            m.starts_with("the allocation at 0x7f0000000000 (2097152 bytes) behind a training tensor cannot be shared through CUDA IPC: cuIpcGetMemHandle failed: CUDA_ERROR_INVALID_VALUE (1): invalid argument. awex shares memory from cuMemAlloc"),
            "{m}"
        );
        assert!(
            m.contains("PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"),
            "{m}"
        );
        assert!(m.ends_with("or use the nccl transport"), "{m}");
        assert!(
            !m.contains("  "),
            "no doubled spaces from the line breaks: {m}"
        );
    }

    #[test]
    fn the_fd_errors_name_the_allocation_or_the_process_and_the_way_out() {
        let e = CudaError::ExportFd {
            base: 0x2a_0000_0000,
            size: 20 << 20,
            detail: "cuMemExportToShareableHandle failed: CUDA_ERROR_INVALID_VALUE (1)".into(),
        };
        let m = e.to_string();
        assert!(m.starts_with("the cuMemCreate allocation at 0x2a00000000 (20971520 bytes) behind a training tensor cannot be exported as a POSIX file descriptor: cuMemExportToShareableHandle failed"), "{m}");
        assert!(
            m.contains("CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR"),
            "{m}"
        );
        let e = CudaError::FetchFd {
            pid: 4242,
            fd: 57,
            detail: "Operation not permitted (os error 1)".into(),
        };
        let m = e.to_string();
        assert!(m.starts_with("could not take file descriptor 57 of training process 4242 (pidfd_getfd): Operation not permitted (os error 1)."), "{m}");
        assert!(
            m.contains("kernel.yama.ptrace_scope 0 or CAP_SYS_PTRACE"),
            "{m}"
        );
        for m in [
            m,
            CudaError::NotContiguous {
                ptr: 1,
                len: 2,
                hole: 3,
            }
            .to_string(),
        ] {
            assert!(!m.contains("  "), "{m}");
        }
    }
}
