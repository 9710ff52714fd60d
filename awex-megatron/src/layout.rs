//! The Megatron-Core training side as a lazily computed [`SideLayout`].
//!
//! Both directions go through one function, [`MegatronLayout::describe`], which gives the
//! shape and the canonical pieces of one local parameter at one shard coordinate: a rank's
//! layout calls it for the rank's parameters, and `holders(canonical)` calls it only for the
//! few (parameter, shard) pairs the rules say can contain that canonical tensor.

use crate::config::{Chunks, Config, Coord, ExpertLayout, Geometry};
use crate::names::{Canon, LayerNames, Local, Split, chunk_prefix};
use awex_core::DType;
use awex_core::layout::{
    Dims, Holder, LayoutError, LocalTensor, Placement, RankId, RankLayout, Region, Side, SideLayout,
};
use awex_core::model::family::Sink;
use awex_core::model::{HfNames, ModelSpec, Part};
use std::sync::{Arc, OnceLock};

/// Which shard of a local parameter a rank holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Shard {
    /// A replicated parameter.
    Whole,
    /// TP rank.
    Tp(u64),
    /// EP rank and ETP rank.
    Expert { ep: u64, etp: u64 },
}

/// One canonical box inside a local parameter.
#[derive(Clone, Copy, Debug)]
struct Piece {
    canon: Canon,
    region: Region,
    local_offset: Dims,
}

/// Every training rank of a Megatron-Core job for one model and parallel config.
pub struct MegatronLayout {
    cfg: Config,
    geo: Geometry,
    chunks: Chunks,
    layers: u64,
    moe_layers: Vec<bool>,
    /// the pipeline stage of every layer
    stages: Vec<u64>,
    tied: bool,
    /// the parts each layer has (bit `part as u64`), from the model's family
    layer_parts: Vec<u64>,
    names: &'static HfNames,
    dtype: DType,
    embedding: Arc<str>,
    final_norm: Arc<str>,
    output_layer: Arc<str>,
    layer_names: Vec<OnceLock<LayerNames>>,
}

impl std::fmt::Debug for MegatronLayout {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MegatronLayout")
            .field("cfg", &self.cfg)
            .field("layers", &self.layers)
            .field("dtype", &self.dtype)
            .finish_non_exhaustive()
    }
}

impl MegatronLayout {
    /// Checks the config against the model and prepares the layout (names are built on first use).
    pub fn new(
        model: &ModelSpec,
        parallel: &awex_core::ParallelConfig,
    ) -> Result<Self, LayoutError> {
        if model.linear.is_some() {
            return Err(LayoutError::Config(hybrid_unmapped(model)));
        }
        if model.has(Part::ExpertsGateUp) {
            return Err(LayoutError::Config(gpt_oss_unmapped(model)));
        }
        if let Some(p) = model.parts().into_iter().find(|p| !MAPPED.contains(p)) {
            return Err(LayoutError::Config(unmapped(model, p)));
        }
        let cfg = Config::resolve(parallel)?;
        let geo = Geometry::new(model, &cfg)?;
        let chunks = Chunks::new(model.num_layers, &cfg)?;
        let stages = (0..model.num_layers)
            .map(|l| chunks.place(l).stage)
            .collect();
        let first = chunk_prefix(cfg.vpp, 0);
        let last = chunk_prefix(cfg.vpp, cfg.vpp - 1);
        Ok(MegatronLayout {
            geo,
            chunks,
            layers: model.num_layers,
            moe_layers: (0..model.num_layers)
                .map(|l| model.is_moe_layer(l))
                .collect(),
            stages,
            tied: model.tie_word_embeddings,
            layer_parts: (0..model.num_layers)
                .map(|l| layer_parts(model, l))
                .collect(),
            names: model.names(),
            dtype: if cfg.fp32 { DType::F32 } else { model.dtype },
            embedding: Arc::from(format!("{first}embedding.word_embeddings.weight")),
            final_norm: Arc::from(format!("{last}decoder.final_layernorm.weight")),
            output_layer: Arc::from(format!("{last}output_layer.weight")),
            layer_names: (0..model.num_layers).map(|_| OnceLock::new()).collect(),
            cfg,
        })
    }

    /// The resolved parallel config.
    pub fn config(&self) -> &Config {
        &self.cfg
    }

    /// The local dtype of every parameter.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// The coordinates of a training rank, or `None` outside the world.
    pub fn coord(&self, rank: RankId) -> Option<Coord> {
        (rank.engine == 0 && (rank.rank as u64) < self.cfg.world_size())
            .then(|| self.cfg.coord(rank.rank as u64))
    }

    /// The dtype of a local parameter: the router's expert bias is fp32 whatever the parameters'
    /// dtype (`TopKRouter._maintain_float32_expert_bias`), every other one [`Self::dtype`].
    fn dtype_of(&self, local: Local) -> DType {
        match local {
            Local::ExpertBias(_) => DType::F32,
            _ => self.dtype,
        }
    }

