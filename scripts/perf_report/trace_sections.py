"""Section 3 of docs/performance.md: the real traces, replayed on every allocator, through
soma-replay on several streams, and repeatedly on one pool."""

from .common import (ALLOCATORS, BASELINES, MIB, WITH_STREAMS, fmt_ns, load_json, median,
                     median_range, verdict)
from .runs import REPLAYS, RERUN_MODES, RERUNS
from .workload_tables import LEGEND, allocator_table


def _memory_table(w, traces):
    """The peak reserved / fragmentation table of a traces.json, with the target verdicts."""
    w("| trace | peak live MiB | " + " | ".join(f"`{a}`" for a in ALLOCATORS) +
      " | soma own | soma maps / unmaps | soma-recycle maps / unmaps |")
    w("|---|---:|" + "---:|" * len(ALLOCATORS) + "---:|---:|---:|")
    frag_ok = True
    never_worse = True
    notes = []
    recycle = []
    for t in traces:
        peak = t["peak_live_requested"]
        al = t["allocators"]
        cells = []
        fr = {}
        for a in ALLOCATORS:
            if a in al:
                r = al[a]["peak_reserved"]
                fr[a] = r / peak
                cells.append(f"{r / MIB:.0f} ({fr[a]:.3f})")
            else:
                cells.append("—")
        s = al.get("soma", {})
        own = s.get("own_fragmentation")

        def calls(a):
            c = al.get(a, {}).get("cold_driver_calls")
            return "—" if c is None else f"{c.get('map', 0)} / {c.get('unmap', 0)}"
        w(f"| {t['trace']} | {peak / MIB:.0f} | " + " | ".join(cells) +
          f" | {'—' if own is None else f'{own:.3f}'} | {calls('soma')} | "
          f"{calls('soma-recycle')} |")
        if "soma-recycle" in fr:
            recycle.append((t["trace"], fr["soma-recycle"]))
        if fr.get("soma", 9) > 1.05:
            frag_ok = False
        better = [b for b in BASELINES + ["driver"] if b in fr and fr[b] < fr.get("soma", 0)]
        if better:
            never_worse = False
            notes.append(f"{t['trace']}: " + ", ".join(
                f"{b} {fr[b]:.3f} vs soma {fr['soma']:.3f}" for b in better))
    w("")
    w(f"- Target: fragmentation ≤ 1.05 on every trace with default settings — "
      f"{verdict(frag_ok)}.")
    w(f"- Target: never worse than any baseline — {verdict(never_worse)}" +
      (" (" + "; ".join(notes) + ")." if notes else "."))
    if recycle:
        worst = max(recycle, key=lambda x: x[1])
        w(f"- With recycling on growth (`soma-recycle`, `soma-engine-recycle`): "
          f"fragmentation at most {worst[1]:.3f} ({worst[0]}), paid for with driver calls on "
          "every warm replay; the targets are for the default settings.")


