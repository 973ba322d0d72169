//! Two streams, one pool: a loader stream fills buffers that a compute stream consumes,
//! and memory freed on one stream is reused on the other through events — directly, and
//! along a chain of three streams.
//!
//! ```sh
//! cargo run --example multi_stream
//! ```

use soma::{KernelArg, MemPool, ReusePolicy};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let npu = soma::sim::Npu::builder().build()?;
    let dev = npu.device(0)?;
    let loader = dev.create_stream()?;
    let compute = dev.create_stream()?;
    let pool = MemPool::builder()
        .max_size(1 << 30)
        .reuse(ReusePolicy::new(true, false, false)) // only event dependencies, to show them
        .build(&dev)?;

    let n = 256 * 1024;
    let mut sums = Vec::new();
    for batch in 0..8 {
        // The loader stages a batch; the allocation lives on the loader stream.
        let mut input = pool.alloc_async::<f32>(n, &loader)?;
        loader.copy_from_host(&mut input, &vec![batch as f32; n])?;
        // Hand it to the compute stream: an event on the loader, a wait on compute.
        let input = input.hand_off(&compute)?;
        let mut sum = pool.alloc_async::<f32>(1, &compute)?;
        compute.launch("sum", &[KernelArg::read(&input), KernelArg::write(&mut sum)], |b| {
            b.write::<f32>(1)?[0] = b.read::<f32>(0)?.iter().sum();
            Ok(())
        })?;
        drop(input); // freed onto `compute`, no synchronisation
                     // The loader learns that compute is past the free: the next batch's input reuses the
                     // block through this event (no host synchronisation inside the loop).
        let ev = compute.record_event()?;
        loader.wait_event(&ev)?;
        sums.push(sum);
    }
    let st = pool.stats();
    let mut total = 0.0f64;
    for sum in &sums {
        let mut out = [0f32];
        compute.copy_to_host(sum, &mut out)?;
        total += f64::from(out[0]);
    }
    println!("sum of all batches: {total}");
    println!(
        "reuses: same stream {}, through events {}, after a host synchronisation {}; \
         allocations from fresh memory: {}",
        st.reuses.same_stream,
        st.reuses.event_dependency,
        st.reuses.host_synchronized,
        st.fresh_allocations
    );
    drop(sums);

    // A chain: s1 frees, s2 waits on s1, s3 waits on s2 — s3 may reuse s1's block.
    let (s1, s2, s3) = (dev.create_stream()?, dev.create_stream()?, dev.create_stream()?);
    let a = pool.alloc_async::<u8>(4 << 20, &s1)?;
    let ptr = a.device_ptr();
    drop(a);
    s2.wait_event(&s1.record_event()?)?;
    s3.wait_event(&s2.record_event()?)?;
    let b = pool.alloc_async::<u8>(4 << 20, &s3)?;
    println!("s3 reused s1's block through s2: {}", b.device_ptr() == ptr);
    Ok(())
}
