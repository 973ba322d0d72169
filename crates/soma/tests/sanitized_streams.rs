//! With the stream-order sanitizer on, a long-lived pool serving a stream per request (each
//! allocates, memsets and frees a block, and is dropped) costs neither sanitizer state nor
//! memory that grows with the number of requests, as `SOMA_SANITIZER=fail` promises for whole
//! test suites and servers. (Own test binary: it reads the resident set of the whole process.)

use soma::sim::{Npu, SanitizerMode, SimDevice};
use soma::{Device, MemPool};

/// The tests read the resident set of the whole process: one at a time.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

fn rss_bytes() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap();
    let pages: u64 = statm.split_whitespace().nth(1).unwrap().parse().unwrap();
    pages * 4096
}

fn sanitized() -> (Npu, std::sync::Arc<SimDevice>) {
    let npu = Npu::builder().capacity(1 << 30).sanitizer(SanitizerMode::FailStream).build();
    let npu = npu.unwrap();
    let sim = npu.sim_device(0).unwrap();
    (npu, sim)
}

/// One request: a stream that allocates 4 KiB from the pool, memsets it, frees it, and is
/// dropped.
fn request(dev: &Device, pool: &MemPool<'_>) {
    let s = dev.create_stream().unwrap();
    let mut block = pool.alloc_async::<u8>(4096, &s).unwrap();
    s.memset(&mut block, 0x5A).unwrap();
    drop(block);
    drop(s);
}

/// Whether `counts` stay bounded: a count that grows with the number of requests is about
/// twice as large at the end as half-way; a bounded one (a sawtooth, as dropped streams are
/// forgotten in batches) peaks as high in the first half as in the second.
fn flat(counts: &[usize]) -> bool {
    let (first, second) = counts.split_at(counts.len() / 2);
    let peak = |c: &[usize]| c.iter().copied().max().unwrap_or(0);
    2 * peak(second) < 3 * peak(first)
}

#[test]
fn streams_of_a_long_lived_pool_are_forgotten() {
    let _serial = serial();
    let (npu, sim) = sanitized();
    let dev = npu.device(0).unwrap();
    let pool = MemPool::builder().max_size(64 << 20).build(&dev).unwrap();
    let tracked: Vec<usize> = (0..1000)
        .map(|_| {
            request(&dev, &pool);
            sim.sanitizer_tracked_streams()
        })
        .collect();
    assert!(flat(&tracked), "tracked streams: {tracked:?}");
    assert_eq!(sim.sanitizer_reports(), []);
}

#[test]
fn streams_running_host_functions_are_forgotten() {
    let _serial = serial();
    let (npu, sim) = sanitized();
    let dev = npu.device(0).unwrap();
    let tracked: Vec<usize> = (0..1000)
        .map(|_| {
            let s = dev.create_stream().unwrap();
            s.host_fn(|| {}).unwrap();
            drop(s);
            sim.sanitizer_tracked_streams()
        })
        .collect();
    assert!(flat(&tracked), "tracked streams: {tracked:?}");
}

#[test]
fn requests_do_not_grow_the_resident_set() {
    let _serial = serial();
    let (npu, _sim) = sanitized();
    let dev = npu.device(0).unwrap();
    let pool = MemPool::builder().max_size(64 << 20).build(&dev).unwrap();
    // Warm up: the pool's first growth, the allocator's arenas for the worker threads.
    (0..300).for_each(|_| request(&dev, &pool));
    let base = rss_bytes();
    (0..3000).for_each(|_| request(&dev, &pool));
    let grown = rss_bytes().saturating_sub(base);
    assert!(grown < 4 << 20, "3000 requests grew the resident set by {grown} bytes");
}
