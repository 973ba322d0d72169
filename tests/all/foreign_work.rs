//! Work soma does not see: kernels enqueued on the backend's raw stream, and the contract
//! that orders frees after them (`record_use` for another stream's raw work).

use soma::hal::{AccessMode, BufferAccess, KernelLaunch, StreamHal};
use soma::prelude::*;
use soma::sim::{Npu, ReportKind, SanitizerMode, SimStreamExt as _};
use soma::{MemPool, PoolAlloc};

/// A "foreign" kernel: launched on the raw stream, invisible to soma's bookkeeping.
fn foreign_scale(raw: &dyn StreamHal, x: &PoolAlloc<'_, f32>) {
    raw.launch(KernelLaunch {
        name: "foreign_scale",
        buffers: vec![BufferAccess {
            ptr: x.device_ptr(),
            len: x.byte_len(),
            mode: AccessMode::Write,
        }],
        body: Box::new(|b| {
            b.write::<f32>(0)?.iter_mut().for_each(|v| *v *= 2.0);
            Ok(())
        }),
    })
    .unwrap();
}

/// Allocates on s1, runs a foreign kernel on s2 (ordered after the allocation), optionally
/// tells soma about the use, frees on s1; returns the sanitizer's reports.
fn foreign_use_on_another_stream(record: bool) -> Vec<ReportKind> {
    let npu = Npu::builder().sanitizer(SanitizerMode::Report).build().unwrap();
    let dev = npu.device(0).unwrap();
    let (s1, s2) = (dev.create_stream().unwrap(), dev.create_stream().unwrap());
    let pool = MemPool::builder().build(&dev).unwrap();
    let x = pool.alloc_zeros::<f32>(1024, &s1).unwrap();
    if record {
        x.record_use(&s2).unwrap();
    } else {
        s2.wait_stream(&s1).unwrap(); // ordered after the allocation, but soma is not told
    }
    let gate = crate::common::Gate::close(&s2);
    foreign_scale(s2.as_raw().unwrap(), &x);
    drop(x);
    gate.open();
    s1.synchronize().unwrap();
    s2.synchronize().unwrap();
    npu.sim_device(0).unwrap().sanitizer_reports().iter().map(|r| r.kind).collect()
}

#[test]
fn a_foreign_use_on_another_stream_needs_record_use() {
    assert!(
        foreign_use_on_another_stream(false).contains(&ReportKind::FreeNotOrderedAfterUse),
        "without record_use the free is not ordered after the foreign kernel"
    );
    assert_eq!(foreign_use_on_another_stream(true), vec![], "with record_use it is clean");
}

#[test]
fn foreign_work_on_the_allocations_own_stream_is_ordered_like_soma_work() {
    let npu = Npu::builder().sanitizer(SanitizerMode::Report).build().unwrap();
    let dev = npu.device(0).unwrap();
    let s = dev.create_stream().unwrap();
    let pool = MemPool::builder().build(&dev).unwrap();
    let x = pool.upload(&[1.5f32; 256], &s).unwrap();
    s.note_foreign_work();
    foreign_scale(s.as_raw().unwrap(), &x);
    assert_eq!(s.download(&x).unwrap(), vec![3.0; 256]);
    drop(x);
    let y = pool.alloc_zeros::<f32>(256, &s).unwrap();
    s.synchronize().unwrap();
    drop(y);
    assert!(npu.sim_device(0).unwrap().sanitizer_reports().is_empty());
}

#[test]
fn the_raw_accessor_gives_the_streams_own_backend_stream() {
    let npu = crate::common::npu();
    let dev = npu.device(0).unwrap();
    let s = dev.create_stream().unwrap();
    assert_eq!(s.as_raw().unwrap().id(), s.id());
}
