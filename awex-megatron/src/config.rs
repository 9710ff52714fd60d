//! The Megatron parallel configuration: accepted keys, validation against a model, the rank
//! mesh (tp-cp-ep-dp-pp order) and the assignment of layers to pipeline stages and chunks.

use awex_core::backend::{ParallelConfig, ParallelKey};
use awex_core::layout::{LayoutError, RankId};
use awex_core::model::ModelSpec;

/// Megatron's `make_vocab_size_divisible_by` default: the vocabulary is padded to a multiple of this times tp.
pub const VOCAB_DIVISIBLE_BY: u64 = 128;

/// The parallel keys `megatron:` accepts.
pub const KEYS: &[ParallelKey] = &[
    ParallelKey {
        name: "tp",
        default: Some(1),
        help: "tensor-parallel size (--tensor-model-parallel-size)",
    },
    ParallelKey {
        name: "pp",
        default: Some(1),
        help: "pipeline-parallel size (--pipeline-model-parallel-size)",
    },
    ParallelKey {
        name: "dp",
        default: Some(1),
        help: "data-parallel size (replicates parameters)",
    },
    ParallelKey {
        name: "cp",
        default: Some(1),
        help: "context-parallel size (--context-parallel-size; replicates parameters)",
    },
    ParallelKey {
        name: "ep",
        default: Some(1),
        help: "expert-parallel size (--expert-model-parallel-size)",
    },
    ParallelKey {
        name: "etp",
        default: None,
        help: "expert tensor-parallel size (--expert-tensor-parallel-size); defaults to tp",
    },
    ParallelKey {
        name: "vpp",
        default: Some(1),
        help: "virtual pipeline chunks per stage (interleaved schedule)",
    },
    ParallelKey {
        name: "first_stage_layers",
        default: None,
        help: "layers on the first pipeline stage (--decoder-first-pipeline-num-layers)",
    },
    ParallelKey {
        name: "last_stage_layers",
        default: None,
        help: "layers on the last pipeline stage (--decoder-last-pipeline-num-layers)",
    },
    ParallelKey {
        name: "fp32",
        default: Some(0),
        help: "1 when parameters are fp32 (no --bf16); the sender converts",
    },
    ParallelKey {
        name: "local_spec",
        default: Some(0),
        help: "1 for Megatron-Core's local (non-Transformer-Engine) layer spec: separate input_layernorm / pre_mlp_layernorm",
    },
    ParallelKey {
        name: "grouped_gemm",
        default: None,
        help: "MoE experts: 1 for TEGroupedMLP (--moe-grouped-gemm: mlp.experts.linear_fc1.weight{j}), 0 for SequentialMLP (mlp.experts.local_experts.{j}.linear_fc1.weight); defaults to 1 with Transformer Engine, 0 with local_spec=1 (the local spec always builds SequentialMLP)",
    },
    ParallelKey {
        name: "single_grouped_weight",
        default: Some(0),
        help: "1 when TEGroupedMLP keeps each layer's experts in one stacked parameter (moe_single_grouped_weight: mlp.experts.linear_fc1.weight [experts, rows, hidden]); needs grouped_gemm=1",
    },
];

/// How a MoE layer's experts are stored, which decides their parameter names.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ExpertLayout {
    /// `TEGroupedMLP` (`megatron/core/transformer/moe/experts.py`) over TE's `GroupedLinear`:
    /// one parameter per local expert, `mlp.experts.linear_fc1.weight{j}`.
    Grouped,
    /// `TEGroupedMLP` with `moe_single_grouped_weight`: one stacked parameter per layer,
    /// `mlp.experts.linear_fc1.weight` of shape `[local experts, rows, cols]`.
    SingleGrouped,
    /// `SequentialMLP` (`megatron/core/transformer/moe/experts.py`): a `ModuleList` of `MLP`s,
    /// `mlp.experts.local_experts.{j}.linear_fc1.weight`.
    Sequential,
}

fn config_error(message: String) -> LayoutError {
    LayoutError::Config(message)
}

