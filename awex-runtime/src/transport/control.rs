//! The control-segment codec shared by the `shm` and `cuda-ipc` transports: a POSIX
//! shared-memory segment of 64-bit words that a training rank writes once (a header of magic,
//! `ready` and `done` words and the transport's counts, then its tables) and its receivers read.
//! A receiver reads a segment another process wrote, so every count and index it takes from one
//! is checked (with checked arithmetic) against the mapping before it is used.

use crate::RuntimeError;
use crate::shm::ShmSegment;
use std::sync::atomic::{AtomicU64, Ordering};

/// The `ready` word of a segment no version was published in yet.
pub(crate) const NONE: u64 = u64::MAX;

/// A control segment, as 64-bit words.
pub(crate) struct ControlSegment {
    seg: ShmSegment,
}

impl ControlSegment {
    /// Creates segment `name` of `words` words (zeroed; not valid until [`Self::seal`]).
    pub(crate) fn create(name: &str, words: usize) -> Result<Self, RuntimeError> {
        let bytes = words
            .checked_mul(8)
            .ok_or(crate::ShmError::TablesOverflow)?;
        Ok(ControlSegment {
            seg: ShmSegment::create(name, bytes)?,
        })
    }

    /// Opens another rank's segment `name`.
    pub(crate) fn open(name: &str) -> Result<Self, RuntimeError> {
        Ok(ControlSegment {
            seg: ShmSegment::open(name)?,
        })
    }

    /// The underlying segment (its name, unlinking it).
    pub(crate) fn segment(&self) -> &ShmSegment {
        &self.seg
    }

    /// Whole words in the mapping.
    pub(crate) fn words(&self) -> usize {
        self.seg.len() / 8
    }

    /// Word `i`, or `None` outside the mapping.
    pub(crate) fn word_at(&self, i: usize) -> Option<&AtomicU64> {
        if i >= self.words() {
            return None;
        }
        // SAFETY: in bounds (checked above) and 8-byte aligned (page-aligned mapping).
        Some(unsafe { &*(self.seg.ptr().add(i * 8) as *const AtomicU64) })
    }

    /// Word `i` of a header or of a table whose bounds were checked when the segment was
    /// created or opened.
    pub(crate) fn word(&self, i: usize) -> &AtomicU64 {
        self.word_at(i)
            .unwrap_or_else(|| unreachable!("header and checked tables are inside the segment"))
    }

    /// The header's `ready` word: the `(version, attempt)` tag the sender published.
    pub(crate) fn ready(&self) -> &AtomicU64 {
        self.word(1)
    }

    /// The header's `done` word: how many receivers finished the published version.
    pub(crate) fn done(&self) -> &AtomicU64 {
        self.word(2)
    }

    /// Whether the segment is at least `header` words long and starts with `magic`.
    pub(crate) fn has_magic(&self, magic: u64, header: usize) -> bool {
        self.words() >= header.max(1) && self.word(0).load(Ordering::Acquire) == magic
    }

    /// Marks a segment whose tables are written valid: nothing published, nobody done, then
    /// `magic` (released last, so a reader that sees it sees the tables).
    pub(crate) fn seal(&self, magic: u64) {
        self.ready().store(NONE, Ordering::Relaxed);
        self.done().store(0, Ordering::Relaxed);
        self.word(0).store(magic, Ordering::Release);
    }

    /// A cursor writing consecutive words from word `at` (of the segment's own tables).
    pub(crate) fn writer(&self, at: usize) -> Cursor<'_> {
        Cursor { ctl: self, at }
    }

    /// A cursor reading consecutive words from word `at` (of tables checked to fit).
    pub(crate) fn reader(&self, at: usize) -> Cursor<'_> {
        Cursor { ctl: self, at }
    }
}

/// Consecutive words of a control segment, written or read in order.
pub(crate) struct Cursor<'a> {
    ctl: &'a ControlSegment,
    at: usize,
}

impl Cursor<'_> {
    /// Writes the next word.
    pub(crate) fn put(&mut self, v: u64) {
        self.ctl.word(self.at).store(v, Ordering::Relaxed);
        self.at += 1;
    }

    /// Reads the next word.
    pub(crate) fn next(&mut self) -> u64 {
        let v = self.ctl.word(self.at).load(Ordering::Relaxed);
        self.at += 1;
        v
    }

    /// The word the cursor is at.
    pub(crate) fn position(&self) -> usize {
        self.at
    }
}

/// Words of a header of `header` words followed by tables of `(words per entry, entries)`;
/// `None` when that overflows.
pub(crate) fn table_words(header: usize, tables: &[(usize, u64)]) -> Option<usize> {
    tables.iter().try_fold(header, |acc, &(width, n)| {
        acc.checked_add(width.checked_mul(usize::try_from(n).ok()?)?)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_sizes_add_up_and_overflow_is_none() {
        assert_eq!(table_words(8, &[(3, 2), (1, 5)]), Some(8 + 6 + 5));
        assert_eq!(table_words(8, &[]), Some(8));
        assert_eq!(table_words(8, &[(3, u64::MAX / 2)]), None);
        assert_eq!(table_words(usize::MAX, &[(1, 1)]), None);
    }
}
