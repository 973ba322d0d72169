//! The API in one page: a pool, allocations on a stream, a kernel, typed attributes, stats.
//!
//! ```sh
//! cargo run --example quickstart
//! ```

use soma::{attr, KernelArg, MemPool};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let npu = soma::sim::Npu::builder().build()?; // the software NPU
    let dev = npu.device(0)?;
    let s = dev.create_stream()?;
    let pool = MemPool::builder().max_size(8 << 30).build(&dev)?;

    let n = 1 << 20;
    let host: Vec<f32> = (0..n).map(|i| i as f32).collect();
    let mut x = pool.alloc_async::<f32>(n, &s)?; // usable on `s`
    let mut y = pool.alloc_async::<f32>(n, &s)?;
    s.copy_from_host(&mut x, &host)?; // stream-ordered, staged: `host` is free to change
    s.launch("saxpy", &[KernelArg::read(&x), KernelArg::write(&mut y)], |b| {
        let (x, y) = (b.read::<f32>(0)?, b.write::<f32>(1)?);
        for (y, x) in y.iter_mut().zip(x) {
            *y = 2.0 * x + 1.0;
        }
        Ok(())
    })?;
    drop(x); // freed onto `s` in stream order: no synchronisation, no driver call

    let mut out = vec![0f32; n];
    s.copy_to_host(&y, &mut out)?; // waits for the copy
    assert_eq!(out[10], 21.0);

    // The next allocation of the same size reuses x's block at once.
    let z = pool.alloc_async::<f32>(n, &s)?;
    println!("z reused a cached block: {}", pool.stats().reuses.same_stream == 1);
    drop((y, z));

    println!(
        "used {} B, reserved {} B",
        pool.get::<attr::UsedMemCurrent>()?,
        pool.get::<attr::ReservedMemCurrent>()?
    );
    pool.set::<attr::ReleaseThreshold>(0)?; // release the cache at the next synchronize
    s.synchronize()?;
    println!(
        "after synchronize with threshold 0: reserved {} B",
        pool.get::<attr::ReservedMemCurrent>()?
    );
    println!("\n{}", pool.stats());
    Ok(())
}
