//! Executing every rank's real plan the way the transports do, as an activity graph.
//!
//! Every training rank is planned with [`awex_core::plan::Pair::plan_rank`] (both ends of a
//! pair compute the same transfers, so the senders' plans hold every pair). Each transport's
//! schedule is then laid out as activities over the topology's links ([`crate::net`]):
//!
//! - `nccl` (`awex-gpu/src/nccl/{schedule,program}.rs`,
//!   `awex-runtime/src/transport/nccl.rs`): a pair's transfers are cut into buckets of
//!   `pair_bucket_bytes(budget, peers, budget, peers)`; step `k` of a rank is one NCCL group
//!   holding bucket `k` of every peer that has one, issued on one stream after
//!   step `k-1`; a bucket moves once both ends issued their step `k` (NCCL matches a send with
//!   its receive). A training rank packs staged buckets of step `k` on its copy engine once
//!   the sends of step `k-2` left that slot (two slots); an inference rank receives step `k`
//!   once the unpack of step `k-2` emptied its slot, and unpacks after the receive. Each step
//!   costs the topology's per-message latency. On large pairs, consecutive steps are merged
//!   into groups of `steps_per_group` steps (same bytes, the latency of every step; the pack
//!   and unpack of a merged group overlap its transfers but for one step's share).
//! - `cuda-ipc` (`awex-runtime/src/transport/cuda_ipc/`, `awex-gpu/src/cuda/engine.rs`):
//!   an inference rank replays the CUDA graph it captured at join for each peer (one launch,
//!   `launch_us`, each): one copy per transfer (linear pieces of at most 256 MiB) over 16
//!   streams, largest first, each copy to the least-loaded stream of the batch. The peers'
//!   graphs run at once (`AWEX_IPC_PEERS=concurrent`, the default) or peer after peer
//!   (`sequential`, [`PeerOrder`]). Copies inside one GPU use its memory; between GPUs of a
//!   node, NVLink.
//! - `shm` (`awex-runtime/src/transport/shm.rs`): an inference rank copies its peers'
//!   buckets one after another on its own thread, out of the training ranks' shared memory; every
//!   copy of a host shares the host's memory bandwidth.
//! - `tcp` (`awex-runtime/src/transport/tcp.rs`): every pair streams its buckets over its
//!   own connection, one after another, all pairs at once; pack and unpack overlap the wire
//!   (two buffers per end) and are not charged. Not calibrated.

use crate::SimError;
use crate::buckets::{BucketRun, bucket_runs, count};
use crate::net::{Act, Graph, Kind, NONE, RunStats};
use crate::topology::{DeviceKind, Topology};
use awex_core::Transport;
use awex_core::layout::{RankId, Side};
use awex_core::plan::{Pair, Transfers};
use serde::Serialize;
use std::collections::HashMap;
use std::time::Instant;

/// How to run a simulation.
#[derive(Clone, Debug)]
pub struct Options {
    /// The transport; `None` picks cuda-ipc for colocated GPUs, nccl for other GPUs, shm on CPU.
    pub transport: Option<Transport>,
    /// Staging bucket size (the NCCL per-step budget), bytes.
    pub bucket_bytes: u64,
    /// Most flows in the graph before consecutive NCCL steps are merged.
    pub max_flows: u64,
    /// Flows ending within this fraction of the lower bound of an event end with it.
    pub quantum: f64,
    /// Threads that plan the ranks.
    pub threads: usize,
    /// How a cuda-ipc receiver takes its peers' copies.
    pub peers: PeerOrder,
    /// Bytes on the wire per planned (dense) byte: 1 for dense updates, the delta's expected
    /// fraction at a density (`awex_core::encoding::delta::expected_fraction`); the buckets
    /// and their steps stay those of the plan, each carrying fewer bytes.
    pub wire_scale: f64,
    /// Per inference rank (by index): it takes every byte whatever `wire_scale` says (a rank of
    /// an engine that joined the pair and holds no version yet: its first update is dense).
    /// Empty: none does.
    pub dense_ranks: Vec<bool>,
}

