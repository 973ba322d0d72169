//! The shadow model's own bookkeeping: what it expects of each call, and how a reuse is
//! justified.

use super::*;

impl fmt::Debug for Freed {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "Freed {{ {:#x}..{:#x}, inc {}, pos {}, epoch {} }}",
            self.start, self.end, self.inc, self.pos, self.epoch
        )
    }
}

impl fmt::Debug for Live {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Live {{ p{} {:#x}+{} ({} B) }}", self.pool, self.ptr, self.size, self.bytes)
    }
}

impl Model {
    pub(crate) fn new() -> Result<Model, String> {
        let mut pools = Vec::new();
        for max in POOL_MAX {
            let h = try_pool(&props(max as usize))
                .map_err(|e| format!("aclrtMemPoolCreate: {e} ({})", msg()))?;
            pools.push(PoolState {
                handle: h,
                max,
                switches: [false; 3],
                threshold: 0,
                last_reserved: 0,
                epoch: 0,
            });
        }
        let mut m = Model {
            slots: vec![None; SLOTS as usize],
            streams: BTreeMap::new(),
            destroyed: BTreeSet::new(),
            observed: BTreeMap::new(),
            next_inc: 0,
            events: (0..EVENTS).map(|_| None).collect(),
            pools,
            live: Vec::new(),
            freed: vec![Vec::new(); POOL_MAX.len()],
            freed_ptrs: Vec::new(),
            violations: Arc::new(Mutex::new(Vec::new())),
            log: Vec::new(),
            used: BTreeSet::new(),
            scratch: None,
            strict_recycling: false,
            seq: 0,
        };
        m.add_stream(0, std::ptr::null_mut());
        Ok(m)
    }

    pub(crate) fn add_stream(&mut self, slot: usize, handle: aclrtStream) {
        let inc = self.next_inc;
        self.next_inc += 1;
        self.slots[slot] = Some(inc);
        self.streams.insert(
            inc,
            StreamState {
                handle,
                inc,
                tasks: 0,
                done: Arc::new(AtomicU64::new(0)),
                vc: Vc::default(),
                mvc: Vc::default(),
            },
        );
    }

    /// The live stream at `slot`, else the next live one (slot 0 always is).
    pub(crate) fn pick(&self, slot: u8) -> Inc {
        let n = SLOTS as usize;
        (0..n).find_map(|i| self.slots[(slot as usize + i) % n]).expect("slot 0 is live")
    }

    pub(crate) fn st(&self, inc: Inc) -> &StreamState {
        &self.streams[&inc]
    }

    pub(crate) fn st_mut(&mut self, inc: Inc) -> &mut StreamState {
        self.streams.get_mut(&inc).expect("live stream")
    }

    pub(crate) fn observe(&mut self, inc: Inc, pos: u64) {
        let e = self.observed.entry(inc).or_insert(pos);
        *e = (*e).max(pos);
    }

    pub(crate) fn observe_all(&mut self) {
        let all: Vec<(Inc, u64)> = self.streams.values().map(|s| (s.inc, s.tasks)).collect();
        for (inc, pos) in all {
            self.observe(inc, pos);
        }
    }

    pub(crate) fn observed(&self, inc: Inc) -> u64 {
        if self.destroyed.contains(&inc) {
            u64::MAX
        } else {
            self.observed.get(&inc).copied().unwrap_or(0)
        }
    }

    /// Has the free `f` completed (its marker ran)? Waits up to `grace` for it.
    pub(crate) fn completed(&self, f: &Freed, grace: Duration) -> bool {
        let Some(s) = self.streams.get(&f.inc) else { return true }; // destroyed: drained
        let deadline = Instant::now() + grace;
        loop {
            if s.done.load(Ordering::SeqCst) > f.pos {
                return true;
            }
            if Instant::now() >= deadline {
                return false;
            }
            std::thread::sleep(Duration::from_micros(200));
        }
    }

