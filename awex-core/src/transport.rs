//! The transports awex can move bytes over: one name for the whole project (command line, wire,
//! runtime). The plan is the same for all of them.

use serde::{Deserialize, Serialize};
use std::fmt;
use std::str::FromStr;

/// How the bytes move between the two sides (the plan is the same for all).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Transport {
    /// Shared memory, same host, CPU.
    Shm,
    /// TCP, multi-host, CPU.
    Tcp,
    /// CUDA IPC handles, same host, GPU.
    CudaIpc,
    /// NCCL send/recv, separate GPUs.
    Nccl,
}

/// Where a transport's bytes live while they move: what memory its ranks' tensors must be in.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Memory {
    /// Host memory (the CPU transports).
    Host,
    /// GPU memory (the CUDA transports).
    Gpu,
}

/// Where a transport converts a transfer whose two sides hold different dtypes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Conversion {
    /// The sender converts on the host while it packs a bucket.
    SenderHost,
    /// The receiving GPU converts as it writes: bf16 and f16 to and from f32 (others refused).
    ReceiverGpu,
    /// The sending GPU converts as it packs a bucket: bf16 and f16 to and from f32 (others
    /// refused).
    SenderGpu,
    /// Nowhere: the transport copies bytes only and refuses a plan that converts.
    Refused,
}

// Every property below is one exhaustive `match` without a catch-all arm: a new transport does
// not compile until it answers each of them (docs/architecture.md, "Adding a transport").
impl Transport {
    /// Every transport, in the order the help text lists them.
    pub const ALL: [Transport; 4] = [
        Transport::Shm,
        Transport::Tcp,
        Transport::CudaIpc,
        Transport::Nccl,
    ];

    /// The wire and command-line name (`cuda-ipc`).
    pub fn as_str(self) -> &'static str {
        match self {
            Transport::Shm => "shm",
            Transport::Tcp => "tcp",
            Transport::CudaIpc => "cuda-ipc",
            Transport::Nccl => "nccl",
        }
    }

    /// Which memory the ranks' tensors must be in.
    pub fn memory(self) -> Memory {
        match self {
            Transport::Shm | Transport::Tcp => Memory::Host,
            Transport::CudaIpc | Transport::Nccl => Memory::Gpu,
        }
    }

    /// Whether the transport moves GPU memory ([`Transport::memory`] is [`Memory::Gpu`]).
    pub fn on_gpu(self) -> bool {
        self.memory() == Memory::Gpu
    }

    /// Whether both sides must run on one host (one node): the receivers map the senders'
    /// memory rather than receive it over a network.
    pub fn same_host_only(self) -> bool {
        match self {
            Transport::Shm | Transport::CudaIpc => true,
            Transport::Tcp | Transport::Nccl => false,
        }
    }

    /// What the transport does with the pair's data-plane secret from the join answer (`None`:
    /// it needs none), as a phrase for messages ("authenticates its peers with it").
    pub fn pair_secret_use(self) -> Option<&'static str> {
        match self {
            Transport::Tcp => Some("authenticates its peers with it"),
            Transport::Nccl => Some("seals its communicator id with it"),
            Transport::Shm | Transport::CudaIpc => None,
        }
    }

    /// Whether the transport needs the pair's data-plane secret ([`Transport::pair_secret_use`]).
    pub fn needs_pair_secret(self) -> bool {
        self.pair_secret_use().is_some()
    }

    /// Whether the transport's ranks create POSIX shared-memory segments on their host (data or
    /// control segments, which a killed rank leaves behind for the next one to reclaim).
    pub fn uses_shm_segments(self) -> bool {
        match self {
            Transport::Shm | Transport::CudaIpc => true,
            Transport::Tcp | Transport::Nccl => false,
        }
    }

    /// Whether a training rank sends out of a shared-memory copy of its tensors that the
    /// receivers read in place (rather than out of the tensors themselves).
    pub fn sends_from_shared_memory(self) -> bool {
        match self {
            Transport::Shm => true,
            Transport::Tcp | Transport::CudaIpc | Transport::Nccl => false,
        }
    }

    /// Whether a training rank and an inference rank may share one GPU (colocated placement).
    pub fn shares_a_gpu(self) -> bool {
        match self {
            Transport::CudaIpc => true,
            // NCCL cannot connect two ranks of one communicator on one GPU; the CPU
            // transports use no GPU
            Transport::Nccl | Transport::Shm | Transport::Tcp => false,
        }
    }

    /// Whether the transport's senders quantise the FP8 blocks they hold whole, so that the
    /// wire carries e4m3 bytes and scales for them (`plan::EncodeAt::Sender`). `false`: the
    /// receiver quantises every block from the canonical dtype. A transport opts in here once
    /// its runtime sends and writes sender-encoded transfers.
    pub fn encodes_fp8_on_sender(self) -> bool {
        match self {
            // shm: the receiver quantises each whole block as it reads it from the sender's
            // shared memory (and the sender as it checksums); tcp: the sender as it packs;
            // nccl: the training GPU as it packs a bucket into its staging slot (a block that
            // no one sender holds whole is refused there)
            Transport::Shm | Transport::Tcp | Transport::Nccl => true,
            // cuda-ipc: the receiver quantises its bf16 staging on the GPU
            Transport::CudaIpc => false,
        }
    }

    /// Where a transfer between different dtypes is converted, if anywhere.
    pub fn conversion(self) -> Conversion {
        match self {
            Transport::Shm | Transport::Tcp => Conversion::SenderHost,
            Transport::CudaIpc => Conversion::ReceiverGpu,
            Transport::Nccl => Conversion::SenderGpu,
        }
    }
}

impl fmt::Display for Transport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for Transport {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "shm" => Ok(Transport::Shm),
            "tcp" => Ok(Transport::Tcp),
            "cuda-ipc" | "cuda_ipc" | "ipc" => Ok(Transport::CudaIpc),
            "nccl" => Ok(Transport::Nccl),
            _ => Err(format!(
                "unknown transport `{s}`; expected one of {}",
                Transport::ALL.map(Transport::as_str).join(", ")
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_transport_parses_from_its_own_name_and_unknown_names_list_them_all() {
        for t in Transport::ALL {
            assert_eq!(t.as_str().parse::<Transport>(), Ok(t));
            assert_eq!(t.to_string(), t.as_str());
        }
        assert_eq!(
            "rdma".parse::<Transport>(),
            Err("unknown transport `rdma`; expected one of shm, tcp, cuda-ipc, nccl".to_string())
        );
    }

    #[test]
    fn properties_describe_each_transport() {
        use Transport::*;
        let row = |t: Transport| {
            (
                t.on_gpu(),
                t.same_host_only(),
                t.needs_pair_secret(),
                t.uses_shm_segments(),
                t.sends_from_shared_memory(),
                t.shares_a_gpu(),
                t.conversion(),
            )
        };
        assert_eq!(
            row(Shm),
            (
                false,
                true,
                false,
                true,
                true,
                false,
                Conversion::SenderHost
            )
        );
        assert_eq!(
            row(Tcp),
            (
                false,
                false,
                true,
                false,
                false,
                false,
                Conversion::SenderHost
            )
        );
        assert_eq!(
            row(CudaIpc),
            (
                true,
                true,
                false,
                true,
                false,
                true,
                Conversion::ReceiverGpu
            )
        );
        assert_eq!(
            row(Nccl),
            (
                true,
                false,
                true,
                false,
                false,
                false,
                Conversion::SenderGpu
            )
        );
    }
}