impl Options {
    /// Bytes on the wire per planned byte to inference rank `i`.
    pub fn scale_to(&self, i: usize) -> f64 {
        if self.dense_ranks.get(i).copied().unwrap_or(false) {
            1.0
        } else {
            self.wire_scale
        }
    }
}

/// How a simulated cuda-ipc receiver takes its peers' copies.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum PeerOrder {
    /// Every peer's graph replayed at once, each on its own stream (the transport's default,
    /// `AWEX_IPC_PEERS=concurrent`).
    #[default]
    Concurrent,
    /// One peer after the other, in plan order (`AWEX_IPC_PEERS=sequential`, the order before).
    Sequential,
    /// What-if: one batch taking the peers' copies in turn.
    Interleaved,
}

impl PeerOrder {
    /// The name the command line and the report use.
    pub fn as_str(self) -> &'static str {
        match self {
            PeerOrder::Concurrent => "concurrent",
            PeerOrder::Sequential => "sequential",
            PeerOrder::Interleaved => "interleaved",
        }
    }
}

impl std::str::FromStr for PeerOrder {
    type Err = SimError;
    fn from_str(s: &str) -> Result<Self, SimError> {
        [
            PeerOrder::Concurrent,
            PeerOrder::Sequential,
            PeerOrder::Interleaved,
        ]
        .into_iter()
        .find(|p| p.as_str() == s)
        .ok_or_else(|| {
            SimError::Usage(format!(
                "unknown peer order `{s}`; choose concurrent, sequential or interleaved"
            ))
        })
    }
}

impl Default for Options {
    fn default() -> Self {
        Options {
            transport: None,
            bucket_bytes: 64 << 20,
            max_flows: 300_000,
            quantum: 1e-4,
            threads: std::thread::available_parallelism().map_or(1, |n| n.get()),
            peers: PeerOrder::default(),
            wire_scale: 1.0,
            dense_ranks: Vec::new(),
        }
    }
}

/// One training rank -> inference rank pair and its transfers (in execution order).
pub struct PairPlan {
    /// Training rank index.
    pub t: u32,
    /// Inference rank index.
    pub i: u32,
    /// Wire bytes.
    pub bytes: u64,
    /// The transfers.
    pub transfers: Transfers,
}

/// Every pair of a pair of layouts, planned from the senders' plans.
pub struct Plans {
    /// Training ranks, in order.
    pub training: Vec<RankId>,
    /// Inference ranks, in order.
    pub inference: Vec<RankId>,
    /// Pairs sorted by (training, inference).
    pub pairs: Vec<PairPlan>,
    /// Wall time of planning every training rank, seconds (all threads).
    pub plan_s: f64,
}

/// Plans every training rank (on `threads` threads) and collects its peer plans.
pub fn plan_all(pair: &Pair<'_>, threads: usize) -> Result<Plans, SimError> {
    let t0 = Instant::now();
    let training = pair.training.ranks();
    let inference = pair.inference.ranks();
    let index: HashMap<RankId, u32> = inference
        .iter()
        .enumerate()
        .map(|(k, r)| (*r, k as u32))
        .collect();
    let threads = threads.clamp(1, 64).min(training.len().max(1));
    let chunk = training.len().div_ceil(threads).max(1);
    let parts: Vec<Result<Vec<PairPlan>, SimError>> = std::thread::scope(|scope| {
        let hs: Vec<_> = training
            .chunks(chunk)
            .enumerate()
            .map(|(c, ranks)| {
                let index = &index;
                scope.spawn(move || {
                    let mut out = Vec::new();
                    for (k, &rank) in ranks.iter().enumerate() {
                        let t = (c * chunk + k) as u32;
                        let plan = pair.plan_rank(Side::Training, rank)?;
                        for p in plan.peers {
                            let i = *index.get(&p.peer).ok_or_else(|| {
                                SimError::Plan(format!(
                                    "training rank {rank} plans for inference rank {}, which the inference side does not list",
                                    p.peer
                                ))
                            })?;
                            out.push(PairPlan {
                                t,
                                i,
                                bytes: p.bytes,
                                transfers: p.transfers,
                            });
                        }
                    }
                    Ok(out)
                })
            })
            .collect();
        hs.into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err(SimError::Plan("a planning thread panicked".into())))
            })
            .collect()
    });
    let mut pairs = Vec::new();
    for p in parts {
        pairs.extend(p?);
    }
    Ok(Plans {
        training,
        inference,
        pairs,
        plan_s: t0.elapsed().as_secs_f64(),
    })
}

