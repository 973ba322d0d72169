//! One step of a program: applied to the real pools and streams, and to the model.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use soma::{attr, MemPool, ReusePolicy};

use super::model::{round_up, Freed, Inc, Live, Model};
use super::program::Op;
use super::{cover, Gate, MIB, TIGHT_MAX};

pub(super) fn apply<'d>(
    m: &mut Model<'d>,
    dev: &'d soma::Device,
    pools: &[MemPool<'d>],
    op: &Op,
) -> Result<(), String> {
    let pool_of = |p: u8| p as usize % pools.len();
    match *op {
        Op::CreateStream { slot } => m.create_stream(dev, slot as usize % m.streams.len()),
        Op::DestroyStream { slot } => {
            if m.streams[slot as usize].is_some() {
                m.open_gates(); // dropping a stream drains it
                let e = m.streams[slot as usize].take().expect("live");
                drop(e.stream);
                m.destroyed.insert(e.inc);
            }
        }
        Op::Alloc { pool, stream, bytes } => {
            let Some(t) = m.pick(stream) else { return Ok(()) };
            let p = pool_of(pool);
            let pool = &pools[p];
            let policy = pool.reuse_policy();
            let before = pool.stats();
            let enqueued_before: Vec<(usize, u64)> = (0..m.streams.len())
                .filter_map(|i| m.streams[i].as_ref().map(|e| (i, e.stream.hal().enqueued())))
                .collect();
            let result = pool.alloc_raw(u64::from(bytes), &m.entry(t).stream);
            let after = pool.stats();
            if after.oom_retries > before.oom_retries {
                // The pool synchronised the streams holding pending frees: what has completed
                // by now is host-observed as far as the model knows.
                let done: Vec<(Inc, u64)> = m
                    .streams
                    .iter()
                    .flatten()
                    .map(|e| (e.inc, e.stream.hal().completed()))
                    .collect();
                for (inc, pos) in done {
                    m.observe(inc, pos);
                }
            }
            let (ptr, size) = match result {
                Ok(a) => a,
                Err(soma::Error::OutOfMemory(oom)) if pool.max_size() == TIGHT_MAX => {
                    cover("(out of memory)");
                    // A failed allocation changes nothing but the OOM counters; recyclable
                    // free segments may have been unmapped.
                    let same = after.used == before.used
                        && after.live_allocations == before.live_allocations
                        && after.allocations == before.allocations
                        && after.reserved <= before.reserved
                        && after.ooms == before.ooms + 1;
                    if !same || oom.rounded != round_up(u64::from(bytes), pool.alignment()) {
                        return Err(format!(
                            "out of memory changed the pool: {before:?} -> {after:?} ({oom:?})"
                        ));
                    }
                    m.log.push(format!("alloc p{p} {bytes} on slot {t}: out of memory"));
                    return Ok(());
                }
                Err(e) => return Err(format!("alloc_raw failed: {e}")),
            };
            let expect = round_up(u64::from(bytes), pool.alignment());
            if size != expect {
                return Err(format!("rounded size {size}, expected {expect}"));
            }
            let (start, end) = (ptr.addr(), ptr.addr() + size);
            let internal = after.reuses.internal_dependency > before.reuses.internal_dependency;
            let (t_inc, t_vc) = (m.entry(t).inc, m.entry(t).vc.clone());
            let mut overlapped = Vec::new();
            let mut kept = Vec::new();
            for f in std::mem::take(&mut m.freed[p]) {
                if f.end <= start || f.start >= end {
                    kept.push(f);
                    continue;
                }
                if f.start < start {
                    kept.push(Freed { end: start, ..f.clone() });
                }
                if f.end > end {
                    kept.push(Freed { start: end, ..f.clone() });
                }
                overlapped.push(f);
            }
            m.freed[p] = kept;
            let mut dependencies = BTreeMap::<Inc, u64>::new();
            for f in &overlapped {
                match m.justify(f, t_inc, &t_vc, policy, after.unmap_calls) {
                    Some(why) => {
                        cover(why);
                        m.log.push(format!("  reuse of {f:?} by inc {t_inc}: {why}"));
                    }
                    None if policy.internal_dependencies && internal => {
                        cover("internal dependency");
                        let d = dependencies.entry(f.inc).or_insert(f.pos);
                        *d = (*d).max(f.pos);
                    }
                    None => {
                        return Err(format!(
                            "allocation {ptr:?}+{size} on stream inc {t_inc} (clock {t_vc:?}) \
                             reuses {f:?} (completed {}, host observed {}) with no rule; \
                             policy {policy:?}; reuses before {:?} after {:?}",
                            m.completed(f.inc),
                            m.host_observed(f.inc),
                            before.reuses,
                            after.reuses
                        ));
                    }
                }
            }
            for (inc, pos) in dependencies {
                // The pool recorded an event on `inc` after the free and made `t` wait on it:
                // a host function on `t` must not run before `inc` has reached the free.
                let src = Arc::clone(&m.hals[&inc]);
                let violations = Arc::clone(&m.violations);
                let what =
                    format!("internal dependency: inc {t_inc} ran before inc {inc} reached {pos}");
                m.entry(t)
                    .stream
                    .host_fn(move || {
                        if src.completed() < pos {
                            violations.lock().unwrap().push(what);
                        }
                    })
                    .map_err(|e| e.to_string())?;
                m.log.push(format!(
                    "  internal dependency of inc {t_inc} on inc {inc} (free at {pos})"
                ));
            }
            if internal {
                // Learn the ordering the pool inserted, whatever justified the block in the
                // model: it recorded an event on the block's stream (the only other stream
                // whose queue grew during the call) and made `t` wait on it.
                for (i, n) in enqueued_before {
                    let Some(src) = m.streams[i].as_ref() else { continue };
                    let q = src.stream.hal().enqueued();
                    if i == t || q == n {
                        continue;
                    }
                    let (src_inc, src_vc) = (src.inc, src.vc.clone());
                    let e = m.streams[t].as_mut().expect("live");
                    e.vc.join(&src_vc);
                    e.vc.raise(src_inc, q);
                    m.log.push(format!("  inc {t_inc} now waits for inc {src_inc} up to {q}"));
                }
            }
            m.log.push(format!("alloc p{p} {ptr:?}+{size} on inc {t_inc} ({:?})", after.reuses));
            m.live.push(Live { pool: p, ptr, size, inc: t_inc });
        }
        Op::Free { which, stream } => {
            if m.live.is_empty() {
                return Ok(());
            }
            let live = m.live.swap_remove(which as usize % m.live.len());
            // Free on the named stream; if it is gone, on any live stream.
            let Some(t) = m.pick(stream) else {
                m.live.push(live);
                return Ok(());
            };
            let e = m.entry(t);
            let pool = &pools[live.pool];
            pool.free_raw(live.ptr, &e.stream).map_err(|e| format!("free_raw failed: {e}"))?;
            let pos = e.stream.hal().enqueued();
            let f = Freed {
                start: live.ptr.addr(),
                end: live.ptr.addr() + live.size,
                inc: e.inc,
                pos,
                unmaps_at_free: pool.stats().unmap_calls,
            };
            m.log.push(format!(
                "free p{} {:?} (of inc {}) on inc {} at {pos}",
                live.pool, live.ptr, live.inc, e.inc
            ));
            m.freed[live.pool].push(f);
        }
        Op::Record { stream, event } => {
            let Some(t) = m.pick(stream) else { return Ok(()) };
            let e = m.entry(t);
            let ev = event as usize;
            e.stream.record(&m.events[ev].0).map_err(|e| e.to_string())?;
            let q = e.stream.hal().enqueued();
            let mut clock = e.vc.clone();
            clock.raise(e.inc, q);
            m.log.push(format!("record e{ev} on inc {} at {q}", e.inc));
            m.events[ev].1 = Some(clock);
        }
        Op::Wait { stream, event } => {
            let Some(t) = m.pick(stream) else { return Ok(()) };
            let ev = event as usize;
            m.entry(t).stream.wait_event(&m.events[ev].0).map_err(|e| e.to_string())?;
            if let Some(clock) = m.events[ev].1.clone() {
                let e = m.streams[t].as_mut().expect("live");
                e.vc.join(&clock);
                m.log.push(format!("inc {} waits e{ev}: clock {:?}", e.inc, e.vc));
            }
        }
        Op::WaitStream { waiter, on } => {
            let (Some(w), Some(o)) = (m.pick(waiter), m.pick(on)) else { return Ok(()) };
            m.entry(w).stream.wait_stream(&m.entry(o).stream).map_err(|e| e.to_string())?;
            let src = m.entry(o);
            let mut clock = src.vc.clone();
            clock.raise(src.inc, src.stream.hal().enqueued());
            let e = m.streams[w].as_mut().expect("live");
            e.vc.join(&clock);
            m.log.push(format!("inc {} waits for stream inc: clock {:?}", e.inc, e.vc));
        }
        Op::SyncStream { stream } => {
            let Some(t) = m.pick(stream) else { return Ok(()) };
            m.open_gates();
            let e = m.entry(t);
            let (inc, pos) = (e.inc, e.stream.hal().enqueued());
            e.stream.synchronize().map_err(|e| e.to_string())?;
            m.observe(inc, pos);
        }
        Op::SyncEvent { event } => {
            m.open_gates();
            let ev = event as usize;
            m.events[ev].0.synchronize().map_err(|e| e.to_string())?;
            if let Some(clock) = m.events[ev].1.clone() {
                for (inc, pos) in clock.0 {
                    m.observe(inc, pos);
                }
            }
        }
        Op::SyncDevice => {
            m.open_gates();
            sync_device(m, dev)?;
            // The release threshold applied at the synchronisation: with every free
            // host-observed and nothing enqueued since, trimming to the threshold now finds
            // nothing more to release.
            for (p, pool) in pools.iter().enumerate() {
                let threshold = pool.get::<attr::ReleaseThreshold>().map_err(|e| e.to_string())?;
                let released = pool.trim_to(threshold).map_err(|e| e.to_string())?;
                if released != 0 {
                    return Err(format!(
                        "pool {p}: device synchronize left {released} bytes above the \
                         threshold {threshold} that trim_to(threshold) then released"
                    ));
                }
            }
        }
        Op::QueryStream { stream } => {
            let Some(t) = m.pick(stream) else { return Ok(()) };
            let e = m.entry(t);
            let (inc, pos) = (e.inc, e.stream.hal().enqueued());
            if e.stream.query().map_err(|e| e.to_string())? {
                m.observe(inc, pos);
            }
        }
        Op::QueryEvent { event } => {
            let ev = event as usize;
            let clock = m.events[ev].1.clone();
            if m.events[ev].0.query().map_err(|e| e.to_string())? {
                for (inc, pos) in clock.map(|c| c.0).unwrap_or_default() {
                    m.observe(inc, pos);
                }
            }
        }
        Op::Trim { pool, mib } => {
            let pool = &pools[pool_of(pool)];
            let before = pool.stats().reserved;
            let released = pool
                .trim_to((u64::from(mib) * MIB).min(pool.max_size()))
                .map_err(|e| format!("trim_to: {e}"))?;
            let after = pool.stats().reserved;
            if before - after != released {
                return Err(format!("trim released {released}, reserved {before} -> {after}"));
            }
        }
        Op::SyncTrimAll => {
            m.open_gates();
            sync_device(m, dev)?;
            for (p, pool) in pools.iter().enumerate() {
                pool.trim_to(0).map_err(|e| format!("trim_to(0): {e}"))?;
                let st = pool.stats();
                if !m.live.iter().any(|l| l.pool == p) && st.reserved != 0 {
                    return Err(format!("pool {p}: no live allocation, all synchronised and trimmed, yet reserved {}", st.reserved));
                }
                if st.pending_bytes != 0 && m.live.iter().all(|l| l.pool != p) {
                    return Err(format!("pool {p}: pending bytes after a full trim: {st:?}"));
                }
            }
        }
        Op::SetReuse { pool, follow, opportunistic, internal } => {
            let pool = &pools[pool_of(pool)];
            pool.set_reuse_policy(ReusePolicy::new(follow, opportunistic, internal));
            let got = (
                pool.get::<attr::ReuseFollowEventDependencies>().map_err(|e| e.to_string())?,
                pool.get::<attr::ReuseAllowOpportunistic>().map_err(|e| e.to_string())?,
                pool.get::<attr::ReuseAllowInternalDependencies>().map_err(|e| e.to_string())?,
            );
            if got != (follow, opportunistic, internal) {
                return Err(format!("reuse attributes read back as {got:?}"));
            }
        }
        Op::ResetHighs { pool } => {
            let pool = &pools[pool_of(pool)];
            pool.reset::<attr::UsedMemHigh>().map_err(|e| e.to_string())?;
            pool.reset::<attr::ReservedMemHigh>().map_err(|e| e.to_string())?;
            let st = pool.stats();
            if st.used_high != st.used || st.reserved_high != st.reserved {
                return Err(format!("a reset high-water mark is not its current value: {st:?}"));
            }
        }
        Op::SetThreshold { pool, mib } => {
            let pool = &pools[pool_of(pool)];
            let v = (u64::from(mib) * MIB).min(pool.max_size());
            pool.set::<attr::ReleaseThreshold>(v).map_err(|e| e.to_string())?;
            if pool.get::<attr::ReleaseThreshold>().map_err(|e| e.to_string())? != v {
                return Err("threshold not stored".into());
            }
        }
        Op::Sleep { stream, ms } => {
            let Some(t) = m.pick(stream) else { return Ok(()) };
            let d = Duration::from_millis(u64::from(ms));
            m.entry(t).stream.host_fn(move || std::thread::sleep(d)).map_err(|e| e.to_string())?;
        }
        Op::Gate { stream, steps } => {
            let Some(t) = m.pick(stream) else { return Ok(()) };
            let g = Gate::close(&m.entry(t).stream)?;
            m.gates.push((g, steps));
        }
    }
    Ok(())
}

pub(super) fn sync_device(m: &mut Model<'_>, dev: &soma::Device) -> Result<(), String> {
    let snapshot: Vec<(Inc, u64)> =
        m.streams.iter().flatten().map(|e| (e.inc, e.stream.hal().enqueued())).collect();
    dev.synchronize().map_err(|e| e.to_string())?;
    for (inc, pos) in snapshot {
        m.observe(inc, pos);
    }
    Ok(())
}
