//! Opening the files of a model directory safely: regular files only, never blocking, and
//! (for names read from an index) never outside the directory.

pub(crate) use crate::file::{open_regular, read_regular};
use std::path::{Component, Path, PathBuf};

/// A string from a file, quoted for a message: shown only if it looks like a name awex itself
/// would print (ASCII letters, digits, `._-/`, at most 256 characters), so that an error about a
/// file that is not what it claims to be never echoes what it holds.
pub(crate) fn shown(s: &str) -> String {
    let plain = !s.is_empty()
        && s.len() <= 256
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-' | b'/'));
    if plain {
        format!("`{s}`")
    } else {
        format!("a name of {} bytes that is not a plain name", s.len())
    }
}

/// The directories files of `dir` may resolve into: `dir` itself and, for a snapshot of the
/// Hugging Face hub cache (`<repo>/snapshots/<revision>`, whose files are symlinks to
/// `<repo>/blobs/<hash>`), that repository's `blobs`.
fn roots(dir: &Path) -> Result<Vec<PathBuf>, String> {
    let canon = dir.canonicalize().map_err(|e| e.to_string())?;
    let mut v = vec![canon.clone()];
    if let Some(snapshots) = canon.parent() {
        if snapshots.file_name().is_some_and(|n| n == "snapshots") {
            if let Some(repo) = snapshots.parent() {
                v.push(repo.join("blobs"));
            }
        }
    }
    Ok(v)
}

/// Resolves a file name read from `dir`'s index: a plain relative path (no `..`, `.`, root or
/// prefix) that, symlinks followed, stays inside `dir` (see [`roots`]).
pub(crate) fn inside(dir: &Path, name: &str) -> Result<PathBuf, String> {
    let rel = Path::new(name);
    let plain = !name.is_empty() && rel.components().all(|c| matches!(c, Component::Normal(_)));
    if !plain {
        return Err(format!(
            "{} is not a plain relative file name inside the model directory (no `..`, `.` or absolute path)",
            shown(name)
        ));
    }
    let path = dir.join(rel);
    let real = path
        .canonicalize()
        .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    let roots = roots(dir).map_err(|e| format!("cannot read {}: {e}", dir.display()))?;
    if !roots.iter().any(|r| real.starts_with(r)) {
        return Err(format!(
            "{} leads outside the model directory {} (to {}); awex reads only files inside it",
            shown(name),
            dir.display(),
            real.display()
        ));
    }
    Ok(path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_plain_names_inside_the_directory_resolve() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("a.safetensors"), b"x").unwrap();
        assert_eq!(
            inside(dir.path(), "a.safetensors").unwrap(),
            dir.path().join("a.safetensors")
        );
        for bad in ["../a.safetensors", "/etc/passwd", "./a.safetensors", ""] {
            assert!(
                inside(dir.path(), bad)
                    .unwrap_err()
                    .contains("is not a plain relative file name"),
                "{bad}"
            );
        }
    }

    #[test]
    fn file_contents_are_not_shown() {
        assert_eq!(
            shown("model.layers.0.mlp.gate.weight"),
            "`model.layers.0.mlp.gate.weight`"
        );
        assert_eq!(
            shown("root:x:0:0"),
            "a name of 10 bytes that is not a plain name"
        );
    }
}