/// The links of a topology, created for the devices in use.
struct Links {
    kind: DeviceKind,
    gpn: u32,
    nics: u32,
    map: HashMap<(u8, u32), u32>,
}

const NVL_OUT: u8 = 0;
const NVL_IN: u8 = 1;
const NIC_OUT: u8 = 2;
const NIC_IN: u8 = 3;
const COPY: u8 = 4;
const HOST: u8 = 5;
const THREAD: u8 = 6;

impl Links {
    fn new(topo: &Topology) -> Self {
        Links {
            kind: topo.kind,
            gpn: topo.gpus_per_node,
            nics: topo.nics(),
            map: HashMap::new(),
        }
    }

    fn get(&mut self, g: &mut Graph, topo: &Topology, what: u8, id: u32) -> u32 {
        if let Some(&l) = self.map.get(&(what, id)) {
            return l;
        }
        let (name, class, gbps) = match what {
            NVL_OUT => (
                format!("gpu{id} nvlink out"),
                "nvlink-out",
                topo.nvlink_gbps,
            ),
            NVL_IN => (format!("gpu{id} nvlink in"), "nvlink-in", topo.nvlink_gbps),
            NIC_OUT => (
                format!("node{} nic{} out", id / self.nics, id % self.nics),
                "nic-out",
                topo.nic_gbps,
            ),
            NIC_IN => (
                format!("node{} nic{} in", id / self.nics, id % self.nics),
                "nic-in",
                topo.nic_gbps,
            ),
            COPY => (format!("gpu{id} memory copy"), "gpu-copy", topo.copy_gbps),
            HOST => (
                format!("host{id} memory"),
                "host-memory",
                topo.host_copy_gbps,
            ),
            _ => (
                format!("rank process {id} copy"),
                "process-copy",
                topo.thread_copy_gbps,
            ),
        };
        let l = g.link(name, class, gbps);
        self.map.insert((what, id), l);
        l
    }

    fn nic(&self, dev: u32) -> u32 {
        let node = dev / self.gpn;
        let local = dev % self.gpn;
        node * self.nics + local * self.nics / self.gpn
    }

    /// The links bytes from device `s` to device `d` cross.
    fn path(&mut self, g: &mut Graph, topo: &Topology, s: u32, d: u32) -> [u32; 2] {
        let same_node = s / self.gpn == d / self.gpn;
        match self.kind {
            DeviceKind::Gpu if s == d => [self.get(g, topo, COPY, s), NONE],
            DeviceKind::Gpu if same_node => {
                [self.get(g, topo, NVL_OUT, s), self.get(g, topo, NVL_IN, d)]
            }
            _ if !same_node || self.kind == DeviceKind::Gpu => {
                let (a, b) = (self.nic(s), self.nic(d));
                [self.get(g, topo, NIC_OUT, a), self.get(g, topo, NIC_IN, b)]
            }
            // a CPU host: loopback through the host's memory
            _ => [self.get(g, topo, HOST, s / self.gpn), NONE],
        }
    }
}

/// What the graph builder reports besides the graph.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Shape {
    /// Flows in the graph.
    pub flows: u64,
    /// Activities in the graph.
    pub activities: u64,
    /// Most NCCL steps of one rank (0 for other transports).
    pub steps_max: u64,
    /// NCCL steps merged into one simulated group.
    pub steps_per_group: u64,
    /// Buckets (NCCL: pair buckets; shm/tcp: peer buckets; cuda-ipc: copies).
    pub buckets: u64,
}

/// A built graph, ready to run.
pub struct Built {
    /// The graph.
    pub graph: Graph,
    /// Its final activity.
    pub done: Act,
    /// Its shape.
    pub shape: Shape,
    /// The transport it runs.
    pub transport: Transport,
    /// Devices (or CPU rank slots) of the training ranks.
    pub train_dev: Vec<u32>,
    /// Devices of the inference ranks.
    pub infer_dev: Vec<u32>,
    /// Nodes used.
    pub nodes: u32,
}

