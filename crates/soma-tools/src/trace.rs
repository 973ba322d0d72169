//! Allocator traces: `op,id,bytes,stream` CSV files (format in `data/traces/README.md`), plain
//! or gzipped (`.csv.gz`).
//!
//! A trace is turned into a sequence of [`Op`]s over dense *slots*: the `k`-th allocation of
//! the trace gets slot `k`, and its free names the same slot. Replays keep one handle per slot
//! in a `Vec`, so the replay loop does no hashing.

use std::collections::HashMap;
use std::io::Read;
use std::path::{Path, PathBuf};

/// One allocator event over dense slots.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    /// Allocate `bytes` (> 0) into `slot` (every slot is allocated exactly once).
    Alloc {
        /// Dense index of the allocation (0, 1, 2, … in allocation order).
        slot: u32,
        /// Requested bytes, as in the trace (not rounded).
        bytes: u64,
    },
    /// Free the live allocation in `slot`.
    Free {
        /// The slot of an earlier, still live allocation.
        slot: u32,
    },
}

/// Facts about an op sequence, recomputed from the ops.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TraceStats {
    /// Number of ops (allocations + frees).
    pub events: u64,
    /// Allocations.
    pub allocs: u64,
    /// Frees.
    pub frees: u64,
    /// Largest sum of requested live bytes at any point.
    pub peak_live_bytes: u64,
    /// Most live allocations at once.
    pub max_live_count: u64,
    /// Allocations still live at the end.
    pub live_at_end: u64,
}

impl TraceStats {
    /// Computes the statistics of `ops` (which must be well formed, see [`validate`]).
    pub fn of(ops: &[Op]) -> TraceStats {
        let mut sizes: Vec<u64> = Vec::new();
        let (mut live, mut live_count) = (0u64, 0u64);
        let mut s = TraceStats { events: ops.len() as u64, ..TraceStats::default() };
        for op in ops {
            match *op {
                Op::Alloc { slot, bytes } => {
                    let slot = slot as usize;
                    if sizes.len() <= slot {
                        sizes.resize(slot + 1, 0);
                    }
                    sizes[slot] = bytes;
                    // Saturating: a trace of absurd sizes fails at replay, not here.
                    live = live.saturating_add(bytes);
                    live_count += 1;
                    s.allocs += 1;
                    s.peak_live_bytes = s.peak_live_bytes.max(live);
                    s.max_live_count = s.max_live_count.max(live_count);
                }
                Op::Free { slot } => {
                    live = live.saturating_sub(sizes[slot as usize]);
                    live_count -= 1;
                    s.frees += 1;
                }
            }
        }
        s.live_at_end = live_count;
        s
    }
}

/// A parsed trace.
#[derive(Clone, Debug)]
pub struct Trace {
    /// File name without `.csv` / `.csv.gz`.
    pub name: String,
    /// The events in program order.
    pub ops: Vec<Op>,
    /// The `stream` column of each event (parallel to `ops`).
    pub streams: Vec<u32>,
    /// Number of slots (= allocations).
    pub slots: usize,
    /// Statistics recomputed from the ops.
    pub stats: TraceStats,
}

