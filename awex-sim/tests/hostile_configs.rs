//! Every family's config as transformers writes it (`awex-core/tests/fixtures/hf`), with any one
//! integer set to a hostile or odd value, goes through the whole chain (the config read, the
//! catalogue, both sides' layouts through the registered backends, every rank's plan) to an
//! error or a plan, never a panic: the tests run with overflow checks, so arithmetic that would
//! wrap in a release build panics here.

use awex_core::backend::side_layout;
use awex_core::layout::Side;
use awex_core::plan::Pair;
use awex_core::{BackendSpec, Catalogue, ModelSpec};
use serde_json::{Value, json};

/// Each integer of `cfg` (top level, and each integer in a top-level list) set to each of
/// `values`, one at a time, named.
fn with_each_integer_set(cfg: &Value, values: &[u64]) -> Vec<(String, Value)> {
    let mut out = Vec::new();
    for (key, v) in cfg.as_object().expect("a config is an object") {
        let mut at = |path: String, set: &dyn Fn(&mut Value, u64)| {
            for &x in values {
                let mut c = cfg.clone();
                set(&mut c, x);
                out.push((format!("{path}={x}"), c));
            }
        };
        match v {
            Value::Number(n) if n.is_u64() => at(key.clone(), &|c, x| c[key] = json!(x)),
            Value::Array(items) => {
                for (i, item) in items.iter().enumerate() {
                    if item.is_u64() {
                        at(format!("{key}[{i}]"), &|c, x| c[key][i] = json!(x));
                    }
                }
            }
            _ => {}
        }
    }
    out
}

/// Plans every rank of both sides of each pair of `sides` the model's layouts allow: (plans
/// made, refusals).
fn plan_all(model: &ModelSpec, sides: &[(&str, &str)]) -> (usize, usize) {
    let cat = Catalogue::of(model);
    let (mut made, mut refused) = (0, 0);
    for (t, i) in sides {
        let ts: BackendSpec = t.parse().expect("a training spec");
        let is: BackendSpec = i.parse().expect("an inference spec");
        let (Ok(tl), Ok(il)) = (
            side_layout(Side::Training, &ts, model),
            side_layout(Side::Inference, &is, model),
        ) else {
            refused += 1;
            continue;
        };
        let pair = Pair {
            catalogue: &cat,
            training: &*tl,
            inference: &*il,
            encode_on_sender: false,
        };
        for (side, l) in [(Side::Training, &tl), (Side::Inference, &il)] {
            for rank in l.ranks() {
                match pair.plan_rank(side, rank) {
                    Ok(_) => made += 1,
                    Err(_) => refused += 1,
                }
            }
        }
    }
    (made, refused)
}

#[test]
fn a_hostile_integer_in_any_family_s_config_is_an_error_or_a_plan_never_a_panic() {
    std::hint::black_box((
        awex_megatron::CRATE,
        awex_sglang::CRATE,
        awex_fsdp::CRATE,
        awex_vllm::CRATE,
    ));
    let dir = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../awex-core/tests/fixtures/hf"
    );
    let mut files: Vec<_> = std::fs::read_dir(dir)
        .expect("the fixtures")
        .map(|e| e.expect("an entry").path())
        .filter(|p| p.extension().is_some_and(|x| x == "json"))
        .collect();
    files.sort();
    assert!(files.len() >= 19, "{} fixtures", files.len());
    let values = [u64::MAX, (1 << 20) + 1, 0, 3, 1024];
    let sides = [
        ("megatron:tp=2,pp=2,ep=2,etp=1", "sglang:tp=2,ep=2"),
        ("fsdp:dp=3", "vllm:tp=2,ep=2"),
    ];
    let mut bad = Vec::new();
    let (mut configs_refused, mut made, mut refused) = (0, 0, 0);
    for f in &files {
        let fixture: Value =
            serde_json::from_str(&std::fs::read_to_string(f).expect("a fixture")).expect("json");
        let name = f
            .file_name()
            .expect("a name")
            .to_string_lossy()
            .into_owned();
        for (what, cfg) in with_each_integer_set(&fixture["config"], &values) {
            let r = std::panic::catch_unwind(|| match ModelSpec::from_config_value(&cfg) {
                Err(_) => None,
                Ok(model) => Some(plan_all(&model, &sides)),
            });
            match r {
                Err(_) => bad.push(format!("{name} {what}")),
                Ok(None) => configs_refused += 1,
                Ok(Some((m, r))) => {
                    made += m;
                    refused += r;
                }
            }
        }
    }
    assert!(bad.is_empty(), "panicked:\n{}", bad.join("\n"));
    // every outcome was reached
    assert!(
        configs_refused > 100 && made > 1000 && refused > 100,
        "{configs_refused} configs refused; {made} plans made, {refused} refused"
    );
}
