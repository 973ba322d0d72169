//! Owned handles: engines that keep their device, pools, streams and memory in structs,
//! threads and async tasks, with the same stream-ordered semantics as the borrowed handles.

use std::sync::{mpsc, Arc};

use soma::prelude::*;
use soma::sim::{Npu, SanitizerMode};
use soma::{Device, MemPool, OwnedAlloc, OwnedPool, OwnedStream, ReusePolicy};

/// What an engine holds: no lifetime anywhere.
struct Engine {
    device: Device,
    weights: OwnedPool,
    activations: OwnedPool,
    stream: OwnedStream,
    embedding: OwnedAlloc<f32>,
}

impl Engine {
    fn new(device: Device) -> soma::Result<Engine> {
        let weights = MemPool::builder().build_owned(&device)?;
        let activations = MemPool::builder().build_owned(&device)?;
        let stream = device.create_owned_stream()?;
        let embedding = weights.upload(&[0.25f32; 4096], &stream)?;
        Ok(Engine { device, weights, activations, stream, embedding })
    }

    fn step(&self, scale: f32) -> soma::Result<f32> {
        let mut x = self.activations.alloc_async::<f32>(self.embedding.len(), &self.stream)?;
        self.stream.copy(&mut x, &self.embedding)?;
        self.stream.launch("scale", &[soma::KernelArg::write(&mut x)], move |b| {
            b.write::<f32>(0)?.iter_mut().for_each(|v| *v *= scale);
            Ok(())
        })?;
        Ok(self.stream.download(&x.slice(..1)?)?[0])
    }

    /// Bytes of weights on the device.
    fn weight_bytes(&self) -> u64 {
        assert!(self.device.info().total_memory > 0);
        self.weights.stats().used
    }
}

#[test]
fn an_engine_struct_owns_everything_it_uses() {
    let npu = crate::common::npu();
    let engine = Engine::new(npu.device(0).unwrap()).unwrap();
    assert_eq!(engine.step(4.0).unwrap(), 1.0);
    assert_eq!(engine.weight_bytes(), 4096 * 4);
    // The engine moves to another thread as a whole.
    let result = std::thread::spawn(move || engine.step(2.0)).join().unwrap();
    assert_eq!(result.unwrap(), 0.5);
}

#[test]
fn an_arc_of_a_pool_is_shared_by_threads() {
    let npu = crate::common::npu();
    let dev = npu.device(0).unwrap();
    let pool = Arc::new(MemPool::builder().build_owned(&dev).unwrap());
    let workers: Vec<_> = (0..4u8)
        .map(|i| {
            let (pool, dev) = (Arc::clone(&pool), dev.clone());
            std::thread::spawn(move || -> soma::Result<Vec<u8>> {
                let s = dev.create_owned_stream()?;
                let x = pool.upload(&[i; 64], &s)?;
                s.download(&x)
            })
        })
        .collect();
    for (i, w) in workers.into_iter().enumerate() {
        assert_eq!(w.join().unwrap().unwrap(), vec![i as u8; 64]);
    }
    assert_eq!(pool.stats().used, 0);
}

#[test]
fn allocations_outlive_the_handles_they_came_from() {
    // The last allocation keeps its pool and stream alive, and is freed onto the stream.
    let npu = crate::common::npu();
    let dev = npu.device(0).unwrap();
    let sim = npu.sim_device(0).unwrap();
    let x = {
        let pool = MemPool::builder().build_owned(&dev).unwrap();
        let s = dev.create_owned_stream().unwrap();
        pool.upload(&[7u16; 100], &s).unwrap()
    };
    assert_eq!(x.stream().download(&x).unwrap(), vec![7; 100]);
    assert!(sim.stats().mapped_bytes > 0);
    drop(x);
    assert_eq!(sim.stats().mapped_bytes, 0, "the pool went with its last allocation");
    assert_eq!(sim.stats().live_streams, 0, "and so did the stream");
}

#[test]
fn channel_errors_holding_allocations_box_into_dyn_error() {
    fn send_after_hangup() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
        let npu = crate::common::npu();
        let dev = npu.device(0).unwrap();
        let pool = MemPool::builder().build_owned(&dev)?;
        let s = dev.create_owned_stream()?;
        let (tx, rx) = mpsc::channel::<OwnedAlloc<u8>>();
        drop(rx);
        tx.send(pool.alloc_async::<u8>(16, &s)?)?; // SendError<OwnedAlloc<u8>>
        Ok(())
    }
    let err = send_after_hangup().unwrap_err();
    assert!(err.to_string().contains("sending on a closed channel"), "{err}");
}

