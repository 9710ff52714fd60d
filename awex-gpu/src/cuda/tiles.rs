//! The tile table of a batch: every kernel copy of a batch cut into tiles of about the same
//! size, which one launch of `awex_copy_tiles` (`copy_tiles.ptx`) moves.
//!
//! Each block of that launch takes the next tile from a counter in device memory (one atomic
//! add per tile), so the blocks walk the table in order and at any moment work on about
//! (blocks x tile) bytes next to each other: the tiles are laid out in source address order,
//! so the copy sweeps the sender's memory front to back. A launch per copy (or per 256 MiB
//! piece) pays a ramp and a tail each, and one launch that strides over a whole large IPC
//! mapping lets the blocks drift apart over it, which on an H200 read about 3x slower than the
//! same launch over local memory (23.7-26.1 against 8.4 ms for 16.4 GB; `docs/benchmarks.md`,
//! the floor "copy kernel, from the sender's memory").
//!
//! A tile is `rows` rows of `nvec` 16-byte vectors: `src + r * src_pitch` to
//! `dst + r * dst_pitch` for `r` in `0..rows`. A row at least as wide as the tile is cut into
//! column tiles of one row; narrower rows are grouped, as many to a tile as fit.

use super::desc::CopyDesc;

/// Bytes of one entry in device memory: `src: u64, dst: u64, nvec: u32, rows: u32,
/// src_pitch: u32, dst_pitch: u32`, little-endian, 16-byte aligned.
pub const TILE_ENTRY_BYTES: usize = 32;

/// The default tile: 64 KiB.
pub const DEFAULT_TILE_BYTES: u64 = 64 << 10;

/// The largest tile table a batch gets (16 MiB: 524,288 tiles, 32 GiB in 64 KiB tiles); a
/// batch whose table would be larger is launched per copy. The table is device memory beside
/// the receiver's own; this bound keeps a receiver's extra memory under two 64 MiB buckets for
/// the largest models measured. On an H200 (`docs/benchmarks.md`, 2026-12-01 20:39 UTC):
/// qwen3-8b's 250,097 tiles (7.6 MiB) and qwen3-30b-a3b's per-tensor 310,849 (9.5 MiB) take
/// the tile kernel; qwen3-30b-a3b out of one 61 GB buffer, 931,953 tiles (28.4 MiB, 154 MiB
/// extra in all against 116-120 MiB per copy), does not.
pub const MAX_TABLE_BYTES: u64 = 16 << 20;

/// Whether a table of `tiles` tiles is within [`MAX_TABLE_BYTES`].
pub fn table_within_bound(tiles: usize) -> bool {
    tiles as u64 * TILE_ENTRY_BYTES as u64 <= MAX_TABLE_BYTES
}

/// One tile of a batch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Tile {
    /// First source byte.
    pub src: u64,
    /// First destination byte.
    pub dst: u64,
    /// 16-byte vectors per row.
    pub nvec: u32,
    /// Rows.
    pub rows: u32,
    /// Bytes from one source row to the next.
    pub src_pitch: u32,
    /// Bytes from one destination row to the next.
    pub dst_pitch: u32,
}

impl Tile {
    /// Bytes moved.
    pub fn bytes(&self) -> u64 {
        self.nvec as u64 * 16 * self.rows as u64
    }
}

/// Whether the tile kernel can move `d`: 16-byte vectors on both ends (the caller checks that,
/// see [`super::kernel_fits`]) and pitches that fit the table's 32-bit fields.
pub fn tiles_fit(d: &CopyDesc) -> bool {
    let pitched = d.height > 1 || d.depth > 1;
    !pitched || (d.src_pitch <= u32::MAX as u64 && d.dst_pitch <= u32::MAX as u64)
}

/// Cuts `descs` (each with 16-byte aligned addresses, width and pitches, and [`tiles_fit`]) into
/// tiles of at most `tile` bytes (rounded down to whole vectors, at least one), in source
/// address order of the descriptors. Copies of no bytes (or narrower than one vector) make none.
pub fn tile_table(descs: &[CopyDesc], tile: u64) -> Vec<Tile> {
    let mut out = Vec::with_capacity(tile_count(descs, tile));
    for_each_tile(descs, tile, |t| out.push(t));
    out
}