/// A resolved Megatron parallel configuration (defaults applied, sizes checked to be non-zero).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Config {
    /// Tensor-parallel size.
    pub tp: u64,
    /// Pipeline-parallel size.
    pub pp: u64,
    /// Data-parallel size.
    pub dp: u64,
    /// Context-parallel size.
    pub cp: u64,
    /// Expert-parallel size.
    pub ep: u64,
    /// Expert tensor-parallel size.
    pub etp: u64,
    /// Virtual pipeline chunks per stage.
    pub vpp: u64,
    /// Layers on the first stage, when set explicitly.
    pub first_stage_layers: Option<u64>,
    /// Layers on the last stage, when set explicitly.
    pub last_stage_layers: Option<u64>,
    /// Parameters are fp32 rather than the model dtype.
    pub fp32: bool,
    /// The model uses the local layer spec (norms are modules of their own, not fused into the linears).
    pub local_spec: bool,
    /// How MoE experts are stored.
    pub experts: ExpertLayout,
}

impl Config {
    /// Resolves a parallel config: rejects unknown keys and zero sizes, applies defaults (etp = tp).
    pub fn resolve(parallel: &ParallelConfig) -> Result<Config, LayoutError> {
        let p = parallel
            .checked(KEYS, "megatron")
            .map_err(|e| config_error(e.to_string()))?;
        let size = |key: &str| -> Result<u64, LayoutError> {
            match p.get_or(key, 1) {
                0 => Err(config_error(format!(
                    "megatron {key}=0; every parallel size must be at least 1"
                ))),
                v => Ok(v),
            }
        };
        let tp = size("tp")?;
        let stage_layers = |key: &str| -> Result<Option<u64>, LayoutError> {
            match p.get(key) {
                Some(0) => Err(config_error(format!(
                    "megatron {key}=0; a pipeline stage needs at least 1 layer"
                ))),
                v => Ok(v),
            }
        };
        let fp32 = match p.get_or("fp32", 0) {
            0 => false,
            1 => true,
            v => {
                return Err(config_error(format!(
                    "megatron fp32={v}; use fp32=1 for fp32 parameters or fp32=0 for the model dtype"
                )));
            }
        };
        let local_spec = match p.get_or("local_spec", 0) {
            0 => false,
            1 => true,
            v => {
                return Err(config_error(format!(
                    "megatron local_spec={v}; use local_spec=1 for the local layer spec or local_spec=0 for Transformer Engine"
                )));
            }
        };
        let flag = |key: &str, default: u64, meaning: &str| -> Result<bool, LayoutError> {
            match p.get_or(key, default) {
                0 => Ok(false),
                1 => Ok(true),
                v => Err(config_error(format!(
                    "megatron {key}={v}; use {key}=1 for {meaning} or {key}=0 for not"
                ))),
            }
        };
        let grouped = flag(
            "grouped_gemm",
            if local_spec { 0 } else { 1 },
            "TEGroupedMLP experts",
        )?;
        let single = flag(
            "single_grouped_weight",
            0,
            "one stacked expert parameter per layer",
        )?;
        if grouped && local_spec {
            return Err(config_error(
                "megatron grouped_gemm=1 with local_spec=1: the local layer spec always builds SequentialMLP experts (LocalSpecProvider.grouped_mlp_modules); use grouped_gemm=0"
                    .to_string(),
            ));
        }
        let experts = match (grouped, single) {
            (true, false) => ExpertLayout::Grouped,
            (true, true) => ExpertLayout::SingleGrouped,
            (false, false) => ExpertLayout::Sequential,
            (false, true) => {
                return Err(config_error(
                    "megatron single_grouped_weight=1 needs grouped_gemm=1 (Megatron-Core requires moe_grouped_gemm for moe_single_grouped_weight)"
                        .to_string(),
                ));
            }
        };
        let cfg = Config {
            experts,
            tp,
            pp: size("pp")?,
            dp: size("dp")?,
            cp: size("cp")?,
            ep: size("ep")?,
            etp: match p.get("etp") {
                None => tp,
                Some(_) => size("etp")?,
            },
            vpp: size("vpp")?,
            first_stage_layers: stage_layers("first_stage_layers")?,
            last_stage_layers: stage_layers("last_stage_layers")?,
            fp32,
            local_spec,
        };
        // every size is within awex_core::limits (`checked` above); so is their product
        awex_core::limits::check_world(
            "megatron",
            &[
                ("tp", cfg.tp),
                ("cp", cfg.cp),
                ("dp", cfg.dp),
                ("pp", cfg.pp),
            ],
        )
        .map_err(|e| config_error(e.to_string()))?;
        Ok(cfg)
    }

