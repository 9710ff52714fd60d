//! Shared checks for layout tests: awex-core's whole-side checks, asserted.

#![allow(dead_code)]

use awex_core::layout::{SideLayout, check};
use awex_core::model::Catalogue;

/// Every shard of each canonical tensor is disjoint from the others and they add up to it.
pub fn check_holders_partition(side: &dyn SideLayout, cat: &Catalogue) {
    check::holders_partition(side, cat).unwrap_or_else(|e| panic!("{e}"));
}

/// Validation, holders, coverage, partition and the per-engine byte round trip.
pub fn check_side(side: &dyn SideLayout, cat: &Catalogue) {
    check::side(side, cat).unwrap_or_else(|e| panic!("{e}"));
}
