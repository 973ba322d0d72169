#!/usr/bin/env bash
# Regenerates the ascend-sys bindings from crates/ascend-sys/include/acl/*.h with bindgen and
# diffs them against the committed crates/ascend-sys/src/bindings.rs.
#
#   scripts/check-bindings.sh            exit 0 if identical, 1 (with a diff) on drift
#   scripts/check-bindings.sh --bless    overwrite the committed file with the fresh output
#
# Needs libclang (Debian 12: apt-get install --no-install-recommends libclang1-14
# libclang-common-14-dev). Extra arguments after the options are passed to cargo
# (e.g. --locked). Honours CARGO_TARGET_DIR. ASCEND_TOOLKIT_HOME is ignored on purpose: the
# committed file is generated from our own headers, not from a CANN install.
set -euo pipefail
cd "$(dirname "$0")/.."

bless=0
if [[ "${1:-}" == "--bless" ]]; then
  bless=1
  shift
fi

committed=crates/ascend-sys/src/bindings.rs
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
fresh="$tmp/bindings.rs"

# The build script writes $OUT_DIR/bindings.rs and copies it to ASCEND_SYS_BINDINGS_OUT; a
# new path every run forces the build script to run again (rerun-if-env-changed).
if ! env -u ASCEND_TOOLKIT_HOME ASCEND_SYS_BINDINGS_OUT="$fresh" \
    cargo build -p ascend-sys --features bindgen "$@"; then
  echo "check-bindings: the bindgen build failed (is libclang installed?)" >&2
  exit 2
fi
if [[ ! -s "$fresh" ]]; then
  echo "check-bindings: the build script did not write $fresh" >&2
  exit 2
fi

if ((bless)); then
  cp "$fresh" "$committed"
  echo "check-bindings: wrote $committed"
  exit 0
fi

if diff -u "$committed" "$fresh"; then
  echo "check-bindings: $committed is up to date"
else
  echo "check-bindings: $committed drifted from include/acl/*.h;" \
       "run scripts/check-bindings.sh --bless and commit the result" >&2
  exit 1
fi
