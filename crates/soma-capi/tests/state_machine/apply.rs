//! One step of a program run against the C API and the model, and the checks after it.

use super::*;

/// Runs `op` against the C API and the model, checking the result of the call.
pub(crate) fn apply(m: &mut Model, op: &Op) -> Result<(), String> {
    let pool_of = |p: u8| p as usize % POOL_MAX.len();
    match *op {
        Op::CreateStream { slot } => {
            let slot = 1 + (slot as usize - 1) % (SLOTS as usize - 1);
            if m.slots[slot].is_none() {
                let mut h = std::ptr::null_mut();
                // SAFETY: valid out-pointer.
                acl(unsafe { aclrtCreateStream(&mut h) }, "aclrtCreateStream")?;
                m.add_stream(slot, h);
            }
        }
        Op::DestroyStream { slot } => {
            let slot = 1 + (slot as usize - 1) % (SLOTS as usize - 1);
            if let Some(inc) = m.slots[slot].take() {
                let s = m.streams.remove(&inc).expect("live");
                acl(aclrtDestroyStream(s.handle), "aclrtDestroyStream")?;
                m.destroyed.insert(inc);
                m.log.push(format!("destroy stream inc {inc}"));
            }
        }
        Op::Alloc { pool, stream, bytes } => {
            let t = m.pick(stream);
            let p = pool_of(pool);
            let (ph, sw) = (m.pools[p].handle, m.pools[p].switches);
            let reserved_before = attr(ph, RESERVED)?;
            let ptr = try_alloc(bytes as usize, ph, m.st(t).handle)
                .map_err(|e| format!("aclrtMemPoolMallocAsync: {e} ({})", msg()))?;
            let size = round_up(u64::from(bytes), ALIGN);
            // Granules of live allocations of this pool before this one, with when each was
            // allocated: only a block live since before a free pins its granules (one
            // allocated later may sit in a granule recycled and mapped again after the free).
            let busy: Vec<(u64, u64)> = m
                .live
                .iter()
                .filter(|l| l.pool == p)
                .flat_map(|l| {
                    (l.ptr / GRANULE..=(l.ptr + l.size - 1) / GRANULE).map(|g| (g, l.seq))
                })
                .collect();
            m.seq += 1;
            // Tracked at once, so that a case failing below still frees it at teardown (a
            // pool with live allocations cannot be destroyed: its address space would leak).
            m.live.push(Live { pool: p, ptr, bytes: u64::from(bytes), size, seq: m.seq });
            if ptr == 0 || ptr % ALIGN != 0 {
                return Err(format!("pointer {ptr:#x} not {ALIGN}-aligned"));
            }
            if attr(ph, RESERVED)? < reserved_before {
                m.pools[p].epoch += 1;
            }
            let epoch = m.pools[p].epoch;
            let (start, end) = (ptr, ptr + size);
            let mut overlapped = Vec::new();
            let mut kept = Vec::new();
            let mut others: BTreeSet<Inc> = BTreeSet::new();
            for f in std::mem::take(&mut m.freed[p]) {
                if f.inc != t {
                    others.insert(f.inc);
                }
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
            for f in &overlapped {
                let (a, b) = (f.start.max(start), f.end.min(end));
                let free_granules = (a / GRANULE..=(b - 1) / GRANULE)
                    .all(|g| !busy.iter().any(|&(bg, seq)| bg == g && seq < f.seq));
                match m.justify(f, t, sw, epoch, free_granules) {
                    Some(why) => {
                        cover(why);
                        m.used.insert(why);
                        m.log.push(format!("  reuse of {f:?} by inc {t}: {why}"));
                        if why.ends_with("(verified)") {
                            let done = Arc::clone(&m.st(f.inc).done);
                            let violations = Arc::clone(&m.violations);
                            let (inc, pos) = (f.inc, f.pos);
                            let what = format!(
                                "{why}: inc {t} ran before inc {inc} completed its free at {pos} \
                                 ({:#x}..{:#x})",
                                f.start, f.end
                            );
                            m.task(t, move || {
                                if done.load(Ordering::SeqCst) <= pos {
                                    violations.lock().unwrap_or_else(|e| e.into_inner()).push(what);
                                }
                            })?;
                        }
                    }
                    None => {
                        let ts = m.st(t);
                        return Err(format!(
                            "allocation {ptr:#x}+{size} on stream inc {t} (clock {:?}, maybe \
                             {:?}) reuses {f:?} with no rule (switches {sw:?}, observed {}, \
                             marker {}, epoch now {epoch})",
                            ts.vc,
                            ts.mvc,
                            m.observed(f.inc),
                            m.streams
                                .get(&f.inc)
                                .map_or(u64::MAX, |s| s.done.load(Ordering::SeqCst)),
                        ));
                    }
                }
            }
            if sw[2] {
                // The pool may have made `t` wait on an event recorded at the end of any
                // stream holding freed memory of this pool: learn it as a *maybe* ordering.
                for s in others {
                    let Some(src) = m.streams.get(&s) else { continue };
                    let (mut clock, tasks) = (src.mvc.clone(), src.tasks);
                    clock.join(&src.vc);
                    clock.raise(s, tasks);
                    m.st_mut(t).mvc.join(&clock);
                }
            }
            m.log.push(format!("alloc p{p} {bytes} -> {ptr:#x}+{size} on inc {t}"));
        }
        Op::Free { which, stream } => {
            if m.live.is_empty() {
                return Ok(());
            }
            let l = m.live.swap_remove(which as usize % m.live.len());
            let t = m.pick(stream);
            acl(free(l.ptr, m.st(t).handle), "aclrtMemPoolFreeAsync")?;
            let pos = m.st(t).tasks;
            m.task(t, || {})?; // the free's marker, at `pos + 1`
            let epoch = m.pools[l.pool].epoch;
            m.seq += 1;
            let seq = m.seq;
            m.freed[l.pool].push(Freed {
                start: l.ptr,
                end: l.ptr + l.size,
                inc: t,
                pos,
                epoch,
                seq,
            });
            m.freed_ptrs.push(l.ptr);
            m.log.push(format!("free p{} {:#x} on inc {t} at {pos}", l.pool, l.ptr));
        }
        Op::Record { stream, event } => {
            let t = m.pick(stream);
            let ev = event_handle(m, event)?;
            acl(aclrtRecordEvent(ev, m.st(t).handle), "aclrtRecordEvent")?;
            let s = m.st_mut(t);
            s.tasks += 1;
            let (mut vc, mut mvc) = (s.vc.clone(), s.mvc.clone());
            vc.raise(t, s.tasks);
            mvc.raise(t, s.tasks);
            m.log.push(format!("record e{event} on inc {t}: {vc:?}"));
            m.events[event as usize] = Some((ev, Some((vc, mvc))));
        }
        Op::Wait { stream, event } => {
            let t = m.pick(stream);
            let ev = event_handle(m, event)?;
            acl(aclrtStreamWaitEvent(m.st(t).handle, ev), "aclrtStreamWaitEvent")?;
            if let Some((_, Some((vc, mvc)))) = m.events[event as usize].clone() {
                let s = m.st_mut(t);
                s.vc.join(&vc);
                s.mvc.join(&vc);
                s.mvc.join(&mvc);
                m.log.push(format!("inc {t} waits e{event}: {vc:?}"));
            }
        }
        Op::RecordWait { on, waiter, event } => {
            apply(m, &Op::Record { stream: on, event })?;
            apply(m, &Op::Wait { stream: waiter, event })?;
        }
        Op::ResetHighs { pool } => {
            let h = m.pools[pool_of(pool)].handle;
            for a in [RESERVED_HIGH, USED_HIGH] {
                acl(set_u64(h, a, 0), "aclrtMemPoolSetAttr(high, 0)")?;
            }
            let v = attrs(h)?;
            if v[5] != v[4] || v[7] != v[6] {
                return Err(format!("a reset high-water mark is not its current value: {v:?}"));
            }
        }
        Op::SyncStream { stream } => {
            let t = m.pick(stream);
            acl(aclrtSynchronizeStream(m.st(t).handle), "aclrtSynchronizeStream")?;
            let pos = m.st(t).tasks;
            m.observe(t, pos);
            released(m, "stream synchronised", None)?;
        }
        Op::SyncEvent { event } => {
            let ev = event_handle(m, event)?;
            acl(aclrtSynchronizeEvent(ev), "aclrtSynchronizeEvent")?;
            if let Some((_, Some((vc, _)))) = m.events[event as usize].clone() {
                for (inc, pos) in vc.0 {
                    m.observe(inc, pos);
                }
            }
            released(m, "event synchronised", None)?;
        }
        Op::SyncDevice => sync_device(m)?,
        Op::Trim { pool, mib } => {
            let p = pool_of(pool);
            let (h, max) = (m.pools[p].handle, m.pools[p].max);
            let n = u64::from(mib) * MIB_U;
            if n > max {
                m.must_fail(AclError::ERROR_INVALID_PARAM, "trim above the pool size", || {
                    aclrtMemPoolTrimTo(h, n as usize)
                })?;
            } else {
                acl(aclrtMemPoolTrimTo(h, n as usize), "aclrtMemPoolTrimTo")?;
                released(m, "trimmed", Some((p, n)))?;
            }
        }
        Op::SetReuse { pool, attr: a, on } => {
            let p = pool_of(pool);
            let a = a as usize % 3;
            let h = m.pools[p].handle;
            acl(set_u32(h, SWITCHES[a], if on { 7 } else { 0 }), "aclrtMemPoolSetAttr")?;
            m.pools[p].switches[a] = on;
        }
        Op::SetThreshold { pool, mib } => {
            let p = pool_of(pool);
            let (h, max) = (m.pools[p].handle, m.pools[p].max);
            let n = u64::from(mib) * MIB_U;
            if n > max {
                m.must_fail(
                    AclError::ERROR_INVALID_PARAM,
                    "threshold above the pool size",
                    || set_u64(h, THRESHOLD, n),
                )?;
            } else {
                acl(set_u64(h, THRESHOLD, n), "aclrtMemPoolSetAttr(threshold)")?;
                m.pools[p].threshold = n;
            }
        }
        Op::Sleep { stream, ms } => {
            let t = m.pick(stream);
            let d = Duration::from_millis(u64::from(ms));
            m.task(t, move || std::thread::sleep(d))?;
        }
        Op::HostSleep { ms } => std::thread::sleep(Duration::from_millis(u64::from(ms))),
        Op::DoubleFree { which, stream } => {
            let live: BTreeSet<u64> = m.live.iter().map(|l| l.ptr).collect();
            let cands: Vec<u64> =
                m.freed_ptrs.iter().copied().filter(|p| !live.contains(p)).collect();
            if cands.is_empty() {
                return Ok(());
            }
            let ptr = cands[which as usize % cands.len()];
            let h = m.st(m.pick(stream)).handle;
            m.must_fail(AclError::ERROR_INVALID_PARAM, "double free", || free(ptr, h))?;
            cover("(double free rejected)");
        }
        Op::InteriorFree { which, offset, stream } => {
            let cands: Vec<&Live> = m.live.iter().filter(|l| l.bytes >= 2).collect();
            if cands.is_empty() {
                return Ok(());
            }
            let l = cands[which as usize % cands.len()];
            let ptr = l.ptr + 1 + u64::from(offset) % (l.bytes - 1);
            let h = m.st(m.pick(stream)).handle;
            m.must_fail(AclError::ERROR_INVALID_PARAM, "interior free", || free(ptr, h))?;
            cover("(interior free rejected)");
        }
        Op::DestroyLivePool { pool } => {
            let p = pool_of(pool);
            if !m.live.iter().any(|l| l.pool == p) {
                return Ok(());
            }
            let h = m.pools[p].handle;
            m.must_fail(AclError::ERROR_INVALID_PARAM, "destroy with live allocations", || {
                aclrtMemPoolDestroy(h)
            })?;
            cover("(destroy of a live pool rejected)");
        }
        Op::ScratchPool { bytes, stream } => {
            let t = m.pick(stream);
            let s = m.st(t).handle;
            let h = try_pool(&props(64 << 20))
                .map_err(|e| format!("aclrtMemPoolCreate: {e} ({})", msg()))?;
            m.scratch = Some((h, Vec::new()));
            let alloc = |m: &mut Model, n: usize| {
                let p =
                    try_alloc(n, h, s).map_err(|e| format!("scratch alloc: {e} ({})", msg()))?;
                m.scratch.as_mut().expect("scratch").1.push(p);
                Ok::<u64, String>(p)
            };
            let a = alloc(m, bytes as usize)?;
            let before = attrs(h)?;
            m.must_fail(AclError::ERROR_INVALID_PARAM, "destroy of a scratch pool in use", || {
                aclrtMemPoolDestroy(h)
            })?;
            if attrs(h)? != before {
                return Err("a failed destroy changed the scratch pool".into());
            }
            let b = alloc(m, 512)?;
            acl(free(b, s), "scratch free")?;
            m.scratch.as_mut().expect("scratch").1.retain(|&p| p != b);
            acl(free(a, s), "scratch free")?;
            m.scratch.as_mut().expect("scratch").1.clear();
            acl(aclrtMemPoolDestroy(h), "aclrtMemPoolDestroy")?;
            // The destroy does not wait for the frees pending on `t` (the device gives their
            // memory back once they complete): it observes nothing.
            m.scratch = None;
            m.must_fail(AclError::ERROR_INVALID_PARAM, "free after pool destroy", || free(a, s))?;
            m.must_fail(AclError::ERROR_RT_INVALID_HANDLE, "alloc from a destroyed pool", || {
                try_alloc(512, h, s).err().unwrap_or(AclError::SUCCESS)
            })?;
        }
    }
    Ok(())
}

pub(crate) fn event_handle(m: &mut Model, event: u8) -> Result<aclrtEvent, String> {
    let i = event as usize;
    if m.events[i].is_none() {
        let mut e = std::ptr::null_mut();
        // SAFETY: valid out-pointer.
        acl(unsafe { aclrtCreateEvent(&mut e) }, "aclrtCreateEvent")?;
        m.events[i] = Some((e, None));
    }
    Ok(m.events[i].as_ref().expect("created").0)
}

/// `aclrtSynchronizeDevice` (then the release thresholds apply).
pub(crate) fn sync_device(m: &mut Model) -> Result<(), String> {
    acl(aclrtSynchronizeDevice(), "aclrtSynchronizeDevice")?;
    m.observe_all();
    released(m, "device synchronised", None)
}

/// After a synchronisation (`trim: None`: down to the release threshold) or a trim: a pool
/// without live allocations whose every free the host has observed complete holds at most
/// the threshold / the trim's bytes to keep.
///
/// Observed here means strictly after the free: a stream synchronisation or an event record
/// at a position above the free's (after its marker), or the stream destroyed. (The model's
/// positions miss waits and inserted tasks, and the engine may learn of a completion later
/// than a host function runs, so neither `>=` nor the markers are evidence enough.)
pub(crate) fn released(m: &Model, what: &str, trim: Option<(usize, u64)>) -> Result<(), String> {
    let complete = |f: &Freed| m.observed(f.inc) > f.pos;
    for (p, pool) in m.pools.iter().enumerate() {
        if trim.is_some_and(|(q, _)| q != p) || m.live.iter().any(|l| l.pool == p) {
            continue;
        }
        if !m.freed[p].iter().all(complete) {
            continue;
        }
        // A trim keeps at least its argument rounded up to the granularity (CUDA's and
        // CANN's `minBytesToKeep`, docs/c-api.md); the threshold releases down to itself.
        let bound = trim.map_or(pool.threshold, |(_, n)| n.next_multiple_of(GRANULE));
        let r = attr(pool.handle, RESERVED)?;
        if r > bound {
            return Err(format!(
                "pool {p}: no live allocation, every free completed, {what}: reserved {r} > {bound} \
                 (threshold {})",
                pool.threshold
            ));
        }
    }
    Ok(())
}

pub(crate) fn check(m: &mut Model) -> Result<(), String> {
    let mut all: Vec<&Live> = m.live.iter().collect();
    all.sort_by_key(|l| l.ptr);
    for w in all.windows(2) {
        if w[0].ptr + w[0].size > w[1].ptr {
            return Err(format!("live allocations overlap: {:?} and {:?}", w[0], w[1]));
        }
    }
    m.note_reserved()?;
    for (p, pool) in m.pools.iter().enumerate() {
        let v = attrs(pool.handle)?;
        let [follow, opp, internal, threshold, reserved, reserved_high, used, used_high] = v[..]
        else {
            unreachable!()
        };
        let want_used: u64 = m.live.iter().filter(|l| l.pool == p).map(|l| l.size).sum();
        let bad = |what: String| Err(format!("pool {p}: {what}; attributes {v:?}"));
        if used != want_used {
            return bad(format!("USED {used} != Σ live sizes rounded to 512 B {want_used}"));
        }
        if reserved < used || reserved > pool.max || reserved % GRANULE != 0 {
            return bad(format!("RESERVED {reserved} not a granule multiple in [USED, max]"));
        }
        if reserved_high < reserved || used_high < used {
            return bad("a high-water mark below its current value".into());
        }
        let sw = pool.switches.map(u64::from);
        if [follow, opp, internal] != sw || threshold != pool.threshold {
            return bad(format!("switches / threshold read back, model {sw:?} {}", pool.threshold));
        }
    }
    let v = m.violations.lock().unwrap_or_else(|e| e.into_inner());
    if !v.is_empty() {
        return Err(format!("ordering violations: {v:?}"));
    }
    Ok(())
}

/// Frees everything, synchronises, trims, destroys the pools, streams and events; checks
/// that the memory went back and that the destroyed pools' pointers are rejected.
pub(crate) fn finish(m: &mut Model) -> Result<(), String> {
    while !m.live.is_empty() {
        apply(m, &Op::Free { which: 0, stream: 0 })?;
    }
    sync_device(m)?;
    check(m)?;
    for (p, pool) in m.pools.iter().enumerate() {
        acl(aclrtMemPoolTrimTo(pool.handle, 0), "aclrtMemPoolTrimTo(0)")?;
        let v = attrs(pool.handle)?;
        if v[4] != 0 || v[6] != 0 {
            return Err(format!("pool {p} holds memory after free all + sync + trim: {v:?}"));
        }
    }
    for p in std::mem::take(&mut m.pools) {
        acl(aclrtMemPoolDestroy(p.handle), "aclrtMemPoolDestroy")?;
    }
    if let Some(&ptr) = m.freed_ptrs.last() {
        fails_now(free(ptr, std::ptr::null_mut()), "free after the pool was destroyed")?;
    }
    let v = m.violations.lock().unwrap_or_else(|e| e.into_inner());
    if !v.is_empty() {
        return Err(format!("ordering violations: {v:?}"));
    }
    Ok(())
}

pub(crate) fn fails_now(e: AclError, what: &str) -> Result<(), String> {
    if e != AclError::ERROR_INVALID_PARAM {
        return Err(format!("{what}: returned {e}, expected ERROR_INVALID_PARAM"));
    }
    Ok(())
}

/// Releases what a case created, whatever happened.
pub(crate) fn teardown(m: &mut Model) {
    let _ = aclrtSynchronizeDevice();
    for l in std::mem::take(&mut m.live) {
        let _ = free(l.ptr, std::ptr::null_mut());
    }
    if let Some((h, ptrs)) = m.scratch.take() {
        for p in ptrs {
            let _ = free(p, std::ptr::null_mut());
        }
        let _ = aclrtSynchronizeDevice();
        let _ = aclrtMemPoolDestroy(h);
    }
    let _ = aclrtSynchronizeDevice();
    for p in std::mem::take(&mut m.pools) {
        let _ = aclrtMemPoolDestroy(p.handle);
    }
    for (_, s) in std::mem::take(&mut m.streams) {
        if !s.handle.is_null() {
            let _ = aclrtDestroyStream(s.handle);
        }
    }
    for (e, _) in m.events.drain(..).flatten() {
        let _ = aclrtDestroyEvent(e);
    }
}