    /// Ranks of one pipeline stage (`tp * cp * dp`).
    pub fn stage_size(&self) -> u64 {
        self.tp * self.cp * self.dp
    }

    /// Number of training ranks (`tp * cp * dp * pp`).
    pub fn world_size(&self) -> u64 {
        self.stage_size() * self.pp
    }

    /// Expert data-parallel size: the stage's ranks over `etp * ep`.
    pub fn edp(&self) -> u64 {
        self.stage_size() / (self.etp * self.ep)
    }

    /// The coordinates of a global rank (which must be below the world size).
    pub fn coord(&self, global: u64) -> Coord {
        let s = global % self.stage_size();
        Coord {
            tp: s % self.tp,
            cp: (s / self.tp) % self.cp,
            dp: s / (self.tp * self.cp),
            pp: global / self.stage_size(),
            etp: s % self.etp,
            ep: (s / self.etp) % self.ep,
            edp: s / (self.etp * self.ep),
        }
    }

    /// Every rank of pipeline stage `pp` (the replicas of a stage-replicated parameter).
    pub fn stage_ranks(&self, pp: u64) -> Vec<RankId> {
        let s = self.stage_size();
        (pp * s..(pp + 1) * s)
            .map(|r| RankId::train(r as u32))
            .collect()
    }

    /// The ranks of stage `pp` with tensor-parallel rank `tp_rank`: its DP x CP replicas, ascending.
    pub fn tp_ranks(&self, pp: u64, tp_rank: u64) -> Vec<RankId> {
        let mut v = Vec::with_capacity((self.dp * self.cp) as usize);
        for dp in 0..self.dp {
            for cp in 0..self.cp {
                let g = tp_rank + self.tp * (cp + self.cp * (dp + self.dp * pp));
                v.push(RankId::train(g as u32));
            }
        }
        v
    }

    /// The ranks of stage `pp` with expert coordinates (`ep_rank`, `etp_rank`): its EDP replicas, ascending.
    pub fn expert_ranks(&self, pp: u64, ep_rank: u64, etp_rank: u64) -> Vec<RankId> {
        let base = pp * self.stage_size();
        (0..self.edp())
            .map(|edp| {
                let g = base + etp_rank + self.etp * (ep_rank + self.ep * edp);
                RankId::train(g as u32)
            })
            .collect()
    }
}

/// Where one global rank sits in the decoder mesh and in its stage's expert mesh.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Coord {
    /// Tensor-parallel rank.
    pub tp: u64,
    /// Context-parallel rank.
    pub cp: u64,
    /// Data-parallel rank.
    pub dp: u64,
    /// Pipeline stage.
    pub pp: u64,
    /// Expert tensor-parallel rank.
    pub etp: u64,
    /// Expert-parallel rank.
    pub ep: u64,
    /// Expert data-parallel rank.
    pub edp: u64,
}

