//! The flow-level network model and the activity graph it runs.
//!
//! An update is a graph of activities: flows (bytes over one or two links), delays (a fixed
//! time: a latency, a copy on a private engine) and joins (zero time), each starting once all
//! its predecessors finished. Active flows share every link max-min fairly (progressive
//! filling: the link with the smallest share per unfrozen flow fixes its flows' rate, and so
//! on); rates are recomputed whenever a flow starts or ends. Time advances from event to
//! event; flows that would end within `quantum` of the next event end with it (a bounded
//! error that keeps large graphs tractable).

use std::cmp::Reverse;
use std::collections::BinaryHeap;

/// Index of an activity.
pub type Act = u32;

/// No link.
pub const NONE: u32 = u32::MAX;

/// What an activity does.
#[derive(Clone, Copy, Debug)]
pub enum Kind {
    /// Bytes over up to two links.
    Flow {
        /// The links (NONE for an unused slot).
        links: [u32; 2],
        /// Bytes.
        bytes: f64,
    },
    /// A fixed time, seconds.
    Delay(f64),
    /// Nothing; finishes as soon as it starts.
    Join,
}

/// A link: capacity in bytes per second.
#[derive(Clone, Debug)]
pub struct Link {
    /// Name shown in reports.
    pub name: String,
    /// Class shown in reports (e.g. `nic-out`).
    pub class: &'static str,
    /// Bytes per second.
    pub cap: f64,
}

/// Timeline bins per link (the bin width doubles when the run outgrows them).
pub const BINS: usize = 128;

/// What a run measured.
#[derive(Clone, Debug, Default)]
pub struct RunStats {
    /// When the last activity finished, seconds.
    pub end: f64,
    /// When each activity finished.
    pub finish: Vec<f64>,
    /// Bytes carried by each link.
    pub link_bytes: Vec<f64>,
    /// Per link, bytes carried in each timeline bin.
    pub bins: Vec<[f64; BINS]>,
    /// Width of one bin, seconds.
    pub bin_width: f64,
    /// Rate computations.
    pub solves: u64,
    /// Events (distinct times at which something finished).
    pub events: u64,
}

/// An activity graph over links.
#[derive(Default)]
pub struct Graph {
    links: Vec<Link>,
    kinds: Vec<Kind>,
    deps: Vec<u32>,
    edges: Vec<(Act, Act)>,
}

impl Graph {
    /// An empty graph.
    pub fn new() -> Self {
        Graph::default()
    }

    /// Adds a link, returning its index.
    pub fn link(&mut self, name: String, class: &'static str, gbps: f64) -> u32 {
        self.links.push(Link {
            name,
            class,
            cap: gbps * 1e9,
        });
        self.links.len() as u32 - 1
    }

    /// The links.
    pub fn links(&self) -> &[Link] {
        &self.links
    }

    /// Activities so far.
    pub fn len(&self) -> usize {
        self.kinds.len()
    }

    /// Whether the graph has no activity.
    pub fn is_empty(&self) -> bool {
        self.kinds.is_empty()
    }

    /// Adds an activity that starts once every activity of `after` finished.
    pub fn add(&mut self, kind: Kind, after: &[Act]) -> Act {
        let id = self.kinds.len() as Act;
        self.kinds.push(kind);
        self.deps.push(after.len() as u32);
        for &a in after {
            self.edges.push((a, id));
        }
        id
    }

    /// Adds a dependency: `b` starts only after `a` finished.
    pub fn after(&mut self, b: Act, a: Act) {
        self.deps[b as usize] += 1;
        self.edges.push((a, b));
    }

    /// Calls `f(links, bytes)` for every flow.
    pub fn for_each_flow(&self, mut f: impl FnMut([u32; 2], f64)) {
        for k in &self.kinds {
            if let Kind::Flow { links, bytes } = *k {
                f(links, bytes);
            }
        }
    }

