//! The runtime's errors: one [`RuntimeError`] with a variant per kind of failure, each
//! carrying the fields that identify it (tensor, segment, peer, setting) and, where another
//! layer failed, that layer's error as its `source`.

use awex_control::client::ClientError;
use awex_core::dims::Dims as Shape;
use awex_core::dtype::DType;
use awex_core::layout::RankId;
use awex_gpu::cuda::CudaError;
use awex_gpu::nccl::NcclError;
use std::time::Duration;

use crate::Location;

/// Why a rank could not execute an update.
#[derive(Debug, thiserror::Error)]
pub enum RuntimeError {
    /// Registered tensors disagree with the rank's layout.
    #[error("layout mismatch: {0}")]
    Layout(Box<LayoutMismatch>),
    /// A tensor view is malformed, missing or in the wrong memory.
    #[error("tensor: {0}")]
    Tensor(#[from] TensorError),
    /// The rank's tensors live where its transport cannot move them.
    #[error(transparent)]
    Placement(#[from] PlacementError),
    /// A setting of this rank disagrees with the pair's.
    #[error("{0}")]
    Config(Box<ConfigMismatch>),
    /// A CUDA call failed; `what` names the operation.
    #[error("{}", cuda_message(.what, .source))]
    Cuda {
        /// the operation (e.g. "opening the tensors' GPU")
        what: String,
        /// the driver's error
        #[source]
        source: CudaError,
    },
    /// NCCL failed (a build without CUDA, loading, communicator, grouped operations).
    #[error("{}", nccl_message(.0))]
    Nccl(#[source] NcclError),
    /// A shared-memory segment failed.
    #[error("shared memory: {0}")]
    Shm(#[from] ShmError),
    /// The transport failed (a peer, the wire, a published table).
    #[error("transport: {0}")]
    Transport(#[from] TransportError),
    /// A gateway call the rank needed failed (the pair kv, a report).
    #[error("{what}: {source}")]
    Gateway {
        /// what the rank asked the gateway for
        what: &'static str,
        /// the client's error
        #[source]
        source: ClientError,
    },
    /// The gateway could not be reached (or forgot the pair) while the rank needed it.
    #[error("{what}: {reason}")]
    GatewayLost {
        /// what the rank asked the gateway for
        what: &'static str,
        /// why it could not be done
        reason: String,
    },
    /// A value the rank must read from the pair kv is not there although every rank joined.
    #[error(
        "pair `{pair}` has no kv `{key}` although every rank has joined (waited {waited:?}); the rank that publishes it once joined (training rank 0 for nccl) must run the same transport"
    )]
    MissingKv {
        /// the pair
        pair: String,
        /// the key
        key: String,
        /// how long the rank waited for it
        waited: Duration,
    },
    /// A value read from the pair kv never verified (a forged, tampered or replayed NCCL id)
    /// within the wait.
    #[error("{cause} (waited {waited:?} for a value that verifies)")]
    UnverifiedKv {
        /// how long the rank waited for a genuine value
        waited: Duration,
        /// why the last value read was refused
        #[source]
        cause: Box<RuntimeError>,
    },
    /// Atomic apply: copying the staged version into the live tensors failed (the live
    /// tensors may hold part of it).
    #[error("copying the staged version {version} into the live tensors failed: {cause}")]
    Apply {
        /// the version
        version: u64,
        /// why
        #[source]
        cause: Box<RuntimeError>,
    },
    /// Filling or checking a version's weights failed (the first mismatch, described).
    #[error("tensor: {detail}")]
    Weights {
        /// the version filled or checked
        version: u64,
        /// the first mismatch
        detail: String,
    },
    /// A bucket's checksum did not match the sender's.
    #[error("bucket {bucket} from training rank {peer} failed its checksum (corrupted in transit)")]
    Checksum {
        /// the sender
        peer: RankId,
        /// bucket index
        bucket: u64,
    },
    /// The update was aborted elsewhere.
    #[error("update {0} was aborted")]
    Aborted(u64),
    /// The update's deadline passed.
    #[error("update {0} missed its deadline")]
    Deadline(u64),
    /// The attempt this rank worked on was already over on the gateway (it failed or a later
    /// attempt started, e.g. while this rank's process was stopped): its part is void.
    #[error(
        "attempt {attempt} of update {version} was already over ({why}); this rank's part of it does not count, and it takes the next attempt from the gateway"
    )]
    AttemptOver {
        /// the version
        version: u64,
        /// the attempt this rank worked on
        attempt: u32,
        /// what the gateway said
        why: String,
    },
    /// A box copy failed.
    #[error(transparent)]
    Copy(#[from] awex_core::layout::copy::CopyError),
    /// Planning failed.
    #[error(transparent)]
    Plan(#[from] awex_core::plan::PlanError),
    /// An FP8 inference rank could not be set up, or an update's weights not quantised (the
    /// message names the tensor).
    #[error("{0}")]
    Fp8(String),
    /// A source tensor holds infinity or NaN (pair option `check_finite`): nothing was sent.
    #[error(
        "`{tensor}` holds {value} at element {element} of this rank's shard; the update is not sent (check_finite is on): fix the training step that produced it"
    )]
    NonFinite {
        /// the tensor
        tensor: String,
        /// its first non-finite element (flat index into the rank's shard)
        element: u64,
        /// what it holds
        value: String,
    },
}

impl From<LayoutMismatch> for RuntimeError {
    fn from(e: LayoutMismatch) -> Self {
        RuntimeError::Layout(Box::new(e))
    }
}

impl From<ConfigMismatch> for RuntimeError {
    fn from(e: ConfigMismatch) -> Self {
        RuntimeError::Config(Box::new(e))
    }
}

impl From<NcclError> for RuntimeError {
    fn from(e: NcclError) -> Self {
        match e {
            NcclError::Cancelled(v) => RuntimeError::Aborted(v),
            e => RuntimeError::Nccl(e),
        }
    }
}

/// A build without CUDA says so alone; NCCL's own failures are the transport's.
fn nccl_message(e: &NcclError) -> String {
    match e {
        NcclError::NeedsCuda => e.to_string(),
        e => format!("transport: {e}"),
    }
}

/// Setup problems (no CUDA build, no driver, no GPU, a transfer the device path cannot do)
/// keep their own message; the rest name the operation.
fn cuda_message(what: &str, e: &CudaError) -> String {
    match e {
        CudaError::NotBuilt
        | CudaError::NoDriver { .. }
        | CudaError::NoGpu { .. }
        | CudaError::OldDriver { .. }
        | CudaError::NoSuchDevice { .. }
        | CudaError::Conversion { .. } => e.to_string(),
        e => format!("{what}: {e}"),
    }
}

/// Registered tensors that disagree with the rank's layout.
#[derive(Debug, thiserror::Error)]
pub enum LayoutMismatch {
    /// A tensor of the layout was not registered.
    #[error(
        "rank {rank} must register `{tensor}` (shape {shape}, {dtype}), but it was not registered"
    )]
    Missing {
        /// the rank
        rank: RankId,
        /// the tensor
        tensor: String,
        /// its shape in the layout
        shape: Shape,
        /// its dtype in the layout
        dtype: DType,
    },
    /// A registered tensor has another shape than the layout's.
    #[error("`{tensor}` has shape {got} but rank {rank}'s layout needs {expected}")]
    Shape {
        /// the tensor
        tensor: String,
        /// the rank
        rank: RankId,
        /// the layout's shape
        expected: Shape,
        /// the registered shape
        got: Shape,
    },
    /// A registered tensor has another dtype than the layout's.
    #[error("`{tensor}` is {got} but rank {rank}'s layout needs {expected}")]
    DType {
        /// the tensor
        tensor: String,
        /// the rank
        rank: RankId,
        /// the layout's dtype
        expected: DType,
        /// the registered dtype
        got: DType,
    },
    /// A registered tensor is not in the layout.
    #[error("`{tensor}` is not a tensor of rank {rank}'s layout")]
    Extra {
        /// the tensor
        tensor: String,
        /// the rank
        rank: RankId,
    },
    /// A side's layout could not be built.
    #[error(transparent)]
    Side(#[from] awex_core::backend::SideError),
}

