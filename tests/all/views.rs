//! Views: sub-ranges and reinterpretations of allocations, accepted wherever a buffer is.

use soma::prelude::*;
use soma::sim::{Npu, SanitizerMode};
use soma::{Error, KernelArg, MemPool};

#[test]
fn a_write_through_a_view_changes_only_its_range() {
    let npu = crate::common::npu();
    let dev = npu.device(0).unwrap();
    let s = dev.create_stream().unwrap();
    let pool = MemPool::builder().build(&dev).unwrap();
    let mut x = pool.upload(&[0u32; 8], &s).unwrap();
    s.copy_from_host(&mut x.slice_mut(2..4).unwrap(), &[7, 8]).unwrap();
    s.fill(&mut x.slice_mut(6..).unwrap(), 9).unwrap();
    s.memset(&mut x.slice_mut(..1).unwrap(), 0xff).unwrap();
    assert_eq!(s.download(&x).unwrap(), vec![u32::MAX, 0, 7, 8, 0, 0, 9, 9]);
    assert_eq!(s.download(&x.slice(2..=3).unwrap()).unwrap(), vec![7, 8]);
    // Views of views, and a kernel over a view.
    let tail = x.slice(4..).unwrap();
    assert_eq!(s.download(&tail.slice(2..).unwrap()).unwrap(), vec![9, 9]);
    let mut y = pool.alloc_zeros::<u32>(2, &s).unwrap();
    s.launch(
        "copy_tail",
        &[KernelArg::read(&tail.slice(2..).unwrap()), KernelArg::write(&mut y)],
        |b| {
            let v = b.read::<u32>(0)?.to_vec();
            b.write::<u32>(1)?.copy_from_slice(&v);
            Ok(())
        },
    )
    .unwrap();
    assert_eq!(s.download(&y).unwrap(), vec![9, 9]);
}

#[test]
fn split_halves_are_written_independently() {
    let npu = crate::common::npu();
    let dev = npu.device(0).unwrap();
    let s = dev.create_stream().unwrap();
    let pool = MemPool::builder().build(&dev).unwrap();
    let mut x = pool.alloc_zeros::<u16>(6, &s).unwrap();
    let (mut a, mut b) = x.split_at_mut(2).unwrap();
    s.fill(&mut a, 1).unwrap();
    s.fill(&mut b, 2).unwrap();
    assert_eq!(s.download(&x).unwrap(), vec![1, 1, 2, 2, 2, 2]);
    assert!(matches!(x.split_at_mut(7), Err(Error::InvalidArgument(_))));
}

#[test]
fn bad_ranges_and_casts_are_errors_not_panics() {
    let npu = crate::common::npu();
    let dev = npu.device(0).unwrap();
    let s = dev.create_stream().unwrap();
    let pool = MemPool::builder().build(&dev).unwrap();
    let mut x = pool.alloc_async::<u8>(10, &s).unwrap();
    for bad in [x.slice(0..11).err(), x.slice(11..).err(), x.slice(..=10).err()] {
        assert!(matches!(bad, Some(Error::InvalidArgument(m)) if m.contains("out of range")));
    }
    #[allow(clippy::reversed_empty_ranges)]
    let reversed = x.slice(6..3).err();
    assert!(matches!(reversed, Some(Error::InvalidArgument(m)) if m.contains("starts at 6")));
    assert!(x.slice_mut(3..20).is_err());
    // 10 bytes are no whole u32s; bytes 1..9 are 8 bytes but not 4-aligned.
    assert!(
        matches!(x.cast::<u32>(), Err(Error::InvalidArgument(m)) if m.contains("whole number"))
    );
    let misaligned = x.slice(1..9).unwrap().cast::<u32>().err();
    assert!(matches!(misaligned, Some(Error::InvalidArgument(m)) if m.contains("aligned")));
    assert_eq!(x.slice(0..8).unwrap().cast::<u32>().unwrap().len(), 2);
    assert_eq!(x.cast_mut::<u16>().unwrap().len(), 5);
    // An empty view is fine and copies nothing.
    assert_eq!(s.download(&x.slice(4..4).unwrap()).unwrap(), Vec::<u8>::new());
}

