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
    Dims, Holder, LayoutError, LocalTensor, Placement, RankId, RankLayout, Region, Side, SideLayout,
};
use awex_core::model::ModelSpec;
use std::sync::Arc;

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

/// `(layer, expert, part)` of a canonical per-expert name (`part` is `gate_proj`, `up_proj` or `down_proj`).
fn expert_parts(name: &str) -> Option<(u64, u64, &str)> {
    let (l, rest) = name.strip_prefix("model.layers.")?.split_once('.')?;
    let (e, part) = rest.strip_prefix("mlp.experts.")?.split_once('.')?;
    let part = part.strip_suffix(".weight")?;
    Some((parse_index(l)?, parse_index(e)?, part))
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
        })
    }

    /// The same mesh with MoE experts as transformers 5 holds them in memory: per layer one
    /// `mlp.experts.gate_up_proj` `[E, 2I, H]` and one `mlp.experts.down_proj` `[E, H, I]`,
    /// which FSDP2 shards on the expert dim, instead of transformers 4's per-expert
    /// `mlp.experts.{e}.gate_proj.weight`. The canonical tensors stay per-expert (the checkpoint's).
    pub fn with_fused_experts(mut self, fused: bool) -> Result<Self, FsdpConfigError> {
        if fused && self.tp > 1 {
            return Err(FsdpConfigError::FusedExpertsWithTp {
                tp: u64::from(self.tp),
            });
        }
        self.fused_experts = fused;
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
        match rest {
            "mlp.experts.gate_up_proj" => Some((l, Fused::GateUp)),
            "mlp.experts.down_proj" => Some((l, Fused::Down)),
            _ => None,
        }
    }

    /// The local tensor of a fused expert tensor on DP rank `dp_rank`: experts `torch.chunk`ed over dp.
    fn fused_tensor(&self, name: &str, l: u64, which: Fused, dp_rank: u32) -> LocalTensor {
        let s = &self.spec;
        let (h, e_all) = (s.hidden_size, s.num_experts());
        let mi = s.moe.as_ref().map_or(0, |m| m.moe_intermediate_size);
        let (e0, n) = chunk(e_all, u64::from(self.dp), u64::from(dp_rank));
        let mut placements = Vec::new();
        for j in 0..n {
            let e = e0 + j;
            let canon = |part: &str| -> Arc<str> {
                Arc::from(format!("model.layers.{l}.mlp.experts.{e}.{part}.weight"))
            };
            match which {
                Fused::GateUp => {
                    for (i, part) in ["gate_proj", "up_proj"].into_iter().enumerate() {
                        placements.push(Placement {
                            canonical: canon(part),
                            region: Region::new([0, 0], [mi, h]),
                            local_offset: Dims::new(&[j, i as u64 * mi, 0]),
                        });
                    }
                }
                Fused::Down => placements.push(Placement {
                    canonical: canon("down_proj"),
                    region: Region::new([0, 0], [h, mi]),
                    local_offset: Dims::new(&[j, 0, 0]),
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

    /// Every parameter name in HF `named_parameters()` order.
    fn param_names(&self) -> Vec<String> {
        let s = &self.spec;
        let mut v = Vec::new();
        v.push("model.embed_tokens.weight".to_string());
        for l in 0..s.num_layers {
            let p = format!("model.layers.{l}");
            for proj in ["q_proj", "k_proj", "v_proj"] {
                v.push(format!("{p}.self_attn.{proj}.weight"));
                if s.attention_bias {
                    v.push(format!("{p}.self_attn.{proj}.bias"));
                }
            }
            v.push(format!("{p}.self_attn.o_proj.weight"));
            if s.qk_norm() {
                v.push(format!("{p}.self_attn.q_norm.weight"));
                v.push(format!("{p}.self_attn.k_norm.weight"));
            }
            if s.is_moe_layer(l) && self.fused_experts {
                // Qwen3MoeSparseMoeBlock (transformers 5) registers `experts` before `gate`
                v.push(format!("{p}.mlp.experts.gate_up_proj"));
                v.push(format!("{p}.mlp.experts.down_proj"));
                v.push(format!("{p}.mlp.gate.weight"));
            } else if s.is_moe_layer(l) {
                v.push(format!("{p}.mlp.gate.weight"));
                for e in 0..s.num_experts() {
                    for part in ["gate_proj", "up_proj", "down_proj"] {
                        v.push(format!("{p}.mlp.experts.{e}.{part}.weight"));
                    }
                }
            } else {
                for part in ["gate_proj", "up_proj", "down_proj"] {
                    v.push(format!("{p}.mlp.{part}.weight"));
                }
            }
            v.push(format!("{p}.input_layernorm.weight"));
            v.push(format!("{p}.post_attention_layernorm.weight"));
        }
        v.push("model.norm.weight".to_string());
        if !s.tie_word_embeddings {
            v.push("lm_head.weight".to_string());
        }
        v
    }

    /// The canonical shape and TP split of a parameter, parsed from its HF name.
    pub fn param(&self, name: &str) -> Option<(Dims, TpSplit)> {
        let s = &self.spec;
        let (h, hd) = (s.hidden_size, s.head_dim);
        let d2 = |a: u64, b: u64| Dims::new(&[a, b]);
        let d1 = |a: u64| Dims::new(&[a]);
        match name {
            "model.embed_tokens.weight" => return Some((d2(s.vocab_size, h), TpSplit::Rows)),
            "lm_head.weight" if !s.tie_word_embeddings => {
                return Some((d2(s.vocab_size, h), TpSplit::Rows));
            }
            "model.norm.weight" => return Some((d1(h), TpSplit::Replicated)),
            _ => {}
        }
        let rest = name.strip_prefix("model.layers.")?;
        let (l, rest) = rest.split_once('.')?;
        let l = parse_index(l)?;
        if l >= s.num_layers {
            return None;
        }
        let moe = s.is_moe_layer(l);
        let bias = s.attention_bias;
        let qk = s.qk_norm();
        let (q, kv, i) = (s.q_size(), s.kv_size(), s.intermediate_size);
        Some(match rest {
            "input_layernorm.weight" | "post_attention_layernorm.weight" => {
                (d1(h), TpSplit::Replicated)
            }
            "self_attn.q_proj.weight" => (d2(q, h), TpSplit::Rows),
            "self_attn.k_proj.weight" | "self_attn.v_proj.weight" => (d2(kv, h), TpSplit::Rows),
            "self_attn.q_proj.bias" if bias => (d1(q), TpSplit::Rows),
            "self_attn.k_proj.bias" | "self_attn.v_proj.bias" if bias => (d1(kv), TpSplit::Rows),
            "self_attn.o_proj.weight" => (d2(h, q), TpSplit::Cols),
            "self_attn.q_norm.weight" | "self_attn.k_norm.weight" if qk => {
                (d1(hd), TpSplit::Replicated)
            }
            "mlp.gate_proj.weight" | "mlp.up_proj.weight" if !moe => (d2(i, h), TpSplit::Rows),
            "mlp.down_proj.weight" if !moe => (d2(h, i), TpSplit::Cols),
            "mlp.gate.weight" if moe => (d2(s.num_experts(), h), TpSplit::Replicated),
            _ if moe => {
                let rest = rest.strip_prefix("mlp.experts.")?;
                let (e, part) = rest.split_once('.')?;
                if parse_index(e)? >= s.num_experts() {
                    return None;
                }
                let mi = s.moe.as_ref()?.moe_intermediate_size;
                match part {
                    "gate_proj.weight" | "up_proj.weight" => (d2(mi, h), TpSplit::Rows),
                    "down_proj.weight" => (d2(h, mi), TpSplit::Cols),
                    _ => return None,
                }
            }
            _ => return None,
        })
    }

    /// What mesh position `(dp_rank, tp_rank)` holds of a parameter of `shape` split by `split`.
    fn shard(&self, shape: Dims, split: TpSplit, dp_rank: u32, tp_rank: u32) -> Shard {
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
        let (start, len) = chunk(tp_local.get(0), u64::from(self.dp), u64::from(dp_rank));
        let mut local = tp_local;
        local.set(0, len);
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
        let dtype: DType = self.spec.dtype;
        let tensors = self
            .param_names()
            .into_iter()
            .filter_map(|name| {
                if let Some((l, which)) = self.fused(&name) {
                    return Some(self.fused_tensor(&name, l, which, dp_rank));
                }
                let (shape, split) = self.param(&name)?;
                let shard = self.shard(shape, split, dp_rank, tp_rank);
                let name: Arc<str> = Arc::from(name);
                let placements = shard
                    .region
                    .map(|region| Placement {
                        canonical: name.clone(),
                        region,
                        local_offset: Dims::zeros(shape.ndim()),
                    })
                    .into_iter()
                    .collect();
                Some(LocalTensor {
                    name,
                    shape: shard.shape,
                    dtype,
                    placements,
                })
            })
            .collect();
        Some(RankLayout { rank, tensors })
    }

    fn holders(&self, canonical: &str) -> Vec<Holder> {
        if self.fused_experts
            && let Some((l, e, part)) = expert_parts(canonical)
            && self.param(canonical).is_some()
        {
            let (which, name) = match part {
                "down_proj" => (
                    Fused::Down,
                    format!("model.layers.{l}.mlp.experts.down_proj"),
                ),
                _ => (
                    Fused::GateUp,
                    format!("model.layers.{l}.mlp.experts.gate_up_proj"),
                ),
            };
            let per = self.spec.num_experts().div_ceil(u64::from(self.dp));
            let k = (e / per) as u32;
            let local = self.fused_tensor(&name, l, which, k);
            let ranks: Vec<RankId> = (0..self.replicate)
                .map(|rep| RankId::train(self.rank_of(rep, k, 0)))
                .collect();
            return local
                .placements
                .iter()
                .filter(|p| &*p.canonical == canonical)
                .map(|p| Holder {
                    ranks: ranks.clone(),
                    tensor: local.name.clone(),
                    tensor_shape: local.shape,
                    dtype: local.dtype,
                    region: p.region,
                    local_offset: p.local_offset,
                })
                .collect();
        }
        let Some((shape, split)) = self.param(canonical) else {
            return Vec::new();
        };
        let name: Arc<str> = Arc::from(canonical);
        // TP ranks that hold distinct shards; a replicated parameter's shard is shared by all TP ranks.
        let tp_groups: Vec<Vec<u32>> = match split {
            TpSplit::Replicated => vec![(0..self.tp).collect()],
            _ => (0..self.tp).map(|t| vec![t]).collect(),
        };
        let mut out = Vec::new();
        for group in &tp_groups {
            for k in 0..self.dp {
                let shard = self.shard(shape, split, k, group[0]);
                let Some(region) = shard.region else {
                    continue;
                };
                let ranks = (0..self.replicate)
                    .flat_map(|rep| group.iter().map(move |&t| (rep, t)))
                    .map(|(rep, t)| RankId::train(self.rank_of(rep, k, t)))
                    .collect();
                out.push(Holder {
                    ranks,
                    tensor: name.clone(),
                    tensor_shape: shard.shape,
                    dtype: self.spec.dtype,
                    region,
                    local_offset: Dims::zeros(shape.ndim()),
                });
            }
        }
        out
    }
}
