//! A small inference server on the software NPU: what an engine built on soma looks like.
//!
//! ```sh
//! cargo run --release --example serve                # 48 requests, 4 workers
//! cargo run --release --example serve -- --quick     # 12 requests, 3 workers
//! SOMA_SANITIZER=fail cargo run --release --example serve -- --quick
//! ```
//!
//! * **Weights** live in an [`OwnedPool`], uploaded once and shared by every worker through
//!   an `Arc<Model>`; a worker's first use of them on its streams orders those streams after
//!   the upload (soma records the use).
//! * **A paged KV cache**: fixed-size blocks of [`BLOCK_TOKENS`] tokens from a KV pool with a
//!   hard `max_size`. A request takes all its blocks when it is admitted and gives them back
//!   when it finishes. When the KV pool is full the request waits in the queue until another
//!   one finishes; nothing fails.
//! * **Prefill on one stream, decode on another**, ordered by one event: the request's block
//!   table moves to the decode stream with [`OwnedAlloc::hand_off_all`]. Each decode step
//!   appends the new token's K and V through a writable view of one slot of one block
//!   ([`DeviceBufferMut::slice_mut`]), so only those bytes are written.
//! * **Workers** are threads taking requests from a shared queue; each owns its two streams
//!   and its [`HostBuffer`] for the logits, which come back with an asynchronous copy.
//! * The tokens are checked against a reference run (one worker, one request at a time), and
//!   the example exits with an error if any differs.

use std::collections::VecDeque;
use std::sync::{Arc, Condvar, Mutex};
use std::time::Instant;

use soma::prelude::*;
use soma::sim::Npu;
use soma::{
    attr, Device, Error, HostBuffer, KernelArg, MemPool, OomAction, OwnedAlloc, OwnedPool,
    OwnedStream,
};

/// Model width.
const HIDDEN: usize = 64;
/// Vocabulary size.
const VOCAB: usize = 256;
/// Hidden layers before attention.
const LAYERS: usize = 2;
/// Tokens per KV block.
const BLOCK_TOKENS: usize = 16;
/// Floats per KV block: a key and a value of `HIDDEN` for each token.
const BLOCK_FLOATS: usize = BLOCK_TOKENS * 2 * HIDDEN;
/// The KV pool holds this many blocks: fewer than the requests in flight could ask for, so
/// that requests queue.
const KV_POOL_BLOCKS: u64 = 8;
/// The software NPU's allocation granularity: one KV block, so that the KV pool's
/// `max_size` is exactly its blocks (Ascend's 2 MiB would hold 256 of these small blocks).
const GRANULARITY: u64 = (BLOCK_FLOATS * 4) as u64;

type Result<T> = std::result::Result<T, Box<dyn std::error::Error + Send + Sync>>;

/// One request: a prompt and how many tokens to generate.
#[derive(Clone, Debug)]
struct Request {
    id: usize,
    prompt: Vec<u32>,
    new_tokens: usize,
}

impl Request {
    fn blocks(&self) -> usize {
        (self.prompt.len() + self.new_tokens).div_ceil(BLOCK_TOKENS)
    }
}

/// The weights on the device.
struct Model {
    embedding: OwnedAlloc<f32>,
    layers: Vec<OwnedAlloc<f32>>,
    key: OwnedAlloc<f32>,
    value: OwnedAlloc<f32>,
    output: OwnedAlloc<f32>,
}

/// Deterministic pseudo-random weights in [-0.5, 0.5).
fn weights(seed: u64, n: usize) -> Vec<f32> {
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state >> 40) as f32 / (1u64 << 24) as f32 - 0.5
        })
        .collect()
}

impl Model {
    fn load(pool: &OwnedPool, stream: &OwnedStream) -> soma::Result<Model> {
        let square = HIDDEN * HIDDEN;
        let scale = |v: Vec<f32>, by: f32| v.into_iter().map(|x| x * by).collect::<Vec<_>>();
        let layers = (0..LAYERS)
            .map(|l| pool.upload(&scale(weights(10 + l as u64, square), 0.25), stream))
            .collect::<soma::Result<Vec<_>>>()?;
        let model = Model {
            embedding: pool.upload(&weights(1, VOCAB * HIDDEN), stream)?,
            layers,
            key: pool.upload(&scale(weights(2, square), 0.25), stream)?,
            value: pool.upload(&scale(weights(3, square), 0.25), stream)?,
            output: pool.upload(&weights(4, HIDDEN * VOCAB), stream)?,
        };
        stream.synchronize()?;
        Ok(model)
    }

