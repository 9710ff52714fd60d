//! The FSDP2 / HSDP (+ TP) layout: what every training rank holds, under HF module names.
//!
//! Every parameter is a DTensor. With TP (2-D mesh) it is first split over the TP mesh
//! (colwise layers on dim 0, rowwise layers on dim 1, norms and the router replicated), then
//! FSDP shards the TP-local tensor's dim 0 over the DP mesh; HSDP replicate groups hold identical
//! copies. Both splits follow `torch.chunk`: chunk = ceil(n / parts), trailing ranks may hold
//! fewer rows or none. The mesh is `(replicate, dp, tp)`, row-major, tp fastest:
//! `rank = (rep * dp + dp_rank) * tp + tp_rank`.

use awex_core::DType;
use awex_core::layout::{
    Alike, AlikeKey, Dims, Holder, LayoutError, LocalTensor, Placement, RankId, RankLayout, Region,
    Side, SideLayout,
};
use awex_core::model::family::Sink;
use awex_core::model::{Canon, ModelSpec, Part, Role, Split as ExpertSplit};

use crate::transformers::Rules;

/// The module transformers 5 holds a MoE block under in memory, whatever the checkpoint calls it
/// (`conversion_mapping.py` renames Mixtral's `block_sparse_moe` to `mlp`): `mlp.gate` (the
/// router) and `mlp.experts` (`gate_up_proj`, `down_proj`).
const FUSED_MOE: &str = "mlp";
/// transformers 5's fused gate and up projections of every expert, under `{FUSED_MOE}.experts.`.
const FUSED_GATE_UP: &str = "gate_up_proj";
/// transformers 5's fused down projections of every expert, under `{FUSED_MOE}.experts.`.
const FUSED_DOWN: &str = "down_proj";

/// The parallel keys a live rank's parameter names decide: `fused_experts=1` when some name
/// ends in transformers 5's `mlp.experts.gate_up_proj` (the name [`FsdpLayout`] gives it);
/// nothing when none does (a dense model says nothing about its experts). Names may carry
/// any prefix, and wrapper segments (`_orig_mod.`) before the layer.
pub fn options_from_names(names: &[&str]) -> Vec<(&'static str, u64)> {
    let fused = names.iter().any(|n| {
        n.strip_suffix(FUSED_GATE_UP)
            .and_then(|n| n.strip_suffix(".experts."))
            .and_then(|n| n.strip_suffix(FUSED_MOE))
            .is_some_and(|n| n.ends_with('.'))
    });
    if fused {
        vec![("fused_experts", 1)]
    } else {
        Vec::new()
    }
}

/// The parts the FSDP layout places (each in the family's dtype for it, checked HF module
/// order); a family with any other part is refused by name.
const MAPPED: [Part; 49] = [
    Part::Embed,
    Part::LmHead,
    Part::FinalNorm,
    Part::InputNorm,
    Part::PostNorm,
    Part::Q,
    Part::K,
    Part::V,
    Part::QBias,
    Part::KBias,
    Part::VBias,
    Part::O,
    Part::OBias,
    Part::QNorm,
    Part::KNorm,
    Part::Gate,
    Part::Up,
    Part::Down,
    Part::Router,
    Part::RouterBias,
    Part::ExpertGate,
    Part::ExpertUp,
    Part::ExpertDown,
    Part::SharedGate,
    Part::SharedUp,
    Part::SharedDown,
    Part::QDown,
    Part::QDownNorm,
    Part::QUp,
    Part::KvDown,
    Part::KvDownNorm,
    Part::KvUp,
    Part::SharedExpertGate,
    Part::LinQkvz,
    Part::LinBa,
    Part::LinQkv,
    Part::LinZ,
    Part::LinB,
    Part::LinA,
    Part::LinConv,
    Part::LinALog,
    Part::LinDtBias,
    Part::LinNorm,
    Part::LinOut,
    Part::Sinks,
    Part::ExpertsGateUp,
    Part::ExpertsGateUpBias,
    Part::ExpertsDown,
    Part::ExpertsDownBias,
];