    /// Runs the graph to its end. `quantum`: flows ending within it of an event end with it.
    pub fn run(&self, quantum: f64, horizon_hint: f64) -> RunStats {
        let n = self.kinds.len();
        // successors, CSR
        let mut start = vec![0u32; n + 1];
        for &(a, _) in &self.edges {
            start[a as usize + 1] += 1;
        }
        for i in 0..n {
            start[i + 1] += start[i];
        }
        let mut succ = vec![0u32; self.edges.len()];
        let mut fill = start.clone();
        for &(a, b) in &self.edges {
            succ[fill[a as usize] as usize] = b;
            fill[a as usize] += 1;
        }
        drop(fill);

        let nl = self.links.len();
        let mut deps = self.deps.clone();
        let mut st = RunStats {
            finish: vec![f64::NAN; n],
            link_bytes: vec![0.0; nl],
            bins: vec![[0.0; BINS]; nl],
            bin_width: (horizon_hint.max(1e-9) * 1.25) / BINS as f64,
            ..RunStats::default()
        };
        // active flows: (activity, remaining bytes, rate)
        let mut active: Vec<(Act, f64, f64)> = Vec::new();
        let mut timers: BinaryHeap<Reverse<(OrdF64, Act)>> = BinaryHeap::new();
        let mut ready: Vec<Act> = (0..n as Act).filter(|&a| deps[a as usize] == 0).collect();
        let mut now = 0.0f64;
        let mut solver = Solver::new(nl);
        let mut dirty = true;
        loop {
            // start everything ready; zero-time activities finish at once
            while let Some(a) = ready.pop() {
                let done_now = match self.kinds[a as usize] {
                    Kind::Flow { bytes, .. } if bytes > 0.0 => {
                        active.push((a, bytes, 0.0));
                        dirty = true;
                        false
                    }
                    Kind::Delay(d) if d > 0.0 => {
                        timers.push(Reverse((OrdF64(now + d), a)));
                        false
                    }
                    _ => true,
                };
                if done_now {
                    st.finish[a as usize] = now;
                    for &b in &succ[start[a as usize] as usize..start[a as usize + 1] as usize] {
                        deps[b as usize] -= 1;
                        if deps[b as usize] == 0 {
                            ready.push(b);
                        }
                    }
                }
            }
            if active.is_empty() && timers.is_empty() {
                break;
            }
            if dirty {
                solver.solve(&self.kinds, &self.links, &mut active);
                st.solves += 1;
                dirty = false;
            }
            // the next event
            let mut next = timers.peek().map_or(f64::INFINITY, |t| t.0.0.0);
            for &(_, rem, rate) in &active {
                if rate > 0.0 {
                    next = next.min(now + rem / rate);
                }
            }
            if !next.is_finite() {
                // flows with no capacity anywhere: they never end
                break;
            }
            let dt = next - now;
            // account the interval on the links
            if dt > 0.0 {
                while next > st.bin_width * BINS as f64 {
                    st.bin_width *= 2.0;
                    for b in st.bins.iter_mut() {
                        for i in 0..BINS / 2 {
                            b[i] = b[2 * i] + b[2 * i + 1];
                        }
                        for x in b.iter_mut().skip(BINS / 2) {
                            *x = 0.0;
                        }
                    }
                }
                for &l in &solver.touched {
                    let l = l as usize;
                    let r = solver.link_rate[l];
                    if r > 0.0 {
                        st.link_bytes[l] += r * dt;
                        add_to_bins(&mut st.bins[l], st.bin_width, now, next, r);
                    }
                }
            }
            now = next;
            st.events += 1;
            // finish flows ending now (or within the quantum)
            let mut i = 0;
            while i < active.len() {
                let (a, rem, rate) = active[i];
                let rem = rem - rate * dt;
                if rem <= rate * quantum + 1e-3 {
                    // ends with this event: its last bytes count on its links
                    if let Kind::Flow { links, .. } = self.kinds[a as usize] {
                        for l in links {
                            if l != NONE && rem > 0.0 {
                                st.link_bytes[l as usize] += rem;
                                add_to_bins(
                                    &mut st.bins[l as usize],
                                    st.bin_width,
                                    now,
                                    now + rem / rate.max(1.0),
                                    rate,
                                );
                            }
                        }
                    }
                    active.swap_remove(i);
                    dirty = true;
                    st.finish[a as usize] = now;
                    for &b in &succ[start[a as usize] as usize..start[a as usize + 1] as usize] {
                        deps[b as usize] -= 1;
                        if deps[b as usize] == 0 {
                            ready.push(b);
                        }
                    }
                } else {
                    active[i].1 = rem;
                    i += 1;
                }
            }
            while let Some(Reverse((t, a))) = timers.peek().copied() {
                if t.0 > now + quantum {
                    break;
                }
                timers.pop();
                st.finish[a as usize] = now.max(t.0);
                for &b in &succ[start[a as usize] as usize..start[a as usize + 1] as usize] {
                    deps[b as usize] -= 1;
                    if deps[b as usize] == 0 {
                        ready.push(b);
                    }
                }
            }
        }
        st.end = st
            .finish
            .iter()
            .copied()
            .filter(|f| f.is_finite())
            .fold(0.0, f64::max);
        st
    }
}

