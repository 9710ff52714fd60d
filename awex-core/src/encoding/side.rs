//! An FP8 inference side: a backend's layout with the linear weights stored as FP8 blocks.
//!
//! [`Fp8Side`] is a pass over any inference [`SideLayout`] (the backend's code is untouched):
//! every local tensor whose placements are all linear weights the `quantization_config`
//! quantises ([`crate::model::Part::fp8_linear`], minus `ignored_layers`) becomes `f8e4m3`
//! with an [`Encoding::Fp8Block`], and gets its scale tensor right after it
//! ([`Fp8Block::scale_name`], fp32, [`Encoding::Fp8Scales`]) with placements in block
//! coordinates of the derived canonical tensor `<canonical>_scale_inv`, as SGLang and vLLM
//! hold them (a fused `qkv_proj.weight_scale_inv` concatenates the parts' block rows).
//!
//! The planner sees an FP8 tensor's holders as `f8e4m3` and asks [`SideLayout::tensor_encoding`]
//! for their encoding; it delivers the canonical dtype (bf16) into the tensor's staging, and the
//! receiver quantises (`crate::plan::EncodeAt::Receiver`). Scale tensors take no transfer.

use super::{Encoding, Fp8Block, Fp8Config, Fp8Quantiser, QuantiseError, Recipe};
use crate::dtype::DType;
use crate::layout::{Dims, Holder, LayoutError, LocalTensor, Placement, RankId, RankLayout};
use crate::layout::{Region, Side, SideLayout};
use crate::model::{Catalogue, ModelSpec, Part};
use serde::{Deserialize, Serialize};
use std::collections::HashSet;
use std::sync::Arc;

/// What makes an inference side FP8: the checkpoint's `quantization_config` and the quantiser
/// whose bytes the engine is to hold.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct InferFp8 {
    /// The parsed `quantization_config` (block, scale format, ignored layers).
    pub config: Fp8Config,
    /// Which torch reference's bytes awex writes.
    pub recipe: Recipe,
}

impl InferFp8 {
    /// Pairs a config with a recipe; refused when the recipe cannot write the config's
    /// encoding (its scale format or block shape), naming both.
    pub fn new(config: Fp8Config, recipe: Recipe) -> Result<InferFp8, QuantiseError> {
        let f = InferFp8 { config, recipe };
        // the quantiser checks the pair before any byte; an empty matrix checks only that
        f.quantiser()
            .quantise::<u16>(&[], super::Shape2d::dense(0, 0), &mut [], 0, &mut [], 0)?;
        Ok(f)
    }

    /// The encoding of every quantised tensor.
    pub fn encoding(&self) -> &Fp8Block {
        &self.config.encoding
    }

    /// The CPU quantiser (CUDA torch arithmetic, where the engines quantise).
    pub fn quantiser(&self) -> Fp8Quantiser {
        Fp8Quantiser::new(self.recipe, self.config.encoding.clone())
    }

    /// One line for messages and `plan`: `fp8 e4m3, 128x128 blocks, fp32 scales, recipe vllm`.
    pub fn describe(&self) -> String {
        let b = &self.config.encoding;
        format!(
            "fp8 e4m3, {}x{} blocks, {} scales, recipe {}{}",
            b.block[0],
            b.block[1],
            match b.scale_format {
                super::ScaleFormat::F32 => "fp32",
                super::ScaleFormat::Ue8m0 => "ue8m0",
            },
            self.recipe.name(),
            if self.config.ignored_layers.is_empty() {
                String::new()
            } else {
                format!(", {} ignored layers", self.config.ignored_layers.len())
            }
        )
    }
}

/// SGLang 0.5.23 `layers/quantization/utils.py::_module_path_match`: `ignored` names the
/// module `prefix`, or one of its ancestors, or a dotted run of its path.
fn module_path_match(ignored: &str, prefix: &str) -> bool {
    let ignored = ignored.trim_end_matches('.');
    let prefix = prefix.trim_end_matches('.');
    ignored == prefix
        || prefix
            .strip_prefix(ignored)
            .is_some_and(|r| r.starts_with('.'))
        || format!(".{prefix}.").contains(&format!(".{ignored}."))
}

