//! Encodings: how a side stores a tensor, with the CPU reference of each.
//!
//! A tensor is stored [`Encoding::Plain`] (bf16/fp16/fp32 elements, as the training side
//! holds them) or [`Encoding::Fp8Block`] (`float8_e4m3fn` elements plus an fp32 scale per
//! block, the layout of DeepSeek-V3's, Kimi-K2's and Qwen3's FP8 checkpoints). This module
//! holds the FP8 format ([`e4m3`]), the encoding and its parsing from an HF
//! `quantization_config` ([`fp8_block`]), the quantisers awex reproduces byte for byte
//! ([`recipe`]), the CPU reference quantiser and dequantiser ([`quantise`]) and exact deltas
//! against the version a receiver holds ([`delta`]; a bucket's segments framed for a GPU decoder:
//! [`delta_frame`]). The GPU kernel
//! with the same bytes is in `awex-gpu` (`cuda::fp8`).

pub mod delta;
pub mod delta_frame;
pub mod e4m3;
pub mod fp8_block;
pub mod quantise;
pub mod recipe;
pub mod side;

use crate::dtype::DType;
use serde::{Deserialize, Serialize};

pub use delta::{DeltaError, DeltaStats};
pub use fp8_block::{Fp8Block, Fp8Config, QuantConfigError, ScaleFormat};
pub use quantise::{DequantTo, Fp8Quantiser, QuantiseError, Shape2d, dequantise};
pub use recipe::{Recipe, TorchDevice};
pub use side::{Fp8Side, InferFp8};

/// How one side stores a tensor.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Encoding {
    /// Elements of one dtype, as they are.
    Plain(DType),
    /// e4m3fn elements and an fp32 `weight_scale_inv` per block.
    Fp8Block(Fp8Block),
    /// The fp32 scales of an [`Encoding::Fp8Block`] tensor (`weight_scale_inv`), one per block,
    /// in block coordinates: written with the weight by the quantiser, never on their own.
    Fp8Scales(Fp8Block),
}

impl Encoding {
    /// Bytes of one element's payload (the scales are a tensor of their own).
    pub fn element_size(&self) -> usize {
        match self {
            Encoding::Plain(d) => d.size(),
            Encoding::Fp8Block(_) => 1,
            Encoding::Fp8Scales(_) => 4,
        }
    }

    /// Whether this is an FP8 encoding (the weight or its scales).
    pub fn is_fp8(&self) -> bool {
        !matches!(self, Encoding::Plain(_))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn encodings_serialise_by_name_and_fp8_stores_one_byte_per_element() {
        let plain = Encoding::Plain(DType::Bf16);
        let fp8 = Encoding::Fp8Block(Recipe::DeepGemmUe8m0.encoding([128, 128]));
        assert_eq!(
            serde_json::to_string(&plain).unwrap(),
            r#"{"plain":"bf16"}"#
        );
        assert_eq!(
            serde_json::to_string(&fp8).unwrap(),
            r#"{"fp8_block":{"block":[128,128],"scale_format":"ue8m0"}}"#
        );
        for e in [&plain, &fp8] {
            let back: Encoding = serde_json::from_str(&serde_json::to_string(e).unwrap()).unwrap();
            assert_eq!(&back, e);
        }
        assert_eq!(plain.element_size(), 2);
        assert_eq!(fp8.element_size(), 1);
    }
}
