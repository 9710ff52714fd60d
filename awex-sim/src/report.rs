//! What a simulation reports: the predicted time, the busiest link and the bound it implies,
//! per-link utilisation, and a picture of utilisation over time.

use crate::exec::Shape;
use crate::net::{BINS, Link, RunStats};
use serde::Serialize;
use std::fmt::Write as _;

/// One link's figures.
#[derive(Clone, Debug, Serialize)]
pub struct LinkReport {
    /// The link.
    pub name: String,
    /// Its class (`nic-out`, `nvlink-in`, `gpu-copy`, ...).
    pub class: String,
    /// Capacity, GB/s.
    pub gbps: f64,
    /// Bytes carried.
    pub bytes: u64,
    /// Its bytes over its bandwidth: no schedule finishes sooner.
    pub bound_s: f64,
    /// Bytes over (capacity x transfer time).
    pub utilisation: f64,
}

/// Figures of one class of links.
#[derive(Clone, Debug, Serialize)]
pub struct ClassReport {
    /// The class.
    pub class: String,
    /// Links of the class that carried bytes.
    pub links: usize,
    /// Bytes of all of them.
    pub bytes: u64,
    /// Most bytes on one link.
    pub max_bytes: u64,
    /// Mean bytes per link.
    pub mean_bytes: f64,
    /// Mean utilisation over the transfer time.
    pub utilisation: f64,
}

/// Utilisation over time of one link or one class (mean over its links).
#[derive(Clone, Debug, Serialize)]
pub struct Series {
    /// Link name or `class (mean of N)`.
    pub name: String,
    /// Utilisation (0..1) of each bin.
    pub util: Vec<f64>,
}

/// Utilisation over time.
#[derive(Clone, Debug, Serialize)]
pub struct Timeline {
    /// Width of a bin, seconds.
    pub bin_s: f64,
    /// Per class.
    pub classes: Vec<Series>,
    /// The busiest links.
    pub links: Vec<Series>,
}

/// Everything a simulation found.
#[derive(Clone, Debug, Serialize)]
pub struct Report {
    /// Model name.
    pub model: String,
    /// Engines left out of the update (`--failed-engines`): their ranks got nothing.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub failed_engines: Vec<u32>,
    /// Engines joining (`--joining-engines`): their ranks took every byte (a full catch-up).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub joining_engines: Vec<u32>,
    /// Training spec.
    pub training: String,
    /// Inference spec.
    pub inference: String,
    /// Topology, in words.
    pub topology: String,
    /// Placement of the ranks.
    pub placement: String,
    /// Transport whose schedule ran.
    pub transport: String,
    /// Staging bucket size (NCCL per-step budget), bytes.
    pub bucket_bytes: u64,
    /// How cuda-ipc receivers take their peers: `concurrent` (the transport's default),
    /// `sequential` (peer after peer) or `interleaved` (a what-if).
    pub peer_order: String,
    /// Training ranks.
    pub training_ranks: usize,
    /// Inference ranks.
    pub inference_ranks: usize,
    /// Nodes used.
    pub nodes: u32,
    /// Peer pairs with transfers.
    pub pairs: usize,
    /// Transfers (after coalescing).
    pub transfers: u64,
    /// Bytes moved.
    pub moved_bytes: u64,
    /// Predicted update time: transfers plus the control plane, seconds. A prediction.
    pub predicted_s: f64,
    /// Predicted time of the transfers alone, seconds.
    pub transfer_s: f64,
    /// The control plane's share (start request to commit), seconds.
    pub control_s: f64,
    /// The busiest link (most bytes over bandwidth).
    pub busiest_link: Option<LinkReport>,
    /// Its bytes over its bandwidth, seconds.
    pub lower_bound_s: f64,
    /// `transfer_s` over `lower_bound_s`.
    pub ratio_to_bound: f64,
    /// Largest over mean bytes sent per training rank (1.0: perfectly balanced egress).
    pub egress_max_over_mean: f64,
    /// Largest over mean bytes received per inference rank.
    pub ingress_max_over_mean: f64,
    /// Whether the plan is the bottleneck: the busiest link is a sender's and carries more than
    /// 1.1 x the mean of its class.
    pub plan_bottleneck: bool,
    /// Per class of link.
    pub classes: Vec<ClassReport>,
    /// The busiest links (at most 16).
    pub links: Vec<LinkReport>,
    /// Utilisation over time.
    pub timeline: Timeline,
    /// The simulation's own figures.
    pub sim: SimFigures,
    /// With an FP8 inference side: the bytes the plans move per encoding.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fp8: Option<Fp8Wire>,
    /// Delta updates (`--delta-density`): what the prediction assumed and added.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub delta: Option<DeltaPrediction>,
}

