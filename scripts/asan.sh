#!/usr/bin/env bash
# AddressSanitizer run of the unit and integration tests of the crates with `unsafe` code:
# soma-sim (device memory: mmap, raw slices handed to kernels), soma-core (host staging
# buffers of async copies) and the root integration tests (the pool end to end on the
# software NPU).
#
#   bash scripts/asan.sh                 # all three
#   bash scripts/asan.sh -p soma-sim     # extra cargo arguments replace the package list
#
# Needs a nightly toolchain; without one it prints a note and exits 0 (CI treats it as
# optional). Builds in its own target dir (target/asan, or $ASAN_TARGET_DIR) so that the
# instrumented build does not evict the normal cache. --target is mandatory: without it
# RUSTFLAGS would also instrument build scripts and proc-macros, and the build fails.
# LeakSanitizer runs too (ASan's default on Linux); ASAN_OPTIONS can be extended by the caller.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! rustup toolchain list 2>/dev/null | grep -q '^nightly'; then
  echo "asan: no nightly toolchain: skipped"
  exit 0
fi

HOST=x86_64-unknown-linux-gnu
export RUSTFLAGS="-Zsanitizer=address -Clink-arg=-Wl,--export-dynamic"
export RUSTDOCFLAGS="-Zsanitizer=address"
export ASAN_OPTIONS="detect_leaks=1:abort_on_error=1${ASAN_OPTIONS:+:$ASAN_OPTIONS}"
export CARGO_INCREMENTAL=0
TARGET_DIR=${ASAN_TARGET_DIR:-target/asan}

if (($#)); then
  packages=("$@")
else
  packages=(-p soma-sim -p soma-core -p soma-rs)
fi

start=$SECONDS
# --lib --tests: unit tests and integration tests (doc tests and benches are left out: doc
# tests duplicate the unit tests' coverage, benches run too long instrumented).
# soma-rs (the root package) has no library: its integration tests come with --tests.
cargo +nightly test --locked --target "$HOST" --target-dir "$TARGET_DIR" \
  "${packages[@]}" --lib --tests --no-fail-fast
echo "asan: passed in $((SECONDS - start))s"