/// Where a part comes among its layer's HF parameters (`named_parameters()` order); with
/// transformers 5's fused experts, `mlp.experts` is declared before `mlp.gate`; shared experts
/// (`mlp.shared_experts`, GLM-4.5's `Glm4MoeMoE`) after both. The router's score-correction
/// bias is a buffer (`e_score_correction_bias`), listed after the router's weight.
/// DeepSeek-V3's multi-latent attention (`DeepseekV3Attention.__init__`,
/// transformers `models/deepseek_v3/modeling_deepseek_v3.py`) declares `q_proj` or
/// `q_a_proj`, `q_a_layernorm`, `q_b_proj`, then `kv_a_proj_with_mqa`, `kv_a_layernorm`,
/// `kv_b_proj`, then `o_proj`.
/// The hybrid Qwen models (transformers 5.19 `Qwen3NextGatedDeltaNet`, `Qwen3_5GatedDeltaNet`,
/// as `named_parameters()` lists them): `dt_bias`, `A_log`, `conv1d`, then Qwen3-Next's
/// `in_proj_qkvz`, `in_proj_ba`, `norm`, `out_proj`, or Qwen3.5's `norm`, `out_proj`,
/// `in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a` (a layer holds either these or
/// attention, so the ranks may repeat attention's); their MoE block declares the router
/// (`mlp.gate`) before the fused experts, then the shared expert and its gate.
/// gpt-oss (transformers 5.19 `GptOssAttention`, `GptOssMLP`, `GptOssExperts`): the attention's
/// own `sinks` before its projections, `mlp.router` (weight, bias) before `mlp.experts`
/// (`gate_up_proj`, `gate_up_proj_bias`, `down_proj`, `down_proj_bias`, the catalogue's order).
fn module_rank(part: Part, fused_experts: bool, hybrid: bool) -> u8 {
    use Part::*;
    match part {
        LinDtBias => 0,
        LinALog => 1,
        LinConv => 2,
        LinQkvz => 3,
        LinBa => 4,
        LinNorm => 5,
        LinOut => 6,
        LinQkv => 7,
        LinZ => 8,
        LinB => 9,
        LinA => 10,
        Router if hybrid => 19,
        Q => 0,
        QBias => 1,
        QDown => 2,
        QDownNorm => 3,
        QUp => 4,
        K => 5,
        KBias => 6,
        V => 7,
        VBias => 8,
        KvDown => 9,
        KvDownNorm => 10,
        KvUp => 11,
        O => 12,
        OBias => 13,
        QNorm => 14,
        KNorm => 15,
        Gate => 16,
        Up => 17,
        Down => 18,
        Router | RouterBias if fused_experts => 21,
        Router | RouterBias => 19,
        ExpertGate | ExpertUp | ExpertDown => 20,
        SharedGate => 23,
        SharedUp => 24,
        SharedDown => 25,
        SharedExpertGate => 26,
        InputNorm => 27,
        PostNorm => 28,
        _ => 22,
    }
}
use std::sync::Arc;

/// Whether transformers holds `part` as a buffer, not a parameter: the router's
/// score-correction bias (`e_score_correction_bias`: `nn.Buffer` in `Glm4MoeTopkRouter`,
/// `register_buffer` in `DeepseekV3TopkRouter`). FSDP2 shards parameters only (`fully_shard`
/// leaves buffers as they are), so every rank holds it whole. gpt-oss's router bias
/// (`GptOssTopKRouter.bias`) is an `nn.Parameter`, sharded like the others.
fn is_buffer(spec: &ModelSpec, part: Part) -> bool {
    part == Part::RouterBias && !spec.has(Part::ExpertsGateUp)
}

/// A parallel configuration the FSDP layout cannot describe.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum FsdpConfigError {
    /// A mesh dimension is 0.
    #[error("fsdp {key}=0 is not a valid mesh size; {key} must be at least 1")]
    Zero {
        /// the parallel key
        key: &'static str,
    },
    /// A mesh size or the world is above awex's limits.
    #[error(transparent)]
    Limit(#[from] awex_core::limits::LimitError),
    /// Fused experts (`mlp.experts.gate_up_proj`) with a TP mesh, which awex does not describe.
    #[error(
        "fsdp fused_experts=1 with tp={tp}: awex describes transformers' fused expert tensors sharded over dp only; use tp=1 (or experts with per-expert names)"
    )]
    FusedExpertsWithTp {
        /// tensor-parallel size
        tp: u64,
    },
    /// A model holding all its experts in one tensor per layer (gpt-oss) with a TP mesh.
    #[error(
        "fsdp tp={tp}: {class} holds each layer's experts in one tensor (`mlp.experts.gate_up_proj` [experts, hidden, 2 * intermediate], gate/up interleaved), which transformers' TP plan for it splits in a way awex does not describe; use tp=1 (FSDP shards those tensors by experts over dp)"
    )]
    StackedExpertsWithTp {
        /// the HF class
        class: &'static str,
        /// tensor-parallel size
        tp: u64,
    },
    /// The model has a part awex does not lay out for FSDP yet.
    #[error(
        "fsdp: {class} ({family}) has `{example}` ({part}), which awex does not map to FSDP's parameters yet"
    )]
    Unmapped {
        /// the HF class
        class: &'static str,
        /// the family
        family: &'static str,
        /// one tensor of the part
        example: String,
        /// the part
        part: &'static str,
    },
    /// Multi-latent attention with a TP mesh: transformers' DeepSeek-V3 TP plan splits no
    /// attention projection, which awex does not describe.
    #[error(
        "fsdp tp={tp} with {class}'s multi-latent attention: transformers' tensor-parallel plan for it (`base_model_tp_plan`) splits the MLP only and leaves q_a_proj/q_b_proj/kv_a_proj_with_mqa/kv_b_proj/o_proj whole, which awex does not describe; use tp=1 (FSDP over dp, HSDP with replicate)"
    )]
    MlaWithTp {
        /// the HF class
        class: &'static str,
        /// tensor-parallel size
        tp: u64,
    },
    /// Gated DeltaNet with a TP mesh, which awex does not describe yet.
    #[error(
        "fsdp tp={tp} with {class}'s Gated DeltaNet linear attention: transformers' tensor-parallel plan for it (`base_model_tp_plan`: in_proj_* `colwise_gather_output`, conv1d, A_log and dt_bias not named) is not described by awex yet; use tp=1 (FSDP over dp, HSDP with replicate)"
    )]
    LinearWithTp {
        /// the HF class
        class: &'static str,
        /// tensor-parallel size
        tp: u64,
    },
    /// A `transformers` value that names no release.
    #[error(transparent)]
    Transformers(#[from] crate::transformers::RulesError),
    /// Tensor parallelism must give every rank whole query and KV heads.
    #[error(
        "model has {heads} attention heads and {kv_heads} KV heads; fsdp tp={tp} needs both divisible by tp (a colwise q/k/v_proj shard must hold whole heads, in the model's query-to-KV ratio)"
    )]
    Heads {
        /// query heads
        heads: u64,
        /// KV heads
        kv_heads: u64,
        /// tensor-parallel size
        tp: u64,
    },
}

