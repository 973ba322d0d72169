#!/usr/bin/env python3
"""Writes docs/performance.md, whole, from the benches' output.

Reads criterion's `<target>/criterion/**/new/{benchmark,estimates}.json` and the benches' own
JSON (`<target>/soma-bench/*.json`: fragmentation, bookkeeping, reuse counters, the captured
llama_decode output), describes the machine it runs on, and fills the prose of
`scripts/perf_report/template.md` with the tables. Run it on the machine that ran the benches:

    cargo bench                                  # SOMA_BENCH_QUICK=1 for a short run
    cargo bench -p soma-sim --bench sim
    mkdir -p target/soma-bench
    cargo run --release --example llama_decode > target/soma-bench/llama_decode.txt
    scripts/perf-report.py --callgrind

Before writing, it runs `soma-replay --json --replays 3` over the traces of `data/traces` (or
`$SOMA_TRACES`) with 1, 2 and 4 streams in `--rounds` interleaved rounds (default 5), and
repeated 12 times on one pool (also over the traces in `$SOMA_EXTRA_TRACES` when set);
`--no-replay` skips that. `--callgrind` also runs
`soma-hotpath` under `valgrind --tool=callgrind` (64 live blocks, 10 000 and 20 000 pairs)
and reports instructions per alloc + free pair. `--out PATH` writes somewhere else than
docs/performance.md (e.g. to look at a quick run's page).
"""

import argparse
import os
import sys

sys.dont_write_bytecode = True  # no __pycache__ in the checkout

from perf_report import document, runs  # noqa: E402
from perf_report.common import ROOT, load_criterion  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=os.environ.get("CARGO_TARGET_DIR",
                                                       os.path.join(ROOT, "target")),
                    help="the target directory the benches wrote to")
    ap.add_argument("--out", default=os.path.join(ROOT, "docs", "performance.md"),
                    help="where to write the page (default: docs/performance.md)")
    ap.add_argument("--callgrind", action="store_true",
                    help="run soma-hotpath under callgrind first")
    ap.add_argument("--no-replay", action="store_true",
                    help="do not run soma-replay over the traces")
    ap.add_argument("--rounds", type=int, default=5,
                    help="interleaved rounds of the soma-replay runs (default 5)")
    args = ap.parse_args()
    target = os.path.abspath(args.target)
    if not load_criterion(target):
        sys.exit(f"no criterion output under {target}/criterion: run `cargo bench` first")
    os.makedirs(os.path.join(target, "soma-bench"), exist_ok=True)
    if args.callgrind:
        runs.run_callgrind(target)
    if not args.no_replay:
        runs.run_replays(target, max(1, args.rounds))
    page = document.render(target)
    with open(args.out, "w") as f:
        f.write(page)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