/// An inference side whose linear weights are FP8 blocks (see the module doc).
pub struct Fp8Side {
    inner: Arc<dyn SideLayout>,
    model: ModelSpec,
    fp8: InferFp8,
    /// local names of the FP8 tensors
    tensors: HashSet<Arc<str>>,
    /// parts the engine quantises beyond `Part::fp8_linear` ([`SideLayout::fp8_extra_parts`])
    extra: Vec<Part>,
}

impl Fp8Side {
    /// Marks `inner`'s quantised tensors; refuses a tensor whose placements are partly
    /// quantised, a canonical dtype the quantisers do not read, and a shard that cuts a block
    /// (SGLang refuses such a TP split too: `Weight output_partition_size = 48 is not divisible
    /// by weight quantization block_n = 128`), each by name.
    pub fn new(
        inner: Arc<dyn SideLayout>,
        model: &ModelSpec,
        catalogue: &Catalogue,
        fp8: InferFp8,
    ) -> Result<Fp8Side, LayoutError> {
        if model.linear.is_some() {
            return Err(LayoutError::Config(format!(
                "{} with FP8 blocks: which Gated DeltaNet projections the engines hold as FP8 is not described by awex (SGLang 0.5.23 builds `in_proj_qkvz`, `in_proj_ba` and `out_proj` with the checkpoint's quantization config, vLLM 0.33 `in_proj_ba` without blockwise FP8); serve these models in bf16",
                model.architecture.hf_name()
            )));
        }
        let extra = inner.fp8_extra_parts().to_vec();
        let mut side = Fp8Side {
            inner,
            model: model.clone(),
            fp8,
            tensors: HashSet::new(),
            extra,
        };
        // every engine lays out the same tensors: the first engine's ranks decide
        let ranks = side.inner.ranks();
        let first = ranks.first().map(|r| r.engine);
        for rank in ranks.into_iter().filter(|r| Some(r.engine) == first) {
            let Some(layout) = side.inner.rank_layout(rank) else {
                continue;
            };
            for t in &layout.tensors {
                if side.check_tensor(rank, t, catalogue)? {
                    side.tensors.insert(t.name.clone());
                }
            }
        }
        Ok(side)
    }

    /// The FP8 settings.
    pub fn fp8(&self) -> &InferFp8 {
        &self.fp8
    }

    /// Whether the checkpoint stores canonical tensor `canonical` as FP8 blocks: a linear weight
    /// ([`Part::fp8_linear`]) or a part the engine's class quantises too
    /// ([`SideLayout::fp8_extra_parts`]), unless `ignored_layers` names its module.
    pub fn quantised(&self, canonical: &str) -> bool {
        let Some(c) = self.model.names().parse(canonical) else {
            return false;
        };
        if !c.part.fp8_linear() && !self.extra.contains(&c.part) {
            return false;
        }
        let module = canonical.strip_suffix(".weight").unwrap_or(canonical);
        !self
            .fp8
            .config
            .ignored_layers
            .iter()
            .any(|i| module_path_match(i, module))
    }