/// The sizes of a model's tensors as Megatron shards them, checked against a config.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Geometry {
    /// Hidden size.
    pub hidden: u64,
    /// Size of one head.
    pub head_dim: u64,
    /// Rows of q_proj.
    pub q_rows: u64,
    /// Rows of k_proj (and v_proj).
    pub kv_rows: u64,
    /// Query rows of one query group.
    pub group_q_rows: u64,
    /// Rows of one query group in linear_qkv: its queries, one key head, one value head.
    pub group_rows: u64,
    /// Rows of linear_qkv on one TP rank.
    pub qkv_local_rows: u64,
    /// Real vocabulary size.
    pub vocab: u64,
    /// Vocabulary rows on one TP rank (padded vocabulary / tp).
    pub vocab_local_rows: u64,
    /// Dense intermediate size.
    pub inter: u64,
    /// Dense intermediate rows on one TP rank.
    pub inter_local: u64,
    /// Routed experts per MoE layer.
    pub experts: u64,
    /// Experts on one EP rank.
    pub experts_local: u64,
    /// One expert's intermediate size.
    pub moe_inter: u64,
    /// One expert's intermediate rows on one ETP rank.
    pub moe_inter_local: u64,
    /// The shared experts' intermediate rows on one TP rank (0: no shared experts).
    pub shared_inter_local: u64,
    /// Input columns of the attention output projection (`linear_proj`) on one TP rank.
    pub o_cols_local: u64,
    /// Multi-latent attention's sizes (`None`: grouped-query attention).
    pub mla: Option<MlaGeometry>,
}

/// The sizes of multi-latent attention's tensors as Megatron-Core shards them
/// (`MLASelfAttention.__init__`, megatron/core/transformer/multi_latent_attention.py).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MlaGeometry {
    /// Rows of the query down projection (`q_lora_rank`).
    pub q_lora: u64,
    /// Rows of the key/value down projection: `kv_lora_rank + qk_rope_head_dim`.
    pub kv_down_rows: u64,
    /// `kv_lora_rank`: the size of the key/value latent and its norm.
    pub kv_lora: u64,
    /// Rows of the query up projection on one TP rank: its heads' `nope + rope` rows, per head.
    pub q_rows_local: u64,
    /// Rows of the key/value up projection on one TP rank: its heads' `nope + v` rows, per head.
    pub kv_up_rows_local: u64,
    /// Rows of each down projection on one TP rank: a 1/tp slice with the local spec
    /// (`ColumnParallelLinear`), all of them with Transformer Engine (`TELinear`, duplicated).
    pub down_split: u64,
}