impl From<FsdpConfigError> for LayoutError {
    fn from(e: FsdpConfigError) -> Self {
        LayoutError::Config(e.to_string())
    }
}

/// How tensor parallelism splits a parameter before FSDP shards it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TpSplit {
    /// Colwise (and vocab-parallel embedding): split along dim 0.
    Rows,
    /// Rowwise: split along dim 1.
    Cols,
    /// Replicated over TP (norms, the MoE router).
    Replicated,
}

/// `[start, start + len)` of part `i` when `n` is split into `parts` with `torch.chunk` semantics.
pub fn chunk(n: u64, parts: u64, i: u64) -> (u64, u64) {
    let c = n.div_ceil(parts);
    let start = (i * c).min(n);
    let end = (start + c).min(n);
    (start, end - start)
}

/// The FSDP2 layout of every training rank for one model and `(replicate, dp, tp)`.
#[derive(Clone, Debug)]
pub struct FsdpLayout {
    spec: ModelSpec,
    dp: u32,
    replicate: u32,
    tp: u32,
    fused_experts: bool,
    /// with fused experts: each layer's fused tensor names, `[gate_up, down]`, made once (every
    /// expert's holder names one)
    fused_names: Vec<[Arc<str>; 2]>,
    rules: Rules,
}

/// A transformers 5 fused expert tensor (`Qwen3MoeExperts` in
/// `transformers/models/qwen3_moe/modeling_qwen3_moe.py`): `gate_up_proj` is
/// `[experts, 2 * moe_intermediate, hidden]` with expert e's gate rows then its up rows
/// (`linear(x, gate_up_proj[e]).chunk(2, dim=-1)` gives gate, up), `down_proj` is
/// `[experts, hidden, moe_intermediate]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Fused {
    /// `mlp.experts.gate_up_proj`
    GateUp,
    /// `mlp.experts.down_proj`
    Down,
}

/// One parameter's local tensor on a rank: its shape, and the canonical box it holds (if any).
struct Shard {
    shape: Dims,
    region: Option<Region>,
}

impl FsdpLayout {
    /// Checks the mesh sizes; builds no rank.
    pub fn new(
        spec: &ModelSpec,
        dp: u64,
        replicate: u64,
        tp: u64,
    ) -> Result<Self, FsdpConfigError> {
        for (key, v) in [("dp", dp), ("replicate", replicate), ("tp", tp)] {
            if v == 0 {
                return Err(FsdpConfigError::Zero { key });
            }
        }
        awex_core::limits::check_parallel(
            "fsdp",
            [("dp", dp), ("replicate", replicate), ("tp", tp)],
        )?;
        awex_core::limits::check_world(
            "fsdp",
            &[("replicate", replicate), ("dp", dp), ("tp", tp)],
        )?;
        if let Some(p) = spec.parts().into_iter().find(|p| !MAPPED.contains(p)) {
            let family = spec.architecture.family();
            return Err(FsdpConfigError::Unmapped {
                class: family.hf_class,
                family: family.name,
                example: (0..spec.num_layers)
                    .find_map(|l| family.names.name(Canon::at(p, l)))
                    .unwrap_or_default(),
                part: p.label(),
            });
        }
        // transformers' DeepseekV3Config.base_model_tp_plan (configuration_deepseek_v3.py) names
        // no attention projection: with tp > 1 MLA stays whole on every TP rank, while the
        // parts' roles split its up projections; refuse rather than describe it wrongly
        if spec.mla.is_some() && tp > 1 {
            return Err(FsdpConfigError::MlaWithTp {
                class: spec.architecture.family().hf_class,
                tp,
            });
        }
        if spec.has(Part::ExpertsGateUp) && tp > 1 {
            return Err(FsdpConfigError::StackedExpertsWithTp {
                class: spec.architecture.family().hf_class,
                tp,
            });
        }
        if spec.linear.is_some() && tp > 1 {
            return Err(FsdpConfigError::LinearWithTp {
                class: spec.architecture.family().hf_class,
                tp,
            });
        }
        // Transformers' TP plan (models/qwen3/configuration_qwen3.py, transformers 5.24) makes
        // q/k/v_proj colwise and o_proj rowwise; the attention reshapes each local projection
        // to (-1, head_dim) heads and repeats KV heads by the global
        // num_attention_heads / num_key_value_heads (models/qwen3/modeling_qwen3.py), and
        // `get_kv_heads_per_rank` (distributed/tensor_parallel.py) finds no valid sharding
        // when the KV heads do not divide by tp. So both head counts must divide by tp.
        if spec.num_heads % tp != 0 || spec.num_kv_heads % tp != 0 {
            return Err(FsdpConfigError::Heads {
                heads: spec.num_heads,
                kv_heads: spec.num_kv_heads,
                tp,
            });
        }
        Ok(FsdpLayout {
            spec: spec.clone(),
            dp: dp as u32,
            replicate: replicate as u32,
            tp: tp as u32,
            fused_experts: false,
            fused_names: Vec::new(),
            rules: Rules::default(),
        })
    }

