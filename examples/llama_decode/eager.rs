//! The two eager runs: every tensor of a decode step allocated and freed as the step goes,
//! through the plain driver or through soma pools; the decode code is written once against
//! [`TensorAlloc`].

use std::cell::{Cell, RefCell};
use std::time::{Duration, Instant};

use soma::sim::{Npu, SimDevice};
use soma::{
    Device, DeviceBuffer, DeviceBufferMut, DriverAlloc, KernelArg, MemPool, PoolAlloc, Stream,
};
use soma_core::observe::{History, Record, RecordKind};

use super::report::{driver_calls, RunReport};
use super::{
    kernels, weight_shapes, Result, ACTIVATIONS_POOL_MAX, FFN, HEADS, HIDDEN, HISTORY_EVENTS,
    KV_BLOCK, LAYERS, PROMPT, VOCAB, WEIGHTS_POOL_MAX,
};

/// How a run allocates its tensors; the decode code is written once against it.
pub(super) trait TensorAlloc<'s> {
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

/// Allocations through the driver's `malloc` / synchronise / `free`.
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

/// Allocations through a soma pool, on one stream.
pub(super) struct PoolPath<'s> {
    pub(super) pool: &'s MemPool<'s>,
    pub(super) stream: &'s Stream<'s>,
    pub(super) clock: Cell<Duration>,
    pub(super) live: Cell<(u64, u64)>,
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
pub(super) struct KvCache<B> {
    /// Keys, `capacity` rows of the hidden size.
    pub(super) k: B,
    /// Values, likewise.
    pub(super) v: B,
    /// Tokens the cache holds.
    pub(super) capacity: usize,
}