/// Lays out the update of `plans` on `topo` with `opts`' transport.
pub fn build(plans: &Plans, topo: &Topology, opts: &Options) -> Result<Built, SimError> {
    let (train_dev, infer_dev, nodes) = topo.place(plans.training.len(), plans.inference.len())?;
    let colocated = plans
        .pairs
        .iter()
        .any(|p| train_dev[p.t as usize] == infer_dev[p.i as usize]);
    let transport = opts.transport.unwrap_or(match topo.kind {
        DeviceKind::Cpu => Transport::Shm,
        DeviceKind::Gpu if colocated => Transport::CudaIpc,
        DeviceKind::Gpu => Transport::Nccl,
    });
    let gpn = topo.gpus_per_node;
    let same_node = |p: &PairPlan| train_dev[p.t as usize] / gpn == infer_dev[p.i as usize] / gpn;
    if transport.on_gpu() && topo.kind == DeviceKind::Cpu {
        return Err(SimError::Usage(format!(
            "{transport} needs GPUs, but topology `{}` describes CPU hosts; use shm or tcp",
            topo.name
        )));
    }
    if transport.on_gpu() && colocated && !transport.shares_a_gpu() {
        return Err(SimError::Usage(format!(
            "{transport} cannot put a training and an inference rank on the same GPU (colocated placement); use cuda-ipc"
        )));
    }
    if transport.same_host_only() {
        if let Some(p) = plans.pairs.iter().find(|p| !same_node(p)) {
            return Err(SimError::Usage(format!(
                "{transport} moves bytes inside one node, but training rank {} (device {}) and inference rank {} (device {}) are on different nodes of {gpn}; use nccl or tcp, or place them together",
                plans.training[p.t as usize],
                train_dev[p.t as usize],
                plans.inference[p.i as usize],
                infer_dev[p.i as usize]
            )));
        }
    }
    let mut g = Graph::new();
    let mut links = Links::new(topo);
    let mut shape = Shape::default();
    let mut finals: Vec<Act> = Vec::new();
    let lat = topo.latency_us * 1e-6;
    let (t_n, i_n) = (plans.training.len(), plans.inference.len());
    match transport {
        Transport::Nccl => {
            let mut peers_t = vec![0usize; t_n];
            let mut peers_i = vec![0usize; i_n];
            for p in &plans.pairs {
                peers_t[p.t as usize] += 1;
                peers_i[p.i as usize] += 1;
            }
            let b = opts.bucket_bytes;
            let runs: Vec<Vec<BucketRun>> = plans
                .pairs
                .iter()
                .map(|p| {
                    let size =
                        pair_bucket_bytes(b, peers_t[p.t as usize], b, peers_i[p.i as usize]);
                    bucket_runs(p.transfers.iter_owned(), size)
                })
                .collect();
            let steps: Vec<u64> = runs.iter().map(|r| count(r)).collect();
            shape.buckets = steps.iter().sum();
            let mut steps_t = vec![0u64; t_n];
            let mut steps_i = vec![0u64; i_n];
            for (p, &s) in plans.pairs.iter().zip(&steps) {
                steps_t[p.t as usize] = steps_t[p.t as usize].max(s);
                steps_i[p.i as usize] = steps_i[p.i as usize].max(s);
            }
            shape.steps_max = steps_t.iter().chain(&steps_i).copied().max().unwrap_or(0);
            let chunk = shape.buckets.div_ceil(opts.max_flows.max(1)).max(1);
            shape.steps_per_group = chunk;
            let groups = |s: u64| s.div_ceil(chunk) as usize;
            // per pair and group: bytes, packed bytes (sender), unpacked bytes (receiver)
            let mut per_pair: Vec<Vec<(u32, u64, u64, u64)>> = Vec::with_capacity(runs.len());
            let mut staged_t: Vec<Vec<u64>> = steps_t.iter().map(|&s| vec![0; groups(s)]).collect();
            let mut staged_i: Vec<Vec<u64>> = steps_i.iter().map(|&s| vec![0; groups(s)]).collect();
            for (p, r) in plans.pairs.iter().zip(&runs) {
                let v = split_groups(r, chunk);
                for &(j, _, ss, sd) in &v {
                    staged_t[p.t as usize][j as usize] += ss;
                    staged_i[p.i as usize][j as usize] += sd;
                }
                per_pair.push(v);
            }
            let copy = topo.copy_gbps * 1e9;
            // rank groups: (issue, lat, end) per group; pack / unpack chains
            struct Rg {
                lat: Vec<Act>,
                end: Vec<Act>,
            }
            let mut build_rank = |g: &mut Graph, steps: u64, staged: &[u64], side: Side| -> Rg {
                let n = groups(steps);
                let mut rg = Rg {
                    lat: Vec::with_capacity(n),
                    end: Vec::with_capacity(n),
                };
                let mut work: Vec<Act> = Vec::with_capacity(n); // pack (training) or unpack (inference)
                let mut tail: Option<Act> = None;
                for j in 0..n {
                    let k = (steps - j as u64 * chunk).min(chunk);
                    let whole = staged[j] as f64 / copy;
                    let issue = g.add(Kind::Join, &[]);
                    if j > 0 {
                        g.after(issue, rg.end[j - 1]);
                    }
                    let l = g.add(Kind::Delay(k as f64 * lat), &[issue]);
                    let end = g.add(Kind::Join, &[l]);
                    match side {
                        Side::Training => {
                            // pack of group j: after pack j-1 and once the sends of j-2 left the slot
                            let mut deps = Vec::new();
                            if j > 0 {
                                deps.push(work[j - 1]);
                            }
                            if j > 1 {
                                deps.push(rg.end[j - 2]);
                            }
                            let pack = g.add(Kind::Delay(whole), &deps);
                            let first = g.add(Kind::Delay(whole / k as f64), &deps);
                            g.after(issue, first);
                            g.after(end, pack);
                            work.push(pack);
                        }
                        Side::Inference => {
                            if j > 1 {
                                g.after(issue, work[j - 2]);
                            }
                            let mut deps = vec![if k == 1 { end } else { l }];
                            if j > 0 {
                                deps.push(work[j - 1]);
                            }
                            let unpack = g.add(Kind::Delay(whole), &deps);
                            if k > 1 {
                                tail = Some(g.add(Kind::Delay(whole / k as f64), &[end, unpack]));
                            } else {
                                tail = None;
                            }
                            work.push(unpack);
                        }
                    }
                    rg.lat.push(l);
                    rg.end.push(end);
                }
                let last = match side {
                    Side::Training => rg.end.last().copied(),
                    Side::Inference => tail.or(work.last().copied()),
                };
                if let Some(a) = last {
                    finals.push(a);
                }
                rg
            };
            let rt: Vec<Rg> = (0..t_n)
                .map(|t| build_rank(&mut g, steps_t[t], &staged_t[t], Side::Training))
                .collect();
            let ri: Vec<Rg> = (0..i_n)
                .map(|i| build_rank(&mut g, steps_i[i], &staged_i[i], Side::Inference))
                .collect();
            for (p, v) in plans.pairs.iter().zip(&per_pair) {
                let (t, i) = (p.t as usize, p.i as usize);
                let path = links.path(&mut g, topo, train_dev[t], infer_dev[i]);
                for &(j, bytes, _, _) in v {
                    let j = j as usize;
                    let f = g.add(
                        Kind::Flow {
                            links: path,
                            bytes: bytes as f64 * opts.scale_to(i),
                        },
                        &[rt[t].lat[j], ri[i].lat[j]],
                    );
                    g.after(rt[t].end[j], f);
                    g.after(ri[i].end[j], f);
                    shape.flows += 1;
                }
            }
        }
        Transport::CudaIpc => {
            // the receiver's copy engine (`CudaIpcConfig`'s defaults): 16 streams, linear copies
            // cut into 256 MiB pieces, each peer's copies captured into one CUDA graph at join
            // and replayed with one launch per update
            const STREAMS: usize = 16;
            const SPLIT: u64 = 256 << 20;
            let launch = topo.launch_us * 1e-6;
            let mut by_dst: Vec<Vec<usize>> = vec![Vec::new(); i_n];
            for (k, p) in plans.pairs.iter().enumerate() {
                by_dst[p.i as usize].push(k);
            }
            for (i, pairs) in by_dst.iter().enumerate() {
                if pairs.is_empty() {
                    continue;
                }
                let mut host: Option<Act> = None;
                // one batch per peer (one captured graph each); or, as a what-if, one batch
                // taking the peers' copies in turn
                let mut batches: Vec<Vec<([u32; 2], u64)>> = Vec::new();
                for &k in pairs {
                    let p = &plans.pairs[k];
                    let path = links.path(&mut g, topo, train_dev[p.t as usize], infer_dev[i]);
                    let mut b = Vec::new();
                    for i in 0..p.transfers.len() {
                        let mut left = p.transfers.bytes_of(i);
                        while left > 0 {
                            let piece = left.min(SPLIT);
                            left -= piece;
                            b.push((path, piece));
                        }
                    }
                    batches.push(b);
                }
                if opts.peers == PeerOrder::Interleaved {
                    let mut merged = Vec::new();
                    let longest = batches.iter().map(Vec::len).max().unwrap_or(0);
                    for j in 0..longest {
                        merged.extend(batches.iter().filter_map(|b| b.get(j).copied()));
                    }
                    batches = vec![merged];
                }
                // sequential (and interleaved): every batch after the previous one ended;
                // concurrent: every peer's graph from the start, on its own stream
                let mut ends: Vec<Act> = Vec::new();
                for batch in &mut batches {
                    // the graph's replay: one launch per batch
                    let h = g.add(Kind::Delay(launch), host.as_slice());
                    host = Some(h);
                    let mut stream_last: [Option<Act>; STREAMS] = [None; STREAMS];
                    let after = match opts.peers {
                        PeerOrder::Concurrent => None,
                        PeerOrder::Sequential | PeerOrder::Interleaved => ends.last().copied(),
                    };
                    // largest first, each to the least-loaded stream (`CopyOrder::LargestFirst`;
                    // the tile kernel's blocks likewise keep every stream's share moving)
                    batch.sort_by_key(|&(_, piece)| std::cmp::Reverse(piece));
                    let mut load = [0u64; STREAMS];
                    for &(path, piece) in batch.iter() {
                        let (s, _) = load
                            .iter()
                            .enumerate()
                            .min_by_key(|&(i, &l)| (l, i))
                            .unwrap_or((0, &0));
                        load[s] += piece;
                        let mut deps = vec![h];
                        deps.extend(stream_last[s].or(after));
                        let f = g.add(
                            Kind::Flow {
                                links: path,
                                bytes: piece as f64 * opts.scale_to(i),
                            },
                            &deps,
                        );
                        stream_last[s] = Some(f);
                        shape.flows += 1;
                        shape.buckets += 1;
                    }
                    // the batch ends when all its streams did
                    let all: Vec<Act> = stream_last.iter().flatten().copied().collect();
                    if !all.is_empty() {
                        ends.push(g.add(Kind::Join, &all));
                    }
                }
                if !ends.is_empty() {
                    finals.push(g.add(Kind::Join, &ends));
                }
            }
        }
        Transport::Shm | Transport::Tcp => {
            let mut by_dst: Vec<Vec<usize>> = vec![Vec::new(); i_n];
            for (k, p) in plans.pairs.iter().enumerate() {
                by_dst[p.i as usize].push(k);
            }
            for (i, pairs) in by_dst.iter().enumerate() {
                let mut prev: Option<Act> = None;
                for &k in pairs {
                    let p = &plans.pairs[k];
                    let runs = bucket_runs(p.transfers.iter_owned(), opts.bucket_bytes);
                    let n = count(&runs);
                    shape.buckets += n;
                    let (s, d) = (train_dev[p.t as usize], infer_dev[i]);
                    let path = if transport == Transport::Shm {
                        // the receiver's own copy loop, inside its host's memory bandwidth
                        let host = links.path(&mut g, topo, s, d)[0];
                        let host = if topo.kind == DeviceKind::Cpu {
                            host
                        } else {
                            links.get(&mut g, topo, COPY, d)
                        };
                        [host, links.get(&mut g, topo, THREAD, d)]
                    } else {
                        links.path(&mut g, topo, s, d)
                    };
                    let lat_d = g.add(Kind::Delay(n as f64 * lat), prev.as_slice());
                    let f = g.add(
                        Kind::Flow {
                            links: path,
                            bytes: p.bytes as f64 * opts.scale_to(i),
                        },
                        &[lat_d],
                    );
                    shape.flows += 1;
                    if transport == Transport::Shm {
                        // one receiver thread: peers one after another
                        prev = Some(f);
                    } else {
                        finals.push(f);
                    }
                }
                finals.extend(prev);
            }
        }
    }
    let done = g.add(Kind::Join, &finals);
    shape.activities = g.len() as u64;
    Ok(Built {
        graph: g,
        done,
        shape,
        transport,
        train_dev,
        infer_dev,
        nodes,
    })
}