    /// The same mesh with the dtypes transformers release `version` (`major * 100 + minor`)
    /// gives the parameters ([`crate::transformers`]): from 5.24 on, DeepSeek-V2/V3, Kimi-K2
    /// and GLM-4.5 hold their routers in fp32 in a bf16 or fp16 model.
    pub fn with_transformers(mut self, version: u64) -> Result<Self, FsdpConfigError> {
        self.rules = Rules::of_release(version)?;
        Ok(self)
    }

    /// The same mesh with MoE experts as transformers 5 holds them in memory: per layer one
    /// `mlp.experts.gate_up_proj` `[E, 2I, H]` and one `mlp.experts.down_proj` `[E, H, I]`,
    /// which FSDP2 shards on the expert dim, instead of transformers 4's per-expert
    /// `mlp.experts.{e}.gate_proj.weight`. The canonical tensors stay per-expert (the checkpoint's).
    /// A model whose checkpoint already holds all experts in one tensor per layer (gpt-oss) has
    /// the same names either way, so the key changes nothing for it.
    pub fn with_fused_experts(mut self, fused: bool) -> Result<Self, FsdpConfigError> {
        if self.spec.has(Part::ExpertsGateUp) {
            return Ok(self);
        }
        if fused && self.tp > 1 {
            return Err(FsdpConfigError::FusedExpertsWithTp {
                tp: u64::from(self.tp),
            });
        }
        self.fused_experts = fused;
        self.fused_names = if fused {
            (0..self.spec.num_layers)
                .map(|l| {
                    [FUSED_GATE_UP, FUSED_DOWN].map(|leaf| {
                        Arc::from(format!("model.layers.{l}.{FUSED_MOE}.experts.{leaf}"))
                    })
                })
                .collect()
        } else {
            Vec::new()
        };
        Ok(self)
    }

    /// Which fused expert tensor a local name is, and its layer.
    fn fused(&self, name: &str) -> Option<(u64, Fused)> {
        if !self.fused_experts {
            return None;
        }
        let (l, rest) = name.strip_prefix("model.layers.")?.split_once('.')?;
        let l = parse_index(l)?;
        if l >= self.spec.num_layers || !self.spec.is_moe_layer(l) {
            return None;
        }
        match rest.strip_prefix(FUSED_MOE)?.strip_prefix(".experts.")? {
            FUSED_GATE_UP => Some((l, Fused::GateUp)),
            FUSED_DOWN => Some((l, Fused::Down)),
            _ => None,
        }
    }

    /// The local tensor of a fused expert tensor on DP rank `dp_rank`: experts `torch.chunk`ed over dp.
    fn fused_tensor(&self, name: &str, l: u64, which: Fused, dp_rank: u32) -> LocalTensor {
        let s = &self.spec;
        let (h, e_all) = (s.hidden_size, s.num_experts());
        let mi = s.moe.as_ref().map_or(0, |m| m.moe_intermediate_size);
        let (e0, n) = chunk(e_all, u64::from(self.dp), u64::from(dp_rank));
        let names = s.names();
        let mut placements = Vec::new();
        for j in 0..n {
            let e = e0 + j;
            let canon = |part: Part| -> Arc<str> {
                Arc::from(names.name(Canon::expert_at(part, l, e)).unwrap_or_default())
            };
            match which {
                Fused::GateUp => {
                    for (i, part) in [Part::ExpertGate, Part::ExpertUp].into_iter().enumerate() {
                        placements.push(Placement {
                            canonical: canon(part),
                            region: Region::new([0, 0], [mi, h]),
                            local_offset: Dims::new(&[j, i as u64 * mi, 0]),
                            transposed: false,
                        });
                    }
                }
                Fused::Down => placements.push(Placement {
                    canonical: canon(Part::ExpertDown),
                    region: Region::new([0, 0], [h, mi]),
                    local_offset: Dims::new(&[j, 0, 0]),
                    transposed: false,
                }),
            }
        }
        let shape = match which {
            Fused::GateUp => Dims::new(&[n, 2 * mi, h]),
            Fused::Down => Dims::new(&[n, h, mi]),
        };
        LocalTensor {
            name: Arc::from(name),
            shape,
            dtype: s.dtype,
            encoding: awex_core::encoding::Encoding::Plain(s.dtype),
            placements,
        }
    }

    /// `(replicate, dp, tp)` coordinates of a global rank.
    pub fn coords(&self, rank: u32) -> (u32, u32, u32) {
        let tp_r = rank % self.tp;
        let rest = rank / self.tp;
        (rest / self.dp, rest % self.dp, tp_r)
    }

    /// The global rank at mesh coordinates `(rep, dp_rank, tp_rank)`.
    pub fn rank_of(&self, rep: u32, dp_rank: u32, tp_rank: u32) -> u32 {
        (rep * self.dp + dp_rank) * self.tp + tp_rank
    }