def _streams_table(w, rows):
    w(f"The same traces through `soma-replay --replays {REPLAYS}` (public API, default pool), "
      "ops spread round-robin over N streams: a free on another stream than the allocation's "
      "hands the allocation off first (event recorded, waited on), so blocks move between "
      "streams only through events. Each run replays the trace "
      f"{REPLAYS} times on one pool, freeing what a replay leaves live before the next: "
      "replay 1 is cold, the later ones warm. The runs go in interleaved rounds (every round "
      "runs every trace and stream count once); ns/op = median over the rounds (range). Map / "
      "unmap calls of each replay, modelled driver time per op of replay 1 and of the last "
      "replay (first round's counts; † where rounds differ, as event timing may with several "
      "streams), fragmentation = peak reserved over all replays / peak live requested.")
    w("")
    w("| trace | streams | rounds | ns/op cold | ns/op warm | maps / unmaps per replay | "
      "driver ns/op cold | driver ns/op warm | fragmentation | cross-stream frees |")
    w("|---|---:|---:|---:|---:|---|---:|---:|---:|---:|")
    warm_calls = []
    for r in rows:
        runs = r["rounds"]
        first = runs[0]
        reps = first.get("replays") or []
        cold = [d["replays"][0]["ns_per_op"] for d in runs if d.get("replays")]
        warm = [x["ns_per_op"] for d in runs for x in (d.get("replays") or [])[1:]]
        counts = [[(x["map_calls"], x["unmap_calls"]) for x in d.get("replays") or []]
                  for d in runs]
        varies = " †" if any(c != counts[0] for c in counts) else ""
        per = ", ".join(f"{m} / {u}" for m, u in counts[0]) + varies
        drv_cold = reps[0]["driver_ns_per_op"] if reps else None
        drv_warm = reps[-1]["driver_ns_per_op"] if len(reps) > 1 else None
        w(f"| {r['trace']} | {r['streams']} | {len(runs)} | {median_range(cold)} | "
          f"{median_range(warm)} | {per} | {fmt_ns(drv_cold)} | {fmt_ns(drv_warm)} | "
          f"{first['fragmentation_vs_requested']:.3f} | {first['hand_offs']} |")
        if r["streams"] == 1:
            warm_calls.append((r["trace"], [c[1:] for c in counts]))
    w("")
    if warm_calls:
        bad = [f"{t} ({', '.join(f'{m} / {u}' for m, u in runs[0])})" for t, runs in warm_calls
               if any(m or u for c in runs for m, u in c)]
        w(f"- Target: replays 2 to {REPLAYS} make no map or unmap call on every trace (one "
          f"stream, default settings) — {verdict(not bad)}" +
          (f" (maps / unmaps of the warm replays, first round: {'; '.join(bad)})."
           if bad else "."))
    by = {(r["trace"], r["streams"]): r for r in rows}
    ratios = []
    for (trace, n), r in by.items():
        one = by.get((trace, 1))
        if n == 4 and one:
            mine = [x["ns_per_op"] for d in r["rounds"] for x in d.get("replays") or []]
            base = [x["ns_per_op"] for d in one["rounds"] for x in d.get("replays") or []]
            if mine and base and median(base) > 0:
                ratios.append((trace, median(mine) / median(base),
                               r["rounds"][0]["fragmentation_vs_requested"]))
    if ratios:
        worst = max(ratios, key=lambda x: x[1])
        frag = max(ratios, key=lambda x: x[2])
        one = {t: by[(t, 1)]["rounds"][0]["fragmentation_vs_requested"] for t, _, _ in ratios}
        above_one = [f"{t} {f:.3f} vs {one[t]:.3f}" for t, _, f in ratios if f > one[t] + 0.005]
        w(f"- Target: 4 streams ≤ 2× the single-stream host cost per op (medians over every "
          f"replay of the rounds) — {verdict(worst[1] <= 2)} (worst {worst[1]:.2f}× on "
          f"{worst[0]}); fragmentation ≤ 1.05 with 4 streams — {verdict(frag[2] <= 1.05)} "
          f"(highest {frag[2]:.3f}, {frag[0]}); with 4 streams, every trace within 0.005 of "
          f"its one-stream fragmentation — {verdict(not above_one)}" +
          (f" ({'; '.join(above_one)})." if above_one else "."))