/// A malformed, missing or misplaced tensor view.
#[derive(Debug, thiserror::Error)]
pub enum TensorError {
    /// A tensor the plan moves is not registered on this side.
    #[error("{side} tensor `{name}` is not registered")]
    NotRegistered {
        /// "source" or "destination"
        side: &'static str,
        /// the tensor
        name: String,
    },
    /// A view's byte length disagrees with its shape and dtype.
    #[error("`{name}`: {len} bytes given but shape {shape} of {dtype} needs {want}")]
    Size {
        /// the tensor
        name: String,
        /// bytes given
        len: usize,
        /// its shape
        shape: Shape,
        /// its dtype
        dtype: DType,
        /// bytes the shape needs
        want: usize,
    },
    /// A non-empty view with a null pointer.
    #[error("`{name}`: null data pointer")]
    NullPointer {
        /// the tensor
        name: String,
    },
    /// A host-only operation was asked of a device view.
    #[error(
        "`{name}` lives in {location}; this operation reads host memory only: copy the tensor to a host TensorSet first (TensorSet::download_to) or use the cuda-ipc transport"
    )]
    HostOnly {
        /// the tensor
        name: String,
        /// where it lives
        location: Location,
    },
    /// The same name registered twice.
    #[error("`{name}` is registered twice")]
    Twice {
        /// the tensor
        name: String,
    },
    /// A rank's tensors in more than one place.
    #[error(
        "`{first}` lives in {first_location} but `{other}` in {other_location}; register every tensor of a rank in one place"
    )]
    MixedLocations {
        /// the first tensor
        first: String,
        /// where it lives
        first_location: Location,
        /// a tensor elsewhere
        other: String,
        /// where that one lives
        other_location: Location,
    },
    /// The host staging set lacks a device tensor.
    #[error("the host staging set has no tensor `{name}`")]
    NoStagingCopy {
        /// the tensor
        name: String,
    },
    /// Staging was asked for a tensor that is not in GPU memory.
    #[error("`{name}` lives in {location}; only tensors in GPU memory are staged through the host")]
    NotStaged {
        /// the tensor
        name: String,
        /// where it lives
        location: Location,
    },
    /// A staging copy in device memory.
    #[error(
        "the staging copy of `{name}` lives in {location}; it must be host memory (TensorSet::host_mirror)"
    )]
    StagingOnDevice {
        /// the tensor
        name: String,
        /// where the copy lives
        location: Location,
    },
    /// A staging copy of another size.
    #[error("`{name}` holds {device} bytes on the GPU but {host} in the host staging set")]
    StagingSize {
        /// the tensor
        name: String,
        /// bytes on the GPU
        device: usize,
        /// bytes in the staging set
        host: usize,
    },
    /// Atomic apply: a live tensor and its staging copy differ in size or place.
    #[error(
        "`{name}` holds {live} bytes in {live_location} but its staging copy {staging} bytes in {staging_location}"
    )]
    StagingMismatch {
        /// the tensor
        name: String,
        /// its live size
        live: usize,
        /// where the live tensor is
        live_location: Location,
        /// its staging copy's size
        staging: usize,
        /// where the staging copy is
        staging_location: Location,
    },
    /// The shared-memory mirror has no room for a tensor.
    #[error("`{name}` has no place in the mirror")]
    NotMirrored {
        /// the tensor
        name: String,
    },
}

