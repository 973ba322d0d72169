//! LLaMA-7B-shaped decoding on the software NPU, with realistic driver latencies, once
//! allocating every tensor through the plain driver (`malloc` / synchronise / `free`, as code
//! without a pool must) and once through soma's stream-ordered pools.
//!
//! ```sh
//! cargo run --release --example llama_decode                 # 6 + 64 decode steps
//! cargo run --release --example llama_decode -- --quick      # 2 + 8 steps
//! cargo run --release --example llama_decode -- --out DIR    # pictures into DIR
//! ```
//!
//! What it allocates, per decode step (batch 1, fp16 shapes stored as `f32` activations):
//! 32 layers × (norm, q, k, v, scores, probs, attention output, o-projection, residual,
//! norm, gate, up, activation, down, residual) plus a KV cache per layer that grows by
//! reallocation every 16 tokens, and the logits. The 13.5 GB of weights are allocated once
//! and never written, so the process stays small; the kernels compute real attention over
//! the KV cache, so both runs must produce the same tokens.
//!
//! Each run also draws its memory timeline (used and reserved bytes over time, live
//! allocations stacked as bands) to `llama_decode_driver.svg` and `llama_decode_pool.svg` in
//! the output directory, which the demo prints: `--out DIR`, else `llama_decode/` in the
//! target directory (`$CARGO_TARGET_DIR`, else the workspace's `target/`), so that a run
//! never writes over files of the checkout. The pool run's picture comes from the
//! activation pool's own history, the driver run's from a [`History`] that the demo fills
//! itself at every allocation and free. `scripts/refresh-doc-images.sh` runs the demo with
//! `--out docs/img` to refresh the pictures of the README.

use std::cell::{Cell, RefCell};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use soma::sim::{LatencyModel, Npu, SimDevice};
use soma::{
    Device, DeviceBuffer, DeviceBufferMut, DriverAlloc, KernelArg, MemPool, PoolAlloc, Stream,
};
use soma_core::observe::{History, Record, RecordKind, SvgOptions};

const HIDDEN: usize = 4096;
const LAYERS: usize = 32;
const HEADS: usize = 32;
const HEAD_DIM: usize = HIDDEN / HEADS;
const FFN: usize = 11008;
const VOCAB: usize = 32000;
const PROMPT: usize = 96;
const KV_BLOCK: usize = 16;
const WEIGHT_BYTES_PER_ELEM: usize = 2; // fp16
/// The weights' pool: room for the 13.5 GB of weights.
const WEIGHTS_POOL_MAX: u64 = 16 << 30;
/// The activations' and KV caches' pool.
const ACTIVATIONS_POOL_MAX: u64 = 8 << 30;
/// Events the activation pool's history keeps: enough for the whole run.
const HISTORY_EVENTS: usize = 1 << 17;

type Result<T> = std::result::Result<T, Box<dyn std::error::Error>>;

/// How a run allocates its tensors; the decode code is written once against it.
trait TensorAlloc<'s> {
    type Buf<T: bytemuck::Pod + Send + Sync>: DeviceBufferMut<Elem = T> + 's;
    fn raw_alloc<T: bytemuck::Pod + Send + Sync>(&self, len: usize) -> soma::Result<Self::Buf<T>>;
    fn clock(&self) -> &Cell<Duration>;
    fn live(&self) -> &Cell<(u64, u64)>;

    /// Allocates, timing the call and tracking live bytes.
    fn alloc<T: bytemuck::Pod + Send + Sync>(&self, len: usize) -> soma::Result<Self::Buf<T>> {
        let t = Instant::now();
        let b = self.raw_alloc::<T>(len)?;
        self.clock().set(self.clock().get() + t.elapsed());
        let (live, high) = self.live().get();
        let live = live + b.byte_len();
        self.live().set((live, high.max(live)));
        self.after_alloc();
        self.log(RecordKind::Alloc, b.device_ptr().addr(), b.byte_len());
        Ok(b)
    }

    /// Called after every allocation and free (outside the timed part) with the buffer's
    /// address and size: the driver path logs them to draw its memory timeline (a pool keeps
    /// its own history).
    fn log(&self, _kind: RecordKind, _addr: u64, _bytes: u64) {}

    /// Called after every allocation (the driver path samples the device's memory there).
    fn after_alloc(&self) {}

    /// Frees, timing the call.
    fn free<T: bytemuck::Pod + Send + Sync>(&self, b: Self::Buf<T>) {
        let bytes = b.byte_len();
        let addr = b.device_ptr().addr();
        let t = Instant::now();
        drop(b);
        self.clock().set(self.clock().get() + t.elapsed());
        let (live, high) = self.live().get();
        self.live().set((live - bytes, high));
        self.log(RecordKind::Free, addr, bytes);
    }
}