impl Geometry {
    /// Checks that `cfg` can shard `model` and computes the local sizes.
    pub fn new(model: &ModelSpec, cfg: &Config) -> Result<Geometry, LayoutError> {
        let tp = cfg.tp;
        let (nq, ng, hd) = (model.num_heads, model.num_kv_heads, model.head_dim);
        if nq == 0 || ng == 0 || hd == 0 || model.hidden_size == 0 || model.vocab_size == 0 {
            return Err(config_error(format!(
                "model `{}` has a zero size (heads={nq}, kv_heads={ng}, head_dim={hd}, hidden={}, vocab={})",
                model.name, model.hidden_size, model.vocab_size
            )));
        }
        if nq % ng != 0 {
            return Err(config_error(format!(
                "model has {nq} attention heads and {ng} KV heads; num_attention_heads must be a multiple of num_query_groups"
            )));
        }
        if nq % tp != 0 {
            return Err(config_error(format!(
                "model has {nq} attention heads; megatron tp={tp} needs num_attention_heads divisible by tp"
            )));
        }
        if ng % tp != 0 && tp % ng != 0 {
            return Err(config_error(format!(
                "model has {ng} KV heads; megatron tp={tp} needs num_query_groups divisible by tp (or tp a multiple of it)"
            )));
        }
        let group_q_rows = nq / ng * hd;
        let group_rows = group_q_rows + 2 * hd;
        let qkv_rows = group_rows * ng;
        if qkv_rows % tp != 0 {
            return Err(config_error(format!(
                "model has {ng} KV heads and {nq} query heads of head_dim {hd}: the {qkv_rows} rows of linear_qkv do not split evenly over megatron tp={tp}"
            )));
        }
        let dense = (0..model.num_layers).any(|l| !model.is_moe_layer(l));
        if dense && (model.intermediate_size == 0 || model.intermediate_size % tp != 0) {
            return Err(config_error(format!(
                "model has intermediate_size {}; megatron tp={tp} needs it divisible by tp (and non-zero)",
                model.intermediate_size
            )));
        }
        let (experts, moe_inter) = match &model.moe {
            Some(m) => (m.num_experts, m.moe_intermediate_size),
            None => (0, 0),
        };
        if model.moe.is_some() {
            if experts == 0 || experts % cfg.ep != 0 {
                return Err(config_error(format!(
                    "model has {experts} experts; megatron ep={} needs num_experts divisible by ep (and non-zero)",
                    cfg.ep
                )));
            }
            if moe_inter == 0 || moe_inter % cfg.etp != 0 {
                return Err(config_error(format!(
                    "model has moe_intermediate_size {moe_inter}; megatron etp={} needs it divisible by etp (and non-zero)",
                    cfg.etp
                )));
            }
        }
        // the shared experts are an MLP split over tp (`SharedExpertMLP`,
        // megatron/core/transformer/moe/shared_experts.py: `tp_group=pg_collection.tp`)
        let shared = model.moe.as_ref().map_or(0, |m| m.shared_intermediate_size);
        if shared % tp != 0 {
            return Err(config_error(format!(
                "model has shared experts of intermediate size {shared}; megatron tp={tp} needs it divisible by tp"
            )));
        }
        let per_stage = cfg.stage_size();
        if per_stage % (cfg.etp * cfg.ep) != 0 {
            return Err(config_error(format!(
                "megatron tp*cp*dp = {}*{}*{} = {per_stage} ranks per pipeline stage is not divisible by etp*ep = {}*{} = {}",
                cfg.tp,
                cfg.cp,
                cfg.dp,
                cfg.etp,
                cfg.ep,
                cfg.etp * cfg.ep
            )));
        }
        let mla = match &model.mla {
            None => None,
            Some(a) => Some(Self::mla(a, nq, cfg)?),
        };
        let o_cols = match &model.mla {
            Some(a) => nq * a.v_head_dim,
            None => nq * hd,
        };
        let multiple = VOCAB_DIVISIBLE_BY * tp;
        let padded = model.vocab_size.div_ceil(multiple) * multiple;
        Ok(Geometry {
            o_cols_local: o_cols / tp,
            mla,
            hidden: model.hidden_size,
            head_dim: hd,
            q_rows: nq * hd,
            kv_rows: ng * hd,
            group_q_rows,
            group_rows,
            qkv_local_rows: qkv_rows / tp,
            vocab: model.vocab_size,
            vocab_local_rows: padded / tp,
            inter: model.intermediate_size,
            inter_local: model.intermediate_size / tp,
            experts,
            experts_local: if experts == 0 { 0 } else { experts / cfg.ep },
            moe_inter,
            moe_inter_local: moe_inter / cfg.etp,
            shared_inter_local: shared / tp,
        })
    }
}

impl Geometry {
    /// MLA's local sizes: the up projections split by heads over tp (`nq % tp` is checked
    /// before); with the local spec the down projections are `ColumnParallelLinear`s too
    /// (`get_gpt_layer_local_submodules`), so their rows must split evenly over tp.
    fn mla(
        a: &awex_core::model::MlaSpec,
        nq: u64,
        cfg: &Config,
    ) -> Result<MlaGeometry, LayoutError> {
        let tp = cfg.tp;
        // With the latent norms on (`qk_layernorm`, which the kv norm needs),
        // `QKNormConfigResolver._resolve_mla_qk_layernorm`
        // (megatron/core/transformer/mla_qk_norm_config.py) makes `linear_q_proj` a fused
        // norm + linear: Transformer Engine's carries a `layer_norm_weight` over the hidden
        // state that no HF checkpoint has, and the local spec has no such module (the build
        // fails). With them off there is no kv norm. Either way not the HF model.
        let Some(q_lora) = a.q_lora_rank else {
            return Err(config_error(
                "model has multi-latent attention without q_lora_rank (a plain q_proj); Megatron-Core 0.19 cannot build it as the HF model: with the latent norms on (qk_layernorm, needed for kv_a_layernorm) QKNormConfigResolver makes linear_q_proj a fused norm + linear whose layer_norm_weight has no tensor in the checkpoint (Transformer Engine), or fails to build (local spec); awex supports Megatron MLA with q_lora_rank"
                    .to_string(),
            ));
        };
        let kv_down_rows = a.kv_lora_rank + a.qk_rope_head_dim;
        let down_split = if cfg.local_spec { tp } else { 1 };
        if cfg.local_spec {
            let downs = [
                ("q_lora_rank", q_lora, "linear_q_down_proj"),
                (
                    "kv_lora_rank + qk_rope_head_dim",
                    kv_down_rows,
                    "linear_kv_down_proj",
                ),
            ];
            for (what, rows, module) in downs {
                if rows % tp != 0 {
                    return Err(config_error(format!(
                        "model has {what} = {rows}; megatron tp={tp} with local_spec=1 splits {module} (a ColumnParallelLinear) over tp, which needs it divisible by tp (Transformer Engine's spec keeps it whole: local_spec=0)"
                    )));
                }
            }
        }
        let heads_local = nq / tp;
        Ok(MlaGeometry {
            q_lora,
            kv_down_rows,
            kv_lora: a.kv_lora_rank,
            q_rows_local: heads_local * (a.qk_nope_head_dim + a.qk_rope_head_dim),
            kv_up_rows_local: heads_local * (a.qk_nope_head_dim + a.v_head_dim),
            down_split,
        })
    }
}

