//! Page-locked host buffers, asynchronous transfers and awaitable completion.

use std::future::Future;
use std::pin::pin;
use std::sync::Arc;
use std::task::{Context, Poll, Wake};
use std::time::Duration;

use soma::prelude::*;
use soma::{Error, HostBuffer, MemPool, ReusePolicy};

use crate::common::Gate;

/// Drives a future to completion on this thread (what any executor does).
fn block_on<F: Future>(f: F) -> F::Output {
    struct Unpark(std::thread::Thread);
    impl Wake for Unpark {
        fn wake(self: Arc<Self>) {
            self.0.unpark();
        }
    }
    let waker = Arc::new(Unpark(std::thread::current())).into();
    let mut cx = Context::from_waker(&waker);
    let mut f = pin!(f);
    loop {
        match f.as_mut().poll(&mut cx) {
            Poll::Ready(v) => return v,
            Poll::Pending => std::thread::park_timeout(Duration::from_secs(30)),
        }
    }
}

/// Polls a future once with a waker that does nothing.
fn poll_once<F: Future + Unpin>(f: &mut F) -> Poll<F::Output> {
    std::pin::Pin::new(f).poll(&mut Context::from_waker(std::task::Waker::noop()))
}

#[test]
fn page_locked_buffers_are_zeroed_counted_and_freed() {
    let npu = crate::common::npu();
    let dev = npu.device(0).unwrap();
    let sim = npu.sim_device(0).unwrap();
    let host = HostBuffer::<u64>::new(&dev, 1000).unwrap();
    assert!(host.iter().all(|&v| v == 0));
    assert_eq!(sim.stats().host_bytes, 8192, "rounded to whole pages");
    let copy = HostBuffer::from_slice(&dev, &[1u8, 2, 3]).unwrap();
    assert_eq!(&copy[..], &[1, 2, 3]);
    drop((host, copy));
    assert_eq!(sim.stats().host_bytes, 0);
    assert!(matches!(HostBuffer::<u32>::new(&dev, 0), Err(Error::InvalidSize(_))));
    assert!(matches!(HostBuffer::<u32>::new(&dev, usize::MAX), Err(Error::InvalidSize(_))));
}

#[test]
fn downloads_are_lent_until_complete_and_make_no_staging_copy() {
    let npu = crate::common::npu();
    let dev = npu.device(0).unwrap();
    let s = dev.create_stream().unwrap();
    let pool = MemPool::builder().build(&dev).unwrap();
    let x = pool.upload(&[3.0f32; 1024], &s).unwrap();
    let gate = Gate::close(&s);
    let mut transfer = s.copy_to_host_async(&x, HostBuffer::new(&dev, 1024).unwrap()).unwrap();
    // The stream is held: the copy cannot have run, and the call did not wait for it.
    assert!(!transfer.is_complete());
    assert!(poll_once(&mut transfer).is_pending());
    gate.open();
    let host = block_on(transfer).unwrap();
    assert!(host.iter().all(|&v| v == 3.0));
    // A shorter host buffer takes the start; a longer one is refused.
    let head = s.copy_to_host_async(&x, HostBuffer::new(&dev, 4).unwrap()).unwrap().wait().unwrap();
    assert_eq!(&head[..], &[3.0; 4]);
    let long = s.copy_to_host_async(&x, HostBuffer::new(&dev, 1025).unwrap());
    assert!(matches!(long, Err(Error::InvalidArgument(_))));
}

#[test]
fn uploads_return_the_buffer_for_reuse() {
    let npu = crate::common::npu();
    let dev = npu.device(0).unwrap();
    let s = dev.create_stream().unwrap();
    let pool = MemPool::builder().build(&dev).unwrap();
    let mut x = pool.alloc_zeros::<u32>(16, &s).unwrap();
    let mut staging = HostBuffer::<u32>::new(&dev, 8).unwrap();
    for round in 0..3u32 {
        staging.fill(round + 1);
        let mut window = x.slice_mut(round as usize * 4..round as usize * 4 + 8).unwrap();
        staging = s.copy_from_host_async(&mut window, staging).unwrap().wait().unwrap();
    }
    assert_eq!(s.download(&x).unwrap(), [vec![1; 4], vec![2; 4], vec![3; 8]].concat());
}

