//! Reading an HF safetensors checkpoint (single file or sharded with an index), memory-mapped.
//!
//! Every byte of the files is untrusted. Offsets and sizes are checked in 64-bit arithmetic
//! that cannot wrap, the header length is bounded before the header is parsed, a tensor name
//! may appear once in a file and once in the whole checkpoint, each tensor must lie in exactly
//! the shard the index names, shard names stay inside the model directory, only regular files
//! are opened (never blocking on a FIFO or device), and no error message quotes the files'
//! contents beyond names that look like names.

use super::Catalogue;
use super::file::{inside, open_regular, read_regular, shown};
use crate::dtype::DType;
use crate::layout::MAX_DIMS;
use crate::limits::{MAX_JSON_BYTES, MAX_SAFETENSORS_HEADER_BYTES};
use serde::de::{Deserialize, Deserializer, MapAccess, Visitor};
use serde_json::Value;
use std::collections::{HashMap, HashSet};
use std::fmt;
use std::fs::File;
use std::path::Path;
use std::sync::Arc;

/// Why a checkpoint cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    /// A file could not be read or mapped.
    #[error("cannot read {path}: {message}")]
    Io {
        /// the file
        path: String,
        /// the cause
        message: String,
    },
    /// A file is not valid safetensors.
    #[error("{path} is not a valid safetensors file: {message}")]
    Format {
        /// the file
        path: String,
        /// what is wrong
        message: String,
    },
    /// The checkpoint disagrees with the model's catalogue, or its index with its shards.
    #[error("checkpoint {dir}: {message}")]
    Mismatch {
        /// the directory
        dir: String,
        /// the first difference
        message: String,
    },
}

struct Mapped {
    ptr: *const u8,
    len: usize,
}

// SAFETY: a read-only private mapping, never written.
unsafe impl Send for Mapped {}
// SAFETY: as above.
unsafe impl Sync for Mapped {}

impl Drop for Mapped {
    fn drop(&mut self) {
        if self.len > 0 {
            // SAFETY: ptr/len come from a successful mmap.
            unsafe { libc::munmap(self.ptr as *mut libc::c_void, self.len) };
        }
    }
}

impl Mapped {
    fn bytes(&self) -> &[u8] {
        if self.len == 0 {
            return &[];
        }
        // SAFETY: the mapping is `len` readable bytes for as long as `self` lives.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
}

/// Maps `len` bytes of an open regular file read-only.
fn map_file(f: &File, len: u64) -> Result<Mapped, String> {
    let len = usize::try_from(len).map_err(|_| format!("{len} bytes do not fit this machine"))?;
    if len == 0 {
        return Ok(Mapped {
            ptr: std::ptr::null(),
            len: 0,
        });
    }
    use std::os::fd::AsRawFd;
    // SAFETY: mapping an open file read-only; checked for failure.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ,
            libc::MAP_PRIVATE,
            f.as_raw_fd(),
            0,
        )
    };
    if p == libc::MAP_FAILED {
        return Err(std::io::Error::last_os_error().to_string());
    }
    Ok(Mapped {
        ptr: p as *const u8,
        len,
    })
}

/// A JSON object's entries in file order, keeping duplicate keys (which a map would drop).
struct Entries<V>(Vec<(String, V)>);

impl<'de, V: Deserialize<'de>> Deserialize<'de> for Entries<V> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V2<V>(std::marker::PhantomData<V>);
        impl<'de, V: Deserialize<'de>> Visitor<'de> for V2<V> {
            type Value = Entries<V>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut m: A) -> Result<Entries<V>, A::Error> {
                let mut v = Vec::new();
                while let Some(e) = m.next_entry::<String, V>()? {
                    v.push(e);
                }
                Ok(Entries(v))
            }
        }
        d.deserialize_map(V2(std::marker::PhantomData))
    }
}

/// The index file: only `weight_map` is read.
#[derive(serde::Deserialize)]
struct Index {
    weight_map: Entries<String>,
}

/// Where a JSON document went wrong, without quoting it (serde_json's messages can).
fn json_error(e: &serde_json::Error) -> String {
    use serde_json::error::Category;
    let what = match e.classify() {
        Category::Io => "cannot be read",
        Category::Syntax => "is not valid JSON",
        Category::Data => "does not have the expected structure",
        Category::Eof => "ends early",
    };
    format!("{what} (line {}, column {})", e.line(), e.column())
}

