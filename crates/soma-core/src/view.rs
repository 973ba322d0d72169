//! Views: sub-ranges of a device buffer, typed as the buffer or reinterpreted (`cast`).
//!
//! A view borrows its buffer, so the buffer cannot be freed (or moved to another stream)
//! while a view of it exists. Copies, memsets, kernels and `record_use` accept views like
//! whole buffers; a use through a view records a use of the whole allocation (its free is
//! ordered after it), while the sanitizer and the backend's bounds checks see only the bytes
//! the view covers.

use std::marker::PhantomData;
use std::ops::{Bound, RangeBounds};

use crate::buffer::{BufferOwner, DeviceBuffer, DeviceBufferMut, Sealed};
use crate::device::Device;
use crate::error::{Error, Result};
use crate::hal::DevicePtr;
use crate::stream::Stream;

/// A read-only view of part of a device buffer; see [`DeviceBuffer::slice`].
pub struct View<'a, T> {
    owner: &'a dyn BufferOwner,
    ptr: DevicePtr,
    len: usize,
    _elem: PhantomData<fn() -> T>,
}

/// A writable view of part of a device buffer; see [`DeviceBufferMut::slice_mut`].
///
/// It holds the buffer's `&mut` borrow, so two writable views of one buffer cannot exist at
/// once (split a buffer with [`DeviceBufferMut::split_at_mut`] to write two halves).
pub struct ViewMut<'a, T> {
    owner: &'a dyn BufferOwner,
    ptr: DevicePtr,
    len: usize,
    _elem: PhantomData<fn() -> T>,
}

/// The two halves of [`DeviceBufferMut::split_at_mut`].
pub type SplitMut<'a, T> = (ViewMut<'a, T>, ViewMut<'a, T>);

/// `range` resolved against a buffer of `len` elements, or the error `[]` would panic with.
pub(crate) fn resolve(range: impl RangeBounds<usize>, len: usize) -> Result<(usize, usize)> {
    let start = match range.start_bound() {
        Bound::Included(&s) => Some(s),
        Bound::Excluded(&s) => s.checked_add(1),
        Bound::Unbounded => Some(0),
    };
    let end = match range.end_bound() {
        Bound::Included(&e) => e.checked_add(1),
        Bound::Excluded(&e) => Some(e),
        Bound::Unbounded => Some(len),
    };
    let out_of_range = |what: &str, at: Option<usize>| {
        let at = at.map_or_else(|| "past usize::MAX".to_string(), |i| i.to_string());
        Error::InvalidArgument(format!(
            "slice {what} {at} out of range for a buffer of {len} elements"
        ))
    };
    match (start, end) {
        (Some(s), _) if s > len => Err(out_of_range("start", Some(s))),
        (None, _) => Err(out_of_range("start", None)),
        (_, Some(e)) if e > len => Err(out_of_range("end", Some(e))),
        (_, None) => Err(out_of_range("end", None)),
        (Some(s), Some(e)) if s > e => {
            Err(Error::InvalidArgument(format!("slice starts at {s} but ends at {e}")))
        }
        (Some(s), Some(e)) => Ok((s, e)),
    }
}

/// The pointer and length of `[start, end)` of `buffer`, reinterpreted as `U` when `U` is
/// not the buffer's element type.
fn sub_range<B: DeviceBuffer + ?Sized>(buffer: &B, start: usize, end: usize) -> (DevicePtr, usize) {
    let elem = std::mem::size_of::<B::Elem>() as u64;
    // In range, so within the buffer's bytes: no overflow, a valid device address.
    let ptr = buffer.device_ptr().checked_add(start as u64 * elem).unwrap_or(buffer.device_ptr());
    (ptr, end - start)
}

/// The pointer and element count of `buffer` seen as `[U]`, or why it cannot be.
fn cast_range<B: DeviceBuffer + ?Sized, U>(buffer: &B) -> Result<(DevicePtr, usize)> {
    let (size, align) = (std::mem::size_of::<U>() as u64, std::mem::align_of::<U>() as u64);
    let name = std::any::type_name::<U>();
    if size == 0 {
        return Err(Error::InvalidArgument(format!("cannot view memory as zero-sized {name}")));
    }
    let bytes = buffer.byte_len();
    if bytes % size != 0 {
        return Err(Error::InvalidArgument(format!(
            "{bytes} bytes are not a whole number of {name} ({size} bytes each)"
        )));
    }
    if buffer.device_ptr().addr() % align != 0 {
        return Err(Error::InvalidArgument(format!(
            "{} is not aligned for {name} ({align} bytes)",
            buffer.device_ptr()
        )));
    }
    Ok((buffer.device_ptr(), (bytes / size) as usize))
}

impl<'a, T> View<'a, T> {
    pub(crate) fn of<B: DeviceBuffer>(buffer: &'a B, ptr: DevicePtr, len: usize) -> Self {
        View { owner: buffer, ptr, len, _elem: PhantomData }
    }
}