fn add_to_bins(bins: &mut [f64; BINS], w: f64, t0: f64, t1: f64, rate: f64) {
    let mut t = t0;
    while t < t1 {
        let i = ((t / w) as usize).min(BINS - 1);
        let edge = ((i + 1) as f64 * w).min(t1);
        let edge = if edge <= t { t1 } else { edge };
        bins[i] += rate * (edge - t);
        t = edge;
    }
}

/// A total order on finite floats, for the timer heap.
#[derive(Clone, Copy, Debug)]
struct OrdF64(f64);
impl PartialEq for OrdF64 {
    fn eq(&self, o: &Self) -> bool {
        self.cmp(o).is_eq()
    }
}
impl Eq for OrdF64 {}
impl PartialOrd for OrdF64 {
    fn partial_cmp(&self, o: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(o))
    }
}
impl Ord for OrdF64 {
    fn cmp(&self, o: &Self) -> std::cmp::Ordering {
        self.0.total_cmp(&o.0)
    }
}

/// Max-min fair rates by progressive filling.
struct Solver {
    rem: Vec<f64>,
    /// unfrozen flows per link
    count: Vec<u32>,
    /// flows per link, CSR over the active list: `start[l]..start[l] + total[l]`
    start: Vec<u32>,
    total: Vec<u32>,
    fill: Vec<u32>,
    members: Vec<u32>,
    frozen: Vec<bool>,
    link_rate: Vec<f64>,
    touched: Vec<u32>,
}

impl Solver {
    fn new(links: usize) -> Self {
        Solver {
            rem: vec![0.0; links],
            count: vec![0; links],
            start: vec![0; links],
            total: vec![0; links],
            fill: vec![0; links],
            members: Vec::new(),
            frozen: Vec::new(),
            link_rate: vec![0.0; links],
            touched: Vec::new(),
        }
    }

