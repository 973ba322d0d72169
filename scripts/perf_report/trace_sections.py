"""Section 3 of docs/performance.md: the real traces, replayed on every allocator, through
soma-replay on several streams, and repeatedly on one pool."""

from .common import ALLOCATORS, BASELINES, MIB, fmt_ns, load_json, verdict
from .runs import RERUN_MODES, RERUNS


def _memory_table(w, traces):
    """The peak reserved / fragmentation table of a traces.json, with the target verdicts."""
    w("| trace | peak live MiB | " + " | ".join(f"`{a}`" for a in ALLOCATORS) +
      " | soma own | soma maps / unmaps | soma-retain maps / unmaps |")
    w("|---|---:|" + "---:|" * len(ALLOCATORS) + "---:|---:|---:|")
    frag_ok = True
    never_worse = True
    notes = []
    retain = []
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
        sr = al.get("soma-retain", {})
        own = s.get("own_fragmentation")
        w(f"| {t['trace']} | {peak / MIB:.0f} | " + " | ".join(cells) +
          f" | {'—' if own is None else f'{own:.3f}'} | {s.get('map_calls', '—')} / "
          f"{s.get('unmap_calls', '—')} | {sr.get('map_calls', '—')} / "
          f"{sr.get('unmap_calls', '—')} |")
        if "soma-retain" in fr:
            retain.append((t["trace"], fr["soma-retain"]))
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
    if retain:
        worst = max(retain, key=lambda x: x[1])
        w(f"- Without recycling on growth (`soma-retain`, `soma-engine-retain`): "
          f"fragmentation at most {worst[1]:.3f} ({worst[0]}); the 1.05 target is for the "
          "default settings.")


def _streams_table(w, rows):
    w("The same traces through `soma-replay` (public API, default pool), ops spread "
      "round-robin over N streams: a free on another stream than the allocation's hands the "
      "allocation off first (event recorded, waited on), so blocks move between streams only "
      "through events. Fragmentation = peak reserved / peak live requested.")
    w("")
    w("| trace | streams | ns / op | peak reserved MiB | fragmentation | map / unmap | "
      "cross-stream frees |")
    w("|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        w(f"| {r['trace']} | {r['streams']} | {r['ns_per_op']:.0f} | "
          f"{r['peak_reserved'] / MIB:.0f} | {r['fragmentation_vs_requested']:.3f} | "
          f"{r['map_calls']} / {r['unmap_calls']} | {r['hand_offs']} |")


def _reruns_table(w, rows):
    w(f"Runs repeated on one pool (`soma-replay --replays {RERUNS}`, default pool, one stream "
      "unless said): *resident* keeps what the trace leaves live (weights, a training run's "
      "optimizer state) and repeats the rest — a server or a training loop (`--resident`); "
      "*from empty* frees everything between runs — a model unloaded and loaded again; "
      "*retain* the same without recycling (`--no-recycle`); *4 streams in turn* runs each "
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
        w("ns per op:")
        w("")
        w("| trace | ops | " + " | ".join(f"`{a}`" for a in ALLOCATORS) + " |")
        w("|---|---:|" + "---:|" * len(ALLOCATORS))
        for t in measured:
            w(f"| {t['trace']} | {t['ops']} | " + " | ".join(
                fmt_ns(crit.get(("trace", a, t["trace"]))) for a in ALLOCATORS) + " |")
        w("")
        w("Peak reserved (MiB) and fragmentation:")
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