/// Tensors in memory the chosen transport cannot move.
#[derive(Debug, thiserror::Error)]
pub enum PlacementError {
    /// A host transport was given device tensors.
    #[error(
        "{transport} reads and writes host memory, but `{name}` lives in {location}; use the cuda-ipc transport for tensors in GPU memory"
    )]
    DeviceTensor {
        /// the transport (or operation) that needs host memory
        transport: String,
        /// the tensor
        name: String,
        /// where it lives
        location: Location,
    },
    /// A GPU was asked of host tensors.
    #[error(
        "these tensors live in host memory, not on a GPU; allocate them with TensorSet::allocate_cuda or register device views (TensorView::new_cuda)"
    )]
    NotOnGpu,
    /// A cuda-ipc rank with host tensors.
    #[error(
        "the cuda-ipc transport moves tensors in GPU memory, but this rank's tensors live in host memory; allocate them with TensorSet::allocate_cuda or register device views, or use the shm or tcp transport"
    )]
    HostTensors,
    /// One tensor of a device set is not on the GPU.
    #[error("`{name}` does not live on the GPU")]
    NotDevice {
        /// the tensor
        name: String,
    },
    /// A shm training rank whose tensors are not in awex shared memory.
    #[error(
        "the shm transport needs the training rank's tensors in awex shared memory (TensorSet::allocate_shm); use tcp for tensors allocated elsewhere"
    )]
    NotShared,
    /// A tensor outside the rank's shared-memory segment.
    #[error("tensor `{name}` does not live in the rank's shared-memory segment")]
    OutsideSegment {
        /// the tensor
        name: String,
    },
}

