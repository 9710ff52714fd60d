//! The simulation against cases solvable by hand, against topology changes, and against the
//! project's measured runs.

use awex_core::DType;
use awex_core::Transport;
use awex_core::layout::Side;
use awex_core::plan::Pair;
use awex_core::synthetic::{SyntheticSide, TensorSplit, catalogue};
use awex_sim::calibration::{Calibration, DATA};
use awex_sim::exec::Options;
use awex_sim::topology::{Placement, Topology};
use awex_sim::{Names, simulate};

fn link_backends() {
    std::hint::black_box((awex_megatron::CRATE, awex_sglang::CRATE, awex_fsdp::CRATE));
}

fn side(side: Side, shards: u32, rows: u64, n: usize) -> SyntheticSide {
    SyntheticSide {
        side,
        engines: 1,
        replicas: 1,
        shards,
        splits: (0..n)
            .map(|_| TensorSplit {
                dim: 0,
                cuts: (1..shards)
                    .map(|s| rows * s as u64 / shards as u64)
                    .collect(),
                pad: 0,
            })
            .collect(),
        dtype: DType::Bf16,
        fuse: false,
    }
}

fn topo(placement: Placement) -> Topology {
    Topology {
        name: "test".into(),
        nodes: 0,
        gpus_per_node: 8,
        nvlink_gbps: 100.0,
        nic_gbps: 25.0,
        copy_gbps: 1000.0,
        latency_us: 10.0,
        launch_us: 1.0,
        control_ms: 0.0,
        placement,
        ..Topology::preset("h200x8").unwrap()
    }
}

#[test]
fn two_ranks_over_nvlink_take_the_time_worked_out_by_hand() {
    // one bf16 tensor of 8192 x 8192 (128 MiB), one training rank, one inference rank on the
    // next GPU of the node; 64 MiB buckets: two NCCL steps of one contiguous bucket each (no
    // staging), each 10 us of latency then 64 MiB at 100 GB/s
    let cat = catalogue(&[vec![8192, 8192]]);
    let t = side(Side::Training, 1, 8192, 1).build(&cat);
    let i = side(Side::Inference, 1, 8192, 1).build(&cat);
    let pair = Pair {
        catalogue: &cat,
        training: &t,
        inference: &i,
        encode_on_sender: false,
    };
    let opts = Options {
        transport: Some(Transport::Nccl),
        bucket_bytes: 64 << 20,
        ..Options::default()
    };
    let r = simulate(&pair, &Names::default(), &topo(Placement::Packed), &opts).unwrap();
    let want = 2.0 * (10e-6 + (64u64 << 20) as f64 / 100e9);
    assert!(
        (r.transfer_s - want).abs() < 1e-9,
        "{} vs {want}",
        r.transfer_s
    );
    assert_eq!(r.sim.shape.steps_max, 2);
    assert_eq!(r.moved_bytes, 128 << 20);
    let b = r.busiest_link.as_ref().unwrap();
    assert_eq!(b.class, "nvlink-out");
    assert!((r.lower_bound_s - (128u64 << 20) as f64 / 100e9).abs() < 1e-12);

    // the same pair on one GPU over cuda-ipc: one copy of 128 MiB (under the 256 MiB piece
    // limit) issued after 1 us, at 1000 GB/s
    let opts = Options {
        transport: Some(Transport::CudaIpc),
        ..opts
    };
    let r = simulate(&pair, &Names::default(), &topo(Placement::Colocated), &opts).unwrap();
    let want = 1e-6 + (128u64 << 20) as f64 / 1000e9;
    assert!((r.transfer_s - want).abs() < 1e-9, "{}", r.transfer_s);
    assert_eq!(r.busiest_link.unwrap().class, "gpu-copy");
}

#[test]
fn staged_buckets_pay_the_first_pack_and_the_last_unpack() {
    // one 4096 x 4096 bf16 tensor (32 MiB) whole on both sides: one bucket of one contiguous
    // piece, sent and received in place: latency, then the wire
    let cat = catalogue(&[vec![4096, 4096]]);
    let t = side(Side::Training, 1, 4096, 1).build(&cat);
    let i = side(Side::Inference, 1, 4096, 1).build(&cat);
    let pair = Pair {
        catalogue: &cat,
        training: &t,
        inference: &i,
        encode_on_sender: false,
    };
    let opts = Options {
        transport: Some(Transport::Nccl),
        ..Options::default()
    };
    let r = simulate(&pair, &Names::default(), &topo(Placement::Packed), &opts).unwrap();
    // a single contiguous transfer: direct on both ends
    let mib32 = (32u64 << 20) as f64;
    let want = 10e-6 + mib32 / 100e9;
    assert!((r.transfer_s - want).abs() < 1e-9, "{}", r.transfer_s);

    // two tensors of 16 MiB in one 64 MiB bucket: two pieces, staged on both ends; time: pack
    // (32 MiB at 1000 GB/s), latency, wire (32 MiB at 100 GB/s), unpack
    let cat = catalogue(&[vec![2048, 4096], vec![2048, 4096]]);
    let t = side(Side::Training, 1, 2048, 2).build(&cat);
    let i = side(Side::Inference, 1, 2048, 2).build(&cat);
    let pair = Pair {
        catalogue: &cat,
        training: &t,
        inference: &i,
        encode_on_sender: false,
    };
    let r = simulate(&pair, &Names::default(), &topo(Placement::Packed), &opts).unwrap();
    let want = mib32 / 1000e9 + 10e-6 + mib32 / 100e9 + mib32 / 1000e9;
    assert!(
        (r.transfer_s - want).abs() < 1e-9,
        "{} vs {want}",
        r.transfer_s
    );
}

