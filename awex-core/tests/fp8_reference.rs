//! awex's CPU block quantisers give torch's bytes: every recipe, every test matrix, on each
//! torch device whose digests `engines/fp8_refs.py` committed in
//! `tests/fixtures/fp8_reference.json` (the Python side checks its transcriptions against the
//! engines' own functions and regenerates those digests; see `engines/tests`).

use awex_core::encoding::{Fp8Quantiser, Recipe, Shape2d, TorchDevice};
use serde_json::Value;

/// The bf16 test matrices of `engines/fp8_refs.py::matrix_bits`, bit for bit.
fn matrix_bits(rows: usize, cols: usize, seed: u64) -> Vec<u16> {
    const PATTERNS: [(u64, u64); 8] = [
        (127 - 14, 17),
        (0, 0),
        (0, 1),
        (127 - 40, 20),
        (200, 54),
        (0, 130),
        (127 - 8, 9),
        (127 - 3, 2),
    ];
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    if s == 0 {
        s = 1;
    }
    let mut out = Vec::with_capacity(rows * cols);
    for r in 0..rows {
        for c in 0..cols {
            s ^= s >> 12;
            s ^= s << 25;
            s ^= s >> 27;
            let x = s.wrapping_mul(0x2545_F491_4F6C_DD1D);
            let (lo, span) = PATTERNS[((r / 128) * 7 + c / 128) % 8];
            if span == 0 {
                out.push(0);
                continue;
            }
            let sign = (x >> 63) & 1;
            let exp = lo + ((x >> 8) % span);
            let mant = x & 0x7f;
            out.push(((sign << 15) | (exp << 7) | mant) as u16);
        }
    }
    out
}

fn fnv1a(data: impl IntoIterator<Item = u8>) -> String {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in data {
        h = (h ^ b as u64).wrapping_mul(0x100_0000_01b3);
    }
    format!("{h:016x}")
}

fn fixture() -> Value {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/fp8_reference.json"
    );
    serde_json::from_str(&std::fs::read_to_string(path).expect("the committed fixture"))
        .expect("valid JSON")
}

/// (recipes checked, the ones whose digests differ)
fn check_device(key: &str, device: TorchDevice) -> (usize, Vec<String>) {
    let doc = fixture();
    let Some(cases) = doc[key]["cases"].as_object() else {
        return (0, vec![]);
    };
    let mut checked = 0;
    let mut wrong = vec![];
    for (case, recipes) in cases {
        // `ROWSxCOLS:SEED`, or `ROWSxCOLS:SEED:BNxBK` for blocks other than 128 x 128
        let mut parts = case.split(':');
        let pair = |s: &str| -> (usize, usize) {
            let (a, b) = s.split_once('x').expect("AxB");
            (a.parse().unwrap(), b.parse().unwrap())
        };
        let (rows, cols) = pair(parts.next().expect("shape"));
        let seed: u64 = parts.next().expect("seed").parse().unwrap();
        let block = parts.next().map_or([128, 128], |b| {
            let (bn, bk) = pair(b);
            [bn as u32, bk as u32]
        });
        let x = matrix_bits(rows, cols, seed);
        for (name, want) in recipes.as_object().expect("recipes") {
            let recipe: Recipe = name.parse().expect("a known recipe");
            let enc = recipe.encoding(block);
            let [sr, sc] = enc.scale_shape(rows as u64, cols as u64);
            let mut q = vec![0u8; rows * cols];
            let mut s = vec![0f32; (sr * sc) as usize];
            let quant = Fp8Quantiser {
                recipe,
                device,
                encoding: enc,
            };
            quant
                .quantise(
                    &x,
                    Shape2d::dense(rows, cols),
                    &mut q,
                    cols,
                    &mut s,
                    sc as usize,
                )
                .expect("finite input");
            let got = [
                fnv1a(q.iter().copied()),
                fnv1a(s.iter().flat_map(|v| v.to_le_bytes())),
            ];
            let want = [want[0].as_str().unwrap(), want[1].as_str().unwrap()];
            if got[0] != want[0] || got[1] != want[1] {
                wrong.push(format!(
                    "{key} {case} {name}: e4m3 {} vs {}, scales {} vs {}",
                    got[0], want[0], got[1], want[1]
                ));
            }
            checked += 1;
        }
    }
    (checked, wrong)
}

#[test]
fn every_recipe_matches_torch_on_the_cpu_byte_for_byte() {
    let (n, wrong) = check_device("cpu", TorchDevice::Cpu);
    assert!(
        wrong.is_empty(),
        "digests differ from torch's:\n{}",
        wrong.join("\n")
    );
    // six matrices in 128 x 128 blocks, one in 64 x 96 blocks (the recipes that take a block)
    assert_eq!(n, 6 * Recipe::ALL.len() + 7);
}

#[test]
fn every_recipe_matches_torch_on_cuda_byte_for_byte() {
    // written on a GPU machine by `python engines/fp8_refs.py --device cuda`
    let (n, wrong) = check_device("cuda", TorchDevice::Cuda);
    assert!(
        wrong.is_empty(),
        "digests differ from torch's:\n{}",
        wrong.join("\n")
    );
    assert_eq!(n, 6 * Recipe::ALL.len() + 7);
}

#[test]
fn the_digests_tell_cpu_from_cuda_arithmetic() {
    // `amax / 448.0` rounds differently on the two devices: the CPU digests must not match
    // quantisers that follow CUDA's rule (the ones that divide by a Python float)
    let (_, wrong) = check_device("cpu", TorchDevice::Cuda);
    for name in ["vllm", "deepgemm-legacy", "awex-python", "sglang-ue8m0"] {
        assert!(
            wrong.iter().any(|w| w.contains(&format!(" {name}: "))),
            "{name}: {wrong:?}"
        );
    }
}

#[test]
fn the_generator_covers_zero_subnormal_and_huge_blocks() {
    let x = matrix_bits(300, 520, 1);
    // block (0, 1): all zero; block (0, 2): subnormals; block (0, 4): huge
    assert!(
        x[..128 * 520]
            .chunks(520)
            .all(|r| r[128..256].iter().all(|&v| v == 0))
    );
    assert!(
        x[..520]
            .iter()
            .skip(256)
            .take(128)
            .all(|&v| v & 0x7f80 == 0)
    );
    assert!(
        x[..520]
            .iter()
            .skip(512)
            .take(8)
            .all(|&v| (v >> 7) & 0xff >= 200)
    );
}