/// The NCCL transport's smallest pair bucket (`awex-gpu/src/nccl/schedule.rs`,
/// `PAIR_BUCKET_FLOOR`).
pub const PAIR_BUCKET_FLOOR: u64 = 4 << 20;

/// The NCCL transport's bucket size of a pair (`awex-gpu/src/nccl/schedule.rs`,
/// `pair_bucket_bytes`): each end's budget split over its peers, but at least
/// [`PAIR_BUCKET_FLOOR`] when the budget is at least that; the smaller end, at least 1.
pub fn pair_bucket_bytes(budget_a: u64, peers_a: usize, budget_b: u64, peers_b: usize) -> u64 {
    let share = |budget: u64, peers: usize| {
        let split = budget / (peers.max(1) as u64);
        if budget >= PAIR_BUCKET_FLOOR {
            split.max(PAIR_BUCKET_FLOOR)
        } else {
            split
        }
    };
    share(budget_a, peers_a)
        .min(share(budget_b, peers_b))
        .max(1)
}

/// A pair's buckets summed per group of `chunk` steps: (group, bytes, staged at the sender,
/// staged at the receiver).
fn split_groups(runs: &[BucketRun], chunk: u64) -> Vec<(u32, u64, u64, u64)> {
    let mut out: Vec<(u32, u64, u64, u64)> = Vec::new();
    let mut k = 0u64;
    for r in runs {
        let mut n = r.count;
        while n > 0 {
            let j = k / chunk;
            let take = n.min((j + 1) * chunk - k);
            let b = take * r.bytes;
            if out.last().is_none_or(|x| x.0 as u64 != j) {
                out.push((j as u32, 0, 0, 0));
            }
            if let Some(x) = out.last_mut() {
                x.1 += b;
                if r.staged_src {
                    x.2 += b;
                }
                if r.staged_dst {
                    x.3 += b;
                }
            }
            k += take;
            n -= take;
        }
    }
    out
}

