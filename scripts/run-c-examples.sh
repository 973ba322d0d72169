#!/usr/bin/env bash
# Builds libascendcl.so (crate soma-capi, release), compiles every C example in examples/c/
# against our headers (crates/ascend-sys/include) with -Wall -Wextra -Werror, links it with
# -lascendcl and an rpath, and runs it. Exits non-zero on the first failure.
#
# Honours CARGO_TARGET_DIR (default: target/) and CC (default: cc). The examples run on the
# software NPU; SOMA_SIM_* variables are passed through (see docs/c-api.md). trace_replay
# reads plain CSV: the gzipped traces of data/traces are decompressed into
# <target>/c-examples/traces first, and on the default device it must replay all of them
# ($SOMA_TRACES, when set, names a directory of plain traces to replay instead).
set -euo pipefail
cd "$(dirname "$0")/.."

CC=${CC:-cc}
echo "=== cargo build -p soma-capi --release"
cargo build -p soma-capi --release

target_dir=${CARGO_TARGET_DIR:-target}
mkdir -p "$target_dir"
target_dir=$(cd "$target_dir" && pwd)
lib_dir="$target_dir/release"
if [[ ! -f "$lib_dir/libascendcl.so" ]]; then
  echo "error: $lib_dir/libascendcl.so was not built" >&2
  exit 1
fi
out_dir="$target_dir/c-examples"
mkdir -p "$out_dir"

expected_traces=""
if [[ -z "${SOMA_TRACES:-}" ]]; then
  traces_dir="$out_dir/traces"
  rm -rf "$traces_dir"
  mkdir -p "$traces_dir"
  count=0
  for gz in data/traces/*.csv.gz; do
    gzip -dc "$gz" >"$traces_dir/$(basename "$gz" .gz)"
    count=$((count + 1))
  done
  export SOMA_TRACES="$traces_dir"
  # On the default device (64 GiB) every trace fits.
  if [[ -z "${SOMA_SIM_CAPACITY:-}" ]]; then
    expected_traces="replayed $count of $count traces"
  fi
fi

failed=0
for src in examples/c/*.c; do
  name=$(basename "$src" .c)
  echo "=== $name: compile"
  "$CC" -std=c11 -O2 -Wall -Wextra -Werror -I crates/ascend-sys/include -I examples/c \
    "$src" -o "$out_dir/$name" -L "$lib_dir" -lascendcl -Wl,-rpath,"$lib_dir"
  echo "=== $name: run"
  if "$out_dir/$name" | tee "$out_dir/$name.out"; then
    if [[ "$name" == trace_replay && -n "$expected_traces" ]] &&
      ! grep -q "^$expected_traces " "$out_dir/$name.out"; then
      echo "=== $name: FAILED (expected \"$expected_traces\")" >&2
      failed=1
    else
      echo "=== $name: passed"
    fi
  else
    echo "=== $name: FAILED (exit ${PIPESTATUS[0]})" >&2
    failed=1
  fi
done
if ((failed)); then
  echo "C examples: some failed" >&2
  exit 1
fi
echo "C examples: all passed"
