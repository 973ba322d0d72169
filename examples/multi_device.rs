//! A tensor-parallel layer over several devices: each device holds a slice of the weights,
//! computes a partial result, and the partials travel peer to peer to device 0, which adds
//! them up. Every device has its own pool; nothing synchronises the host inside the loop.
//!
//! ```sh
//! cargo run --release --example multi_device                # 4 devices, 32 tokens
//! cargo run --release --example multi_device -- --quick     # 3 devices, 4 tokens
//! SOMA_SANITIZER=fail cargo run --release --example multi_device -- --quick
//! ```
//!
//! * **The layer** is `y = W x` with `W` split by columns (a row-parallel linear layer, as in
//!   Megatron-style tensor parallelism): device `k` holds `W_k`, the columns of its slice of
//!   `x`, and computes `y_k = W_k x_k`; `y` is the sum of the `y_k`.
//! * **Peer access** is enabled from device 0 to every other device (one direction: device 0
//!   reads their memory, they never read its). Device 0's stream pulls the partials: a copy
//!   into a staging block for the even devices, a kernel that reads the peer's memory
//!   directly for the odd ones.
//! * **Ordering across devices** comes from soma: device 0's copy or kernel records its use
//!   of device `k`'s partial, which makes device 0's stream wait for device `k`'s work (an
//!   event of device `k`), and the partial's free on device `k` waits for device 0's use (an
//!   event of device 0). The partials' blocks are reused on their own streams at the next
//!   token.
//! * **The link** between devices is costed by the latency model at 56 GB/s (one HCCS
//!   link), the rest of the model is off.
//! * The result of every token is checked against the same layer computed on the host; the
//!   example exits with an error if any element differs.

use std::time::Instant;

use soma::prelude::*;
use soma::sim::{LatencyModel, Npu, HCCS_BANDWIDTH};
use soma::{Device, KernelArg, MemPool, OwnedAlloc, OwnedPool, OwnedStream};

/// One device's share of the layer.
struct Shard {
    device: Device,
    stream: OwnedStream,
    pool: OwnedPool,
    /// `W_k`: `OUT` rows of this device's `cols` columns, row-major.
    weights: OwnedAlloc<f32>,
    /// First column of this device's slice of `x`.
    first_col: usize,
    cols: usize,
}

struct Config {
    devices: u32,
    tokens: usize,
    inputs: usize,
    outputs: usize,
}