/// How a delta update was predicted: the flows carry `wire_scale` of their planned bytes, and
/// before them every training rank diffs its shard against its copy of the base.
#[derive(Clone, Debug, Serialize)]
pub struct DeltaPrediction {
    /// The fraction of elements assumed changed.
    pub density: f64,
    /// Bytes of an element on the wire (2: bf16; 1: e4m3 with an FP8 inference side).
    pub element_bytes: usize,
    /// Wire bytes per planned byte.
    pub wire_scale: f64,
    /// Seconds of the busiest training rank's diff and encode pass (reading what it sends and
    /// its copy of the base in bf16, writing the copy), at `encode_rate` bytes per second.
    pub encode_s: f64,
    /// The rate assumed for that pass (an H200's device copy, 4.27 TB/s read+write, on GPU
    /// topologies; a core's memcpy, 8 GB/s, on CPU ones).
    pub encode_rate: f64,
}

/// Bytes on the wire per encoding of an FP8 inference side (every pair together).
#[derive(Clone, Debug, Default, Serialize)]
pub struct Fp8Wire {
    /// The encoding, in words (`fp8 e4m3, 128x128 blocks, fp32 scales, recipe vllm`).
    pub encoding: String,
    /// Sender-encoded: e4m3 bytes.
    pub sender_e4m3_bytes: u64,
    /// Sender-encoded: fp32 scale bytes.
    pub sender_scale_bytes: u64,
    /// Receiver-encoded: canonical-dtype (bf16) bytes into the receivers' staging.
    pub receiver_wire_bytes: u64,
    /// Bytes into plain tensors.
    pub plain_bytes: u64,
}

impl Fp8Wire {
    /// The figures of a set of transfers; `None` when none is into an FP8 tensor.
    pub fn of<T: std::borrow::Borrow<awex_core::plan::Transfer>>(
        ts: impl Iterator<Item = T>,
    ) -> Option<Fp8Wire> {
        let mut w = Fp8Wire::default();
        let mut any = false;
        for t in ts {
            let t = t.borrow();
            if t.sender_encoded() {
                w.sender_e4m3_bytes += t.numel();
                w.sender_scale_bytes += t.scale_bytes();
            } else if t.encode.is_some() {
                w.receiver_wire_bytes += t.bytes();
            } else {
                w.plain_bytes += t.bytes();
                continue;
            }
            any = true;
        }
        any.then_some(w)
    }
}

/// How the simulation ran.
#[derive(Clone, Debug, Serialize)]
pub struct SimFigures {
    /// Graph shape.
    #[serde(flatten)]
    pub shape: Shape,
    /// Rate computations.
    pub solves: u64,
    /// Events.
    pub events: u64,
    /// Seconds planning every training rank.
    pub plan_s: f64,
    /// Seconds building the graph.
    pub build_s: f64,
    /// Seconds running it.
    pub run_s: f64,
    /// The event quantum, seconds.
    pub quantum_s: f64,
}

