//! The third run: soma pools plus graph capture. The step is captured once per KV-cache
//! length bucket (the caches' capacity, a multiple of `KV_BLOCK` tokens) and launched at
//! every step. Its activations are allocated and freed inside the capture, as the eager runs
//! do at every step: the pool serves them once, at capture time, from memory it keeps for the
//! graph, where each layer's activations reuse the previous layer's (launches allocate
//! nothing). The kernels read the step's token and position from a small device buffer the
//! host writes before each launch (allocated before the capture), and write the next token
//! into a buffer allocated inside the capture (an output of the graph), so one graph serves
//! every step of its bucket. When the sequence outgrows the bucket, the graph is dropped (it
//! uses the caches) and its memory goes back to the pool, the caches grow by reallocation and
//! copy, as in the other runs, and the next bucket's step is captured. At the end, the step is
//! captured for several buckets at once, with a region of graph memory per graph and with one
//! shared graph pool, to compare what the pool keeps for them.

use std::time::{Duration, Instant};

use soma::sim::Npu;
use soma::{CaptureMode, Graph, GraphPool, KernelArg, PoolAlloc, Stream};

use super::eager::{prompt_caches, KvCache, PoolPath, Pools, RunFigures, TensorAlloc};
use super::report::{driver_calls, mib, RunReport};
use super::{kernels, Result, FFN, HEADS, HIDDEN, KV_BLOCK, PROMPT, VOCAB};

/// One step's graph and the buffers it shares with the host.
struct StepGraph<'s> {
    /// `[token, position]`, written by the host before each launch: allocated before the
    /// capture (a copy from the host cannot be captured).
    params: PoolAlloc<'s, u32>,
    /// The step's token: allocated inside the capture and not freed there, an output of the
    /// graph, read by the host after each launch.
    next: PoolAlloc<'s, u32>,
    graph: Graph<'s>,
}

