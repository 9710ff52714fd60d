//! Where the ranks run: the GPU transports' checks and the placement of ranks on GPUs.

use super::args::Args;
use anyhow::bail;
use awex_core::Transport;
use awex_core::layout::RankId;

/// Refuses the GPU transports where they cannot run, saying why: a build without CUDA, no
/// driver, no GPU, one of `gpus` missing, or (nccl) no usable NCCL library.
pub fn check_gpu_transport(transport: Transport, gpus: &[u32]) -> anyhow::Result<()> {
    if !transport.on_gpu() {
        return Ok(());
    }
    if !awex_gpu::cuda::BUILT {
        bail!(
            "this awex-cli was built without CUDA, so the demo cannot use `{transport}`; rebuild with `cargo build --release -p awex-cli --features cuda`, or use --transport shm or tcp"
        );
    }
    let count = awex_gpu::cuda::device_count()?;
    if let Some(&gpu) = gpus.iter().find(|&&g| g >= count) {
        bail!(awex_gpu::cuda::CudaError::NoSuchDevice {
            ordinal: gpu,
            count
        });
    }
    if transport == Transport::Nccl {
        awex_gpu::nccl::Library::load(crate::settings::transports()?.nccl_library.as_deref())?;
    }
    Ok(())
}

/// Why a CPU transport refuses the GPU flags, saying which flag applies to which transport.
pub fn cpu_transport_takes_no_gpu(transport: Transport) -> String {
    format!(
        "`{transport}` runs on the CPU and takes no GPU flags: --gpu applies to --transport cuda-ipc (the GPU of every rank) and nccl (the default of --train-gpus and --infer-gpus); --train-gpus and --infer-gpus apply to nccl only"
    )
}

/// Parses a comma list of GPU ordinals given to `flag`.
pub fn parse_gpus(flag: &str, list: &str) -> anyhow::Result<Vec<u32>> {
    let gpus: Vec<u32> = list
        .split(',')
        .map(|g| {
            g.trim().parse::<u32>().map_err(|_| {
                anyhow::anyhow!(
                    "{flag} takes a comma list of GPU ordinals such as `0,1`, but `{}` in `{list}` is not one",
                    g.trim()
                )
            })
        })
        .collect::<anyhow::Result<_>>()?;
    Ok(gpus)
}

/// The GPU of every rank: training rank `i` uses `train[i % len]`, inference rank `i`
/// (engine-major) `infer[i % len]`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Gpus {
    /// GPUs of the training ranks.
    pub train: Vec<u32>,
    /// GPUs of the inference ranks.
    pub infer: Vec<u32>,
}

impl Gpus {
    /// The placement the arguments ask for; `--train-gpus` / `--infer-gpus` only place the
    /// ranks of `--transport nccl` (cuda-ipc puts every rank on `--gpu`).
    pub fn of(a: &Args, transport: Transport) -> anyhow::Result<Gpus> {
        if !transport.on_gpu()
            && (a.gpu.is_some() || a.train_gpus.is_some() || a.infer_gpus.is_some())
        {
            bail!("{}", cpu_transport_takes_no_gpu(transport));
        }
        if transport != Transport::Nccl && (a.train_gpus.is_some() || a.infer_gpus.is_some()) {
            bail!(
                "--train-gpus and --infer-gpus place the ranks of --transport nccl; with `{transport}` use --gpu"
            );
        }
        let list = |flag: &str, v: &Option<String>| match v {
            Some(l) => parse_gpus(flag, l),
            None => Ok(vec![a.gpu()]),
        };
        Ok(Gpus {
            train: list("--train-gpus", &a.train_gpus)?,
            infer: list("--infer-gpus", &a.infer_gpus)?,
        })
    }

    /// The GPU of the `i`-th rank of `side`.
    pub fn of_rank(&self, side: awex_core::layout::Side, i: usize) -> u32 {
        let l = match side {
            awex_core::layout::Side::Training => &self.train,
            awex_core::layout::Side::Inference => &self.infer,
        };
        l.get(i % l.len().max(1)).copied().unwrap_or(0)
    }

    /// Every GPU named.
    pub fn all(&self) -> Vec<u32> {
        let mut g: Vec<u32> = self.train.iter().chain(&self.infer).copied().collect();
        g.sort_unstable();
        g.dedup();
        g
    }

