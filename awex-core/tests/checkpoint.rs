//! Reading hostile or broken safetensors checkpoints: every file is untrusted, so offsets that
//! wrap, duplicate names, shards that disagree with the index, paths that leave the model
//! directory and files that are not regular files are refused with a message that quotes
//! nothing of what they hold; random headers never panic.

use awex_core::model::presets::preset;
use awex_core::model::{Catalogue, Checkpoint, ModelSpec};
use proptest::prelude::*;
use serde_json::{Value, json};
use std::path::Path;
use std::sync::mpsc;
use std::time::Duration;

fn tiny() -> Catalogue {
    Catalogue::of(&preset("qwen3-tiny").expect("preset"))
}

/// A safetensors file from a raw header text and `data` bytes.
fn raw_file(header: &str, data: &[u8]) -> Vec<u8> {
    let mut out = (header.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(header.as_bytes());
    out.extend_from_slice(data);
    out
}

/// Header entries and data for every tensor of `cat` (bf16, bytes `7`), names filtered by `keep`.
fn tensors(cat: &Catalogue, keep: impl Fn(&str) -> bool) -> (serde_json::Map<String, Value>, u64) {
    let mut h = serde_json::Map::new();
    let mut at = 0u64;
    for c in cat.tensors().iter().filter(|c| keep(&c.name)) {
        h.insert(
            c.name.clone(),
            json!({"dtype": "BF16", "shape": c.shape.as_slice(), "data_offsets": [at, at + c.nbytes()]}),
        );
        at += c.nbytes();
    }
    (h, at)
}

fn write_file(path: &Path, h: &serde_json::Map<String, Value>, data_len: u64) {
    let text = serde_json::to_string(h).expect("json");
    std::fs::write(path, raw_file(&text, &vec![7u8; data_len as usize])).expect("write");
}

fn write_index(dir: &Path, map: &[(&str, &str)]) {
    let m: serde_json::Map<String, Value> =
        map.iter().map(|(t, s)| (t.to_string(), json!(s))).collect();
    std::fs::write(
        dir.join("model.safetensors.index.json"),
        json!({"metadata": {}, "weight_map": m}).to_string(),
    )
    .expect("write index");
}

/// Opens on a thread and gives up after 10 s (a FIFO blocks `open()` forever).
fn open_err(dir: &Path) -> String {
    let (tx, rx) = mpsc::channel();
    let d = dir.to_path_buf();
    std::thread::spawn(move || {
        let r = Checkpoint::open(&d, &tiny()).map(|c| c.len());
        let _ = tx.send(r.map_err(|e| e.to_string()));
    });
    match rx.recv_timeout(Duration::from_secs(10)) {
        Ok(Ok(n)) => panic!("checkpoint with {n} tensors was accepted"),
        Ok(Err(e)) => e,
        Err(mpsc::RecvTimeoutError::Disconnected) => panic!("Checkpoint::open panicked"),
        Err(mpsc::RecvTimeoutError::Timeout) => {
            panic!("Checkpoint::open did not return within 10 s")
        }
    }
}

/// Splits the tiny model over two shards (embedding and layer 0 in the first) with an index.
fn two_shards(dir: &Path) -> Vec<(String, &'static str)> {
    let cat = tiny();
    let first = |n: &str| n.starts_with("model.embed") || n.starts_with("model.layers.0.");
    let (a, alen) = tensors(&cat, first);
    let (b, blen) = tensors(&cat, |n| !first(n));
    write_file(&dir.join("a.safetensors"), &a, alen);
    write_file(&dir.join("b.safetensors"), &b, blen);
    a.keys()
        .map(|k| (k.clone(), "a.safetensors"))
        .chain(b.keys().map(|k| (k.clone(), "b.safetensors")))
        .collect()
}

fn index_of(dir: &Path, map: &[(String, &str)]) {
    let m: Vec<(&str, &str)> = map.iter().map(|(t, s)| (t.as_str(), *s)).collect();
    write_index(dir, &m);
}

#[test]
fn offsets_that_wrap_around_2_pow_64_are_refused() {
    let cat = tiny();
    let dir = tempfile::tempdir().expect("tempdir");
    let (mut h, len) = tensors(&cat, |_| true);
    let name = "model.norm.weight";
    let nbytes = cat.get(name).expect("norm").nbytes();
    let entry =
        |end: u64| json!({"dtype": "BF16", "shape": [64], "data_offsets": [end - nbytes, end]});
    // both offsets have 20 digits whatever `end` is near 2^64, so the header length is fixed
    h.insert(name.into(), entry(u64::MAX - 1000));
    let text_len = serde_json::to_string(&h).expect("json").len() as u64;
    // 8 + header + end wraps to 4: inside the file; begin = end - 128 lies before the mapping
    let end = u64::MAX - (8 + text_len) + 5;
    h.insert(name.into(), entry(end));
    assert_eq!(
        serde_json::to_string(&h).expect("json").len() as u64,
        text_len
    );
    write_file(&dir.path().join("model.safetensors"), &h, len);
    let e = open_err(dir.path());
    assert!(
        e.contains("`model.norm.weight` (header entry") && e.contains("outside the"),
        "{e}"
    );
}

#[test]
fn a_tensor_name_twice_in_one_header_is_refused() {
    let cat = tiny();
    let dir = tempfile::tempdir().expect("tempdir");
    let (h, len) = tensors(&cat, |_| true);
    let mut text = serde_json::to_string(&h).expect("json");
    // the same name again, pointing at the first tensor's bytes
    let (first, entry) = h.iter().next().expect("a tensor");
    text.pop();
    text.push_str(&format!(",{}:{entry}}}", json!(first)));
    std::fs::write(
        dir.path().join("model.safetensors"),
        raw_file(&text, &vec![7u8; len as usize]),
    )
    .expect("write");
    let e = open_err(dir.path());
    assert!(
        e.ends_with(&format!(
            "is not a valid safetensors file: tensor `{first}` appears twice in its header"
        )),
        "{e}"
    );
}

#[test]
fn each_tensor_comes_from_the_shard_the_index_names() {
    let dir = tempfile::tempdir().expect("tempdir");
    let map = two_shards(dir.path());
    index_of(dir.path(), &map);
    let ck = Checkpoint::open(dir.path(), &tiny()).expect("valid sharded checkpoint");
    assert_eq!(ck.len(), tiny().len());
    assert_eq!(ck.tensor("model.norm.weight"), Some(&[7u8; 128][..]));

    // the index names the other shard for one tensor
    let moved: Vec<(String, &str)> = map
        .iter()
        .map(|(t, s)| {
            let s = if t == "model.norm.weight" {
                "a.safetensors"
            } else {
                *s
            };
            (t.clone(), s)
        })
        .collect();
    index_of(dir.path(), &moved);
    let e = open_err(dir.path());
    assert!(
        e.ends_with(
            "tensor `model.norm.weight` is in `b.safetensors` but the index names `a.safetensors`"
        ),
        "{e}"
    );
}

#[test]
fn a_tensor_in_two_shards_is_refused() {
    let cat = tiny();
    let dir = tempfile::tempdir().expect("tempdir");
    let map = two_shards(dir.path());
    // c.safetensors holds lm_head again (b holds it too); the index names c for it
    let (c, clen) = tensors(&cat, |n| n == "lm_head.weight");
    write_file(&dir.path().join("c.safetensors"), &c, clen);
    let with_c: Vec<(String, &str)> = map
        .iter()
        .map(|(t, s)| {
            let s = if t == "lm_head.weight" {
                "c.safetensors"
            } else {
                *s
            };
            (t.clone(), s)
        })
        .collect();
    index_of(dir.path(), &with_c);
    let e = open_err(dir.path());
    assert!(
        e.ends_with("tensor `lm_head.weight` is in both `b.safetensors` and `c.safetensors`"),
        "{e}"
    );
}

#[test]
fn shard_paths_must_stay_inside_the_model_directory() {
    let outer = tempfile::tempdir().expect("tempdir");
    let dir = outer.path().join("model");
    std::fs::create_dir(&dir).expect("mkdir");
    let map = two_shards(&dir);
    // a valid shard outside the directory, reached by `..`, an absolute path, and a symlink
    std::fs::rename(
        dir.join("b.safetensors"),
        outer.path().join("b.safetensors"),
    )
    .expect("mv");
    let abs = outer.path().join("b.safetensors");
    let abs = abs.to_str().expect("utf-8 path");
    for (name, want) in [
        (
            "../b.safetensors",
            "`../b.safetensors` is not a plain relative file name",
        ),
        (abs, "is not a plain relative file name"),
    ] {
        let m: Vec<(String, &str)> = map
            .iter()
            .map(|(t, s)| (t.clone(), if *s == "b.safetensors" { name } else { *s }))
            .collect();
        index_of(&dir, &m);
        let e = open_err(&dir);
        assert!(e.contains(want), "{name}: {e}");
    }
    std::os::unix::fs::symlink(
        outer.path().join("b.safetensors"),
        dir.join("b.safetensors"),
    )
    .expect("symlink");
    index_of(&dir, &map);
    let e = open_err(&dir);
    assert!(
        e.contains("`b.safetensors` leads outside the model directory"),
        "{e}"
    );
}

#[test]
fn a_hub_cache_snapshot_may_link_into_its_repository_blobs_only() {
    // <repo>/snapshots/<rev>/x -> ../../blobs/<hash>, as the Hugging Face hub cache lays it out
    let repo = tempfile::tempdir().expect("tempdir");
    let snap = repo.path().join("snapshots").join("0123abc");
    let blobs = repo.path().join("blobs");
    std::fs::create_dir_all(&snap).expect("mkdir");
    std::fs::create_dir_all(&blobs).expect("mkdir");
    let map = two_shards(&snap);
    index_of(&snap, &map);
    for (i, f) in [
        "a.safetensors",
        "b.safetensors",
        "model.safetensors.index.json",
    ]
    .iter()
    .enumerate()
    {
        let blob = blobs.join(format!("hash{i}"));
        std::fs::rename(snap.join(f), &blob).expect("mv");
        std::os::unix::fs::symlink(format!("../../blobs/hash{i}"), snap.join(f)).expect("symlink");
    }
    let ck = Checkpoint::open(&snap, &tiny()).expect("hub snapshot");
    assert_eq!(ck.len(), tiny().len());
    // a link to another repository's blobs leads outside
    let other = repo.path().join("other-blobs");
    std::fs::create_dir(&other).expect("mkdir");
    std::fs::rename(blobs.join("hash1"), other.join("hash1")).expect("mv");
    std::fs::remove_file(snap.join("b.safetensors")).expect("rm");
    std::os::unix::fs::symlink("../../other-blobs/hash1", snap.join("b.safetensors"))
        .expect("symlink");
    let e = open_err(&snap);
    assert!(
        e.contains("`b.safetensors` leads outside the model directory"),
        "{e}"
    );
}

#[test]
fn a_fifo_is_refused_instead_of_blocking() {
    let dir = tempfile::tempdir().expect("tempdir");
    let map = two_shards(dir.path());
    index_of(dir.path(), &map);
    std::fs::remove_file(dir.path().join("b.safetensors")).expect("rm");
    let fifo = std::ffi::CString::new(
        dir.path()
            .join("b.safetensors")
            .to_str()
            .expect("utf-8 path"),
    )
    .expect("c string");
    // SAFETY: a valid NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(fifo.as_ptr(), 0o600) }, 0);
    let e = open_err(dir.path());
    assert!(e.ends_with("it is a FIFO, not a regular file"), "{e}");
}

#[test]
fn every_reader_of_a_named_config_refuses_a_fifo_instead_of_blocking() {
    let dir = tempfile::tempdir().expect("tempdir");
    let file = dir.path().join("config.json");
    let c = std::ffi::CString::new(file.to_str().expect("utf-8 path")).expect("c string");
    // SAFETY: a valid NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
    let arg = dir.path().to_str().expect("utf-8 path");
    let want = "it is a FIFO, not a regular file";
    for e in [
        ModelSpec::read_config(dir.path()).map(|_| ()).unwrap_err(),
        ModelSpec::from_path(&file).map(|_| ()).unwrap_err(),
        ModelSpec::resolve(arg).map(|_| ()).unwrap_err(),
        ModelSpec::config_value_of(arg).map(|_| ()).unwrap_err(),
    ] {
        assert!(e.to_string().ends_with(want), "{e}");
    }
    // a preset has no config to read; a real config reads as JSON
    assert_eq!(
        ModelSpec::config_value_of("qwen3-tiny").expect("preset"),
        None
    );
    std::fs::remove_file(&file).expect("rm");
    std::fs::write(&file, r#"{"architectures": ["Qwen3ForCausalLM"]}"#).expect("write");
    let v = ModelSpec::config_value_of(arg)
        .expect("read")
        .expect("a config");
    assert_eq!(v["architectures"][0], "Qwen3ForCausalLM");
}

#[test]
fn errors_never_echo_what_a_non_checkpoint_file_holds() {
    let dir = tempfile::tempdir().expect("tempdir");
    let map = two_shards(dir.path());
    index_of(dir.path(), &map);
    // a shard that is really some other file, as /etc/passwd would be
    let secret = b"root:x:0:0:root:/root:/bin/bash\ndaemon:x:1:1:daemon:/usr/sbin\n";
    std::fs::write(dir.path().join("b.safetensors"), secret).expect("write");
    let e = open_err(dir.path());
    let first8 = u64::from_le_bytes(secret[..8].try_into().expect("8 bytes"));
    assert!(!e.contains(&first8.to_string()), "{e}");
    assert!(!e.contains("root"), "{e}");
    assert!(
        e.ends_with("is not a valid safetensors file: its header length field is above the 100000000 bytes a safetensors header may have"),
        "{e}"
    );
    // a header length that fits, over text that is not JSON
    let mut f = 40u64.to_le_bytes().to_vec();
    f.extend_from_slice(&secret[..]);
    std::fs::write(dir.path().join("b.safetensors"), f).expect("write");
    let e = open_err(dir.path());
    assert!(!e.contains("root") && !e.contains("daemon"), "{e}");
    assert!(
        e.contains("its header is not valid JSON (line 1, column"),
        "{e}"
    );
    // JSON whose values are secrets
    let text = r#"{"password": "hunter2-secret"}"#;
    std::fs::write(dir.path().join("b.safetensors"), raw_file(text, b"")).expect("write");
    let e = open_err(dir.path());
    assert!(!e.contains("hunter2"), "{e}");
    assert!(
        e.contains("`password` (header entry 0) has no `dtype`"),
        "{e}"
    );
}

#[test]
fn dtype_and_shape_must_match_the_byte_length_exactly() {
    let cat = tiny();
    let dir = tempfile::tempdir().expect("tempdir");
    let (mut h, len) = tensors(&cat, |_| true);
    // 64 bf16 elements are 128 bytes, the entry spans 126
    let off = h["model.norm.weight"]["data_offsets"].clone();
    let begin = off[0].as_u64().expect("offset");
    h.insert(
        "model.norm.weight".into(),
        json!({"dtype": "BF16", "shape": [64], "data_offsets": [begin, begin + 126]}),
    );
    write_file(&dir.path().join("model.safetensors"), &h, len);
    let e = open_err(dir.path());
    assert!(
        e.contains("is BF16 [64], which is 128 bytes, but its data_offsets span 126 bytes"),
        "{e}"
    );
    // a shape whose element count overflows 64 bits
    h.insert(
        "model.norm.weight".into(),
        json!({"dtype": "BF16", "shape": [1u64 << 62, 8], "data_offsets": [begin, begin + 128]}),
    );
    write_file(&dir.path().join("model.safetensors"), &h, len);
    let e = open_err(dir.path());
    assert!(e.contains("which is more than 2^64 bytes"), "{e}");
}

/// Offsets inside a small file, anywhere, or within 1000 of 2^64 (where sums wrap).
fn offset() -> impl Strategy<Value = u64> {
    prop_oneof![0u64..600, any::<u64>(), u64::MAX - 1000..=u64::MAX]
}

/// Dimensions: small, anywhere, or large enough that their product overflows.
fn size() -> impl Strategy<Value = u64> {
    prop_oneof![0u64..70, any::<u64>(), 1u64 << 31..1u64 << 34]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, failure_persistence: None, ..ProptestConfig::default() })]

    /// Random headers (offsets anywhere in u64, random shapes and dtypes, random lengths) never
    /// panic and never hand out bytes outside the file.
    #[test]
    fn random_headers_never_panic_or_read_out_of_bounds(
        entries in prop::collection::vec(
            (0usize..4, prop::collection::vec(size(), 0..3), offset(), offset(), 0usize..3),
            0..6,
        ),
        data_len in 0usize..512,
        len_delta in -3i64..3,
    ) {
        let cat = tiny();
        let names = ["model.norm.weight", "lm_head.weight", "model.embed_tokens.weight", "x"];
        let dtypes = ["BF16", "F32", "U8"];
        let mut text = String::from("{");
        for (i, (n, shape, a, b, d)) in entries.iter().enumerate() {
            if i > 0 {
                text.push(',');
            }
            text.push_str(&format!(
                "{}:{{\"dtype\":\"{}\",\"shape\":{},\"data_offsets\":[{a},{b}]}}",
                json!(names[*n]), dtypes[*d], json!(shape)
            ));
        }
        text.push('}');
        let mut bytes = ((text.len() as i64 + len_delta).max(0) as u64).to_le_bytes().to_vec();
        bytes.extend_from_slice(text.as_bytes());
        bytes.extend(vec![3u8; data_len]);
        let dir = tempfile::tempdir().expect("tempdir");
        std::fs::write(dir.path().join("model.safetensors"), &bytes).expect("write");
        match Checkpoint::open(dir.path(), &cat) {
            Ok(ck) => {
                for c in cat.tensors() {
                    let t = ck.tensor(&c.name).expect("every tensor");
                    prop_assert_eq!(t.len() as u64, c.nbytes());
                }
            }
            Err(e) => prop_assert!(!e.to_string().is_empty()),
        }
    }
}