    /// The weight arguments of a kernel, in the order [`hidden_state`] reads them from index
    /// `first`.
    fn args(&self) -> Vec<KernelArg<'_>> {
        let mut args = vec![KernelArg::read(&self.embedding)];
        args.extend(self.layers.iter().map(KernelArg::read));
        args.push(KernelArg::read(&self.key));
        args.push(KernelArg::read(&self.value));
        args.push(KernelArg::read(&self.output));
        args
    }
}

/// Index of the key matrix among a kernel's weight arguments.
const KEY_ARG: usize = 1 + LAYERS;
/// Index of the value matrix.
const VALUE_ARG: usize = KEY_ARG + 1;
/// Index of the output projection.
const OUTPUT_ARG: usize = VALUE_ARG + 1;
/// Number of weight arguments.
const WEIGHT_ARGS: usize = OUTPUT_ARG + 1;

fn matvec(m: &[f32], x: &[f32], rows: usize) -> Vec<f32> {
    (0..rows)
        .map(|r| m[r * x.len()..(r + 1) * x.len()].iter().zip(x).map(|(a, b)| a * b).sum())
        .collect()
}

/// A token's hidden state: its embedding through the layers (inside a kernel body).
fn hidden_state(
    b: &dyn soma::hal::KernelBuffers,
    token: u32,
) -> std::result::Result<Vec<f32>, soma::hal::KernelError> {
    let embedding = b.read::<f32>(0)?;
    let row = token as usize % VOCAB;
    let mut x = embedding[row * HIDDEN..(row + 1) * HIDDEN].to_vec();
    for l in 0..LAYERS {
        let y = matvec(b.read::<f32>(1 + l)?, &x, HIDDEN);
        x.iter_mut().zip(y).for_each(|(x, y)| *x = (*x + y).tanh());
    }
    Ok(x)
}

/// Writes the key and value of `token` into `slot` (`2 * HIDDEN` floats, a view of a block).
fn append_kv(
    model: &Model,
    stream: &OwnedStream,
    slot: &mut impl DeviceBufferMut<Elem = f32>,
    token: u32,
) -> soma::Result<()> {
    let mut args = model.args();
    args.push(KernelArg::write(slot));
    stream.launch("append_kv", &args, move |b| {
        let x = hidden_state(b, token)?;
        let k = matvec(b.read::<f32>(KEY_ARG)?, &x, HIDDEN);
        let v = matvec(b.read::<f32>(VALUE_ARG)?, &x, HIDDEN);
        let out = b.write::<f32>(WEIGHT_ARGS)?;
        out[..HIDDEN].copy_from_slice(&k);
        out[HIDDEN..].copy_from_slice(&v);
        Ok(())
    })
}

/// The logits of the next token: `token`'s hidden state attending over the first `len`
/// cached tokens of `blocks`.
fn attend(
    model: &Model,
    stream: &OwnedStream,
    blocks: &[OwnedAlloc<f32>],
    len: usize,
    token: u32,
    logits: &mut OwnedAlloc<f32>,
) -> soma::Result<()> {
    let mut args = model.args();
    args.extend(blocks.iter().map(KernelArg::read));
    args.push(KernelArg::write(logits));
    let n_blocks = blocks.len();
    stream.launch("attend", &args, move |b| {
        let q = hidden_state(b, token)?;
        let (mut scores, mut values) = (Vec::with_capacity(len), Vec::with_capacity(len));
        for t in 0..len {
            let block = b.read::<f32>(WEIGHT_ARGS + t / BLOCK_TOKENS)?;
            let at = (t % BLOCK_TOKENS) * 2 * HIDDEN;
            let k = &block[at..at + HIDDEN];
            scores.push(q.iter().zip(k).map(|(a, b)| a * b).sum::<f32>() / (HIDDEN as f32).sqrt());
            values.push(&block[at + HIDDEN..at + 2 * HIDDEN]);
        }
        let max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let weights: Vec<f32> = scores.iter().map(|s| (s - max).exp()).collect();
        let total: f32 = weights.iter().sum();
        let mut x = q;
        for (w, v) in weights.iter().zip(values) {
            x.iter_mut().zip(v).for_each(|(x, v)| *x += w / total * v);
        }
        let out = matvec(b.read::<f32>(OUTPUT_ARG)?, &x, VOCAB);
        b.write::<f32>(WEIGHT_ARGS + n_blocks)?.copy_from_slice(&out);
        Ok(())
    })
}

/// What a worker keeps between requests.
struct Worker {
    model: Arc<Model>,
    kv: OwnedPool,
    activations: OwnedPool,
    prefill: OwnedStream,
    decode: OwnedStream,
    /// Page-locked memory the logits come back in.
    logits_host: Option<HostBuffer<f32>>,
}