#[test]
fn cast_reinterprets_the_bytes() {
    let npu = crate::common::npu();
    let dev = npu.device(0).unwrap();
    let s = dev.create_stream().unwrap();
    let pool = MemPool::builder().build(&dev).unwrap();
    let mut raw = pool.alloc_zeros::<u8>(8, &s).unwrap();
    s.copy_from_host(&mut raw.cast_mut::<f32>().unwrap(), &[1.0f32, -2.0]).unwrap();
    let bytes = s.download(&raw).unwrap();
    assert_eq!(bytes[..4], 1.0f32.to_ne_bytes());
    assert_eq!(s.download(&raw.cast::<f32>().unwrap()).unwrap(), vec![1.0, -2.0]);
    let halves = pool.upload(&[soma::f16::from_f32(0.5), soma::f16::from_f32(-3.0)], &s).unwrap();
    let bits = s.download(&halves.cast::<u16>().unwrap()).unwrap();
    assert_eq!(bits, vec![soma::f16::from_f32(0.5).to_bits(), soma::f16::from_f32(-3.0).to_bits()]);
    let brain = pool.upload(&[soma::bf16::from_f32(2.0)], &s).unwrap();
    assert_eq!(s.download(&brain).unwrap(), vec![soma::bf16::from_f32(2.0)]);
}

#[test]
fn a_use_through_a_view_orders_the_free_after_it() {
    // The view records a use of the whole allocation on s2: the free on s1 waits for it and
    // the sanitizer stays silent, while its accesses cover only the viewed bytes.
    let npu = Npu::builder().sanitizer(SanitizerMode::Report).build().unwrap();
    let dev = npu.device(0).unwrap();
    let (s1, s2) = (dev.create_stream().unwrap(), dev.create_stream().unwrap());
    let pool = MemPool::builder().build(&dev).unwrap();
    let mut x = pool.alloc_zeros::<f32>(64, &s1).unwrap();
    s2.fill(&mut x.slice_mut(60..).unwrap(), 1.0).unwrap();
    drop(x);
    let y = pool.alloc_zeros::<f32>(64, &s1).unwrap();
    s1.synchronize().unwrap();
    s2.synchronize().unwrap();
    drop(y);
    let reports = npu.sim_device(0).unwrap().sanitizer_reports();
    assert!(reports.is_empty(), "{reports:?}");
}

#[test]
fn a_kernel_through_a_view_holds_only_the_viewed_bytes() {
    // While a kernel on s2 reads the first half through a view, s1 (not ordered with s2) may
    // write the second half: the device sees disjoint accesses. The same kernel over the
    // whole buffer makes that write a data race, which the software NPU refuses.
    for whole in [false, true] {
        let npu = crate::common::npu();
        let dev = npu.device(0).unwrap();
        let (s1, s2) = (dev.create_stream().unwrap(), dev.create_stream().unwrap());
        let pool = MemPool::builder().build(&dev).unwrap();
        let mut x = pool.alloc_zeros::<u8>(4096, &s1).unwrap();
        s2.wait_stream(&s1).unwrap();
        let (started_tx, started_rx) = std::sync::mpsc::channel();
        let (release_tx, release_rx) = std::sync::mpsc::channel::<()>();
        let read = if whole { x.slice(..).unwrap() } else { x.slice(..2048).unwrap() };
        s2.launch("read", &[KernelArg::read(&read)], move |_| {
            let _ = started_tx.send(());
            let _ = release_rx.recv_timeout(std::time::Duration::from_secs(30));
            Ok(())
        })
        .unwrap();
        started_rx.recv().unwrap();
        s1.memset(&mut x.slice_mut(2048..).unwrap(), 1).unwrap();
        let written = s1.synchronize();
        drop(release_tx);
        s2.synchronize().unwrap();
        assert_eq!(written.is_err(), whole, "whole buffer: {whole}: {written:?}");
        s1.wait_stream(&s2).unwrap();
        drop(x);
    }
}
