"""One table per workload (a trace, a random_allocations cell): every allocator's host time,
driver calls, modelled driver time and total per op, cold and warm, and its peak reserved
over the workload's peak live bytes."""

from .common import add_ns, fmt_calls, fmt_ns, median, median_range

HEADER = ("| allocator | host ns/op cold | host ns/op warm | driver calls cold | driver calls "
          "warm | driver ns/op cold | driver ns/op warm | total ns/op cold | total ns/op warm "
          "| peak reserved / peak live |")
RULE = "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"


def _host(x):
    """(text, figure) of a host time given as the rounds' list or one figure."""
    if isinstance(x, list):
        return median_range(x), median(x)
    return fmt_ns(x), x


def allocator_table(w, rows, peak_live):
    """Writes the table through `w`. `rows`: (allocator, host cold, host warm, calls cold,
    calls warm, driver ns/op cold, driver ns/op warm, peak reserved cold, peak reserved
    warm), a host time being a list of the rounds' figures or one figure, anything None
    when not measured."""
    w(HEADER)
    w(RULE)
    for name, hc, hw, cc, cw, dc, dw, rc, rw in rows:
        (hc_text, hc_ns), (hw_text, hw_ns) = _host(hc), _host(hw)
        if rc is None:
            reserved = "—"
        elif rw is None or rw == rc:
            reserved = f"{rc / peak_live:.3f}"
        else:
            reserved = f"{rc / peak_live:.3f} → {rw / peak_live:.3f}"
        w(f"| `{name}` | {hc_text} | {hw_text} | {fmt_calls(cc)} | {fmt_calls(cw)} | "
          f"{fmt_ns(dc)} | {fmt_ns(dw)} | {fmt_ns(add_ns(hc_ns, dc))} | "
          f"{fmt_ns(add_ns(hw_ns, dw))} | {reserved} |")


LEGEND = ("Host ns/op: median of the interleaved rounds with their range (one figure: a single "
          "measurement); cold = the first replay on a fresh allocator, warm = the next replay "
          "on the same one. Driver calls: `map / unmap / malloc / free` of the replay (each map "
          "with its `aclrtMallocPhysical`, each unmap with its `aclrtFreePhysical`); driver "
          "ns/op: their modelled time (see *Driver cost model*) over the replay's ops; total = "
          "host median + modelled driver time. Peak reserved / peak live: after the cold "
          "replay (→ after the warm one, when it grew).")