impl<'a, T> ViewMut<'a, T> {
    pub(crate) fn of<B: DeviceBufferMut>(buffer: &'a mut B, ptr: DevicePtr, len: usize) -> Self {
        ViewMut { owner: buffer, ptr, len, _elem: PhantomData }
    }

    /// The same range, read-only, for as long as this view is borrowed.
    pub fn as_view(&self) -> View<'_, T> {
        View { owner: self.owner, ptr: self.ptr, len: self.len, _elem: PhantomData }
    }
}

/// A writable view of the first element of a non-empty `buffer`.
pub(crate) fn first_mut<B: DeviceBufferMut>(buffer: &mut B) -> ViewMut<'_, B::Elem> {
    let ptr = buffer.device_ptr();
    ViewMut::of(buffer, ptr, 1)
}

pub(crate) fn slice<B: DeviceBuffer>(
    buffer: &B,
    range: impl RangeBounds<usize>,
) -> Result<View<'_, B::Elem>> {
    let (start, end) = resolve(range, buffer.len())?;
    let (ptr, len) = sub_range(buffer, start, end);
    Ok(View::of(buffer, ptr, len))
}

pub(crate) fn slice_mut<B: DeviceBufferMut>(
    buffer: &mut B,
    range: impl RangeBounds<usize>,
) -> Result<ViewMut<'_, B::Elem>> {
    let (start, end) = resolve(range, buffer.len())?;
    let (ptr, len) = sub_range(buffer, start, end);
    Ok(ViewMut::of(buffer, ptr, len))
}

pub(crate) fn split_at_mut<B: DeviceBufferMut>(
    buffer: &mut B,
    mid: usize,
) -> Result<SplitMut<'_, B::Elem>> {
    let len = buffer.len();
    if mid > len {
        return Err(Error::InvalidArgument(format!(
            "split at {mid} out of range for a buffer of {len} elements"
        )));
    }
    let (left, _) = sub_range(buffer, 0, mid);
    let (right, _) = sub_range(buffer, mid, len);
    // Both halves share the buffer's `&mut` borrow, as `<[T]>::split_at_mut` does; they
    // cover disjoint bytes, so a write through one never touches the other.
    let owner: &dyn BufferOwner = buffer;
    Ok((
        ViewMut { owner, ptr: left, len: mid, _elem: PhantomData },
        ViewMut { owner, ptr: right, len: len - mid, _elem: PhantomData },
    ))
}

pub(crate) fn cast<B: DeviceBuffer, U>(buffer: &B) -> Result<View<'_, U>> {
    let (ptr, len) = cast_range::<B, U>(buffer)?;
    Ok(View::of(buffer, ptr, len))
}

pub(crate) fn cast_mut<B: DeviceBufferMut, U>(buffer: &mut B) -> Result<ViewMut<'_, U>> {
    let (ptr, len) = cast_range::<B, U>(buffer)?;
    Ok(ViewMut::of(buffer, ptr, len))
}

macro_rules! view_impls {
    ($view:ident) => {
        impl<T> Sealed for $view<'_, T> {}

        impl<T> BufferOwner for $view<'_, T> {
            fn device(&self) -> &Device {
                self.owner.device()
            }

            fn record_use(&self, stream: &Stream<'_>) -> Result<()> {
                self.owner.record_use(stream)
            }
        }

        impl<T: bytemuck::Pod + Send + Sync> DeviceBuffer for $view<'_, T> {
            type Elem = T;
            fn device_ptr(&self) -> DevicePtr {
                self.ptr
            }
            fn len(&self) -> usize {
                self.len
            }
        }

        impl<T> std::fmt::Debug for $view<'_, T> {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.debug_struct(stringify!($view))
                    .field("ptr", &self.ptr)
                    .field("len", &self.len)
                    .field("elem", &std::any::type_name::<T>())
                    .finish()
            }
        }
    };
}

view_impls!(View);
view_impls!(ViewMut);

impl<T: bytemuck::Pod + Send + Sync> DeviceBufferMut for ViewMut<'_, T> {}

#[cfg(test)]
mod tests {
    use super::resolve;

    #[test]
    fn ranges_resolve_as_slices_do() {
        assert_eq!(resolve(.., 8).unwrap(), (0, 8));
        assert_eq!(resolve(2..5, 8).unwrap(), (2, 5));
        assert_eq!(resolve(2..=5, 8).unwrap(), (2, 6));
        assert_eq!(resolve(8.., 8).unwrap(), (8, 8));
        assert_eq!(resolve(..=7, 8).unwrap(), (0, 8));
        for bad in [resolve(0..9, 8), resolve(9.., 8), resolve(..=8, 8), resolve(..=usize::MAX, 8)]
        {
            assert!(bad.unwrap_err().to_string().contains("out of range"));
        }
        #[allow(clippy::reversed_empty_ranges)]
        let reversed = resolve(5..2, 8);
        assert!(reversed.unwrap_err().to_string().contains("starts at 5 but ends at 2"));
    }
}