    /// Refuses a placement with two ranks of the communicator (`training` then `inference`
    /// ranks, in rank order) on one GPU: NCCL rejects it at communicator init.
    pub fn refuse_shared(&self, training: &[RankId], inference: &[RankId]) -> anyhow::Result<()> {
        use awex_core::layout::Side;
        let name = |side: Side, r: RankId| match side {
            Side::Training => format!("training rank {}", r.rank),
            Side::Inference => format!("inference rank {r}"),
        };
        let mut used: std::collections::HashMap<u32, String> = Default::default();
        let ranks = training
            .iter()
            .enumerate()
            .map(|(i, &r)| (Side::Training, i, r))
            .chain(
                inference
                    .iter()
                    .enumerate()
                    .map(|(i, &r)| (Side::Inference, i, r)),
            );
        for (side, i, r) in ranks {
            let gpu = self.of_rank(side, i);
            let me = name(side, r);
            if let Some(first) = used.get(&gpu) {
                bail!(
                    "NCCL cannot put two ranks of one communicator on the same GPU: {first} and {me} would both use GPU {gpu}; give every rank its own GPU with --train-gpus and --infer-gpus (e.g. --train-gpus 0 --infer-gpus 1 for one rank a side)"
                );
            }
            used.insert(gpu, me);
        }
        Ok(())
    }
}