/// The dtypes awex reads, by safetensors name.
fn dtype_of(name: &str) -> Option<DType> {
    [
        DType::Bf16,
        DType::F16,
        DType::F32,
        DType::F64,
        DType::U8,
        DType::I8,
        DType::I32,
        DType::I64,
        DType::F8E4m3,
    ]
    .into_iter()
    .find(|d| d.safetensors_name() == name)
}

/// One tensor of a file's header, checked against the file.
struct HeaderTensor {
    name: String,
    dtype: DType,
    shape: Vec<u64>,
    /// byte range in the file
    start: u64,
    end: u64,
}

/// Parses and checks one safetensors file's header: every tensor's dtype, shape and byte range.
fn parse_header(bytes: &[u8]) -> Result<Vec<HeaderTensor>, String> {
    let file_len = bytes.len() as u64;
    let Some(len_field) = bytes.get(..8) else {
        return Err(format!(
            "it is {file_len} bytes, shorter than the 8-byte header length"
        ));
    };
    let mut le = [0u8; 8];
    le.copy_from_slice(len_field);
    let n = u64::from_le_bytes(le);
    // The length field is file content: say how it is wrong without printing it.
    if n > MAX_SAFETENSORS_HEADER_BYTES {
        return Err(format!(
            "its header length field is above the {MAX_SAFETENSORS_HEADER_BYTES} bytes a safetensors header may have"
        ));
    }
    let data_start = n + 8; // n is at most 10^8
    if data_start > file_len {
        return Err(format!(
            "its header length field runs past the end of the file ({file_len} bytes)"
        ));
    }
    let data_len = file_len - data_start;
    let header = &bytes[8..data_start as usize];
    let entries: Entries<Value> =
        serde_json::from_slice(header).map_err(|e| format!("its header {}", json_error(&e)))?;
    let mut seen = HashSet::new();
    let mut out = Vec::with_capacity(entries.0.len());
    for (i, (name, t)) in entries.0.into_iter().enumerate() {
        if !seen.insert(name.clone()) {
            return Err(format!(
                "tensor {} appears twice in its header",
                shown(&name)
            ));
        }
        if name == "__metadata__" {
            continue;
        }
        let what = || format!("tensor {} (header entry {i})", shown(&name));
        let dtype_name = t.get("dtype").and_then(Value::as_str);
        let dtype = dtype_name
            .and_then(dtype_of)
            .ok_or_else(|| match dtype_name {
                Some(d) => format!(
                    "{} has dtype {}, not one of BF16, F16, F32, F64, U8, I8, I32, I64",
                    what(),
                    shown(d)
                ),
                None => format!("{} has no `dtype`", what()),
            })?;
        let shape: Vec<u64> = t
            .get("shape")
            .and_then(Value::as_array)
            .filter(|s| s.len() <= MAX_DIMS)
            .and_then(|s| s.iter().map(Value::as_u64).collect::<Option<Vec<u64>>>())
            .ok_or_else(|| {
                format!(
                    "{} has no `shape` of at most {MAX_DIMS} non-negative integers",
                    what()
                )
            })?;
        let (begin, end) = t
            .get("data_offsets")
            .and_then(Value::as_array)
            .filter(|o| o.len() == 2)
            .and_then(|o| Some((o[0].as_u64()?, o[1].as_u64()?)))
            .ok_or_else(|| format!("{} has no `data_offsets` [begin, end]", what()))?;
        if begin > end || end > data_len {
            return Err(format!(
                "{} has data_offsets [{begin}, {end}] outside the {data_len} data bytes of the file",
                what()
            ));
        }
        let want = shape
            .iter()
            .try_fold(1u64, |a, &d| a.checked_mul(d))
            .and_then(|n| n.checked_mul(dtype.size() as u64));
        if want != Some(end - begin) {
            return Err(format!(
                "{} is {} {shape:?}, which is {} bytes, but its data_offsets span {} bytes",
                what(),
                dtype.safetensors_name(),
                want.map_or_else(|| "more than 2^64".to_string(), |w| w.to_string()),
                end - begin
            ));
        }
        out.push(HeaderTensor {
            name,
            dtype,
            shape,
            start: data_start + begin,
            end: data_start + end,
        });
    }
    // No two tensors share bytes.
    let mut ranges: Vec<(u64, u64, &str)> = out
        .iter()
        .filter(|t| t.end > t.start)
        .map(|t| (t.start, t.end, t.name.as_str()))
        .collect();
    ranges.sort_unstable();
    if let Some(w) = ranges.windows(2).find(|w| w[1].0 < w[0].1) {
        return Err(format!(
            "tensors {} and {} overlap",
            shown(w[0].2),
            shown(w[1].2)
        ));
    }
    Ok(out)
}