#[test]
fn the_topology_moves_the_bottleneck() {
    // 8 training ranks (a row split of 8 tensors) into 8 inference ranks (the same split):
    // rank k sends its 8 x 4 MiB to inference rank k
    let cat = catalogue(&vec![vec![8192, 2048]; 8]);
    let t = side(Side::Training, 8, 8192, 8).build(&cat);
    let i = side(Side::Inference, 8, 8192, 8).build(&cat);
    let pair = Pair {
        catalogue: &cat,
        training: &t,
        inference: &i,
        encode_on_sender: false,
    };
    let opts = Options {
        transport: Some(Transport::Nccl),
        ..Options::default()
    };
    let per_rank = (8192u64 * 2048 * 2) as f64; // 8 tensors x 1/8 of each
    // separate nodes, a NIC per GPU: every NIC carries one rank's bytes
    let r = simulate(&pair, &Names::default(), &topo(Placement::Separate), &opts).unwrap();
    let b = r.busiest_link.clone().unwrap();
    assert!(b.class.starts_with("nic"), "{b:?}");
    assert!((r.lower_bound_s - per_rank / 25e9).abs() < 1e-12);
    // one NIC per node: all 8 ranks share it, 8 x the bound
    let mut one = topo(Placement::Separate);
    one.nics_per_node = 1;
    let r1 = simulate(&pair, &Names::default(), &one, &opts).unwrap();
    assert_eq!(r1.busiest_link.as_ref().unwrap().name, "node0 nic0 out");
    assert!((r1.lower_bound_s - 8.0 * per_rank / 25e9).abs() < 1e-12);
    assert!(
        r1.transfer_s > 7.5 * r.transfer_s,
        "{} {}",
        r1.transfer_s,
        r.transfer_s
    );
    // both sides in one node of 16 GPUs: NVLink carries it
    let mut big = topo(Placement::Packed);
    big.gpus_per_node = 16;
    let r2 = simulate(&pair, &Names::default(), &big, &opts).unwrap();
    assert!(r2.busiest_link.unwrap().class.starts_with("nvlink"));
    assert!((r2.lower_bound_s - per_rank / 100e9).abs() < 1e-12);
}

#[test]
fn bad_requests_are_refused_with_the_fix_named() {
    let cat = catalogue(&[vec![64, 64]]);
    let t = side(Side::Training, 1, 64, 1).build(&cat);
    let i = side(Side::Inference, 1, 64, 1).build(&cat);
    let pair = Pair {
        catalogue: &cat,
        training: &t,
        inference: &i,
        encode_on_sender: false,
    };
    let nccl = Options {
        transport: Some(Transport::Nccl),
        ..Options::default()
    };
    let e = simulate(&pair, &Names::default(), &topo(Placement::Colocated), &nccl).unwrap_err();
    assert!(e.to_string().contains("use cuda-ipc"), "{e}");
    let ipc = Options {
        transport: Some(Transport::CudaIpc),
        ..Options::default()
    };
    let e = simulate(&pair, &Names::default(), &topo(Placement::Separate), &ipc).unwrap_err();
    assert!(e.to_string().contains("different nodes"), "{e}");
    let mut small = topo(Placement::Separate);
    small.nodes = 1;
    let e = simulate(&pair, &Names::default(), &small, &nccl).unwrap_err();
    assert!(e.to_string().contains("need 2 nodes"), "{e}");
}

#[test]
fn predictions_of_the_measured_runs_are_within_15_percent() {
    link_backends();
    let cal = Calibration::parse(DATA).unwrap();
    assert!(cal.run.len() >= 9);
    let mut worst = 0f64;
    for run in &cal.run {
        let p = run.predict_ms().unwrap();
        let err = (p - run.measured_ms) / run.measured_ms;
        println!(
            "{:<60} {:>9.2} ms measured {:>9.2} ms predicted {:>+6.1} %",
            run.name,
            run.measured_ms,
            p,
            err * 100.0
        );
        worst = worst.max(err.abs());
        assert!(
            err.abs() <= 0.15,
            "{}: predicted {p:.2} ms, measured {} ms",
            run.name,
            run.measured_ms
        );
    }
    println!("worst {:.1} %", worst * 100.0);
}

