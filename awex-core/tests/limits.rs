//! Hostile sizes are refused at once, naming the field, its value and awex's limit: in a
//! config.json, in a layout a process reports, in a box copy.

use awex_core::DType;
use awex_core::layout::copy::copy_box;
use awex_core::layout::{Dims, LocalTensor, Placement, RankId, RankLayout, Region, validate_rank};
use awex_core::model::presets::preset;
use awex_core::model::{Catalogue, ModelSpec};
use serde_json::{Value, json};
use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::sync::Arc;

/// Counts the bytes each thread allocates, so that a test can say how much work a refusal did
/// (a wall-clock bound would fail on a loaded machine).
struct Counting;

thread_local! {
    static ALLOCATED: Cell<usize> = const { Cell::new(0) };
}

// SAFETY: every call is passed on to the system allocator unchanged; the count is a
// thread-local cell with no destructor.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        let _ = ALLOCATED.try_with(|c| c.set(c.get().saturating_add(l.size())));
        // SAFETY: the caller's layout is passed on as is.
        unsafe { System.alloc(l) }
    }

    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        // SAFETY: `p` came from `alloc` above, which is the system allocator's.
        unsafe { System.dealloc(p, l) }
    }
}

#[global_allocator]
static COUNTING: Counting = Counting;

/// Bytes this thread allocated while running `f`, and its result.
fn allocated<T>(f: impl FnOnce() -> T) -> (usize, T) {
    let before = ALLOCATED.with(Cell::get);
    let r = f();
    (ALLOCATED.with(Cell::get) - before, r)
}

fn qwen3() -> Value {
    json!({
        "architectures": ["Qwen3ForCausalLM"],
        "hidden_size": 64,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "intermediate_size": 128,
        "vocab_size": 1000,
        "dtype": "bfloat16"
    })
}

/// The error for `cfg` with `field` set to `value`, checked to come before anything was built
/// from it: the refusal allocates less than 1 MiB (a walk of the hostile size would take
/// gigabytes).
fn refused(field: &str, value: Value) -> String {
    let mut cfg = qwen3();
    cfg[field] = value;
    let (bytes, r) = allocated(|| ModelSpec::from_config_value(&cfg));
    let e = match r {
        Ok(spec) => panic!("{field} was accepted: {spec:?}"),
        Err(e) => {
            // a source is either said in the message or kept as the source, not both: a
            // report of the whole chain would say it twice
            let text = e.to_string();
            if let Some(source) = std::error::Error::source(&e) {
                assert!(!text.contains(&source.to_string()), "{text}");
            }
            text
        }
    };
    assert!(
        bytes < 1 << 20,
        "{field}: refusing it allocated {bytes} bytes"
    );
    e
}

#[test]
fn a_billion_layers_are_refused_before_anything_walks_them() {
    assert_eq!(
        refused("num_hidden_layers", json!(1_000_000_000u64)),
        "model num_hidden_layers=1000000000 is above awex's limit of 1024 (8x the most layers of a real model, 126)"
    );
    // 1e9 as JSON writes it is not an integer at all
    assert_eq!(
        refused(
            "num_hidden_layers",
            serde_json::from_str("1e9").expect("json")
        ),
        "config.json field `num_hidden_layers`: expected a non-negative integer, found 1000000000.0"
    );
}

#[test]
fn a_vocabulary_of_2_pow_62_is_refused() {
    assert_eq!(
        refused("vocab_size", json!(1u64 << 62)),
        "model vocab_size=4611686018427387904 is above awex's limit of 4194304 (16x the largest real vocabulary, 262144)"
    );
}

#[test]
fn a_head_dim_of_u64_max_is_refused() {
    assert_eq!(
        refused("head_dim", json!(u64::MAX)),
        "model head_dim=18446744073709551615 is above awex's limit of 1024 (4x the largest real head_dim, 256)"
    );
}

#[test]
fn linear_attention_sizes_of_u64_max_are_refused_by_name() {
    let fixture: Value = serde_json::from_str(
        &std::fs::read_to_string(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/fixtures/hf/qwen3-next.json"
        ))
        .expect("the Qwen3-Next fixture"),
    )
    .expect("json");
    for (field, limit, why) in [
        (
            "linear_num_key_heads",
            1024,
            "6x the most heads of a real model, 160",
        ),
        (
            "linear_num_value_heads",
            1024,
            "6x the most heads of a real model, 160",
        ),
        (
            "linear_key_head_dim",
            1024,
            "4x the largest real head_dim, 256",
        ),
        (
            "linear_value_head_dim",
            1024,
            "4x the largest real head_dim, 256",
        ),
        (
            "linear_conv_kernel_dim",
            64,
            "16x the largest real convolution kernel, 4",
        ),
    ] {
        let mut cfg = fixture["config"].clone();
        cfg[field] = json!(u64::MAX);
        let (bytes, r) = allocated(|| ModelSpec::from_config_value(&cfg));
        assert_eq!(
            r.map(|s| s.name).map_err(|e| e.to_string()),
            Err(format!(
                "model {field}={} is above awex's limit of {limit} ({why})",
                u64::MAX
            ))
        );
        assert!(
            bytes < 1 << 20,
            "{field}: refusing it allocated {bytes} bytes"
        );
    }
}

