//! The fake physical side.

use std::collections::BTreeMap;
use std::fmt;

use crate::{Backing, BackingError};

/// The error [`FakeBacking`] reports when told to fail.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Injected;

impl fmt::Display for Injected {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("injected fault")
    }
}

impl std::error::Error for Injected {}

/// A [`Backing`] that maps nothing: it counts calls and bytes, enforces an optional
/// capacity, fails on request and — when checked — records every mapping and asserts that
/// the engine uses it correctly. Tokens are the number of the map call that returned them.
#[derive(Clone, Debug)]
pub struct FakeBacking {
    /// Maps beyond this many mapped bytes fail with [`BackingError::OutOfMemory`].
    pub capacity: Option<u64>,
    /// The next map fails with this error (taken by that map).
    pub fail_next_map: Option<BackingError<Injected>>,
    /// The next unmap fails with [`Injected`] (reset by that unmap).
    pub fail_next_unmap: bool,
    /// Successful map calls.
    pub maps: u64,
    /// Successful unmap calls.
    pub unmaps: u64,
    /// High-water mark of the mapped bytes.
    pub mapped_high: u64,
    /// Checked only: the ranges unmapped, in call order (drain it to look at one step).
    pub unmap_log: Vec<(u64, u64)>,
    /// Bytes currently mapped.
    mapped: u64,
    /// `None`: counting only.
    checks: Option<Checks>,
}

/// What a checked [`FakeBacking`] asserts and records.
#[derive(Clone, Debug)]
struct Checks {
    /// Offsets and sizes are multiples of it.
    granule: u64,
    /// Every mapping lies below it.
    range_end: u64,
    /// offset → (size, token) of every mapping.
    mappings: BTreeMap<u64, (u64, u64)>,
}

impl FakeBacking {
    /// Counting only: no record of the mappings, no checks — what a benchmark of the engine
    /// alone wants (a map or unmap costs a few instructions).
    pub fn counting() -> FakeBacking {
        FakeBacking {
            capacity: None,
            fail_next_map: None,
            fail_next_unmap: false,
            maps: 0,
            unmaps: 0,
            mapped_high: 0,
            unmap_log: Vec::new(),
            mapped: 0,
            checks: None,
        }
    }

    /// Records every mapping and panics when the engine maps a range that is not whole
    /// `granule`s, overlaps a mapping or lies beyond [`FakeBacking::within`]'s end, or
    /// unmaps anything but exactly a range it mapped (with its token).
    pub fn checked(granule: u64) -> FakeBacking {
        let checks = Checks { granule, range_end: u64::MAX, mappings: BTreeMap::new() };
        FakeBacking { checks: Some(checks), ..FakeBacking::counting() }
    }

    /// Maps fail with [`BackingError::OutOfMemory`] beyond `bytes` mapped.
    pub fn with_capacity(self, bytes: u64) -> FakeBacking {
        FakeBacking { capacity: Some(bytes), ..self }
    }

    /// Checked only: every mapping must lie in `[0, range_end)`.
    ///
    /// # Panics
    ///
    /// On a counting backing.
    pub fn within(mut self, range_end: u64) -> FakeBacking {
        self.checks.as_mut().expect("a checked backing").range_end = range_end;
        self
    }

    /// Bytes currently mapped.
    pub fn total(&self) -> u64 {
        self.mapped
    }

    /// Checked only: the mappings in address order, as `(offset, size)` (none when counting).
    pub fn mappings(&self) -> impl Iterator<Item = (u64, u64)> + '_ {
        self.checks.iter().flat_map(|c| c.mappings.iter().map(|(&off, &(size, _))| (off, size)))
    }

    /// Checked only: the mapping that contains byte `at`, as `(offset, size)`.
    pub fn mapping_containing(&self, at: u64) -> Option<(u64, u64)> {
        let checks = self.checks.as_ref()?;
        let (&off, &(size, _)) = checks.mappings.range(..=at).next_back()?;
        (at < off + size).then_some((off, size))
    }
}