    fn world(&self) -> u64 {
        u64::from(self.replicate) * u64::from(self.dp) * u64::from(self.tp)
    }

    /// Every parameter in HF `named_parameters()` order: its local name and the canonical
    /// tensor it is (for fused experts, the first expert's gate or down projection).
    ///
    /// Within a layer HF modules come as `self_attn` (each projection's weight then bias, then
    /// the q/k norms), `mlp`, `input_layernorm`, `post_attention_layernorm`; the family lists
    /// the same parts in checkpoint order, so they are sorted by [`module_rank`].
    fn params(&self) -> Vec<(String, Canon)> {
        /// One layer's parts, experts expanded.
        struct Collect(Vec<Canon>);
        impl Sink for Collect {
            fn part(&mut self, c: Canon, _: Dims) {
                self.0.push(c);
            }
            fn experts(&mut self, l: u64, count: u64, parts: &[(Part, Dims)]) {
                for e in 0..count {
                    self.0
                        .extend(parts.iter().map(|(p, _)| Canon::expert_at(*p, l, e)));
                }
            }
        }
        let s = &self.spec;
        let names = s.names();
        let name = |c: Canon| names.name(c).unwrap_or_default();
        let mut v = vec![(name(Canon::global(Part::Embed)), Canon::global(Part::Embed))];
        let layer = s.architecture.family().layer;
        for l in 0..s.num_layers {
            let mut parts = Collect(Vec::new());
            layer(s, l, &mut parts);
            let mut parts = parts.0;
            parts.sort_by_key(|c| {
                // a module's own parameters (gpt-oss's `sinks`) before its children's
                (
                    c.part != Part::Sinks,
                    module_rank(c.part, self.fused_experts, self.spec.linear.is_some()),
                )
            });
            for c in parts {
                match c.part {
                    Part::ExpertGate | Part::ExpertUp | Part::ExpertDown if self.fused_experts => {
                        // one `gate_up_proj` and one `down_proj` for all experts
                        if c.expert() == Some(0) && c.part != Part::ExpertUp {
                            let leaf = if c.part == Part::ExpertDown {
                                FUSED_DOWN
                            } else {
                                FUSED_GATE_UP
                            };
                            v.push((format!("model.layers.{l}.{FUSED_MOE}.experts.{leaf}"), c));
                        }
                    }
                    _ => v.push((self.local_name(c), c)),
                }
            }
        }
        v.push((
            name(Canon::global(Part::FinalNorm)),
            Canon::global(Part::FinalNorm),
        ));
        if !s.tie_word_embeddings {
            v.push((
                name(Canon::global(Part::LmHead)),
                Canon::global(Part::LmHead),
            ));
        }
        v
    }

    /// The local name of a (not fused) parameter: its HF name, but the router of a layer with
    /// transformers 5's fused experts is `mlp.gate.weight` whatever the checkpoint calls it
    /// (and its bias `mlp.gate.e_score_correction_bias`).
    fn local_name(&self, c: Canon) -> String {
        match (c.part, c.layer()) {
            (Part::Router, Some(l)) if self.fused_experts => {
                format!("model.layers.{l}.{FUSED_MOE}.gate.weight")
            }
            (Part::RouterBias, Some(l)) if self.fused_experts => {
                format!("model.layers.{l}.{FUSED_MOE}.gate.e_score_correction_bias")
            }
            _ => self.spec.canonical_name(c).unwrap_or_default(),
        }
    }

    /// The full shape, the TP split and the dtype of canonical tensor `c`, when the model has
    /// it (the dtype the family gives the part, as the layout's transformers release holds it:
    /// the router's bias always fp32, the router fp32 from 5.24 on for the classes that say so).
    fn param(&self, c: Canon) -> Option<(Dims, TpSplit, DType)> {
        /// Finds one part's shape and dtype.
        struct Find(Part, Option<(Dims, Option<DType>)>);
        impl Sink for Find {
            fn part(&mut self, c: Canon, shape: Dims) {
                if c.part == self.0 {
                    self.1 = Some((shape, None));
                }
            }
            fn part_as(&mut self, c: Canon, shape: Dims, dtype: DType) {
                if c.part == self.0 {
                    self.1 = Some((shape, Some(dtype)));
                }
            }
            fn experts(&mut self, _: u64, _: u64, parts: &[(Part, Dims)]) {
                if let Some((_, shape)) = parts.iter().find(|(p, _)| *p == self.0) {
                    self.1 = Some((*shape, None));
                }
            }
        }
        let s = &self.spec;
        let (shape, dtype) = match c.layer() {
            None => match c.part {
                Part::LmHead if s.tie_word_embeddings => return None,
                Part::Embed | Part::LmHead => (Dims::new(&[s.vocab_size, s.hidden_size]), None),
                _ => (Dims::new(&[s.hidden_size]), None),
            },
            Some(l) if l >= s.num_layers => return None,
            Some(l) => {
                if c.expert().is_some_and(|e| e >= s.num_experts()) {
                    return None;
                }
                let mut f = Find(c.part, None);
                (s.architecture.family().layer)(s, l, &mut f);
                f.1?
            }
        };
        let split = match c.part.role() {
            Role::Vocab | Role::Column | Role::Expert(ExpertSplit::Column) => TpSplit::Rows,
            Role::Row | Role::Expert(ExpertSplit::Row) => TpSplit::Cols,
            // all experts in one tensor (gpt-oss): `new` refuses tp > 1 for them, so only
            // FSDP's dim-0 sharding applies
            Role::Replicated | Role::StackedExperts { .. } => TpSplit::Replicated,
        };
        let dtype = self.rules.dtype(s, c.part, dtype.unwrap_or(s.dtype));
        Some((shape, split, dtype))
    }