    /// Whether the family lists `part` in layer `l`.
    fn has(&self, l: u64, part: Part) -> bool {
        self.layer_parts
            .get(l as usize)
            .is_some_and(|m| m & (1 << part as u64) != 0)
    }

    fn is_moe(&self, l: u64) -> bool {
        self.moe_layers.get(l as usize).copied().unwrap_or(false)
    }

    fn names(&self, l: u64) -> &LayerNames {
        self.layer_names[l as usize].get_or_init(|| {
            let place = self.chunks.place(l);
            let experts = if self.is_moe(l) {
                self.geo.experts_local
            } else {
                0
            };
            LayerNames::new(
                &chunk_prefix(self.cfg.vpp, place.chunk),
                place.local,
                experts,
                self.cfg.local_spec,
                self.cfg.experts,
            )
        })
    }

    fn name(&self, local: Local) -> Arc<str> {
        match local {
            Local::Embedding => self.embedding.clone(),
            Local::FinalNorm => self.final_norm.clone(),
            Local::OutputLayer => self.output_layer.clone(),
            Local::QkvNorm(l) => self.names(l).qkv_norm.clone(),
            Local::Qkv(l) => self.names(l).qkv.clone(),
            Local::QkvBias(l) => self.names(l).qkv_bias.clone(),
            Local::QLayerNorm(l) => self.names(l).q_layernorm.clone(),
            Local::KLayerNorm(l) => self.names(l).k_layernorm.clone(),
            Local::Proj(l) => self.names(l).proj.clone(),
            Local::ProjBias(l) => self.names(l).proj_bias.clone(),
            Local::Fc1Norm(l) => self.names(l).fc1_norm.clone(),
            Local::Fc1(l) => self.names(l).fc1.clone(),
            Local::Fc2(l) => self.names(l).fc2.clone(),
            Local::PreMlpNorm(l) => self.names(l).pre_mlp_norm.clone(),
            Local::Router(l) => self.names(l).router.clone(),
            Local::ExpertBias(l) => self.names(l).expert_bias.clone(),
            Local::SharedFc1(l) => self.names(l).shared_fc1.clone(),
            Local::SharedFc2(l) => self.names(l).shared_fc2.clone(),
            Local::ExpertFc1(l, j) => self.names(l).expert_fc1[j as usize].clone(),
            Local::ExpertFc2(l, j) => self.names(l).expert_fc2[j as usize].clone(),
            Local::StackedFc1(l) => self.names(l).stacked_fc1.clone(),
            Local::StackedFc2(l) => self.names(l).stacked_fc2.clone(),
            Local::InputNorm(l) => self.names(l).input_norm.clone(),
            Local::QDown(l) => self.names(l).q_down.clone(),
            Local::QDownNorm(l) => self.names(l).q_down_norm.clone(),
            Local::QUp(l) => self.names(l).q_up.clone(),
            Local::KvDown(l) => self.names(l).kv_down.clone(),
            Local::KvDownNorm(l) => self.names(l).kv_down_norm.clone(),
            Local::KvUp(l) => self.names(l).kv_up.clone(),
        }
    }

    /// The local parameters of one layer, in Megatron's `named_parameters()` order.
    fn layer_locals(&self, l: u64, out: &mut Vec<Local>) {
        if self.geo.mla.is_some() {
            self.mla_locals(l, out);
        } else if self.cfg.local_spec {
            // the local spec's `input_layernorm` is the layer's first module
            out.extend([Local::QkvNorm(l), Local::Proj(l), Local::Qkv(l)]);
        } else {
            out.extend([Local::Proj(l), Local::QkvNorm(l), Local::Qkv(l)]);
        }
        if self.has(l, Part::OBias) {
            // `linear_proj.bias` follows `linear_proj.weight` in its module
            let at = out
                .iter()
                .rposition(|x| *x == Local::Proj(l))
                .map_or(out.len(), |i| i + 1);
            out.insert(at, Local::ProjBias(l));
        }
        if self.has(l, Part::QBias) {
            out.push(Local::QkvBias(l));
        }
        if self.has(l, Part::QNorm) {
            out.extend([Local::QLayerNorm(l), Local::KLayerNorm(l)]);
        }
        if self.is_moe(l) {
            out.extend([Local::PreMlpNorm(l), Local::Router(l)]);
            if self.has(l, Part::RouterBias) {
                out.push(Local::ExpertBias(l));
            }
            let n = self.geo.experts_local;
            match self.cfg.experts {
                // two GroupedLinear modules, each registering weight0..weight{n-1}
                ExpertLayout::Grouped => {
                    out.extend((0..n).map(|j| Local::ExpertFc1(l, j)));
                    out.extend((0..n).map(|j| Local::ExpertFc2(l, j)));
                }
                // one MLP module per expert, each with fc1 then fc2
                ExpertLayout::Sequential => {
                    out.extend(
                        (0..n).flat_map(|j| [Local::ExpertFc1(l, j), Local::ExpertFc2(l, j)]),
                    );
                }
                ExpertLayout::SingleGrouped => {
                    out.extend([Local::StackedFc1(l), Local::StackedFc2(l)]);
                }
            }
            // `MoELayer.__init__` builds the shared experts after the routed ones
            if self.has(l, Part::SharedGate) {
                out.extend([Local::SharedFc1(l), Local::SharedFc2(l)]);
            }
        } else {
            out.extend([Local::Fc1Norm(l), Local::Fc1(l), Local::Fc2(l)]);
        }
    }

