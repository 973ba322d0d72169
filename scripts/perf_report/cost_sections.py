"""The driver cost model of docs/performance.md: what each driver call is charged, as the
benches wrote it (`driver_cost_model.json`, from `DriverCostModel::ascend_like`)."""

from .common import load_json

# (key, CANN call, where the number comes from), in the model's order.
SOURCES = [
    ("malloc", "`aclrtMalloc`",
     "published measurements put it at 0.5–2 ms; the software NPU's "
     "`LatencyModel::ascend_like().driver_alloc`"),
    ("alloc_physical", "`aclrtMallocPhysical`",
     "the same driver allocation of physical memory; `LatencyModel::ascend_like()` charges "
     "`driver_alloc` for it too"),
    ("map", "`aclrtMapMem`",
     "`LatencyModel::ascend_like().map`: tens to a hundred µs per mapping change; torch_npu "
     "documents mapping changes as synchronous with the device and expensive "
     "(`NPUCachingAllocator.cpp`, note on expandable segments)"),
    ("unmap", "`aclrtUnmapMem`", "`LatencyModel::ascend_like().map`"),
    ("free", "`aclrtFree`",
     "no published figure: a driver round trip that changes the device's address space, "
     "charged as a mapping change (the software NPU does not delay it)"),
    ("free_physical", "`aclrtFreePhysical`", "as `aclrtFree`"),
    ("reserve", "`aclrtReserveMemAddress`", "as `aclrtFree` (made when a pool is built: no "
     "replay makes one)"),
    ("release", "`aclrtReleaseMemAddress`", "as `aclrtFree`"),
]


def _fmt_cost(ns):
    if ns >= 1_000_000:
        return f"{ns / 1_000_000:g} ms"
    return f"{ns / 1_000:g} µs"


def cost_model(target):
    """The per-call costs and their sources."""
    model = load_json(target, "driver_cost_model")
    if not model:
        return "Not measured: no `driver_cost_model.json` in the benches' output."
    L = ["| call | modelled cost | source |", "|---|---:|---|"]
    for key, call, source in SOURCES:
        if key in model:
            L.append(f"| {call} | {_fmt_cost(model[key])} | {source} |")
    return "\n".join(L)