impl Checks {
    /// Asserts that mapping `[offset, offset + size)` is valid.
    fn check_map(&self, offset: u64, size: u64) {
        let g = self.granule;
        assert!(size > 0 && offset % g == 0 && size % g == 0, "unaligned map {offset} +{size}");
        assert!(offset + size <= self.range_end, "map {offset} +{size} outside the range");
        if let Some((&o, &(s, _))) = self.mappings.range(..offset + size).next_back() {
            assert!(o + s <= offset, "map {offset} +{size} overlaps the mapping at {o}");
        }
    }
}

impl Backing for FakeBacking {
    type Error = Injected;

    #[inline]
    fn map(&mut self, offset: u64, size: u64) -> Result<u64, BackingError<Injected>> {
        if let Some(checks) = &self.checks {
            checks.check_map(offset, size);
        }
        if let Some(e) = self.fail_next_map.take() {
            return Err(e);
        }
        if self.capacity.is_some_and(|cap| self.mapped + size > cap) {
            return Err(BackingError::OutOfMemory);
        }
        self.maps += 1;
        self.mapped += size;
        self.mapped_high = self.mapped_high.max(self.mapped);
        if let Some(checks) = &mut self.checks {
            checks.mappings.insert(offset, (size, self.maps));
        }
        Ok(self.maps)
    }

    #[inline]
    fn unmap(&mut self, offset: u64, size: u64, token: u64) -> Result<(), Injected> {
        if std::mem::take(&mut self.fail_next_unmap) {
            return Err(Injected);
        }
        if let Some(checks) = &mut self.checks {
            let mapped = checks.mappings.remove(&offset);
            assert_eq!(mapped, Some((size, token)), "unmap of a range not mapped as such");
            self.unmap_log.push((offset, size));
        }
        self.mapped -= size;
        self.unmaps += 1;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_enforces_capacity_and_injects_failures() {
        let mut b = FakeBacking::counting().with_capacity(8);
        assert_eq!(b.map(0, 4), Ok(1));
        assert_eq!(b.map(4, 8), Err(BackingError::OutOfMemory));
        b.fail_next_map = Some(BackingError::Driver(Injected));
        assert_eq!(b.map(4, 2), Err(BackingError::Driver(Injected)));
        assert_eq!(b.map(4, 4), Ok(2));
        b.fail_next_unmap = true;
        assert_eq!(b.unmap(0, 4, 1), Err(Injected));
        assert_eq!(b.unmap(0, 4, 1), Ok(()));
        assert_eq!((b.maps, b.unmaps, b.total(), b.mapped_high), (2, 1, 4, 8));
        assert!(b.unmap_log.is_empty(), "a counting backing keeps no log");
    }

    #[test]
    fn checked_records_mappings() {
        let mut b = FakeBacking::checked(2).within(16);
        let t = b.map(4, 4).unwrap();
        assert_eq!(b.mappings().collect::<Vec<_>>(), [(4, 4)]);
        assert_eq!(b.mapping_containing(7), Some((4, 4)));
        assert_eq!(b.mapping_containing(8), None);
        b.unmap(4, 4, t).unwrap();
        assert_eq!(b.unmap_log, [(4, 4)]);
        assert_eq!(b.mappings().count(), 0);
    }

    #[test]
    #[should_panic(expected = "overlaps")]
    fn checked_rejects_overlapping_maps() {
        let mut b = FakeBacking::checked(2);
        b.map(0, 4).unwrap();
        let _ = b.map(2, 4);
    }

    #[test]
    #[should_panic(expected = "not mapped as such")]
    fn checked_rejects_partial_unmaps() {
        let mut b = FakeBacking::checked(2);
        let t = b.map(0, 4).unwrap();
        let _ = b.unmap(0, 2, t);
    }

    #[test]
    #[should_panic(expected = "outside the range")]
    fn checked_rejects_maps_beyond_the_range() {
        let mut b = FakeBacking::checked(2).within(8);
        let _ = b.map(6, 4);
    }
}
