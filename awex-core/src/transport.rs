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

impl Transport {
    /// The wire and command-line name (`cuda-ipc`).
    pub fn as_str(self) -> &'static str {
        match self {
            Transport::Shm => "shm",
            Transport::Tcp => "tcp",
            Transport::CudaIpc => "cuda-ipc",
            Transport::Nccl => "nccl",
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
                "unknown transport `{s}`; expected one of shm, tcp, cuda-ipc, nccl"
            )),
        }
    }
}