/// Runs a built graph.
pub fn run(b: &Built, quantum_s: f64, horizon: f64) -> RunStats {
    b.graph.run(quantum_s, horizon)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pair_bucket_size_is_the_transports() {
        for (a, pa, b, pb) in [
            (64u64 << 20, 4, 64u64 << 20, 1),
            (100, 3, 1000, 2),
            (1, 8, 1, 8),
            (10, 0, 10, 0),
            (1 << 30, 406, 1 << 30, 44),
            (64 << 20, 406, 64 << 20, 44),
            (1 << 20, 406, 64 << 20, 1),
        ] {
            assert_eq!(
                pair_bucket_bytes(a, pa, b, pb),
                awex_gpu::nccl::pair_bucket_bytes(a, pa, b, pb)
            );
        }
        assert_eq!(PAIR_BUCKET_FLOOR, awex_gpu::nccl::PAIR_BUCKET_FLOOR);
    }

    #[test]
    fn groups_sum_the_buckets_of_their_steps() {
        let runs = [
            BucketRun {
                bytes: 10,
                count: 5,
                staged_src: false,
                staged_dst: true,
            },
            BucketRun {
                bytes: 3,
                count: 1,
                staged_src: true,
                staged_dst: true,
            },
        ];
        assert_eq!(
            split_groups(&runs, 2),
            vec![(0, 20, 0, 20), (1, 20, 0, 20), (2, 13, 3, 13)]
        );
        assert_eq!(split_groups(&runs, 1).len(), 6);
    }
}