    fn solve(&mut self, kinds: &[Kind], links: &[Link], active: &mut [(Act, f64, f64)]) {
        for &l in &self.touched {
            self.total[l as usize] = 0;
            self.link_rate[l as usize] = 0.0;
        }
        self.touched.clear();
        let flow_links = |a: Act| match kinds[a as usize] {
            Kind::Flow { links, .. } => links,
            _ => [NONE, NONE],
        };
        for &(a, _, _) in active.iter() {
            for l in flow_links(a) {
                if l != NONE {
                    if self.total[l as usize] == 0 {
                        self.touched.push(l);
                    }
                    self.total[l as usize] += 1;
                }
            }
        }
        let mut at = 0u32;
        for &l in &self.touched {
            let li = l as usize;
            self.start[li] = at;
            self.fill[li] = at;
            at += self.total[li];
            self.count[li] = self.total[li];
            self.rem[li] = links[li].cap;
        }
        self.members.clear();
        self.members.resize(at as usize, 0);
        for (fi, &(a, _, _)) in active.iter().enumerate() {
            for l in flow_links(a) {
                if l != NONE {
                    let li = l as usize;
                    self.members[self.fill[li] as usize] = fi as u32;
                    self.fill[li] += 1;
                }
            }
        }
        self.frozen.clear();
        self.frozen.resize(active.len(), false);
        let mut heap: BinaryHeap<Reverse<(OrdF64, u32)>> = self
            .touched
            .iter()
            .map(|&l| {
                let l = l as usize;
                Reverse((OrdF64(self.rem[l] / self.count[l] as f64), l as u32))
            })
            .collect();
        let mut unfrozen = active.len();
        while let Some(Reverse((share, l))) = heap.pop() {
            if unfrozen == 0 {
                break;
            }
            let li = l as usize;
            if self.count[li] == 0 {
                continue;
            }
            let cur = self.rem[li] / self.count[li] as f64;
            if cur > share.0 * (1.0 + 1e-12) + 1e-9 {
                heap.push(Reverse((OrdF64(cur), l)));
                continue;
            }
            let s = cur.max(0.0);
            let (b, e) = (
                self.start[li] as usize,
                (self.start[li] + self.total[li]) as usize,
            );
            for k in b..e {
                let fi = self.members[k] as usize;
                if self.frozen[fi] {
                    continue;
                }
                self.frozen[fi] = true;
                unfrozen -= 1;
                active[fi].2 = s;
                for ol in flow_links(active[fi].0) {
                    if ol != NONE {
                        let o = ol as usize;
                        self.rem[o] -= s;
                        self.count[o] -= 1;
                        self.link_rate[o] += s;
                    }
                }
            }
        }
        // flows on no link at all run at once (1 PB/s)
        for (fi, f) in active.iter_mut().enumerate() {
            if !self.frozen[fi] {
                f.2 = 1e15;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn two_flows_share_a_link_then_one_speeds_up() {
        // one 10 GB/s link; flows of 10 GB and 20 GB: 5 GB/s each until 2 s, then 10 GB/s
        let mut g = Graph::new();
        let l = g.link("l".into(), "x", 10.0);
        let a = g.add(
            Kind::Flow {
                links: [l, NONE],
                bytes: 10e9,
            },
            &[],
        );
        let b = g.add(
            Kind::Flow {
                links: [l, NONE],
                bytes: 20e9,
            },
            &[],
        );
        let st = g.run(0.0, 3.0);
        assert!((st.finish[a as usize] - 2.0).abs() < 1e-9);
        assert!((st.finish[b as usize] - 3.0).abs() < 1e-9);
        assert!((st.link_bytes[l as usize] - 30e9).abs() < 1.0);
        let binned: f64 = st.bins[l as usize].iter().sum();
        assert!((binned - 30e9).abs() < 1.0);
    }

    #[test]
    fn max_min_gives_the_unbottlenecked_flow_the_rest() {
        // links x (10) and y (4); flow 1 on x and y, flows 2 and 3 on x only:
        // y limits flow 1 to 4, flows 2 and 3 split the remaining 6 of x
        let mut g = Graph::new();
        let x = g.link("x".into(), "x", 10.0);
        let y = g.link("y".into(), "y", 4.0);
        let f1 = g.add(
            Kind::Flow {
                links: [x, y],
                bytes: 4e9,
            },
            &[],
        );
        let f2 = g.add(
            Kind::Flow {
                links: [x, NONE],
                bytes: 3e9,
            },
            &[],
        );
        let d = g.add(Kind::Delay(0.5), &[f1, f2]);
        let st = g.run(0.0, 1.0);
        assert!((st.finish[f1 as usize] - 1.0).abs() < 1e-9);
        // flow 2 at 6 GB/s: 3 GB in 0.5 s
        assert!((st.finish[f2 as usize] - 0.5).abs() < 1e-9);
        assert!((st.finish[d as usize] - 1.5).abs() < 1e-9);
        assert!((st.end - 1.5).abs() < 1e-9);
    }
}