    /// Enqueues the model's own task `f` on `inc` (counted as one position).
    /// When it has run it publishes its position in the stream's `done`.
    pub(crate) fn task(
        &mut self,
        inc: Inc,
        f: impl FnOnce() + Send + 'static,
    ) -> Result<(), String> {
        let s = self.st(inc);
        let (h, pos, done) = (s.handle, s.tasks + 1, Arc::clone(&s.done));
        let f = move || {
            f();
            done.fetch_max(pos, Ordering::SeqCst);
        };
        acl(launch(h, f), "aclrtLaunchHostFunc")?;
        self.st_mut(inc).tasks += 1;
        Ok(())
    }

    /// Why the new allocation on `t` may overlap the freed range `f`; `Ok(None)` if no
    /// enabled rule allows it. Permissive where the engine is conservative, never beyond
    /// what is safe:
    /// * same stream; host observed (a synchronisation covering `m`, or the stream was
    ///   destroyed); follow event dependencies (if on): `t`'s clock covers `m` (a record
    ///   right before the free, with no task between, counts: as safe as one after it);
    /// * opportunistic (if on) or recycled (RESERVED went down since the free: remapped
    ///   memory is fresh): the free has completed — checked after the call returned, with a
    ///   grace period, since the model sees completion only through its marker (the task
    ///   right after the free);
    /// * internal dependencies (if on), or rule 2 through a wait the pool may have inserted
    ///   earlier: accepted, and a host function on `t` then checks the free's marker ran.
    pub(crate) fn justify(
        &self,
        f: &Freed,
        t: Inc,
        sw: [bool; 3],
        epoch: u64,
        free_granules: bool,
    ) -> Option<&'static str> {
        let ts = self.st(t);
        if f.inc == t {
            return Some("same stream");
        }
        if self.observed(f.inc) >= f.pos {
            return Some("host observed");
        }
        if sw[0] && ts.vc.get(f.inc) >= f.pos {
            return Some("event dependency");
        }
        let by_completion = sw[1] || epoch > f.epoch;
        let why_done = if sw[1] { "opportunistic" } else { "recycled" };
        // Before the verified rules: a reuse the engine made because the free had completed
        // must not be verified as an inserted wait (the marker may run a moment late).
        if by_completion && self.completed(f, GRACE) {
            return Some(why_done);
        }
        // Complete frees in granules without live allocations may have been recycled
        // (unmapped) meanwhile; their addresses are then fresh address space for every
        // stream (docs/semantics.md). `strict_recycling` rejects it.
        if !self.strict_recycling && free_granules && self.completed(f, GRACE) {
            return Some("recycled address space (complete, unmapped, mapped again)");
        }
        if sw[2] {
            return Some("internal dependency (verified)");
        }
        if sw[0] && ts.mvc.get(f.inc) >= f.pos {
            return Some("event dependency through an inserted wait (verified)");
        }
        None
    }

    /// Reads RESERVED of every pool and bumps a pool's epoch when it went down.
    pub(crate) fn note_reserved(&mut self) -> Result<(), String> {
        for p in &mut self.pools {
            let r = attr(p.handle, RESERVED)?;
            if r < p.last_reserved {
                p.epoch += 1;
            }
            p.last_reserved = r;
        }
        Ok(())
    }

    pub(crate) fn all_attrs(&self) -> Result<Vec<Vec<u64>>, String> {
        self.pools.iter().map(|p| attrs(p.handle)).collect()
    }

    /// Calls `f`, expecting `want`, and checks that no attribute of any pool changed.
    pub(crate) fn must_fail(
        &self,
        want: AclError,
        what: &str,
        f: impl FnOnce() -> AclError,
    ) -> Result<(), String> {
        let before = self.all_attrs()?;
        let e = f();
        if e != want {
            return Err(format!("{what}: returned {e}, expected {want} ({})", msg()));
        }
        if msg().is_empty() {
            return Err(format!("{what}: no error message"));
        }
        let after = self.all_attrs()?;
        if before != after {
            return Err(format!("{what}: attributes changed: {before:?} -> {after:?}"));
        }
        Ok(())
    }
}
