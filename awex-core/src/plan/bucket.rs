//! Buckets: a peer plan cut into pieces of bounded size, the unit every transport moves.
//!
//! The cut is part of the plan: both ends of a peer pair compute the same buckets from the same
//! transfers and bucket size.

use crate::dims::Dims;
use crate::plan::Transfer;

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

/// Cuts a peer's transfers (in order) into buckets of at most `max_bytes` wire bytes.
pub fn make_buckets(transfers: &[Transfer], max_bytes: u64) -> Vec<Bucket> {
    let max_bytes = max_bytes.max(1);
    let mut out = Vec::new();
    let mut cur = Bucket::default();
    for (i, t) in transfers.iter().enumerate() {
        let rows = t.extent.get(0);
        let row_bytes = t.bytes() / rows.max(1);
        let mut row0 = 0;
        while row0 < rows {
            let room = max_bytes.saturating_sub(cur.bytes);
            let mut take = (room / row_bytes.max(1)).min(rows - row0);
            if take == 0 {
                if !cur.pieces.is_empty() {
                    out.push(std::mem::take(&mut cur));
                    continue;
                }
                take = 1; // one row larger than a bucket travels alone
            }
            cur.pieces.push(Piece {
                transfer: i as u32,
                row0,
                rows: take,
            });
            cur.bytes += take * row_bytes;
            row0 += take;
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
    d.set(dn - k, d.get(dn - k) + p.row0);
    e.set(0, p.rows);
    (s, d, e)
}
