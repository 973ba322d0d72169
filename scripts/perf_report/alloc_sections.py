"""Sections 1 and 2 of docs/performance.md: the hot path and RMM's random_allocations."""

from .common import (ALLOCATORS, BASELINES, MIB, PAIRED, PAIRED_BASELINES, VARIANTS,
                     VARIANTS_API_FIRST, cell_label, fmt_ns, fmt_ratio, load_json, median,
                     ratio, verdict)

# Columns of the cold random_allocations table.
COLD = VARIANTS_API_FIRST + ["tlsf"]
LIVES = ["64", "10000", "1000000"]


def hot_path(target, crit):
    """The hot-path table, its targets and the instruction counts (`crit`: mean ns)."""
    L = []
    w = L.append
    w("| allocator | 64 live | 10 000 live | 1 000 000 live | 1M / 64 | vs offset-allocator (64 / 10k / 1M) |")
    w("|---|---:|---:|---:|---:|---|")
    hot = {a: [crit.get(("hot", a, v)) for v in LIVES] for a in ALLOCATORS}
    oa = hot["offset-allocator"]
    for a in ALLOCATORS:
        row = hot[a]
        if all(x is None for x in row):
            continue
        vs = " / ".join(fmt_ratio(ratio(row[i], oa[i])) for i in range(3))
        w(f"| `{a}` | {' | '.join(fmt_ns(x) for x in row)} | {fmt_ratio(ratio(row[2], row[0]))} "
          f"| {vs} |")
    w("")
    api = hot["soma"]
    if None not in api and None not in oa:
        worst = max(ratio(api[i], oa[i]) for i in range(3))
        flat = api[2] / api[0]
        spread = max(api) / min(api)
        w(f"- Target: public API ≤ 2× offset-allocator's pair — {verdict(worst <= 2)} "
          f"(worst {worst:.2f}×).")
        w(f"- Target: flat, ≤ 1.3× between 64 and 1 000 000 live blocks — "
          f"{verdict(flat <= 1.3)} (1 000 000 / 64 = {flat:.2f}×; max/min over all three "
          f"columns {spread:.2f}×, offset-allocator's own {max(oa) / min(oa):.2f}×: the "
          f"columns are measured minutes apart on a shared machine).")
    eng = hot["soma-engine"]
    if None not in eng and None not in oa:
        w(f"- The engine alone: {fmt_ratio(max(ratio(eng[i], oa[i]) for i in range(3)))} "
          "offset-allocator at worst.")
    cg = load_json(target, "callgrind")
    if cg:
        w("")
        w("Instructions per pair (`valgrind --tool=callgrind`, `soma-hotpath ALLOC 64 N`, "
          "difference of N = 20 000 and N = 10 000, divided by 10 000):")
        w("")
        w("| allocator | Ir / pair |")
        w("|---|---:|")
        for a, v in cg.items():
            w(f"| `{a}` | {v:.0f} |")
    return "\n".join(L)


