//! awex-sim: an update's predicted time on a stated cluster, from awex's own plans.
//!
//! Every rank's real plan ([`awex_core::plan`]) is executed the way its transport executes it
//! ([`exec`]) over a flow-level model of the cluster's links ([`net`], [`topology`]). The
//! result ([`report::Report`]) is a prediction: the model is calibrated on the runs this
//! project could measure (`data/calibration.toml`), not on large clusters.

#![warn(missing_docs)]

pub mod buckets;
pub mod calibration;
#[cfg(feature = "cli")]
pub mod cli;
pub mod exec;
pub mod net;
pub mod report;
pub mod topology;

use awex_core::plan::Pair;
use exec::{Options, Plans};
use report::{Report, SimFigures};
use std::time::Instant;
use topology::Topology;

/// Why a simulation cannot run.
#[derive(Debug, thiserror::Error)]
pub enum SimError {
    /// The topology is malformed or cannot hold the pair.
    #[error("topology: {0}")]
    Topology(String),
    /// A rank cannot be planned.
    #[error("plan: {0}")]
    Plan(String),
    /// The request does not fit the transport or the topology.
    #[error("{0}")]
    Usage(String),
}

impl From<awex_core::plan::PlanError> for SimError {
    fn from(e: awex_core::plan::PlanError) -> Self {
        SimError::Plan(e.to_string())
    }
}

/// Names shown in the report.
#[derive(Clone, Debug, Default)]
pub struct Names {
    /// Model.
    pub model: String,
    /// Training spec.
    pub training: String,
    /// Inference spec.
    pub inference: String,
}

/// Plans the pair and simulates its update on `topo`.
pub fn simulate(
    pair: &Pair<'_>,
    names: &Names,
    topo: &Topology,
    opts: &Options,
) -> Result<Report, SimError> {
    topo.check()?;
    let plans = exec::plan_all(pair, opts.threads)?;
    simulate_plans(&plans, names, topo, opts)
}

/// Simulates the update of already planned pairs on `topo`.
pub fn simulate_plans(
    plans: &Plans,
    names: &Names,
    topo: &Topology,
    opts: &Options,
) -> Result<Report, SimError> {
    let t0 = Instant::now();
    let built = exec::build(plans, topo, opts)?;
    let build_s = t0.elapsed().as_secs_f64();
    // the bound before running: every flow's bytes on its links
    let g = &built.graph;
    let t1 = Instant::now();
    let bound_hint = {
        // a quick pass: the run reports exact link bytes; the hint only sizes bins and quantum
        let mut bytes = vec![0f64; g.links().len()];
        let mut any = false;
        for_each_flow(g, |links, b| {
            for l in links {
                if l != net::NONE {
                    bytes[l as usize] += b;
                    any = true;
                }
            }
        });
        let _ = any;
        g.links()
            .iter()
            .zip(&bytes)
            .map(|(l, b)| if l.cap > 0.0 { b / l.cap } else { 0.0 })
            .fold(0.0, f64::max)
    };
    let quantum_s = opts.quantum * bound_hint;
    let st = exec::run(&built, quantum_s, bound_hint);
    let run_s = t1.elapsed().as_secs_f64();
    let transfer_s = st.finish[built.done as usize];
    let all = report::link_reports(g.links(), &st, transfer_s);
    let busiest = all.first().cloned();
    let lower_bound_s = busiest.as_ref().map_or(0.0, |b| b.bound_s);
    let classes = report::class_reports(&all);
    let timeline = report::timeline(g.links(), &st, transfer_s, &all);
    let mut egress = vec![0u64; plans.training.len()];
    let mut ingress = vec![0u64; plans.inference.len()];
    for p in &plans.pairs {
        egress[p.t as usize] += p.bytes;
        ingress[p.i as usize] += p.bytes;
    }
    let max_over_mean = |v: &[u64]| {
        let sending: Vec<u64> = v.iter().copied().filter(|&b| b > 0).collect();
        let mean = sending.iter().sum::<u64>() as f64 / sending.len().max(1) as f64;
        if mean > 0.0 {
            *sending.iter().max().unwrap_or(&0) as f64 / mean
        } else {
            0.0
        }
    };
    let plan_bottleneck = busiest.as_ref().is_some_and(|b| {
        b.class.ends_with("-out")
            && classes
                .iter()
                .find(|c| c.class == b.class)
                .is_some_and(|c| b.bytes as f64 > 1.1 * c.mean_bytes)
    });
    let control_s = topo.control_ms * 1e-3;
    Ok(Report {
        failed_engines: Vec::new(),
        joining_engines: Vec::new(),
        model: names.model.clone(),
        training: names.training.clone(),
        inference: names.inference.clone(),
        topology: topo.name.clone(),
        placement: topo.placement.to_string(),
        transport: built.transport.to_string(),
        bucket_bytes: opts.bucket_bytes,
        peer_order: opts.peers.as_str().to_string(),
        training_ranks: plans.training.len(),
        inference_ranks: plans.inference.len(),
        nodes: built.nodes,
        pairs: plans.pairs.len(),
        transfers: plans.pairs.iter().map(|p| p.transfers.len() as u64).sum(),
        moved_bytes: plans.pairs.iter().map(|p| p.bytes).sum(),
        predicted_s: transfer_s + control_s,
        transfer_s,
        control_s,
        lower_bound_s,
        ratio_to_bound: if lower_bound_s > 0.0 {
            transfer_s / lower_bound_s
        } else {
            0.0
        },
        busiest_link: busiest,
        egress_max_over_mean: max_over_mean(&egress),
        ingress_max_over_mean: max_over_mean(&ingress),
        plan_bottleneck,
        classes,
        links: all.into_iter().take(16).collect(),
        timeline,
        sim: SimFigures {
            shape: built.shape.clone(),
            solves: st.solves,
            events: st.events,
            plan_s: plans.plan_s,
            build_s,
            run_s,
            quantum_s,
        },
        fp8: report::Fp8Wire::of(plans.pairs.iter().flat_map(|p| p.transfers.iter_owned())).map(
            |mut f| {
                f.encoding = "fp8".into();
                f
            },
        ),
        delta: None,
    })
}

fn for_each_flow(g: &net::Graph, f: impl FnMut([u32; 2], f64)) {
    g.for_each_flow(f)
}