struct DriverPath<'d> {
    dev: &'d Device,
    sim: &'d SimDevice,
    /// Device memory held by `malloc` outside this path (the weights).
    baseline: Cell<u64>,
    reserved_high: Cell<u64>,
    clock: Cell<Duration>,
    live: Cell<(u64, u64)>,
    /// The allocation log, in the pool's history format, for the memory timeline.
    history: RefCell<History>,
    stream_id: u64,
    start: Instant,
}

impl<'d> TensorAlloc<'d> for DriverPath<'d> {
    type Buf<T: bytemuck::Pod + Send + Sync> = DriverAlloc<'d, T>;
    fn raw_alloc<T: bytemuck::Pod + Send + Sync>(
        &self,
        len: usize,
    ) -> soma::Result<DriverAlloc<'d, T>> {
        DriverAlloc::new(self.dev, len)
    }
    fn clock(&self) -> &Cell<Duration> {
        &self.clock
    }
    fn live(&self) -> &Cell<(u64, u64)> {
        &self.live
    }
    fn after_alloc(&self) {
        // Every driver allocation holds whole 2 MiB granules: this is the real footprint.
        let held = self.sim.stats().malloc_bytes.saturating_sub(self.baseline.get());
        self.reserved_high.set(self.reserved_high.get().max(held));
    }
    fn log(&self, kind: RecordKind, addr: u64, bytes: u64) {
        // Reserved = what the driver holds for this path: whole granules per allocation.
        let reserved = self.sim.stats().malloc_bytes.saturating_sub(self.baseline.get());
        self.history.borrow_mut().push(Record {
            t_ns: self.start.elapsed().as_nanos() as u64,
            stream: self.stream_id,
            offset: addr,
            size: bytes,
            requested: if kind == RecordKind::Alloc { bytes } else { 0 },
            used: self.live.get().0,
            reserved,
            ..Record::new(kind)
        });
    }
}

struct PoolPath<'s> {
    pool: &'s MemPool<'s>,
    stream: &'s Stream<'s>,
    clock: Cell<Duration>,
    live: Cell<(u64, u64)>,
}

impl<'s> TensorAlloc<'s> for PoolPath<'s> {
    type Buf<T: bytemuck::Pod + Send + Sync> = PoolAlloc<'s, T>;
    fn raw_alloc<T: bytemuck::Pod + Send + Sync>(
        &self,
        len: usize,
    ) -> soma::Result<PoolAlloc<'s, T>> {
        self.pool.alloc_async(len, self.stream)
    }
    fn clock(&self) -> &Cell<Duration> {
        &self.clock
    }
    fn live(&self) -> &Cell<(u64, u64)> {
        &self.live
    }
}

/// A layer's KV cache: capacity grows by `KV_BLOCK` tokens, by reallocation and copy.
struct KvCache<B> {
    k: B,
    v: B,
    capacity: usize,
}

fn kernel_err(msg: &str) -> soma::hal::KernelError {
    soma::hal::KernelError::new(msg)
}