/// The NCCL setting the workers get unless the environment sets it: NVLink SHARP (NVLS) off,
/// since point-to-point transfers do not use it and its multicast setup can fail where the
/// fabric does not offer it. `None` when the user set `NCCL_NVLS_ENABLE`.
pub fn nccl_nvls_default(user: Option<&std::ffi::OsStr>) -> Option<(&'static str, &'static str)> {
    match user {
        Some(_) => None,
        None => Some(("NCCL_NVLS_ENABLE", "0")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_transports_need_no_gpu() {
        for t in [Transport::Shm, Transport::Tcp] {
            assert!(check_gpu_transport(t, &[7]).is_ok());
        }
    }

    fn args(transport: &str, extra: &[&str]) -> Args {
        use clap::Parser;
        #[derive(clap::Parser)]
        struct Cli {
            #[command(flatten)]
            a: Args,
        }
        let mut argv = vec!["demo", "--transport", transport];
        argv.extend_from_slice(extra);
        Cli::try_parse_from(argv).unwrap().a
    }

    #[test]
    fn gpu_lists_parse_and_rank_i_takes_entry_i_modulo_the_list() {
        assert_eq!(parse_gpus("--train-gpus", "0").unwrap(), vec![0]);
        assert_eq!(
            parse_gpus("--infer-gpus", "4, 5,6,7").unwrap(),
            vec![4, 5, 6, 7]
        );
        for bad in ["", "0,", "a", "0,-1", "1.5"] {
            let e = parse_gpus("--infer-gpus", bad).unwrap_err().to_string();
            assert!(
                e.starts_with(
                    "--infer-gpus takes a comma list of GPU ordinals such as `0,1`, but `"
                ) && e.ends_with(&format!("in `{bad}` is not one")),
                "{e}"
            );
        }
        assert_eq!(
            parse_gpus("--train-gpus", "0,x").unwrap_err().to_string(),
            "--train-gpus takes a comma list of GPU ordinals such as `0,1`, but `x` in `0,x` is not one"
        );
        let g = Gpus::of(
            &args("nccl", &["--train-gpus", "0,1", "--infer-gpus", "2,3,4"]),
            Transport::Nccl,
        )
        .unwrap();
        use awex_core::layout::Side;
        let train: Vec<u32> = (0..4).map(|i| g.of_rank(Side::Training, i)).collect();
        let infer: Vec<u32> = (0..4).map(|i| g.of_rank(Side::Inference, i)).collect();
        assert_eq!((train, infer), (vec![0, 1, 0, 1], vec![2, 3, 4, 2]));
        assert_eq!(g.all(), vec![0, 1, 2, 3, 4]);
        // both default to --gpu
        let d = Gpus::of(&args("nccl", &["--gpu", "3"]), Transport::Nccl).unwrap();
        assert_eq!(
            d,
            Gpus {
                train: vec![3],
                infer: vec![3]
            }
        );
    }

    #[test]
    fn placement_flags_are_refused_outside_nccl() {
        let e = Gpus::of(
            &args("cuda-ipc", &["--infer-gpus", "1"]),
            Transport::CudaIpc,
        )
        .unwrap_err();
        assert_eq!(
            e.to_string(),
            "--train-gpus and --infer-gpus place the ranks of --transport nccl; with `cuda-ipc` use --gpu"
        );
        // a CPU transport takes none of the GPU flags, --gpu included
        for t in [Transport::Shm, Transport::Tcp] {
            for flags in [
                &["--gpu", "1"][..],
                &["--train-gpus", "0"],
                &["--infer-gpus", "1"],
            ] {
                let e = Gpus::of(&args(t.as_str(), flags), t).unwrap_err();
                assert_eq!(
                    e.to_string(),
                    format!(
                        "`{t}` runs on the CPU and takes no GPU flags: --gpu applies to --transport cuda-ipc (the GPU of every rank) and nccl (the default of --train-gpus and --infer-gpus); --train-gpus and --infer-gpus apply to nccl only"
                    ),
                    "{flags:?}"
                );
            }
            Gpus::of(&args(t.as_str(), &[]), t).unwrap();
        }
    }

    #[test]
    fn two_ranks_on_one_gpu_are_refused_naming_both() {
        let t = |n: u32| (0..n).map(RankId::train).collect::<Vec<_>>();
        let i = |e: u32, n: u32| {
            (0..e)
                .flat_map(|e| (0..n).map(move |r| RankId::infer(e, r)))
                .collect::<Vec<_>>()
        };
        let g = |train: &[u32], infer: &[u32]| Gpus {
            train: train.to_vec(),
            infer: infer.to_vec(),
        };
        assert_eq!(
            g(&[0], &[0])
                .refuse_shared(&t(1), &i(1, 1))
                .unwrap_err()
                .to_string(),
            "NCCL cannot put two ranks of one communicator on the same GPU: training rank 0 and inference rank 0/0 would both use GPU 0; give every rank its own GPU with --train-gpus and --infer-gpus (e.g. --train-gpus 0 --infer-gpus 1 for one rank a side)"
        );
        // two training ranks wrapping onto one GPU
        let e = g(&[0], &[1]).refuse_shared(&t(2), &i(1, 1)).unwrap_err();
        assert!(
            e.to_string()
                .contains("training rank 0 and training rank 1 would both use GPU 0"),
            "{e}"
        );
        // the second engine's first rank wraps onto the first engine's GPU
        let e = g(&[0, 1], &[2, 3])
            .refuse_shared(&t(2), &i(2, 2))
            .unwrap_err();
        assert!(
            e.to_string()
                .contains("inference rank 0/0 and inference rank 1/0 would both use GPU 2"),
            "{e}"
        );
        g(&[0], &[1]).refuse_shared(&t(1), &i(1, 1)).unwrap();
        g(&[0, 1, 2, 3], &[4, 5, 6, 7])
            .refuse_shared(&t(4), &i(2, 2))
            .unwrap();
    }

    #[test]
    fn workers_get_nvls_off_unless_the_user_set_it() {
        assert_eq!(nccl_nvls_default(None), Some(("NCCL_NVLS_ENABLE", "0")));
        assert_eq!(nccl_nvls_default(Some(std::ffi::OsStr::new("1"))), None);
        assert_eq!(nccl_nvls_default(Some(std::ffi::OsStr::new(""))), None);
    }

    #[cfg(not(feature = "cuda"))]
    #[test]
    fn nccl_without_the_cuda_feature_says_the_binary_lacks_cuda() {
        assert_eq!(
            check_gpu_transport(Transport::Nccl, &[0, 1])
                .unwrap_err()
                .to_string(),
            "this awex-cli was built without CUDA, so the demo cannot use `nccl`; rebuild with `cargo build --release -p awex-cli --features cuda`, or use --transport shm or tcp"
        );
    }

    #[cfg(not(feature = "cuda"))]
    #[test]
    fn cuda_ipc_without_the_cuda_feature_says_the_binary_lacks_cuda() {
        assert_eq!(
            check_gpu_transport(Transport::CudaIpc, &[0])
                .unwrap_err()
                .to_string(),
            "this awex-cli was built without CUDA, so the demo cannot use `cuda-ipc`; rebuild with `cargo build --release -p awex-cli --features cuda`, or use --transport shm or tcp"
        );
    }

    #[cfg(feature = "cuda")]
    #[test]
    fn cuda_ipc_without_a_driver_says_no_cuda_driver_found() {
        if awex_gpu::cuda::driver_present() {
            eprintln!("libcuda is present here; the GPU demo covers this machine");
            return;
        }
        assert_eq!(
            check_gpu_transport(Transport::CudaIpc, &[0])
                .unwrap_err()
                .to_string(),
            "no CUDA driver found: libcuda could not be loaded (tried libcuda.so and libcuda.so.1 on the library search path); install the NVIDIA driver or run on a machine with a GPU"
        );
    }
}
