//! The third run: soma pools plus graph capture. The step's buffers are allocated from the
//! pool before the capture and reused by every launch; the step is captured once per
//! KV-cache length bucket (the caches' capacity, a multiple of `KV_BLOCK` tokens) and
//! launched at every step. The kernels read the step's token and position from a small device
//! buffer the host writes before each launch, so one graph serves every step of its bucket.
//! When the sequence outgrows the bucket, the graph is dropped (it uses the caches), the caches
//! grow by reallocation and copy, as in the other runs, and the next bucket's step is captured.

use std::cell::Cell;
use std::time::{Duration, Instant};

use soma::sim::Npu;
use soma::{CaptureMode, Graph, KernelArg, MemPool, PoolAlloc, Stream};
use soma_core::observe::History;

use super::eager::{prompt_caches, KvCache, PoolPath, TensorAlloc};
use super::report::{driver_calls, RunReport};
use super::{
    kernels, weight_shapes, Result, ACTIVATIONS_POOL_MAX, FFN, HEADS, HIDDEN, HISTORY_EVENTS,
    KV_BLOCK, PROMPT, VOCAB, WEIGHTS_POOL_MAX,
};

/// The buffers of one step: allocated before its capture, used by every launch.
struct Workspace<'s> {
    /// `[token, position]`, written by the host before each launch.
    params: PoolAlloc<'s, u32>,
    x: PoolAlloc<'s, f32>,
    mid: PoolAlloc<'s, f32>,
    h: PoolAlloc<'s, f32>,
    q: PoolAlloc<'s, f32>,
    k: PoolAlloc<'s, f32>,
    v: PoolAlloc<'s, f32>,
    /// Sized for the bucket's longest sequence.
    scores: PoolAlloc<'s, f32>,
    probs: PoolAlloc<'s, f32>,
    attn: PoolAlloc<'s, f32>,
    o: PoolAlloc<'s, f32>,
    gate: PoolAlloc<'s, f32>,
    up: PoolAlloc<'s, f32>,
    act: PoolAlloc<'s, f32>,
    down: PoolAlloc<'s, f32>,
    logits: PoolAlloc<'s, f32>,
    next: PoolAlloc<'s, u32>,
}

impl<'s> Workspace<'s> {
    fn new(a: &PoolPath<'s>, capacity: usize) -> Result<Self> {
        Ok(Workspace {
            params: a.alloc(2)?,
            x: a.alloc(HIDDEN)?,
            mid: a.alloc(HIDDEN)?,
            h: a.alloc(HIDDEN)?,
            q: a.alloc(HIDDEN)?,
            k: a.alloc(HIDDEN)?,
            v: a.alloc(HIDDEN)?,
            scores: a.alloc(HEADS * capacity)?,
            probs: a.alloc(HEADS * capacity)?,
            attn: a.alloc(HIDDEN)?,
            o: a.alloc(HIDDEN)?,
            gate: a.alloc(FFN)?,
            up: a.alloc(FFN)?,
            act: a.alloc(FFN)?,
            down: a.alloc(HIDDEN)?,
            logits: a.alloc(VOCAB)?,
            next: a.alloc(1)?,
        })
    }

    /// Gives every buffer back to the pool.
    fn free(self, a: &PoolPath<'s>) {
        a.free(self.params);
        a.free(self.next);
        for b in [self.x, self.mid, self.h, self.q, self.k, self.v, self.scores, self.probs] {
            a.free(b);
        }
        for b in [self.attn, self.o, self.gate, self.up, self.act, self.down, self.logits] {
            a.free(b);
        }
    }
}

/// The position the kernels read: `params[1]`.
fn position(params: &[u32]) -> usize {
    params[1] as usize
}