    /// Multi-latent attention's parameters of one layer, in `named_parameters()` order:
    /// `TransformerLayer` builds `input_layernorm` (a module under every MLA spec) before
    /// `self_attention`; `MultiLatentAttention.__init__` builds `linear_proj`, then
    /// `MLASelfAttention.__init__` the q projections, `linear_kv_down_proj`,
    /// `linear_kv_up_proj`, then the local spec's `q_layernorm` and `kv_layernorm`
    /// (megatron/core/transformer/multi_latent_attention.py). Transformer Engine's
    /// `TELayerNormColumnParallelLinear` holds its `layer_norm_weight` before its `weight`
    /// (`LayerNormLinear.__init__` registers them in that order,
    /// transformer_engine/pytorch/module/layernorm_linear.py).
    fn mla_locals(&self, l: u64, out: &mut Vec<Local>) {
        out.extend([Local::InputNorm(l), Local::Proj(l)]);
        let local = self.cfg.local_spec;
        // `Geometry::new` refuses MLA without q_lora_rank (no `linear_q_proj` here)
        out.push(Local::QDown(l));
        if !local {
            out.push(Local::QDownNorm(l));
        }
        out.push(Local::QUp(l));
        out.push(Local::KvDown(l));
        if !local {
            out.push(Local::KvDownNorm(l));
        }
        out.push(Local::KvUp(l));
        if local {
            out.extend([Local::QDownNorm(l), Local::KvDownNorm(l)]);
        }
    }

    /// Every local parameter of pipeline stage `stage`, in order.
    fn stage_locals(&self, stage: u64) -> Vec<Local> {
        let (pp, vpp) = (self.cfg.pp, self.cfg.vpp);
        let mut out = Vec::new();
        for v in 0..vpp {
            if stage == 0 && v == 0 {
                out.push(Local::Embedding);
            }
            for l in self.chunks.layers(stage, v) {
                self.layer_locals(l, &mut out);
            }
            if stage == pp - 1 && v == vpp - 1 {
                out.push(Local::FinalNorm);
                if !self.tied || pp > 1 {
                    out.push(Local::OutputLayer);
                }
            }
        }
        out
    }

    /// Rows `[start, start + len)` of a canonical `[rows, cols]` matrix (or of a vector when `cols` is `None`).
    fn rows(start: u64, len: u64, cols: Option<u64>) -> Region {
        match cols {
            Some(c) => Region::new([start, 0], [len, c]),
            None => Region::new([start], [len]),
        }
    }

    /// The pieces of linear_qkv (weight, or bias when `cols` is `None`) on TP rank `r`.
    fn qkv_pieces(&self, l: u64, r: u64, cols: Option<u64>, f: &mut impl FnMut(Piece)) {
        let g = &self.geo;
        let (s0, s1) = (r * g.qkv_local_rows, (r + 1) * g.qkv_local_rows);
        let bias = cols.is_none();
        let at = |row: u64| match cols {
            Some(_) => Dims::new(&[row, 0]),
            None => Dims::new(&[row]),
        };
        for group in s0 / g.group_rows..=(s1 - 1) / g.group_rows {
            let base = group * g.group_rows;
            let blocks = [
                (
                    if bias {
                        Canon::at(Part::QBias, l)
                    } else {
                        Canon::at(Part::Q, l)
                    },
                    base,
                    g.group_q_rows,
                    group * g.group_q_rows,
                ),
                (
                    if bias {
                        Canon::at(Part::KBias, l)
                    } else {
                        Canon::at(Part::K, l)
                    },
                    base + g.group_q_rows,
                    g.head_dim,
                    group * g.head_dim,
                ),
                (
                    if bias {
                        Canon::at(Part::VBias, l)
                    } else {
                        Canon::at(Part::V, l)
                    },
                    base + g.group_q_rows + g.head_dim,
                    g.head_dim,
                    group * g.head_dim,
                ),
            ];
            for (canon, start, len, canon_row) in blocks {
                let (lo, hi) = (start.max(s0), (start + len).min(s1));
                if lo < hi {
                    f(Piece {
                        canon,
                        region: Self::rows(canon_row + (lo - start), hi - lo, cols),
                        local_offset: at(lo - s0),
                    });
                }
            }
        }
    }