/// Layers of the model split into model chunks: chunk `c` lives on stage `c % pp` as virtual chunk `c / pp`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Chunks {
    /// `starts[c]..starts[c + 1]` are the global layers of chunk `c` (length `pp * vpp + 1`).
    starts: Vec<u64>,
    pp: u64,
}

/// Where one layer lives: stage, virtual chunk, and its index within that chunk.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LayerPlace {
    /// Pipeline stage.
    pub stage: u64,
    /// Virtual chunk on that stage.
    pub chunk: u64,
    /// Layer index local to the chunk (as in `decoder.layers.{i}`).
    pub local: u64,
}

impl Chunks {
    /// Splits `layers` over the stages (and virtual chunks) of `cfg`.
    pub fn new(layers: u64, cfg: &Config) -> Result<Chunks, LayoutError> {
        let (pp, vpp) = (cfg.pp, cfg.vpp);
        let (first, last) = (cfg.first_stage_layers, cfg.last_stage_layers);
        let explicit = first.is_some() || last.is_some();
        let describe_explicit = || {
            let mut parts = Vec::new();
            if let Some(f) = first {
                parts.push(format!("first_stage_layers={f}"));
            }
            if let Some(l) = last {
                parts.push(format!("last_stage_layers={l}"));
            }
            parts.join(" and ")
        };
        if vpp > 1 {
            if explicit {
                return Err(config_error(format!(
                    "megatron vpp={vpp} cannot be combined with {}; use an even split",
                    describe_explicit()
                )));
            }
            if pp == 1 {
                return Err(config_error(format!(
                    "megatron vpp={vpp} needs pp > 1 (the interleaved schedule splits pipeline stages)"
                )));
            }
            let chunks = pp * vpp;
            if layers % chunks != 0 {
                return Err(config_error(format!(
                    "model has {layers} layers; megatron pp={pp} vpp={vpp} needs num_layers divisible by pp*vpp = {chunks}"
                )));
            }
            let per = layers / chunks;
            return Ok(Chunks {
                starts: (0..=chunks).map(|c| c * per).collect(),
                pp,
            });
        }
        if !explicit {
            if layers % pp != 0 {
                return Err(config_error(format!(
                    "model has {layers} layers; megatron pp={pp} needs num_layers divisible by pp (or first_stage_layers / last_stage_layers)"
                )));
            }
            let per = layers / pp;
            return Ok(Chunks {
                starts: (0..=pp).map(|c| c * per).collect(),
                pp,
            });
        }
        if pp == 1 {
            return Err(config_error(format!(
                "megatron {} need pp > 1 (pp=1 puts every layer on one stage)",
                describe_explicit()
            )));
        }
        let fixed = first.unwrap_or(0) + last.unwrap_or(0);
        let others = pp - first.is_some() as u64 - last.is_some() as u64;
        let rest = layers.checked_sub(fixed);
        let even = match rest {
            Some(0) if others == 0 => Some(0),
            Some(r) if others > 0 && r % others == 0 && r / others > 0 => Some(r / others),
            _ => None,
        };
        let Some(per) = even else {
            return Err(config_error(format!(
                "model has {layers} layers; megatron pp={pp} with {} leaves {} layers for the {others} other stages, which must split evenly with at least 1 layer each",
                describe_explicit(),
                layers as i128 - fixed as i128
            )));
        };
        let mut starts = vec![0u64];
        for stage in 0..pp {
            let n = match (stage, first, last) {
                (0, Some(f), _) => f,
                (s, _, Some(l)) if s == pp - 1 => l,
                _ => per,
            };
            let prev = starts[starts.len() - 1];
            starts.push(prev + n);
        }
        Ok(Chunks { starts, pp })
    }