    /// Whether `t` is an FP8 tensor, after checking it can be one.
    fn check_tensor(
        &self,
        rank: RankId,
        t: &LocalTensor,
        catalogue: &Catalogue,
    ) -> Result<bool, LayoutError> {
        let quantised = t
            .placements
            .iter()
            .filter(|p| self.quantised(&p.canonical))
            .count();
        if quantised == 0 {
            return Ok(false);
        }
        let err = |message: String| {
            Err(LayoutError::Config(format!(
                "inference rank {rank}: `{}` {message}",
                t.name
            )))
        };
        if quantised != t.placements.len() {
            let plain: Vec<&str> = t
                .placements
                .iter()
                .filter(|p| !self.quantised(&p.canonical))
                .map(|p| &*p.canonical)
                .collect();
            return err(format!(
                "holds FP8 parts and parts the quantization_config keeps unquantised ({}); a fused tensor is quantised whole (SGLang: \"all shards of fused layers to have the same precision\"): list all of its parts in ignored_layers or none",
                plain.join(", ")
            ));
        }
        if t.shape.ndim() < 2 {
            return err(format!(
                "has shape {:?}; an FP8 block tensor is a matrix or a stack of matrices",
                t.shape.as_slice()
            ));
        }
        let [bn, bk] = self.fp8.config.encoding.block.map(u64::from);
        let nd = t.shape.ndim();
        let (lrows, lcols) = (t.shape.as_slice()[nd - 2], t.shape.as_slice()[nd - 1]);
        for p in &t.placements {
            let c = catalogue.get(&p.canonical).ok_or_else(|| {
                LayoutError::Config(format!(
                    "inference rank {rank}: `{}` places `{}`, which is not a tensor of the model",
                    t.name, p.canonical
                ))
            })?;
            if !matches!(c.dtype, DType::Bf16 | DType::F32) {
                return err(format!(
                    "holds `{}` of dtype {}; awex quantises bf16 or f32 weights to FP8",
                    p.canonical, c.dtype
                ));
            }
            let rd = p.region.ndim();
            if rd < 2 {
                return err(format!(
                    "places `{}` as a {rd}-d box; an FP8 weight is a matrix",
                    p.canonical
                ));
            }
            let off = p.region.offset.as_slice();
            let ext = p.region.extent.as_slice();
            let cs = c.shape.as_slice();
            let lo = p.local_offset.as_slice();
            for (axis, block, what, local_len) in [
                (0usize, bn, ("output rows", "block_n"), lrows),
                (1, bk, ("input columns", "block_k"), lcols),
            ] {
                let (o, e, full) = (off[rd - 2 + axis], ext[rd - 2 + axis], cs[rd - 2 + axis]);
                let l = lo[nd - 2 + axis];
                let ends_at_edges = o + e == full && l + e == local_len;
                if o % block != 0 || l % block != 0 || (e % block != 0 && !ends_at_edges) {
                    return err(format!(
                        "holds {} {o}..{} of `{}` (of {full}) at {l}; that cuts a {}x{} block: {} = {e} is not divisible by weight quantization {} = {block} (SGLang and vLLM refuse this split too): pick a tensor parallel size that splits the weight on whole blocks",
                        what.0,
                        o + e,
                        p.canonical,
                        bn,
                        bk,
                        if axis == 0 {
                            "output_partition_size"
                        } else {
                            "input_size_per_partition"
                        },
                        what.1,
                    ));
                }
            }
        }
        Ok(true)
    }

    /// The scale tensor of FP8 tensor `t` (already marked): `[.., ceil(R / bn), ceil(C / bk)]`
    /// fp32, each weight placement mapped to block coordinates of `<canonical>_scale_inv`.
    fn scale_tensor(&self, t: &LocalTensor) -> LocalTensor {
        let b = self.fp8.config.encoding.block.map(u64::from);
        let to_blocks = |d: &Dims, ceil: bool| {
            let mut v = d.as_slice().to_vec();
            let n = v.len();
            for i in 0..2 {
                v[n - 2 + i] = if ceil {
                    v[n - 2 + i].div_ceil(b[i])
                } else {
                    v[n - 2 + i] / b[i]
                };
            }
            Dims::new(&v)
        };
        let placements = t
            .placements
            .iter()
            .map(|p| Placement {
                canonical: Arc::from(Fp8Block::scale_name(&p.canonical)),
                region: Region {
                    offset: to_blocks(&p.region.offset, false),
                    extent: to_blocks(&p.region.extent, true),
                },
                local_offset: to_blocks(&p.local_offset, false),
                transposed: false,
            })
            .collect();
        LocalTensor {
            name: Arc::from(Fp8Block::scale_name(&t.name)),
            shape: to_blocks(&t.shape, true),
            dtype: DType::F32,
            encoding: Encoding::Fp8Scales(self.fp8.config.encoding.clone()),
            placements,
        }
    }

