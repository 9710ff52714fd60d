//! `awex-cli gc`: removes the shared-memory segments of awex ranks that died (SIGKILL, OOM)
//! without unlinking them; live segments (their creator still holds the liveness lock) stay.
//! Also the descriptor sockets such ranks left in the temp directory (cuda-ipc with memory
//! mapped by `cuMemMap`), where nobody accepts any more.

use std::process::ExitCode;

/// Arguments of `awex-cli gc`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Only this pair's segments (matched exactly); all awex segments without it.
    #[arg(long)]
    pub pair: Option<String>,
    /// Print JSON (`{"removed": [...]}`).
    #[arg(long)]
    pub json: bool,
}

/// Runs the subcommand.
pub fn run(a: Args) -> anyhow::Result<ExitCode> {
    let removed = awex_runtime::shm::gc(a.pair.as_deref());
    let sockets = awex_runtime::shm::gc_fd_sockets(a.pair.as_deref());
    if a.json {
        println!(
            "{}",
            serde_json::json!({ "removed": removed, "removed_sockets": sockets })
        );
    } else if removed.is_empty() && sockets.is_empty() {
        println!("no dead awex segments in /dev/shm");
    } else {
        for r in &removed {
            println!("removed /dev/shm/{r}");
        }
        for s in &sockets {
            println!("removed {s}");
        }
        println!(
            "{} removed",
            super::plan::plural((removed.len() + sockets.len()) as u64, "dead segment")
        );
    }
    Ok(ExitCode::SUCCESS)
}
