//! A minimal safetensors writer (header JSON + raw little-endian bytes), for `--dump-dir`.

use anyhow::Context;
use awex_core::DType;
use std::io::Write;
use std::path::Path;

/// Writes tensors `(name, dtype, shape, bytes)` to a safetensors file, creating parent directories.
pub fn write(path: &Path, tensors: &[(String, DType, Vec<u64>, &[u8])]) -> anyhow::Result<()> {
    let mut sorted: Vec<&(String, DType, Vec<u64>, &[u8])> = tensors.iter().collect();
    sorted.sort_by(|a, b| a.0.cmp(&b.0));
    let mut header = serde_json::Map::new();
    let mut at = 0u64;
    for (name, dtype, shape, bytes) in &sorted {
        let end = at + bytes.len() as u64;
        header.insert(
            name.clone(),
            serde_json::json!({ "dtype": dtype.safetensors_name(), "shape": shape, "data_offsets": [at, end] }),
        );
        at = end;
    }
    let mut text = serde_json::to_vec(&serde_json::Value::Object(header))?;
    while text.len() % 8 != 0 {
        text.push(b' ');
    }
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    let f = std::fs::File::create(path).with_context(|| format!("creating {}", path.display()))?;
    let mut w = std::io::BufWriter::with_capacity(1 << 20, f);
    w.write_all(&(text.len() as u64).to_le_bytes())?;
    w.write_all(&text)?;
    for (_, _, _, bytes) in sorted {
        w.write_all(bytes)?;
    }
    w.flush()?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_names_offsets_and_bytes_follow_the_format() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("a/b.safetensors");
        let (x, y) = ([1u8, 2, 3, 4], [9u8, 9]);
        write(
            &p,
            &[
                ("z".into(), DType::Bf16, vec![2], &x[..]),
                ("a".into(), DType::U8, vec![2, 1], &y[..]),
            ],
        )
        .unwrap();
        let data = std::fs::read(&p).unwrap();
        let n = u64::from_le_bytes(data[..8].try_into().unwrap()) as usize;
        assert_eq!(n % 8, 0);
        let h: serde_json::Value = serde_json::from_slice(&data[8..8 + n]).unwrap();
        assert_eq!(h["a"]["data_offsets"], serde_json::json!([0, 2]));
        assert_eq!(h["z"]["dtype"], "BF16");
        assert_eq!(h["z"]["data_offsets"], serde_json::json!([2, 6]));
        assert_eq!(&data[8 + n..], &[9, 9, 1, 2, 3, 4]);
    }
}