/// A setting of this rank that disagrees with the pair's (or with itself).
#[derive(Debug, thiserror::Error)]
pub enum ConfigMismatch {
    /// A setting differs from the pair's.
    #[error("pair `{pair}` {field} {expected} but this rank was started with {got}{hint}")]
    Pair {
        /// the pair
        pair: String,
        /// the setting, phrased as the pair's ("uses transport", "moves buckets of")
        field: &'static str,
        /// the pair's value
        expected: String,
        /// this rank's value
        got: String,
        /// how to fix it ("" or "; ...")
        hint: &'static str,
    },
    /// The pair was connected again since this rank was configured.
    #[error(
        "pair `{pair}` was connected again (connect uid {got} instead of {expected}); restart this rank"
    )]
    Reconnected {
        /// the pair
        pair: String,
        /// the uid this rank was configured with
        expected: String,
        /// the pair's uid now
        got: String,
    },
    /// The transport built is not the one configured.
    #[error("this rank was configured for transport {configured} but built a {built} transport")]
    BuiltTransport {
        /// configured
        configured: awex_core::Transport,
        /// built
        built: awex_core::Transport,
    },
    /// A pair whose transport needs the pair secret, without one in the join answer.
    #[error(
        "the gateway's join answer for pair `{pair}` carries no pair secret; the {transport} transport {} (upgrade the gateway)",
        .transport.pair_secret_use().unwrap_or("needs it")
    )]
    NoSecret {
        /// the pair
        pair: String,
        /// the transport that needs it
        transport: awex_core::Transport,
    },
    /// A transport that writes the live tensors directly was asked to apply a staged version.
    #[error(
        "the {transport} transport writes the live tensors directly; it has nothing staged to apply"
    )]
    NothingStaged {
        /// the transport
        transport: awex_core::Transport,
    },
}

/// A shared-memory segment that could not be created, opened or used.
#[derive(Debug, thiserror::Error)]
pub enum ShmError {
    /// A system call on a segment failed.
    #[error("{op} `/dev/shm/{name}`: {source}")]
    Os {
        /// the call ("create", "open", "map", ...)
        op: &'static str,
        /// the segment
        name: String,
        /// the system's error
        #[source]
        source: std::io::Error,
    },
    /// A name awex does not create.
    #[error("bad shared-memory name `{name}`: must start with `{prefix}` and use [A-Za-z0-9._-]")]
    BadName {
        /// the name
        name: String,
        /// the prefix every awex segment carries
        prefix: &'static str,
    },
    /// A sweeper kept removing the segment while it was being created.
    #[error("`/dev/shm/{name}` was removed while it was being created, three times")]
    Vanished {
        /// the segment
        name: String,
    },
    /// The control tables' size overflows.
    #[error("the shm control tables overflow")]
    TablesOverflow,
}