/// A hint for a tensor of a decoder layer the model does not have: the layer index is past
/// `num_hidden_layers`, which is what an MTP layer the config does not declare looks like.
fn past_the_layers(name: &str, cat: &Catalogue) -> String {
    let layer = |n: &str| -> Option<u64> {
        n.strip_prefix("model.layers.")?
            .split_once('.')?
            .0
            .parse()
            .ok()
    };
    let (Some(l), Some(last)) = (
        layer(name),
        cat.tensors().iter().filter_map(|t| layer(&t.name)).max(),
    ) else {
        return String::new();
    };
    if l > last {
        format!(
            " (past the model's {} decoder layers; a config with multi-token-prediction layers \
             declares them in num_nextn_predict_layers, and awex skips them)",
            last + 1
        )
    } else {
        String::new()
    }
}

/// One tensor's bytes: inside a mapped file, or widened from a narrower float type.
enum Entry {
    /// `[start, end)` of mapped file `file`, in the catalogue's dtype.
    Mapped {
        file: usize,
        start: usize,
        end: usize,
    },
    /// The stored tensor widened to the catalogue's fp32 ([`widens`]).
    Widened(Vec<u8>),
}

/// Whether a tensor stored as `stored` is read as the catalogue's `needed` by widening it, which
/// is exact: a bf16 or fp16 tensor where the model holds fp32 (a DeepSeek-V3 router's
/// `e_score_correction_bias` in a checkpoint written by `model.to(torch.bfloat16)`). SGLang and
/// vLLM load such a tensor with `param.data.copy_(loaded_weight)` into their fp32 parameter,
/// which widens it so.
fn widens(stored: DType, needed: DType) -> bool {
    needed == DType::F32 && matches!(stored, DType::Bf16 | DType::F16)
}

/// A memory-mapped HF checkpoint whose tensors match a model's catalogue exactly.
pub struct Checkpoint {
    files: Vec<Arc<Mapped>>,
    tensors: HashMap<String, Entry>,
    /// tensors the checkpoint holds under a not-moved rule ([`Catalogue::not_moved`]), sorted
    skipped: Vec<String>,
}

impl Checkpoint {
    /// Whether `dir` names safetensors weights (`model.safetensors` or an index exists, of any
    /// file type, so that [`Checkpoint::open`] explains what is wrong with it).
    pub fn present(dir: &Path) -> bool {
        ["model.safetensors", "model.safetensors.index.json"]
            .iter()
            .any(|f| std::fs::symlink_metadata(dir.join(f)).is_ok())
    }