/// Per-link reports from a run, busiest first.
pub fn link_reports(links: &[Link], st: &RunStats, transfer_s: f64) -> Vec<LinkReport> {
    let mut v: Vec<LinkReport> = links
        .iter()
        .zip(&st.link_bytes)
        .filter(|(_, b)| **b > 0.0)
        .map(|(l, &b)| LinkReport {
            name: l.name.clone(),
            class: l.class.to_string(),
            gbps: l.cap / 1e9,
            bytes: b.round() as u64,
            bound_s: if l.cap > 0.0 {
                b / l.cap
            } else {
                f64::INFINITY
            },
            utilisation: if transfer_s > 0.0 && l.cap > 0.0 {
                b / (l.cap * transfer_s)
            } else {
                0.0
            },
        })
        .collect();
    v.sort_by(|a, b| b.bound_s.total_cmp(&a.bound_s).then(a.name.cmp(&b.name)));
    v
}

/// Per-class summaries.
pub fn class_reports(all: &[LinkReport]) -> Vec<ClassReport> {
    let mut classes: Vec<String> = all.iter().map(|l| l.class.clone()).collect();
    classes.sort();
    classes.dedup();
    classes
        .into_iter()
        .map(|c| {
            let ls: Vec<&LinkReport> = all.iter().filter(|l| l.class == c).collect();
            let bytes: u64 = ls.iter().map(|l| l.bytes).sum();
            ClassReport {
                links: ls.len(),
                bytes,
                max_bytes: ls.iter().map(|l| l.bytes).max().unwrap_or(0),
                mean_bytes: bytes as f64 / ls.len().max(1) as f64,
                utilisation: ls.iter().map(|l| l.utilisation).sum::<f64>() / ls.len().max(1) as f64,
                class: c,
            }
        })
        .collect()
}

/// The timeline: per-class means and the busiest links, over the bins the run used.
pub fn timeline(
    links: &[Link],
    st: &RunStats,
    transfer_s: f64,
    busiest: &[LinkReport],
) -> Timeline {
    let used = ((transfer_s / st.bin_width).ceil() as usize).clamp(1, BINS);
    let util = |l: usize| -> Vec<f64> {
        (0..used)
            .map(|b| {
                let w = st
                    .bin_width
                    .min(transfer_s - b as f64 * st.bin_width)
                    .max(1e-18);
                st.bins[l][b] / (links[l].cap * w)
            })
            .collect()
    };
    let mut classes: Vec<&'static str> = links.iter().map(|l| l.class).collect();
    classes.sort();
    classes.dedup();
    let class_series = classes
        .iter()
        .filter_map(|c| {
            let ls: Vec<usize> = (0..links.len())
                .filter(|&l| links[l].class == *c && st.link_bytes[l] > 0.0)
                .collect();
            if ls.is_empty() {
                return None;
            }
            let mut sum = vec![0.0; used];
            for &l in &ls {
                for (s, u) in sum.iter_mut().zip(util(l)) {
                    *s += u;
                }
            }
            Some(Series {
                name: format!("{c} (mean of {})", ls.len()),
                util: sum.into_iter().map(|s| s / ls.len() as f64).collect(),
            })
        })
        .collect();
    let link_series = busiest
        .iter()
        .take(4)
        .filter_map(|b| {
            let l = links.iter().position(|l| l.name == b.name)?;
            Some(Series {
                name: b.name.clone(),
                util: util(l),
            })
        })
        .collect();
    Timeline {
        bin_s: st.bin_width,
        classes: class_series,
        links: link_series,
    }
}

fn human_bytes(b: f64) -> String {
    const UNITS: [&str; 5] = ["B", "KB", "MB", "GB", "TB"];
    let mut v = b;
    let mut u = 0;
    while v >= 1000.0 && u < UNITS.len() - 1 {
        v /= 1000.0;
        u += 1;
    }
    format!("{v:.2} {}", UNITS[u])
}

fn human_s(s: f64) -> String {
    if s >= 1.0 {
        format!("{s:.3} s")
    } else {
        format!("{:.2} ms", s * 1e3)
    }
}