impl Worker {
    fn new(
        device: &Device,
        model: Arc<Model>,
        kv: OwnedPool,
        activations: OwnedPool,
    ) -> soma::Result<Worker> {
        Ok(Worker {
            model,
            kv,
            activations,
            prefill: device.create_owned_stream()?,
            decode: device.create_owned_stream()?,
            logits_host: Some(HostBuffer::new(device, VOCAB)?),
        })
    }

    /// The request's KV blocks, all or none: `None` when the KV pool is full.
    fn admit(&self, request: &Request) -> soma::Result<Option<Vec<OwnedAlloc<f32>>>> {
        let mut blocks = Vec::with_capacity(request.blocks());
        for _ in 0..request.blocks() {
            match self.kv.alloc_async_or::<f32>(BLOCK_FLOATS, &self.prefill, |_| OomAction::Fail) {
                Ok(block) => blocks.push(block),
                Err(Error::OutOfMemory(_)) => return Ok(None), // the blocks taken go back
                Err(e) => return Err(e),
            }
        }
        Ok(Some(blocks))
    }

    /// Runs an admitted request: prefill, hand-off, decode; returns the generated tokens.
    fn run(
        &mut self,
        request: &Request,
        mut blocks: Vec<OwnedAlloc<f32>>,
    ) -> soma::Result<Vec<u32>> {
        for (t, &token) in request.prompt.iter().enumerate() {
            let block = &mut blocks[t / BLOCK_TOKENS];
            let at = (t % BLOCK_TOKENS) * 2 * HIDDEN;
            append_kv(
                &self.model,
                &self.prefill,
                &mut block.slice_mut(at..at + 2 * HIDDEN)?,
                token,
            )?;
        }
        // The whole block table moves to the decode stream with one event.
        OwnedAlloc::hand_off_all(&mut blocks, &self.decode)?;
        let mut tokens = Vec::with_capacity(request.new_tokens);
        let mut last = *request.prompt.last().unwrap_or(&0);
        let first = request.prompt.len();
        for len in first..first + request.new_tokens {
            let mut logits = self.activations.alloc_async::<f32>(VOCAB, &self.decode)?;
            attend(&self.model, &self.decode, &blocks, len, last, &mut logits)?;
            let host = self.logits_host.take().expect("the worker's logits buffer");
            let host = self.decode.copy_to_host_async(&logits, host)?.wait()?;
            let next = argmax(&host);
            self.logits_host = Some(host);
            drop(logits); // freed onto the decode stream, reused by the next step
            let block = &mut blocks[len / BLOCK_TOKENS];
            let at = (len % BLOCK_TOKENS) * 2 * HIDDEN;
            append_kv(&self.model, &self.decode, &mut block.slice_mut(at..at + 2 * HIDDEN)?, next)?;
            tokens.push(next);
            last = next;
        }
        drop(blocks); // the KV blocks go back to the pool, in the decode stream's order
        Ok(tokens)
    }
}

fn argmax(v: &[f32]) -> u32 {
    v.iter()
        .enumerate()
        .fold((0, f32::NEG_INFINITY), |best, (i, &x)| if x > best.1 { (i, x) } else { best })
        .0 as u32
}

/// The queue the workers share, and what they report.
#[derive(Default)]
struct Queue {
    pending: VecDeque<Request>,
    /// Requests running now.
    running: usize,
    done: Vec<(usize, Vec<u32>)>,
    /// Times a request found the KV pool full and went back to the queue.
    waits: usize,
}