    /// The shape of local parameter `local` at shard `shard`, calling `f` for each canonical box in it.
    fn describe(&self, local: Local, shard: Shard, f: &mut impl FnMut(Piece)) -> Dims {
        let g = &self.geo;
        let h = g.hidden;
        let (tp_r, ep_r, etp_r) = match shard {
            Shard::Whole => (0, 0, 0),
            Shard::Tp(r) => (r, 0, 0),
            Shard::Expert { ep, etp } => (0, ep, etp),
        };
        let whole = |f: &mut dyn FnMut(Piece), canon: Canon, shape: Dims| {
            f(Piece {
                canon,
                region: Region::full(shape),
                local_offset: Dims::zeros(shape.ndim()),
            });
            shape
        };
        // a column-parallel gate/up pair fused along dim 0 (`linear_fc1`), `n` rows each per rank
        let gate_up = |f: &mut dyn FnMut(Piece), parts: [Canon; 2], n: u64| {
            for (i, canon) in parts.into_iter().enumerate() {
                f(Piece {
                    canon,
                    region: Region::new([tp_r * n, 0], [n, h]),
                    local_offset: Dims::new(&[i as u64 * n, 0]),
                });
            }
            Dims::new(&[2 * n, h])
        };
        // a row-parallel down projection (`linear_fc2`), `n` columns per rank
        let down = |f: &mut dyn FnMut(Piece), canon: Canon, n: u64| {
            f(Piece {
                canon,
                region: Region::new([0, tp_r * n], [h, n]),
                local_offset: Dims::new(&[0, 0]),
            });
            Dims::new(&[h, n])
        };
        match local {
            Local::Embedding | Local::OutputLayer => {
                let canon = match (local, self.tied) {
                    (Local::OutputLayer, false) => Canon::global(Part::LmHead),
                    _ => Canon::global(Part::Embed),
                };
                let per = g.vocab_local_rows;
                let start = tp_r * per;
                let end = (start + per).min(g.vocab);
                if start < end {
                    f(Piece {
                        canon,
                        region: Region::new([start, 0], [end - start, h]),
                        local_offset: Dims::new(&[0, 0]),
                    });
                }
                Dims::new(&[per, h])
            }
            Local::FinalNorm => whole(f, Canon::global(Part::FinalNorm), Dims::new(&[h])),
            Local::QkvNorm(l) => whole(f, Canon::at(Part::InputNorm, l), Dims::new(&[h])),
            Local::QLayerNorm(l) => whole(f, Canon::at(Part::QNorm, l), Dims::new(&[g.head_dim])),
            Local::KLayerNorm(l) => whole(f, Canon::at(Part::KNorm, l), Dims::new(&[g.head_dim])),
            Local::Fc1Norm(l) | Local::PreMlpNorm(l) => {
                whole(f, Canon::at(Part::PostNorm, l), Dims::new(&[h]))
            }
            Local::Router(l) => whole(f, Canon::at(Part::Router, l), Dims::new(&[g.experts, h])),
            Local::ExpertBias(l) => {
                whole(f, Canon::at(Part::RouterBias, l), Dims::new(&[g.experts]))
            }
            Local::SharedFc1(l) => gate_up(
                f,
                [Canon::at(Part::SharedGate, l), Canon::at(Part::SharedUp, l)],
                g.shared_inter_local,
            ),
            Local::SharedFc2(l) => down(f, Canon::at(Part::SharedDown, l), g.shared_inter_local),
            Local::Qkv(l) => {
                self.qkv_pieces(l, tp_r, Some(h), f);
                Dims::new(&[g.qkv_local_rows, h])
            }
            Local::QkvBias(l) => {
                self.qkv_pieces(l, tp_r, None, f);
                Dims::new(&[g.qkv_local_rows])
            }
            Local::Proj(l) => {
                let cols = g.o_cols_local;
                f(Piece {
                    canon: Canon::at(Part::O, l),
                    region: Region::new([0, tp_r * cols], [h, cols]),
                    local_offset: Dims::new(&[0, 0]),
                });
                Dims::new(&[h, cols])
            }
            Local::ProjBias(l) => whole(f, Canon::at(Part::OBias, l), Dims::new(&[h])),
            Local::Fc1(l) => gate_up(
                f,
                [Canon::at(Part::Gate, l), Canon::at(Part::Up, l)],
                g.inter_local,
            ),
            Local::Fc2(l) => down(f, Canon::at(Part::Down, l), g.inter_local),
            Local::ExpertFc1(l, j) => {
                let e = ep_r * g.experts_local + j;
                let n = g.moe_inter_local;
                for (i, canon) in [
                    Canon::expert_at(Part::ExpertGate, l, e),
                    Canon::expert_at(Part::ExpertUp, l, e),
                ]
                .into_iter()
                .enumerate()
                {
                    f(Piece {
                        canon,
                        region: Region::new([etp_r * n, 0], [n, h]),
                        local_offset: Dims::new(&[i as u64 * n, 0]),
                    });
                }
                Dims::new(&[2 * n, h])
            }
            Local::ExpertFc2(l, j) => {
                let e = ep_r * g.experts_local + j;
                let n = g.moe_inter_local;
                f(Piece {
                    canon: Canon::expert_at(Part::ExpertDown, l, e),
                    region: Region::new([0, etp_r * n], [h, n]),
                    local_offset: Dims::new(&[0, 0]),
                });
                Dims::new(&[h, n])
            }
            Local::StackedFc1(l) => {
                let (per, n) = (g.experts_local, g.moe_inter_local);
                for j in 0..per {
                    let e = ep_r * per + j;
                    for (i, canon) in [
                        Canon::expert_at(Part::ExpertGate, l, e),
                        Canon::expert_at(Part::ExpertUp, l, e),
                    ]
                    .into_iter()
                    .enumerate()
                    {
                        f(Piece {
                            canon,
                            region: Region::new([etp_r * n, 0], [n, h]),
                            local_offset: Dims::new(&[j, i as u64 * n, 0]),
                        });
                    }
                }
                Dims::new(&[per, 2 * n, h])
            }
            Local::InputNorm(l) => whole(f, Canon::at(Part::InputNorm, l), Dims::new(&[h])),
            Local::QDown(_)
            | Local::QDownNorm(_)
            | Local::QUp(_)
            | Local::KvDown(_)
            | Local::KvDownNorm(_)
            | Local::KvUp(_) => self.mla_pieces(local, tp_r, f),
            Local::StackedFc2(l) => {
                let (per, n) = (g.experts_local, g.moe_inter_local);
                for j in 0..per {
                    f(Piece {
                        canon: Canon::expert_at(Part::ExpertDown, l, ep_r * per + j),
                        region: Region::new([0, etp_r * n], [h, n]),
                        local_offset: Dims::new(&[j, 0, 0]),
                    });
                }
                Dims::new(&[per, h, n])
            }
        }
    }

