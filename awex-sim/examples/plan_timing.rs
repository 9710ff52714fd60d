//! Times the planner on one pair and prints every rank's fingerprint digest.
//!
//! `cargo run --release -p awex-sim --example plan_timing -- moe-1t megatron:tp=8,pp=8,dp=16,ep=32,etp=1 sglang:tp=16,ep=16,engines=8`
//!
//! Arguments: model, training spec, inference spec, repetitions, mode (`all`, `one`, `each`),
//! the rank timed (`E/N`), and the threads a plan may take (`Pair::plan_rank_on`; default:
//! what `Pair::plan_rank` takes).

use awex_core::backend::side_layout;
use awex_core::layout::{RankId, Side};
use awex_core::plan::Pair;
use awex_core::{BackendSpec, Catalogue, ModelSpec};
use std::time::Instant;

fn main() -> anyhow::Result<()> {
    std::hint::black_box((
        awex_megatron::CRATE,
        awex_sglang::CRATE,
        awex_fsdp::CRATE,
        awex_vllm::CRATE,
    ));
    let a: Vec<String> = std::env::args().skip(1).collect();
    let get = |i: usize, d: &str| a.get(i).cloned().unwrap_or_else(|| d.to_string());
    let model = ModelSpec::resolve(&get(0, "moe-1t"))?;
    let cat = Catalogue::of(&model);
    let ts: BackendSpec = get(1, "megatron:tp=8,pp=8,dp=16,ep=32,etp=1").parse()?;
    let is: BackendSpec = get(2, "sglang:tp=16,ep=16,engines=8").parse()?;
    let reps: usize = get(3, "5").parse()?;
    let mode = get(4, "all");
    let all = mode == "all";
    let rank = match get(5, "0/0").split_once('/') {
        Some((e, r)) => RankId::infer(e.parse()?, r.parse()?),
        None => anyhow::bail!("rank as E/N"),
    };
    let threads: usize = match a.get(6) {
        Some(t) => t.parse()?,
        None => std::thread::available_parallelism()
            .map_or(1, |n| n.get())
            .min(awex_core::plan::PLAN_THREADS),
    };
    let training = side_layout(Side::Training, &ts, &model)?;
    let inference = side_layout(Side::Inference, &is, &model)?;
    let pair = Pair {
        catalogue: &cat,
        training: &*training,
        inference: &*inference,
        encode_on_sender: false,
    };
    let mut best = f64::MAX;
    let mut make = f64::MAX;
    let mut fp = 0;
    let mut made = 0;
    let mut faults = Vec::new();
    for _ in 0..reps {
        let f0 = minor_faults();
        let t0 = Instant::now();
        let p = pair.plan_rank_on(Side::Inference, rank, threads)?;
        best = best.min(t0.elapsed().as_secs_f64() * 1e3);
        faults.push(minor_faults().zip(f0).map(|(a, b)| a - b));
        fp = p.fingerprint;
        // what a transport pays at connect: every transfer made as a `Transfer` value
        let t1 = Instant::now();
        made = p.peers.iter().map(|q| q.transfers.as_slice().len()).sum();
        make = make.min(t1.elapsed().as_secs_f64() * 1e3);
    }
    if mode == "each" {
        let mut v = Vec::new();
        for r in inference.ranks() {
            let t0 = Instant::now();
            let p = pair.plan_rank(Side::Inference, r)?;
            v.push((
                t0.elapsed().as_secs_f64() * 1e3,
                r,
                p.peers.len(),
                p.transfers(),
            ));
        }
        v.sort_by(|a, b| b.0.total_cmp(&a.0));
        for x in v.iter().take(8) {
            println!(
                "{:.2} ms infer:{} {} peers {} transfers",
                x.0, x.1, x.2, x.3
            );
        }
    }
    println!(
        "infer:{rank} best of {reps}: {best:.2} ms on {threads} thread(s), fingerprint {fp:016x}"
    );
    println!("  its {made} transfers made as Transfer values: best {make:.2} ms");
    // (a page touched for the first time costs a fault: microseconds in a VM)
    if let Some(f) = faults
        .iter()
        .map(|f| f.map(|n| n.to_string()))
        .collect::<Option<Vec<_>>>()
    {
        println!(
            "  minor page faults while planning, per repetition: {}",
            f.join(" ")
        );
    }
    if all {
        let mut h = xxhash_rust::xxh3::Xxh3::new();
        let t0 = Instant::now();
        for (side, l) in [(Side::Training, &training), (Side::Inference, &inference)] {
            for r in l.ranks() {
                let p = pair.plan_rank(side, r)?;
                h.update(&p.fingerprint.to_le_bytes());
            }
        }
        println!(
            "all ranks: {:.0} ms, digest of rank fingerprints {:016x}",
            t0.elapsed().as_secs_f64() * 1e3,
            h.digest()
        );
    }
    Ok(())
}

/// The process's minor page faults so far (`/proc/self/stat`, Linux; `None` elsewhere).
fn minor_faults() -> Option<u64> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    // the fields after the command name (which may hold spaces), from field 3; minflt is 10
    stat.rsplit_once(')')?
        .1
        .split_whitespace()
        .nth(7)?
        .parse()
        .ok()
}