/// The number of tiles [`tile_table`] makes of `descs`, without making them.
pub fn tile_count(descs: &[CopyDesc], tile: u64) -> usize {
    let tile_vec = tile_vectors(tile);
    descs
        .iter()
        .filter(|d| d.bytes() > 0 && d.width >= 16)
        .map(|d| {
            let nvec = d.width / 16;
            let per_slice = if nvec >= tile_vec {
                d.height * nvec.div_ceil(tile_vec)
            } else {
                d.height.div_ceil(rows_per_tile(tile_vec, nvec))
            };
            (per_slice * d.depth) as usize
        })
        .sum()
}

/// The tile table's bytes as the kernel reads them (see [`TILE_ENTRY_BYTES`]), made in one
/// pass: `table_bytes(&tile_table(descs, tile))` without the tiles in between.
pub fn tile_table_bytes(descs: &[CopyDesc], tile: u64) -> Vec<u8> {
    let mut b = Vec::with_capacity(tile_count(descs, tile) * TILE_ENTRY_BYTES);
    for_each_tile(descs, tile, |t| push_entry(&mut b, &t));
    b
}

/// 16-byte vectors in a tile of `tile` bytes: at least one.
fn tile_vectors(tile: u64) -> u64 {
    (tile / 16).clamp(1, u32::MAX as u64)
}

/// Whole rows of `nvec` vectors (fewer than `tile_vec`) that one tile takes.
fn rows_per_tile(tile_vec: u64, nvec: u64) -> u64 {
    (tile_vec / nvec).clamp(1, u32::MAX as u64)
}

/// Calls `f` with every tile of `descs`, in the order of [`tile_table`].
fn for_each_tile(descs: &[CopyDesc], tile: u64, mut f: impl FnMut(Tile)) {
    let tile_vec = tile_vectors(tile);
    let mut order: Vec<&CopyDesc> = descs
        .iter()
        .filter(|d| d.bytes() > 0 && d.width >= 16)
        .collect();
    order.sort_by_key(|d| (d.src, d.dst));
    for d in order {
        let nvec = d.width / 16;
        // a linear copy's pitch is its width: the table only needs pitches between rows
        let (sp, dp) = if d.height > 1 || d.depth > 1 {
            (d.src_pitch as u32, d.dst_pitch as u32)
        } else {
            (0, 0)
        };
        for z in 0..d.depth {
            let s0 = d.src + z * d.src_rows * d.src_pitch;
            let d0 = d.dst + z * d.dst_rows * d.dst_pitch;
            if nvec >= tile_vec {
                // wide rows: column tiles of one row each
                for y in 0..d.height {
                    let (sr, dr) = (s0 + y * d.src_pitch, d0 + y * d.dst_pitch);
                    let mut c = 0;
                    while c < nvec {
                        let n = tile_vec.min(nvec - c);
                        f(Tile {
                            src: sr + c * 16,
                            dst: dr + c * 16,
                            nvec: n as u32,
                            rows: 1,
                            src_pitch: sp,
                            dst_pitch: dp,
                        });
                        c += n;
                    }
                }
            } else {
                // narrow rows: as many whole rows to a tile as fit
                let per = rows_per_tile(tile_vec, nvec);
                let mut y = 0;
                while y < d.height {
                    let k = per.min(d.height - y);
                    f(Tile {
                        src: s0 + y * d.src_pitch,
                        dst: d0 + y * d.dst_pitch,
                        nvec: nvec as u32,
                        rows: k as u32,
                        src_pitch: sp,
                        dst_pitch: dp,
                    });
                    y += k;
                }
            }
        }
    }
}

fn push_entry(b: &mut Vec<u8>, t: &Tile) {
    b.extend_from_slice(&t.src.to_le_bytes());
    b.extend_from_slice(&t.dst.to_le_bytes());
    b.extend_from_slice(&t.nvec.to_le_bytes());
    b.extend_from_slice(&t.rows.to_le_bytes());
    b.extend_from_slice(&t.src_pitch.to_le_bytes());
    b.extend_from_slice(&t.dst_pitch.to_le_bytes());
}

