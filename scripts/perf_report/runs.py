"""What the script runs itself before writing: soma-replay over the traces, soma-hotpath under
callgrind. Both write their figures next to the benches' JSON."""

import glob
import json
import os
import re
import subprocess

from .common import ROOT

RERUNS = 12
# Replays of each streams-table run: the first on a fresh pool (cold), the others warm.
REPLAYS = 3
STREAMS = (1, 2, 4)
_IN_TURN = ["--streams", "4", "--stream-per-replay"]
# The rerun table's columns: (key, label, soma-replay options, whether the 1.05 target
# applies). With recycling on growth (`recycle`) the target is not claimed: it trades driver
# calls for tighter memory.
RERUN_MODES = [
    ("once", "once", [], False),
    ("resident", "resident", ["--replays", str(RERUNS), "--resident"], True),
    ("from_empty", "from empty", ["--replays", str(RERUNS)], True),
    ("from_empty_recycle", "from empty, recycling", ["--replays", str(RERUNS), "--recycle"],
     False),
    ("resident_streams", "resident, 4 streams in turn",
     ["--replays", str(RERUNS), "--resident", *_IN_TURN], True),
    ("from_empty_streams", "from empty, 4 streams in turn",
     ["--replays", str(RERUNS), *_IN_TURN], True),
    ("resident_streams_sync", "resident, 4 streams in turn, synchronized",
     ["--replays", str(RERUNS), "--resident", *_IN_TURN, "--sync-per-replay"], True),
    ("from_empty_streams_sync", "from empty, 4 streams in turn, synchronized",
     ["--replays", str(RERUNS), *_IN_TURN, "--sync-per-replay"], True),
]


def build_tools(target):
    """Builds soma-tools' binaries in release into `target`: they must measure the tree the
    benches measured."""
    subprocess.run(["cargo", "build", "--release", "-p", "soma-tools"], cwd=ROOT, check=True,
                   env=dict(os.environ, CARGO_TARGET_DIR=target))


def run_callgrind(target):
    """Instructions per alloc + free pair of `soma-hotpath` (64 live blocks): the difference
    of 20 000 and 10 000 pairs under callgrind, divided by 10 000 -> soma-bench/callgrind.json."""
    build_tools(target)
    exe = os.path.join(target, "release", "soma-hotpath")
    res = {}
    for alloc in ["soma", "soma-engine", "offset-allocator", "tlsf", "torch-npu", "llama-cpp"]:
        counts = []
        for n in (10000, 20000):
            out = os.path.join(target, "soma-bench", f"callgrind.{alloc}.{n}")
            env = dict(os.environ, SOMA_HOTPATH_CAPACITY_MIB="256")
            p = subprocess.run(["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}",
                                exe, alloc, "64", str(n)], capture_output=True, text=True,
                               env=env, check=False)
            m = re.search(r"refs:\s+([\d,]+)", p.stderr)
            counts.append(int(m.group(1).replace(",", "")) if m else None)
        if None not in counts:
            res[alloc] = (counts[1] - counts[0]) / 10000
    with open(os.path.join(target, "soma-bench", "callgrind.json"), "w") as f:
        json.dump(res, f)
    return res


def trace_dir():
    """`$SOMA_TRACES`, else the workspace's own traces."""
    return os.environ.get("SOMA_TRACES", os.path.join(ROOT, "data", "traces"))


def trace_files(tdir):
    """The *.csv and *.csv.gz traces of directory `tdir`, sorted."""
    return sorted(glob.glob(os.path.join(tdir, "*.csv")) + glob.glob(os.path.join(tdir, "*.csv.gz")))


def replay_json(exe, path, opts):
    """The report of `soma-replay PATH OPTS --json`, or None when the replay failed."""
    r = subprocess.run([exe, path, *opts, "--json"], capture_output=True, text=True, check=False)
    if r.returncode != 0 or not r.stdout.strip():
        return None
    return json.loads(r.stdout.strip().splitlines()[-1])


def run_replays(target, rounds):
    """soma-replay --json --replays 3 on every trace with 1, 2 and 4 streams, in `rounds`
    interleaved rounds (every round runs every (trace, streams) pair once, starting one pair
    further than the round before) -> soma-bench/replay.json, one entry per pair with the
    report of each round; the same traces (and those of `$SOMA_EXTRA_TRACES`) run
    repeatedly on one pool in the modes of RERUN_MODES -> soma-bench/replay-reruns.json."""
    build_tools(target)
    exe = os.path.join(target, "release", "soma-replay")
    paths = trace_files(trace_dir())
    pairs = [(p, n) for p in paths for n in STREAMS]
    reports = {pair: [] for pair in pairs}
    for r in range(rounds):
        for i in range(len(pairs)):
            p, n = pairs[(r + i) % len(pairs)]
            d = replay_json(exe, p, ["--streams", str(n), "--replays", str(REPLAYS)])
            if d:
                reports[(p, n)].append(d)
    rows = [{"trace": runs[0]["trace"], "streams": n, "rounds": runs}
            for (p, n), runs in reports.items() if runs]
    with open(os.path.join(target, "soma-bench", "replay.json"), "w") as f:
        json.dump(rows, f)
    extra = os.environ.get("SOMA_EXTRA_TRACES")
    if extra:
        paths += trace_files(extra)
    reruns = []
    for p in paths:
        row = {}
        for mode, _, opts, _ in RERUN_MODES:
            d = replay_json(exe, p, opts)
            if d:
                row["trace"] = d["trace"]
                row[mode] = d
        if row:
            reruns.append(row)
    with open(os.path.join(target, "soma-bench", "replay-reruns.json"), "w") as f:
        json.dump(reruns, f)