#[test]
fn cuda_ipc_receivers_reading_peer_after_peer_queue_on_one_sender() {
    // a 4096 x 8192 bf16 tensor (64 MiB) split in two row halves over 2 training ranks (GPUs 0
    // and 1); 2 inference engines of one rank each (GPUs 2 and 3) need all of it. Peer after
    // peer (`sequential`), both receivers read training rank 0, then training rank 1: each
    // sender's NVLink serves both, 2 x 32 MiB at a time. Concurrent (the transport's default)
    // or interleaved, every link runs full.
    use awex_sim::exec::PeerOrder;
    let mut cat_side = side(Side::Inference, 1, 4096, 1);
    cat_side.engines = 2;
    let cat = catalogue(&[vec![4096, 8192]]);
    let t = side(Side::Training, 2, 4096, 1).build(&cat);
    let i = cat_side.build(&cat);
    let pair = Pair {
        catalogue: &cat,
        training: &t,
        inference: &i,
        encode_on_sender: false,
    };
    let b = (64u64 << 20) as f64;
    let c = 100e9;
    let run = |peers: PeerOrder| {
        let opts = Options {
            transport: Some(Transport::CudaIpc),
            peers,
            ..Options::default()
        };
        simulate(&pair, &Names::default(), &topo(Placement::Packed), &opts).unwrap()
    };
    // (order, time worked out by hand: one graph launch of 1 us per peer, issued one after the
    // other by the host)
    for (peers, want) in [
        // the first peer's graph after 1 us, the second's after the first's 2 x 32 MiB
        (PeerOrder::Sequential, 1e-6 + 2.0 * b / c),
        // the second sender's link starts 1 us after the first's and carries 64 MiB
        (PeerOrder::Concurrent, 2e-6 + b / c),
        // one graph for both peers
        (PeerOrder::Interleaved, 1e-6 + b / c),
    ] {
        let r = run(peers);
        assert!(
            (r.transfer_s - want).abs() < 1e-9,
            "{peers:?}: {} vs {want}",
            r.transfer_s
        );
        assert!((r.lower_bound_s - b / c).abs() < 1e-12);
        assert_eq!(r.peer_order, peers.as_str());
    }
}

/// An FP8 inference side over nccl: the plans quantise on the sender (as nccl's FP8 path
/// will), so the wire carries e4m3 + scales and the bound follows those bytes.
#[test]
fn an_fp8_inference_side_moves_e4m3_and_scales_and_its_bound_follows() {
    use awex_core::encoding::{Fp8Config, InferFp8, Recipe};
    use awex_core::pair::PairSpec;
    link_backends();
    let fp8 = InferFp8::new(
        Fp8Config::from_hf(&serde_json::json!({
            "quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]
        }))
        .unwrap(),
        Recipe::Vllm,
    )
    .unwrap();
    let model = awex_core::model::presets::preset("qwen3-0.6b").unwrap();
    let spec = |f: Option<InferFp8>| PairSpec {
        model: model.clone(),
        train: "megatron:tp=2".parse().unwrap(),
        infer: "sglang:tp=2".parse().unwrap(),
        transport: Transport::Nccl,
        infer_fp8: f,
    };
    let opts = Options {
        transport: Some(Transport::Nccl),
        ..Options::default()
    };
    let topo = topo(Placement::Separate);
    let plain = spec(None).resolve().unwrap();
    let r0 = simulate(&plain.plan_pair(), &Names::default(), &topo, &opts).unwrap();
    assert!(r0.fp8.is_none());
    let p = spec(Some(fp8)).resolve().unwrap();
    let mut pair = p.plan_pair();
    pair.encode_on_sender = awex_sim::cli::encodes_on_sender(Transport::Nccl);
    assert!(pair.encode_on_sender);
    let r = simulate(&pair, &Names::default(), &topo, &opts).unwrap();
    let f = r.fp8.as_ref().unwrap();
    // tp 2 -> tp 2 in 128 x 128 blocks: every block is held whole by its sender
    assert_eq!(f.receiver_wire_bytes, 0);
    assert!(f.sender_e4m3_bytes > 0);
    // one fp32 scale per block of 16384 elements
    assert_eq!(f.sender_scale_bytes * 128 * 128 / 4, f.sender_e4m3_bytes);
    assert_eq!(
        r.moved_bytes,
        f.sender_e4m3_bytes + f.sender_scale_bytes + f.plain_bytes
    );
    // the linear weights' bf16 became e4m3 + scales, the rest moves as before
    assert_eq!(
        r0.moved_bytes,
        2 * f.sender_e4m3_bytes + f.plain_bytes,
        "{f:?}"
    );
    // the bound is the busiest link's bytes, which shrink as the plan's do
    let moved = r.moved_bytes as f64 / r0.moved_bytes as f64;
    let bound = r.lower_bound_s / r0.lower_bound_s;
    assert!(
        bound < 0.75 && (bound - moved).abs() < 0.05,
        "{bound} vs {moved}"
    );
    assert!(r.transfer_s < r0.transfer_s);
    assert!(r.ratio_to_bound >= 1.0 - 1e-9);
    // the text says what moved per encoding
    assert!(r.text().contains("sender-encoded"), "{}", r.text());
}
