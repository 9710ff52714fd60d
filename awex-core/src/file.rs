//! Reading a file a user names safely: regular files only, never blocking, of bounded size.
//!
//! Every path awex reads from its caller (a `config.json`, an index, a token file, a topology
//! file, a checkpoint's tracker) goes through here: a FIFO or a device in its place is refused
//! with what it is instead of hanging `open()` or `read()`, and a file larger than its reader
//! expects is refused before it is read.

use std::fs::{File, Metadata};
use std::io::Read;
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
use std::path::Path;

/// What kind of file `m` is, for a message about a file that is not a regular one ("a FIFO",
/// "a directory", ...).
pub fn kind(m: &Metadata) -> &'static str {
    let t = m.file_type();
    if t.is_dir() {
        "a directory"
    } else if t.is_fifo() {
        "a FIFO"
    } else if t.is_socket() {
        "a socket"
    } else if t.is_char_device() {
        "a character device"
    } else if t.is_block_device() {
        "a block device"
    } else {
        "not a regular file"
    }
}

/// Opens `path` for reading if it is a regular file (after symlinks), with its length.
///
/// The type is checked before opening, and the file is opened with `O_NONBLOCK` and checked
/// again through the open descriptor, so a FIFO or device (or one swapped in between) is refused
/// instead of blocking `open()` or reading a stream.
pub fn open_regular(path: &Path) -> Result<(File, u64), String> {
    let m = std::fs::metadata(path).map_err(|e| e.to_string())?;
    if !m.is_file() {
        return Err(format!("it is {}, not a regular file", kind(&m)));
    }
    let f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_NOCTTY)
        .open(path)
        .map_err(|e| e.to_string())?;
    let m = f.metadata().map_err(|e| e.to_string())?;
    if !m.is_file() {
        return Err(format!("it is {}, not a regular file", kind(&m)));
    }
    Ok((f, m.len()))
}

/// Reads a regular file of at most `max` bytes.
pub fn read_regular(path: &Path, max: u64) -> Result<Vec<u8>, String> {
    let (f, len) = open_regular(path)?;
    if len > max {
        return Err(format!(
            "it is {len} bytes, more than the {max} bytes awex reads from such a file"
        ));
    }
    let mut out = Vec::with_capacity(len as usize);
    f.take(max + 1)
        .read_to_end(&mut out)
        .map_err(|e| e.to_string())?;
    if out.len() as u64 > max {
        return Err(format!(
            "it grew past the {max} bytes awex reads from such a file"
        ));
    }
    Ok(out)
}

/// [`read_regular`] as UTF-8 text.
pub fn read_regular_text(path: &Path, max: u64) -> Result<String, String> {
    String::from_utf8(read_regular(path, max)?).map_err(|_| "it is not UTF-8 text".to_string())
}