/// One decode step through all layers; returns the next token.
fn decode_step<'s, A: TensorAlloc<'s>>(
    a: &A,
    s: &Stream<'_>,
    token: u32,
    pos: usize,
    caches: &mut [KvCache<A::Buf<f32>>],
) -> Result<u32> {
    let mut x = a.alloc::<f32>(HIDDEN)?;
    s.launch("embed", &[KernelArg::write(&mut x)], move |b| {
        kernels::embed(token, b.write::<f32>(0)?);
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
        let args = [
            KernelArg::read(&h),
            KernelArg::write(&mut q),
            KernelArg::write(&mut k),
            KernelArg::write(&mut v),
        ];
        s.launch("qkv_proj", &args, move |b| {
            let h = b.read::<f32>(0)?;
            kernels::qkv(h, b.write(1)?, b.write(2)?, b.write(3)?, salt);
            Ok(())
        })?;
        let args = [
            KernelArg::read(&k),
            KernelArg::read(&v),
            KernelArg::write(&mut cache.k),
            KernelArg::write(&mut cache.v),
        ];
        s.launch("kv_append", &args, move |b| {
            kernels::kv_append(b.read(0)?, b.read(1)?, b.write(2)?, b.write(3)?, pos)
        })?;
        a.free(k);
        a.free(v);
        let mut scores = a.alloc::<f32>(HEADS * seq)?;
        let args = [KernelArg::read(&q), KernelArg::read(&cache.k), KernelArg::write(&mut scores)];
        s.launch("scores", &args, move |b| {
            kernels::scores(b.read(0)?, b.read(1)?, b.write(2)?, seq);
            Ok(())
        })?;
        a.free(q);
        let mut probs = a.alloc::<f32>(HEADS * seq)?;
        s.launch("softmax", &[KernelArg::read(&scores), KernelArg::write(&mut probs)], move |b| {
            kernels::softmax(b.read(0)?, b.write(1)?, seq);
            Ok(())
        })?;
        a.free(scores);
        let mut attn = a.alloc::<f32>(HIDDEN)?;
        let args =
            [KernelArg::read(&probs), KernelArg::read(&cache.v), KernelArg::write(&mut attn)];
        s.launch("attn_v", &args, move |b| {
            kernels::attn_v(b.read(0)?, b.read(1)?, b.write(2)?, seq);
            Ok(())
        })?;
        a.free(probs);
        let mut o = a.alloc::<f32>(HIDDEN)?;
        s.launch("o_proj", &[KernelArg::read(&attn), KernelArg::write(&mut o)], |b| {
            kernels::o_proj(b.read(0)?, b.write(1)?);
            Ok(())
        })?;
        a.free(attn);
        let mut x1 = a.alloc::<f32>(HIDDEN)?;
        add(s, &x, &o, &mut x1)?;
        a.free(o);
        a.free(std::mem::replace(&mut x, x1));
        let mut h2 = a.alloc::<f32>(HIDDEN)?;
        rms_norm(s, &x, &mut h2)?;
        let mut gate = a.alloc::<f32>(FFN)?;
        let mut up = a.alloc::<f32>(FFN)?;
        let args = [KernelArg::read(&h2), KernelArg::write(&mut gate), KernelArg::write(&mut up)];
        s.launch("gate_up", &args, |b| {
            kernels::gate_up(b.read(0)?, b.write(1)?, b.write(2)?);
            Ok(())
        })?;
        a.free(h2);
        let mut act = a.alloc::<f32>(FFN)?;
        let args = [KernelArg::read(&gate), KernelArg::read(&up), KernelArg::write(&mut act)];
        s.launch("silu_mul", &args, |b| {
            kernels::silu_mul(b.read(0)?, b.read(1)?, b.write(2)?);
            Ok(())
        })?;
        a.free(gate);
        a.free(up);
        let mut down = a.alloc::<f32>(HIDDEN)?;
        s.launch("down", &[KernelArg::read(&act), KernelArg::write(&mut down)], |b| {
            kernels::down(b.read(0)?, b.write(1)?);
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
        kernels::lm_head(b.read(0)?, b.write(1)?);
        Ok(())
    })?;
    a.free(hn);
    let mut next = a.alloc::<u32>(1)?;
    s.launch("argmax", &[KernelArg::read(&logits), KernelArg::write(&mut next)], |b| {
        b.write::<u32>(1)?[0] = kernels::argmax(b.read(0)?);
        Ok(())
    })?;
    a.free(logits);
    let mut out = [0u32; 1];
    s.copy_to_host(&next, &mut out)?; // the host needs the token: one sync per step
    a.free(next);
    Ok(out[0])
}

fn rms_norm<B1: DeviceBuffer<Elem = f32>, B2: DeviceBufferMut<Elem = f32>>(
    s: &Stream<'_>,
    x: &B1,
    out: &mut B2,
) -> Result<()> {
    s.launch("rms_norm", &[KernelArg::read(x), KernelArg::write(out)], |b| {
        kernels::rms_norm(b.read(0)?, b.write(1)?);
        Ok(())
    })?;
    Ok(())
}

fn add<B1, B2, B3>(s: &Stream<'_>, x: &B1, y: &B2, out: &mut B3) -> Result<()>
where
    B1: DeviceBuffer<Elem = f32>,
    B2: DeviceBuffer<Elem = f32>,
    B3: DeviceBufferMut<Elem = f32>,
{
    s.launch("add", &[KernelArg::read(x), KernelArg::read(y), KernelArg::write(out)], |b| {
        kernels::add(b.read(0)?, b.read(1)?, b.write(2)?);
        Ok(())
    })?;
    Ok(())
}

/// Runs `steps` decode steps after the prompt, printing progress under the run's `label`.
fn decode<'s, A: TensorAlloc<'s>>(
    a: &A,
    s: &Stream<'_>,
    label: &str,
    steps: usize,
    caches: &mut [KvCache<A::Buf<f32>>],
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

/// The run through the driver.
pub(super) fn run_driver(npu: &Npu, steps: usize) -> Result<RunReport> {
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

/// The KV caches of the prompt, one per layer.
pub(super) fn prompt_caches<'s, A: TensorAlloc<'s>>(
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

/// The run through soma pools.
/// The pools of the two pool runs: weights in a pool of their own (they live as long as the
/// model), activations and KV caches in another, whose history draws the timeline.
pub(super) struct Pools<'d> {
    pub(super) weights: MemPool<'d>,
    pub(super) acts: MemPool<'d>,
}

impl<'d> Pools<'d> {
    pub(super) fn new(dev: &'d Device) -> Result<Self> {
        // Weights live as long as the model: one map call per tensor is enough.
        let weights =
            MemPool::builder().max_size(WEIGHTS_POOL_MAX).segments_per_growth(1).build(dev)?;
        let acts =
            MemPool::builder().max_size(ACTIVATIONS_POOL_MAX).history(HISTORY_EVENTS).build(dev)?;
        Ok(Pools { weights, acts })
    }

    /// Loads the weights onto `s`, saying so under `label`; returns them and the time taken.
    pub(super) fn load_weights<'s>(
        &'s self,
        label: &str,
        s: &'s Stream<'d>,
    ) -> Result<(Vec<PoolAlloc<'s, u16>>, Duration)> {
        println!("{label}: loading the weights into the weights' pool");
        let t = Instant::now();
        let weights: Vec<PoolAlloc<'_, u16>> = weight_shapes()
            .into_iter()
            .map(|n| self.weights.alloc_async(n, s))
            .collect::<soma::Result<_>>()?;
        let took = t.elapsed();
        println!(
            "{label}: weights loaded in {} ms; allocating the prompt's KV caches",
            took.as_millis()
        );
        Ok((weights, took))
    }

    /// The activation path of a run on `s`, its clock and live bytes at zero.
    pub(super) fn path<'s>(&'s self, s: &'s Stream<'d>) -> PoolPath<'s> {
        PoolPath {
            pool: &self.acts,
            stream: s,
            clock: Cell::new(Duration::ZERO),
            live: Cell::new((0, 0)),
        }
    }

    /// The report of a run named `name` over `path`, with the activation pool's figures.
    pub(super) fn report(
        &self,
        name: &'static str,
        path: &PoolPath<'_>,
        run: RunFigures,
    ) -> RunReport {
        let stats = self.acts.stats();
        RunReport {
            name,
            steps: run.tokens.len(),
            tokens: run.tokens,
            alloc_overhead: path.clock.get(),
            driver_calls: run.driver_calls,
            reserved_high: stats.reserved_high,
            used_high: stats.used_high,
            wall: run.wall,
            weights_load: run.weights_load,
            history: self.acts.history_log().unwrap_or_else(|| History::new(1)),
        }
    }
}

/// What a pool run measured itself.
pub(super) struct RunFigures {
    pub(super) tokens: Vec<u32>,
    pub(super) driver_calls: u64,
    pub(super) wall: Duration,
    pub(super) weights_load: Duration,
}

pub(super) fn run_pool(npu: &Npu, steps: usize) -> Result<RunReport> {
    const LABEL: &str = "soma pools";
    let dev = npu.device(0)?;
    let sim = npu.sim_device(0)?;
    let s = dev.create_stream()?;
    let pools = Pools::new(&dev)?;
    let (weights, weights_load) = pools.load_weights(LABEL, &s)?;
    let path = pools.path(&s);
    let mut caches = prompt_caches(&path, &s)?;
    path.clock.set(Duration::ZERO);
    let calls0 = driver_calls(&sim);
    let t = Instant::now();
    let tokens = decode(&path, &s, LABEL, steps, &mut caches)?;
    let wall = t.elapsed();
    println!("\nactivation pool after the pool run:\n{}\n", pools.acts.stats());
    let run = RunFigures { tokens, driver_calls: driver_calls(&sim) - calls0, wall, weights_load };
    let report = pools.report("soma pool", &path, run);
    drop(caches);
    drop(weights);
    Ok(report)
}
