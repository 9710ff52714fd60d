//! Reading an HF safetensors checkpoint (single file or sharded with an index), memory-mapped.

use super::Catalogue;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
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
    /// The checkpoint disagrees with the model's catalogue.
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

fn map_file(path: &Path) -> Result<Mapped, CheckpointError> {
    let io = |m: String| CheckpointError::Io {
        path: path.display().to_string(),
        message: m,
    };
    let f = std::fs::File::open(path).map_err(|e| io(e.to_string()))?;
    let len = f.metadata().map_err(|e| io(e.to_string()))?.len() as usize;
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
        return Err(io(std::io::Error::last_os_error().to_string()));
    }
    Ok(Mapped {
        ptr: p as *const u8,
        len,
    })
}

/// One tensor's bytes inside a mapped file.
struct Entry {
    file: usize,
    start: usize,
    end: usize,
}

/// A memory-mapped HF checkpoint whose tensors match a model's catalogue exactly.
pub struct Checkpoint {
    files: Vec<Arc<Mapped>>,
    tensors: HashMap<String, Entry>,
}

impl Checkpoint {
    /// Whether `dir` holds safetensors weights (`model.safetensors` or an index).
    pub fn present(dir: &Path) -> bool {
        dir.join("model.safetensors").is_file()
            || dir.join("model.safetensors.index.json").is_file()
    }

    /// Opens the checkpoint in `dir` and checks it against the catalogue (names, shapes, dtypes).
    pub fn open(dir: &Path, cat: &Catalogue) -> Result<Self, CheckpointError> {
        let index = dir.join("model.safetensors.index.json");
        let files: Vec<PathBuf> = if index.is_file() {
            let text = std::fs::read_to_string(&index).map_err(|e| CheckpointError::Io {
                path: index.display().to_string(),
                message: e.to_string(),
            })?;
            let v: serde_json::Value =
                serde_json::from_str(&text).map_err(|e| CheckpointError::Format {
                    path: index.display().to_string(),
                    message: e.to_string(),
                })?;
            let mut names: Vec<String> = v
                .get("weight_map")
                .and_then(|m| m.as_object())
                .map(|m| {
                    m.values()
                        .filter_map(|f| f.as_str().map(String::from))
                        .collect()
                })
                .unwrap_or_default();
            names.sort();
            names.dedup();
            names.into_iter().map(|n| dir.join(n)).collect()
        } else {
            vec![dir.join("model.safetensors")]
        };
        let mut ck = Checkpoint {
            files: Vec::new(),
            tensors: HashMap::new(),
        };
        for (fi, path) in files.iter().enumerate() {
            let m = map_file(path)?;
            let fmt = |message: String| CheckpointError::Format {
                path: path.display().to_string(),
                message,
            };
            // SAFETY: the mapping is `len` bytes long.
            let bytes = unsafe { std::slice::from_raw_parts(m.ptr, m.len) };
            if bytes.len() < 8 {
                return Err(fmt("shorter than its 8-byte header length".into()));
            }
            let n = u64::from_le_bytes(bytes[..8].try_into().unwrap_or([0; 8])) as usize;
            let header = bytes
                .get(8..8usize.saturating_add(n))
                .ok_or_else(|| fmt(format!("header of {n} bytes runs past the end")))?;
            let h: serde_json::Map<String, serde_json::Value> =
                serde_json::from_slice(header).map_err(|e| fmt(format!("header: {e}")))?;
            let data = 8 + n;
            for (name, t) in h {
                if name == "__metadata__" {
                    continue;
                }
                let off = t
                    .get("data_offsets")
                    .and_then(|o| o.as_array())
                    .filter(|o| o.len() == 2)
                    .and_then(|o| Some((o[0].as_u64()? as usize, o[1].as_u64()? as usize)))
                    .ok_or_else(|| fmt(format!("`{name}` has no data_offsets")))?;
                if off.0 > off.1 || data + off.1 > bytes.len() {
                    return Err(fmt(format!("`{name}` lies outside the file")));
                }
                let shape: Vec<u64> = t
                    .get("shape")
                    .and_then(|s| s.as_array())
                    .map(|s| s.iter().filter_map(|d| d.as_u64()).collect())
                    .unwrap_or_default();
                let dtype = t.get("dtype").and_then(|d| d.as_str()).unwrap_or("?");
                let Some(c) = cat.get(&name) else {
                    return Err(CheckpointError::Mismatch {
                        dir: dir.display().to_string(),
                        message: format!("`{name}` is not a tensor of the model in config.json"),
                    });
                };
                if c.shape.as_slice() != shape.as_slice() || dtype != c.dtype.safetensors_name() {
                    return Err(CheckpointError::Mismatch {
                        dir: dir.display().to_string(),
                        message: format!(
                            "`{name}` is {dtype} {shape:?} but the model needs {} {}",
                            c.dtype.safetensors_name(),
                            c.shape
                        ),
                    });
                }
                if (off.1 - off.0) as u64 != c.nbytes() {
                    return Err(fmt(format!(
                        "`{name}` has {} bytes, not {}",
                        off.1 - off.0,
                        c.nbytes()
                    )));
                }
                ck.tensors.insert(
                    name,
                    Entry {
                        file: fi,
                        start: data + off.0,
                        end: data + off.1,
                    },
                );
            }
            ck.files.push(Arc::new(m));
        }
        if let Some(missing) = cat
            .tensors()
            .iter()
            .find(|c| !ck.tensors.contains_key(&c.name))
        {
            return Err(CheckpointError::Mismatch {
                dir: dir.display().to_string(),
                message: format!("`{}` is missing", missing.name),
            });
        }
        Ok(ck)
    }

    /// A tensor's bytes (in its catalogue dtype).
    pub fn tensor(&self, name: &str) -> Option<&[u8]> {
        let e = self.tensors.get(name)?;
        let m = &self.files[e.file];
        // SAFETY: the range was checked against the mapping when the checkpoint was opened.
        Some(unsafe { std::slice::from_raw_parts(m.ptr.add(e.start), e.end - e.start) })
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
                    "BF16",
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
}