    /// Opens the checkpoint in `dir` and checks it against the catalogue (names, shapes, dtypes).
    pub fn open(dir: &Path, cat: &Catalogue) -> Result<Self, CheckpointError> {
        let mismatch = |message: String| CheckpointError::Mismatch {
            dir: dir.display().to_string(),
            message,
        };
        let index_name = "model.safetensors.index.json";
        let index_path = dir.join(index_name);
        // shard name -> the tensors the index puts there (None: no index, one file)
        let (shards, weight_map): (Vec<String>, Option<HashMap<String, String>>) =
            if std::fs::symlink_metadata(&index_path).is_ok() {
                let path = inside(dir, index_name).map_err(&mismatch)?;
                let io = |message: String| CheckpointError::Io {
                    path: path.display().to_string(),
                    message,
                };
                let text = read_regular(&path, MAX_JSON_BYTES).map_err(io)?;
                let index: Index =
                    serde_json::from_slice(&text).map_err(|e| CheckpointError::Format {
                        path: path.display().to_string(),
                        message: format!(
                            "the index {}; it must be an object with a `weight_map` of tensor name to shard file",
                            json_error(&e)
                        ),
                    })?;
                let mut map = HashMap::with_capacity(index.weight_map.0.len());
                for (name, shard) in index.weight_map.0 {
                    if map.insert(name.clone(), shard).is_some() {
                        return Err(mismatch(format!(
                            "the index lists tensor {} twice",
                            shown(&name)
                        )));
                    }
                }
                let mut shards: Vec<String> = map.values().cloned().collect();
                shards.sort();
                shards.dedup();
                (shards, Some(map))
            } else {
                (vec!["model.safetensors".to_string()], None)
            };
        // Pass 1: map and parse every shard.
        let mut headers = Vec::with_capacity(shards.len());
        let mut files = Vec::with_capacity(shards.len());
        for shard in &shards {
            let path = inside(dir, shard).map_err(&mismatch)?;
            let io = |message: String| CheckpointError::Io {
                path: path.display().to_string(),
                message,
            };
            let (f, len) = open_regular(&path).map_err(io)?;
            let m = map_file(&f, len).map_err(io)?;
            drop(f);
            let header = parse_header(m.bytes()).map_err(|message| CheckpointError::Format {
                path: path.display().to_string(),
                message,
            })?;
            headers.push(header);
            files.push(Arc::new(m));
        }
        // Pass 2: each tensor in one shard, the one the index names, as the catalogue has it.
        let mut found: HashMap<&str, usize> = HashMap::new();
        for (fi, header) in headers.iter().enumerate() {
            for t in header {
                if let Some(&other) = found.get(t.name.as_str()) {
                    return Err(mismatch(format!(
                        "tensor {} is in both {} and {}",
                        shown(&t.name),
                        shown(&shards[other]),
                        shown(&shards[fi])
                    )));
                }
                found.insert(&t.name, fi);
            }
        }
        let mut ck = Checkpoint {
            files,
            tensors: HashMap::with_capacity(found.len()),
            skipped: Vec::new(),
        };
        for (fi, header) in headers.iter().enumerate() {
            let shard = &shards[fi];
            for t in header {
                let name = shown(&t.name);
                if let Some(map) = &weight_map {
                    match map.get(&t.name) {
                        Some(s) if s == shard => {}
                        Some(s) => {
                            return Err(mismatch(format!(
                                "tensor {name} is in {} but the index names {}",
                                shown(shard),
                                shown(s)
                            )));
                        }
                        None => {
                            return Err(mismatch(format!(
                                "tensor {name} is in {} but the index does not list it",
                                shown(shard)
                            )));
                        }
                    }
                }
                let Some(c) = cat.get(&t.name) else {
                    if cat.not_moved().iter().any(|r| r.covers(&t.name)) {
                        ck.skipped.push(t.name.clone());
                        continue;
                    }
                    return Err(mismatch(format!(
                        "{name} is not a tensor of the model in config.json{}",
                        past_the_layers(&t.name, cat)
                    )));
                };
                if c.shape.as_slice() != t.shape.as_slice()
                    || (t.dtype != c.dtype && !widens(t.dtype, c.dtype))
                {
                    return Err(mismatch(format!(
                        "{name} is {} {:?} but the model needs {} {}{}",
                        t.dtype.safetensors_name(),
                        t.shape,
                        c.dtype.safetensors_name(),
                        c.shape,
                        if c.shape.as_slice() == t.shape.as_slice() && c.dtype == DType::F32 {
                            " (or BF16 / F16, which awex widens)"
                        } else {
                            ""
                        }
                    )));
                }
                // parse_header checked start <= end <= the file's length, which is the mapping's
                let (start, end) = (t.start as usize, t.end as usize);
                let entry = if t.dtype == c.dtype {
                    Entry::Mapped {
                        file: fi,
                        start,
                        end,
                    }
                } else {
                    let stored = ck.files[fi].bytes().get(start..end).unwrap_or_default();
                    let mut wide = vec![0u8; stored.len() / t.dtype.size() * c.dtype.size()];
                    crate::dtype::convert(stored, t.dtype, &mut wide, c.dtype).map_err(|e| {
                        mismatch(format!("{name}: widening {} to {}: {e}", t.dtype, c.dtype))
                    })?;
                    Entry::Widened(wide)
                };
                ck.tensors.insert(t.name.clone(), entry);
            }
        }
        if let Some(map) = &weight_map {
            let mut listed: Vec<(&String, &String)> = map.iter().collect();
            listed.sort();
            if let Some((name, shard)) = listed
                .into_iter()
                .find(|(n, _)| !found.contains_key(n.as_str()))
            {
                return Err(mismatch(format!(
                    "the index puts tensor {} in {}, which does not hold it",
                    shown(name),
                    shown(shard)
                )));
            }
        }
        if let Some(missing) = cat
            .tensors()
            .iter()
            .find(|c| !ck.tensors.contains_key(&c.name))
        {
            return Err(mismatch(format!("`{}` is missing", missing.name)));
        }
        ck.skipped.sort();
        Ok(ck)
    }