/// One decode step through all layers; returns the next token.
fn decode_step<'s, A: TensorAlloc<'s>>(
    a: &A,
    s: &Stream<'_>,
    token: u32,
    pos: usize,
    caches: &mut Vec<KvCache<A::Buf<f32>>>,
) -> Result<u32> {
    let mut x = a.alloc::<f32>(HIDDEN)?;
    s.launch("embed", &[KernelArg::write(&mut x)], move |b| {
        for (i, v) in b.write::<f32>(0)?.iter_mut().enumerate() {
            *v = ((token as usize * 31 + i * 7) % 97) as f32 / 97.0 - 0.5;
        }
        Ok(())
    })?;
    let seq = pos + 1;
    for (layer, cache) in caches.iter_mut().enumerate() {
        // Grow the cache by reallocation, as a `torch.cat`-style cache does.
        if seq > cache.capacity {
            let capacity = cache.capacity + KV_BLOCK;
            let mut k = a.alloc::<f32>(capacity * HIDDEN)?;
            let mut v = a.alloc::<f32>(capacity * HIDDEN)?;
            s.copy(&mut k, &cache.k)?;
            s.copy(&mut v, &cache.v)?;
            let old = std::mem::replace(cache, KvCache { k, v, capacity });
            a.free(old.k);
            a.free(old.v);
        }
        let mut h = a.alloc::<f32>(HIDDEN)?;
        rms_norm(s, &x, &mut h)?;
        let mut q = a.alloc::<f32>(HIDDEN)?;
        let mut k = a.alloc::<f32>(HIDDEN)?;
        let mut v = a.alloc::<f32>(HIDDEN)?;
        let salt = layer as f32 * 0.01;
        s.launch(
            "qkv_proj",
            &[
                KernelArg::read(&h),
                KernelArg::write(&mut q),
                KernelArg::write(&mut k),
                KernelArg::write(&mut v),
            ],
            move |b| {
                let h = b.read::<f32>(0)?;
                let (q, k, v) = (b.write::<f32>(1)?, b.write::<f32>(2)?, b.write::<f32>(3)?);
                for i in 0..HIDDEN {
                    q[i] = h[i] * (0.9 + salt);
                    k[i] = h[(i + 1) % HIDDEN] * (1.1 - salt);
                    v[i] = h[(i + 7) % HIDDEN] + salt;
                }
                Ok(())
            },
        )?;
        let row = pos;
        s.launch(
            "kv_append",
            &[
                KernelArg::read(&k),
                KernelArg::read(&v),
                KernelArg::write(&mut cache.k),
                KernelArg::write(&mut cache.v),
            ],
            move |b| {
                let (k, v) = (b.read::<f32>(0)?, b.read::<f32>(1)?);
                let ck = b.write::<f32>(2)?;
                ck.get_mut(row * HIDDEN..(row + 1) * HIDDEN)
                    .ok_or_else(|| kernel_err("kv row"))?
                    .copy_from_slice(k);
                let cv = b.write::<f32>(3)?;
                cv.get_mut(row * HIDDEN..(row + 1) * HIDDEN)
                    .ok_or_else(|| kernel_err("kv row"))?
                    .copy_from_slice(v);
                Ok(())
            },
        )?;
        a.free(k);
        a.free(v);
        let mut scores = a.alloc::<f32>(HEADS * seq)?;
        s.launch(
            "scores",
            &[KernelArg::read(&q), KernelArg::read(&cache.k), KernelArg::write(&mut scores)],
            move |b| {
                let (q, ck, sc) = (b.read::<f32>(0)?, b.read::<f32>(1)?, b.write::<f32>(2)?);
                let scale = 1.0 / (HEAD_DIM as f32).sqrt();
                for hd in 0..HEADS {
                    let qh = &q[hd * HEAD_DIM..(hd + 1) * HEAD_DIM];
                    for t in 0..seq {
                        let kh = &ck[t * HIDDEN + hd * HEAD_DIM..t * HIDDEN + (hd + 1) * HEAD_DIM];
                        sc[hd * seq + t] =
                            qh.iter().zip(kh).map(|(a, b)| a * b).sum::<f32>() * scale;
                    }
                }
                Ok(())
            },
        )?;
        a.free(q);
        let mut probs = a.alloc::<f32>(HEADS * seq)?;
        s.launch("softmax", &[KernelArg::read(&scores), KernelArg::write(&mut probs)], move |b| {
            let (sc, p) = (b.read::<f32>(0)?, b.write::<f32>(1)?);
            for hd in 0..HEADS {
                let row = &sc[hd * seq..(hd + 1) * seq];
                let max = row.iter().copied().fold(f32::MIN, f32::max);
                let sum: f32 = row.iter().map(|v| (v - max).exp()).sum();
                for t in 0..seq {
                    p[hd * seq + t] = (row[t] - max).exp() / sum;
                }
            }
            Ok(())
        })?;
        a.free(scores);
        let mut attn = a.alloc::<f32>(HIDDEN)?;
        s.launch(
            "attn_v",
            &[KernelArg::read(&probs), KernelArg::read(&cache.v), KernelArg::write(&mut attn)],
            move |b| {
                let (p, cv, out) = (b.read::<f32>(0)?, b.read::<f32>(1)?, b.write::<f32>(2)?);
                out.fill(0.0);
                for hd in 0..HEADS {
                    for t in 0..seq {
                        let w = p[hd * seq + t];
                        let vh = &cv[t * HIDDEN + hd * HEAD_DIM..t * HIDDEN + (hd + 1) * HEAD_DIM];
                        for (o, v) in out[hd * HEAD_DIM..(hd + 1) * HEAD_DIM].iter_mut().zip(vh) {
                            *o += w * v;
                        }
                    }
                }
                Ok(())
            },
        )?;
        a.free(probs);
        let mut o = a.alloc::<f32>(HIDDEN)?;
        elementwise(s, "o_proj", &attn, &mut o, |v| v * 0.5)?;
        a.free(attn);
        let mut x1 = a.alloc::<f32>(HIDDEN)?;
        add(s, &x, &o, &mut x1)?;
        a.free(o);
        a.free(std::mem::replace(&mut x, x1));
        let mut h2 = a.alloc::<f32>(HIDDEN)?;
        rms_norm(s, &x, &mut h2)?;
        let mut gate = a.alloc::<f32>(FFN)?;
        let mut up = a.alloc::<f32>(FFN)?;
        s.launch(
            "gate_up",
            &[KernelArg::read(&h2), KernelArg::write(&mut gate), KernelArg::write(&mut up)],
            |b| {
                let h = b.read::<f32>(0)?;
                let (g, u) = (b.write::<f32>(1)?, b.write::<f32>(2)?);
                for i in 0..FFN {
                    g[i] = h[i % HIDDEN] * 1.5;
                    u[i] = h[(i * 3) % HIDDEN] * 0.7;
                }
                Ok(())
            },
        )?;
        a.free(h2);
        let mut act = a.alloc::<f32>(FFN)?;
        s.launch(
            "silu_mul",
            &[KernelArg::read(&gate), KernelArg::read(&up), KernelArg::write(&mut act)],
            |b| {
                let (g, u, out) = (b.read::<f32>(0)?, b.read::<f32>(1)?, b.write::<f32>(2)?);
                for i in 0..FFN {
                    out[i] = g[i] / (1.0 + (-g[i]).exp()) * u[i];
                }
                Ok(())
            },
        )?;
        a.free(gate);
        a.free(up);
        let mut down = a.alloc::<f32>(HIDDEN)?;
        s.launch("down", &[KernelArg::read(&act), KernelArg::write(&mut down)], |b| {
            let (act, d) = (b.read::<f32>(0)?, b.write::<f32>(1)?);
            d.fill(0.0);
            for (i, v) in act.iter().enumerate() {
                d[i % HIDDEN] += v * 0.1;
            }
            Ok(())
        })?;
        a.free(act);
        let mut x2 = a.alloc::<f32>(HIDDEN)?;
        add(s, &x, &down, &mut x2)?;
        a.free(down);
        a.free(h);
        a.free(std::mem::replace(&mut x, x2));
    }
    let mut hn = a.alloc::<f32>(HIDDEN)?;
    rms_norm(s, &x, &mut hn)?;
    a.free(x);
    let mut logits = a.alloc::<f32>(VOCAB)?;
    s.launch("lm_head", &[KernelArg::read(&hn), KernelArg::write(&mut logits)], |b| {
        let (h, l) = (b.read::<f32>(0)?, b.write::<f32>(1)?);
        for (i, v) in l.iter_mut().enumerate() {
            *v = h[i % HIDDEN] * ((i % 13) as f32 - 6.0) + h[(i * 5) % HIDDEN];
        }
        Ok(())
    })?;
    a.free(hn);
    let mut next = a.alloc::<u32>(1)?;
    s.launch("argmax", &[KernelArg::read(&logits), KernelArg::write(&mut next)], |b| {
        let l = b.read::<f32>(0)?;
        let best = l
            .iter()
            .enumerate()
            .fold((0, f32::MIN), |acc, (i, &v)| if v > acc.1 { (i, v) } else { acc });
        b.write::<u32>(1)?[0] = best.0 as u32;
        Ok(())
    })?;
    a.free(logits);
    let mut out = [0u32; 1];
    s.copy_to_host(&next, &mut out)?; // the host needs the token: one sync per step
    a.free(next);
    Ok(out[0])
}