def _reruns_table(w, rows):
    w(f"Runs repeated on one pool (`soma-replay --replays {RERUNS}`, default pool, one stream "
      "unless said): *resident* keeps what the trace leaves live (weights, a training run's "
      "optimizer state) and repeats the rest — a server or a training loop (`--resident`); "
      "*from empty* frees everything between runs — a model unloaded and loaded again; "
      "*recycling* the same with recycling on growth (`--recycle`); *4 streams in turn* runs each "
      "run on one stream, the next on the next of 4 (`--streams 4 --stream-per-replay`: a "
      "server running its requests on its streams in turn; a run reuses the frees of the runs "
      "before it by the opportunistic rule); *synchronized* adds a device synchronize after "
      "each run, once it has freed what it frees (`--sync-per-replay`: a server that waits "
      "for each request; the pool then settles the frees the host has observed, so they "
      "merge whatever their stream). Fragmentation = peak reserved / peak used over all runs; "
      "map / unmap calls of the last run (once: of the only run). Traces of "
      "`SOMA_EXTRA_TRACES` as well when it was set.")
    w("")
    w("| trace | " + " | ".join(label for _, label, _, _ in RERUN_MODES) + " |")
    w("|---|" + "---:|" * len(RERUN_MODES))
    worst = {}
    for row in rows:
        cells = []
        for mode, _, _, targeted in RERUN_MODES:
            d = row.get(mode)
            if d is None:
                cells.append("—")
                continue
            cells.append(f"{d['fragmentation']:.3f} ({d['map_calls']} / {d['unmap_calls']})")
            if targeted:
                worst[mode] = max(worst.get(mode, (0, "")), (d["fragmentation"], row["trace"]))
        w(f"| {row['trace']} | " + " | ".join(cells) + " |")
    w("")
    for mode, label, _, _ in RERUN_MODES:
        if mode in worst:
            f, t = worst[mode]
            w(f"- Fragmentation ≤ 1.05 over {RERUNS} runs, {label}: {verdict(f <= 1.05)} "
              f"(highest {f:.3f}, {t}).")


def traces(target, crit):
    """Time and memory per allocator, more traces, several streams, repeated runs."""
    L = []
    w = L.append
    measured = load_json(target, "traces")
    if not measured:
        w("Not measured: no `traces.json` in the benches' output.")
    else:
        w(LEGEND + " Host times from the interleaved rounds of the traces bench (every round "
          "builds each allocator fresh and replays the trace twice); where an allocator is "
          "not in the rounds, criterion's mean of a cold replay.")
        w("")
        for t in measured:
            w(f"**{t['trace']}** ({t['ops']} ops, peak live "
              f"{t['peak_live_requested'] / MIB:.0f} MiB):")
            w("")
            al = t["allocators"]
            pc = t.get("paired_cold_ns_per_op") or {}
            pw = t.get("paired_warm_ns_per_op") or {}
            rows = []
            for a in WITH_STREAMS:
                if a not in al:
                    continue
                d = al[a]
                rows.append((a, pc.get(a) or crit.get(("trace", a, t["trace"])), pw.get(a),
                             d.get("cold_driver_calls"), d.get("warm_driver_calls"),
                             d.get("cold_driver_ns_per_op"), d.get("warm_driver_ns_per_op"),
                             d.get("peak_reserved"), d.get("warm_peak_reserved")))
            allocator_table(w, rows, t["peak_live_requested"])
            w("")
        w("Peak reserved (MiB) and fragmentation after the cold replay, with the driver map / "
          "unmap calls of soma's cold replay:")
        w("")
        _memory_table(w, measured)
    extra = load_json(target, "traces-extra")
    if extra:
        w("")
        w("More traces, recorded with the tool of `data/traces/tools/` and the recipes in "
          "`scripts/extra_trace_recipes.py` (the traces themselves are not in the repository; "
          "the recipes' file says how to record them), replayed the same way — what models the four bundled traces "
          "do not cover would see. Written to `traces-extra.json` by "
          "`SOMA_TRACES=DIR SOMA_TRACES_JSON=traces-extra cargo bench --bench traces`; memory "
          "only (deterministic):")
        w("")
        _memory_table(w, extra)
    rows = load_json(target, "replay")
    if rows:
        w("")
        _streams_table(w, rows)
    reruns = load_json(target, "replay-reruns")
    if reruns:
        w("")
        _reruns_table(w, reruns)
    return "\n".join(L)