/// The table as the kernel reads it (see [`TILE_ENTRY_BYTES`]).
pub fn table_bytes(tiles: &[Tile]) -> Vec<u8> {
    let mut b = Vec::with_capacity(tiles.len() * TILE_ENTRY_BYTES);
    for t in tiles {
        push_entry(&mut b, t);
    }
    b
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// What the kernel does with a table, on host memory: `mem` is one address space.
    fn run_tiles(tiles: &[Tile], mem: &mut [u8]) {
        for t in tiles {
            for r in 0..t.rows as u64 {
                let s = (t.src + r * t.src_pitch as u64) as usize;
                let d = (t.dst + r * t.dst_pitch as u64) as usize;
                let n = t.nvec as usize * 16;
                mem.copy_within(s..s + n, d);
            }
        }
    }

    fn run_descs(descs: &[CopyDesc], mem: &mut [u8]) {
        for d in descs {
            d.for_each_row(|s, t, n| mem.copy_within(s as usize..(s + n) as usize, t as usize));
        }
    }

    fn pitched(src: u64, dst: u64, width: u64, height: u64, sp: u64, dp: u64) -> CopyDesc {
        CopyDesc {
            height,
            src_pitch: sp,
            dst_pitch: dp,
            ..CopyDesc::linear(src, dst, width)
        }
    }

    #[test]
    fn a_linear_copy_is_cut_into_whole_tiles_and_a_tail() {
        let t = tile_table(&[CopyDesc::linear(0, 1 << 20, 1000 * 16)], 256 * 16);
        assert_eq!(
            t.iter()
                .map(|t| (t.src, t.dst, t.nvec, t.rows))
                .collect::<Vec<_>>(),
            vec![
                (0, 1 << 20, 256, 1),
                (4096, (1 << 20) + 4096, 256, 1),
                (8192, (1 << 20) + 8192, 256, 1),
                (12288, (1 << 20) + 12288, 232, 1)
            ]
        );
        assert_eq!(t.iter().map(Tile::bytes).sum::<u64>(), 16_000);
    }

    #[test]
    fn narrow_rows_are_grouped_and_wide_rows_split_into_columns() {
        // 10 rows of 3 vectors, a tile of 8 vectors: 2 rows per tile, 5 tiles
        let t = tile_table(&[pitched(0, 4096, 48, 10, 64, 80)], 128);
        assert_eq!(
            t.iter()
                .map(|t| (t.src, t.rows, t.nvec))
                .collect::<Vec<_>>(),
            vec![
                (0, 2, 3),
                (128, 2, 3),
                (256, 2, 3),
                (384, 2, 3),
                (512, 2, 3)
            ]
        );
        assert!(t.iter().all(|t| (t.src_pitch, t.dst_pitch) == (64, 80)));
        // 2 rows of 20 vectors, a tile of 8: 8 + 8 + 4 per row
        let t = tile_table(&[pitched(0, 8192, 320, 2, 512, 640)], 128);
        assert_eq!(
            t.iter().map(|t| (t.src, t.dst, t.nvec)).collect::<Vec<_>>(),
            vec![
                (0, 8192, 8),
                (128, 8320, 8),
                (256, 8448, 4),
                (512, 8832, 8),
                (640, 8960, 8),
                (768, 9088, 4)
            ]
        );
    }

    #[test]
    fn tiles_follow_source_addresses_and_skip_empty_copies() {
        let t = tile_table(
            &[
                CopyDesc::linear(4096, 0, 32),
                CopyDesc::linear(0, 512, 0),
                CopyDesc::linear(1024, 256, 16),
            ],
            1 << 20,
        );
        assert_eq!(
            t.iter().map(|t| t.src).collect::<Vec<_>>(),
            vec![1024, 4096]
        );
    }

    #[test]
    fn the_table_bound_admits_the_measured_small_tables_only() {
        assert!(table_within_bound(250_097) && table_within_bound(310_849));
        assert!(table_within_bound(524_288) && !table_within_bound(524_289));
        assert!(!table_within_bound(931_953));
    }

    #[test]
    fn entries_are_32_little_endian_bytes() {
        let t = Tile {
            src: 0x0102_0304_0506_0708,
            dst: 0x1112_1314_1516_1718,
            nvec: 0x2122_2324,
            rows: 7,
            src_pitch: 0x3132_3334,
            dst_pitch: 9,
        };
        let b = table_bytes(&[t, t]);
        assert_eq!(b.len(), 2 * TILE_ENTRY_BYTES);
        assert_eq!(&b[..8], &0x0102_0304_0506_0708u64.to_le_bytes());
        assert_eq!(&b[16..20], &0x2122_2324u32.to_le_bytes());
        assert_eq!(&b[20..24], &7u32.to_le_bytes());
        assert_eq!(&b[24..28], &0x3132_3334u32.to_le_bytes());
        assert_eq!(&b[28..32], &9u32.to_le_bytes());
        assert_eq!(b[..32], b[32..]);
    }

    #[test]
    fn copies_narrower_than_a_vector_make_no_tiles_and_no_panic() {
        let d = [CopyDesc::linear(0, 64, 8), pitched(0, 64, 0, 3, 16, 16)];
        assert!(tile_table(&d, 64).is_empty());
        assert_eq!(tile_count(&d, 64), 0);
        assert!(tile_table_bytes(&d, 64).is_empty());
    }

    #[test]
    fn pitches_past_32_bits_do_not_fit_but_linear_copies_of_any_size_do() {
        assert!(tiles_fit(&CopyDesc::linear(0, 0, 8 << 30)));
        assert!(!tiles_fit(&pitched(0, 0, 16, 2, 1 << 32, 16)));
        assert!(tiles_fit(&pitched(0, 0, 16, 2, u32::MAX as u64 - 15, 16)));
    }

    /// A random batch of non-overlapping copies inside a small address space: sources in the
    /// first half, destinations in the second, every unit 16 bytes.
    fn batch() -> impl Strategy<Value = Vec<CopyDesc>> {
        prop::collection::vec((1u64..6, 1u64..5, 1u64..3, 0u64..3, 0u64..3), 1..6).prop_map(
            |shapes| {
                let (mut s, mut d) = (0u64, 1u64 << 16);
                shapes
                    .into_iter()
                    .map(|(w, h, z, sgap, dgap)| {
                        let (w, sp, dp) = (w * 16, (w + sgap) * 16, (w + dgap) * 16);
                        let desc = CopyDesc {
                            src: s,
                            dst: d,
                            width: w,
                            height: h,
                            depth: z,
                            src_pitch: sp,
                            dst_pitch: dp,
                            src_rows: h + 1,
                            dst_rows: h,
                        };
                        s += sp * (h + 1) * z + 64;
                        d += dp * h * z + 32;
                        desc
                    })
                    .collect()
            },
        )
    }

    proptest! {
        #[test]
        fn the_tiles_move_exactly_the_descriptors_bytes(descs in batch(), tile_vec in 1u64..9) {
            let mem0: Vec<u8> = (0..1usize << 17).map(|i| (i * 7 + i / 251) as u8).collect();
            let (mut a, mut b) = (mem0.clone(), mem0);
            run_descs(&descs, &mut a);
            let tiles = tile_table(&descs, tile_vec * 16);
            run_tiles(&tiles, &mut b);
            prop_assert!(a == b);
            let bytes: u64 = descs.iter().map(CopyDesc::bytes).sum();
            prop_assert_eq!(tiles.iter().map(Tile::bytes).sum::<u64>(), bytes);
            prop_assert!(tiles.iter().all(|t| t.bytes() <= (tile_vec * 16).max(t.nvec as u64 * 16)));
            prop_assert_eq!(tile_count(&descs, tile_vec * 16), tiles.len());
            prop_assert!(tile_table_bytes(&descs, tile_vec * 16) == table_bytes(&tiles));
        }
    }
}