impl Report {
    /// The report for people.
    pub fn text(&self) -> String {
        let mut o = String::new();
        let _ = writeln!(o, "PREDICTION (simulated, not measured)");
        let _ = writeln!(o, "model        {}", self.model);
        let _ = writeln!(
            o,
            "training     {} ({} ranks)",
            self.training, self.training_ranks
        );
        let _ = writeln!(
            o,
            "inference    {} ({} ranks)",
            self.inference, self.inference_ranks
        );
        if !self.failed_engines.is_empty() {
            let _ = writeln!(
                o,
                "left out     engines {:?} (failed: their ranks get nothing)",
                self.failed_engines
            );
        }
        if !self.joining_engines.is_empty() {
            let _ = writeln!(
                o,
                "joining      engines {:?} (they hold no version: their ranks get every byte)",
                self.joining_engines
            );
        }
        let _ = writeln!(
            o,
            "topology     {} ({} placement, {} nodes)",
            self.topology, self.placement, self.nodes
        );
        let _ = writeln!(
            o,
            "transport    {} (buckets of {} MiB)",
            self.transport,
            self.bucket_bytes as f64 / (1u64 << 20) as f64
        );
        let _ = writeln!(
            o,
            "moved        {} in {} transfers over {} pairs",
            human_bytes(self.moved_bytes as f64),
            self.transfers,
            self.pairs
        );
        if let Some(d) = &self.delta {
            let _ = writeln!(
                o,
                "delta        density {:.3} %: {:.3} % of the planned bytes on the wire ({}-byte elements), diff and encode {:.2} ms on the busiest training rank (included below)",
                d.density * 100.0,
                d.wire_scale * 100.0,
                d.element_bytes,
                d.encode_s * 1e3
            );
        }
        if let Some(f) = &self.fp8 {
            let _ = writeln!(
                o,
                "fp8          {}: {} e4m3 + {} scales sender-encoded, {} receiver-encoded (the canonical dtype), plain {}",
                f.encoding,
                human_bytes(f.sender_e4m3_bytes as f64),
                human_bytes(f.sender_scale_bytes as f64),
                human_bytes(f.receiver_wire_bytes as f64),
                human_bytes(f.plain_bytes as f64)
            );
        }
        let _ = writeln!(
            o,
            "predicted    {} (transfers {} + control {})",
            human_s(self.predicted_s),
            human_s(self.transfer_s),
            human_s(self.control_s)
        );
        if let Some(b) = &self.busiest_link {
            let _ = writeln!(
                o,
                "bound        {} : busiest link {} carries {} at {:.1} GB/s; transfers take {:.3} x that",
                human_s(self.lower_bound_s),
                b.name,
                human_bytes(b.bytes as f64),
                b.gbps,
                self.ratio_to_bound
            );
        }
        let _ = writeln!(
            o,
            "balance      egress max/mean {:.3}, ingress max/mean {:.3}{}",
            self.egress_max_over_mean,
            self.ingress_max_over_mean,
            if self.plan_bottleneck {
                " (the plan is the bottleneck: a sender carries > 1.1 x its share)"
            } else {
                ""
            }
        );
        let _ = writeln!(o, "links by class:");
        for c in &self.classes {
            let _ = writeln!(
                o,
                "  {:<13} {:>5} links  {:>10} total  {:>10} max  utilisation {:>5.1} %",
                c.class,
                c.links,
                human_bytes(c.bytes as f64),
                human_bytes(c.max_bytes as f64),
                c.utilisation * 100.0
            );
        }
        let _ = writeln!(o, "busiest links:");
        for l in self.links.iter().take(8) {
            let _ = writeln!(
                o,
                "  {:<24} {:>10}  bound {:>10}  utilisation {:>5.1} %",
                l.name,
                human_bytes(l.bytes as f64),
                human_s(l.bound_s),
                l.utilisation * 100.0
            );
        }
        let s = &self.sim;
        let _ = writeln!(
            o,
            "simulation   {} flows, {} activities, {} events, {} NCCL steps max ({} per group); plan {:.2} s, build {:.2} s, run {:.2} s",
            s.shape.flows,
            s.shape.activities,
            s.events,
            s.shape.steps_max,
            s.shape.steps_per_group,
            s.plan_s,
            s.build_s,
            s.run_s
        );
        o
    }

