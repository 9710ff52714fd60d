//! `Region`: an N-d box (offset + extent) of a tensor.

use super::Dims;
use serde::{Deserialize, Serialize};
use std::fmt;

/// An N-d box: `[offset[i], offset[i] + extent[i])` along every dimension.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Region {
    /// First coordinate.
    pub offset: Dims,
    /// Size along every dimension.
    pub extent: Dims,
}

impl Region {
    /// A box from offset and extent (same number of dims).
    #[inline]
    pub fn new(offset: impl Into<Dims>, extent: impl Into<Dims>) -> Self {
        let (offset, extent) = (offset.into(), extent.into());
        debug_assert_eq!(offset.ndim(), extent.ndim());
        Region { offset, extent }
    }

    /// The whole of a tensor of `shape`.
    #[inline]
    pub fn full(shape: Dims) -> Self {
        Region {
            offset: Dims::zeros(shape.ndim()),
            extent: shape,
        }
    }

    /// Rows `[start, start + len)` of a tensor of `shape` (all of the other dims).
    #[inline]
    pub fn rows(shape: Dims, start: u64, len: u64) -> Self {
        Self::slice(shape, 0, start, len)
    }

    /// `[start, start + len)` along dimension `dim` of a tensor of `shape`.
    #[inline]
    pub fn slice(shape: Dims, dim: usize, start: u64, len: u64) -> Self {
        let mut r = Region::full(shape);
        r.offset.set(dim, start);
        r.extent.set(dim, len);
        r
    }

    /// Number of dimensions.
    #[inline]
    pub fn ndim(&self) -> usize {
        self.offset.ndim()
    }

    /// Number of elements.
    #[inline]
    pub fn numel(&self) -> u64 {
        self.extent.numel()
    }

    /// Whether the box holds no element.
    #[inline]
    pub fn is_empty(&self) -> bool {
        self.extent.as_slice().contains(&0)
    }

    /// One past the last coordinate.
    #[inline]
    pub fn end(&self) -> Dims {
        self.offset.add(&self.extent)
    }

    /// The intersection, or `None` if empty (or the dims differ).
    #[inline]
    pub fn intersect(&self, o: &Region) -> Option<Region> {
        if self.ndim() != o.ndim() {
            return None;
        }
        let mut r = *self;
        for i in 0..self.ndim() {
            let lo = self.offset.get(i).max(o.offset.get(i));
            let hi = (self.offset.get(i).saturating_add(self.extent.get(i)))
                .min(o.offset.get(i).saturating_add(o.extent.get(i)));
            if hi <= lo {
                return None;
            }
            r.offset.set(i, lo);
            r.extent.set(i, hi - lo);
        }
        Some(r)
    }

    /// The number of elements of [`Region::intersect`], without making it (0 when it is
    /// `None`).
    #[inline]
    pub fn overlap_numel(&self, o: &Region) -> u64 {
        if self.ndim() != o.ndim() {
            return 0;
        }
        let mut n = 1u64;
        for i in 0..self.ndim() {
            let lo = self.offset.get(i).max(o.offset.get(i));
            let hi = (self.offset.get(i).saturating_add(self.extent.get(i)))
                .min(o.offset.get(i).saturating_add(o.extent.get(i)));
            if hi <= lo {
                return 0;
            }
            n = n.saturating_mul(hi - lo);
        }
        n
    }

    /// Whether `o` lies entirely inside `self`.
    #[inline]
    pub fn contains(&self, o: &Region) -> bool {
        self.ndim() == o.ndim()
            && (0..self.ndim()).all(|i| {
                let (end, o_end) = (
                    self.offset.get(i).checked_add(self.extent.get(i)),
                    o.offset.get(i).checked_add(o.extent.get(i)),
                );
                o.offset.get(i) >= self.offset.get(i)
                    && matches!((o_end, end), (Some(a), Some(b)) if a <= b)
            })
    }

    /// Whether the box fits inside a tensor of `shape` (checked: a box whose end does not fit
    /// 64 bits fits nothing).
    pub fn fits(&self, shape: &Dims) -> bool {
        self.ndim() == shape.ndim()
            && (0..self.ndim()).all(|i| {
                self.offset
                    .get(i)
                    .checked_add(self.extent.get(i))
                    .is_some_and(|end| end <= shape.get(i))
            })
    }
}

impl fmt::Debug for Region {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{self}")
    }
}

impl fmt::Display for Region {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("[")?;
        for i in 0..self.ndim() {
            if i > 0 {
                f.write_str(", ")?;
            }
            write!(
                f,
                "{}..{}",
                self.offset.get(i),
                u128::from(self.offset.get(i)) + u128::from(self.extent.get(i))
            )?;
        }
        f.write_str("]")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn intersect_and_contain() {
        let a = Region::new([0, 0], [4, 8]);
        let b = Region::new([2, 6], [4, 4]);
        assert_eq!(a.intersect(&b), Some(Region::new([2, 6], [2, 2])));
        assert_eq!(a.intersect(&Region::new([4, 0], [1, 1])), None);
        assert!(a.contains(&Region::new([1, 1], [3, 7])));
        assert!(!a.contains(&b));
        assert!(a.fits(&Dims::new(&[4, 8])));
        assert!(!b.fits(&Dims::new(&[4, 8])));
        assert_eq!(format!("{b}"), "[2..6, 6..10]");
    }

    proptest::proptest! {
        #[test]
        fn overlap_numel_counts_the_intersection(
            a in proptest::collection::vec((0u64..6, 0u64..6), 0..4),
            b in proptest::collection::vec((0u64..6, 0u64..6), 0..4),
        ) {
            let region = |v: &[(u64, u64)]| {
                let (o, e): (Vec<u64>, Vec<u64>) = v.iter().copied().unzip();
                Region { offset: Dims::new(&o), extent: Dims::new(&e) }
            };
            let (a, b) = (region(&a), region(&b));
            proptest::prop_assert_eq!(a.overlap_numel(&b), a.intersect(&b).map_or(0, |r| r.numel()));
        }
    }
}