    /// The pieces of one of MLA's parameters on TP rank `tp_r` (0 for a whole one): each is a
    /// contiguous slice of its canonical tensor's rows, as Megatron-Core and HF agree on the
    /// rows' order (per head `[nope | rope]` for the query, `[nope | v]` for the key/value up
    /// projection, `[latent | rope]` for the key/value down projection: `torch.split` in
    /// `MLASelfAttention.get_query_key_value_tensors` as in transformers' `DeepseekV3Attention`).
    fn mla_pieces(&self, local: Local, tp_r: u64, f: &mut impl FnMut(Piece)) -> Dims {
        let g = &self.geo;
        let h = g.hidden;
        let Some(m) = &g.mla else {
            return Dims::new(&[0]);
        };
        // rows [r * n, (r + 1) * n) of a canonical [_, cols] matrix
        let mut rows = |canon: Canon, n: u64, cols: u64| {
            f(Piece {
                canon,
                region: Region::new([tp_r * n, 0], [n, cols]),
                local_offset: Dims::new(&[0, 0]),
            });
            Dims::new(&[n, cols])
        };
        match local {
            Local::QUp(l) => rows(Canon::at(Part::QUp, l), m.q_rows_local, m.q_lora),
            Local::KvUp(l) => rows(Canon::at(Part::KvUp, l), m.kv_up_rows_local, m.kv_lora),
            Local::QDown(l) => rows(Canon::at(Part::QDown, l), m.q_lora / m.down_split, h),
            Local::KvDown(l) => rows(Canon::at(Part::KvDown, l), m.kv_down_rows / m.down_split, h),
            Local::QDownNorm(l) => {
                let n = m.q_lora;
                f(Piece {
                    canon: Canon::at(Part::QDownNorm, l),
                    region: Region::new([0], [n]),
                    local_offset: Dims::new(&[0]),
                });
                Dims::new(&[n])
            }
            Local::KvDownNorm(l) => {
                f(Piece {
                    canon: Canon::at(Part::KvDownNorm, l),
                    region: Region::new([0], [m.kv_lora]),
                    local_offset: Dims::new(&[0]),
                });
                Dims::new(&[m.kv_lora])
            }
            _ => Dims::new(&[0]),
        }
    }

    /// Whether the model has this canonical tensor (its family lists the part in that layer).
    fn exists(&self, c: Canon) -> bool {
        match (c.layer(), c.expert()) {
            (None, _) => c.part != Part::LmHead || !self.tied,
            (Some(l), _) if l >= self.layers => false,
            (Some(l), None) => self.has(l, c.part),
            (Some(l), Some(e)) => self.has(l, c.part) && e < self.geo.experts,
        }
    }