#[test]
fn tokio_tasks_hold_allocations_across_awaits() {
    let npu = crate::common::npu();
    let dev = npu.device(0).unwrap();
    let pool = MemPool::builder().build_owned(&dev).unwrap();
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).build().unwrap();
    let sums = rt.block_on(async move {
        let tasks: Vec<tokio::task::JoinHandle<soma::Result<u32>>> = (1..=4u32)
            .map(|i| {
                let (pool, dev) = (pool.clone(), dev.clone());
                tokio::spawn(async move {
                    let s = dev.create_owned_stream()?;
                    let x = pool.upload(&vec![i; 256], &s)?;
                    s.synchronize_async().await?; // `x` is held across the await
                    let host = s.copy_to_host_async(&x, soma::HostBuffer::new(&dev, 256)?)?.await?;
                    soma::Result::Ok(host.iter().sum::<u32>())
                })
            })
            .collect();
        let mut sums = Vec::new();
        for t in tasks {
            sums.push(t.await.unwrap().unwrap());
        }
        sums
    });
    assert_eq!(sums, vec![256, 512, 768, 1024]);
}

#[test]
fn owned_hand_offs_move_in_place_and_in_batches() {
    let npu = Npu::builder().sanitizer(SanitizerMode::Report).build().unwrap();
    let dev = npu.device(0).unwrap();
    let pool =
        MemPool::builder().reuse(ReusePolicy::new(false, false, false)).build_owned(&dev).unwrap();
    let (prefill, decode) =
        (dev.create_owned_stream().unwrap(), dev.create_owned_stream().unwrap());
    let mut table: Vec<OwnedAlloc<f32>> =
        (0..32).map(|i| pool.upload(&[i as f32; 64], &prefill).unwrap()).collect();
    // Prefill held busy: a wait on a record that has already completed enqueues nothing.
    let (release, gate) = std::sync::mpsc::channel::<()>();
    prefill.host_fn(move || gate.recv().unwrap_or_default()).unwrap();
    let before = decode.hal().enqueued();
    OwnedAlloc::hand_off_all(&mut table, &decode).unwrap();
    assert_eq!(decode.hal().enqueued() - before, 1, "one event wait for the whole table");
    release.send(()).unwrap();
    assert!(table.iter().all(|b| b.stream().same_stream(&decode)));
    // Decode writes every block, then frees them on decode: nothing to report.
    for b in &mut table {
        decode.fill(b, 1.0).unwrap();
    }
    let mut one = pool.alloc_zeros::<f32>(8, &decode).unwrap();
    one.hand_off(&prefill).unwrap();
    prefill.fill(&mut one, 2.0).unwrap();
    drop(table);
    drop(one);
    decode.synchronize().unwrap();
    prefill.synchronize().unwrap();
    assert!(npu.sim_device(0).unwrap().sanitizer_reports().is_empty());
}

#[test]
fn a_failed_batch_hand_off_moves_nothing() {
    let npu = Npu::builder().devices(2).build().unwrap();
    let (d0, d1) = (npu.device(0).unwrap(), npu.device(1).unwrap());
    let pool = MemPool::builder().build_owned(&d0).unwrap();
    let s = d0.create_owned_stream().unwrap();
    let other = d1.create_owned_stream().unwrap();
    let mut table: Vec<_> = (0..3).map(|_| pool.alloc_async::<u8>(8, &s).unwrap()).collect();
    assert!(OwnedAlloc::hand_off_all(&mut table, &other).is_err());
    assert!(table.iter().all(|b| b.stream().same_stream(&s)));
}

#[test]
fn owned_allocations_compact_and_free_explicitly() {
    let npu = crate::common::npu();
    let dev = npu.device(0).unwrap();
    let pool = MemPool::builder().build_owned(&dev).unwrap();
    let s = dev.create_owned_stream().unwrap();
    let blocks: Vec<_> = (0..4).map(|i| pool.upload(&[i as u8; 1 << 20], &s).unwrap()).collect();
    let [a, b, c, d]: [OwnedAlloc<u8>; 4] = blocks.try_into().unwrap();
    let low = a.device_ptr();
    drop(a);
    c.free().unwrap();
    let (mut b, mut d) = (b, d);
    let moved = pool.compact(&s, &mut [&mut b, &mut d]).unwrap();
    assert_eq!(moved, 2);
    assert_eq!(b.device_ptr(), low);
    assert_eq!(s.download(&b).unwrap(), vec![1; 1 << 20]);
    assert_eq!(s.download(&d).unwrap(), vec![3; 1 << 20]);
    let other = MemPool::builder().build_owned(&dev).unwrap();
    assert!(other.compact(&s, &mut [&mut b]).is_err(), "an allocation of another pool");
}