fn rms_norm<B1: DeviceBufferMut<Elem = f32>, B2: DeviceBufferMut<Elem = f32>>(
    s: &Stream<'_>,
    x: &B1,
    out: &mut B2,
) -> Result<()> {
    s.launch("rms_norm", &[KernelArg::read(x), KernelArg::write(out)], |b| {
        let (x, o) = (b.read::<f32>(0)?, b.write::<f32>(1)?);
        let rms = (x.iter().map(|v| v * v).sum::<f32>() / x.len() as f32 + 1e-6).sqrt();
        for (o, x) in o.iter_mut().zip(x) {
            *o = x / rms;
        }
        Ok(())
    })?;
    Ok(())
}

fn elementwise<B1, B2>(
    s: &Stream<'_>,
    name: &'static str,
    x: &B1,
    out: &mut B2,
    f: fn(f32) -> f32,
) -> Result<()>
where
    B1: DeviceBufferMut<Elem = f32>,
    B2: DeviceBufferMut<Elem = f32>,
{
    s.launch(name, &[KernelArg::read(x), KernelArg::write(out)], move |b| {
        let (x, o) = (b.read::<f32>(0)?, b.write::<f32>(1)?);
        for (o, x) in o.iter_mut().zip(x) {
            *o = f(*x);
        }
        Ok(())
    })?;
    Ok(())
}

