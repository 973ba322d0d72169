"""Names, number formats and the readers of the benches' output."""

import glob
import json
import os
from collections import namedtuple

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MIB = 1 << 20

ALLOCATORS = ["soma", "soma-recycle", "soma-engine", "soma-engine-recycle", "offset-allocator",
              "tlsf", "soma-replica", "torch-npu", "llama-cpp", "first-fit", "driver"]
BASELINES = ["offset-allocator", "tlsf", "soma-replica", "torch-npu", "llama-cpp", "first-fit"]
# Every allocator of the cold / warm and driver tables: soma's public API on one and on 4
# streams first, then the rest.
WITH_STREAMS = ["soma", "soma-4-streams"] + ALLOCATORS[1:]
# soma's variants measured against the baselines (ratio columns and targets).
VARIANTS = ["soma-engine", "soma-engine-recycle", "soma", "soma-recycle"]
# The same, public API first (column order of the allocator tables).
VARIANTS_API_FIRST = ["soma", "soma-recycle", "soma-engine", "soma-engine-recycle"]
# The baselines of random_allocations' interleaved rounds (all but the slow first fit), and
# every allocator of those rounds, in column order.
PAIRED_BASELINES = [b for b in BASELINES if b != "first-fit"]
PAIRED = ["soma", "soma-4-streams"] + VARIANTS_API_FIRST[1:] + PAIRED_BASELINES
# Driver calls as the tables show them: (key of the JSON object, label).
CALL_KINDS = [("map", "map"), ("unmap", "unmap"), ("malloc", "malloc"), ("free", "free")]

# A criterion estimate: mean and confidence interval in ns, and the benchmark's throughput
# ({"Bytes": n} or {"Elements": n}) when it declares one.
Estimate = namedtuple("Estimate", "low mean high throughput")


def load_criterion(target):
    """{(group, function, value): Estimate} from `<target>/criterion/**/new/`."""
    out = {}
    for bench in glob.glob(os.path.join(target, "criterion", "**", "new", "benchmark.json"),
                           recursive=True):
        d = os.path.dirname(bench)
        try:
            with open(bench) as f:
                b = json.load(f)
            with open(os.path.join(d, "estimates.json")) as f:
                e = json.load(f)["mean"]
        except (OSError, ValueError, KeyError):
            continue
        ci = e.get("confidence_interval", {})
        out[(b.get("group_id"), b.get("function_id"), b.get("value_str"))] = Estimate(
            ci.get("lower_bound"), e["point_estimate"], ci.get("upper_bound"),
            b.get("throughput"))
    return out


def means(crit):
    """{(group, function, value): mean ns} of `load_criterion`'s estimates."""
    return {k: v.mean for k, v in crit.items()}


def load_json(target, name):
    """`<target>/soma-bench/<name>.json`, or None when absent or unreadable."""
    try:
        with open(os.path.join(target, "soma-bench", name + ".json")) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def fmt_ns(ns):
    if ns is None:
        return "—"
    if ns >= 1e6:
        return f"{ns / 1e6:.2f} ms"
    if ns >= 1e4:
        return f"{ns / 1e3:.1f} µs"
    if ns >= 1e3:
        return f"{ns / 1e3:.2f} µs"
    return f"{ns:.1f} ns"


def ratio(a, b):
    if a is None or b is None or b == 0:
        return None
    return a / b


def fmt_ratio(r):
    return "—" if r is None else f"{r:.2f}×"


def verdict(ok):
    return "**met**" if ok else "**missed**"


def median(xs):
    s = sorted(xs)
    n = len(s)
    return None if n == 0 else (s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2)


def cell_label(cell):
    """A random_allocations cell id (`1000x4`) as the tables print it."""
    return cell.replace("x", " × ")


def median_range(xs):
    """`median (min–max)` of a list of ns figures, or — when empty."""
    if not xs:
        return "—"
    return f"{fmt_ns(median(xs))} ({fmt_ns(min(xs))}–{fmt_ns(max(xs))})"


def fmt_calls(calls):
    """Driver calls as `map / unmap / malloc / free` (each with its physical allocation or
    free), or — when not measured."""
    if not calls:
        return "—"
    return " / ".join(str(calls.get(k, 0)) for k, _ in CALL_KINDS)


def add_ns(a, b):
    """`a + b`, None when either is."""
    return None if a is None or b is None else a + b