/// Serves `requests` with `workers` threads; returns each request's tokens (by id) and the
/// number of times a request waited for KV memory.
fn serve(
    device: &Device,
    model: &Arc<Model>,
    requests: &[Request],
    workers: usize,
) -> Result<(Vec<Vec<u32>>, usize, OwnedPool)> {
    let kv = MemPool::builder()
        .max_size(KV_POOL_BLOCKS * (BLOCK_FLOATS * 4) as u64)
        .build_owned(device)?;
    let activations = MemPool::builder().build_owned(device)?;
    let shared = Arc::new((
        Mutex::new(Queue { pending: requests.iter().cloned().collect(), ..Queue::default() }),
        Condvar::new(),
    ));
    let handles: Vec<_> = (0..workers)
        .map(|_| {
            let (device, model, kv, activations, shared) = (
                device.clone(),
                Arc::clone(model),
                kv.clone(),
                activations.clone(),
                Arc::clone(&shared),
            );
            std::thread::spawn(move || -> soma::Result<()> {
                let mut worker = Worker::new(&device, model, kv, activations)?;
                let (queue, changed) = &*shared;
                loop {
                    let request = {
                        let mut q = queue.lock().unwrap();
                        loop {
                            if let Some(r) = q.pending.pop_front() {
                                q.running += 1;
                                break r;
                            }
                            if q.running == 0 {
                                return Ok(());
                            }
                            q = changed.wait(q).unwrap();
                        }
                    };
                    match worker.admit(&request)? {
                        Some(blocks) => {
                            let tokens = worker.run(&request, blocks)?;
                            let mut q = queue.lock().unwrap();
                            q.running -= 1;
                            q.done.push((request.id, tokens));
                            changed.notify_all();
                        }
                        None => {
                            // KV pool full: back to the front of the queue until a request ends.
                            let mut q = queue.lock().unwrap();
                            q.waits += 1;
                            q.running -= 1;
                            q.pending.push_front(request);
                            if q.running > 0 {
                                drop(changed.wait(q).unwrap());
                            }
                        }
                    }
                }
            })
        })
        .collect();
    for h in handles {
        h.join().map_err(|_| "a worker panicked")??;
    }
    let (queue, _) = &*shared;
    let mut q = queue.lock().unwrap();
    let mut done = std::mem::take(&mut q.done);
    done.sort_by_key(|d| d.0);
    Ok((done.into_iter().map(|d| d.1).collect(), q.waits, kv))
}

fn requests(n: usize) -> Vec<Request> {
    (0..n)
        .map(|id| {
            let prompt_len = 8 + (id * 7) % 40;
            Request {
                id,
                prompt: (0..prompt_len).map(|t| ((id * 31 + t * 17) % VOCAB) as u32).collect(),
                new_tokens: 4 + (id * 5) % 20,
            }
        })
        .collect()
}

fn main() -> std::process::ExitCode {
    match run() {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("serve: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}

fn run() -> Result<()> {
    let quick = std::env::args().skip(1).any(|a| a == "--quick");
    if let Some(bad) = std::env::args().skip(1).find(|a| a != "--quick") {
        return Err(format!("unknown argument {bad:?} (usage: serve [--quick])").into());
    }
    let (n_requests, workers) = if quick { (12, 3) } else { (48, 4) };
    let npu = Npu::builder().granularity(GRANULARITY).build()?;
    let device = npu.device(0)?;
    let load = device.create_owned_stream()?;
    let weights = MemPool::builder().build_owned(&device)?;
    let model = Arc::new(Model::load(&weights, &load)?);
    let requests = requests(n_requests);
    println!(
        "serve: {n_requests} requests on {workers} workers; model {HIDDEN} wide, {LAYERS} layers, \
         {VOCAB} tokens; KV cache of {KV_POOL_BLOCKS} blocks of {BLOCK_TOKENS} tokens"
    );

    let t = Instant::now();
    let (reference, _, _) = serve(&device, &model, &requests, 1)?;
    let reference_ms = t.elapsed().as_secs_f64() * 1e3;
    let t = Instant::now();
    let (served, waits, kv) = serve(&device, &model, &requests, workers)?;
    let served_ms = t.elapsed().as_secs_f64() * 1e3;

    let mismatched: Vec<usize> = (0..n_requests).filter(|&i| served[i] != reference[i]).collect();
    if !mismatched.is_empty() {
        return Err(format!(
            "requests {mismatched:?} generated other tokens than the reference run"
        )
        .into());
    }
    let tokens: usize = served.iter().map(Vec::len).sum();
    let stats = kv.stats();
    println!(
        "serve: {n_requests} requests, {tokens} tokens, same tokens as the reference run; \
         {:.1} ms ({:.0} tokens/s) on {workers} workers, {:.1} ms on one; \
         {waits} waits for KV memory; KV pool peak used {} KiB of {} KiB reserved, \
         {} reuses across streams",
        served_ms,
        tokens as f64 / served_ms * 1e3,
        reference_ms,
        kv.get::<attr::UsedMemHigh>()? >> 10,
        kv.get::<attr::ReservedMemHigh>()? >> 10,
        stats.reuses.event_dependency
            + stats.reuses.opportunistic
            + stats.reuses.internal_dependency
            + stats.reuses.host_synchronized,
    );
    let reports = npu.sim_device(0)?.sanitizer_reports();
    if !reports.is_empty() {
        return Err(format!(
            "the sanitizer reported {} problems, first: {}",
            reports.len(),
            reports[0]
        )
        .into());
    }
    drop(model);
    drop(weights);
    drop(load);
    Ok(())
}
