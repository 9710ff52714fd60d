//! The nccl transport's construction errors, against the stub libnccl.

#[path = "../../awex-gpu/tests/stub_nccl/mod.rs"]
mod stub_nccl;

use awex_core::layout::{RankId, Side};
use awex_gpu::nccl::{CommWorld, NcclError};
use std::sync::Arc;
use stub_nccl::{load, stub};

#[cfg(not(feature = "cuda"))]
#[test]
fn without_cuda_the_transport_says_how_to_build_it() {
    use awex_core::plan::RankPlan;
    use awex_gpu::nccl::DeviceTensors;
    use awex_runtime::transport::{NcclConfig, NcclTransport};
    let Some((_d, path)) = stub(&[]) else { return };
    let lib = load(&path);
    let uid = lib.unique_id().unwrap();
    let plan = Arc::new(RankPlan {
        side: Side::Training,
        rank: RankId::train(0),
        peers: vec![],
        fingerprint: 0,
    });
    let cfg = NcclConfig::new(0, CommWorld::new(1, 1, 1).unwrap());
    let e = NcclTransport::new(lib, cfg, plan, Arc::new(DeviceTensors::default()), uid)
        .err()
        .expect("a build without CUDA cannot make the transport");
    assert_eq!(e, NcclError::NeedsCuda);
    assert_eq!(
        e.to_string(),
        "the nccl transport needs awex built with --features cuda"
    );
}

#[cfg(feature = "cuda")]
#[test]
fn with_cuda_but_no_driver_the_transport_says_so() {
    use awex_core::plan::RankPlan;
    use awex_gpu::nccl::DeviceTensors;
    use awex_runtime::transport::{NcclConfig, NcclTransport};
    if awex_gpu::cuda::driver_present() {
        eprintln!("libcuda is present here; this test covers machines without a driver");
        return;
    }
    let Some((_d, path)) = stub(&[]) else { return };
    let lib = load(&path);
    let uid = lib.unique_id().unwrap();
    let plan = Arc::new(RankPlan {
        side: Side::Training,
        rank: RankId::train(0),
        peers: vec![],
        fingerprint: 0,
    });
    let cfg = NcclConfig::new(0, CommWorld::new(1, 1, 1).unwrap());
    let e = NcclTransport::new(lib, cfg, plan, Arc::new(DeviceTensors::default()), uid)
        .err()
        .expect("no driver, no transport");
    assert!(matches!(
        e,
        NcclError::Cuda(awex_gpu::cuda::CudaError::NoDriver { .. })
    ));
}