/// A transport failure: a peer, the wire, or what a peer published.
#[derive(Debug, thiserror::Error)]
pub enum TransportError {
    /// A wait on a peer ran out.
    #[error("{what}: timed out after {:.1} s waiting for {peer}", .after.as_secs_f64())]
    PeerTimedOut {
        /// what was waited for
        what: String,
        /// the peer
        peer: String,
        /// how long it waited
        after: Duration,
    },
    /// An I/O call to a peer failed.
    #[error("{what}: {peer} failed: {source}")]
    PeerFailed {
        /// what was being done
        what: String,
        /// the peer
        peer: String,
        /// the system's error
        #[source]
        source: std::io::Error,
    },
    /// A training rank's stream ended before the first frame of this version: its sender gave
    /// it up (and opens a fresh one), nothing of this version was read from it.
    #[error(
        "training rank {peer} closed its stream before sending anything of version {version} (it gave this rank up in an earlier version), and opened no fresh one"
    )]
    GivenUpStream {
        /// the training rank
        peer: RankId,
        /// the version being received
        version: u64,
    },
    /// A peer closed the connection.
    #[error("{what}: {peer} closed the connection")]
    PeerClosed {
        /// what was being done
        what: String,
        /// the peer
        peer: String,
    },
    /// A local I/O call failed.
    #[error("{what}: {source}")]
    Io {
        /// what was being done
        what: String,
        /// the system's error
        #[source]
        source: std::io::Error,
    },
    /// The deadline passed while waiting on the network.
    #[error("deadline passed during network I/O")]
    DeadlinePassed,
    /// An inference rank published no address.
    #[error("inference rank {peer} published no tcp address")]
    NoAddress {
        /// the peer
        peer: RankId,
    },
    /// An address resolves to nothing.
    #[error("{addr} resolves to nothing")]
    Unresolvable {
        /// the address
        addr: String,
    },
    /// The tcp transport was not given the pair's secret.
    #[error(
        "the tcp transport has no pair secret (it comes with the gateway's join answer; is the gateway older than this rank?)"
    )]
    NoSecret,
    /// A peer failed the pair-secret proof.
    #[error("{addr} does not hold pair `{pair}`'s secret: it is not inference rank {peer}")]
    NotAuthenticated {
        /// the address connected to
        addr: String,
        /// the pair
        pair: String,
        /// the rank expected there
        peer: RankId,
    },
    /// A training rank never connected to this inference rank.
    #[error("training rank {peer} never connected ({cause}){refusals}")]
    NeverConnected {
        /// the peer
        peer: RankId,
        /// why the wait ended
        #[source]
        cause: Box<RuntimeError>,
        /// the connections this rank refused meanwhile (`""` for none; else how many and the
        /// last one's peer and reason, after `; `)
        refusals: String,
    },
    /// A connection broke while buckets were queued for it.
    #[error("connection to {peer} broke")]
    Broken {
        /// the peer
        peer: RankId,
    },
    /// A sender thread stopped early.
    #[error("sender stopped")]
    SenderStopped,
    /// A lock was poisoned by a panicking thread.
    #[error("poisoned")]
    Poisoned,
    /// A thread of the transport panicked.
    #[error("{0} panicked")]
    Panicked(&'static str),
    /// The blocking execution task failed.
    #[error("execution task failed: {0}")]
    Task(#[source] tokio::task::JoinError),
    /// The rank's transport unwound in a panic of an earlier update (or apply); the rank
    /// cannot move bytes any more.
    #[error(
        "this rank's transport was lost when an earlier update panicked in it; restart the rank"
    )]
    Lost,
    /// The transport was used after closing.
    #[error("{0} is closed")]
    Closed(&'static str),
    /// A bucket buffer too small for the bucket.
    #[error("bucket buffer of {cap} bytes is too small")]
    BufferTooSmall {
        /// its capacity
        cap: usize,
    },
    /// A delta that cannot be applied (malformed, or against a version this rank does not hold).
    #[error("delta update: {0}")]
    Delta(String),
    /// A pair option this transport does not implement (the message names the alternatives).
    #[error("{0}")]
    Unsupported(String),
    /// A bucket shorter than its plan.
    #[error("bucket of {len} bytes is shorter than its plan")]
    ShortBucket {
        /// the bytes received
        len: usize,
    },
    /// More buckets than planned.
    #[error("training rank {peer} sent too many buckets")]
    TooManyBuckets {
        /// the sender
        peer: RankId,
    },
    /// A bucket header other than the one expected next.
    #[error(
        "{what}: expected bucket {index} of version {version} ({bytes} bytes), got bucket {got_bucket} of version {got_version} ({got_bytes} bytes)"
    )]
    UnexpectedBucket {
        /// what was being read
        what: String,
        /// the bucket expected
        index: usize,
        /// the version expected
        version: u64,
        /// its size
        bytes: u64,
        /// the bucket received
        got_bucket: u64,
        /// its version
        got_version: u64,
        /// its size
        got_bytes: u64,
    },
    /// A training rank's rendezvous value lacks a field.
    #[error("training rank {peer} published no {transport} `{field}`{suffix} (rendezvous {info})")]
    NoRendezvous {
        /// the peer
        peer: RankId,
        /// the transport
        transport: &'static str,
        /// the missing field
        field: String,
        /// " segment" where the field names one
        suffix: &'static str,
        /// the value published
        info: String,
    },
    /// A segment that is not an awex shm control segment.
    #[error("shm segment `{name}` of training rank {peer} is not an awex control segment")]
    NotShmControl {
        /// the segment
        name: String,
        /// the peer
        peer: RankId,
    },
    /// A segment that is not an awex cuda-ipc control segment.
    #[error("shared-memory segment `{name}` is not an awex cuda-ipc control segment ({why})")]
    NotIpcControl {
        /// the segment
        name: String,
        /// what is wrong with it
        why: &'static str,
    },
    /// Peers with different bucket sizes.
    #[error(
        "training rank {peer} uses buckets of {theirs} bytes, this rank {ours} (every rank must use the pair's bucket_mib)"
    )]
    BucketSize {
        /// the peer
        peer: RankId,
        /// its bucket size
        theirs: u64,
        /// this rank's
        ours: u64,
    },
    /// A peer's tensor table outside its control segment.
    #[error("training rank {peer}'s tensor table is outside its control segment")]
    TableOutside {
        /// the peer
        peer: RankId,
    },
    /// A peer lists a tensor outside its data segment.
    #[error("training rank {peer} lists a tensor outside its segment")]
    TensorOutside {
        /// the peer
        peer: RankId,
    },
    /// A peer has no plan for this rank.
    #[error("training rank {peer} has no plan for inference rank {me} (plans disagree)")]
    NoPlanFor {
        /// the peer
        peer: RankId,
        /// this rank
        me: RankId,
    },
    /// A peer cuts the transfers into other buckets than this rank.
    #[error(
        "training rank {peer} cuts its transfers to inference rank {me} into {theirs} buckets (checksums {sums_at}..), this rank into {ours} of {sums} checksums (bucket sizes or plans disagree)"
    )]
    BucketCount {
        /// the peer
        peer: RankId,
        /// this rank
        me: RankId,
        /// the peer's bucket count
        theirs: u64,
        /// where its checksums start
        sums_at: u64,
        /// this rank's bucket count
        ours: u64,
        /// checksums the peer publishes
        sums: u64,
    },
    /// The checksum table is smaller than the plan.
    #[error("checksum table too small")]
    ChecksumTable,
    /// A checksum index beyond the published ones.
    #[error(
        "checksum {index} lies outside the {sums} the training rank publishes (plans disagree)"
    )]
    ChecksumOutside {
        /// the index
        index: u64,
        /// checksums published
        sums: usize,
    },
    /// A peer publishes no checksum for a bucket.
    #[error("training rank {peer} has no checksum for bucket {bucket}")]
    NoChecksum {
        /// the peer
        peer: RankId,
        /// the bucket
        bucket: usize,
    },
    /// A peer does not share a tensor the plan reads.
    #[error("training rank {peer} does not share tensor `{tensor}`")]
    Unshared {
        /// the peer
        peer: RankId,
        /// the tensor
        tensor: String,
    },
    /// A peer withdrew the version mid-read.
    #[error("training rank {peer} withdrew version {version} while it was being read")]
    Withdrawn {
        /// the peer
        peer: RankId,
        /// the version
        version: u64,
    },
    /// A peer's IPC event could not be parsed.
    #[error("training rank {peer}'s event: {source}")]
    Event {
        /// the peer
        peer: RankId,
        /// the parse error
        #[source]
        source: CudaError,
    },
    /// A GPU transport was used without its host staging set.
    #[error("no host staging set")]
    NoStaging,
    /// A CUDA call of the transport failed.
    #[error("{}", cuda_message(.what, .source))]
    Cuda {
        /// the operation
        what: String,
        /// the driver's error
        #[source]
        source: CudaError,
    },
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Errors travel in every `Result` of the hot path: the rare, large ones are boxed.
    #[test]
    fn the_error_stays_small() {
        assert!(
            size_of::<RuntimeError>() <= 112,
            "{}",
            size_of::<RuntimeError>()
        );
    }

    #[test]
    fn sources_are_kept() {
        use std::error::Error;
        let e = RuntimeError::from(ShmError::Os {
            op: "cannot open",
            name: "awex-x".into(),
            source: std::io::Error::from_raw_os_error(2),
        });
        assert_eq!(
            e.to_string(),
            format!(
                "shared memory: cannot open `/dev/shm/awex-x`: {}",
                std::io::Error::from_raw_os_error(2)
            )
        );
        let inner = e.source().and_then(|s| s.source());
        assert!(
            inner.is_some_and(|s| s.downcast_ref::<std::io::Error>().is_some()),
            "{inner:?}"
        );
        let e = RuntimeError::from(TransportError::PeerTimedOut {
            what: "receive from training rank t0".into(),
            peer: "127.0.0.1:1".into(),
            after: Duration::from_millis(2500),
        });
        assert_eq!(
            e.to_string(),
            "transport: receive from training rank t0: timed out after 2.5 s waiting for 127.0.0.1:1"
        );
        let e = RuntimeError::from(ConfigMismatch::Pair {
            pair: "p".into(),
            field: "uses transport",
            expected: "tcp".into(),
            got: "shm".into(),
            hint: "",
        });
        assert_eq!(
            e.to_string(),
            "pair `p` uses transport tcp but this rank was started with shm"
        );
    }
}