/// A deterministic pseudo-random value in `[-1, 1)` for `(a, b)`.
fn value(a: usize, b: usize) -> f32 {
    let h = (a as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ (b as u64).wrapping_mul(0xC2B2_AE3D);
    ((h >> 40) % 2000) as f32 / 1000.0 - 1.0
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let quick = std::env::args().any(|a| a == "--quick");
    let cfg = if quick {
        Config { devices: 3, tokens: 4, inputs: 384, outputs: 128 }
    } else {
        Config { devices: 4, tokens: 32, inputs: 4096, outputs: 1024 }
    };
    let latency = LatencyModel::none().with_peer_bandwidth(HCCS_BANDWIDTH);
    let npu = Npu::builder().devices(cfg.devices).capacity(4 << 30).latency(latency).build()?;
    let shards = load_shards(&npu, &cfg)?;
    let head = &shards[0];
    for peer in &shards[1..] {
        head.device.enable_peer_access(&peer.device)?;
    }

    let started = Instant::now();
    let mut link_bytes = 0u64;
    for token in 0..cfg.tokens {
        let x: Vec<f32> = (0..cfg.inputs).map(|i| value(token, i)).collect();
        // Every device computes its partial result on its own stream.
        let mut partials = Vec::with_capacity(shards.len());
        for shard in &shards {
            let xs = shard.pool.upload(&x[shard.first_col..][..shard.cols], &shard.stream)?;
            let mut partial = shard.pool.alloc_async::<f32>(cfg.outputs, &shard.stream)?;
            let cols = shard.cols;
            let args = [
                KernelArg::read(&shard.weights),
                KernelArg::read(&xs),
                KernelArg::write(&mut partial),
            ];
            shard.stream.launch("matvec", &args, move |b| {
                let (w, x, y) = (b.read::<f32>(0)?, b.read::<f32>(1)?, b.write::<f32>(2)?);
                for (row, out) in w.chunks_exact(cols).zip(y.iter_mut()) {
                    *out = row.iter().zip(x).map(|(w, x)| w * x).sum();
                }
                Ok(())
            })?;
            partials.push(partial);
        }
        // Device 0 gathers: its own partial first, then each peer's over the link.
        let mut sum = head.pool.alloc_async::<f32>(cfg.outputs, &head.stream)?;
        head.stream.copy(&mut sum, &partials[0])?;
        for (k, partial) in partials.iter().enumerate().skip(1) {
            link_bytes += partial.byte_len();
            if k % 2 == 0 {
                let mut staged = head.pool.alloc_async::<f32>(cfg.outputs, &head.stream)?;
                head.stream.copy(&mut staged, partial)?; // device k → device 0
                add_into(&head.stream, &mut sum, &staged)?;
            } else {
                add_into(&head.stream, &mut sum, partial)?; // reads device k's memory
            }
        }
        // Freed on their own devices' streams, after device 0's reads of them.
        drop(partials);
        let y = head.stream.download(&sum)?;
        check(&cfg, &x, &y, token)?;
    }
    let elapsed = started.elapsed();

    println!(
        "{} tokens through a {}x{} layer split over {} devices in {:.1} ms",
        cfg.tokens,
        cfg.outputs,
        cfg.inputs,
        cfg.devices,
        elapsed.as_secs_f64() * 1e3
    );
    println!(
        "peer-to-peer: {} KiB of partial results over the link ({:.2} µs at 56 GB/s)",
        link_bytes >> 10,
        latency.peer_copy_time(link_bytes).as_secs_f64() * 1e6
    );
    for (k, shard) in shards.iter().enumerate() {
        shard.stream.synchronize()?;
        let st = shard.pool.stats();
        println!(
            "device {k}: {} allocations from fresh memory, {} reused on the same stream, \
             {} bytes in use (the weights)",
            st.fresh_allocations, st.reuses.same_stream, st.used
        );
        if st.reuses.same_stream == 0 && cfg.tokens > 1 {
            return Err(format!("device {k}: no block was reused across tokens").into());
        }
    }
    Ok(())
}

/// A pool, a stream and a slice of the weights on every device.
fn load_shards(npu: &Npu, cfg: &Config) -> Result<Vec<Shard>, Box<dyn std::error::Error>> {
    let n = cfg.devices as usize;
    let mut shards = Vec::with_capacity(n);
    for k in 0..n {
        let device = npu.device(k as u32)?;
        let stream = device.create_owned_stream()?;
        let pool = MemPool::builder().max_size(1 << 30).build_owned(&device)?;
        let (first_col, cols) = (k * cfg.inputs / n, cfg.inputs / n);
        let mut w = Vec::with_capacity(cfg.outputs * cols);
        for row in 0..cfg.outputs {
            w.extend((first_col..first_col + cols).map(|col| value(row, col + 1)));
        }
        let weights = pool.upload(&w, &stream)?;
        shards.push(Shard { device, stream, pool, weights, first_col, cols });
    }
    Ok(shards)
}

/// Enqueues `sum += part` on `stream` (`part` may be a peer device's memory).
fn add_into<P: DeviceBuffer<Elem = f32>>(
    stream: &OwnedStream,
    sum: &mut OwnedAlloc<f32>,
    part: &P,
) -> soma::Result<()> {
    stream.launch("add", &[KernelArg::write(sum), KernelArg::read(part)], |b| {
        let (sum, part) = (b.write::<f32>(0)?, b.read::<f32>(1)?);
        sum.iter_mut().zip(part).for_each(|(s, p)| *s += p);
        Ok(())
    })
}

/// Compares `y` with the layer computed on the host.
fn check(cfg: &Config, x: &[f32], y: &[f32], token: usize) -> Result<(), String> {
    for (row, &got) in y.iter().enumerate() {
        let want: f32 = (0..cfg.inputs).map(|col| value(row, col + 1) * x[col]).sum();
        if (got - want).abs() > 1e-3 * (1.0 + want.abs()) {
            return Err(format!(
                "token {token}, output {row}: {got} on the devices, {want} on the host"
            ));
        }
    }
    Ok(())
}