#[test]
fn sizes_each_within_limits_can_still_be_too_large_together() {
    let mut cfg = qwen3();
    cfg["hidden_size"] = json!(65_536);
    cfg["intermediate_size"] = json!(1 << 20);
    cfg["num_hidden_layers"] = json!(1024);
    cfg["num_attention_heads"] = json!(64);
    cfg["num_key_value_heads"] = json!(8);
    let e = ModelSpec::from_config_value(&cfg)
        .map(|s| s.name)
        .map_err(|e| e.to_string());
    let bytes = (1024u128
        * (2 * 65_536 + 3 * (1 << 20) * 65_536 + 2 * 1024 * 65_536 + 2 * 128 * 65_536 + 2 * 16)
        + 2 * 1000 * 65_536
        + 65_536)
        * 2;
    assert_eq!(
        e,
        Err(format!(
            "model total bytes={bytes} is above awex's limit of 17592186044416 (16 TiB, 2x a 2T-parameter model in fp32)"
        ))
    );
}

#[test]
fn every_preset_is_within_the_limits() {
    for name in awex_core::model::presets::names() {
        let spec = preset(name).expect("preset");
        assert_eq!(spec.validate(), Ok(()), "{name}");
    }
    let cat = Catalogue::of(&preset("moe-1t").expect("preset"));
    assert!(cat.len() < 100_000);
}

fn hostile(region: Region, local_offset: Dims, shape: Dims) -> RankLayout {
    let name: Arc<str> = Arc::from("model.norm.weight");
    RankLayout {
        rank: RankId::train(0),
        tensors: vec![LocalTensor {
            name: name.clone(),
            shape,
            dtype: DType::Bf16,
            encoding: awex_core::encoding::Encoding::Plain(DType::Bf16),
            placements: vec![Placement {
                canonical: name,
                region,
                local_offset,
                transposed: false,
            }],
        }],
    }
}

#[test]
fn a_reported_box_whose_end_wraps_around_2_pow_64_is_out_of_bounds() {
    let cat = Catalogue::of(&preset("qwen3-tiny").expect("preset"));
    // offset + extent wraps to 1, which would "fit" the 64-element norm
    let wrap = Region::new([u64::MAX], [2]);
    let e = validate_rank(&hostile(wrap, Dims::new(&[0]), Dims::new(&[64])), &cat)
        .map_err(|e| e.to_string());
    assert_eq!(
        e,
        Err(
            "rank 0/0: `model.norm.weight` places box [18446744073709551615..18446744073709551617] of `model.norm.weight`, outside its shape [64]"
                .into()
        )
    );
    // a local offset that wraps the same way
    let e = validate_rank(
        &hostile(
            Region::new([0], [64]),
            Dims::new(&[u64::MAX - 10]),
            Dims::new(&[64]),
        ),
        &cat,
    )
    .map_err(|e| e.to_string());
    assert!(
        e.as_ref()
            .is_err_and(|e| e.contains("outside its local shape [64]")),
        "{e:?}"
    );
    // a local shape whose bytes do not fit 64 bits
    let e = validate_rank(
        &hostile(
            Region::new([0], [64]),
            Dims::new(&[0, 0]),
            Dims::new(&[1 << 40, 1 << 40]),
        ),
        &cat,
    )
    .map_err(|e| e.to_string());
    assert!(
        e.as_ref().is_err_and(
            |e| e.contains("has shape [1099511627776, 1099511627776] of bf16, more than")
        ),
        "{e:?}"
    );
}

#[test]
fn a_box_copy_with_wrapping_offsets_is_refused_not_a_panic() {
    let src = vec![1u8; 8];
    let mut dst = vec![0u8; 8];
    let e = copy_box(
        &src,
        &Dims::new(&[4]),
        &Dims::new(&[u64::MAX]),
        DType::Bf16,
        &mut dst,
        &Dims::new(&[4]),
        &Dims::new(&[0]),
        DType::Bf16,
        &Dims::new(&[2]),
    )
    .map_err(|e| e.to_string());
    assert_eq!(
        e,
        Err("box [2] at [18446744073709551615] does not fit a tensor of shape [4]".into())
    );
    // a shape whose byte size wraps to 0 cannot claim an empty buffer is long enough
    let e = copy_box(
        &src,
        &Dims::new(&[1 << 63]),
        &Dims::new(&[0]),
        DType::Bf16,
        &mut dst,
        &Dims::new(&[4]),
        &Dims::new(&[0]),
        DType::Bf16,
        &Dims::new(&[2]),
    )
    .map_err(|e| e.to_string());
    assert!(
        e.as_ref()
            .is_err_and(|e| e.contains("is smaller than shape")),
        "{e:?}"
    );
}