    fn shard(&self, shape: Dims, split: TpSplit, dp_rank: u32, tp_rank: u32) -> Shard {
        let (tp_local, origin) = self.tp_shard(shape, split, tp_rank);
        self.dp_shard(tp_local, origin, dp_rank)
    }

    /// The shape and the origin of TP rank `tp_rank`'s part of a parameter of `shape`.
    fn tp_shard(&self, shape: Dims, split: TpSplit, tp_rank: u32) -> (Dims, Dims) {
        let mut tp_local = shape;
        let mut origin = Dims::zeros(shape.ndim());
        let tp_dim = match split {
            TpSplit::Rows => Some(0),
            TpSplit::Cols => Some(1),
            TpSplit::Replicated => None,
        };
        if let Some(dim) = tp_dim {
            let (start, len) = chunk(shape.get(dim), u64::from(self.tp), u64::from(tp_rank));
            tp_local.set(dim, len);
            origin.set(dim, start);
        }
        (tp_local, origin)
    }

    /// DP rank `dp_rank`'s dim-0 chunk of a TP part ([`FsdpLayout::tp_shard`]).
    fn dp_shard(&self, tp_local: Dims, origin: Dims, dp_rank: u32) -> Shard {
        let (start, len) = chunk(tp_local.get(0), u64::from(self.dp), u64::from(dp_rank));
        let mut local = tp_local;
        local.set(0, len);
        let mut origin = origin;
        origin.set(0, origin.get(0) + start);
        let region = (local.numel() > 0).then_some(Region {
            offset: origin,
            extent: local,
        });
        Shard {
            shape: local,
            region,
        }
    }
}

/// Parses a decimal index as PyTorch module names write it (no sign, no leading zeros).
fn parse_index(s: &str) -> Option<u64> {
    if s.is_empty() || (s.len() > 1 && s.starts_with('0')) || !s.bytes().all(|b| b.is_ascii_digit())
    {
        return None;
    }
    s.parse().ok()
}

impl SideLayout for FsdpLayout {
    fn side(&self) -> Side {
        Side::Training
    }

    fn ranks(&self) -> Vec<RankId> {
        (0..self.world()).map(|r| RankId::train(r as u32)).collect()
    }

    fn world_size(&self) -> usize {
        self.world() as usize
    }

    fn rank_layout(&self, rank: RankId) -> Option<RankLayout> {
        if rank.engine != 0 || u64::from(rank.rank) >= self.world() {
            return None;
        }
        let (_, dp_rank, tp_rank) = self.coords(rank.rank);
        let tensors = self
            .params()
            .into_iter()
            .filter_map(|(name, c)| {
                if let Some((l, which)) = self.fused(&name) {
                    return Some(self.fused_tensor(&name, l, which, dp_rank));
                }
                let (shape, split, dtype) = self.param(c)?;
                let shard = if is_buffer(&self.spec, c.part) {
                    Shard {
                        shape,
                        region: Some(Region::full(shape)),
                    }
                } else {
                    self.shard(shape, split, dp_rank, tp_rank)
                };
                let canonical: Arc<str> = Arc::from(self.spec.canonical_name(c)?);
                let name: Arc<str> = if *name == *canonical {
                    canonical.clone()
                } else {
                    Arc::from(name)
                };
                let placements = shard
                    .region
                    .map(|region| Placement {
                        canonical: canonical.clone(),
                        region,
                        local_offset: Dims::zeros(shape.ndim()),
                        transposed: false,
                    })
                    .into_iter()
                    .collect();
                Some(LocalTensor {
                    name,
                    shape: shard.shape,
                    dtype,
                    encoding: awex_core::encoding::Encoding::Plain(dtype),
                    placements,
                })
            })
            .collect();
        Some(RankLayout { rank, tensors })
    }

    fn holders(&self, canonical: &str) -> Vec<Holder> {
        let mut out = Vec::new();
        self.holders_into(canonical, &mut out);
        out
    }