    /// The tensors the checkpoint holds that a not-moved rule skips (the MTP layers' tensors of
    /// a DeepSeek-V3 or GLM-4.5 checkpoint), sorted; they are neither checked nor moved.
    pub fn skipped(&self) -> &[String] {
        &self.skipped
    }

    /// A tensor's bytes (in its catalogue dtype: a narrower float tensor widened).
    pub fn tensor(&self, name: &str) -> Option<&[u8]> {
        match self.tensors.get(name)? {
            Entry::Mapped { file, start, end } => self.files[*file].bytes().get(*start..*end),
            Entry::Widened(v) => Some(v),
        }
    }

    /// Number of tensors.
    pub fn len(&self) -> usize {
        self.tensors.len()
    }

    /// Whether the checkpoint holds no tensor.
    pub fn is_empty(&self) -> bool {
        self.tensors.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::presets::preset;

    fn write(dir: &Path, tensors: &[(&str, &str, Vec<u64>, usize)]) {
        let mut h = serde_json::Map::new();
        let mut at = 0;
        for (name, dt, shape, len) in tensors {
            h.insert(
                name.to_string(),
                serde_json::json!({"dtype": dt, "shape": shape, "data_offsets": [at, at + len]}),
            );
            at += len;
        }
        let text = serde_json::to_vec(&h).unwrap();
        let mut out = (text.len() as u64).to_le_bytes().to_vec();
        out.extend(text);
        out.extend(vec![7u8; at]);
        std::fs::write(dir.join("model.safetensors"), out).unwrap();
    }

    fn all(cat: &Catalogue) -> Vec<(&str, &str, Vec<u64>, usize)> {
        cat.tensors()
            .iter()
            .map(|c| {
                (
                    c.name.as_str(),
                    c.dtype.safetensors_name(),
                    c.shape.as_slice().to_vec(),
                    c.nbytes() as usize,
                )
            })
            .collect()
    }

    #[test]
    fn opens_a_matching_checkpoint_and_names_the_first_mismatch() {
        let cat = Catalogue::of(&preset("qwen3-tiny").unwrap());
        let dir = tempfile::tempdir().unwrap();
        write(dir.path(), &all(&cat));
        let ck = Checkpoint::open(dir.path(), &cat).unwrap();
        assert_eq!(ck.len(), cat.len());
        assert_eq!(ck.tensor("model.norm.weight").unwrap(), &[7u8; 128][..]);

        let mut t = all(&cat);
        t.retain(|x| x.0 != "model.norm.weight");
        write(dir.path(), &t);
        let e = Checkpoint::open(dir.path(), &cat)
            .err()
            .unwrap()
            .to_string();
        assert!(e.ends_with("`model.norm.weight` is missing"), "{e}");

        let mut t = all(&cat);
        t[0].2 = vec![999, 64];
        t[0].3 = 999 * 64 * 2;
        write(dir.path(), &t);
        let e = Checkpoint::open(dir.path(), &cat)
            .err()
            .unwrap()
            .to_string();
        assert!(
            e.contains(
                "`model.embed_tokens.weight` is BF16 [999, 64] but the model needs BF16 [1000, 64]"
            ),
            "{e}"
        );

        std::fs::write(
            dir.path().join("model.safetensors"),
            b"\xff\xff\xff\xff\xff\xff\xff\x7f{}",
        )
        .unwrap();
        let e = Checkpoint::open(dir.path(), &cat)
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains("is not a valid safetensors file"), "{e}");
    }

