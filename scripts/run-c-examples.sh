#!/usr/bin/env bash
# Builds libascendcl.so (crate soma-capi, release), compiles every C example in examples/c/
# against our headers (crates/ascend-sys/include) with -Wall -Wextra -Werror, links it with
# -lascendcl and an rpath, and runs it. Exits non-zero on the first failure.
#
# Honours CARGO_TARGET_DIR (default: target/) and CC (default: cc). The examples run on the
# software NPU; SOMA_SIM_* variables are passed through (see docs/c-api.md).
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

failed=0
for src in examples/c/*.c; do
  name=$(basename "$src" .c)
  echo "=== $name: compile"
  "$CC" -std=c11 -O2 -Wall -Wextra -Werror -I crates/ascend-sys/include -I examples/c \
    "$src" -o "$out_dir/$name" -L "$lib_dir" -lascendcl -Wl,-rpath,"$lib_dir"
  echo "=== $name: run"
  if "$out_dir/$name"; then
    echo "=== $name: passed"
  else
    echo "=== $name: FAILED (exit $?)" >&2
    failed=1
  fi
done
if ((failed)); then
  echo "C examples: some failed" >&2
  exit 1
fi
echo "C examples: all passed"