fn add<B1, B2, B3>(s: &Stream<'_>, x: &B1, y: &B2, out: &mut B3) -> Result<()>
where
    B1: DeviceBufferMut<Elem = f32>,
    B2: DeviceBufferMut<Elem = f32>,
    B3: DeviceBufferMut<Elem = f32>,
{
    s.launch("add", &[KernelArg::read(x), KernelArg::read(y), KernelArg::write(out)], |b| {
        let (x, y, o) = (b.read::<f32>(0)?, b.read::<f32>(1)?, b.write::<f32>(2)?);
        for i in 0..o.len() {
            o[i] = x[i] + y[i];
        }
        Ok(())
    })?;
    Ok(())
}

/// Element counts of the LLaMA-7B weights, one entry per tensor.
fn weight_shapes() -> Vec<usize> {
    let mut shapes = vec![VOCAB * HIDDEN]; // embedding
    for _ in 0..LAYERS {
        shapes.extend([HIDDEN * HIDDEN; 4]); // q, k, v, o
        shapes.extend([HIDDEN * FFN; 3]); // gate, up, down
        shapes.extend([HIDDEN; 2]); // norms
    }
    shapes.extend([HIDDEN, VOCAB * HIDDEN]); // final norm, lm head
    shapes
}

/// Figures of one run.
struct RunReport {
    name: &'static str,
    steps: usize,
    tokens: Vec<u32>,
    alloc_overhead: Duration,
    driver_calls: u64,
    reserved_high: u64,
    used_high: u64,
    wall: Duration,
    weights_load: Duration,
    /// The run's allocations and frees (activations and KV caches), for its picture.
    history: History,
}

fn driver_calls(sim: &SimDevice) -> u64 {
    let c = sim.stats().calls;
    c.malloc + c.free + c.alloc_physical + c.free_physical + c.map + c.unmap
}

/// Runs `steps` decode steps after the prompt, printing progress under the run's `label`.
fn decode<'s, A: TensorAlloc<'s>>(
    a: &A,
    s: &Stream<'_>,
    label: &str,
    steps: usize,
    caches: &mut Vec<KvCache<A::Buf<f32>>>,
) -> Result<Vec<u32>> {
    let every = steps.div_ceil(8).max(1);
    let mut token = 1u32;
    let mut tokens = Vec::with_capacity(steps);
    for step in 0..steps {
        let t = Instant::now();
        token = decode_step(a, s, token, PROMPT + step, caches)?;
        tokens.push(token);
        if step == 0 || (step + 1) % every == 0 || step + 1 == steps {
            let ms = t.elapsed().as_secs_f64() * 1e3;
            println!("{label}: step {}/{steps}: token {token}, {ms:.1} ms", step + 1);
        }
    }
    Ok(tokens)
}

fn run_driver(npu: &Npu, steps: usize) -> Result<RunReport> {
    const LABEL: &str = "driver path";
    let dev = npu.device(0)?;
    let sim = npu.sim_device(0)?;
    let s = dev.create_stream()?;
    println!("{LABEL}: loading the weights, one driver allocation per tensor");
    let t = Instant::now();
    // Weights: u16 stands in for fp16; allocated once, never written.
    let weights: Vec<DriverAlloc<'_, u16>> = weight_shapes()
        .into_iter()
        .map(|n| DriverAlloc::new(&dev, n))
        .collect::<soma::Result<_>>()?;
    let weights_load = t.elapsed();
    let path = DriverPath {
        dev: &dev,
        sim: &sim,
        baseline: Cell::new(sim.stats().malloc_bytes),
        reserved_high: Cell::new(0),
        clock: Cell::new(Duration::ZERO),
        live: Cell::new((0, 0)),
        history: RefCell::new(History::new(1 << 16)),
        stream_id: s.id(),
        start: Instant::now(),
    };
    println!(
        "{LABEL}: weights loaded in {} ms; allocating the prompt's KV caches",
        weights_load.as_millis()
    );
    let mut caches = prompt_caches(&path, &s)?;
    path.clock.set(Duration::ZERO);
    let calls0 = driver_calls(&sim);
    let t = Instant::now();
    let tokens = decode(&path, &s, LABEL, steps, &mut caches)?;
    let wall = t.elapsed();
    let report = RunReport {
        name: "driver malloc/free",
        steps,
        tokens,
        alloc_overhead: path.clock.get(),
        driver_calls: driver_calls(&sim) - calls0,
        reserved_high: path.reserved_high.get(),
        used_high: path.live.get().1,
        wall,
        weights_load,
        history: path.history.borrow().clone(),
    };
    drop(caches);
    drop(weights);
    Ok(report)
}

fn prompt_caches<'s, A: TensorAlloc<'s>>(
    a: &A,
    s: &Stream<'_>,
) -> Result<Vec<KvCache<A::Buf<f32>>>> {
    let capacity = PROMPT.div_ceil(KV_BLOCK) * KV_BLOCK;
    let mut caches = Vec::with_capacity(LAYERS);
    for layer in 0..LAYERS {
        let mut k = a.alloc::<f32>(capacity * HIDDEN)?;
        let mut v = a.alloc::<f32>(capacity * HIDDEN)?;
        let fill = (layer % 7) as u8;
        s.memset(&mut k, fill)?;
        s.memset(&mut v, fill)?;
        caches.push(KvCache { k, v, capacity });
    }
    Ok(caches)
}

fn run_pool(npu: &Npu, steps: usize) -> Result<RunReport> {
    const LABEL: &str = "soma pools";
    let dev = npu.device(0)?;
    let sim = npu.sim_device(0)?;
    let s = dev.create_stream()?;
    // Weights live as long as the model: one map call per tensor is enough.
    let weights_pool =
        MemPool::builder().max_size(WEIGHTS_POOL_MAX).segments_per_growth(1).build(&dev)?;
    // The history draws the timeline.
    let acts_pool =
        MemPool::builder().max_size(ACTIVATIONS_POOL_MAX).history(HISTORY_EVENTS).build(&dev)?;
    println!("{LABEL}: loading the weights into the weights' pool");
    let t = Instant::now();
    let weights: Vec<PoolAlloc<'_, u16>> = weight_shapes()
        .into_iter()
        .map(|n| weights_pool.alloc_async(n, &s))
        .collect::<soma::Result<_>>()?;
    let weights_load = t.elapsed();
    let path = PoolPath {
        pool: &acts_pool,
        stream: &s,
        clock: Cell::new(Duration::ZERO),
        live: Cell::new((0, 0)),
    };
    println!(
        "{LABEL}: weights loaded in {} ms; allocating the prompt's KV caches",
        weights_load.as_millis()
    );
    let mut caches = prompt_caches(&path, &s)?;
    path.clock.set(Duration::ZERO);
    let calls0 = driver_calls(&sim);
    let t = Instant::now();
    let tokens = decode(&path, &s, LABEL, steps, &mut caches)?;
    let wall = t.elapsed();
    let stats = acts_pool.stats();
    println!("\nactivation pool after the pool run:\n{stats}\n");
    let report = RunReport {
        name: "soma pool",
        steps,
        tokens,
        alloc_overhead: path.clock.get(),
        driver_calls: driver_calls(&sim) - calls0,
        reserved_high: stats.reserved_high,
        used_high: stats.used_high,
        wall,
        weights_load,
        history: acts_pool.history_log().unwrap_or_else(|| History::new(1)),
    };
    drop(caches);
    drop(weights);
    Ok(report)
}

/// Draws a run's memory timeline into `dir/<file>`.
fn write_timeline(dir: &Path, file: &str, r: &RunReport) -> Result<PathBuf> {
    let title = format!(
        "LLaMA-7B decode, {}: activations and KV caches over {} steps after the prompt",
        r.name, r.steps
    );
    let path = dir.join(file);
    std::fs::create_dir_all(dir)?;
    std::fs::write(&path, r.history.to_svg(&SvgOptions::titled(title)))?;
    Ok(path)
}

fn mib(b: u64) -> String {
    format!("{:.1} MiB", b as f64 / (1u64 << 20) as f64)
}

fn gib(b: u64) -> String {
    format!("{} GiB", b >> 30)
}

const USAGE: &str = "usage: llama_decode [--quick] [--out DIR]
  --quick    2 decode steps through the driver and 8 through the pools (default 6 and 64)
  --out DIR  where the memory timelines go (default: llama_decode/ in the target directory)";

/// The command line: decode steps of each run and the output directory.
struct Options {
    driver_steps: usize,
    pool_steps: usize,
    out: PathBuf,
}

impl Options {
    fn parse() -> Result<Options> {
        let mut o = Options { driver_steps: 6, pool_steps: 64, out: default_out_dir() };
        let mut args = std::env::args().skip(1);
        while let Some(a) = args.next() {
            match a.as_str() {
                "--quick" => (o.driver_steps, o.pool_steps) = (2, 8),
                "--out" => o.out = args.next().ok_or(USAGE)?.into(),
                "--help" | "-h" => {
                    println!("{USAGE}");
                    std::process::exit(0);
                }
                _ => return Err(format!("unknown argument {a:?}\n{USAGE}").into()),
            }
        }
        Ok(o)
    }
}

/// `llama_decode/` in the target directory: `$CARGO_TARGET_DIR` (relative to the workspace
/// when relative), else the workspace's `target/`.
fn default_out_dir() -> PathBuf {
    let workspace = Path::new(env!("CARGO_MANIFEST_DIR"));
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map_or_else(|| workspace.join("target"), |dir| workspace.join(dir));
    target.join("llama_decode")
}

/// The latency model in words.
fn describe_latency(m: &LatencyModel) -> String {
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    format!(
        "{} ms per driver allocation, {} ms per map or unmap, {} µs per task launch, copies at {} GB/s",
        ms(m.driver_alloc),
        ms(m.map),
        m.launch.as_micros(),
        m.copy_bandwidth / 1_000_000_000
    )
}

/// What the demo runs, in words.
fn print_configuration(o: &Options, latency: &LatencyModel) {
    let shapes = weight_shapes();
    let weight_bytes = shapes.iter().sum::<usize>() * WEIGHT_BYTES_PER_ELEM;
    println!("LLaMA-7B decode on the software NPU, batch 1");
    println!(
        "  model:    {LAYERS} layers, hidden size {HIDDEN}, {HEADS} attention heads of \
         {HEAD_DIM}, feed-forward {FFN}, vocabulary {VOCAB}"
    );
    println!(
        "  weights:  {:.1} GB of fp16 in {} tensors, allocated once, never written",
        weight_bytes as f64 / 1e9,
        shapes.len()
    );
    println!("  prompt:   {PROMPT} tokens; each layer's KV cache grows by reallocation every {KV_BLOCK} tokens");
    println!(
        "  runs:     {} decode steps allocating through the driver (malloc, synchronize, free), \
         {} through soma pools",
        o.driver_steps, o.pool_steps
    );
    println!(
        "  pools:    weights in a pool of {} that maps one segment per growth; activations \
         and KV caches in a pool of {} with the default reuse policy, keeping a history of \
         its last {HISTORY_EVENTS} events",
        gib(WEIGHTS_POOL_MAX),
        gib(ACTIVATIONS_POOL_MAX)
    );
    println!("  latency:  Ascend-like: {}", describe_latency(latency));
    println!("  pictures: {}\n", o.out.display());
}

fn main() -> std::process::ExitCode {
    match run() {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("llama_decode: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}

fn run() -> Result<()> {
    let options = Options::parse()?;
    let latency = LatencyModel::ascend_like();
    let npu = Npu::builder().latency(latency).build()?;
    print_configuration(&options, &latency);

    let driver = run_driver(&npu, options.driver_steps)?;
    let pool = run_pool(&npu, options.pool_steps)?;

    println!(
        "{:<20} {:>6} {:>14} {:>13} {:>12} {:>12} {:>8} {:>12} {:>12}",
        "run",
        "steps",
        "alloc ms/step",
        "driver calls",
        "reserved hi",
        "used hi",
        "frag",
        "wall ms/step",
        "weights load"
    );
    for r in [&driver, &pool] {
        let per = |d: Duration| d.as_secs_f64() * 1e3 / r.steps as f64;
        println!(
            "{:<20} {:>6} {:>14.3} {:>13.1} {:>12} {:>12} {:>8.3} {:>12.2} {:>10.0}ms",
            r.name,
            r.steps,
            per(r.alloc_overhead),
            r.driver_calls as f64 / r.steps as f64,
            mib(r.reserved_high),
            mib(r.used_high),
            r.reserved_high as f64 / r.used_high.max(1) as f64,
            per(r.wall),
            r.weights_load.as_secs_f64() * 1e3,
        );
    }
    let common = driver.tokens.len().min(pool.tokens.len());
    if driver.tokens[..common] != pool.tokens[..common] {
        return Err(format!("token mismatch: {:?} vs {:?}", driver.tokens, pool.tokens).into());
    }
    println!(
        "\ntokens of both runs agree over the first {common} steps: {:?}",
        &pool.tokens[..common]
    );
    let driver_svg = write_timeline(&options.out, "llama_decode_driver.svg", &driver)?;
    let pool_svg = write_timeline(&options.out, "llama_decode_pool.svg", &pool)?;
    println!(
        "allocation overhead per step: {:.2} ms (driver) -> {:.3} ms (pool), {:.0}x less",
        driver.alloc_overhead.as_secs_f64() * 1e3 / driver.steps as f64,
        pool.alloc_overhead.as_secs_f64() * 1e3 / pool.steps as f64,
        (driver.alloc_overhead.as_secs_f64() / driver.steps as f64)
            / (pool.alloc_overhead.as_secs_f64() / pool.steps as f64).max(1e-12)
    );
    println!("memory timelines: {} and {}", driver_svg.display(), pool_svg.display());
    Ok(())
}