    /// An SVG picture of link utilisation over time.
    pub fn svg(&self) -> String {
        let (w, h, left, top, right, bottom) = (960.0, 420.0, 60.0, 40.0, 300.0, 40.0);
        let pw = w - left - right;
        let ph = h - top - bottom;
        let tl = &self.timeline;
        let n = tl
            .classes
            .iter()
            .chain(&tl.links)
            .map(|s| s.util.len())
            .max()
            .unwrap_or(1)
            .max(1);
        let span = self.transfer_s.max(1e-12);
        let mut o = String::new();
        let _ = writeln!(
            o,
            r#"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" font-size="12">"#
        );
        let _ = writeln!(o, r#"<rect width="{w}" height="{h}" fill="white"/>"#);
        let title = format!(
            "PREDICTED link utilisation: {} {} -> {}, {} ({})",
            self.model,
            self.training,
            self.inference,
            self.transport,
            human_s(self.predicted_s)
        );
        let _ = writeln!(o, r#"<text x="{left}" y="20">{}</text>"#, escape(&title));
        let _ = writeln!(
            o,
            r##"<rect x="{left}" y="{top}" width="{pw}" height="{ph}" fill="none" stroke="#888"/>"##
        );
        for k in 0..=4 {
            let y = top + ph * (1.0 - k as f64 / 4.0);
            let _ = writeln!(
                o,
                r##"<text x="{}" y="{}" text-anchor="end">{}%</text><line x1="{left}" x2="{}" y1="{y}" y2="{y}" stroke="#eee"/>"##,
                left - 4.0,
                y + 4.0,
                k * 25,
                left + pw
            );
            let x = left + pw * k as f64 / 4.0;
            let _ = writeln!(
                o,
                r#"<text x="{x}" y="{}" text-anchor="middle">{}</text>"#,
                top + ph + 16.0,
                human_s(span * k as f64 / 4.0)
            );
        }
        const COLORS: [&str; 10] = [
            "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
            "#bcbd22", "#17becf",
        ];
        for (k, s) in tl.classes.iter().chain(&tl.links).enumerate() {
            let c = COLORS[k % COLORS.len()];
            let dash = if k >= tl.classes.len() {
                r#" stroke-dasharray="4 3""#
            } else {
                ""
            };
            let mut pts = String::new();
            for (b, u) in s.util.iter().enumerate() {
                let x0 = left + pw * (b as f64 * tl.bin_s / span).min(1.0);
                let x1 = left + pw * ((b + 1) as f64 * tl.bin_s / span).min(1.0);
                let y = top + ph * (1.0 - u.clamp(0.0, 1.0));
                let _ = write!(pts, "{x0:.1},{y:.1} {x1:.1},{y:.1} ");
            }
            let _ = writeln!(
                o,
                r#"<polyline points="{pts}" fill="none" stroke="{c}" stroke-width="1.5"{dash}/>"#
            );
            let ly = top + 14.0 + 16.0 * k as f64;
            let _ = writeln!(
                o,
                r#"<line x1="{}" x2="{}" y1="{ly}" y2="{ly}" stroke="{c}" stroke-width="2"{dash}/><text x="{}" y="{}">{}</text>"#,
                left + pw + 10.0,
                left + pw + 30.0,
                left + pw + 36.0,
                ly + 4.0,
                escape(&s.name)
            );
        }
        let _ = n;
        let _ = writeln!(o, "</svg>");
        o
    }
}

fn escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}