impl Trace {
    /// Parses trace text. Errors name the offending line.
    ///
    /// # Errors
    /// A wrong header, a malformed line, an unknown op, a zero-byte allocation, a free that
    /// carries bytes, a reused id, or a free of an id that is not live.
    pub fn parse(name: &str, text: &str) -> Result<Trace, String> {
        let mut lines = text.lines();
        match lines.next() {
            Some(h) if h.trim_end() == "op,id,bytes,stream" => {}
            Some(other) => {
                return Err(format!("line 1: bad header {other:?}, expected `op,id,bytes,stream`"))
            }
            None => return Err("empty file: expected the header `op,id,bytes,stream`".into()),
        }
        let mut ops = Vec::new();
        let mut streams = Vec::new();
        // id -> (slot, live)
        let mut ids: HashMap<u64, (u32, bool)> = HashMap::new();
        for (n, line) in lines.enumerate() {
            let line_no = n + 2;
            let line = line.trim_end();
            if line.is_empty() {
                continue;
            }
            let mut f = line.split(',');
            let (Some(op), Some(id), Some(bytes), Some(stream), None) =
                (f.next(), f.next(), f.next(), f.next(), f.next())
            else {
                return Err(format!("line {line_no}: expected 4 fields: {line}"));
            };
            let num = |s: &str, what: &str| {
                s.parse::<u64>().map_err(|e| format!("line {line_no}: bad {what} {s:?}: {e}"))
            };
            let id = num(id, "id")?;
            let bytes = num(bytes, "bytes")?;
            let stream = u32::try_from(num(stream, "stream")?)
                .map_err(|_| format!("line {line_no}: stream out of range"))?;
            match op {
                "a" => {
                    if bytes == 0 {
                        return Err(format!("line {line_no}: allocation of 0 bytes"));
                    }
                    let slot = u32::try_from(ids.len())
                        .map_err(|_| format!("line {line_no}: too many allocations"))?;
                    if ids.insert(id, (slot, true)).is_some() {
                        return Err(format!("line {line_no}: id {id} allocated twice"));
                    }
                    ops.push(Op::Alloc { slot, bytes });
                }
                "f" => {
                    if bytes != 0 {
                        return Err(format!("line {line_no}: a free carries 0 bytes, not {bytes}"));
                    }
                    let Some(entry) = ids.get_mut(&id) else {
                        return Err(format!("line {line_no}: free of unknown id {id}"));
                    };
                    if !entry.1 {
                        return Err(format!("line {line_no}: double free of id {id}"));
                    }
                    entry.1 = false;
                    ops.push(Op::Free { slot: entry.0 });
                }
                other => return Err(format!("line {line_no}: unknown op {other:?}")),
            }
            streams.push(stream);
        }
        let stats = TraceStats::of(&ops);
        Ok(Trace { name: name.to_string(), slots: ids.len(), ops, streams, stats })
    }

    /// Reads and parses a `.csv` or `.csv.gz` file.
    ///
    /// # Errors
    /// I/O and decompression errors, and everything [`Trace::parse`] rejects.
    pub fn load(path: &Path) -> Result<Trace, String> {
        let raw = std::fs::read(path).map_err(|e| format!("{}: {e}", path.display()))?;
        let file = path.file_name().map(|f| f.to_string_lossy().into_owned()).unwrap_or_default();
        let text = if file.ends_with(".gz") {
            let mut s = String::new();
            // Every member: `make_traces.py` writes one, but a concatenation is a valid gzip file.
            flate2::read::MultiGzDecoder::new(&raw[..])
                .read_to_string(&mut s)
                .map_err(|e| format!("{}: gunzip: {e}", path.display()))?;
            s
        } else {
            String::from_utf8(raw).map_err(|e| format!("{}: not UTF-8: {e}", path.display()))?
        };
        let name = file.trim_end_matches(".gz").trim_end_matches(".csv").to_string();
        Trace::parse(&name, &text).map_err(|e| format!("{}: {e}", path.display()))
    }
}

/// Checks that `ops` is well formed: slots allocated once, freed at most once, only while live.
///
/// # Errors
/// The index of the first bad op.
pub fn validate(ops: &[Op]) -> Result<(), String> {
    let mut state: Vec<u8> = Vec::new(); // 0 never, 1 live, 2 freed
    for (i, op) in ops.iter().enumerate() {
        match *op {
            Op::Alloc { slot, bytes } => {
                let slot = slot as usize;
                if state.len() <= slot {
                    state.resize(slot + 1, 0);
                }
                if state[slot] != 0 || bytes == 0 {
                    return Err(format!("op {i}: bad allocation of slot {slot}"));
                }
                state[slot] = 1;
            }
            Op::Free { slot } => {
                if state.get(slot as usize) != Some(&1) {
                    return Err(format!("op {i}: free of slot {slot} that is not live"));
                }
                state[slot as usize] = 2;
            }
        }
    }
    Ok(())
}