#[test]
fn a_dropped_transfer_waits_for_its_copy() {
    let npu = crate::common::npu();
    let dev = npu.device(0).unwrap();
    let sim = npu.sim_device(0).unwrap();
    let s = dev.create_stream().unwrap();
    let pool = MemPool::builder().build(&dev).unwrap();
    let x = pool.upload(&[1u8; 4096], &s).unwrap();
    s.host_fn(|| std::thread::sleep(Duration::from_millis(20))).unwrap();
    let copy_at = s.hal().enqueued() + 1;
    let transfer = s.copy_to_host_async(&x, HostBuffer::new(&dev, 4096).unwrap()).unwrap();
    drop(transfer);
    // The copy had completed when the drop returned, and the buffer is freed.
    assert!(s.hal().completed() >= copy_at);
    assert_eq!(sim.stats().host_bytes, 0);
}

#[test]
fn a_failed_stream_fails_its_transfer_and_futures() {
    let npu = crate::common::npu();
    let dev = npu.device(0).unwrap();
    let s = dev.create_stream().unwrap();
    let pool = MemPool::builder().build(&dev).unwrap();
    let x = pool.alloc_zeros::<u8>(64, &s).unwrap();
    s.launch("fails", &[], |_| Err(soma::hal::KernelError::new("boom"))).unwrap();
    let transfer = s.copy_to_host_async(&x, HostBuffer::new(&dev, 64).unwrap()).unwrap();
    assert!(transfer.wait().is_err());
    assert!(block_on(s.synchronize_async()).is_err());
    let event = s.record_event().unwrap();
    assert!(block_on(event.wait_async()).is_err());
}

#[test]
fn awaited_completion_is_a_host_observation() {
    // A free on s1, then s1's completion seen through a future: the block is reusable on s2
    // with every cross-stream rule off, exactly as after `synchronize`.
    for how in ["stream", "event", "transfer"] {
        let npu = crate::common::npu();
        let dev = npu.device(0).unwrap();
        let (s1, s2) = (dev.create_stream().unwrap(), dev.create_stream().unwrap());
        let pool =
            MemPool::builder().reuse(ReusePolicy::new(false, false, false)).build(&dev).unwrap();
        let keep = pool.alloc_async::<u8>(4096, &s1).unwrap();
        let x = pool.alloc_async::<u8>(1 << 20, &s1).unwrap();
        let addr = x.device_ptr();
        drop(x);
        match how {
            "stream" => block_on(s1.synchronize_async()).unwrap(),
            "event" => block_on(s1.record_event().unwrap().wait_async()).unwrap(),
            _ => drop(
                block_on(s1.copy_to_host_async(&keep, HostBuffer::new(&dev, 1).unwrap()).unwrap())
                    .unwrap(),
            ),
        }
        let y = pool.alloc_async::<u8>(1 << 20, &s2).unwrap();
        assert_eq!(y.device_ptr(), addr, "{how}: reused after the awaited completion");
        assert_eq!(pool.stats().reuses.host_synchronized, 1, "{how}");
    }
}

#[test]
fn an_event_future_waits_for_the_record_it_was_made_for() {
    let npu = crate::common::npu();
    let dev = npu.device(0).unwrap();
    let s = dev.create_stream().unwrap();
    let gate = Gate::close(&s);
    let event = s.record_event().unwrap();
    let mut wait = event.wait_async();
    assert!(poll_once(&mut wait).is_pending());
    let waiter = std::thread::scope(|scope| {
        let h = scope.spawn(|| block_on(wait));
        std::thread::sleep(Duration::from_millis(10));
        assert!(!h.is_finished(), "completed while the stream was held");
        gate.open();
        h.join().unwrap()
    });
    waiter.unwrap();
    assert!(event.query().unwrap());
    // A never-recorded event is complete at once.
    block_on(dev.create_event().unwrap().wait_async()).unwrap();
}