impl<'s> StepGraph<'s> {
    /// Captures a step over `caches` with score buffers for `capacity` tokens: every
    /// activation is allocated inside the capture, from memory the pool keeps for the graph
    /// (or for `shared`), and freed there once used, so that the next layer's activations
    /// reuse it at every launch.
    fn capture(
        a: &PoolPath<'s>,
        caches: &mut [KvCache<PoolAlloc<'s, f32>>],
        capacity: usize,
        shared: Option<&GraphPool>,
    ) -> Result<Self> {
        let s = a.stream;
        let params = a.alloc::<u32>(2)?;
        match shared {
            Some(pool) => s.begin_capture_with_pool(CaptureMode::Global, pool)?,
            None => s.begin_capture(CaptureMode::Global)?,
        }
        let next = record_step(a, &params, caches, capacity);
        // Ended whatever happened, so that the stream goes on outside the capture.
        let graph = s.end_capture();
        Ok(StepGraph { params, next: next?, graph: graph? })
    }

    /// Launches the step for `token` at position `pos`; returns the next token.
    fn launch(&mut self, s: &Stream<'_>, token: u32, pos: usize) -> Result<u32> {
        s.copy_from_host(&mut self.params, &[token, pos as u32])?;
        self.graph.launch(s)?;
        let mut out = [0u32; 1];
        s.copy_to_host(&self.next, &mut out)?;
        Ok(out[0])
    }

    /// Drops the graph (after its launches; its memory goes back to the pool) and frees the
    /// buffers.
    fn free(self, a: &PoolPath<'s>) {
        drop(self.graph);
        a.free(self.next);
        a.free(self.params);
    }
}

/// The position the kernels read: `params[1]`.
fn position(params: &[u32]) -> usize {
    params[1] as usize
}

/// Enqueues one decode step on the capturing stream, allocating and freeing its activations
/// as it goes; returns the output token's buffer.
fn record_step<'s>(
    a: &PoolPath<'s>,
    params: &PoolAlloc<'s, u32>,
    caches: &mut [KvCache<PoolAlloc<'s, f32>>],
    capacity: usize,
) -> Result<PoolAlloc<'s, u32>> {
    let s = a.stream;
    let mut x = a.alloc::<f32>(HIDDEN)?;
    s.launch_replayable("embed", &[KernelArg::read(params), KernelArg::write(&mut x)], |b| {
        kernels::embed(b.read::<u32>(0)?[0], b.write(1)?);
        Ok(())
    })?;
    for (layer, cache) in caches.iter_mut().enumerate() {
        let mut h = a.alloc::<f32>(HIDDEN)?;
        rms_norm(s, &x, &mut h)?;
        let salt = layer as f32 * 0.01;
        let mut q = a.alloc::<f32>(HIDDEN)?;
        let (mut k, mut v) = (a.alloc::<f32>(HIDDEN)?, a.alloc::<f32>(HIDDEN)?);
        let args = [
            KernelArg::read(&h),
            KernelArg::write(&mut q),
            KernelArg::write(&mut k),
            KernelArg::write(&mut v),
        ];
        s.launch_replayable("qkv_proj", &args, move |b| {
            kernels::qkv(b.read(0)?, b.write(1)?, b.write(2)?, b.write(3)?, salt);
            Ok(())
        })?;
        let args = [
            KernelArg::read(params),
            KernelArg::read(&k),
            KernelArg::read(&v),
            KernelArg::write(&mut cache.k),
            KernelArg::write(&mut cache.v),
        ];
        s.launch_replayable("kv_append", &args, |b| {
            let row = position(b.read(0)?);
            kernels::kv_append(b.read(1)?, b.read(2)?, b.write(3)?, b.write(4)?, row)
        })?;
        a.free(k);
        a.free(v);
        let mut scores = a.alloc::<f32>(HEADS * capacity)?;
        let args = [
            KernelArg::read(params),
            KernelArg::read(&q),
            KernelArg::read(&cache.k),
            KernelArg::write(&mut scores),
        ];
        s.launch_replayable("scores", &args, |b| {
            let seq = position(b.read(0)?) + 1;
            kernels::scores(b.read(1)?, b.read(2)?, b.write(3)?, seq);
            Ok(())
        })?;
        a.free(q);
        let mut probs = a.alloc::<f32>(HEADS * capacity)?;
        let args =
            [KernelArg::read(params), KernelArg::read(&scores), KernelArg::write(&mut probs)];
        s.launch_replayable("softmax", &args, |b| {
            kernels::softmax(b.read(1)?, b.write(2)?, position(b.read(0)?) + 1);
            Ok(())
        })?;
        a.free(scores);
        let mut attn = a.alloc::<f32>(HIDDEN)?;
        let args = [
            KernelArg::read(params),
            KernelArg::read(&probs),
            KernelArg::read(&cache.v),
            KernelArg::write(&mut attn),
        ];
        s.launch_replayable("attn_v", &args, |b| {
            let seq = position(b.read(0)?) + 1;
            kernels::attn_v(b.read(1)?, b.read(2)?, b.write(3)?, seq);
            Ok(())
        })?;
        a.free(probs);
        let mut o = a.alloc::<f32>(HIDDEN)?;
        s.launch_replayable("o_proj", &[KernelArg::read(&attn), KernelArg::write(&mut o)], |b| {
            kernels::o_proj(b.read(0)?, b.write(1)?);
            Ok(())
        })?;
        a.free(attn);
        let mut mid = a.alloc::<f32>(HIDDEN)?;
        add(s, &x, &o, &mut mid)?;
        a.free(o);
        rms_norm(s, &mid, &mut h)?;
        let (mut gate, mut up) = (a.alloc::<f32>(FFN)?, a.alloc::<f32>(FFN)?);
        let args = [KernelArg::read(&h), KernelArg::write(&mut gate), KernelArg::write(&mut up)];
        s.launch_replayable("gate_up", &args, |b| {
            kernels::gate_up(b.read(0)?, b.write(1)?, b.write(2)?);
            Ok(())
        })?;
        a.free(h);
        let mut act = a.alloc::<f32>(FFN)?;
        let args = [KernelArg::read(&gate), KernelArg::read(&up), KernelArg::write(&mut act)];
        s.launch_replayable("silu_mul", &args, |b| {
            kernels::silu_mul(b.read(0)?, b.read(1)?, b.write(2)?);
            Ok(())
        })?;
        a.free(gate);
        a.free(up);
        let mut down = a.alloc::<f32>(HIDDEN)?;
        s.launch_replayable("down", &[KernelArg::read(&act), KernelArg::write(&mut down)], |b| {
            kernels::down(b.read(0)?, b.write(1)?);
            Ok(())
        })?;
        a.free(act);
        add(s, &mid, &down, &mut x)?;
        a.free(mid);
        a.free(down);
    }
    let mut h = a.alloc::<f32>(HIDDEN)?;
    rms_norm(s, &x, &mut h)?;
    a.free(x);
    let mut logits = a.alloc::<f32>(VOCAB)?;
    s.launch_replayable("lm_head", &[KernelArg::read(&h), KernelArg::write(&mut logits)], |b| {
        kernels::lm_head(b.read(0)?, b.write(1)?);
        Ok(())
    })?;
    a.free(h);
    let mut next = a.alloc::<u32>(1)?;
    let args = [KernelArg::read(&logits), KernelArg::write(&mut next)];
    s.launch_replayable("argmax", &args, |b| {
        b.write::<u32>(1)?[0] = kernels::argmax(b.read(0)?);
        Ok(())
    })?;
    a.free(logits);
    Ok(next)
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
    let pools = Pools::new(&dev)?;
    let acts_pool = &pools.acts;
    let (weights, weights_load) = pools.load_weights(LABEL, &s)?;
    let path = pools.path(&s);
    let mut caches = prompt_caches(&path, &s)?;
    path.clock.set(Duration::ZERO);
    let calls0 = driver_calls(&sim);
    let every = steps.div_ceil(8).max(1);
    let (mut token, mut tokens, mut captures) = (1u32, Vec::with_capacity(steps), 0);
    let (mut tasks, mut graph_memory) = (0, 0);
    let mut step_graph: Option<StepGraph<'_>> = None;
    let t = Instant::now();
    for step in 0..steps {
        let ts = Instant::now();
        let pos = PROMPT + step;
        if pos + 1 > caches[0].capacity {
            // The graph uses the caches: it goes before them (and its memory with it).
            if let Some(g) = step_graph.take() {
                g.free(&path);
            }
            grow(&path, &s, &mut caches)?;
        }
        let g = match &mut step_graph {
            Some(g) => g,
            slot @ None => {
                let capacity = caches[0].capacity;
                let g = slot.insert(StepGraph::capture(&path, &mut caches, capacity, None)?);
                captures += 1;
                tasks = g.graph.task_count();
                graph_memory = acts_pool.stats().graph_reserved;
                g
            }
        };
        token = g.launch(&s, token, pos)?;
        tokens.push(token);
        if step == 0 || (step + 1) % every == 0 || step + 1 == steps {
            let ms = ts.elapsed().as_secs_f64() * 1e3;
            println!("{LABEL}: step {}/{steps}: token {token}, {ms:.1} ms", step + 1);
        }
    }
    let wall = t.elapsed();
    let launch = sim.latency().launch;
    println!(
        "{LABEL}: {captures} graph(s) captured, one per KV-cache bucket of {KV_BLOCK} tokens, \
         each allocating its activations inside the capture ({} of graph memory, reused from \
         layer to layer); {tasks} tasks per launch, whose launch cost the latency model charges \
         once ({} µs) instead of per task ({:.2} ms a step on the eager path)",
        mib(graph_memory),
        launch.as_micros(),
        launch.as_secs_f64() * 1e3 * tasks as f64
    );
    if let Some(g) = step_graph.take() {
        g.free(&path);
    }
    let run = RunFigures { tokens, driver_calls: driver_calls(&sim) - calls0, wall, weights_load };
    let report = pools.report("soma pool + graph", &path, run);
    compare_graph_memory(&path, &mut caches)?;
    drop(caches);
    drop(weights);
    Ok(report)
}