    /// The FP8 pass over one rank's layout: FP8 tensors marked, each followed by its scales.
    pub fn encode_rank(&self, layout: RankLayout) -> RankLayout {
        let mut tensors = Vec::with_capacity(layout.tensors.len());
        for mut t in layout.tensors {
            if self.tensors.contains(&t.name) {
                t.dtype = DType::F8E4m3;
                t.encoding = Encoding::Fp8Block(self.fp8.config.encoding.clone());
                let s = self.scale_tensor(&t);
                tensors.push(t);
                tensors.push(s);
            } else {
                tensors.push(t);
            }
        }
        RankLayout {
            rank: layout.rank,
            tensors,
        }
    }

    /// Local names of the FP8 tensors (one engine's; every engine has the same).
    pub fn fp8_tensors(&self) -> impl Iterator<Item = &str> {
        self.tensors.iter().map(|t| &**t)
    }
}

impl SideLayout for Fp8Side {
    fn side(&self) -> Side {
        self.inner.side()
    }

    fn ranks(&self) -> Vec<RankId> {
        self.inner.ranks()
    }

    fn world_size(&self) -> usize {
        self.inner.world_size()
    }

    fn engines(&self) -> u32 {
        self.inner.engines()
    }

    fn rank_layout(&self, rank: RankId) -> Option<RankLayout> {
        self.inner.rank_layout(rank).map(|l| self.encode_rank(l))
    }

    fn holders(&self, canonical: &str) -> Vec<Holder> {
        let mut h = self.inner.holders(canonical);
        if self.quantised(canonical) {
            for x in &mut h {
                if self.tensors.contains(&x.tensor) {
                    x.dtype = DType::F8E4m3;
                }
            }
        }
        h
    }

    fn dropped(&self) -> Vec<String> {
        self.inner.dropped()
    }

    fn for_each_canonical(&self, rank: RankId, f: &mut dyn FnMut(&str)) -> bool {
        // the scales' derived canonicals take no transfer: the planner sees the weights only
        self.inner.for_each_canonical(rank, f)
    }

    fn tensor_encoding(&self, tensor: &str) -> Option<Encoding> {
        self.tensors
            .contains(tensor)
            .then(|| Encoding::Fp8Block(self.fp8.config.encoding.clone()))
    }

    fn fp8_extra_parts(&self) -> &[Part] {
        &self.extra
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ignored_layers_match_on_dotted_module_paths_as_sglang_does() {
        assert!(module_path_match(
            "model.layers.0.self_attn.q_proj",
            "model.layers.0.self_attn.q_proj"
        ));
        assert!(module_path_match(
            "model.layers.0",
            "model.layers.0.mlp.down_proj"
        ));
        assert!(module_path_match("mlp.gate", "model.layers.3.mlp.gate"));
        assert!(!module_path_match(
            "mlp.gate",
            "model.layers.3.mlp.gate_proj"
        ));
        assert!(!module_path_match(
            "model.layers.1",
            "model.layers.10.mlp.up_proj"
        ));
    }

    #[test]
    fn hybrid_linear_attention_models_are_refused_fp8_by_name() {
        use crate::layout::fused_tp::{FusedTp, FusedTpLayout, LmHead};
        let spec = ModelSpec::resolve("qwen3-next-tiny").unwrap();
        let layout = FusedTpLayout::new(
            &spec,
            FusedTp {
                tp: 1,
                ep: 1,
                engines: 1,
                vocab_rows: 1024,
                lm_head: LmHead::Own(Arc::from("lm_head.weight")),
                routed_experts: "",
                drops: &[],
                fused_shared_experts: false,
                mla_down: "",
                hybrid_attention: "",
                expert_biases: ["w13_weight_bias", "w2_weight_bias"],
                sinks_dtype: None,
                local_names: &[],
            },
        )
        .unwrap();
        let config = serde_json::json!({"quantization_config": {
            "quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [16, 16]}});
        let f = Fp8Config::from_hf_model_config(&config).unwrap().unwrap();
        let fp8 = InferFp8::new(f, Recipe::Vllm).unwrap();
        let e = Fp8Side::new(Arc::new(layout), &spec, &Catalogue::of(&spec), fp8)
            .err()
            .expect("refused");
        assert!(
            e.to_string()
                .contains("Qwen3NextForCausalLM with FP8 blocks"),
            "{e}"
        );
        assert!(e.to_string().contains("serve these models in bf16"), "{e}");
    }
}
