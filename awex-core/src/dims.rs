//! `Dims`: a small inline N-d coordinate (shape, offset or extent), copyable and allocation-free.

use serde::{Deserialize, Deserializer, Serialize, Serializer};
use std::fmt;

/// The most dimensions a tensor may have in awex (canonical tensors have 1 or 2, local up to 3).
pub const MAX_DIMS: usize = 4;

/// An N-d coordinate or size with N <= [`MAX_DIMS`], stored inline.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct Dims {
    n: u8,
    v: [u64; MAX_DIMS],
}

impl Dims {
    /// Builds from a slice; panics only if more than [`MAX_DIMS`] values (a programming error).
    #[inline]
    pub fn new(v: &[u64]) -> Self {
        assert!(v.len() <= MAX_DIMS, "awex supports at most {MAX_DIMS} dims");
        let mut d = Dims {
            n: v.len() as u8,
            v: [0; MAX_DIMS],
        };
        d.v[..v.len()].copy_from_slice(v);
        d
    }

    /// Builds from a slice, or `None` with more than [`MAX_DIMS`] values.
    #[inline]
    pub fn try_new(v: &[u64]) -> Option<Self> {
        (v.len() <= MAX_DIMS).then(|| Dims::new(v))
    }

    /// All zeros with `n` dims.
    #[inline]
    pub fn zeros(n: usize) -> Self {
        Dims::new(&[0; MAX_DIMS][..n.min(MAX_DIMS)])
    }

    /// Number of dimensions.
    #[inline]
    pub fn ndim(&self) -> usize {
        self.n as usize
    }

    /// The values.
    #[inline]
    pub fn as_slice(&self) -> &[u64] {
        &self.v[..self.n as usize]
    }

    /// The values, mutable.
    #[inline]
    pub fn as_mut_slice(&mut self) -> &mut [u64] {
        &mut self.v[..self.n as usize]
    }

    /// Product of the values (number of elements of a shape or extent), saturating at
    /// `u64::MAX`: a shape within `crate::limits` never gets there, and an unchecked one reads
    /// as too large rather than wrapping to a small count.
    #[inline]
    pub fn numel(&self) -> u64 {
        self.as_slice()
            .iter()
            .fold(1u64, |a, &b| a.saturating_mul(b))
    }

    /// Product of the values, or `None` if it does not fit 64 bits.
    pub fn checked_numel(&self) -> Option<u64> {
        self.as_slice()
            .iter()
            .try_fold(1u64, |a, &b| a.checked_mul(b))
    }

    /// Element-wise sum (offset + extent), saturating at `u64::MAX` (see [`Dims::checked_add`]).
    #[inline]
    pub fn add(&self, o: &Dims) -> Dims {
        let mut r = *self;
        for (a, b) in r.as_mut_slice().iter_mut().zip(o.as_slice()) {
            *a = a.saturating_add(*b);
        }
        r
    }

    /// Element-wise sum, or `None` if a dimension does not fit 64 bits.
    pub fn checked_add(&self, o: &Dims) -> Option<Dims> {
        let mut r = *self;
        for (a, b) in r.as_mut_slice().iter_mut().zip(o.as_slice()) {
            *a = a.checked_add(*b)?;
        }
        Some(r)
    }

    /// Value of dimension `i`.
    #[inline]
    pub fn get(&self, i: usize) -> u64 {
        self.as_slice()[i]
    }

    /// Sets dimension `i`.
    #[inline]
    pub fn set(&mut self, i: usize, v: u64) {
        self.as_mut_slice()[i] = v;
    }

    /// Row-major strides in elements for this shape.
    pub fn strides(&self) -> Dims {
        let mut s = Dims::zeros(self.ndim());
        let mut acc = 1u64;
        for i in (0..self.ndim()).rev() {
            s.set(i, acc);
            acc = acc.saturating_mul(self.get(i));
        }
        s
    }

    /// Linear element offset of coordinate `at` in a row-major tensor of this shape.
    pub fn linear(&self, at: &Dims) -> u64 {
        let strides = self.strides();
        at.as_slice()
            .iter()
            .zip(strides.as_slice())
            .fold(0u64, |acc, (a, s)| acc.saturating_add(a.saturating_mul(*s)))
    }
}

impl fmt::Debug for Dims {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{self}")
    }
}

impl fmt::Display for Dims {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("[")?;
        for (i, v) in self.as_slice().iter().enumerate() {
            if i > 0 {
                f.write_str(", ")?;
            }
            write!(f, "{v}")?;
        }
        f.write_str("]")
    }
}

impl From<&[u64]> for Dims {
    #[inline]
    fn from(v: &[u64]) -> Self {
        Dims::new(v)
    }
}

impl<const N: usize> From<[u64; N]> for Dims {
    #[inline]
    fn from(v: [u64; N]) -> Self {
        Dims::new(&v)
    }
}

impl Serialize for Dims {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        self.as_slice().serialize(s)
    }
}

impl<'de> Deserialize<'de> for Dims {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let v = Vec::<u64>::deserialize(d)?;
        Dims::try_new(&v).ok_or_else(|| {
            serde::de::Error::custom(format!(
                "{} dims given; awex supports at most {MAX_DIMS}",
                v.len()
            ))
        })
    }
}