def _paired_table(w, cells):
    """random_allocations' interleaved rounds: per cell, each allocator's median ns per op and
    the median over rounds of each variant's ratio to the fastest baseline of the same round."""
    rows = []
    for c in cells:
        p = c.get("paired_ns_per_op") or {}
        rounds = min((len(v) for v in p.values()), default=0)
        base = [b for b in PAIRED_BASELINES if b in p]
        if rounds == 0 or not base:
            continue
        fastest = [min(p[b][r] for b in base) for r in range(rounds)]
        ratios, beats = {}, {}
        for a in VARIANTS:
            if a not in p:
                continue
            rs = [p[a][r] / fastest[r] for r in range(rounds) if fastest[r] > 0]
            ratios[a] = (median(rs), min(rs), max(rs))
            if "soma-replica" in p:
                beats[a] = median([p[a][r] / p["soma-replica"][r] for r in range(rounds)
                                   if p["soma-replica"][r] > 0]) < 1
        rows.append((c, p, rounds, ratios, beats))
    if not rows:
        return
    w("Interleaved rounds: after criterion, the cell's allocators (all but the first-fit free "
      "list and the driver path) replay in rounds, one timed warm replay each per round, the "
      "order rotating from round to round; a ratio is taken within a round (the same minutes "
      "of the machine) and the table gives its median over the rounds, with the range. On a "
      "shared machine the ratio of two criterion means taken minutes apart moves by ±30–50 % "
      "from run to run; the within-round ratio moves far less, so **the targets below are "
      "judged on these medians**. ns per op = the median over the rounds.")
    w("")
    w("| n × max MiB | rounds | " + " | ".join(f"`{a}`" for a in PAIRED) + " | " +
      " | ".join(f"{a} / fastest baseline" for a in VARIANTS) + " |")
    w("|---|---:|" + "---:|" * (len(PAIRED) + len(VARIANTS)))
    for c, p, rounds, ratios, _ in rows:
        def cellr(a, ratios=ratios):
            if a not in ratios:
                return "—"
            m, lo, hi = ratios[a]
            return f"{m:.2f}× ({lo:.2f}–{hi:.2f})"
        w(f"| {cell_label(c['cell'])} | {rounds} | " +
          " | ".join(fmt_ns(median(p[a])) if a in p else "—" for a in PAIRED) + " | " +
          " | ".join(cellr(a) for a in VARIANTS) + " |")
    w("")
    for a in VARIANTS:
        rs = [(c["cell"], ratios[a][0], beats.get(a, True)) for c, _, _, ratios, beats in rows
              if a in ratios]
        if not rs:
            continue
        within = sum(1 for _, r, _ in rs if r <= 1.5)
        ok = all(r <= 1.5 and b for _, r, b in rs)
        worst = max(rs, key=lambda x: x[1])
        slower = [cell for cell, _, b in rs if not b]
        part = (f"; slower than soma-replica at {', '.join(slower)}" if slower else "")
        w(f"- Target (`{a}`, interleaved medians): every cell faster than soma-replica and "
          f"within 1.5× of the fastest baseline — {verdict(ok)} ({within} of {len(rs)} cells "
          f"within 1.5×, worst {worst[1]:.2f}× at {worst[0]}{part}).")
    w("")


