#!/usr/bin/env bash
# Redraws the README's memory timelines (docs/img/llama_decode_{driver,pool}.svg) by running
# the demo with its pictures directed into docs/img. The demo itself writes under target/
# and never touches the checkout; run this when the pictures should change, and commit them.
#
#   scripts/refresh-doc-images.sh          # the full demo (6 + 64 decode steps)
#
# Extra arguments are passed to the demo. Honours CARGO_TARGET_DIR.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo run --release --example llama_decode -- --out docs/img "$@"
git status --short docs/img