    /// The local parameters (with their stage) that can hold canonical tensor `c`.
    fn locals_of(&self, c: Canon) -> ([Option<(Local, u64)>; 2], Option<u64>) {
        let last = self.cfg.pp - 1;
        let l = c.layer().unwrap_or(0);
        let stage = match self.stages.get(l as usize) {
            Some(&s) => s,
            None => self.chunks.place(l).stage,
        };
        let one = |local: Local| [Some((local, stage)), None];
        let mut expert = None;
        let list = match c.part {
            Part::Embed => [
                Some((Local::Embedding, 0)),
                (self.tied && self.cfg.pp > 1).then_some((Local::OutputLayer, last)),
            ],
            Part::LmHead => [Some((Local::OutputLayer, last)), None],
            Part::FinalNorm => [Some((Local::FinalNorm, last)), None],
            Part::InputNorm if self.geo.mla.is_some() => one(Local::InputNorm(l)),
            Part::InputNorm => one(Local::QkvNorm(l)),
            Part::Q | Part::K | Part::V => one(Local::Qkv(l)),
            Part::QDown => one(Local::QDown(l)),
            Part::QDownNorm => one(Local::QDownNorm(l)),
            Part::QUp => one(Local::QUp(l)),
            Part::KvDown => one(Local::KvDown(l)),
            Part::KvDownNorm => one(Local::KvDownNorm(l)),
            Part::KvUp => one(Local::KvUp(l)),
            Part::QBias | Part::KBias | Part::VBias => one(Local::QkvBias(l)),
            Part::O => one(Local::Proj(l)),
            Part::OBias => one(Local::ProjBias(l)),
            Part::QNorm => one(Local::QLayerNorm(l)),
            Part::KNorm => one(Local::KLayerNorm(l)),
            Part::PostNorm if self.is_moe(l) => one(Local::PreMlpNorm(l)),
            Part::PostNorm => one(Local::Fc1Norm(l)),
            Part::Gate | Part::Up => one(Local::Fc1(l)),
            Part::Down => one(Local::Fc2(l)),
            Part::Router => one(Local::Router(l)),
            Part::RouterBias => one(Local::ExpertBias(l)),
            Part::SharedGate | Part::SharedUp => one(Local::SharedFc1(l)),
            Part::SharedDown => one(Local::SharedFc2(l)),
            Part::ExpertGate | Part::ExpertUp | Part::ExpertDown => {
                let e = c.expert().unwrap_or(0);
                let per = self.geo.experts_local;
                expert = Some(e / per);
                let j = e % per;
                let down = c.part == Part::ExpertDown;
                let local = match (self.cfg.experts, down) {
                    (ExpertLayout::SingleGrouped, true) => Local::StackedFc2(l),
                    (ExpertLayout::SingleGrouped, false) => Local::StackedFc1(l),
                    (_, true) => Local::ExpertFc2(l, j),
                    (_, false) => Local::ExpertFc1(l, j),
                };
                one(local)
            }
            // a hybrid model has no Megatron layout (`MegatronLayout::new` refuses it)
            Part::SharedExpertGate
            | Part::LinQkvz
            | Part::LinBa
            | Part::LinQkv
            | Part::LinZ
            | Part::LinB
            | Part::LinA
            | Part::LinConv
            | Part::LinALog
            | Part::LinDtBias
            | Part::LinNorm
            | Part::LinOut => [None, None],
            // gpt-oss has no Megatron layout (`MegatronLayout::new` refuses it)
            Part::Sinks
            | Part::ExpertsGateUp
            | Part::ExpertsGateUpBias
            | Part::ExpertsDown
            | Part::ExpertsDownBias => [None, None],
        };
        (list, expert)
    }

    /// Appends the holders of `target` inside `local` at `shard` of `stage`.
    fn push_holders(
        &self,
        out: &mut Vec<Holder>,
        target: Canon,
        local: Local,
        stage: u64,
        shard: Shard,
    ) {
        // the holders are pushed as the pieces come, their ranks filled in after
        let first = out.len();
        let tensor = self.name(local);
        let shape = self.describe(local, shard, &mut |p| {
            if p.canon == target {
                out.push(Holder {
                    ranks: Vec::new(),
                    tensor: tensor.clone(),
                    tensor_shape: Dims::default(),
                    dtype: self.dtype_of(local),
                    region: p.region,
                    local_offset: p.local_offset,
                    transposed: false,
                });
            }
        });
        if out.len() == first {
            return;
        }
        let ranks = match shard {
            Shard::Whole => self.cfg.stage_ranks(stage),
            Shard::Tp(r) => self.cfg.tp_ranks(stage, r),
            Shard::Expert { ep, etp } => self.cfg.expert_ranks(stage, ep, etp),
        };
        if let Some((last, rest)) = out[first..].split_last_mut() {
            for h in rest {
                h.ranks = ranks.clone();
                h.tensor_shape = shape;
            }
            last.ranks = ranks;
            last.tensor_shape = shape;
        }
    }
}

/// The parts the Megatron layout places; a family with any other part is refused by name.
const MAPPED: [Part; 32] = [
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
];

