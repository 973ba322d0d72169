"""Sections 1 and 2 of docs/performance.md: the hot path and RMM's random_allocations."""

from .common import (ALLOCATORS, BASELINES, MIB, PAIRED, PAIRED_BASELINES, VARIANTS,
                     WITH_STREAMS, cell_label, fmt_ns, fmt_ratio, load_json, median, ratio,
                     verdict)
from .workload_tables import LEGEND, allocator_table

LIVES = ["64", "10000", "1000000"]



def bar_of(allocator):
    """The target ratio to the fastest baseline: 1.5× for the engine, 2× for the public API
    (its locking and stream-ordered bookkeeping on top)."""
    return 1.5 if allocator.startswith("soma-engine") else 2.0

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
      "list, the driver path and those whose warm replay was too slow for criterion) replay "
      "in rounds, one timed warm replay each per round, the "
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
        bar = bar_of(a)
        within = sum(1 for _, r, _ in rs if r <= bar)
        ok = all(r <= bar and b for _, r, b in rs)
        worst = max(rs, key=lambda x: x[1])
        slower = [cell for cell, _, b in rs if not b]
        part = (f"; slower than soma-replica at {', '.join(slower)}" if slower else "")
        w(f"- Target (`{a}`, interleaved medians): every cell faster than soma-replica and "
          f"within {bar:g}× of the fastest baseline — {verdict(ok)} ({within} of {len(rs)} "
          f"cells within {bar:g}×, worst {worst[1]:.2f}× at {worst[0]}{part}).")
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
        bar = bar_of(a)
        if not rs:
            w(f"- Target (`{a}`): every cell faster than soma-replica and first-fit and "
              f"within {bar:g}× of the fastest baseline — not measured.")
            continue
        ok = all(r <= bar and beats for _, r, beats in rs)
        worst = max(rs, key=lambda x: x[1])
        part = "" if len(rs) == len(cells) else f"; {len(rs)} of {len(cells)} cells measured"
        w(f"- Target (`{a}`): every cell faster than soma-replica and first-fit and within "
          f"{bar:g}× of the fastest baseline — {verdict(ok)} (worst {worst[1]:.1f}× at "
          f"{worst[0]}{part}).")
    w("")
    _paired_table(w, cells)
    _cell_tables(w, cells, warm, cold)
    return "\n".join(L)


def _cell_tables(w, cells, warm, cold):
    """Per cell, every allocator cold and warm: host time, driver calls and modelled time,
    peak reserved; then the targets on soma's warm driver calls and cold / warm ratio.
    `warm(allocator, cell)`: the criterion (or slow) warm figure; `cold(cell object,
    allocator)`: the single first replay's."""
    w("Every allocator, cold and warm, per cell. " + LEGEND + " Host warm: the interleaved "
      "rounds' warm replays where the allocator is in them, else criterion's mean (the "
      "first-fit free list, the driver path); host cold: the cold rounds (each on a fresh "
      "instance), else the single first replay before criterion.")
    w("")
    no_calls, ratios = [], []
    for c in cells:
        cell = c["cell"]
        get = lambda key, a, c=c: (c.get(key) or {}).get(a)  # noqa: E731
        w(f"**{cell_label(cell)} MiB** ({c['ops']} ops, peak live "
          f"{c['peak_live_bytes'] / MIB:.0f} MiB):")
        w("")
        rows = []
        for a in WITH_STREAMS:
            if get("cold_reserved_high", a) is None:
                continue
            host_cold = get("paired_cold_ns_per_op", a) or cold(c, a)
            host_warm = get("paired_ns_per_op", a) or warm(a, cell)
            rows.append((a, host_cold, host_warm, get("cold_driver_calls", a),
                         get("warm_driver_calls", a), get("cold_driver_ns_per_op", a),
                         get("warm_driver_ns_per_op", a), get("cold_reserved_high", a),
                         get("warm_reserved_high", a)))
        allocator_table(w, rows, c["peak_live_bytes"])
        w("")
        calls = get("warm_driver_calls", "soma")
        if calls is not None:
            no_calls.append((cell, calls.get("map", 0) + calls.get("unmap", 0)))
        first, hot = get("paired_cold_ns_per_op", "soma"), get("paired_ns_per_op", "soma")
        if first and hot and median(hot) > 0:
            ratios.append((cell, median(first) / median(hot)))
    if no_calls:
        bad = [f"{cell} ({n})" for cell, n in no_calls if n > 0]
        w(f"- Target: `soma`'s warm replay maps and unmaps nothing, every cell — "
          f"{verdict(not bad)}" + (f" (map + unmap calls at {', '.join(bad)})." if bad else "."))
    if ratios:
        worst = max(ratios, key=lambda x: x[1])
        w(f"- Target: `soma`'s first replay ≤ 3× a warm one, every cell (median of the cold "
          f"rounds / median of the warm rounds) — "
          f"{verdict(worst[1] <= 3)} (worst {worst[1]:.2f}× at {worst[0]}).")