/// Captures the step for several buckets at once, as a server does before serving (the
/// analogue here of PyTorch's graphs for several batch sizes), once with a region of graph
/// memory per graph and once with one graph pool they share, and prints what the pool keeps
/// for them each time. Each graph is launched once, at a position every bucket holds: they
/// must all give the same token.
fn compare_graph_memory<'s>(
    a: &PoolPath<'s>,
    caches: &mut [KvCache<PoolAlloc<'s, f32>>],
) -> Result<()> {
    const LABEL: &str = "graph memory";
    let largest = caches[0].capacity;
    let buckets: Vec<usize> =
        (0..4).map(|i| largest - i * KV_BLOCK).filter(|&c| c >= KV_BLOCK).collect();
    let pos = buckets[buckets.len() - 1] - 1;
    let mut reserved = Vec::new();
    for shared in [None, Some(a.pool.graph_pool())] {
        // The largest first: with a graph pool, the smaller ones fit in what it freed.
        let mut graphs = Vec::with_capacity(buckets.len());
        for &capacity in &buckets {
            graphs.push(StepGraph::capture(a, caches, capacity, shared.as_ref())?);
        }
        // One after another on one stream: the graphs of a graph pool never run concurrently.
        let tokens: Vec<u32> =
            graphs.iter_mut().map(|g| g.launch(a.stream, 1, pos)).collect::<Result<_>>()?;
        if tokens.windows(2).any(|w| w[0] != w[1]) {
            return Err(format!("{LABEL}: the buckets' graphs disagree: {tokens:?}").into());
        }
        reserved.push(a.pool.stats().graph_reserved);
        for g in graphs {
            g.free(a);
        }
    }
    println!(
        "{LABEL}: the step captured for {} buckets at once ({buckets:?} tokens) keeps {} in a \
         region per graph, {} in one graph pool they share (captured largest first, launched \
         one after another)",
        buckets.len(),
        mib(reserved[0]),
        mib(reserved[1])
    );
    Ok(())
}