/// Enqueues one decode step on the capturing stream `s`, over `w` and `caches`.
fn capture_step(
    s: &Stream<'_>,
    w: &mut Workspace<'_>,
    caches: &mut [KvCache<PoolAlloc<'_, f32>>],
) -> Result<()> {
    s.launch_replayable("embed", &[KernelArg::read(&w.params), KernelArg::write(&mut w.x)], |b| {
        kernels::embed(b.read::<u32>(0)?[0], b.write(1)?);
        Ok(())
    })?;
    for (layer, cache) in caches.iter_mut().enumerate() {
        rms_norm(s, &w.x, &mut w.h)?;
        let salt = layer as f32 * 0.01;
        let args = [
            KernelArg::read(&w.h),
            KernelArg::write(&mut w.q),
            KernelArg::write(&mut w.k),
            KernelArg::write(&mut w.v),
        ];
        s.launch_replayable("qkv_proj", &args, move |b| {
            kernels::qkv(b.read(0)?, b.write(1)?, b.write(2)?, b.write(3)?, salt);
            Ok(())
        })?;
        let args = [
            KernelArg::read(&w.params),
            KernelArg::read(&w.k),
            KernelArg::read(&w.v),
            KernelArg::write(&mut cache.k),
            KernelArg::write(&mut cache.v),
        ];
        s.launch_replayable("kv_append", &args, |b| {
            let row = position(b.read(0)?);
            kernels::kv_append(b.read(1)?, b.read(2)?, b.write(3)?, b.write(4)?, row)
        })?;
        let args = [
            KernelArg::read(&w.params),
            KernelArg::read(&w.q),
            KernelArg::read(&cache.k),
            KernelArg::write(&mut w.scores),
        ];
        s.launch_replayable("scores", &args, |b| {
            let seq = position(b.read(0)?) + 1;
            kernels::scores(b.read(1)?, b.read(2)?, b.write(3)?, seq);
            Ok(())
        })?;
        let args = [
            KernelArg::read(&w.params),
            KernelArg::read(&w.scores),
            KernelArg::write(&mut w.probs),
        ];
        s.launch_replayable("softmax", &args, |b| {
            kernels::softmax(b.read(1)?, b.write(2)?, position(b.read(0)?) + 1);
            Ok(())
        })?;
        let args = [
            KernelArg::read(&w.params),
            KernelArg::read(&w.probs),
            KernelArg::read(&cache.v),
            KernelArg::write(&mut w.attn),
        ];
        s.launch_replayable("attn_v", &args, |b| {
            let seq = position(b.read(0)?) + 1;
            kernels::attn_v(b.read(1)?, b.read(2)?, b.write(3)?, seq);
            Ok(())
        })?;
        s.launch_replayable(
            "o_proj",
            &[KernelArg::read(&w.attn), KernelArg::write(&mut w.o)],
            |b| {
                kernels::o_proj(b.read(0)?, b.write(1)?);
                Ok(())
            },
        )?;
        add(s, &w.x, &w.o, &mut w.mid)?;
        rms_norm(s, &w.mid, &mut w.h)?;
        let args =
            [KernelArg::read(&w.h), KernelArg::write(&mut w.gate), KernelArg::write(&mut w.up)];
        s.launch_replayable("gate_up", &args, |b| {
            kernels::gate_up(b.read(0)?, b.write(1)?, b.write(2)?);
            Ok(())
        })?;
        let args = [KernelArg::read(&w.gate), KernelArg::read(&w.up), KernelArg::write(&mut w.act)];
        s.launch_replayable("silu_mul", &args, |b| {
            kernels::silu_mul(b.read(0)?, b.read(1)?, b.write(2)?);
            Ok(())
        })?;
        s.launch_replayable(
            "down",
            &[KernelArg::read(&w.act), KernelArg::write(&mut w.down)],
            |b| {
                kernels::down(b.read(0)?, b.write(1)?);
                Ok(())
            },
        )?;
        add(s, &w.mid, &w.down, &mut w.x)?;
    }
    rms_norm(s, &w.x, &mut w.h)?;
    s.launch_replayable(
        "lm_head",
        &[KernelArg::read(&w.h), KernelArg::write(&mut w.logits)],
        |b| {
            kernels::lm_head(b.read(0)?, b.write(1)?);
            Ok(())
        },
    )?;
    let args = [KernelArg::read(&w.logits), KernelArg::write(&mut w.next)];
    s.launch_replayable("argmax", &args, |b| {
        b.write::<u32>(1)?[0] = kernels::argmax(b.read(0)?);
        Ok(())
    })?;
    Ok(())
}

fn rms_norm(s: &Stream<'_>, x: &PoolAlloc<'_, f32>, out: &mut PoolAlloc<'_, f32>) -> Result<()> {
    s.launch_replayable("rms_norm", &[KernelArg::read(x), KernelArg::write(out)], |b| {
        kernels::rms_norm(b.read(0)?, b.write(1)?);
        Ok(())
    })?;
    Ok(())
}

fn add(
    s: &Stream<'_>,
    x: &PoolAlloc<'_, f32>,
    y: &PoolAlloc<'_, f32>,
    out: &mut PoolAlloc<'_, f32>,
) -> Result<()> {
    s.launch_replayable(
        "add",
        &[KernelArg::read(x), KernelArg::read(y), KernelArg::write(out)],
        |b| {
            kernels::add(b.read(0)?, b.read(1)?, b.write(2)?);
            Ok(())
        },
    )?;
    Ok(())
}

/// Grows every cache by one bucket (reallocation and copy, outside any capture).
fn grow<'s>(
    a: &PoolPath<'s>,
    s: &Stream<'_>,
    caches: &mut [KvCache<PoolAlloc<'s, f32>>],
) -> Result<()> {
    for cache in caches {
        let capacity = cache.capacity + KV_BLOCK;
        let mut k = a.alloc::<f32>(capacity * HIDDEN)?;
        let mut v = a.alloc::<f32>(capacity * HIDDEN)?;
        s.copy(&mut k, &cache.k)?;
        s.copy(&mut v, &cache.v)?;
        let old = std::mem::replace(cache, KvCache { k, v, capacity });
        a.free(old.k);
        a.free(old.v);
    }
    Ok(())
}

/// The run through soma pools, with the step captured once per bucket and launched.
pub(super) fn run_graph(npu: &Npu, steps: usize) -> Result<RunReport> {
    const LABEL: &str = "soma pools + graph";
    let dev = npu.device(0)?;
    let sim = npu.sim_device(0)?;
    let s = dev.create_stream()?;
    let weights_pool =
        MemPool::builder().max_size(WEIGHTS_POOL_MAX).segments_per_growth(1).build(&dev)?;
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
    let every = steps.div_ceil(8).max(1);
    let (mut token, mut tokens, mut captures) = (1u32, Vec::with_capacity(steps), 0);
    let mut step_graph: Option<(Workspace<'_>, Graph<'_>)> = None;
    let t = Instant::now();
    for step in 0..steps {
        let ts = Instant::now();
        let pos = PROMPT + step;
        if pos + 1 > caches[0].capacity {
            // The graph uses the caches and the workspace: it goes before them.
            if let Some((w, graph)) = step_graph.take() {
                drop(graph);
                w.free(&path);
            }
            grow(&path, &s, &mut caches)?;
        }
        if step_graph.is_none() {
            let mut w = Workspace::new(&path, caches[0].capacity)?;
            s.begin_capture(CaptureMode::Global)?;
            capture_step(&s, &mut w, &mut caches)?;
            step_graph = Some((w, s.end_capture()?));
            captures += 1;
        }
        let Some((w, graph)) = step_graph.as_mut() else {
            return Err("the step's graph is missing".into());
        };
        s.copy_from_host(&mut w.params, &[token, pos as u32])?;
        graph.launch(&s)?;
        let mut out = [0u32; 1];
        s.copy_to_host(&w.next, &mut out)?;
        token = out[0];
        tokens.push(token);
        if step == 0 || (step + 1) % every == 0 || step + 1 == steps {
            let ms = ts.elapsed().as_secs_f64() * 1e3;
            println!("{LABEL}: step {}/{steps}: token {token}, {ms:.1} ms", step + 1);
        }
    }
    let wall = t.elapsed();
    let tasks = step_graph.as_ref().map_or(0, |(_, g)| g.task_count());
    let launch = sim.latency().launch;
    println!(
        "{LABEL}: {captures} graph(s) captured, one per KV-cache bucket of {KV_BLOCK} tokens; \
         {tasks} tasks per launch, whose launch cost the latency model charges once ({} µs) \
         instead of per task ({:.2} ms a step on the eager path)",
        launch.as_micros(),
        launch.as_secs_f64() * 1e3 * tasks as f64
    );
    if let Some((w, graph)) = step_graph.take() {
        drop(graph);
        w.free(&path);
    }
    let stats = acts_pool.stats();
    let report = RunReport {
        name: "soma pool + graph",
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