    #[test]
    fn a_bf16_router_bias_is_widened_to_the_fp32_the_model_holds() {
        // what `model.to(torch.bfloat16).save_pretrained(...)` writes for DeepSeek-V3: every
        // tensor BF16, the router's e_score_correction_bias ([8], F32 in the model) included
        let cat = Catalogue::of(&preset("deepseek-v3-tiny").unwrap());
        let bias = "model.layers.1.mlp.gate.e_score_correction_bias";
        assert_eq!(cat.get(bias).unwrap().dtype, DType::F32);
        let dir = tempfile::tempdir().unwrap();
        let stored = |dt: &'static str, size: usize| {
            let mut t = all(&cat);
            for x in t
                .iter_mut()
                .filter(|x| x.0.ends_with("e_score_correction_bias"))
            {
                x.1 = dt;
                x.3 = 8 * size;
            }
            t
        };
        for dt in ["BF16", "F16"] {
            write(dir.path(), &stored(dt, 2));
            let ck = Checkpoint::open(dir.path(), &cat).unwrap();
            // every stored byte is 7: bf16 0x0707 widens to f32 0x07070000 exactly, fp16 0x0707
            // (a subnormal) to its exact f32
            let want: Vec<u8> = if dt == "BF16" {
                [0u8, 0, 7, 7].repeat(8)
            } else {
                let mut v = vec![0u8; 32];
                crate::dtype::convert(&[7u8; 16], DType::F16, &mut v, DType::F32).unwrap();
                assert_eq!(
                    f32::from_le_bytes(v[..4].try_into().unwrap()),
                    0x0707 as f32 * 2f32.powi(-24)
                );
                v
            };
            assert_eq!(ck.tensor(bias).unwrap(), &want[..], "{dt}");
            assert_eq!(ck.tensor("model.norm.weight").unwrap(), &[7u8; 128][..]);
        }
        // nothing else changes: F64 and I32 stay refused, and a narrower copy of a BF16 tensor
        // too (awex never narrows a checkpoint)
        write(dir.path(), &stored("F64", 8));
        let e = Checkpoint::open(dir.path(), &cat)
            .err()
            .unwrap()
            .to_string();
        assert!(
            e.contains(&format!(
                "`{bias}` is F64 [8] but the model needs F32 [8] (or BF16 / F16, which awex widens)"
            )),
            "{e}"
        );
        let mut t = all(&cat);
        let norm = t.iter_mut().find(|x| x.0 == "model.norm.weight").unwrap();
        norm.1 = "F32";
        norm.3 = 64 * 4;
        write(dir.path(), &t);
        let e = Checkpoint::open(dir.path(), &cat)
            .err()
            .unwrap()
            .to_string();
        assert!(
            e.contains("`model.norm.weight` is F32 [64] but the model needs BF16 [64]"),
            "{e}"
        );
    }

    #[test]
    fn a_declared_mtp_layer_is_skipped_and_listed_an_undeclared_one_is_named() {
        // a DeepSeek-V3 checkpoint with its MTP layer after the decoder layers (as the published
        // one holds model.layers.61.*)
        let mut spec = preset("deepseek-v3-tiny").unwrap();
        let layers = spec.num_layers;
        let mtp = [
            format!("model.layers.{layers}.enorm.weight"),
            format!("model.layers.{layers}.eh_proj.weight"),
            format!("model.layers.{layers}.mlp.experts.0.gate_proj.weight"),
        ];
        fn with_mtp<'a>(
            cat: &'a Catalogue,
            mtp: &'a [String],
        ) -> Vec<(&'a str, &'a str, Vec<u64>, usize)> {
            let mut t = all(cat);
            for n in mtp {
                t.push((n.as_str(), "BF16", vec![64], 128));
            }
            t
        }
        let dir = tempfile::tempdir().unwrap();

        // not declared: refused, naming the tensor and the field that declares it
        let cat = Catalogue::of(&spec);
        write(dir.path(), &with_mtp(&cat, &mtp));
        let e = Checkpoint::open(dir.path(), &cat)
            .err()
            .unwrap()
            .to_string();
        assert!(
            e.contains(
                "is not a tensor of the model in config.json (past the model's 3 decoder layers"
            ) && e.contains("num_nextn_predict_layers"),
            "{e}"
        );

        // declared: every MTP tensor skipped and listed, every catalogue tensor opened
        spec.mtp_layers = 1;
        let cat = Catalogue::of(&spec);
        write(dir.path(), &with_mtp(&cat, &mtp));
        let ck = Checkpoint::open(dir.path(), &cat).unwrap();
        assert_eq!(ck.len(), cat.len());
        let mut want = mtp.to_vec();
        want.sort();
        assert_eq!(ck.skipped(), want.as_slice());
        assert!(ck.tensor(&mtp[0]).is_none());

        // a layer past the declared MTP layers is still refused
        let mut t = with_mtp(&cat, &mtp);
        let beyond = format!("model.layers.{}.enorm.weight", layers + 1);
        t.push((beyond.as_str(), "BF16", vec![64], 128));
        write(dir.path(), &t);
        let e = Checkpoint::open(dir.path(), &cat)
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains(&beyond), "{e}");
    }
}