    /// The canonical tensors of `rank`'s shards without building them (what
    /// [`SideLayout::rank_layout`] places: every parameter whose shard on the rank is not
    /// empty, every buffer, and with fused experts the experts of the rank's DP chunk).
    fn for_each_canonical(&self, rank: RankId, f: &mut dyn FnMut(&str)) -> bool {
        if rank.engine != 0 || u64::from(rank.rank) >= self.world() {
            return false;
        }
        let (_, dp_rank, tp_rank) = self.coords(rank.rank);
        let names = self.spec.names();
        let held = |c: Canon| match self.param(c) {
            Some((shape, split, _)) => {
                is_buffer(&self.spec, c.part)
                    || self.shard(shape, split, dp_rank, tp_rank).region.is_some()
            }
            None => false,
        };
        // (`whole`: an expert of a fused expert tensor, whose shard is the rank's whole chunk)
        let mut put = |c: Canon, whole: bool| {
            if (whole || held(c))
                && let Some(name) = names.name(c)
            {
                f(&name);
            }
        };
        /// Hands every part of a layer on, its experts expanded (with fused experts, those of
        /// the rank's chunk, `(first, count)`).
        struct Each<'a>(&'a mut dyn FnMut(Canon, bool), Option<(u64, u64)>);
        impl Sink for Each<'_> {
            fn part(&mut self, c: Canon, _: Dims) {
                (self.0)(c, false);
            }
            fn experts(&mut self, l: u64, count: u64, parts: &[(Part, Dims)]) {
                let (first, n) = self.1.unwrap_or((0, count));
                for e in first..(first + n).min(count) {
                    for (p, _) in parts {
                        (self.0)(Canon::expert_at(*p, l, e), self.1.is_some());
                    }
                }
            }
        }
        put(Canon::global(Part::Embed), false);
        let s = &self.spec;
        for l in 0..s.num_layers {
            let fused = (self.fused_experts && s.is_moe_layer(l))
                .then(|| chunk(s.num_experts(), u64::from(self.dp), u64::from(dp_rank)));
            (s.architecture.family().layer)(s, l, &mut Each(&mut put, fused));
        }
        put(Canon::global(Part::FinalNorm), false);
        put(Canon::global(Part::LmHead), false);
        true
    }

    /// From the tensor's geometry: its kind, shape, TP split and dtype (an expert of fused
    /// tensors: its part, DP rank and place there), the mesh being the layout's own.
    fn alike(&self, canonical: &str) -> Option<Alike> {
        let g = self.geometry(canonical)?;
        Some(Alike {
            key: alike_key(&g)?,
            tensor: g.name().clone(),
        })
    }

    /// Every holder is written over one of `out`'s (its rank list refilled in place), so a
    /// tensor cut into every DP shard allocates no rank list once a tensor of as many shards
    /// came before.
    fn holders_into(&self, canonical: &str, out: &mut Vec<Holder>) {
        let mut put = Refill { out, n: 0 };
        self.fill_holders(canonical, &mut put);
        let n = put.n;
        out.truncate(n);
    }
}

/// Writes holders over a list's, from its start: each one's rank list is refilled in place.
struct Refill<'a> {
    out: &'a mut Vec<Holder>,
    /// holders written so far
    n: usize,
}

impl Refill<'_> {
    /// The next holder, with its rank list emptied for the caller to fill; every other field
    /// is the caller's to set ([`set`]).
    fn next(&mut self) -> &mut Holder {
        if self.n == self.out.len() {
            self.out.push(Holder {
                ranks: Vec::new(),
                tensor: Arc::from(""),
                tensor_shape: Dims::default(),
                dtype: DType::Bf16,
                region: Region {
                    offset: Dims::default(),
                    extent: Dims::default(),
                },
                local_offset: Dims::default(),
                transposed: false,
            });
        }
        let h = &mut self.out[self.n];
        self.n += 1;
        h.ranks.clear();
        h
    }
}

/// Sets every field of `h` but its rank list.
fn set(
    h: &mut Holder,
    tensor: &Arc<str>,
    tensor_shape: Dims,
    dtype: DType,
    region: Region,
    local_offset: Dims,
) {
    if !Arc::ptr_eq(&h.tensor, tensor) {
        h.tensor = tensor.clone();
    }
    h.tensor_shape = tensor_shape;
    h.dtype = dtype;
    h.region = region;
    h.local_offset = local_offset;
    h.transposed = false;
}

/// What one canonical tensor's holders are computed from ([`FsdpLayout::geometry`]): the
/// layout's `holders` and `alike` both read it, so that tensors of one [`Alike`] key have
/// equal holders by construction.
enum Geometry {
    /// One expert of a layer's fused expert tensor, on the DP rank `k` holding it (its `j`-th
    /// expert there; `up`: its up rows).
    Fused {
        name: Arc<str>,
        down: bool,
        up: bool,
        k: u32,
        j: u64,
        shape: Dims,
        region: Region,
        local_offset: Dims,
    },
    /// A buffer every rank holds whole.
    Buffer {
        name: Arc<str>,
        shape: Dims,
        dtype: DType,
    },
    /// A parameter split over TP, then sharded along dim 0 over DP.
    Param {
        name: Arc<str>,
        shape: Dims,
        split: TpSplit,
        dtype: DType,
    },
}