/// The trace files (`*.csv`, `*.csv.gz`) of `dir`, sorted by name; `Err` with the reason to
/// print when the directory is absent or holds none.
///
/// # Errors
/// The directory is missing or unreadable, or contains no trace.
pub fn find_traces(dir: &Path) -> Result<Vec<PathBuf>, String> {
    let rd = std::fs::read_dir(dir)
        .map_err(|e| format!("trace directory {} is absent ({e})", dir.display()))?;
    let mut paths: Vec<PathBuf> = rd
        .filter_map(|d| d.ok().map(|d| d.path()))
        .filter(|p| {
            let n = p.file_name().map(|f| f.to_string_lossy().into_owned()).unwrap_or_default();
            n.ends_with(".csv") || n.ends_with(".csv.gz")
        })
        .collect();
    paths.sort();
    // A trace present both plain and gzipped is replayed once (the plain file).
    let names: Vec<String> =
        paths.iter().map(|p| p.file_name().unwrap_or_default().to_string_lossy().into()).collect();
    paths.retain(|p| {
        let n = p.file_name().unwrap_or_default().to_string_lossy().into_owned();
        !(n.ends_with(".csv.gz") && names.contains(&n.trim_end_matches(".gz").to_string()))
    });
    if paths.is_empty() {
        return Err(format!("no *.csv or *.csv.gz trace in {}", dir.display()));
    }
    Ok(paths)
}

/// The directory of the traces distributed with the workspace: `data/traces` under the
/// workspace root (`root`).
pub fn bundled_trace_dir(root: &Path) -> PathBuf {
    root.join("data").join("traces")
}

/// The trace directory the benches and tools use: `$SOMA_TRACES`, else the bundled traces
/// ([`bundled_trace_dir`]) of the workspace root (`root`).
pub fn default_trace_dir(root: &Path) -> PathBuf {
    std::env::var_os("SOMA_TRACES").map(PathBuf::from).unwrap_or_else(|| bundled_trace_dir(root))
}

#[cfg(test)]
mod tests {
    use super::*;

    const SMALL: &str = "op,id,bytes,stream\na,0,100,0\na,1,50,0\nf,0,0,0\na,2,70,0\nf,2,0,0\n";

    #[test]
    fn parses_and_counts() {
        let t = Trace::parse("small", SMALL).unwrap();
        assert_eq!(
            t.ops,
            vec![
                Op::Alloc { slot: 0, bytes: 100 },
                Op::Alloc { slot: 1, bytes: 50 },
                Op::Free { slot: 0 },
                Op::Alloc { slot: 2, bytes: 70 },
                Op::Free { slot: 2 },
            ]
        );
        assert_eq!(t.slots, 3);
        assert_eq!(t.streams, vec![0; 5]);
        assert_eq!(
            t.stats,
            TraceStats {
                events: 5,
                allocs: 3,
                frees: 2,
                peak_live_bytes: 150,
                max_live_count: 2,
                live_at_end: 1
            }
        );
        validate(&t.ops).unwrap();
    }

    #[test]
    fn ids_need_not_be_dense() {
        let t = Trace::parse("x", "op,id,bytes,stream\na,7,1,0\na,3,2,0\nf,7,0,0\n").unwrap();
        assert_eq!(t.ops[2], Op::Free { slot: 0 });
    }

    #[test]
    fn rejects_bad_input() {
        for bad in [
            "op,id,bytes\na,0,1,0\n",
            "op,id,bytes,stream\na,0,0,0\n",
            "op,id,bytes,stream\na,0,1\n",
            "op,id,bytes,stream\nx,0,1,0\n",
            "op,id,bytes,stream\nf,0,0,0\n",
            "op,id,bytes,stream\na,0,1,0\nf,0,0,0\nf,0,0,0\n",
            "op,id,bytes,stream\na,0,1,0\na,0,1,0\n",
            "op,id,bytes,stream\na,0,-1,0\n",
            "op,id,bytes,stream\na,0,10,0\nf,0,7,0\n",
            "",
        ] {
            assert!(Trace::parse("bad", bad).is_err(), "{bad:?}");
        }
        assert!(validate(&[Op::Free { slot: 0 }]).is_err());
        assert!(Trace::parse("empty", "").unwrap_err().contains("empty file"));
    }