/// The parts of one layer as a set (bit `part as u64`), from the family's list.
fn layer_parts(model: &ModelSpec, l: u64) -> u64 {
    /// Collects part bits.
    struct Bits(u64);
    impl Sink for Bits {
        fn part(&mut self, c: Canon, _: Dims) {
            self.0 |= 1 << c.part as u64;
        }
        fn experts(&mut self, _: u64, count: u64, parts: &[(Part, Dims)]) {
            if count > 0 {
                self.0 |= parts.iter().fold(0, |m, (p, _)| m | 1 << *p as u64);
            }
        }
    }
    let mut b = Bits(0);
    (model.architecture.family().layer)(model, l, &mut b);
    b.0
}

/// Why a hybrid linear-attention model (Qwen3-Next, Qwen3.5, Qwen3.5-MoE) has no Megatron
/// layout: Megatron-Core 0.19.2 builds Gated DeltaNet only with Transformer Engine and FLA
/// (flash-linear-attention), so it cannot be built on CPU, where awex checks every Megatron
/// layout against the real parameters.
///
/// What 0.19.2 builds (read from its code, not built): a `GPTModel` whose layers come from
/// `get_transformer_block_with_experimental_attention_variant_spec`
/// (models/gpt/experimental_attention_variant_module_specs.py; `experimental_attention_variant
/// = "gated_delta_net"`, `linear_attention_freq` places the full-attention layers). A Gated
/// DeltaNet layer's `self_attention` (ssm/gated_delta_net/gdn.py `GatedDeltaNet`, common.py
/// `_GDNBase.__init__`) holds `in_proj.layer_norm_weight` [hidden] (the input norm, fused: the
/// layer's `input_layernorm` is IdentityOp), `in_proj.weight` [(2 qk + 2 v + 2 nv) / tp, hidden]
/// whose rows on each tp rank are [query | key | value | z | beta | alpha] of that rank
/// (`in_proj_split_sections`; the checkpoint groups them by key head), `conv1d.weight`
/// [(2 qk + v) / tp, 1, kernel] of [query | key | value] channels per rank, `dt_bias` and
/// `A_log` [nv / tp] in the parameter dtype (the catalogue's `A_log` is fp32), `out_norm.weight`
/// [value head dim] and `out_proj.weight` [hidden, v / tp]. A full-attention layer with
/// `attention_output_gate` holds `linear_qkv.weight` of [query heads | gate heads | key | value]
/// per query group (transformer/attention.py `SelfAttention.get_query_key_value_tensors`; the
/// checkpoint's `q_proj` is [query | gate] per head). The shared expert's gate is
/// `mlp.shared_experts.gate_weight` [1, hidden] (transformer/moe/shared_experts.py).
///
/// Why it is not built on CPU (each checked against the installed 0.19.2):
/// - `_get_backend_spec_provider` asserts `transformer_impl == "transformer_engine"`; with the
///   local backend `LocalSpecProvider.column_parallel_layer_norm_linear` (models/backends.py) is
///   None, which `get_gated_delta_net_module_spec` makes the `in_proj`; models/hybrid/
///   hybrid_layer_specs.py uses Transformer Engine modules only. Transformer Engine needs CUDA.
/// - `_GDNBase.__init__` raises ImportError without FLA, and the forward calls FLA's `l2norm`
///   (and, outside `deterministic_mode`, `chunk_gated_delta_rule` and `causal_conv1d`).
///
/// Beyond the build, not a layout: the checkpoint's norms are zero-centred (1 + weight,
/// transformers' `Qwen3NextRMSNorm`) but its gated `linear_attn.norm` is not
/// (`Qwen3NextRMSNormGated`), while Megatron applies one `layernorm_zero_centered_gamma` to every
/// norm, `out_norm` included (`TENorm`; the local `WrappedTorchNorm` refuses it,
/// transformer/torch_norm.py), so a transfer would shift one kind of norm by 1 instead of copying.
fn hybrid_unmapped(model: &ModelSpec) -> String {
    let family = model.architecture.family();
    format!(
        "megatron: {} ({}) mixes Gated DeltaNet linear attention with gated full attention, which Megatron-Core 0.19.2 builds only with Transformer Engine and FLA (flash-linear-attention): its Gated DeltaNet layer specs assert transformer_impl=\"transformer_engine\" (models/gpt/experimental_attention_variant_module_specs.py `_get_backend_spec_provider`; the local backend has no fused norm + linear for `in_proj`, models/hybrid/hybrid_layer_specs.py is Transformer Engine only) and `GatedDeltaNet` raises ImportError without FLA (ssm/gated_delta_net/common.py `_GDNBase.__init__`), so it cannot be built and checked on CPU. Its Gated DeltaNet `in_proj` holds [query | key | value | z | beta | alpha] rows per tensor-parallel rank (`in_proj_split_sections`), and Megatron applies one layernorm_zero_centered_gamma to every norm while the checkpoint's gated `linear_attn.norm` is not zero-centred (its other norms are), so a transfer would shift norms by 1, not copy them. awex does not map these models to Megatron-Core; train them with FSDP2 (fsdp:dp=N at tp 1)",
        family.hf_class, family.name
    )
}

