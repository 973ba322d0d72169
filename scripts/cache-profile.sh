#!/usr/bin/env bash
# Cache misses per operation of one random_allocations cell, for one allocator:
#
#   scripts/cache-profile.sh ALLOCATOR N MAX_MIB [TARGET_DIR]
#   (ALLOCATOR: soma | soma-recycle | soma-engine | soma-engine-retain | offset-allocator | tlsf)
#
# Runs `soma-hotpath random` under valgrind's cachegrind twice, with 2 and 3 replays of the
# sequence on one allocator, and prints the difference divided by the ops of one replay:
# instructions, L1d read / write misses and last-level read / write misses of one warm
# replay, set-up and the cold first replay cancelled out. The simulated caches are this
# machine's L1d and L2 (`lscpu`; override with SOMA_D1 / SOMA_LL as cachegrind's
# size,assoc,line), so "last level" here means an L2 miss. Counts are exact and repeatable.
#
# The public API (`soma`, `soma-recycle`) reserves the software NPU's memory up front, and
# valgrind cannot map 32 GiB: use n ≤ 10 000 (SOMA_HOTPATH_CAPACITY_MIB=4096 is set here).
set -euo pipefail
[[ $# -ge 3 ]] || { sed -n 2,5p "$0"; exit 2; }
alloc=$1 n=$2 max=$3 target=${4:-${CARGO_TARGET_DIR:-target}}
bin=$target/release/soma-hotpath
[[ -x $bin ]] || { echo "build first: cargo build --release -p soma-tools --bins" >&2; exit 2; }
d1=${SOMA_D1:-49152,12,64} ll=${SOMA_LL:-1048576,16,64}
capacity=32768
[[ $alloc == soma || $alloc == soma-recycle ]] && capacity=4096
tmp=$(mktemp -d) pids=()
trap 'rm -rf "$tmp"' EXIT
for replays in 2 3; do
  SOMA_HOTPATH_CAPACITY_MIB=$capacity valgrind --tool=cachegrind --cache-sim=yes \
    --D1="$d1" --LL="$ll" --cachegrind-out-file="$tmp/$replays.out" \
    "$bin" random "$alloc" "$n" "$max" "$replays" >/dev/null 2>"$tmp/$replays.err" &
  pids+=($!)
done
for pid in "${pids[@]}"; do
  wait "$pid" || { grep -hv -e '^==' -e '^--' -e '^$' "$tmp"/*.err | head -3 >&2; echo "soma-hotpath failed" >&2; exit 1; }
done
python3 - "$tmp" "$alloc" "$n" "$max" <<'EOF'
import sys
tmp, alloc, n, mx = sys.argv[1:]
def totals(path):
    events = None
    for line in open(path):
        if line.startswith("events:"):
            events = line.split()[1:]
        elif line.startswith("summary:"):
            return dict(zip(events, map(int, line.split()[1:])))
    sys.exit(f"{path}: no summary (did the run fail? see the .err beside it)")
a, b = totals(f"{tmp}/2.out"), totals(f"{tmp}/3.out")
ops = 2 * int(n)
d = {k: (b[k] - a[k]) / ops for k in a}
print(f"{alloc} random_allocations {n}x{mx}, per op of a warm replay: "
      f"Ir {d['Ir']:.1f}  L1d miss rd {d['D1mr']:.2f} wr {d['D1mw']:.2f}  "
      f"LL miss rd {d['DLmr']:.2f} wr {d['DLmw']:.2f}")
EOF