impl FsdpLayout {
    /// What the holders of `canonical` are computed from (`None`: not a tensor of this side).
    fn geometry(&self, canonical: &str) -> Option<Geometry> {
        let c = self.spec.names().parse(canonical)?;
        if self.fused_experts
            && let (Some(l), Some(e)) = (c.layer(), c.expert())
            && self.param(c).is_some()
        {
            // expert e's box of the fused tensor on the DP rank holding it (as
            // `fused_tensor` places it: its j-th expert, gate rows then up rows)
            let s = &self.spec;
            let (h, e_all) = (s.hidden_size, s.num_experts());
            let mi = s.moe.as_ref().map_or(0, |m| m.moe_intermediate_size);
            let per = e_all.div_ceil(u64::from(self.dp));
            let k = (e / per) as u32;
            let (e0, n) = chunk(e_all, u64::from(self.dp), u64::from(k));
            let j = e - e0;
            let (down, up) = (c.part == Part::ExpertDown, c.part == Part::ExpertUp);
            let (leaf, shape, region, local_offset) = if down {
                (
                    FUSED_DOWN,
                    Dims::new(&[n, h, mi]),
                    Region::new([0, 0], [h, mi]),
                    Dims::new(&[j, 0, 0]),
                )
            } else {
                (
                    FUSED_GATE_UP,
                    Dims::new(&[n, 2 * mi, h]),
                    Region::new([0, 0], [mi, h]),
                    Dims::new(&[j, u64::from(up) * mi, 0]),
                )
            };
            let name = match self.fused_names.get(l as usize) {
                Some(names) => names[usize::from(down)].clone(),
                None => Arc::from(format!("model.layers.{l}.{FUSED_MOE}.experts.{leaf}")),
            };
            return Some(Geometry::Fused {
                name,
                down,
                up,
                k,
                j,
                shape,
                region,
                local_offset,
            });
        }
        let (shape, split, dtype) = self.param(c)?;
        // the local name is the canonical name asked for, as `local_name` writes it (`parse`
        // accepts exactly what `HfNames::name` writes: a test pins it for every family), but
        // for the router of a layer with fused experts
        let name: Arc<str> = match (c.part, c.layer()) {
            (Part::Router | Part::RouterBias, Some(_)) if self.fused_experts => {
                Arc::from(self.local_name(c))
            }
            _ => Arc::from(canonical),
        };
        Some(if is_buffer(&self.spec, c.part) {
            Geometry::Buffer { name, shape, dtype }
        } else {
            Geometry::Param {
                name,
                shape,
                split,
                dtype,
            }
        })
    }

    /// The holders of `canonical` ([`SideLayout::holders`]), written through `put`.
    fn fill_holders(&self, canonical: &str, put: &mut Refill<'_>) {
        let s = &self.spec;
        match self.geometry(canonical) {
            None => {}
            Some(Geometry::Fused {
                name,
                k,
                shape,
                region,
                local_offset,
                ..
            }) => {
                let h = put.next();
                h.ranks
                    .extend((0..self.replicate).map(|rep| RankId::train(self.rank_of(rep, k, 0))));
                set(h, &name, shape, s.dtype, region, local_offset);
            }
            Some(Geometry::Buffer { name, shape, dtype }) => {
                let h = put.next();
                h.ranks
                    .extend((0..self.world()).map(|r| RankId::train(r as u32)));
                let local_offset = Dims::zeros(shape.ndim());
                set(h, &name, shape, dtype, Region::full(shape), local_offset);
            }
            Some(Geometry::Param {
                name,
                shape,
                split,
                dtype,
            }) => {
                // TP ranks that hold distinct shards, in `groups` of `count` ranks from
                // `first`: a replicated parameter's shard is shared by all TP ranks
                let (groups, count) = match split {
                    TpSplit::Replicated => (1, self.tp),
                    _ => (self.tp, 1),
                };
                put.out
                    .reserve((groups as usize * self.dp as usize).saturating_sub(put.out.len()));
                let local_offset = Dims::zeros(shape.ndim());
                for first in (0..groups).map(|g| g * count) {
                    let (tp_local, origin) = self.tp_shard(shape, split, first);
                    for k in 0..self.dp {
                        let shard = self.dp_shard(tp_local, origin, k);
                        let Some(region) = shard.region else {
                            continue;
                        };
                        let h = put.next();
                        for rep in 0..self.replicate {
                            for t in first..first + count {
                                h.ranks.push(RankId::train(self.rank_of(rep, k, t)));
                            }
                        }
                        set(h, &name, shard.shape, dtype, region, local_offset);
                    }
                }
            }
        }
    }
}

/// The [`Alike`] key of a geometry: every value its holders are computed from but the name
/// (the layout's mesh is the same for every tensor); `None` for a shape of more dims than the
/// key holds.
fn alike_key(g: &Geometry) -> Option<AlikeKey> {
    let dims = |d: &Dims, out: &mut [u64]| -> Option<()> {
        let v = d.as_slice();
        if v.len() >= out.len() {
            return None;
        }
        out[0] = v.len() as u64;
        out[1..=v.len()].copy_from_slice(v);
        Some(())
    };
    let mut key = [0u64; 8];
    match g {
        // (`n`, the region and the offset follow from `k`, `down`, `up` and `j`)
        Geometry::Fused { down, up, k, j, .. } => {
            key[..5].copy_from_slice(&[1, u64::from(*down), u64::from(*up), u64::from(*k), *j]);
        }
        Geometry::Buffer { shape, dtype, .. } => {
            key[..2].copy_from_slice(&[2, *dtype as u64]);
            dims(shape, &mut key[2..])?;
        }
        Geometry::Param {
            shape,
            split,
            dtype,
            ..
        } => {
            let split = match split {
                TpSplit::Rows => 0,
                TpSplit::Cols => 1,
                TpSplit::Replicated => 2,
            };
            key[..3].copy_from_slice(&[3, split, *dtype as u64]);
            dims(shape, &mut key[3..])?;
        }
    }
    Some(key)
}

impl Geometry {
    fn name(&self) -> &Arc<str> {
        match self {
            Geometry::Fused { name, .. }
            | Geometry::Buffer { name, .. }
            | Geometry::Param { name, .. } => name,
        }
    }
}