def random_allocations(target, crit):
    """The warm, interleaved, cold, driver-call and memory tables of random_allocations."""
    L = []
    w = L.append
    cells = load_json(target, "random_allocations") or []
    if not cells:
        return "Not measured: no `random_allocations.json` in the benches' output."
    slow_rows = load_json(target, "random_allocations_slow") or []
    slow = {(r["allocator"], r["cell"]): r["ns_per_op"] for r in slow_rows}
    slow_cold = {(r["allocator"], r["cell"]): r["cold_ns_per_op"] for r in slow_rows
                 if "cold_ns_per_op" in r}

    def warm(a, cell):
        # A slow entry is the latest measurement of its pair (every run that measures a pair
        # replaces or drops its entry), so it wins over a criterion estimate left by an
        # earlier run.
        if (a, cell) in slow:
            return slow[(a, cell)]
        return crit.get(("random_allocations", a, cell))

    def cold(c, a):
        v = (c.get("cold_ns_per_op") or {}).get(a)
        return v if v is not None else slow_cold.get((a, c["cell"]))

    w("| n × max MiB | ops | " + " | ".join(f"`{a}`" for a in ALLOCATORS) + " | " +
      " | ".join(f"{a} / fastest baseline" for a in VARIANTS) + " |")
    w("|---|---:|" + "---:|" * len(ALLOCATORS) + "---:|" * len(VARIANTS))
    rel = {a: [] for a in VARIANTS}  # (cell, ratio to fastest baseline, beats both slow ones)
    for c in cells:
        cell = c["cell"]
        v = {a: warm(a, cell) for a in ALLOCATORS}
        base = [v[b] for b in BASELINES if v[b] is not None]
        fastest = min(base) if base else None
        slower = [v[b] for b in ("soma-replica", "first-fit") if v[b] is not None]
        ratios = []
        for a in VARIANTS:
            r = ratio(v[a], fastest)
            ratios.append(r)
            if r is not None:
                rel[a].append((cell, r, all(v[a] < x for x in slower)))
        w(f"| {cell_label(cell)} | {c['ops']} | " +
          " | ".join(fmt_ns(v[a]) + (" †" if (a, cell) in slow else "") for a in ALLOCATORS) +
          " | " + " | ".join(fmt_ratio(r) for r in ratios) + " |")
    w("")
    if slow:
        w("† slower than the bench's limit (1.5 s per replay; 0.3 s with `SOMA_BENCH_QUICK=1`) "
          "for criterion's 10 samples: the second (warm) replay on the instance, timed once "
          "(see `random_allocations_slow.json`, which also holds the first replay's time).")
        w("")
    for a in VARIANTS:
        rs = rel[a]
        if not rs:
            w(f"- Target (`{a}`): every cell faster than soma-replica and first-fit and "
              "within 1.5× of the fastest baseline — not measured.")
            continue
        ok = all(r <= 1.5 and beats for _, r, beats in rs)
        worst = max(rs, key=lambda x: x[1])
        part = "" if len(rs) == len(cells) else f"; {len(rs)} of {len(cells)} cells measured"
        w(f"- Target (`{a}`): every cell faster than soma-replica and first-fit and within "
          f"1.5× of the fastest baseline — {verdict(ok)} (worst {worst[1]:.1f}× at "
          f"{worst[0]}{part}).")
    w("")
    _paired_table(w, cells)
    w("Cold: ns per op of the first replay on a fresh allocator (one replay, timed once, "
      "before criterion's iterations on the same instance), beside the warm mean above:")
    w("")
    w("| n × max MiB | " + " | ".join(f"`{a}` cold" for a in COLD) + " | " +
      " | ".join(f"`{a}` cold / warm" for a in ("soma", "soma-engine")) + " |")
    w("|---|" + "---:|" * (len(COLD) + 2))
    for c in cells:
        cell = c["cell"]
        w(f"| {cell_label(cell)} | " + " | ".join(fmt_ns(cold(c, a)) for a in COLD) +
          " | " + " | ".join(fmt_ratio(ratio(cold(c, a), warm(a, cell)))
                             for a in ("soma", "soma-engine")) + " |")
    w("")

    def calls(c, kind, a):
        m = (c.get(f"{kind}_map_calls") or {}).get(a)
        u = (c.get(f"{kind}_unmap_calls") or {}).get(a)
        return "—" if m is None or u is None else f"{m} / {u}"

    w("Driver map / unmap calls per replay (the pure offset allocators never map): first = the "
      "cold replay on a fresh allocator, warm = the second replay on the same instance, what "
      "every timed iteration repeats (the engines' counting backing and the pools' driver "
      "calls on soma-sim):")
    w("")
    w("| n × max MiB | allocs | " +
      " | ".join(f"`{a}` first | `{a}` warm" for a in VARIANTS_API_FIRST) + " |")
    w("|---|---:|" + "---:|" * (2 * len(VARIANTS_API_FIRST)))
    for c in cells:
        w(f"| {cell_label(c['cell'])} | {c['allocs']} | " + " | ".join(
            f"{calls(c, 'cold', a)} | {calls(c, 'warm', a)}" for a in VARIANTS_API_FIRST) + " |")
    w("")
    w("Peak reserved after the warm replays / peak live requested bytes of the sequence (the "
      "memory side of the figures above; reserved as defined in the allocator table; the "
      "driver path maps each allocation's granules and nothing else):")
    w("")
    mem = [a for a in ALLOCATORS if a != "driver"]
    w("| n × max MiB | peak live MiB | " + " | ".join(f"`{a}`" for a in mem) + " |")
    w("|---|---:|" + "---:|" * len(mem))
    for c in cells:
        live = c["peak_live_bytes"]
        res = c.get("warm_reserved_high") or {}
        w(f"| {cell_label(c['cell'])} | {live / MIB:.0f} | " + " | ".join(
            "—" if res.get(a) is None else f"{res[a] / live:.3f}" for a in mem) + " |")
    return "\n".join(L)