    /// Global layers of chunk `c` (`c = virtual * pp + stage`).
    pub fn layers(&self, stage: u64, chunk: u64) -> std::ops::Range<u64> {
        let c = (chunk * self.pp + stage) as usize;
        self.starts[c]..self.starts[c + 1]
    }

    /// Where global layer `l` lives (`l` must be below the number of layers).
    pub fn place(&self, l: u64) -> LayerPlace {
        // the chunk c with starts[c] <= l < starts[c + 1]
        let c = self.starts.partition_point(|&s| s <= l).saturating_sub(1);
        let c64 = c as u64;
        LayerPlace {
            stage: c64 % self.pp,
            chunk: c64 / self.pp,
            local: l - self.starts[c],
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(pairs: &[(&str, u64)]) -> Config {
        Config::resolve(&ParallelConfig::from_pairs(pairs.iter().copied())).unwrap()
    }

    #[test]
    fn etp_defaults_to_tp() {
        assert_eq!(cfg(&[("tp", 4)]).etp, 4);
        assert_eq!(cfg(&[("tp", 4), ("etp", 1)]).etp, 1);
    }

    #[test]
    fn rank_coordinates_follow_tp_cp_ep_dp_pp_order() {
        let c = cfg(&[
            ("tp", 2),
            ("cp", 2),
            ("dp", 2),
            ("pp", 2),
            ("ep", 2),
            ("etp", 1),
        ]);
        // 13 = tp 1 + 2 * (cp 0 + 2 * (dp 1 + 2 * pp 1))
        let k = c.coord(13);
        assert_eq!((k.tp, k.cp, k.dp, k.pp), (1, 0, 1, 1));
        // stage-local 5 = etp 0 + 1 * (ep 1 + 2 * edp 2)
        assert_eq!((k.etp, k.ep, k.edp), (0, 1, 2));
        assert_eq!(c.edp(), 4);
    }

    #[test]
    fn explicit_stage_sizes_split_the_rest_evenly() {
        let c = cfg(&[
            ("pp", 4),
            ("first_stage_layers", 1),
            ("last_stage_layers", 3),
        ]);
        let ch = Chunks::new(10, &c).unwrap();
        assert_eq!(ch.layers(0, 0), 0..1);
        assert_eq!(ch.layers(1, 0), 1..4);
        assert_eq!(ch.layers(2, 0), 4..7);
        assert_eq!(ch.layers(3, 0), 7..10);
        assert_eq!(
            ch.place(5),
            LayerPlace {
                stage: 2,
                chunk: 0,
                local: 1
            }
        );
    }

    #[test]
    fn virtual_chunks_interleave_over_stages() {
        let c = cfg(&[("pp", 2), ("vpp", 2)]);
        let ch = Chunks::new(8, &c).unwrap();
        assert_eq!(ch.layers(0, 0), 0..2);
        assert_eq!(ch.layers(1, 0), 2..4);
        assert_eq!(ch.layers(0, 1), 4..6);
        assert_eq!(ch.layers(1, 1), 6..8);
        assert_eq!(
            ch.place(5),
            LayerPlace {
                stage: 0,
                chunk: 1,
                local: 1
            }
        );
    }
}
