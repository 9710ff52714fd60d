//! Buckets: a peer plan cut into pieces of bounded size, the unit every transport moves.
//!
//! The cut is part of the plan: both ends of a peer pair compute the same buckets from the same
//! transfers and bucket size.

use crate::dims::Dims;
use crate::plan::{SCALE_BYTES, Transfer};
use std::borrow::Borrow;

/// Rows `[row0, row0 + rows)` (along the box's first dim) of one transfer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Piece {
    /// Index of the transfer in the peer plan.
    pub transfer: u32,
    /// First row of the box.
    pub row0: u64,
    /// Rows.
    pub rows: u64,
}

/// Pieces moved together; at most the bucket size on the wire unless one row is larger.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Bucket {
    /// The pieces in wire order.
    pub pieces: Vec<Piece>,
    /// Wire bytes (destination dtype).
    pub bytes: u64,
}

/// How a transfer is cut into pieces: whole units of `rows` rows (along the box's first dim).
///
/// A unit is one row, except for a sender-encoded transfer ([`Transfer::scale_box`]) whose box
/// has two dims: there a unit is one row of blocks (`bn` rows, the last one possibly fewer at
/// the tensor's edge), so that every piece holds whole blocks and their scales. A unit's wire
/// bytes are its elements in the destination dtype plus, sender-encoded, its blocks' scales.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Units {
    /// Rows of the box per unit.
    pub rows: u64,
    /// Units in the transfer (the last may hold fewer rows).
    pub count: u64,
    /// Wire bytes of a full unit.
    pub bytes: u64,
    /// Wire bytes of the last unit.
    pub last_bytes: u64,
}

impl Units {
    /// The units of transfer `t`.
    pub fn of(t: &Transfer) -> Units {
        let rows = t.extent.get(0).max(1);
        let row_elems = t.extent.numel() / t.extent.get(0).max(1);
        let dsize = t.dst_dtype.size() as u64;
        match t.scale_box() {
            Some(s) => {
                let k = t.extent.ndim();
                let unit = if k == 2 {
                    t.encode.as_ref().map_or(1, |e| e.encoding.block[0] as u64)
                } else {
                    1
                };
                let count = rows.div_ceil(unit);
                // scales per unit: a row of blocks (k = 2) or one stacked box
                let scales = s.extent.numel() / s.extent.get(0).max(1) * SCALE_BYTES;
                let last_rows = rows - (count - 1) * unit;
                Units {
                    rows: unit,
                    count,
                    bytes: unit * row_elems * dsize + scales,
                    last_bytes: last_rows * row_elems * dsize + scales,
                }
            }
            None => Units {
                rows: 1,
                count: rows,
                bytes: row_elems * dsize,
                last_bytes: row_elems * dsize,
            },
        }
    }

    /// Wire bytes of units `[u0, u0 + n)`.
    pub fn bytes_of(&self, u0: u64, n: u64) -> u64 {
        if n == 0 {
            0
        } else if u0 + n == self.count {
            (n - 1) * self.bytes + self.last_bytes
        } else {
            n * self.bytes
        }
    }

    /// The box rows of units `[u0, u0 + n)` of a transfer of `rows` rows: (first row, rows).
    pub fn rows_of(&self, u0: u64, n: u64, rows: u64) -> (u64, u64) {
        let r0 = u0 * self.rows;
        (r0, ((u0 + n) * self.rows).min(rows) - r0)
    }
}

/// Cuts a peer's transfers (in order) into buckets of at most `max_bytes` wire bytes, in whole
/// [`Units`] (rows; rows of blocks for a sender-encoded transfer). `transfers`: a slice of
/// them or a peer's [`super::Transfers`].
pub fn make_buckets<T: Borrow<Transfer>>(
    transfers: impl IntoIterator<Item = T>,
    max_bytes: u64,
) -> Vec<Bucket> {
    let max_bytes = max_bytes.max(1);
    let mut out = Vec::new();
    let mut cur = Bucket::default();
    for (i, t) in transfers.into_iter().enumerate() {
        let t = t.borrow();
        let rows = t.extent.get(0);
        let u = Units::of(t);
        let units = if rows == 0 { 0 } else { u.count };
        let mut u0 = 0;
        while u0 < units {
            let room = max_bytes.saturating_sub(cur.bytes);
            let mut take = (room / u.bytes.max(1)).min(units - u0);
            if take == 0 {
                if !cur.pieces.is_empty() {
                    out.push(std::mem::take(&mut cur));
                    continue;
                }
                take = 1; // one unit larger than a bucket travels alone
            }
            let (row0, n) = u.rows_of(u0, take, rows);
            cur.pieces.push(Piece {
                transfer: i as u32,
                row0,
                rows: n,
            });
            cur.bytes += u.bytes_of(u0, take);
            u0 += take;
            if cur.bytes >= max_bytes {
                out.push(std::mem::take(&mut cur));
            }
        }
    }
    if !cur.pieces.is_empty() {
        out.push(cur);
    }
    out
}

/// Source offset, destination offset and extent of a piece.
pub fn piece_box(t: &Transfer, p: &Piece) -> (Dims, Dims, Dims) {
    let k = t.extent.ndim();
    let mut s = t.src_offset;
    let mut d = t.dst_offset;
    let mut e = t.extent;
    let (sn, dn) = (s.ndim(), d.ndim());
    s.set(sn - k, s.get(sn - k) + p.row0);
    // a transposed 2-d box's first dim runs along the destination's last dim
    let dd = if t.transposed && k == 2 {
        dn - 1
    } else {
        dn - k
    };
    d.set(dd, d.get(dd) + p.row0);
    e.set(0, p.rows);
    (s, d, e)
}

/// Where a piece of a sender-encoded transfer puts its blocks' scales: offset and extent in
/// the destination's scale tensor ([`Transfer::scale_box`] narrowed to the piece's rows of
/// blocks, or of stacked matrices for a box of more than two dims). `None` for any other
/// transfer.
pub fn piece_scale_box(t: &Transfer, p: &Piece) -> Option<(Dims, Dims)> {
    let sb = t.scale_box()?;
    let bn = t.encode.as_ref()?.encoding.block[0] as u64;
    let (k, n) = (t.extent.ndim(), sb.offset.ndim());
    let (mut off, mut ext) = (sb.offset, sb.extent);
    if k == 2 {
        off.set(n - 2, off.get(n - 2) + p.row0 / bn);
        ext.set(0, p.rows.div_ceil(bn));
    } else {
        off.set(n - k, off.get(n - k) + p.row0);
        ext.set(0, p.rows);
    }
    Some((off, ext))
}