/// Why gpt-oss has no Megatron layout: what Megatron-Core 0.19.2 builds for it, what keeps it
/// off the CPU, and a transpose on the training side (awex transposes inference boxes only).
fn gpt_oss_unmapped(model: &ModelSpec) -> String {
    let family = model.architecture.family();
    format!(
        "megatron: {} ({}) holds each layer's experts in one tensor transposed against Megatron-Core's (`mlp.experts.gate_up_proj` [experts, hidden, 2 * intermediate], gate/up interleaved). Megatron-Core 0.19.2 builds its parts: attention sinks as `core_attention.softmax_offset` [heads / tp] (softmax_type=\"learnable\", transformer/dot_product_attention.py, created on torch.cuda.current_device(), so not on CPU), biases on every linear layer (add_bias_linear, experts' biases only at expert_tensor_parallel_size=1), the router's weight and bias in fp32 (moe/router.py), the clamped activation (activation_func=quick_gelu, glu_linear_offset=1, activation_func_clamp_value); its experts' `linear_fc1` is [2 * intermediate, hidden] per expert, [gate | up] halves in SequentialMLP and interleaved only in TEGroupedMLP (moe_mlp_glu_interleave_size=1): either is the transpose of the checkpoint's, and awex transposes boxes on the inference side only (a training holder stored transposed is refused). Train gpt-oss with FSDP2 (fsdp:dp=N at tp 1)",
        family.hf_class, family.name
    )
}

/// Why a family with `part` has no Megatron layout yet.
fn unmapped(model: &ModelSpec, part: Part) -> String {
    let family = model.architecture.family();
    let example = (0..model.num_layers)
        .find_map(|l| family.names.name(Canon::at(part, l)))
        .unwrap_or_else(|| part.label().to_string());
    format!(
        "megatron: {} ({}) has `{example}` ({}), which awex does not map to Megatron-Core's parameters yet",
        family.hf_class,
        family.name,
        part.label()
    )
}

impl SideLayout for MegatronLayout {
    fn side(&self) -> Side {
        Side::Training
    }

    fn ranks(&self) -> Vec<RankId> {
        (0..self.cfg.world_size())
            .map(|r| RankId::train(r as u32))
            .collect()
    }

    fn world_size(&self) -> usize {
        self.cfg.world_size() as usize
    }

    fn engines(&self) -> u32 {
        1
    }

    fn rank_layout(&self, rank: RankId) -> Option<RankLayout> {
        let c = self.coord(rank)?;
        let locals = self.stage_locals(c.pp);
        let mut tensors = Vec::with_capacity(locals.len());
        // canonical names repeat within a tensor (q pieces of several groups): build each once
        let mut names: Vec<(Canon, Arc<str>)> = Vec::new();
        for local in locals {
            let shard = match local.split(self.cfg.local_spec) {
                Split::Replicated => Shard::Whole,
                Split::Tp => Shard::Tp(c.tp),
                Split::Expert => Shard::Expert {
                    ep: c.ep,
                    etp: c.etp,
                },
            };
            let mut placements = Vec::new();
            names.clear();
            let shape = self.describe(local, shard, &mut |p| {
                let canonical = match names.iter().find(|(k, _)| *k == p.canon) {
                    Some((_, n)) => n.clone(),
                    None => {
                        let n: Arc<str> = Arc::from(self.names.name(p.canon).unwrap_or_default());
                        names.push((p.canon, n.clone()));
                        n
                    }
                };
                placements.push(Placement {
                    canonical,
                    region: p.region,
                    local_offset: p.local_offset,
                    transposed: false,
                });
            });
            tensors.push(LocalTensor {
                name: self.name(local),
                shape,
                dtype: self.dtype_of(local),
                encoding: awex_core::encoding::Encoding::Plain(self.dtype_of(local)),
                placements,
            });
        }
        Some(RankLayout { rank, tensors })
    }

    fn holders(&self, canonical: &str) -> Vec<Holder> {
        let Some(target) = self.names.parse(canonical) else {
            return Vec::new();
        };
        if !self.exists(target) {
            return Vec::new();
        }
        let (locals, expert) = self.locals_of(target);
        let mut out = Vec::new();
        for (local, stage) in locals.into_iter().flatten() {
            match local.split(self.cfg.local_spec) {
                Split::Replicated => {
                    self.push_holders(&mut out, target, local, stage, Shard::Whole)
                }
                Split::Tp => {
                    for r in 0..self.cfg.tp {
                        self.push_holders(&mut out, target, local, stage, Shard::Tp(r));
                    }
                }
                Split::Expert => {
                    let ep = expert.unwrap_or(0);
                    for etp in 0..self.cfg.etp {
                        self.push_holders(
                            &mut out,
                            target,
                            local,
                            stage,
                            Shard::Expert { ep, etp },
                        );
                    }
                }
            }
        }
        out
    }
}
