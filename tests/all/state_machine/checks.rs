//! The properties checked after every step, and the final check that everything is given
//! back to the device.

use soma::MemPool;

use super::model::{Live, Model};
use super::program::Op;
use super::steps::{apply, sync_device};
use super::MIB;

pub(super) fn check(
    m: &Model<'_>,
    pools: &[MemPool<'_>],
    sim: &soma::sim::SimDevice,
) -> Result<(), String> {
    let mut all: Vec<&Live> = m.live.iter().collect();
    all.sort_by_key(|l| l.ptr);
    for w in all.windows(2) {
        if w[0].ptr.addr() + w[0].size > w[1].ptr.addr() {
            return Err(format!("live allocations overlap: {:?} and {:?}", w[0], w[1]));
        }
    }
    let mut reserved_total = 0;
    for (p, pool) in pools.iter().enumerate() {
        let st = pool.stats();
        let live: Vec<&Live> = m.live.iter().filter(|l| l.pool == p).collect();
        let used: u64 = live.iter().map(|l| l.size).sum();
        let bad = |what: &str| Err(format!("pool {p}: {what}: {st:?}"));
        if st.used != used {
            return bad(&format!("used {} != sum of live sizes {used}", st.used));
        }
        if st.live_allocations != live.len() as u64 {
            return bad(&format!("{} live allocations in the model", live.len()));
        }
        if st.reserved < st.used || st.reserved > st.max_size {
            return bad("reserved outside [used, max]");
        }
        if st.used_high < st.used || st.reserved_high < st.reserved {
            return bad("a high-water mark below its current value");
        }
        if st.free_bytes != st.reserved - st.used || st.pending_bytes > st.free_bytes {
            return bad("free / pending bytes inconsistent");
        }
        if st.allocations != st.fresh_allocations + st.reuses.total() {
            return bad("allocations != fresh + reuses");
        }
        if st.allocations - st.frees != st.live_allocations {
            return bad("allocations - frees != live allocations");
        }
        if st.largest_free_block > st.free_bytes {
            return bad("largest free block above the free bytes");
        }
        if st.reserved % (2 * MIB) != 0 {
            return bad("reserved is not a whole number of granules");
        }
        for l in live {
            if pool.owns(l.ptr) != Some(l.size) {
                return bad(&format!(
                    "owns({:?}) = {:?}, expected {}",
                    l.ptr,
                    pool.owns(l.ptr),
                    l.size
                ));
            }
        }
        reserved_total += st.reserved;
    }
    let sst = sim.stats();
    if sst.mapped_bytes != reserved_total || sst.physical_bytes != reserved_total {
        return Err(format!(
            "device mapped {} / physical {} bytes, pools reserve {reserved_total}",
            sst.mapped_bytes, sst.physical_bytes
        ));
    }
    let v = m.violations.lock().unwrap();
    if !v.is_empty() {
        return Err(format!("ordering violations: {v:?}"));
    }
    Ok(())
}

/// Frees everything, synchronises, trims to 0 and checks that the device got it all back.
pub(super) fn finish<'d>(
    m: &mut Model<'d>,
    dev: &'d soma::Device,
    pools: &[MemPool<'d>],
    sim: &soma::sim::SimDevice,
) -> Result<(), String> {
    m.open_gates();
    if m.pick(0).is_none() {
        m.create_stream(dev, 0);
    }
    while !m.live.is_empty() {
        let n = m.live.len() as u8;
        apply(m, dev, pools, &Op::Free { which: n - 1, stream: n })?;
    }
    sync_device(m, dev)?;
    check(m, pools, sim)?;
    for (p, pool) in pools.iter().enumerate() {
        pool.trim_to(0).map_err(|e| e.to_string())?;
        let st = pool.stats();
        if st.reserved != 0 || st.used != 0 {
            return Err(format!(
                "pool {p} holds memory after free all + sync + trim_to(0): {st:?}"
            ));
        }
    }
    if sim.stats().mapped_bytes != 0 {
        return Err(format!("device still maps memory: {:?}", sim.stats()));
    }
    let v = m.violations.lock().unwrap();
    if !v.is_empty() {
        return Err(format!("ordering violations: {v:?}"));
    }
    Ok(())
}
