//! Private copies of an [`Access`](super::Access)'s ranges that lie in memory shared with
//! another process: a kernel gets a slice of the copy, never of the shared bytes, which the
//! other process may write at any time.

use std::alloc::Layout;
use std::cell::OnceCell;
use std::ptr::NonNull;

use smallvec::SmallVec;

/// Alignment a private copy keeps from its device address: a typed view (`&[f32]`, …) of the
/// copy is aligned exactly when one of the device bytes would be.
const KEPT_ALIGN: usize = 4096;

/// A private, zero-initialised buffer of `len` bytes whose address agrees with a device
/// address modulo [`KEPT_ALIGN`].
pub(super) struct PrivateCopy {
    base: NonNull<u8>,
    layout: Layout,
    offset: usize,
    len: usize,
}

impl PrivateCopy {
    /// A buffer of `len` (> 0) bytes for the device bytes at `addr`.
    pub(super) fn new(addr: u64, len: usize) -> PrivateCopy {
        let offset = (addr % KEPT_ALIGN as u64) as usize;
        let layout = offset
            .checked_add(len)
            .and_then(|size| Layout::from_size_align(size, KEPT_ALIGN).ok())
            .unwrap_or_else(|| panic!("a private copy of {len} bytes"));
        // SAFETY: the layout's size is at least `len`, which is not zero.
        let base = unsafe { std::alloc::alloc_zeroed(layout) };
        let base = NonNull::new(base).unwrap_or_else(|| std::alloc::handle_alloc_error(layout));
        PrivateCopy { base, layout, offset, len }
    }

    /// The first byte: `len` initialised bytes, owned by `self`, start here.
    pub(super) fn as_ptr(&self) -> *mut u8 {
        self.base.as_ptr().wrapping_add(self.offset)
    }

    /// Length in bytes.
    pub(super) fn len(&self) -> usize {
        self.len
    }
}

impl Drop for PrivateCopy {
    fn drop(&mut self) {
        // SAFETY: `base` was allocated in `new` with this layout and is freed only here.
        unsafe { std::alloc::dealloc(self.base.as_ptr(), self.layout) };
    }
}

/// Which ranges of an access cross processes, and the private copy of each handed out so far.
pub(super) struct Staging {
    /// Per range of the access: whether it touches memory shared across processes.
    cross: SmallVec<[bool; 4]>,
    /// Per range: its private copy, once a kernel asked for it.
    copies: SmallVec<[OnceCell<PrivateCopy>; 4]>,
}

impl Staging {
    /// Staging for ranges of which `cross[i]` cross processes.
    pub(super) fn new(cross: SmallVec<[bool; 4]>) -> Self {
        let copies = cross.iter().map(|_| OnceCell::new()).collect();
        Staging { cross, copies }
    }

    /// Whether range `i` touches memory shared across processes.
    pub(super) fn is_cross(&self, i: usize) -> bool {
        self.cross.get(i).copied().unwrap_or(false)
    }

    /// The private copy of range `i`, made by `make` the first time it is asked for. It lives
    /// until [`take`](Self::take) or the staging is dropped, both of which need `&mut self`.
    pub(super) fn copy_of(&self, i: usize, make: impl FnOnce() -> PrivateCopy) -> &PrivateCopy {
        self.copies[i].get_or_init(make)
    }

    /// Takes back the private copy of range `i`, if one was made.
    pub(super) fn take(&mut self, i: usize) -> Option<PrivateCopy> {
        self.copies.get_mut(i)?.take()
    }
}