    /// Sizes whose sum overflows are counted (saturating), not a panic in a debug build.
    #[test]
    fn huge_sizes_do_not_overflow_the_statistics() {
        let text =
            format!("op,id,bytes,stream\na,0,{max},0\na,1,{max},0\nf,0,0,0\n", max = u64::MAX);
        let t = Trace::parse("huge", &text).unwrap();
        assert_eq!(t.stats.peak_live_bytes, u64::MAX);
    }

    /// A gzip file of several members (a concatenation) is read whole.
    #[test]
    fn loads_every_member_of_a_gzip_file() {
        use std::io::Write;
        let dir = std::env::temp_dir().join(format!("soma-tools-multigz-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let (head, tail) = SMALL.split_at(SMALL.find("f,0").unwrap());
        let mut bytes = Vec::new();
        for part in [head, tail] {
            let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
            gz.write_all(part.as_bytes()).unwrap();
            bytes.extend(gz.finish().unwrap());
        }
        let path = dir.join("multi.csv.gz");
        std::fs::write(&path, bytes).unwrap();
        let t = Trace::load(&path).unwrap();
        assert_eq!(t.ops, Trace::parse("small", SMALL).unwrap().ops);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn loads_gzip_and_plain() {
        use std::io::Write;
        let dir = std::env::temp_dir().join(format!("soma-tools-trace-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("a.csv"), SMALL).unwrap();
        let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        gz.write_all(SMALL.as_bytes()).unwrap();
        std::fs::write(dir.join("b.csv.gz"), gz.finish().unwrap()).unwrap();
        std::fs::write(dir.join("a.csv.gz"), b"ignored: a.csv wins").unwrap();
        let found = find_traces(&dir).unwrap();
        assert_eq!(found.len(), 2);
        let a = Trace::load(&found[0]).unwrap();
        let b = Trace::load(&found[1]).unwrap();
        assert_eq!((a.name.as_str(), b.name.as_str()), ("a", "b"));
        assert_eq!(a.ops, b.ops);
        std::fs::remove_dir_all(&dir).unwrap();
        assert!(find_traces(&dir).is_err());
    }

    /// The bundled traces are all there and match the statistics their README documents.
    #[test]
    fn bundled_traces_match_their_readme() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
        let paths = find_traces(&bundled_trace_dir(&root)).unwrap();
        let mut names = Vec::new();
        for p in paths {
            let t = Trace::load(&p).unwrap();
            validate(&t.ops).unwrap();
            let (events, peak, max_live, at_end) = match t.name.as_str() {
                "bert_base_infer" => (9_321, 578_544_704, 215, 201),
                "gpt2_small_infer" => (53_970, 533_941_260, 190, 148),
                "gpt2_small_train" => (27_674, 5_918_590_840, 917, 740),
                "llama_tinyllama_infer" => (86_995, 2_237_464_832, 265, 203),
                other => panic!("{other}: a trace the README does not list"),
            };
            let s = t.stats;
            assert_eq!(
                (s.events, s.peak_live_bytes, s.max_live_count, s.live_at_end),
                (events, peak, max_live, at_end),
                "{}",
                t.name
            );
            names.push(t.name);
        }
        assert_eq!(
            names,
            ["bert_base_infer", "gpt2_small_infer", "gpt2_small_train", "llama_tinyllama_infer"]
        );
    }

    /// `$SOMA_TRACES` names another directory; without it the bundled one is used.
    #[test]
    fn trace_dir_defaults_to_the_bundled_traces() {
        let root = Path::new("checkout");
        let expected =
            std::env::var_os("SOMA_TRACES").map_or_else(|| root.join("data/traces"), PathBuf::from);
        assert_eq!(default_trace_dir(root), expected);
    }
}
