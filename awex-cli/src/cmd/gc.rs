//! `awex-cli gc`: removes the shared-memory segments of awex ranks that died (SIGKILL, OOM)
//! without unlinking them; live segments (their creator still holds the liveness lock) stay.

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
    if a.json {
        println!("{}", serde_json::json!({ "removed": removed }));
    } else if removed.is_empty() {
        println!("no dead awex segments in /dev/shm");
    } else {
        for r in &removed {
            println!("removed /dev/shm/{r}");
        }
        println!(
            "{} removed",
            super::plan::plural(removed.len() as u64, "dead segment")
        );
    }
    Ok(ExitCode::SUCCESS)
}
